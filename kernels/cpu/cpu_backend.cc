// CpuBackend: host memory, copies, and forwarding of every op to its kernels/cpu/<op>.cc function.
#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "base/cpu_limit.h"
#include "base/status_macros.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

CpuBuffer::CpuBuffer(size_t bytes) : bytes_(bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  data_ = rounded == 0 ? nullptr : std::aligned_alloc(64, rounded);
}

CpuBuffer::~CpuBuffer() { std::free(data_); }

CpuBackend::CpuBackend(int num_threads) : num_threads_(num_threads) {}

void CpuBackend::ApplyThreads(int64_t work) const {
  // Small ops run on the calling thread (a team of one): waking OpenMP workers costs more than
  // it saves, and their spin-waiting slows everything down on a loaded machine.
  const int n = work < cpu_internal::kParallelMinWork ? 1
                : num_threads_ > 0                   ? num_threads_
                                                     : UsableCores();
  if (omp_get_max_threads() != n) omp_set_num_threads(n);
  // OpenBLAS runs single-threaded inside OpenMP regions (matmul.cc).
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

absl::StatusOr<std::unique_ptr<Buffer>> CpuBackend::Allocate(size_t bytes) {
  auto buffer = std::make_unique<CpuBuffer>(bytes);
  if (bytes > 0 && buffer->data() == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
  }
  return std::unique_ptr<Buffer>(std::move(buffer));
}

absl::Status CpuBackend::CopyToDevice(void* dst, const void* src, size_t bytes, Stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("CopyToDevice: null");
  std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(void* dst, const void* src, size_t bytes, Stream) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("CopyToHost: null");
  std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Synchronize(Stream) { return absl::OkStatus(); }

absl::StatusOr<std::unique_ptr<Buffer>> CpuBackend::AllocateHost(size_t bytes) {
  return Allocate(bytes);
}

absl::Status CpuBackend::Supports(const EmbeddingParams& p) const { return CpuSupportsEmbedding(p); }
absl::Status CpuBackend::Embedding(const EmbeddingParams& p, Stream) {
  ApplyThreads(p.out.NumElements());
  return CpuEmbedding(p);
}
absl::Status CpuBackend::Supports(const RmsNormParams& p) const { return CpuSupportsRmsNorm(p); }
absl::Status CpuBackend::RmsNorm(const RmsNormParams& p, Stream) {
  ApplyThreads(p.in.NumElements());
  return CpuRmsNorm(p);
}
absl::Status CpuBackend::Supports(const MatMulParams& p) const { return CpuSupportsMatMul(p); }
absl::Status CpuBackend::MatMul(const MatMulParams& p, Stream) {
  ApplyThreads(p.in.dim(0) * p.weight.NumElements());
  return CpuMatMul(p);
}
absl::Status CpuBackend::Supports(const RopeParams& p) const { return CpuSupportsRope(p); }
absl::Status CpuBackend::Rope(const RopeParams& p, Stream) {
  ApplyThreads(p.x.NumElements());
  return CpuRope(p);
}
absl::Status CpuBackend::Supports(const SwiGluParams& p) const { return CpuSupportsSwiGlu(p); }
absl::Status CpuBackend::SwiGlu(const SwiGluParams& p, Stream) {
  ApplyThreads(p.gate.NumElements());
  return CpuSwiGlu(p);
}
absl::Status CpuBackend::Supports(const AddParams& p) const { return CpuSupportsAdd(p); }
absl::Status CpuBackend::Add(const AddParams& p, Stream) {
  ApplyThreads(p.a.NumElements());
  return CpuAdd(p);
}

// Shape/dtype checks for the attention ops (the ops themselves live in attention.cc and check
// their params again, including span contents).
absl::Status CpuBackend::Supports(const PagedAttentionParams& p) const {
  constexpr const char* kOp = "PagedAttention";
  STRATA_RETURN_IF_ERROR(CheckRank(p.q, 3, kOp, "q"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.k_pool, 3, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.v_pool, 3, kOp, "v_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 3, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.lse, 2, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.q, DType::kF32, kOp, "q"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.lse, DType::kF32, kOp, "lse"));
  if (p.k_pool.dtype != DType::kF32 && p.k_pool.dtype != DType::kBF16 &&
      p.k_pool.dtype != DType::kFP8E4M3) {
    return absl::UnimplementedError(
        absl::StrCat("PagedAttention: pool dtype ", DTypeName(p.k_pool.dtype), " unsupported"));
  }
  STRATA_RETURN_IF_ERROR(CheckDType(p.v_pool, p.k_pool.dtype, kOp, "v_pool"));
  for (int i = 0; i < 3; ++i) {
    STRATA_RETURN_IF_ERROR(CheckDim(p.v_pool, i, p.k_pool.dim(i), kOp, "v_pool"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.out, i, p.q.dim(i), kOp, "out"));
  }
  STRATA_RETURN_IF_ERROR(CheckDim(p.k_pool, 2, p.q.dim(2), kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.lse, 0, p.q.dim(0), kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.lse, 1, p.q.dim(1), kOp, "lse"));
  if (p.num_kv_heads <= 0 || p.q.dim(1) % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttention: num_kv_heads ", p.num_kv_heads,
                                                   " must divide num_q_heads ", p.q.dim(1)));
  }
  if (p.span_offsets == nullptr) {
    return absl::InvalidArgumentError("PagedAttention: span_offsets is null");
  }
  if (p.q.dim(0) > 0 && p.q_positions == nullptr) {
    return absl::InvalidArgumentError("PagedAttention: q_positions is null");
  }
  if (!std::isfinite(p.scale)) {
    return absl::InvalidArgumentError("PagedAttention: scale must be finite");
  }
  return absl::OkStatus();
}
absl::Status CpuBackend::PagedAttention(const PagedAttentionParams& p, Stream) {
  // Work: query rows x attended keys x head_dim.
  int64_t keys = 0;
  if (p.span_offsets != nullptr && p.spans != nullptr && p.num_kv_heads > 0) {
    for (int32_t i = p.span_offsets[0]; i < p.span_offsets[p.num_kv_heads]; ++i) {
      keys += p.spans[i].length;
    }
  }
  const int64_t group = p.num_kv_heads > 0 ? p.q.dim(1) / p.num_kv_heads : 1;
  ApplyThreads(p.q.dim(0) * group * keys * p.q.dim(2));
  return CpuPagedAttention(p);
}

absl::Status CpuBackend::Supports(const MergeAttentionParams& p) const {
  constexpr const char* kOp = "MergeAttention";
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 3, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.lse, 2, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.lse, DType::kF32, kOp, "lse"));
  if (p.num_parts < 1 || p.outs == nullptr || p.lses == nullptr) {
    return absl::InvalidArgumentError("MergeAttention: needs at least one part");
  }
  for (int s = 0; s < p.num_parts; ++s) {
    STRATA_RETURN_IF_ERROR(CheckRank(p.outs[s], 3, kOp, "outs[s]"));
    STRATA_RETURN_IF_ERROR(CheckRank(p.lses[s], 2, kOp, "lses[s]"));
    STRATA_RETURN_IF_ERROR(CheckDType(p.outs[s], DType::kF32, kOp, "outs[s]"));
    STRATA_RETURN_IF_ERROR(CheckDType(p.lses[s], DType::kF32, kOp, "lses[s]"));
    for (int i = 0; i < 3; ++i) {
      STRATA_RETURN_IF_ERROR(CheckDim(p.outs[s], i, p.out.dim(i), kOp, "outs[s]"));
    }
    for (int i = 0; i < 2; ++i) {
      STRATA_RETURN_IF_ERROR(CheckDim(p.lses[s], i, p.out.dim(i), kOp, "lses[s]"));
    }
  }
  STRATA_RETURN_IF_ERROR(CheckDim(p.lse, 0, p.out.dim(0), kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.lse, 1, p.out.dim(1), kOp, "lse"));
  return absl::OkStatus();
}
absl::Status CpuBackend::MergeAttention(const MergeAttentionParams& p, Stream) {
  ApplyThreads(static_cast<int64_t>(p.num_parts) * p.out.NumElements());
  return CpuMergeAttention(p);
}

absl::Status CpuBackend::Supports(const PageCopyParams& p) const { return CpuSupportsPageCopy(p); }
absl::Status CpuBackend::PageCopy(const PageCopyParams& p, Stream) { return CpuPageCopy(p); }
absl::Status CpuBackend::ResolvePages(const ResolvePagesParams& p, Stream) {
  return CpuResolvePages(p);
}
absl::Status CpuBackend::AppendKv(const AppendKvParams& p, Stream) { return CpuAppendKv(p); }
absl::Status CpuBackend::EncodeFp8Pages(const EncodeFp8PagesParams& p, Stream) { return CpuEncodeFp8Pages(p); }

// Device-resident selection (kernels/cpu/selection.cc): run on the calling thread, except
// SelectedAttention (KV heads in parallel when the work is large enough).
absl::Status CpuBackend::ScoreSummaries(const ScoreSummariesParams& p, Stream) {
  return CpuScoreSummaries(p);
}
absl::Status CpuBackend::ScoreKeys(const ScoreKeysParams& p, Stream) { return CpuScoreKeys(p); }
absl::Status CpuBackend::VoteTopK(const VoteTopKParams& p, Stream) { return CpuVoteTopK(p); }
absl::Status CpuBackend::SelectedAttention(const SelectedAttentionParams& p, Stream) {
  // Work: query heads x attended tokens (at most) x head_dim; KV heads run in parallel.
  if (p.q.rank == 3) {
    const int64_t tokens = std::max<int64_t>(0, p.prefix_end) + p.middle.Count() +
                           std::max<int64_t>(0, p.suffix_end - p.suffix_begin);
    ApplyThreads(p.q.dim(1) * tokens * p.q.dim(2));
  }
  return CpuSelectedAttention(p);
}
absl::Status CpuBackend::UpdateSummaries(const UpdateSummariesParams& p, Stream) {
  return CpuUpdateSummaries(p);
}
absl::Status CpuBackend::SelectionCacheCheck(const SelectionCacheCheckParams& p, Stream) {
  return CpuSelectionCacheCheck(p);
}

// Token sampling (kernels/cpu/sampling.cc): on the calling thread.
absl::Status CpuBackend::Supports(const SampleParams& p) const { return CpuSupportsSample(p); }
absl::Status CpuBackend::Sample(const SampleParams& p, Stream) { return CpuSample(p); }

std::unique_ptr<Backend> MakeCpuBackend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace strata::kernels
