// Elementwise addition of two f32 tensors of the same shape.
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

absl::Status CpuSupportsAdd(const AddParams& p) {
  constexpr const char* kOp = "Add";
  if (p.a.rank < 1) return absl::InvalidArgumentError("Add: a must have rank >= 1");
  STRATA_RETURN_IF_ERROR(CheckRank(p.a, p.a.rank, kOp, "a"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.b, p.a.rank, kOp, "b"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, p.a.rank, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.a, DType::kF32, kOp, "a"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.b, DType::kF32, kOp, "b"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  if (!std::isfinite(p.a_scale) || !std::isfinite(p.b_scale)) {
    return absl::InvalidArgumentError("Add: scales must be finite");
  }
  for (int i = 0; i < p.a.rank; ++i) {
    if (p.b.shape[i] != p.a.shape[i] || p.out.shape[i] != p.a.shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat("Add: shapes differ: ", p.a.DebugString(),
                                                     " ", p.b.DebugString(), " ",
                                                     p.out.DebugString()));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuAdd(const AddParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsAdd(p));
  const int64_t n = p.a.NumElements();
  const float* a = p.a.As<const float>();
  const float* b = p.b.As<const float>();
  float* o = p.out.As<float>();
  if (p.a_scale == 1.0f && p.b_scale == 1.0f) {
#pragma omp parallel for schedule(static) if (n >= cpu_internal::kParallelMinWork)
    for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
    return absl::OkStatus();
  }
  const float sa = p.a_scale, sb = p.b_scale;
#pragma omp parallel for schedule(static) if (n >= cpu_internal::kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) o[i] = std::fma(sa, a[i], sb * b[i]);
  return absl::OkStatus();
}

}  // namespace strata::kernels
