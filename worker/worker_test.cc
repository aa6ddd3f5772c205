// Tests of worker::Worker on a tiny random model with an embedded LocalStore: prefill persists
// every page and finalizes the document; a job on the READY document loads its KV (no prefill)
// and generates the same greedy tokens as engine::Generate over document + prompt; cancellation.
#include "worker/worker.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/generator.h"
#include "gtest/gtest.h"
#include "kvstore/local_store.h"
#include "kvstore/metrics.h"
#include "model/random_model.h"
#include "prometheus/registry.h"

namespace strata::worker {
namespace {

constexpr char kDocId[] = "0123456789abcdef0123456789abcdef";

class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_worker_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    model::RandomModelOptions mo;
    mo.preset = "tiny";
    mo.seed = 7;
    mo.write_tokenizer = false;
    std::printf("seed=%llu\n", static_cast<unsigned long long>(mo.seed));
    ASSERT_TRUE(model::WriteRandomModel(dir_ + "/model", mo).ok());
    STRATA_ASSERT_OK_AND_ASSIGN(model_, model::LoadModel(dir_ + "/model"));
    backend_ = kernels::MakeCpuBackend(1);
    kv_metrics_ = std::make_unique<kvstore::KvMetrics>(&registry_);
    kvstore::LocalStoreOptions so;
    so.path = dir_ + "/kv";
    so.metrics = kv_metrics_.get();
    STRATA_ASSERT_OK_AND_ASSIGN(store_, kvstore::LocalStore::Open(so));
    metrics_ = std::make_unique<WorkerMetrics>(&registry_);
    WorkerOptions wo;
    wo.prefill_chunk_size = 64;
    STRATA_ASSERT_OK_AND_ASSIGN(worker_, Worker::Create(wo, model_.get(), backend_.get(), store_.get(),
                                                        store_.get(), metrics_.get()));
    for (int i = 0; i < 150; ++i) doc_.push_back((i * 37 + 11) % 500);
  }
  void TearDown() override {
    worker_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }

  v1::PrefillShardRequest PrefillRequest() const {
    v1::PrefillShardRequest r;
    r.mutable_shard()->set_document_id(kDocId);
    r.mutable_shard()->set_first_page(0);
    r.mutable_shard()->set_end_page(3);
    r.mutable_shard_map()->set_document_id(kDocId);
    r.mutable_shard_map()->set_page_size(64);
    r.mutable_shard_map()->set_num_tokens(doc_.size());
    r.mutable_token_ids()->Assign(doc_.begin(), doc_.end());
    return r;
  }
  v1::RunJobRequest JobRequest(const std::string& id, const std::vector<int32_t>& prompt) const {
    v1::RunJobRequest r;
    r.set_job_id(id);
    r.mutable_shard_map()->set_document_id(kDocId);
    r.mutable_shard_map()->set_page_size(64);
    r.mutable_shard_map()->set_num_tokens(doc_.size());
    r.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(kDocId);
    r.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
    r.mutable_params()->set_max_tokens(8);
    r.mutable_params()->set_ignore_eos(true);
    return r;
  }

  std::string dir_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<kernels::Backend> backend_;
  prometheus::Registry registry_;
  std::unique_ptr<kvstore::KvMetrics> kv_metrics_;
  std::unique_ptr<kvstore::LocalStore> store_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::unique_ptr<Worker> worker_;
  std::vector<int32_t> doc_;
};

TEST_F(WorkerTest, PrefillPersistsAndJobMatchesLocalGenerate) {
  std::vector<v1::PrefillShardProgress> progress;
  ASSERT_TRUE(worker_->PrefillShard(PrefillRequest(), [&](const v1::PrefillShardProgress& p) { progress.push_back(p); },
                                    nullptr).ok());
  ASSERT_FALSE(progress.empty());
  EXPECT_TRUE(progress.back().complete());
  EXPECT_EQ(progress.back().pages_persisted(), 3u);
  EXPECT_GE(progress.size(), 3u);  // chunks of 64 tokens
  STRATA_ASSERT_OK_AND_ASSIGN(kvstore::DocumentId id, kvstore::DocumentId::FromHex(kDocId));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->GetDocument(id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(doc.stored_pages(), 3u * 2 * 2);  // pages x layers x KV heads

  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9};
  std::vector<v1::JobEvent> events;
  ASSERT_TRUE(worker_->RunJob(JobRequest("job-1", prompt), [&](const v1::JobEvent& e) {
    events.push_back(e);
    return true;
  }).ok());
  ASSERT_FALSE(events.empty());
  ASSERT_TRUE(events.back().has_snapshot());
  const v1::JobInfo& info = events.back().snapshot();
  EXPECT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(info.usage().cached_tokens(), doc_.size());
  EXPECT_EQ(info.usage().prompt_tokens(), doc_.size() + prompt.size());
  EXPECT_EQ(info.usage().pages_fetched().disk(), 3u * 2 * 2);
  EXPECT_EQ(info.output_token_ids_size(), 8);

  // Reference: the whole sequence through engine::Generate with a bf16 KV cache.
  std::vector<int32_t> all = doc_;
  all.insert(all.end(), prompt.begin(), prompt.end());
  engine::TransformerOptions topt;
  topt.prefill_chunk_size = 64;
  STRATA_ASSERT_OK_AND_ASSIGN(auto tf, engine::Transformer::Create(model_->config, model_->weights, backend_.get(), topt));
  engine::GenerateOptions go;
  go.max_tokens = 8;
  go.ignore_eos = true;
  go.kv_dtype = kernels::DType::kBF16;
  auto dense = engine::MakeDensePolicy();
  STRATA_ASSERT_OK_AND_ASSIGN(engine::GenerateResult ref, engine::Generate(tf.get(), nullptr, all, go, dense.get(), nullptr));
  std::vector<int32_t> got(info.output_token_ids().begin(), info.output_token_ids().end());
  EXPECT_EQ(got, ref.tokens);

  // Prefilling a READY document again is a no-op that reports completion.
  progress.clear();
  ASSERT_TRUE(worker_->PrefillShard(PrefillRequest(), [&](const v1::PrefillShardProgress& p) { progress.push_back(p); },
                                    nullptr).ok());
  ASSERT_EQ(progress.size(), 1u);
  EXPECT_TRUE(progress[0].complete());
}

TEST_F(WorkerTest, UnknownDocumentFailsTheJob) {
  std::vector<v1::JobEvent> events;
  ASSERT_TRUE(worker_->RunJob(JobRequest("job-2", {1, 2}), [&](const v1::JobEvent& e) {
    events.push_back(e);
    return true;
  }).ok());
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().snapshot().state(), v1::JobInfo::FAILED);
  EXPECT_EQ(events.back().snapshot().error_code(), static_cast<int>(absl::StatusCode::kNotFound));
}

TEST_F(WorkerTest, ReceiverGoneCancelsTheJob) {
  ASSERT_TRUE(worker_->PrefillShard(PrefillRequest(), nullptr, nullptr).ok());
  int tokens = 0;
  absl::Status s = worker_->RunJob(JobRequest("job-3", {1, 2}), [&](const v1::JobEvent& e) {
    if (e.has_tokens()) ++tokens;
    return tokens < 2;
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(tokens, 2);
  EXPECT_FALSE(worker_->CancelJob("job-3"));  // no longer running
}

TEST_F(WorkerTest, SparsePolicyAttendsLessThanTheContext) {
  ASSERT_TRUE(worker_->PrefillShard(PrefillRequest(), nullptr, nullptr).ok());
  v1::RunJobRequest req = JobRequest("job-5", {1, 2, 3});
  req.mutable_policy()->set_name("quest");
  req.mutable_policy()->set_budget_tokens(16);
  req.mutable_policy()->set_sink_tokens(4);
  req.mutable_policy()->set_window_tokens(16);
  req.mutable_policy()->set_page_size(64);
  v1::JobInfo last;
  ASSERT_TRUE(worker_->RunJob(req, [&](const v1::JobEvent& e) {
    if (e.has_snapshot()) last = e.snapshot();
    return true;
  }).ok());
  ASSERT_EQ(last.state(), v1::JobInfo::DONE) << last.error_message();
  EXPECT_EQ(last.output_token_ids_size(), 8);
  EXPECT_GT(last.usage().mean_attended_tokens(), 0.0);
  EXPECT_LT(last.usage().mean_attended_tokens(), static_cast<double>(doc_.size()));

  req.set_job_id("job-6");
  req.mutable_policy()->set_page_size(32);  // not the deployment's page size
  ASSERT_TRUE(worker_->RunJob(req, [&](const v1::JobEvent& e) {
    if (e.has_snapshot()) last = e.snapshot();
    return true;
  }).ok());
  EXPECT_EQ(last.state(), v1::JobInfo::FAILED);
  EXPECT_EQ(last.error_code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
}

TEST_F(WorkerTest, CancelJobEndsWithCancelledSnapshot) {
  ASSERT_TRUE(worker_->PrefillShard(PrefillRequest(), nullptr, nullptr).ok());
  v1::RunJobRequest req = JobRequest("job-4", {1, 2});
  req.mutable_params()->set_max_tokens(100000);
  int tokens = 0;
  v1::JobInfo last;
  absl::Status s = worker_->RunJob(req, [&](const v1::JobEvent& e) {
    if (e.has_tokens() && ++tokens == 3) EXPECT_TRUE(worker_->CancelJob("job-4"));
    if (e.has_snapshot()) last = e.snapshot();
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(last.state(), v1::JobInfo::CANCELLED);
  EXPECT_EQ(last.finish_reason(), v1::JobInfo::CANCELLED_BY_CLIENT);
  EXPECT_LE(tokens, 4);
}

// Lazy mount (WorkerOptions::lazy_mount) over a 10-page document (640 tokens; the tiny model has
// 2 layers x 2 KV heads, so 40 pages in all), prefilled by the fixture's worker; a second worker
// on the same store mounts lazily.
class LazyMountTest : public WorkerTest {
 protected:
  void SetUp() override {
    WorkerTest::SetUp();
    if (HasFatalFailure()) return;
    doc_.clear();
    for (int i = 0; i < 640; ++i) doc_.push_back((i * 37 + 11) % 500);
    v1::PrefillShardRequest r = PrefillRequest();
    r.mutable_shard()->set_end_page(10);
    STRATA_ASSERT_OK(worker_->PrefillShard(r, nullptr, nullptr));
  }
  std::unique_ptr<Worker> LazyWorker(int64_t cache_pages) {
    WorkerOptions wo;
    wo.worker_id = "lazy";
    wo.prefill_chunk_size = 64;
    wo.lazy_mount = true;
    wo.lazy_cache_pages = cache_pages;
    auto w = Worker::Create(wo, model_.get(), backend_.get(), store_.get(), store_.get(), nullptr);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  }
  static v1::JobInfo Run(Worker* w, const v1::RunJobRequest& req) {
    v1::JobInfo last;
    EXPECT_TRUE(w->RunJob(req, [&](const v1::JobEvent& e) {
      if (e.has_snapshot()) last = e.snapshot();
      return true;
    }).ok());
    EXPECT_EQ(last.state(), v1::JobInfo::DONE) << last.error_message();
    return last;
  }
  static uint64_t Fetched(const v1::JobInfo& info) {
    const v1::PagesByTier& t = info.usage().pages_fetched();
    return t.host() + t.disk() + t.remote();
  }
  static std::vector<int32_t> Tokens(const v1::JobInfo& info) {
    return std::vector<int32_t>(info.output_token_ids().begin(), info.output_token_ids().end());
  }
  v1::RunJobRequest Quest(const std::string& id, uint32_t budget, uint32_t window, int max_tokens) const {
    v1::RunJobRequest req = JobRequest(id, {5, 6, 7, 8, 9});
    req.mutable_policy()->set_name("quest");
    req.mutable_policy()->set_budget_tokens(budget);
    req.mutable_policy()->set_sink_tokens(64);
    req.mutable_policy()->set_window_tokens(window);
    req.mutable_params()->set_max_tokens(max_tokens);
    return req;
  }
};

TEST_F(LazyMountTest, EveryPageChosenGivesTheFullMountTokens) {
  // A budget above the document: the full mount's quest attends the whole middle, the lazy
  // chooser picks every page; both selections are the whole document.
  const v1::JobInfo full = Run(worker_.get(), Quest("full", 1024, 64, 8));
  EXPECT_EQ(Fetched(full), 40u);
  std::unique_ptr<Worker> lazy = LazyWorker(8192);
  ASSERT_NE(lazy, nullptr);
  const v1::JobInfo got = Run(lazy.get(), Quest("lazy", 1024, 64, 8));
  EXPECT_EQ(Tokens(got), Tokens(full));
  EXPECT_EQ(Fetched(got), 40u);  // each page once: the page cache serves the later steps
  EXPECT_EQ(got.usage().cached_tokens(), 640u);
}

TEST_F(LazyMountTest, SmallBudgetFetchesOnlyChosenPagesAndCacheSizeDoesNotChangeTokens) {
  // Per forward and (layer, KV head): page 0, the last page and 1 middle page. 4 forwards
  // (prompt + 3 decode steps) touch at most 2 + 4 pages of each (layer, KV head).
  std::unique_ptr<Worker> big = LazyWorker(8192);
  ASSERT_NE(big, nullptr);
  const v1::JobInfo a = Run(big.get(), Quest("big", 64, 64, 4));
  EXPECT_GE(Fetched(a), 12u);
  EXPECT_LE(Fetched(a), 24u);
  EXPECT_LT(Fetched(a), 40u);
  EXPECT_LT(a.usage().mean_attended_tokens(), 640.0);
  // A cache of 1 page grows to one call's need (2 heads x 3 pages) and evicts between layers:
  // every call refetches its 6 pages (4 forwards x 2 layers x 6), and the tokens are the same.
  std::unique_ptr<Worker> tiny = LazyWorker(1);
  ASSERT_NE(tiny, nullptr);
  const v1::JobInfo b = Run(tiny.get(), Quest("tiny", 64, 64, 4));
  EXPECT_EQ(Tokens(b), Tokens(a));
  EXPECT_EQ(Fetched(b), 48u);
}

TEST_F(LazyMountTest, DenseJobStillLoadsEveryPage) {
  const v1::JobInfo full = Run(worker_.get(), JobRequest("full-dense", {5, 6, 7}));
  std::unique_ptr<Worker> lazy = LazyWorker(8192);
  ASSERT_NE(lazy, nullptr);
  const v1::JobInfo got = Run(lazy.get(), JobRequest("lazy-dense", {5, 6, 7}));
  EXPECT_EQ(Tokens(got), Tokens(full));
  EXPECT_EQ(got.usage().pages_fetched().disk(), 40u);
}

TEST(WorkerOptionsTest, RejectsOutOfRangeValuesNamingTheField) {
  STRATA_EXPECT_OK(WorkerOptions().Validate());
  struct Case {
    const char* field;
    void (*set)(WorkerOptions*);
  };
  const Case cases[] = {
      {"max_decode_batch", [](WorkerOptions* o) { o->max_decode_batch = 0; }},
      {"peer_timeout_ms", [](WorkerOptions* o) { o->peer_timeout_ms = 0; }},
      {"lazy_cache_pages", [](WorkerOptions* o) { o->lazy_cache_pages = 0; }},
      {"page_size", [](WorkerOptions* o) { o->page_size = 0; }},
  };
  for (const Case& c : cases) {
    WorkerOptions o;
    c.set(&o);
    const absl::Status s = o.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace strata::worker
