// A small run of the fidelity benchmark: exact when the budget covers the context, sane otherwise.
#include "bench/fidelity.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace strata::bench {
namespace {

TEST(FidelityTest, SmallRun) {
  FidelityOptions o;
  o.contexts = {4096};
  o.budgets = {256, 8192};
  o.page_sizes = {16};
  o.policies = {"streaming", "quest", "tokenselect", "hip", "radar"};
  o.kv_heads = 1;
  o.rf_features = 256;
  o.seed = 3;
  auto rows = RunFidelity(o, nullptr);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 10u);
  for (const FidelityRow& r : *rows) {
    SCOPED_TRACE(r.policy + " budget " + std::to_string(r.budget));
    EXPECT_GE(r.mass_recall, 0.0);
    EXPECT_LE(r.mass_recall, 1.0 + 1e-6);
    EXPECT_LE(r.attended_tokens, o.sink_tokens + o.window_tokens + 1 + r.budget);
    if (r.budget == 8192 && r.policy != "streaming") {
      EXPECT_NEAR(r.mass_recall, 1.0, 1e-6);
      EXPECT_NEAR(r.topk_recall, 1.0, 1e-9);
      EXPECT_NEAR(r.rel_error, 0.0, 1e-6);
    }
    nlohmann::json j = nlohmann::json::parse(FidelityRowJson(r), nullptr, false);
    ASSERT_FALSE(j.is_discarded());
    EXPECT_EQ(j["policy"], r.policy);
    EXPECT_EQ(j["context"], r.context);
  }
  // Token-level selection beats sinks + window on planted needles.
  double streaming = -1, tokenselect = -1;
  for (const FidelityRow& r : *rows) {
    if (r.budget != 256) continue;
    if (r.policy == "streaming") streaming = r.topk_recall;
    if (r.policy == "tokenselect") tokenselect = r.topk_recall;
  }
  EXPECT_GT(tokenselect, streaming);
  FidelityOptions bad = o;
  bad.policies = {"nope"};
  EXPECT_FALSE(RunFidelity(bad, nullptr).ok());
}

}  // namespace
}  // namespace strata::bench
