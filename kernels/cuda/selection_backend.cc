// CudaBackend's device-resident selection ops (declared in kernels/cuda/cuda_backend.h): the CPU
// twin's validation (kernels/cpu/selection.cc), this backend's limits, then the launches of
// kernels/cuda/selection.cu and the selected-attention kernels of kernels/cuda/attention.cu.
// Nothing here reads device memory on the host, so every op can be captured in a CUDA graph.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/cuda_status.h"
#include "kernels/cuda/internal/launch.h"

namespace strata::kernels {
namespace {

using cuda_internal::DeviceCandidates;
using cuda_internal::FloatType;

FloatType PoolType(DType t) {
  return t == DType::kBF16 ? FloatType::kBF16
         : t == DType::kFP8E4M3 ? FloatType::kFP8E4M3
                                : FloatType::kF32;
}

// Valid after CheckCandidateList (ids and counts fit in int32).
DeviceCandidates ToDevice(const CandidateList& c, const int32_t* skip = nullptr) {
  DeviceCandidates d;
  d.skip = skip;
  d.parents = c.parents.data != nullptr ? c.parents.As<const int32_t>() : nullptr;
  d.num_parents = c.parents.data != nullptr ? static_cast<int32_t>(c.parents.dim(1)) : 0;
  d.fanout = c.fanout;
  d.begin = static_cast<int32_t>(c.begin);
  d.end = static_cast<int32_t>(c.end);
  d.count = static_cast<int32_t>(c.Count());
  return d;
}

// log2(v) for a power of two v >= 1, else -1.
int ShiftOf(int64_t v) {
  return v >= 1 && (v & (v - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(v)) : -1;
}

absl::Status CheckGroup(int64_t group, const char* op) {
  if (group > cuda_internal::kSelectMaxGroup) {
    return absl::UnimplementedError(absl::StrCat(op, ": ", group, " query heads per KV head > ",
                                                 cuda_internal::kSelectMaxGroup));
  }
  return absl::OkStatus();
}

absl::Status CheckScoreShape(int64_t num_kv_heads, int64_t group, int64_t head_dim,
                             const char* op) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group, op));
  if (num_kv_heads > 65535) return absl::UnimplementedError(absl::StrCat(op, ": > 65535 KV heads"));
  if (group * head_dim * 4 > 48 * 1024) {
    return absl::UnimplementedError(absl::StrCat(op, ": group * head_dim > 12288"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::ScoreSummaries(const ScoreSummariesParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsScoreSummaries(p));
  const int64_t hkv = p.summaries.dim(0), group = p.q.dim(0) / hkv, d = p.q.dim(1);
  STRATA_RETURN_IF_ERROR(CheckScoreShape(hkv, group, d, "ScoreSummaries"));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchScoreSummaries(
      p.q.As<const float>(), p.summaries.data, PoolType(p.summaries.dtype), static_cast<int>(hkv),
      static_cast<int>(group), static_cast<int>(d), p.summaries.dim(1),
      ToDevice(p.candidates, p.skip_heads),
      p.scale, p.scores.As<float>(), ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::ScoreKeys(const ScoreKeysParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsScoreKeys(p));
  const int64_t hkv = p.page_table.dim(0), group = p.q.dim(0) / hkv, d = p.q.dim(1);
  STRATA_RETURN_IF_ERROR(CheckScoreShape(hkv, group, d, "ScoreKeys"));
  if (p.k_pool.dim(1) > (int64_t{1} << 30) || p.page_table.dim(1) > (int64_t{1} << 30)) {
    return absl::UnimplementedError("ScoreKeys: page size or table beyond 2^30");
  }
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchScoreKeys(
      p.q.As<const float>(), p.k_pool.data, PoolType(p.k_pool.dtype), p.k_pool.dim(0),
      static_cast<int>(p.k_pool.dim(1)), p.page_table.As<const int32_t>(),
      static_cast<int>(p.page_table.dim(1)), static_cast<int>(hkv), static_cast<int>(group),
      static_cast<int>(d), ToDevice(p.candidates, p.skip_heads), p.scale, p.scores.As<float>(),
      ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::VoteTopK(const VoteTopKParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsVoteTopK(p));
  const int64_t hkv = p.scores.dim(0), group = p.scores.dim(1);
  STRATA_RETURN_IF_ERROR(CheckGroup(group, "VoteTopK"));
  if (hkv > 65535) return absl::UnimplementedError("VoteTopK: > 65535 KV heads");
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const cudaStream_t stream = ToCuda(s);
  const DeviceCandidates c = ToDevice(p.candidates, p.skip_heads);
  if (p.partitions > 1) {
    if (group > 4) {
      return absl::UnimplementedError("VoteTopK: partitions with more than 4 query heads per KV head");
    }
    const cudaError_t e = cuda_internal::LaunchPartVoteTopK(
        p.scores.As<const float>(), static_cast<int>(hkv), static_cast<int>(group), c,
        static_cast<int>(p.k), p.partitions,
        p.vote.data != nullptr ? p.vote.As<float>() : nullptr, p.selected.As<int32_t>(), stream);
    if (e == cudaErrorInvalidValue) {
      return absl::UnimplementedError("VoteTopK: more than 4096 candidates in a part");
    }
    STRATA_CUDA_RETURN_IF_ERROR(e);
    return absl::OkStatus();
  }
  const int64_t scratch_bytes = cuda_internal::VoteTopKScratchBytes(static_cast<int>(hkv), c.count);
  void* scratch = nullptr;
  if (scratch_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(scratch, AllocScratch(scratch_bytes, stream));
  }
  const cudaError_t e = cuda_internal::LaunchVoteTopK(
      p.scores.As<const float>(), static_cast<int>(hkv), static_cast<int>(group), c,
      static_cast<int>(p.k), p.vote.data != nullptr ? p.vote.As<float>() : nullptr,
      p.selected.As<int32_t>(), scratch, stream);
  if (scratch != nullptr) STRATA_RETURN_IF_ERROR(FreeScratch(scratch, stream));
  STRATA_CUDA_RETURN_IF_ERROR(e);
  return absl::OkStatus();
}

absl::Status CudaBackend::SelectedAttention(const SelectedAttentionParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsSelectedAttention(p));
  // CpuSupportsSelectedAttention refuses slot_scales with f32|bf16 pools (InvalidArgument).
  const int64_t hkv = p.page_table.dim(0), hq = p.q.dim(1), d = p.q.dim(2);
  if (!cuda_internal::SelectedAttentionSupports(static_cast<int>(hq), static_cast<int>(hkv),
                                                static_cast<int>(d))) {
    return absl::UnimplementedError(absl::StrCat(
        "SelectedAttention: needs head_dim 64/128/256 and at most ",
        cuda_internal::kDecodeMaxGroup, " query heads per KV head (got ", d, ", ", hq / hkv, ")"));
  }
  if (reinterpret_cast<uintptr_t>(p.q.data) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.k_pool.data) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.v_pool.data) % 16 != 0) {
    return absl::UnimplementedError("SelectedAttention: q and pools must be 16-byte aligned");
  }
  const int64_t total = p.prefix_end + p.middle.Count() + (p.suffix_end - p.suffix_begin);
  if (total > (int64_t{1} << 30) || p.k_pool.dim(1) > (int64_t{1} << 30) ||
      p.page_table.dim(1) > (int64_t{1} << 30)) {
    return absl::UnimplementedError("SelectedAttention: more than 2^30 tokens per head");
  }
  if (hq == 0) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const cudaStream_t stream = ToCuda(s);

  cuda_internal::SelectedAttentionShape shape;
  shape.num_q_heads = static_cast<int>(hq);
  shape.num_kv_heads = static_cast<int>(hkv);
  shape.head_dim = static_cast<int>(d);
  shape.num_slots = p.k_pool.dim(0);
  shape.page_size = static_cast<int>(p.k_pool.dim(1));
  shape.table_pages = static_cast<int>(p.page_table.dim(1));
  shape.prefix_end = static_cast<int32_t>(p.prefix_end);
  shape.suffix_begin = static_cast<int32_t>(p.suffix_begin);
  shape.suffix_len = static_cast<int32_t>(p.suffix_end - p.suffix_begin);
  shape.total = static_cast<int32_t>(total);
  shape.scale = p.scale * p.k_scale;  // k_scale, v_scale: 1 unless the pools are fp8
  shape.v_scale = p.v_scale;
  shape.slot_scales = p.slot_scales;  // fp8 pools only (checked above); per row on the device
  // Split-K: about decode_items_per_sm_ items per SM over all KV heads (for the tensor-core
  // kernel kDecodeMmaItemsPerSm unless SetDecodeItemsPerSm chose), but at least one full tile of
  // keys per item (a block's round trips to memory are the same for 16 or 128 keys, and fewer
  // items make the merge cheaper).
  const int items_per_sm =
      decode_items_per_sm_ > 0 ? decode_items_per_sm_
      : cuda_internal::SelectedDecodeMmaSupports(shape, PoolType(p.k_pool.dtype))
          ? cuda_internal::kDecodeMmaItemsPerSm
          : cuda_internal::kDecodeItemsPerSm;
  const int64_t target_per_head =
      std::max<int64_t>(1, (static_cast<int64_t>(num_sms_) * items_per_sm + hkv - 1) / hkv);
  const int64_t chunk = std::max<int64_t>(cuda_internal::kDecodeTile,
                                          (total + target_per_head - 1) / target_per_head);
  shape.chunk = static_cast<int32_t>(chunk);
  shape.items_per_head = static_cast<int32_t>(std::max<int64_t>(1, (total + chunk - 1) / chunk));

  // The split-K kernel's partials; the cluster kernel (short lists) needs none.
  const int64_t scratch_bytes = cuda_internal::SelectedAttentionScratchFloats(shape) * 4;
  void* scratch = nullptr;
  if (scratch_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(scratch, AllocScratch(scratch_bytes, stream));
  }
  const cudaError_t e = cuda_internal::LaunchSelectedAttention(
      p.q.As<const float>(), p.k_pool.data, p.v_pool.data, PoolType(p.k_pool.dtype),
      p.page_table.As<const int32_t>(), ToDevice(p.middle), shape, p.prefix_len,
      static_cast<float*>(scratch),
      p.out.As<float>(), p.lse.As<float>(), stream);
  if (scratch != nullptr) STRATA_RETURN_IF_ERROR(FreeScratch(scratch, stream));
  STRATA_CUDA_RETURN_IF_ERROR(e);
  return absl::OkStatus();
}

absl::Status CudaBackend::SelectionCacheCheck(const SelectionCacheCheckParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsSelectionCacheCheck(p));
  const int64_t hkv = p.cached_q.dim(0), n = p.cached_q.dim(1);
  if (hkv > 0x7fffffff || n > 0x7fffffff) {
    return absl::UnimplementedError("SelectionCacheCheck: more than 2^31 heads or elements");
  }
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchSelectionCacheCheck(
      p.q.As<const float>(), p.cached_q.As<float>(), p.valid.As<int32_t>(), p.reuse.As<int32_t>(),
      p.hit_count, static_cast<int>(hkv), static_cast<int>(n), p.theta, ToCuda(s)));
  return absl::OkStatus();
}

namespace {

// Whether SelectStagesKernel can run p.attend after the stages (kernels/cuda/internal/launch.h
// DeviceSelectAttend: bf16 pools, or fp8 ones where no key stage reads bf16 (the kernel reads one
// format), head_dim 128, the stages' group, the middle the last stage's
// selection by a power-of-two fanout, no prefix_len or slot_scales, each block's share of the
// positions within its staging area); if so fills *d. Called by SelectStages once the stages
// take the kernel and p.attend passed CpuSupportsSelectedAttention, which between them guarantee
// what is not checked again here:
//  - CpuSupportsSelectedAttention: v_pool has k_pool's dtype and shape;
//    slot_scales is null with bf16 pools; 0 <= prefix_end <= 2^30; 0 <= suffix_begin <=
//    suffix_end < 2^31 and suffix_end - suffix_begin <= 2^30; 0 <= middle.begin <= middle.end
//    < 2^31; middle.parents, when set, an i32 [page_table.dim(0), *] view.
//  - SelectStages' kernel conditions: p.q.data 16-byte aligned (a.q.data is p.q.data).
// LaunchSelectStages repeats some of the conditions below, but as errors (cudaErrorInvalidValue)
// where this falls back to the separate op, so they stay here.
// bf16_keys / fp8_keys: whether a key stage reads a bf16 / an fp8 pool.
// partitioned: for LaunchPartStages, which checks its own limits (PartStagesFits) instead of
// SelectStagesKernel's (the middle's count and the shares of its cluster's blocks).
bool SelectAttendInKernel(const SelectStagesParams& p, bool bf16_keys, bool fp8_keys,
                          int64_t hkv, int64_t group, cuda_internal::DeviceSelectAttend* d,
                          bool partitioned = false) {
  const SelectedAttentionParams& a = *p.attend;
  const SelectStage& last = p.stages[p.num_stages - 1];
  const int fanout_shift = ShiftOf(a.middle.fanout);
  const bool fp8 = a.k_pool.dtype == DType::kFP8E4M3;
  if (fp8 ? bf16_keys : fp8_keys) return false;  // the kernel reads one pool format
  // The kernel attends with the stages' split query: the same q and scale.
  if (a.q.data != p.q.data || a.scale * a.k_scale != p.scale ||
      (a.k_pool.dtype != DType::kBF16 && !fp8) || a.slot_scales != nullptr ||
      a.q.dim(2) != 128 || a.q.dim(1) != hkv * group || a.page_table.dim(0) != hkv ||
      a.prefix_len != nullptr || a.middle.parents.data == nullptr ||
      a.middle.parents.data != last.selected.data || a.middle.parents.dim(1) != last.k ||
      fanout_shift < 0 || (!partitioned && last.k > cuda_internal::kSelectStagesMaxParents) ||
      a.k_pool.dim(0) * a.k_pool.dim(1) > (int64_t{1} << 40) ||
      a.page_table.dim(1) > (int64_t{1} << 30) || a.suffix_begin > (int64_t{1} << 30) ||
      a.middle.end > (int64_t{1} << 30) || reinterpret_cast<uintptr_t>(a.k_pool.data) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.v_pool.data) % 16 != 0) {
    return false;
  }
  const int64_t fixed = a.prefix_end + (a.suffix_end - a.suffix_begin);
  if (!partitioned &&
      !cuda_internal::SelectStagesCanAttend(static_cast<int>(hkv), fixed, a.middle.Count())) {
    return false;
  }
  d->k_pool = a.k_pool.data;
  d->v_pool = a.v_pool.data;
  d->table = a.page_table.As<const int32_t>();
  d->table_pages = static_cast<int>(a.page_table.dim(1));
  d->page_size = static_cast<int>(a.k_pool.dim(1));
  d->num_slots = a.k_pool.dim(0);
  d->prefix_end = static_cast<int32_t>(a.prefix_end);
  d->suffix_begin = static_cast<int32_t>(a.suffix_begin);
  d->suffix_len = static_cast<int32_t>(a.suffix_end - a.suffix_begin);
  d->fanout_shift = fanout_shift;
  d->middle = ToDevice(a.middle);
  d->v_scale = a.v_scale;
  d->fp8 = fp8 ? 1 : 0;
  d->out = a.out.As<float>();
  d->lse = a.lse.As<float>();
  const char* e = std::getenv("STRATA_SELECT_ATTEND_FIXED");
  d->fixed_early = e != nullptr && std::string_view(e) == "late" ? 0 : 1;
  return true;
}

// The ops one by one where a fused kernel does not run the shape, unless
// STRATA_SELECT_STAGES=require_fused (read at every call: tests that must run `kernel`), which
// fails instead.
absl::Status OpByOpUnlessRequired(Backend& b, const SelectStagesParams& p, Stream s,
                                  const char* kernel) {
  const char* env = std::getenv("STRATA_SELECT_STAGES");
  if (env != nullptr && std::string_view(env) == "require_fused") {
    return absl::FailedPreconditionError(absl::StrCat(
        "SelectStages: STRATA_SELECT_STAGES=require_fused and the shape is not one the ", kernel,
        " runs"));
  }
  return SelectStagesOpByOp(b, p, s);  // checks the attention's params first
}

// Whether a fused selection kernel attends too: where it can (`fits`), unless
// STRATA_SELECT_ATTEND=separate (read at every call: A/B timing and tests) runs the attention as
// its own op; =require_fused fails instead of doing so.
absl::StatusOr<bool> AttendFused(bool fits, const char* kernel) {
  const char* ae = std::getenv("STRATA_SELECT_ATTEND");
  const std::string_view mode = ae == nullptr ? "" : ae;
  const bool fused = mode != "separate" && fits;
  if (!fused && mode == "require_fused") {
    return absl::FailedPreconditionError(absl::StrCat(
        "SelectStages: STRATA_SELECT_ATTEND=require_fused and the attention is not one the ",
        kernel, " runs"));
  }
  return fused;
}

// The selection cache's check as the selection kernels take it (cuda_internal::DeviceCacheCheck).
cuda_internal::DeviceCacheCheck DeviceCheckOf(const SelectionCacheCheckParams& cc) {
  cuda_internal::DeviceCacheCheck d;
  d.q = cc.q.As<const float>();
  d.cached = cc.cached_q.As<float>();
  d.valid = cc.valid.As<int32_t>();
  d.reuse = cc.reuse.As<int32_t>();
  d.hits = reinterpret_cast<unsigned long long*>(cc.hit_count);
  d.theta = cc.theta;
  return d;
}

}  // namespace

// SelectStages with partitions > 1 (called by SelectStages once every stage passed its checks;
// d holds the stages, `fused` whether their shape suits a kernel at all): one PartStagesKernel
// (kernels/cuda/internal/launch.h LaunchPartStages) where the chain fits it, the attention in it
// where that fits too, else after it as its own op; otherwise op by op (VoteTopK in parts:
// PartVoteTopKKernel). STRATA_SELECT_STAGES=opbyop / require_fused as for SelectStages.
absl::Status CudaBackend::SelectStagesInParts(const SelectStagesParams& p,
                                              const cuda_internal::DeviceSelectStages& d,
                                              bool fused, int64_t hkv, int64_t group,
                                              bool bf16_keys, bool fp8_keys, Stream s) {
  const int parts = p.partitions;
  fused = fused &&
          cuda_internal::PartStagesFits(static_cast<int>(hkv), static_cast<int>(group), parts, d,
                                        nullptr);
  if (!fused) return OpByOpUnlessRequired(*this, p, s, "partitioned kernel");
  if (p.attend != nullptr) STRATA_RETURN_IF_ERROR(CpuSupportsSelectedAttention(*p.attend));
  cuda_internal::DeviceSelectAttend da;
  bool attend_fused = false;
  if (p.attend != nullptr) {
    // The attention in the kernel merges its parts through global memory: by each KV head's
    // last block with p.arrivals, else by a second kernel.
    const bool fits =
        SelectAttendInKernel(p, bf16_keys, fp8_keys, hkv, group, &da, true) &&
        cuda_internal::PartStagesFits(static_cast<int>(hkv), static_cast<int>(group), parts, d,
                                      &da);
    STRATA_ASSIGN_OR_RETURN(attend_fused, AttendFused(fits, "partitioned kernel"));
  }
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  // The selection cache's check (p.cache_check): in the kernel where it attends with arrival
  // counters, else as its own op now, its flags the skip flags.
  const int32_t* skip = p.skip_heads;
  if (p.cache_check != nullptr) {
    const SelectionCacheCheckParams& cc = *p.cache_check;
    if (attend_fused && p.arrivals.data != nullptr) {
      da.check = DeviceCheckOf(cc);
    } else {
      STRATA_RETURN_IF_ERROR(SelectionCacheCheck(cc, s));
      skip = cc.reuse.As<const int32_t>();
    }
  }
  void* partials = nullptr;  // the parts' partials
  if (attend_fused) {
    STRATA_ASSIGN_OR_RETURN(
        partials, AllocScratch(cuda_internal::PartMergeScratchFloats(static_cast<int>(hkv), parts) *
                                   sizeof(float),
                               ToCuda(s)));
    da.merge_partials = static_cast<float*>(partials);
    // With the caller's arrival counters the kernel's last blocks merge (no second kernel).
    da.merge_arrivals = static_cast<uint32_t*>(p.arrivals.data);
  }
  const cudaError_t launched = cuda_internal::LaunchPartStages(
      p.q.As<const float>(), p.scale, static_cast<int>(hkv), static_cast<int>(group), parts, d,
      skip, attend_fused ? &da : nullptr, ToCuda(s));
  if (partials != nullptr) STRATA_RETURN_IF_ERROR(FreeScratch(partials, ToCuda(s)));
  STRATA_CUDA_RETURN_IF_ERROR(launched);
  if (p.attend != nullptr && !attend_fused) return SelectedAttention(*p.attend, s);
  return absl::OkStatus();
}

// SelectStages runs as one kernel (cuda_internal::LaunchSelectStages) unless
// STRATA_SELECT_STAGES=opbyop (read at every call: A/B timing and tests) or the shape is not one it
// runs; then as the ops it stands for (STRATA_SELECT_STAGES=require_fused: FailedPrecondition
// instead, for tests that must run the kernel). Either way every stage's checks and the
// attention's CpuSupportsSelectedAttention come first, so a call they refuse writes nothing.
absl::Status CudaBackend::SelectStages(const SelectStagesParams& p, Stream s) {
  // The selection cache's check: each path below decides where it runs. In parts,
  // SelectStagesInParts runs it inside the partitioned kernel where that kernel attends and
  // counts arrivals, else as its own op before it; in one part LaunchSelectStages runs it inside
  // the cluster kernel for the forms that have an instance with it, else its kernel first; where
  // the shape falls back to the ops one by one, SelectStagesOpByOp runs it as its own op first.
  // STRATA_SELECT_CHECK_IN_KERNEL=0: always as its own op first (SelectionCacheCheckKernel),
  // then this op with its flags as skip_heads.
  if (p.cache_check != nullptr) {
    const char* env = std::getenv("STRATA_SELECT_CHECK_IN_KERNEL");
    if (env != nullptr && std::string_view(env) == "0") {
      return SelectStagesAfterCacheCheck(*this, p, s);
    }
    STRATA_RETURN_IF_ERROR(CpuSupportsSelectionCacheCheck(*p.cache_check));
  }
  STRATA_RETURN_IF_ERROR(CheckSelectStagesChain(p));
  // Each stage's own checks, as the op-by-op calls make them (the same errors either way).
  STRATA_RETURN_IF_ERROR(CheckSelectStagesOps(p));
  const char* env = std::getenv("STRATA_SELECT_STAGES");
  bool fused = env == nullptr || std::string_view(env) != "opbyop";
  const SelectStage& first = p.stages[0];
  const int64_t hkv = first.summaries.data != nullptr ? first.summaries.dim(0)
                                                      : first.page_table.dim(0);
  cuda_internal::DeviceSelectStages d;
  d.num_stages = p.num_stages;
  bool bf16_keys = false, fp8_keys = false;  // a key stage reads a bf16 / an fp8 pool
  for (int i = 0; i < p.num_stages; ++i) {
    const SelectStage& st = p.stages[i];
    cuda_internal::DeviceSelectStage& ds = d.stage[i];
    int64_t stage_hkv = 0;
    if (st.summaries.data != nullptr) {
      stage_hkv = st.summaries.dim(0);
      fused = fused && st.summaries.dtype == DType::kBF16;
      ds.kind = cuda_internal::SelectStageKind::kSummariesBF16;
      ds.rows = st.summaries.data;
      ds.num_items = st.summaries.dim(1);
    } else {
      stage_hkv = st.page_table.dim(0);
      const int page_shift = ShiftOf(st.k_pool.dim(1));
      const int fanout_shift = st.candidates.parents.data == nullptr
                                   ? 0
                                   : ShiftOf(st.candidates.fanout);
      const bool fp8 = st.k_pool.dtype == DType::kFP8E4M3;
      fused = fused && (st.k_pool.dtype == DType::kBF16 || fp8) && page_shift >= 0 &&
              fanout_shift >= 0 && st.page_table.dim(1) <= (int64_t{1} << 30);
      ds.kind = fp8 ? cuda_internal::SelectStageKind::kKeysFP8
                    : cuda_internal::SelectStageKind::kKeysBF16;
      fp8_keys = fp8_keys || fp8;
      bf16_keys = bf16_keys || st.k_pool.dtype == DType::kBF16;
      ds.rows = st.k_pool.data;
      ds.num_items = st.k_pool.dim(0);
      ds.table = st.page_table.As<const int32_t>();
      ds.table_pages = static_cast<int>(std::min<int64_t>(st.page_table.dim(1), 1 << 30));
      ds.page_shift = page_shift;
      ds.fanout_shift = fanout_shift;
    }
    fused = fused && stage_hkv == hkv &&
            reinterpret_cast<uintptr_t>(ds.rows) % 16 == 0 && st.k <= (int64_t{1} << 30);
    ds.c = ToDevice(st.candidates);
    ds.k = static_cast<int>(std::min<int64_t>(st.k, int64_t{1} << 30));
    ds.selected = st.selected.As<int32_t>();
  }
  // The kernel reads one key format (launch.h): key stages over bf16 and fp8 pools run op by op.
  fused = fused && !(bf16_keys && fp8_keys);
  const int64_t group = hkv > 0 ? p.q.dim(0) / hkv : 0;
  fused = fused && hkv >= 1 && hkv <= 65535 && group >= 1 && group <= 4 && p.q.dim(1) == 128 &&
          reinterpret_cast<uintptr_t>(p.q.data) % 16 == 0;
  if (p.partitions > 1) return SelectStagesInParts(p, d, fused, hkv, group, bf16_keys, fp8_keys, s);
  if (fused) {
    STRATA_RETURN_IF_ERROR(MakeCurrent());
    const int64_t max_count = cuda_internal::SelectStagesMaxCandidates(static_cast<int>(hkv));
    for (int i = 0; i < p.num_stages; ++i) {
      fused = fused && d.stage[i].c.count <= max_count &&
              (i + 1 == p.num_stages || d.stage[i].k <= cuda_internal::kSelectStagesMaxParents);
    }
  }
  if (!fused) return OpByOpUnlessRequired(*this, p, s, "fused kernel");
  // The attention's params before the kernel runs, as SelectStagesOpByOp checks them: a refused
  // attention writes nothing (this backend's own limits of the separate op are checked where it
  // runs).
  if (p.attend != nullptr) STRATA_RETURN_IF_ERROR(CpuSupportsSelectedAttention(*p.attend));
  // The attention in the same kernel where it can run there (SelectAttendInKernel), else after it
  // as its own op (AttendFused: STRATA_SELECT_ATTEND).
  cuda_internal::DeviceSelectAttend da;
  bool attend_fused = false;
  if (p.attend != nullptr) {
    STRATA_ASSIGN_OR_RETURN(
        attend_fused,
        AttendFused(SelectAttendInKernel(p, bf16_keys, fp8_keys, hkv, group, &da),
                    "selection kernel"));
  }
  cuda_internal::DeviceCacheCheck check;
  if (p.cache_check != nullptr) check = DeviceCheckOf(*p.cache_check);
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchSelectStages(
      p.q.As<const float>(), p.scale, static_cast<int>(hkv), static_cast<int>(group), d,
      p.skip_heads, attend_fused ? &da : nullptr, ToCuda(s),
      p.cache_check != nullptr ? &check : nullptr));
  if (p.attend != nullptr && !attend_fused) return SelectedAttention(*p.attend, s);
  return absl::OkStatus();
}

absl::Status CudaBackend::UpdateSummaries(const UpdateSummariesParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsUpdateSummaries(p));
  if (p.first == p.end) return absl::OkStatus();
  if (p.page_table.dim(0) > 65535 || p.k_pool.dim(1) > (int64_t{1} << 30) ||
      p.page_table.dim(1) > (int64_t{1} << 30)) {
    return absl::UnimplementedError("UpdateSummaries: > 65535 KV heads or 2^30 pages");
  }
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const int64_t page = p.k_pool.dim(1);
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchUpdateSummaries(
      p.k_pool.data, PoolType(p.k_pool.dtype), p.k_pool.dim(0), static_cast<int>(page),
      static_cast<int>(p.k_pool.dim(2)), p.page_table.As<const int32_t>(),
      static_cast<int>(p.page_table.dim(1)), static_cast<int>(p.page_table.dim(0)), p.end,
      p.first / page, (p.end + page - 1) / page, p.pages.data, PoolType(p.pages.dtype),
      p.pages.dim(1), p.segments.data,
      p.segments.data != nullptr ? p.segments.dim(1) : 0, p.segment_pages, ToCuda(s)));
  return absl::OkStatus();
}

}  // namespace strata::kernels
