// Tier G: the GPU page cache (DESIGN.md section 4). A fixed pool of page slots in backend memory
// holding the pages of one document selected recently, a page table that the attention kernels
// can read on the device, clock eviction with pins for the pages of the current step, and batched
// fills of missed pages from the host tier.
//
// Slots: `num_slots` slots of one page each, in the engine's KvCache slot layout:
// k_pool() / v_pool() are [num_slots, page_size, head_dim] bf16, so a KvSpan's `slot` may name a
// cache slot directly (kernels::PagedAttentionParams).
// Page table: page (layer, kv_head, page) has the flat index
// (layer * num_kv_heads + kv_head) * pages_per_head + page; the host keeps table[index] = slot or
// -1 and mirrors it into device_table() ([num_layers * num_kv_heads * pages_per_head] int32 in
// backend memory). The device copy is updated by the same stream-ordered op that fills the slots,
// after the page bytes, so a device reader that sees a slot sees its bytes.
//
// Eviction (exact, so tests can predict it): a slot that was never used is taken first, lowest
// slot number first. When none is left, a clock hand sweeps the slots from where it stopped: a
// pinned slot is skipped; a slot with its reference bit set has it cleared and is passed; the
// first unpinned slot with a clear bit is the victim (the hand stops just past it). Hits and fills
// set the reference bit. At most two sweeps; when every slot is pinned there is no victim.
//
// Fills: the misses of a call are looked up in `source` (the host tier; pages in the page_format
// encoding, bf16, this page_size and head_dim), their K and V bytes gathered into a staging buffer
// from Backend::AllocateHost (pinned on CUDA) -- or, for pages held in `in_place_allocator`
// memory, read where they lie -- and copied into their slots with one Backend::PageCopy on
// `stream` (batches of at most max_batch_pages; two staging buffers used in
// turn, one reused only after the copy out of it has completed). The copy is asynchronous; a call
// that hands out a slot whose fill may still be in flight first waits for `stream`.
//
// Miss policy per call (DESIGN.md section 4): kWait fills every miss before returning (exact);
// kOrdered hands out a slot for every page like kWait (exact) but returns as soon as the fills are
// queued on `stream`, for readers queued on `stream` after the call (stream order makes them see
// the bytes; no host wait); kDefer returns -1 for misses and issues their fills without waiting
// (best effort: as many as there are unpinned slots), so the next step finds them. Prefetch() issues the fills of a
// selection (e.g. step t's, as the guess for step t+1) without pinning or counting lookups.
//
// Metrics (kvstore/metrics.h, tier="gpu"): lookups and hits (pages asked for by Acquire, not by
// Prefetch), evictions, resident and capacity bytes (K+V bytes of used slots / all slots),
// fetch duration (one Acquire that filled pages with kWait, including the wait), and
// strata_kv_fetch_bytes_total{src="host",dst="gpu"} (bytes filled).
//
// Device-managed mode (GpuCacheOptions::device_managed): the clock, pins, page table and counters
// live in backend memory and EnqueueResolve makes a selection's pages resident with one
// stream-ordered op (Backend::ResolvePages): the misses are read by the device from the host
// tier's pinned pages in place, nothing waits on the host and the call can be captured in a CUDA
// graph with the attention that reads the slots. The host-side Acquire / Release / Prefetch /
// SlotOf are then FailedPrecondition; stats(), the metrics and resident_pages() follow the device
// counters as of the last SyncDeviceStats().
//
// Not yet: one cache serves one document (a worker with several documents needs one per document
// or a shared pool); a host-managed cache dequantises each fp8 page it fetches into a bf16 page
// (host work and a copy, bf16 bytes over PCIe, never read in place; a device-managed one keeps
// them as fp8 with per-slot scales);
// waits are host-side Synchronize calls on `stream` (no events between streams).
//
// Thread-safe: every method takes one mutex, and backend calls are made under it (so one thread
// may prefetch while another acquires). The backend must not be used concurrently by others
// without the synchronisation kernels/backend.h asks for.
#ifndef STRATA_KVSTORE_GPU_CACHE_H_
#define STRATA_KVSTORE_GPU_CACHE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kvstore/document_id.h"
#include "kvstore/metrics.h"
#include "kvstore/page_store.h"

namespace strata::kvstore {

struct GpuCacheOptions {
  DocumentId document;        // whose pages; the key of every source lookup
  int num_layers = 0;         // > 0
  int num_kv_heads = 0;       // > 0
  int64_t pages_per_head = 0; // > 0; pages per (layer, kv head); table entries < 2^31 in all
  int page_size = 64;         // P
  int head_dim = 128;         // d
  int64_t num_slots = 0;      // > 0, < 2^31
  // Most pages one PageCopy fills (size of each of the two staging buffers). Default: 1024.
  int max_batch_pages = 1024;
  PageStore* source = nullptr;  // the host tier; not owned; required
  // Pages whose buffer came from this allocator are read in place by the fill op instead of being
  // gathered into staging. It must hand out AllocateHost memory of the cache's backend
  // (BackendPageAllocator, kvstore/backend_page_allocator.h). Default (null): gather every page.
  PageAllocator* in_place_allocator = nullptr;
  // Opt-in, for a document held whole in the host tier: Create looks every page up in `source`
  // once (and checks it) and the cache keeps the references, so a miss costs no source lookup or
  // page check. The pages then stay alive while the cache lives even if the source evicts them,
  // and later changes to the source are not seen. Create fails (NotFound, ...) when a page is
  // missing. Memory: one PageRef (16 bytes) per page. Default: false (look misses up per call).
  bool hold_source_pages = false;
  KvMetrics* metrics = nullptr; // default (null): a private registry; not owned
  // For several caches sharing `metrics` (e.g. one per worker job): the resident and capacity
  // gauges are changed by this cache's own amounts (added at Create and as pages come and go,
  // taken back when the cache is destroyed), so they read the sum over the caches alive.
  // Default: false (the gauges are set to this cache's values).
  bool additive_gauges = false;
  kernels::Stream stream = nullptr;  // where fills run (nullptr: the backend's default)
  // Device-managed mode (see the file comment). The pools take the pages' dtype: bf16, or fp8
  // e4m3 with each page's scales kept per slot (slot_scales()). Needs hold_source_pages and
  // in_place_allocator, every page of the document allocated by it (so that the device can read
  // it in place) and, when a page half is a multiple of 16 bytes, 16-byte aligned page bytes:
  // Create fails (FailedPrecondition) otherwise. Costs 13 bytes per slot and 8 per page of
  // backend memory (fp8: 8 more per slot and per page for the scales).
  bool device_managed = false;

  absl::Status Validate() const;
};

// A page of the document: (layer, kv head, page index).
struct GpuPageId {
  int32_t layer = 0;
  int32_t kv_head = 0;
  int32_t page = 0;
};

enum class MissPolicy {
  kWait,   // exact: every page is resident when Acquire returns
  // Exact, stream-ordered: every page has a slot when Acquire returns, but its fill (or an
  // earlier prefetch it hits) may still be in flight on `stream`: only work queued on `stream`
  // after the call may read the slots (and Release may follow right after queuing that work).
  kOrdered,
  kDefer,  // misses get slot -1 and are fetched for the next step
};

// Running totals since Create (also what the metrics count), for tests and benchmarks.
struct GpuCacheStats {
  int64_t lookups = 0;
  int64_t hits = 0;
  int64_t evictions = 0;
  int64_t fills = 0;          // pages copied into slots (Acquire and Prefetch)
  int64_t fill_bytes = 0;     // K+V bytes of those pages
  int64_t fill_batches = 0;   // PageCopy calls
  int64_t in_place = 0;       // filled pages read in place (not gathered into staging)
  double gather_seconds = 0;  // host time: source lookups, checks, gathering into staging
  double source_seconds = 0;  // of which: the source lookups and page checks (FetchFromSource)
  double wait_seconds = 0;    // host time blocked in Synchronize(stream)
  double copy_seconds = 0;    // host time in Backend::PageCopy calls (checks and launch)
};

class GpuPageCache {
 public:
  // ResourceExhausted when the pools, table or staging do not fit; InvalidArgument for bad
  // options. `backend` is not owned and must outlive the cache.
  static absl::StatusOr<std::unique_ptr<GpuPageCache>> Create(const GpuCacheOptions& options,
                                                              kernels::Backend* backend);
  ~GpuPageCache();
  GpuPageCache(const GpuPageCache&) = delete;
  GpuPageCache& operator=(const GpuPageCache&) = delete;

  // The pages of one step: (*slots)[i] is the slot holding pages[i], pinned until Release(*slots),
  // or -1 (kDefer) for a miss whose fill was issued (or skipped, if no slot was free). A page
  // listed twice is pinned twice. Counts one lookup per entry.
  // Errors leave pins and residency as they were: InvalidArgument (page out of range),
  // ResourceExhausted (kWait, more distinct misses than unpinned slots), NotFound (a missed page
  // is not in the source), FailedPrecondition (a source page of another shape), Unimplemented (a
  // page dtype other than bf16 / fp8), or the source's and backend's errors.
  absl::Status Acquire(absl::Span<const GpuPageId> pages, MissPolicy policy,
                       std::vector<int32_t>* slots);

  // Unpins the slots an Acquire returned (entries < 0 are ignored). InvalidArgument, with nothing
  // unpinned, when a slot is out of range or would be unpinned more often than it was pinned.
  // An unpinned slot may be refilled by the next fill on `stream`: release only after the work
  // reading it has completed, or when that work is on `stream` itself (stream order protects it).
  absl::Status Release(absl::Span<const int32_t> slots);

  // Issues the fills of the listed pages that are not resident, without waiting, pinning or
  // counting lookups; best effort when slots run out. *issued (optional) receives the number of
  // pages whose fill was issued. Errors as Acquire (InvalidArgument, NotFound, ...).
  absl::Status Prefetch(absl::Span<const GpuPageId> pages, int64_t* issued = nullptr);

  // Waits until every issued fill has landed.
  absl::Status WaitForFills();

  // Device-managed mode: queues on `stream` the op that makes resident, for every KV head of
  // `layer`, the pages of the tokens a SelectedAttention over the same prefix_end / middle /
  // suffix attends (Backend::ResolvePages; the middle's parents, if any, are read on the device
  // when the op runs). A SelectedAttention queued after it on `stream`, over k_pool(), v_pool() and
  // the layer's rows of device_table() ([num_kv_heads, pages_per_head] from
  // device_table() + layer * num_kv_heads * pages_per_head), reads every such page. Each call
  // pins its own pages only (against its own evictions); the slots of earlier calls may be
  // refilled by later ones, so queue the reading attention before the next call, on `stream`.
  // FailedPrecondition without device_managed; InvalidArgument for a layer or selection out of
  // range; ResourceExhausted when the selection can name more pages than there are slots (a call
  // must never run out of victims).
  absl::Status EnqueueResolve(int layer, int64_t prefix_end, const kernels::CandidateList& middle,
                              int64_t suffix_begin, int64_t suffix_end);

  // Device-managed mode: waits for `stream`, reads the device counters and brings stats(), the
  // metrics and resident_pages() up to date. FailedPrecondition without device_managed. Not
  // during a graph capture.
  absl::Status SyncDeviceStats();

  // The slot of a page on the host (-1 when absent); InvalidArgument out of range.
  absl::StatusOr<int32_t> SlotOf(const GpuPageId& page) const;

  // [num_slots, page_size, head_dim] bf16 (fp8_e4m3 for a device-managed cache of fp8 pages)
  kernels::TensorView k_pool() const;
  kernels::TensorView v_pool() const;
  const int32_t* device_table() const;  // backend memory, see the file comment
  // Device-managed cache of fp8 pages: backend memory [num_slots, 2] f32, the (K, V) scales of the
  // page in each slot (kernels::SelectedAttentionParams::slot_scales); null otherwise.
  const float* slot_scales() const;
  int64_t table_size() const { return table_size_; }
  const GpuCacheOptions& options() const { return options_; }
  int64_t page_bytes() const { return static_cast<int64_t>(page_bytes_); }  // K+V of one page
  int64_t resident_pages() const;
  int64_t pinned_slots() const;
  GpuCacheStats stats() const;

 private:
  GpuPageCache(const GpuCacheOptions& options, kernels::Backend* backend);
  absl::Status Init();

  struct Staging {
    std::unique_ptr<kernels::Buffer> pages;  // max_batch_pages x page_bytes_
    std::unique_ptr<kernels::Buffer> slots;  // int32 [max_batch_pages]
    std::unique_ptr<kernels::Buffer> index;  // int32 [2 * max_batch_pages]
    std::unique_ptr<kernels::Buffer> value;  // int32 [2 * max_batch_pages]
    std::unique_ptr<kernels::Buffer> sources;  // const void* [max_batch_pages]
    std::vector<PageRef> hold;  // pages read in place by the batch: alive until it completes
    uint64_t seq = 0;                        // batch that last used it
  };

  absl::StatusOr<int64_t> FlatIndex(const GpuPageId& p) const;
  // Looks up the distinct `missing` flat indices in the source and checks every page; nothing
  // changes in the cache. Returns the pages in order.
  absl::StatusOr<std::vector<PageRef>> FetchFromSource(const std::vector<int64_t>& missing);
  // A slot for a new page (never-used first, then clock), or -1 when every slot is pinned.
  int32_t ClaimSlot();
  // Fills pages[i] (flat index ids[i]) into fresh slots, `pin` each (kWait) or not, in batches.
  // Stops early (best effort) when no slot is left; *filled = pages filled. (*slot_of)[i] = slot.
  absl::Status Fill(const std::vector<int64_t>& ids, const std::vector<PageRef>& pages, bool pin,
                    std::vector<int32_t>* slot_of, int64_t* filled);
  absl::Status WaitLocked();
  // A fresh mark for the per-call "seen" flags below (clears them when the counter wraps).
  uint32_t NextEpoch();
  void PublishGauges();

  GpuCacheOptions options_;
  kernels::Backend* backend_;
  size_t half_bytes_ = 0;  // K (or V) bytes of one page
  size_t page_bytes_ = 0;  // K + V
  int64_t table_size_ = 0;
  std::unique_ptr<prometheus::Registry> own_registry_;
  std::unique_ptr<KvMetrics> own_metrics_;
  TierMetrics m_;
  prometheus::Counter* fetch_bytes_ = nullptr;
  double published_capacity_ = 0;  // additive_gauges: what this cache added to the gauges
  double published_resident_ = 0;  // guarded by mu_ (after Init)

  std::unique_ptr<kernels::Buffer> k_pool_, v_pool_, device_table_;
  std::vector<PageRef> held_;  // hold_source_pages: flat index -> page (immutable after Init)
  // device_managed: the state of kernels::PageCacheState in backend memory.
  std::unique_ptr<kernels::Buffer> d_slot_page_, d_stamp_, d_ref_, d_counters_, d_scratch_,
      d_sources_, d_page_scales_, d_slot_scales_;
  // The pools' dtype: bf16, or (device-managed) the pages' dtype, set from the first page seen.
  kernels::DType pool_dtype_ = kernels::DType::kBF16;
  bool pool_dtype_known_ = false;
  kernels::PageCacheState device_state_;
  std::vector<int64_t> synced_counters_;  // guarded by mu_: the counters at the last sync
  absl::Status InitDeviceState();

  mutable std::mutex mu_;
  std::vector<int32_t> table_;      // guarded by mu_: flat index -> slot or -1
  std::vector<int64_t> slot_page_;  // guarded by mu_: slot -> flat index or -1
  std::vector<int32_t> pins_;       // guarded by mu_
  std::vector<uint8_t> ref_;        // guarded by mu_: clock reference bits
  std::vector<uint64_t> fence_;     // guarded by mu_: batch that filled the slot
  std::vector<uint32_t> id_mark_;   // guarded by mu_: per page, epoch_ when seen in this call
  std::vector<uint32_t> slot_mark_; // guarded by mu_: per slot, epoch_ when seen in this call
  std::vector<int32_t> release_count_;  // guarded by mu_: all zero between Release calls
  uint32_t epoch_ = 0;              // guarded by mu_
  int64_t next_unused_ = 0;         // guarded by mu_: slots >= this were never used
  int64_t hand_ = 0;                // guarded by mu_
  int64_t resident_ = 0;            // guarded by mu_
  int64_t pinned_ = 0;              // guarded by mu_: slots with pins > 0
  uint64_t issued_seq_ = 0;         // guarded by mu_: batches issued
  uint64_t completed_seq_ = 0;      // guarded by mu_: batches known complete
  Staging staging_[2];              // guarded by mu_
  int next_staging_ = 0;            // guarded by mu_
  GpuCacheStats stats_;             // guarded by mu_
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_GPU_CACHE_H_
