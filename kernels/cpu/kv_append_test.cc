// Tests of the CPU AppendKv (kernels/cpu/kv_append.cc): rows land in the KvCache layout converted
// exactly as ConvertFromF32 (fp8: F32ToFP8E4M3 of x / scale), nothing else in the pools changes,
// the device-position form writes only for an allowed position, and bad params are refused.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

constexpr int64_t kHeads = 3, kDim = 17, kPage = 5, kPerHead = 3, kSlots = kHeads * kPerHead;

struct Fixture {
  DType dtype;
  std::vector<float> k, v;                 // [n, heads, dim]
  std::vector<uint8_t> kpool, vpool;       // pool bytes, random before the append
  AppendKvParams p;

  Fixture(DType dt, int64_t n, int64_t first, std::mt19937& rng) : dtype(dt) {
    std::uniform_real_distribution<float> u(-300, 300);
    k.resize(n * kHeads * kDim);
    v.resize(k.size());
    for (float& x : k) x = u(rng);
    for (float& x : v) x = u(rng);
    // Special values: NaN, infinities, saturation, signed zero, fp8 subnormals.
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(), -1e30f, 1000.0f, -0.0f,
                              1e-9f, 0.0007f};
    for (size_t i = 0; i < std::size(specials) && 3 * i < k.size(); ++i) {
      k[3 * i] = specials[i];
      v[3 * i + 1] = specials[i];
    }
    const size_t bytes = static_cast<size_t>(kSlots * kPage * kDim) * DTypeSize(dt);
    kpool.resize(bytes);
    vpool.resize(bytes);
    for (auto& b : kpool) b = static_cast<uint8_t>(rng());
    for (auto& b : vpool) b = static_cast<uint8_t>(rng());
    p.k = TensorView(k.data(), DType::kF32, {n, kHeads, kDim});
    p.v = TensorView(v.data(), DType::kF32, {n, kHeads, kDim});
    p.k_pool = TensorView(kpool.data(), dt, {kSlots, kPage, kDim});
    p.v_pool = TensorView(vpool.data(), dt, {kSlots, kPage, kDim});
    p.first = first;
    p.slots_per_head = kPerHead;
    if (dt == DType::kFP8E4M3) {
      p.k_scale = 0.3f;
      p.v_scale = 4.0f;
    }
  }

  // The pools as they must be after appending the rows at position `first`.
  void Expected(int64_t first, std::vector<uint8_t>* ek, std::vector<uint8_t>* ev) const {
    *ek = kpool;
    *ev = vpool;
    const int64_t n = p.k.dim(0);
    const size_t es = DTypeSize(dtype);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < kHeads; ++g) {
        const int64_t pos = first + i;
        const size_t dst = static_cast<size_t>(((g * kPerHead + pos / kPage) * kPage + pos % kPage) *
                                               kDim) * es;
        for (int64_t c = 0; c < kDim; ++c) {
          const size_t src = static_cast<size_t>((i * kHeads + g) * kDim + c);
          float xk = k[src], xv = v[src];
          if (dtype == DType::kFP8E4M3) {
            xk /= p.k_scale;
            xv /= p.v_scale;
          }
          ConvertFromF32(&xk, ek->data() + dst + c * es, dtype, 1);
          ConvertFromF32(&xv, ev->data() + dst + c * es, dtype, 1);
        }
      }
    }
  }
};

TEST(CpuAppendKvTest, MatchesHostConversionForEveryPoolDType) {
  std::mt19937 rng(20261122);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kFP8E4M3}) {
    Fixture f(dt, /*n=*/7, /*first=*/4, rng);  // positions 4..10: pages 0, 1 and 2
    std::vector<uint8_t> ek, ev;
    f.Expected(4, &ek, &ev);
    STRATA_ASSERT_OK(CpuAppendKv(f.p));
    EXPECT_EQ(f.kpool, ek) << DTypeName(dt);
    EXPECT_EQ(f.vpool, ev) << DTypeName(dt);
  }
  // fp8: saturation and NaN as F32ToFP8E4M3 says.
  EXPECT_EQ(F32ToFP8E4M3(1e30f), 0x7e);
  EXPECT_EQ(F32ToFP8E4M3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(F32ToFP8E4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
}

TEST(CpuAppendKvTest, DevicePositionWritesOnlyAllowedPositions) {
  std::mt19937 rng(7);
  Fixture f(DType::kFP8E4M3, /*n=*/2, /*first=*/8, rng);  // 8 = the largest allowed position
  const std::vector<uint8_t> k0 = f.kpool, v0 = f.vpool;
  int32_t pos = -1;
  f.p.first_device = &pos;
  STRATA_ASSERT_OK(CpuAppendKv(f.p));
  EXPECT_EQ(f.kpool, k0);
  pos = 9;  // above `first`: nothing written
  STRATA_ASSERT_OK(CpuAppendKv(f.p));
  EXPECT_EQ(f.kpool, k0);
  EXPECT_EQ(f.vpool, v0);
  pos = 3;
  std::vector<uint8_t> ek, ev;
  f.Expected(3, &ek, &ev);
  STRATA_ASSERT_OK(CpuAppendKv(f.p));
  EXPECT_EQ(f.kpool, ek);
  EXPECT_EQ(f.vpool, ev);
}

// With AppendKvParams::rope the pools get the keys as Rope rotates them (k itself unchanged), the
// queries are rotated in place as Rope rotates them, also when the device position refuses the
// append, and rope.x without inv_freq is refused.
TEST(CpuAppendKvTest, RopeAppendsRotatedKeysAndRotatesQueries) {
  std::mt19937 rng(31);
  constexpr int64_t kDimEven = 16, kQHeads = 6, n = 3, first = 2;
  std::uniform_real_distribution<float> u(-2, 2);
  std::vector<float> k(n * kHeads * kDimEven), v(k.size()), q(n * kQHeads * kDimEven);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  for (float& x : q) x = u(rng);
  std::vector<float> inv_freq(kDimEven / 2);
  for (int64_t i = 0; i < kDimEven / 2; ++i) inv_freq[i] = std::pow(500000.0f, -2.0f * i / kDimEven);
  const std::vector<int32_t> positions = {70001, 9, 123456};
  for (DType dt : {DType::kF32, DType::kBF16, DType::kFP8E4M3}) {
    const size_t bytes = static_cast<size_t>(kSlots * kPage * kDimEven) * DTypeSize(dt);
    std::vector<uint8_t> kpool(bytes, 0x11), vpool(bytes, 0x22), ekpool = kpool, evpool = vpool;
    // Expected: Rope on copies of q and k, then the plain append of the rotated keys.
    std::vector<float> eq = q, ek = k;
    STRATA_ASSERT_OK(CpuRope({TensorView(eq.data(), DType::kF32, {n, kQHeads, kDimEven}),
                              positions.data(),
                              TensorView(inv_freq.data(), DType::kF32, {kDimEven / 2}), 1.0f}));
    STRATA_ASSERT_OK(CpuRope({TensorView(ek.data(), DType::kF32, {n, kHeads, kDimEven}),
                              positions.data(),
                              TensorView(inv_freq.data(), DType::kF32, {kDimEven / 2}), 1.0f}));
    AppendKvParams plain;
    plain.k = TensorView(ek.data(), DType::kF32, {n, kHeads, kDimEven});
    plain.v = TensorView(v.data(), DType::kF32, {n, kHeads, kDimEven});
    plain.k_pool = TensorView(ekpool.data(), dt, {kSlots, kPage, kDimEven});
    plain.v_pool = TensorView(evpool.data(), dt, {kSlots, kPage, kDimEven});
    plain.first = first;
    plain.slots_per_head = kPerHead;
    if (dt == DType::kFP8E4M3) plain.k_scale = 0.5f, plain.v_scale = 2.0f;
    STRATA_ASSERT_OK(CpuAppendKv(plain));

    std::vector<float> qr = q, kr = k;
    AppendKvParams p = plain;
    p.k = TensorView(kr.data(), DType::kF32, {n, kHeads, kDimEven});
    p.k_pool = TensorView(kpool.data(), dt, {kSlots, kPage, kDimEven});
    p.v_pool = TensorView(vpool.data(), dt, {kSlots, kPage, kDimEven});
    p.rope = {TensorView(qr.data(), DType::kF32, {n, kQHeads, kDimEven}), positions.data(),
              TensorView(inv_freq.data(), DType::kF32, {kDimEven / 2}), 1.0f};
    STRATA_ASSERT_OK(CpuAppendKv(p));
    EXPECT_EQ(kpool, ekpool) << DTypeName(dt);
    EXPECT_EQ(vpool, evpool) << DTypeName(dt);
    EXPECT_EQ(qr, eq) << DTypeName(dt);
    EXPECT_EQ(kr, k) << "k is left as it is";

    // A refused device position: nothing appended, the queries still rotated.
    const std::vector<uint8_t> before = kpool;
    qr = q;
    const int32_t refused = -1;
    p.first_device = &refused;
    STRATA_ASSERT_OK(CpuAppendKv(p));
    EXPECT_EQ(kpool, before);
    EXPECT_EQ(qr, eq);

    p.first_device = nullptr;
    AppendKvParams bad = p;
    bad.rope.x = TensorView(qr.data(), DType::kF32, {n - 1, kQHeads, kDimEven});  // rows != n
    EXPECT_THAT(CpuAppendKv(bad), StatusIs(absl::StatusCode::kInvalidArgument));
    bad = p;
    bad.rope.positions = nullptr;
    EXPECT_THAT(CpuAppendKv(bad), StatusIs(absl::StatusCode::kInvalidArgument));
    p.rope.inv_freq = TensorView();
    EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kInvalidArgument));
    p.rope.inv_freq = TensorView(inv_freq.data(), DType::kF32, {kDimEven / 2 - 1});
    EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST(CpuAppendKvTest, RejectsBadParams) {
  std::mt19937 rng(9);
  Fixture f(DType::kBF16, /*n=*/5, /*first=*/6, rng);
  AppendKvParams p = f.p;
  p.first = 13;  // positions up to 17: page 3, past a head's 3 slots
  EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = f.p;
  p.slots_per_head = kPerHead + 1;  // the last head's pages would pass the last slot
  EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = f.p;
  p.k_scale = 2.0f;  // scales must stay 1 for bf16 pools
  EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = f.p;
  p.v = TensorView(f.v.data(), DType::kF32, {5, kHeads, kDim - 1});
  EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = f.p;
  p.k_pool.dtype = p.v_pool.dtype = DType::kF16;
  EXPECT_THAT(CpuAppendKv(p), StatusIs(absl::StatusCode::kUnimplemented));
  Fixture g(DType::kFP8E4M3, 1, 0, rng);
  g.p.v_scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(CpuAppendKv(g.p), StatusIs(absl::StatusCode::kInvalidArgument));
  // The backend entry point is the same op.
  auto cpu = MakeCpuBackend(1);
  Fixture h(DType::kF32, 2, 0, rng);
  std::vector<uint8_t> ek, ev;
  h.Expected(0, &ek, &ev);
  STRATA_ASSERT_OK(cpu->AppendKv(h.p, nullptr));
  EXPECT_EQ(h.kpool, ek);
}

}  // namespace
}  // namespace strata::kernels
