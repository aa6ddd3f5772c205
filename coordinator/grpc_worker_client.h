// WorkerClient over gRPC (internal.proto, service Worker): what `strata coordinator` and
// `strata serve` use to reach workers. One channel per worker address (cached); each
// PrefillShard / MountShard / UnmountShard / RunJob call runs on its own thread, which invokes the
// callbacks and then on_done exactly once. CancelJob sends CancelJob to the worker (the worker then ends the job's RunJob
// stream with a CANCELLED snapshot).
//
// Thread-safe. The destructor cancels calls in flight and waits for their threads (their
// on_done callbacks have run when it returns).
#ifndef STRATA_COORDINATOR_GRPC_WORKER_CLIENT_H_
#define STRATA_COORDINATOR_GRPC_WORKER_CLIENT_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/worker_client.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace strata::coordinator {

struct GrpcWorkerClientOptions {
  // Deadline of a PrefillShard call (a long document takes a while). Default: 6 h.
  int64_t prefill_timeout_ms = int64_t{6} * 3600 * 1000;
  // Deadline of a RunJob call. Default: 6 h.
  int64_t job_timeout_ms = int64_t{6} * 3600 * 1000;
  // Deadline of a MountShard call (the worker reads the shard's summaries). Default: 10 min.
  int64_t mount_timeout_ms = int64_t{10} * 60 * 1000;
  // Deadline of an UnmountShard call. Default: 30 s.
  int64_t unmount_timeout_ms = 30 * 1000;
  // Deadline of a CancelJob call. Default: 5 s.
  int64_t cancel_timeout_ms = 5000;
};

class GrpcWorkerClient final : public WorkerClient {
 public:
  explicit GrpcWorkerClient(const GrpcWorkerClientOptions& options = {});
  ~GrpcWorkerClient() override;  // Shutdown()

  // Cancels the calls in flight and waits until their on_done callbacks have run; later calls
  // get on_done(CANCELLED) at once. Call it while the receiver of the callbacks (the
  // Coordinator) is still alive. Idempotent.
  void Shutdown();

  void PrefillShard(const v1::WorkerInfo& worker, const v1::PrefillShardRequest& request, ProgressFn on_progress,
                    DoneFn on_done) override;
  void MountShard(const v1::WorkerInfo& worker, const v1::MountShardRequest& request, DoneFn on_done) override;
  void UnmountShard(const v1::WorkerInfo& worker, const v1::UnmountShardRequest& request, DoneFn on_done) override;
  void RunJob(const v1::WorkerInfo& worker, const v1::RunJobRequest& request, JobEventFn on_event,
              DoneFn on_done) override;
  void CancelJob(const v1::WorkerInfo& worker, const std::string& job_id) override;

 private:
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& address);
  // Registers a call; false when shutting down.
  bool Begin(grpc::ClientContext* ctx);
  void End(grpc::ClientContext* ctx);
  // A unary call to `worker` on its own thread with a deadline of `timeout_ms`: `call` issues
  // the RPC over the channel; on_done gets its status (CANCELLED at once when shutting down).
  using UnaryFn = std::function<absl::Status(const std::shared_ptr<grpc::Channel>&, grpc::ClientContext*)>;
  void CallUnary(const v1::WorkerInfo& worker, int64_t timeout_ms, UnaryFn call, DoneFn on_done);

  const GrpcWorkerClientOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, grpc::ClientContext*> job_calls_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_GRPC_WORKER_CLIENT_H_
