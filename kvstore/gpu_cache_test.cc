// GpuPageCache on the CPU backend: clock eviction exactly as the header describes, pins, the
// all-pinned error, page bytes and the device page table after eviction and refill, the miss
// policies, prefetch, the gpu-tier metrics, errors that change nothing, and a prefetch thread
// racing a decode thread.
#include "kvstore/gpu_cache.h"

#include <set>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/testing/forwarding_backend.h"
#include "kvstore/backend_page_allocator.h"
#include "kvstore/host_cache.h"
#include "kvstore/metrics.h"
#include "kvstore/page_format.h"
#include "kvstore/testing/test_pages.h"
#include "prometheus/registry.h"

namespace strata::kvstore {
namespace {

using ::strata::testing::StatusIs;

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kPages = 10;  // per (layer, head)
constexpr int kP = 4;
constexpr int kD = 8;

class GpuCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = kernels::MakeCpuBackend(1);
    metrics_ = std::make_unique<KvMetrics>(&registry_);
    layout_ = testing::SmallLayout(kLayers, kHeads, kP, kD);
    doc_.bytes.fill('g');
    HostCacheOptions ho;
    ho.capacity_bytes = int64_t{64} << 20;
    STRATA_ASSERT_OK_AND_ASSIGN(host_, HostCache::Create(ho));
    std::vector<PageWrite> writes;
    for (uint32_t l = 0; l < kLayers; ++l) {
      for (uint32_t h = 0; h < kHeads; ++h) {
        // The last page is partly filled (tokens beyond the end are zero).
        for (uint32_t p = 0; p < kPages; ++p) {
          PageWrite w;
          w.key = PageKey{doc_, l, h, p};
          STRATA_ASSERT_OK_AND_ASSIGN(
              w.data, PageBuffer::Copy(testing::MakePage(layout_, kPages * kP - 1, l, h, p, 7)));
          writes.push_back(std::move(w));
        }
      }
    }
    STRATA_ASSERT_OK(host_->Put(writes, {}));
  }

  GpuCacheOptions Options(int64_t slots) {
    GpuCacheOptions o;
    o.document = doc_;
    o.num_layers = kLayers;
    o.num_kv_heads = kHeads;
    o.pages_per_head = kPages;
    o.page_size = kP;
    o.head_dim = kD;
    o.num_slots = slots;
    o.max_batch_pages = 3;  // small, so that fills take several batches
    o.source = host_.get();
    o.metrics = metrics_.get();
    return o;
  }

  std::unique_ptr<GpuPageCache> Make(int64_t slots) {
    auto c = GpuPageCache::Create(Options(slots), backend_.get());
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // The slot's K and V bytes equal the source page's.
  void ExpectSlotHolds(GpuPageCache& c, int32_t slot, const GpuPageId& id) {
    std::vector<PageRef> got;
    ASSERT_TRUE(host_->GetPages({PageKey{doc_, static_cast<uint32_t>(id.layer),
                                         static_cast<uint32_t>(id.kv_head),
                                         static_cast<uint32_t>(id.page)}},
                                &got)
                    .ok());
    ASSERT_NE(got[0], nullptr);
    const size_t half = static_cast<size_t>(kP) * kD * 2;
    const char* k = static_cast<const char*>(c.k_pool().data) + half * slot;
    const char* v = static_cast<const char*>(c.v_pool().data) + half * slot;
    EXPECT_EQ(std::memcmp(k, PageKBytes(got[0]->view()).data(), half), 0)
        << "K of slot " << slot << " page " << id.page;
    EXPECT_EQ(std::memcmp(v, PageVBytes(got[0]->view()).data(), half), 0)
        << "V of slot " << slot << " page " << id.page;
  }

  // Every page's host slot, its bytes, and the device table mirror agree.
  void ExpectConsistent(GpuPageCache& c) {
    STRATA_ASSERT_OK(c.WaitForFills());
    std::vector<int32_t> device(c.table_size());
    STRATA_ASSERT_OK(backend_->CopyToHost(device.data(), c.device_table(),
                                          device.size() * sizeof(int32_t), nullptr));
    std::vector<int> owners(c.options().num_slots, 0);
    int64_t resident = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (int h = 0; h < kHeads; ++h) {
        for (int p = 0; p < kPages; ++p) {
          const GpuPageId id{l, h, p};
          STRATA_ASSERT_OK_AND_ASSIGN(int32_t s, c.SlotOf(id));
          EXPECT_EQ(device[(l * kHeads + h) * kPages + p], s) << l << "/" << h << "/" << p;
          if (s < 0) continue;
          ++resident;
          ++owners[s];
          ExpectSlotHolds(c, s, id);
        }
      }
    }
    for (int n : owners) EXPECT_LE(n, 1);
    EXPECT_EQ(c.resident_pages(), resident);
  }

  double Counter(const char* name, const std::string& tier) {
    for (const auto& f : registry_.Collect()) {
      if (f.name != name) continue;
      for (const auto& m : f.metric) {
        for (const auto& l : m.label) {
          if (l.value == tier) {
            return f.type == prometheus::MetricType::Gauge ? m.gauge.value : m.counter.value;
          }
        }
      }
    }
    return -1;
  }

  std::unique_ptr<kernels::Backend> backend_;
  prometheus::Registry registry_;
  std::unique_ptr<KvMetrics> metrics_;
  KvLayout layout_;
  DocumentId doc_;
  std::unique_ptr<HostCache> host_;
};

std::vector<GpuPageId> Pages(std::initializer_list<int> pages, int layer = 0, int head = 0) {
  std::vector<GpuPageId> v;
  for (int p : pages) v.push_back(GpuPageId{layer, head, p});
  return v;
}

// n pages drawn uniformly from the whole document (layer, head, page, in that order per page).
std::vector<GpuPageId> RandomPages(std::mt19937& rng, int n) {
  std::vector<GpuPageId> v;
  for (int i = 0; i < n; ++i) {
    v.push_back(GpuPageId{static_cast<int32_t>(rng() % kLayers),
                          static_cast<int32_t>(rng() % kHeads),
                          static_cast<int32_t>(rng() % kPages)});
  }
  return v;
}

TEST_F(GpuCacheTest, OptionsAreValidated) {
  GpuCacheOptions o = Options(4);
  o.num_slots = 0;
  EXPECT_THAT(GpuPageCache::Create(o, backend_.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o = Options(4);
  o.source = nullptr;
  EXPECT_THAT(GpuPageCache::Create(o, backend_.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  o = Options(4);
  o.pages_per_head = int64_t{1} << 30;
  EXPECT_THAT(GpuPageCache::Create(o, backend_.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(GpuPageCache::Create(Options(4), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(GpuCacheTest, ClockEvictsExactlyAsSpecified) {
  auto c = Make(4);
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> slots;
  // Never-used slots first, lowest first.
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1, 2, 3}), MissPolicy::kWait, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2, 3}));
  STRATA_ASSERT_OK(c->Release(slots));
  STRATA_ASSERT_OK(c->Acquire(Pages({0}), MissPolicy::kWait, &slots));  // hit
  EXPECT_EQ(slots, (std::vector<int32_t>{0}));
  STRATA_ASSERT_OK(c->Release(slots));
  // Every reference bit is set: the hand clears 0..3, wraps, and takes slot 0 (page 0 goes).
  STRATA_ASSERT_OK(c->Acquire(Pages({4}), MissPolicy::kWait, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{0}));
  STRATA_ASSERT_OK(c->Release(slots));
  EXPECT_EQ(*c->SlotOf({0, 0, 0}), -1);
  STRATA_ASSERT_OK(c->Acquire(Pages({1}), MissPolicy::kWait, &slots));  // hit: sets slot 1's bit
  STRATA_ASSERT_OK(c->Release(slots));
  // The hand is at 1: clears slot 1's bit, takes slot 2 (page 2).
  STRATA_ASSERT_OK(c->Acquire(Pages({5}), MissPolicy::kWait, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{2}));
  STRATA_ASSERT_OK(c->Release(slots));
  EXPECT_EQ(*c->SlotOf({0, 0, 2}), -1);
  EXPECT_EQ(*c->SlotOf({0, 0, 1}), 1);
  EXPECT_EQ(*c->SlotOf({0, 0, 3}), 3);
  EXPECT_EQ(*c->SlotOf({0, 0, 4}), 0);
  EXPECT_EQ(*c->SlotOf({0, 0, 5}), 2);
  // Next: hand at 3, slot 3's bit is still clear from the first sweep -> page 3 goes.
  STRATA_ASSERT_OK(c->Acquire(Pages({6}), MissPolicy::kWait, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{3}));
  STRATA_ASSERT_OK(c->Release(slots));
  const GpuCacheStats s = c->stats();
  EXPECT_EQ(s.lookups, 9);
  EXPECT_EQ(s.hits, 2);
  EXPECT_EQ(s.evictions, 3);
  EXPECT_EQ(s.fills, 7);
  ExpectConsistent(*c);
}

TEST_F(GpuCacheTest, PinnedPagesAreNeverEvicted) {
  auto c = Make(4);
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> step1, other;
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1, 2}), MissPolicy::kWait, &step1));  // stays pinned
  EXPECT_EQ(c->pinned_slots(), 3);
  for (int p = 3; p < kPages; ++p) {
    STRATA_ASSERT_OK(c->Acquire(Pages({p}), MissPolicy::kWait, &other));
    EXPECT_EQ(other, (std::vector<int32_t>{3}));  // the only unpinned slot
    STRATA_ASSERT_OK(c->Release(other));
  }
  for (int p = 0; p < 3; ++p) EXPECT_EQ(*c->SlotOf({0, 0, p}), p);
  ExpectConsistent(*c);
  STRATA_ASSERT_OK(c->Release(step1));
  EXPECT_EQ(c->pinned_slots(), 0);
}

TEST_F(GpuCacheTest, AllPinnedIsResourceExhaustedAndChangesNothing) {
  auto c = Make(4);
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> step, slots;
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1, 2, 3}), MissPolicy::kWait, &step));
  const GpuCacheStats before = c->stats();
  EXPECT_THAT(c->Acquire(Pages({4}), MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kResourceExhausted));
  // Hits on unpinned pages count against the room too: 2 unpinned, 1 of them hit, 2 misses.
  STRATA_ASSERT_OK(c->Release(std::vector<int32_t>{step[0], step[1]}));
  EXPECT_THAT(c->Acquire(Pages({0, 5, 6}), MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(c->pinned_slots(), 2);
  EXPECT_EQ(c->stats().lookups, before.lookups);
  EXPECT_EQ(c->stats().fills, before.fills);
  // Deferred misses are not an error when the slots run out: the hits come back, misses -1.
  STRATA_ASSERT_OK(c->Acquire(Pages({2, 3, 7}), MissPolicy::kDefer, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{2, 3, -1}));
  STRATA_ASSERT_OK(c->Release(slots));
  STRATA_ASSERT_OK(c->Release(std::vector<int32_t>{step[2], step[3]}));
  ExpectConsistent(*c);
}

TEST_F(GpuCacheTest, BytesExactAfterEvictionAndRefill) {
  auto c = Make(5);
  ASSERT_NE(c, nullptr);
  std::mt19937 rng(3);
  std::vector<int32_t> slots;
  for (int step = 0; step < 40; ++step) {
    const std::vector<GpuPageId> want = RandomPages(rng, 4);
    STRATA_ASSERT_OK(c->Acquire(want, MissPolicy::kWait, &slots));
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_GE(slots[i], 0);
      ExpectSlotHolds(*c, slots[i], want[i]);
    }
    STRATA_ASSERT_OK(c->Release(slots));
  }
  EXPECT_GT(c->stats().evictions, 20);
  ExpectConsistent(*c);
}

TEST_F(GpuCacheTest, OrderedMissesGetTheSameSlotsAndBytesAsWait) {
  // kOrdered hands out exactly what kWait does (same slots, same evictions), only without the
  // host wait; after the stream is drained the bytes are those of the source.
  auto a = Make(5);
  auto b = Make(5);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::mt19937 rng(11);
  std::vector<int32_t> sa, sb;
  for (int step = 0; step < 40; ++step) {
    const std::vector<GpuPageId> want = RandomPages(rng, 4);
    STRATA_ASSERT_OK(a->Acquire(want, MissPolicy::kWait, &sa));
    STRATA_ASSERT_OK(b->Acquire(want, MissPolicy::kOrdered, &sb));
    ASSERT_EQ(sa, sb) << "step " << step;
    STRATA_ASSERT_OK(backend_->Synchronize(nullptr));  // the reader's stream
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_GE(sb[i], 0);
      ExpectSlotHolds(*b, sb[i], want[i]);
    }
    STRATA_ASSERT_OK(a->Release(sa));
    STRATA_ASSERT_OK(b->Release(sb));
  }
  EXPECT_EQ(a->stats().evictions, b->stats().evictions);
  EXPECT_EQ(a->stats().hits, b->stats().hits);
  EXPECT_GT(b->stats().evictions, 20);
  ExpectConsistent(*b);
  // Exact like kWait: more distinct misses than unpinned slots is refused, nothing pinned.
  EXPECT_THAT(b->Acquire(Pages({0, 1, 2, 3, 4, 5}), MissPolicy::kOrdered, &sb),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(b->pinned_slots(), 0);
}

TEST_F(GpuCacheTest, HeldSourcePagesFillWithoutLookingUpTheSource) {
  GpuCacheOptions o = Options(5);
  o.hold_source_pages = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto held, GpuPageCache::Create(o, backend_.get()));
  auto plain = Make(5);
  ASSERT_NE(plain, nullptr);
  std::mt19937 rng(5);
  std::vector<int32_t> sa, sb;
  for (int step = 0; step < 30; ++step) {
    const std::vector<GpuPageId> want = RandomPages(rng, 4);
    STRATA_ASSERT_OK(plain->Acquire(want, MissPolicy::kWait, &sa));
    STRATA_ASSERT_OK(held->Acquire(want, MissPolicy::kWait, &sb));
    ASSERT_EQ(sa, sb);
    for (size_t i = 0; i < want.size(); ++i) ExpectSlotHolds(*held, sb[i], want[i]);
    STRATA_ASSERT_OK(plain->Release(sa));
    STRATA_ASSERT_OK(held->Release(sb));
  }
  ExpectConsistent(*held);
  // With the document gone from the source, the held cache still fills (from its references);
  // the plain one reports the missing page.
  std::vector<PageRef> keep;  // the bytes, for the comparison below
  STRATA_ASSERT_OK(host_->GetPages({PageKey{doc_, 1, 1, 9}}, &keep));
  host_->EraseDocument(doc_);
  std::vector<int32_t> slots;
  EXPECT_THAT(plain->Acquire({GpuPageId{1, 1, 9}, GpuPageId{1, 1, 8}, GpuPageId{1, 0, 7},
                              GpuPageId{0, 0, 6}, GpuPageId{0, 1, 5}},
                             MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kNotFound));
  STRATA_ASSERT_OK(held->Acquire({GpuPageId{1, 1, 9}}, MissPolicy::kWait, &slots));
  ASSERT_GE(slots[0], 0);
  const size_t half = static_cast<size_t>(kP) * kD * 2;
  EXPECT_EQ(std::memcmp(static_cast<const char*>(held->k_pool().data) + half * slots[0],
                        PageKBytes(keep[0]->view()).data(), half),
            0);
  STRATA_ASSERT_OK(held->Release(slots));
  // Create fails when a page is missing from the source.
  EXPECT_THAT(GpuPageCache::Create(o, backend_.get()).status(),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(GpuCacheTest, DuplicatesArePinnedPerEntry) {
  auto c = Make(4);
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> slots;
  STRATA_ASSERT_OK(c->Acquire(Pages({1, 1, 2}), MissPolicy::kWait, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(c->stats().fills, 2);
  STRATA_ASSERT_OK(c->Release(std::vector<int32_t>{0}));
  EXPECT_EQ(c->pinned_slots(), 2);  // slot 0 once more, slot 1
  EXPECT_THAT(c->Release(std::vector<int32_t>{0, 0}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(c->pinned_slots(), 2);  // the failed release changed nothing
  EXPECT_THAT(c->Release(std::vector<int32_t>{4}), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK(c->Release(std::vector<int32_t>{0, 1, -1}));
  EXPECT_EQ(c->pinned_slots(), 0);
}

TEST_F(GpuCacheTest, DeferredMissesArriveForTheNextStep) {
  auto c = Make(8);
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> slots;
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1}), MissPolicy::kWait, &slots));
  STRATA_ASSERT_OK(c->Release(slots));
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1, 2, 3}), MissPolicy::kDefer, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, -1, -1}));
  STRATA_ASSERT_OK(c->Release(slots));
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1, 2, 3}), MissPolicy::kDefer, &slots));
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2, 3}));
  STRATA_ASSERT_OK(c->Release(slots));
  EXPECT_EQ(c->stats().lookups, 10);
  EXPECT_EQ(c->stats().hits, 6);
  ExpectConsistent(*c);
}

TEST_F(GpuCacheTest, PrefetchFillsWithoutCountingLookups) {
  auto c = Make(8);
  ASSERT_NE(c, nullptr);
  int64_t issued = -1;
  STRATA_ASSERT_OK(c->Prefetch(Pages({3, 4, 5, 5}, 1, 1), &issued));
  EXPECT_EQ(issued, 3);
  EXPECT_EQ(c->stats().lookups, 0);
  EXPECT_EQ(c->pinned_slots(), 0);
  STRATA_ASSERT_OK(c->Prefetch(Pages({3, 4, 5, 6}, 1, 1), &issued));
  EXPECT_EQ(issued, 1);
  std::vector<int32_t> slots;
  STRATA_ASSERT_OK(c->Acquire(Pages({3, 4, 5, 6}, 1, 1), MissPolicy::kWait, &slots));
  EXPECT_EQ(c->stats().hits, 4);
  STRATA_ASSERT_OK(c->Release(slots));
  ExpectConsistent(*c);
}

TEST_F(GpuCacheTest, MetricsMoveUnderTierGpu) {
  auto c = Make(3);
  ASSERT_NE(c, nullptr);
  const double page_bytes = 2.0 * kP * kD * 2;
  EXPECT_EQ(Counter("strata_kv_capacity_bytes", "gpu"), 3 * page_bytes);
  EXPECT_EQ(Counter("strata_kv_resident_bytes", "gpu"), 0);
  std::vector<int32_t> slots;
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 1, 2}), MissPolicy::kWait, &slots));
  STRATA_ASSERT_OK(c->Release(slots));
  STRATA_ASSERT_OK(c->Acquire(Pages({0, 3}), MissPolicy::kWait, &slots));
  STRATA_ASSERT_OK(c->Release(slots));
  EXPECT_EQ(Counter("strata_kv_lookups_total", "gpu"), 5);
  EXPECT_EQ(Counter("strata_kv_hits_total", "gpu"), 1);
  EXPECT_EQ(Counter("strata_kv_evictions_total", "gpu"), 1);
  EXPECT_EQ(Counter("strata_kv_resident_bytes", "gpu"), 3 * page_bytes);
  double fetched = -1;
  for (const auto& f : registry_.Collect()) {
    if (f.name != "strata_kv_fetch_bytes_total") continue;
    for (const auto& m : f.metric) {
      bool src = false, dst = false;
      for (const auto& l : m.label) {
        src |= l.name == "src" && l.value == "host";
        dst |= l.name == "dst" && l.value == "gpu";
      }
      if (src && dst) fetched = m.counter.value;
    }
  }
  EXPECT_EQ(fetched, 4 * page_bytes);
}

TEST_F(GpuCacheTest, AdditiveGaugesSumOverTheCachesAlive) {
  // Two caches on one registry (e.g. two worker jobs): capacity and resident bytes add up, and a
  // destroyed cache takes its own share back.
  const double page_bytes = 2.0 * kP * kD * 2;
  GpuCacheOptions o = Options(3);
  o.additive_gauges = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto a, GpuPageCache::Create(o, backend_.get()));
  o.num_slots = 5;
  STRATA_ASSERT_OK_AND_ASSIGN(auto b, GpuPageCache::Create(o, backend_.get()));
  EXPECT_EQ(Counter("strata_kv_capacity_bytes", "gpu"), 8 * page_bytes);
  std::vector<int32_t> slots;
  STRATA_ASSERT_OK(a->Acquire(Pages({0, 1, 2}), MissPolicy::kWait, &slots));
  STRATA_ASSERT_OK(a->Release(slots));
  STRATA_ASSERT_OK(a->Acquire(Pages({3}), MissPolicy::kWait, &slots));  // evicts one: still 3
  STRATA_ASSERT_OK(a->Release(slots));
  STRATA_ASSERT_OK(b->Acquire(Pages({0, 1}), MissPolicy::kWait, &slots));
  STRATA_ASSERT_OK(b->Release(slots));
  EXPECT_EQ(Counter("strata_kv_resident_bytes", "gpu"), 5 * page_bytes);
  a.reset();
  EXPECT_EQ(Counter("strata_kv_capacity_bytes", "gpu"), 5 * page_bytes);
  EXPECT_EQ(Counter("strata_kv_resident_bytes", "gpu"), 2 * page_bytes);
  b.reset();
  EXPECT_EQ(Counter("strata_kv_capacity_bytes", "gpu"), 0);
  EXPECT_EQ(Counter("strata_kv_resident_bytes", "gpu"), 0);
}

TEST_F(GpuCacheTest, ErrorsChangeNothing) {
  auto c = Make(4);
  ASSERT_NE(c, nullptr);
  std::vector<int32_t> slots;
  EXPECT_THAT(c->Acquire(Pages({kPages}), MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c->Acquire({GpuPageId{kLayers, 0, 0}}, MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(c->Acquire(Pages({0}), MissPolicy::kWait, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A page the host tier lacks: NotFound, and the hit on page 1 is not left pinned.
  STRATA_ASSERT_OK(c->Acquire(Pages({1}), MissPolicy::kWait, &slots));
  STRATA_ASSERT_OK(c->Release(slots));
  host_->EraseDocument(doc_);
  EXPECT_THAT(c->Acquire(Pages({1, 2}), MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(c->pinned_slots(), 0);
  EXPECT_EQ(c->resident_pages(), 1);
  EXPECT_THAT(c->Prefetch(Pages({3})), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(c->resident_pages(), 1);
}

TEST_F(GpuCacheTest, WrongPageShapeIsRefused) {
  HostCacheOptions ho;
  STRATA_ASSERT_OK_AND_ASSIGN(auto other, HostCache::Create(ho));
  const KvLayout wide = testing::SmallLayout(kLayers, kHeads, kP, 2 * kD);
  PageWrite w;
  w.key = PageKey{doc_, 0, 0, 0};
  STRATA_ASSERT_OK_AND_ASSIGN(w.data,
                              PageBuffer::Copy(testing::MakePage(wide, kP, 0, 0, 0, 1)));
  STRATA_ASSERT_OK(other->Put({w}, {}));
  GpuCacheOptions o = Options(4);
  o.source = other.get();
  STRATA_ASSERT_OK_AND_ASSIGN(auto c, GpuPageCache::Create(o, backend_.get()));
  std::vector<int32_t> slots;
  EXPECT_THAT(c->Acquire(Pages({0}), MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(c->resident_pages(), 0);
}

TEST_F(GpuCacheTest, HostManagedCacheDequantisesFp8PagesIntoBf16Slots) {
  // The same document as fp8 pages (per-page scales) in a host tier of backend memory: the
  // host-managed cache's pools stay bf16, and each slot holds its page dequantised (fp8 * scale
  // rounded to bf16: PageToBf16), never read in place.
  BackendPageAllocator alloc(backend_.get(), 4096);
  HostCacheOptions ho;
  ho.allocator = &alloc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto fp8_host, HostCache::Create(ho));
  KvLayout fp8 = layout_;
  fp8.page.dtype = kernels::DType::kFP8E4M3;
  std::vector<PageWrite> writes;
  for (uint32_t p = 0; p < kPages; ++p) {
    PageWrite w;
    w.key = PageKey{doc_, 1, 0, p};
    STRATA_ASSERT_OK_AND_ASSIGN(w.data, PageBuffer::Copy(testing::MakePage(fp8, kPages * kP - 1, 1, 0, p, 7)));
    writes.push_back(std::move(w));
  }
  STRATA_ASSERT_OK(fp8_host->Put(writes, {}));
  GpuCacheOptions o = Options(4);
  o.source = fp8_host.get();
  o.in_place_allocator = &alloc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto c, GpuPageCache::Create(o, backend_.get()));
  EXPECT_EQ(c->k_pool().dtype, kernels::DType::kBF16);
  std::vector<int32_t> slots;
  const std::vector<GpuPageId> ids = Pages({0, 3, 9}, 1, 0);
  STRATA_ASSERT_OK(c->Acquire(ids, MissPolicy::kWait, &slots));
  EXPECT_EQ(c->stats().in_place, 0);
  const size_t half = static_cast<size_t>(kP) * kD;
  std::vector<uint16_t> k(half), v(half);
  for (size_t i = 0; i < ids.size(); ++i) {
    const absl::string_view page = writes[static_cast<size_t>(ids[i].page)].data->view();
    STRATA_ASSERT_OK(PageToBf16(page, k.data(), v.data()));
    const auto* sk = static_cast<const uint16_t*>(c->k_pool().data) + half * slots[i];
    const auto* sv = static_cast<const uint16_t*>(c->v_pool().data) + half * slots[i];
    EXPECT_EQ(std::memcmp(sk, k.data(), half * 2), 0) << "page " << ids[i].page;
    EXPECT_EQ(std::memcmp(sv, v.data(), half * 2), 0) << "page " << ids[i].page;
    // Not the fp8 bytes themselves: the slot holds values, not codes.
    EXPECT_NE(std::memcmp(sk, PageKBytes(page).data(), half), 0);
  }
  STRATA_ASSERT_OK(c->Release(slots));
}

TEST(BackendPageAllocatorTest, BlocksFromChunksAreReusedAndLargeRequestsOwnBuffers) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  BackendPageAllocator a(backend.get(), 100, 1000);  // blocks of 128 bytes, chunks of 8 blocks
  EXPECT_EQ(a.block_bytes(), 128u);
  std::set<void*> seen;
  std::vector<void*> blocks;
  for (int i = 0; i < 10; ++i) {
    void* p = a.Allocate(100);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    EXPECT_TRUE(seen.insert(p).second);
    std::memset(p, i, 128);
    blocks.push_back(p);
  }
  EXPECT_EQ(a.reserved_bytes(), 2 * 1024u);  // two chunks of 8 x 128 bytes
  a.Free(blocks[3], 100);
  EXPECT_EQ(a.Allocate(50), blocks[3]);  // reused
  void* big = a.Allocate(5000);
  ASSERT_NE(big, nullptr);
  std::memset(big, 1, 5000);
  EXPECT_EQ(a.reserved_bytes(), 2 * 1024u + 5000u);
  a.Free(big, 5000);
  EXPECT_EQ(a.reserved_bytes(), 2 * 1024u);
}

TEST(BackendPageAllocatorTest, ReserveObtainsWholeChunksUpFront) {
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend(1);
  BackendPageAllocator a(backend.get(), 100, 1000);  // blocks of 128 bytes, chunks of 8 blocks
  STRATA_ASSERT_OK(a.Reserve(2500));                  // three chunks
  EXPECT_EQ(a.reserved_bytes(), 3 * 1024u);
  STRATA_ASSERT_OK(a.Reserve(1000));  // already there
  EXPECT_EQ(a.reserved_bytes(), 3 * 1024u);
  std::set<void*> seen;
  for (int i = 0; i < 24; ++i) {  // every reserved block, none pinned on the way
    void* p = a.Allocate(128);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(seen.insert(p).second);
  }
  EXPECT_EQ(a.reserved_bytes(), 3 * 1024u);
  ASSERT_NE(a.Allocate(1), nullptr);  // the 25th block needs a fourth chunk
  EXPECT_EQ(a.reserved_bytes(), 4 * 1024u);
}

// The CPU backend whose AllocateHost succeeds `allowed` times, then returns ResourceExhausted (as
// cudaHostAlloc does when no more memory can be pinned).
class LimitedHostBackend : public kernels::testing::ForwardingBackend {
 public:
  explicit LimitedHostBackend(int allowed)
      : ForwardingBackend("limited-host", kernels::MakeCpuBackend(1)), allowed_(allowed) {}
  absl::StatusOr<std::unique_ptr<kernels::Buffer>> AllocateHost(size_t bytes) override {
    if (allowed_-- <= 0) return absl::ResourceExhaustedError("no more pinned memory");
    return ForwardingBackend::AllocateHost(bytes);
  }

 private:
  int allowed_;
};

TEST(BackendPageAllocatorTest, ReserveStopsAtTheFirstFailedChunkAndKeepsWhatItHas) {
  LimitedHostBackend backend(2);
  BackendPageAllocator a(&backend, 100, 1000);  // blocks of 128 bytes, chunks of 8 blocks
  EXPECT_THAT(a.Reserve(4000), StatusIs(absl::StatusCode::kResourceExhausted,
                                        ::testing::HasSubstr("2048 of 4000 bytes reserved")));
  EXPECT_EQ(a.reserved_bytes(), 2 * 1024u);
  std::set<void*> seen;
  for (int i = 0; i < 16; ++i) {  // the two chunks it got are there to use
    void* p = a.Allocate(128);
    ASSERT_NE(p, nullptr) << i;
    EXPECT_TRUE(seen.insert(p).second);
  }
  EXPECT_EQ(a.Allocate(128), nullptr);   // a third chunk cannot be had
  EXPECT_EQ(a.Allocate(5000), nullptr);  // nor a large buffer
  EXPECT_EQ(a.reserved_bytes(), 2 * 1024u);

  // A stop already requested: nothing is pinned.
  LimitedHostBackend more(100);
  BackendPageAllocator b(&more, 100, 1000);
  std::atomic<bool> stop{true};
  EXPECT_THAT(b.Reserve(4000, &stop), StatusIs(absl::StatusCode::kCancelled));
  EXPECT_EQ(b.reserved_bytes(), 0u);
}

TEST_F(GpuCacheTest, PagesInBackendHostMemoryAreReadInPlace) {
  // A host tier whose buffers come from AllocateHost memory: the fills read them where they lie.
  BackendPageAllocator alloc(backend_.get(), layout_.page.EncodedBytes(), 1 << 16);
  HostCacheOptions ho;
  ho.allocator = &alloc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto pinned_host, HostCache::Create(ho));
  std::vector<PageRef> all;
  std::vector<PageKey> keys;
  for (uint32_t p = 0; p < kPages; ++p) keys.push_back(PageKey{doc_, 1, 0, p});
  STRATA_ASSERT_OK(host_->GetPages(keys, &all));
  std::vector<PageWrite> writes;
  for (uint32_t p = 0; p < kPages; p += 2) writes.push_back(PageWrite{keys[p], all[p]});
  STRATA_ASSERT_OK(pinned_host->Put(writes, {}));  // even pages in pinned memory (copied)
  // Odd pages stay in plain memory: a tier in front that serves them.
  class Either : public PageStore {
   public:
    Either(PageStore* a, PageStore* b) : a_(a), b_(b) {}
    const char* tier() const override { return "host"; }
    absl::Status GetPages(absl::Span<const PageKey> k, std::vector<PageRef>* out) override {
      STRATA_RETURN_IF_ERROR(a_->GetPages(k, out));
      std::vector<PageRef> more;
      STRATA_RETURN_IF_ERROR(b_->GetPages(k, &more));
      for (size_t i = 0; i < k.size(); ++i) {
        if ((*out)[i] == nullptr) (*out)[i] = more[i];
      }
      return absl::OkStatus();
    }
    absl::Status Put(absl::Span<const PageWrite>, absl::Span<const SummaryWrite>) override {
      return absl::UnimplementedError("read-only");
    }
    absl::Status GetSummaries(absl::Span<const SummaryKey> k, std::vector<PageRef>* out) override {
      out->assign(k.size(), nullptr);
      return absl::OkStatus();
    }
    PageStore* a_;
    PageStore* b_;
  } either(pinned_host.get(), host_.get());
  GpuCacheOptions o = Options(6);
  o.source = &either;
  o.in_place_allocator = &alloc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto c, GpuPageCache::Create(o, backend_.get()));
  std::vector<int32_t> slots;
  for (int round = 0; round < 3; ++round) {
    for (int p = 0; p < kPages; p += 3) {
      const std::vector<GpuPageId> want = Pages({p, (p + 1) % kPages, (p + 5) % kPages}, 1, 0);
      STRATA_ASSERT_OK(c->Acquire(want, MissPolicy::kWait, &slots));
      for (size_t i = 0; i < want.size(); ++i) ExpectSlotHolds(*c, slots[i], want[i]);
      STRATA_ASSERT_OK(c->Release(slots));
    }
  }
  const GpuCacheStats s = c->stats();
  EXPECT_GT(s.in_place, 0);
  EXPECT_LT(s.in_place, s.fills);  // the odd pages were gathered
  ExpectConsistent(*c);
}

// Device-managed mode (on the CPU backend, whose ResolvePages is the specification): a host tier
// in AllocateHost memory, selections made resident by EnqueueResolve, the table rows read back,
// the counters synced into stats() and the metrics, and the host-managed calls refused.
TEST_F(GpuCacheTest, DeviceManagedResolvesSelectionsWithoutHostBookkeeping) {
  BackendPageAllocator alloc(backend_.get(), layout_.page.EncodedBytes(), 1 << 16);
  HostCacheOptions ho;
  ho.allocator = &alloc;
  STRATA_ASSERT_OK_AND_ASSIGN(auto pinned_host, HostCache::Create(ho));
  std::vector<PageKey> keys;
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (uint32_t h = 0; h < kHeads; ++h) {
      for (uint32_t p = 0; p < kPages; ++p) keys.push_back(PageKey{doc_, l, h, p});
    }
  }
  std::vector<PageRef> all;
  STRATA_ASSERT_OK(host_->GetPages(keys, &all));
  std::vector<PageWrite> writes;
  for (size_t i = 0; i < keys.size(); ++i) writes.push_back(PageWrite{keys[i], all[i]});
  STRATA_ASSERT_OK(pinned_host->Put(writes, {}));  // copied into the allocator's memory

  GpuCacheOptions o = Options(10);
  o.device_managed = true;
  o.source = pinned_host.get();
  EXPECT_THAT(GpuPageCache::Create(o, backend_.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));  // needs held pages in place
  o.hold_source_pages = true;
  o.in_place_allocator = &alloc;
  GpuCacheOptions plain = o;
  plain.source = host_.get();  // pages outside the allocator
  EXPECT_THAT(GpuPageCache::Create(plain, backend_.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  STRATA_ASSERT_OK_AND_ASSIGN(auto c, GpuPageCache::Create(o, backend_.get()));

  std::vector<int32_t> parents = {3, 7, -1, /*head 1:*/ 7, 2, 9};
  kernels::CandidateList mid;
  mid.parents = kernels::TensorView(parents.data(), kernels::DType::kI32, {kHeads, 3});
  mid.fanout = kP;
  mid.begin = kP;  // page 0 comes from the prefix
  mid.end = kPages * kP;
  auto check_layer = [&](int layer, const std::vector<std::vector<int>>& want) {
    std::vector<int32_t> table(c->table_size());
    STRATA_ASSERT_OK(backend_->CopyToHost(table.data(), c->device_table(),
                                          table.size() * sizeof(int32_t), nullptr));
    for (int h = 0; h < kHeads; ++h) {
      for (int p : want[h]) {
        const int32_t s = table[(layer * kHeads + h) * kPages + p];
        ASSERT_GE(s, 0) << "layer " << layer << " head " << h << " page " << p;
        ExpectSlotHolds(*c, s, GpuPageId{layer, h, p});
      }
    }
  };
  STRATA_ASSERT_OK(c->EnqueueResolve(1, /*prefix_end=*/kP, mid, 0, 0));
  check_layer(1, {{0, 3, 7}, {0, 7, 2, 9}});
  STRATA_ASSERT_OK(c->SyncDeviceStats());
  GpuCacheStats s = c->stats();
  EXPECT_EQ(s.lookups, 7);
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.fills, 7);
  EXPECT_EQ(c->resident_pages(), 7);
  // Same selection on layer 1 again: all hits. Then layer 0 needs 8 slots: the 3 never used,
  // then (every reference bit cleared by the hand) 5 evictions.
  STRATA_ASSERT_OK(c->EnqueueResolve(1, kP, mid, 0, 0));
  STRATA_ASSERT_OK(c->EnqueueResolve(0, kP, mid, /*suffix=*/(kPages - 1) * kP, kPages * kP));
  check_layer(0, {{0, 3, 7, 9}, {0, 7, 2, 9}});
  STRATA_ASSERT_OK(c->SyncDeviceStats());
  s = c->stats();
  EXPECT_EQ(s.lookups, 7 + 7 + 8);
  EXPECT_EQ(s.hits, 7);
  EXPECT_EQ(s.fills, 15);
  EXPECT_EQ(s.evictions, 5);
  EXPECT_EQ(c->resident_pages(), 10);
  EXPECT_EQ(s.fill_bytes, 15 * c->page_bytes());
  EXPECT_EQ(registry_.Collect().empty(), false);

  // A selection that could name more pages than there are slots is refused; host calls too.
  kernels::CandidateList wide = mid;
  std::vector<int32_t> many(kHeads * 5, 1);
  wide.parents = kernels::TensorView(many.data(), kernels::DType::kI32, {kHeads, 5});
  EXPECT_THAT(c->EnqueueResolve(0, kP, wide, 0, 0),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(c->EnqueueResolve(kLayers, kP, mid, 0, 0),
              StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<int32_t> slots;
  EXPECT_THAT(c->Acquire(Pages({1}, 0, 0), MissPolicy::kWait, &slots),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(c->Prefetch(Pages({1}, 0, 0)), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(c->SlotOf(GpuPageId{0, 0, 1}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  auto host_managed = Make(4);
  EXPECT_THAT(host_managed->EnqueueResolve(0, kP, mid, 0, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(host_managed->SyncDeviceStats(), StatusIs(absl::StatusCode::kFailedPrecondition));

  // One fp8 page among bf16 ones: the pools cannot hold both.
  std::vector<float> k(kP * kD), v(kP * kD);
  STRATA_ASSERT_OK(DecodePage(all[5]->view(), k.data(), v.data()));
  PageShape fp8 = layout_.page;
  fp8.dtype = kernels::DType::kFP8E4M3;
  const kernels::TensorView kf(k.data(), kernels::DType::kF32, {kP, kD});
  const kernels::TensorView vf(v.data(), kernels::DType::kF32, {kP, kD});
  STRATA_ASSERT_OK_AND_ASSIGN(std::string page, EncodePage(fp8, kf, vf));
  STRATA_ASSERT_OK_AND_ASSIGN(PageRef fp8_page, PageBuffer::Copy(page, &alloc));
  STRATA_ASSERT_OK(pinned_host->Put({PageWrite{keys[5], fp8_page}}, {}));
  EXPECT_THAT(GpuPageCache::Create(o, backend_.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

// Attention over cache slots equals attention over a pool holding every page at its own index:
// the cache's pools are in the KvCache slot layout, so spans may name cache slots directly.
TEST_F(GpuCacheTest, PagedAttentionOverCacheSlotsMatchesAFullPool) {
  auto c = Make(7);
  ASSERT_NE(c, nullptr);
  const int layer = 1;
  const size_t half = static_cast<size_t>(kP) * kD;
  // The full pool: page p of head h at slot h * kPages + p.
  std::vector<uint16_t> full_k(kHeads * kPages * half), full_v(full_k.size());
  for (int h = 0; h < kHeads; ++h) {
    std::vector<PageKey> keys;
    for (int p = 0; p < kPages; ++p) {
      keys.push_back(PageKey{doc_, static_cast<uint32_t>(layer), static_cast<uint32_t>(h),
                             static_cast<uint32_t>(p)});
    }
    std::vector<PageRef> pages;
    STRATA_ASSERT_OK(host_->GetPages(keys, &pages));
    for (int p = 0; p < kPages; ++p) {
      std::memcpy(&full_k[(h * kPages + p) * half], PageKBytes(pages[p]->view()).data(), 2 * half);
      std::memcpy(&full_v[(h * kPages + p) * half], PageVBytes(pages[p]->view()).data(), 2 * half);
    }
  }
  // A selection per head (3 pages each), fetched into the cache (slots in miss order).
  const std::vector<std::vector<int>> selected = {{7, 2, 9}, {0, 5, 8}};
  std::vector<GpuPageId> want;
  for (int h = 0; h < kHeads; ++h) {
    for (int p : selected[h]) want.push_back(GpuPageId{layer, h, p});
  }
  std::vector<int32_t> slots;
  STRATA_ASSERT_OK(c->Acquire(want, MissPolicy::kWait, &slots));
  const int q_heads = 2 * kHeads;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(q_heads * kD);
  for (float& x : q) x = u(rng);
  std::vector<kernels::KvSpan> via_cache, via_full;
  std::vector<int32_t> offsets = {0};
  for (int h = 0, i = 0; h < kHeads; ++h) {
    for (int p : selected[h]) {
      via_cache.push_back(kernels::KvSpan{slots[i++], 0, kP, p * kP});
      via_full.push_back(kernels::KvSpan{h * kPages + p, 0, kP, p * kP});
    }
    offsets.push_back(static_cast<int32_t>(via_cache.size()));
  }
  const int32_t q_pos = kPages * kP;
  auto attend = [&](kernels::TensorView k, kernels::TensorView v,
                    const std::vector<kernels::KvSpan>& spans, std::vector<float>* out) {
    std::vector<float> lse(q_heads);
    out->assign(q_heads * kD, 0);
    kernels::PagedAttentionParams a;
    a.q = kernels::TensorView(q.data(), kernels::DType::kF32, {1, q_heads, kD});
    a.k_pool = k;
    a.v_pool = v;
    a.spans = spans.data();
    a.span_offsets = offsets.data();
    a.num_kv_heads = kHeads;
    a.q_positions = &q_pos;
    a.scale = 0.25f;
    a.out = kernels::TensorView(out->data(), kernels::DType::kF32, {1, q_heads, kD});
    a.lse = kernels::TensorView(lse.data(), kernels::DType::kF32, {1, q_heads});
    ASSERT_TRUE(backend_->PagedAttention(a, nullptr).ok());
  };
  std::vector<float> out_cache, out_full;
  attend(c->k_pool(), c->v_pool(), via_cache, &out_cache);
  attend(kernels::TensorView(full_k.data(), kernels::DType::kBF16, {kHeads * kPages, kP, kD}),
         kernels::TensorView(full_v.data(), kernels::DType::kBF16, {kHeads * kPages, kP, kD}),
         via_full, &out_full);
  EXPECT_EQ(out_cache, out_full);
  float norm = 0;
  for (float x : out_full) norm += x * x;
  EXPECT_GT(norm, 0);
  STRATA_ASSERT_OK(c->Release(slots));
}

TEST_F(GpuCacheTest, PrefetchThreadRacesDecodeThread) {
  auto c = Make(12);
  ASSERT_NE(c, nullptr);
  std::atomic<bool> stop{false};
  std::thread prefetcher([&] {
    std::mt19937 rng(11);
    while (!stop.load()) {
      const std::vector<GpuPageId> want = RandomPages(rng, 5);
      EXPECT_TRUE(c->Prefetch(want).ok());
    }
  });
  std::mt19937 rng(5);
  std::vector<int32_t> slots;
  for (int step = 0; step < 300; ++step) {
    const std::vector<GpuPageId> want = RandomPages(rng, 6);
    const MissPolicy policy = step % 2 == 0 ? MissPolicy::kWait : MissPolicy::kDefer;
    STRATA_ASSERT_OK(c->Acquire(want, policy, &slots));
    for (size_t i = 0; i < want.size(); ++i) {
      if (slots[i] >= 0) ExpectSlotHolds(*c, slots[i], want[i]);
    }
    STRATA_ASSERT_OK(c->Release(slots));
  }
  stop.store(true);
  prefetcher.join();
  EXPECT_EQ(c->pinned_slots(), 0);
  ExpectConsistent(*c);
}

}  // namespace
}  // namespace strata::kvstore
