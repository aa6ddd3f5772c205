// Decode throughput of concurrent jobs on one worker, with decode steps batched across jobs
// (WorkerOptions::max_decode_batch) and without (max_decode_batch = 1), on a generated model.
//
//   decode_batch_bench [--preset small] [--jobs 8] [--tokens 16] [--doc 128] [--threads 1]
//
// Prints, per mode: wall seconds from starting every job to the last one finishing, generated
// tokens per second, decode steps and batched forwards, and whether every job's tokens equal the
// unbatched run's.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "kvstore/local_store.h"
#include "model/random_model.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

int Run(int argc, char** argv) {
  std::string preset = "small";
  int jobs = 8, tokens = 16, doc_tokens = 128, threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--preset") {
      preset = argv[i + 1];
    } else if (flag == "--jobs") {
      jobs = std::atoi(argv[i + 1]);
    } else if (flag == "--tokens") {
      tokens = std::atoi(argv[i + 1]);
    } else if (flag == "--doc") {
      doc_tokens = std::atoi(argv[i + 1]);
    } else if (flag == "--threads") {
      threads = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (jobs < 1 || tokens < 2 || doc_tokens < 1) {
    std::fprintf(stderr, "--jobs >= 1, --tokens >= 2, --doc >= 1\n");
    return 2;
  }
  char tmpl[] = "/tmp/strata_decode_batch_bench_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string dir = tmpl;
  model::RandomModelOptions mo;
  mo.preset = preset;
  mo.seed = 5;
  mo.write_tokenizer = false;
  if (auto written = model::WriteRandomModel(dir + "/model", mo); !written.ok()) {
    std::fprintf(stderr, "%s\n", written.status().ToString().c_str());
    return 1;
  }
  auto m = model::LoadModel(dir + "/model");
  if (!m.ok()) return 1;
  auto backend = kernels::MakeCpuBackend(threads);
  kvstore::LocalStoreOptions so;
  so.path = dir + "/kv";
  so.sync_writes = false;
  auto store = kvstore::LocalStore::Open(so);
  if (!store.ok()) return 1;
  const int64_t vocab = (*m)->config.vocab_size;
  const std::string doc_id = "0f0e0d0c0b0a09080706050403020100";

  std::vector<std::vector<int32_t>> reference;
  for (int batch : {1, 16}) {
    WorkerOptions wo;
    wo.max_decode_batch = batch;
    auto w = Worker::Create(wo, m->get(), backend.get(), store->get(), store->get(), nullptr);
    if (!w.ok()) return 1;
    v1::PrefillShardRequest prefill;
    prefill.mutable_shard()->set_document_id(doc_id);
    for (int i = 0; i < doc_tokens; ++i) prefill.add_token_ids(static_cast<int32_t>((i * 97 + 13) % vocab));
    if (absl::Status s = (*w)->PrefillShard(prefill, nullptr, nullptr); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    std::vector<std::vector<int32_t>> out(jobs);
    std::vector<std::thread> ts;
    const int64_t start = MonotonicNanos();
    for (int j = 0; j < jobs; ++j) {
      ts.emplace_back([&, j] {
        v1::RunJobRequest req;
        req.set_job_id(absl::StrCat("bench-", j));
        req.mutable_shard_map()->set_document_id(doc_id);
        req.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(doc_id);
        req.add_prompt_token_ids(static_cast<int32_t>(1 + j));
        req.mutable_params()->set_max_tokens(tokens);
        req.mutable_params()->set_ignore_eos(true);
        absl::Status s = (*w)->RunJob(req, [&](const v1::JobEvent& e) {
          if (e.has_snapshot()) {
            out[j].assign(e.snapshot().output_token_ids().begin(), e.snapshot().output_token_ids().end());
          }
          return true;
        });
        if (!s.ok()) std::fprintf(stderr, "job %d: %s\n", j, s.ToString().c_str());
      });
    }
    for (auto& t : ts) t.join();
    const double seconds = (MonotonicNanos() - start) * 1e-9;
    if (batch == 1) reference = out;
    bool same = true;
    for (int j = 0; j < jobs; ++j) same &= out[j] == reference[j] && static_cast<int>(out[j].size()) == tokens;
    std::printf("preset=%s jobs=%d tokens=%d doc=%d threads=%d max_decode_batch=%d: %.3f s, %.1f tokens/s, "
                "%lld decode steps in %lld forwards, tokens equal to unbatched: %s\n",
                preset.c_str(), jobs, tokens, doc_tokens, threads, batch, seconds, jobs * tokens / seconds,
                static_cast<long long>((*w)->decode_steps()), static_cast<long long>((*w)->decode_batches()),
                same ? "yes" : "NO");
  }
  store->reset();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace strata::worker

int main(int argc, char** argv) { return strata::worker::Run(argc, argv); }
