// Decode attention to a document whose KV lives in the host tier, read through the GPU page cache
// (tier G, kvstore/gpu_cache.h): an engine::ExternalAttention for Transformer::Forward.
//
// The forward's own KvCache holds only the tokens after the document (prompt and generated ones,
// ForwardOptions::cache_first_position = document_tokens); per layer, this hook attends the
// document: the pages a PageChooser picks for each KV head (default: every page, which makes the
// result exact) are acquired from the cache (MissPolicy::kWait, in chunks of at most
// max_pages_per_chunk pages, so a document larger than the cache streams through it), attended
// with Backend::PagedAttention over the cache's slots (one partial per chunk), and released. The
// transformer merges the partials with its local attention (MergeAttention; the CUDA backend
// merges at most 64 parts, so keep the chunks of one call below 64 there).
//
// Positions: page p holds document positions [p * page_size, min((p + 1) * page_size,
// document_tokens)); every document token precedes the queries, so nothing is masked.
// Thread-compatible (one forward at a time); the cache and backend must outlive it.
#ifndef STRATA_ENGINE_GPU_CACHE_ATTENTION_H_
#define STRATA_ENGINE_GPU_CACHE_ATTENTION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/selection_cache.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kvstore/gpu_cache.h"

namespace strata::engine {

// The document pages (ascending, each in [0, num_pages)) that KV head `kv_head` of `layer` attends
// for queries q (host f32 [num_tokens, num_q_heads, head_dim]). Appends to *pages (empty on entry);
// an error ends the forward.
using PageChooser = std::function<absl::Status(int layer, int kv_head, const float* q,
                                               int num_tokens, int num_q_heads,
                                               std::vector<int32_t>* pages)>;

// A PageChooser from minmax page summaries held in `store` (key (document, layer, kv_head, kind,
// page); payload f32 min[head_dim] then max[head_dim] of the page's keys, as the worker persists
// them): per KV head, page 0 (sinks), the last `window_pages` pages, and the `budget_pages` other
// pages with the highest head soft vote (TokenSelect): the sum over the group's query heads of
// the softmax over pages of the Quest bound scale * sum_i max(q_i min_i, q_i max_i). A call of
// several query tokens (a prompt chunk) chooses once with the chunk's mean query (MeanQuery,
// engine/query_mean.h), as every chunk chooser of the engine does. Summaries are read from the store on first use of a
// (layer, kv head) and kept. Errors: the store's; NotFound for a missing or malformed summary;
// InvalidArgument for a layer or head outside the options.
// The minmax page summaries of one document, per (layer, kv head) [num_pages, 2 head_dim] f32 as the
// worker persists them, read from `store` on first use of a (layer, kv head) and kept (a failed read
// is retried on the next Get). Shared by the choosers of the jobs on one document and by the device
// upload of the same summaries, so each is read from the store once. Thread-safe: one lock per
// (layer, kv head), so different ones are read at once.
class MinMaxSummaryCache {
 public:
  // bf16_bounds: each summary row is rounded outward to bf16 values as it is read
  // (kernels::MinMaxRowsToBF16; still f32 here, now exactly bf16-representable), so that the
  // host choosers and a bf16 device copy of the summaries choose from the same bounds.
  MinMaxSummaryCache(kvstore::PageStore* store, kvstore::DocumentId document, uint32_t summary_kind,
                     int num_layers, int num_kv_heads, int head_dim, int64_t num_pages,
                     bool bf16_bounds = false);
  // The summaries of (layer, kv_head), valid as long as the cache. InvalidArgument for a layer or
  // head outside the shape; NotFound for a missing or malformed summary; the store's errors.
  absl::StatusOr<const std::vector<float>*> Get(int layer, int kv_head);
  // Whether this cache serves choosers of the given shape (document pages, layers, heads, dims).
  bool Matches(int num_layers, int num_kv_heads, int head_dim, int64_t num_pages) const;
  int64_t bytes() const;  // summaries held
  bool bf16_bounds() const { return bf16_bounds_; }

 private:
  kvstore::PageStore* store_;
  kvstore::DocumentId document_;
  uint32_t summary_kind_;
  int num_layers_, num_kv_heads_, head_dim_;
  int64_t num_pages_;
  bool bf16_bounds_;
  struct Entry {
    std::mutex mu;            // held while the entry is read from the store
    std::vector<float> data;  // empty until read
  };
  std::unique_ptr<Entry[]> entries_;  // per (layer, kv head)
  std::atomic<int64_t> bytes_{0};
};

struct MinMaxChooserOptions {
  kvstore::PageStore* store = nullptr;  // not owned
  kvstore::DocumentId document;
  uint32_t summary_kind = 1;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t num_pages = 0;  // document pages per (layer, kv head)
  int budget_pages = 32;
  int window_pages = 1;
  // Where the summaries come from: null (the chooser reads `store` into its own cache), or a cache
  // shared with other choosers of the document (its shape must match these options; `store` and
  // `summary_kind` are then unused).
  std::shared_ptr<MinMaxSummaryCache> summaries;
  // Selection cache (TokenSelect; the host twin of DeviceSelectionCache): a one-token call for a
  // (layer, kv head) whose group query q_g (the group's query heads, [group * head_dim]) has
  // cos(q_g, c) >= cache_theta with the query c that (layer, kv head) last chose for returns the
  // pages chosen then (cos = q.c / sqrt(|q|^2 |c|^2) in double, 0 when a norm is 0, NaN no hit);
  // otherwise it chooses and caches q_g. A call of several tokens chooses and forgets the entry.
  // > 1 (the default): off. With cache_counters, every one-token call adds one cache_lookups and
  // a hit one cache_hits (not owned; the chooser's caller serializes the calls).
  double cache_theta = 2.0;
  SelectionCounters* cache_counters = nullptr;
};
PageChooser MakeMinMaxChooser(const MinMaxChooserOptions& options);

// The device side of the same choice for one query token, enqueued on the backend's default
// stream (nothing read on the host): scores the middle pages [1, window_first) of every KV head
// by their minmax summaries (ScoreSummaries, scale 1 / sqrt(d)) and keeps the k pages of highest
// head soft vote (VoteTopK), as one Backend::SelectStages stage (on CUDA with bf16 summaries one
// kernel). q: [hq, d] f32; summaries: [hkv, pages, 2d] f32 or bf16; scores: scratch
// [hkv, hq / hkv, window_first - 1] f32 (contents unspecified after the call); selected: [hkv, k]
// i32 (out, ascending page ids, -1 pads); all backend memory. The caller adds page 0 and the
// window pages. With skip_heads (backend memory, [hkv] i32: DeviceSelectionCache::Check's reuse
// flags) a KV head flagged keeps its row of `selected` as it was.
absl::Status EnqueueMinMaxPageTopK(kernels::Backend* backend, const kernels::TensorView& q,
                                   const kernels::TensorView& summaries, int64_t window_first,
                                   int64_t k, const kernels::TensorView& scores,
                                   const kernels::TensorView& selected,
                                   const int32_t* skip_heads = nullptr);

// The same choice through the selection cache `cache` (its k the call's): the cache's check of
// `layer` is part of the op (kernels::SelectStagesParams::cache_check: on CUDA inside the
// selection kernel), a KV head whose query is similar to its cached one keeping its row of
// cache.kept(layer), the others selecting into it; the lookups are counted once the op is queued
// (DeviceSelectionCache::CountChecks). Returns cache.kept(layer).
absl::StatusOr<kernels::TensorView> EnqueueCachedMinMaxPageTopK(
    kernels::Backend* backend, const kernels::TensorView& q, const kernels::TensorView& summaries,
    int64_t window_first, int64_t k, const kernels::TensorView& scores,
    DeviceSelectionCache& cache, int layer);

// The pages of one KV head from a `selected` row of EnqueueMinMaxPageTopK (k ids, -1 pads) as the
// chooser returns them: page 0, the selected middle pages in [1, window_first), and the window
// pages [window_first, num_pages), appended to `pages` sorted and without repeats.
void AppendChosenPages(const int32_t* selected, int64_t k, int64_t window_first,
                       int64_t num_pages, std::vector<int32_t>* pages);

// The tokens a DevicePageChooser chose, as a device-side selection for Backend::SelectedAttention
// (KV head g: document tokens [0, prefix_end), the valid token ids of `middle` -- backend memory --
// and [suffix_begin, suffix_end)). It must name exactly the tokens of the pages in the chooser's
// page lists, each once.
struct DeviceTokenSelection {
  bool valid = false;  // false: not given (attend through the page lists)
  int64_t prefix_end = 0;
  kernels::CandidateList middle;
  int64_t suffix_begin = 0;
  int64_t suffix_end = 0;
};

// A chooser for the device path: the queries are backend memory (f32 [num_tokens, num_q_heads,
// head_dim], queued on the backend's default stream); (*pages)[g] (sized num_kv_heads and cleared
// by the caller) receives the pages KV head g attends, each in [0, num_pages). Selection may run
// on the device; the page lists must be on the host when it returns (the cache's Acquire needs
// them), so an implementation usually ends with one copy to the host. It may also fill
// *selection (valid = false on entry): then a one-token call whose pages fit one chunk attends
// with Backend::SelectedAttention over the cache's device page table (no span list planned on the
// host; the backend's errors, Unimplemented included, end the call); otherwise through
// PagedAttention.
// With a device-managed cache (kvstore::GpuCacheOptions::device_managed) `pages` is null: only
// *selection is wanted (it must be filled and valid), nothing needs to reach the host, and the
// call must queue device work only (no host reads or waits) so that it can be captured in a graph.
using DevicePageChooser = std::function<absl::Status(
    int layer, const kernels::TensorView& q, std::vector<std::vector<int32_t>>* pages,
    DeviceTokenSelection* selection)>;

struct GpuCacheAttentionOptions {
  int64_t document_tokens = 0;  // > 0; at most cache pages_per_head * page_size
  // Pages acquired per chunk (one Acquire + one PagedAttention each). 0: the cache's slot count.
  int64_t max_pages_per_chunk = 0;
  PageChooser chooser;  // null: every page (exact)
  // Device path (ExternalAttention::AttendsOnDevice): q stays in backend memory and the partial
  // is written there (chunks merged on the device), so the transformer copies nothing to the host
  // for this hook. Pages come from `device_chooser` when set, else from `chooser` (q copied to the
  // host for it), else every page. When the cache fills on the default stream (its options'
  // stream is null), misses are acquired with MissPolicy::kOrdered and released right after the
  // attention is queued: no host wait for fills. Otherwise kWait, and the hook waits for the
  // attention before releasing. Default: false (Attend, the host path).
  // With a device-managed cache (kvstore::GpuCacheOptions::device_managed, on the default
  // stream) the device path is the only one: Create requires device_path and device_chooser, and
  // each query token attends with EnqueueResolve + SelectedAttention, no host round trip.
  bool device_path = false;
  DevicePageChooser device_chooser;
  // Device-managed cache: a call of several query tokens (a prompt chunk) asks device_chooser
  // once with all of them (q [num_tokens, hq, d], pages null) for one selection that serves the
  // whole chunk (one EnqueueResolve, then SelectedAttention per token); the chooser may wait
  // for the device for it (prompt chunks are not captured in graphs). Default false: every token is
  // chosen for by itself.
  bool chunk_selection = false;
};

// Totals over Attend calls.
struct GpuCacheAttentionCounters {
  int64_t calls = 0;
  int64_t chunks = 0;
  int64_t pages_attended = 0;
  int64_t selected_attention = 0;  // device-path calls attended through SelectedAttention
};

class GpuCacheAttention : public ExternalAttention {
 public:
  // InvalidArgument for a document that does not fit the cache's page table.
  static absl::StatusOr<std::unique_ptr<GpuCacheAttention>> Create(
      const GpuCacheAttentionOptions& options, kvstore::GpuPageCache* cache,
      kernels::Backend* backend);

  // InvalidArgument when q's head count does not divide by the cache's KV heads; ResourceExhausted
  // when a chunk does not fit in the unpinned slots; errors of the cache and backend.
  absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      std::vector<AttentionPartial>* parts) override;

  bool AttendsOnDevice() const override { return options_.device_path; }
  // The device path (see GpuCacheAttentionOptions::device_path). Errors as Attend, plus
  // InvalidArgument for views that do not match and FailedPrecondition without device_path.
  absl::Status AttendOnDevice(int layer, const kernels::TensorView& q, int64_t q_begin,
                              const kernels::TensorView& out,
                              const kernels::TensorView& lse) override;

  // True with a device-managed cache (kvstore::GpuCacheOptions::device_managed): AttendOnDevice
  // then queues device work only (the chooser's selection, GpuPageCache::EnqueueResolve,
  // SelectedAttention), reads nothing on the host and does not depend on q_begin beyond its
  // check, so a decode step that calls it can be captured in a CUDA graph and replayed.
  bool CapturableOnDevice() const override {
    return options_.device_path && cache_->options().device_managed;
  }

  const GpuCacheAttentionCounters& counters() const { return counters_; }

 private:
  GpuCacheAttention(const GpuCacheAttentionOptions& options, kvstore::GpuPageCache* cache,
                    kernels::Backend* backend)
      : options_(options), cache_(cache), backend_(backend) {}

  GpuCacheAttentionOptions options_;
  kvstore::GpuPageCache* cache_;
  kernels::Backend* backend_;
  GpuCacheAttentionCounters counters_;
  // The pages of every KV head for one call, from the chooser, in head order (checked).
  absl::Status ChoosePages(int layer, const float* q_host, const kernels::TensorView* q_device,
                           int num_tokens, int num_q_heads,
                           std::vector<kvstore::GpuPageId>* ids,
                           DeviceTokenSelection* selection = nullptr);
  // SelectedAttention of one query token over `sel`, reading the cache's pools through its
  // device table rows of `layer`.
  kernels::SelectedAttentionParams SelectedOverTable(int layer, const DeviceTokenSelection& sel,
                                                     const kernels::TensorView& q,
                                                     const kernels::TensorView& out,
                                                     const kernels::TensorView& lse) const;
  // The device-managed path of AttendOnDevice: per query token, the chooser's device selection,
  // the cache's EnqueueResolve and SelectedAttention over the cache's table rows of `layer`.
  absl::Status AttendDeviceManaged(int layer, const kernels::TensorView& q,
                                   const kernels::TensorView& out, const kernels::TensorView& lse);
  // Queues PagedAttention of `part` (slots from Acquire) into out / lse.
  absl::Status AttendChunk(absl::Span<const kvstore::GpuPageId> part,
                           const std::vector<int32_t>& slots, const kernels::TensorView& q,
                           const int32_t* positions, const kernels::TensorView& out,
                           const kernels::TensorView& lse);

  std::unique_ptr<kernels::Buffer> q_buf_, out_buf_, lse_buf_;  // grown on demand
  // Device path scratch: chunk partials and the running merge (grown on demand).
  std::unique_ptr<kernels::Buffer> chunk_o_, chunk_lse_, acc_o_[2], acc_lse_[2];
  std::vector<float> q_host_;
  std::vector<std::vector<int32_t>> head_pages_;
  std::vector<kernels::KvSpan> spans_;
  std::vector<int32_t> offsets_, positions_;
};

}  // namespace strata::engine

#endif  // STRATA_ENGINE_GPU_CACHE_ATTENTION_H_
