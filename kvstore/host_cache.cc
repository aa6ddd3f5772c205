#include "kvstore/host_cache.h"

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "kvstore/internal/keys.h"

namespace strata::kvstore {
HostCache::Key HostCache::PageCacheKey(const PageKey& k) {
  Key key;
  key.bytes[0] = 'p';
  internal::WritePageKey(k, &key.bytes[1]);
  return key;
}

HostCache::Key HostCache::SummaryCacheKey(const SummaryKey& k) {
  Key key;
  key.bytes[0] = 's';
  internal::WriteSummaryKey(k, &key.bytes[1]);
  return key;
}

absl::Status HostCacheOptions::Validate() const {
  if (capacity_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host cache capacity_bytes must be > 0, got ", capacity_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostCache>> HostCache::Create(const HostCacheOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::unique_ptr<HostCache>(new HostCache(options));
}

HostCache::HostCache(const HostCacheOptions& options) : options_(options) {
  if (options_.allocator == nullptr) options_.allocator = DefaultPageAllocator();
  KvMetrics* metrics = options_.metrics;
  if (metrics == nullptr) {
    own_registry_ = std::make_unique<prometheus::Registry>();
    own_metrics_ = std::make_unique<KvMetrics>(own_registry_.get());
    metrics = own_metrics_.get();
  }
  m_ = metrics->ForTier("host");
  m_.capacity_bytes->Set(static_cast<double>(options_.capacity_bytes));
}

HostCache::~HostCache() {
  std::lock_guard<std::mutex> lock(mu_);
  m_.resident_bytes->Set(0);
}

void HostCache::Lookup(const std::vector<Key>& keys, std::vector<PageRef>* out) {
  Stopwatch watch;
  out->assign(keys.size(), nullptr);
  int64_t hits = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = map_.find(keys[i]);
      if (it == map_.end()) continue;
      lru_.splice(lru_.begin(), lru_, it->second);
      (*out)[i] = it->second->data;
      ++hits;
    }
  }
  m_.lookups->Increment(static_cast<double>(keys.size()));
  m_.hits->Increment(static_cast<double>(hits));
  m_.fetch_duration->Observe(watch.ElapsedSeconds());
}

absl::Status HostCache::GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) {
  std::vector<Key> k;
  k.reserve(keys.size());
  for (const PageKey& key : keys) k.push_back(PageCacheKey(key));
  Lookup(k, out);
  return absl::OkStatus();
}

absl::Status HostCache::GetSummaries(absl::Span<const SummaryKey> keys,
                                     std::vector<PageRef>* out) {
  std::vector<Key> k;
  k.reserve(keys.size());
  for (const SummaryKey& key : keys) k.push_back(SummaryCacheKey(key));
  Lookup(k, out);
  return absl::OkStatus();
}

void HostCache::PeekPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) const {
  out->assign(keys.size(), nullptr);
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = map_.find(PageCacheKey(keys[i]));
    if (it != map_.end()) (*out)[i] = it->second->data;
  }
}

absl::Status HostCache::Insert(const Key& key, const DocumentId& doc, const PageRef& data,
                               PageAllocator* allocator) {
  if (data == nullptr) return absl::InvalidArgumentError("host cache: null page");
  const int64_t size = static_cast<int64_t>(data->size());
  if (size > options_.capacity_bytes) return absl::OkStatus();  // never fits; not cached
  PageRef ref = data;
  if (allocator != nullptr && data->allocator() != allocator) {
    // When the allocator fails (pinned memory can run out), the page stays in the memory it
    // arrived in: still cached, only not readable in place by a device.
    absl::StatusOr<PageRef> copy = PageBuffer::Copy(data->view(), allocator);
    if (copy.ok()) ref = *std::move(copy);
  }
  std::vector<PageRef> evicted;  // released outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it != map_.end()) {
    resident_ -= static_cast<int64_t>(it->second->data->size());
    evicted.push_back(std::move(it->second->data));
    lru_.erase(it->second);
    map_.erase(it);
  }
  int64_t evictions = 0;
  while (resident_ + size > options_.capacity_bytes && !lru_.empty()) {
    Entry& victim = lru_.back();
    resident_ -= static_cast<int64_t>(victim.data->size());
    evicted.push_back(std::move(victim.data));
    map_.erase(victim.key);
    lru_.pop_back();
    ++evictions;
  }
  lru_.push_front(Entry{key, doc, std::move(ref)});
  map_.emplace(key, lru_.begin());
  resident_ += size;
  m_.evictions->Increment(static_cast<double>(evictions));
  m_.resident_bytes->Set(static_cast<double>(resident_));
  return absl::OkStatus();
}

absl::Status HostCache::Put(absl::Span<const PageWrite> pages,
                            absl::Span<const SummaryWrite> summaries) {
  for (const PageWrite& w : pages) {
    if (absl::Status s = Insert(PageCacheKey(w.key), w.key.document, w.data, options_.allocator);
        !s.ok()) {
      return s;
    }
  }
  for (const SummaryWrite& w : summaries) {
    if (absl::Status s = Insert(SummaryCacheKey(w.key), w.key.document, w.data, nullptr); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

void HostCache::EraseDocument(const DocumentId& document) {
  std::vector<PageRef> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = lru_.begin(); it != lru_.end();) {
    if (it->document != document) {
      ++it;
      continue;
    }
    resident_ -= static_cast<int64_t>(it->data->size());
    dropped.push_back(std::move(it->data));
    map_.erase(it->key);
    it = lru_.erase(it);
  }
  m_.resident_bytes->Set(static_cast<double>(resident_));
}

int64_t HostCache::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resident_;
}

int64_t HostCache::num_entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(map_.size());
}

}  // namespace strata::kvstore
