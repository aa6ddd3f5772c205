// Tests of CpuPagedAttention / CpuMergeAttention against a naive double-precision softmax.
#include "kernels/cpu/cpu_backend.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace strata::kernels
