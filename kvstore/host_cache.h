// Tier H: a byte-budgeted LRU cache of pages and summaries in host memory.
//
// Holds page PageRefs whose memory comes from the configured PageAllocator (the CUDA backend can
// pass a pinned-memory allocator, kvstore/backend_page_allocator.h); pages inserted from another
// allocator are copied (or, when the allocator fails, kept where they are). Summaries stay in the
// memory they arrive in (they are read by the host and uploaded whole, never read in place by the
// device, and are much smaller than the page blocks of such an allocator). Entries larger than
// the whole budget are not cached. Not durable: Put succeeds as soon as the entries are in
// memory. Counts lookups, hits, evictions and resident/capacity bytes under tier "host".
// Thread-safe (one mutex; the critical sections are hash-map and list operations). Standard
// library locks are used so that TSan sees them (Debian's Abseil is not TSan-instrumented).
#ifndef STRATA_KVSTORE_HOST_CACHE_H_
#define STRATA_KVSTORE_HOST_CACHE_H_

#include <array>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "kvstore/internal/keys.h"
#include "kvstore/metrics.h"
#include "kvstore/page_store.h"

namespace strata::kvstore {

struct HostCacheOptions {
  // Byte budget for cached page and summary bytes. Default: 1 GiB. Not reloadable.
  int64_t capacity_bytes = int64_t{1} << 30;
  // Where cached buffers live. Default (null): DefaultPageAllocator(). Not owned; must outlive
  // the cache.
  PageAllocator* allocator = nullptr;
  // Metrics sink. Default (null): a private registry. Not owned.
  KvMetrics* metrics = nullptr;

  absl::Status Validate() const;  // capacity_bytes > 0
};

class HostCache final : public PageStore {
 public:
  static absl::StatusOr<std::unique_ptr<HostCache>> Create(const HostCacheOptions& options);
  ~HostCache() override;

  const char* tier() const override { return "host"; }
  absl::Status GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) override;
  // Inserts (or refreshes) the entries, evicting least recently used ones to stay in budget. A
  // page the allocator cannot take (pinned memory can run out) is cached in the memory it arrived
  // in. InvalidArgument for a null entry.
  absl::Status Put(absl::Span<const PageWrite> pages,
                   absl::Span<const SummaryWrite> summaries) override;
  absl::Status GetSummaries(absl::Span<const SummaryKey> keys, std::vector<PageRef>* out) override;

  // The cached pages of `keys` (null where absent) without counting lookups or hits and without
  // refreshing their LRU positions: for a caller asking whether the tier holds a whole document
  // before deciding how to read it (worker/lazy_attention.h).
  void PeekPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) const;

  // Drops every entry of `document`.
  void EraseDocument(const DocumentId& document);

  int64_t resident_bytes() const;
  int64_t capacity_bytes() const { return options_.capacity_bytes; }
  // Where cached pages live (the option, or DefaultPageAllocator()).
  PageAllocator* allocator() const { return options_.allocator; }
  int64_t num_entries() const;

 private:
  explicit HostCache(const HostCacheOptions& options);
  // A page's or summary's key in the map: a tag byte ('p' / 's'), then the store's key bytes
  // (kvstore/internal/keys.h), in a fixed array (no allocation per lookup).
  struct Key {
    std::array<uint8_t, 1 + internal::kSummaryKeySize> bytes{};
    bool operator==(const Key& o) const { return bytes == o.bytes; }
    template <typename H>
    friend H AbslHashValue(H h, const Key& k) {
      return H::combine_contiguous(std::move(h), k.bytes.data(), k.bytes.size());
    }
  };
  static Key PageCacheKey(const PageKey& k);
  static Key SummaryCacheKey(const SummaryKey& k);
  // Inserts `data`, copied into `allocator` memory unless it is already there (null: kept as is).
  absl::Status Insert(const Key& key, const DocumentId& doc, const PageRef& data,
                      PageAllocator* allocator);
  void Lookup(const std::vector<Key>& keys, std::vector<PageRef>* out);

  struct Entry {
    Key key;
    DocumentId document;
    PageRef data;
  };
  using Lru = std::list<Entry>;  // front = most recently used

  HostCacheOptions options_;
  std::unique_ptr<prometheus::Registry> own_registry_;
  std::unique_ptr<KvMetrics> own_metrics_;
  TierMetrics m_;

  mutable std::mutex mu_;
  Lru lru_;                                               // guarded by mu_
  absl::flat_hash_map<Key, Lru::iterator> map_;  // guarded by mu_
  int64_t resident_ = 0;                                  // guarded by mu_
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_HOST_CACHE_H_
