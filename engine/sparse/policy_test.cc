// Tests of the sparse policies through KvCache and CpuPagedAttention.
#include "engine/sparse/policy.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine::sparse {
namespace {

using ::strata::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using kernels::DType;
using kernels::TensorView;

constexpr uint32_t kSeed = 5150;
constexpr int kLayers = 2, kHq = 8, kHkv = 2, kD = 32;

const std::vector<PolicyKind> kSparseKinds = {PolicyKind::kStreaming, PolicyKind::kQuest,
                                              PolicyKind::kRadar,     PolicyKind::kTokenSelect,
                                              PolicyKind::kHip,       PolicyKind::kSubGen};

// A cache of `len` random tokens (both layers the same), filled in chunks with OnAppend calls.
struct World {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  std::unique_ptr<KvCache> cache;
  std::vector<float> keys, values;  // [len, hkv, d]
  int64_t len = 0;
  int page = 16;
};

void Build(World* w, int64_t len, int page, DType dtype, std::mt19937& rng,
           const std::vector<int64_t>& needles = {}, const float* needle_dir = nullptr,
           int needle_run = 1, float needle_scale = 4.0f) {
  KvCacheOptions o;
  o.num_layers = kLayers;
  o.num_kv_heads = kHkv;
  o.head_dim = kD;
  o.page_size = page;
  o.dtype = dtype;
  o.max_tokens = len + 64;
  w->page = page;
  w->cache = std::move(KvCache::Create(o, w->backend.get())).value();
  std::normal_distribution<float> nd;
  w->keys.resize(static_cast<size_t>(len) * kHkv * kD);
  w->values.resize(w->keys.size());
  for (float& x : w->keys) x = nd(rng);
  for (float& x : w->values) x = nd(rng);
  for (int64_t n : needles) {
    for (int64_t t = n; t < n + needle_run && t < len; ++t) {
      for (int g = 0; g < kHkv; ++g) {
        for (int i = 0; i < kD; ++i) w->keys[(t * kHkv + g) * kD + i] = needle_scale * needle_dir[i];
      }
    }
  }
  w->len = len;
}

// Appends tokens [from, to) to every layer and tells the policy.
void Feed(World* w, AttentionPolicy* p, int64_t from, int64_t to) {
  const int64_t n = to - from;
  for (int l = 0; l < kLayers; ++l) {
    TensorView k(&w->keys[from * kHkv * kD], DType::kF32, {n, kHkv, kD});
    TensorView v(&w->values[from * kHkv * kD], DType::kF32, {n, kHkv, kD});
    STRATA_ASSERT_OK(w->cache->Append(l, k, v));
    if (p != nullptr) STRATA_ASSERT_OK(p->OnAppend(l, *w->cache, from, to));
  }
}

void FeedAll(World* w, AttentionPolicy* p, std::mt19937& rng) {
  int64_t t = w->cache->length(0);
  while (t < w->len) {
    const int64_t c = std::min<int64_t>(w->len - t, std::uniform_int_distribution<int>(1, 700)(rng));
    Feed(w, p, t, t + c);
    t += c;
  }
}

// Token positions attended by KV head g (each exactly once, else the test fails).
std::vector<int64_t> Attended(const Selection& sel, int g) {
  std::vector<int64_t> out;
  for (int i = sel.offsets[g]; i < sel.offsets[g + 1]; ++i) {
    for (int j = 0; j < sel.spans[i].length; ++j) out.push_back(sel.spans[i].position + j);
  }
  std::sort(out.begin(), out.end());
  EXPECT_TRUE(std::adjacent_find(out.begin(), out.end()) == out.end()) << "duplicate tokens";
  return out;
}

std::vector<float> Attend(World* w, int layer, const Selection& sel, const std::vector<float>& q,
                          int nt, int64_t q_begin) {
  std::vector<float> out(q.size()), lse(static_cast<size_t>(nt) * kHq);
  std::vector<int32_t> pos(nt);
  for (int t = 0; t < nt; ++t) pos[t] = static_cast<int32_t>(q_begin + t);
  kernels::PagedAttentionParams p;
  p.q = TensorView(const_cast<float*>(q.data()), DType::kF32, {nt, kHq, kD});
  p.k_pool = w->cache->k_pool(layer);
  p.v_pool = w->cache->v_pool(layer);
  p.spans = sel.spans.data();
  p.span_offsets = sel.offsets.data();
  p.num_kv_heads = kHkv;
  p.q_positions = pos.data();
  p.scale = 1.0f / std::sqrt(static_cast<float>(kD));
  p.out = TensorView(out.data(), DType::kF32, {nt, kHq, kD});
  p.lse = TensorView(lse.data(), DType::kF32, {nt, kHq});
  STRATA_EXPECT_OK(kernels::CpuPagedAttention(p));
  return out;
}

PolicyOptions Small(PolicyKind kind, int budget) {
  PolicyOptions o;
  o.kind = kind;
  o.token_budget = budget;
  o.sink_tokens = 8;
  o.window_tokens = 32;
  o.page_size = 16;
  o.rf_features = 256;
  o.two_level_min_pages = 16;  // exercise the two-level path
  o.segment_pages = 4;
  o.min_segments = 2;
  return o;
}

TEST(PolicyOptionsTest, ParseAndValidate) {
  EXPECT_EQ(ParsePolicyName("radar").value(), PolicyKind::kRadar);
  EXPECT_THAT(ParsePolicyName("nope"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(ParseSummaryKind("rf").value(), SummaryKind::kRf);
  EXPECT_THAT(ParseSummaryKind("max"), StatusIs(absl::StatusCode::kInvalidArgument));
  PolicyOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.kind = PolicyKind::kQuest;
  o.summary = SummaryKind::kNone;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  o = PolicyOptions();
  o.page_size = 0;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  o = PolicyOptions();
  o.cache_theta = 0;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  for (int factor : {0, 17}) {
    o = PolicyOptions();
    o.tokenselect_candidate_factor = factor;
    EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("candidate_factor")))
        << factor;
  }
  o.tokenselect_candidate_factor = 16;
  EXPECT_TRUE(o.Validate().ok());
  o = PolicyOptions();
  EXPECT_THAT(MakeAttentionPolicy(o, 2, 8, 3, 32), StatusIs(absl::StatusCode::kInvalidArgument));
  o.dense_layers = {2};
  EXPECT_THAT(MakeAttentionPolicy(o, 2, 8, 2, 32), StatusIs(absl::StatusCode::kInvalidArgument));
}

// tokenselect_partitions: 0 (by the budget, the default) or a power of two in [1, 64] (the error
// names the field); any budget (one that is not a multiple of the parts is rounded up to one,
// TokenSelectPartitionsKeepTheirShare).
TEST(PolicyOptionsTest, TokenSelectPartitions) {
  PolicyOptions o;
  EXPECT_EQ(o.tokenselect_partitions, 0);
  STRATA_EXPECT_OK(o.Validate());
  // By the budget: the largest power of two <= 16 that divides it with >= 128 tokens per part
  // (the default never rounds the budget up), inside the shape every backend runs in parts
  // (kernels/part_limits.h): candidate_factor * B / P <= 4096 candidates per part (4 * 16384 /
  // 16 is; 4 * 16400 / 16 is not), at most 4 query heads per KV head; else 1.
  for (const auto& [budget, want] : {std::pair{2048, 16}, std::pair{4096, 16}, std::pair{16384, 16},
                                     std::pair{16400, 1}, std::pair{1 << 20, 1}, std::pair{2047, 1},
                                     std::pair{2000, 8}, std::pair{1990, 2}, std::pair{3000, 8},
                                     std::pair{1024, 8}, std::pair{512, 4}, std::pair{256, 2},
                                     std::pair{255, 1}, std::pair{1, 1}}) {
    o.token_budget = budget;
    EXPECT_EQ(o.EffectivePartitions(4), want) << budget;
  }
  // The default never rounds a budget up: its count divides every budget, with >= 128 tokens per
  // part (or is 1), and keeps a part's candidates within 4096.
  for (int budget = 1; budget <= 20000; ++budget) {
    o.token_budget = budget;
    const int p = o.EffectivePartitions(4);
    ASSERT_EQ(budget % p, 0) << budget;
    ASSERT_TRUE(p == 1 || (budget / p >= 128 && 4 * budget / p <= 4096)) << budget << " " << p;
  }
  o.token_budget = 2048;
  EXPECT_EQ(o.EffectivePartitions(1), 16);
  EXPECT_EQ(o.EffectivePartitions(5), 1);
  o.tokenselect_candidate_factor = 16;  // 32768 candidates: 2048 per part
  EXPECT_EQ(o.EffectivePartitions(4), 16);
  o.token_budget = 8192;  // 131072: 8192 per part
  EXPECT_EQ(o.EffectivePartitions(4), 1);
  o.tokenselect_partitions = 4;
  EXPECT_EQ(o.EffectivePartitions(8), 4);  // given: as given, whatever the budget and shape
  for (int parts : {-4, 3, 6, 48, 128}) {
    o = PolicyOptions();
    o.tokenselect_partitions = parts;
    EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("tokenselect_partitions")))
        << parts;
  }
  for (int parts : {1, 2, 16, 64}) {
    o = PolicyOptions();  // tokenselect, budget 2048
    o.tokenselect_partitions = parts;
    SCOPED_TRACE(parts);
    STRATA_EXPECT_OK(o.Validate());
  }
  o = PolicyOptions();
  o.kind = PolicyKind::kTokenSelect;
  o.token_budget = 100;
  o.tokenselect_partitions = 8;
  STRATA_EXPECT_OK(o.Validate());
  o.token_budget = 104;
  STRATA_EXPECT_OK(o.Validate());
  o.token_budget = 0;  // a multiple too
  STRATA_EXPECT_OK(o.Validate());
  o.token_budget = 100;
  o.tokenselect_partitions = 4;
  STRATA_EXPECT_OK(o.Validate());
  o.tokenselect_partitions = 1;  // one part takes any budget
  o.token_budget = 99;
  STRATA_EXPECT_OK(o.Validate());
  // Other policies ignore the parts (but not their range).
  o.kind = PolicyKind::kQuest;
  o.tokenselect_partitions = 8;
  STRATA_EXPECT_OK(o.Validate());
  o.tokenselect_partitions = 3;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MakeSparsePolicy(o, kLayers, kHq, kHkv, kD),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Every policy whose budget covers the whole context is exact (equals dense), for decode and
// for a prefill chunk, with f32 and bf16 pools.
// 512-token first-level segments unless set (bench/RESULTS.md, fidelity: first-level segments).
TEST(PolicyOptionsTest, EffectiveSegmentPages) {
  PolicyOptions o;
  EXPECT_EQ(o.EffectiveSegmentPages(), 8);  // P = 64
  o.page_size = 16;
  EXPECT_EQ(o.EffectiveSegmentPages(), 32);
  o.page_size = 1024;
  EXPECT_EQ(o.EffectiveSegmentPages(), 1);
  o.segment_pages = 4;
  EXPECT_EQ(o.EffectiveSegmentPages(), 4);
}

TEST(PolicyTest, FullBudgetEqualsDense) {
  std::mt19937 rng(kSeed);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    World w;
    Build(&w, 600, 16, dtype, rng);
    std::vector<std::unique_ptr<AttentionPolicy>> policies;
    for (PolicyKind kind : kSparseKinds) {
      if (kind == PolicyKind::kStreaming) continue;  // never attends the middle
      policies.push_back(MakeAttentionPolicy(Small(kind, 4096), kLayers, kHq, kHkv, kD).value());
    }
    std::unique_ptr<AttentionPolicy> dense = MakeDensePolicy();
    int64_t t = 0;
    while (t < w.len) {
      const int64_t c = std::min<int64_t>(w.len - t, std::uniform_int_distribution<int>(1, 120)(rng));
      Feed(&w, nullptr, t, t + c);
      for (auto& p : policies) {
        for (int l = 0; l < kLayers; ++l) STRATA_ASSERT_OK(p->OnAppend(l, *w.cache, t, t + c));
      }
      std::vector<float> q(static_cast<size_t>(c) * kHq * kD);
      std::normal_distribution<float> nd;
      for (float& x : q) x = nd(rng);
      Selection ref_sel;
      STRATA_ASSERT_OK(dense->Select(1, q.data(), c, kHq, t, *w.cache, &ref_sel));
      const std::vector<float> ref = Attend(&w, 1, ref_sel, q, c, t);
      for (auto& p : policies) {
        Selection sel;
        STRATA_ASSERT_OK(p->Select(1, q.data(), c, kHq, t, *w.cache, &sel));
        const std::vector<float> got = Attend(&w, 1, sel, q, c, t);
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_NEAR(got[i], ref[i], 1e-5) << p->Name() << " at length " << t + c;
        }
      }
      t += c;
    }
  }
}

// Budgets are never exceeded: attended = sinks + window + middle with middle <= B; spans disjoint.
TEST(PolicyTest, BudgetsNeverExceeded) {
  std::mt19937 rng(kSeed + 1);
  World w;
  Build(&w, 3000, 16, DType::kF32, rng);
  for (int budget : {0, 1, 17, 100, 640}) {
    std::vector<std::unique_ptr<SparsePolicy>> policies;
    for (PolicyKind kind : kSparseKinds) {
      if (kind == PolicyKind::kSubGen && budget < 4) continue;  // no room for clusters
      policies.push_back(MakeSparsePolicy(Small(kind, budget), kLayers, kHq, kHkv, kD).value());
    }
    World fresh;
    fresh.backend = kernels::MakeCpuBackend(1);
    std::mt19937 rng2(kSeed + 2);
    Build(&fresh, 3000, 16, DType::kF32, rng2);
    for (int64_t t = 0; t < fresh.len; t += 500) {
      Feed(&fresh, nullptr, t, t + 500);
      for (auto& p : policies) {
        for (int l = 0; l < kLayers; ++l) STRATA_ASSERT_OK(p->OnAppend(l, *fresh.cache, t, t + 500));
      }
      for (int step = 0; step < 3; ++step) {
        std::vector<float> q(kHq * kD);
        std::normal_distribution<float> nd;
        for (float& x : q) x = nd(rng);
        const int64_t len = t + 500;
        for (auto& p : policies) {
          Selection sel;
          STRATA_ASSERT_OK(p->Select(0, q.data(), 1, kHq, len - 1, *fresh.cache, &sel));
          for (int g = 0; g < kHkv; ++g) {
            const std::vector<int64_t> a = Attended(sel, g);
            const int64_t sinks = std::min<int64_t>(8, len);
            const int64_t wb = std::clamp<int64_t>(len - 1 - 32, sinks, len);
            int64_t middle = 0;
            for (int64_t x : a) middle += (x >= sinks && x < wb);
            ASSERT_LE(middle, budget) << p->Name();
            ASSERT_EQ(static_cast<int64_t>(a.size()), sinks + (len - wb) + middle) << p->Name();
          }
        }
      }
    }
  }
}

// An fp8 KV cache (codes times per-tensor scales) selects exactly as an f32 cache holding its
// values, for every policy that reads keys (HeadRows reads the codes times k_scale / v_scale).
TEST(PolicyTest, Fp8CacheSelectsAsTheF32CacheOfItsValues) {
  constexpr float kKScale = 0.25f, kVScale = 0.5f;
  std::mt19937 rng(kSeed + 9);
  World w8, w32;
  Build(&w8, 1800, 16, DType::kF32, rng);
  KvCacheOptions o = w8.cache->options();
  o.dtype = DType::kFP8E4M3;
  o.k_scale = kKScale;
  o.v_scale = kVScale;
  w8.cache = std::move(KvCache::Create(o, w8.backend.get())).value();
  Build(&w32, 1800, 16, DType::kF32, rng);
  // The f32 cache holds what the fp8 one stores, as values.
  for (size_t i = 0; i < w8.keys.size(); ++i) {
    w32.keys[i] = kernels::FP8E4M3ToF32(kernels::F32ToFP8E4M3(w8.keys[i] / kKScale)) * kKScale;
    w32.values[i] = kernels::FP8E4M3ToF32(kernels::F32ToFP8E4M3(w8.values[i] / kVScale)) * kVScale;
  }
  std::vector<std::unique_ptr<SparsePolicy>> p8, p32;
  for (PolicyKind kind : kSparseKinds) {
    p8.push_back(MakeSparsePolicy(Small(kind, 128), kLayers, kHq, kHkv, kD).value());
    p32.push_back(MakeSparsePolicy(Small(kind, 128), kLayers, kHq, kHkv, kD).value());
  }
  for (int64_t t = 0; t < w8.len; t += 600) {
    Feed(&w8, nullptr, t, t + 600);
    Feed(&w32, nullptr, t, t + 600);
    for (size_t i = 0; i < p8.size(); ++i) {
      for (int l = 0; l < kLayers; ++l) {
        STRATA_ASSERT_OK(p8[i]->OnAppend(l, *w8.cache, t, t + 600));
        STRATA_ASSERT_OK(p32[i]->OnAppend(l, *w32.cache, t, t + 600));
      }
    }
  }
  std::normal_distribution<float> nd;
  int selecting = 0;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> q(kHq * kD);
    for (float& x : q) x = nd(rng);
    for (size_t i = 0; i < p8.size(); ++i) {
      SCOPED_TRACE(p8[i]->Name());
      Selection a, b;
      STRATA_ASSERT_OK(p8[i]->Select(1, q.data(), 1, kHq, w8.len - 1, *w8.cache, &a));
      STRATA_ASSERT_OK(p32[i]->Select(1, q.data(), 1, kHq, w32.len - 1, *w32.cache, &b));
      ASSERT_EQ(a.offsets, b.offsets);
      for (int g = 0; g < kHkv; ++g) {
        EXPECT_EQ(Attended(a, g), Attended(b, g)) << "KV head " << g;
        selecting += static_cast<int>(Attended(a, g).size()) < w8.len;
      }
    }
  }
  EXPECT_EQ(selecting, 3 * static_cast<int>(p8.size()) * kHkv);  // every policy chose a subset
}

// A needle whose score dominates is always selected (hip: a run of needle tokens, since HiP relies
// on attention locality to find it; a lone token between random keys is invisible to centre keys).
TEST(PolicyTest, PlantedNeedleIsSelected) {
  std::mt19937 rng(kSeed + 3);
  std::normal_distribution<float> nd;
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<float> dir(kD);
    double n2 = 0;
    for (float& x : dir) {
      x = nd(rng);
      n2 += x * x;
    }
    for (float& x : dir) x *= static_cast<float>(std::sqrt(kD / n2));  // |dir| = sqrt(d)
    const int64_t len = 4000;
    const int64_t needle = std::uniform_int_distribution<int64_t>(100, len - 200)(rng);
    for (PolicyKind kind : {PolicyKind::kQuest, PolicyKind::kRadar, PolicyKind::kTokenSelect,
                            PolicyKind::kHip}) {
      for (SummaryKind summary :
           {SummaryKind::kDefault, SummaryKind::kRf, SummaryKind::kMean, SummaryKind::kNone}) {
        if (kind == PolicyKind::kHip && summary != SummaryKind::kDefault) continue;
        if (kind != PolicyKind::kTokenSelect && summary == SummaryKind::kNone) continue;
        World w;
        std::mt19937 wrng(kSeed + 10 * trial);
        PolicyOptions o = Small(kind, 256);
        o.summary = summary;
        // Averaging summaries (mean, rf) dilute a single key by the page length, and rf estimates
        // exp(q.k / sqrt(d)) with a variance growing like exp(|q' + k'|^2) / n (RADAR Theorem 2's
        // exp(zeta^2 / sqrt(d)) factor), so for them the needle is a run of moderate keys covering
        // a page; minmax (an upper bound) and token-level scoring must find a single strong key.
        const SummaryKind eff = o.EffectiveSummary();
        const bool averaging = eff == SummaryKind::kRf || eff == SummaryKind::kMean;
        if (eff == SummaryKind::kRf) o.rf_features = 2048;
        const int run = kind == PolicyKind::kHip ? 64 : averaging ? 32 : 1;
        Build(&w, len, 16, DType::kBF16, wrng, {needle}, dir.data(), run, averaging ? 1.0f : 4.0f);
        std::unique_ptr<AttentionPolicy> p = MakeAttentionPolicy(o, kLayers, kHq, kHkv, kD).value();
        FeedAll(&w, p.get(), rng);
        // Queries of every head: the needle direction plus noise.
        std::vector<float> q(kHq * kD);
        for (int h = 0; h < kHq; ++h) {
          for (int i = 0; i < kD; ++i) q[h * kD + i] = dir[i] + 0.3f * nd(rng);
        }
        Selection sel;
        STRATA_ASSERT_OK(p->Select(1, q.data(), 1, kHq, len - 1, *w.cache, &sel));
        for (int g = 0; g < kHkv; ++g) {
          const std::vector<int64_t> a = Attended(sel, g);
          ASSERT_TRUE(std::binary_search(a.begin(), a.end(), needle + run / 2))
              << p->Name() << " missed the needle at " << needle << " trial " << trial
              << " seed " << kSeed;
        }
      }
    }
  }
}

// The selection cache hits exactly when cosine(query, cached query) >= theta.
TEST(PolicyTest, SelectionCacheFollowsTheta) {
  std::mt19937 rng(kSeed + 4);
  World w;
  Build(&w, 2000, 16, DType::kF32, rng);
  PolicyOptions o = Small(PolicyKind::kQuest, 128);
  o.cache_theta = 0.9;
  std::unique_ptr<AttentionPolicy> p = MakeAttentionPolicy(o, kLayers, kHq, kHkv, kD).value();
  FeedAll(&w, p.get(), rng);
  std::normal_distribution<float> nd;
  // Base query a (same norm in every head) and, per head, a unit vector orthogonal to it, so that
  // b = c a + sqrt(1 - c^2) |a| u has cosine exactly c with a for the group too.
  std::vector<float> a(kHq * kD), u(kHq * kD);
  for (int h = 0; h < kHq; ++h) {
    double aa = 0;
    for (int i = 0; i < kD; ++i) {
      a[h * kD + i] = nd(rng);
      aa += a[h * kD + i] * a[h * kD + i];
    }
    for (int i = 0; i < kD; ++i) a[h * kD + i] /= std::sqrt(aa);
    double ua = 0, uu = 0;
    for (int i = 0; i < kD; ++i) u[h * kD + i] = nd(rng);
    for (int i = 0; i < kD; ++i) ua += u[h * kD + i] * a[h * kD + i];
    for (int i = 0; i < kD; ++i) u[h * kD + i] -= ua * a[h * kD + i];
    for (int i = 0; i < kD; ++i) uu += u[h * kD + i] * u[h * kD + i];
    for (int i = 0; i < kD; ++i) u[h * kD + i] /= std::sqrt(uu);
  }
  auto with_cos = [&](double c) {
    std::vector<float> b(a.size());
    for (size_t i = 0; i < b.size(); ++i) b[i] = c * a[i] + std::sqrt(1 - c * c) * u[i];
    return b;
  };
  Selection sel;
  STRATA_ASSERT_OK(p->Select(1, a.data(), 1, kHq, w.len - 1, *w.cache, &sel));
  EXPECT_EQ(p->counters().cache_lookups, kHkv);
  EXPECT_EQ(p->counters().cache_hits, 0);
  std::vector<float> near = with_cos(0.95);
  STRATA_ASSERT_OK(p->Select(1, near.data(), 1, kHq, w.len - 1, *w.cache, &sel));
  EXPECT_EQ(p->counters().cache_lookups, 2 * kHkv);
  EXPECT_EQ(p->counters().cache_hits, kHkv);  // 0.95 >= 0.9: reused
  std::vector<float> far = with_cos(0.85);
  STRATA_ASSERT_OK(p->Select(1, far.data(), 1, kHq, w.len - 1, *w.cache, &sel));
  EXPECT_EQ(p->counters().cache_hits, kHkv);  // 0.85 < 0.9 (vs the cached a): miss, re-selected
  // The cache now holds `far`; `far` itself hits.
  STRATA_ASSERT_OK(p->Select(1, far.data(), 1, kHq, w.len - 1, *w.cache, &sel));
  EXPECT_EQ(p->counters().cache_hits, 2 * kHkv);
  // Layer 0 has its own cache: first lookup misses.
  STRATA_ASSERT_OK(p->Select(0, far.data(), 1, kHq, w.len - 1, *w.cache, &sel));
  EXPECT_EQ(p->counters().cache_hits, 2 * kHkv);
  EXPECT_EQ(p->counters().cache_lookups, 5 * kHkv);
}

// With a chunk of queries, selection uses the chunk's mean query, and the chunk + window are
// always attended.
TEST(PolicyTest, ChunkUsesMeanQueryAndAttendsItself) {
  std::mt19937 rng(kSeed + 5);
  std::normal_distribution<float> nd;
  for (PolicyKind kind : {PolicyKind::kQuest, PolicyKind::kRadar, PolicyKind::kTokenSelect,
                          PolicyKind::kHip}) {
    World w;
    Build(&w, 4000, 16, DType::kF32, rng);
    PolicyOptions o = Small(kind, 160);
    std::unique_ptr<AttentionPolicy> chunked = MakeAttentionPolicy(o, kLayers, kHq, kHkv, kD).value();
    std::unique_ptr<AttentionPolicy> single = MakeAttentionPolicy(o, kLayers, kHq, kHkv, kD).value();
    FeedAll(&w, nullptr, rng);
    for (int l = 0; l < kLayers; ++l) {
      STRATA_ASSERT_OK(chunked->OnAppend(l, *w.cache, 0, w.len));
      STRATA_ASSERT_OK(single->OnAppend(l, *w.cache, 0, w.len));
    }
    const int nt = 300;
    const int64_t q_begin = w.len - nt;
    std::vector<float> q(static_cast<size_t>(nt) * kHq * kD), mean(kHq * kD, 0.0f);
    for (float& x : q) x = nd(rng);
    for (int t = 0; t < nt; ++t) {
      for (int i = 0; i < kHq * kD; ++i) mean[i] += q[t * kHq * kD + i] / nt;
    }
    Selection a, b;
    STRATA_ASSERT_OK(chunked->Select(0, q.data(), nt, kHq, q_begin, *w.cache, &a));
    STRATA_ASSERT_OK(single->Select(0, mean.data(), 1, kHq, q_begin, *w.cache, &b));
    for (int g = 0; g < kHkv; ++g) {
      const std::vector<int64_t> ta = Attended(a, g), tb = Attended(b, g);
      EXPECT_EQ(ta, tb) << PolicyName(kind);
      for (int64_t t = q_begin - 32; t < w.len; ++t) {
        ASSERT_TRUE(std::binary_search(ta.begin(), ta.end(), t)) << "token " << t;
      }
    }
  }
}

// Dense layers attend everything; other layers do not.
TEST(PolicyTest, DenseLayers) {
  std::mt19937 rng(kSeed + 6);
  World w;
  Build(&w, 3000, 16, DType::kF32, rng);
  PolicyOptions o = Small(PolicyKind::kRadar, 128);
  o.dense_layers = {0};
  std::unique_ptr<AttentionPolicy> p = MakeAttentionPolicy(o, kLayers, kHq, kHkv, kD).value();
  FeedAll(&w, p.get(), rng);
  std::vector<float> q(kHq * kD, 0.1f);
  Selection s0, s1;
  STRATA_ASSERT_OK(p->Select(0, q.data(), 1, kHq, w.len - 1, *w.cache, &s0));
  STRATA_ASSERT_OK(p->Select(1, q.data(), 1, kHq, w.len - 1, *w.cache, &s1));
  EXPECT_EQ(static_cast<int64_t>(Attended(s0, 0).size()), w.len);
  EXPECT_EQ(static_cast<int64_t>(Attended(s1, 0).size()), 8 + 128 + 33);
}

// tokenselect in parts (PolicyOptions::tokenselect_partitions), one- and two-level: part j (the
// pages, two-level the segments, whose index is j mod P) keeps exactly ceil(budget / P) middle
// tokens of its own (each part has more candidates than that; budget 250 is not a multiple of
// the parts and is rounded up), the selected tokens are disjoint and in
// the middle, sinks and window are attended whole, for a decode step and a prefill chunk; a
// planted needle is still found; and the parts change the selection (P = 1 does not: it is the
// default's, token for token).
TEST(PolicyTest, TokenSelectPartitionsKeepTheirShare) {
  std::mt19937 rng(kSeed + 11);
  std::normal_distribution<float> nd;
  std::vector<float> dir(kD);
  double n2 = 0;
  for (float& x : dir) {
    x = nd(rng);
    n2 += x * x;
  }
  for (float& x : dir) x *= static_cast<float>(std::sqrt(kD / n2));
  const int64_t len = 3000, needle = 1234;
  const int page = 16, seg_pages = 4, sinks = 8, window = 32;
  World w;
  Build(&w, len, page, DType::kF32, rng, {needle}, dir.data(), 1, 4.0f);
  FeedAll(&w, nullptr, rng);
  for (const auto& [budget, two_level] : {std::pair{256, false}, std::pair{256, true}, std::pair{250, true}}) {
    PolicyOptions o = Small(PolicyKind::kTokenSelect, budget);
    // Two-level: 47 segments of which 16 are kept (8 per part at P = 2, 2 at P = 8).
    o.two_level_min_pages = two_level ? 16 : 1 << 20;
    o.segment_factor = 1;
    ASSERT_EQ(o.segment_pages, seg_pages);
    ASSERT_EQ(o.page_size, page);
    // The default (0: by the budget, 2 parts at 256 and 1 at 250) must select as that count does.
    std::unique_ptr<SparsePolicy> def = MakeSparsePolicy(o, kLayers, kHq, kHkv, kD).value();
    const int def_parts = o.EffectivePartitions(kHq / kHkv);
    ASSERT_EQ(def_parts, budget >= 256 ? 2 : 1);
    std::vector<int> all_parts = {1, 2, 4, 8};
    std::vector<std::unique_ptr<SparsePolicy>> policies;
    for (int parts : all_parts) {
      PolicyOptions op = o;
      op.tokenselect_partitions = parts;
      policies.push_back(MakeSparsePolicy(op, kLayers, kHq, kHkv, kD).value());
    }
    for (int l = 0; l < kLayers; ++l) {
      STRATA_ASSERT_OK(def->OnAppend(l, *w.cache, 0, len));
      for (auto& p : policies) STRATA_ASSERT_OK(p->OnAppend(l, *w.cache, 0, len));
    }
    for (int round = 0; round < 3; ++round) {
      // Rounds 0 and 1: a decode step (round 1 towards the needle); round 2: a chunk of 5.
      const int nt = round == 2 ? 5 : 1;
      const int64_t q_begin = len - nt;
      std::vector<float> q(static_cast<size_t>(nt) * kHq * kD);
      for (int t = 0; t < nt; ++t) {
        for (int i = 0; i < kHq * kD; ++i) {
          q[t * kHq * kD + i] = round == 1 ? dir[i % kD] + 0.3f * nd(rng) : nd(rng);
        }
      }
      Selection ref, by_default;
      STRATA_ASSERT_OK(policies[0]->Select(0, q.data(), nt, kHq, q_begin, *w.cache, &ref));
      STRATA_ASSERT_OK(def->Select(0, q.data(), nt, kHq, q_begin, *w.cache, &by_default));
      for (size_t pi = 0; pi < policies.size(); ++pi) {
        const int parts = all_parts[pi];
        SCOPED_TRACE(::testing::Message() << "budget " << budget << " two_level " << two_level
                                          << " parts " << parts << " round " << round);
        Selection sel;
        STRATA_ASSERT_OK(policies[pi]->Select(0, q.data(), nt, kHq, q_begin, *w.cache, &sel));
        if (parts == def_parts) {
          for (int g = 0; g < kHkv; ++g) EXPECT_EQ(Attended(sel, g), Attended(by_default, g)) << g;
        }
        bool differs = false;
        for (int g = 0; g < kHkv; ++g) {
          const std::vector<int64_t> a = Attended(sel, g);  // fails on a duplicate token
          const std::vector<int64_t> want = Attended(ref, g);
          if (parts == 1) {
            EXPECT_EQ(a, want) << g;
            continue;
          }
          differs = differs || a != want;
          const int64_t wb = q_begin - window;
          std::vector<int64_t> per_part(parts, 0);
          int64_t head = 0, tail = 0;
          for (int64_t t : a) {
            if (t < sinks) {
              ++head;
            } else if (t >= wb) {
              ++tail;
            } else {
              const int64_t unit = two_level ? t / page / seg_pages : t / page;
              ++per_part[unit % parts];
            }
          }
          EXPECT_EQ(head, sinks);
          EXPECT_EQ(tail, len - wb);
          for (int j = 0; j < parts; ++j) EXPECT_EQ(per_part[j], (budget + parts - 1) / parts) << "part " << j;
          if (round == 1) {
            EXPECT_TRUE(std::binary_search(a.begin(), a.end(), needle)) << "missed the needle";
          }
        }
        if (parts > 1) {
          EXPECT_TRUE(differs) << "the parts selected what one part does";
        }
      }
    }
  }
}

// A part's share of the candidates smaller than a page (candidate factor 1, budget 32, 4 parts:
// 8 candidate tokens each, 16-token pages) still takes a whole page of its own and keeps its 8
// tokens from it.
TEST(PolicyTest, TokenSelectPartsShareSmallerThanAPage) {
  std::mt19937 rng(kSeed + 12);
  World w;
  const int64_t len = 2000;
  Build(&w, len, 16, DType::kF32, rng);
  FeedAll(&w, nullptr, rng);
  for (bool two_level : {false, true}) {
    PolicyOptions o = Small(PolicyKind::kTokenSelect, 32);
    o.two_level_min_pages = two_level ? 16 : 1 << 20;
    o.tokenselect_candidate_factor = 1;
    o.tokenselect_partitions = 4;
    std::unique_ptr<SparsePolicy> p = MakeSparsePolicy(o, kLayers, kHq, kHkv, kD).value();
    for (int l = 0; l < kLayers; ++l) STRATA_ASSERT_OK(p->OnAppend(l, *w.cache, 0, len));
    std::normal_distribution<float> nd;
    std::vector<float> q(kHq * kD);
    for (float& x : q) x = nd(rng);
    Selection sel;
    STRATA_ASSERT_OK(p->Select(0, q.data(), 1, kHq, len - 1, *w.cache, &sel));
    for (int g = 0; g < kHkv; ++g) {
      SCOPED_TRACE(::testing::Message() << "two_level " << two_level << " head " << g);
      const std::vector<int64_t> a = Attended(sel, g);
      const int64_t wb = len - 1 - o.window_tokens;
      std::vector<int64_t> per_part(4, 0);
      for (int64_t t : a) {
        if (t >= o.sink_tokens && t < wb) {
          ++per_part[(two_level ? t / 16 / o.segment_pages : t / 16) % 4];
        }
      }
      for (int j = 0; j < 4; ++j) EXPECT_EQ(per_part[j], 8) << "part " << j;
    }
  }
}

TEST(PolicyTest, RejectsMismatchedCache) {
  std::mt19937 rng(kSeed + 7);
  World w;
  Build(&w, 100, 16, DType::kF32, rng);
  PolicyOptions o = Small(PolicyKind::kQuest, 64);
  o.page_size = 32;  // cache uses 16
  std::unique_ptr<AttentionPolicy> p = MakeAttentionPolicy(o, kLayers, kHq, kHkv, kD).value();
  Feed(&w, nullptr, 0, 100);
  EXPECT_THAT(p->OnAppend(0, *w.cache, 0, 100), StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> q(kHq * kD);
  Selection sel;
  EXPECT_THAT(p->Select(0, q.data(), 1, kHq, 99, *w.cache, &sel),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::engine::sparse
