// Backend::SelectStages on the CPU backend (SelectStagesOpByOp, the attention checked first): the
// same selections as the ScoreSummaries / ScoreKeys and VoteTopK calls it stands for, the chain
// checks, errors of the ops passed through, skip_heads, and the attention after the stages
// (`attend`; one the backend refuses fails the op before any stage writes).
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

constexpr int kHkv = 3, kGroup = 2, kD = 16, kPage = 8, kSegPages = 4, kPages = 40;
constexpr int kSegs = kPages / kSegPages;
constexpr int64_t kKeepSegs = 4, kKPages = 6, kKTokens = 20;

// A three-stage chain (segments -> pages -> tokens) over random host data.
class SelectStagesOpByOpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cpu_ = MakeCpuBackend(1);
    std::mt19937 rng(20261128);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, size_t n) {
      v.resize(n);
      for (float& x : v) x = u(rng);
    };
    fill(q_, kHkv * kGroup * kD);
    fill(segs_, kHkv * kSegs * 2 * kD);
    fill(pages_, kHkv * kPages * 2 * kD);
    fill(pool_, kHkv * kPages * kPage * kD);
    table_.resize(kHkv * kPages);
    for (int i = 0; i < kHkv * kPages; ++i) table_[i] = i;
    seg_scores_.assign(kHkv * kGroup * kSegs, 0.0f);
    page_scores_.assign(kHkv * kGroup * kKeepSegs * kSegPages, 0.0f);
    tok_scores_.assign(kHkv * kGroup * kKPages * kPage, 0.0f);
    top_segs_.assign(kHkv * kKeepSegs, -7);
    top_pages_.assign(kHkv * kKPages, -7);
    top_tokens_.assign(kHkv * kKTokens, -7);
  }

  SelectStagesParams Params() {
    SelectStagesParams p;
    p.q = TensorView(q_.data(), DType::kF32, {kHkv * kGroup, kD});
    p.scale = 0.25f;
    p.num_stages = 3;
    SelectStage& s = p.stages[0];
    s.summaries = TensorView(segs_.data(), DType::kF32, {kHkv, kSegs, 2 * kD});
    s.candidates.begin = 0;
    s.candidates.end = kSegs;
    s.k = kKeepSegs;
    s.scores = TensorView(seg_scores_.data(), DType::kF32, {kHkv, kGroup, kSegs});
    s.selected = TensorView(top_segs_.data(), DType::kI32, {kHkv, kKeepSegs});
    SelectStage& pg = p.stages[1];
    pg.summaries = TensorView(pages_.data(), DType::kF32, {kHkv, kPages, 2 * kD});
    pg.candidates.parents = s.selected;
    pg.candidates.fanout = kSegPages;
    pg.candidates.begin = 1;
    pg.candidates.end = kPages - 1;
    pg.k = kKPages;
    pg.scores = TensorView(page_scores_.data(), DType::kF32, {kHkv, kGroup, kKeepSegs * kSegPages});
    pg.selected = TensorView(top_pages_.data(), DType::kI32, {kHkv, kKPages});
    SelectStage& kt = p.stages[2];
    kt.k_pool = TensorView(pool_.data(), DType::kF32, {kHkv * kPages, kPage, kD});
    kt.page_table = TensorView(table_.data(), DType::kI32, {kHkv, kPages});
    kt.candidates.parents = pg.selected;
    kt.candidates.fanout = kPage;
    kt.candidates.begin = 3;
    kt.candidates.end = kPages * kPage - 5;
    kt.k = kKTokens;
    kt.scores = TensorView(tok_scores_.data(), DType::kF32, {kHkv, kGroup, kKPages * kPage});
    kt.selected = TensorView(top_tokens_.data(), DType::kI32, {kHkv, kKTokens});
    return p;
  }

  // The step's attention over the last stage of p: sinks [0, 3), p's selected tokens in the
  // middle, the last 5 tokens as the window; V from `v`, outputs into `out` and `lse`.
  SelectedAttentionParams Attention(const SelectStagesParams& p, std::vector<float>& v,
                                    std::vector<float>& out, std::vector<float>& lse) {
    SelectedAttentionParams at;
    at.q = TensorView(q_.data(), DType::kF32, {1, kHkv * kGroup, kD});
    at.k_pool = p.stages[2].k_pool;
    at.v_pool = TensorView(v.data(), DType::kF32, {kHkv * kPages, kPage, kD});
    at.page_table = p.stages[2].page_table;
    at.prefix_end = 3;
    at.middle.parents = p.stages[2].selected;
    at.middle.begin = 3;
    at.middle.end = kPages * kPage - 5;
    at.suffix_begin = kPages * kPage - 5;
    at.suffix_end = kPages * kPage;
    at.scale = p.scale;
    at.out = TensorView(out.data(), DType::kF32, {1, kHkv * kGroup, kD});
    at.lse = TensorView(lse.data(), DType::kF32, {1, kHkv * kGroup});
    return at;
  }

  std::unique_ptr<Backend> cpu_;
  std::vector<float> q_, segs_, pages_, pool_, seg_scores_, page_scores_, tok_scores_;
  std::vector<int32_t> table_, top_segs_, top_pages_, top_tokens_;
};

TEST_F(SelectStagesOpByOpTest, SelectsAsTheOpsOneByOne) {
  const SelectStagesParams p = Params();
  // The ops by hand first.
  for (int i = 0; i < p.num_stages; ++i) {
    const SelectStage& st = p.stages[i];
    if (st.summaries.data != nullptr) {
      ScoreSummariesParams a;
      a.q = p.q;
      a.summaries = st.summaries;
      a.candidates = st.candidates;
      a.scale = p.scale;
      a.scores = st.scores;
      STRATA_ASSERT_OK(cpu_->ScoreSummaries(a, nullptr));
    } else {
      ScoreKeysParams k;
      k.q = p.q;
      k.k_pool = st.k_pool;
      k.page_table = st.page_table;
      k.candidates = st.candidates;
      k.scale = p.scale;
      k.scores = st.scores;
      STRATA_ASSERT_OK(cpu_->ScoreKeys(k, nullptr));
    }
    VoteTopKParams t;
    t.scores = st.scores;
    t.candidates = st.candidates;
    t.k = st.k;
    t.selected = st.selected;
    STRATA_ASSERT_OK(cpu_->VoteTopK(t, nullptr));
  }
  const std::vector<int32_t> want_segs = top_segs_, want_pages = top_pages_,
                             want_tokens = top_tokens_;
  // Every stage selected something real (the test data is not degenerate).
  for (int g = 0; g < kHkv; ++g) {
    EXPECT_GE(want_tokens[g * kKTokens], 0) << "head " << g;
  }
  top_segs_.assign(top_segs_.size(), -7);
  top_pages_.assign(top_pages_.size(), -7);
  top_tokens_.assign(top_tokens_.size(), -7);
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  EXPECT_EQ(top_segs_, want_segs);
  EXPECT_EQ(top_pages_, want_pages);
  EXPECT_EQ(top_tokens_, want_tokens);
}

// With `attend` the op ends with that SelectedAttention over the selection: out and lse are the
// separate call's, bit for bit, and an attention the op refuses fails the op.
TEST_F(SelectStagesOpByOpTest, AttendsAfterTheStages) {
  std::vector<float> v(pool_.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<float> out(kHkv * kGroup * kD, -7.0f), lse(kHkv * kGroup, -7.0f);
  SelectStagesParams p = Params();
  SelectedAttentionParams at = Attention(p, v, out, lse);
  p.attend = &at;
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  const std::vector<float> got_out = out, got_lse = lse;
  for (float x : got_lse) EXPECT_TRUE(std::isfinite(x));
  out.assign(out.size(), -7.0f);
  lse.assign(lse.size(), -7.0f);
  STRATA_ASSERT_OK(cpu_->SelectedAttention(at, nullptr));
  EXPECT_EQ(got_out, out);
  EXPECT_EQ(got_lse, lse);
  at.suffix_end = at.suffix_begin - 1;  // a broken suffix: SelectedAttention refuses
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// An attention the backend refuses (lse one head short) fails the op before any stage runs: the
// stages' selections and scores, out and lse all keep their poison.
TEST_F(SelectStagesOpByOpTest, RefusedAttentionWritesNothing) {
  constexpr int32_t kPoison = 0x7eadbeef;
  constexpr float kPoisonF = -7.0f;
  std::vector<float> v(pool_.size(), 0.5f);
  std::vector<float> out(kHkv * kGroup * kD, kPoisonF), lse(kHkv * kGroup, kPoisonF);
  for (std::vector<int32_t>* sel : {&top_segs_, &top_pages_, &top_tokens_}) {
    sel->assign(sel->size(), kPoison);
  }
  for (std::vector<float>* sc : {&seg_scores_, &page_scores_, &tok_scores_}) {
    sc->assign(sc->size(), kPoisonF);
  }
  SelectStagesParams p = Params();
  SelectedAttentionParams at = Attention(p, v, out, lse);
  at.lse = TensorView(lse.data(), DType::kF32, {1, kHkv * kGroup - 1});
  p.attend = &at;
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  for (const std::vector<int32_t>* sel : {&top_segs_, &top_pages_, &top_tokens_}) {
    EXPECT_EQ(*sel, std::vector<int32_t>(sel->size(), kPoison));
  }
  for (const std::vector<float>* sc : {&seg_scores_, &page_scores_, &tok_scores_, &out, &lse}) {
    EXPECT_EQ(*sc, std::vector<float>(sc->size(), kPoisonF));
  }
  // The same attention with the whole lse runs, and writes them all.
  at.lse = TensorView(lse.data(), DType::kF32, {1, kHkv * kGroup});
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  EXPECT_NE(top_tokens_, std::vector<int32_t>(top_tokens_.size(), kPoison));
  for (float x : lse) EXPECT_TRUE(std::isfinite(x) && x != kPoisonF);
}

TEST_F(SelectStagesOpByOpTest, RefusesABrokenChain) {
  SelectStagesParams p = Params();
  std::vector<int32_t> other(top_pages_.size(), 0);
  p.stages[2].candidates.parents.data = other.data();  // not stage 1's selection
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p = Params();
  p.stages[1].candidates.parents = TensorView();  // a plain range after stage 0
  p.stages[1].candidates.end = kPages;
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p = Params();
  p.stages[1].candidates.parents.shape[1] = kKeepSegs - 1;  // a narrower view of it
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  for (int n : {0, -1, kMaxSelectStages + 1}) {
    p = Params();
    p.num_stages = n;
    EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument))
        << n;
  }
  // arrivals other than a 4-byte aligned i32 [num_kv_heads] view.
  std::vector<int32_t> arrivals(kHkv + 1, 0);
  for (const TensorView bad :
       {TensorView(arrivals.data(), DType::kF32, {kHkv}),
        TensorView(arrivals.data(), DType::kI32, {kHkv + 1}),
        TensorView(arrivals.data(), DType::kI32, {1, kHkv}),
        TensorView(reinterpret_cast<char*>(arrivals.data()) + 1, DType::kI32, {kHkv})}) {
    p = Params();
    p.arrivals = bad;
    EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument))
        << bad.DebugString();
  }
  // Nothing was written by a refused call.
  EXPECT_EQ(top_segs_, std::vector<int32_t>(top_segs_.size(), -7));
}

// An i32 [num_kv_heads] arrivals view is accepted; the CPU backend leaves it alone.
TEST_F(SelectStagesOpByOpTest, AcceptsArrivals) {
  std::vector<int32_t> arrivals(kHkv, 0);
  SelectStagesParams p = Params();
  p.arrivals = TensorView(arrivals.data(), DType::kI32, {kHkv});
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  EXPECT_EQ(arrivals, std::vector<int32_t>(kHkv, 0));
}

TEST_F(SelectStagesOpByOpTest, PassesTheOpsErrorsThrough) {
  SelectStagesParams p = Params();
  p.stages[1].scores.shape[2] = 3;  // the page stage's scores too small: ScoreSummaries refuses
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p = Params();
  p.stages[2].k = -1;  // VoteTopK refuses
  EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(SelectStagesOpByOpTest, SkippedHeadsKeepTheirSelections) {
  const SelectStagesParams p = Params();
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  const std::vector<int32_t> fresh_pages = top_pages_, fresh_tokens = top_tokens_;
  top_pages_.assign(top_pages_.size(), -7);
  top_tokens_.assign(top_tokens_.size(), -7);
  const std::vector<int32_t> skip = {0, 1, 0};
  SelectStagesParams ps = p;
  ps.skip_heads = skip.data();
  STRATA_ASSERT_OK(cpu_->SelectStages(ps, nullptr));
  for (int g = 0; g < kHkv; ++g) {
    for (int64_t j = 0; j < kKTokens; ++j) {
      EXPECT_EQ(top_tokens_[g * kKTokens + j], skip[g] ? -7 : fresh_tokens[g * kKTokens + j]);
    }
    for (int64_t j = 0; j < kKPages; ++j) {
      EXPECT_EQ(top_pages_[g * kKPages + j], skip[g] ? -7 : fresh_pages[g * kKPages + j]);
    }
  }
}

// The selection cache's state of one call (SelectionCacheCheckParams over host memory): head 0's
// cached query is the call's own (a hit), head 1's its negation (a miss), head 2 invalid (a miss).
struct CacheState {
  std::vector<float> cached;
  std::vector<int32_t> valid, reuse;
  int64_t hits = 5;

  explicit CacheState(const std::vector<float>& q) : valid{1, 1, 0}, reuse(kHkv, -7) {
    cached.assign(q.size(), 0.0f);
    const size_t row = static_cast<size_t>(kGroup) * kD;
    for (size_t i = 0; i < row; ++i) cached[i] = q[i];
    for (size_t i = row; i < 2 * row; ++i) cached[i] = -q[i];
    for (size_t i = 2 * row; i < 3 * row; ++i) cached[i] = 0.25f;
  }
  SelectionCacheCheckParams Params(std::vector<float>& q) {
    SelectionCacheCheckParams cc;
    cc.q = TensorView(q.data(), DType::kF32, {kHkv * kGroup, kD});
    cc.cached_q = TensorView(cached.data(), DType::kF32, {kHkv, kGroup * kD});
    cc.valid = TensorView(valid.data(), DType::kI32, {kHkv});
    cc.theta = 0.9f;
    cc.reuse = TensorView(reuse.data(), DType::kI32, {kHkv});
    cc.hit_count = &hits;
    return cc;
  }
  bool operator==(const CacheState& o) const {
    return cached == o.cached && valid == o.valid && reuse == o.reuse && hits == o.hits;
  }
};

// SelectStages with cache_check is SelectionCacheCheck, then SelectStages with its reuse flags
// as skip_heads: the same cache state, selections and attention as those two calls.
TEST_F(SelectStagesOpByOpTest, ChecksTheSelectionCacheFirst) {
  std::vector<float> v(pool_.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.29f * static_cast<float>(i));
  std::vector<float> out(kHkv * kGroup * kD, -7.0f), lse(kHkv * kGroup, -7.0f);
  // The two calls.
  CacheState two(q_);
  SelectionCacheCheckParams cc2 = two.Params(q_);
  STRATA_ASSERT_OK(cpu_->SelectionCacheCheck(cc2, nullptr));
  EXPECT_EQ(two.reuse, (std::vector<int32_t>{1, 0, 0}));
  EXPECT_EQ(two.hits, 6);
  EXPECT_EQ(two.valid, (std::vector<int32_t>{1, 1, 1}));
  SelectStagesParams p = Params();
  p.skip_heads = two.reuse.data();
  SelectedAttentionParams at = Attention(p, v, out, lse);
  p.attend = &at;
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  const std::vector<int32_t> want_pages = top_pages_, want_tokens = top_tokens_;
  const std::vector<float> want_out = out, want_lse = lse;
  EXPECT_EQ(std::vector<int32_t>(want_tokens.begin(), want_tokens.begin() + kKTokens),
            std::vector<int32_t>(kKTokens, -7));  // head 0 reused: left as it was
  // The one call, from the same starting state.
  top_segs_.assign(top_segs_.size(), -7);
  top_pages_.assign(top_pages_.size(), -7);
  top_tokens_.assign(top_tokens_.size(), -7);
  out.assign(out.size(), -7.0f);
  lse.assign(lse.size(), -7.0f);
  CacheState one(q_);
  SelectionCacheCheckParams cc1 = one.Params(q_);
  p.skip_heads = nullptr;
  p.cache_check = &cc1;
  STRATA_ASSERT_OK(cpu_->SelectStages(p, nullptr));
  EXPECT_TRUE(one == two);
  EXPECT_EQ(top_pages_, want_pages);
  EXPECT_EQ(top_tokens_, want_tokens);
  EXPECT_EQ(out, want_out);
  EXPECT_EQ(lse, want_lse);
}

// A call with cache_check that is refused writes nothing: not the cache's state, not a selection.
TEST_F(SelectStagesOpByOpTest, RefusedCacheCheckWritesNothing) {
  const CacheState before(q_);
  auto refused = [&](const char* what, auto&& edit) {
    SCOPED_TRACE(what);
    CacheState st(q_);
    SelectionCacheCheckParams cc = st.Params(q_);
    SelectStagesParams p = Params();
    p.cache_check = &cc;
    edit(p, cc);
    EXPECT_THAT(cpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_TRUE(st == before);
    EXPECT_EQ(top_tokens_, std::vector<int32_t>(top_tokens_.size(), -7));
    EXPECT_EQ(top_segs_, std::vector<int32_t>(top_segs_.size(), -7));
  };
  const std::vector<int32_t> skip(kHkv, 0);
  refused("skip_heads too", [&](SelectStagesParams& p, SelectionCacheCheckParams&) {
    p.skip_heads = skip.data();
  });
  std::vector<float> other_q = q_;
  refused("another query", [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
    cc.q.data = other_q.data();
  });
  refused("a stage's scores too small", [&](SelectStagesParams& p, SelectionCacheCheckParams&) {
    p.stages[1].scores.shape[2] = 3;
  });
  refused("the check's cached queries one head short",
          [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
            cc.cached_q.shape[0] = kHkv - 1;
          });
  refused("the check's cache for other KV heads (one head of the whole query)",
          [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
            cc.cached_q.shape[0] = 1;
            cc.cached_q.shape[1] = kHkv * kGroup * kD;
            cc.valid.shape[0] = 1;
            cc.reuse.shape[0] = 1;
          });
  refused("the query in another shape", [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
    cc.q.shape[0] = kHkv;
    cc.q.shape[1] = kGroup * kD;
  });
  refused("theta not finite", [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
    cc.theta = std::numeric_limits<float>::quiet_NaN();
  });
}

}  // namespace
}  // namespace strata::kernels
