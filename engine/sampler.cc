// Token sampling; see engine/sampler.h.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace strata::engine {

absl::Status SamplingOptions::Validate() const {
  if (!(temperature >= 0.0) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be finite and >= 0, got ", temperature));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (!(top_p > 0.0 && top_p <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  return absl::OkStatus();
}

Pcg32::Pcg32(uint64_t seed, uint64_t stream) {
  // pcg32_srandom_r from the PCG reference implementation.
  state_ = 0;
  inc_ = (stream << 1u) | 1u;
  Next();
  state_ += seed;
  Next();
}

uint32_t Pcg32::Next() {
  const uint64_t old = state_;
  state_ = old * 6364136223846793005ULL + inc_;
  const uint32_t xorshifted = static_cast<uint32_t>(((old >> 18u) ^ old) >> 27u);
  const uint32_t rot = static_cast<uint32_t>(old >> 59u);
  return (xorshifted >> rot) | (xorshifted << ((-rot) & 31u));
}

double Pcg32::NextUniform() { return static_cast<double>(Next() >> 8) * (1.0 / 16777216.0); }

Sampler::Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {
  if (!(options_.temperature >= 0.0) || !std::isfinite(options_.temperature)) {
    options_.temperature = 0.0;
  }
  options_.top_k = std::max<int64_t>(0, options_.top_k);
  if (!(options_.top_p > 0.0)) options_.top_p = 1e-9;
  if (!(options_.top_p <= 1.0)) options_.top_p = 1.0;
}

absl::StatusOr<int32_t> Sampler::Sample(const float* logits, int64_t vocab) {
  if (vocab < 1 || logits == nullptr) return absl::InvalidArgumentError("Sample: empty logits");
  // Candidates: every finite or +inf logit (NaN and -inf can never be picked).
  candidates_.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    const float l = logits[i];
    if (std::isnan(l) || l == -INFINITY) continue;
    candidates_.emplace_back(l, static_cast<int32_t>(i));
  }
  if (candidates_.empty()) {
    return absl::InvalidArgumentError("Sample: every logit is NaN or -inf");
  }
  auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (options_.temperature == 0.0) {
    return std::min_element(candidates_.begin(), candidates_.end(), better)->second;
  }
  if (options_.top_k > 0 && options_.top_k < static_cast<int64_t>(candidates_.size())) {
    std::partial_sort(candidates_.begin(), candidates_.begin() + options_.top_k, candidates_.end(),
                      better);
    candidates_.resize(options_.top_k);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), better);
  }
  // candidates_ is sorted by logit descending, so also by probability descending.
  const double inv_t = 1.0 / options_.temperature;
  const double max_l = static_cast<double>(candidates_[0].first) * inv_t;
  probs_.resize(candidates_.size());
  double total = 0.0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    const double l = static_cast<double>(candidates_[i].first);
    probs_[i] = std::isinf(max_l) ? (l == candidates_[0].first ? 1.0 : 0.0)
                                  : std::exp(l * inv_t - max_l);
    total += probs_[i];
  }
  size_t keep = candidates_.size();
  if (options_.top_p < 1.0) {
    double cum = 0.0;
    for (size_t i = 0; i < candidates_.size(); ++i) {
      cum += probs_[i] / total;
      if (cum >= options_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (size_t i = 0; i < keep; ++i) kept += probs_[i];
  const double u = rng_.NextUniform() * kept;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += probs_[i];
    if (u < cum) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;  // rounding at the very top of the range
}

kernels::SampleRow SampleRowStream::Next() {
  kernels::SampleRow row;
  row.temperature = options_.temperature;
  row.top_p = options_.top_p;
  row.top_k = options_.top_k;
  row.u = options_.temperature > 0.0 ? rng_.NextUniform() : 0.0;
  return row;
}

}  // namespace strata::engine
