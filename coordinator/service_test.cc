#include "coordinator/service.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "coordinator/testing/fake_worker_client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/testing/random_requests.h"
#include "strata/v1/api.grpc.pb.h"

namespace strata::coordinator {
namespace {

using v1::JobInfo;

// grpc.health.v1.Health/Check of the overall server ("") through the generic stub (the health
// client stubs are not installed): 1 SERVING, 2 NOT_SERVING, -1 when the call fails.
int HealthOf(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto call = stub.PrepareCall(&ctx, "/grpc.health.v1.Health/Check", &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer empty_request;
  grpc::Slice nothing("");
  empty_request = grpc::ByteBuffer(&nothing, 1);
  call->Write(empty_request, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  call->WritesDone(reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  const bool got = ok;
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok() || !got) return -1;
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return bytes.size() == 2 && bytes[0] == '\x08' ? bytes[1] : -1;
}

// The gRPC adapters against an in-process server whose workers are a FakeWorkerClient.
class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_service_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    CatalogOptions catalog_options;
    catalog_options.path = dir_;
    catalog_options.sync_writes = false;
    auto catalog = Catalog::Open(catalog_options);
    ASSERT_TRUE(catalog.ok()) << catalog.status();
    CoordinatorOptions options;
    options.limits.vocab_size = 1000;
    options.random_seed = 99;
    coordinator_ = std::make_unique<Coordinator>(options, *std::move(catalog), &workers_, nullptr,
                                                 &MonotonicNanos, &WallMicros);
    STRATA_ASSERT_OK(coordinator_->Start());
    CoordinatorServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.tick_interval_ms = 20;
    auto server = CoordinatorServer::Start(server_options, coordinator_.get(), nullptr);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials());
    channel_ = channel;
    jobs_ = v1::JobService::NewStub(channel);
    documents_ = v1::DocumentService::NewStub(channel);
  }
  void TearDown() override {
    server_.reset();
    coordinator_.reset();
    std::filesystem::remove_all(dir_);
  }
  void RegisterWorker() {
    v1::RegisterWorkerRequest r;
    r.mutable_worker()->set_worker_id("w1");
    r.mutable_worker()->set_address("127.0.0.1:1");
    r.mutable_worker()->set_capacity_tokens(1 << 20);
    r.mutable_worker()->set_max_jobs(4);
    STRATA_ASSERT_OK(coordinator_->RegisterWorker(r));
  }
  // Waits (bounded) until the fake has `n` RunJob calls.
  bool WaitForRuns(size_t n) {
    for (int i = 0; i < 500; ++i) {
      if (workers_.runs().size() >= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  static void Deadline(grpc::ClientContext* ctx, int seconds = 10) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }
  static v1::JobSubmitRequest PromptOnly() {
    v1::JobSubmitRequest r;
    r.mutable_prompt_tokens()->add_ids(1);
    r.mutable_prompt_tokens()->add_ids(2);
    r.mutable_params()->set_max_tokens(4);
    return r;
  }

  std::string dir_;
  testing::FakeWorkerClient workers_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::DocumentService::Stub> documents_;
};

// Given a worker, when a client calls Generate, then it receives the snapshots, the tokens the
// leader streams and a final snapshot with usage, numbered 1, 2, 3, ...
TEST_F(ServiceTest, GenerateRelaysTheLeadersEvents) {
  RegisterWorker();
  grpc::ClientContext ctx;
  Deadline(&ctx);
  auto reader = jobs_->Generate(&ctx, PromptOnly());
  // The first event is the snapshot taken when the stream subscribed (QUEUED, or PREFILLING when
  // the tick thread dispatched the job first); later events all reach the stream.
  std::vector<v1::JobEvent> events(1);
  ASSERT_TRUE(reader->Read(&events[0]));
  ASSERT_TRUE(events[0].has_snapshot());
  EXPECT_TRUE(events[0].snapshot().state() == JobInfo::QUEUED || events[0].snapshot().state() == JobInfo::PREFILLING);
  ASSERT_TRUE(WaitForRuns(1));
  auto run = workers_.runs()[0];
  EXPECT_EQ(run.request.prompt_token_ids_size(), 2);
  for (const char* piece : {"Hel", "lo"}) {
    v1::JobEvent e;
    e.mutable_tokens()->add_token_ids(7);
    e.mutable_tokens()->set_text(piece);
    run.on_event(e);
  }
  v1::JobEvent last;
  last.mutable_snapshot()->set_state(JobInfo::DONE);
  last.mutable_snapshot()->set_finish_reason(JobInfo::STOP);
  last.mutable_snapshot()->mutable_usage()->set_completion_tokens(2);
  last.mutable_snapshot()->mutable_usage()->set_mean_attended_tokens(2.5);
  last.mutable_snapshot()->mutable_usage()->mutable_pages_fetched()->set_gpu(3);
  run.on_event(last);
  run.on_done(absl::OkStatus());

  v1::JobEvent e;
  while (reader->Read(&e)) events.push_back(e);
  grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_GE(events.size(), 4u);
  for (size_t i = 0; i < events.size(); ++i) EXPECT_EQ(events[i].sequence(), i + 1);
  std::string text;
  for (const auto& ev : events) {
    if (ev.has_tokens()) text += ev.tokens().text();
  }
  EXPECT_EQ(text, "Hello");
  const JobInfo& final_job = events.back().snapshot();
  EXPECT_EQ(final_job.state(), JobInfo::DONE);
  EXPECT_EQ(final_job.output_text(), "Hello");
  EXPECT_EQ(final_job.usage().prompt_tokens(), 2u);
  EXPECT_EQ(final_job.usage().completion_tokens(), 2u);
  EXPECT_DOUBLE_EQ(final_job.usage().mean_attended_tokens(), 2.5);
  EXPECT_EQ(final_job.usage().pages_fetched().gpu(), 3u);
}

// Given a client watching a running job, when another client cancels it, then the watcher gets
// a CANCELLED snapshot and the stream ends OK, and the leader is told to stop.
TEST_F(ServiceTest, WatchSeesCancellation) {
  RegisterWorker();
  grpc::ClientContext submit_ctx;
  Deadline(&submit_ctx);
  JobInfo job;
  ASSERT_TRUE(jobs_->Submit(&submit_ctx, PromptOnly(), &job).ok());
  ASSERT_TRUE(WaitForRuns(1));
  grpc::ClientContext watch_ctx;
  Deadline(&watch_ctx);
  v1::JobWatchRequest watch;
  watch.set_job_id(job.job_id());
  auto reader = jobs_->Watch(&watch_ctx, watch);
  v1::JobEvent e;
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.snapshot().state(), JobInfo::PREFILLING);
  grpc::ClientContext cancel_ctx;
  Deadline(&cancel_ctx);
  v1::JobCancelRequest cancel;
  cancel.set_job_id(job.job_id());
  JobInfo cancelled;
  ASSERT_TRUE(jobs_->Cancel(&cancel_ctx, cancel, &cancelled).ok());
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.snapshot().state(), JobInfo::CANCELLED);
  EXPECT_FALSE(reader->Read(&e));
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_EQ(workers_.cancels().size(), 1u);
  EXPECT_EQ(workers_.cancels()[0].second, job.job_id());
}

TEST_F(ServiceTest, UploadStreamErrors) {
  {  // text without a tokenizer
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DocumentUploadResponse response;
    auto writer = documents_->Upload(&ctx, &response);
    v1::DocumentUploadRequest r;
    r.set_text("hello");
    writer->Write(r);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  {  // options after the first message
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DocumentUploadResponse response;
    auto writer = documents_->Upload(&ctx, &response);
    v1::DocumentUploadRequest r;
    r.mutable_tokens()->add_ids(1);
    writer->Write(r);
    r.mutable_options()->set_pin(true);
    writer->Write(r);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // a good upload in many small messages
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DocumentUploadResponse response;
    auto writer = documents_->Upload(&ctx, &response);
    for (int i = 0; i < 50; ++i) {
      v1::DocumentUploadRequest r;
      r.mutable_tokens()->add_ids(i);
      ASSERT_TRUE(writer->Write(r));
    }
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
    EXPECT_EQ(response.document().num_tokens(), 50u);
    EXPECT_TRUE(response.created());
  }
}

// Given a running job, when the server drains, then health turns NOT_SERVING, submissions get
// UNAVAILABLE, and after the drain timeout the job is handed back to the queue and its leader
// is told to stop.
TEST_F(ServiceTest, DrainHandsBackRunningJobs) {
  RegisterWorker();
  EXPECT_EQ(HealthOf(channel_), 1);
  grpc::ClientContext submit_ctx;
  Deadline(&submit_ctx);
  JobInfo job;
  ASSERT_TRUE(jobs_->Submit(&submit_ctx, PromptOnly(), &job).ok());
  ASSERT_TRUE(WaitForRuns(1));
  int64_t handed_back = -1;
  std::thread drain([&] {
    handed_back = DrainAndShutdown(coordinator_.get(), server_.get(), absl::Milliseconds(600), absl::Seconds(1));
  });
  // While draining (the job still runs): NOT_SERVING, and no new work.
  int health = 0;
  for (int i = 0; i < 100 && (health = HealthOf(channel_)) != 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(health, 2);
  grpc::ClientContext refused_ctx;
  Deadline(&refused_ctx);
  JobInfo refused;
  EXPECT_EQ(jobs_->Submit(&refused_ctx, PromptOnly(), &refused).error_code(), grpc::StatusCode::UNAVAILABLE);
  drain.join();
  EXPECT_EQ(handed_back, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo after, coordinator_->GetJob(job.job_id()));
  EXPECT_EQ(after.state(), JobInfo::QUEUED);
  ASSERT_EQ(workers_.cancels().size(), 1u);
}

// Given a running job, when it finishes during the drain, then nothing is handed back.
TEST_F(ServiceTest, DrainWaitsForJobsThatFinish) {
  RegisterWorker();
  grpc::ClientContext submit_ctx;
  Deadline(&submit_ctx);
  JobInfo job;
  ASSERT_TRUE(jobs_->Submit(&submit_ctx, PromptOnly(), &job).ok());
  ASSERT_TRUE(WaitForRuns(1));
  int64_t handed_back = -1;
  std::thread drain([&] {
    handed_back = DrainAndShutdown(coordinator_.get(), server_.get(), absl::Seconds(20), absl::Seconds(1));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto run = workers_.runs()[0];
  v1::JobEvent done;
  done.mutable_snapshot()->set_state(JobInfo::DONE);
  run.on_event(done);
  run.on_done(absl::OkStatus());
  drain.join();
  EXPECT_EQ(handed_back, 0);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo after, coordinator_->GetJob(job.job_id()));
  EXPECT_EQ(after.state(), JobInfo::DONE);
  EXPECT_TRUE(workers_.cancels().empty());
}

// No request harms the coordinator: random requests (fields near the valid values, the edges of
// each type, unknown enum numbers, the ids of a real job, document and worker) and valid requests
// with a few fields changed, to every method of its three services, get an answer or a canonical
// error, never UNKNOWN, INTERNAL or UNIMPLEMENTED; the server then still serves.
TEST_F(ServiceTest, RandomRequestsGetCanonicalAnswers) {
  v1::RegisterWorkerRequest reg;
  reg.mutable_worker()->set_worker_id("w1");
  reg.mutable_worker()->set_address("127.0.0.1:1");
  reg.mutable_worker()->set_capacity_tokens(1 << 20);
  reg.mutable_worker()->set_max_jobs(4);
  STRATA_ASSERT_OK_AND_ASSIGN(const v1::RegisterWorkerResponse lease, coordinator_->RegisterWorker(reg));
  grpc::ClientContext submit_ctx;
  Deadline(&submit_ctx);
  JobInfo job;
  ASSERT_TRUE(jobs_->Submit(&submit_ctx, PromptOnly(), &job).ok());
  v1::DocumentUploadRequest upload;
  for (int i = 0; i < 300; ++i) upload.mutable_tokens()->add_ids(i % 1000);
  std::string document_id;
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DocumentUploadResponse response;
    auto writer = documents_->Upload(&ctx, &response);
    ASSERT_TRUE(writer->Write(upload));
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
    document_id = response.document().document_id();
  }
  proto::testing::RandomRequestOptions o;
  o.known_strings = {job.job_id(), document_id, "w1", "tokenselect", "quest", "dense", "streaming"};
  auto seed = [&o](const std::string& method, const google::protobuf::Message& m) {
    o.seeds[method].push_back({m.SerializeAsString()});
  };
  v1::JobSubmitRequest on_doc = PromptOnly();
  on_doc.set_document_id(document_id);
  on_doc.mutable_policy()->set_name("tokenselect");
  on_doc.mutable_policy()->set_budget_tokens(64);
  for (const v1::JobSubmitRequest& r : {PromptOnly(), on_doc}) {
    seed("Submit", r);
    seed("Generate", r);
  }
  o.seeds["Upload"].push_back({upload.SerializeAsString(), upload.SerializeAsString()});
  v1::JobGetRequest job_ref;
  job_ref.set_job_id(job.job_id());
  for (const char* m : {"Get", "Watch", "Cancel"}) seed(m, job_ref);  // JobService's (same fields)
  v1::DocumentPinRequest doc_ref;
  doc_ref.set_document_id(document_id);
  doc_ref.set_pinned(true);
  seed("Pin", doc_ref);
  seed("Delete", doc_ref);
  seed("Register", reg);
  v1::HeartbeatRequest beat;
  beat.set_worker_id("w1");
  beat.set_lease_id(lease.lease_id());
  seed("Heartbeat", beat);
  seed("Deregister", beat);
  const std::vector<proto::testing::RandomCall> calls = proto::testing::CallServicesWithRandomRequests(
      channel_, {"strata.v1.JobService", "strata.v1.DocumentService", "strata.v1.WorkerRegistry"}, 40, 20261130, o,
      0.5);
  EXPECT_EQ(calls.size(), 40u * (6 + 6 + 3));
  const std::vector<proto::testing::RandomCall> bad = proto::testing::UnexpectedCodes(calls);
  EXPECT_TRUE(bad.empty()) << proto::testing::Describe(bad);
  EXPECT_GT(proto::testing::CountAnswered(calls), 20);  // mutated seeds are often still valid
  EXPECT_EQ(HealthOf(channel_), 1);
  STRATA_ASSERT_OK(coordinator_->RegisterWorker(reg).status());  // the fuzz may have deregistered it
  grpc::ClientContext ctx;
  Deadline(&ctx);
  JobInfo again;
  ASSERT_TRUE(jobs_->Submit(&ctx, PromptOnly(), &again).ok());
  EXPECT_NE(again.job_id(), job.job_id());
}
}  // namespace
}  // namespace strata::coordinator
