// The device-resident selection ops (kernels/backend.h: ScoreSummaries, ScoreKeys, VoteTopK,
// SelectedAttention), chained as the quest and default tokenselect pipelines, reproduce the
// engine's CPU policies (engine/sparse/policy.h) on a KvCache: the same attended tokens per KV head
// and the same attention output as PagedAttention over the policy's spans. Runs the ops through the
// CPU backend (their specification); kernels/cuda/selection_test.cc holds the CUDA twins to them.
#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/kv_cache.h"
#include "engine/sparse/policy.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine::sparse {
namespace {

using kernels::CandidateList;
using kernels::DType;
using kernels::TensorView;

constexpr int kHq = 8, kHkv = 2, kD = 32, kPage = 16, kSegPages = 4;
constexpr int kBudget = 256, kSinks = 64, kWindow = 256, kMinSegments = 16, kSegmentFactor = 4;
constexpr int kCandidateFactor = 4;
constexpr int kTwoLevelMinPages = 512;  // below the middle's 1250 pages: two-level ranking
// Middle [64, len - 1 - 256) is page-aligned at both ends (no partial page for FillPages to add).
constexpr int64_t kLen = 1250 * kPage + kWindow + 1;

PolicyOptions Options(PolicyKind kind) {
  PolicyOptions o;
  o.kind = kind;
  o.token_budget = kBudget;
  o.sink_tokens = kSinks;
  o.window_tokens = kWindow;
  o.page_size = kPage;
  o.segment_pages = kSegPages;
  o.min_segments = kMinSegments;
  o.segment_factor = kSegmentFactor;
  o.tokenselect_candidate_factor = kCandidateFactor;
  o.two_level_min_pages = kTwoLevelMinPages;
  o.tokenselect_partitions = 1;  // the exact vote, as the chain below runs it
  o.cache_theta = 2.0;  // no selection cache
  return o;
}

// Tokens attended per KV head, from spans.
std::vector<std::set<int64_t>> TokenSets(const std::vector<kernels::KvSpan>& spans,
                                         const std::vector<int32_t>& offsets) {
  std::vector<std::set<int64_t>> out(kHkv);
  for (int g = 0; g < kHkv; ++g) {
    for (int32_t i = offsets[g]; i < offsets[g + 1]; ++i) {
      for (int32_t t = 0; t < spans[i].length; ++t) out[g].insert(spans[i].position + t);
    }
  }
  return out;
}

class DevicePipelineTest : public ::testing::TestWithParam<std::tuple<PolicyKind, DType>> {};

TEST_P(DevicePipelineTest, MatchesCpuPolicy) {
  const auto [kind, dtype] = GetParam();
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  KvCacheOptions co;
  co.num_layers = 1;
  co.num_kv_heads = kHkv;
  co.head_dim = kD;
  co.page_size = kPage;
  co.dtype = dtype;
  co.max_tokens = kLen;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<KvCache> cache, KvCache::Create(co, cpu.get()));
  std::mt19937 rng(4242 + static_cast<int>(kind) * 7 + static_cast<int>(dtype));
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(kLen) * kHkv * kD), v(k.size()), q(kHq * kD);
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  for (float& x : q) x = 2.0f * nd(rng);
  STRATA_ASSERT_OK_AND_ASSIGN(auto policy, MakeSparsePolicy(Options(kind), 1, kHq, kHkv, kD));
  STRATA_ASSERT_OK(cache->Append(0, TensorView(k.data(), DType::kF32, {kLen, kHkv, kD}),
                                 TensorView(v.data(), DType::kF32, {kLen, kHkv, kD})));
  STRATA_ASSERT_OK(policy->OnAppend(0, *cache, 0, kLen));
  Selection sel;
  STRATA_ASSERT_OK(policy->Select(0, q.data(), 1, kHq, kLen - 1, *cache, &sel));
  const std::vector<std::set<int64_t>> want = TokenSets(sel.spans, sel.offsets);

  // Device-side inputs: page table, f32 minmax summaries of pages and segments (from the stored,
  // possibly bf16-rounded keys, as HeadSummaries builds them).
  const TensorView k_pool = cache->k_pool(0), v_pool = cache->v_pool(0);
  const int64_t pages = (kLen + kPage - 1) / kPage, segs = (pages + kSegPages - 1) / kSegPages;
  std::vector<int32_t> table(kHkv * pages);
  std::vector<float> ps(static_cast<size_t>(kHkv) * pages * 2 * kD);
  std::vector<float> ss(static_cast<size_t>(kHkv) * segs * 2 * kD);
  std::vector<float> row(kD);
  for (int g = 0; g < kHkv; ++g) {
    for (int64_t p = 0; p < pages; ++p) {
      table[g * pages + p] = cache->SlotOf(0, g, p);
      float* s = &ps[(g * pages + p) * 2 * kD];
      for (int e = 0; e < kD; ++e) s[e] = INFINITY, s[kD + e] = -INFINITY;
      for (int64_t t = p * kPage; t < std::min<int64_t>(kLen, (p + 1) * kPage); ++t) {
        const int64_t r = static_cast<int64_t>(table[g * pages + p]) * kPage + t % kPage;
        kernels::ConvertToF32(static_cast<const char*>(k_pool.data) + r * kD * kernels::DTypeSize(dtype),
                              dtype, row.data(), kD);
        for (int e = 0; e < kD; ++e) {
          s[e] = std::min(s[e], row[e]);
          s[kD + e] = std::max(s[kD + e], row[e]);
        }
      }
      float* sg = &ss[(g * segs + p / kSegPages) * 2 * kD];
      if (p % kSegPages == 0) std::copy(s, s + 2 * kD, sg);
      for (int e = 0; e < kD; ++e) {
        sg[e] = std::min(sg[e], s[e]);
        sg[kD + e] = std::max(sg[kD + e], s[kD + e]);
      }
    }
  }

  const int group = kHq / kHkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  const int64_t window_begin = kLen - 1 - kWindow;
  const int64_t p0 = kSinks / kPage, p1 = (window_begin + kPage - 1) / kPage;
  const int64_t s0 = p0 / kSegPages, s1 = (p1 - 1) / kSegPages + 1;
  const bool tokens = kind == PolicyKind::kTokenSelect;
  const int64_t wanted_pages = (tokens ? kCandidateFactor * kBudget : kBudget) / kPage;
  const int64_t keep = std::min<int64_t>(
      s1 - s0, std::max<int64_t>(kMinSegments, (kSegmentFactor * wanted_pages + kSegPages - 1) / kSegPages));
  ASSERT_GT(p1 - p0, kTwoLevelMinPages) << "the test wants two-level ranking";

  std::vector<float> seg_scores(kHkv * group * (s1 - s0)), page_scores(kHkv * group * keep * kSegPages);
  std::vector<float> tok_scores(kHkv * group * wanted_pages * kPage);
  std::vector<int32_t> top_segs(kHkv * keep), top_pages(kHkv * wanted_pages), top_tokens(kHkv * kBudget);
  kernels::ScoreSummariesParams a;
  a.q = TensorView(q.data(), DType::kF32, {kHq, kD});
  a.summaries = TensorView(ss.data(), DType::kF32, {kHkv, segs, 2 * kD});
  a.candidates.begin = s0;
  a.candidates.end = s1;
  a.scale = scale;
  a.scores = TensorView(seg_scores.data(), DType::kF32, {kHkv, group, s1 - s0});
  STRATA_ASSERT_OK(cpu->ScoreSummaries(a, nullptr));
  kernels::VoteTopKParams t;
  t.scores = a.scores;
  t.candidates = a.candidates;
  t.k = keep;
  t.selected = TensorView(top_segs.data(), DType::kI32, {kHkv, keep});
  STRATA_ASSERT_OK(cpu->VoteTopK(t, nullptr));
  a.summaries = TensorView(ps.data(), DType::kF32, {kHkv, pages, 2 * kD});
  a.candidates = CandidateList();
  a.candidates.parents = t.selected;
  a.candidates.fanout = kSegPages;
  a.candidates.begin = p0;
  a.candidates.end = p1;
  a.scores = TensorView(page_scores.data(), DType::kF32, {kHkv, group, keep * kSegPages});
  STRATA_ASSERT_OK(cpu->ScoreSummaries(a, nullptr));
  t.scores = a.scores;
  t.candidates = a.candidates;
  t.k = wanted_pages;
  t.selected = TensorView(top_pages.data(), DType::kI32, {kHkv, wanted_pages});
  STRATA_ASSERT_OK(cpu->VoteTopK(t, nullptr));
  const TensorView pt(table.data(), DType::kI32, {kHkv, pages});
  CandidateList middle;
  middle.parents = t.selected;
  middle.fanout = kPage;
  middle.begin = kSinks;
  middle.end = window_begin;
  if (tokens) {
    kernels::ScoreKeysParams sk;
    sk.q = a.q;
    sk.k_pool = k_pool;
    sk.page_table = pt;
    sk.candidates = middle;
    sk.scale = scale;
    sk.scores = TensorView(tok_scores.data(), DType::kF32, {kHkv, group, wanted_pages * kPage});
    STRATA_ASSERT_OK(cpu->ScoreKeys(sk, nullptr));
    t.scores = sk.scores;
    t.candidates = middle;
    t.k = kBudget;
    t.selected = TensorView(top_tokens.data(), DType::kI32, {kHkv, kBudget});
    STRATA_ASSERT_OK(cpu->VoteTopK(t, nullptr));
    middle.parents = t.selected;
    middle.fanout = 1;
  }

  // The same attended tokens per KV head.
  for (int g = 0; g < kHkv; ++g) {
    std::set<int64_t> got;
    for (int64_t x = 0; x < kSinks; ++x) got.insert(x);
    for (int64_t x = window_begin; x < kLen; ++x) got.insert(x);
    for (int64_t i = 0; i < middle.Count(); ++i) {
      const int64_t id = kernels::CandidateId(middle, g, i);
      if (id >= 0) got.insert(id);
    }
    EXPECT_EQ(got.size(), static_cast<size_t>(kSinks + kBudget + (kLen - window_begin))) << g;
    EXPECT_EQ(got, want[g]) << "KV head " << g;
  }

  // The same attention output as PagedAttention over the policy's spans.
  std::vector<float> out(kHq * kD), lse(kHq), out2(kHq * kD), lse2(kHq);
  kernels::SelectedAttentionParams at;
  at.q = TensorView(q.data(), DType::kF32, {1, kHq, kD});
  at.k_pool = k_pool;
  at.v_pool = v_pool;
  at.page_table = pt;
  at.prefix_end = kSinks;
  at.middle = middle;
  at.suffix_begin = window_begin;
  at.suffix_end = kLen;
  at.scale = scale;
  at.out = TensorView(out.data(), DType::kF32, {1, kHq, kD});
  at.lse = TensorView(lse.data(), DType::kF32, {1, kHq});
  STRATA_ASSERT_OK(cpu->SelectedAttention(at, nullptr));
  const int32_t qpos = static_cast<int32_t>(kLen - 1);
  kernels::PagedAttentionParams pa;
  pa.q = at.q;
  pa.k_pool = k_pool;
  pa.v_pool = v_pool;
  pa.spans = sel.spans.data();
  pa.span_offsets = sel.offsets.data();
  pa.num_kv_heads = kHkv;
  pa.q_positions = &qpos;
  pa.causal = true;
  pa.scale = scale;
  pa.out = TensorView(out2.data(), DType::kF32, {1, kHq, kD});
  pa.lse = TensorView(lse2.data(), DType::kF32, {1, kHq});
  STRATA_ASSERT_OK(cpu->PagedAttention(pa, nullptr));
  for (int i = 0; i < kHq * kD; ++i) EXPECT_NEAR(out[i], out2[i], 1e-4) << i;
  for (int i = 0; i < kHq; ++i) EXPECT_NEAR(lse[i], lse2[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(PoliciesAndDtypes, DevicePipelineTest,
                         ::testing::Combine(::testing::Values(PolicyKind::kQuest,
                                                              PolicyKind::kTokenSelect),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

}  // namespace
}  // namespace strata::engine::sparse
