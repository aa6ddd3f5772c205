// Lazy mount of a READY document for sparse jobs (DESIGN.md section 4: "only summaries load,
// pages stream in as selected").
//
// LazyDocumentAttention is an engine::ExternalAttention over the document's tokens [0,
// document_tokens) whose KV stays in the page store. The forward's own KvCache holds only the
// prompt and the generated tokens (ForwardOptions::cache_first_position = document_tokens), as
// for a sharded job. Per layer and KV head, a PageChooser (worker.cc uses
// engine::MakeMinMaxChooser, which reads the persisted minmax summaries on first use of a
// (layer, KV head) and keeps them) picks the document pages to attend; the pages not resident in
// the bounded page cache are fetched from the store (through the tiers: TieredStore::GetPages
// with per-tier counts) in one batch per call, decoded to f32 into the cache's slots, and the
// chosen pages are attended with Backend::PagedAttention over the cache's pools (one partial per
// call). Nothing else of the document is read.
//
// Page cache: a fixed pool of capacity_pages slots (each one (layer, KV head, page): K and V,
// [page_size, head_dim] f32), least-recently-used eviction; pages are reused across layers'
// calls and decode steps. When one call needs more pages than the capacity, the pool grows to
// that call's need (so a too-small capacity costs memory, never correctness).
//
// Positions: page p holds positions [p * P, min((p + 1) * P, document_tokens)); every document
// token precedes the queries, so nothing is masked. The backend must read host memory (the CPU
// backend). Thread-compatible (one forward at a time).
#ifndef STRATA_WORKER_LAZY_ATTENTION_H_
#define STRATA_WORKER_LAZY_ATTENTION_H_

#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_policy.h"
#include "engine/gpu_cache_attention.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kvstore/document_id.h"
#include "kvstore/page_store.h"
#include "kvstore/tiered_store.h"

namespace strata::worker {

struct LazyAttentionOptions {
  kvstore::PageStore* store = nullptr;  // not owned; a TieredStore counts pages per tier
  kvstore::DocumentId document;
  int64_t document_tokens = 0;  // > 0
  int page_size = 64;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  engine::PageChooser chooser;  // required
  // Page-cache slots (one slot = one (layer, KV head, page)). Default 8192.
  int64_t capacity_pages = 8192;
};

class LazyDocumentAttention : public engine::ExternalAttention {
 public:
  // InvalidArgument for missing store/chooser/backend, non-positive sizes, or a backend that is
  // not the CPU backend.
  static absl::StatusOr<std::unique_ptr<LazyDocumentAttention>> Create(const LazyAttentionOptions& options,
                                                                      kernels::Backend* backend);

  // InvalidArgument for a bad layer or head count or queries inside the document; DataLoss for a
  // page missing from the store; errors of the chooser, store and backend are passed through.
  absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      std::vector<engine::AttentionPartial>* parts) override;

  // Pages read from each tier (page-cache misses).
  const kvstore::TierCounts& pages() const { return pages_; }
  // Page-cache hits and misses over every call.
  int64_t cache_hits() const { return hits_; }
  int64_t cache_misses() const { return misses_; }
  // candidate_tokens: document tokens per (call, KV head); selected_tokens: tokens attended.
  const engine::SelectionCounters& counters() const { return counters_; }
  // Slots in the page cache now (capacity_pages, or more after a call that needed more).
  int64_t slots() const { return slots_; }

 private:
  LazyDocumentAttention(const LazyAttentionOptions& options, kernels::Backend* backend)
      : options_(options), backend_(backend) {}
  // Makes sure every page of `keys` is resident; fills (*slots)[i] with the slot of keys[i].
  absl::Status Resident(const std::vector<kvstore::PageKey>& keys, std::vector<int32_t>* slots);

  const LazyAttentionOptions options_;
  kernels::Backend* const backend_;
  int64_t slots_ = 0;
  std::vector<float> k_pool_, v_pool_;  // [slots_, P, d]
  std::vector<int32_t> free_;           // unused slots
  struct Entry {
    int32_t slot;
    std::list<uint64_t>::iterator lru;
  };
  std::unordered_map<uint64_t, Entry> map_;  // (layer, head, page) -> slot
  std::list<uint64_t> lru_;                  // most recent first
  kvstore::TierCounts pages_;
  int64_t hits_ = 0, misses_ = 0;
  engine::SelectionCounters counters_;
  std::vector<int32_t> positions_;
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_LAZY_ATTENTION_H_
