// The tiered page store: a host cache in front of the durable tiers (DESIGN.md section 4).
//
// Reads go host -> local (RocksDB) -> remote (KV store service): each tier is asked only for
// what the tiers before it missed, and pages found below the host tier are inserted into the
// host cache (fetch bytes counted src=<tier>, dst=host). A key no tier holds stays null.
// Writes go to every durable tier configured (local and/or remote) and return once all of them
// acknowledged the batch durable (PutDeferred: acknowledged it, durable at FinalizeDocument; see
// PageStore); only then are the pages inserted into the host cache. Any tier may be absent (null),
// but at least one must be set.
//
// Thread-safe when its tiers are (all of ours are). The tiers are not owned.
#ifndef STRATA_KVSTORE_TIERED_STORE_H_
#define STRATA_KVSTORE_TIERED_STORE_H_

#include <memory>
#include <vector>

#include "kvstore/host_cache.h"
#include "kvstore/page_store.h"

namespace strata::kvstore {

struct TieredStoreOptions {
  HostCache* host = nullptr;    // tier H; optional
  PageStore* local = nullptr;   // tier D (LocalStore); optional
  PageStore* remote = nullptr;  // tier R (RemoteStore); optional

  absl::Status Validate() const;  // at least one tier
};

// Where the pages of one read came from.
struct TierCounts {
  int64_t host = 0;
  int64_t local = 0;
  int64_t remote = 0;
};

class TieredStore final : public PageStore {
 public:
  static absl::StatusOr<std::unique_ptr<TieredStore>> Create(const TieredStoreOptions& options);

  const char* tier() const override { return "tiered"; }
  // Errors of a tier (e.g. DataLoss from a corrupt local page, Unavailable from the service)
  // fail the call.
  absl::Status GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) override;
  // GetPages that also adds to `counts` how many pages each tier served (for per-job usage) and,
  // with `fill_host` false, leaves the host cache as it was: a bulk load whose pages go on to a
  // cache of their own (a shard's mount) would otherwise flood tier H and evict what it held.
  absl::Status GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out,
                        TierCounts* counts, bool fill_host = true);
  absl::Status Put(absl::Span<const PageWrite> pages,
                   absl::Span<const SummaryWrite> summaries) override;
  absl::Status PutDeferred(absl::Span<const PageWrite> pages,
                           absl::Span<const SummaryWrite> summaries) override;
  absl::Status GetSummaries(absl::Span<const SummaryKey> keys, std::vector<PageRef>* out) override;

  // Tier H, or null.
  HostCache* host() const { return options_.host; }

 private:
  explicit TieredStore(const TieredStoreOptions& options) : options_(options) {}
  absl::Status Write(absl::Span<const PageWrite> pages, absl::Span<const SummaryWrite> summaries,
                     bool deferred);
  template <typename Key, typename Write>
  absl::Status Get(absl::Span<const Key> keys, std::vector<PageRef>* out,
                   absl::Status (PageStore::*get)(absl::Span<const Key>, std::vector<PageRef>*),
                   TierCounts* counts, bool fill_host = true);

  TieredStoreOptions options_;
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_TIERED_STORE_H_
