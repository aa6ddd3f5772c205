// See engine/sparse/internal/subgen.h.
#include "engine/sparse/internal/subgen.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace strata::engine::sparse {

SubGenState::SubGenState(int head_dim, int samples_per_cluster, int value_samples,
                         int max_clusters, double radius, uint64_t seed)
    : head_dim_(head_dim),
      t_(std::max(1, samples_per_cluster)),
      s_(std::max(0, value_samples)),
      max_clusters_(std::max(1, max_clusters)),
      radius_(radius),
      rng_(seed),
      value_samples_(s_, -1) {}

void SubGenState::Add(int64_t t, const float* k, const float* v) {
  const int d = head_dim_;
  double knorm2 = 0.0;
  for (int i = 0; i < d; ++i) knorm2 += static_cast<double>(k[i]) * k[i];
  ++seen_;
  sum_sq_norm_ += knorm2;
  const double delta = radius_ * std::sqrt(sum_sq_norm_ / static_cast<double>(seen_));
  std::uniform_real_distribution<double> u(0.0, 1.0);

  // UpdateSoftmaxNormalizer.
  int best = -1;
  double best_d2 = std::numeric_limits<double>::infinity();
  const int m = num_clusters();
  for (int c = 0; c < m; ++c) {
    const float* x = &reps_[static_cast<size_t>(c) * d];
    double d2 = 0.0;
    for (int i = 0; i < d; ++i) {
      const double diff = static_cast<double>(k[i]) - x[i];
      d2 += diff * diff;
    }
    if (d2 < best_d2) {
      best_d2 = d2;
      best = c;
    }
  }
  if (best >= 0 && (best_d2 <= delta * delta || m >= max_clusters_)) {
    const int64_t n = ++counts_[best];
    for (int j = 0; j < t_; ++j) {
      if (u(rng_) < 1.0 / static_cast<double>(n)) cluster_samples_[static_cast<size_t>(best) * t_ + j] = t;
    }
  } else {
    reps_.insert(reps_.end(), k, k + d);
    counts_.push_back(1);
    cluster_samples_.insert(cluster_samples_.end(), t_, t);
  }

  // UpdateMatrixProduct.
  double vnorm2 = 0.0;
  for (int i = 0; i < d; ++i) vnorm2 += static_cast<double>(v[i]) * v[i];
  if (vnorm2 > 0.0) {
    const double p = vnorm2 / (mu_ + vnorm2);
    for (int j = 0; j < s_; ++j) {
      if (u(rng_) < p) value_samples_[j] = t;
    }
  }
  mu_ += vnorm2;
}

std::vector<int64_t> SubGenState::SampledTokens() const {
  std::vector<int64_t> out(cluster_samples_.begin(), cluster_samples_.end());
  for (int64_t t : value_samples_) {
    if (t >= 0) out.push_back(t);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace strata::engine::sparse
