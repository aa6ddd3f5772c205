// Embedding lookup: out[i, :] = table[ids[i], :] converted to f32.
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;
using cpu_internal::CheckWeightDType;

absl::Status CpuSupportsEmbedding(const EmbeddingParams& p) {
  constexpr const char* kOp = "Embedding";
  STRATA_RETURN_IF_ERROR(CheckRank(p.table, 2, kOp, "table"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 2, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckWeightDType(p.table, kOp, "table"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.out, 1, p.table.dim(1), kOp, "out"));
  if (p.out.dim(0) > 0 && p.ids == nullptr) {
    return absl::InvalidArgumentError("Embedding: ids is null");
  }
  return absl::OkStatus();
}

absl::Status CpuEmbedding(const EmbeddingParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsEmbedding(p));
  const int64_t n = p.out.dim(0), hidden = p.table.dim(1), vocab = p.table.dim(0);
  for (int64_t i = 0; i < n; ++i) {
    if (p.ids[i] < 0 || p.ids[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("Embedding: id ", p.ids[i], " at ", i, " is outside [0, ", vocab, ")"));
    }
  }
  float* out = p.out.As<float>();
#pragma omp parallel for schedule(static) if (n * hidden >= cpu_internal::kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    cpu_internal::LoadF32(p.table, static_cast<int64_t>(p.ids[i]) * hidden, hidden, out + i * hidden);
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
