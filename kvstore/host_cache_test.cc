#include "kvstore/host_cache.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"

namespace strata::kvstore {
namespace {

PageKey Key(uint32_t page, uint8_t doc = 1) {
  PageKey k;
  k.document.bytes[0] = doc;
  k.page_index = page;
  return k;
}

PageRef Buf(size_t n, char c) { return *PageBuffer::Copy(std::string(n, c)); }

class CountingAllocator final : public PageAllocator {
 public:
  void* Allocate(size_t bytes) override {
    live_.fetch_add(static_cast<int64_t>(bytes));
    return new char[bytes];
  }
  void Free(void* p, size_t bytes) override {
    live_.fetch_sub(static_cast<int64_t>(bytes));
    delete[] static_cast<char*>(p);
  }
  int64_t live() const { return live_.load(); }

 private:
  std::atomic<int64_t> live_{0};
};

double Value(prometheus::Registry& r, const std::string& name, const std::string& tier) {
  for (const auto& fam : r.Collect()) {
    if (fam.name != name) continue;
    for (const auto& m : fam.metric) {
      for (const auto& l : m.label) {
        if (l.name == "tier" && l.value == tier) {
          return fam.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
        }
      }
    }
  }
  return -1;
}

TEST(HostCacheTest, EvictsLeastRecentlyUsedWithinByteBudget) {
  prometheus::Registry registry;
  KvMetrics metrics(&registry);
  HostCacheOptions o;
  o.capacity_bytes = 300;
  o.metrics = &metrics;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(100, 'a')}, PageWrite{Key(1), Buf(100, 'b')},
                               PageWrite{Key(2), Buf(100, 'c')}},
                              {}));
  EXPECT_EQ(cache->resident_bytes(), 300);
  std::vector<PageRef> out;
  const std::vector<PageKey> touch = {Key(0)};
  STRATA_ASSERT_OK(cache->GetPages(touch, &out));  // 0 becomes most recent; 1 is the LRU
  ASSERT_NE(out[0], nullptr);
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(3), Buf(100, 'd')}}, {}));
  const std::vector<PageKey> all = {Key(0), Key(1), Key(2), Key(3)};
  STRATA_ASSERT_OK(cache->GetPages(all, &out));
  EXPECT_NE(out[0], nullptr);
  EXPECT_EQ(out[1], nullptr);
  EXPECT_NE(out[2], nullptr);
  ASSERT_NE(out[3], nullptr);
  EXPECT_EQ(out[3]->view(), std::string(100, 'd'));
  EXPECT_EQ(cache->resident_bytes(), 300);
  EXPECT_EQ(Value(registry, "strata_kv_lookups_total", "host"), 5);
  EXPECT_EQ(Value(registry, "strata_kv_hits_total", "host"), 4);
  EXPECT_EQ(Value(registry, "strata_kv_evictions_total", "host"), 1);
  EXPECT_EQ(Value(registry, "strata_kv_resident_bytes", "host"), 300);
  EXPECT_EQ(Value(registry, "strata_kv_capacity_bytes", "host"), 300);
}

TEST(HostCacheTest, OversizedEntryIsNotCachedAndReplacementKeepsAccounting) {
  HostCacheOptions o;
  o.capacity_bytes = 100;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(101, 'a')}}, {}));
  EXPECT_EQ(cache->num_entries(), 0);
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(60, 'a')}}, {}));
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(40, 'b')}}, {}));
  EXPECT_EQ(cache->resident_bytes(), 40);
  EXPECT_EQ(cache->num_entries(), 1);
  SummaryKey sk;
  sk.document = Key(0).document;
  sk.kind = 2;
  STRATA_ASSERT_OK(cache->Put({}, {SummaryWrite{sk, Buf(10, 's')}}));
  std::vector<PageRef> out;
  const std::vector<SummaryKey> keys = {sk};
  STRATA_ASSERT_OK(cache->GetSummaries(keys, &out));
  ASSERT_NE(out[0], nullptr);
  EXPECT_EQ(out[0]->view(), "ssssssssss");
  cache->EraseDocument(Key(0).document);
  EXPECT_EQ(cache->resident_bytes(), 0);
  EXPECT_EQ(cache->num_entries(), 0);
}

TEST(HostCacheTest, UsesItsAllocatorAndFreesEverything) {
  CountingAllocator alloc;
  {
    HostCacheOptions o;
    o.capacity_bytes = 1000;
    o.allocator = &alloc;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
    STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(100, 'a')}}, {}));  // copied into alloc
    EXPECT_EQ(alloc.live(), 100);
    std::vector<PageRef> out;
    const std::vector<PageKey> keys = {Key(0)};
    STRATA_ASSERT_OK(cache->GetPages(keys, &out));
    EXPECT_EQ(out[0]->allocator(), &alloc);
  }
  EXPECT_EQ(alloc.live(), 0);
}

class FailingAllocator final : public PageAllocator {
 public:
  void* Allocate(size_t) override { return nullptr; }
  void Free(void*, size_t) override {}
};

// An adopted page (PageBuffer::Adopt: a received message's bytes, no allocator) holds the very
// bytes it was given; a cache with an allocator copies it into its own memory.
TEST(HostCacheTest, AdoptedPagesKeepTheirBytesAndAreCopiedIn) {
  std::string bytes(300, 'z');
  bytes[7] = 'q';
  const char* where = bytes.data();
  const PageRef adopted = PageBuffer::Adopt(std::move(bytes));
  EXPECT_EQ(adopted->data(), where);  // not copied
  EXPECT_EQ(adopted->size(), 300u);
  EXPECT_EQ(adopted->view()[7], 'q');
  EXPECT_EQ(adopted->allocator(), nullptr);
  CountingAllocator alloc;
  {
    HostCacheOptions o;
    o.capacity_bytes = 1000;
    o.allocator = &alloc;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
    STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), adopted}}, {}));
    EXPECT_EQ(alloc.live(), 300);
    std::vector<PageRef> out;
    const std::vector<PageKey> keys = {Key(0)};
    STRATA_ASSERT_OK(cache->GetPages(keys, &out));
    EXPECT_EQ(out[0]->allocator(), &alloc);
    EXPECT_EQ(out[0]->view(), adopted->view());
  }
  EXPECT_EQ(alloc.live(), 0);
}

TEST(HostCacheTest, SummariesKeepTheirMemoryAndAFailingAllocatorStillCaches) {
  CountingAllocator alloc;
  {
    HostCacheOptions o;
    o.allocator = &alloc;
    STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
    SummaryKey sk;
    sk.document = Key(0).document;
    STRATA_ASSERT_OK(cache->Put({}, {SummaryWrite{sk, Buf(64, 's')}}));
    EXPECT_EQ(alloc.live(), 0);  // summaries are not copied into the page allocator
    std::vector<PageRef> out;
    const std::vector<SummaryKey> keys = {sk};
    STRATA_ASSERT_OK(cache->GetSummaries(keys, &out));
    ASSERT_NE(out[0], nullptr);
    EXPECT_EQ(out[0]->view(), std::string(64, 's'));
  }
  FailingAllocator failing;
  HostCacheOptions o;
  o.allocator = &failing;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(100, 'a')}}, {}));
  std::vector<PageRef> out;
  const std::vector<PageKey> keys = {Key(0)};
  STRATA_ASSERT_OK(cache->GetPages(keys, &out));
  ASSERT_NE(out[0], nullptr);
  EXPECT_NE(out[0]->allocator(), &failing);
  EXPECT_EQ(out[0]->view(), std::string(100, 'a'));
}

TEST(HostCacheTest, PeekPagesCountsNothingAndKeepsTheLruOrder) {
  prometheus::Registry registry;
  KvMetrics metrics(&registry);
  HostCacheOptions o;
  o.capacity_bytes = 200;
  o.metrics = &metrics;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(0), Buf(100, 'a')}}, {}));
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(1), Buf(100, 'b')}}, {}));
  std::vector<PageRef> out;
  const std::vector<PageKey> keys = {Key(0), Key(2), Key(1)};
  cache->PeekPages(keys, &out);
  ASSERT_EQ(out.size(), 3u);
  ASSERT_NE(out[0], nullptr);
  EXPECT_EQ(out[0]->view(), std::string(100, 'a'));
  EXPECT_EQ(out[1], nullptr);
  ASSERT_NE(out[2], nullptr);
  EXPECT_EQ(Value(registry, "strata_kv_lookups_total", "host"), 0);
  EXPECT_EQ(Value(registry, "strata_kv_hits_total", "host"), 0);
  // Page 0 is still the least recently used: a third page evicts it, not page 1.
  STRATA_ASSERT_OK(cache->Put({PageWrite{Key(2), Buf(100, 'c')}}, {}));
  cache->PeekPages(keys, &out);
  EXPECT_EQ(out[0], nullptr);
  EXPECT_NE(out[1], nullptr);
  EXPECT_NE(out[2], nullptr);
}

TEST(HostCacheTest, ConcurrentGetAndPutStayWithinBudget) {
  HostCacheOptions o;
  o.capacity_bytes = 64 * 100;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache, HostCache::Create(o));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, t] {
      std::vector<PageRef> out;
      for (uint32_t i = 0; i < 2000; ++i) {
        const PageKey k = Key(i % 200, static_cast<uint8_t>(t));
        if (i % 2 == 0) {
          ASSERT_TRUE(cache->Put({PageWrite{k, Buf(100, static_cast<char>('a' + t))}}, {}).ok());
        } else {
          const std::vector<PageKey> keys = {k};
          ASSERT_TRUE(cache->GetPages(keys, &out).ok());
          if (out[0] != nullptr) {
            ASSERT_EQ(out[0]->view()[0], static_cast<char>('a' + t));
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(cache->resident_bytes(), o.capacity_bytes);
  EXPECT_EQ(cache->resident_bytes(), cache->num_entries() * 100);
}

}  // namespace
}  // namespace strata::kvstore
