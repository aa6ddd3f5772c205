// Tests of the paged KV cache and the dense policy (through CpuPagedAttention).
#include "engine/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine {
namespace {

using ::strata::testing::StatusIs;
using kernels::DType;
using kernels::TensorView;

constexpr uint32_t kSeed = 7321;

::testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << s;
}

TEST(KvCacheOptionsTest, Validate) {
  KvCacheOptions o{2, 2, 8, 16, DType::kF32, 100};
  EXPECT_TRUE(o.Validate().ok());
  KvCacheOptions bad = o;
  bad.page_size = 0;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = o;
  bad.dtype = DType::kI32;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  KvCacheOptions fp8 = o;
  fp8.dtype = DType::kFP8E4M3;
  fp8.k_scale = 0.5f;
  EXPECT_TRUE(fp8.Validate().ok());
  bad = fp8;
  bad.v_scale = 0.0f;  // scales must be finite and > 0
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  bad.v_scale = NAN;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = o;
  bad.k_scale = 0.5f;  // and 1 for f32|bf16
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = o;
  bad.max_tokens = 0;
  EXPECT_THAT(bad.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
}

class KvCacheTest : public ::testing::TestWithParam<DType> {};

TEST_P(KvCacheTest, AppendStoresRowsWhereSpansSayAndDenseAttentionIsExact) {
  const DType dtype = GetParam();
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  KvCacheOptions o;
  o.num_layers = 2;
  o.num_kv_heads = 2;
  o.head_dim = 5;
  o.page_size = 7;
  o.dtype = dtype;
  o.max_tokens = 60;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> cache, KvCache::Create(o, backend.get()));
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> nd;
  // Tokens kept on the side as reference: [pos][g][d].
  std::vector<float> all_k, all_v;
  int64_t len = 0;
  for (int chunk : {1, 3, 17, 6, 1, 20}) {
    std::vector<float> k(chunk * 2 * 5), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    all_k.insert(all_k.end(), k.begin(), k.end());
    all_v.insert(all_v.end(), v.begin(), v.end());
    for (int layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE(IsOk(cache->Append(layer, TensorView(k.data(), DType::kF32, {chunk, 2, 5}),
                                     TensorView(v.data(), DType::kF32, {chunk, 2, 5}))));
    }
    len += chunk;
  }
  ASSERT_EQ(cache->length(1), len);
  EXPECT_EQ(cache->num_pages(1), (len + 6) / 7);
  // Every row lands where AppendSpans points.
  const TensorView kp = cache->k_pool(1);
  std::vector<kernels::KvSpan> spans;
  for (int g = 0; g < 2; ++g) {
    spans.clear();
    cache->AppendSpans(1, g, 3, len + 100, &spans);  // end clipped to the length
    int64_t pos = 3;
    for (const kernels::KvSpan& s : spans) {
      ASSERT_EQ(s.position, pos);
      ASSERT_LE(s.offset + s.length, 7);
      for (int j = 0; j < s.length; ++j, ++pos) {
        for (int c = 0; c < 5; ++c) {
          const size_t row = (static_cast<size_t>(s.slot) * 7 + s.offset + j) * 5 + c;
          float got = dtype == DType::kF32 ? kp.As<float>()[row]
                                           : kernels::BF16ToF32(kp.As<uint16_t>()[row]);
          float want = all_k[(pos * 2 + g) * 5 + c];
          if (dtype == DType::kBF16) want = kernels::BF16ToF32(kernels::F32ToBF16(want));
          ASSERT_EQ(got, want) << "pos " << pos << " g " << g;
        }
      }
    }
    ASSERT_EQ(pos, len);
  }
  // Dense policy + paged attention = naive attention over all tokens.
  std::unique_ptr<AttentionPolicy> dense = MakeDensePolicy();
  const int hq = 4, nt = 2;
  std::vector<float> q(nt * hq * 5);
  for (float& x : q) x = nd(rng);
  Selection sel;
  ASSERT_TRUE(IsOk(dense->Select(1, q.data(), nt, hq, len - nt, *cache, &sel)));
  ASSERT_EQ(sel.offsets.size(), 3u);
  std::vector<float> out(q.size()), lse(nt * hq);
  std::vector<int32_t> qpos = {static_cast<int32_t>(len - 2), static_cast<int32_t>(len - 1)};
  kernels::PagedAttentionParams p;
  p.q = TensorView(q.data(), DType::kF32, {nt, hq, 5});
  p.k_pool = cache->k_pool(1);
  p.v_pool = cache->v_pool(1);
  p.spans = sel.spans.data();
  p.span_offsets = sel.offsets.data();
  p.num_kv_heads = 2;
  p.q_positions = qpos.data();
  p.scale = 0.4f;
  p.out = TensorView(out.data(), DType::kF32, {nt, hq, 5});
  p.lse = TensorView(lse.data(), DType::kF32, {nt, hq});
  ASSERT_TRUE(IsOk(kernels::CpuPagedAttention(p)));
  for (int t = 0; t < nt; ++t) {
    for (int h = 0; h < hq; ++h) {
      const int g = h / 2;
      double m = -1e30, sum = 0;
      std::vector<double> s(qpos[t] + 1), acc(5, 0.0);
      auto rd = [&](const std::vector<float>& a, size_t i) {
        return dtype == DType::kF32 ? a[i] : kernels::BF16ToF32(kernels::F32ToBF16(a[i]));
      };
      for (int j = 0; j <= qpos[t]; ++j) {
        double dot = 0;
        for (int c = 0; c < 5; ++c) dot += q[(t * hq + h) * 5 + c] * rd(all_k, (j * 2 + g) * 5 + c);
        s[j] = 0.4 * dot;
        m = std::max(m, s[j]);
      }
      for (int j = 0; j <= qpos[t]; ++j) {
        const double w = std::exp(s[j] - m);
        sum += w;
        for (int c = 0; c < 5; ++c) acc[c] += w * rd(all_v, (j * 2 + g) * 5 + c);
      }
      for (int c = 0; c < 5; ++c) {
        EXPECT_NEAR(out[(t * hq + h) * 5 + c], acc[c] / sum, 1e-5);
      }
      EXPECT_NEAR(lse[t * hq + h], m + std::log(sum), 1e-5);
    }
  }
  EXPECT_EQ(dense->counters().selected_tokens, 2 * len);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvCacheTest, ::testing::Values(DType::kF32, DType::kBF16));

// fp8 caches store each value as AppendKv does: F32ToFP8E4M3 of value / scale, per tensor.
TEST(KvCacheTest, Fp8AppendStoresScaledCodes) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  KvCacheOptions o{2, 2, 8, 4, DType::kFP8E4M3, 20};
  o.k_scale = 0.125f;
  o.v_scale = 3.0f;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> cache, KvCache::Create(o, backend.get()));
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> nd(0.0f, 20.0f);
  std::vector<float> k(7 * 2 * 8), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = nd(rng), v[i] = nd(rng);
  k[3] = 1e6f;  // saturates to +448 * scale
  for (int l = 0; l < 2; ++l) {
    for (int64_t first : {0, 3}) {  // two appends: [0, 3) and [3, 7)
      const int64_t n = first == 0 ? 3 : 4;
      STRATA_ASSERT_OK(cache->Append(l, TensorView(k.data() + first * 16, DType::kF32, {n, 2, 8}),
                                     TensorView(v.data() + first * 16, DType::kF32, {n, 2, 8})));
    }
    const auto* kp = static_cast<const uint8_t*>(cache->k_pool(l).data);
    const auto* vp = static_cast<const uint8_t*>(cache->v_pool(l).data);
    for (int64_t t = 0; t < 7; ++t) {
      for (int g = 0; g < 2; ++g) {
        const int64_t row = static_cast<int64_t>(cache->SlotOf(l, g, t / 4)) * 4 + t % 4;
        for (int e = 0; e < 8; ++e) {
          const size_t src = (static_cast<size_t>(t) * 2 + g) * 8 + e;
          ASSERT_EQ(kp[row * 8 + e], kernels::F32ToFP8E4M3(k[src] / o.k_scale)) << t << " " << g;
          ASSERT_EQ(vp[row * 8 + e], kernels::F32ToFP8E4M3(v[src] / o.v_scale)) << t << " " << g;
        }
      }
    }
  }
  EXPECT_EQ(kernels::FP8E4M3ToF32(static_cast<const uint8_t*>(cache->k_pool(0).data)[3]), 448.0f);
  EXPECT_EQ(cache->k_pool(0).dtype, DType::kFP8E4M3);
}

// PageTable: every layer's slots, -1 past the cache's pages, cut at the width asked.
TEST(KvCacheTest, PageTableHoldsTheSlotsOfEveryLayer) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  const KvCacheOptions o{2, 3, 4, 8, DType::kF32, 20};  // 3 pages per KV head
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> cache, KvCache::Create(o, backend.get()));
  ASSERT_EQ(cache->pages_per_head(), 3);
  for (const int64_t width : {3, 5, 2}) {
    SCOPED_TRACE(width);
    const std::vector<int32_t> t = cache->PageTable(width);
    ASSERT_EQ(t.size(), static_cast<size_t>(3 * width));
    for (int g = 0; g < 3; ++g) {
      for (int64_t p = 0; p < width; ++p) {
        const int32_t want = p < 3 ? cache->SlotOf(1, g, p) : -1;
        EXPECT_EQ(t[g * width + p], want) << g << " " << p;
        if (p < 3) EXPECT_EQ(cache->SlotOf(0, g, p), cache->SlotOf(1, g, p));
      }
    }
  }
}

TEST(KvCacheTest, RejectsOverflowAndBadShapes) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  KvCacheOptions o{1, 2, 4, 8, DType::kF32, 10};
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> cache, KvCache::Create(o, backend.get()));
  std::vector<float> k(11 * 2 * 4);
  EXPECT_THAT(cache->Append(0, TensorView(k.data(), DType::kF32, {11, 2, 4}),
                            TensorView(k.data(), DType::kF32, {11, 2, 4})),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(cache->Append(0, TensorView(k.data(), DType::kF32, {2, 4, 2}),
                            TensorView(k.data(), DType::kF32, {2, 4, 2})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(cache->Append(3, TensorView(k.data(), DType::kF32, {2, 2, 4}),
                            TensorView(k.data(), DType::kF32, {2, 2, 4})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(cache->length(0), 0);
  EXPECT_TRUE(IsOk(cache->Append(0, TensorView(k.data(), DType::kF32, {10, 2, 4}),
                                 TensorView(k.data(), DType::kF32, {10, 2, 4}))));
}

// A CPU backend that calls itself a device: KvCache then appends with AppendKv, or, when the
// backend lacks it (`append_kv` false), continues pages from its last-page mirror.
class DeviceNamedBackend : public kernels::CpuBackend {
 public:
  explicit DeviceNamedBackend(bool append_kv) : kernels::CpuBackend(1), append_kv_(append_kv) {}
  std::string Name() const override { return "cuda:test"; }
  absl::Status AppendKv(const kernels::AppendKvParams& p, kernels::Stream s) override {
    if (!append_kv_) return absl::UnimplementedError("no AppendKv");
    return kernels::CpuBackend::AppendKv(p, s);
  }

 private:
  bool append_kv_;
};

// AppendPages of whole pages, then of a partial page, then Append continuing that page, against
// Append alone: every stored row equal, on the CPU backend, on a device-named one with AppendKv
// and on one continuing pages from the mirror.
TEST(KvCacheTest, AppendPagesStoresWhatAppendStores) {
  for (const int mode : {0, 1, 2}) {
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << (mode == 0 ? "cpu " : mode == 1 ? "AppendKv " : "mirror ")
                                        << kernels::DTypeName(dtype));
      std::unique_ptr<kernels::Backend> backend;
      if (mode == 0) {
        backend = kernels::MakeCpuBackend(1);
      } else {
        backend = std::make_unique<DeviceNamedBackend>(mode == 1);
      }
      constexpr int L = 2, H = 2, D = 4, P = 8;
      constexpr int64_t T = 3 * P + 5;  // 2 whole pages, then 11 tokens (a page and 3), then 2 more
      const KvCacheOptions o{L, H, D, P, dtype, 40};
      STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> ref, KvCache::Create(o, backend.get()));
      STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> cache, KvCache::Create(o, backend.get()));
      std::mt19937 rng(kSeed);
      std::normal_distribution<float> nd;
      std::vector<float> k(T * H * D), v(T * H * D);
      for (float& x : k) x = nd(rng);
      for (float& x : v) x = nd(rng);
      for (int l = 0; l < L; ++l) {
        ASSERT_TRUE(IsOk(ref->Append(l, TensorView(k.data(), DType::kF32, {T, H, D}),
                                     TensorView(v.data(), DType::kF32, {T, H, D}))));
      }
      const size_t esize = kernels::DTypeSize(dtype), row = D * esize;
      const size_t page_bytes = kernels::PageCopyBytes(P, D, dtype);
      // Staging pages [p0, p0 + count) of `layer` from the reference's pools, rows past `end` zero.
      auto stage = [&](int layer, int64_t p0, int64_t count, int64_t end, kernels::Buffer* staging) {
        char* out = static_cast<char*>(staging->data());
        std::memset(out, 0, static_cast<size_t>(count) * H * page_bytes);
        const char* kp = static_cast<const char*>(ref->k_pool(layer).data);
        const char* vp = static_cast<const char*>(ref->v_pool(layer).data);
        for (int64_t j = 0; j < count; ++j) {
          for (int g = 0; g < H; ++g) {
            char* dst = out + static_cast<size_t>(j * H + g) * page_bytes;
            const int64_t p = p0 + j;
            const int64_t rows = std::min<int64_t>(P, end - p * P);
            const size_t at = static_cast<size_t>(ref->SlotOf(layer, g, p)) * P * row;
            std::memcpy(dst, kp + at, rows * row);
            std::memcpy(dst + P * row, vp + at, rows * row);
          }
        }
      };
      STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<kernels::Buffer> staging,
                                  backend->AllocateHost(2 * H * page_bytes));
      STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<kernels::Buffer> slots,
                                  backend->AllocateHost(2 * H * sizeof(int32_t)));
      int32_t* sl = static_cast<int32_t*>(slots->data());
      for (int l = 0; l < L; ++l) {
        stage(l, 0, 2, T, staging.get());
        ASSERT_TRUE(IsOk(cache->AppendPages(l, 2 * P, staging->data(), 2 * H * page_bytes, sl)));
        ASSERT_TRUE(IsOk(backend->Synchronize(nullptr)));
        EXPECT_EQ(cache->length(l), 2 * P);
        // Not a whole page's start / staging too short: refused, nothing changed.
        EXPECT_THAT(cache->AppendPages(l, P + 3, staging->data(), H * page_bytes, sl),
                    StatusIs(absl::StatusCode::kInvalidArgument));
        stage(l, 2, 2, 3 * P + 3, staging.get());
        ASSERT_TRUE(IsOk(cache->AppendPages(l, P + 3, staging->data(), 2 * H * page_bytes, sl)));
        ASSERT_TRUE(IsOk(backend->Synchronize(nullptr)));
        EXPECT_THAT(cache->AppendPages(l, P, staging->data(), 2 * H * page_bytes, sl),
                    StatusIs(absl::StatusCode::kInvalidArgument));
        const int64_t done = 3 * P + 3;
        ASSERT_TRUE(IsOk(cache->Append(l, TensorView(k.data() + done * H * D, DType::kF32, {T - done, H, D}),
                                       TensorView(v.data() + done * H * D, DType::kF32, {T - done, H, D}))));
        ASSERT_TRUE(IsOk(backend->Synchronize(nullptr)));
        ASSERT_EQ(cache->length(l), T);
        for (int g = 0; g < H; ++g) {
          for (int64_t t = 0; t < T; ++t) {
            const size_t at = (static_cast<size_t>(cache->SlotOf(l, g, t / P)) * P + t % P) * row;
            for (const bool is_k : {true, false}) {
              const char* a = static_cast<const char*>((is_k ? cache->k_pool(l) : cache->v_pool(l)).data) + at;
              const char* b = static_cast<const char*>((is_k ? ref->k_pool(l) : ref->v_pool(l)).data) + at;
              ASSERT_EQ(std::memcmp(a, b, row), 0) << "layer " << l << " head " << g << " token " << t
                                                   << (is_k ? " K" : " V");
            }
          }
        }
      }
      // Past max_tokens: refused.
      STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> small,
                                  KvCache::Create(KvCacheOptions{L, H, D, P, dtype, P + 1}, backend.get()));
      EXPECT_THAT(small->AppendPages(0, 2 * P, staging->data(), 2 * H * page_bytes, sl),
                  StatusIs(absl::StatusCode::kResourceExhausted));
      EXPECT_EQ(small->length(0), 0);
    }
  }
}

}  // namespace
}  // namespace strata::engine
