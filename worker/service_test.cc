// The worker's gRPC service driven through coordinator::GrpcWorkerClient (the coordinator's
// transport), in one process on 127.0.0.1: prefill progress and completion, a job's events and
// its single on_done, CancelJob of a running job, and an unreachable worker; random requests to
// every method of its services; the registration agent registering again after NOT_FOUND and
// reporting mounted shards in heartbeats.
#include "worker/service.h"

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/grpc_worker_client.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "strata/v1/internal.grpc.pb.h"
#include "kvstore/local_store.h"
#include "model/random_model.h"
#include "prometheus/registry.h"
#include "proto/testing/random_requests.h"

namespace strata::worker {
namespace {

constexpr char kDocId[] = "fedcba9876543210fedcba9876543210";

// A worker on the CPU backend over a random tiny model and a LocalStore in a temp dir (removed,
// with everything, when it goes).
struct TestWorker {
  std::string dir;
  std::unique_ptr<model::Model> model;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<kvstore::LocalStore> store;
  std::unique_ptr<Worker> worker;

  static absl::Status Make(const std::string& name, uint64_t seed, TestWorker* t) {
    std::string tmpl = "/tmp/" + name + "_XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return absl::InternalError("mkdtemp failed");
    t->dir = tmpl;
    model::RandomModelOptions mo;
    mo.seed = seed;
    mo.write_tokenizer = false;
    STRATA_RETURN_IF_ERROR(model::WriteRandomModel(t->dir + "/model", mo).status());
    STRATA_ASSIGN_OR_RETURN(t->model, model::LoadModel(t->dir + "/model"));
    t->backend = kernels::MakeCpuBackend(1);
    kvstore::LocalStoreOptions so;
    so.path = t->dir + "/kv";
    so.sync_writes = false;
    STRATA_ASSIGN_OR_RETURN(t->store, kvstore::LocalStore::Open(so));
    STRATA_ASSIGN_OR_RETURN(t->worker, Worker::Create(WorkerOptions(), t->model.get(), t->backend.get(),
                                                      t->store.get(), t->store.get(), nullptr));
    return absl::OkStatus();
  }
  ~TestWorker() {
    worker.reset();
    store.reset();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
};

TEST(WorkerServiceTest, GrpcWorkerClientDrivesTheWorker) {
  char tmpl[] = "/tmp/strata_worker_service_test_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  model::RandomModelOptions mo;
  mo.seed = 11;
  mo.write_tokenizer = false;
  std::printf("seed=%llu\n", static_cast<unsigned long long>(mo.seed));
  ASSERT_TRUE(model::WriteRandomModel(dir + "/model", mo).ok());
  STRATA_ASSERT_OK_AND_ASSIGN(auto m, model::LoadModel(dir + "/model"));
  auto backend = kernels::MakeCpuBackend(1);
  prometheus::Registry registry;
  kvstore::KvMetrics kv_metrics(&registry);
  kvstore::LocalStoreOptions so;
  so.path = dir + "/kv";
  so.sync_writes = false;
  so.metrics = &kv_metrics;
  STRATA_ASSERT_OK_AND_ASSIGN(auto store, kvstore::LocalStore::Open(so));
  WorkerOptions wo;
  wo.prefill_chunk_size = 32;
  STRATA_ASSERT_OK_AND_ASSIGN(auto w, Worker::Create(wo, m.get(), backend.get(), store.get(), store.get(), nullptr));
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, WorkerServer::Start(WorkerServerOptions{"127.0.0.1:0"}, w.get()));
  w->SetAddress(absl::StrCat("127.0.0.1:", server->port()));
  const v1::WorkerInfo info = w->Info();
  EXPECT_EQ(info.address(), absl::StrCat("127.0.0.1:", server->port()));
  EXPECT_EQ(info.backend(), "cpu");
  // The selection link is on by default, advertised at the address's host.
  ASSERT_GT(server->selection_link_port(), 0);
  EXPECT_EQ(info.selection_link_address(), absl::StrCat("127.0.0.1:", server->selection_link_port()));

  coordinator::GrpcWorkerClient client;
  std::vector<int32_t> doc;
  for (int i = 0; i < 100; ++i) doc.push_back(1 + i * 3);
  v1::PrefillShardRequest prefill;
  prefill.mutable_shard()->set_document_id(kDocId);
  prefill.mutable_shard()->set_end_page(2);
  prefill.mutable_shard_map()->set_page_size(64);
  prefill.mutable_shard_map()->set_num_tokens(doc.size());
  prefill.mutable_token_ids()->Assign(doc.begin(), doc.end());
  std::vector<v1::PrefillShardProgress> progress;  // written by the client's thread before on_done
  absl::Notification prefilled;
  absl::Status prefill_status;
  std::atomic<int> prefill_done{0};
  client.PrefillShard(
      info, prefill, [&](const v1::PrefillShardProgress& p) { progress.push_back(p); },
      [&](const absl::Status& s) {
        prefill_status = s;
        if (++prefill_done == 1) prefilled.Notify();
      });
  ASSERT_TRUE(prefilled.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(prefill_status.ok()) << prefill_status;
  ASSERT_GE(progress.size(), 2u);
  EXPECT_TRUE(progress.back().complete());
  EXPECT_EQ(progress.back().pages_persisted(), 2u);

  // A job that would run long, cancelled through CancelJob once tokens flow.
  v1::RunJobRequest job;
  job.set_job_id("job-a");
  job.mutable_shard_map()->set_document_id(kDocId);
  job.mutable_shard_map()->set_page_size(64);
  job.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(kDocId);
  job.add_prompt_token_ids(9);
  job.mutable_params()->set_max_tokens(200000);
  job.mutable_params()->set_ignore_eos(true);
  std::atomic<int> tokens{0};
  std::atomic<int> job_done{0};
  v1::JobInfo last;
  absl::Status job_status;
  absl::Notification finished;
  client.RunJob(
      info, job,
      [&](const v1::JobEvent& e) {
        if (e.has_tokens() && ++tokens == 5) client.CancelJob(info, "job-a");
        if (e.has_snapshot()) last = e.snapshot();
      },
      [&](const absl::Status& s) {
        job_status = s;
        if (++job_done == 1) finished.Notify();
      });
  ASSERT_TRUE(finished.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(job_status.ok()) << job_status;
  EXPECT_EQ(last.state(), v1::JobInfo::CANCELLED);
  EXPECT_EQ(last.usage().cached_tokens(), doc.size());
  EXPECT_GE(tokens.load(), 5);
  EXPECT_LT(tokens.load(), 100000);

  // An address where nothing listens: on_done once with UNAVAILABLE.
  v1::WorkerInfo nowhere = info;
  nowhere.set_address("127.0.0.1:1");
  absl::Notification failed;
  absl::Status failed_status;
  client.RunJob(
      nowhere, job, [](const v1::JobEvent&) {},
      [&](const absl::Status& s) {
        failed_status = s;
        failed.Notify();
      });
  ASSERT_TRUE(failed.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(failed_status.code(), absl::StatusCode::kUnavailable) << failed_status;

  client.Shutdown();
  EXPECT_EQ(prefill_done.load(), 1);
  EXPECT_EQ(job_done.load(), 1);
  server->Shutdown(absl::Seconds(1));
  server.reset();
  w.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

// No request harms the worker: random requests and valid ones with a few fields changed (a prefill,
// a mount, a job, a selection stream's open and query, a page read) to every method of its three
// gRPC services get an answer or a canonical error, never UNKNOWN, INTERNAL or UNIMPLEMENTED; the
// worker then still runs a job on the document it held.
TEST(WorkerServiceTest, RandomRequestsGetCanonicalAnswers) {
  TestWorker t;
  STRATA_ASSERT_OK(TestWorker::Make("strata_worker_service_random", 13, &t));
  Worker* w = t.worker.get();
  const model::ModelConfig& c = t.model->config;
  v1::PrefillShardRequest prefill;
  prefill.mutable_shard()->set_document_id(kDocId);
  prefill.mutable_shard()->set_end_page(2);
  prefill.mutable_shard_map()->set_page_size(64);
  prefill.mutable_shard_map()->set_num_tokens(100);
  for (int i = 0; i < 100; ++i) prefill.add_token_ids(1 + i * 3);
  STRATA_ASSERT_OK(w->PrefillShard(prefill, nullptr, nullptr));
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, WorkerServer::Start(WorkerServerOptions{"127.0.0.1:0", "off"}, w));
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials());

  proto::testing::RandomRequestOptions o;
  o.known_strings = {kDocId, "job-r", "tokenselect", "quest", "dense"};
  auto seed = [&o](const std::string& method, const google::protobuf::Message& m) {
    o.seeds[method].push_back({m.SerializeAsString()});
  };
  v1::PrefillShardRequest other = prefill;  // another document's prefill
  other.mutable_shard()->set_document_id("0123456789abcdef0123456789abcdef");
  seed("PrefillShard", other);
  v1::MountShardRequest mount;
  *mount.mutable_shard() = prefill.shard();
  seed("MountShard", mount);
  seed("UnmountShard", mount);
  v1::RunJobRequest job;
  job.set_job_id("job-r");
  job.mutable_shard_map()->set_document_id(kDocId);
  job.mutable_shard_map()->set_page_size(64);
  job.mutable_shard_map()->set_num_tokens(100);
  *job.mutable_shard_map()->add_shards()->mutable_range() = prefill.shard();
  job.add_prompt_token_ids(9);
  job.mutable_params()->set_max_tokens(4);
  seed("RunJob", job);
  job.mutable_policy()->set_name("tokenselect");
  job.mutable_policy()->set_budget_tokens(64);
  seed("RunJob", job);
  v1::CancelJobRequest cancel;
  cancel.set_job_id("job-r");
  seed("CancelJob", cancel);
  v1::SelectionRequest open, query;
  open.mutable_open()->set_job_id("job-r");
  *open.mutable_open()->mutable_shard() = prefill.shard();
  open.mutable_open()->mutable_policy()->set_name("tokenselect");
  open.mutable_open()->mutable_policy()->set_budget_tokens(64);
  open.mutable_open()->set_num_q_heads(static_cast<uint32_t>(c.num_heads));
  open.mutable_open()->set_head_dim(static_cast<uint32_t>(c.head_dim));
  query.mutable_query()->set_layer(1);
  query.mutable_query()->set_num_tokens(1);
  query.mutable_query()->set_q_begin(100);
  query.mutable_query()->set_q(std::string(static_cast<size_t>(c.num_heads * c.head_dim) * sizeof(float), '\x01'));
  o.seeds["Select"].push_back({open.SerializeAsString(), query.SerializeAsString(), query.SerializeAsString()});
  v1::GetPagesRequest pages;
  pages.set_document_id(kDocId);
  pages.add_keys()->set_page_index(1);
  seed("GetPages", pages);

  // Seed 44 sends the prefill that crashed the worker before PrefillShard checked the shard's
  // end page against the document (sharded_test BadShardPrefillsAreRefused has it by hand).
  const std::vector<proto::testing::RandomCall> calls = proto::testing::CallServicesWithRandomRequests(
      channel, {"strata.v1.Worker", "strata.v1.ShardSelection", "strata.v1.PeerPages"}, 30, 44, o, 5.0);
  EXPECT_EQ(calls.size(), 30u * (5 + 1 + 1));
  const std::vector<proto::testing::RandomCall> bad = proto::testing::UnexpectedCodes(calls);
  EXPECT_TRUE(bad.empty()) << proto::testing::Describe(bad);
  EXPECT_GT(proto::testing::CountAnswered(calls), 20);
  // The document still serves a job.
  coordinator::GrpcWorkerClient client;
  w->SetAddress(absl::StrCat("127.0.0.1:", server->port()));
  job.set_job_id("job-after");
  absl::Notification finished;
  absl::Status job_status;
  v1::JobInfo last;
  client.RunJob(
      w->Info(), job,
      [&](const v1::JobEvent& e) {
        if (e.has_snapshot()) last = e.snapshot();
      },
      [&](const absl::Status& s) {
        job_status = s;
        finished.Notify();
      });
  ASSERT_TRUE(finished.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(job_status.ok()) << job_status;
  EXPECT_EQ(last.state(), v1::JobInfo::DONE) << last.error_message();
  client.Shutdown();
  server->Shutdown(absl::Seconds(1));
}

// WorkerServerOptions' addresses: a listen address without a port and a malformed link address are
// refused, a link port in use is UNAVAILABLE, "off" serves no link (the worker advertises none).
TEST(WorkerServiceTest, ServerAddressOptions) {
  TestWorker t;
  STRATA_ASSERT_OK(TestWorker::Make("strata_worker_service_options", 7, &t));
  Worker* w = t.worker.get();
  EXPECT_THAT(WorkerServer::Start(WorkerServerOptions{"127.0.0.1"}, w).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  WorkerServerOptions bad_link{"127.0.0.1:0", "no-port"};
  EXPECT_THAT(WorkerServer::Start(bad_link, w).status(), testing::StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(auto first, WorkerServer::Start(WorkerServerOptions{"127.0.0.1:0"}, w));
  WorkerServerOptions taken{"127.0.0.1:0", absl::StrCat("127.0.0.1:", first->selection_link_port())};
  EXPECT_THAT(WorkerServer::Start(taken, w).status(), testing::StatusIs(absl::StatusCode::kUnavailable));
  first.reset();
  WorkerServerOptions off{"127.0.0.1:0", "off"};
  STRATA_ASSERT_OK_AND_ASSIGN(auto plain, WorkerServer::Start(off, w));
  EXPECT_EQ(plain->selection_link_port(), 0);
  w->SetAddress(absl::StrCat("127.0.0.1:", plain->port()));
  EXPECT_TRUE(w->Info().selection_link_address().empty());
}

// A registry that forgets the worker once (its first heartbeat gets NOT_FOUND, as after a
// coordinator restart) and records the mounted shards of later heartbeats.
class ForgetfulRegistry final : public v1::WorkerRegistry::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterWorkerRequest*,
                        v1::RegisterWorkerResponse* response) override {
    absl::MutexLock lock(&mu);
    ++registrations;
    response->set_lease_id(static_cast<uint64_t>(registrations));
    response->set_heartbeat_interval_ms(20);
    response->set_heartbeat_timeout_ms(1000);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse*) override {
    absl::MutexLock lock(&mu);
    ++heartbeats;
    if (heartbeats == 1) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    mounted_tokens = request->load().mounted_tokens();
    mounted_shards = request->mounted_shards_size();
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const v1::DeregisterWorkerRequest*,
                          v1::DeregisterWorkerResponse*) override {
    return grpc::Status::OK;
  }
  absl::Mutex mu;
  int registrations = 0, heartbeats = 0, mounted_shards = 0;
  uint64_t mounted_tokens = 0;
};

TEST(RegistrationAgentTest, RegistersAgainAfterNotFoundAndReportsMountedShards) {
  TestWorker t;
  STRATA_ASSERT_OK(TestWorker::Make("strata_worker_registration_test", 12, &t));
  Worker* w = t.worker.get();
  // A one-page document, mounted.
  v1::PrefillShardRequest prefill;
  prefill.mutable_shard()->set_document_id(kDocId);
  prefill.mutable_shard()->set_end_page(1);
  for (int i = 0; i < 40; ++i) prefill.add_token_ids(3 + i);
  STRATA_ASSERT_OK(w->PrefillShard(prefill, nullptr, nullptr));
  v1::MountShardRequest mount;
  *mount.mutable_shard() = prefill.shard();
  STRATA_ASSERT_OK(w->MountShard(mount).status());

  ForgetfulRegistry registry;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&registry);
  std::unique_ptr<grpc::Server> coordinator = builder.BuildAndStart();
  ASSERT_NE(coordinator, nullptr);
  RegistrationOptions ro;
  ro.coordinator = absl::StrCat("127.0.0.1:", port);
  ro.retry_interval_ms = 20;
  RegistrationAgent agent(ro, w);
  agent.Start();
  ASSERT_TRUE(agent.WaitRegistered(absl::Seconds(10)));
  // The first heartbeat is refused: the agent registers again (without aborting) and its later
  // heartbeats report the mount.
  bool done = false;
  for (int i = 0; i < 500 && !done; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
    absl::MutexLock lock(&registry.mu);
    done = registry.registrations >= 2 && registry.heartbeats >= 3;
  }
  agent.Stop();
  coordinator->Shutdown(std::chrono::system_clock::now());
  {
    absl::MutexLock lock(&registry.mu);
    EXPECT_GE(registry.registrations, 2);
    EXPECT_GE(registry.heartbeats, 3);
    EXPECT_EQ(registry.mounted_shards, 1);
    EXPECT_EQ(registry.mounted_tokens, 40u);
  }
}

}  // namespace
}  // namespace strata::worker
