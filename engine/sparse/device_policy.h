// The quest and tokenselect policies with every step on the compute backend (the selection ops
// of kernels/backend.h). Minmax page and segment summaries live in backend memory and are
// refreshed by UpdateSummaries on each append; a decode step's selection (two-level page ranking,
// token soft vote, top-k) runs as one Backend::SelectStages op (on CUDA one kernel) and its
// attention as SelectedAttention over the selection's CandidateList, with nothing read on the
// host, so on the CUDA backend a layer's decode attention can be captured in a CUDA graph.
//
// Semantics are those of MakeSparsePolicy with the same PolicyOptions (sinks, window, budget,
// segments, two-level threshold, candidate factor, dense layers; see engine/sparse/policy.h and
// sparse_device_pipeline_test / device_policy_test), except:
//   - the selection cache (options.cache_theta <= 1; > 1 disables it) runs on the backend
//     (Backend::SelectionCacheCheck, then the selection ops with skip_heads): per layer and KV head
//     a decode step whose group query has cosine >= theta with the query of that head's last
//     selection reuses that selection, clipped to the current middle by SelectedAttention. For
//     tokenselect (token ids) this is the host policy's ClipRanges exactly; for quest the kept
//     page ids are expanded to their tokens inside the current middle, so a kept page that held
//     the old window start also attends its tokens that have since left the window (the host
//     keeps the ranges clipped at selection time). Prefill chunks (AttendChunk) neither use nor
//     fill the cache and invalidate it for the layer (the host chunk path looks it up with the
//     chunk's mean query); the next decode step selects;
//   - decode only: one query token, at position cache.length(layer) - 1;
//   - pages are taken as the top ceil(wanted / P) by vote, where the host policy's FillPages may
//     add a boundary page that lies partly outside the middle and still fits the budget;
//   - where the two-level stage would keep every segment, the pages are scored directly (the
//     same candidates; the host policy goes through the segments), saving two launches; not
//     with partitions (below), whose parts are dealt by segment on the two-level path.
// tokenselect with options.EffectivePartitions(group) = R > 1 (the host policy's TokenSelectParts):
// SelectStagesParams::partitions = R, so every stage runs in R independent parts (which a
// backend may run in a thread block each, with no top-k across blocks) and every stage's k is a
// multiple of R: the
// segment stage keeps the host's segment count rounded up to a multiple of R (ceil(count / R)
// per part, the host's share), the page stage ceil(wanted / P) pages rounded up likewise
// (ceil(ceil(wanted / P) / R) per part, the host's), and the token stage the budget rounded up
// likewise (ceil(budget / R) per part, the host's). Part j holds the pages (two-
// level: the segments) whose index is j modulo R; the selected ids are grouped by part (part j's
// ascending, then -1), which SelectedAttention and AttendChunk read in any order. quest always
// selects in one part.
// Used by engine::Transformer through ForwardOptions::device_policy (one-token segments), by
// `strata generate` and by the worker's jobs (worker/worker.h, WorkerOptions::device_selection).
//
// Prefill chunks (AttendChunk): the chunk of m queries selects once, with its mean query (the
// host policy's chunk path, TokenSelect's chunk-wise selection), on the backend; the selection
// (per KV head at most B token ids or ceil(B / P) page ids, a few KB) is copied to the host, which
// waits for the stream once per call; the spans sinks + selected middle + [q_begin - W, length)
// are then attended by Backend::PagedAttention with causal positions (on CUDA the tensor-core
// flash kernel). Differences from the host policy's chunk path, besides those above:
//   - the mean query is computed on the backend by a tree of MergeAttention calls (at most 64
//     parts each, equal weights through the parts' lse), so it differs from the host's running
//     sum in rounding (~1e-7 relative): a near-tie in a page or token vote may go the other way;
//   - the chunk is not split (the host policy does not split it either).
//
// Thread-compatible. The backend and the caches passed in must outlive the policy.
#ifndef STRATA_ENGINE_SPARSE_DEVICE_POLICY_H_
#define STRATA_ENGINE_SPARSE_DEVICE_POLICY_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_policy.h"
#include "engine/kv_cache.h"
#include "engine/query_mean.h"
#include "engine/selection_cache.h"
#include "engine/sparse/policy.h"
#include "kernels/backend.h"

namespace strata::engine::sparse {

class DevicePolicy {
 public:
  // options.kind must be quest or tokenselect, with minmax summaries (the default); the cache
  // options are those of the KvCache that will be passed in (page_size must equal
  // options.page_size). InvalidArgument otherwise; ResourceExhausted when backend memory runs out.
  static absl::StatusOr<std::unique_ptr<DevicePolicy>> Create(const PolicyOptions& options,
                                                              const KvCacheOptions& cache,
                                                              int num_q_heads,
                                                              kernels::Backend* backend);
  ~DevicePolicy();

  // Tokens [first, end) of `layer` were appended to `cache` (end == cache.length(layer)).
  absl::Status OnAppend(int layer, const KvCache& cache, int64_t first, int64_t end,
                        kernels::Stream stream);

  // Decode attention of `layer` for the query at position cache.length(layer) - 1:
  // q [1, num_q_heads, head_dim] f32 in backend memory (after RoPE); writes out [1, num_q_heads,
  // head_dim] and lse [1, num_q_heads] (backend memory) as PagedAttention would over the policy's
  // selection. Enqueued on `stream`; returns without waiting.
  absl::Status Attend(int layer, const kernels::TensorView& q, const KvCache& cache,
                      const kernels::TensorView& out, const kernels::TensorView& lse,
                      kernels::Stream stream);

  // The host side of an Attend call whose device work was recorded in a CUDA graph (Backend::
  // BeginCapture around an Attend) and replayed: counts what that Attend would count (counters(),
  // the selection cache's lookups) without queueing anything. The cache must be the one recorded,
  // at the length it had then (e.g. a mounted shard's, which does not grow). InvalidArgument as
  // Attend for a bad layer or an empty cache.
  absl::Status NoteReplayedAttend(int layer, const KvCache& cache);
  // The other way: an Attend recorded into a graph that was then discarded (its capture failed)
  // counted a step that never ran; this takes those counts back.
  absl::Status DiscardRecordedAttend(int layer, const KvCache& cache);

  // Prefill-chunk attention of `layer` for the m = q.dim(0) >= 1 queries at cache positions
  // [q_begin, q_begin + m) (q_begin + m <= cache.length(layer): the cache already holds them):
  // q [m, num_q_heads, head_dim] f32 in backend memory (after RoPE); writes out [m, num_q_heads,
  // head_dim] and lse [m, num_q_heads] (backend memory) as PagedAttention over, per KV head,
  //   sinks [0, S), the middle selected with the chunk's mean query (everything when the middle
  //   [S, q_begin - W) fits in the budget, or on a dense layer), and [max(S, q_begin - W), length)
  // with causal masking by position (query i at position_offset + q_begin + i; span positions
  // are cache index + position_offset, as engine::ForwardOptions::cache_first_position). Waits
  // for `stream` once (the selection's copy to the host); PagedAttention is enqueued on `stream`.
  // InvalidArgument for malformed views or positions; errors of the backend are passed through.
  absl::Status AttendChunk(int layer, const kernels::TensorView& q, int64_t q_begin,
                           const KvCache& cache, int64_t position_offset,
                           const kernels::TensorView& out, const kernels::TensorView& lse,
                           kernels::Stream stream);

  // Attention of the m = q.dim(0) >= 1 queries q [m, num_q_heads, head_dim] (f32, backend memory,
  // after RoPE) that follow every token of `layer` in `cache` (e.g. a leader's queries over a
  // mounted document shard, worker/shard_attention.h): the selection AttendChunk makes for a chunk
  // at q_begin = cache.length(layer) - 1 (the m queries' mean query; window [length - 1 - W,
  // length), so the last cached token is always attended), attended by every query without causal
  // masking (every cached token precedes every query). Writes out [m, num_q_heads, head_dim] and
  // lse [m, num_q_heads] (backend memory). One query (m = 1) is a decode step's (Attend: the same
  // selection, the selection cache when on, on CUDA one kernel, enqueued without waiting); more
  // wait for `stream` once (the selection's copy to the host), as AttendChunk, and invalidate the
  // layer's selection cache. InvalidArgument for malformed views or an empty layer.
  absl::Status AttendFollowing(int layer, const kernels::TensorView& q, const KvCache& cache,
                               const kernels::TensorView& out, const kernels::TensorView& lse,
                               kernels::Stream stream);

  // What the Attend calls that succeeded attended, per KV head, as planned on the host (nothing
  // is read back from the backend): candidate_tokens += the cache length; selected_tokens += the
  // cache length where attention is exact (dense layer, or the middle fits in the budget), else
  // sinks + window + the middle's planned size: min(budget, ceil(budget * factor / P) * P) for
  // tokenselect (the top-k size; the budget rounded up to a multiple of the parts), and
  // min(ceil(budget / P) * P, middle) for quest (an upper bound: a chosen page cut by the sink
  // or window boundary attends fewer tokens). No selection cache: lookups (num_kv_heads per
  // selecting decode step, as the host counts them) are counted on the host and hits on the
  // backend; both reach counters() only through ReadCacheHits, so
  // until then cache_lookups and cache_hits stay as last read (0 at first) and a hit ratio is
  // never half updated (selected_tokens stays the planned size on hits too). AttendChunk and
  // AttendFollowing calls add the cache length and the tokens actually attended (the selection is
  // read back there), per KV head.
  const SelectionCounters& counters() const { return counters_; }

  // Copies the lookups so far and the backend's count of selection-cache hits into counters();
  // waits for `stream` (not for use inside a graph capture). No-op when the cache is off.
  absl::Status ReadCacheHits(kernels::Stream stream);
  // The same in two parts, for a caller that waits for `stream` anyway: QueueCacheHitsRead queues
  // the count's copy on it, TakeCacheHits (after that wait) copies the lookups and that count
  // into counters(). Both no-ops when the cache is off.
  absl::Status QueueCacheHitsRead(kernels::Stream stream);
  void TakeCacheHits();

 private:
  DevicePolicy(const PolicyOptions& options, const KvCacheOptions& cache, int num_q_heads,
               kernels::Backend* backend);
  absl::Status Init();
  absl::Status CheckCache(int layer, const KvCache& cache) const;
  // The plan of a decode step of `layer` over a cache of `len` tokens (Attend): its sinks' end,
  // its window's start, and whether it attends exactly (a dense layer, or the middle fits the
  // budget) rather than selecting.
  struct StepPlan {
    int64_t sink_end = 0, window_begin = 0;
    bool exact = false;
  };
  StepPlan PlanStep(int layer, int64_t len) const;
  // What the step counts on the host, times `sign` (counters_; the selection-cache lookups are
  // counted by Attend and, for a replay, by the cache's CountChecks).
  void CountStep(const StepPlan& plan, int64_t len, int sign = 1);
  // NoteReplayedAttend (sign 1) and DiscardRecordedAttend (sign -1).
  absl::Status CountOutsideAttend(int layer, const KvCache& cache, int sign);
  // InvalidArgument unless q is f32 [m >= 1, num_q_heads, head_dim] and out / lse f32 [m,
  // num_q_heads, head_dim] / [m, num_q_heads].
  absl::Status CheckQueryViews(const kernels::TensorView& q, const kernels::TensorView& out,
                               const kernels::TensorView& lse) const;
  // AttendChunk (following = false) and AttendFollowing (true: q_begin = length - 1, no causal
  // masking, position_offset unused), after their checks of the layer and the views.
  absl::Status AttendQueries(int layer, const kernels::TensorView& q, int64_t q_begin,
                             bool following, const KvCache& cache, int64_t position_offset,
                             const kernels::TensorView& out, const kernels::TensorView& lse,
                             kernels::Stream stream);
  // Queues the middle selection of `layer` for the queries q [num_q_heads, head_dim] over
  // [sink_end, window_begin) (which must exceed the budget) and returns the middle as
  // SelectedAttention reads it (parents in top_pages_ or top_tokens_; with `check` (the selection
  // cache's check of q, run first by the same SelectStages op: SelectStagesParams::cache_check)
  // the heads it flags for reuse are not recomputed and the result is in the selection cache's
  // kept(layer)).
  // attend (optional): the step's attention, whose middle is set to the selection and which
  // runs in the same SelectStages op (SelectStagesParams::attend).
  absl::StatusOr<kernels::CandidateList> SelectMiddle(
      int layer, const kernels::TensorView& q, const KvCache& cache, int64_t sink_end,
      int64_t window_begin, const kernels::SelectionCacheCheckParams* check,
      kernels::SelectedAttentionParams* attend, kernels::Stream stream);
  PolicyOptions options_;
  KvCacheOptions cache_options_;
  int hq_, hkv_, group_, d_, page_, seg_pages_;
  // The selection's independent parts (SelectStagesParams::partitions): tokenselect's
  // options.EffectivePartitions(group_), 1 for quest. Every stage's k is a multiple of it.
  int parts_;
  int64_t max_pages_, max_segs_;
  // Pages kept before the token stage (tokenselect) or attended (quest): the host policy's
  // ceil(wanted / page) (policy_wanted_pages_; wanted = budget x candidate factor for
  // tokenselect, the budget for quest) rounded up to a multiple of parts_.
  int64_t wanted_pages_;
  int64_t policy_wanted_pages_;
  // Tokens the token stage keeps (tokenselect): the budget rounded up to a multiple of parts_.
  int64_t kept_tokens_;
  // n rounded up to a multiple of parts_.
  int64_t RoundUpToParts(int64_t n) const;
  kernels::Backend* backend_;
  std::vector<bool> dense_layer_;
  // Per layer: page table (filled on the first append), page and segment summaries.
  std::vector<std::unique_ptr<kernels::Buffer>> table_, pages_, segs_;
  std::vector<bool> table_ready_;
  // Shared scratch of one Attend call.
  std::unique_ptr<kernels::Buffer> seg_scores_, page_scores_, tok_scores_, top_segs_, top_pages_,
      top_tokens_;
  // With parts (parts_ > 1): SelectStagesParams::arrivals, [hkv] i32, zero between calls.
  std::unique_ptr<kernels::Buffer> arrivals_;
  SelectionCounters counters_;
  int64_t queued_lookups_ = 0;  // the lookups when QueueCacheHitsRead queued the count's read
  // Selection cache (cache_on_), whose kept selection per layer is quest: [hkv, wanted_pages_]
  // page ids; tokenselect: [hkv, budget] token ids.
  bool cache_on_ = false;
  std::unique_ptr<DeviceSelectionCache> sel_cache_;
  // Element type of the page and segment summaries: bf16 for a bf16 or fp8 cache (exact), else f32.
  kernels::DType summary_dtype_ = kernels::DType::kF32;
  // AttendChunk state: the chunk's mean query (engine/query_mean.h), the selection read back,
  // the spans and query positions for PagedAttention.
  DeviceQueryMean mean_query_;
  std::vector<int32_t> selected_host_;
  Selection chunk_selection_;
  std::vector<int32_t> chunk_positions_;
};

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_DEVICE_POLICY_H_
