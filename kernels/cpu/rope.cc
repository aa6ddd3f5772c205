// Rotary position embedding in place, Hugging Face "rotate half" convention. The angle is the f32
// product position * inv_freq[i], as transformers computes it, so the rotation matches it bit for
// bit up to the cos/sin implementation.
#include <algorithm>
#include <cmath>

#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

absl::Status CpuSupportsRope(const RopeParams& p) {
  constexpr const char* kOp = "Rope";
  STRATA_RETURN_IF_ERROR(CheckRank(p.x, 3, kOp, "x"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.inv_freq, 1, kOp, "inv_freq"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.x, DType::kF32, kOp, "x"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.inv_freq, DType::kF32, kOp, "inv_freq"));
  if (p.x.dim(2) % 2 != 0) return absl::InvalidArgumentError("Rope: head_dim must be even");
  STRATA_RETURN_IF_ERROR(CheckDim(p.inv_freq, 0, p.x.dim(2) / 2, kOp, "inv_freq"));
  if (p.x.dim(0) > 0 && p.positions == nullptr) {
    return absl::InvalidArgumentError("Rope: positions is null");
  }
  return absl::OkStatus();
}

absl::Status CpuRope(const RopeParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsRope(p));
  const int64_t n = p.x.dim(0), heads = p.x.dim(1), d = p.x.dim(2), half = d / 2;
  const float* inv_freq = p.inv_freq.As<const float>();
  float* x = p.x.As<float>();
#pragma omp parallel for schedule(static) if (n * heads * d >= cpu_internal::kParallelMinWork)
  for (int64_t t = 0; t < n; ++t) {
    const float pos = static_cast<float>(p.positions[t]);
    float cs[512], sn[512];  // head_dim / 2 <= 512 in every supported model; chunked otherwise
    for (int64_t i0 = 0; i0 < half; i0 += 512) {
      const int64_t m = std::min<int64_t>(512, half - i0);
      for (int64_t i = 0; i < m; ++i) {
        const float a = pos * inv_freq[i0 + i];
        cs[i] = std::cos(a) * p.attention_factor;
        sn[i] = std::sin(a) * p.attention_factor;
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * d;
        for (int64_t i = 0; i < m; ++i) {
          const float x1 = v[i0 + i], x2 = v[i0 + i + half];
          v[i0 + i] = x1 * cs[i] - x2 * sn[i];
          v[i0 + i + half] = x2 * cs[i] + x1 * sn[i];
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
