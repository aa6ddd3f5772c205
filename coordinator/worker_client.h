// The coordinator's view of the workers: the calls it makes to them (internal.proto, service
// Worker). The gRPC implementation lives with the worker code; tests use
// coordinator/testing/fake_worker_client.h.
//
// The coordinator never calls these with its own lock held, so implementations may invoke the
// callbacks from any thread, even before the call returns. For each PrefillShard, MountShard,
// UnmountShard and RunJob call, `on_done` runs exactly once, after the last progress/event
// callback. Implementations are thread-safe.
#ifndef STRATA_COORDINATOR_WORKER_CLIENT_H_
#define STRATA_COORDINATOR_WORKER_CLIENT_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "strata/v1/internal.pb.h"

namespace strata::coordinator {

class WorkerClient {
 public:
  using ProgressFn = std::function<void(const v1::PrefillShardProgress&)>;
  using JobEventFn = std::function<void(const v1::JobEvent&)>;
  using DoneFn = std::function<void(const absl::Status&)>;

  virtual ~WorkerClient() = default;

  // Prefills one shard on `worker`. on_done gets OK once the shard is durable.
  virtual void PrefillShard(const v1::WorkerInfo& worker, const v1::PrefillShardRequest& request,
                            ProgressFn on_progress, DoneFn on_done) = 0;

  // Asks `worker` to mount a durable shard (summaries in memory, pages through its tiers on
  // demand), so that it can answer selection requests and lead jobs on it. on_done gets OK once
  // mounted; UNIMPLEMENTED from a worker that mounts documents only when it runs a job.
  virtual void MountShard(const v1::WorkerInfo& worker, const v1::MountShardRequest& request, DoneFn on_done) = 0;

  // Asks `worker` to drop a mounted shard (its pages stay durable in the KV store).
  virtual void UnmountShard(const v1::WorkerInfo& worker, const v1::UnmountShardRequest& request,
                            DoneFn on_done) = 0;

  // Runs a job with `worker` as leader, relaying its events. on_done gets the final status of the
  // call (OK after a terminal snapshot event).
  virtual void RunJob(const v1::WorkerInfo& worker, const v1::RunJobRequest& request,
                      JobEventFn on_event, DoneFn on_done) = 0;

  // Asks `worker` to stop a job (best effort; also cancels the RunJob call).
  virtual void CancelJob(const v1::WorkerInfo& worker, const std::string& job_id) = 0;
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_WORKER_CLIENT_H_
