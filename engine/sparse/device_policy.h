// The quest and tokenselect policies with every step on the compute backend (the selection ops
// of kernels/backend.h). Minmax page and segment summaries live in backend memory and are
// refreshed by UpdateSummaries on each append; a decode step's selection (two-level page ranking,
// token soft vote, top-k) and its attention run as backend ops chained through CandidateList, with
// nothing read on the host, so on the CUDA backend a layer's decode attention can be captured in
// a CUDA graph.
//
// Semantics are those of MakeSparsePolicy with the same PolicyOptions (sinks, window, budget,
// segments, two-level threshold, candidate factor, dense layers; see engine/sparse/policy.h and
// sparse_device_pipeline_test / device_policy_test), except:
//   - no selection cache (cache_theta is ignored: every call selects);
//   - decode only: one query token, at position cache.length(layer) - 1;
//   - pages are taken as the top ceil(wanted / P) by vote, where the host policy's FillPages may
//     add a boundary page that lies partly outside the middle and still fits the budget.
// Used by engine::Transformer through ForwardOptions::device_policy (one-token segments), by
// `strata generate` and by the worker's jobs (worker/worker.h, WorkerOptions::device_selection).
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

  // What the Attend calls that succeeded attended, per KV head, as planned on the host (nothing
  // is read back from the backend): candidate_tokens += the cache length; selected_tokens += the
  // cache length where attention is exact (dense layer, or the middle fits in the budget), else
  // sinks + window + the middle's planned size: min(budget, ceil(budget * factor / P) * P) for
  // tokenselect (the top-k size), and min(ceil(budget / P) * P, middle) for quest (an upper
  // bound: a chosen page cut by the sink or window boundary attends fewer tokens). No selection
  // cache, so cache_lookups and cache_hits stay 0.
  const SelectionCounters& counters() const { return counters_; }

 private:
  DevicePolicy(const PolicyOptions& options, const KvCacheOptions& cache, int num_q_heads,
               kernels::Backend* backend);
  absl::Status Init();
  absl::Status CheckCache(int layer, const KvCache& cache) const;

  PolicyOptions options_;
  KvCacheOptions cache_options_;
  int hq_, hkv_, group_, d_, page_, seg_pages_;
  int64_t max_pages_, max_segs_;
  int64_t wanted_pages_;  // pages kept before the token stage (tokenselect) or attended (quest)
  kernels::Backend* backend_;
  std::vector<bool> dense_layer_;
  // Per layer: page table (filled on the first append), page and segment summaries.
  std::vector<std::unique_ptr<kernels::Buffer>> table_, pages_, segs_;
  std::vector<bool> table_ready_;
  // Shared scratch of one Attend call.
  std::unique_ptr<kernels::Buffer> seg_scores_, page_scores_, tok_scores_, top_segs_, top_pages_,
      top_tokens_;
  SelectionCounters counters_;
};

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_DEVICE_POLICY_H_
