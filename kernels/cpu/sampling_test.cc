// The CPU Sample op against engine::Sampler: for random logits (with NaN / -inf / +inf entries and
// duplicate values) and random options, the op fed the same PCG32 uniforms must return exactly
// engine::Sampler's tokens, over awkward vocab sizes and several steps per row. Also: validation,
// and -1 for a row with nothing to pick.
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

// Random options: greedy, temperature only, top-k, top-p, both; some out of range (clamped).
engine::SamplingOptions RandomOptions(std::mt19937& rng, int64_t vocab) {
  engine::SamplingOptions o;
  const int kind = static_cast<int>(rng() % 6);
  std::uniform_real_distribution<double> t(0.05, 2.0);
  o.temperature = kind == 0 ? 0.0 : t(rng);
  if (kind == 2 || kind == 4) o.top_k = 1 + static_cast<int64_t>(rng() % (vocab + 2));
  if (kind == 3 || kind == 4) o.top_p = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  if (kind == 5 && rng() % 2 == 0) o.top_p = 0.5;
  o.seed = rng();
  return o;
}

// Logits: normal values; with `dups`, only a few distinct values; some NaN / -inf / +inf.
std::vector<float> RandomLogits(std::mt19937& rng, int64_t vocab, bool dups, bool specials) {
  std::vector<float> l(vocab);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (auto& x : l) x = dups ? static_cast<float>(static_cast<int>(rng() % 4)) : n(rng);
  if (specials) {
    for (int i = 0; i < 3; ++i) {
      const int64_t j = rng() % vocab;
      const int k = static_cast<int>(rng() % 4);
      l[j] = k == 0   ? std::numeric_limits<float>::quiet_NaN()
             : k == 1 ? -std::numeric_limits<float>::infinity()
             : k == 2 ? std::numeric_limits<float>::infinity()
                      : -0.0f;
    }
  }
  return l;
}

void CheckAgainstSampler(int64_t vocab, int trials, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int trial = 0; trial < trials; ++trial) {
    const int rows = 1 + static_cast<int>(rng() % 3);
    std::vector<float> logits;
    std::vector<engine::SamplingOptions> opts;
    for (int r = 0; r < rows; ++r) {
      const auto l = RandomLogits(rng, vocab, trial % 3 == 1, trial % 4 == 2);
      logits.insert(logits.end(), l.begin(), l.end());
      opts.push_back(RandomOptions(rng, vocab));
    }
    std::vector<engine::Sampler> samplers;
    std::vector<engine::Pcg32> streams;
    for (const auto& o : opts) {
      samplers.emplace_back(o);
      streams.emplace_back(o.seed);
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<SampleRow> sr(rows);
      for (int r = 0; r < rows; ++r) {
        sr[r].temperature = opts[r].temperature;
        sr[r].top_k = opts[r].top_k;
        sr[r].top_p = opts[r].top_p;
        if (ClampSampleRow(sr[r]).temperature > 0.0) sr[r].u = streams[r].NextUniform();
      }
      std::vector<int32_t> tokens(rows, -7);
      SampleParams p;
      p.logits = TensorView(logits.data(), DType::kF32, {rows, vocab});
      p.rows = sr.data();
      p.tokens = TensorView(tokens.data(), DType::kI32, {rows});
      STRATA_ASSERT_OK(CpuSample(p));
      for (int r = 0; r < rows; ++r) {
        auto want = samplers[r].Sample(logits.data() + r * vocab, vocab);
        const int32_t w = want.ok() ? *want : -1;
        ASSERT_EQ(tokens[r], w) << "vocab " << vocab << " trial " << trial << " step " << step
                                << " row " << r << " T " << opts[r].temperature << " k "
                                << opts[r].top_k << " p " << opts[r].top_p;
      }
    }
  }
}

TEST(CpuSampleTest, MatchesEngineSampler) {
  CheckAgainstSampler(1, 50, 1);
  CheckAgainstSampler(3, 200, 2);
  CheckAgainstSampler(17, 200, 3);
  CheckAgainstSampler(1000, 60, 4);
  CheckAgainstSampler(128256, 4, 5);
}

TEST(CpuSampleTest, NothingToPickGivesMinusOne) {
  std::vector<float> logits = {std::nanf(""), -INFINITY, std::nanf("")};
  SampleRow rows[2];
  rows[1].temperature = 1.0;
  rows[1].u = 0.5;
  std::vector<float> two(logits);
  two.insert(two.end(), logits.begin(), logits.end());
  int32_t tokens[2] = {5, 5};
  SampleParams p;
  p.logits = TensorView(two.data(), DType::kF32, {2, 3});
  p.rows = rows;
  p.tokens = TensorView(tokens, DType::kI32, {2});
  STRATA_ASSERT_OK(MakeCpuBackend(1)->Sample(p, nullptr));
  EXPECT_EQ(tokens[0], -1);
  EXPECT_EQ(tokens[1], -1);
}

TEST(CpuSampleTest, RejectsMalformedParams) {
  std::vector<float> logits(6, 0.0f);
  SampleRow rows[2];
  int32_t tokens[3];
  SampleParams p;
  p.logits = TensorView(logits.data(), DType::kF32, {2, 3});
  p.rows = rows;
  p.tokens = TensorView(tokens, DType::kI32, {3});
  EXPECT_THAT(CpuSupportsSample(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.tokens = TensorView(tokens, DType::kI32, {2});
  STRATA_EXPECT_OK(CpuSupportsSample(p));
  p.rows = nullptr;
  EXPECT_THAT(CpuSample(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.rows = rows;
  p.logits = TensorView(logits.data(), DType::kF32, {6, 0});
  EXPECT_THAT(CpuSupportsSample(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.logits = TensorView(logits.data(), DType::kBF16, {2, 3});
  EXPECT_THAT(CpuSupportsSample(p), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::kernels
