#include "coordinator/coordinator.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "coordinator/testing/fake_worker_client.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;
using v1::JobInfo;

constexpr int64_t kSecond = 1'000'000'000;

// Records every event it is sent.
class RecordingObserver : public JobObserver {
 public:
  void OnJobEvent(const v1::JobEvent& event) override { events.push_back(event); }
  std::vector<v1::JobEvent> events;
};

class RecordingDocumentObserver : public DocumentObserver {
 public:
  void OnDocument(const absl::Status& status, const v1::DocumentInfo& info) override {
    statuses.push_back(status);
    infos.push_back(info);
  }
  std::vector<absl::Status> statuses;
  std::vector<v1::DocumentInfo> infos;
};

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_coordinator_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    options_.limits.vocab_size = 1000;
    options_.limits.max_document_tokens = 10000;
    options_.limits.max_prompt_tokens = 100;
    options_.placement.page_size = options_.limits.page_size = 16;
    options_.placement.target_shard_tokens = 256;
    options_.registry.heartbeat_interval_nanos = 1 * kSecond;
    options_.registry.heartbeat_timeout_nanos = 3 * kSecond;
    options_.random_seed = 1234;  // fixed: job ids and seeds are reproducible
    Restart();
  }
  void TearDown() override {
    coordinator_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Restart() {
    coordinator_.reset();
    CatalogOptions catalog_options;
    catalog_options.path = dir_;
    catalog_options.sync_writes = false;
    auto catalog = Catalog::Open(catalog_options);
    ASSERT_TRUE(catalog.ok()) << catalog.status();
    ASSERT_TRUE(options_.Validate().ok()) << options_.Validate();
    coordinator_ = std::make_unique<Coordinator>(
        options_, *std::move(catalog), &workers_, nullptr, [this] { return now_; }, [this] { return now_ / 1000; });
    STRATA_ASSERT_OK(coordinator_->Start());
  }

  std::string Upload(int n, int first = 1) {
    DocumentContent content;
    for (int i = 0; i < n; ++i) content.tokens.push_back((first + i) % 1000);
    auto r = coordinator_->UploadDocument(v1::DocumentUploadOptions(), content);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->document().document_id() : "";
  }
  static v1::JobSubmitRequest Job(const std::string& document_id, int prompt_len = 3) {
    v1::JobSubmitRequest r;
    if (!document_id.empty()) r.set_document_id(document_id);
    for (int i = 0; i < prompt_len; ++i) r.mutable_prompt_tokens()->add_ids(i + 1);
    r.mutable_params()->set_max_tokens(8);
    return r;
  }
  void RegisterWorker(const std::string& id, uint64_t capacity = 100000) {
    v1::RegisterWorkerRequest r;
    r.mutable_worker()->set_worker_id(id);
    r.mutable_worker()->set_address("127.0.0.1:1");
    r.mutable_worker()->set_selection_link_address("127.0.0.1:2");
    r.mutable_worker()->set_capacity_tokens(capacity);
    r.mutable_worker()->set_max_jobs(2);
    auto response = coordinator_->RegisterWorker(r);
    ASSERT_TRUE(response.ok()) << response.status();
    leases_[id] = response->lease_id();
  }
  // A heartbeat reporting the shards whose MountShard calls FinishMounts completed with OK.
  void Beat(const std::string& id) {
    v1::HeartbeatRequest r;
    r.set_worker_id(id);
    r.set_lease_id(leases_[id]);
    for (const v1::ShardRange& range : mounted_[id]) *r.add_mounted_shards() = range;
    ASSERT_TRUE(coordinator_->Heartbeat(r).ok());
  }
  // Completes every prefill call not completed yet.
  void FinishPrefills() {
    auto calls = workers_.prefills();
    for (size_t i = prefills_done_; i < calls.size(); ++i) {
      v1::PrefillShardProgress p;
      p.set_tokens_prefilled(calls[i].request.token_ids_size());
      p.set_complete(true);
      calls[i].on_progress(p);
      calls[i].on_done(absl::OkStatus());
    }
    prefills_done_ = calls.size();
  }
  // Completes every MountShard / UnmountShard call not completed yet with `status`.
  void FinishMounts(const absl::Status& status = absl::OkStatus()) {
    auto calls = workers_.mounts();
    for (size_t i = mounts_done_; i < calls.size(); ++i) {
      if (status.ok()) {
        std::vector<v1::ShardRange>& held = mounted_[calls[i].worker_id];
        held.erase(std::remove_if(held.begin(), held.end(),
                                  [&](const v1::ShardRange& r) {
                                    return r.document_id() == calls[i].shard.document_id() &&
                                           r.first_page() == calls[i].shard.first_page();
                                  }),
                   held.end());
        if (calls[i].mount) held.push_back(calls[i].shard);
      }
      calls[i].on_done(status);
    }
    mounts_done_ = calls.size();
  }
  // MountShard calls (not unmounts) made since index `from`.
  std::vector<testing::FakeWorkerClient::MountCall> MountsSince(size_t from) {
    std::vector<testing::FakeWorkerClient::MountCall> out;
    auto calls = workers_.mounts();
    for (size_t i = from; i < calls.size(); ++i) {
      if (calls[i].mount) out.push_back(calls[i]);
    }
    return out;
  }
  JobInfo::State StateOf(const std::string& job_id) {
    auto job = coordinator_->GetJob(job_id);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->state() : JobInfo::STATE_UNSPECIFIED;
  }
  size_t CountJobs() {
    auto list = coordinator_->ListJobs(v1::JobListRequest());
    EXPECT_TRUE(list.ok());
    return list.ok() ? list->jobs_size() : 0;
  }
  size_t CountDocuments() {
    auto list = coordinator_->ListDocuments(v1::DocumentListRequest());
    EXPECT_TRUE(list.ok());
    return list.ok() ? list->documents_size() : 0;
  }

  std::string dir_;
  int64_t now_ = 1000 * kSecond;
  CoordinatorOptions options_;
  testing::FakeWorkerClient workers_;
  std::unique_ptr<Coordinator> coordinator_;
  std::map<std::string, uint64_t> leases_;
  size_t prefills_done_ = 0;
  size_t mounts_done_ = 0;
  // Shards each fake worker holds mounted (what its heartbeats report).
  std::map<std::string, std::vector<v1::ShardRange>> mounted_;
};

TEST_F(CoordinatorTest, UploadIsContentAddressed) {
  DocumentContent content;
  content.tokens = {5, 6, 7};
  v1::DocumentUploadOptions upload;
  upload.set_display_name("notes");
  STRATA_ASSERT_OK_AND_ASSIGN(auto first, coordinator_->UploadDocument(upload, content));
  EXPECT_TRUE(first.created());
  EXPECT_EQ(first.document().document_id().size(), 32u);
  EXPECT_EQ(first.document().state(), v1::DocumentInfo::PENDING);
  EXPECT_EQ(first.document().num_tokens(), 3u);
  upload.set_pin(true);
  STRATA_ASSERT_OK_AND_ASSIGN(auto second, coordinator_->UploadDocument(upload, content));
  EXPECT_FALSE(second.created());
  EXPECT_EQ(second.document().document_id(), first.document().document_id());
  EXPECT_TRUE(second.document().pinned());
  content.tokens = {5, 6, 8};
  STRATA_ASSERT_OK_AND_ASSIGN(auto third, coordinator_->UploadDocument(upload, content));
  EXPECT_NE(third.document().document_id(), first.document().document_id());
  EXPECT_EQ(CountDocuments(), 2u);
}

TEST_F(CoordinatorTest, BadUploadsChangeNothing) {
  DocumentContent empty;
  EXPECT_THAT(coordinator_->UploadDocument(v1::DocumentUploadOptions(), empty),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  DocumentContent big;
  big.tokens.assign(10001, 1);
  EXPECT_THAT(coordinator_->UploadDocument(v1::DocumentUploadOptions(), big),
              StatusIs(absl::StatusCode::kResourceExhausted));
  DocumentContent bad_ids;
  bad_ids.tokens = {1, 1000};
  EXPECT_THAT(coordinator_->UploadDocument(v1::DocumentUploadOptions(), bad_ids),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens[1]")));
  DocumentContent text;
  text.is_text = true;
  text.text = "hello";
  EXPECT_THAT(coordinator_->UploadDocument(v1::DocumentUploadOptions(), text),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("tokenizer")));
  EXPECT_EQ(CountDocuments(), 0u);
}

TEST_F(CoordinatorTest, BadSubmissionsGetTheRightCodeAndChangeNothing) {
  const std::string doc = Upload(40);
  struct Case {
    std::string name;
    v1::JobSubmitRequest request;
    absl::StatusCode code;
  };
  std::vector<Case> cases;
  cases.push_back({"unknown document", Job("0123456789abcdef0123456789abcdef"), absl::StatusCode::kNotFound});
  cases.push_back({"malformed document id", Job("xyz"), absl::StatusCode::kInvalidArgument});
  cases.push_back({"empty prompt", Job(doc, 0), absl::StatusCode::kInvalidArgument});
  cases.push_back({"oversized prompt", Job(doc, 101), absl::StatusCode::kInvalidArgument});
  v1::JobSubmitRequest r = Job(doc);
  r.mutable_prompt_tokens()->add_ids(5000);
  cases.push_back({"invalid token id", r, absl::StatusCode::kInvalidArgument});
  r = Job(doc);
  r.mutable_params()->set_max_tokens(100000);
  cases.push_back({"max tokens out of range", r, absl::StatusCode::kInvalidArgument});
  r = Job(doc);
  r.mutable_policy()->set_name("oracle");
  cases.push_back({"unknown policy", r, absl::StatusCode::kInvalidArgument});
  r = Job(doc);
  r.mutable_policy()->set_name("quest");
  r.mutable_policy()->set_budget_tokens(3);
  cases.push_back({"budget out of range", r, absl::StatusCode::kInvalidArgument});
  r = Job(doc);
  r.mutable_policy()->set_name("tokenselect");
  r.mutable_policy()->set_candidate_factor(17);
  cases.push_back({"candidate factor out of range", r, absl::StatusCode::kInvalidArgument});
  r = Job(doc);
  r.mutable_policy()->set_name("tokenselect");
  r.mutable_policy()->set_partitions(3);
  cases.push_back({"partitions not a power of two", r, absl::StatusCode::kInvalidArgument});
  r = Job("");
  for (int i = 0; i < 10001; ++i) r.mutable_inline_document()->mutable_tokens()->add_ids(1);
  cases.push_back({"inline document over the limit", r, absl::StatusCode::kResourceExhausted});
  r = Job("");
  r.set_prompt_text("hi");
  cases.push_back({"text prompt without tokenizer", r, absl::StatusCode::kFailedPrecondition});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_THAT(coordinator_->SubmitJob(c.request), StatusIs(c.code));
  }
  EXPECT_EQ(CountJobs(), 0u);
  EXPECT_EQ(CountDocuments(), 1u);
}

TEST_F(CoordinatorTest, WithoutWorkersJobsStayQueuedAndDocumentsPending) {
  const std::string doc = Upload(40);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  EXPECT_EQ(job.state(), JobInfo::QUEUED);
  EXPECT_EQ(job.prompt_tokens(), 43u);
  EXPECT_EQ(job.params().max_tokens(), 8u);
  EXPECT_EQ(job.policy().name(), "dense");
  EXPECT_TRUE(job.params().has_seed());
  for (int i = 0; i < 3; ++i) {
    now_ += kSecond;
    coordinator_->Tick();
  }
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::QUEUED);
  STRATA_ASSERT_OK_AND_ASSIGN(auto info, coordinator_->GetDocument(doc));
  EXPECT_EQ(info.state(), v1::DocumentInfo::PENDING);
  EXPECT_TRUE(workers_.prefills().empty());
  EXPECT_TRUE(workers_.runs().empty());
}

TEST_F(CoordinatorTest, CancelQueuedJobThenCancelAgainIsFailedPrecondition) {
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(Upload(10))));
  RecordingObserver watcher;
  STRATA_ASSERT_OK(coordinator_->WatchJob(job.job_id(), &watcher));
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo cancelled, coordinator_->CancelJob(job.job_id()));
  EXPECT_EQ(cancelled.state(), JobInfo::CANCELLED);
  EXPECT_EQ(cancelled.finish_reason(), JobInfo::CANCELLED_BY_CLIENT);
  EXPECT_THAT(coordinator_->CancelJob(job.job_id()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("finished")));
  EXPECT_THAT(coordinator_->CancelJob("job-0000000000000000"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_EQ(watcher.events.size(), 2u);
  EXPECT_EQ(watcher.events[0].snapshot().state(), JobInfo::QUEUED);
  EXPECT_EQ(watcher.events[1].snapshot().state(), JobInfo::CANCELLED);
  coordinator_->UnwatchJob(job.job_id(), &watcher);
}

TEST_F(CoordinatorTest, AdmissionLimitIsResourceExhausted) {
  options_.admission.max_pending_jobs = 2;
  Restart();
  const std::string doc = Upload(10);
  STRATA_ASSERT_OK(coordinator_->SubmitJob(Job(doc)).status());
  STRATA_ASSERT_OK(coordinator_->SubmitJob(Job(doc)).status());
  EXPECT_THAT(coordinator_->SubmitJob(Job(doc)), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(CountJobs(), 2u);
}

TEST_F(CoordinatorTest, DocumentInUseCannotBeDeleted) {
  const std::string doc = Upload(10);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  EXPECT_THAT(coordinator_->DeleteDocument(doc), StatusIs(absl::StatusCode::kFailedPrecondition));
  STRATA_ASSERT_OK(coordinator_->CancelJob(job.job_id()));
  STRATA_ASSERT_OK(coordinator_->DeleteDocument(doc));
  EXPECT_THAT(coordinator_->GetDocument(doc), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(coordinator_->DeleteDocument(doc), StatusIs(absl::StatusCode::kNotFound));
}

// Given a worker, when a document is uploaded and a job submitted, then the document is prefilled
// in shards, the job runs on a leader, and its events and usage reach the watcher.
TEST_F(CoordinatorTest, FullLifeWithAFakeWorker) {
  RegisterWorker("w1");
  const std::string doc = Upload(600);  // 38 pages of 16 -> 3 shards of <= 16 pages
  RecordingDocumentObserver doc_watcher;
  STRATA_ASSERT_OK(coordinator_->WatchDocument(doc, &doc_watcher));
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  RecordingObserver watcher;
  STRATA_ASSERT_OK(coordinator_->WatchJob(job.job_id(), &watcher));
  coordinator_->Tick();
  auto prefills = workers_.prefills();
  ASSERT_EQ(prefills.size(), 3u);
  int64_t tokens = 0;
  for (const auto& p : prefills) tokens += p.request.token_ids_size();
  EXPECT_EQ(tokens, 600);
  // ANCHOR (the default): all shards at once; the anchor is the first shard's 13 pages.
  EXPECT_EQ(prefills[0].request.anchor_token_ids_size(), 0);
  EXPECT_EQ(prefills[1].request.anchor_token_ids_size(), 13 * 16);
  EXPECT_EQ(prefills[1].request.mode(), v1::PREFILL_MODE_ANCHOR);
  EXPECT_TRUE(workers_.runs().empty());  // the document is not READY yet
  FinishPrefills();
  STRATA_ASSERT_OK_AND_ASSIGN(auto doc_info, coordinator_->GetDocument(doc));
  EXPECT_EQ(doc_info.state(), v1::DocumentInfo::READY);
  EXPECT_EQ(doc_info.prefill_mode(), v1::DocumentInfo::ANCHOR);
  EXPECT_EQ(doc_watcher.infos.back().state(), v1::DocumentInfo::READY);
  // READY: the holder mounts its shards before the job runs.
  EXPECT_TRUE(workers_.runs().empty());
  ASSERT_EQ(MountsSince(0).size(), 3u);
  // w1 holds every shard: its jobs read the document themselves, so the mounts say so.
  for (const auto& m : MountsSince(0)) EXPECT_TRUE(m.whole_document);
  FinishMounts();
  auto runs = workers_.runs();
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].worker_id, "w1");
  EXPECT_EQ(runs[0].request.prompt_token_ids_size(), 3);
  EXPECT_EQ(runs[0].request.shard_map().shards_size(), 3);
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::PREFILLING);

  v1::JobEvent e;
  e.mutable_tokens()->add_token_ids(42);
  e.mutable_tokens()->set_text("x");
  runs[0].on_event(e);
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::DECODING);
  v1::JobEvent final_event;
  final_event.mutable_snapshot()->set_state(JobInfo::DONE);
  final_event.mutable_snapshot()->set_finish_reason(JobInfo::STOP);
  final_event.mutable_snapshot()->mutable_usage()->set_completion_tokens(1);
  final_event.mutable_snapshot()->mutable_usage()->set_cached_tokens(600);
  final_event.mutable_snapshot()->mutable_usage()->mutable_pages_fetched()->set_host(7);
  runs[0].on_event(final_event);
  runs[0].on_done(absl::OkStatus());

  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo done, coordinator_->GetJob(job.job_id()));
  EXPECT_EQ(done.state(), JobInfo::DONE);
  EXPECT_EQ(done.finish_reason(), JobInfo::STOP);
  EXPECT_EQ(done.output_text(), "x");
  EXPECT_EQ(done.usage().prompt_tokens(), 603u);
  EXPECT_EQ(done.usage().cached_tokens(), 600u);
  EXPECT_EQ(done.usage().pages_fetched().host(), 7u);
  EXPECT_EQ(done.leader_worker_id(), "w1");
  // Watcher saw: QUEUED, PREFILLING, DECODING, tokens, DONE.
  std::vector<std::string> seen;
  for (const auto& ev : watcher.events) {
    seen.push_back(ev.has_snapshot() ? JobInfo::State_Name(ev.snapshot().state()) : "tokens");
  }
  EXPECT_EQ(seen, (std::vector<std::string>{"QUEUED", "PREFILLING", "DECODING", "tokens", "DONE"}));
  EXPECT_THAT(coordinator_->CancelJob(job.job_id()), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(CoordinatorTest, CancelReachesTheLeader) {
  RegisterWorker("w1");
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job("")));  // no document
  coordinator_->Tick();
  ASSERT_EQ(workers_.runs().size(), 1u);
  STRATA_ASSERT_OK(coordinator_->CancelJob(job.job_id()).status());
  auto cancels = workers_.cancels();
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_EQ(cancels[0].first, "w1");
  EXPECT_EQ(cancels[0].second, job.job_id());
  // The worker's late events are ignored.
  v1::JobEvent e;
  e.mutable_tokens()->add_token_ids(1);
  workers_.runs()[0].on_event(e);
  workers_.runs()[0].on_done(absl::CancelledError());
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::CANCELLED);
}

// Given a job running on w1, when w1 stops heartbeating, then the job is requeued and w2 runs it.
TEST_F(CoordinatorTest, SilentWorkerLosesItsJobs) {
  RegisterWorker("w1");
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job("")));
  coordinator_->Tick();
  ASSERT_EQ(workers_.runs().size(), 1u);
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::PREFILLING);
  now_ += 2 * kSecond;
  RegisterWorker("w2");
  now_ += 2 * kSecond;  // w1 silent for 4 s > 3 s; w2 for 2 s
  coordinator_->Tick();
  auto runs = workers_.runs();
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[1].worker_id, "w2");
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::PREFILLING);
  // The old leader's stream ending late changes nothing.
  runs[0].on_done(absl::UnavailableError("gone"));
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo now_running, coordinator_->GetJob(job.job_id()));
  EXPECT_EQ(now_running.leader_worker_id(), "w2");
  Beat("w2");
}

TEST_F(CoordinatorTest, PrefillFailureFailsDocumentAndItsJobs) {
  RegisterWorker("w1");
  const std::string doc = Upload(20);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  coordinator_->Tick();
  ASSERT_EQ(workers_.prefills().size(), 1u);
  workers_.prefills()[0].on_done(absl::InternalError("out of memory"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto info, coordinator_->GetDocument(doc));
  EXPECT_EQ(info.state(), v1::DocumentInfo::FAILED);
  EXPECT_THAT(info.error_message(), HasSubstr("out of memory"));
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo failed, coordinator_->GetJob(job.job_id()));
  EXPECT_EQ(failed.state(), JobInfo::FAILED);
  EXPECT_EQ(failed.error_code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
}

TEST_F(CoordinatorTest, RestartKeepsCatalogAndRequeuesRunningJobs) {
  const std::string doc = Upload(10);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo queued, coordinator_->SubmitJob(Job(doc)));
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo cancelled, coordinator_->SubmitJob(Job(doc)));
  STRATA_ASSERT_OK(coordinator_->CancelJob(cancelled.job_id()).status());
  RegisterWorker("w1");
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo running, coordinator_->SubmitJob(Job("")));
  coordinator_->Tick();
  EXPECT_EQ(StateOf(running.job_id()), JobInfo::PREFILLING);

  Restart();
  EXPECT_EQ(CountDocuments(), 1u);
  EXPECT_EQ(CountJobs(), 3u);
  EXPECT_EQ(StateOf(queued.job_id()), JobInfo::QUEUED);
  EXPECT_EQ(StateOf(cancelled.job_id()), JobInfo::CANCELLED);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo requeued, coordinator_->GetJob(running.job_id()));
  EXPECT_EQ(requeued.state(), JobInfo::QUEUED);
  EXPECT_TRUE(requeued.leader_worker_id().empty());
  // The workers must register again with the new process.
  EXPECT_THAT(coordinator_->Heartbeat([&] {
    v1::HeartbeatRequest r;
    r.set_worker_id("w1");
    r.set_lease_id(leases_["w1"]);
    return r;
  }()),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(CoordinatorTest, DrainRefusesWorkAndHandsBackRunningJobs) {
  RegisterWorker("w1");
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job("")));
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->RunningJobs(), 1);
  coordinator_->StartDrain();
  EXPECT_THAT(coordinator_->SubmitJob(Job("")), StatusIs(absl::StatusCode::kUnavailable));
  DocumentContent content;
  content.tokens = {1, 2};
  EXPECT_THAT(coordinator_->UploadDocument(v1::DocumentUploadOptions(), content),
              StatusIs(absl::StatusCode::kUnavailable));
  coordinator_->HandBackRunningJobs();
  EXPECT_EQ(coordinator_->RunningJobs(), 0);
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::QUEUED);
  ASSERT_EQ(workers_.cancels().size(), 1u);
}

TEST_F(CoordinatorTest, ListFiltersAndPages) {
  const std::string a = Upload(10, 1);
  const std::string b = Upload(10, 100);
  for (int i = 0; i < 5; ++i) STRATA_ASSERT_OK(coordinator_->SubmitJob(Job(i < 3 ? a : b)).status());
  v1::JobListRequest request;
  request.set_document_id(a);
  STRATA_ASSERT_OK_AND_ASSIGN(auto on_a, coordinator_->ListJobs(request));
  EXPECT_EQ(on_a.jobs_size(), 3);
  request.Clear();
  request.set_page_size(2);
  std::set<std::string> seen;
  for (int page = 0; page < 5; ++page) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto list, coordinator_->ListJobs(request));
    for (const auto& j : list.jobs()) seen.insert(j.job_id());
    if (list.next_page_token().empty()) break;
    request.set_page_token(list.next_page_token());
  }
  EXPECT_EQ(seen.size(), 5u);
  request.Clear();
  request.set_page_size(5000);
  EXPECT_THAT(coordinator_->ListJobs(request), StatusIs(absl::StatusCode::kInvalidArgument));
  v1::DocumentListRequest docs;
  docs.set_state(v1::DocumentInfo::READY);
  STRATA_ASSERT_OK_AND_ASSIGN(auto ready, coordinator_->ListDocuments(docs));
  EXPECT_EQ(ready.documents_size(), 0);
}

TEST_F(CoordinatorTest, IncompatibleWorkersAreRefused) {
  options_.model_fingerprint = "llama-abc";
  Restart();
  v1::RegisterWorkerRequest r;
  r.mutable_worker()->set_worker_id("w1");
  r.mutable_worker()->set_address("127.0.0.1:1");
  r.mutable_worker()->set_capacity_tokens(1000);
  r.mutable_worker()->set_max_jobs(1);
  r.mutable_worker()->set_model_fingerprint("qwen-xyz");
  EXPECT_THAT(coordinator_->RegisterWorker(r), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("model")));
  r.mutable_worker()->set_model_fingerprint("llama-abc");
  r.mutable_worker()->mutable_layout()->set_page_size(32);  // the deployment uses 16
  EXPECT_THAT(coordinator_->RegisterWorker(r), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("pages")));
  r.mutable_worker()->mutable_layout()->set_page_size(16);
  r.mutable_worker()->set_vocab_size(32000);  // the coordinator validates against 1000
  EXPECT_THAT(coordinator_->RegisterWorker(r), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("vocabulary")));
  r.mutable_worker()->set_vocab_size(1000);
  STRATA_ASSERT_OK(coordinator_->RegisterWorker(r));
}

TEST_F(CoordinatorTest, RequestIdDeduplicatesRetries) {
  const std::string doc = Upload(10);
  v1::JobSubmitRequest r = Job(doc);
  r.set_request_id("client-42/attempt");
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo first, coordinator_->SubmitJob(r));
  EXPECT_EQ(first.request_id(), "client-42/attempt");
  r.mutable_params()->set_max_tokens(9);  // not compared
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo retry, coordinator_->SubmitJob(r));
  EXPECT_EQ(retry.job_id(), first.job_id());
  EXPECT_EQ(retry.params().max_tokens(), 8u);
  Restart();
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo after_restart, coordinator_->SubmitJob(r));
  EXPECT_EQ(after_restart.job_id(), first.job_id());
  EXPECT_EQ(CountJobs(), 1u);
  r.set_request_id(std::string(129, 'x'));
  EXPECT_THAT(coordinator_->SubmitJob(r), StatusIs(absl::StatusCode::kInvalidArgument));
  r.set_request_id("has space");
  EXPECT_THAT(coordinator_->SubmitJob(r), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(CountJobs(), 1u);
}

TEST_F(CoordinatorTest, JobIdsSortByCreationTime) {
  const std::string doc = Upload(10);
  std::vector<std::string> ids;
  for (int i = 0; i < 20; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
    ids.push_back(job.job_id());
    now_ += 1'000'000;  // 1 ms
  }
  EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto list, coordinator_->ListJobs(v1::JobListRequest()));
  ASSERT_EQ(list.jobs_size(), 20);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(list.jobs(i).job_id(), ids[i]);
}

TEST_F(CoordinatorTest, PinSetsPinAndTtl) {
  const std::string doc = Upload(10);
  v1::DocumentPinRequest pin;
  pin.set_document_id(doc);
  pin.set_pinned(true);
  pin.set_ttl_seconds(60);
  STRATA_ASSERT_OK_AND_ASSIGN(auto info, coordinator_->PinDocument(pin));
  EXPECT_TRUE(info.pinned());
  EXPECT_EQ(info.expire_time_micros(), now_ / 1000 + 60'000'000);
  pin.set_ttl_seconds(-1);
  EXPECT_THAT(coordinator_->PinDocument(pin), StatusIs(absl::StatusCode::kInvalidArgument));
  // Past 100 years: refused (now + ttl in microseconds would overflow int64 near its maximum).
  pin.set_ttl_seconds(kMaxTtlSeconds + 1);
  EXPECT_THAT(coordinator_->PinDocument(pin), StatusIs(absl::StatusCode::kInvalidArgument));
  pin.set_ttl_seconds(std::numeric_limits<int64_t>::max());
  EXPECT_THAT(coordinator_->PinDocument(pin), StatusIs(absl::StatusCode::kInvalidArgument));
  pin.set_ttl_seconds(kMaxTtlSeconds);
  STRATA_ASSERT_OK_AND_ASSIGN(info, coordinator_->PinDocument(pin));
  EXPECT_EQ(info.expire_time_micros(), now_ / 1000 + kMaxTtlSeconds * 1'000'000);
  pin.set_document_id("0123456789abcdef0123456789abcdef");
  pin.set_ttl_seconds(0);
  EXPECT_THAT(coordinator_->PinDocument(pin), StatusIs(absl::StatusCode::kNotFound));
  // An upload's time to live has the same range; a refused upload stores nothing.
  DocumentContent content;
  for (int i = 0; i < 5; ++i) content.tokens.push_back(400 + i);
  v1::DocumentUploadOptions options;
  const size_t documents = CountDocuments();
  for (int64_t ttl : {int64_t{-1}, kMaxTtlSeconds + 1, std::numeric_limits<int64_t>::max()}) {
    options.set_ttl_seconds(ttl);
    EXPECT_THAT(coordinator_->UploadDocument(options, content),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("ttl_seconds")))
        << ttl;
  }
  EXPECT_EQ(CountDocuments(), documents);
  options.set_ttl_seconds(kMaxTtlSeconds);
  STRATA_ASSERT_OK(coordinator_->UploadDocument(options, content).status());
}

TEST_F(CoordinatorTest, ExpiredUnpinnedDocumentsAreCollected) {
  auto upload = [&](int first, int64_t ttl, bool pin) {
    DocumentContent content;
    for (int i = 0; i < 5; ++i) content.tokens.push_back(first + i);
    v1::DocumentUploadOptions options;
    options.set_ttl_seconds(ttl);
    options.set_pin(pin);
    auto r = coordinator_->UploadDocument(options, content);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->document().document_id() : "";
  };
  const std::string expiring = upload(1, 10, false);
  const std::string pinned = upload(100, 10, true);
  const std::string forever = upload(200, 0, false);
  const std::string in_use = upload(300, 10, false);
  STRATA_ASSERT_OK(coordinator_->SubmitJob(Job(in_use)));
  RecordingDocumentObserver watcher;
  STRATA_ASSERT_OK(coordinator_->WatchDocument(expiring, &watcher));
  coordinator_->Tick();  // first collection: nothing has expired
  EXPECT_EQ(CountDocuments(), 4u);
  now_ += 61 * kSecond;  // past the TTL and the collection interval
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->GetDocument(expiring), StatusIs(absl::StatusCode::kNotFound));
  STRATA_EXPECT_OK(coordinator_->GetDocument(pinned));
  STRATA_EXPECT_OK(coordinator_->GetDocument(forever));
  STRATA_EXPECT_OK(coordinator_->GetDocument(in_use));
  ASSERT_FALSE(watcher.statuses.empty());
  EXPECT_EQ(watcher.statuses.back().code(), absl::StatusCode::kNotFound);
}

// Given three workers and an EXACT document of three shards, then shard i is sent only once
// shard i-1 is durable, without an anchor; once READY each holder mounts its shard and the job
// gets the map with the holders' addresses.
TEST_F(CoordinatorTest, ExactPrefillIsSequentialAndJobsWaitForMounts) {
  for (const char* w : {"w1", "w2", "w3"}) RegisterWorker(w);
  DocumentContent content;
  for (int i = 0; i < 600; ++i) content.tokens.push_back(1 + i % 999);
  v1::DocumentUploadOptions upload;
  upload.set_prefill_mode(v1::DocumentInfo::EXACT);
  STRATA_ASSERT_OK_AND_ASSIGN(auto uploaded, coordinator_->UploadDocument(upload, content));
  EXPECT_EQ(uploaded.document().prefill_mode(), v1::DocumentInfo::EXACT);
  const std::string doc = uploaded.document().document_id();
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  coordinator_->Tick();
  for (int shard = 0; shard < 3; ++shard) {
    auto prefills = workers_.prefills();
    ASSERT_EQ(prefills.size(), static_cast<size_t>(shard + 1)) << "shard " << shard;
    const auto& call = prefills.back();
    EXPECT_EQ(call.request.mode(), v1::PREFILL_MODE_EXACT);
    EXPECT_EQ(call.request.anchor_token_ids_size(), 0);
    EXPECT_EQ(call.request.shard_map().shards_size(), 3);
    EXPECT_EQ(call.request.shard().first_page(), call.request.shard_map().shards(shard).range().first_page());
    EXPECT_EQ(call.request.token_ids(0), content.tokens[call.request.shard().first_page() * 16]);
    coordinator_->Tick();  // nothing else starts while the shard runs
    EXPECT_EQ(workers_.prefills().size(), static_cast<size_t>(shard + 1));
    STRATA_ASSERT_OK_AND_ASSIGN(auto info, coordinator_->GetDocument(doc));
    EXPECT_EQ(info.progress().shards_ready(), static_cast<uint32_t>(shard));
    EXPECT_EQ(info.progress().shards_total(), 3u);
    FinishPrefills();
  }
  STRATA_ASSERT_OK_AND_ASSIGN(auto info, coordinator_->GetDocument(doc));
  EXPECT_EQ(info.state(), v1::DocumentInfo::READY);
  EXPECT_TRUE(workers_.runs().empty());
  auto mounts = MountsSince(0);
  ASSERT_EQ(mounts.size(), 3u);
  std::set<std::string> holders;
  for (const auto& m : mounts) holders.insert(m.worker_id);
  EXPECT_EQ(holders, (std::set<std::string>{"w1", "w2", "w3"}));
  // Each holder has one shard of three: its pages serve the other leaders' selection streams.
  for (const auto& m : mounts) EXPECT_FALSE(m.whole_document);
  // One mount done is not enough.
  mounts[0].on_done(absl::OkStatus());
  coordinator_->Tick();
  EXPECT_TRUE(workers_.runs().empty());
  mounts[1].on_done(absl::OkStatus());
  mounts[2].on_done(absl::UnimplementedError("this worker mounts when it runs a job"));  // counts as mounted
  mounts_done_ = workers_.mounts().size();
  ASSERT_EQ(workers_.runs().size(), 1u);
  const v1::RunJobRequest run = workers_.runs()[0].request;
  EXPECT_EQ(run.job_id(), job.job_id());
  ASSERT_EQ(run.shard_map().shards_size(), 3);
  for (const auto& a : run.shard_map().shards()) {
    EXPECT_EQ(a.worker_address(), "127.0.0.1:1");
    EXPECT_EQ(a.selection_link_address(), "127.0.0.1:2");  // the holder's selection link
  }
  EXPECT_EQ(workers_.prefills().size(), 3u);
}

TEST_F(CoordinatorTest, PrefillModeDefaultsAnchorCapAndBadModes) {
  options_.default_prefill_mode = v1::DocumentInfo::EXACT;
  options_.anchor_tokens = 40;
  Restart();
  RegisterWorker("w1");
  DocumentContent content;
  for (int i = 0; i < 600; ++i) content.tokens.push_back(1 + i % 999);
  v1::DocumentUploadOptions upload;
  upload.set_prefill_mode(static_cast<v1::DocumentInfo::PrefillMode>(7));
  EXPECT_THAT(coordinator_->UploadDocument(upload, content), StatusIs(absl::StatusCode::kInvalidArgument));
  v1::JobSubmitRequest inline_job = Job("");
  inline_job.mutable_inline_document()->mutable_tokens()->add_ids(5);
  inline_job.mutable_inline_document()->set_prefill_mode(static_cast<v1::DocumentInfo::PrefillMode>(9));
  EXPECT_THAT(coordinator_->SubmitJob(inline_job), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(CountDocuments(), 0u);
  // No mode: the server default (EXACT here).
  STRATA_ASSERT_OK_AND_ASSIGN(auto exact, coordinator_->UploadDocument(v1::DocumentUploadOptions(), content));
  EXPECT_EQ(exact.document().prefill_mode(), v1::DocumentInfo::EXACT);
  coordinator_->Tick();
  EXPECT_EQ(workers_.prefills().size(), 1u);
  // ANCHOR: the anchor is capped at anchor_tokens.
  content.tokens[0] = 998;
  upload.set_prefill_mode(v1::DocumentInfo::ANCHOR);
  STRATA_ASSERT_OK_AND_ASSIGN(auto anchor, coordinator_->UploadDocument(upload, content));
  EXPECT_EQ(anchor.document().prefill_mode(), v1::DocumentInfo::ANCHOR);
  coordinator_->Tick();
  auto prefills = workers_.prefills();
  ASSERT_EQ(prefills.size(), 4u);
  EXPECT_EQ(prefills[2].request.anchor_token_ids_size(), 40);
  EXPECT_EQ(prefills[2].request.anchor_token_ids(0), 998);
  EXPECT_EQ(prefills[3].request.mode(), v1::PREFILL_MODE_ANCHOR);
  options_.anchor_tokens = 0;
  EXPECT_FALSE(options_.Validate().ok());
}

// Given a READY document on three workers, when a worker that leads no job is dropped, then its
// shard moves to a live worker (map version + 1), which mounts it; nothing is prefilled again and
// the running job is untouched. When the leader is dropped, its job is requeued and runs again.
TEST_F(CoordinatorTest, DroppedWorkersShardsMoveWithoutPrefill) {
  for (const char* w : {"w1", "w2", "w3"}) RegisterWorker(w);
  const std::string doc = Upload(600);
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  coordinator_->Tick();
  FinishPrefills();
  FinishMounts();
  ASSERT_EQ(workers_.runs().size(), 1u);
  const std::string leader = workers_.runs()[0].worker_id;
  const v1::ShardMap before = workers_.runs()[0].request.shard_map();
  EXPECT_EQ(before.version(), 1u);
  std::string peer;
  for (const char* w : {"w1", "w2", "w3"}) {
    if (w != leader && peer.empty()) peer = w;
  }
  // Everyone but `peer` heartbeats; `peer` is dropped after the 3 s timeout.
  const size_t mounts_before = workers_.mounts().size();
  for (int i = 0; i < 4; ++i) {
    now_ += kSecond;
    for (const char* w : {"w1", "w2", "w3"}) {
      if (w != peer) Beat(w);
    }
    coordinator_->Tick();
  }
  auto moved = MountsSince(mounts_before);
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_NE(moved[0].worker_id, peer);
  FinishMounts();
  EXPECT_EQ(workers_.prefills().size(), 3u);  // no prefill again
  EXPECT_EQ(workers_.runs().size(), 1u);      // the job runs on
  EXPECT_EQ(StateOf(job.job_id()), JobInfo::PREFILLING);
  STRATA_ASSERT_OK_AND_ASSIGN(auto doc_info, coordinator_->GetDocument(doc));
  EXPECT_EQ(doc_info.state(), v1::DocumentInfo::READY);

  // The leader deregisters: its job goes back to the queue and runs on the last worker, with the
  // map of version 3 (the leader's shard moved too).
  v1::DeregisterWorkerRequest bye;
  bye.set_worker_id(leader);
  bye.set_lease_id(leases_[leader]);
  STRATA_ASSERT_OK(coordinator_->DeregisterWorker(bye));
  FinishMounts();
  auto runs = workers_.runs();
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_NE(runs[1].worker_id, leader);
  EXPECT_NE(runs[1].worker_id, peer);
  EXPECT_EQ(runs[1].request.shard_map().version(), 3u);
  for (const auto& a : runs[1].request.shard_map().shards()) EXPECT_EQ(a.worker_id(), runs[1].worker_id);
  EXPECT_EQ(workers_.prefills().size(), 3u);
  // The old leader's stream ending late changes nothing.
  runs[0].on_done(absl::UnavailableError("gone"));
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo now_running, coordinator_->GetJob(job.job_id()));
  EXPECT_EQ(now_running.leader_worker_id(), runs[1].worker_id);
}

// Given a READY, mounted document, when the coordinator restarts, then the workers registering
// again mount their shards again; shards of a worker that does not come back move only after the
// grace period (one heartbeat timeout).
TEST_F(CoordinatorTest, RestartRemountsReadyDocuments) {
  for (const char* w : {"w1", "w2", "w3"}) RegisterWorker(w);
  const std::string doc = Upload(600);
  coordinator_->Tick();
  FinishPrefills();
  coordinator_->Tick();
  EXPECT_EQ(MountsSince(0).size(), 3u);  // mounted once READY, without any job
  FinishMounts();

  Restart();
  size_t mark = workers_.mounts().size();
  RegisterWorker("w1");
  RegisterWorker("w2");
  coordinator_->Tick();
  auto again = MountsSince(mark);
  EXPECT_EQ(again.size(), 2u);  // w1's and w2's shards; w3's waits for w3 (grace period)
  for (const auto& m : again) EXPECT_NE(m.worker_id, "w3");
  FinishMounts();
  STRATA_ASSERT_OK_AND_ASSIGN(JobInfo job, coordinator_->SubmitJob(Job(doc)));
  coordinator_->Tick();
  EXPECT_TRUE(workers_.runs().empty());
  // w3 never comes back: after the grace period its shard moves.
  mark = workers_.mounts().size();
  for (int i = 0; i < 4; ++i) {
    now_ += kSecond;
    Beat("w1");
    Beat("w2");
    coordinator_->Tick();
  }
  auto moved = MountsSince(mark);
  ASSERT_EQ(moved.size(), 1u);
  FinishMounts();
  ASSERT_EQ(workers_.runs().size(), 1u);
  EXPECT_EQ(workers_.runs()[0].request.job_id(), job.job_id());
  EXPECT_EQ(workers_.runs()[0].request.shard_map().version(), 2u);
  EXPECT_EQ(workers_.prefills().size(), 3u);  // READY survived the restart: no prefill
  STRATA_ASSERT_OK_AND_ASSIGN(auto info, coordinator_->GetDocument(doc));
  EXPECT_EQ(info.state(), v1::DocumentInfo::READY);
}

TEST_F(CoordinatorTest, FailedMountIsRetriedAndDeleteUnmounts) {
  RegisterWorker("w1");
  const std::string doc = Upload(100);
  coordinator_->Tick();
  FinishPrefills();
  coordinator_->Tick();
  ASSERT_EQ(MountsSince(0).size(), 1u);
  FinishMounts(absl::InternalError("disk full"));
  coordinator_->Tick();
  EXPECT_EQ(MountsSince(0).size(), 1u);  // not at once
  now_ += 2 * kSecond;
  Beat("w1");
  coordinator_->Tick();
  ASSERT_EQ(MountsSince(0).size(), 2u);
  FinishMounts();
  STRATA_ASSERT_OK(coordinator_->DeleteDocument(doc));
  auto calls = workers_.mounts();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_FALSE(calls.back().mount);
  EXPECT_EQ(calls.back().worker_id, "w1");
  EXPECT_EQ(calls.back().shard.document_id(), doc);
  EXPECT_EQ(calls.back().shard.end_page(), 7u);  // 100 tokens in pages of 16
  FinishMounts();
}

// Given a mounted shard, when the worker's heartbeats stop reporting it (after the settling
// time of two heartbeat intervals), then the coordinator asks for the mount again.
TEST_F(CoordinatorTest, ShardMissingFromHeartbeatsIsMountedAgain) {
  RegisterWorker("w1");
  Upload(100);
  coordinator_->Tick();
  FinishPrefills();
  coordinator_->Tick();
  ASSERT_EQ(MountsSince(0).size(), 1u);
  FinishMounts();
  for (int i = 0; i < 3; ++i) {
    now_ += kSecond;
    Beat("w1");  // reports the shard
    coordinator_->Tick();
  }
  EXPECT_EQ(MountsSince(0).size(), 1u);
  mounted_["w1"].clear();  // the worker dropped it
  now_ += kSecond;
  Beat("w1");
  coordinator_->Tick();
  auto mounts = MountsSince(0);
  ASSERT_EQ(mounts.size(), 2u);
  EXPECT_EQ(mounts[1].worker_id, "w1");
  EXPECT_EQ(mounts[1].shard.end_page(), 7u);
}

}  // namespace
}  // namespace strata::coordinator
