// The CPU reference of the device-resident selection ops (kernels/cpu/selection.cc) against
// independent formulations: SelectedAttention equals PagedAttention over the same tokens given as
// spans; VoteTopK equals a full sort of the soft votes; minmax summary scores bound every key's
// score from above; ScoreKeys equals the plain dot product through the page table.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/vote_rank.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

const float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> RandomF(std::mt19937& rng, int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(CpuSelectionTest, SelectedAttentionEqualsPagedAttentionOverSpans) {
  std::mt19937 rng(7);
  const int hkv = 3, group = 4, hq = hkv * group, d = 32, page = 8, table_pages = 20;
  const int slots = hkv * table_pages + 2;
  std::vector<float> q = RandomF(rng, hq * d), k = RandomF(rng, slots * page * d),
                     v = RandomF(rng, slots * page * d);
  std::vector<int32_t> perm(slots);
  for (int i = 0; i < slots; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(perm.begin(), perm.begin() + hkv * table_pages);
  const int64_t prefix = 5, mid_end = 130, len = 150;
  // Middle: 9 random tokens of [prefix, mid_end) per head, ascending, plus one -1.
  const int m = 10;
  std::vector<int32_t> parents(hkv * m);
  for (int g = 0; g < hkv; ++g) {
    std::vector<int32_t> all;
    for (int32_t t = prefix; t < mid_end; ++t) all.push_back(t);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(m - 1);
    std::sort(all.begin(), all.end());
    for (int i = 0; i < m - 1; ++i) parents[g * m + i] = all[i];
    parents[g * m + m - 1] = -1;
  }
  std::vector<float> out(hq * d), lse(hq);
  SelectedAttentionParams p;
  p.q = TensorView(q.data(), DType::kF32, {1, hq, d});
  p.k_pool = TensorView(k.data(), DType::kF32, {slots, page, d});
  p.v_pool = TensorView(v.data(), DType::kF32, {slots, page, d});
  p.page_table = TensorView(table.data(), DType::kI32, {hkv, table_pages});
  p.prefix_end = prefix;
  p.middle.parents = TensorView(parents.data(), DType::kI32, {hkv, m});
  p.middle.begin = prefix;
  p.middle.end = mid_end;
  p.suffix_begin = mid_end;
  p.suffix_end = len;
  p.scale = 0.3f;
  p.out = TensorView(out.data(), DType::kF32, {1, hq, d});
  p.lse = TensorView(lse.data(), DType::kF32, {1, hq});
  STRATA_ASSERT_OK(CpuSelectedAttention(p));

  // The same tokens as one-token spans.
  std::vector<KvSpan> spans;
  std::vector<int32_t> offsets = {0};
  for (int g = 0; g < hkv; ++g) {
    std::vector<int32_t> tokens;
    for (int32_t t = 0; t < prefix; ++t) tokens.push_back(t);
    for (int i = 0; i < m; ++i) {
      if (parents[g * m + i] >= 0) tokens.push_back(parents[g * m + i]);
    }
    for (int32_t t = mid_end; t < len; ++t) tokens.push_back(t);
    for (int32_t t : tokens) {
      spans.push_back({table[g * table_pages + t / page], t % page, 1, t});
    }
    offsets.push_back(static_cast<int32_t>(spans.size()));
  }
  std::vector<float> out2(hq * d), lse2(hq);
  const int32_t qpos = static_cast<int32_t>(len);
  PagedAttentionParams a;
  a.q = p.q;
  a.k_pool = p.k_pool;
  a.v_pool = p.v_pool;
  a.spans = spans.data();
  a.span_offsets = offsets.data();
  a.num_kv_heads = hkv;
  a.q_positions = &qpos;
  a.causal = false;
  a.scale = p.scale;
  a.out = TensorView(out2.data(), DType::kF32, {1, hq, d});
  a.lse = TensorView(lse2.data(), DType::kF32, {1, hq});
  STRATA_ASSERT_OK(CpuPagedAttention(a));
  for (int i = 0; i < hq * d; ++i) EXPECT_NEAR(out[i], out2[i], 1e-5) << i;
  for (int i = 0; i < hq; ++i) EXPECT_NEAR(lse[i], lse2[i], 1e-5) << i;
}

// The dense decode step with its length read from memory (SelectedAttentionParams::prefix_len):
// over pools laid out as engine::KvCache lays them out (page p of KV head g in slot
// g * slots_per_head + p), prefix_end = the capacity and *prefix_len = len must equal
// PagedAttention over the spans of tokens [0, len) with the query at position len - 1 (causal),
// for every len, with the same params struct reused (only the int changes, as in a graph replay).
// Pool rows past len hold random values, so attending one of them would change the result.
TEST(CpuSelectionTest, DeviceLengthPrefixEqualsPagedAttentionOverCache) {
  std::mt19937 rng(23);
  const int hkv = 2, group = 3, hq = hkv * group, d = 16, page = 8, slots_per_head = 6;
  const int slots = hkv * slots_per_head, capacity = slots_per_head * page;
  std::vector<float> q = RandomF(rng, hq * d), k = RandomF(rng, slots * page * d),
                     v = RandomF(rng, slots * page * d);
  std::vector<int32_t> table(hkv * slots_per_head);
  for (int i = 0; i < hkv * slots_per_head; ++i) table[i] = i;  // slot g * slots_per_head + p
  int32_t len_value = 0;
  std::vector<float> out(hq * d), lse(hq);
  SelectedAttentionParams p;
  p.q = TensorView(q.data(), DType::kF32, {1, hq, d});
  p.k_pool = TensorView(k.data(), DType::kF32, {slots, page, d});
  p.v_pool = TensorView(v.data(), DType::kF32, {slots, page, d});
  p.page_table = TensorView(table.data(), DType::kI32, {hkv, slots_per_head});
  p.prefix_end = capacity;
  p.prefix_len = &len_value;
  p.scale = 0.25f;
  p.out = TensorView(out.data(), DType::kF32, {1, hq, d});
  p.lse = TensorView(lse.data(), DType::kF32, {1, hq});
  for (int len : {1, 2, 7, 8, 9, 16, 23, 40, capacity}) {
    len_value = len;
    STRATA_ASSERT_OK(CpuSelectedAttention(p));
    std::vector<KvSpan> spans;
    std::vector<int32_t> offsets = {0};
    for (int g = 0; g < hkv; ++g) {
      for (int t0 = 0; t0 < len; t0 += page) {
        spans.push_back({g * slots_per_head + t0 / page, 0, std::min(page, len - t0), t0});
      }
      offsets.push_back(static_cast<int32_t>(spans.size()));
    }
    std::vector<float> out2(hq * d), lse2(hq);
    const int32_t qpos = len - 1;
    PagedAttentionParams a;
    a.q = p.q;
    a.k_pool = p.k_pool;
    a.v_pool = p.v_pool;
    a.spans = spans.data();
    a.span_offsets = offsets.data();
    a.num_kv_heads = hkv;
    a.q_positions = &qpos;
    a.causal = true;
    a.scale = p.scale;
    a.out = TensorView(out2.data(), DType::kF32, {1, hq, d});
    a.lse = TensorView(lse2.data(), DType::kF32, {1, hq});
    STRATA_ASSERT_OK(CpuPagedAttention(a));
    for (int i = 0; i < hq * d; ++i) EXPECT_NEAR(out[i], out2[i], 1e-5) << "len " << len << " " << i;
    for (int i = 0; i < hq; ++i) EXPECT_NEAR(lse[i], lse2[i], 1e-5) << "len " << len << " " << i;
  }
  // A length past the bound is clamped to it; zero or negative attends nothing (out 0, lse -inf).
  len_value = capacity + 100;
  STRATA_ASSERT_OK(CpuSelectedAttention(p));
  const std::vector<float> full(out.begin(), out.end());
  len_value = capacity;
  STRATA_ASSERT_OK(CpuSelectedAttention(p));
  for (int i = 0; i < hq * d; ++i) EXPECT_EQ(out[i], full[i]) << i;
  for (int32_t none : {0, -3}) {
    len_value = none;
    STRATA_ASSERT_OK(CpuSelectedAttention(p));
    for (int i = 0; i < hq * d; ++i) EXPECT_EQ(out[i], 0.0f) << i;
    for (int i = 0; i < hq; ++i) EXPECT_EQ(lse[i], kNegInf) << i;
  }
}

TEST(CpuSelectionTest, VoteTopKEqualsSortedVotes) {
  std::mt19937 rng(11);
  const int hkv = 2, group = 3;
  const int64_t n = 300;
  for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{299}, int64_t{400}}) {
    std::vector<float> scores = RandomF(rng, hkv * group * n, -5.0f, 5.0f);
    for (int64_t i = 0; i < n; i += 13) {
      for (int h = 0; h < group; ++h) scores[h * n + i] = kNegInf;  // head 0: invalid candidates
    }
    std::vector<int32_t> sel(hkv * k, 99);
    std::vector<float> vote(hkv * n);
    VoteTopKParams p;
    p.scores = TensorView(scores.data(), DType::kF32, {hkv, group, n});
    p.candidates.begin = 1000;
    p.candidates.end = 1000 + n;
    p.k = k;
    p.selected = TensorView(sel.data(), DType::kI32, {hkv, k});
    p.vote = TensorView(vote.data(), DType::kF32, {hkv, n});
    STRATA_ASSERT_OK(CpuVoteTopK(p));
    for (int g = 0; g < hkv; ++g) {
      // Reference: the soft vote in double, sorted.
      std::vector<double> ref(n, 0.0);
      for (int h = 0; h < group; ++h) {
        const float* s = &scores[(g * group + h) * n];
        double m = -INFINITY, sum = 0;
        for (int64_t i = 0; i < n; ++i) m = std::max<double>(m, s[i]);
        for (int64_t i = 0; i < n; ++i) sum += std::exp(s[i] - m);
        for (int64_t i = 0; i < n; ++i) ref[i] += std::exp(s[i] - m) / sum;
      }
      std::vector<int64_t> order;
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_NEAR(vote[g * n + i], ref[i], 1e-6);
        if (!(g == 0 && i % 13 == 0)) order.push_back(i);
      }
      // Ranked by the op's own votes (checked against the reference above) through their rank
      // keys, ties to the lower index (kernels/vote_rank.h).
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return VoteRankBefore(VoteRankKey(vote[g * n + a]), a, VoteRankKey(vote[g * n + b]), b);
      });
      const int64_t take = std::min<int64_t>(k, order.size());
      std::vector<int32_t> want;
      for (int64_t i = 0; i < take; ++i) want.push_back(static_cast<int32_t>(1000 + order[i]));
      std::sort(want.begin(), want.end());
      want.resize(k, -1);
      EXPECT_EQ(std::vector<int32_t>(sel.begin() + g * k, sel.begin() + (g + 1) * k), want)
          << "k " << k << " head " << g;
    }
  }
}

// VoteTopK in parts equals, part by part, VoteTopK over that part's candidates alone (its scores
// gathered, its ids as a token list): the same ids in the part's slice of selected, and the
// same votes bit for bit; a plain range deals ids in turn, parents go by blocks. Bad partitions
// are refused.
TEST(CpuSelectionTest, VoteTopKInPartsIsVoteTopKOfEachPart) {
  std::mt19937 rng(23);
  const int hkv = 2, group = 3;
  for (const bool with_parents : {false, true}) {
    for (const int parts : {2, 4, 8}) {
      SCOPED_TRACE(::testing::Message() << "parts " << parts << (with_parents ? " parents" : ""));
      const int fanout = with_parents ? 4 : 1;
      const int64_t num_parents = 8 * parts;
      const int64_t n = with_parents ? num_parents * fanout : 301;
      const int64_t begin = with_parents ? 0 : 1003, end = with_parents ? 900 : begin + n;
      std::vector<int32_t> parents(hkv * num_parents);
      for (auto& x : parents) x = static_cast<int32_t>(rng() % 230) - 5;  // some -1 .. -5, some past end
      for (const int64_t k : {int64_t{0}, int64_t{parts}, int64_t{6 * parts}, int64_t{64 * parts}}) {
        std::vector<float> scores = RandomF(rng, hkv * group * n, -4.0f, 4.0f);
        for (int64_t i = 0; i < n; i += 11) scores[i] = kNegInf;  // head 0, query 0: some -inf
        std::vector<int32_t> sel(hkv * k, 99);
        std::vector<float> vote(hkv * n, -1.0f);
        VoteTopKParams p;
        p.scores = TensorView(scores.data(), DType::kF32, {hkv, group, n});
        if (with_parents) {
          p.candidates.parents = TensorView(parents.data(), DType::kI32, {hkv, num_parents});
        }
        p.candidates.fanout = fanout;
        p.candidates.begin = begin;
        p.candidates.end = end;
        p.k = k;
        p.selected = TensorView(sel.data(), DType::kI32, {hkv, k});
        p.vote = TensorView(vote.data(), DType::kF32, {hkv, n});
        p.partitions = parts;
        STRATA_ASSERT_OK(CpuVoteTopK(p));
        const int64_t kp = k / parts;
        for (int g = 0; g < hkv; ++g) {
          for (int part = 0; part < parts; ++part) {
            std::vector<int64_t> members;
            for (int64_t i = 0; i < n; ++i) {
              const bool in = with_parents ? (i / fanout) / (num_parents / parts) == part
                                           : (begin + i) % parts == part;
              if (in) members.push_back(i);
            }
            const int64_t m = static_cast<int64_t>(members.size());
            std::vector<float> sub(group * m);
            std::vector<int32_t> ids(m);
            for (int64_t j = 0; j < m; ++j) {
              for (int h = 0; h < group; ++h) sub[h * m + j] = scores[(g * group + h) * n + members[j]];
              const int64_t i = members[j];
              int64_t id = begin + i;
              if (with_parents) {
                const int32_t par = parents[g * num_parents + i / fanout];
                id = par < 0 ? -1 : int64_t{par} * fanout + i % fanout;
              }
              ids[j] = id >= begin && id < end ? static_cast<int32_t>(id) : -1;
            }
            std::vector<int32_t> want(std::max<int64_t>(kp, 1), 77);
            std::vector<float> want_vote(m);
            VoteTopKParams w;
            w.scores = TensorView(sub.data(), DType::kF32, {1, group, m});
            w.candidates.parents = TensorView(ids.data(), DType::kI32, {1, m});
            w.candidates.begin = begin;
            w.candidates.end = end;
            w.k = kp;
            w.selected = TensorView(want.data(), DType::kI32, {1, kp});
            w.vote = TensorView(want_vote.data(), DType::kF32, {1, m});
            STRATA_ASSERT_OK(CpuVoteTopK(w));
            want.resize(kp);
            EXPECT_EQ(std::vector<int32_t>(sel.begin() + g * k + part * kp,
                                           sel.begin() + g * k + (part + 1) * kp),
                      want)
                << "k " << k << " head " << g << " part " << part;
            for (int64_t j = 0; j < m; ++j) {
              ASSERT_EQ(vote[g * n + members[j]], want_vote[j]) << "candidate " << members[j];
            }
          }
        }
      }
    }
  }
  std::vector<float> scores(2 * 8, 0.0f);
  std::vector<int32_t> sel(8);
  VoteTopKParams p;
  p.scores = TensorView(scores.data(), DType::kF32, {1, 2, 8});
  p.candidates.end = 8;
  p.selected = TensorView(sel.data(), DType::kI32, {1, 6});
  p.k = 6;
  for (const int bad : {0, 3, 128}) {
    p.partitions = bad;
    EXPECT_THAT(CpuVoteTopK(p), StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
  }
  p.partitions = 4;  // k 6 is not a multiple
  EXPECT_THAT(CpuVoteTopK(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.partitions = 2;
  STRATA_EXPECT_OK(CpuVoteTopK(p));
}

// Votes closer than the rank key's resolution tie, and the tie goes to the lower index; votes
// a few bins apart rank by vote.
TEST(CpuSelectionTest, VoteTopKTiesVotesWithinTheRankResolution) {
  const int64_t n = 3;
  for (float gap : {2e-7f, 1e-4f}) {
    // One query head: candidate 1 scores `gap` above candidate 0, candidate 2 far below.
    std::vector<float> scores = {0.0f, gap, -10.0f};
    std::vector<int32_t> sel(1, 99);
    std::vector<float> vote(n);
    VoteTopKParams p;
    p.scores = TensorView(scores.data(), DType::kF32, {1, 1, n});
    p.candidates.begin = 0;
    p.candidates.end = n;
    p.k = 1;
    p.selected = TensorView(sel.data(), DType::kI32, {1, 1});
    p.vote = TensorView(vote.data(), DType::kF32, {1, n});
    STRATA_ASSERT_OK(CpuVoteTopK(p));
    ASSERT_GT(vote[1], vote[0]);
    if (gap < 1e-6f) {
      ASSERT_EQ(VoteRankKey(vote[0]), VoteRankKey(vote[1])) << vote[0] << " " << vote[1];
      EXPECT_EQ(sel[0], 0) << "a tie goes to the lower index";
    } else {
      ASSERT_LT(VoteRankKey(vote[0]), VoteRankKey(vote[1]));
      EXPECT_EQ(sel[0], 1);
    }
  }
}

TEST(CpuSelectionTest, SummaryScoresBoundKeyScoresAndKeyScoresAreDots) {
  std::mt19937 rng(5);
  const int hkv = 2, group = 2, hq = hkv * group, d = 16, page = 4, pages = 6;
  std::vector<float> q = RandomF(rng, hq * d), k = RandomF(rng, hkv * pages * page * d);
  std::vector<int32_t> table(hkv * pages);
  for (int i = 0; i < hkv * pages; ++i) table[i] = i;
  std::vector<float> sums(hkv * pages * 2 * d);
  for (int r = 0; r < hkv * pages; ++r) {
    for (int e = 0; e < d; ++e) {
      float lo = INFINITY, hi = -INFINITY;
      for (int t = 0; t < page; ++t) {
        lo = std::min(lo, k[(r * page + t) * d + e]);
        hi = std::max(hi, k[(r * page + t) * d + e]);
      }
      sums[r * 2 * d + e] = lo;
      sums[r * 2 * d + d + e] = hi;
    }
  }
  std::vector<float> page_scores(hq * pages), key_scores(hq * pages * page);
  ScoreSummariesParams s;
  s.q = TensorView(q.data(), DType::kF32, {hq, d});
  s.summaries = TensorView(sums.data(), DType::kF32, {hkv, pages, 2 * d});
  s.candidates.end = pages;
  s.scale = 0.5f;
  s.scores = TensorView(page_scores.data(), DType::kF32, {hkv, group, pages});
  STRATA_ASSERT_OK(CpuScoreSummaries(s));
  ScoreKeysParams kp;
  kp.q = s.q;
  kp.k_pool = TensorView(k.data(), DType::kF32, {hkv * pages, page, d});
  kp.page_table = TensorView(table.data(), DType::kI32, {hkv, pages});
  kp.candidates.end = pages * page;
  kp.scale = 0.5f;
  kp.scores = TensorView(key_scores.data(), DType::kF32, {hkv, group, pages * page});
  STRATA_ASSERT_OK(CpuScoreKeys(kp));
  for (int g = 0; g < hkv; ++g) {
    for (int j = 0; j < group; ++j) {
      const int h = g * group + j;
      for (int t = 0; t < pages * page; ++t) {
        double dot = 0;
        for (int e = 0; e < d; ++e) dot += 0.5 * q[h * d + e] * k[((g * pages) * page + t) * d + e];
        const float got = key_scores[(g * group + j) * pages * page + t];
        EXPECT_NEAR(got, dot, 1e-5);
        EXPECT_GE(page_scores[(g * group + j) * pages + t / page] + 1e-5f, got);
      }
    }
  }
  // Bad table entries and out-of-range candidates score -inf.
  table[0] = -1;
  kp.candidates.begin = 0;
  STRATA_ASSERT_OK(CpuScoreKeys(kp));
  EXPECT_EQ(key_scores[0], kNegInf);
  s.candidates.end = pages + 3;
  s.candidates.begin = 3;
  STRATA_ASSERT_OK(CpuScoreSummaries(s));  // ids pages .. pages + 2 are past num_items
  EXPECT_EQ(page_scores[pages - 1], kNegInf);
}

// bf16 summaries rounded outward: each min / max is the nearest bf16 at or below / above the f32
// value, and the scores are those of the f32 rows the bf16 ones hold, never below the exact bound.
TEST(CpuSelectionTest, Bf16SummariesRoundOutwardAndStillBound) {
  std::mt19937 rng(21);
  const int hkv = 2, group = 2, hq = hkv * group, d = 16, items = 9;
  std::vector<float> q = RandomF(rng, hq * d), sums = RandomF(rng, hkv * items * 2 * d);
  for (int r = 0; r < hkv * items; ++r) {
    for (int e = 0; e < d; ++e) {
      float& lo = sums[r * 2 * d + e];
      float& hi = sums[r * 2 * d + d + e];
      if (lo > hi) std::swap(lo, hi);
    }
  }
  sums[0] = 1.0f;  // exactly representable: unchanged
  sums[d] = 1.0f;
  std::vector<uint16_t> s16(sums.size());
  MinMaxRowsToBF16(sums.data(), hkv * items, d, s16.data());
  std::vector<float> back(sums.size());
  for (size_t i = 0; i < sums.size(); ++i) {
    back[i] = BF16ToF32(s16[i]);
    const bool is_max = (i / d) % 2 == 1;
    const float x = sums[i], ulp = std::ldexp(1.0f, std::ilogb(x) - 7);
    if (is_max) {
      EXPECT_GE(back[i], x) << i;
      EXPECT_LT(back[i] - x, ulp) << i;
    } else {
      EXPECT_LE(back[i], x) << i;
      EXPECT_LT(x - back[i], ulp) << i;
    }
  }
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[d], 1.0f);
  EXPECT_EQ(F32ToBF16Directed(3.4e38f, true), 0x7f80);  // beyond the largest finite bf16: +inf
  EXPECT_EQ(F32ToBF16Directed(-3.4e38f, false), 0xff80);
  EXPECT_EQ(F32ToBF16Directed(-3.4e38f, true), 0xff7f);
  std::vector<float> got(hq * items), want(hq * items), exact(hq * items);
  ScoreSummariesParams s;
  s.q = TensorView(q.data(), DType::kF32, {hq, d});
  s.candidates.end = items;
  s.scale = 0.25f;
  s.summaries = TensorView(s16.data(), DType::kBF16, {hkv, items, 2 * d});
  s.scores = TensorView(got.data(), DType::kF32, {hkv, group, items});
  STRATA_ASSERT_OK(CpuScoreSummaries(s));
  s.summaries = TensorView(back.data(), DType::kF32, {hkv, items, 2 * d});
  s.scores = TensorView(want.data(), DType::kF32, {hkv, group, items});
  STRATA_ASSERT_OK(CpuScoreSummaries(s));
  s.summaries = TensorView(sums.data(), DType::kF32, {hkv, items, 2 * d});
  s.scores = TensorView(exact.data(), DType::kF32, {hkv, group, items});
  STRATA_ASSERT_OK(CpuScoreSummaries(s));
  EXPECT_EQ(got, want);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_GE(got[i], exact[i] - 1e-6f) << i;
  // fp8 summaries are refused.
  s.summaries.dtype = DType::kFP8E4M3;
  EXPECT_FALSE(CpuScoreSummaries(s).ok());
}

TEST(CpuSelectionTest, UpdateSummariesIncrementalEqualsBruteForce) {
  std::mt19937 rng(9);
  const int hkv = 2, d = 8, page = 4, table_pages = 30, seg = 3;
  const int slots = hkv * table_pages;
  std::vector<float> k = RandomF(rng, slots * page * d);
  std::vector<int32_t> table(hkv * table_pages);
  for (int i = 0; i < hkv * table_pages; ++i) table[i] = (i * 7) % slots;  // a permutation
  const int64_t len = 101;
  std::vector<float> pages(hkv * table_pages * 2 * d, -7.0f), segs(hkv * 10 * 2 * d, -7.0f);
  UpdateSummariesParams p;
  p.k_pool = TensorView(k.data(), DType::kF32, {slots, page, d});
  p.page_table = TensorView(table.data(), DType::kI32, {hkv, table_pages});
  p.pages = TensorView(pages.data(), DType::kF32, {hkv, table_pages, 2 * d});
  p.segments = TensorView(segs.data(), DType::kF32, {hkv, 10, 2 * d});
  p.segment_pages = seg;
  for (int64_t first = 0; first < len;) {
    const int64_t end = std::min<int64_t>(len, first + 1 + rng() % 9);
    p.first = first;
    p.end = end;
    STRATA_ASSERT_OK(CpuUpdateSummaries(p));
    first = end;
  }
  const int64_t np = (len + page - 1) / page;
  for (int g = 0; g < hkv; ++g) {
    for (int64_t pg = 0; pg < np; ++pg) {
      for (int e = 0; e < d; ++e) {
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t t = pg * page; t < std::min<int64_t>(len, (pg + 1) * page); ++t) {
          const float x = k[(static_cast<int64_t>(table[g * table_pages + t / page]) * page + t % page) * d + e];
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        EXPECT_EQ(pages[(g * table_pages + pg) * 2 * d + e], lo);
        EXPECT_EQ(pages[(g * table_pages + pg) * 2 * d + d + e], hi);
        float& slo = segs[(g * 10 + pg / seg) * 2 * d + e];
        float& shi = segs[(g * 10 + pg / seg) * 2 * d + d + e];
        EXPECT_LE(slo, lo);
        EXPECT_GE(shi, hi);
      }
    }
    for (int64_t sg = 0; sg < (np + seg - 1) / seg; ++sg) {
      for (int e = 0; e < d; ++e) {
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t pg = sg * seg; pg < std::min<int64_t>(np, (sg + 1) * seg); ++pg) {
          lo = std::min(lo, pages[(g * table_pages + pg) * 2 * d + e]);
          hi = std::max(hi, pages[(g * table_pages + pg) * 2 * d + d + e]);
        }
        EXPECT_EQ(segs[(g * 10 + sg) * 2 * d + e], lo);
        EXPECT_EQ(segs[(g * 10 + sg) * 2 * d + d + e], hi);
      }
    }
    // Rows past the data are untouched.
    EXPECT_EQ(pages[(g * table_pages + np) * 2 * d], -7.0f);
  }
  // Tokens beyond the table are rejected.
  p.first = 0;
  p.end = table_pages * page + 1;
  EXPECT_THAT(CpuUpdateSummaries(p), StatusIs(absl::StatusCode::kInvalidArgument));
  // bf16 rows: the f32 rows rounded outward (this pool is f32, so inexact), pages and segments.
  std::vector<uint16_t> pages16(pages.size(), 0), segs16(segs.size(), 0);
  p.pages = TensorView(pages16.data(), DType::kBF16, {hkv, table_pages, 2 * d});
  p.segments = TensorView(segs16.data(), DType::kBF16, {hkv, 10, 2 * d});
  p.first = 0;
  p.end = len;
  STRATA_ASSERT_OK(CpuUpdateSummaries(p));
  for (int64_t r = 0; r < hkv * table_pages; ++r) {
    if (r % table_pages >= np) continue;
    for (int e = 0; e < 2 * d; ++e) {
      EXPECT_EQ(pages16[r * 2 * d + e], F32ToBF16Directed(pages[r * 2 * d + e], e >= d)) << r << " " << e;
    }
  }
  for (int64_t r = 0; r < hkv * 10; ++r) {
    if (r % 10 >= (np + seg - 1) / seg) continue;
    for (int e = 0; e < 2 * d; ++e) {
      EXPECT_EQ(segs16[r * 2 * d + e], F32ToBF16Directed(segs[r * 2 * d + e], e >= d)) << r << " " << e;
    }
  }
  p.segments = TensorView(segs.data(), DType::kF32, {hkv, 10, 2 * d});  // mixed types: refused
  EXPECT_THAT(CpuUpdateSummaries(p), StatusIs(absl::StatusCode::kInvalidArgument));
}

// fp8 pools: ScoreKeys and UpdateSummaries read the stored values, so they give exactly what they
// give over an f32 pool holding the decoded codes (kernels/backend.h "fp8 KV pools").
TEST(CpuSelectionTest, Fp8PoolsScoreAndSummariseTheirStoredValues) {
  std::mt19937 rng(11);
  const int hkv = 2, group = 3, d = 16, page = 4, table_pages = 9, slots = 20;
  std::vector<float> x = RandomF(rng, slots * page * d, -300.0f, 300.0f);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> decoded(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    codes[i] = F32ToFP8E4M3(x[i]);
    decoded[i] = FP8E4M3ToF32(codes[i]);
  }
  std::vector<int32_t> table(hkv * table_pages);
  for (size_t i = 0; i < table.size(); ++i) table[i] = i % 7 == 3 ? -1 : static_cast<int32_t>((i * 5) % slots);
  const std::vector<float> q = RandomF(rng, hkv * group * d);
  const int64_t n = table_pages * page - 3;
  std::vector<float> s8(hkv * group * n), s32(hkv * group * n);
  ScoreKeysParams k;
  k.q = TensorView(const_cast<float*>(q.data()), DType::kF32, {hkv * group, d});
  k.page_table = TensorView(table.data(), DType::kI32, {hkv, table_pages});
  k.candidates.begin = 2;
  k.candidates.end = 2 + n;
  k.scale = 0.03125f;
  k.k_pool = TensorView(codes.data(), DType::kFP8E4M3, {slots, page, d});
  k.scores = TensorView(s8.data(), DType::kF32, {hkv, group, n});
  STRATA_ASSERT_OK(CpuScoreKeys(k));
  k.k_pool = TensorView(decoded.data(), DType::kF32, {slots, page, d});
  k.scores = TensorView(s32.data(), DType::kF32, {hkv, group, n});
  STRATA_ASSERT_OK(CpuScoreKeys(k));
  EXPECT_EQ(s8, s32);
  EXPECT_GT(std::count_if(s8.begin(), s8.end(), [](float v) { return v != kNegInf; }), n);

  std::vector<uint16_t> p8(hkv * table_pages * 2 * d, 1), p32(hkv * table_pages * 2 * d, 2);
  UpdateSummariesParams u;
  u.page_table = k.page_table;
  u.end = table_pages * page - 1;
  u.k_pool = TensorView(codes.data(), DType::kFP8E4M3, {slots, page, d});
  u.pages = TensorView(p8.data(), DType::kBF16, {hkv, table_pages, 2 * d});
  STRATA_ASSERT_OK(CpuUpdateSummaries(u));
  u.k_pool = TensorView(decoded.data(), DType::kF32, {slots, page, d});
  u.pages = TensorView(p32.data(), DType::kBF16, {hkv, table_pages, 2 * d});
  STRATA_ASSERT_OK(CpuUpdateSummaries(u));
  EXPECT_EQ(p8, p32);
  // Another dtype is still refused.
  u.k_pool.dtype = DType::kI32;
  EXPECT_THAT(CpuUpdateSummaries(u), StatusIs(absl::StatusCode::kUnimplemented));
}

TEST(CpuSelectionTest, MalformedParamsAreInvalidArgument) {
  std::vector<float> buf(256);
  VoteTopKParams p;
  p.scores = TensorView(buf.data(), DType::kF32, {2, 2, 8});
  p.candidates.end = 8;
  p.k = 3;
  p.selected = TensorView(buf.data(), DType::kI32, {2, 4});  // k mismatch
  EXPECT_THAT(CpuVoteTopK(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.selected = TensorView(buf.data(), DType::kI32, {2, 3});
  p.candidates.end = 7;  // count mismatch
  EXPECT_THAT(CpuVoteTopK(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.candidates.end = 8;
  p.candidates.fanout = 0;
  EXPECT_THAT(CpuVoteTopK(p), StatusIs(absl::StatusCode::kInvalidArgument));
  SelectedAttentionParams a;
  a.q = TensorView(buf.data(), DType::kF32, {2, 4, 8});  // two tokens
  EXPECT_THAT(CpuSelectedAttention(a), StatusIs(absl::StatusCode::kInvalidArgument));
  // The same checks through the Backend interface.
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  EXPECT_THAT(cpu->VoteTopK(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// SelectionCacheCheck: the first call selects every head (valid 0), a repeated query hits, a query
// whose cosine falls below theta misses and is cached, zero queries never hit, valid = 0 forces a
// miss, and hit_count adds the hits.
TEST(CpuSelectionTest, SelectionCacheCheckFlagsAndCaches) {
  std::mt19937 rng(21);
  const int hkv = 3, group = 2, d = 8, n = group * d;
  std::vector<float> q = RandomF(rng, hkv * n), cached(hkv * n, 7.0f);
  std::vector<int32_t> valid(hkv, 0), reuse(hkv, 5);
  int64_t hits = 0;
  SelectionCacheCheckParams p;
  p.q = TensorView(q.data(), DType::kF32, {hkv * group, d});
  p.cached_q = TensorView(cached.data(), DType::kF32, {hkv, n});
  p.valid = TensorView(valid.data(), DType::kI32, {hkv});
  p.reuse = TensorView(reuse.data(), DType::kI32, {hkv});
  p.theta = 0.9f;
  p.hit_count = &hits;
  STRATA_ASSERT_OK(CpuSelectionCacheCheck(p));
  EXPECT_EQ(reuse, std::vector<int32_t>({0, 0, 0}));
  EXPECT_EQ(valid, std::vector<int32_t>({1, 1, 1}));
  EXPECT_EQ(cached, q);
  EXPECT_EQ(hits, 0);
  // Head 0 repeats (scaled: cosine 1), head 1 drifts slightly (cosine > 0.9), head 2 turns away.
  std::vector<float> q2 = q;
  for (int i = 0; i < n; ++i) q2[i] *= 3.0f;
  for (int i = 0; i < n; ++i) q2[n + i] += 0.02f * (i % 2 ? 1.0f : -1.0f);
  for (int i = 0; i < n; ++i) q2[2 * n + i] = -q[2 * n + i];
  const std::vector<float> before = cached;
  p.q.data = q2.data();
  STRATA_ASSERT_OK(CpuSelectionCacheCheck(p));
  EXPECT_EQ(reuse, std::vector<int32_t>({1, 1, 0}));
  EXPECT_EQ(hits, 2);
  // Hits keep the cached query of the selection; the miss caches the new one.
  EXPECT_EQ(std::vector<float>(cached.begin(), cached.begin() + 2 * n),
            std::vector<float>(before.begin(), before.begin() + 2 * n));
  EXPECT_EQ(std::vector<float>(cached.begin() + 2 * n, cached.end()),
            std::vector<float>(q2.begin() + 2 * n, q2.end()));
  // theta 1: only an exactly parallel query hits; valid 0 forces a miss; a zero query never hits.
  p.theta = 1.0f;
  valid[1] = 0;
  std::vector<float> q3 = q2;
  for (int i = 0; i < n; ++i) q3[2 * n + i] = 0.0f;
  p.q.data = q3.data();
  STRATA_ASSERT_OK(CpuSelectionCacheCheck(p));
  EXPECT_EQ(reuse[1], 0);
  EXPECT_EQ(reuse[2], 0);
  EXPECT_EQ(valid[1], 1);
  EXPECT_EQ(std::vector<float>(cached.begin() + n, cached.begin() + 2 * n),
            std::vector<float>(q3.begin() + n, q3.begin() + 2 * n));
  STRATA_ASSERT_OK(CpuSelectionCacheCheck(p));  // head 2's cached query is now zero: no hit
  EXPECT_EQ(reuse[2], 0);
  // Malformed: wrong cached shape, non-finite theta.
  p.theta = NAN;
  EXPECT_THAT(CpuSelectionCacheCheck(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.theta = 0.9f;
  p.cached_q = TensorView(cached.data(), DType::kF32, {hkv, n - 1});
  EXPECT_THAT(CpuSelectionCacheCheck(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.cached_q = TensorView(cached.data(), DType::kF32, {hkv, n});
  p.reuse = TensorView(reuse.data(), DType::kI32, {hkv - 1});
  EXPECT_THAT(CpuSelectionCacheCheck(p), StatusIs(absl::StatusCode::kInvalidArgument));
}

// skip_heads: a flagged head's rows of the outputs keep their previous values, the other heads
// equal a call without skip_heads.
TEST(CpuSelectionTest, SkipHeadsLeaveFlaggedHeadsUntouched) {
  std::mt19937 rng(23);
  const int hkv = 3, group = 2, hq = hkv * group, d = 16, page = 4, pages = 10;
  const int64_t nk = pages * page, k = 5;
  std::vector<float> kpool = RandomF(rng, hkv * pages * page * d);
  std::vector<float> sums = RandomF(rng, hkv * pages * 2 * d);
  std::vector<int32_t> table(hkv * pages);
  for (int i = 0; i < hkv * pages; ++i) table[i] = i;
  const std::vector<int32_t> skip = {0, 1, 0};
  struct Out {
    std::vector<float> page_scores, key_scores, vote;
    std::vector<int32_t> sel;
  };
  auto run = [&](const std::vector<float>& q, const int32_t* skip_heads, Out* o) {
    ScoreSummariesParams s;
    s.q = TensorView(const_cast<float*>(q.data()), DType::kF32, {hq, d});
    s.summaries = TensorView(sums.data(), DType::kF32, {hkv, pages, 2 * d});
    s.candidates.end = pages;
    s.scale = 0.5f;
    s.scores = TensorView(o->page_scores.data(), DType::kF32, {hkv, group, pages});
    s.skip_heads = skip_heads;
    STRATA_ASSERT_OK(CpuScoreSummaries(s));
    ScoreKeysParams kp;
    kp.q = s.q;
    kp.k_pool = TensorView(kpool.data(), DType::kF32, {hkv * pages, page, d});
    kp.page_table = TensorView(table.data(), DType::kI32, {hkv, pages});
    kp.candidates.end = nk;
    kp.scale = 0.5f;
    kp.scores = TensorView(o->key_scores.data(), DType::kF32, {hkv, group, nk});
    kp.skip_heads = skip_heads;
    STRATA_ASSERT_OK(CpuScoreKeys(kp));
    VoteTopKParams t;
    t.scores = kp.scores;
    t.candidates = kp.candidates;
    t.k = k;
    t.selected = TensorView(o->sel.data(), DType::kI32, {hkv, k});
    t.vote = TensorView(o->vote.data(), DType::kF32, {hkv, nk});
    t.skip_heads = skip_heads;
    STRATA_ASSERT_OK(CpuVoteTopK(t));
  };
  auto fresh = [&]() {
    return Out{std::vector<float>(hq * pages), std::vector<float>(hq * nk),
               std::vector<float>(hkv * nk), std::vector<int32_t>(hkv * k)};
  };
  const std::vector<float> q1 = RandomF(rng, hq * d), q2 = RandomF(rng, hq * d);
  Out first = fresh(), plain2 = fresh();
  run(q1, nullptr, &first);
  run(q2, nullptr, &plain2);
  Out skipped = first;  // step 2 over step 1's outputs, head 1 skipped
  run(q2, skip.data(), &skipped);
  auto rows = [](const auto& v, int g, int64_t per_head) {
    return std::vector<std::decay_t<decltype(v[0])>>(v.begin() + g * per_head,
                                                     v.begin() + (g + 1) * per_head);
  };
  for (int g = 0; g < hkv; ++g) {
    const Out& want = skip[g] ? first : plain2;
    EXPECT_EQ(rows(skipped.page_scores, g, group * pages), rows(want.page_scores, g, group * pages))
        << g;
    EXPECT_EQ(rows(skipped.key_scores, g, group * nk), rows(want.key_scores, g, group * nk)) << g;
    EXPECT_EQ(rows(skipped.vote, g, nk), rows(want.vote, g, nk)) << g;
    EXPECT_EQ(rows(skipped.sel, g, k), rows(want.sel, g, k)) << g;
  }
  EXPECT_NE(rows(first.sel, 1, k), rows(plain2.sel, 1, k));  // the skip is observable
}

// SelectedAttention clips middle ids to [middle.begin, middle.end): a token list holding ids that
// the suffix now covers, or below the prefix end, and page parents straddling both ends attend
// exactly as the lists with those ids removed (the host policy's ClipRanges).
TEST(CpuSelectionTest, SelectedAttentionClipsStaleMiddleIds) {
  std::mt19937 rng(29);
  const int hkv = 2, group = 2, hq = hkv * group, d = 16, page = 4, pages = 20;
  const int slots = hkv * pages;
  std::vector<float> q = RandomF(rng, hq * d), kp = RandomF(rng, slots * page * d),
                     vp = RandomF(rng, slots * page * d);
  std::vector<int32_t> table(slots);
  for (int i = 0; i < slots; ++i) table[i] = i;
  const int64_t prefix = 6, mid_end = 50, len = 70;
  auto attend = [&](const std::vector<int32_t>& parents, int fanout, std::vector<float>* out,
                    std::vector<float>* lse) {
    const int64_t m = static_cast<int64_t>(parents.size()) / hkv;
    SelectedAttentionParams p;
    p.q = TensorView(q.data(), DType::kF32, {1, hq, d});
    p.k_pool = TensorView(kp.data(), DType::kF32, {slots, page, d});
    p.v_pool = TensorView(vp.data(), DType::kF32, {slots, page, d});
    p.page_table = TensorView(table.data(), DType::kI32, {hkv, pages});
    p.prefix_end = prefix;
    p.middle.parents = TensorView(const_cast<int32_t*>(parents.data()), DType::kI32, {hkv, m});
    p.middle.fanout = fanout;
    p.middle.begin = prefix;
    p.middle.end = mid_end;
    p.suffix_begin = mid_end;
    p.suffix_end = len;
    p.scale = 0.25f;
    out->assign(hq * d, NAN);
    lse->assign(hq, NAN);
    p.out = TensorView(out->data(), DType::kF32, {1, hq, d});
    p.lse = TensorView(lse->data(), DType::kF32, {1, hq});
    STRATA_ASSERT_OK(CpuSelectedAttention(p));
  };
  std::vector<float> o1, l1, o2, l2;
  // Tokens: 3 and 52, 55 are outside the middle (52, 55 are in the suffix now).
  attend({3, 10, 20, 52, 55, /*head 1*/ 7, 49, 50, 51, -1}, 1, &o1, &l1);
  attend({-1, 10, 20, -1, -1, /*head 1*/ 7, 49, -1, -1, -1}, 1, &o2, &l2);
  for (int i = 0; i < hq * d; ++i) ASSERT_EQ(o1[i], o2[i]) << i;
  for (int i = 0; i < hq; ++i) ASSERT_EQ(l1[i], l2[i]) << i;
  // Pages of 4: page 1 = tokens 4..7 (6, 7 in the middle), page 12 = 48..51 (48, 49 in it).
  attend({1, 12, 5, /*head 1*/ 12, 13, -1}, page, &o1, &l1);
  attend({6, 7, 48, 49, 20, 21, 22, 23, /*head 1*/ 48, 49, -1, -1, -1, -1, -1, -1}, 1, &o2, &l2);
  for (int i = 0; i < hq * d; ++i) ASSERT_NEAR(o1[i], o2[i], 1e-6) << i;
  for (int i = 0; i < hq; ++i) ASSERT_NEAR(l1[i], l2[i], 1e-6) << i;
}

}  // namespace
}  // namespace strata::kernels

namespace strata::kernels {
namespace {

// Per-slot scales (SelectedAttentionParams::slot_scales) on fp8 pools: the same as an f32 pool
// holding every element dequantised with its slot's scales (times the pool's k_scale / v_scale).
TEST(CpuSelectionTest, SlotScalesDequantiseEachSlot) {
  std::mt19937 rng(21);
  const int hkv = 2, group = 2, hq = hkv * group, d = 16, page = 4, table_pages = 5;
  const int slots = hkv * table_pages;
  const int64_t n = static_cast<int64_t>(slots) * page * d;
  std::vector<uint8_t> k8(n), v8(n);
  std::vector<float> kf(n), vf(n), scales(2 * slots);
  std::uniform_real_distribution<float> u(-3, 3), sc(0.01f, 2.0f);
  for (float& x : scales) x = sc(rng);
  const float k_scale = 0.5f, v_scale = 1.5f;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = i / (page * d);
    k8[i] = F32ToFP8E4M3(u(rng));
    v8[i] = F32ToFP8E4M3(u(rng));
    kf[i] = FP8E4M3ToF32(k8[i]) * (k_scale * scales[2 * slot]);
    vf[i] = FP8E4M3ToF32(v8[i]) * (v_scale * scales[2 * slot + 1]);
  }
  std::vector<int32_t> table(hkv * table_pages);
  for (int i = 0; i < hkv * table_pages; ++i) table[i] = (i * 7) % slots;  // a permutation
  std::vector<float> q = RandomF(rng, hq * d);
  std::vector<int32_t> parents = {1, 3, -1, 2, 0, 3};
  SelectedAttentionParams p;
  p.q = TensorView(q.data(), DType::kF32, {1, hq, d});
  p.page_table = TensorView(table.data(), DType::kI32, {hkv, table_pages});
  p.prefix_end = 2;
  p.middle.parents = TensorView(parents.data(), DType::kI32, {hkv, 3});
  p.middle.fanout = page;
  p.middle.begin = page;
  p.middle.end = 4 * page;
  p.suffix_begin = 4 * page + 1;
  p.suffix_end = 5 * page;
  p.scale = 0.25f;
  std::vector<float> o8(hq * d, NAN), l8(hq, NAN), of(hq * d, NAN), lf(hq, NAN);
  SelectedAttentionParams a = p;
  a.k_pool = TensorView(k8.data(), DType::kFP8E4M3, {slots, page, d});
  a.v_pool = TensorView(v8.data(), DType::kFP8E4M3, {slots, page, d});
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.slot_scales = scales.data();
  a.out = TensorView(o8.data(), DType::kF32, {1, hq, d});
  a.lse = TensorView(l8.data(), DType::kF32, {1, hq});
  STRATA_ASSERT_OK(CpuSelectedAttention(a));
  SelectedAttentionParams b = p;
  b.k_pool = TensorView(kf.data(), DType::kF32, {slots, page, d});
  b.v_pool = TensorView(vf.data(), DType::kF32, {slots, page, d});
  b.out = TensorView(of.data(), DType::kF32, {1, hq, d});
  b.lse = TensorView(lf.data(), DType::kF32, {1, hq});
  STRATA_ASSERT_OK(CpuSelectedAttention(b));
  for (int i = 0; i < hq * d; ++i) EXPECT_NEAR(o8[i], of[i], 1e-5f * (1 + std::fabs(of[i]))) << i;
  for (int h = 0; h < hq; ++h) EXPECT_NEAR(l8[h], lf[h], 1e-5f * (1 + std::fabs(lf[h]))) << h;
  // Slot scales on a non-fp8 pool are refused.
  b.slot_scales = scales.data();
  EXPECT_THAT(CpuSelectedAttention(b), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::kernels
