// Times CudaBackend::PagedAttention for one decode token (Llama-3.1-8B shape: 32 query heads,
// 8 KV heads, head_dim 128, bf16 pool, 64-token pages, random data) at several context lengths,
// over (a) every page of the context ("dense") and (b) a 2048-token budget of 32 random pages per
// KV head ("budget"). Three figures per row, medians:
//   gpu_us   device time of one call: a 256 MiB memset flushes L2, a host function holds the
//            stream until the call has been enqueued, and CUDA events bracket the call (plan
//            copy, split-K kernel, combine kernel and the gaps between them; no host time);
//   host_us  host time of the call (validation, planning, enqueueing);
//   b2b_us   calls enqueued back to back without flush or sync, total event time / calls
//            (the steady state: host-bound or device-bound, whichever is slower).
// The budget case is also swept over the split-K items per SM (CudaBackend::SetDecodeItemsPerSm).
//
// Then (unless --no-pipelines) the device-resident sparse pipelines, selection + attention for one
// layer with PolicyOptions defaults (P 64, B 2048, sinks 64, window 256, the policy's 512-token
// segments of 8 pages; before session 38 the bench used segments of 16 pages,
// STRATA_BENCH_SEGMENT_PAGES=16, which its earlier figures are), two-level above 4096 pages (up
// to 256K one-level; STRATA_BENCH_TWO_LEVEL_MIN_PAGES=N: above N; the policy's threshold was 512
// before session 39, which made 128K two-level) keeping max(128, 4 * wanted / G) segments,
// one-level where that keeps every segment, as DevicePolicy (STRATA_BENCH_KEEP_SEGMENT_STAGE=1:
// two-level there too);
// minmax page summaries computed here from the bf16 keys, in bf16 as DevicePolicy keeps them for
// a bf16 cache (kernels::MinMaxRowsToBF16, exact here); STRATA_BENCH_SUMMARY_BF16=0: in f32;
// STRATA_BENCH_POOL=fp8: the pipelines' K and V pools are fp8 e4m3 codes of the same values at a
// per-tensor scale of 2^-8, the summaries those of the stored values):
//   quest        ScoreSummaries (segments) -> VoteTopK -> ScoreSummaries (pages) -> VoteTopK
//                (B / P pages) -> SelectedAttention (sinks + pages + window)
//   tokenselect  ... -> VoteTopK (4B / P pages) -> ScoreKeys (their tokens) -> VoteTopK (B tokens)
//                -> SelectedAttention (sinks + tokens + window)
// with the selection stages and the attention as one Backend::SelectStages op with `attend` set
// (one kernel on CUDA where the shape allows; STRATA_BENCH_ATTEND=op: the selection stages as one
// op and SelectedAttention after it; STRATA_BENCH_FUSED=0: the ops one by one, as listed);
// tokenselect's stages in 16 independent parts, the policy's default at B = 2048
// (PolicyOptions::EffectivePartitions; SelectStagesParams::partitions; on CUDA the partitioned
// kernel), its rows labelled "tokenselect/p16"; STRATA_BENCH_PARTITIONS=P (a power of two 1 to
// 64) for P parts, 1 the exact vote (rows "tokenselect", the default before session 39), with
// SelectStagesParams::arrivals as DevicePolicy passes them (STRATA_BENCH_ARRIVALS=0: without);
// each also as "+miss" (the selection cache's check first, theta 2: every KV head selects) and
// "+hit" (theta 0.5 with q unchanged: every KV head reuses its selection, the selection kernels
// exit at the top and only the check and the attention do work), the check inside the
// SelectStages op as DevicePolicy passes it (SelectStagesParams::cache_check: on CUDA inside the
// partitioned kernel where it attends, and inside quest's one-part kernel;
// STRATA_BENCH_CHECK_IN_OP=0: SelectionCacheCheck as its own op before it); the MiB column is
// the selecting step's bytes in every row.
// Per op (each op alone, inputs left by the full runs): STAGES = 100 eager calls back to back
// (can be bound by the host's launch cost), GSTAGES = a graph of 20 calls replayed.
// each timed as: eager_us (ops enqueued back to back, event time / calls), graph_us (the pipeline
// captured once in a CUDA graph and replayed back to back), cold_us (median of single graph
// launches after a 256 MiB L2 flush), plus the bytes the pipeline must read (summaries scanned,
// candidate keys, attended K and V, scores) and that figure over cold_us as a fraction of
// 3.35 TB/s (H100 SXM HBM3).
//
// Usage: cuda_attention_bench [--ncu] [--no-sweep] [--no-pipelines] [--pipelines-only]
//                             [context ...]   (default contexts: 32768 131072)
//   --ncu: few iterations and no host gate, for running under Nsight Compute.
//   --no-sweep: the budget case at the default items per SM only.
//   --policy quest|tokenselect: only that pipeline.
//   --rows plain,miss,hit: only those pipeline rows (any of the three, comma-separated; for
//     running one row under Nsight Compute, whose -k/-s/-c then count that row's launches only).
//   --stage-phases: after each fused row (not +hit; +miss with the check in the op), the selection
//     kernel's phases (PHASES lines).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/launch.h"
#include "kernels/cuda/testing/bench_util.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {
namespace {

using bench::Gate;
using bench::Median;
using bench::MustAllocate;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kPage = 64, kBudget = 2048;
int g_warmup = 5, g_runs = 50;
bool g_ncu = false;
bool g_sweep = true, g_pipelines = true, g_only_pipelines = false;
std::string g_policy;  // --policy quest|tokenselect: only that pipeline
// --rows plain,miss,hit: the pipeline rows run, by cache mode (0 plain, 1 +miss, 2 +hit).
bool g_row_on[3] = {true, true, true};
bool g_stage_phases = false;  // --stage-phases: SelectStagesKernel's phase stamps

double g_dense_us = 0;  // the dense row's gpu_us for the current context

// ---- Device-resident pipelines ---------------------------------------------------------------

constexpr int kSinks = 64, kWindow = 256;
constexpr int kMinSegments = 128, kSegmentFactor = 4;
// PolicyOptions::EffectiveSegmentPages for these pages: segments of 512 tokens.
constexpr int kSegmentPagesOfThePolicy = 512 / kPage;
constexpr double kHbmBytesPerSecond = 3.35e12;
// The integer in environment variable `name` when it is in [lo, hi], else `fallback`.
int EnvInt(const char* name, int lo, int hi, int fallback) {
  const char* e = std::getenv(name);
  const int v = e == nullptr ? fallback : std::atoi(e);
  return v >= lo && v <= hi ? v : fallback;
}
// Pages per segment: DevicePolicy's (PolicyOptions::EffectiveSegmentPages, 8 for pages of 64),
// or STRATA_BENCH_SEGMENT_PAGES (1 to 64).
int SegPages() {
  static const int g = EnvInt("STRATA_BENCH_SEGMENT_PAGES", 1, 64, kSegmentPagesOfThePolicy);
  return g;
}
// Two-level once the middle has more pages than this: PolicyOptions::two_level_min_pages's
// default, or STRATA_BENCH_TWO_LEVEL_MIN_PAGES (0 to 1 << 24).
int TwoLevelMinPages() {
  static const int m = EnvInt("STRATA_BENCH_TWO_LEVEL_MIN_PAGES", 0, 1 << 24, 4096);
  return m;
}
// tokenselect's candidate tokens per budget token (PolicyOptions::tokenselect_candidate_factor):
// 4, or STRATA_BENCH_CANDIDATE_FACTOR (1 to 16) for the speed side of the fidelity trade-off.
int CandidateFactor() {
  static const int f = EnvInt("STRATA_BENCH_CANDIDATE_FACTOR", 1, 16, 4);
  return f;
}
// tokenselect's parts (STRATA_BENCH_PARTITIONS, a power of two 1 to 64; 16 otherwise).
int Partitions() {
  static const int p = [] {
    const int v = EnvInt("STRATA_BENCH_PARTITIONS", 1, 64, 16);
    return ValidPartitions(v) ? v : 16;
  }();
  return p;
}

// Runs one layer's selection + attention for `policy` ("quest" or "tokenselect") over a context
// of `len` tokens (query at position len - 1) and returns the bytes it must read.
struct Pipeline {
  Backend* b;
  int64_t len;
  bool token_level;
  // Device buffers.
  void *q, *k, *v, *table, *page_sums, *seg_sums, *seg_scores, *top_segs, *page_scores, *top_pages,
      *tok_scores, *top_tokens, *out, *lse;
  int64_t pages_per_head, segs_per_head;
  DType summary_dtype = DType::kF32;  // of page_sums and seg_sums
  // The K and V pools: bf16, or fp8 (STRATA_BENCH_POOL=fp8: codes of the bf16 values / k_scale,
  // k_scale = v_scale = 2^-8; the selection's scale carries k_scale, as the policies pass it).
  DType pool_dtype = DType::kBF16;
  float kv_scale = 1.0f;
  // Derived sizes.
  int64_t window_begin, p0, p1, s0, s1, keep_segs, page_cands, top_page_k, tok_cands;
  bool two_level;
  // Selection cache (cache_mode 1 = every head misses: theta 2; 2 = every head hits: theta 0.5
  // and q unchanged): the check in the SelectStages op (CheckInOp), else SelectionCacheCheck
  // first and the selection ops with skip_heads.
  int cache_mode = 0;
  void *cache_q = nullptr, *cache_valid = nullptr, *reuse = nullptr;
  // SelectStagesParams::arrivals for tokenselect in parts, as DevicePolicy passes them (zeroed
  // once); STRATA_BENCH_ARRIVALS=0 leaves them out (the parts then merge in a second kernel).
  void* arrivals = nullptr;
  // The selection as one SelectStages op (default) or op by op (STRATA_BENCH_FUSED=0).
  bool fused = true;
  bool attend_in_op = true;  // with `fused`: the attention inside the SelectStages op

  void Plan() {
    window_begin = std::max<int64_t>(kSinks, len - 1 - kWindow);
    p0 = kSinks / kPage;
    p1 = (window_begin + kPage - 1) / kPage;
    const int64_t wanted_tokens = token_level ? int64_t{CandidateFactor()} * kBudget : kBudget;
    const int64_t wanted_pages = (wanted_tokens + kPage - 1) / kPage;
    two_level = p1 - p0 > TwoLevelMinPages();
    s0 = p0 / SegPages();
    s1 = (p1 - 1) / SegPages() + 1;
    keep_segs = std::min<int64_t>(s1 - s0, std::max<int64_t>(kMinSegments,
        (kSegmentFactor * wanted_pages + SegPages() - 1) / SegPages()));
    // Every segment kept (128K: 128 of 128): the pages are scored directly, as DevicePolicy
    // does (same candidates); STRATA_BENCH_KEEP_SEGMENT_STAGE=1 keeps the segment stage.
    if (keep_segs >= s1 - s0 && std::getenv("STRATA_BENCH_KEEP_SEGMENT_STAGE") == nullptr) {
      two_level = false;
    }
    if (token_level) {  // each stage's k a multiple of the parts
      const int parts = Partitions();
      keep_segs = (keep_segs + parts - 1) / parts * parts;
    }
    page_cands = two_level ? keep_segs * SegPages() : p1 - p0;
    top_page_k = wanted_pages;
    tok_cands = top_page_k * kPage;
  }

  int64_t BytesRead() const {
    const int64_t group = kQHeads / kKvHeads;
    int64_t bytes = 0;
    const int64_t sb = static_cast<int64_t>(DTypeSize(summary_dtype));
    if (two_level) bytes += kKvHeads * (s1 - s0) * 2 * kHeadDim * sb + kKvHeads * group * (s1 - s0) * 4;
    bytes += kKvHeads * page_cands * 2 * kHeadDim * sb + kKvHeads * group * page_cands * 4;
    const int64_t kvb = static_cast<int64_t>(DTypeSize(pool_dtype));
    if (token_level) bytes += kKvHeads * tok_cands * kHeadDim * kvb + kKvHeads * group * tok_cands * 4;
    const int64_t attended = kSinks + (len - window_begin) + (token_level ? kBudget : top_page_k * kPage);
    bytes += kKvHeads * attended * kHeadDim * kvb * 2;
    return bytes;
  }

  // The selection stages over the pipeline's buffers: [segments ->] pages [-> tokens].
  SelectStagesParams Stages(const int32_t* skip) const {
    const int group = kQHeads / kKvHeads;
    SelectStagesParams sp;
    sp.q = TensorView(q, DType::kF32, {kQHeads, kHeadDim});
    sp.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim)) * kv_scale;
    sp.skip_heads = skip;
    int n = 0;
    if (two_level) {
      SelectStage& st = sp.stages[n++];
      st.summaries = TensorView(seg_sums, summary_dtype, {kKvHeads, segs_per_head, 2 * kHeadDim});
      st.candidates.begin = s0;
      st.candidates.end = s1;
      st.k = keep_segs;
      st.scores = TensorView(seg_scores, DType::kF32, {kKvHeads, group, s1 - s0});
      st.selected = TensorView(top_segs, DType::kI32, {kKvHeads, keep_segs});
    }
    SelectStage& pg = sp.stages[n++];
    pg.summaries = TensorView(page_sums, summary_dtype, {kKvHeads, pages_per_head, 2 * kHeadDim});
    if (two_level) {
      pg.candidates.parents = sp.stages[0].selected;
      pg.candidates.fanout = SegPages();
    }
    pg.candidates.begin = p0;
    pg.candidates.end = p1;
    pg.k = top_page_k;
    pg.scores = TensorView(page_scores, DType::kF32, {kKvHeads, group, page_cands});
    pg.selected = TensorView(top_pages, DType::kI32, {kKvHeads, top_page_k});
    if (token_level) {
      SelectStage& kt = sp.stages[n++];
      kt.k_pool = KPool();
      kt.page_table = TensorView(table, DType::kI32, {kKvHeads, pages_per_head});
      kt.candidates.parents = pg.selected;
      kt.candidates.fanout = kPage;
      kt.candidates.begin = kSinks;
      kt.candidates.end = window_begin;
      kt.k = kBudget;
      kt.scores = TensorView(tok_scores, DType::kF32, {kKvHeads, group, tok_cands});
      kt.selected = TensorView(top_tokens, DType::kI32, {kKvHeads, kBudget});
    }
    sp.num_stages = n;
    if (token_level) sp.partitions = Partitions();
    if (token_level && arrivals != nullptr) {
      sp.arrivals = TensorView(arrivals, DType::kI32, {kKvHeads});
    }
    return sp;
  }
  TensorView KPool() const {
    return TensorView(k, pool_dtype, {kKvHeads * pages_per_head, kPage, kHeadDim});
  }

  // Runs the whole pipeline, or (only >= 0) just its op number `only` (0-based, in order), which
  // then reads the outputs of the previous stages left by an earlier full run.
  absl::Status Run(Stream s, int only = -1) const {
    int stage = 0;
    auto on = [&]() { return only < 0 || only == stage++; };
    const int group = kQHeads / kKvHeads;
    const int32_t* skip = nullptr;
    SelectionCacheCheckParams cc;
    if (cache_mode != 0) {
      cc.q = TensorView(q, DType::kF32, {kQHeads, kHeadDim});
      cc.cached_q = TensorView(cache_q, DType::kF32, {kKvHeads, group * kHeadDim});
      cc.valid = TensorView(cache_valid, DType::kI32, {kKvHeads});
      cc.theta = cache_mode == 1 ? 2.0f : 0.5f;
      cc.reuse = TensorView(reuse, DType::kI32, {kKvHeads});
    }
    if (cache_mode != 0 && !CheckInOp()) {
      if (on()) STRATA_RETURN_IF_ERROR(b->SelectionCacheCheck(cc, s));
      skip = static_cast<const int32_t*>(reuse);
    }
    SelectStagesParams sp = Stages(skip);
    if (CheckInOp()) sp.cache_check = &cc;
    const SelectedAttentionParams at = Attention(sp);
    if (fused && attend_in_op) {
      sp.attend = &at;
      if (on()) STRATA_RETURN_IF_ERROR(b->SelectStages(sp, s));
      return absl::OkStatus();
    }
    if (fused) {
      if (on()) STRATA_RETURN_IF_ERROR(b->SelectStages(sp, s));
    } else {
      // The ops SelectStages stands for, one by one (kernels::SelectStagesOpByOp's calls).
      for (int i = 0; i < sp.num_stages; ++i) {
        if (sp.stages[i].summaries.data != nullptr) {
          if (on()) STRATA_RETURN_IF_ERROR(b->ScoreSummaries(StageScoreSummariesParams(sp, i), s));
        } else {
          if (on()) STRATA_RETURN_IF_ERROR(b->ScoreKeys(StageScoreKeysParams(sp, i), s));
        }
        if (on()) STRATA_RETURN_IF_ERROR(b->VoteTopK(StageVoteTopKParams(sp, i), s));
      }
    }
    if (on()) return b->SelectedAttention(at, s);
    return absl::OkStatus();
  }

  // The attention over the last stage's selection (sinks + middle + window).
  SelectedAttentionParams Attention(const SelectStagesParams& sp) const {
    CandidateList middle;
    middle.parents = sp.stages[sp.num_stages - 1].selected;
    middle.fanout = token_level ? 1 : kPage;
    middle.begin = kSinks;
    middle.end = window_begin;
    SelectedAttentionParams at;
    at.q = TensorView(q, DType::kF32, {1, kQHeads, kHeadDim});
    at.k_pool = KPool();
    at.v_pool = TensorView(v, pool_dtype, {kKvHeads * pages_per_head, kPage, kHeadDim});
    at.page_table = TensorView(table, DType::kI32, {kKvHeads, pages_per_head});
    at.prefix_end = kSinks;
    at.middle = middle;
    at.suffix_begin = window_begin;
    at.suffix_end = len;
    at.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    at.k_scale = kv_scale;  // at.scale * at.k_scale == sp.scale (kv_scale a power of two)
    at.v_scale = kv_scale;
    at.out = TensorView(out, DType::kF32, {1, kQHeads, kHeadDim});
    at.lse = TensorView(lse, DType::kF32, {1, kQHeads});
    return at;
  }

  // The selection cache's check inside the SelectStages op (SelectStagesParams::cache_check, as
  // DevicePolicy passes it) where the attention is in the op too; STRATA_BENCH_CHECK_IN_OP=0: as
  // its own op before it.
  bool CheckInOp() const {
    const char* e = std::getenv("STRATA_BENCH_CHECK_IN_OP");
    return cache_mode != 0 && fused && attend_in_op && (e == nullptr || std::string(e) != "0");
  }

  int NumStages() const {
    if (fused && attend_in_op) return (cache_mode != 0 && !CheckInOp() ? 1 : 0) + 1;
    if (fused) return (cache_mode != 0 ? 1 : 0) + 1 + 1;
    return (cache_mode != 0 ? 1 : 0) + (two_level ? 2 : 0) + 2 + (token_level ? 2 : 0) + 1;
  }
};

// --stage-phases: one more call of the fused selection op with SelectStagesKernel's phase stamps
// on (cuda_internal::SetSelectStagesPhaseStamps), printed per stage as the median over blocks of
// each phase's clock64 cycles and its microseconds at 1.98 GHz (the H100 / H200 boost clock), and
// the slowest block's microseconds.
void StagePhases(const Pipeline& pl, cudaStream_t stream, int64_t context,
                 const std::string& label) {
  constexpr int P = cuda_internal::kSelectStagesPhases;
  constexpr int kMaxBlocks = 16 * kKvHeads;
  long long* d = nullptr;
  BENCH_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(long long) * P * kMaxBlocks) ==
                  cudaSuccess,
              "stamps");
  BENCH_CHECK(cudaMemset(d, 0, sizeof(long long) * P * kMaxBlocks) == cudaSuccess, "stamps");
  BENCH_CHECK(cuda_internal::SetSelectStagesPhaseStamps(d, kMaxBlocks) == cudaSuccess, "set");
  BENCH_CHECK(pl.Run(stream, 0).ok(), "phase run");  // op 0: the selection
  BENCH_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "phase sync");
  BENCH_CHECK(cuda_internal::SetSelectStagesPhaseStamps(nullptr, 0) == cudaSuccess, "unset");
  std::vector<long long> h(static_cast<size_t>(P) * kMaxBlocks);
  BENCH_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(long long), cudaMemcpyDeviceToHost) ==
                  cudaSuccess, "stamps back");
  cudaFree(d);
  const char* names[cuda_internal::kSelectStagesPhasesPerStage] = {
      "start", "scored", "local", "recv", "keys", "pass0", "pass1", "pass2", "end"};
  // One PHASES line: the phases at stamp indices [first, first + count).
  auto print_line = [&](const std::string& what, int first, int count, const char* const* names) {
    std::printf("PHASES %-8lld %-12s %s:", static_cast<long long>(context), label.c_str(),
                what.c_str());
    bool any = false;
    for (int ph = 0; ph < count; ++ph) {
      const int idx = first + ph;
      std::vector<double> dt;
      for (int b = 0; b < kMaxBlocks; ++b) {
        const long long* row = &h[static_cast<size_t>(b) * P];
        if (row[0] == 0 || row[idx] == 0) continue;
        long long prev = 0;  // the last stamp written before this one
        for (int j = idx - 1; j >= 0 && prev == 0; --j) prev = row[j];
        dt.push_back(static_cast<double>(row[idx] - prev));
      }
      if (dt.empty()) continue;
      any = true;
      const double med = Median(dt);
      const double mx = *std::max_element(dt.begin(), dt.end());
      std::printf(" %s %.0f (%.2f us, max %.2f)", names[ph], med, med / 1980.0, mx / 1980.0);
    }
    std::printf(any ? "\n" : " (not run)\n");
  };
  for (int st = 0; st < cuda_internal::kSelectStagesMax; ++st) {
    print_line("stage " + std::to_string(st), 1 + st * cuda_internal::kSelectStagesPhasesPerStage,
               cuda_internal::kSelectStagesPhasesPerStage, names);
  }
  // The attention's phases when it ran in the kernel.
  const char* anames[cuda_internal::kSelectStagesAttendPhases] = {
      "rows", "fixed-in", "fixed", "t0-in", "t0", "t1-in", "t1", "merged"};
  print_line("attend",
             1 + cuda_internal::kSelectStagesMax * cuda_internal::kSelectStagesPhasesPerStage,
             cuda_internal::kSelectStagesAttendPhases, anames);
  // The part kernel's placement (kSelectStagesPlaceSlot): how many SMs its blocks ran on, the
  // blocks that shared an SM, each block's time from entry to exit (%globaltimer, after its
  // merge where it merges) for blocks alone on their SM and those sharing one, the blocks' entry
  // skew, and the span from the first entry to the last exit.
  constexpr int S = cuda_internal::kSelectStagesPlaceSlot;
  std::vector<int> sm_blocks(1024, 0);
  std::vector<int> block_sm;
  std::vector<long long> t0, t1;
  for (int b = 0; b < kMaxBlocks; ++b) {
    const long long* row = &h[static_cast<size_t>(b) * P];
    if (row[S + 1] == 0 || row[S + 2] == 0 || row[S] < 0 || row[S] >= 1024) continue;
    block_sm.push_back(static_cast<int>(row[S]));
    ++sm_blocks[static_cast<size_t>(row[S])];
    t0.push_back(row[S + 1]);
    t1.push_back(row[S + 2]);
  }
  if (block_sm.empty()) return;
  std::vector<double> alone, shared;
  int sms = 0;
  for (int n : sm_blocks) sms += n > 0 ? 1 : 0;
  for (size_t i = 0; i < block_sm.size(); ++i) {
    const double us = static_cast<double>(t1[i] - t0[i]) / 1000.0;
    (sm_blocks[static_cast<size_t>(block_sm[i])] > 1 ? shared : alone).push_back(us);
  }
  const long long first = *std::min_element(t0.begin(), t0.end());
  const long long last_in = *std::max_element(t0.begin(), t0.end());
  const long long last_out = *std::max_element(t1.begin(), t1.end());
  auto med_max = [](std::vector<double> v) {
    if (v.empty()) return std::string("-");
    const double mx = *std::max_element(v.begin(), v.end());
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.2f / %.2f", Median(v), mx);
    return std::string(buf);
  };
  std::printf("BLOCKS %-8lld %-12s %zu blocks on %d SMs (%zu sharing an SM); entry skew %.2f us; "
              "entry to exit, median / max: alone %s, sharing %s us; span %.2f us\n",
              static_cast<long long>(context), label.c_str(), block_sm.size(), sms, shared.size(),
              static_cast<double>(last_in - first) / 1000.0, med_max(alone).c_str(),
              med_max(shared).c_str(), static_cast<double>(last_out - first) / 1000.0);
}

void RunPipelines(CudaBackend& cuda, cudaStream_t stream, void* flush, size_t flush_bytes,
                  int64_t context, const std::vector<uint16_t>& keys_bf16, Buffer& k, Buffer& v,
                  Buffer& q, Buffer& out, Buffer& lse) {
  const int64_t pages = context / kPage, segs = (pages + SegPages() - 1) / SegPages();
  // STRATA_BENCH_POOL=fp8: the pipelines read fp8 copies of the pools (codes of x / kFp8Scale).
  const char* pool_env = std::getenv("STRATA_BENCH_POOL");
  const bool fp8 = pool_env != nullptr && std::string(pool_env) == "fp8";
  constexpr float kFp8Scale = 1.0f / 256;
  std::vector<uint8_t> k8;
  std::unique_ptr<Buffer> d_k8, d_v8;
  if (fp8) {
    k8.resize(keys_bf16.size());
    for (size_t i = 0; i < k8.size(); ++i) k8[i] = F32ToFP8E4M3(BF16ToF32(keys_bf16[i]) / kFp8Scale);
    d_k8 = MustAllocate(cuda, k8.size());
    d_v8 = MustAllocate(cuda, k8.size());
    BENCH_CHECK(cuda.CopyToDevice(d_k8->data(), k8.data(), k8.size(), stream).ok(), "k8");
    BENCH_CHECK(cuda.CopyToDevice(d_v8->data(), k8.data() + 1, k8.size() - 1, stream).ok(), "v8");
    std::printf("pools: fp8 e4m3 (scale 2^-8)\n");
  }
  // The stored value of key element i (what the summaries bound).
  auto key_at = [&](size_t i) {
    return fp8 ? FP8E4M3ToF32(k8[i]) : BF16ToF32(keys_bf16[i]);
  };
  // Minmax summaries of every page and segment of every head (slot g * pages + p holds page p).
  std::vector<float> ps(static_cast<size_t>(kKvHeads) * pages * 2 * kHeadDim);
  std::vector<float> ss(static_cast<size_t>(kKvHeads) * segs * 2 * kHeadDim);
  for (int64_t r = 0; r < kKvHeads * pages; ++r) {
    float* s = &ps[r * 2 * kHeadDim];
    for (int e = 0; e < kHeadDim; ++e) s[e] = 1e30f, s[kHeadDim + e] = -1e30f;
    for (int t = 0; t < kPage; ++t) {
      const size_t row = static_cast<size_t>(r * kPage + t) * kHeadDim;
      for (int e = 0; e < kHeadDim; ++e) {
        const float x = key_at(row + e);
        s[e] = std::min(s[e], x);
        s[kHeadDim + e] = std::max(s[kHeadDim + e], x);
      }
    }
    const int64_t g = r / pages, p = r % pages;
    float* sg = &ss[(g * segs + p / SegPages()) * 2 * kHeadDim];
    if (p % SegPages() == 0) std::copy(s, s + 2 * kHeadDim, sg);
    for (int e = 0; e < kHeadDim; ++e) {
      sg[e] = std::min(sg[e], s[e]);
      sg[kHeadDim + e] = std::max(sg[kHeadDim + e], s[kHeadDim + e]);
    }
  }
  std::vector<int32_t> table(kKvHeads * pages);
  for (int64_t i = 0; i < kKvHeads * pages; ++i) table[i] = static_cast<int32_t>(i);
  const char* sum_env = std::getenv("STRATA_BENCH_SUMMARY_BF16");
  const bool sum_bf16 = sum_env == nullptr || std::string(sum_env) != "0";
  // The summaries as the pipelines read them: f32, or bf16 rounded outward.
  std::vector<uint16_t> ps16, ss16;
  const void* ps_src = ps.data();
  const void* ss_src = ss.data();
  size_t elem = sizeof(float);
  if (sum_bf16) {
    ps16.resize(ps.size());
    ss16.resize(ss.size());
    MinMaxRowsToBF16(ps.data(), kKvHeads * pages, kHeadDim, ps16.data());
    MinMaxRowsToBF16(ss.data(), kKvHeads * segs, kHeadDim, ss16.data());
    ps_src = ps16.data();
    ss_src = ss16.data();
    elem = sizeof(uint16_t);
    std::printf("summaries: bf16, rounded outward\n");
  }
  {
    const char* fe = std::getenv("STRATA_BENCH_FUSED");
    std::printf("selection: %s (SelectStagesKernel: clusters of %d blocks)\n",
                fe != nullptr && std::string(fe) == "0" ? "op by op (STRATA_BENCH_FUSED=0)"
                                                        : "one SelectStages op",
                cuda_internal::SelectStagesClusterBlocks(kKvHeads));
  }
  auto d_ps = MustAllocate(cuda, ps.size() * elem), d_ss = MustAllocate(cuda, ss.size() * elem);
  auto d_table = MustAllocate(cuda, table.size() * 4);
  BENCH_CHECK(cuda.CopyToDevice(d_ps->data(), ps_src, ps.size() * elem, stream).ok(), "ps");
  BENCH_CHECK(cuda.CopyToDevice(d_ss->data(), ss_src, ss.size() * elem, stream).ok(), "ss");
  BENCH_CHECK(cuda.CopyToDevice(d_table->data(), table.data(), table.size() * 4, stream).ok(), "t");
  const size_t big = static_cast<size_t>(kKvHeads) * kQHeads * 16384 * 4;  // any stage's scores
  auto d_s1 = MustAllocate(cuda, big), d_s2 = MustAllocate(cuda, big), d_s3 = MustAllocate(cuda, big);
  auto d_i1 = MustAllocate(cuda, kKvHeads * 16384 * 4), d_i2 = MustAllocate(cuda, kKvHeads * 16384 * 4);
  auto d_i3 = MustAllocate(cuda, kKvHeads * 16384 * 4);
  auto d_cq = MustAllocate(cuda, kQHeads * kHeadDim * 4);
  auto d_cv = MustAllocate(cuda, kKvHeads * 4), d_reuse = MustAllocate(cuda, kKvHeads * 4);
  auto d_arrivals = MustAllocate(cuda, kKvHeads * 4);
  BENCH_CHECK(cudaMemset(d_arrivals->data(), 0, kKvHeads * 4) == cudaSuccess, "arrivals");
  const char* arrivals_env = std::getenv("STRATA_BENCH_ARRIVALS");
  const bool use_arrivals = arrivals_env == nullptr || std::string(arrivals_env) != "0";

  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int run = 0; run < 6; ++run) {
    const int policy = run / 3, cache_mode = run % 3;
    if (!g_policy.empty() && g_policy != (policy == 1 ? "tokenselect" : "quest")) continue;
    if (!g_row_on[cache_mode]) continue;
    const std::string label = std::string(policy == 1 ? "tokenselect" : "quest") +
                              (policy == 1 && Partitions() > 1
                                   ? "/p" + std::to_string(Partitions())
                                   : std::string()) +
                              (cache_mode == 1 ? "+miss" : cache_mode == 2 ? "+hit" : "");
    Pipeline pl;
    pl.cache_mode = cache_mode;
    const char* fused_env = std::getenv("STRATA_BENCH_FUSED");
    pl.fused = fused_env == nullptr || std::string(fused_env) != "0";
    const char* attend_env = std::getenv("STRATA_BENCH_ATTEND");
    pl.attend_in_op = attend_env == nullptr || std::string(attend_env) != "op";
    pl.cache_q = d_cq->data(), pl.cache_valid = d_cv->data(), pl.reuse = d_reuse->data();
    if (use_arrivals) pl.arrivals = d_arrivals->data();
    BENCH_CHECK(cudaMemsetAsync(d_cv->data(), 0, kKvHeads * 4, stream) == cudaSuccess, "valid");
    pl.b = &cuda;
    pl.len = context;
    pl.token_level = policy == 1;
    pl.q = q.data(), pl.k = k.data(), pl.v = v.data(), pl.table = d_table->data();
    if (fp8) {
      pl.pool_dtype = DType::kFP8E4M3;
      pl.kv_scale = kFp8Scale;
      pl.k = d_k8->data(), pl.v = d_v8->data();
    }
    pl.page_sums = d_ps->data(), pl.seg_sums = d_ss->data();
    pl.summary_dtype = sum_bf16 ? DType::kBF16 : DType::kF32;
    pl.seg_scores = d_s1->data(), pl.page_scores = d_s2->data(), pl.tok_scores = d_s3->data();
    pl.top_segs = d_i1->data(), pl.top_pages = d_i2->data(), pl.top_tokens = d_i3->data();
    pl.out = out.data(), pl.lse = lse.data();
    pl.pages_per_head = pages;
    pl.segs_per_head = segs;
    pl.Plan();
    BENCH_CHECK(pl.page_cands <= 16384 && pl.s1 - pl.s0 <= 16384, "score buffers too small");
    for (int i = 0; i < 5; ++i) {
      const absl::Status st = pl.Run(stream);
      BENCH_CHECK(st.ok(), st.ToString().c_str());
    }
    BENCH_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "warm-up");
    const int calls = 100;
    // Eager, back to back.
    cudaEventRecord(e0, stream);
    for (int c = 0; c < calls; ++c) BENCH_CHECK(pl.Run(stream).ok(), "run");
    cudaEventRecord(e1, stream);
    BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "sync");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    const double eager = ms * 1000.0 / calls;
    // Captured once, replayed.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess, "capture");
    const absl::Status cst = pl.Run(stream);
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph) == cudaSuccess, "end capture");
    BENCH_CHECK(cst.ok(), cst.ToString().c_str());
    BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess, "instantiate");
    for (int i = 0; i < 5; ++i) cudaGraphLaunch(exec, stream);
    cudaEventRecord(e0, stream);
    for (int c = 0; c < calls; ++c) cudaGraphLaunch(exec, stream);
    cudaEventRecord(e1, stream);
    BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "graph sync");
    cudaEventElapsedTime(&ms, e0, e1);
    const double graph_us = ms * 1000.0 / calls;
    std::vector<double> cold;
    for (int it = 0; it < g_warmup + g_runs; ++it) {
      cudaMemsetAsync(flush, it & 0xff, flush_bytes, stream);
      cudaEventRecord(e0, stream);
      cudaGraphLaunch(exec, stream);
      cudaEventRecord(e1, stream);
      BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "cold sync");
      cudaEventElapsedTime(&ms, e0, e1);
      if (it >= g_warmup) cold.push_back(ms * 1000.0);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    std::vector<float> o(kQHeads * kHeadDim);
    BENCH_CHECK(cuda.CopyToHost(o.data(), out.data(), o.size() * 4, stream).ok(), "out");
    for (float f : o) BENCH_CHECK(std::isfinite(f), "non-finite pipeline output");
    const double cold_us = Median(cold);
    const double mib = pl.BytesRead() / 1048576.0;
    std::printf("PIPE %-8lld %-12s %9.1f %9.1f %9.1f %8.2f %9.2f %7.3f %s\n",
                static_cast<long long>(context), label.c_str(), eager,
                graph_us, cold_us, g_dense_us > 0 ? cold_us / g_dense_us : 0.0, mib,
                pl.BytesRead() / (cold_us * 1e-6) / kHbmBytesPerSecond,
                pl.two_level ? "two-level" : "one-level");
    std::fflush(stdout);
    // Per-op breakdown: each op alone, back to back (inputs from the runs above).
    std::printf("STAGES %-8lld %-12s", static_cast<long long>(context), label.c_str());
    for (int st = 0; st < pl.NumStages(); ++st) {
      for (int i = 0; i < 3; ++i) BENCH_CHECK(pl.Run(stream, st).ok(), "stage");
      cudaEventRecord(e0, stream);
      for (int c = 0; c < calls; ++c) BENCH_CHECK(pl.Run(stream, st).ok(), "stage");
      cudaEventRecord(e1, stream);
      BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "stage sync");
      cudaEventElapsedTime(&ms, e0, e1);
      std::printf(" %7.1f", ms * 1000.0 / calls);
    }
    std::printf("   (us per op, in pipeline order)\n");
    // The same per op from a CUDA graph of 20 calls of the op alone, replayed (device-bound: no
    // host launch cost; the gaps between kernels are those of a graph).
    std::printf("GSTAGES %-8lld %-12s", static_cast<long long>(context), label.c_str());
    for (int st = 0; st < pl.NumStages(); ++st) {
      constexpr int kPerGraph = 20, kReplays = 10;
      cudaGraph_t sg = nullptr;
      cudaGraphExec_t sx = nullptr;
      BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess,
                  "stage capture");
      absl::Status sst;
      for (int c = 0; c < kPerGraph && sst.ok(); ++c) sst = pl.Run(stream, st);
      BENCH_CHECK(cudaStreamEndCapture(stream, &sg) == cudaSuccess, "stage end capture");
      BENCH_CHECK(sst.ok(), sst.ToString().c_str());
      BENCH_CHECK(cudaGraphInstantiate(&sx, sg, 0) == cudaSuccess, "stage instantiate");
      for (int i = 0; i < 3; ++i) cudaGraphLaunch(sx, stream);
      cudaEventRecord(e0, stream);
      for (int i = 0; i < kReplays; ++i) cudaGraphLaunch(sx, stream);
      cudaEventRecord(e1, stream);
      BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "stage graph sync");
      cudaEventElapsedTime(&ms, e0, e1);
      std::printf(" %7.1f", ms * 1000.0 / (kPerGraph * kReplays));
      cudaGraphExecDestroy(sx);
      cudaGraphDestroy(sg);
    }
    std::printf("   (us per op from a graph of the op alone)\n");
    // Phases of the selecting step, also with the cache's check in it (+miss; the first op).
    if (g_stage_phases && pl.fused && (cache_mode == 0 || (cache_mode == 1 && pl.CheckInOp()))) {
      StagePhases(pl, stream, context, label);
    }
    std::fflush(stdout);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// --rows: a comma-separated list of plain, miss and hit into g_row_on; false where a name is none
// of them (or the list is empty).
bool ParseRows(const std::string& list) {
  bool on[3] = {false, false, false};
  size_t begin = 0;
  while (true) {
    const size_t end = list.find(',', begin);
    const std::string name = list.substr(begin, end == std::string::npos ? end : end - begin);
    if (name == "plain") {
      on[0] = true;
    } else if (name == "miss") {
      on[1] = true;
    } else if (name == "hit") {
      on[2] = true;
    } else {
      return false;
    }
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  std::copy(on, on + 3, g_row_on);
  return true;
}

int Run(int argc, char** argv) {
  std::vector<int64_t> contexts;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--ncu") {
      g_ncu = true;
      g_warmup = 2;
      g_runs = 3;
      g_pipelines = false;
    } else if (std::string(argv[i]) == "--stage-phases") {
      g_stage_phases = true;
    } else if (std::string(argv[i]) == "--no-sweep") {
      g_sweep = false;
    } else if (std::string(argv[i]) == "--no-pipelines") {
      g_pipelines = false;
    } else if (std::string(argv[i]) == "--pipelines-only") {
      g_only_pipelines = true;
    } else if (std::string(argv[i]) == "--policy" && i + 1 < argc) {
      g_policy = argv[++i];
    } else if (std::string(argv[i]) == "--rows" && i + 1 < argc) {
      if (!ParseRows(argv[++i])) {
        std::fprintf(stderr, "--rows: expected plain, miss and/or hit, got \"%s\"\n", argv[i]);
        return 2;
      }
    } else {
      contexts.push_back(std::atoll(argv[i]));
    }
  }
  if (contexts.empty()) contexts = {32768, 131072};
  auto made = MakeCudaBackend(0);
  if (!made.ok()) {
    std::printf("no CUDA GPU: %s\n", made.status().ToString().c_str());
    return 0;
  }
  auto backend = std::move(made).value();
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  void* flush = nullptr;
  const size_t flush_bytes = size_t{256} << 20;
  BENCH_CHECK(cudaMalloc(&flush, flush_bytes) == cudaSuccess, "cudaMalloc flush");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaStream_t stream = nullptr;  // the backend's own stream is used for nullptr below
  auto* cuda = static_cast<CudaBackend*>(backend.get());
  auto s_or = cuda->CreateStream();
  BENCH_CHECK(s_or.ok(), "CreateStream");
  stream = static_cast<cudaStream_t>(s_or.value());

  std::printf("%-8s %-7s %8s %8s %9s %9s %9s %8s %7s\n", "context", "keys", "tokens/h",
              "items/SM", "gpu_us", "host_us", "b2b_us", "MiB", "GB/s");
  if (g_pipelines) {
    std::printf("pipeline rows: PIPE context policy eager_us graph_us cold_us cold/dense MiB "
                "frac_of_3.35TB/s levels\n");
  }
  std::mt19937 rng(1234);
  for (int64_t context : contexts) {
    const int64_t pages_per_head = context / kPage;
    const int64_t slots = pages_per_head * kKvHeads;
    const int64_t elems = slots * kPage * kHeadDim;
    // Random bf16 in [-1, 1) (never zeros: zeros can time faster than real data).
    std::vector<uint16_t> host(elems);
    uint32_t x = 2463534242u;
    for (int64_t i = 0; i < elems; ++i) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      const float f = static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
      host[i] = F32ToBF16(f);
    }
    auto k = backend->Allocate(elems * 2);
    auto v = backend->Allocate(elems * 2);
    BENCH_CHECK(k.ok() && v.ok(), "pool allocation");
    BENCH_CHECK(backend->CopyToDevice(k.value()->data(), host.data(), elems * 2, nullptr).ok(), "k");
    BENCH_CHECK(backend->CopyToDevice(v.value()->data(), host.data() + 1, (elems - 1) * 2, nullptr).ok(), "v");
    std::vector<float> qh(kQHeads * kHeadDim);
    std::uniform_real_distribution<float> ud(-1, 1);
    for (float& f : qh) f = ud(rng);
    auto q = backend->Allocate(qh.size() * 4);
    auto out = backend->Allocate(qh.size() * 4);
    auto lse = backend->Allocate(kQHeads * 4);
    BENCH_CHECK(q.ok() && out.ok() && lse.ok(), "q/out/lse allocation");
    BENCH_CHECK(backend->CopyToDevice(q.value()->data(), qh.data(), qh.size() * 4, nullptr).ok(), "q");

    for (int mode = 0; mode < 2; ++mode) {
      const bool dense = mode == 0;
      if (g_only_pipelines && !dense) continue;
      std::vector<KvSpan> spans;
      std::vector<int32_t> offsets(kKvHeads + 1, 0);
      for (int g = 0; g < kKvHeads; ++g) {
        offsets[g] = static_cast<int32_t>(spans.size());
        std::vector<int32_t> pages(pages_per_head);
        for (int64_t i = 0; i < pages_per_head; ++i) pages[i] = static_cast<int32_t>(i);
        if (!dense) {
          std::shuffle(pages.begin(), pages.end(), rng);
          pages.resize(std::min<int64_t>(kBudget / kPage, pages_per_head));
          std::sort(pages.begin(), pages.end());
        }
        for (int32_t pg : pages) {
          spans.push_back({static_cast<int32_t>(g * pages_per_head + pg), 0, kPage, pg * kPage});
        }
      }
      offsets[kKvHeads] = static_cast<int32_t>(spans.size());
      const int64_t tokens_per_head = spans.size() / kKvHeads * kPage;
      int32_t qpos = static_cast<int32_t>(context);
      PagedAttentionParams p;
      p.q = q.value()->View(DType::kF32, {1, kQHeads, kHeadDim});
      p.k_pool = k.value()->View(DType::kBF16, {slots, kPage, kHeadDim});
      p.v_pool = v.value()->View(DType::kBF16, {slots, kPage, kHeadDim});
      p.spans = spans.data();
      p.span_offsets = offsets.data();
      p.num_kv_heads = kKvHeads;
      p.q_positions = &qpos;
      p.causal = true;
      p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
      p.out = out.value()->View(DType::kF32, {1, kQHeads, kHeadDim});
      p.lse = lse.value()->View(DType::kF32, {1, kQHeads});
      const double mib =
          static_cast<double>(tokens_per_head) * kKvHeads * kHeadDim * 2 * 2 / (1 << 20);
      std::vector<int> sweep = {4};
      if (!dense && !g_ncu && g_sweep) sweep = {1, 2, 4, 8, 16};
      for (int items_per_sm : sweep) {
        cuda->SetDecodeItemsPerSm(items_per_sm);
        // Ungated warm-up first: a call that has to grow the pinned staging ring (cudaMallocHost /
        // cudaFreeHost synchronise the device) must not run while the gate holds the stream.
        for (int it = 0; it < 8; ++it) {
          const absl::Status st = backend->PagedAttention(p, stream);
          BENCH_CHECK(st.ok(), st.ToString().c_str());
        }
        BENCH_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "warm-up");
        std::vector<double> gpu_us, host_us;
        for (int it = 0; it < g_warmup + g_runs; ++it) {
          BENCH_CHECK(cudaMemsetAsync(flush, it & 0xff, flush_bytes, stream) == cudaSuccess, "flush");
          Gate gate;
          if (!g_ncu) {
            BENCH_CHECK(cudaLaunchHostFunc(stream, Gate::Wait, &gate) == cudaSuccess, "gate");
          }
          BENCH_CHECK(cudaEventRecord(e0, stream) == cudaSuccess, "event");
          const auto h0 = std::chrono::steady_clock::now();
          const absl::Status st = backend->PagedAttention(p, stream);
          const auto h1 = std::chrono::steady_clock::now();
          BENCH_CHECK(cudaEventRecord(e1, stream) == cudaSuccess, "event");
          gate.open.store(true, std::memory_order_release);
          BENCH_CHECK(st.ok(), st.ToString().c_str());
          BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "sync");
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          if (it >= g_warmup) {
            gpu_us.push_back(ms * 1000.0);
            host_us.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count());
          }
        }
        // Back to back: the steady state of repeated calls.
        double b2b = 0;
        if (!g_ncu) {
          const int calls = 50;
          BENCH_CHECK(cudaEventRecord(e0, stream) == cudaSuccess, "event");
          for (int c = 0; c < calls; ++c) {
            const absl::Status st = backend->PagedAttention(p, stream);
            BENCH_CHECK(st.ok(), st.ToString().c_str());
          }
          BENCH_CHECK(cudaEventRecord(e1, stream) == cudaSuccess, "event");
          BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "sync");
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          b2b = ms * 1000.0 / calls;
        }
        std::vector<float> o(qh.size());
        BENCH_CHECK(backend->CopyToHost(o.data(), out.value()->data(), o.size() * 4, stream).ok(),
                    "out");
        for (float f : o) BENCH_CHECK(std::isfinite(f), "non-finite output");
        const double med = Median(gpu_us);
        if (dense) g_dense_us = med;
        std::printf("%-8lld %-7s %8lld %8d %9.1f %9.1f %9.1f %8.1f %7.0f\n",
                    static_cast<long long>(context), dense ? "dense" : "budget",
                    static_cast<long long>(tokens_per_head), items_per_sm, med, Median(host_us),
                    b2b, mib, mib * 1.048576e6 / (med * 1e3));
        std::fflush(stdout);
      }
      cuda->SetDecodeItemsPerSm(0);
    }
    if (g_pipelines) {
      RunPipelines(*cuda, stream, flush, flush_bytes, context, host, *k.value(), *v.value(),
                   *q.value(), *out.value(), *lse.value());
    }
  }
  cudaFree(flush);
  BENCH_CHECK(cuda->DestroyStream(stream).ok(), "DestroyStream");
  return 0;
}

}  // namespace
}  // namespace strata::kernels

int main(int argc, char** argv) { return strata::kernels::Run(argc, argv); }
