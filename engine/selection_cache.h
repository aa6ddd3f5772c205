// TokenSelect's selection cache kept on the backend (DESIGN.md section 3; papers/DIGEST.md,
// TokenSelect Algorithm 1): per layer and KV head, a decode step whose group query has cosine
// >= theta with the query that head last selected for reuses that selection instead of
// selecting again. One mechanism for every device-side chooser: the sparse DevicePolicy and
// the page choosers of the GPU page cache (EnqueueMinMaxPageTopK).
//
// Per layer it holds the cached group queries [num_kv_heads, group * head_dim] f32, their valid
// flags, the step's reuse flags and the layer's kept selection [num_kv_heads, kept] i32, whose
// rows a hit leaves as they are. Use, per layer and one-token step:
//   ASSIGN_OR_RETURN(const int32_t* skip, cache->Check(layer, q, stream));
//   ... the selection ops with skip_heads = skip, the last one writing cache->kept(layer) ...
// or, with the check inside the SelectStages op (SelectStagesParams::cache_check):
//   ASSIGN_OR_RETURN(SelectionCacheCheckParams cc, cache->CheckParams(layer, q));
//   ... SelectStages with cache_check = &cc, its last stage writing cache->kept(layer) ...
// Check is Backend::SelectionCacheCheck: backend memory only, so it can be captured in a CUDA
// graph. Lookups are counted on the host (num_kv_heads per Check, or CountChecks for checks
// queued by other ops or replayed from a graph) and hits on the backend (ReadHits).
// Thread-compatible.
#ifndef STRATA_ENGINE_SELECTION_CACHE_H_
#define STRATA_ENGINE_SELECTION_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::engine {

class DeviceSelectionCache {
 public:
  // theta in (0, 1] (PolicyOptions::cache_theta; callers with theta > 1 make none). kept >= 1 ids
  // per KV head. InvalidArgument for bad sizes; the backend's allocation errors. Every layer
  // starts invalid (its first Check misses).
  static absl::StatusOr<std::unique_ptr<DeviceSelectionCache>> Create(kernels::Backend* backend,
                                                                      int num_layers,
                                                                      int num_kv_heads, int group,
                                                                      int head_dim, int64_t kept,
                                                                      double theta);

  // Queues the check of `layer` for the query q [num_kv_heads * group, head_dim] f32 (backend
  // memory) and returns the layer's reuse flags [num_kv_heads] (backend memory) to pass as
  // skip_heads to the selection ops queued after it. Counts num_kv_heads lookups.
  absl::StatusOr<const int32_t*> Check(int layer, const kernels::TensorView& q,
                                       kernels::Stream stream);
  // The params of that check, for an op that runs it (SelectStagesParams::cache_check); the
  // layer's reuse flags are cc.reuse. Counts nothing: CountChecks(1) once that op is queued.
  absl::StatusOr<kernels::SelectionCacheCheckParams> CheckParams(int layer,
                                                                 const kernels::TensorView& q);
  // Lookups of `checks` checks queued by other ops (CheckParams) or replayed from a captured
  // graph (negative: checks recorded into a graph that was discarded, taken back).
  void CountChecks(int64_t checks) { lookups_ += checks * num_kv_heads_; }
  // The layer's kept selection [num_kv_heads, kept] i32 (backend memory).
  kernels::TensorView kept(int layer) const;
  // Forgets the layer's cached queries: its next Check misses on every head (for example after a
  // prompt chunk, which selects without the cache).
  absl::Status Invalidate(int layer, kernels::Stream stream);

  int64_t lookups() const { return lookups_; }
  // The hits so far (the backend's count); waits for `stream` (not inside a graph capture).
  absl::StatusOr<int64_t> ReadHits(kernels::Stream stream);
  // The same read without a wait of its own: QueueHitsRead queues the copy of the count on
  // `stream` (into host memory of AllocateHost's), and QueuedHits returns it once the caller has
  // waited for that stream (a caller that waits anyway, e.g. for results copied back with it,
  // saves ReadHits' second wait).
  absl::Status QueueHitsRead(kernels::Stream stream);
  int64_t QueuedHits() const;
  double theta() const { return theta_; }

 private:
  DeviceSelectionCache() = default;
  kernels::Backend* backend_ = nullptr;
  int num_kv_heads_ = 0, group_ = 0, head_dim_ = 0;
  int64_t kept_ = 0;
  double theta_ = 0.0;
  struct Layer {
    std::unique_ptr<kernels::Buffer> cached_q, valid, reuse, kept;
  };
  std::vector<Layer> layers_;
  std::unique_ptr<kernels::Buffer> hit_count_;  // one int64
  std::unique_ptr<kernels::Buffer> hits_host_;  // one int64 (AllocateHost), on first QueueHitsRead
  int64_t lookups_ = 0;
};

}  // namespace strata::engine

#endif  // STRATA_ENGINE_SELECTION_CACHE_H_
