// DevicePolicy (selection on the compute backend) against the host policies of MakeSparsePolicy
// with the same options, on the CPU backend: a sequence is appended in random chunks (both
// policies told), then several decode steps (one token appended, then attention) must give the
// output of PagedAttention over the host policy's spans. Covers two-level and one-level ranking,
// the short-context case (the middle fits in the budget), dense layers, f32 and bf16 caches, and
// the errors.
#include "engine/sparse/device_policy.h"

#include <cmath>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine::sparse {
namespace {

using ::strata::testing::StatusIs;
using kernels::DType;
using kernels::TensorView;

constexpr int kLayers = 2, kHq = 8, kHkv = 2, kD = 32, kPage = 16;

PolicyOptions Options(PolicyKind kind) {
  PolicyOptions o;
  o.kind = kind;
  o.token_budget = 128;
  o.sink_tokens = 32;
  o.window_tokens = 64;
  o.page_size = kPage;
  o.segment_pages = 4;
  o.min_segments = 8;
  o.segment_factor = 4;
  o.two_level_min_pages = 64;
  o.cache_theta = 2.0;  // the host policy's selection cache off (the device policy has none)
  o.dense_layers = {1};
  return o;
}

struct Case {
  PolicyKind kind;
  DType dtype;
  int64_t len;  // tokens before the decode steps
};

class DevicePolicyTest : public ::testing::TestWithParam<Case> {};

TEST_P(DevicePolicyTest, DecodeMatchesHostPolicy) {
  const Case c = GetParam();
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  const int steps = 3;
  KvCacheOptions co;
  co.num_layers = kLayers;
  co.num_kv_heads = kHkv;
  co.head_dim = kD;
  co.page_size = kPage;
  co.dtype = c.dtype;
  co.max_tokens = c.len + steps;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(co, cpu.get()));
  const PolicyOptions o = Options(c.kind);
  STRATA_ASSERT_OK_AND_ASSIGN(auto host, MakeSparsePolicy(o, kLayers, kHq, kHkv, kD));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, DevicePolicy::Create(o, co, kHq, cpu.get()));
  std::mt19937 rng(77 + static_cast<int>(c.len) + static_cast<int>(c.kind));
  std::normal_distribution<float> nd;
  auto append = [&](int64_t n) {
    std::vector<float> k(static_cast<size_t>(n) * kHkv * kD), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    for (int l = 0; l < kLayers; ++l) {
      const int64_t first = cache->length(l);
      STRATA_ASSERT_OK(cache->Append(l, TensorView(k.data(), DType::kF32, {n, kHkv, kD}),
                                     TensorView(v.data(), DType::kF32, {n, kHkv, kD})));
      STRATA_ASSERT_OK(host->OnAppend(l, *cache, first, first + n));
      STRATA_ASSERT_OK(dev->OnAppend(l, *cache, first, first + n, nullptr));
    }
  };
  for (int64_t t = 0; t < c.len;) {
    const int64_t n = std::min<int64_t>(c.len - t, 1 + rng() % 300);
    append(n);
    t += n;
  }
  for (int step = 0; step < steps; ++step) {
    append(1);
    const int64_t len = cache->length(0);
    std::vector<float> q(kHq * kD);
    for (float& x : q) x = 2.0f * nd(rng);
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " layer " << l);
      Selection sel;
      STRATA_ASSERT_OK(host->Select(l, q.data(), 1, kHq, len - 1, *cache, &sel));
      std::vector<float> want(kHq * kD), want_lse(kHq), got(kHq * kD, NAN), got_lse(kHq, NAN);
      const int32_t qpos = static_cast<int32_t>(len - 1);
      kernels::PagedAttentionParams pa;
      pa.q = TensorView(q.data(), DType::kF32, {1, kHq, kD});
      pa.k_pool = cache->k_pool(l);
      pa.v_pool = cache->v_pool(l);
      pa.spans = sel.spans.data();
      pa.span_offsets = sel.offsets.data();
      pa.num_kv_heads = kHkv;
      pa.q_positions = &qpos;
      pa.scale = 1.0f / std::sqrt(static_cast<float>(kD));
      pa.out = TensorView(want.data(), DType::kF32, {1, kHq, kD});
      pa.lse = TensorView(want_lse.data(), DType::kF32, {1, kHq});
      STRATA_ASSERT_OK(cpu->PagedAttention(pa, nullptr));
      STRATA_ASSERT_OK(dev->Attend(l, pa.q, *cache, TensorView(got.data(), DType::kF32, {1, kHq, kD}),
                                   TensorView(got_lse.data(), DType::kF32, {1, kHq}), nullptr));
      for (int i = 0; i < kHq * kD; ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << i;
      for (int i = 0; i < kHq; ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-4) << i;
    }
  }
}

// The window start moves with each step and is mostly not page-aligned; with an aligned sink end
// the host FillPages and the device top-k then pick the same pages (a partial last page among the
// top ones leaves less than a page of budget, so no further page fits either way).
INSTANTIATE_TEST_SUITE_P(
    Cases, DevicePolicyTest,
    ::testing::Values(Case{PolicyKind::kTokenSelect, DType::kF32, 3000},  // two-level
                      Case{PolicyKind::kTokenSelect, DType::kBF16, 3000},
                      Case{PolicyKind::kQuest, DType::kF32, 3000},
                      Case{PolicyKind::kQuest, DType::kBF16, 700},        // one-level
                      Case{PolicyKind::kTokenSelect, DType::kF32, 700},
                      Case{PolicyKind::kTokenSelect, DType::kF32, 150}));  // middle fits

TEST(DevicePolicyErrorsTest, RejectsWhatItCannotRun) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  KvCacheOptions co;
  co.num_layers = 1;
  co.num_kv_heads = kHkv;
  co.head_dim = kD;
  co.page_size = kPage;
  co.max_tokens = 256;
  PolicyOptions o = Options(PolicyKind::kRadar);
  o.dense_layers.clear();
  EXPECT_THAT(DevicePolicy::Create(o, co, kHq, cpu.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.kind = PolicyKind::kTokenSelect;
  o.summary = SummaryKind::kMean;
  EXPECT_THAT(DevicePolicy::Create(o, co, kHq, cpu.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.summary = SummaryKind::kDefault;
  o.page_size = 32;
  EXPECT_THAT(DevicePolicy::Create(o, co, kHq, cpu.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.page_size = kPage;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, DevicePolicy::Create(o, co, kHq, cpu.get()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(co, cpu.get()));
  std::vector<float> q(kHq * kD), out(kHq * kD), lse(kHq);
  const TensorView qv(q.data(), DType::kF32, {1, kHq, kD});
  const TensorView ov(out.data(), DType::kF32, {1, kHq, kD}), lv(lse.data(), DType::kF32, {1, kHq});
  EXPECT_THAT(dev->Attend(0, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // empty cache
  std::vector<float> kv(10 * kHkv * kD, 0.5f);
  STRATA_ASSERT_OK(cache->Append(0, TensorView(kv.data(), DType::kF32, {10, kHkv, kD}),
                                 TensorView(kv.data(), DType::kF32, {10, kHkv, kD})));
  EXPECT_THAT(dev->Attend(0, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));  // no OnAppend yet
  EXPECT_THAT(dev->OnAppend(0, *cache, 0, 9, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // does not end at the length
  STRATA_ASSERT_OK(dev->OnAppend(0, *cache, 0, 10, nullptr));
  STRATA_ASSERT_OK(dev->Attend(0, qv, *cache, ov, lv, nullptr));
  for (int i = 0; i < kHq * kD; ++i) EXPECT_NEAR(out[i], 0.5f, 1e-6);
  EXPECT_THAT(dev->Attend(1, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // layer out of range
}

}  // namespace
}  // namespace strata::engine::sparse
