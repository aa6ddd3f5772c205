// Tests of CpuPagedAttention / CpuMergeAttention against a naive double-precision softmax.
#include "kernels/cpu/cpu_backend.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/internal/exp.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint32_t kSeed = 20261122;

// (STRATA_ASSERT_OK binds a reference to a temporary Status; this copies it.)
::testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << s;
}

struct Problem {
  int num_tokens = 1, num_q_heads = 8, num_kv_heads = 2, head_dim = 17;
  int num_slots = 12, page_size = 16;
  DType dtype = DType::kF32;
  bool causal = true;
  std::vector<float> q;
  std::vector<float> kf, vf;            // pool contents as f32 (already rounded for bf16)
  std::vector<uint16_t> kb, vb;         // bf16 pool storage
  std::vector<KvSpan> spans;
  std::vector<int32_t> offsets;
  std::vector<int32_t> q_positions;

  TensorView KPool() {
    return dtype == DType::kF32 ? TensorView(kf.data(), dtype, {num_slots, page_size, head_dim})
                                : TensorView(kb.data(), dtype, {num_slots, page_size, head_dim});
  }
  TensorView VPool() {
    return dtype == DType::kF32 ? TensorView(vf.data(), dtype, {num_slots, page_size, head_dim})
                                : TensorView(vb.data(), dtype, {num_slots, page_size, head_dim});
  }
};

// Random pools; spans: per KV head, a random subset of slots, each with a random sub-range,
// positions increasing (a sequence laid out page by page with gaps).
Problem MakeProblem(std::mt19937& rng, int num_tokens, int hq, int hkv, int d, DType dtype,
                    bool causal) {
  Problem p;
  p.num_tokens = num_tokens;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.dtype = dtype;
  p.causal = causal;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  p.q.resize(static_cast<size_t>(num_tokens) * hq * d);
  for (float& x : p.q) x = nd(rng) * 1.5f;
  const size_t pool = static_cast<size_t>(p.num_slots) * p.page_size * d;
  p.kf.resize(pool);
  p.vf.resize(pool);
  p.kb.resize(pool);
  p.vb.resize(pool);
  for (size_t i = 0; i < pool; ++i) {
    p.kb[i] = F32ToBF16(nd(rng));
    p.vb[i] = F32ToBF16(nd(rng));
    p.kf[i] = BF16ToF32(p.kb[i]);
    p.vf[i] = BF16ToF32(p.vb[i]);
  }
  std::uniform_int_distribution<int> slot_d(0, p.num_slots - 1);
  std::uniform_int_distribution<int> nspan_d(0, 5);
  p.offsets.push_back(0);
  int max_pos = 0;
  for (int g = 0; g < hkv; ++g) {
    int pos = 0;
    const int n = nspan_d(rng);
    for (int s = 0; s < n; ++s) {
      KvSpan span;
      span.slot = slot_d(rng);
      span.offset = std::uniform_int_distribution<int>(0, p.page_size - 1)(rng);
      span.length = std::uniform_int_distribution<int>(0, p.page_size - span.offset)(rng);
      pos += std::uniform_int_distribution<int>(0, 7)(rng);
      span.position = pos;
      pos += span.length;
      p.spans.push_back(span);
    }
    max_pos = std::max(max_pos, pos);
    p.offsets.push_back(static_cast<int32_t>(p.spans.size()));
  }
  for (int t = 0; t < num_tokens; ++t) {
    p.q_positions.push_back(std::uniform_int_distribution<int>(0, max_pos + 2)(rng));
  }
  return p;
}

void NaiveAttention(const Problem& p, float scale, std::vector<float>* out, std::vector<float>* lse) {
  const int d = p.head_dim, group = p.num_q_heads / p.num_kv_heads;
  out->assign(static_cast<size_t>(p.num_tokens) * p.num_q_heads * d, 0.0f);
  lse->assign(static_cast<size_t>(p.num_tokens) * p.num_q_heads, 0.0f);
  for (int t = 0; t < p.num_tokens; ++t) {
    for (int h = 0; h < p.num_q_heads; ++h) {
      const int g = h / group;
      const float* q = &p.q[(static_cast<size_t>(t) * p.num_q_heads + h) * d];
      std::vector<double> s;
      std::vector<const float*> vrows;
      for (int i = p.offsets[g]; i < p.offsets[g + 1]; ++i) {
        const KvSpan& sp = p.spans[i];
        for (int j = 0; j < sp.length; ++j) {
          if (p.causal && sp.position + j > p.q_positions[t]) continue;
          const size_t row = static_cast<size_t>(sp.slot) * p.page_size + sp.offset + j;
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * p.kf[row * d + c];
          s.push_back(dot * scale);
          vrows.push_back(&p.vf[row * d]);
        }
      }
      const size_t r = static_cast<size_t>(t) * p.num_q_heads + h;
      if (s.empty()) {
        (*lse)[r] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double m = s[0];
      for (double x : s) m = std::max(m, x);
      double sum = 0;
      for (double x : s) sum += std::exp(x - m);
      std::vector<double> acc(d, 0.0);
      for (size_t j = 0; j < s.size(); ++j) {
        const double w = std::exp(s[j] - m) / sum;
        for (int c = 0; c < d; ++c) acc[c] += w * vrows[j][c];
      }
      for (int c = 0; c < d; ++c) (*out)[r * d + c] = static_cast<float>(acc[c]);
      (*lse)[r] = static_cast<float>(m + std::log(sum));
    }
  }
}

absl::Status RunPaged(Problem& p, const std::vector<KvSpan>& spans,
                      const std::vector<int32_t>& offsets, float scale, std::vector<float>* out,
                      std::vector<float>* lse) {
  out->assign(static_cast<size_t>(p.num_tokens) * p.num_q_heads * p.head_dim, 12345.0f);  // poison
  lse->assign(static_cast<size_t>(p.num_tokens) * p.num_q_heads, 12345.0f);
  PagedAttentionParams a;
  a.q = TensorView(p.q.data(), DType::kF32, {p.num_tokens, p.num_q_heads, p.head_dim});
  a.k_pool = p.KPool();
  a.v_pool = p.VPool();
  a.spans = spans.data();
  a.span_offsets = offsets.data();
  a.num_kv_heads = p.num_kv_heads;
  a.q_positions = p.q_positions.data();
  a.causal = p.causal;
  a.scale = scale;
  a.out = TensorView(out->data(), DType::kF32, {p.num_tokens, p.num_q_heads, p.head_dim});
  a.lse = TensorView(lse->data(), DType::kF32, {p.num_tokens, p.num_q_heads});
  return CpuPagedAttention(a);
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float atol,
                 float rtol, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << what << " NaN at " << i;
    if (std::isinf(want[i])) {
      ASSERT_EQ(got[i], want[i]) << what << " at " << i;
      continue;
    }
    ASSERT_LE(std::fabs(got[i] - want[i]), atol + rtol * std::fabs(want[i]))
        << what << " at " << i << ": got " << got[i] << " want " << want[i] << " seed " << kSeed;
  }
}

struct Case {
  int num_tokens, head_dim;
  DType dtype;
  bool causal;
};

class PagedAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(PagedAttentionTest, MatchesNaiveSoftmax) {
  const Case c = GetParam();
  std::mt19937 rng(kSeed + c.head_dim * 31 + c.num_tokens);
  for (int trial = 0; trial < 20; ++trial) {
    Problem p = MakeProblem(rng, c.num_tokens, /*hq=*/8, /*hkv=*/2, c.head_dim, c.dtype, c.causal);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    std::vector<float> out, lse, ref_out, ref_lse;
    ASSERT_TRUE(IsOk(RunPaged(p, p.spans, p.offsets, scale, &out, &lse)));
    NaiveAttention(p, scale, &ref_out, &ref_lse);
    ExpectClose(out, ref_out, 2e-5f, 2e-4f, "out");
    ExpectClose(lse, ref_lse, 2e-5f, 2e-5f, "lse");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, PagedAttentionTest,
    ::testing::Values(Case{1, 1, DType::kF32, true}, Case{3, 3, DType::kF32, false},
                      Case{17, 17, DType::kF32, true}, Case{1, 129, DType::kF32, true},
                      Case{3, 129, DType::kBF16, true}, Case{17, 3, DType::kBF16, false},
                      Case{1, 17, DType::kBF16, false}, Case{3, 128, DType::kBF16, true}));

// Splitting each head's spans into parts (also splitting spans in the middle), attending each
// part and merging gives the whole.
TEST(MergeAttentionTest, SplitAttendMergeEqualsWhole) {
  std::mt19937 rng(kSeed);
  for (int trial = 0; trial < 30; ++trial) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      Problem p = MakeProblem(rng, 3, 8, 2, 33, dtype, trial % 2 == 0);
      const float scale = 0.2f;
      std::vector<float> whole_out, whole_lse;
      ASSERT_TRUE(IsOk(RunPaged(p, p.spans, p.offsets, scale, &whole_out, &whole_lse)));
      const int num_parts = 1 + trial % 4;
      std::vector<std::vector<KvSpan>> part_spans(num_parts);
      std::vector<std::vector<int32_t>> part_offsets(num_parts, std::vector<int32_t>{0});
      for (int g = 0; g < p.num_kv_heads; ++g) {
        for (int i = p.offsets[g]; i < p.offsets[g + 1]; ++i) {
          KvSpan s = p.spans[i];
          // Split the span in two at a random point; each half goes to a random part.
          const int cut = std::uniform_int_distribution<int>(0, s.length)(rng);
          KvSpan a = s, b = s;
          a.length = cut;
          b.offset = s.offset + cut;
          b.length = s.length - cut;
          b.position = s.position + cut;
          part_spans[rng() % num_parts].push_back(a);
          part_spans[rng() % num_parts].push_back(b);
        }
        for (int k = 0; k < num_parts; ++k) {
          part_offsets[k].push_back(static_cast<int32_t>(part_spans[k].size()));
        }
      }
      std::vector<std::vector<float>> outs(num_parts), lses(num_parts);
      std::vector<TensorView> out_views, lse_views;
      for (int k = 0; k < num_parts; ++k) {
        ASSERT_TRUE(IsOk(RunPaged(p, part_spans[k], part_offsets[k], scale, &outs[k], &lses[k])));
        out_views.emplace_back(outs[k].data(), DType::kF32,
                               std::initializer_list<int64_t>{3, 8, 33});
        lse_views.emplace_back(lses[k].data(), DType::kF32, std::initializer_list<int64_t>{3, 8});
      }
      std::vector<float> merged(whole_out.size(), 777.0f), merged_lse(whole_lse.size(), 777.0f);
      MergeAttentionParams m;
      m.outs = out_views.data();
      m.lses = lse_views.data();
      m.num_parts = num_parts;
      m.out = TensorView(merged.data(), DType::kF32, {3, 8, 33});
      m.lse = TensorView(merged_lse.data(), DType::kF32, {3, 8});
      ASSERT_TRUE(IsOk(CpuMergeAttention(m)));
      ExpectClose(merged, whole_out, 1e-5f, 1e-4f, "merged out");
      ExpectClose(merged_lse, whole_lse, 1e-5f, 1e-5f, "merged lse");
    }
  }
}

TEST(MergeAttentionTest, AllEmptyGivesZeroAndNegInf) {
  std::vector<float> o1(4, 0.0f), o2(4, 0.0f), l1(2, -INFINITY), l2(2, -INFINITY);
  std::vector<float> out(4, 9.0f), lse(2, 9.0f);
  TensorView outs[2] = {TensorView(o1.data(), DType::kF32, {1, 2, 2}),
                        TensorView(o2.data(), DType::kF32, {1, 2, 2})};
  TensorView lses[2] = {TensorView(l1.data(), DType::kF32, {1, 2}),
                        TensorView(l2.data(), DType::kF32, {1, 2})};
  MergeAttentionParams m;
  m.outs = outs;
  m.lses = lses;
  m.num_parts = 2;
  m.out = TensorView(out.data(), DType::kF32, {1, 2, 2});
  m.lse = TensorView(lse.data(), DType::kF32, {1, 2});
  ASSERT_TRUE(IsOk(CpuMergeAttention(m)));
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -INFINITY);
  m.num_parts = 0;
  EXPECT_THAT(CpuMergeAttention(m), StatusIs(absl::StatusCode::kInvalidArgument));
  m.num_parts = 2;
  m.lse = TensorView(lse.data(), DType::kF32, {2, 1});
  EXPECT_THAT(CpuMergeAttention(m), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(PagedAttentionTest, NothingAttendedGivesZeroAndNegInf) {
  std::mt19937 rng(kSeed);
  Problem p = MakeProblem(rng, 2, 4, 1, 8, DType::kF32, true);
  p.spans = {KvSpan{0, 0, 4, 100}};  // all keys after the queries
  p.offsets = {0, 1};
  p.q_positions = {10, 99};
  std::vector<float> out, lse;
  ASSERT_TRUE(IsOk(RunPaged(p, p.spans, p.offsets, 0.3f, &out, &lse)));
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -INFINITY);
  p.offsets = {0, 0};  // no spans at all
  ASSERT_TRUE(IsOk(RunPaged(p, p.spans, p.offsets, 0.3f, &out, &lse)));
  for (float x : lse) EXPECT_EQ(x, -INFINITY);
}

TEST(PagedAttentionTest, RejectsBadSpansAndShapes) {
  std::mt19937 rng(kSeed);
  Problem p = MakeProblem(rng, 1, 4, 1, 8, DType::kF32, false);
  std::vector<float> out, lse;
  const std::vector<int32_t> off = {0, 1};
  EXPECT_THAT(RunPaged(p, {KvSpan{p.num_slots, 0, 1, 0}}, off, 1.0f, &out, &lse),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside pool")));
  EXPECT_THAT(RunPaged(p, {KvSpan{-1, 0, 1, 0}}, off, 1.0f, &out, &lse),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(RunPaged(p, {KvSpan{0, p.page_size - 2, 3, 0}}, off, 1.0f, &out, &lse),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(RunPaged(p, {KvSpan{0, -1, 1, 0}}, off, 1.0f, &out, &lse),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Poisoned outputs untouched on error.
  EXPECT_EQ(out[0], 12345.0f);
  // 4 query heads over 3 KV heads is not GQA.
  p.num_kv_heads = 3;
  EXPECT_THAT(RunPaged(p, {}, {0, 0, 0, 0}, 1.0f, &out, &lse),
              StatusIs(absl::StatusCode::kInvalidArgument));
}


// ---- fp8 pools (kernels/backend.h "fp8 KV pools") --------------------------------------------

// Random fp8 codes (NaN codes 0x7f / 0xff excluded) and the f32 pool they stand for,
// FP8E4M3ToF32(code) * scale.
void RandomFp8(std::mt19937& rng, size_t n, float scale, std::vector<uint8_t>* codes,
               std::vector<float>* values) {
  codes->resize(n);
  values->resize(n);
  for (size_t i = 0; i < n; ++i) {
    uint8_t c;
    do {
      c = static_cast<uint8_t>(rng());
    } while ((c & 0x7f) == 0x7f || (c & 0x78) == 0x78);  // no NaN, |x| < 256
    (*codes)[i] = c;
    (*values)[i] = FP8E4M3ToF32(c) * scale;
  }
}

// PagedAttention over fp8 pools equals PagedAttention over the f32 pools of the dequantised
// values (the CPU reads stored * scale into f32 and runs the same f32 math): bit for bit.
TEST(PagedAttentionFp8Test, EqualsF32OnDequantisedValues) {
  std::mt19937 rng(kSeed + 8);
  for (int tokens : {1, 3, 17}) {
    for (int d : {64, 128}) {
      Problem f = MakeProblem(rng, tokens, 8, 2, d, DType::kF32, /*causal=*/true);
      const size_t n = f.kf.size();
      std::vector<uint8_t> k8, v8;
      const float k_scale = 0.043f, v_scale = 1.7f;
      RandomFp8(rng, n, k_scale, &k8, &f.kf);
      RandomFp8(rng, n, v_scale, &v8, &f.vf);
      const int64_t rows = static_cast<int64_t>(tokens) * f.num_q_heads;
      std::vector<float> out32(rows * d), lse32(rows), out8(rows * d, NAN), lse8(rows, NAN);
      PagedAttentionParams p;
      p.q = TensorView(f.q.data(), DType::kF32, {tokens, f.num_q_heads, d});
      p.k_pool = f.KPool();
      p.v_pool = f.VPool();
      p.spans = f.spans.data();
      p.span_offsets = f.offsets.data();
      p.num_kv_heads = f.num_kv_heads;
      p.q_positions = f.q_positions.data();
      p.causal = true;
      p.scale = 1.0f / std::sqrt(static_cast<float>(d));
      p.out = TensorView(out32.data(), DType::kF32, {tokens, f.num_q_heads, d});
      p.lse = TensorView(lse32.data(), DType::kF32, {tokens, f.num_q_heads});
      ASSERT_TRUE(IsOk(CpuPagedAttention(p)));
      PagedAttentionParams p8 = p;
      p8.k_pool = TensorView(k8.data(), DType::kFP8E4M3, {f.num_slots, f.page_size, d});
      p8.v_pool = TensorView(v8.data(), DType::kFP8E4M3, {f.num_slots, f.page_size, d});
      p8.k_scale = k_scale;
      p8.v_scale = v_scale;
      p8.out = TensorView(out8.data(), DType::kF32, {tokens, f.num_q_heads, d});
      p8.lse = TensorView(lse8.data(), DType::kF32, {tokens, f.num_q_heads});
      ASSERT_TRUE(IsOk(CpuPagedAttention(p8)));
      int attended = 0;
      for (float x : lse32) attended += std::isfinite(x) ? 1 : 0;
      EXPECT_GT(attended, 0) << "no row attended anything: the comparison would be vacuous";
      EXPECT_EQ(out8, out32) << tokens << " tokens, d " << d;
      EXPECT_EQ(lse8, lse32) << tokens << " tokens, d " << d;
      // Scales: finite and > 0 for fp8; exactly 1 for f32|bf16.
      p8.k_scale = 0.0f;
      EXPECT_THAT(CpuPagedAttention(p8), StatusIs(absl::StatusCode::kInvalidArgument));
      p8.k_scale = std::numeric_limits<float>::infinity();
      EXPECT_THAT(CpuPagedAttention(p8), StatusIs(absl::StatusCode::kInvalidArgument));
      p.v_scale = 2.0f;
      EXPECT_THAT(CpuPagedAttention(p), StatusIs(absl::StatusCode::kInvalidArgument));
    }
  }
}

// SelectedAttention (CPU twin in kernels/cpu/selection.cc) over fp8 pools: the same bit-for-bit
// equality with f32 pools of the dequantised values, through a page table with a missing page.
TEST(SelectedAttentionFp8Test, EqualsF32OnDequantisedValues) {
  std::mt19937 rng(kSeed + 9);
  auto cpu = MakeCpuBackend(1);
  for (int64_t d : {64, 128}) {
    const int64_t hkv = 2, hq = 6, page = 16, slots = 9, pages = 4;
    std::vector<float> q(hq * d);
    std::uniform_real_distribution<float> u(-2, 2);
    for (float& x : q) x = u(rng);
    std::vector<uint8_t> k8, v8;
    std::vector<float> kf, vf;
    RandomFp8(rng, slots * page * d, 0.05f, &k8, &kf);
    RandomFp8(rng, slots * page * d, 3.0f, &v8, &vf);
    std::vector<int32_t> table = {3, 0, 7, -1, 8, 2, 99, 5};  // [hkv, pages]: gaps skipped
    std::vector<float> out32(hq * d), lse32(hq), out8(hq * d, NAN), lse8(hq, NAN);
    SelectedAttentionParams p;
    p.q = TensorView(q.data(), DType::kF32, {1, hq, d});
    p.k_pool = TensorView(kf.data(), DType::kF32, {slots, page, d});
    p.v_pool = TensorView(vf.data(), DType::kF32, {slots, page, d});
    p.page_table = TensorView(table.data(), DType::kI32, {hkv, pages});
    p.prefix_end = 5;
    p.middle.begin = 9;
    p.middle.end = 40;
    p.suffix_begin = 50;
    p.suffix_end = 63;
    p.scale = 1.0f / std::sqrt(static_cast<float>(d));
    p.out = TensorView(out32.data(), DType::kF32, {1, hq, d});
    p.lse = TensorView(lse32.data(), DType::kF32, {1, hq});
    ASSERT_TRUE(IsOk(cpu->SelectedAttention(p, nullptr)));
    SelectedAttentionParams p8 = p;
    p8.k_pool = TensorView(k8.data(), DType::kFP8E4M3, {slots, page, d});
    p8.v_pool = TensorView(v8.data(), DType::kFP8E4M3, {slots, page, d});
    p8.k_scale = 0.05f;
    p8.v_scale = 3.0f;
    p8.out = TensorView(out8.data(), DType::kF32, {1, hq, d});
    p8.lse = TensorView(lse8.data(), DType::kF32, {1, hq});
    ASSERT_TRUE(IsOk(cpu->SelectedAttention(p8, nullptr)));
    for (float x : lse32) EXPECT_TRUE(std::isfinite(x));
    EXPECT_EQ(out8, out32) << "d " << d;
    EXPECT_EQ(lse8, lse32) << "d " << d;
    p8.v_scale = -1.0f;
    EXPECT_THAT(cpu->SelectedAttention(p8, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

}  // namespace
}  // namespace strata::kernels

namespace strata::kernels {
namespace {

// The softmax weights' exponential against std::exp: within 1 ulp on every 64th float of
// [-87.3, 0] (about 17M values), 0 below, NaN for NaN.
TEST(ExpNonPositiveTest, WithinOneUlpOfStdExp) {
  int64_t worst = 0;
  float worst_x = 0.0f;
  int64_t checked = 0;
  uint32_t bits = 0x80000000u;  // -0.0f; increasing bits walk down through the negative floats
  for (;; bits += 64) {
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    if (x < -87.3f) break;
    const float want = std::exp(x), got = cpu_internal::ExpNonPositive(x);
    int32_t a, b;
    std::memcpy(&a, &want, sizeof(a));
    std::memcpy(&b, &got, sizeof(b));
    const int64_t ulps = a > b ? int64_t{a} - b : int64_t{b} - a;
    if (ulps > worst) worst = ulps, worst_x = x;
    ++checked;
  }
  EXPECT_LE(worst, 1) << "at x = " << worst_x << " (" << checked << " values)";
  EXPECT_GT(checked, 10000000);
  EXPECT_EQ(cpu_internal::ExpNonPositive(0.0f), 1.0f);
  EXPECT_EQ(cpu_internal::ExpNonPositive(-87.31f), 0.0f);
  EXPECT_EQ(cpu_internal::ExpNonPositive(-1e6f), 0.0f);
  EXPECT_EQ(cpu_internal::ExpNonPositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(cpu_internal::ExpNonPositive(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace strata::kernels
