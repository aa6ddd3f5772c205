// Lazy mount of a READY document for sparse jobs (DESIGN.md section 4: "only summaries load,
// pages stream in as selected"), served through the GPU page cache (tier G).
//
// LazyDocumentAttention is a thin adapter that assembles the one page-cache mechanism of the
// engine for a worker job: an engine::GpuCacheAttention (engine/gpu_cache_attention.h) over a
// kvstore::GpuPageCache (kvstore/gpu_cache.h) on the job's own backend (CPU or CUDA), whose
// source is the worker's page store seen through a tier-counting adapter. It is an
// engine::ExternalAttention over the document's tokens [0, document_tokens) whose KV stays in the
// page store; the forward's own KvCache holds only the prompt and the generated tokens
// (ForwardOptions::cache_first_position = document_tokens), as for a sharded job.
//
// Selection: per layer and KV head, page 0, the last ceil(window / P) pages and the budget_pages
// other pages of highest head soft vote over the persisted minmax summaries (the rule of
// engine::MakeMinMaxChooser). On the CPU backend (the host path, GpuCacheAttention::Attend) the
// host MakeMinMaxChooser picks them. With the device path (default on any other backend) every
// call picks them with Backend::ScoreSummaries + VoteTopK over the layer's summaries held in
// backend memory (read from the store and uploaded on first use of the layer; one copy of the
// selection to the host); a call of several tokens (a prompt chunk) chooses once with the
// chunk's mean query, computed on the device (engine::DeviceQueryMean), as the host chooser does
// on the host. Attention: GpuCacheAttention (PagedAttention over the cache's
// bf16 slots, merged with the local attention by the transformer).
//
// Sharing (LazyAttentionOptions::share, WorkerOptions::lazy_shared_documents): the jobs on one
// document use one LazyDocumentShare for the layers' summaries in backend memory and the resident
// mode's device-managed cache; host-managed caches and the choosers' scratch are per job.
//
// Page cache: max(min(capacity_pages, every page of the document), one call's largest need =
// num_kv_heads * min(pages, 1 + budget_pages + window_pages)) slots (capacity_pages 0, the
// default: AutoCachePages), each one (layer, KV head,
// page) in bf16, clock eviction with pins (kvstore/gpu_cache.h). A capacity below one call's need
// is raised to it (a too-small capacity costs refetches, never correctness), so every call is one
// chunk (one partial). Misses are fetched in one batch per call from the store: through a
// kvstore::TieredStore the host tier is asked first and pages read from RocksDB / the remote KV
// store are inserted into the host tier (the TieredStore's rule); pages() counts them by the tier
// that served them. The cache's metrics (tier "gpu": lookups, hits, evictions, resident and
// capacity bytes, fetch bytes host -> gpu) go to `metrics` with gauges that add up over the
// caches alive at once.
//
// Resident mode (device-managed cache): with the device path, when the store is a
// kvstore::TieredStore whose host tier keeps its pages in a kvstore::BackendPageAllocator of the
// job's backend (pinned host memory on CUDA; cli/server_runtime.h sets this up) and holds every
// page of the document at Create (HostCache::PeekPages: counted nowhere, LRU untouched), the cache
// is device-managed (GpuCacheOptions::device_managed; it keeps references to the pages, so they
// stay alive for the job even if the tier evicts them): every layer's summaries are uploaded at
// Create, and each query token's selection (EnqueueMinMaxPageTopK), page-cache step
// (GpuPageCache::EnqueueResolve, fills copied by the device from the pinned pages) and
// SelectedAttention over the cache's table are queued on the device with nothing read on the
// host (CapturableOnDevice). A prompt chunk is chosen for once on the device (its mean query) and
// that selection serves all its tokens (GpuCacheAttentionOptions::chunk_selection). Otherwise (some page only on disk
// or remote, a CPU-memory host tier, the host path) the host-managed cache above. In resident
// mode pages().host counts the cache's fills (after SyncStats).
//
// Positions: page p holds positions [p * P, min((p + 1) * P, document_tokens)); every document
// token precedes the queries, so nothing is masked. Thread-compatible (one forward at a time).
#ifndef STRATA_WORKER_LAZY_ATTENTION_H_
#define STRATA_WORKER_LAZY_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_policy.h"
#include "engine/gpu_cache_attention.h"
#include "engine/selection_cache.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kvstore/document_id.h"
#include "kvstore/gpu_cache.h"
#include "kvstore/metrics.h"
#include "kvstore/page_store.h"
#include "kvstore/tiered_store.h"

namespace strata::worker {

// What the lazy jobs on one document share, kept by the worker between jobs
// (WorkerOptions::lazy_shared_documents): the minmax summaries read once from the store into host
// memory (engine::MinMaxSummaryCache, for the jobs' host choosers and the upload), the layers'
// summaries in backend memory (each uploaded on first use by any job) and, in resident mode, the
// device-managed page cache with its
// references to the document's host-tier pages, so that a later question on the document neither
// re-uploads summaries nor re-reads the page table, and finds the pages earlier questions left in
// the slots. Host-managed caches stay per job. Thread-safe (one mutex); jobs using it must
// serialize their backend work, as the worker's engine lock does.
class LazyDocumentShare {
 public:
  LazyDocumentShare();
  ~LazyDocumentShare();
  LazyDocumentShare(const LazyDocumentShare&) = delete;
  LazyDocumentShare& operator=(const LazyDocumentShare&) = delete;

  // True once a job made the share's device-managed cache.
  bool resident() const;
  // Backend memory it holds: the summaries loaded so far and the cache's slot pools.
  int64_t device_bytes() const;
  // Of which the summaries.
  int64_t summary_bytes() const;

  struct Impl;

 private:
  friend class LazyDocumentAttention;
  std::unique_ptr<Impl> impl_;
};

// The default page cache (LazyAttentionOptions::capacity_pages 0): the larger of
// kAutoCacheMinPages slots and kAutoCacheSteps decode steps' pages (num_layers calls of
// `per_call` pages each).
inline constexpr int64_t kAutoCacheSteps = 4;
inline constexpr int64_t kAutoCacheMinPages = 8192;
int64_t AutoCachePages(int num_layers, int64_t per_call);

struct LazyAttentionOptions {
  kvstore::PageStore* store = nullptr;  // not owned; a TieredStore counts pages per tier
  kvstore::DocumentId document;
  int64_t document_tokens = 0;  // > 0
  int page_size = 64;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  // Selection (see the file comment); summaries of kind summary_kind (minmax) in the store.
  uint32_t summary_kind = 1;
  int budget_pages = 32;  // >= 0
  int window_pages = 1;   // >= 0
  // Page-cache slots (one slot = one (layer, KV head, page)); 0 (default): AutoCachePages, at least
  // the pages of kAutoCacheSteps decode steps, so that a step's pages can still be resident at the
  // next steps whatever the model's size (the fixed 8192 of before session 7 is smaller than one
  // step of an 8B model: every page was refetched each step).
  int64_t capacity_pages = 0;
  // Where the cache's tier="gpu" metrics go; null: a private registry. Not owned.
  kvstore::KvMetrics* metrics = nullptr;
  // -1: the device path on a backend other than the CPU backend, the host path on it; 0: host
  // path; 1: device path (also on the CPU backend, whose selection ops are the reference twins).
  int device_path = -1;
  // -1: resident mode when possible (see the file comment); 0: never; 1: required
  // (FailedPrecondition from Create when it is not possible).
  int device_managed = -1;
  // Selection cache (TokenSelect's query-similarity reuse, engine/selection_cache.h): a one-token
  // choice whose group query has cosine >= cache_theta with the query a KV head last selected for
  // keeps that head's pages (the device chooser: DeviceSelectionCache; the host chooser:
  // MinMaxChooserOptions::cache_theta). Prompt chunks select without it and make the layer's next
  // one-token choice select. > 1 (the default): off. Lookups and hits go to counters() (the
  // device chooser's as of the last SyncStats).
  double cache_theta = 2.0;
  // The summaries the choosers score: f32 as persisted, or bf16 (the default) rounded outward
  // (kernels::MinMaxRowsToBF16: every bound still holds, a little more loosely), half the backend
  // memory and half the bytes each selection reads. The host chooser uses the same rounded
  // values (MinMaxSummaryCache bf16_bounds), so the host and device paths choose alike.
  kernels::DType summary_dtype = kernels::DType::kBF16;
  // State shared with the document's other jobs (see LazyDocumentShare); null: a private one.
  // InvalidArgument from Create when it was made for another document or shape.
  std::shared_ptr<LazyDocumentShare> share;
};

class LazyDocumentAttention : public engine::ExternalAttention {
 public:
  // InvalidArgument for a missing store or backend or non-positive sizes; errors of the cache's
  // allocations (ResourceExhausted).
  static absl::StatusOr<std::unique_ptr<LazyDocumentAttention>> Create(const LazyAttentionOptions& options,
                                                                      kernels::Backend* backend);
  ~LazyDocumentAttention() override;

  // InvalidArgument for a bad layer or head count or queries inside the document; DataLoss for a
  // page missing from the store; errors of the chooser, store, cache and backend are passed through.
  absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      std::vector<engine::AttentionPartial>* parts) override;
  bool AttendsOnDevice() const override;
  bool CapturableOnDevice() const override;
  absl::Status AttendOnDevice(int layer, const kernels::TensorView& q, int64_t q_begin,
                              const kernels::TensorView& out, const kernels::TensorView& lse) override;
  // Graph mode (resident mode only; Create has uploaded every layer's summaries): PrepareCapture
  // allocates the device chooser's buffers; OnReplayedStep counts a replayed one-token
  // step as AttendOnDevice counts one (counters(), device_choices()) for every layer.
  absl::Status PrepareCapture(int num_q_heads) override;
  void OnReplayedStep(int64_t q_begin) override;

  // Pages read from each tier (page-cache misses; resident mode: the fills from the host tier as
  // of the last SyncStats).
  const kvstore::TierCounts& pages() const;
  // Brings the device chooser's selection-cache counts in counters() up to date (waits for the
  // queued work); in resident mode also pages(), cache_hits(), cache_misses() and the cache's
  // metrics (GpuPageCache::SyncDeviceStats). Not during a graph capture.
  absl::Status SyncStats();
  // True in resident mode (a device-managed cache; see the file comment).
  bool device_managed() const;
  // Host time of Create after the checks: the residency check (one PeekPages per page), the
  // cache (resident mode: per-page addresses uploaded) and, in resident mode, the summaries.
  double setup_seconds() const;
  // Page-cache hits and misses over every call (GpuPageCache lookups - hits; resident mode: of the
  // share's cache since it was made).
  int64_t cache_hits() const;
  int64_t cache_misses() const;
  // candidate_tokens: document tokens per (call, KV head); selected_tokens: tokens attended.
  const engine::SelectionCounters& counters() const;
  // Slots in the page cache (see the file comment).
  int64_t slots() const;
  // One-token calls whose pages the backend chose (device path).
  int64_t device_choices() const;
  const kvstore::GpuPageCache& cache() const;

  struct State;  // the source adapter, choosers, cache and hook (lazy_attention.cc)

 private:
  explicit LazyDocumentAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_LAZY_ATTENTION_H_
