#include "coordinator/grpc_worker_client.h"

#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/status_conversion.h"
#include "strata/v1/internal.grpc.pb.h"

namespace strata::coordinator {
namespace {

std::chrono::system_clock::time_point DeadlineIn(int64_t ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

}  // namespace

GrpcWorkerClient::GrpcWorkerClient(const GrpcWorkerClientOptions& options) : options_(options) {}

GrpcWorkerClient::~GrpcWorkerClient() { Shutdown(); }

void GrpcWorkerClient::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_.empty(); };
  mu_.Await(absl::Condition(&idle));
}

std::shared_ptr<grpc::Channel> GrpcWorkerClient::ChannelTo(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  channels_[address] = channel;
  return channel;
}

bool GrpcWorkerClient::Begin(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return false;
  calls_.insert(ctx);
  return true;
}

void GrpcWorkerClient::End(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  calls_.erase(ctx);
  for (auto it = job_calls_.begin(); it != job_calls_.end(); ++it) {
    if (it->second == ctx) {
      job_calls_.erase(it);
      break;
    }
  }
}

void GrpcWorkerClient::PrefillShard(const v1::WorkerInfo& worker, const v1::PrefillShardRequest& request,
                                    ProgressFn on_progress, DoneFn on_done) {
  auto ctx = std::make_shared<grpc::ClientContext>();
  ctx->set_deadline(DeadlineIn(options_.prefill_timeout_ms));
  if (!Begin(ctx.get())) {
    on_done(absl::CancelledError("worker client shutting down"));
    return;
  }
  auto channel = ChannelTo(worker.address());
  std::thread([this, channel, ctx, request, on_progress = std::move(on_progress),
               on_done = std::move(on_done)] {
    auto stub = v1::Worker::NewStub(channel);
    auto reader = stub->PrefillShard(ctx.get(), request);
    v1::PrefillShardProgress p;
    bool complete = false;
    while (reader->Read(&p)) {
      complete |= p.complete();
      on_progress(p);
    }
    absl::Status s = proto::FromGrpcStatus(reader->Finish());
    if (s.ok() && !complete) s = absl::UnavailableError("prefill stream ended without completion");
    on_done(s);
    End(ctx.get());
  }).detach();
}

void GrpcWorkerClient::CallUnary(const v1::WorkerInfo& worker, int64_t timeout_ms, UnaryFn call,
                                 DoneFn on_done) {
  auto ctx = std::make_shared<grpc::ClientContext>();
  ctx->set_deadline(DeadlineIn(timeout_ms));
  if (!Begin(ctx.get())) {
    on_done(absl::CancelledError("worker client shutting down"));
    return;
  }
  auto channel = ChannelTo(worker.address());
  std::thread([this, channel, ctx, call = std::move(call), on_done = std::move(on_done)] {
    on_done(call(channel, ctx.get()));
    End(ctx.get());
  }).detach();
}

void GrpcWorkerClient::MountShard(const v1::WorkerInfo& worker, const v1::MountShardRequest& request,
                                  DoneFn on_done) {
  CallUnary(
      worker, options_.mount_timeout_ms,
      [request](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx) {
        v1::MountShardResponse response;
        return proto::FromGrpcStatus(v1::Worker::NewStub(channel)->MountShard(ctx, request, &response));
      },
      std::move(on_done));
}

void GrpcWorkerClient::UnmountShard(const v1::WorkerInfo& worker, const v1::UnmountShardRequest& request,
                                    DoneFn on_done) {
  CallUnary(
      worker, options_.unmount_timeout_ms,
      [request](const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx) {
        v1::UnmountShardResponse response;
        return proto::FromGrpcStatus(v1::Worker::NewStub(channel)->UnmountShard(ctx, request, &response));
      },
      std::move(on_done));
}

void GrpcWorkerClient::RunJob(const v1::WorkerInfo& worker, const v1::RunJobRequest& request,
                              JobEventFn on_event, DoneFn on_done) {
  auto ctx = std::make_shared<grpc::ClientContext>();
  ctx->set_deadline(DeadlineIn(options_.job_timeout_ms));
  if (!Begin(ctx.get())) {
    on_done(absl::CancelledError("worker client shutting down"));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    job_calls_[request.job_id()] = ctx.get();
  }
  auto channel = ChannelTo(worker.address());
  std::thread([this, channel, ctx, request, on_event = std::move(on_event), on_done = std::move(on_done)] {
    auto stub = v1::Worker::NewStub(channel);
    auto reader = stub->RunJob(ctx.get(), request);
    v1::JobEvent e;
    while (reader->Read(&e)) on_event(e);
    absl::Status s = proto::FromGrpcStatus(reader->Finish());
    on_done(s);
    End(ctx.get());
  }).detach();
}

void GrpcWorkerClient::CancelJob(const v1::WorkerInfo& worker, const std::string& job_id) {
  auto channel = ChannelTo(worker.address());
  auto ctx = std::make_shared<grpc::ClientContext>();
  ctx->set_deadline(DeadlineIn(options_.cancel_timeout_ms));
  if (!Begin(ctx.get())) return;
  std::thread([this, channel, ctx, job_id] {
    auto stub = v1::Worker::NewStub(channel);
    v1::CancelJobRequest req;
    req.set_job_id(job_id);
    v1::CancelJobResponse resp;
    grpc::Status s = stub->CancelJob(ctx.get(), req, &resp);
    End(ctx.get());
    (void)s;  // best effort: the worker also stops the job when its RunJob call is cancelled
  }).detach();
}

}  // namespace strata::coordinator
