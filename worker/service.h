// The worker's gRPC side: the internal Worker service (internal.proto) over a worker::Worker,
// with grpc.health.v1 and server reflection; and the registration agent that registers the
// worker with the coordinator's WorkerRegistry and heartbeats (re-registering on NOT_FOUND,
// stopping jobs the coordinator lists in cancel_job_ids).
//
// The same server also serves ShardSelection (internal.proto) over Worker::OpenSelection: one
// stream per job and peer, SelectionOpen first, then one SelectionResponse per LayerQuery, in
// order; a bad first message or query ends the stream with INVALID_ARGUMENT, mount errors with
// their code. MountShard / UnmountShard call Worker::MountShard / UnmountShard; heartbeats carry
// Load() (mounted_tokens) and MountedShards(). PeerPages is served over Worker::GetPeerPages
// (the worker's store: host cache, then its durable tiers).
//
// Beside the gRPC server, WorkerServer serves the same selection streams over the selection link
// (worker/selection_link.h: plain TCP, the transport leaders take for a decode layer's round trip)
// and reports its port to the worker (Worker::SetSelectionLinkPort), whose Info() advertises it.
//
// Thread-safe.
#ifndef STRATA_WORKER_SERVICE_H_
#define STRATA_WORKER_SERVICE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "worker/selection_link.h"
#include "worker/worker.h"

namespace grpc {
class Server;
class Channel;
}  // namespace grpc

namespace strata::worker {

struct WorkerServerOptions {
  // gRPC listen address; port 0 picks a free one (see port()). Required.
  std::string listen_address = "127.0.0.1:0";
  // Where the selection link listens ("host:port", port 0: a free one): empty for listen_address's
  // host and a free port, "off" for no link (leaders then use the gRPC stream).
  std::string selection_link_address;

  absl::Status Validate() const;
};

class WorkerServer {
 public:
  // Starts serving `worker` (must outlive the server). UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(const WorkerServerOptions& options, Worker* worker);
  ~WorkerServer();

  int port() const { return port_; }
  // The selection link's port; 0 when it is off.
  int selection_link_port() const { return link_ != nullptr ? link_->port() : 0; }
  // Health of every served name.
  void SetServing(bool serving);
  // Stops accepting calls; running calls get `grace`, then are cancelled; the selection link's
  // connections end. Idempotent.
  void Shutdown(absl::Duration grace);

  class Impl;
  class SelectionImpl;
  class PeerPagesImpl;

 private:
  WorkerServer() = default;
  int port_ = 0;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<SelectionImpl> selection_;
  std::unique_ptr<PeerPagesImpl> peer_pages_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<SelectionLinkServer> link_;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

struct RegistrationOptions {
  // Coordinator address ("host:port"). Required.
  std::string coordinator;
  // Deadline of every registry call. Default 5 s.
  int64_t call_timeout_ms = 5000;
  // Delay between failed registration attempts. Default 500 ms.
  int64_t retry_interval_ms = 500;
};

// Registers `worker` and heartbeats in a background thread until Stop().
class RegistrationAgent {
 public:
  RegistrationAgent(const RegistrationOptions& options, Worker* worker);
  ~RegistrationAgent();  // Stop()

  void Start();
  // Waits until the first registration succeeded or `timeout` passed; true when registered.
  bool WaitRegistered(absl::Duration timeout);
  // Sends draining = true in the following heartbeats.
  void SetDraining();
  // Deregisters (best effort) and joins the thread. Idempotent.
  void Stop();

 private:
  void Loop();

  const RegistrationOptions options_;
  Worker* const worker_;
  std::shared_ptr<grpc::Channel> channel_;
  std::thread thread_;
  absl::Notification registered_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ = false;
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_SERVICE_H_
