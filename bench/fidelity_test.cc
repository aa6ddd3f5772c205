// A small run of the fidelity benchmark: exact when the budget covers the context, sane otherwise.
#include "bench/fidelity.h"

#include <cmath>

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

// Selecting from fp8 keys (each page's keys as an fp8 page holds them): the oracle, which reads
// the truth, is untouched; the policies see other keys and still select nearly as well; page sizes
// that do not divide the generator's chunk are refused.
TEST(FidelityTest, Fp8SelectionKeys) {
  FidelityOptions o;
  o.contexts = {8192};
  o.budgets = {512};
  o.page_sizes = {16};
  o.policies = {"oracle", "quest", "tokenselect"};
  o.kv_heads = 1;
  o.seed = 5;
  auto bf16 = RunFidelity(o, nullptr);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  o.fp8_selection_keys = true;
  auto fp8 = RunFidelity(o, nullptr);
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  ASSERT_EQ(fp8->size(), 3u);
  ASSERT_EQ(bf16->size(), 3u);
  bool any_differs = false;
  for (size_t i = 0; i < fp8->size(); ++i) {
    const FidelityRow& a = (*bf16)[i];
    const FidelityRow& b = (*fp8)[i];
    SCOPED_TRACE(b.policy);
    ASSERT_EQ(a.policy, b.policy);
    EXPECT_EQ(a.selection_keys, "bf16");
    if (b.policy == "oracle") {
      EXPECT_EQ(b.selection_keys, "bf16");
      EXPECT_EQ(a.mass_recall, b.mass_recall);
      EXPECT_EQ(a.rel_error, b.rel_error);
      continue;
    }
    EXPECT_EQ(b.selection_keys, "fp8");
    EXPECT_GE(b.mass_recall, a.mass_recall - 0.05);
    any_differs = any_differs || a.mass_recall != b.mass_recall || a.rel_error != b.rel_error;
    nlohmann::json j = nlohmann::json::parse(FidelityRowJson(b), nullptr, false);
    ASSERT_FALSE(j.is_discarded());
    EXPECT_EQ(j["selection_keys"], "fp8");
  }
  EXPECT_TRUE(any_differs) << "the policies saw the same keys";
  o.page_sizes = {48};  // does not divide 8192
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSelectionKeys("bf16").value(), false);
  EXPECT_EQ(ParseSelectionKeys("fp8").value(), true);
  EXPECT_EQ(ParseSelectionKeys("fp16").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSelectionKeys("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FidelityTest, WorkloadProfiles) {
  auto calibrated = WorkloadProfile("calibrated");
  ASSERT_TRUE(calibrated.ok());
  EXPECT_EQ(calibrated->length_rule, LengthRule::kConstant);
  auto logtemp = WorkloadProfile("calibrated-logtemp");
  ASSERT_TRUE(logtemp.ok());
  EXPECT_EQ(logtemp->length_rule, LengthRule::kLlama4);
  EXPECT_EQ(logtemp->background_logit, calibrated->background_logit);
  auto diffuse = WorkloadProfile("diffuse");
  ASSERT_TRUE(diffuse.ok());
  EXPECT_NEAR(diffuse->background_logit, -45.0 / std::sqrt(128.0), 1e-12);
  EXPECT_LT(calibrated->background_logit, diffuse->background_logit);
  EXPECT_FALSE(WorkloadProfile("sharp").ok());
  // Llama 4: 1 + 0.1 ln(1 + floor(L / 8192)).
  EXPECT_EQ(QueryTemperature(LengthRule::kConstant, 1 << 20), 1.0);
  EXPECT_EQ(QueryTemperature(LengthRule::kLlama4, 4096), 1.0);
  EXPECT_NEAR(QueryTemperature(LengthRule::kLlama4, 131072), 1.0 + 0.1 * std::log(17.0), 1e-12);
  EXPECT_NEAR(QueryTemperature(LengthRule::kLlama4, 1 << 20), 1.0 + 0.1 * std::log(129.0), 1e-12);
  FidelityOptions bad;
  bad.workload.background_logit = 0.5;
  EXPECT_FALSE(bad.Validate().ok());
  FidelityOptions parts;
  for (int p : {3, 128}) {
    parts.tokenselect_partitions = p;
    EXPECT_FALSE(parts.Validate().ok()) << p;
  }
  for (int p : {-1, 0, 1, 16, 64}) {  // -1 and 0: the policy's default, by the budget
    parts.tokenselect_partitions = p;
    EXPECT_TRUE(parts.Validate().ok()) << p;
  }
}

// A lower background logit concentrates attention: the oracle's mass at a fixed budget rises.
TEST(FidelityTest, BackgroundLogitControlsDiffuseness) {
  FidelityOptions o;
  o.contexts = {16384};
  o.budgets = {512};
  o.page_sizes = {64};
  o.policies = {"oracle"};
  o.kv_heads = 1;
  double mass[2];
  const char* profiles[2] = {"diffuse", "calibrated"};
  for (int i = 0; i < 2; ++i) {
    auto w = WorkloadProfile(profiles[i]);
    ASSERT_TRUE(w.ok());
    o.workload = *w;
    auto rows = RunFidelity(o, nullptr);
    ASSERT_TRUE(rows.ok()) << rows.status();
    ASSERT_EQ(rows->size(), 1u);
    EXPECT_EQ((*rows)[0].profile, profiles[i]);
    mass[i] = (*rows)[0].mass_recall;
  }
  EXPECT_GT(mass[1], mass[0] + 0.01);
}

}  // namespace
}  // namespace strata::bench
