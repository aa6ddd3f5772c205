// engine/query_mean.h: the host mean (with a row stride) and the backend's merge tree agree with
// a plain average; bad queries are refused.
#include "engine/query_mean.h"

#include <cmath>
#include <random>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"

namespace strata::engine {
namespace {

using kernels::DType;
using kernels::TensorView;

TEST(QueryMeanTest, HostMeanWithAndWithoutStride) {
  // q [3 tokens, 4 floats]: the full rows, then floats 1..2 of each row (stride 4).
  const std::vector<float> q = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<float> mean;
  MeanQuery(q.data(), 3, 4, &mean);
  EXPECT_EQ(mean, (std::vector<float>{5, 6, 7, 8}));
  MeanQuery(q.data() + 1, 3, 2, &mean, 4);
  EXPECT_EQ(mean, (std::vector<float>{6, 7}));
  MeanQuery(q.data(), 1, 4, &mean);
  EXPECT_EQ(mean, (std::vector<float>{1, 2, 3, 4}));
}

TEST(QueryMeanTest, DeviceMeanMatchesTheHostMeanOverOneToThreeMergeLevels) {
  constexpr int kHeads = 4, kDim = 8;
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  DeviceQueryMean device(backend.get(), kHeads, kDim);
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  // 1 (q itself), 5 and 64 (one level), 65 and 700 (two), 5000 (three); 5 again reuses the plan.
  for (int m : {1, 5, 64, 65, 700, 5000, 5}) {
    std::vector<float> q(static_cast<size_t>(m) * kHeads * kDim);
    for (float& x : q) x = g(rng);
    std::vector<float> want;
    MeanQuery(q.data(), m, kHeads * kDim, &want);
    STRATA_ASSERT_OK_AND_ASSIGN(const TensorView got,
                                device.Mean(TensorView(q.data(), DType::kF32, {m, kHeads, kDim}), nullptr));
    ASSERT_EQ(got.rank, 2);
    EXPECT_EQ(got.dim(0), kHeads);
    EXPECT_EQ(got.dim(1), kDim);
    if (m == 1) EXPECT_EQ(got.data, q.data());
    const float* out = static_cast<const float*>(got.data);
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-5f) << "m " << m << " at " << i;
  }
}

TEST(QueryMeanTest, DeviceMeanRefusesAnotherShapeOrDtype) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  DeviceQueryMean device(backend.get(), 4, 8);
  std::vector<float> q(2 * 4 * 8);
  EXPECT_THAT(device.Mean(TensorView(q.data(), DType::kF32, {2, 3, 8}), nullptr).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(device.Mean(TensorView(q.data(), DType::kF32, {2, 4, 4}), nullptr).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(device.Mean(TensorView(q.data(), DType::kBF16, {2, 4, 8}), nullptr).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(device.Mean(TensorView(q.data(), DType::kF32, {0, 4, 8}), nullptr).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(device.Mean(TensorView(nullptr, DType::kF32, {2, 4, 8}), nullptr).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::engine
