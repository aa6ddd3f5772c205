// Shard placement and leader choice: pure functions from (document length, target shard size,
// worker capacities) to a shard map, and from (shard map, worker loads) to a leader.
//
// Placement splits the document's pages into ceil(pages / pages_per_shard) contiguous shards of
// nearly equal size (sizes differ by at most one page), then assigns each shard, largest first,
// to the worker with the most free capacity that can hold it (ties: fewer shards of this document
// already, then smaller worker id). Deterministic. Thread-safe (no state).
#ifndef STRATA_COORDINATOR_PLACEMENT_H_
#define STRATA_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "strata/v1/internal.pb.h"

namespace strata::coordinator {

struct PlacementOptions {
  // Tokens per KV page (P). Default: 64.
  int64_t page_size = 64;
  // Target tokens per shard; rounded down to whole pages (at least one page). Default: 64K.
  int64_t target_shard_tokens = 65536;

  // InvalidArgument unless page_size >= 1 and target_shard_tokens >= 1.
  absl::Status Validate() const;
};

struct WorkerCapacity {
  std::string worker_id;
  // Tokens the worker can still mount.
  int64_t free_tokens = 0;
};

// Places `num_tokens` tokens of document `document_id` on `workers`.
// INVALID_ARGUMENT: num_tokens < 1 or invalid options. UNAVAILABLE: no workers.
// RESOURCE_EXHAUSTED: some shard fits on no worker (the map would be incomplete).
absl::StatusOr<v1::ShardMap> PlaceDocument(const std::string& document_id, int64_t num_tokens,
                                           const PlacementOptions& options,
                                           const std::vector<WorkerCapacity>& workers);

// Moves the shards of `map` whose holder is not among `workers` (it is gone) to live workers:
// each, largest first, to the worker with the most free capacity that can hold it (ties: fewer
// shards of this document already, then smaller id), as PlaceDocument does. Shards held by live
// workers stay. When something moved, the result has version + 1 and the moved shards' addresses
// cleared (the caller fills them in); otherwise it equals `map`.
// UNAVAILABLE: no workers. RESOURCE_EXHAUSTED: a moved shard fits on no worker.
absl::StatusOr<v1::ShardMap> ReassignShards(const v1::ShardMap& map, const std::vector<WorkerCapacity>& workers);

struct WorkerLoadView {
  std::string worker_id;
  int64_t running_jobs = 0;
  int64_t max_jobs = 0;
};

// Chooses the leader of a job on a document placed by `map` (an empty map: a job without a
// document). Among workers with a free job slot: the one holding the most tokens of the
// document, then the fewest running jobs, then the smallest id. UNAVAILABLE when none has a free
// slot.
absl::StatusOr<std::string> ChooseLeader(const v1::ShardMap& map,
                                         const std::vector<WorkerLoadView>& workers);

// Tokens of the shard: [first_page * P, min(end_page * P, num_tokens)).
int64_t ShardTokens(const v1::ShardRange& range, int64_t page_size, int64_t num_tokens);

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_PLACEMENT_H_
