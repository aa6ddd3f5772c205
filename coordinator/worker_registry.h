// The registry of live workers: registration, heartbeats with a timeout, and capacity/load
// snapshots for admission, placement and leader choice.
//
// A worker is live from Register until it misses heartbeats for `heartbeat_timeout_nanos`
// (ExpireStale removes it and returns its id) or deregisters. Each registration gets a new lease
// id; heartbeats and deregistrations carrying an older lease are NOT_FOUND, so a worker that was
// dropped learns it must register again. Time comes from an injected clock (tests drive it).
// Thread-safe (one mutex).
#ifndef STRATA_COORDINATOR_WORKER_REGISTRY_H_
#define STRATA_COORDINATOR_WORKER_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "strata/v1/internal.pb.h"

namespace strata::coordinator {

// Monotonic nanoseconds.
using NowFn = std::function<int64_t()>;

struct WorkerRegistryOptions {
  // How often workers are asked to heartbeat. Default: 1 s.
  int64_t heartbeat_interval_nanos = 1'000'000'000;
  // A worker silent for this long is dropped. Must exceed the interval. Default: 5 s.
  int64_t heartbeat_timeout_nanos = 5'000'000'000;

  // InvalidArgument unless 0 < interval < timeout.
  absl::Status Validate() const;
};

// One live worker as the registry sees it.
struct WorkerEntry {
  v1::WorkerInfo info;
  uint64_t lease_id = 0;
  v1::WorkerLoad load;
  bool draining = false;
  int64_t last_heartbeat_nanos = 0;
};

class WorkerRegistry {
 public:
  // `now` must be non-null and monotonic.
  WorkerRegistry(const WorkerRegistryOptions& options, NowFn now);

  // Registers (or re-registers, replacing the old lease) a worker. INVALID_ARGUMENT when the
  // worker id is not [A-Za-z0-9._-]{1,128}, the address is empty, or capacity/max_jobs are 0.
  absl::StatusOr<v1::RegisterWorkerResponse> Register(const v1::WorkerInfo& info);

  // Records a heartbeat. NOT_FOUND when the worker is unknown or the lease is not its current one.
  absl::Status Heartbeat(const v1::HeartbeatRequest& request);

  // Removes a worker. NOT_FOUND when unknown or the lease is stale.
  absl::Status Deregister(const std::string& worker_id, uint64_t lease_id);

  // Drops workers whose last heartbeat is older than the timeout; returns their ids (sorted).
  std::vector<std::string> ExpireStale();

  // Live workers, ordered by id.
  std::vector<WorkerEntry> Snapshot() const;
  // The worker, or NOT_FOUND.
  absl::StatusOr<WorkerEntry> Get(const std::string& worker_id) const;
  size_t size() const;

 private:
  const WorkerRegistryOptions options_;
  const NowFn now_;
  mutable absl::Mutex mu_;
  std::map<std::string, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_WORKER_REGISTRY_H_
