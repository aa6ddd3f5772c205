// RMS normalisation, row by row: out = in / sqrt(mean(in^2) + eps) * weight (f32 accumulation),
// optionally after in += residual.
#include <cmath>
#include <vector>

#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;
using cpu_internal::CheckWeightDType;

absl::Status CpuSupportsRmsNorm(const RmsNormParams& p) {
  constexpr const char* kOp = "RmsNorm";
  STRATA_RETURN_IF_ERROR(CheckRank(p.in, 2, kOp, "in"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 2, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.weight, 1, kOp, "weight"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.in, DType::kF32, kOp, "in"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckWeightDType(p.weight, kOp, "weight"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.out, 0, p.in.dim(0), kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.out, 1, p.in.dim(1), kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.weight, 0, p.in.dim(1), kOp, "weight"));
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return absl::InvalidArgumentError("RmsNorm: eps must be finite and >= 0");
  }
  if (p.residual.data != nullptr) {
    STRATA_RETURN_IF_ERROR(CheckRank(p.residual, 2, kOp, "residual"));
    STRATA_RETURN_IF_ERROR(CheckDType(p.residual, DType::kF32, kOp, "residual"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.residual, 0, p.in.dim(0), kOp, "residual"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.residual, 1, p.in.dim(1), kOp, "residual"));
    if (p.residual.data == p.out.data) {
      return absl::InvalidArgumentError("RmsNorm: residual must not alias out");
    }
  }
  return absl::OkStatus();
}

absl::Status CpuRmsNorm(const RmsNormParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsRmsNorm(p));
  const int64_t n = p.in.dim(0), hidden = p.in.dim(1);
  std::vector<float> weight(hidden);
  cpu_internal::LoadF32(p.weight, 0, hidden, weight.data());
  float* in = p.in.As<float>();
  const float* res = p.residual.As<const float>();
  float* out = p.out.As<float>();
#pragma omp parallel for schedule(static) if (n * hidden >= cpu_internal::kParallelMinWork)
  for (int64_t t = 0; t < n; ++t) {
    float* x = in + t * hidden;
    float* y = out + t * hidden;
    if (res != nullptr) {
      for (int64_t i = 0; i < hidden; ++i) x[i] = x[i] + res[t * hidden + i];
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < hidden; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + p.eps);
    for (int64_t i = 0; i < hidden; ++i) y[i] = weight[i] * (x[i] * inv);
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
