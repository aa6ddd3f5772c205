// Times CudaBackend::SelectedAttention alone (one decode token, Llama-3.1-8B shape: 32 query
// heads, 8 KV heads, head_dim 128, 64-token pages) over bf16 and fp8 e4m3 pools, for
//   sparse   sinks 64 + 32 pages of the middle (2048 tokens, parents = page ids) + window 256:
//            2368 tokens per KV head, the selection of the sparse policies' defaults;
//   dense    every token of the context as the prefix (the dense decode step's call);
//   sinks    the 64 sinks alone (one page per KV head: the fixed cost of a call).
// at contexts of 128K and 1M tokens. Pools hold every page of the context (constant bytes; the
// values do not change the work). Figures per row, medians:
//   cold_us   one call after a 256 MiB memset that flushes L2, CUDA events around the call (a
//             host function holds the stream until the call is enqueued, so no host time);
//   b2b_us    100 calls enqueued back to back, event time / 100 (host-bound if the host is slower);
//   graph_us  the call captured once in a CUDA graph, replayed 100 times back to back;
// and the K and V bytes attended, with cold_us as a fraction of 3.35 TB/s (H100 SXM HBM3).
//
// Usage: cuda_selected_attention_bench [--ncu] [--contiguous] [--only sparse|dense|sinks]
//                                      [--pool bf16|fp8|fp8s] [context ...]  (default 131072 1048576)
//   --pool fp8s: fp8 pools with per-slot scales (slot_scales, all 1; the rows say
//                fp8_e4m3+slot_scales); without --pool every pool kind is timed.
//   --ncu: a few calls only (for Nsight Compute).
//   --contiguous: each KV head's pages in consecutive slots (as engine::KvCache lays them out);
//                 default: a random permutation of the slots (as a page cache may hold them).
//   --phases: after each row that runs the cluster kernel, one more graph replay with phase stamps
//             on (cuda_internal::SetSelectedAttentionPhaseStamps) and a PHASES line: per phase the
//             median / max over blocks of its cycles in µs, and the span of the call seen by the
//             device (first block entry to last block exit, %globaltimer).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/internal/launch.h"
#include "kernels/cuda/testing/bench_util.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {
namespace {

using bench::Gate;
using bench::Median;
using bench::MustAllocate;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kPage = 64;
constexpr int kSinks = 64, kWindow = 256, kMiddlePages = 32;
constexpr double kHbmBytesPerSecond = 3.35e12;
bool g_ncu = false;
bool g_contiguous = false;
bool g_phases = false;
std::string g_only, g_pool;

struct Result {
  double cold_us, b2b_us, graph_us;
};

Result Time(Backend& b, const SelectedAttentionParams& p, void* flush, size_t flush_bytes) {
  cudaStream_t s;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess, "stream");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int cold_runs = g_ncu ? 2 : 30, b2b_calls = g_ncu ? 2 : 100;
  for (int i = 0; i < 3; ++i) BENCH_CHECK(b.SelectedAttention(p, s).ok(), "warm-up");
  BENCH_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "sync");
  Result r{};
  std::vector<double> cold;
  for (int i = 0; i < cold_runs; ++i) {
    cudaMemsetAsync(flush, i & 0xff, flush_bytes, s);
    Gate gate;
    cudaLaunchHostFunc(s, Gate::Wait, &gate);
    cudaEventRecord(e0, s);
    BENCH_CHECK(b.SelectedAttention(p, s).ok(), "call");
    cudaEventRecord(e1, s);
    gate.open.store(true, std::memory_order_release);
    BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "cold run");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cold.push_back(ms * 1e3);
  }
  r.cold_us = Median(cold);
  {
    cudaEventRecord(e0, s);
    for (int i = 0; i < b2b_calls; ++i) BENCH_CHECK(b.SelectedAttention(p, s).ok(), "b2b");
    cudaEventRecord(e1, s);
    BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "b2b run");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    r.b2b_us = ms * 1e3 / b2b_calls;
  }
  {
    BENCH_CHECK(b.BeginCapture(s).ok(), "capture");
    const absl::Status st = b.SelectedAttention(p, s);
    auto g = b.EndCapture(s);
    BENCH_CHECK(st.ok() && g.ok(), "captured call");
    BENCH_CHECK((*g)->Replay(s).ok(), "replay");
    BENCH_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "replay sync");
    cudaEventRecord(e0, s);
    for (int i = 0; i < b2b_calls; ++i) BENCH_CHECK((*g)->Replay(s).ok(), "replay");
    cudaEventRecord(e1, s);
    BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "graph run");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    r.graph_us = ms * 1e3 / b2b_calls;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  return r;
}

// One graph replay of the call with phase stamps on (after 20 replays without), then a PHASES
// line: phase i = stamps i-1 -> i of a block (entry, rows + copies issued, first tile resident,
// tiles done, partial written, cluster barrier, merge, exit), cycles at the SM clock.
void PrintPhases(Backend& b, const SelectedAttentionParams& p, const std::string& label) {
  namespace ci = cuda_internal;
  constexpr int kMaxBlocks = 1024, kP = ci::kSelectedPhases;
  const size_t bytes = sizeof(unsigned long long) * 2 * kP * kMaxBlocks;
  auto buf = MustAllocate(b, bytes);
  BENCH_CHECK(cudaMemset(buf->data(), 0, bytes) == cudaSuccess, "stamps");
  cudaStream_t s;
  BENCH_CHECK(cudaStreamCreate(&s) == cudaSuccess, "stream");
  BENCH_CHECK(b.BeginCapture(s).ok(), "capture");
  const absl::Status st = b.SelectedAttention(p, s);
  auto g = b.EndCapture(s);
  BENCH_CHECK(st.ok() && g.ok(), "captured call");
  for (int i = 0; i < 20; ++i) BENCH_CHECK((*g)->Replay(s).ok(), "replay");
  BENCH_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "replay sync");
  auto* stamps = static_cast<unsigned long long*>(buf->data());
  BENCH_CHECK(ci::SetSelectedAttentionPhaseStamps(stamps, kMaxBlocks) == cudaSuccess, "on");
  BENCH_CHECK((*g)->Replay(s).ok(), "replay");
  BENCH_CHECK(cudaStreamSynchronize(s) == cudaSuccess, "stamped replay");
  BENCH_CHECK(ci::SetSelectedAttentionPhaseStamps(nullptr, 0) == cudaSuccess, "off");
  cudaStreamDestroy(s);
  std::vector<unsigned long long> h(2 * kP * kMaxBlocks);
  BENCH_CHECK(cudaMemcpy(h.data(), stamps, bytes, cudaMemcpyDeviceToHost) == cudaSuccess, "copy");
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  const double us_per_cycle = 1e3 / std::max(khz, 1);
  int blocks = 0;
  while (blocks < kMaxBlocks && h[2 * kP * blocks] != 0) ++blocks;
  if (blocks == 0) {
    std::printf("PHASES %s: no stamps (split-K kernel)\n", label.c_str());
    return;
  }
  unsigned long long first = ~0ull, last = 0, last_entry = 0;
  std::printf("PHASES %s blocks=%d sm_clock=%d MHz, phase median/max us:", label.c_str(), blocks,
              khz / 1000);
  for (int ph = 1; ph < kP; ++ph) {
    std::vector<double> d;
    for (int blk = 0; blk < blocks; ++blk) {
      const unsigned long long* r = h.data() + 2 * kP * blk;
      d.push_back(static_cast<double>(r[2 * ph + 1] - r[2 * (ph - 1) + 1]) * us_per_cycle);
    }
    std::sort(d.begin(), d.end());
    std::printf(" %d:%.2f/%.2f", ph, d[d.size() / 2], d.back());
  }
  for (int blk = 0; blk < blocks; ++blk) {
    const unsigned long long* r = h.data() + 2 * kP * blk;
    first = std::min(first, r[0]);
    last_entry = std::max(last_entry, r[0]);
    last = std::max(last, r[2 * (kP - 1)]);
  }
  std::printf(" | span %.2f us, entry skew %.2f us\n", (last - first) * 1e-3,
              (last_entry - first) * 1e-3);
}

void Run(Backend& b, int64_t len, void* flush, size_t flush_bytes) {
  const int64_t pages = (len + kPage - 1) / kPage;
  const int64_t slots = pages * kKvHeads;
  std::mt19937 rng(7);
  // Page table: a random permutation of the slots (pages of a head scattered over the pool).
  std::vector<int32_t> table(slots);
  for (int64_t i = 0; i < slots; ++i) table[i] = static_cast<int32_t>(i);
  if (!g_contiguous) std::shuffle(table.begin(), table.end(), rng);
  auto d_table = MustAllocate(b, slots * 4);
  BENCH_CHECK(b.CopyToDevice(d_table->data(), table.data(), slots * 4, nullptr).ok(), "table");
  // Middle: kMiddlePages random distinct pages of [sinks, window) per head, ascending.
  const int64_t window_begin = len - kWindow;
  const int64_t mp0 = kSinks / kPage, mp1 = window_begin / kPage;
  std::vector<int32_t> parents(kKvHeads * kMiddlePages);
  for (int g = 0; g < kKvHeads; ++g) {
    std::vector<int32_t> all;
    for (int64_t pg = mp0; pg < mp1; ++pg) all.push_back(static_cast<int32_t>(pg));
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + kMiddlePages);
    std::copy(all.begin(), all.begin() + kMiddlePages, parents.begin() + g * kMiddlePages);
  }
  auto d_parents = MustAllocate(b, parents.size() * 4);
  BENCH_CHECK(b.CopyToDevice(d_parents->data(), parents.data(), parents.size() * 4, nullptr).ok(),
              "parents");
  std::vector<float> qh(kQHeads * kHeadDim);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& x : qh) x = u(rng);
  auto d_q = MustAllocate(b, qh.size() * 4);
  BENCH_CHECK(b.CopyToDevice(d_q->data(), qh.data(), qh.size() * 4, nullptr).ok(), "q");
  auto d_out = MustAllocate(b, kQHeads * kHeadDim * 4);
  auto d_lse = MustAllocate(b, kQHeads * 4);

  // Per-slot scales (SelectedAttentionParams::slot_scales) of the fp8s rows: all 1.
  const std::vector<float> ones(static_cast<size_t>(slots) * 2, 1.0f);
  auto d_slot_scales = MustAllocate(b, ones.size() * 4);
  BENCH_CHECK(b.CopyToDevice(d_slot_scales->data(), ones.data(), ones.size() * 4, nullptr).ok(),
              "slot scales");
  // Pools: bf16, fp8, fp8 with per-slot scales ("fp8s").
  for (const std::string pool : {"bf16", "fp8", "fp8s"}) {
    if (!g_pool.empty() && g_pool != pool) continue;
    const DType dt = pool == "bf16" ? DType::kBF16 : DType::kFP8E4M3;
    const size_t pool_bytes = static_cast<size_t>(slots) * kPage * kHeadDim * DTypeSize(dt);
    auto k = MustAllocate(b, pool_bytes);
    auto v = MustAllocate(b, pool_bytes);
    // Constant small values (bf16 0x3c3c ~ 0.0115, fp8 0x3c = 1.5).
    BENCH_CHECK(cudaMemset(k->data(), 0x3c, pool_bytes) == cudaSuccess, "fill");
    BENCH_CHECK(cudaMemset(v->data(), 0x3c, pool_bytes) == cudaSuccess, "fill");
    for (const std::string kind : {"sparse", "sinks", "dense"}) {
      if (!g_only.empty() && g_only != kind) continue;
      const bool sparse = kind == "sparse";
      SelectedAttentionParams p;
      p.q = TensorView(d_q->data(), DType::kF32, {1, kQHeads, kHeadDim});
      p.k_pool = TensorView(k->data(), dt, {slots, kPage, kHeadDim});
      p.v_pool = TensorView(v->data(), dt, {slots, kPage, kHeadDim});
      p.page_table = TensorView(d_table->data(), DType::kI32, {kKvHeads, pages});
      p.scale = 0.0884f;
      if (dt == DType::kFP8E4M3) {
        p.k_scale = 0.01f;
        p.v_scale = 0.02f;
      }
      if (pool == "fp8s") p.slot_scales = static_cast<const float*>(d_slot_scales->data());
      int64_t tokens;
      if (sparse) {
        p.prefix_end = kSinks;
        p.middle.parents = TensorView(d_parents->data(), DType::kI32, {kKvHeads, kMiddlePages});
        p.middle.fanout = kPage;
        p.middle.begin = kSinks;
        p.middle.end = window_begin;
        p.suffix_begin = window_begin;
        p.suffix_end = len;
        tokens = kSinks + kMiddlePages * kPage + kWindow;
      } else if (kind == "sinks") {
        p.prefix_end = kSinks;
        tokens = kSinks;
      } else {
        p.prefix_end = len;
        tokens = len;
      }
      p.out = TensorView(d_out->data(), DType::kF32, {1, kQHeads, kHeadDim});
      p.lse = TensorView(d_lse->data(), DType::kF32, {1, kQHeads});
      const Result r = Time(b, p, flush, flush_bytes);
      if (g_phases) {
        PrintPhases(b, p, std::to_string(len / 1024) + "K " + kind + " " + pool);
      }
      const double mib = static_cast<double>(tokens) * kKvHeads * 2 * kHeadDim * DTypeSize(dt);
      std::printf("| %lldK | %s | %s | %lld | %.1f | %.1f | %.1f | %.2f | %.3f |\n",
                  static_cast<long long>(len / 1024), kind.c_str(),
                  pool == "fp8s" ? "fp8_e4m3+slot_scales" : DTypeName(dt),
                  static_cast<long long>(tokens), r.cold_us, r.b2b_us, r.graph_us,
                  mib / (1 << 20), mib / (r.cold_us * 1e-6) / kHbmBytesPerSecond);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace strata::kernels

int main(int argc, char** argv) {
  std::vector<int64_t> lens;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ncu") {
      strata::kernels::g_ncu = true;
    } else if (a == "--contiguous") {
      strata::kernels::g_contiguous = true;
    } else if (a == "--phases") {
      strata::kernels::g_phases = true;
    } else if (a == "--only" && i + 1 < argc) {
      strata::kernels::g_only = argv[++i];
    } else if (a == "--pool" && i + 1 < argc) {
      strata::kernels::g_pool = argv[++i];
    } else {
      lens.push_back(std::atoll(argv[i]));
    }
  }
  if (lens.empty()) lens = {131072, 1048576};
  auto b = strata::kernels::MakeCudaBackend(0);
  if (!b.ok()) {
    std::fprintf(stderr, "no CUDA backend: %s\n", b.status().ToString().c_str());
    return 1;
  }
  constexpr size_t kFlush = size_t{256} << 20;
  void* flush = nullptr;
  BENCH_CHECK(cudaMalloc(&flush, kFlush) == cudaSuccess, "flush buffer");
  const char* path = std::getenv("STRATA_SELECTED_ATTENTION");
  std::printf("kernel: STRATA_SELECTED_ATTENTION=%s\n", path != nullptr ? path : "(auto)");
  std::printf("| context | selection | pool | tokens/head | cold_us | b2b_us | graph_us | MiB | "
              "frac of 3.35 TB/s (cold) |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t len : lens) strata::kernels::Run(**b, len, flush, kFlush);
  cudaFree(flush);
  return 0;
}
