#include "worker/service.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/status_conversion.h"
#include "strata/v1/internal.grpc.pb.h"

namespace strata::worker {
namespace {

std::chrono::system_clock::time_point DeadlineIn(int64_t ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

// One selection stream's serving loop, for either transport (the gRPC ShardSelection stream, the
// selection link): the first request must open a session (Worker::OpenSelection); every later
// one must be a query, answered through `write`. Returns OK when `read` ends the stream (the
// client closed it, before or after opening) or `write` fails; INVALID_ARGUMENT when the first
// message is not an open or an open comes twice; the session's errors otherwise. Records the
// answers' timing over `transport` ("link" or "grpc"; Worker::RecordShardAnswers).
absl::Status ServeSelectionStream(Worker* worker, const std::string& transport,
                                  const std::function<bool(v1::SelectionRequest*)>& read,
                                  const std::function<bool(const v1::SelectionResponse&)>& write) {
  v1::SelectionRequest req;
  if (!read(&req)) return absl::OkStatus();  // closed before opening
  if (!req.has_open()) return absl::InvalidArgumentError("the first message must be SelectionOpen");
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ShardSession> session, worker->OpenSelection(req.open()));
  // The answers' time: the session's, and writing them (counted when the stream ends).
  double send_seconds = 0;
  const std::string job_id = req.open().job_id();
  absl::Status status;
  while (read(&req)) {
    if (!req.has_query()) {
      status = absl::InvalidArgumentError("SelectionOpen sent twice");
      break;
    }
    v1::SelectionResponse resp;
    status = session->Answer(req.query(), &resp);
    if (!status.ok()) break;
    const auto t0 = std::chrono::steady_clock::now();
    const bool written = write(resp);
    send_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!written) break;
  }
  ShardAnswerTiming timing = session->answer_timing();
  timing.send_seconds = send_seconds;
  worker->RecordShardAnswers(job_id, timing, transport);
  return status;
}

}  // namespace

absl::Status WorkerServerOptions::Validate() const {
  if (listen_address.empty()) return absl::InvalidArgumentError("listen_address is required");
  if (listen_address.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("listen_address '", listen_address, "' has no port"));
  }
  return absl::OkStatus();
}

// The synchronous Worker service: each call runs on a gRPC server thread.
class WorkerServer::Impl final : public v1::Worker::Service {
 public:
  explicit Impl(Worker* worker) : worker_(worker) {}

  grpc::Status PrefillShard(grpc::ServerContext* context, const v1::PrefillShardRequest* request,
                            grpc::ServerWriter<v1::PrefillShardProgress>* writer) override {
    std::atomic<bool> cancelled{false};
    auto on_progress = [&](const v1::PrefillShardProgress& p) {
      if (context->IsCancelled() || !writer->Write(p)) cancelled.store(true);
    };
    // Cancellation of the call is observed between chunks (at each progress report).
    absl::Status s = worker_->PrefillShard(*request, on_progress, &cancelled);
    if (s.ok() && cancelled.load()) s = absl::CancelledError("the caller went away");
    return proto::ToGrpcStatus(s);
  }

  grpc::Status MountShard(grpc::ServerContext*, const v1::MountShardRequest* request,
                          v1::MountShardResponse* response) override {
    absl::StatusOr<v1::MountShardResponse> r = worker_->MountShard(*request);
    if (!r.ok()) return proto::ToGrpcStatus(r.status());
    *response = *r;
    return grpc::Status::OK;
  }
  grpc::Status UnmountShard(grpc::ServerContext*, const v1::UnmountShardRequest* request,
                            v1::UnmountShardResponse*) override {
    return proto::ToGrpcStatus(worker_->UnmountShard(*request));
  }

  grpc::Status RunJob(grpc::ServerContext* context, const v1::RunJobRequest* request,
                      grpc::ServerWriter<v1::JobEvent>* writer) override {
    auto on_event = [&](const v1::JobEvent& e) { return !context->IsCancelled() && writer->Write(e); };
    return proto::ToGrpcStatus(worker_->RunJob(*request, on_event));
  }

  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* request,
                         v1::CancelJobResponse* response) override {
    response->set_found(worker_->CancelJob(request->job_id()));
    return grpc::Status::OK;
  }

 private:
  Worker* const worker_;
};

// ShardSelection: one stream per job and peer, served by ServeSelectionStream on the call's thread.
class WorkerServer::SelectionImpl final : public v1::ShardSelection::Service {
 public:
  explicit SelectionImpl(Worker* worker) : worker_(worker) {}

  grpc::Status Select(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::SelectionResponse, v1::SelectionRequest>* stream) override {
    return proto::ToGrpcStatus(ServeSelectionStream(
        worker_, "grpc", [&](v1::SelectionRequest* req) { return !context->IsCancelled() && stream->Read(req); },
        [&](const v1::SelectionResponse& resp) { return stream->Write(resp); }));
  }

 private:
  Worker* const worker_;
};

// PeerPages over Worker::GetPeerPages.
class WorkerServer::PeerPagesImpl final : public v1::PeerPages::Service {
 public:
  explicit PeerPagesImpl(Worker* worker) : worker_(worker) {}

  grpc::Status GetPages(grpc::ServerContext* context, const v1::GetPagesRequest* request,
                        grpc::ServerWriter<v1::GetPagesResponse>* writer) override {
    return proto::ToGrpcStatus(worker_->GetPeerPages(
        *request, [&](const v1::GetPagesResponse& r) { return !context->IsCancelled() && writer->Write(r); }));
  }

 private:
  Worker* const worker_;
};

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(const WorkerServerOptions& options,
                                                                  Worker* worker) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<WorkerServer> server(new WorkerServer());
  server->impl_ = std::make_unique<Impl>(worker);
  server->selection_ = std::make_unique<SelectionImpl>(worker);
  server->peer_pages_ = std::make_unique<PeerPagesImpl>(worker);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &server->port_);
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.RegisterService(server->impl_.get());
  builder.RegisterService(server->selection_.get());
  builder.RegisterService(server->peer_pages_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on ", options.listen_address));
  }
  if (options.selection_link_address != "off") {
    std::string link = options.selection_link_address;
    if (link.empty()) link = options.listen_address.substr(0, options.listen_address.rfind(':')) + ":0";
    auto serve = [worker](const auto& read, const auto& write) {
      return ServeSelectionStream(worker, "link", read, write);
    };
    STRATA_ASSIGN_OR_RETURN(server->link_, SelectionLinkServer::Start(link, serve));
  }
  worker->SetSelectionLinkPort(server->selection_link_port());  // 0: the worker advertises none
  server->SetServing(true);
  return server;
}

WorkerServer::~WorkerServer() { Shutdown(absl::Seconds(1)); }

void WorkerServer::SetServing(bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus("strata.v1.Worker", serving);
  health->SetServingStatus("strata.v1.ShardSelection", serving);
  health->SetServingStatus("strata.v1.PeerPages", serving);
}

void WorkerServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_ != nullptr) {
    SetServing(false);
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(grace));
  }
  if (link_ != nullptr) link_->Shutdown();
}

RegistrationAgent::RegistrationAgent(const RegistrationOptions& options, Worker* worker)
    : options_(options), worker_(worker) {
  channel_ = grpc::CreateChannel(options.coordinator, grpc::InsecureChannelCredentials());
}

RegistrationAgent::~RegistrationAgent() { Stop(); }

void RegistrationAgent::Start() {
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

bool RegistrationAgent::WaitRegistered(absl::Duration timeout) {
  return registered_.WaitForNotificationWithTimeout(timeout);
}

void RegistrationAgent::SetDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

void RegistrationAgent::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void RegistrationAgent::Loop() {
  auto stub = v1::WorkerRegistry::NewStub(channel_);
  uint64_t lease = 0;
  int64_t interval_ms = options_.retry_interval_ms;
  auto wait = [&](int64_t ms) {
    absl::MutexLock lock(&mu_);
    auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    mu_.AwaitWithTimeout(absl::Condition(&stopped), absl::Milliseconds(ms));
    return stop_;
  };
  while (true) {
    if (lease == 0) {
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineIn(options_.call_timeout_ms));
      v1::RegisterWorkerRequest req;
      *req.mutable_worker() = worker_->Info();
      v1::RegisterWorkerResponse resp;
      grpc::Status s = stub->Register(&ctx, req, &resp);
      if (s.ok()) {
        lease = resp.lease_id();
        interval_ms = resp.heartbeat_interval_ms() > 0 ? resp.heartbeat_interval_ms() : 1000;
        STRATA_LOG(INFO) << "worker " << worker_->options().worker_id << " registered with " << options_.coordinator
                         << " lease=" << lease;
        // A later registration (after NOT_FOUND, e.g. a restarted coordinator) must not notify
        // again: absl::Notification aborts on a second Notify.
        if (!registered_.HasBeenNotified()) registered_.Notify();
      } else {
        STRATA_LOG(WARNING) << "worker: registration with " << options_.coordinator << " failed: "
                            << s.error_message() << " (code " << s.error_code() << ")";
        if (wait(options_.retry_interval_ms)) break;
        continue;
      }
    }
    if (wait(interval_ms)) break;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(options_.call_timeout_ms));
    v1::HeartbeatRequest req;
    req.set_worker_id(worker_->options().worker_id);
    req.set_lease_id(lease);
    *req.mutable_load() = worker_->Load();
    for (const v1::ShardRange& r : worker_->MountedShards()) *req.add_mounted_shards() = r;
    {
      absl::MutexLock lock(&mu_);
      req.set_draining(draining_);
    }
    v1::HeartbeatResponse resp;
    grpc::Status s = stub->Heartbeat(&ctx, req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      lease = 0;  // register again
    } else if (s.ok()) {
      for (const std::string& id : resp.cancel_job_ids()) worker_->CancelJob(id);
    }
  }
  if (lease != 0) {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(options_.call_timeout_ms));
    v1::DeregisterWorkerRequest req;
    req.set_worker_id(worker_->options().worker_id);
    req.set_lease_id(lease);
    v1::DeregisterWorkerResponse resp;
    stub->Deregister(&ctx, req, &resp);  // best effort
  }
}

}  // namespace strata::worker
