// Device selection in a worker job on the CUDA backend (WorkerOptions::device_selection, issue #6):
// a random "small" model (hidden 768, 12 layers, 12 query / 4 KV heads, head_dim 64, bf16
// weights), a document prefilled and persisted by a CUDA worker, then the same jobs (tokenselect,
// quest and dense; 16-token prompt, greedy) on the CUDA worker (device selection auto) and on a
// CPU worker with device selection forced on (the CPU twins of the selection ops) over the same
// store. The tokens must be equal; the table gives each job's time to first token and decode
// rate, and the CUDA decode rate of tokenselect against the same job with device selection off
// (which attends densely on a device backend). Skips with "no CUDA GPU" without one.
// Env: STRATA_WORKER_GPU_DOC_TOKENS (default 40960: a middle of more than 512 pages, so the
// selection runs two-level), STRATA_WORKER_GPU_MAX_TOKENS (default 32).
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
#include "model/random_model.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

constexpr char kDocId[] = "00112233445566778899aabbccddeeff";

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
  double ttft_s = 0;        // RunJob start to the first token
  double decode_tps = 0;    // tokens after the first / time from the first token to the last
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

TEST(WorkerDeviceSelectionGpuTest, CudaJobMatchesCpuDeviceSelection) {
  std::string why;
  std::unique_ptr<kernels::Backend> cuda = CudaBackendOrNull(&why);
  if (cuda == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  const int64_t doc_tokens = EnvInt("STRATA_WORKER_GPU_DOC_TOKENS", 40960);
  const int64_t max_tokens = EnvInt("STRATA_WORKER_GPU_MAX_TOKENS", 32);
  char tmpl[] = "/tmp/strata_worker_gpu_test_XXXXXX";
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

  auto make = [&](const std::string& id, const std::string& mode, kernels::Backend* be) {
    WorkerOptions wo;
    wo.worker_id = id;
    wo.device_selection = mode;
    auto w = Worker::Create(wo, m.get(), be, store.get(), store.get(), nullptr);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? std::move(*w) : nullptr;
  };
  std::unique_ptr<Worker> gpu = make("gpu", "auto", cuda.get());
  std::unique_ptr<Worker> gpu_off = make("gpu-off", "off", cuda.get());
  std::unique_ptr<Worker> host = make("cpu", "on", cpu.get());
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(gpu_off, nullptr);
  ASSERT_NE(host, nullptr);
  STRATA_ASSERT_OK(gpu->device_selection_status());
  STRATA_ASSERT_OK(host->device_selection_status());

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
  STRATA_ASSERT_OK(gpu->PrefillShard(pr, nullptr, nullptr));
  std::printf("document: %lld tokens prefilled and persisted on %s in %.2f s\n", static_cast<long long>(doc_tokens),
              cuda->Name().c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - p0).count());

  auto job = [&](const std::string& id, const std::string& policy) {
    v1::RunJobRequest r;
    r.set_job_id(id);
    r.mutable_shard_map()->set_document_id(kDocId);
    r.mutable_shard_map()->set_page_size(64);
    r.mutable_shard_map()->set_num_tokens(static_cast<uint64_t>(doc_tokens));
    r.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(kDocId);
    for (int i = 0; i < 16; ++i) r.add_prompt_token_ids(100 + 17 * i);
    r.mutable_params()->set_max_tokens(static_cast<uint32_t>(max_tokens));
    r.mutable_params()->set_ignore_eos(true);
    r.mutable_policy()->set_name(policy);  // defaults: budget 2048, sinks 64, window 256
    return r;
  };
  std::printf("%-12s %-22s %9s %12s %9s  %s\n", "policy", "run", "TTFT s", "decode tok/s", "attended", "tokens");
  auto row = [&](const std::string& policy, const std::string& run, const Timed& t) {
    std::string toks;
    for (int32_t x : Tokens(t.info)) toks += std::to_string(x) + " ";
    std::printf("%-12s %-22s %9.3f %12.1f %9.1f  %s\n", policy.c_str(), run.c_str(), t.ttft_s, t.decode_tps,
                t.info.usage().mean_attended_tokens(), toks.c_str());
  };
  int64_t gpu_device_jobs = 0;
  for (const std::string policy : {"tokenselect", "quest", "dense"}) {
    SCOPED_TRACE(policy);
    const Timed g = RunTimed(gpu.get(), job("gpu-" + policy, policy));
    const Timed c = RunTimed(host.get(), job("cpu-" + policy, policy));
    ASSERT_EQ(g.info.state(), v1::JobInfo::DONE) << g.info.error_message();
    ASSERT_EQ(c.info.state(), v1::JobInfo::DONE) << c.info.error_message();
    row(policy, "cuda, device selection", g);
    row(policy, "cpu, device selection", c);
    if (policy != "dense") {
      EXPECT_EQ(gpu->device_selection_jobs(), ++gpu_device_jobs);
      EXPECT_LT(g.info.usage().mean_attended_tokens(), static_cast<double>(doc_tokens) / 4);
    }
    EXPECT_EQ(Tokens(g.info), Tokens(c.info));
    EXPECT_EQ(g.info.usage().mean_attended_tokens(), c.info.usage().mean_attended_tokens());
    size_t same = 0;
    while (same < Tokens(g.info).size() && same < Tokens(c.info).size() && Tokens(g.info)[same] == Tokens(c.info)[same]) {
      ++same;
    }
    std::printf("%-12s cuda and cpu agree on the first %zu of %d tokens\n", policy.c_str(), same,
                g.info.output_token_ids_size());
  }
  // Device selection off on the CUDA backend: tokenselect attends densely (the host policy cannot
  // read device pools).
  const Timed off = RunTimed(gpu_off.get(), job("gpu-off-tokenselect", "tokenselect"));
  ASSERT_EQ(off.info.state(), v1::JobInfo::DONE) << off.info.error_message();
  row("tokenselect", "cuda, selection off", off);
  EXPECT_EQ(gpu_off->device_selection_jobs(), 0);
  EXPECT_GT(off.info.usage().mean_attended_tokens(), static_cast<double>(doc_tokens));
}

}  // namespace
}  // namespace strata::worker
