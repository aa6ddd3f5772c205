// ResolvePages on the CPU (kernels/cpu/page_cache.cc), the specification of the device-managed
// GPU page cache step: hand-worked clock cases, the naming rules (prefix / middle / suffix pages,
// repeats counted once, pages outside the table ignored), unresolved misses, and the invariants
// (table and slot_page inverse maps, every slot's bytes those of its page) over random calls.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

// A cache of `slots` slots over `layers` x `heads` x `pages` pages of P x d f32, in host memory,
// with page f's K and V values f * 1000 + element (distinct per page).
struct Cache {
  Cache(int layers_, int heads_, int pages_, int slots, int P_ = 4, int d_ = 2)
      : layers(layers_), heads(heads_), pages(pages_), P(P_), d(d_) {
    const int64_t n = static_cast<int64_t>(layers) * heads * pages;
    table.assign(n, -1);
    slot_page.assign(slots, -1);
    stamp.assign(slots, 0);
    ref.assign(slots, 0);
    counters.assign(kPageCacheCounterCount, 0);
    scratch.assign(1 + 2 * slots, 0);
    k.assign(static_cast<size_t>(slots) * P * d, -1.0f);
    v.assign(static_cast<size_t>(slots) * P * d, -1.0f);
    bytes.resize(static_cast<size_t>(n) * 2 * P * d);
    for (int64_t f = 0; f < n; ++f) {
      for (int e = 0; e < 2 * P * d; ++e) {
        bytes[f * 2 * P * d + e] = static_cast<float>(f * 1000 + e);
      }
      sources.push_back(&bytes[f * 2 * P * d]);
    }
    state.table = table.data();
    state.table_size = n;
    state.slot_page = slot_page.data();
    state.slot_stamp = stamp.data();
    state.slot_ref = ref.data();
    state.num_slots = slots;
    state.counters = counters.data();
    state.scratch = scratch.data();
    state.scratch_pages = slots;
    state.sources = sources.data();
    page_scales.resize(2 * n);
    for (int64_t f = 0; f < 2 * n; ++f) page_scales[f] = 0.5f + static_cast<float>(f);
    slot_scales.assign(2 * slots, -1.0f);
    state.page_scales = page_scales.data();
    state.slot_scales = slot_scales.data();
    state.k_pool = TensorView(k.data(), DType::kF32, {slots, P, d});
    state.v_pool = TensorView(v.data(), DType::kF32, {slots, P, d});
  }
  // Pages `mid` (page ids, the same for every head, -1 skipped) of `layer` plus a prefix and a
  // suffix in tokens.
  ResolvePagesParams Params(int layer, const std::vector<int32_t>* mid, int64_t prefix_end = 0,
                            int64_t suffix_begin = 0, int64_t suffix_end = 0) {
    ResolvePagesParams p;
    p.state = state;
    p.table_base = static_cast<int64_t>(layer) * heads * pages;
    p.num_kv_heads = heads;
    p.pages_per_head = pages;
    p.page_size = P;
    p.prefix_end = prefix_end;
    p.suffix_begin = suffix_begin;
    p.suffix_end = suffix_end;
    if (mid != nullptr && !mid->empty()) {
      parents.clear();
      for (int g = 0; g < heads; ++g) parents.insert(parents.end(), mid->begin(), mid->end());
      p.middle.parents =
          TensorView(parents.data(), DType::kI32, {heads, static_cast<int64_t>(mid->size())});
      p.middle.fanout = P;
      p.middle.begin = 0;
      p.middle.end = static_cast<int64_t>(pages) * P;
    }
    return p;
  }
  int64_t Flat(int layer, int head, int page) const {
    return (static_cast<int64_t>(layer) * heads + head) * pages + page;
  }
  // table and slot_page are inverse maps and each used slot holds its page's bytes.
  void CheckInvariants() const {
    for (int64_t f = 0; f < static_cast<int64_t>(table.size()); ++f) {
      const int32_t s = table[f];
      ASSERT_GE(s, -1) << f;
      if (s >= 0) {
        ASSERT_LT(s, static_cast<int32_t>(slot_page.size()));
        EXPECT_EQ(slot_page[s], f);
      }
    }
    for (size_t s = 0; s < slot_page.size(); ++s) {
      const int32_t f = slot_page[s];
      if (f < 0) continue;
      EXPECT_EQ(table[f], static_cast<int32_t>(s));
      EXPECT_EQ(slot_scales[2 * s], page_scales[2 * f]) << s;
      EXPECT_EQ(slot_scales[2 * s + 1], page_scales[2 * f + 1]) << s;
      EXPECT_EQ(std::memcmp(&k[s * P * d], &bytes[f * 2 * P * d], P * d * sizeof(float)), 0) << s;
      EXPECT_EQ(std::memcmp(&v[s * P * d], &bytes[f * 2 * P * d + P * d], P * d * sizeof(float)), 0)
          << s;
    }
  }
  int64_t Counter(PageCacheCounter c) const { return counters[c]; }

  int layers, heads, pages, P, d;
  std::vector<int32_t> table, slot_page, scratch, parents;
  std::vector<uint32_t> stamp;
  std::vector<uint8_t> ref;
  std::vector<int64_t> counters;
  std::vector<float> k, v, bytes, page_scales, slot_scales;
  std::vector<const void*> sources;
  PageCacheState state;
};

TEST(CpuPageCacheTest, FirstCallFillsSlotsInClockOrderSecondCallHits) {
  Cache c(/*layers=*/2, /*heads=*/2, /*pages=*/8, /*slots=*/8);
  const std::vector<int32_t> mid = {3, 5};
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(1, &mid)));
  // Named in order: head 0 pages 3, 5; head 1 pages 3, 5 -> slots 0..3.
  EXPECT_EQ(c.table[c.Flat(1, 0, 3)], 0);
  EXPECT_EQ(c.table[c.Flat(1, 0, 5)], 1);
  EXPECT_EQ(c.table[c.Flat(1, 1, 3)], 2);
  EXPECT_EQ(c.table[c.Flat(1, 1, 5)], 3);
  EXPECT_EQ(c.Counter(kPageCacheLookups), 4);
  EXPECT_EQ(c.Counter(kPageCacheHits), 0);
  EXPECT_EQ(c.Counter(kPageCacheFills), 4);
  EXPECT_EQ(c.Counter(kPageCacheHand), 4);
  EXPECT_EQ(c.scratch[0], 4);
  c.CheckInvariants();
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(1, &mid)));
  EXPECT_EQ(c.Counter(kPageCacheLookups), 8);
  EXPECT_EQ(c.Counter(kPageCacheHits), 4);
  EXPECT_EQ(c.Counter(kPageCacheFills), 4);
  EXPECT_EQ(c.Counter(kPageCacheEpoch), 2);
  EXPECT_EQ(c.scratch[0], 0);
  c.CheckInvariants();
}

TEST(CpuPageCacheTest, ClockSkipsPinnedAndReferencedSlots) {
  Cache c(1, 1, 16, 4);
  std::vector<int32_t> a = {0, 1, 2, 3};
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(0, &a)));  // slots 0..3, every ref bit set, hand 0
  std::vector<int32_t> b = {1, 9};  // page 1 hits (pinned); page 9 needs a victim
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(0, &b)));
  // The hand clears slots 0 (ref), skips 1 (pinned), clears 2, 3, wraps, takes slot 0.
  EXPECT_EQ(c.table[9], 0);
  EXPECT_EQ(c.table[0], -1);
  EXPECT_EQ(c.Counter(kPageCacheEvictions), 1);
  EXPECT_EQ(c.Counter(kPageCacheHand), 1);
  EXPECT_EQ(c.ref[2], 0);
  EXPECT_EQ(c.ref[3], 0);
  std::vector<int32_t> d = {10, 11};  // slots 1 (ref set by the hit) is passed: 2 and 3 go
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(0, &d)));
  EXPECT_EQ(c.table[10], 2);
  EXPECT_EQ(c.table[11], 3);
  EXPECT_EQ(c.table[1], 1);
  EXPECT_EQ(c.ref[1], 0);
  EXPECT_EQ(c.Counter(kPageCacheHand), 0);
  c.CheckInvariants();
}

TEST(CpuPageCacheTest, PrefixMiddleAndSuffixNameEachPageOnce) {
  Cache c(1, 2, 10, 32);
  // Prefix: tokens [0, 5) = pages 0, 1; middle: page 1 again and page 6; suffix: tokens
  // [30, 40) = pages 7, 8, 9 (page 9 twice: listed once); pages beyond the table are ignored.
  const std::vector<int32_t> mid = {1, 6, -1};
  ResolvePagesParams p = c.Params(0, &mid, /*prefix_end=*/5, /*suffix_begin=*/30,
                                  /*suffix_end=*/48);
  STRATA_ASSERT_OK(CpuResolvePages(p));
  EXPECT_EQ(c.Counter(kPageCacheLookups), 2 * 6);  // pages 0, 1, 6, 7, 8, 9 per head
  EXPECT_EQ(c.Counter(kPageCacheFills), 2 * 6);
  for (int g = 0; g < 2; ++g) {
    for (int page : {0, 1, 6, 7, 8, 9}) EXPECT_GE(c.table[c.Flat(0, g, page)], 0) << page;
    for (int page : {2, 3, 4, 5}) EXPECT_EQ(c.table[c.Flat(0, g, page)], -1) << page;
  }
  c.CheckInvariants();
}

TEST(CpuPageCacheTest, TokenIdsNameTheirPages) {
  Cache c(1, 1, 10, 8);
  std::vector<int32_t> ids = {5, 6, 7, 22, 39};  // pages 1, 1, 1, 5, 9
  ResolvePagesParams p = c.Params(0, nullptr);
  p.middle.parents = TensorView(ids.data(), DType::kI32, {1, 5});
  p.middle.fanout = 1;
  p.middle.begin = 6;  // token 5 is outside the range: invalid (page 1 is still named by 6, 7)
  p.middle.end = 40;
  STRATA_ASSERT_OK(CpuResolvePages(p));
  EXPECT_EQ(c.Counter(kPageCacheLookups), 3);
  EXPECT_GE(c.table[1], 0);
  EXPECT_GE(c.table[5], 0);
  EXPECT_GE(c.table[9], 0);
  c.CheckInvariants();
}

TEST(CpuPageCacheTest, MissesBeyondTheSlotsAreUnresolved) {
  Cache c(1, 1, 16, 3);
  std::vector<int32_t> a = {0, 1, 2, 3, 4};
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(0, &a)));
  EXPECT_EQ(c.Counter(kPageCacheFills), 3);
  EXPECT_EQ(c.Counter(kPageCacheUnresolved), 2);
  EXPECT_EQ(c.table[3], -1);
  EXPECT_EQ(c.table[4], -1);
  c.CheckInvariants();
  // The next call resolves them (nothing of the last call is pinned any more).
  std::vector<int32_t> b = {3, 4};
  STRATA_ASSERT_OK(CpuResolvePages(c.Params(0, &b)));
  EXPECT_GE(c.table[3], 0);
  EXPECT_GE(c.table[4], 0);
  EXPECT_EQ(c.Counter(kPageCacheUnresolved), 2);
  c.CheckInvariants();
}

TEST(CpuPageCacheTest, RandomCallsKeepTheInvariants) {
  std::mt19937 rng(11);
  Cache c(3, 2, 40, 24);
  std::uniform_int_distribution<int> page(0, 39), layer(0, 2), len(0, 8);
  int64_t lookups = 0;
  for (int call = 0; call < 300; ++call) {
    std::vector<int32_t> mid(len(rng));
    for (int32_t& m : mid) m = page(rng);
    std::set<int32_t> distinct(mid.begin(), mid.end());
    const int l = layer(rng);
    STRATA_ASSERT_OK(CpuResolvePages(c.Params(l, &mid)));
    lookups += 2 * static_cast<int64_t>(distinct.size());
    for (int g = 0; g < 2; ++g) {
      for (int32_t m : distinct) ASSERT_GE(c.table[c.Flat(l, g, m)], 0);
    }
    c.CheckInvariants();
  }
  EXPECT_EQ(c.Counter(kPageCacheLookups), lookups);
  EXPECT_EQ(c.Counter(kPageCacheHits) + c.Counter(kPageCacheFills), lookups);
  EXPECT_EQ(c.Counter(kPageCacheUnresolved), 0);
  EXPECT_GT(c.Counter(kPageCacheHits), 0);
  EXPECT_GT(c.Counter(kPageCacheEvictions), 0);
}

TEST(CpuPageCacheTest, BadParamsAreInvalidArgument) {
  Cache c(1, 1, 8, 4);
  ResolvePagesParams p = c.Params(0, nullptr);
  p.table_base = 4;  // rows 4..11 of an 8-entry table
  EXPECT_THAT(CpuResolvePages(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = c.Params(0, nullptr);
  p.state.sources = nullptr;
  EXPECT_THAT(CpuResolvePages(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = c.Params(0, nullptr);
  p.page_size = 8;  // pools hold 4-token pages
  EXPECT_THAT(CpuResolvePages(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = c.Params(0, nullptr);
  p.state.slot_scales = nullptr;  // page_scales without slot_scales
  EXPECT_THAT(CpuResolvePages(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p = c.Params(0, nullptr);
  p.suffix_end = -1;
  EXPECT_THAT(CpuResolvePages(p), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(c.Counter(kPageCacheEpoch), 0);  // nothing ran
}

}  // namespace
}  // namespace strata::kernels
