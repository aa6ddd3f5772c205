// Lazy mount (WorkerOptions::lazy_mount) in a worker job on the CUDA backend (issue #6): the job's
// GPU page cache lives on the CUDA backend and the decode steps choose their pages with the
// backend's selection ops over summaries held in GPU memory (worker/lazy_attention.h). A random
// "small" model (hidden 768, 12 layers, 12 query / 4 KV heads, head_dim 64, bf16 weights), a
// document prefilled and persisted by a CUDA worker into a LocalStore, then the same quest job
// (defaults: budget 2048, window 256; 16-token prompt, greedy) on lazy-mount workers on the CUDA
// backend and on the CPU backend (host chooser, PagedAttention on the CPU), over the same store.
// The tokens must be equal, and a CUDA worker whose cache is too small for one decode step's pages
// of every layer (it evicts every call) must give the CUDA tokens again. Prints TTFT, decode rate,
// pages fetched. Skips with "no CUDA GPU" without one.
// Env: STRATA_LAZY_GPU_DOC_TOKENS (default 16384), STRATA_LAZY_GPU_MAX_TOKENS (default 32).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kvstore/local_store.h"
#include "kvstore/metrics.h"
#include "model/random_model.h"
#include "prometheus/registry.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

constexpr char kDocId[] = "00112233445566778899aabbccddee01";

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

std::unique_ptr<kernels::Backend> CudaBackendOrNull(std::string* why) {
  kernels::BackendOptions options;
  options.kind = kernels::BackendKind::kCuda;
  const char* env = std::getenv("STRATA_CUDA_PLUGIN");
  options.cuda_plugin = env != nullptr && *env != '\0' ? env : STRATA_CUDA_PLUGIN_PATH;
  absl::StatusOr<std::unique_ptr<kernels::Backend>> b = kernels::MakeBackend(options);
  if (!b.ok()) {
    *why = b.status().ToString();
    return nullptr;
  }
  return std::move(b).value();
}

struct Timed {
  v1::JobInfo info;
  double ttft_s = 0;
  double decode_tps = 0;
};

Timed RunTimed(Worker* w, const v1::RunJobRequest& req) {
  Timed t;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point first, last;
  int tokens = 0;
  const absl::Status s = w->RunJob(req, [&](const v1::JobEvent& e) {
    if (e.has_tokens()) {
      last = Clock::now();
      if (tokens == 0) first = last;
      tokens += e.tokens().token_ids_size();
    }
    if (e.has_snapshot()) t.info = e.snapshot();
    return true;
  });
  EXPECT_TRUE(s.ok()) << s;
  if (tokens > 0) t.ttft_s = std::chrono::duration<double>(first - start).count();
  if (tokens > 1) t.decode_tps = (tokens - 1) / std::chrono::duration<double>(last - first).count();
  return t;
}

std::vector<int32_t> Tokens(const v1::JobInfo& info) {
  return std::vector<int32_t>(info.output_token_ids().begin(), info.output_token_ids().end());
}

double GpuTier(prometheus::Registry& registry, const std::string& name) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == "tier" && l.value == "gpu") return m.counter.value;
      }
    }
  }
  return 0;
}

TEST(WorkerLazyMountGpuTest, CudaLazyJobMatchesCpuLazyJob) {
  std::string why;
  std::unique_ptr<kernels::Backend> cuda = CudaBackendOrNull(&why);
  if (cuda == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  const int64_t doc_tokens = EnvInt("STRATA_LAZY_GPU_DOC_TOKENS", 16384);
  const int64_t max_tokens = EnvInt("STRATA_LAZY_GPU_MAX_TOKENS", 32);
  char tmpl[] = "/tmp/strata_lazy_gpu_test_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{dir};

  model::RandomModelOptions mo;
  mo.preset = "small";
  mo.dtype = kernels::DType::kBF16;
  mo.seed = 11;
  mo.write_tokenizer = false;
  ASSERT_TRUE(model::WriteRandomModel(dir + "/model", mo).ok());
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Model> m, model::LoadModel(dir + "/model"));
  kvstore::LocalStoreOptions so;
  so.path = dir + "/kv";
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<kvstore::LocalStore> store, kvstore::LocalStore::Open(so));
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(0);
  prometheus::Registry registry;
  kvstore::KvMetrics kv(&registry);
  WorkerMetrics metrics(&registry);
  metrics.kv = &kv;

  auto make = [&](const std::string& id, bool lazy, int64_t cache_pages, kernels::Backend* be) {
    WorkerOptions wo;
    wo.worker_id = id;
    wo.lazy_mount = lazy;
    wo.lazy_cache_pages = cache_pages;
    auto w = Worker::Create(wo, m.get(), be, store.get(), store.get(), &metrics);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  };
  std::unique_ptr<Worker> prefill = make("prefill", false, 8192, cuda.get());
  std::unique_ptr<Worker> gpu = make("gpu-lazy", true, 8192, cuda.get());
  std::unique_ptr<Worker> gpu_small = make("gpu-lazy-small", true, 1, cuda.get());
  std::unique_ptr<Worker> host = make("cpu-lazy", true, 8192, cpu.get());
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(gpu_small, nullptr);
  ASSERT_NE(host, nullptr);

  std::vector<int32_t> doc;
  for (int64_t i = 0; i < doc_tokens; ++i) doc.push_back(static_cast<int32_t>((i * 7919 + 13) % 8000));
  v1::PrefillShardRequest pr;
  pr.mutable_shard()->set_document_id(kDocId);
  pr.mutable_shard()->set_first_page(0);
  pr.mutable_shard()->set_end_page(static_cast<uint64_t>((doc_tokens + 63) / 64));
  pr.mutable_shard_map()->set_document_id(kDocId);
  pr.mutable_shard_map()->set_page_size(64);
  pr.mutable_shard_map()->set_num_tokens(static_cast<uint64_t>(doc_tokens));
  pr.mutable_token_ids()->Assign(doc.begin(), doc.end());
  const auto p0 = std::chrono::steady_clock::now();
  STRATA_ASSERT_OK(prefill->PrefillShard(pr, nullptr, nullptr));
  std::printf("document: %lld tokens prefilled and persisted on %s in %.2f s\n", static_cast<long long>(doc_tokens),
              cuda->Name().c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count());

  auto job = [&](const std::string& id) {
    v1::RunJobRequest r;
    r.set_job_id(id);
    r.mutable_shard_map()->set_document_id(kDocId);
    r.mutable_shard_map()->set_page_size(64);
    r.mutable_shard_map()->set_num_tokens(static_cast<uint64_t>(doc_tokens));
    r.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(kDocId);
    for (int i = 0; i < 16; ++i) r.add_prompt_token_ids(100 + 17 * i);
    r.mutable_params()->set_max_tokens(static_cast<uint32_t>(max_tokens));
    r.mutable_params()->set_ignore_eos(true);
    r.mutable_policy()->set_name("quest");  // defaults: budget 2048, window 256
    return r;
  };
  std::printf("%-26s %9s %12s %9s %8s  %s\n", "run", "TTFT s", "decode tok/s", "attended", "fetched", "tokens");
  auto row = [&](const std::string& run, const Timed& t) {
    std::string toks;
    for (int32_t x : Tokens(t.info)) toks += std::to_string(x) + " ";
    const v1::PagesByTier& f = t.info.usage().pages_fetched();
    std::printf("%-26s %9.3f %12.1f %9.1f %8llu  %s\n", run.c_str(), t.ttft_s, t.decode_tps,
                t.info.usage().mean_attended_tokens(),
                static_cast<unsigned long long>(f.host() + f.disk() + f.remote()), toks.c_str());
  };
  const double lookups0 = GpuTier(registry, "strata_kv_lookups_total");
  const Timed g = RunTimed(gpu.get(), job("gpu"));
  const double lookups1 = GpuTier(registry, "strata_kv_lookups_total");
  const Timed s = RunTimed(gpu_small.get(), job("gpu-small"));
  const Timed c = RunTimed(host.get(), job("cpu"));
  ASSERT_EQ(g.info.state(), v1::JobInfo::DONE) << g.info.error_message();
  ASSERT_EQ(s.info.state(), v1::JobInfo::DONE) << s.info.error_message();
  ASSERT_EQ(c.info.state(), v1::JobInfo::DONE) << c.info.error_message();
  row("cuda lazy, 8192 slots", g);
  row("cuda lazy, 1 -> 1 step", s);
  row("cpu lazy, 8192 slots", c);
  EXPECT_GT(lookups1, lookups0);  // the CUDA job's page cache counted under tier "gpu"
  EXPECT_LT(g.info.usage().mean_attended_tokens(), static_cast<double>(doc_tokens) / 4);
  EXPECT_EQ(Tokens(s.info), Tokens(g.info));
  EXPECT_GT(s.info.usage().pages_fetched().disk(), g.info.usage().pages_fetched().disk());
  EXPECT_EQ(Tokens(g.info), Tokens(c.info));
  size_t same = 0;
  while (same < Tokens(g.info).size() && same < Tokens(c.info).size() && Tokens(g.info)[same] == Tokens(c.info)[same]) {
    ++same;
  }
  std::printf("cuda and cpu lazy jobs agree on the first %zu of %d tokens; pages fetched cuda %llu, cpu %llu\n", same,
              g.info.output_token_ids_size(),
              static_cast<unsigned long long>(g.info.usage().pages_fetched().disk()),
              static_cast<unsigned long long>(c.info.usage().pages_fetched().disk()));
}

}  // namespace
}  // namespace strata::worker
