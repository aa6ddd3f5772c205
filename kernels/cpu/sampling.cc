// Token sampling, CPU reference (kernels/backend.h SampleParams): engine::Sampler's algorithm
// (engine/sampler.cc) row by row with the caller's uniform, the same arithmetic in the same order,
// so the tokens are bit-for-bit engine::Sampler's. The specification of kernels/cuda/sampling.cu.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

SampleRow ClampSampleRow(const SampleRow& in) {
  SampleRow r = in;
  if (!(r.temperature >= 0.0) || !std::isfinite(r.temperature)) r.temperature = 0.0;
  r.top_k = std::max<int64_t>(0, r.top_k);
  if (!(r.top_p > 0.0)) r.top_p = 1e-9;
  if (!(r.top_p <= 1.0)) r.top_p = 1.0;
  return r;
}

absl::Status CpuSupportsSample(const SampleParams& p) {
  constexpr const char* kOp = "Sample";
  STRATA_RETURN_IF_ERROR(CheckRank(p.logits, 2, kOp, "logits"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.logits, DType::kF32, kOp, "logits"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.tokens, 1, kOp, "tokens"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.tokens, DType::kI32, kOp, "tokens"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.tokens, 0, p.logits.dim(0), kOp, "tokens"));
  const int64_t vocab = p.logits.dim(1);
  if (vocab < 1 || vocab > int64_t{0x7fffffff}) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": vocab must be in [1, 2^31), got ", vocab));
  }
  if (p.logits.dim(0) > 0 && p.rows == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": rows is null"));
  }
  return absl::OkStatus();
}

namespace {

// engine::Sampler::Sample with `u` in place of rng_.NextUniform(); -1 when nothing can be picked.
int32_t SampleOneRow(const float* logits, int64_t vocab, const SampleRow& row,
                     std::vector<std::pair<float, int32_t>>& candidates,
                     std::vector<double>& probs) {
  candidates.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    const float l = logits[i];
    if (std::isnan(l) || l == -INFINITY) continue;
    candidates.emplace_back(l, static_cast<int32_t>(i));
  }
  if (candidates.empty()) return -1;
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (row.temperature == 0.0) {
    return std::min_element(candidates.begin(), candidates.end(), better)->second;
  }
  if (row.top_k > 0 && row.top_k < static_cast<int64_t>(candidates.size())) {
    std::partial_sort(candidates.begin(), candidates.begin() + row.top_k, candidates.end(),
                      better);
    candidates.resize(row.top_k);
  } else {
    std::sort(candidates.begin(), candidates.end(), better);
  }
  const double inv_t = 1.0 / row.temperature;
  const double max_l = static_cast<double>(candidates[0].first) * inv_t;
  probs.resize(candidates.size());
  double total = 0.0;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const double l = static_cast<double>(candidates[i].first);
    probs[i] = std::isinf(max_l) ? (l == candidates[0].first ? 1.0 : 0.0)
                                 : std::exp(l * inv_t - max_l);
    total += probs[i];
  }
  size_t keep = candidates.size();
  if (row.top_p < 1.0) {
    double cum = 0.0;
    for (size_t i = 0; i < candidates.size(); ++i) {
      cum += probs[i] / total;
      if (cum >= row.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += probs[i];
  const double u = row.u * kept;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += probs[i];
    if (u < cum) return candidates[i].second;
  }
  return candidates[keep - 1].second;
}

}  // namespace

absl::Status CpuSample(const SampleParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsSample(p));
  const int64_t rows = p.logits.dim(0), vocab = p.logits.dim(1);
  std::vector<std::pair<float, int32_t>> candidates;
  std::vector<double> probs;
  for (int64_t r = 0; r < rows; ++r) {
    p.tokens.As<int32_t>()[r] = SampleOneRow(p.logits.As<const float>() + r * vocab, vocab,
                                             ClampSampleRow(p.rows[r]), candidates, probs);
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
