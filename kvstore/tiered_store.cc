#include "kvstore/tiered_store.h"

namespace strata::kvstore {
namespace {

PageWrite MakeWrite(const PageKey& k, PageRef d) { return PageWrite{k, std::move(d)}; }
SummaryWrite MakeWrite(const SummaryKey& k, PageRef d) { return SummaryWrite{k, std::move(d)}; }

absl::Status FillHost(HostCache* host, const std::vector<PageWrite>& w) { return host->Put(w, {}); }
absl::Status FillHost(HostCache* host, const std::vector<SummaryWrite>& w) {
  return host->Put({}, w);
}

}  // namespace

absl::Status TieredStoreOptions::Validate() const {
  if (host == nullptr && local == nullptr && remote == nullptr) {
    return absl::InvalidArgumentError("tiered store: no tier configured");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TieredStore>> TieredStore::Create(
    const TieredStoreOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::unique_ptr<TieredStore>(new TieredStore(options));
}

template <typename Key, typename Write>
absl::Status TieredStore::Get(absl::Span<const Key> keys, std::vector<PageRef>* out,
                              absl::Status (PageStore::*get)(absl::Span<const Key>,
                                                             std::vector<PageRef>*),
                              TierCounts* counts, bool fill_host) {
  out->assign(keys.size(), nullptr);
  std::vector<size_t> missing(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) missing[i] = i;
  PageStore* tiers[3] = {options_.host, options_.local, options_.remote};
  int64_t served[3] = {0, 0, 0};
  std::vector<Write> fill;
  for (int t = 0; t < 3; ++t) {
    PageStore* tier = tiers[t];
    if (tier == nullptr || missing.empty()) continue;
    std::vector<Key> ask;
    ask.reserve(missing.size());
    for (size_t i : missing) ask.push_back(keys[i]);
    std::vector<PageRef> got;
    if (absl::Status s = (tier->*get)(ask, &got); !s.ok()) {
      out->assign(keys.size(), nullptr);
      return s;
    }
    std::vector<size_t> still;
    for (size_t j = 0; j < ask.size(); ++j) {
      if (got[j] == nullptr) {
        still.push_back(missing[j]);
        continue;
      }
      (*out)[missing[j]] = got[j];
      ++served[t];
      if (fill_host && tier != options_.host && options_.host != nullptr) {
        fill.push_back(MakeWrite(ask[j], got[j]));
      }
    }
    missing = std::move(still);
  }
  if (!fill.empty()) {
    // The host cache only fails when its allocator does; the pages are still returned.
    FillHost(options_.host, fill).IgnoreError();
  }
  if (counts != nullptr) {
    counts->host += served[0];
    counts->local += served[1];
    counts->remote += served[2];
  }
  return absl::OkStatus();
}

absl::Status TieredStore::GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) {
  return Get<PageKey, PageWrite>(keys, out, &PageStore::GetPages, nullptr);
}

absl::Status TieredStore::GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out,
                                   TierCounts* counts, bool fill_host) {
  return Get<PageKey, PageWrite>(keys, out, &PageStore::GetPages, counts, fill_host);
}

absl::Status TieredStore::GetSummaries(absl::Span<const SummaryKey> keys,
                                       std::vector<PageRef>* out) {
  return Get<SummaryKey, SummaryWrite>(keys, out, &PageStore::GetSummaries, nullptr);
}

absl::Status TieredStore::Put(absl::Span<const PageWrite> pages,
                              absl::Span<const SummaryWrite> summaries) {
  return Write(pages, summaries, /*deferred=*/false);
}

absl::Status TieredStore::PutDeferred(absl::Span<const PageWrite> pages,
                                      absl::Span<const SummaryWrite> summaries) {
  return Write(pages, summaries, /*deferred=*/true);
}

absl::Status TieredStore::Write(absl::Span<const PageWrite> pages,
                                absl::Span<const SummaryWrite> summaries, bool deferred) {
  for (PageStore* tier : {options_.local, options_.remote}) {
    if (tier == nullptr) continue;
    absl::Status s = deferred ? tier->PutDeferred(pages, summaries) : tier->Put(pages, summaries);
    if (!s.ok()) return s;
  }
  if (options_.host != nullptr) return options_.host->Put(pages, summaries);
  return absl::OkStatus();
}

}  // namespace strata::kvstore
