// SwiGLU: out = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
#include <cmath>

#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

absl::Status CpuSupportsSwiGlu(const SwiGluParams& p) {
  constexpr const char* kOp = "SwiGlu";
  STRATA_RETURN_IF_ERROR(CheckRank(p.gate, 2, kOp, "gate"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.up, 2, kOp, "up"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 2, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.gate, DType::kF32, kOp, "gate"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.up, DType::kF32, kOp, "up"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  for (int i = 0; i < 2; ++i) {
    STRATA_RETURN_IF_ERROR(CheckDim(p.up, i, p.gate.dim(i), kOp, "up"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.out, i, p.gate.dim(i), kOp, "out"));
  }
  return absl::OkStatus();
}

absl::Status CpuSwiGlu(const SwiGluParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsSwiGlu(p));
  const int64_t n = p.gate.NumElements();
  const float* g = p.gate.As<const float>();
  const float* u = p.up.As<const float>();
  float* o = p.out.As<float>();
#pragma omp parallel for schedule(static) if (n >= cpu_internal::kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    o[i] = x / (1.0f + std::exp(-x)) * u[i];
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
