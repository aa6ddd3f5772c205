#include "coordinator/validation.h"

#include <limits>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

ValidationLimits Limits() {
  ValidationLimits l;
  l.vocab_size = 1000;
  l.num_layers = 4;
  return l;
}

TEST(ValidationTest, Ids) {
  STRATA_EXPECT_OK(ValidateDocumentId("0123456789abcdef0123456789abcdef"));
  EXPECT_THAT(ValidateDocumentId("0123456789ABCDEF0123456789abcdef"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateDocumentId("abc"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateDocumentId(""), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_EXPECT_OK(ValidateJobId("job-0123456789abcdef"));
  EXPECT_THAT(ValidateJobId("job-0123456789abcdeg"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ValidateJobId("jab-0123456789abcdef"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ValidationTest, TokenIds) {
  const std::vector<int32_t> good = {0, 5, 999};
  STRATA_EXPECT_OK(ValidateTokenIds(good, 1000, "t"));
  const std::vector<int32_t> big = {0, 1000};
  EXPECT_THAT(ValidateTokenIds(big, 1000, "tokens"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens[1]")));
  STRATA_EXPECT_OK(ValidateTokenIds(big, 0, "t"));  // unknown vocabulary: only negatives fail
  const std::vector<int32_t> neg = {-1};
  EXPECT_THAT(ValidateTokenIds(neg, 0, "t"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ValidationTest, GenerationDefaults) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto p, EffectiveGenerationParams(v1::GenerationParams(), Limits(), 42));
  EXPECT_EQ(p.max_tokens(), 256u);
  EXPECT_EQ(p.top_p(), 1.0f);
  ASSERT_TRUE(p.has_seed());
  EXPECT_EQ(p.seed(), 42u);
  v1::GenerationParams in;
  in.set_seed(7);
  in.set_max_tokens(4096);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveGenerationParams(in, Limits(), 42));
  EXPECT_EQ(p.seed(), 7u);
  EXPECT_EQ(p.max_tokens(), 4096u);
}

TEST(ValidationTest, GenerationOutOfRange) {
  auto expect_bad = [](const v1::GenerationParams& p, const std::string& field) {
    EXPECT_THAT(EffectiveGenerationParams(p, Limits(), 1),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)));
  };
  v1::GenerationParams p;
  p.set_max_tokens(4097);
  expect_bad(p, "max_tokens");
  p = v1::GenerationParams();
  p.set_temperature(2.5f);
  expect_bad(p, "temperature");
  p.set_temperature(std::numeric_limits<float>::quiet_NaN());
  expect_bad(p, "temperature");
  p = v1::GenerationParams();
  p.set_top_p(1.5f);
  expect_bad(p, "top_p");
  p = v1::GenerationParams();
  p.set_top_k(1001);
  expect_bad(p, "top_k");
  p = v1::GenerationParams();
  for (int i = 0; i < 9; ++i) p.add_stop("x");
  expect_bad(p, "stop");
  p = v1::GenerationParams();
  p.add_stop("");
  expect_bad(p, "stop[0]");
  p = v1::GenerationParams();
  p.add_stop_token_ids(1000);
  expect_bad(p, "stop_token_ids");
}

TEST(ValidationTest, PolicyDefaults) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto p, EffectiveSelectionPolicy(v1::SelectionPolicy(), Limits()));
  EXPECT_EQ(p.name(), "dense");
  EXPECT_EQ(p.budget_tokens(), 2048u);
  EXPECT_EQ(p.sink_tokens(), 4u);
  EXPECT_EQ(p.window_tokens(), 256u);
  EXPECT_EQ(p.page_size(), 64u);
  EXPECT_FLOAT_EQ(p.theta(), 0.9f);
  EXPECT_EQ(p.miss_mode(), v1::MISS_MODE_WAIT);
  EXPECT_EQ(p.candidate_factor(), 4u);
  // Unset (or 0): left to the worker's policy, which chooses by the budget it gets.
  EXPECT_FALSE(p.has_partitions());
  v1::SelectionPolicy in;
  in.set_partitions(0);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveSelectionPolicy(in, Limits()));
  EXPECT_FALSE(p.has_partitions());
  in.set_name("quest");
  in.set_sink_tokens(0);  // explicitly zero stays zero
  in.set_theta(1.0f);
  in.set_candidate_factor(2);
  in.set_partitions(8);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveSelectionPolicy(in, Limits()));
  EXPECT_EQ(p.name(), "quest");
  EXPECT_EQ(p.sink_tokens(), 0u);
  EXPECT_FLOAT_EQ(p.theta(), 1.0f);
  EXPECT_EQ(p.candidate_factor(), 2u);
  EXPECT_EQ(p.partitions(), 8u);
  // tokenselect in parts: with the default budget (2048), one set, and one that is not a
  // multiple of the parts (the policy rounds it up; the request keeps what was asked).
  in = v1::SelectionPolicy();
  in.set_name("tokenselect");
  in.set_partitions(64);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveSelectionPolicy(in, Limits()));
  EXPECT_EQ(p.partitions(), 64u);
  EXPECT_EQ(p.budget_tokens(), 2048u);
  in.set_partitions(4);
  in.set_budget_tokens(100);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveSelectionPolicy(in, Limits()));
  EXPECT_EQ(p.partitions(), 4u);
  EXPECT_EQ(p.budget_tokens(), 100u);
  in.set_partitions(8);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveSelectionPolicy(in, Limits()));
  EXPECT_EQ(p.partitions(), 8u);
  EXPECT_EQ(p.budget_tokens(), 100u);
  // Other policies ignore the parts: any budget.
  in.set_name("quest");
  in.set_partitions(8);
  STRATA_ASSERT_OK_AND_ASSIGN(p, EffectiveSelectionPolicy(in, Limits()));
  EXPECT_EQ(p.partitions(), 8u);
}

TEST(ValidationTest, PolicyOutOfRange) {
  auto expect_bad = [](const v1::SelectionPolicy& p, const std::string& field) {
    EXPECT_THAT(EffectiveSelectionPolicy(p, Limits()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(field)));
  };
  v1::SelectionPolicy p;
  p.set_name("magic");
  expect_bad(p, "policy.name");
  p = v1::SelectionPolicy();
  p.set_budget_tokens(8);
  expect_bad(p, "budget_tokens");
  p.set_budget_tokens((1u << 20) + 1);
  expect_bad(p, "budget_tokens");
  p = v1::SelectionPolicy();
  p.set_sink_tokens(2000);
  expect_bad(p, "sink_tokens");
  p = v1::SelectionPolicy();
  p.set_window_tokens(70000);
  expect_bad(p, "window_tokens");
  p = v1::SelectionPolicy();
  p.set_page_size(32);
  expect_bad(p, "page_size");
  p = v1::SelectionPolicy();
  p.set_theta(1.5f);
  expect_bad(p, "theta");
  p = v1::SelectionPolicy();
  p.set_candidate_factor(0);
  expect_bad(p, "candidate_factor");
  p.set_candidate_factor(17);
  expect_bad(p, "candidate_factor");
  for (uint32_t parts : {3u, 12u, 128u, 1u << 31}) {
    p = v1::SelectionPolicy();
    p.set_name("tokenselect");
    p.set_partitions(parts);
    expect_bad(p, "policy.partitions");
  }
  p = v1::SelectionPolicy();
  p.set_name("tokenselect");
  p.set_budget_tokens(100);
  p.set_partitions(8);
  p.set_name("quest");
  p.set_partitions(6);  // the range holds for every policy
  expect_bad(p, "policy.partitions");
  p = v1::SelectionPolicy();
  p.add_dense_layers(4);
  expect_bad(p, "dense_layers");
  p = v1::SelectionPolicy();
  p.set_summary(static_cast<v1::SummaryKind>(17));
  expect_bad(p, "summary");
}

TEST(ValidationTest, LimitsValidate) {
  STRATA_EXPECT_OK(ValidationLimits().Validate());
  ValidationLimits l;
  l.default_max_tokens = 5000;
  EXPECT_THAT(l.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::coordinator
