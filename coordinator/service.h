// The coordinator's gRPC server: DocumentService, JobService (public, api.proto) and
// WorkerRegistry (internal.proto) as thin callback-API adapters over a Coordinator, plus the
// gRPC health service (grpc.health.v1, per-service names) and server reflection, and a thread
// that runs Coordinator::Tick periodically.
//
// Health: "" and every served service name report SERVING until SetServing(false) (drain).
// Thread-safe.
#ifndef STRATA_COORDINATOR_SERVICE_H_
#define STRATA_COORDINATOR_SERVICE_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/coordinator.h"

namespace grpc {
class Server;
}

namespace strata::coordinator {

struct CoordinatorServerOptions {
  // gRPC listen address, "host:port"; port 0 picks a free port (see port()). Required.
  std::string listen_address = "127.0.0.1:7700";
  // Period of Coordinator::Tick (worker expiry, placement, dispatch). Default: 200 ms.
  int64_t tick_interval_ms = 200;
  // Largest accepted request message. Uploads are streamed, so this bounds one chunk. Default: 16 MiB.
  int64_t max_message_bytes = int64_t{16} << 20;

  // InvalidArgument for an empty address or non-positive interval / size.
  absl::Status Validate() const;
};

class CoordinatorServer {
 public:
  // Builds and starts the server. `coordinator` must outlive it; `metrics` may be null.
  // INVALID_ARGUMENT for bad options; UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorServerOptions& options,
                                                                  Coordinator* coordinator,
                                                                  CoordinatorMetrics* metrics);
  // Shuts down (if not done) and joins the tick thread.
  ~CoordinatorServer();

  // The bound port.
  int port() const { return port_; }
  // Sets the health status of every served service name.
  void SetServing(bool serving);
  // Stops accepting calls; calls still running after `grace` are cancelled. Idempotent.
  void Shutdown(absl::Duration grace);

  class Services;  // the service implementations (service.cc)

 private:
  CoordinatorServer() = default;
  void TickLoop();

  Coordinator* coordinator_ = nullptr;
  int64_t tick_interval_ms_ = 200;
  int port_ = 0;
  std::unique_ptr<Services> services_;
  std::unique_ptr<grpc::Server> server_;
  std::thread ticker_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

// The SIGTERM sequence: health turns NOT_SERVING and the coordinator stops admitting work
// (uploads and submissions get UNAVAILABLE), running jobs get `timeout` to finish, those still
// running are handed back (QUEUED in the catalog, their leaders told to stop), then the server
// shuts down with `grace` for calls in flight. Returns the number of jobs handed back.
int64_t DrainAndShutdown(Coordinator* coordinator, CoordinatorServer* server, absl::Duration timeout,
                         absl::Duration grace);

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_SERVICE_H_
