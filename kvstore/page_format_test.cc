#include "kvstore/page_format.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::kvstore {
namespace {

using ::strata::testing::StatusIs;
using kernels::DType;
using kernels::TensorView;

constexpr uint32_t kSeed = 20261122;

std::vector<float> RandomF32(size_t n, std::mt19937* rng, float scale = 3.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

TEST(PageFormatTest, Bf16RoundTripIsBitExact) {
  SCOPED_TRACE(::testing::Message() << "seed " << kSeed);
  std::mt19937 rng(kSeed);
  const PageShape shape{DType::kBF16, 64, 128};
  const size_t n = 64 * 128;
  std::vector<uint16_t> k(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    k[i] = static_cast<uint16_t>(rng());
    v[i] = static_cast<uint16_t>(rng());
    // Keep NaN patterns out: their payload is not preserved through f32 by every path.
    if ((k[i] & 0x7f80) == 0x7f80) k[i] &= 0xbfff;
    if ((v[i] & 0x7f80) == 0x7f80) v[i] &= 0xbfff;
  }
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                              (EncodePage(shape, TensorView(k.data(), DType::kBF16, {64, 128}),
                                         TensorView(v.data(), DType::kBF16, {64, 128}))));
  ASSERT_EQ(page.size(), shape.EncodedBytes());
  ASSERT_EQ(page.size(), 32u + 2 * 64 * 128 * 2);
  EXPECT_EQ(std::memcmp(PageKBytes(page).data(), k.data(), n * 2), 0);
  EXPECT_EQ(std::memcmp(PageVBytes(page).data(), v.data(), n * 2), 0);

  // f32 input that is bf16-representable encodes to the same bytes and decodes exactly.
  std::vector<float> kf(n), vf(n), kd(n), vd(n);
  for (size_t i = 0; i < n; ++i) {
    kf[i] = kernels::BF16ToF32(k[i]);
    vf[i] = kernels::BF16ToF32(v[i]);
  }
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page2,
                              (EncodePage(shape, TensorView(kf.data(), DType::kF32, {64, 128}),
                                         TensorView(vf.data(), DType::kF32, {64, 128}))));
  EXPECT_EQ(page, page2);
  STRATA_ASSERT_OK(DecodePage(page, kd.data(), vd.data()));
  EXPECT_EQ(std::memcmp(kd.data(), kf.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(vd.data(), vf.data(), n * 4), 0);
}

TEST(PageFormatTest, Fp8RoundTripIsExactForRepresentableValues) {
  SCOPED_TRACE(::testing::Message() << "seed " << kSeed);
  std::mt19937 rng(kSeed);
  const PageShape shape{DType::kFP8E4M3, 64, 128};
  const size_t n = 64 * 128;
  // Values fp8 * 2^-3 with amax exactly 448 * 2^-3: the page scale is 2^-3 and every value is
  // representable, so decoding reproduces the input exactly.
  std::vector<float> k(n), v(n), kd(n), vd(n);
  for (size_t i = 0; i < n; ++i) {
    uint8_t bk = static_cast<uint8_t>(rng()), bv = static_cast<uint8_t>(rng());
    if ((bk & 0x7f) == 0x7f) bk &= 0xfe;  // no NaN
    if ((bv & 0x7f) == 0x7f) bv &= 0xfe;
    k[i] = kernels::FP8E4M3ToF32(bk) * 0.125f;
    v[i] = kernels::FP8E4M3ToF32(bv) * 0.125f;
  }
  k[7] = 448.0f * 0.125f;
  v[9] = -448.0f * 0.125f;
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                              (EncodePage(shape, TensorView(k.data(), DType::kF32, {64, 128}),
                                         TensorView(v.data(), DType::kF32, {64, 128}))));
  ASSERT_EQ(page.size(), 32u + 2 * 64 * 128);
  STRATA_ASSERT_OK_AND_ASSIGN(PageHeader h, VerifyPage(page));
  EXPECT_EQ(h.k_scale, 0.125f);
  EXPECT_EQ(h.v_scale, 0.125f);
  STRATA_ASSERT_OK(DecodePage(page, kd.data(), vd.data()));
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(kd[i], k[i]) << i;
    ASSERT_EQ(vd[i], v[i]) << i;
  }
}

TEST(PageFormatTest, Fp8RandomErrorIsWithinE4M3Precision) {
  SCOPED_TRACE(::testing::Message() << "seed " << kSeed);
  std::mt19937 rng(kSeed + 1);
  const PageShape shape{DType::kFP8E4M3, 64, 128};
  const size_t n = 64 * 128;
  std::vector<float> k = RandomF32(n, &rng, 5.0f), v = RandomF32(n, &rng, 0.01f), kd(n), vd(n);
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                              (EncodePage(shape, TensorView(k.data(), DType::kF32, {64, 128}),
                                         TensorView(v.data(), DType::kF32, {64, 128}))));
  STRATA_ASSERT_OK_AND_ASSIGN(PageHeader h, VerifyPage(page));
  STRATA_ASSERT_OK(DecodePage(page, kd.data(), vd.data()));
  for (size_t i = 0; i < n; ++i) {
    // e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 * scale.
    ASSERT_LE(std::fabs(kd[i] - k[i]), std::fabs(k[i]) / 16 + h.k_scale * 0x1p-9f) << i;
    ASSERT_LE(std::fabs(vd[i] - v[i]), std::fabs(v[i]) / 16 + h.v_scale * 0x1p-9f) << i;
  }
}

TEST(PageFormatTest, PageToBf16CopiesBf16AndRoundsDequantisedFp8) {
  SCOPED_TRACE(::testing::Message() << "seed " << kSeed);
  std::mt19937 rng(kSeed + 2);
  const size_t n = 16 * 32;
  std::vector<float> k = RandomF32(n, &rng, 4.0f), v = RandomF32(n, &rng, 0.5f), kd(n), vd(n);
  std::vector<uint16_t> kb(n), vb(n);
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    const PageShape shape{dtype, 16, 32};
    STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                                (EncodePage(shape, TensorView(k.data(), DType::kF32, {13, 32}),
                                           TensorView(v.data(), DType::kF32, {13, 32}))));
    STRATA_ASSERT_OK(PageToBf16(page, kb.data(), vb.data()));
    STRATA_ASSERT_OK(DecodePage(page, kd.data(), vd.data()));
    if (dtype == DType::kBF16) {
      EXPECT_EQ(std::memcmp(kb.data(), PageKBytes(page).data(), n * 2), 0);
      EXPECT_EQ(std::memcmp(vb.data(), PageVBytes(page).data(), n * 2), 0);
    }
    // Either way: the bf16 rounding of the decoded f32 values (rows past the 13 valid ones are 0).
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(kb[i], kernels::F32ToBF16(kd[i])) << kernels::DTypeName(dtype) << " K " << i;
      ASSERT_EQ(vb[i], kernels::F32ToBF16(vd[i])) << kernels::DTypeName(dtype) << " V " << i;
    }
    EXPECT_EQ(kb[n - 1], kernels::F32ToBF16(0.0f));
  }
  EXPECT_THAT(PageToBf16("not a page", kb.data(), vb.data()), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PageFormatTest, PartialPageIsZeroPadded) {
  const PageShape shape{DType::kBF16, 8, 4};
  std::vector<float> k(3 * 4, 1.5f), v(3 * 4, -2.0f), kd(8 * 4, 7.0f), vd(8 * 4, 7.0f);
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                              (EncodePage(shape, TensorView(k.data(), DType::kF32, {3, 4}),
                                         TensorView(v.data(), DType::kF32, {3, 4}))));
  STRATA_ASSERT_OK_AND_ASSIGN(PageHeader h, VerifyPage(page));
  EXPECT_EQ(h.num_tokens, 3);
  STRATA_ASSERT_OK(DecodePage(page, kd.data(), vd.data()));
  for (int i = 0; i < 8 * 4; ++i) {
    EXPECT_EQ(kd[i], i < 12 ? 1.5f : 0.0f);
    EXPECT_EQ(vd[i], i < 12 ? -2.0f : 0.0f);
  }
}

TEST(PageFormatTest, EveryFlippedByteIsDetected) {
  const PageShape shape{DType::kBF16, 4, 8};
  std::vector<float> k(32, 0.25f), v(32, 0.5f);
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                              (EncodePage(shape, TensorView(k.data(), DType::kF32, {4, 8}),
                                         TensorView(v.data(), DType::kF32, {4, 8}))));
  for (size_t i = 0; i < page.size(); ++i) {
    std::string bad = page;
    bad[i] ^= 0x10;
    absl::StatusOr<PageHeader> h = VerifyPage(bad);
    ASSERT_FALSE(h.ok()) << "flip at byte " << i << " not detected";
    if (i >= kPageHeaderBytes) {
      EXPECT_THAT(h, StatusIs(absl::StatusCode::kDataLoss)) << i;
    }
  }
}

TEST(PageFormatTest, MalformedInputIsRejected) {
  const PageShape shape{DType::kBF16, 4, 8};
  std::vector<float> k(5 * 8), v(4 * 8);
  EXPECT_THAT(EncodePage(shape, TensorView(k.data(), DType::kF32, {5, 8}),
                         TensorView(v.data(), DType::kF32, {4, 8})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(EncodePage(shape, TensorView(k.data(), DType::kF32, {4, 7}),
                         TensorView(v.data(), DType::kF32, {4, 7})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(EncodePage(PageShape{DType::kF32, 4, 8}, TensorView(k.data(), DType::kF32, {4, 8}),
                         TensorView(v.data(), DType::kF32, {4, 8})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePageHeader("short"), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page,
                              (EncodePage(shape, TensorView(k.data(), DType::kF32, {4, 8}),
                                         TensorView(v.data(), DType::kF32, {4, 8}))));
  EXPECT_THAT(ParsePageHeader(page + "x"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParsePageHeader(page.substr(0, page.size() - 2)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PageFormatTest, SummaryFramingDetectsCorruption) {
  const std::string payload = "minmax summary bytes";
  std::string stored = EncodeSummary(payload);
  STRATA_ASSERT_OK_AND_ASSIGN(absl::string_view back, DecodeSummary(stored));
  EXPECT_EQ(back, payload);
  stored[10] ^= 1;
  EXPECT_THAT(DecodeSummary(stored), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeSummary("abc"), StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace strata::kvstore
