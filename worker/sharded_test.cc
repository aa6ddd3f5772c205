// A document sharded over three in-process workers (worker::Worker + WorkerServer on 127.0.0.1,
// real gRPC between them) sharing one LocalStore in a temp dir, on a tiny random model:
// - EXACT prefill shard by shard; the document turns READY only with the last shard; the job led
//   by one worker (its own shard in process, the two others over ShardSelection) gives the same
//   greedy tokens as engine::Generate over the whole sequence with a bf16 KV cache and as a
//   single-worker job on the same document;
// - a peer shut down in the middle of decoding: the leader mounts its shard from the store and
//   the job completes with the same tokens (no prefill: prefill_tokens does not move);
// - ANCHOR prefill of the shards in parallel makes the document READY; EXACT out of order and a
//   too long anchor are refused;
// - MountShard / UnmountShard / Load().mounted_tokens / MountedShards, a selection stream, and
//   PeerPages.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/generator.h"
#include "engine/kv_cache.h"
#include "engine/transformer.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/testing/capturing_backend.h"
#include "gtest/gtest.h"
#include "kvstore/local_store.h"
#include "kvstore/page_format.h"
#include "model/random_model.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "strata/v1/internal.grpc.pb.h"
#include "worker/selection_link.h"
#include "worker/service.h"
#include "worker/shard_attention.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

using ::strata::testing::StatusIs;

constexpr char kDocId[] = "00112233445566778899aabbccddeeff";
constexpr int kPage = 64;
constexpr int kWorkers = 3;

// The CPU backend under another name: the transformer and the worker then treat its memory as
// device memory (explicit copies; mounted shards on a separate host backend), which exercises the
// GPU code paths without a GPU.
class DeviceLikeBackend : public kernels::CpuBackend {
 public:
  DeviceLikeBackend() : kernels::CpuBackend(1) {}
  std::string Name() const override { return "cuda:test"; }
};

// A DeviceLikeBackend that counts the calls that attend and select: the shard backend of a
// worker whose shards are placed on the device (WorkerOptions::shard_placement).
class CountingShardBackend : public DeviceLikeBackend {
 public:
  absl::Status PagedAttention(const kernels::PagedAttentionParams& p, kernels::Stream s) override {
    ++attention_calls;
    return DeviceLikeBackend::PagedAttention(p, s);
  }
  absl::Status SelectStages(const kernels::SelectStagesParams& p, kernels::Stream s) override {
    ++selection_calls;
    return DeviceLikeBackend::SelectStages(p, s);
  }
  absl::StatusOr<std::unique_ptr<kernels::Buffer>> Allocate(size_t bytes) override {
    if (full) return absl::ResourceExhaustedError("test: the shard backend is full");
    return DeviceLikeBackend::Allocate(bytes);
  }
  std::atomic<int64_t> attention_calls{0};
  std::atomic<int64_t> selection_calls{0};
  std::atomic<bool> full{false};  // every Allocate fails with ResourceExhausted
};

// The CPU backend with a switch: once armed, its next PagedAttention fails (Internal), once.
class FailOnceBackend : public kernels::CpuBackend {
 public:
  FailOnceBackend() : kernels::CpuBackend(1) {}
  absl::Status PagedAttention(const kernels::PagedAttentionParams& p, kernels::Stream s) override {
    if (armed.exchange(false)) {
      ++failures;
      return absl::InternalError("test: injected PagedAttention failure");
    }
    return kernels::CpuBackend::PagedAttention(p, s);
  }
  std::atomic<bool> armed{false};
  std::atomic<int> failures{0};
};

// A TCP socket bound to a free port of 127.0.0.1 (*port), listening or not; -1 on failure.
int LoopbackSocket(bool listening, int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      (listening && listen(fd, 4) != 0) || getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

class ShardedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_sharded_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    model::RandomModelOptions mo;
    mo.preset = "tiny";
    mo.seed = 7;
    mo.write_tokenizer = false;
    std::printf("seed=%llu\n", static_cast<unsigned long long>(mo.seed));
    ASSERT_TRUE(model::WriteRandomModel(dir_ + "/model", mo).ok());
    STRATA_ASSERT_OK_AND_ASSIGN(model_, model::LoadModel(dir_ + "/model"));
    kvstore::LocalStoreOptions so;
    so.path = dir_ + "/kv";
    so.sync_writes = false;
    STRATA_ASSERT_OK_AND_ASSIGN(store_, kvstore::LocalStore::Open(so));
    for (int i = 0; i < kWorkers; ++i) {
      if (device_like_) {
        backends_.push_back(std::make_unique<DeviceLikeBackend>());
      } else if (failing_leader_ && i == 1) {
        auto b = std::make_unique<FailOnceBackend>();
        failing_ = b.get();
        backends_.push_back(std::move(b));
      } else {
        backends_.push_back(kernels::MakeCpuBackend(1));
      }
      registries_.push_back(std::make_unique<prometheus::Registry>());
      metrics_.push_back(std::make_unique<WorkerMetrics>(registries_.back().get()));
      WorkerOptions wo;
      wo.worker_id = absl::StrCat("w", i);
      wo.prefill_chunk_size = 48;  // chunks that do not align with pages or shards
      wo.peer_timeout_ms = 20000;  // generous: a slow answer under load must not fail over
      if (shards_on_device_) shard_backends_.push_back(std::make_unique<CountingShardBackend>());
      STRATA_ASSERT_OK_AND_ASSIGN(auto w, Worker::Create(wo, model_.get(), backends_.back().get(), store_.get(),
                                                         store_.get(), metrics_.back().get(),
                                                         shards_on_device_ ? shard_backends_.back().get() : nullptr));
      STRATA_ASSERT_OK_AND_ASSIGN(auto s, WorkerServer::Start(WorkerServerOptions{"127.0.0.1:0"}, w.get()));
      w->SetAddress(absl::StrCat("127.0.0.1:", s->port()));
      workers_.push_back(std::move(w));
      servers_.push_back(std::move(s));
    }
    for (int i = 0; i < 330; ++i) doc_.push_back((i * 37 + 11) % 500);  // 6 pages, the last partial
  }
  void TearDown() override {
    for (auto& s : servers_) s->Shutdown(absl::ZeroDuration());
    servers_.clear();
    workers_.clear();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }

  // Shards: w0 pages [0, 2), w1 [2, 4), w2 [4, 6).
  v1::ShardMap Map() const {
    v1::ShardMap m;
    m.set_document_id(kDocId);
    m.set_page_size(kPage);
    m.set_num_tokens(doc_.size());
    for (int i = 0; i < kWorkers; ++i) {
      v1::ShardAssignment* a = m.add_shards();
      a->mutable_range()->set_document_id(kDocId);
      a->mutable_range()->set_first_page(bounds_[i]);
      a->mutable_range()->set_end_page(bounds_[i + 1]);
      a->set_worker_id(absl::StrCat("w", i));
      a->set_worker_address(workers_[i]->Info().address());
      a->set_selection_link_address(workers_[i]->Info().selection_link_address());
    }
    return m;
  }
  v1::PrefillShardRequest Prefill(int shard, v1::PrefillMode mode) const {
    v1::PrefillShardRequest r;
    *r.mutable_shard_map() = Map();
    *r.mutable_shard() = r.shard_map().shards(shard).range();
    const size_t t0 = static_cast<size_t>(bounds_[shard]) * kPage;
    const size_t t1 = std::min(doc_.size(), static_cast<size_t>(bounds_[shard + 1]) * kPage);
    r.mutable_token_ids()->Assign(doc_.begin() + t0, doc_.begin() + t1);
    r.mutable_anchor_token_ids()->Assign(doc_.begin(), doc_.begin() + kPage);
    r.set_mode(mode);
    return r;
  }
  v1::RunJobRequest Job(const std::string& id, int max_tokens, const std::vector<int32_t>* prompt = nullptr) const {
    v1::RunJobRequest r;
    r.set_job_id(id);
    *r.mutable_shard_map() = Map();
    for (int32_t t : prompt != nullptr ? *prompt : prompt_) r.add_prompt_token_ids(t);
    r.mutable_params()->set_max_tokens(max_tokens);
    r.mutable_params()->set_ignore_eos(true);
    return r;
  }
  // A LayerQuery of `step` for layer 1: two tokens after the document, every query value 0.01.
  v1::SelectionRequest TwoTokenQuery(uint64_t step) const {
    const model::ModelConfig& c = model_->config;
    v1::SelectionRequest q;
    q.mutable_query()->set_step(step);
    q.mutable_query()->set_layer(1);
    q.mutable_query()->set_num_tokens(2);
    q.mutable_query()->set_q_begin(doc_.size());
    std::vector<float> qv(2 * c.num_heads * c.head_dim, 0.01f);
    q.mutable_query()->set_q(reinterpret_cast<const char*>(qv.data()), qv.size() * sizeof(float));
    return q;
  }
  // The job over the peers' gRPC ShardSelection streams instead of their selection links.
  static v1::RunJobRequest OverGrpc(v1::RunJobRequest r) {
    for (v1::ShardAssignment& a : *r.mutable_shard_map()->mutable_shards()) a.clear_selection_link_address();
    return r;
  }
  // Waits (up to 10 s) until `counter` reaches `want`; its value.
  static double AwaitCount(const prometheus::Counter* counter, double want) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (counter->Value() < want && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
    return counter->Value();
  }
  v1::DocumentState State() {
    auto id = kvstore::DocumentId::FromHex(kDocId);
    auto doc = store_->GetDocument(*id);
    return doc.ok() ? doc->state() : v1::DOCUMENT_STATE_UNSPECIFIED;
  }
  void PrefillExact() {
    for (int i = 0; i < kWorkers; ++i) {
      STRATA_ASSERT_OK(workers_[i]->PrefillShard(Prefill(i, v1::PREFILL_MODE_EXACT), nullptr, nullptr));
      EXPECT_EQ(State(), i + 1 < kWorkers ? v1::DOCUMENT_STATE_WRITING : v1::DOCUMENT_STATE_READY) << "shard " << i;
      // Every shard after the first loads the earlier ones' pages (strata_page_load_seconds).
      EXPECT_EQ(metrics_[i]->page_load_prefill->Collect().histogram.sample_count, i > 0 ? 1u : 0u) << "shard " << i;
    }
  }
  std::vector<int32_t> Reference(int max_tokens, const std::vector<int32_t>* prompt = nullptr) {
    std::vector<int32_t> all = doc_;
    const std::vector<int32_t>& pr = prompt != nullptr ? *prompt : prompt_;
    all.insert(all.end(), pr.begin(), pr.end());
    engine::TransformerOptions topt;
    topt.prefill_chunk_size = 64;
    auto tf = engine::Transformer::Create(model_->config, model_->weights, backends_[0].get(), topt);
    EXPECT_TRUE(tf.ok());
    engine::GenerateOptions go;
    go.max_tokens = max_tokens;
    go.ignore_eos = true;
    go.kv_dtype = kernels::DType::kBF16;
    auto dense = engine::MakeDensePolicy();
    auto ref = engine::Generate(tf->get(), nullptr, all, go, dense.get(), nullptr);
    EXPECT_TRUE(ref.ok());
    return ref.ok() ? ref->tokens : std::vector<int32_t>();
  }
  v1::JobInfo Run(int leader, const v1::RunJobRequest& req, const Worker::EventFn& also = nullptr) {
    return RunOn(workers_[leader].get(), req, also);
  }
  // The job led by `leader` (any worker); its last snapshot.
  static v1::JobInfo RunOn(Worker* leader, const v1::RunJobRequest& req, const Worker::EventFn& also = nullptr) {
    v1::JobInfo last;
    absl::Status s = leader->RunJob(req, [&](const v1::JobEvent& e) {
      if (e.has_snapshot()) last = e.snapshot();
      return also ? also(e) : true;
    });
    EXPECT_TRUE(s.ok()) << s;
    return last;
  }
  // Two jobs at once, led by workers `la` and `lb`.
  std::pair<v1::JobInfo, v1::JobInfo> RunTwo(int la, const v1::RunJobRequest& a, int lb, const v1::RunJobRequest& b) {
    std::pair<v1::JobInfo, v1::JobInfo> out;
    std::thread ta([&] { out.first = Run(la, a); });
    std::thread tb([&] { out.second = Run(lb, b); });
    ta.join();
    tb.join();
    return out;
  }
  static std::vector<int32_t> Tokens(const v1::JobInfo& info) {
    return std::vector<int32_t>(info.output_token_ids().begin(), info.output_token_ids().end());
  }
  double PrefillTokens() const {
    double sum = 0;
    for (const auto& m : metrics_) sum += m->prefill_tokens->Value();
    return sum;
  }

  bool device_like_ = false;
  bool failing_leader_ = false;  // worker 1's backend is a FailOnceBackend (failing_)
  FailOnceBackend* failing_ = nullptr;
  bool shards_on_device_ = false;  // with device_like_: each worker gets a CountingShardBackend
  std::vector<std::unique_ptr<CountingShardBackend>> shard_backends_;
  // Shard i holds pages [bounds_[i], bounds_[i + 1]).
  std::vector<int> bounds_ = {0, 2, 4, 6};
  std::string dir_;
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<kvstore::LocalStore> store_;
  std::vector<std::unique_ptr<kernels::Backend>> backends_;
  std::vector<std::unique_ptr<prometheus::Registry>> registries_;
  std::vector<std::unique_ptr<WorkerMetrics>> metrics_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::unique_ptr<WorkerServer>> servers_;
  std::vector<int32_t> doc_;
  std::vector<int32_t> prompt_ = {5, 6, 7, 8, 9, 10, 11};
};

TEST_F(ShardedTest, ExactPrefillAndDenseJobMatchOneProcess) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(12);
  ASSERT_EQ(want.size(), 12u);
  std::string shown;
  for (int32_t t : want) absl::StrAppend(&shown, t, " ");
  std::printf("reference tokens: %s\n", shown.c_str());
  // Led by w1: its own shard in process, w0's and w2's over their selection links.
  ASSERT_FALSE(workers_[0]->Info().selection_link_address().empty());
  const v1::JobInfo info = Run(1, Job("sharded-1", 12));
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(Tokens(info), want);
  EXPECT_EQ(info.usage().cached_tokens(), doc_.size());
  EXPECT_EQ(info.usage().prompt_tokens(), doc_.size() + prompt_.size());
  // Every shard's pages were read once from the store (2 pages x 2 layers x 2 KV heads each).
  EXPECT_EQ(info.usage().pages_fetched().disk(), 3u * 2 * 2 * 2);
  // Dense: every context token attended at each decode step.
  EXPECT_GT(info.usage().mean_attended_tokens(), static_cast<double>(doc_.size()));
  EXPECT_EQ(workers_[1]->failovers(), 0);
  // The leader timed its attention over the shards: one call per layer of each of its 12 forwards
  // (the prompt's one chunk, then 11 decode steps) on the 2-layer model.
  EXPECT_EQ(metrics_[1]->shard_attention_layers->Value(), 12.0 * 2);
  EXPECT_GT(metrics_[1]->shard_attention_local_seconds->Value(), 0.0);
  EXPECT_GT(metrics_[1]->shard_attention_peer_seconds->Value(), 0.0);
  EXPECT_EQ(metrics_[0]->shard_attention_layers->Value(), 0.0);  // w0 only answered
  // w0 answered each of those calls over its selection stream; it counts them when the stream
  // ends, which it sees shortly after the job (the leader cancels its streams).
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (metrics_[0]->shard_answers->Value() < 12.0 * 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(metrics_[0]->shard_answers->Value(), 12.0 * 2);
  EXPECT_GT(metrics_[0]->shard_answer_queue_seconds->Value(), 0.0);
  EXPECT_GT(metrics_[0]->shard_answer_wait_seconds->Value(), 0.0);
  EXPECT_GT(metrics_[0]->shard_answer_send_seconds->Value(), 0.0);
  EXPECT_EQ(metrics_[1]->shard_answers->Value(), 0.0);  // the leader answered no stream
  EXPECT_EQ(metrics_[0]->selection_streams_link->Value(), 1.0);
  EXPECT_EQ(metrics_[0]->selection_streams_grpc->Value(), 0.0);

  // The same job over the peers' gRPC streams: the same tokens.
  const v1::JobInfo grpc = Run(1, OverGrpc(Job("sharded-grpc", 12)));
  ASSERT_EQ(grpc.state(), v1::JobInfo::DONE) << grpc.error_message();
  EXPECT_EQ(Tokens(grpc), want);
  EXPECT_EQ(AwaitCount(metrics_[0]->shard_answers, 2 * 12.0 * 2), 2 * 12.0 * 2);
  EXPECT_EQ(metrics_[0]->selection_streams_grpc->Value(), 1.0);
  EXPECT_EQ(metrics_[0]->selection_streams_link->Value(), 1.0);
  // Peers mounted their shards on demand.
  EXPECT_EQ(workers_[0]->Load().mounted_tokens(), 128u);
  EXPECT_EQ(workers_[2]->Load().mounted_tokens(), 330u - 256u);

  // The same document led by one worker that holds every shard (no worker ids in the map).
  v1::RunJobRequest single = Job("single-1", 12);
  for (v1::ShardAssignment& a : *single.mutable_shard_map()->mutable_shards()) {
    a.clear_worker_id();
    a.clear_worker_address();
  }
  const v1::JobInfo one = Run(0, single);
  ASSERT_EQ(one.state(), v1::JobInfo::DONE) << one.error_message();
  EXPECT_EQ(Tokens(one), want);

  // A map that does not cover the document is refused.
  v1::RunJobRequest bad = Job("bad-1", 4);
  bad.mutable_shard_map()->mutable_shards()->RemoveLast();
  const v1::JobInfo failed = Run(1, bad);
  EXPECT_EQ(failed.state(), v1::JobInfo::FAILED);
  EXPECT_EQ(failed.error_code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
}

TEST_F(ShardedTest, LongerDocumentOverUnevenShards) {
  // 1000 tokens (16 pages, the last partial) in shards of 3, 8 and 5 pages; 32 tokens.
  doc_.clear();
  for (int i = 0; i < 1000; ++i) doc_.push_back((i * 131 + 7) % 509);
  bounds_ = {0, 3, 11, 16};
  PrefillExact();
  const std::vector<int32_t> want = Reference(32);
  const v1::JobInfo info = Run(2, Job("long-1", 32));
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(Tokens(info), want);
}

class ShardedDeviceLikeTest : public ShardedTest {
 protected:
  void SetUp() override {
    device_like_ = true;
    ShardedTest::SetUp();
  }
};

TEST_F(ShardedDeviceLikeTest, ExactPrefillAndBatchedDenseJobsMatchOneProcess) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(12);
  const auto [a, b] = RunTwo(1, Job("device-a", 12), 1, Job("device-b", 12));
  ASSERT_EQ(a.state(), v1::JobInfo::DONE) << a.error_message();
  ASSERT_EQ(b.state(), v1::JobInfo::DONE) << b.error_message();
  EXPECT_EQ(Tokens(a), want);
  EXPECT_EQ(Tokens(b), want);
}

// Workers with a shard backend (a second "GPU" instance): mounted shards live and are attended
// there, for the peers' selection answers and the leader's own shard alike.
class ShardedDevicePlacedTest : public ShardedTest {
 protected:
  void SetUp() override {
    device_like_ = true;
    shards_on_device_ = true;
    ShardedTest::SetUp();
  }
};

TEST_F(ShardedDevicePlacedTest, DenseJobsMatchOneProcess) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(12);
  // Two leaders at once: w1's and w2's shard sessions share each worker's shard backend.
  const auto [a, b] = RunTwo(1, Job("placed-a", 12), 2, Job("placed-b", 12));
  ASSERT_EQ(a.state(), v1::JobInfo::DONE) << a.error_message();
  ASSERT_EQ(b.state(), v1::JobInfo::DONE) << b.error_message();
  EXPECT_EQ(Tokens(a), want);
  EXPECT_EQ(Tokens(b), want);
  // Every worker attended its shard on its shard backend (answers, or its own part as leader).
  for (int i = 0; i < kWorkers; ++i) {
    EXPECT_GT(shard_backends_[i]->attention_calls.load(), 0) << "worker " << i;
  }
  EXPECT_EQ(workers_[0]->Load().mounted_tokens(), 128u);
}

TEST_F(ShardedDevicePlacedTest, SparseJobsSelectOnTheShardBackend) {
  PrefillExact();
  for (const char* name : {"quest", "tokenselect"}) {
    SCOPED_TRACE(name);
    const int64_t selections = shard_backends_[0]->selection_calls.load();
    v1::RunJobRequest req = Job(absl::StrCat("placed-", name), 6);
    req.mutable_policy()->set_name(name);
    req.mutable_policy()->set_budget_tokens(64);
    req.mutable_policy()->set_sink_tokens(4);
    req.mutable_policy()->set_window_tokens(16);
    const v1::JobInfo info = Run(1, req);
    ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
    EXPECT_EQ(info.output_token_ids_size(), 6);
    EXPECT_GT(info.usage().mean_attended_tokens(), 0.0);
    EXPECT_LT(info.usage().mean_attended_tokens(), static_cast<double>(doc_.size()));
    // w0 selected on its shard backend: one SelectStages per layer of each answer.
    EXPECT_GT(shard_backends_[0]->selection_calls.load(), selections);
  }
  // The decode steps' answers looked up the selection cache on the device.
  EXPECT_GT(metrics_[0]->selection_cache_lookups->Value(), 0.0);
  // A budget that covers each shard attends everything: the dense tokens.
  v1::RunJobRequest all = Job("placed-all", 12);
  all.mutable_policy()->set_name("tokenselect");
  all.mutable_policy()->set_budget_tokens(4096);
  const v1::JobInfo info = Run(0, all);
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(Tokens(info), Reference(12));
}

TEST_F(ShardedDevicePlacedTest, OtherPoliciesReadAHostCopy) {
  PrefillExact();
  const int64_t attended = shard_backends_[2]->attention_calls.load();
  v1::RunJobRequest req = Job("placed-streaming", 6);
  req.mutable_policy()->set_name("streaming");
  req.mutable_policy()->set_budget_tokens(64);
  const v1::JobInfo info = Run(1, req);
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(info.output_token_ids_size(), 6);
  // w2 answered from a host copy of its shard: nothing ran on its shard backend; the copy is
  // counted and listed as a mount.
  EXPECT_EQ(shard_backends_[2]->attention_calls.load(), attended);
  EXPECT_EQ(workers_[2]->Load().mounted_tokens(), 330u - 256u);
  ASSERT_EQ(workers_[2]->MountedShards().size(), 1u);
  EXPECT_GT(info.usage().pages_fetched().disk(), 0u);
  // A second such job reuses the copies: no page is read again.
  req.set_job_id("placed-streaming-2");
  const v1::JobInfo again = Run(1, req);
  ASSERT_EQ(again.state(), v1::JobInfo::DONE) << again.error_message();
  EXPECT_EQ(again.usage().pages_fetched().disk(), 0u);
  EXPECT_EQ(Tokens(again), Tokens(info));
  // A dense job then mounts the shard on the device beside the copy (both counted), and
  // unmounting drops both.
  const v1::JobInfo dense = Run(1, Job("placed-dense", 4));
  ASSERT_EQ(dense.state(), v1::JobInfo::DONE) << dense.error_message();
  EXPECT_GT(shard_backends_[2]->attention_calls.load(), attended);
  EXPECT_EQ(workers_[2]->Load().mounted_tokens(), 2 * (330u - 256u));
  EXPECT_EQ(workers_[2]->MountedShards().size(), 1u);
  v1::UnmountShardRequest un;
  *un.mutable_shard() = Map().shards(2).range();
  STRATA_ASSERT_OK(workers_[2]->UnmountShard(un));
  EXPECT_EQ(workers_[2]->Load().mounted_tokens(), 0u);
}

TEST_F(ShardedDevicePlacedTest, ShardsThatDoNotFitOnTheDeviceMountInHostMemory) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(8);
  for (auto& b : shard_backends_) b->full = true;
  for (const char* name : {"", "tokenselect"}) {
    SCOPED_TRACE(name);
    v1::RunJobRequest req = Job(absl::StrCat("full-", name), 8);
    req.mutable_policy()->set_name(name);
    const v1::JobInfo info = Run(1, req);
    ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
    if (*name == '\0') {
      EXPECT_EQ(Tokens(info), want);
    }
  }
  // Nothing ran on the full shard backends; the host mounts are registered and counted.
  for (auto& b : shard_backends_) EXPECT_EQ(b->attention_calls.load(), 0);
  EXPECT_EQ(workers_[0]->Load().mounted_tokens(), 128u);
  EXPECT_EQ(workers_[1]->failovers(), 0);
}

TEST_F(ShardedTest, DeviceShardSessionsRefuseHostPoliciesAndUnstartedFinish) {
  // A device-placed shard (here on the CPU backend) with one page of zero keys in every layer.
  auto tf = engine::Transformer::Create(model_->config, model_->weights, backends_[0].get(), {});
  ASSERT_TRUE(tf.ok()) << tf.status();
  STRATA_ASSERT_OK_AND_ASSIGN(auto cache,
                              engine::KvCache::Create((*tf)->MakeCacheOptions(kPage, kPage, kernels::DType::kBF16),
                                                      backends_[0].get()));
  const int64_t hkv = model_->config.num_kv_heads, d = model_->config.head_dim;
  std::vector<float> kv(static_cast<size_t>(kPage * hkv * d), 0.0f);
  for (int l = 0; l < static_cast<int>(model_->config.num_layers); ++l) {
    const kernels::TensorView rows(kv.data(), kernels::DType::kF32, {kPage, hkv, d});
    STRATA_ASSERT_OK(cache->Append(l, rows, rows));
  }
  v1::ShardRange range = Map().shards(0).range();
  range.set_end_page(1);
  auto shard = std::make_shared<const MountedShard>(range, *kvstore::DocumentId::FromHex(kDocId), 0,
                                                    std::move(cache), kvstore::TierCounts(), backends_[0].get(),
                                                    nullptr, /*device_selection=*/true);
  v1::SelectionPolicy streaming;
  streaming.set_name("streaming");
  EXPECT_THAT(ShardSession::Create(shard, streaming, 0, model_->config).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  v1::SelectionPolicy quest;
  quest.set_name("quest");
  STRATA_ASSERT_OK_AND_ASSIGN(auto session, ShardSession::Create(shard, quest, 32, model_->config));
  EXPECT_THAT(session->Finish(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// Random keys and values [tokens, kv heads, head_dim] for MountRows.
std::vector<float> RandomRows(int64_t tokens, const model::ModelConfig& c, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> rows(static_cast<size_t>(tokens * c.num_kv_heads * c.head_dim));
  for (float& x : rows) x = nd(rng);
  return rows;
}

// A shard of the document's first tokens whose every layer holds keys k and values v ([tokens,
// kv heads, head_dim] f32), in a bf16 cache on `be`.
absl::StatusOr<std::shared_ptr<const MountedShard>> MountRows(const std::vector<float>& k, const std::vector<float>& v,
                                                              int64_t tokens, const model::ModelConfig& c,
                                                              kernels::Backend* be, bool device_selection) {
  engine::KvCacheOptions co;
  co.num_layers = static_cast<int>(c.num_layers);
  co.num_kv_heads = static_cast<int>(c.num_kv_heads);
  co.head_dim = static_cast<int>(c.head_dim);
  co.page_size = kPage;
  co.dtype = kernels::DType::kBF16;
  co.max_tokens = tokens;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::KvCache> cache, engine::KvCache::Create(co, be));
  const int64_t hkv = co.num_kv_heads, d = co.head_dim;
  const kernels::TensorView kv(const_cast<float*>(k.data()), kernels::DType::kF32, {tokens, hkv, d});
  const kernels::TensorView vv(const_cast<float*>(v.data()), kernels::DType::kF32, {tokens, hkv, d});
  for (int l = 0; l < co.num_layers; ++l) STRATA_RETURN_IF_ERROR(cache->Append(l, kv, vv));
  v1::ShardRange range;
  range.set_document_id(kDocId);
  range.set_first_page(0);
  range.set_end_page(static_cast<uint64_t>((tokens + kPage - 1) / kPage));
  return std::make_shared<const MountedShard>(range, *kvstore::DocumentId::FromHex(kDocId), 0, std::move(cache),
                                              kvstore::TierCounts(), be, nullptr, device_selection);
}

TEST_F(ShardedTest, DenseSessionOnADeviceShardMatchesTheHostShard) {
  // The same random cache mounted for device selection (dense one-token steps through its page
  // table with SelectedAttention) and for the host (spans and PagedAttention): the same partials.
  const int64_t hkv = model_->config.num_kv_heads, hq = model_->config.num_heads, d = model_->config.head_dim;
  const int64_t tokens = 3 * kPage + 5;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const std::vector<float> k = RandomRows(tokens, model_->config, rng), v = RandomRows(tokens, model_->config, rng);
  std::shared_ptr<const MountedShard> shards[2];
  for (int i = 0; i < 2; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(shards[i], MountRows(k, v, tokens, model_->config, backends_[0].get(), i == 0));
  }
  const v1::SelectionPolicy dense;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, ShardSession::Create(shards[0], dense, 0, model_->config));
  STRATA_ASSERT_OK_AND_ASSIGN(auto host, ShardSession::Create(shards[1], dense, 0, model_->config));
  for (const int n : {1, 3}) {
    std::vector<float> q(static_cast<size_t>(n * hq * d));
    for (float& x : q) x = nd(rng);
    for (int l = 0; l < static_cast<int>(model_->config.num_layers); ++l) {
      SCOPED_TRACE(::testing::Message() << n << " queries, layer " << l);
      engine::AttentionPartial got, want;
      engine::SelectionCounters got_c, want_c;
      STRATA_ASSERT_OK(device->Attend(l, q.data(), n, static_cast<int>(hq), tokens, &got, &got_c));
      STRATA_ASSERT_OK(host->Attend(l, q.data(), n, static_cast<int>(hq), tokens, &want, &want_c));
      ASSERT_EQ(got.o.size(), want.o.size());
      ASSERT_EQ(got.lse.size(), want.lse.size());
      for (size_t i = 0; i < want.o.size(); ++i) ASSERT_NEAR(got.o[i], want.o[i], 1e-5) << i;
      for (size_t i = 0; i < want.lse.size(); ++i) ASSERT_NEAR(got.lse[i], want.lse[i], 1e-5) << i;
      EXPECT_EQ(got_c.candidate_tokens, tokens * hkv);
      EXPECT_EQ(got_c.selected_tokens, want_c.selected_tokens);
    }
  }
}

TEST_F(ShardedTest, TokenSelectPartsRoundTheShardsBudgetShareUp) {
  // tokenselect in 4 parts keeps ceil(budget / 4) tokens per part: a shard's share of 30 tokens
  // keeps 32 (a session with the share 32 gives the same partials and counts, bit for bit), on a
  // device-selection shard and a host one, whose partials agree; 3 parts are refused.
  const int64_t hq = model_->config.num_heads, d = model_->config.head_dim;
  const int64_t tokens = 12 * kPage + 5;
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  const std::vector<float> k = RandomRows(tokens, model_->config, rng), v = RandomRows(tokens, model_->config, rng);
  v1::SelectionPolicy policy;
  policy.set_name("tokenselect");
  policy.set_partitions(4);
  std::vector<float> q(static_cast<size_t>(hq * d));
  for (float& x : q) x = nd(rng);
  engine::AttentionPartial first;
  for (const bool device : {true, false}) {
    SCOPED_TRACE(device ? "device" : "host");
    STRATA_ASSERT_OK_AND_ASSIGN(std::shared_ptr<const MountedShard> shard,
                                MountRows(k, v, tokens, model_->config, backends_[0].get(), device));
    STRATA_ASSERT_OK_AND_ASSIGN(auto rounded, ShardSession::Create(shard, policy, 30, model_->config));
    STRATA_ASSERT_OK_AND_ASSIGN(auto exact, ShardSession::Create(shard, policy, 32, model_->config));
    for (int l = 0; l < static_cast<int>(model_->config.num_layers); ++l) {
      SCOPED_TRACE(::testing::Message() << "layer " << l);
      engine::AttentionPartial a, b;
      engine::SelectionCounters ca, cb;
      STRATA_ASSERT_OK(rounded->Attend(l, q.data(), 1, static_cast<int>(hq), tokens, &a, &ca));
      STRATA_ASSERT_OK(exact->Attend(l, q.data(), 1, static_cast<int>(hq), tokens, &b, &cb));
      EXPECT_EQ(a.o, b.o);
      EXPECT_EQ(a.lse, b.lse);
      EXPECT_EQ(ca.selected_tokens, cb.selected_tokens);
      EXPECT_LT(ca.selected_tokens, ca.candidate_tokens);  // a selection
      if (l == 0 && device) first = a;
      if (l == 0 && !device) {
        ASSERT_EQ(a.o.size(), first.o.size());
        for (size_t i = 0; i < a.o.size(); ++i) ASSERT_NEAR(a.o[i], first.o[i], 1e-4) << i;
        for (size_t i = 0; i < a.lse.size(); ++i) ASSERT_NEAR(a.lse[i], first.lse[i], 1e-4) << i;
      }
    }
    v1::SelectionPolicy three = policy;
    three.set_partitions(3);
    EXPECT_THAT(ShardSession::Create(shard, three, 30, model_->config).status(),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

// A capturing backend whose graphs cannot be made: every recording fails at its end.
class NoGraphBackend : public kernels::testing::CapturingBackend {
 public:
  absl::StatusOr<std::unique_ptr<kernels::Graph>> EndCapture(kernels::Stream s) override {
    STRATA_RETURN_IF_ERROR(CapturingBackend::EndCapture(s).status());
    return absl::InternalError("no graphs here");
  }
};

TEST_F(ShardedTest, ShardStepGraphsGiveTheCallByCallPartialsAndCounts) {
  // The same random shard on the CPU backend (one-token steps queued call by call) and on a
  // capturing backend (each layer's step recorded at its first call, then replayed), and on one
  // whose recordings fail (the step falls back to call by call): the same partials, bit for bit,
  // and the same counts (tokens, selection-cache lookups and hits), tokenselect (the selection
  // cache on: the queries repeat) and dense.
  const int64_t hkv = model_->config.num_kv_heads, hq = model_->config.num_heads, d = model_->config.head_dim;
  const int layers = static_cast<int>(model_->config.num_layers);
  const int64_t tokens = 6 * kPage + 5;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd;
  const std::vector<float> k = RandomRows(tokens, model_->config, rng), v = RandomRows(tokens, model_->config, rng);
  kernels::testing::CapturingBackend capturing;
  NoGraphBackend no_graphs;
  kernels::Backend* const bes[3] = {backends_[0].get(), &capturing, &no_graphs};
  std::shared_ptr<const MountedShard> shards[3];
  for (int i = 0; i < 3; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(shards[i], MountRows(k, v, tokens, model_->config, bes[i], true));
  }
  v1::SelectionPolicy tokenselect;
  tokenselect.set_name("tokenselect");
  tokenselect.set_budget_tokens(32);
  for (const v1::SelectionPolicy& policy : {tokenselect, v1::SelectionPolicy()}) {
    SCOPED_TRACE(policy.name());
    std::unique_ptr<ShardSession> sessions[3];
    for (int i = 0; i < 3; ++i) {
      STRATA_ASSERT_OK_AND_ASSIGN(sessions[i], ShardSession::Create(shards[i], policy, 0, model_->config));
    }
    engine::SelectionCounters counts[3];
    std::vector<float> q(static_cast<size_t>(hq * d));
    int64_t recorded_after_first = 0;
    for (int step = 0; step < 4; ++step) {
      if (step != 2) {
        for (float& x : q) x = nd(rng);  // step 2 repeats step 1's queries: selection-cache hits
      }
      for (int l = 0; l < layers; ++l) {
        SCOPED_TRACE(::testing::Message() << "step " << step << " layer " << l);
        engine::AttentionPartial parts[3];
        for (int i = 0; i < 3; ++i) {
          STRATA_ASSERT_OK(sessions[i]->Attend(l, q.data(), 1, static_cast<int>(hq), tokens, &parts[i], &counts[i]));
        }
        for (int i = 1; i < 3; ++i) {
          EXPECT_EQ(parts[i].o, parts[0].o) << "backend " << i;
          EXPECT_EQ(parts[i].lse, parts[0].lse) << "backend " << i;
        }
      }
      if (step == 0) recorded_after_first = capturing.recorded_ops();
    }
    EXPECT_GT(recorded_after_first, 0);
    EXPECT_EQ(capturing.recorded_ops(), recorded_after_first);  // recorded once per layer, then replayed
    for (int i = 1; i < 3; ++i) {
      EXPECT_EQ(counts[i].candidate_tokens, counts[0].candidate_tokens) << "backend " << i;
      EXPECT_EQ(counts[i].selected_tokens, counts[0].selected_tokens) << "backend " << i;
      EXPECT_EQ(counts[i].cache_lookups, counts[0].cache_lookups) << "backend " << i;
      EXPECT_EQ(counts[i].cache_hits, counts[0].cache_hits) << "backend " << i;
    }
    EXPECT_EQ(counts[0].candidate_tokens, 4 * layers * tokens * hkv);
    if (!policy.name().empty()) {
      EXPECT_LT(counts[0].selected_tokens, counts[0].candidate_tokens);
      EXPECT_GT(counts[0].cache_hits, 0);
    }
  }
}

TEST_F(ShardedTest, ShardPlacementNeedsAShardBackendOnAGpuWorker) {
  DeviceLikeBackend gpu;
  WorkerOptions wo;
  wo.shard_placement = "device";
  EXPECT_THAT(Worker::Create(wo, model_.get(), &gpu, store_.get(), store_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  wo.shard_placement = "gpu";
  EXPECT_THAT(Worker::Create(wo, model_.get(), backends_[0].get(), store_.get(), store_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // The shard backend must be a second device instance.
  wo.shard_placement = "auto";
  EXPECT_THAT(Worker::Create(wo, model_.get(), &gpu, store_.get(), store_.get(), nullptr, &gpu).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // On a CPU worker "device" selects on its own backend: the device path without a GPU.
  wo.shard_placement = "device";
  STRATA_EXPECT_OK(Worker::Create(wo, model_.get(), backends_[0].get(), store_.get(), store_.get(), nullptr).status());
}

TEST_F(ShardedTest, ConcurrentJobsLedByDifferentWorkers) {
  // Each leader waits for the other's peers inside its forward: selection answers must not take
  // the engine lock (no deadlock), and both jobs give the reference tokens.
  PrefillExact();
  const std::vector<int32_t> want = Reference(10);
  const auto [a, b] = RunTwo(0, Job("concurrent-a", 10), 2, Job("concurrent-b", 10));
  ASSERT_EQ(a.state(), v1::JobInfo::DONE) << a.error_message();
  ASSERT_EQ(b.state(), v1::JobInfo::DONE) << b.error_message();
  EXPECT_EQ(Tokens(a), want);
  EXPECT_EQ(Tokens(b), want);
}

TEST_F(ShardedTest, ConcurrentJobsOfOneLeaderAreBatched) {
  PrefillExact();
  const int kJobs = 3, kTokens = 24;
  // A batch waits until every job's step is pending (at most 2 s), so that the batching does not
  // depend on the threads' timing on a loaded 2-core machine.
  workers_[1]->SetDecodeBatchGateForTesting(kJobs);
  std::vector<std::vector<int32_t>> prompts, want;
  for (int j = 0; j < kJobs; ++j) {
    prompts.push_back({static_cast<int32_t>(20 + j), static_cast<int32_t>(40 + 3 * j), 7});
    want.push_back(Reference(kTokens, &prompts[j]));
  }
  std::vector<v1::JobInfo> got(kJobs);
  std::vector<std::thread> threads;
  for (int j = 0; j < kJobs; ++j) {
    threads.emplace_back([&, j] { got[j] = Run(1, Job(absl::StrCat("batched-", j), kTokens, &prompts[j])); });
  }
  for (auto& t : threads) t.join();
  for (int j = 0; j < kJobs; ++j) {
    ASSERT_EQ(got[j].state(), v1::JobInfo::DONE) << got[j].error_message();
    EXPECT_EQ(Tokens(got[j]), want[j]) << "job " << j;
  }
  std::printf("decode steps %lld in %lld batched forwards\n", static_cast<long long>(workers_[1]->decode_steps()),
              static_cast<long long>(workers_[1]->decode_batches()));
  EXPECT_EQ(workers_[1]->decode_steps(), kJobs * (kTokens - 1));
  EXPECT_LT(workers_[1]->decode_batches(), workers_[1]->decode_steps());  // some steps ran together
}

// A batched decode step that fails after the leader sent its queries (the first PagedAttention
// of the step, the leader's own shard in LeaderAttention::Prepare) runs again alone for each job
// whose cache did not take the token; the peers' answers to the failed step's queries are still
// in the streams and are dropped by their step (without that, the retry reads one as its answer,
// finds it malformed and fails the peer over).
class ShardedFailingLeaderTest : public ShardedTest {
 protected:
  void SetUp() override {
    failing_leader_ = true;
    ShardedTest::SetUp();
  }
};

TEST_F(ShardedFailingLeaderTest, AFailedBatchedStepRunsAgainAloneAndDropsItsStaleAnswers) {
  PrefillExact();
  const int kTokens = 8;
  workers_[1]->SetDecodeBatchGateForTesting(2);
  const std::vector<int32_t> prompts[2] = {{20, 40, 7}, {21, 43, 7}};
  std::vector<int32_t> want[2];
  for (int j = 0; j < 2; ++j) want[j] = Reference(kTokens, &prompts[j]);
  const int64_t steps_before = workers_[1]->decode_steps();
  v1::JobInfo got[2];
  std::thread threads[2];
  for (int j = 0; j < 2; ++j) {
    threads[j] = std::thread([&, j] {
      int events = 0;
      got[j] = Run(1, Job(absl::StrCat("retry-", j), kTokens, &prompts[j]), [&](const v1::JobEvent& e) {
        if (j == 0 && e.has_tokens() && ++events == 3) failing_->armed = true;  // the next step fails
        return true;
      });
    });
  }
  for (auto& t : threads) t.join();
  for (int j = 0; j < 2; ++j) {
    ASSERT_EQ(got[j].state(), v1::JobInfo::DONE) << "job " << j << ": " << got[j].error_message();
    EXPECT_EQ(Tokens(got[j]), want[j]) << "job " << j;
  }
  EXPECT_EQ(failing_->failures.load(), 1);
  EXPECT_FALSE(failing_->armed.load());
  EXPECT_EQ(workers_[1]->failovers(), 0);  // no answer of the failed step was taken for a new one
  EXPECT_EQ(workers_[1]->decode_steps() - steps_before, 2 * (kTokens - 1));
}

TEST_F(ShardedTest, SparsePolicySplitsTheBudgetOverShards) {
  PrefillExact();
  v1::RunJobRequest req = Job("sparse-1", 6);
  req.mutable_policy()->set_name("quest");
  req.mutable_policy()->set_budget_tokens(64);
  req.mutable_policy()->set_sink_tokens(4);
  req.mutable_policy()->set_window_tokens(16);
  const v1::JobInfo info = Run(1, req);
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(info.output_token_ids_size(), 6);
  // Per KV head and layer: sinks + each shard's share of 64 tokens (whole pages) + its last token
  // + the prompt and generated tokens, well below the 330-token document.
  EXPECT_GT(info.usage().mean_attended_tokens(), 0.0);
  EXPECT_LT(info.usage().mean_attended_tokens(), static_cast<double>(doc_.size()));
  // The peers ran selections for the leader and counted their selection-cache lookups.
  EXPECT_GT(metrics_[0]->selection_cache_lookups->Value(), 0.0);
  EXPECT_GT(metrics_[2]->selection_cache_lookups->Value(), 0.0);
}

TEST_F(ShardedTest, PeerLostMidDecodeFailsOverToPersistedPages) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(16);
  const double prefilled = PrefillTokens();
  int tokens = 0;
  const v1::JobInfo info = Run(0, Job("failover-1", 16), [&](const v1::JobEvent& e) {
    if (e.has_tokens() && ++tokens == 4) servers_[2]->Shutdown(absl::ZeroDuration());  // w2 goes away
    return true;
  });
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(Tokens(info), want);
  EXPECT_EQ(workers_[0]->failovers(), 1);
  // w0 mounted w2's shard from the store; nothing was prefilled again (only the prompt ran).
  bool has_w2_shard = false;
  for (const v1::ShardRange& r : workers_[0]->MountedShards()) has_w2_shard |= r.first_page() == 4;
  EXPECT_TRUE(has_w2_shard);
  EXPECT_EQ(PrefillTokens() - prefilled, static_cast<double>(prompt_.size()));

  // A peer that is down before the job starts is failed over at open.
  const v1::JobInfo again = Run(1, Job("failover-2", 16));
  ASSERT_EQ(again.state(), v1::JobInfo::DONE) << again.error_message();
  EXPECT_EQ(Tokens(again), want);
  EXPECT_EQ(workers_[1]->failovers(), 1);
}

// A ShardSelection peer that reads every query and never answers (a hung worker).
class SilentSelection final : public v1::ShardSelection::Service {
 public:
  grpc::Status Select(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::SelectionResponse, v1::SelectionRequest>* stream) override {
    v1::SelectionRequest req;
    while (stream->Read(&req)) {
    }
    return grpc::Status::OK;
  }
};

TEST_F(ShardedTest, PeerThatNeverAnswersIsFailedOverAfterTheTimeout) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(8);
  SilentSelection silent;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&silent);
  std::unique_ptr<grpc::Server> hung = builder.BuildAndStart();
  ASSERT_NE(hung, nullptr);
  // A fourth worker leads with a short timeout; w2's shard is served by the silent peer.
  WorkerOptions wo;
  wo.worker_id = "leader";
  wo.peer_timeout_ms = 300;
  STRATA_ASSERT_OK_AND_ASSIGN(auto leader, Worker::Create(wo, model_.get(), backends_[0].get(), store_.get(),
                                                          store_.get(), nullptr));
  v1::RunJobRequest req = OverGrpc(Job("hung-1", 8));
  req.mutable_shard_map()->mutable_shards(2)->set_worker_address(absl::StrCat("127.0.0.1:", port));
  v1::JobInfo last = RunOn(leader.get(), req);
  ASSERT_EQ(last.state(), v1::JobInfo::DONE) << last.error_message();
  EXPECT_EQ(Tokens(last), want);
  EXPECT_EQ(leader->failovers(), 1);
  hung->Shutdown(std::chrono::system_clock::now());

  // The same over a selection link whose holder reads every frame and never answers.
  int link_port = 0;
  const int listener = LoopbackSocket(/*listening=*/true, &link_port);
  ASSERT_GE(listener, 0);
  std::thread silent_link([listener] {
    const int c = accept(listener, nullptr, nullptr);
    char buf[4096];
    while (c >= 0 && recv(c, buf, sizeof(buf), 0) > 0) {
    }
    if (c >= 0) close(c);
  });
  req = Job("hung-2", 8);
  req.mutable_shard_map()->mutable_shards(2)->set_selection_link_address(absl::StrCat("127.0.0.1:", link_port));
  last = RunOn(leader.get(), req);
  ASSERT_EQ(last.state(), v1::JobInfo::DONE) << last.error_message();
  EXPECT_EQ(Tokens(last), want);
  EXPECT_EQ(leader->failovers(), 2);
  silent_link.join();  // the leader closed the link when it failed over
  close(listener);
}

TEST_F(ShardedTest, UnreachableSelectionLinkFallsBackToTheStream) {
  PrefillExact();
  const std::vector<int32_t> want = Reference(8);
  // w2's link is a port nothing listens on (bound, never listened): the leader takes w2's gRPC stream.
  int unused_port = 0;
  const int unused = LoopbackSocket(/*listening=*/false, &unused_port);
  ASSERT_GE(unused, 0);
  v1::RunJobRequest req = Job("fallback-1", 8);
  req.mutable_shard_map()->mutable_shards(2)->set_selection_link_address(absl::StrCat("127.0.0.1:", unused_port));
  const v1::JobInfo info = Run(0, req);
  close(unused);
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(Tokens(info), want);
  EXPECT_EQ(workers_[0]->failovers(), 0);
  EXPECT_EQ(AwaitCount(metrics_[2]->selection_streams_grpc, 1), 1.0);
  EXPECT_EQ(AwaitCount(metrics_[1]->selection_streams_link, 1), 1.0);
  EXPECT_EQ(metrics_[2]->selection_streams_link->Value(), 0.0);
}

TEST_F(ShardedTest, AnchorPrefillInParallelMakesTheDocumentReady) {
  std::vector<absl::Status> results(kWorkers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      std::vector<v1::PrefillShardProgress> progress;
      results[i] = workers_[i]->PrefillShard(Prefill(i, v1::PREFILL_MODE_ANCHOR),
                                             [&](const v1::PrefillShardProgress& p) { progress.push_back(p); },
                                             nullptr);
      if (results[i].ok()) {
        EXPECT_TRUE(progress.back().complete());
        EXPECT_EQ(progress.back().pages_persisted(), 2u);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) STRATA_EXPECT_OK(s);
  EXPECT_EQ(State(), v1::DOCUMENT_STATE_READY);
  const v1::JobInfo info = Run(2, Job("anchor-1", 6));
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(info.output_token_ids_size(), 6);
}

TEST_F(ShardedDeviceLikeTest, AnchorPrefillMakesTheDocumentReady) {
  for (int i = kWorkers - 1; i >= 0; --i) {
    STRATA_ASSERT_OK(workers_[i]->PrefillShard(Prefill(i, v1::PREFILL_MODE_ANCHOR), nullptr, nullptr));
  }
  EXPECT_EQ(State(), v1::DOCUMENT_STATE_READY);
  const v1::JobInfo info = Run(0, Job("device-anchor", 6));
  ASSERT_EQ(info.state(), v1::JobInfo::DONE) << info.error_message();
  EXPECT_EQ(info.output_token_ids_size(), 6);
}

TEST_F(ShardedTest, BadShardPrefillsAreRefused) {
  // EXACT shard 1 before shard 0 is durable.
  EXPECT_THAT(workers_[1]->PrefillShard(Prefill(1, v1::PREFILL_MODE_EXACT), nullptr, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // An anchor that overlaps the shard.
  v1::PrefillShardRequest r = Prefill(1, v1::PREFILL_MODE_ANCHOR);
  r.mutable_anchor_token_ids()->Assign(doc_.begin(), doc_.begin() + 200);
  EXPECT_THAT(workers_[1]->PrefillShard(r, nullptr, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  // Token ids that do not fill the range.
  r = Prefill(1, v1::PREFILL_MODE_ANCHOR);
  r.mutable_token_ids()->RemoveLast();
  EXPECT_THAT(workers_[1]->PrefillShard(r, nullptr, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  // A range past the document.
  r = Prefill(2, v1::PREFILL_MODE_ANCHOR);
  r.mutable_shard()->set_first_page(6);
  r.mutable_shard()->set_end_page(7);
  EXPECT_THAT(workers_[2]->PrefillShard(r, nullptr, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  // The last shard with its end page far past the document (its token ids still fill the rest of
  // the document: this read past the cache before it was refused).
  r = Prefill(2, v1::PREFILL_MODE_ANCHOR);
  r.mutable_shard()->set_end_page(853312);
  EXPECT_THAT(workers_[2]->PrefillShard(r, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("end past the")));
  r.mutable_shard()->set_end_page(uint64_t{1} << 63);
  EXPECT_THAT(workers_[2]->PrefillShard(r, nullptr, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(State(), v1::DOCUMENT_STATE_READY);
}

TEST_F(ShardedTest, MountAndSelectionStream) {
  PrefillExact();
  // Over gRPC: MountShard, then a selection stream with one dense query.
  auto channel = grpc::CreateChannel(workers_[1]->Info().address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Worker::NewStub(channel);
  v1::MountShardRequest mount;
  *mount.mutable_shard() = Map().shards(1).range();
  {
    grpc::ClientContext ctx;
    v1::MountShardResponse resp;
    ASSERT_TRUE(stub->MountShard(&ctx, mount, &resp).ok());
  }
  EXPECT_EQ(workers_[1]->Load().mounted_tokens(), 128u);
  ASSERT_EQ(workers_[1]->MountedShards().size(), 1u);
  EXPECT_EQ(workers_[1]->MountedShards()[0].first_page(), 2u);
  {
    grpc::ClientContext ctx;
    v1::MountShardRequest past = mount;
    past.mutable_shard()->set_end_page(9);
    v1::MountShardResponse resp;
    EXPECT_EQ(stub->MountShard(&ctx, past, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }

  auto sel = v1::ShardSelection::NewStub(channel);
  const model::ModelConfig& c = model_->config;
  v1::SelectionRequest open;
  open.mutable_open()->set_job_id("j");
  *open.mutable_open()->mutable_shard() = mount.shard();
  open.mutable_open()->set_num_q_heads(c.num_heads);
  open.mutable_open()->set_head_dim(c.head_dim);
  {
    grpc::ClientContext ctx;
    auto stream = sel->Select(&ctx);
    ASSERT_TRUE(stream->Write(open));
    v1::SelectionRequest q = TwoTokenQuery(0);
    ASSERT_TRUE(stream->Write(q));
    v1::SelectionResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.layer(), 1u);
    EXPECT_EQ(resp.o().size(), q.query().q().size());
    EXPECT_EQ(resp.lse().size(), 2u * c.num_heads * sizeof(float));
    EXPECT_EQ(resp.selected_tokens(), 128u * c.num_kv_heads);
    // A query of the wrong size ends the stream with INVALID_ARGUMENT.
    q.mutable_query()->set_q("abc");
    ASSERT_TRUE(stream->Write(q));
    EXPECT_FALSE(stream->Read(&resp));
    stream->WritesDone();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    auto stream = sel->Select(&ctx);
    v1::SelectionRequest q;
    q.mutable_query()->set_num_tokens(1);
    ASSERT_TRUE(stream->Write(q));  // no SelectionOpen first
    stream->WritesDone();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    auto stream = sel->Select(&ctx);
    ASSERT_TRUE(stream->Write(open));
    ASSERT_TRUE(stream->Write(open));  // SelectionOpen sent twice
    stream->WritesDone();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  // The first stream's one answer was counted when it ended (the failed query and the other
  // streams answered nothing), its time split into its parts.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (metrics_[1]->shard_answers->Value() < 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(metrics_[1]->shard_answers->Value(), 1.0);
  EXPECT_GT(metrics_[1]->shard_answer_queue_seconds->Value(), 0.0);
  EXPECT_GT(metrics_[1]->shard_answer_send_seconds->Value(), 0.0);
  // Two streams opened a session (the first, and the one that sent its open twice).
  EXPECT_EQ(metrics_[1]->selection_streams_grpc->Value(), 2.0);

  // The same over the selection link.
  const std::string link_address = workers_[1]->Info().selection_link_address();
  {
    STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(link_address, absl::Seconds(5)));
    ASSERT_TRUE(link->Write(open.SerializeAsString()));
    v1::SelectionRequest q = TwoTokenQuery(3);
    ASSERT_TRUE(link->Write(q.SerializeAsString()));
    v1::SelectionResponse resp;
    std::string why;
    ASSERT_TRUE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
    EXPECT_EQ(resp.step(), 3u);
    EXPECT_EQ(resp.layer(), 1u);
    EXPECT_EQ(resp.o().size(), q.query().q().size());
    EXPECT_EQ(resp.lse().size(), 2u * c.num_heads * sizeof(float));
    EXPECT_EQ(resp.selected_tokens(), 128u * c.num_kv_heads);
    // A query of the wrong size ends the stream with INVALID_ARGUMENT, as on gRPC.
    q.mutable_query()->set_q("abc");
    ASSERT_TRUE(link->Write(q.SerializeAsString()));
    EXPECT_FALSE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why));
    EXPECT_NE(why.find("INVALID_ARGUMENT"), std::string::npos) << why;
  }
  {
    // A query before the open.
    STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(link_address, absl::Seconds(5)));
    v1::SelectionRequest q;
    q.mutable_query()->set_num_tokens(1);
    ASSERT_TRUE(link->Write(q.SerializeAsString()));
    v1::SelectionResponse resp;
    std::string why;
    EXPECT_FALSE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why));
    EXPECT_NE(why.find("SelectionOpen"), std::string::npos) << why;
  }
  // Bytes that are not the protocol: a wrong preface, a frame past the size limit, a frame that
  // is not a SelectionRequest. Each gets an INVALID_ARGUMENT error frame, then the end.
  const std::string frame_over_limit = std::string("STL1") + std::string("\xff\xff\xff\x7f\x01\0\0\0", 8);
  const std::string not_a_request = std::string("STL1") + std::string("\x03\0\0\0\x01\0\0\0\xff\xff\xff", 11);
  for (const std::string& bytes : {std::string("HTTP/1.1 GET /\r\n"), frame_over_limit, not_a_request}) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);  // workers_ serve on 127.0.0.1
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(link_address.substr(link_address.rfind(':') + 1))));
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
    std::string got;
    char buf[256];
    ssize_t r;
    while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) got.append(buf, static_cast<size_t>(r));
    close(fd);
    ASSERT_GE(got.size(), 12u) << "for " << bytes.size() << " bytes";
    EXPECT_EQ(got[4], 3);   // an error frame
    EXPECT_EQ(got[8], static_cast<char>(absl::StatusCode::kInvalidArgument));
  }
  // The link's one answer was counted too.
  EXPECT_EQ(AwaitCount(metrics_[1]->shard_answers, 2), 2.0);
  EXPECT_EQ(metrics_[1]->selection_streams_link->Value(), 1.0);  // the one that opened a session

  // PeerPages: a stored page comes back decodable, a page past the document is absent.
  {
    auto pages = v1::PeerPages::NewStub(channel);
    grpc::ClientContext ctx;
    v1::GetPagesRequest req;
    req.set_document_id(kDocId);
    v1::PageKey* k = req.add_keys();
    k->set_layer(1);
    k->set_kv_head(1);
    k->set_page_index(5);
    k = req.add_keys();
    k->set_page_index(9);
    auto reader = pages->GetPages(&ctx, req);
    v1::GetPagesResponse resp;
    std::vector<v1::Page> got;
    while (reader->Read(&resp)) got.insert(got.end(), resp.pages().begin(), resp.pages().end());
    ASSERT_TRUE(reader->Finish().ok());
    ASSERT_EQ(got.size(), 2u);
    EXPECT_FALSE(got[0].absent());
    EXPECT_EQ(got[0].key().page_index(), 5u);
    std::vector<float> kd(kPage * c.head_dim), vd(kPage * c.head_dim);
    STRATA_EXPECT_OK(kvstore::DecodePage(got[0].data(), kd.data(), vd.data()));
    EXPECT_TRUE(got[1].absent());
  }
  {
    auto pages = v1::PeerPages::NewStub(channel);
    grpc::ClientContext ctx;
    v1::GetPagesRequest req;
    req.set_document_id("not-hex");
    auto reader = pages->GetPages(&ctx, req);
    v1::GetPagesResponse resp;
    while (reader->Read(&resp)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }

  v1::UnmountShardRequest unmount;
  *unmount.mutable_shard() = mount.shard();
  STRATA_ASSERT_OK(workers_[1]->UnmountShard(unmount));
  EXPECT_EQ(workers_[1]->Load().mounted_tokens(), 0u);
  EXPECT_TRUE(workers_[1]->MountedShards().empty());
}

}  // namespace
}  // namespace strata::worker
