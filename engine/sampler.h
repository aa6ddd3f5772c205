// Token sampling from logits: greedy, temperature, top-k, top-p; seeded and reproducible.
//
// Reproducibility: the random stream is PCG32 (PCG-XSH-RR 64/32, O'Neill 2014; multiplier
// 6364136223846793005, increment derived from the seed) and uniforms are built from its output
// with fixed arithmetic (24 high bits / 2^24), never with std::*_distribution, so the same seed,
// logits and options give the same tokens on every platform and standard library.
//
// Algorithm for temperature > 0: logits / temperature; keep the top_k largest (0 = all; ties
// broken by lower id); softmax in double over the kept ones; sort by probability (descending,
// ties by lower id); keep the smallest prefix whose mass reaches top_p (at least one token);
// draw u in [0, 1) and return the first token whose cumulative renormalised mass exceeds u.
// Temperature 0 is greedy: the largest logit, ties broken by lower id (no random draw).
//
// Thread-compatible: a Sampler holds its random state; use one per sequence.
#ifndef STRATA_ENGINE_SAMPLER_H_
#define STRATA_ENGINE_SAMPLER_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::engine {

struct SamplingOptions {
  // 0 = greedy. Must be >= 0 and finite. Default: 0.
  double temperature = 0.0;
  // Keep only the k most likely tokens; 0 = no limit. Must be >= 0. Default: 0.
  int64_t top_k = 0;
  // Nucleus sampling mass in (0, 1]; 1 = no limit. Default: 1.
  double top_p = 1.0;
  // Seed of the random stream. Default: 0.
  uint64_t seed = 0;

  // InvalidArgument for out-of-range values.
  absl::Status Validate() const;
};

// PCG32 random stream (see the header comment).
class Pcg32 {
 public:
  explicit Pcg32(uint64_t seed, uint64_t stream = 0x853c49e6748fea9bULL);
  uint32_t Next();
  // Uniform in [0, 1): (Next() >> 8) * 2^-24.
  double NextUniform();

 private:
  uint64_t state_ = 0;
  uint64_t inc_ = 0;
};

class Sampler {
 public:
  // `options` must be valid (Validate()); invalid values are clamped to the nearest valid one.
  explicit Sampler(const SamplingOptions& options);

  // Picks a token from `logits` [vocab]. InvalidArgument when vocab < 1 or when every logit is
  // NaN / -inf.
  absl::StatusOr<int32_t> Sample(const float* logits, int64_t vocab);

 private:
  SamplingOptions options_;
  Pcg32 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
  std::vector<double> probs_;
};

// The SampleRow of each token for Backend::Sample (or its CPU twin, kernels::CpuSample): the
// options and, at temperature > 0, the next uniform of the PCG32 stream engine::Sampler would
// draw from (one per token), so the tokens drawn are engine::Sampler's.
class SampleRowStream {
 public:
  // `options` must be valid (Validate()).
  explicit SampleRowStream(const SamplingOptions& options) : options_(options), rng_(options.seed) {}
  kernels::SampleRow Next();

 private:
  SamplingOptions options_;
  Pcg32 rng_;
};

}  // namespace strata::engine

#endif  // STRATA_ENGINE_SAMPLER_H_
