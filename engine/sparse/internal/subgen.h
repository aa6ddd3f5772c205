// SubGen's streaming state (SubGen Algorithm 1; DIGEST section 3) for one KV head, keeping token
// indices instead of copies of keys and values.
//
// For every new token (key k, value v):
//   UpdateSoftmaxNormalizer: find the nearest cluster representative x_i; if |k - x_i| <= delta,
//     n_i += 1 and each of the cluster's t sample slots takes the token with probability 1/n_i
//     (reservoir); otherwise the token opens a new cluster (representative = the token, its t
//     slots all hold it).
//   UpdateMatrixProduct: each of the s value-sample slots takes the token with probability
//     |v|^2 / (mu + |v|^2); mu += |v|^2 (l2 sampling).
// delta = radius * (running RMS of key norms), so it follows the scale of the keys.
//
// How it fits the span interface (deviations, documented): SubGen's estimator reweights cluster
// samples by n_i / t and value samples by mu / (s |v|^2); PagedAttention attends tokens with unit
// weight, so Strata attends the sampled tokens (de-duplicated) exactly, like the variant the
// SubGen paper evaluates (cluster centres + recent window, unweighted). Memory is bounded by
// capping the clusters at max_clusters = (budget - s) / t: once the cap is reached, a key farther
// than delta from every representative joins the nearest cluster instead of opening one.
// Thread-compatible.
#ifndef STRATA_ENGINE_SPARSE_INTERNAL_SUBGEN_H_
#define STRATA_ENGINE_SPARSE_INTERNAL_SUBGEN_H_

#include <cstdint>
#include <random>
#include <vector>

namespace strata::engine::sparse {

class SubGenState {
 public:
  SubGenState(int head_dim, int samples_per_cluster, int value_samples, int max_clusters,
              double radius, uint64_t seed);

  // Streams token `t` (the next one) with key k and value v, both f32 [head_dim].
  void Add(int64_t t, const float* k, const float* v);

  // All sampled tokens, sorted and de-duplicated (at most max_clusters * t + s).
  std::vector<int64_t> SampledTokens() const;

  int num_clusters() const { return static_cast<int>(counts_.size()); }
  int64_t tokens_seen() const { return seen_; }

 private:
  int head_dim_;
  int t_;
  int s_;
  int max_clusters_;
  double radius_;
  std::mt19937_64 rng_;
  int64_t seen_ = 0;
  double sum_sq_norm_ = 0.0;               // for the RMS key norm
  std::vector<float> reps_;                // [clusters, head_dim]
  std::vector<int64_t> counts_;            // n_i
  std::vector<int64_t> cluster_samples_;   // [clusters, t] token ids
  double mu_ = 0.0;                        // sum of |v|^2
  std::vector<int64_t> value_samples_;     // [s] token ids (-1 = empty)
};

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_INTERNAL_SUBGEN_H_
