#include "kvstore/page_format.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvstore/page_store.h"

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

// kernels' EncodeFp8Pages (the CPU twin; the CUDA one is checked against it in cuda_backend_test)
// assembled with AssemblePage gives EncodePage's bytes, and its summary bounds the decoded keys as
// the worker's host path computes them: awkward values (NaN, inf, zeros of both signs, values in
// e4m3's subnormal range, rows past the valid ones holding garbage), two heads with interleaved
// slots, a partial last page.
TEST(PageFormatTest, EncodeFp8PagesOpGivesEncodePageBytes) {
  for (const auto [page, d] : {std::pair<int, int>{16, 32}, std::pair<int, int>{64, 128}}) {
    SCOPED_TRACE(::testing::Message() << "page " << page << " d " << d << " seed " << kSeed);
    std::mt19937 rng(kSeed + page);
    const int slots = 12, heads = 2, count = 4, last_valid = page / 2 - 1;
    const size_t pe = static_cast<size_t>(page) * d;
    std::vector<uint16_t> kpool(slots * pe), vpool(slots * pe);
    for (std::vector<uint16_t>* pool : {&kpool, &vpool}) {
      std::vector<float> f = RandomF32(pool->size(), &rng);
      for (size_t s = 0; s < static_cast<size_t>(slots); ++s) {
        const float mul = s % 3 == 0 ? 1e-3f : s % 3 == 1 ? 1.0f : 300.0f;
        for (size_t e = 0; e < pe; ++e) f[s * pe + e] *= mul;
      }
      f[3 * pe + 5] = NAN;                          // slot 3: a NaN (scale 1)
      f[6 * pe + 9] = INFINITY;                     // slot 6: inf (scale 1, saturates)
      std::fill(f.begin() + 7 * pe, f.begin() + 8 * pe, 0.0f);  // slot 7: all zero
      for (size_t e = 0; e < pe; e += 3) f[8 * pe + e] = e % 2 ? -0.0f : 0.0f;  // slot 8: signed zeros
      f[8 * pe + 1] = 1e-9f;                        // and e4m3 subnormals after scaling
      kernels::ConvertFromF32(f.data(), pool->data(), DType::kBF16, static_cast<int64_t>(f.size()));
    }
    kernels::EncodeFp8PagesParams p;
    p.k_pool = TensorView(kpool.data(), DType::kBF16, {slots, page, d});
    p.v_pool = TensorView(vpool.data(), DType::kBF16, {slots, page, d});
    p.first_slot = 1;
    p.head_slot_stride = 5;  // head 0: slots 1-4, head 1: slots 6-9 (last page partial)
    p.num_heads = heads;
    p.count = count;
    p.last_valid = last_valid;
    const int items = heads * count;
    std::vector<uint8_t> codes(items * 2 * pe);
    std::vector<float> scales(items * 2), sums(items * 2 * d);
    p.codes = TensorView(codes.data(), DType::kFP8E4M3, {items, 2, page, d});
    p.scales = TensorView(scales.data(), DType::kF32, {items, 2});
    p.summaries = TensorView(sums.data(), DType::kF32, {items, 2 * d});
    STRATA_ASSERT_OK(kernels::CpuEncodeFp8Pages(p));
    const PageShape shape{DType::kFP8E4M3, page, d};
    for (int i = 0; i < items; ++i) {
      const int g = i / count, j = i % count;
      const int slot = 1 + 5 * g + j, valid = j == count - 1 ? last_valid : page;
      STRATA_ASSERT_OK_AND_ASSIGN(
          const std::string want,
          EncodePage(shape, TensorView(kpool.data() + slot * pe, DType::kBF16, {valid, d}),
                     TensorView(vpool.data() + slot * pe, DType::kBF16, {valid, d})));
      std::string got(shape.EncodedBytes(), '\0');
      STRATA_ASSERT_OK(AssemblePage(shape, valid, scales[2 * i], scales[2 * i + 1], codes.data() + 2 * i * pe,
                                    codes.data() + (2 * i + 1) * pe, got.data()));
      ASSERT_EQ(got, want) << "item " << i << " (slot " << slot << ")";
      std::vector<float> kd(pe), vd(pe);
      STRATA_ASSERT_OK(DecodePage(got, kd.data(), vd.data()));
      for (int c = 0; c < d; ++c) {
        float lo = INFINITY, hi = -INFINITY;
        for (int t = 0; t < valid; ++t) {
          lo = std::min(lo, kd[t * d + c]);
          hi = std::max(hi, kd[t * d + c]);
        }
        ASSERT_EQ(std::memcmp(&sums[i * 2 * d + c], &lo, 4), 0) << "item " << i << " min " << c;
        ASSERT_EQ(std::memcmp(&sums[i * 2 * d + d + c], &hi, 4), 0) << "item " << i << " max " << c;
      }
    }
    // Refused: a slot outside the pools, a last page with no row, a codes view of the wrong size.
    kernels::EncodeFp8PagesParams bad = p;
    bad.head_slot_stride = 9;
    EXPECT_THAT(kernels::CpuEncodeFp8Pages(bad), StatusIs(absl::StatusCode::kInvalidArgument));
    bad = p;
    bad.last_valid = 0;
    EXPECT_THAT(kernels::CpuEncodeFp8Pages(bad), StatusIs(absl::StatusCode::kInvalidArgument));
    bad = p;
    bad.count = 3;
    EXPECT_THAT(kernels::CpuEncodeFp8Pages(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST(PageFormatTest, AssemblePageRefusesBadInputAndAllocatorExhaustionIsReported) {
  const PageShape shape{DType::kFP8E4M3, 4, 8};
  std::vector<uint8_t> codes(2 * 4 * 8, 0x38);
  std::string out(shape.EncodedBytes(), '\0');
  for (int bad : {-1, 5}) {
    EXPECT_THAT(AssemblePage(shape, bad, 1.0f, 1.0f, codes.data(), codes.data() + 32, out.data()),
                StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  EXPECT_THAT(AssemblePage(PageShape{DType::kF32, 4, 8}, 4, 1.0f, 1.0f, codes.data(), codes.data(), out.data()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK(AssemblePage(shape, 3, 0.5f, 2.0f, codes.data(), codes.data() + 32, out.data()));
  STRATA_ASSERT_OK_AND_ASSIGN(const PageHeader h, VerifyPage(out));
  EXPECT_EQ(h.num_tokens, 3);
  EXPECT_EQ(h.k_scale, 0.5f);
  EXPECT_EQ(h.v_scale, 2.0f);
  // An allocator with no memory: Allocate and Copy say so.
  struct Empty : PageAllocator {
    void* Allocate(size_t) override { return nullptr; }
    void Free(void*, size_t) override {}
  } empty;
  EXPECT_THAT(PageBuffer::Allocate(64, &empty), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(PageBuffer::Copy("bytes", &empty), StatusIs(absl::StatusCode::kResourceExhausted));
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
