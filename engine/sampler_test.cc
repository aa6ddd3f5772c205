#include "engine/sampler.h"

#include <cmath>
#include <map>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::engine {
namespace {

using ::strata::testing::StatusIs;

TEST(Pcg32Test, MatchesReferenceSequence) {
  // pcg32_srandom_r(&rng, 42, 54) from the PCG reference implementation (pcg32-demo).
  Pcg32 rng(42, 54);
  const uint32_t want[] = {0xa15c02b7, 0x7b47f409, 0xba1d3330, 0x83d2f293, 0xbfa4784b, 0xcbed606e};
  for (uint32_t w : want) EXPECT_EQ(rng.Next(), w);
}

TEST(SamplerTest, GreedyPicksArgmaxLowestIdOnTies) {
  Sampler s({});
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, NAN};
  STRATA_ASSERT_OK_AND_ASSIGN(int32_t id, s.Sample(logits.data(), logits.size()));
  EXPECT_EQ(id, 1);
}

TEST(SamplerTest, RejectsBadInputAndOptions) {
  Sampler s({});
  const std::vector<float> all_bad = {NAN, -INFINITY};
  EXPECT_THAT(s.Sample(all_bad.data(), 2), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(s.Sample(all_bad.data(), 0), StatusIs(absl::StatusCode::kInvalidArgument));
  SamplingOptions o;
  o.temperature = -1;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  o = {};
  o.top_p = 0;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  o = {};
  o.top_k = -2;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
}

std::vector<int32_t> Draw(const SamplingOptions& o, const std::vector<float>& logits, int n) {
  Sampler s(o);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(*s.Sample(logits.data(), logits.size()));
  return out;
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  const std::vector<float> logits = {1.0f, 0.5f, 0.2f, 0.0f, -0.3f, 0.9f, 0.1f};
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 1234;
  const auto a = Draw(o, logits, 200), b = Draw(o, logits, 200);
  EXPECT_EQ(a, b);
  o.seed = 1235;
  EXPECT_NE(Draw(o, logits, 200), a);
}

TEST(SamplerTest, FrequenciesFollowSoftmax) {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 99;
  const int n = 20000;
  std::map<int32_t, int> count;
  for (int32_t id : Draw(o, logits, n)) ++count[id];
  EXPECT_NEAR(count[0] / double(n), 0.5, 0.02);
  EXPECT_NEAR(count[1] / double(n), 0.3, 0.02);
  EXPECT_NEAR(count[2] / double(n), 0.2, 0.02);
}

TEST(SamplerTest, TopKAndTopPRestrictTheSupport) {
  const std::vector<float> logits = {std::log(0.4f), std::log(0.3f), std::log(0.2f),
                                     std::log(0.1f)};
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 5;
  o.top_k = 2;
  for (int32_t id : Draw(o, logits, 2000)) EXPECT_LT(id, 2);
  o.top_k = 0;
  o.top_p = 0.85;  // 0.4 + 0.3 + 0.2 reaches it: token 3 excluded
  std::map<int32_t, int> count;
  for (int32_t id : Draw(o, logits, 5000)) ++count[id];
  EXPECT_EQ(count[3], 0);
  EXPECT_GT(count[2], 0);
  o.top_p = 0.1;  // only the top token
  for (int32_t id : Draw(o, logits, 500)) EXPECT_EQ(id, 0);
}

TEST(SamplerTest, LowTemperatureApproachesGreedy) {
  const std::vector<float> logits = {1.0f, 1.5f, 0.7f};
  SamplingOptions o;
  o.temperature = 1e-3;
  o.seed = 3;
  for (int32_t id : Draw(o, logits, 100)) EXPECT_EQ(id, 1);
}

}  // namespace
}  // namespace strata::engine
