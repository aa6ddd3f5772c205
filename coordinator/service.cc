#include "coordinator/service.h"

#include <atomic>
#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "coordinator/job_state.h"
#include "coordinator/metrics.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/status_conversion.h"
#include "strata/v1/api.grpc.pb.h"
#include "strata/v1/internal.grpc.pb.h"

namespace strata::coordinator {
namespace {

using proto::ToGrpcStatus;

constexpr const char* kServiceNames[] = {"", "strata.v1.DocumentService", "strata.v1.JobService",
                                         "strata.v1.WorkerRegistry"};

void Count(CoordinatorMetrics* metrics, const char* method, const absl::Status& s) {
  if (metrics != nullptr) metrics->CountRequest(method, s);
}

// Finishes a unary call with `s`.
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, CoordinatorMetrics* metrics,
                                const char* method, const absl::Status& s) {
  Count(metrics, method, s);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

// A server-streaming reactor fed by coordinator callbacks: messages are queued and written one at
// a time; StartWrite and Finish are never called with mu_ held (reactions may run inline).
template <typename Msg>
class QueuedWriter : public grpc::ServerWriteReactor<Msg> {
 public:
  QueuedWriter(CoordinatorMetrics* metrics, const char* method) : metrics_(metrics), method_(method) {}

 protected:
  // Queues `msg`; `last` finishes the stream with `final_status` once everything is written.
  void Enqueue(Msg msg, bool last, const absl::Status& final_status) {
    const Msg* to_write = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (closing_) return;
      queue_.push_back(std::move(msg));
      if (last) {
        closing_ = true;
        final_ = final_status;
      }
      if (!writing_) {
        writing_ = true;
        to_write = &queue_.front();
      }
    }
    if (to_write != nullptr) this->StartWrite(to_write);
  }

  // Finishes with `s` after the writes in flight (nothing more is queued).
  void Close(const absl::Status& s) {
    bool finish_now = false;
    {
      absl::MutexLock lock(&mu_);
      if (closing_) return;
      closing_ = true;
      final_ = s;
      finish_now = !writing_;
      if (finish_now) finished_ = true;
    }
    if (finish_now) FinishWith(s);
  }

  void OnWriteDone(bool ok) override {
    const Msg* to_write = nullptr;
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (!ok) {  // the client is gone
        closing_ = true;
        queue_.clear();
        final_ = absl::CancelledError("client went away");
      }
      if (!queue_.empty()) {
        to_write = &queue_.front();
      } else {
        writing_ = false;
        if (closing_ && !finished_) {
          finished_ = true;
          finish = final_;
        }
      }
    }
    if (to_write != nullptr) this->StartWrite(to_write);
    if (finish.has_value()) FinishWith(*finish);
  }

 private:
  void FinishWith(const absl::Status& s) {
    Count(metrics_, method_, s);
    this->Finish(ToGrpcStatus(s));
  }

  CoordinatorMetrics* const metrics_;
  const char* const method_;
  absl::Mutex mu_;
  std::deque<Msg> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status final_ ABSL_GUARDED_BY(mu_);
};

// JobService.Watch and JobService.Generate: streams a job's events until a terminal snapshot.
class JobStreamReactor : public QueuedWriter<v1::JobEvent>, public JobObserver {
 public:
  JobStreamReactor(Coordinator* coordinator, CoordinatorMetrics* metrics, const char* method,
                   bool cancel_job_with_call)
      : QueuedWriter(metrics, method), coordinator_(coordinator), cancel_job_with_call_(cancel_job_with_call) {}

  void Begin(const std::string& job_id) {
    job_id_ = job_id;
    absl::Status s = coordinator_->WatchJob(job_id, this);
    if (!s.ok()) Close(s);
  }
  void Fail(const absl::Status& s) { Close(s); }

  // Called with the coordinator's lock held.
  void OnJobEvent(const v1::JobEvent& event) override {
    v1::JobEvent numbered = event;
    numbered.set_sequence(++sequence_);
    const bool last = event.has_snapshot() && IsTerminal(event.snapshot().state());
    if (last) terminal_ = true;
    Enqueue(std::move(numbered), last, absl::OkStatus());
  }

  void OnCancel() override {
    if (cancel_job_with_call_ && !job_id_.empty() && !terminal_) {
      // Cancelling a Generate call cancels its job (a job that finished meanwhile stays as it is).
      coordinator_->CancelJob(job_id_).IgnoreError();
    }
    Close(absl::CancelledError("call cancelled"));
  }

  void OnDone() override {
    if (!job_id_.empty()) coordinator_->UnwatchJob(job_id_, this);
    delete this;
  }

 private:
  Coordinator* const coordinator_;
  const bool cancel_job_with_call_;
  std::string job_id_;
  uint64_t sequence_ = 0;             // only touched under the coordinator's lock
  std::atomic<bool> terminal_{false};
};

// DocumentService.Watch.
class DocumentWatchReactor : public QueuedWriter<v1::DocumentInfo>, public DocumentObserver {
 public:
  DocumentWatchReactor(Coordinator* coordinator, CoordinatorMetrics* metrics)
      : QueuedWriter(metrics, "DocumentService.Watch"), coordinator_(coordinator) {}

  void Begin(const std::string& document_id) {
    document_id_ = document_id;
    absl::Status s = coordinator_->WatchDocument(document_id, this);
    if (!s.ok()) Close(s);
  }

  void OnDocument(const absl::Status& status, const v1::DocumentInfo& info) override {
    if (!status.ok()) {
      Close(status);
      return;
    }
    const bool last = info.state() == v1::DocumentInfo::READY || info.state() == v1::DocumentInfo::FAILED;
    Enqueue(info, last, absl::OkStatus());
  }

  void OnCancel() override { Close(absl::CancelledError("call cancelled")); }

  void OnDone() override {
    coordinator_->UnwatchDocument(document_id_, this);
    delete this;
  }

 private:
  Coordinator* const coordinator_;
  std::string document_id_;
};

// DocumentService.Upload: accumulates the client stream, enforcing the size limits as it reads.
class UploadReactor : public grpc::ServerReadReactor<v1::DocumentUploadRequest> {
 public:
  UploadReactor(Coordinator* coordinator, CoordinatorMetrics* metrics, const ValidationLimits& limits,
                v1::DocumentUploadResponse* response)
      : coordinator_(coordinator), metrics_(metrics), limits_(limits), response_(response) {
    if (coordinator_->draining()) {
      Done(absl::UnavailableError("server is draining; retry on another replica"));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client finished sending
      absl::StatusOr<v1::DocumentUploadResponse> r = coordinator_->UploadDocument(options_, content_);
      if (r.ok()) *response_ = *std::move(r);
      Done(r.status());
      return;
    }
    absl::Status s = Absorb();
    if (!s.ok()) {
      Done(s);
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  absl::Status Absorb() {
    if (request_.has_options()) {
      if (messages_ > 0) return absl::InvalidArgumentError("upload options must come in the first message");
      options_ = request_.options();
    }
    ++messages_;
    switch (request_.content_case()) {
      case v1::DocumentUploadRequest::kText:
        if (kind_ == v1::DocumentUploadRequest::kTokens) {
          return absl::InvalidArgumentError("an upload is either text or token ids, not both");
        }
        kind_ = v1::DocumentUploadRequest::kText;
        content_.is_text = true;
        if (static_cast<int64_t>(content_.text.size() + request_.text().size()) > limits_.max_upload_bytes) {
          return absl::ResourceExhaustedError(
              absl::StrCat("upload exceeds the limit of ", limits_.max_upload_bytes, " bytes of text"));
        }
        content_.text.append(request_.text());
        break;
      case v1::DocumentUploadRequest::kTokens:
        if (kind_ == v1::DocumentUploadRequest::kText) {
          return absl::InvalidArgumentError("an upload is either text or token ids, not both");
        }
        kind_ = v1::DocumentUploadRequest::kTokens;
        if (static_cast<int64_t>(content_.tokens.size() + request_.tokens().ids_size()) >
            limits_.max_document_tokens) {
          return absl::ResourceExhaustedError(
              absl::StrCat("upload exceeds the limit of ", limits_.max_document_tokens, " tokens"));
        }
        content_.tokens.insert(content_.tokens.end(), request_.tokens().ids().begin(), request_.tokens().ids().end());
        break;
      case v1::DocumentUploadRequest::CONTENT_NOT_SET:
        break;
    }
    return absl::OkStatus();
  }

  void Done(const absl::Status& s) {
    Count(metrics_, "DocumentService.Upload", s);
    Finish(ToGrpcStatus(s));
  }

  Coordinator* const coordinator_;
  CoordinatorMetrics* const metrics_;
  const ValidationLimits limits_;
  v1::DocumentUploadResponse* const response_;
  v1::DocumentUploadRequest request_;
  v1::DocumentUploadOptions options_;
  DocumentContent content_;
  v1::DocumentUploadRequest::ContentCase kind_ = v1::DocumentUploadRequest::CONTENT_NOT_SET;
  int64_t messages_ = 0;
};

class DocumentServiceImpl final : public v1::DocumentService::CallbackService {
 public:
  DocumentServiceImpl(Coordinator* c, CoordinatorMetrics* m, const ValidationLimits& limits)
      : c_(c), m_(m), limits_(limits) {}

  grpc::ServerReadReactor<v1::DocumentUploadRequest>* Upload(grpc::CallbackServerContext*,
                                                             v1::DocumentUploadResponse* response) override {
    return new UploadReactor(c_, m_, limits_, response);
  }
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::DocumentGetRequest* request,
                                v1::DocumentInfo* response) override {
    auto r = c_->GetDocument(request->document_id());
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "DocumentService.Get", r.status());
  }
  grpc::ServerWriteReactor<v1::DocumentInfo>* Watch(grpc::CallbackServerContext*,
                                                    const v1::DocumentWatchRequest* request) override {
    auto* reactor = new DocumentWatchReactor(c_, m_);
    reactor->Begin(request->document_id());
    return reactor;
  }
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const v1::DocumentListRequest* request,
                                 v1::DocumentListResponse* response) override {
    auto r = c_->ListDocuments(*request);
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "DocumentService.List", r.status());
  }
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx, const v1::DocumentDeleteRequest* request,
                                   v1::DocumentDeleteResponse*) override {
    return Reply(ctx, m_, "DocumentService.Delete", c_->DeleteDocument(request->document_id()));
  }
  grpc::ServerUnaryReactor* Pin(grpc::CallbackServerContext* ctx, const v1::DocumentPinRequest* request,
                                v1::DocumentInfo* response) override {
    auto r = c_->PinDocument(*request);
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "DocumentService.Pin", r.status());
  }

 private:
  Coordinator* const c_;
  CoordinatorMetrics* const m_;
  const ValidationLimits limits_;
};

class JobServiceImpl final : public v1::JobService::CallbackService {
 public:
  JobServiceImpl(Coordinator* c, CoordinatorMetrics* m) : c_(c), m_(m) {}

  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* ctx, const v1::JobSubmitRequest* request,
                                   v1::JobInfo* response) override {
    auto r = c_->SubmitJob(*request);
    if (r.ok()) {
      *response = *std::move(r);
      c_->Tick();  // dispatch at once when a worker is free
    }
    return Reply(ctx, m_, "JobService.Submit", r.status());
  }
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::JobGetRequest* request,
                                v1::JobInfo* response) override {
    auto r = c_->GetJob(request->job_id());
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "JobService.Get", r.status());
  }
  grpc::ServerWriteReactor<v1::JobEvent>* Watch(grpc::CallbackServerContext*,
                                                const v1::JobWatchRequest* request) override {
    auto* reactor = new JobStreamReactor(c_, m_, "JobService.Watch", /*cancel_job_with_call=*/false);
    reactor->Begin(request->job_id());
    return reactor;
  }
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* ctx, const v1::JobCancelRequest* request,
                                   v1::JobInfo* response) override {
    auto r = c_->CancelJob(request->job_id());
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "JobService.Cancel", r.status());
  }
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const v1::JobListRequest* request,
                                 v1::JobListResponse* response) override {
    auto r = c_->ListJobs(*request);
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "JobService.List", r.status());
  }
  grpc::ServerWriteReactor<v1::JobEvent>* Generate(grpc::CallbackServerContext*,
                                                   const v1::JobSubmitRequest* request) override {
    auto* reactor = new JobStreamReactor(c_, m_, "JobService.Generate", /*cancel_job_with_call=*/true);
    auto job = c_->SubmitJob(*request);
    if (!job.ok()) {
      reactor->Fail(job.status());
      return reactor;
    }
    reactor->Begin(job->job_id());
    c_->Tick();
    return reactor;
  }

 private:
  Coordinator* const c_;
  CoordinatorMetrics* const m_;
};

class WorkerRegistryImpl final : public v1::WorkerRegistry::CallbackService {
 public:
  WorkerRegistryImpl(Coordinator* c, CoordinatorMetrics* m) : c_(c), m_(m) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterWorkerRequest* request,
                                     v1::RegisterWorkerResponse* response) override {
    auto r = c_->RegisterWorker(*request);
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "WorkerRegistry.Register", r.status());
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override {
    auto r = c_->Heartbeat(*request);
    if (r.ok()) *response = *std::move(r);
    return Reply(ctx, m_, "WorkerRegistry.Heartbeat", r.status());
  }
  grpc::ServerUnaryReactor* Deregister(grpc::CallbackServerContext* ctx,
                                       const v1::DeregisterWorkerRequest* request,
                                       v1::DeregisterWorkerResponse*) override {
    return Reply(ctx, m_, "WorkerRegistry.Deregister", c_->DeregisterWorker(*request));
  }

 private:
  Coordinator* const c_;
  CoordinatorMetrics* const m_;
};

}  // namespace

class CoordinatorServer::Services {
 public:
  Services(Coordinator* c, CoordinatorMetrics* m, const ValidationLimits& limits)
      : documents(c, m, limits), jobs(c, m), registry(c, m) {}
  DocumentServiceImpl documents;
  JobServiceImpl jobs;
  WorkerRegistryImpl registry;
};

absl::Status CoordinatorServerOptions::Validate() const {
  if (listen_address.empty()) return absl::InvalidArgumentError("listen address is empty");
  if (tick_interval_ms <= 0) return absl::InvalidArgumentError("tick_interval_ms must be > 0");
  if (max_message_bytes <= 0 || max_message_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError("max_message_bytes must be in [1, 2^31)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorServerOptions& options, Coordinator* coordinator, CoordinatorMetrics* metrics) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<CoordinatorServer> server(new CoordinatorServer());
  server->coordinator_ = coordinator;
  server->tick_interval_ms_ = options.tick_interval_ms;
  server->services_ = std::make_unique<Services>(coordinator, metrics, coordinator->limits());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(&server->services_->documents);
  builder.RegisterService(&server->services_->jobs);
  builder.RegisterService(&server->services_->registry);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve gRPC on ", options.listen_address));
  }
  server->SetServing(true);
  server->ticker_ = std::thread([s = server.get()] { s->TickLoop(); });
  return server;
}

CoordinatorServer::~CoordinatorServer() {
  Shutdown(absl::Seconds(1));
  if (ticker_.joinable()) ticker_.join();
}

void CoordinatorServer::SetServing(bool serving) {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  for (const char* name : kServiceNames) health->SetServingStatus(name, serving);
}

void CoordinatorServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (server_ != nullptr) {
    SetServing(false);
    server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(grace));
  }
}

void CoordinatorServer::TickLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(tick_interval_ms_));
      if (stopping_) return;
    }
    coordinator_->Tick();
  }
}

int64_t DrainAndShutdown(Coordinator* coordinator, CoordinatorServer* server, absl::Duration timeout,
                         absl::Duration grace) {
  coordinator->StartDrain();
  server->SetServing(false);
  const absl::Time deadline = absl::Now() + timeout;
  while (coordinator->RunningJobs() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  const int64_t handed_back = coordinator->RunningJobs();
  if (handed_back > 0) coordinator->HandBackRunningJobs();
  server->Shutdown(grace);
  return handed_back;
}

}  // namespace strata::coordinator
