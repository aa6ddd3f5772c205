// DevicePolicy (selection on the compute backend) against the host policies of MakeSparsePolicy
// with the same options, on the CPU backend: a sequence is appended in random chunks (both
// policies told), then several decode steps (one token appended, then attention) must give the
// output of PagedAttention over the host policy's spans. Covers two-level and one-level ranking,
// the short-context case (the middle fits in the budget), dense layers, f32 and bf16 caches, and
// the errors. Prefill chunks (AttendChunk): the same comparison for chunks of 1, 3, 17, 129 and
// 700 queries (the mean query's merge tree with one, two and three levels, a shifted last part),
// contexts that are not multiples of the page size, exactness when the budget covers the context,
// and the errors. tokenselect in parts (PolicyOptions::tokenselect_partitions; on the backend
// SelectStagesParams::partitions) against the host policy's TokenSelectParts: decode (with and
// without the selection cache), chunks and following queries, one- and two-level.
#include "engine/sparse/device_policy.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/query_mean.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine::sparse {
namespace {

using ::strata::testing::StatusIs;
using kernels::DType;
using kernels::TensorView;

constexpr int kLayers = 2, kHq = 8, kHkv = 2, kD = 32, kPage = 16;

PolicyOptions Options(PolicyKind kind) {
  PolicyOptions o;
  o.kind = kind;
  o.token_budget = 128;
  o.sink_tokens = 32;
  o.window_tokens = 64;
  o.page_size = kPage;
  o.segment_pages = 4;
  o.min_segments = 8;
  o.segment_factor = 4;
  o.two_level_min_pages = 64;
  o.cache_theta = 2.0;  // the host policy's selection cache off (the device policy has none)
  o.dense_layers = {1};
  return o;
}

// The options of the tests' KV caches: kLayers x kHkv x kD, kPage-token pages.
KvCacheOptions CacheOptions(int64_t max_tokens, DType dtype = DType::kF32) {
  KvCacheOptions co;
  co.num_layers = kLayers;
  co.num_kv_heads = kHkv;
  co.head_dim = kD;
  co.page_size = kPage;
  co.dtype = dtype;
  co.max_tokens = max_tokens;
  return co;
}

// A KV cache (kLayers x kHkv x kD, kPage-token pages) with the host policy and the DevicePolicy
// of the same options over it, both told of every append of random keys and values.
struct PolicyPair {
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<SparsePolicy> host;
  std::unique_ptr<DevicePolicy> dev;
  // With tokenselect_partitions > 1: the host policy of the same options in one part.
  std::unique_ptr<SparsePolicy> one_part;
  std::mt19937 rng;
  std::normal_distribution<float> nd;

  absl::Status Init(const PolicyOptions& o, DType dtype, int64_t max_tokens, kernels::Backend* be,
                    int seed) {
    const KvCacheOptions co = CacheOptions(max_tokens, dtype);
    STRATA_ASSIGN_OR_RETURN(cache, KvCache::Create(co, be));
    STRATA_ASSIGN_OR_RETURN(host, MakeSparsePolicy(o, kLayers, kHq, kHkv, kD));
    STRATA_ASSIGN_OR_RETURN(dev, DevicePolicy::Create(o, co, kHq, be));
    if (o.tokenselect_partitions > 1) {
      PolicyOptions o1 = o;
      o1.tokenselect_partitions = 1;
      STRATA_ASSIGN_OR_RETURN(one_part, MakeSparsePolicy(o1, kLayers, kHq, kHkv, kD));
    }
    rng.seed(static_cast<uint32_t>(seed));
    return absl::OkStatus();
  }
  // One decode step of layer l for query q [kHq, kD] at the cache's last position: the host
  // policy's selection attended by `cpu`'s PagedAttention (want), and the device policy's
  // Attend (got; poisoned with NaN first).
  absl::Status AttendBoth(int l, const std::vector<float>& q, kernels::Backend* cpu,
                          std::vector<float>* want, std::vector<float>* want_lse,
                          std::vector<float>* got, std::vector<float>* got_lse) {
    const int64_t len = cache->length(0);
    Selection sel;
    STRATA_RETURN_IF_ERROR(host->Select(l, q.data(), 1, kHq, len - 1, *cache, &sel));
    STRATA_RETURN_IF_ERROR(HostAttend(l, q, sel, cpu, want, want_lse));
    got->assign(kHq * kD, NAN);
    got_lse->assign(kHq, NAN);
    return dev->Attend(l, TensorView(const_cast<float*>(q.data()), DType::kF32, {1, kHq, kD}),
                       *cache, TensorView(got->data(), DType::kF32, {1, kHq, kD}),
                       TensorView(got_lse->data(), DType::kF32, {1, kHq}), nullptr);
  }
  // PagedAttention (on `cpu`) of the decode query q [kHq, kD] at the cache's last position over
  // `sel`.
  absl::Status HostAttend(int l, const std::vector<float>& q, const Selection& sel,
                          kernels::Backend* cpu, std::vector<float>* want,
                          std::vector<float>* want_lse) {
    const int64_t len = cache->length(0);
    want->assign(kHq * kD, 0.0f);
    want_lse->assign(kHq, 0.0f);
    const int32_t qpos = static_cast<int32_t>(len - 1);
    kernels::PagedAttentionParams pa;
    pa.q = TensorView(const_cast<float*>(q.data()), DType::kF32, {1, kHq, kD});
    pa.k_pool = cache->k_pool(l);
    pa.v_pool = cache->v_pool(l);
    pa.spans = sel.spans.data();
    pa.span_offsets = sel.offsets.data();
    pa.num_kv_heads = kHkv;
    pa.q_positions = &qpos;
    pa.scale = 1.0f / std::sqrt(static_cast<float>(kD));
    pa.out = TensorView(want->data(), DType::kF32, {1, kHq, kD});
    pa.lse = TensorView(want_lse->data(), DType::kF32, {1, kHq});
    return cpu->PagedAttention(pa, nullptr);
  }
  // Appends n random tokens to every layer.
  void Append(int64_t n) {
    std::vector<float> k(static_cast<size_t>(n) * kHkv * kD), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    for (int l = 0; l < kLayers; ++l) {
      const int64_t first = cache->length(l);
      STRATA_ASSERT_OK(cache->Append(l, TensorView(k.data(), DType::kF32, {n, kHkv, kD}),
                                     TensorView(v.data(), DType::kF32, {n, kHkv, kD})));
      STRATA_ASSERT_OK(host->OnAppend(l, *cache, first, first + n));
      if (one_part != nullptr) STRATA_ASSERT_OK(one_part->OnAppend(l, *cache, first, first + n));
      STRATA_ASSERT_OK(dev->OnAppend(l, *cache, first, first + n, nullptr));
    }
  }
  // Appends `len` tokens in pieces of 1 to 300.
  void Fill(int64_t len) {
    for (int64_t t = 0; t < len;) {
      const int64_t n = std::min<int64_t>(len - t, 1 + rng() % 300);
      Append(n);
      t += n;
    }
  }
};

struct Case {
  PolicyKind kind;
  DType dtype;
  int64_t len;    // tokens before the decode steps
  int parts = 1;  // PolicyOptions::tokenselect_partitions
  int factor = 0;  // PolicyOptions::tokenselect_candidate_factor (0: Options')
  int budget = 0;  // PolicyOptions::token_budget (0: Options')
};

class DevicePolicyTest : public ::testing::TestWithParam<Case> {};

TEST_P(DevicePolicyTest, DecodeMatchesHostPolicy) {
  const Case c = GetParam();
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  const int steps = 3;
  PolicyOptions o = Options(c.kind);
  o.tokenselect_partitions = c.parts;
  if (c.factor > 0) o.tokenselect_candidate_factor = c.factor;
  if (c.budget > 0) o.token_budget = c.budget;
  PolicyPair pp;
  STRATA_ASSERT_OK(pp.Init(o, c.dtype, c.len + steps, cpu.get(),
                           77 + static_cast<int>(c.len) + static_cast<int>(c.kind) + c.parts));
  std::mt19937& rng = pp.rng;
  std::normal_distribution<float>& nd = pp.nd;
  pp.Fill(c.len);
  int one_part_differs = 0;  // steps whose output the parts changed
  for (int step = 0; step < steps; ++step) {
    pp.Append(1);
    std::vector<float> q(kHq * kD);
    for (float& x : q) x = 2.0f * nd(rng);
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " layer " << l);
      std::vector<float> want, want_lse, got, got_lse;
      STRATA_ASSERT_OK(pp.AttendBoth(l, q, cpu.get(), &want, &want_lse, &got, &got_lse));
      for (int i = 0; i < kHq * kD; ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << i;
      for (int i = 0; i < kHq; ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-4) << i;
      if (pp.one_part != nullptr) {
        Selection sel;
        STRATA_ASSERT_OK(pp.one_part->Select(l, q.data(), 1, kHq, pp.cache->length(0) - 1,
                                             *pp.cache, &sel));
        std::vector<float> one, one_lse;
        STRATA_ASSERT_OK(pp.HostAttend(l, q, sel, cpu.get(), &one, &one_lse));
        double diff = 0;
        for (int i = 0; i < kHq * kD; ++i) {
          diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - one[i]));
        }
        one_part_differs += diff > 1e-3;
      }
    }
  }
  // Where the middle exceeds the budget (layer 0) the parts select otherwise than one part.
  if (pp.one_part != nullptr && c.len - o.sink_tokens - o.window_tokens > o.token_budget) {
    EXPECT_GT(one_part_differs, 0);
  }
}

// The window start moves with each step and is mostly not page-aligned; with an aligned sink end
// the host FillPages and the device top-k then pick the same pages (a partial last page among the
// top ones leaves less than a page of budget, so no further page fits either way).
INSTANTIATE_TEST_SUITE_P(
    Cases, DevicePolicyTest,
    ::testing::Values(Case{PolicyKind::kTokenSelect, DType::kF32, 3000},  // two-level
                      Case{PolicyKind::kTokenSelect, DType::kBF16, 3000},
                      // Above two_level_min_pages but every segment kept (22-23 of 32): the
                      // device policy scores the pages directly, the host policy goes through
                      // the segments.
                      Case{PolicyKind::kTokenSelect, DType::kF32, 1500},
                      Case{PolicyKind::kTokenSelect, DType::kBF16, 1500},
                      Case{PolicyKind::kQuest, DType::kF32, 3000},
                      Case{PolicyKind::kQuest, DType::kBF16, 700},        // one-level
                      Case{PolicyKind::kTokenSelect, DType::kF32, 700},
                      Case{PolicyKind::kTokenSelect, DType::kF32, 150},  // middle fits
                      // tokenselect in parts (two-level: 32 of the 46 segments kept, 8 per part
                      // at 4 parts, 4 at 8; every stage's k a multiple of the parts).
                      Case{PolicyKind::kTokenSelect, DType::kF32, 3000, 4},
                      Case{PolicyKind::kTokenSelect, DType::kBF16, 3000, 8},
                      // Every segment kept (at most 6 of its own per part at 4 parts): the device
                      // policy must still run the segment stage, whose parts are by segment.
                      Case{PolicyKind::kTokenSelect, DType::kF32, 1500, 4},
                      Case{PolicyKind::kTokenSelect, DType::kF32, 1500, 8},
                      Case{PolicyKind::kTokenSelect, DType::kF32, 700, 4},  // one-level
                      Case{PolicyKind::kTokenSelect, DType::kBF16, 700, 8},
                      Case{PolicyKind::kTokenSelect, DType::kF32, 150, 8},  // middle fits
                      // A part's candidates less than a page (candidate factor 1: 128 / 16 = 8
                      // tokens, 16-token pages): one page per part on both.
                      Case{PolicyKind::kTokenSelect, DType::kF32, 3000, 16, 1},
                      Case{PolicyKind::kTokenSelect, DType::kF32, 700, 16, 1},
                      // Budgets that are not a multiple of the parts: each part keeps
                      // ceil(budget / parts) tokens on both (122 at 8 parts: 16 each, 128 in all;
                      // 100 at 16: 7 each).
                      Case{PolicyKind::kTokenSelect, DType::kF32, 3000, 8, 0, 122},
                      Case{PolicyKind::kTokenSelect, DType::kBF16, 700, 16, 0, 100}));

// The selection cache (cache_theta 0.9) against the host policy's: decode steps whose queries
// repeat (scaled), drift a little, turn away, and change for one KV head only; each step's output
// must equal PagedAttention over the host policy's spans (for tokenselect; quest's kept pages
// also attend the tokens that left the window since, see device_policy.h, so for quest the
// outputs are compared only on selecting steps), and the lookups and hits must be the host's.
struct CacheCase {
  PolicyKind kind;
  int64_t len;
  int parts = 1;  // PolicyOptions::tokenselect_partitions
};

class DevicePolicyCacheTest : public ::testing::TestWithParam<CacheCase> {};

TEST_P(DevicePolicyCacheTest, ReuseMatchesHostSelectionCache) {
  const CacheCase c = GetParam();
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  const int steps = 7;
  PolicyOptions o = Options(c.kind);
  o.cache_theta = 0.9;
  o.tokenselect_partitions = c.parts;
  PolicyPair pp;
  STRATA_ASSERT_OK(pp.Init(o, DType::kF32, c.len + steps, cpu.get(),
                           91 + static_cast<int>(c.len) + static_cast<int>(c.kind)));
  SparsePolicy* host = pp.host.get();
  DevicePolicy* dev = pp.dev.get();
  std::mt19937& rng = pp.rng;
  std::normal_distribution<float>& nd = pp.nd;
  auto append = [&](int64_t n) { pp.Append(n); };
  pp.Fill(c.len);
  const int group_len = kHq / kHkv * kD;
  std::vector<float> q(kHq * kD);
  auto fresh = [&](int g) {
    for (int i = 0; i < group_len; ++i) q[g * group_len + i] = 2.0f * nd(rng);
  };
  int64_t host_hits_before = 0;
  for (int step = 0; step < steps; ++step) {
    // 0: new; 1: scaled repeat (hit); 2: small drift (hit); 3: turned away (miss); 4: head 0
    // repeats, head 1 new; 5: repeat (hit); 6: new.
    switch (step) {
      case 0: case 3: case 6:
        for (int g = 0; g < kHkv; ++g) fresh(g);
        if (step == 3) for (float& x : q) x = -x;
        break;
      case 1:
        for (float& x : q) x *= 1.5f;
        break;
      case 2:
        for (float& x : q) x += 0.05f * nd(rng);
        break;
      case 4:
        fresh(1);
        break;
      default:
        break;
    }
    append(1);
    for (int l = 0; l < kLayers; ++l) {
      SCOPED_TRACE(::testing::Message() << "step " << step << " layer " << l);
      std::vector<float> want, want_lse, got, got_lse;
      STRATA_ASSERT_OK(pp.AttendBoth(l, q, cpu.get(), &want, &want_lse, &got, &got_lse));
      const bool hit_step = host->counters().cache_hits > host_hits_before;
      host_hits_before = host->counters().cache_hits;
      if (c.kind == PolicyKind::kQuest && hit_step) continue;
      for (int i = 0; i < kHq * kD; ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << i;
      for (int i = 0; i < kHq; ++i) ASSERT_NEAR(got_lse[i], want_lse[i], 1e-4) << i;
    }
  }
  EXPECT_EQ(dev->counters().cache_lookups, 0);  // until read, with the hits
  EXPECT_EQ(dev->counters().cache_hits, 0);
  // The read queued on the stream, taken after the caller's wait: the same counts.
  STRATA_ASSERT_OK(dev->QueueCacheHitsRead(nullptr));
  STRATA_ASSERT_OK(cpu->Synchronize(nullptr));
  dev->TakeCacheHits();
  EXPECT_EQ(dev->counters().cache_lookups, host->counters().cache_lookups);
  EXPECT_EQ(dev->counters().cache_hits, host->counters().cache_hits);
  EXPECT_GT(dev->counters().cache_hits, 0);
  STRATA_ASSERT_OK(dev->ReadCacheHits(nullptr));
  EXPECT_EQ(dev->counters().cache_lookups, host->counters().cache_lookups);
  EXPECT_EQ(dev->counters().cache_hits, host->counters().cache_hits);
  // Per selecting layer (layer 1 is dense): steps 1, 2, 5 hit both heads, step 4 head 0.
  EXPECT_EQ(host->counters().cache_lookups, steps * kHkv);
  EXPECT_EQ(host->counters().cache_hits, 3 * kHkv + 1);
}

INSTANTIATE_TEST_SUITE_P(Cases, DevicePolicyCacheTest,
                         ::testing::Values(CacheCase{PolicyKind::kTokenSelect, 3000},  // two-level
                                           CacheCase{PolicyKind::kTokenSelect, 700},
                                           CacheCase{PolicyKind::kTokenSelect, 3000, 4},
                                           CacheCase{PolicyKind::kTokenSelect, 700, 8},
                                           CacheCase{PolicyKind::kQuest, 3000},
                                           CacheCase{PolicyKind::kQuest, 700}));

// A replayed step's host side counts what Attend counts: two policies over one cache, one
// attending every step, the other attending once and then noting replays, end with the same
// counters (tokens, and the selection cache's lookups), on the exact layer and a selecting one.
TEST(DevicePolicyReplayTest, NoteReplayedAttendCountsAsAttend) {
  for (const PolicyKind kind : {PolicyKind::kQuest, PolicyKind::kTokenSelect}) {
    SCOPED_TRACE(static_cast<int>(kind));
    std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
    PolicyOptions o = Options(kind);
    o.cache_theta = 0.9;
    PolicyPair pp;
    STRATA_ASSERT_OK(pp.Init(o, DType::kF32, 2000, cpu.get(), 7));
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DevicePolicy> replayed,
                                DevicePolicy::Create(o, pp.cache->options(), kHq, cpu.get()));
    pp.Fill(1500);
    for (int l = 0; l < kLayers; ++l) {
      STRATA_ASSERT_OK(replayed->OnAppend(l, *pp.cache, 0, pp.cache->length(l), nullptr));
    }
    std::vector<float> q(kHq * kD), out(kHq * kD), lse(kHq);
    for (float& x : q) x = pp.nd(pp.rng);
    const TensorView qv(q.data(), DType::kF32, {1, kHq, kD});
    const TensorView ov(out.data(), DType::kF32, {1, kHq, kD});
    const TensorView lv(lse.data(), DType::kF32, {1, kHq});
    for (int step = 0; step < 3; ++step) {
      for (int l = 0; l < kLayers; ++l) {  // layer 1 is dense: exact attention
        STRATA_ASSERT_OK(pp.dev->Attend(l, qv, *pp.cache, ov, lv, nullptr));
        if (step == 0) {
          STRATA_ASSERT_OK(replayed->Attend(l, qv, *pp.cache, ov, lv, nullptr));
        } else {
          STRATA_ASSERT_OK(replayed->NoteReplayedAttend(l, *pp.cache));
        }
      }
    }
    STRATA_ASSERT_OK(pp.dev->ReadCacheHits(nullptr));
    STRATA_ASSERT_OK(replayed->ReadCacheHits(nullptr));
    const SelectionCounters& a = pp.dev->counters();
    const SelectionCounters& b = replayed->counters();
    EXPECT_EQ(b.candidate_tokens, a.candidate_tokens);
    EXPECT_EQ(b.selected_tokens, a.selected_tokens);
    EXPECT_LT(a.selected_tokens, a.candidate_tokens);  // layer 0 selected
    EXPECT_EQ(b.cache_lookups, a.cache_lookups);
    EXPECT_EQ(a.cache_lookups, 3 * kHkv);  // one check per selecting layer and step
    // The replays ran nothing on the backend: only the first step's check reached it (a miss).
    EXPECT_EQ(b.cache_hits, 0);
    EXPECT_EQ(a.cache_hits, 2 * kHkv);  // the same query again: both heads hit
    // A recorded Attend whose graph was discarded takes its counts back.
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<DevicePolicy> discarded,
                                DevicePolicy::Create(o, pp.cache->options(), kHq, cpu.get()));
    for (int l = 0; l < kLayers; ++l) {
      STRATA_ASSERT_OK(discarded->OnAppend(l, *pp.cache, 0, pp.cache->length(l), nullptr));
      STRATA_ASSERT_OK(discarded->Attend(l, qv, *pp.cache, ov, lv, nullptr));
      STRATA_ASSERT_OK(discarded->DiscardRecordedAttend(l, *pp.cache));
    }
    STRATA_ASSERT_OK(discarded->ReadCacheHits(nullptr));
    EXPECT_EQ(discarded->counters().candidate_tokens, 0);
    EXPECT_EQ(discarded->counters().selected_tokens, 0);
    EXPECT_EQ(discarded->counters().cache_lookups, 0);
  }
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  PolicyPair pp;
  STRATA_ASSERT_OK(pp.Init(Options(PolicyKind::kQuest), DType::kF32, 100, cpu.get(), 3));
  EXPECT_THAT(pp.dev->NoteReplayedAttend(kLayers, *pp.cache), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(pp.dev->NoteReplayedAttend(0, *pp.cache), StatusIs(absl::StatusCode::kInvalidArgument));  // empty
  EXPECT_THAT(pp.dev->DiscardRecordedAttend(0, *pp.cache), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DevicePolicyErrorsTest, RejectsWhatItCannotRun) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  KvCacheOptions co;
  co.num_layers = 1;
  co.num_kv_heads = kHkv;
  co.head_dim = kD;
  co.page_size = kPage;
  co.max_tokens = 256;
  PolicyOptions o = Options(PolicyKind::kRadar);
  o.dense_layers.clear();
  EXPECT_THAT(DevicePolicy::Create(o, co, kHq, cpu.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.kind = PolicyKind::kTokenSelect;
  o.summary = SummaryKind::kMean;
  EXPECT_THAT(DevicePolicy::Create(o, co, kHq, cpu.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.summary = SummaryKind::kDefault;
  o.page_size = 32;
  EXPECT_THAT(DevicePolicy::Create(o, co, kHq, cpu.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o.page_size = kPage;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, DevicePolicy::Create(o, co, kHq, cpu.get()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(co, cpu.get()));
  std::vector<float> q(kHq * kD), out(kHq * kD), lse(kHq);
  const TensorView qv(q.data(), DType::kF32, {1, kHq, kD});
  const TensorView ov(out.data(), DType::kF32, {1, kHq, kD}), lv(lse.data(), DType::kF32, {1, kHq});
  EXPECT_THAT(dev->Attend(0, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // empty cache
  std::vector<float> kv(10 * kHkv * kD, 0.5f);
  STRATA_ASSERT_OK(cache->Append(0, TensorView(kv.data(), DType::kF32, {10, kHkv, kD}),
                                 TensorView(kv.data(), DType::kF32, {10, kHkv, kD})));
  EXPECT_THAT(dev->Attend(0, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));  // no OnAppend yet
  EXPECT_THAT(dev->OnAppend(0, *cache, 0, 9, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // does not end at the length
  STRATA_ASSERT_OK(dev->OnAppend(0, *cache, 0, 10, nullptr));
  STRATA_ASSERT_OK(dev->Attend(0, qv, *cache, ov, lv, nullptr));
  for (int i = 0; i < kHq * kD; ++i) EXPECT_NEAR(out[i], 0.5f, 1e-6);
  EXPECT_THAT(dev->Attend(1, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // layer out of range
}

// ---- Prefill chunks (AttendChunk) ------------------------------------------------------------

struct ChunkCase {
  PolicyKind kind;
  DType dtype;
  int64_t context;  // tokens before the chunk
  int64_t chunk;    // queries in the chunk
  int parts = 1;    // PolicyOptions::tokenselect_partitions
};

// Appends `n` random tokens to every layer of `cache`, telling `host` (when set) and `dev`.
void AppendRandom(KvCache* cache, SparsePolicy* host, DevicePolicy* dev, int64_t n,
                  std::mt19937* rng) {
  std::normal_distribution<float> nd;
  std::vector<float> k(static_cast<size_t>(n) * kHkv * kD), v(k.size());
  for (float& x : k) x = nd(*rng);
  for (float& x : v) x = nd(*rng);
  for (int l = 0; l < kLayers; ++l) {
    const int64_t first = cache->length(l);
    STRATA_ASSERT_OK(cache->Append(l, TensorView(k.data(), DType::kF32, {n, kHkv, kD}),
                                   TensorView(v.data(), DType::kF32, {n, kHkv, kD})));
    if (host != nullptr) STRATA_ASSERT_OK(host->OnAppend(l, *cache, first, first + n));
    STRATA_ASSERT_OK(dev->OnAppend(l, *cache, first, first + n, nullptr));
  }
}

// PagedAttention of q [m, kHq, kD] at positions [q_begin, q_begin + m) over `sel`.
void HostAttention(kernels::Backend* cpu, const KvCache& cache, int layer, const Selection& sel,
                   const std::vector<float>& q, int64_t m, int64_t q_begin,
                   std::vector<float>* out, std::vector<float>* lse) {
  std::vector<int32_t> pos(m);
  for (int64_t i = 0; i < m; ++i) pos[i] = static_cast<int32_t>(q_begin + i);
  out->assign(static_cast<size_t>(m) * kHq * kD, NAN);
  lse->assign(static_cast<size_t>(m) * kHq, NAN);
  kernels::PagedAttentionParams pa;
  pa.q = TensorView(const_cast<float*>(q.data()), DType::kF32, {m, kHq, kD});
  pa.k_pool = cache.k_pool(layer);
  pa.v_pool = cache.v_pool(layer);
  pa.spans = sel.spans.data();
  pa.span_offsets = sel.offsets.data();
  pa.num_kv_heads = kHkv;
  pa.q_positions = pos.data();
  pa.scale = 1.0f / std::sqrt(static_cast<float>(kD));
  pa.out = TensorView(out->data(), DType::kF32, {m, kHq, kD});
  pa.lse = TensorView(lse->data(), DType::kF32, {m, kHq});
  STRATA_ASSERT_OK(cpu->PagedAttention(pa, nullptr));
}

// got / got_lse (the device policy's) against want / want_lse (the host policy's selection
// attended) within 1e-4, every value finite; *from_dense = the largest |got - exact| (exact: the
// dense attention).
void ExpectNearHost(const std::vector<float>& got, const std::vector<float>& got_lse,
                    const std::vector<float>& want, const std::vector<float>& want_lse,
                    const std::vector<float>& exact, double* from_dense) {
  *from_dense = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    ASSERT_NEAR(got[i], want[i], 1e-4) << i;
    *from_dense = std::max(*from_dense, std::fabs(static_cast<double>(got[i]) - exact[i]));
  }
  for (size_t i = 0; i < want_lse.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got_lse[i])) << i;
    ASSERT_NEAR(got_lse[i], want_lse[i], 1e-4) << i;
  }
}

class DevicePolicyChunkTest : public ::testing::TestWithParam<ChunkCase> {};

// A chunk through AttendChunk gives the output of PagedAttention over the host policy's spans
// for the same chunk (mean query, sinks, window before the chunk, the chunk causally), and (where
// the middle exceeds the budget on a sparse layer) not the dense output.
TEST_P(DevicePolicyChunkTest, ChunkMatchesHostPolicy) {
  const ChunkCase c = GetParam();
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  const KvCacheOptions co = CacheOptions(c.context + c.chunk, c.dtype);
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(co, cpu.get()));
  PolicyOptions o = Options(c.kind);
  o.tokenselect_partitions = c.parts;
  STRATA_ASSERT_OK_AND_ASSIGN(auto host, MakeSparsePolicy(o, kLayers, kHq, kHkv, kD));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, DevicePolicy::Create(o, co, kHq, cpu.get()));
  std::unique_ptr<AttentionPolicy> dense = MakeDensePolicy();
  std::mt19937 rng(5 + static_cast<int>(c.context * 31 + c.chunk) + static_cast<int>(c.kind));
  for (int64_t t = 0; t < c.context;) {
    const int64_t n = std::min<int64_t>(c.context - t, 1 + rng() % 300);
    AppendRandom(cache.get(), host.get(), dev.get(), n, &rng);
    t += n;
  }
  AppendRandom(cache.get(), host.get(), dev.get(), c.chunk, &rng);
  const int64_t m = c.chunk, q_begin = c.context;
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(m) * kHq * kD);
  for (float& x : q) x = 2.0f * nd(rng);
  const bool sparse_case =
      q_begin - o.window_tokens - o.sink_tokens > o.token_budget;  // the middle exceeds B
  for (int l = 0; l < kLayers; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    Selection sel, all;
    STRATA_ASSERT_OK(host->Select(l, q.data(), static_cast<int>(m), kHq, q_begin, *cache, &sel));
    STRATA_ASSERT_OK(dense->Select(l, q.data(), static_cast<int>(m), kHq, q_begin, *cache, &all));
    std::vector<float> want, want_lse, exact, exact_lse;
    HostAttention(cpu.get(), *cache, l, sel, q, m, q_begin, &want, &want_lse);
    HostAttention(cpu.get(), *cache, l, all, q, m, q_begin, &exact, &exact_lse);
    std::vector<float> got(want.size(), NAN), got_lse(want_lse.size(), NAN);
    STRATA_ASSERT_OK(dev->AttendChunk(l, TensorView(q.data(), DType::kF32, {m, kHq, kD}),
                                      q_begin, *cache, 0,
                                      TensorView(got.data(), DType::kF32, {m, kHq, kD}),
                                      TensorView(got_lse.data(), DType::kF32, {m, kHq}),
                                      nullptr));
    double from_dense = 0;
    ASSERT_NO_FATAL_FAILURE(ExpectNearHost(got, got_lse, want, want_lse, exact, &from_dense));
    if (sparse_case && l == 0) {
      EXPECT_GT(from_dense, 1e-3);  // layer 0 is sparse: really a selection
    } else {
      EXPECT_LE(from_dense, 1e-5);  // dense layer 1, or the middle fits: exact
    }
  }
  EXPECT_EQ(dev->counters().candidate_tokens, host->counters().candidate_tokens);
  EXPECT_EQ(dev->counters().selected_tokens, host->counters().selected_tokens);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DevicePolicyChunkTest,
    ::testing::Values(ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 3000, 1},   // two-level
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 3001, 3},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kBF16, 2999, 17},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 3000, 129},
                      ChunkCase{PolicyKind::kQuest, DType::kF32, 3003, 17},
                      ChunkCase{PolicyKind::kQuest, DType::kBF16, 701, 129},       // one-level
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 701, 3},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 400, 700},  // 3 levels
                      ChunkCase{PolicyKind::kQuest, DType::kF32, 450, 700},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 150, 129},  // middle fits
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 0, 17},     // first chunk
                      // tokenselect in parts: two-level, every segment kept, one-level.
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 3000, 17, 4},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kBF16, 3001, 3, 8},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 1500, 129, 4},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 701, 3, 8}));

// With a budget that covers the whole middle every layer attends to everything: the output is
// that of dense attention, whatever the chunk.
TEST(DevicePolicyChunkExactTest, BudgetCoveringTheContextIsDense) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  const int64_t context = 1000, m = 37;
  const KvCacheOptions co = CacheOptions(context + 2 * m);
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(co, cpu.get()));
  PolicyOptions o = Options(PolicyKind::kTokenSelect);
  o.dense_layers.clear();
  o.token_budget = static_cast<int>(context + 2 * m);
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, DevicePolicy::Create(o, co, kHq, cpu.get()));
  std::unique_ptr<AttentionPolicy> dense = MakeDensePolicy();
  std::mt19937 rng(3);
  AppendRandom(cache.get(), nullptr, dev.get(), context, &rng);
  std::normal_distribution<float> nd;
  for (int round = 0; round < 2; ++round) {
    AppendRandom(cache.get(), nullptr, dev.get(), m, &rng);
    const int64_t q_begin = cache->length(0) - m;
    std::vector<float> q(static_cast<size_t>(m) * kHq * kD);
    for (float& x : q) x = 2.0f * nd(rng);
    for (int l = 0; l < kLayers; ++l) {
      Selection all;
      STRATA_ASSERT_OK(dense->Select(l, q.data(), static_cast<int>(m), kHq, q_begin, *cache, &all));
      std::vector<float> exact, exact_lse;
      HostAttention(cpu.get(), *cache, l, all, q, m, q_begin, &exact, &exact_lse);
      std::vector<float> got(exact.size(), NAN), got_lse(exact_lse.size(), NAN);
      STRATA_ASSERT_OK(dev->AttendChunk(l, TensorView(q.data(), DType::kF32, {m, kHq, kD}),
                                        q_begin, *cache, 0,
                                        TensorView(got.data(), DType::kF32, {m, kHq, kD}),
                                        TensorView(got_lse.data(), DType::kF32, {m, kHq}),
                                        nullptr));
      for (size_t i = 0; i < exact.size(); ++i) ASSERT_EQ(got[i], exact[i]) << i;
      for (size_t i = 0; i < exact_lse.size(); ++i) ASSERT_EQ(got_lse[i], exact_lse[i]) << i;
    }
  }
  EXPECT_EQ(dev->counters().selected_tokens, dev->counters().candidate_tokens);
}

// ---- Queries after the cache (AttendFollowing: a document shard's answers) ---------------------

class DevicePolicyFollowingTest : public ::testing::TestWithParam<ChunkCase> {};

// m queries that follow every cached token give the output of PagedAttention over the host
// policy's spans for their mean query placed on the last cached token (as worker::ShardSession
// selects on a shard in host memory), every query attending all of them; a sparse layer is not
// the dense output.
TEST_P(DevicePolicyFollowingTest, FollowingQueriesMatchHostPolicy) {
  const ChunkCase c = GetParam();
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  PolicyOptions o = Options(c.kind);
  o.window_tokens = 0;  // a shard's window is its last token only
  o.tokenselect_partitions = c.parts;
  PolicyPair pp;
  STRATA_ASSERT_OK(pp.Init(o, c.dtype, c.context, cpu.get(),
                           11 + static_cast<int>(c.context * 7 + c.chunk) + static_cast<int>(c.kind)));
  KvCache* const cache = pp.cache.get();
  SparsePolicy* const host = pp.host.get();
  DevicePolicy* const dev = pp.dev.get();
  std::unique_ptr<AttentionPolicy> dense = MakeDensePolicy();
  for (int64_t t = 0; t < c.context;) {
    const int64_t n = std::min<int64_t>(c.context - t, 1 + pp.rng() % 300);
    AppendRandom(cache, host, dev, n, &pp.rng);
    t += n;
  }
  const int64_t m = c.chunk, len = c.context;
  std::vector<float> q(static_cast<size_t>(m) * kHq * kD);
  for (float& x : q) x = 2.0f * pp.nd(pp.rng);
  std::vector<float> qmean;
  MeanQuery(q.data(), static_cast<int>(m), static_cast<int64_t>(kHq) * kD, &qmean);
  for (int l = 0; l < kLayers; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    Selection sel, all;
    STRATA_ASSERT_OK(host->Select(l, qmean.data(), 1, kHq, len - 1, *cache, &sel));
    STRATA_ASSERT_OK(dense->Select(l, qmean.data(), 1, kHq, len - 1, *cache, &all));
    std::vector<float> want, want_lse, exact, exact_lse;
    HostAttention(cpu.get(), *cache, l, sel, q, m, len, &want, &want_lse);
    HostAttention(cpu.get(), *cache, l, all, q, m, len, &exact, &exact_lse);
    std::vector<float> got(want.size(), NAN), got_lse(want_lse.size(), NAN);
    STRATA_ASSERT_OK(dev->AttendFollowing(l, TensorView(q.data(), DType::kF32, {m, kHq, kD}),
                                          *cache, TensorView(got.data(), DType::kF32, {m, kHq, kD}),
                                          TensorView(got_lse.data(), DType::kF32, {m, kHq}),
                                          nullptr));
    double from_dense = 0;
    ASSERT_NO_FATAL_FAILURE(ExpectNearHost(got, got_lse, want, want_lse, exact, &from_dense));
    if (l == 0 && len - 1 - o.sink_tokens > o.token_budget) {
      EXPECT_GT(from_dense, 1e-3);  // layer 0 is sparse: really a selection
    } else {
      EXPECT_LE(from_dense, 1e-5);
    }
  }
  EXPECT_EQ(dev->counters().candidate_tokens, host->counters().candidate_tokens);
  EXPECT_EQ(dev->counters().selected_tokens, host->counters().selected_tokens);
  // Malformed calls.
  std::vector<float> out(q.size()), lse(static_cast<size_t>(m) * kHq);
  const TensorView qv(q.data(), DType::kF32, {m, kHq, kD});
  const TensorView ov(out.data(), DType::kF32, {m, kHq, kD});
  EXPECT_THAT(dev->AttendFollowing(kLayers, qv, *cache, ov,
                                   TensorView(lse.data(), DType::kF32, {m, kHq}), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(dev->AttendFollowing(0, qv, *cache, ov,
                                   TensorView(lse.data(), DType::kF32, {m + 1, kHq}), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DevicePolicyFollowingTest,
    ::testing::Values(ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 3000, 1},   // two-level
                      ChunkCase{PolicyKind::kTokenSelect, DType::kBF16, 2999, 3},
                      ChunkCase{PolicyKind::kQuest, DType::kBF16, 3003, 17},
                      ChunkCase{PolicyKind::kQuest, DType::kF32, 701, 1},          // one-level
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 701, 129},
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 150, 3},  // middle fits
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 3000, 1, 4},  // in parts
                      ChunkCase{PolicyKind::kTokenSelect, DType::kF32, 2999, 3, 8}));

TEST(DevicePolicyChunkErrorsTest, RejectsMalformedChunks) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  const KvCacheOptions co = CacheOptions(256);
  const PolicyOptions o = Options(PolicyKind::kTokenSelect);
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, DevicePolicy::Create(o, co, kHq, cpu.get()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(co, cpu.get()));
  const int64_t m = 4;
  std::vector<float> q(m * kHq * kD, 0.25f), out(q.size()), lse(m * kHq);
  const TensorView qv(q.data(), DType::kF32, {m, kHq, kD});
  const TensorView ov(out.data(), DType::kF32, {m, kHq, kD});
  const TensorView lv(lse.data(), DType::kF32, {m, kHq});
  EXPECT_THAT(dev->AttendChunk(0, qv, 0, *cache, 0, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // the cache does not hold them
  EXPECT_THAT(dev->AttendFollowing(0, qv, *cache, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // nothing cached to follow
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> kv(10 * kHkv * kD, 0.5f);
    STRATA_ASSERT_OK(cache->Append(l, TensorView(kv.data(), DType::kF32, {10, kHkv, kD}),
                                   TensorView(kv.data(), DType::kF32, {10, kHkv, kD})));
  }
  EXPECT_THAT(dev->AttendChunk(0, qv, 6, *cache, 0, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));  // no OnAppend yet
  STRATA_ASSERT_OK(dev->OnAppend(0, *cache, 0, 10, nullptr));
  EXPECT_THAT(dev->AttendChunk(0, qv, 7, *cache, 0, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // past the cache length
  EXPECT_THAT(dev->AttendChunk(0, qv, -1, *cache, 0, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(dev->AttendChunk(0, qv, 6, *cache, -5, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // negative position offset
  EXPECT_THAT(dev->AttendChunk(0, qv, 6, *cache, 0, TensorView(out.data(), DType::kF32,
                                                                {m - 1, kHq, kD}),
                               lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // out of another shape
  EXPECT_THAT(dev->AttendChunk(0, TensorView(q.data(), DType::kF32, {m, kHq + 1, kD}), 6,
                               *cache, 0, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(dev->AttendChunk(2, qv, 6, *cache, 0, ov, lv, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));  // layer out of range
  // Equal keys and values: every query averages the same value, whatever it attends.
  STRATA_ASSERT_OK(dev->AttendChunk(0, qv, 6, *cache, 100, ov, lv, nullptr));
  for (float x : out) EXPECT_NEAR(x, 0.5f, 1e-6);
}

// An fp8 KV cache (KvCacheOptions::dtype fp8_e4m3, per-tensor scales) selects and attends as an
// f32 cache holding its dequantised values: the selection scores the stored keys with k_scale
// folded into its scale, the attention applies k_scale and v_scale. Both policies run on the CPU
// backend (the selection ops' reference); the host sparse policy selects over it as over the f32
// cache.
TEST(DevicePolicyFp8CacheTest, SelectsAndAttendsAsTheDequantisedCache) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  constexpr float kKScale = 0.25f, kVScale = 0.5f;  // powers of two: dequantised values exact
  for (PolicyKind kind : {PolicyKind::kQuest, PolicyKind::kTokenSelect}) {
    SCOPED_TRACE(kind == PolicyKind::kQuest ? "quest" : "tokenselect");
    const PolicyOptions o = Options(kind);
    const int64_t len = 1500, steps = 3;
    const KvCacheOptions co = CacheOptions(len + steps);
    KvCacheOptions c8 = CacheOptions(len + steps, DType::kFP8E4M3);
    c8.k_scale = kKScale;
    c8.v_scale = kVScale;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cache8, KvCache::Create(c8, cpu.get()));
    STRATA_ASSERT_OK_AND_ASSIGN(auto cache32, KvCache::Create(co, cpu.get()));
    STRATA_ASSERT_OK_AND_ASSIGN(auto dev8, DevicePolicy::Create(o, c8, kHq, cpu.get()));
    STRATA_ASSERT_OK_AND_ASSIGN(auto dev32, DevicePolicy::Create(o, co, kHq, cpu.get()));
    std::mt19937 rng(31);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    // Rows appended to the fp8 cache as they are and to the f32 cache as the fp8 one holds them.
    auto append = [&](int64_t n) {
      std::vector<float> k(static_cast<size_t>(n) * kHkv * kD), v(k.size()), kq(k.size()), vq(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = nd(rng);
        v[i] = nd(rng);
        kq[i] = kernels::FP8E4M3ToF32(kernels::F32ToFP8E4M3(k[i] / kKScale)) * kKScale;
        vq[i] = kernels::FP8E4M3ToF32(kernels::F32ToFP8E4M3(v[i] / kVScale)) * kVScale;
      }
      for (int l = 0; l < kLayers; ++l) {
        const int64_t first = cache8->length(l);
        STRATA_ASSERT_OK(cache8->Append(l, TensorView(k.data(), DType::kF32, {n, kHkv, kD}),
                                        TensorView(v.data(), DType::kF32, {n, kHkv, kD})));
        STRATA_ASSERT_OK(cache32->Append(l, TensorView(kq.data(), DType::kF32, {n, kHkv, kD}),
                                         TensorView(vq.data(), DType::kF32, {n, kHkv, kD})));
        STRATA_ASSERT_OK(dev8->OnAppend(l, *cache8, first, first + n, nullptr));
        STRATA_ASSERT_OK(dev32->OnAppend(l, *cache32, first, first + n, nullptr));
      }
    };
    for (int64_t t = 0; t < len; t += 300) append(std::min<int64_t>(300, len - t));
    std::vector<float> q(kHq * kD), o8(kHq * kD), o32(kHq * kD), l8(kHq), l32(kHq);
    for (int step = 0; step < steps; ++step) {
      append(1);
      for (float& x : q) x = nd(rng);
      for (int l = 0; l < kLayers; ++l) {
        SCOPED_TRACE(::testing::Message() << "step " << step << " layer " << l);
        const TensorView qv(q.data(), DType::kF32, {1, kHq, kD});
        STRATA_ASSERT_OK(dev8->Attend(l, qv, *cache8, TensorView(o8.data(), DType::kF32, {1, kHq, kD}),
                                      TensorView(l8.data(), DType::kF32, {1, kHq}), nullptr));
        STRATA_ASSERT_OK(dev32->Attend(l, qv, *cache32, TensorView(o32.data(), DType::kF32, {1, kHq, kD}),
                                       TensorView(l32.data(), DType::kF32, {1, kHq}), nullptr));
        for (int i = 0; i < kHq * kD; ++i) ASSERT_NEAR(o8[i], o32[i], 1e-5) << i;
        for (int i = 0; i < kHq; ++i) ASSERT_NEAR(l8[i], l32[i], 1e-5) << i;
      }
    }
    // A sparse layer attends fewer tokens than the context (the comparison covered a selection).
    EXPECT_LT(dev8->counters().selected_tokens, dev8->counters().candidate_tokens);
    // The host policy reads the fp8 cache as the f32 one too: the same selection.
    STRATA_ASSERT_OK_AND_ASSIGN(auto host8, MakeSparsePolicy(o, kLayers, kHq, kHkv, kD));
    STRATA_ASSERT_OK_AND_ASSIGN(auto host32, MakeSparsePolicy(o, kLayers, kHq, kHkv, kD));
    Selection s8, s32;
    STRATA_ASSERT_OK(host8->Select(0, q.data(), 1, kHq, cache8->length(0) - 1, *cache8, &s8));
    STRATA_ASSERT_OK(host32->Select(0, q.data(), 1, kHq, cache32->length(0) - 1, *cache32, &s32));
    ASSERT_EQ(s8.offsets, s32.offsets);
    ASSERT_EQ(s8.spans.size(), s32.spans.size());
    for (size_t i = 0; i < s8.spans.size(); ++i) {
      EXPECT_EQ(s8.spans[i].position, s32.spans[i].position) << i;
      EXPECT_EQ(s8.spans[i].length, s32.spans[i].length) << i;
    }
  }
}

}  // namespace
}  // namespace strata::engine::sparse
