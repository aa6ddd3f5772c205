// Multi-process tests of `strata coordinator`: the server runs as a child process on 127.0.0.1
// (ports picked by the OS and read from --port-file) and is driven through the public gRPC API,
// the internal WorkerRegistry, gRPC health and reflection, and the Prometheus endpoint.
//
// Every child is killed (SIGKILL if SIGTERM did not stop it) and waited for; every wait is bounded.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "strata/v1/api.grpc.pb.h"
#include "strata/v1/internal.grpc.pb.h"
#include "tests/service/child_process.h"

namespace strata {
namespace {

// A `strata coordinator` child process; stdout and stderr both go to one log file.
class CoordinatorProcess {
 public:
  CoordinatorProcess(const std::string& data_dir, const std::string& work_dir, int index) {
    port_file_ = absl::StrCat(work_dir, "/ports.", index);
    log_file_ = absl::StrCat(work_dir, "/coordinator.", index, ".log");
    std::filesystem::remove(port_file_);
    std::vector<std::string> args = {STRATA_BINARY, "coordinator", "--listen", "127.0.0.1:0",
                                     "--metrics-listen", "127.0.0.1:0", "--data", data_dir, "--port-file",
                                     port_file_, "--vocab-size", "1000", "--max-document-tokens", "5000",
                                     "--max-prompt-tokens", "100", "--max-tokens-limit", "512",
                                     "--drain-timeout-seconds", "2", "--no-sync"};
    child_ = std::make_unique<tests::ChildProcess>(std::move(args), log_file_, log_file_);
  }

  // Waits (up to `timeout`) for the port file. False if the child exited or time ran out.
  bool WaitReady(std::chrono::seconds timeout) {
    return child_->WaitForPorts(port_file_, timeout, &grpc_port_, &metrics_port_);
  }

  // Sends `sig` and waits (up to `timeout`) for the exit; returns the exit code, or nullopt.
  std::optional<int> StopWith(int sig, std::chrono::seconds timeout) { return child_->StopWith(sig, timeout); }

  std::string Log() const { return child_->Out(); }

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }

 private:
  std::unique_ptr<tests::ChildProcess> child_;  // killed and waited for when still running
  std::string port_file_;
  std::string log_file_;
  int grpc_port_ = 0;
  int metrics_port_ = 0;
};

// One raw call through the generic stub (request and response as serialized bytes), for services
// whose generated stubs are not installed (health, reflection). Works for unary and streaming
// methods that answer the first message.
grpc::Status RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::string& request, std::string* response) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(&ctx, method, &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t want) { return cq.Next(&tag, &ok) && reinterpret_cast<intptr_t>(tag) == want; };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  step(2);
  call->WritesDone(reinterpret_cast<void*>(3));
  step(3);
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(4));
  step(4);
  if (ok) {
    std::vector<grpc::Slice> slices;
    (void)in.Dump(&slices);
    response->clear();
    for (const grpc::Slice& s : slices) response->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

using tests::HttpGet;

class CoordinatorProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_coordinator_process_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    work_dir_ = tmpl;
    data_dir_ = work_dir_ + "/catalog";
    StartServer();
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) std::fprintf(stderr, "--- coordinator log ---\n%s\n", server_->Log().c_str());
    server_.reset();
    std::filesystem::remove_all(work_dir_);
  }
  void StartServer() {
    server_ = std::make_unique<CoordinatorProcess>(data_dir_, work_dir_, ++starts_);
    ASSERT_TRUE(server_->WaitReady(std::chrono::seconds(30))) << server_->Log();
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->grpc_port()),
                                   grpc::InsecureChannelCredentials());
    documents_ = v1::DocumentService::NewStub(channel_);
    jobs_ = v1::JobService::NewStub(channel_);
    registry_ = v1::WorkerRegistry::NewStub(channel_);
  }
  static void Deadline(grpc::ClientContext* ctx, int seconds = 5) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }

  // Uploads token ids in chunks of `chunk`.
  grpc::Status Upload(const std::vector<int32_t>& tokens, size_t chunk, v1::DocumentUploadResponse* response,
                      bool mix_text = false) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    auto writer = documents_->Upload(&ctx, response);
    for (size_t i = 0; i < tokens.size(); i += chunk) {
      v1::DocumentUploadRequest r;
      if (i == 0) r.mutable_options()->set_display_name("test document");
      for (size_t j = i; j < std::min(tokens.size(), i + chunk); ++j) r.mutable_tokens()->add_ids(tokens[j]);
      if (!writer->Write(r)) break;
    }
    if (mix_text) {
      v1::DocumentUploadRequest r;
      r.set_text("and some text");
      writer->Write(r);
    }
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::Status Submit(const v1::JobSubmitRequest& request, v1::JobInfo* job) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return jobs_->Submit(&ctx, request, job);
  }
  static v1::JobSubmitRequest Job(const std::string& document_id, int prompt_len = 3) {
    v1::JobSubmitRequest r;
    r.set_document_id(document_id);
    for (int i = 0; i < prompt_len; ++i) r.mutable_prompt_tokens()->add_ids(10 + i);
    r.mutable_params()->set_max_tokens(16);
    return r;
  }
  int CountJobs() {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::JobListResponse list;
    EXPECT_TRUE(jobs_->List(&ctx, v1::JobListRequest(), &list).ok());
    return list.jobs_size();
  }
  int CountDocuments() {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DocumentListResponse list;
    EXPECT_TRUE(documents_->List(&ctx, v1::DocumentListRequest(), &list).ok());
    return list.documents_size();
  }
  // grpc.health.v1.Health/Check for `service`: the status enum (1 SERVING, 2 NOT_SERVING), or -1.
  int Health(const std::string& service) {
    std::string request;
    if (!service.empty()) request = absl::StrCat(std::string(1, '\x0a'), std::string(1, static_cast<char>(service.size())), service);
    std::string response;
    grpc::Status s = RawCall(channel_, "/grpc.health.v1.Health/Check", request, &response);
    if (!s.ok()) return -1;
    if (response.empty()) return 0;
    return response.size() == 2 && response[0] == '\x08' ? response[1] : -1;
  }

  std::string work_dir_;
  std::string data_dir_;
  int starts_ = 0;
  std::unique_ptr<CoordinatorProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DocumentService::Stub> documents_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerRegistry::Stub> registry_;
};

TEST_F(CoordinatorProcessTest, HealthReflectionAndMetrics) {
  EXPECT_EQ(Health(""), 1);
  EXPECT_EQ(Health("strata.v1.JobService"), 1);
  EXPECT_EQ(Health("strata.v1.DocumentService"), 1);
  // Reflection (v1alpha): ServerReflectionRequest{list_services: ""} lists our services.
  std::string listing;
  grpc::Status s = RawCall(channel_, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                           std::string("\x3a\x00", 2), &listing);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(absl::StrContains(listing, "strata.v1.DocumentService")) << listing;
  EXPECT_TRUE(absl::StrContains(listing, "strata.v1.JobService")) << listing;
  EXPECT_TRUE(absl::StrContains(listing, "grpc.health.v1.Health")) << listing;

  // One request so that a request counter exists.
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::DocumentInfo info;
  v1::DocumentGetRequest get;
  get.set_document_id("0123456789abcdef0123456789abcdef");
  EXPECT_EQ(documents_->Get(&ctx, get, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  const std::string metrics = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_TRUE(absl::StrContains(metrics, "200 OK")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "strata_jobs{state=\"queued\"} 0")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "strata_job_queue_length 0")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "strata_coordinator_requests_total{code=\"not_found\",method=\"DocumentService.Get\"} 1"))
      << metrics;
}

TEST_F(CoordinatorProcessTest, DocumentsJobsAndBadRequests) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < 300; ++i) tokens.push_back((i * 7) % 1000);
  v1::DocumentUploadResponse uploaded;
  grpc::Status s = Upload(tokens, 128, &uploaded);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(uploaded.created());
  EXPECT_EQ(uploaded.document().num_tokens(), 300u);
  EXPECT_EQ(uploaded.document().state(), v1::DocumentInfo::PENDING);
  EXPECT_EQ(uploaded.document().display_name(), "test document");
  const std::string doc = uploaded.document().document_id();
  v1::DocumentUploadResponse again;
  ASSERT_TRUE(Upload(tokens, 7, &again).ok());
  EXPECT_FALSE(again.created());
  EXPECT_EQ(again.document().document_id(), doc);

  // Bad uploads.
  v1::DocumentUploadResponse unused;
  EXPECT_EQ(Upload(std::vector<int32_t>(5001, 1), 1000, &unused).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(Upload({1, 2, 3}, 3, &unused, /*mix_text=*/true).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Upload({1, 2000}, 3, &unused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Upload({}, 3, &unused).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Bad submissions.
  struct Case {
    const char* name;
    v1::JobSubmitRequest request;
    grpc::StatusCode code;
  };
  std::vector<Case> cases;
  cases.push_back({"unknown document", Job("0123456789abcdef0123456789abcdef"), grpc::StatusCode::NOT_FOUND});
  cases.push_back({"empty prompt", Job(doc, 0), grpc::StatusCode::INVALID_ARGUMENT});
  cases.push_back({"oversized prompt", Job(doc, 101), grpc::StatusCode::INVALID_ARGUMENT});
  v1::JobSubmitRequest r = Job(doc);
  r.mutable_prompt_tokens()->add_ids(1000);
  cases.push_back({"invalid token id", r, grpc::StatusCode::INVALID_ARGUMENT});
  r = Job(doc);
  r.mutable_params()->set_max_tokens(513);
  cases.push_back({"max tokens out of range", r, grpc::StatusCode::INVALID_ARGUMENT});
  r = Job(doc);
  r.mutable_policy()->set_name("clairvoyant");
  cases.push_back({"unknown policy", r, grpc::StatusCode::INVALID_ARGUMENT});
  r = Job(doc);
  r.mutable_policy()->set_name("tokenselect");
  r.mutable_policy()->set_budget_tokens(2000000);
  cases.push_back({"budget out of range", r, grpc::StatusCode::INVALID_ARGUMENT});
  r = Job(doc);
  r.clear_document_id();
  for (int i = 0; i < 5001; ++i) r.mutable_inline_document()->mutable_tokens()->add_ids(1);
  cases.push_back({"inline document over the limit", r, grpc::StatusCode::RESOURCE_EXHAUSTED});
  for (const Case& c : cases) {
    v1::JobInfo job;
    EXPECT_EQ(Submit(c.request, &job).error_code(), c.code) << c.name;
  }
  EXPECT_EQ(CountJobs(), 0);
  EXPECT_EQ(CountDocuments(), 1);

  // A good job waits QUEUED (no workers); cancel works once.
  v1::JobInfo job;
  ASSERT_TRUE(Submit(Job(doc), &job).ok());
  EXPECT_EQ(job.state(), v1::JobInfo::QUEUED);
  EXPECT_EQ(job.prompt_tokens(), 303u);
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::JobGetRequest get;
    get.set_job_id(job.job_id());
    v1::JobInfo got;
    ASSERT_TRUE(jobs_->Get(&ctx, get, &got).ok());
    EXPECT_EQ(got.state(), v1::JobInfo::QUEUED);
  }
  v1::JobCancelRequest cancel;
  cancel.set_job_id(job.job_id());
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::JobInfo cancelled;
    ASSERT_TRUE(jobs_->Cancel(&ctx, cancel, &cancelled).ok());
    EXPECT_EQ(cancelled.state(), v1::JobInfo::CANCELLED);
  }
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::JobInfo unused_job;
    EXPECT_EQ(jobs_->Cancel(&ctx, cancel, &unused_job).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::DocumentDeleteRequest del;
    del.set_document_id("not-an-id");
    v1::DocumentDeleteResponse unused_delete;
    EXPECT_EQ(documents_->Delete(&ctx, del, &unused_delete).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // Workers register over the internal API; a stale lease is NOT_FOUND.
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::RegisterWorkerRequest reg;
    reg.mutable_worker()->set_worker_id("worker-0");
    reg.mutable_worker()->set_address("127.0.0.1:1");
    reg.mutable_worker()->set_capacity_tokens(1 << 20);
    reg.mutable_worker()->set_max_jobs(4);
    v1::RegisterWorkerResponse lease;
    ASSERT_TRUE(registry_->Register(&ctx, reg, &lease).ok());
    grpc::ClientContext ctx2;
    Deadline(&ctx2);
    v1::HeartbeatRequest beat;
    beat.set_worker_id("worker-0");
    beat.set_lease_id(lease.lease_id() + 1);
    v1::HeartbeatResponse unused_beat;
    EXPECT_EQ(registry_->Heartbeat(&ctx2, beat, &unused_beat).error_code(), grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(CoordinatorProcessTest, GenerateStreamsSnapshotAndCancellingTheCallCancelsTheJob) {
  v1::DocumentUploadResponse uploaded;
  ASSERT_TRUE(Upload({1, 2, 3, 4}, 4, &uploaded).ok());
  grpc::ClientContext ctx;
  Deadline(&ctx, 10);
  auto reader = jobs_->Generate(&ctx, Job(uploaded.document().document_id()));
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.sequence(), 1u);
  ASSERT_TRUE(event.has_snapshot());
  EXPECT_EQ(event.snapshot().state(), v1::JobInfo::QUEUED);
  const std::string job_id = event.job_id();
  ctx.TryCancel();
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The server sees the cancellation asynchronously; poll (bounded).
  v1::JobInfo got;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext get_ctx;
    Deadline(&get_ctx);
    v1::JobGetRequest get;
    get.set_job_id(job_id);
    ASSERT_TRUE(jobs_->Get(&get_ctx, get, &got).ok());
    if (got.state() == v1::JobInfo::CANCELLED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(got.state(), v1::JobInfo::CANCELLED);
}

TEST_F(CoordinatorProcessTest, DocumentWatchEndsWithNotFoundWhenDeleted) {
  v1::DocumentUploadResponse uploaded;
  ASSERT_TRUE(Upload({11, 12, 13}, 3, &uploaded).ok());
  const std::string doc = uploaded.document().document_id();
  grpc::ClientContext ctx;
  Deadline(&ctx, 10);
  v1::DocumentWatchRequest watch;
  watch.set_document_id(doc);
  auto reader = documents_->Watch(&ctx, watch);
  v1::DocumentInfo info;
  ASSERT_TRUE(reader->Read(&info));
  EXPECT_EQ(info.state(), v1::DocumentInfo::PENDING);
  EXPECT_EQ(info.document_id(), doc);
  {
    grpc::ClientContext del_ctx;
    Deadline(&del_ctx);
    v1::DocumentDeleteRequest del;
    del.set_document_id(doc);
    v1::DocumentDeleteResponse unused;
    ASSERT_TRUE(documents_->Delete(&del_ctx, del, &unused).ok());
  }
  EXPECT_FALSE(reader->Read(&info));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(CountDocuments(), 0);
}

TEST_F(CoordinatorProcessTest, CatalogSurvivesRestart) {
  v1::DocumentUploadResponse uploaded;
  ASSERT_TRUE(Upload({5, 6, 7, 8, 9}, 2, &uploaded).ok());
  v1::JobInfo job;
  ASSERT_TRUE(Submit(Job(uploaded.document().document_id()), &job).ok());

  std::optional<int> code = server_->StopWith(SIGTERM, std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value()) << "no exit within 20 s of SIGTERM";
  EXPECT_EQ(*code, 0) << server_->Log();
  EXPECT_TRUE(absl::StrContains(server_->Log(), "draining")) << server_->Log();

  StartServer();
  EXPECT_EQ(CountDocuments(), 1);
  EXPECT_EQ(CountJobs(), 1);
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::DocumentGetRequest get;
  get.set_document_id(uploaded.document().document_id());
  v1::DocumentInfo info;
  ASSERT_TRUE(documents_->Get(&ctx, get, &info).ok());
  EXPECT_EQ(info.num_tokens(), 5u);
  EXPECT_EQ(info.state(), v1::DocumentInfo::PENDING);
  grpc::ClientContext ctx2;
  Deadline(&ctx2);
  v1::JobGetRequest get_job;
  get_job.set_job_id(job.job_id());
  v1::JobInfo got;
  ASSERT_TRUE(jobs_->Get(&ctx2, get_job, &got).ok());
  EXPECT_EQ(got.state(), v1::JobInfo::QUEUED);
  EXPECT_EQ(got.params().seed(), job.params().seed());
  // The same content is still the same document.
  v1::DocumentUploadResponse again;
  ASSERT_TRUE(Upload({5, 6, 7, 8, 9}, 5, &again).ok());
  EXPECT_FALSE(again.created());
}

// A --weight-format that does not exist stops the coordinator at startup with exit code 2 and a
// message naming the flag, before it opens its catalog.
TEST(CoordinatorFlagsTest, UnknownWeightFormatExitsWithCode2) {
  char tmpl[] = "/tmp/strata_coordinator_flags_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string log = dir + "/coordinator.log";
  {
    tests::ChildProcess child({STRATA_BINARY, "coordinator", "--listen", "127.0.0.1:0", "--data",
                               dir + "/catalog", "--weight-format", "int4"},
                              log, log);
    const std::optional<int> code = child.Wait(std::chrono::seconds(30));
    ASSERT_TRUE(code.has_value()) << "still running: " << child.Out();
    EXPECT_EQ(*code, 2) << child.Out();
    EXPECT_TRUE(absl::StrContains(child.Out(), "--weight-format")) << child.Out();
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/catalog"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata
