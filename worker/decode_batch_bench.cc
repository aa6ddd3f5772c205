// Decode throughput of concurrent jobs on one worker, with decode steps batched across jobs
// (WorkerOptions::max_decode_batch) and without (max_decode_batch = 1), on a generated model.
//
//   decode_batch_bench [--preset small] [--jobs 8] [--tokens 16] [--doc 128] [--threads 1]
//                      [--backend auto|cpu|cuda] [--device-sampling 1,0] [--temperature 0] [--top-p 1]
//                      [--batch-wait-us N]  (WorkerOptions::decode_batch_wait_us; default the option's)
//                      [--weights bf16|f32]  (the random model's weights; default bf16, as checkpoints
//                                             ship; runs before session 18's last used f32)
//                      [--weight-format checkpoint|fp8]  (WorkerOptions::weight_format: fp8 runs the
//                                             projections on e4m3 rows quantised at load)
//
// Modes: for each listed --device-sampling value (WorkerOptions::device_sampling; default 1 then 0),
// max_decode_batch 1 then 16. --temperature and --top-p set every job's SamplingParams (job j's
// seed is 100 + j at temperature > 0), so every mode draws the same streams. --backend cuda runs
// the worker on the CUDA backend (the plugin from $STRATA_CUDA_PLUGIN or next to the binary; the
// worker's decode_graph is then on: a lone step is a replayed graph).
//
// Prints, per mode: wall seconds from starting every job to the last one finishing, generated
// tokens per second (and "steady": the tokens made while every job was decoding, from the last
// job's first token to the first job's last, over that time, so the jobs' start does not count;
// "-" when there is no such time), decode steps, batched forwards and draws on the backend, and whether every
// job's tokens equal the first mode's. Greedy tokens must; at temperature > 0 a batched step's
// logits can differ from a lone step's in the last bits (another GEMM shape, and the batches'
// makeup depends on timing), and near-equal probabilities of a random model can then swap places,
// so a draw may differ now and then in any mode.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"
#include "kernels/backend_factory.h"
#include "kvstore/local_store.h"
#include "model/random_model.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

int Run(int argc, char** argv) {
  std::string preset = "small";
  int jobs = 8, tokens = 16, doc_tokens = 128, threads = 1;
  std::string backend_name = "cpu", sampling_list = "1,0";
  double temperature = 0, top_p = 1;
  int64_t batch_wait_us = WorkerOptions().decode_batch_wait_us;
  std::string weights = "bf16", weight_format = "checkpoint";
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
    } else if (flag == "--backend") {
      backend_name = argv[i + 1];
    } else if (flag == "--device-sampling") {
      sampling_list = argv[i + 1];
    } else if (flag == "--temperature") {
      temperature = std::atof(argv[i + 1]);
    } else if (flag == "--top-p") {
      top_p = std::atof(argv[i + 1]);
    } else if (flag == "--batch-wait-us") {
      batch_wait_us = std::atoll(argv[i + 1]);
    } else if (flag == "--weights") {
      weights = argv[i + 1];
    } else if (flag == "--weight-format") {
      weight_format = argv[i + 1];
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::vector<bool> samplings;
  for (absl::string_view v : absl::StrSplit(sampling_list, ',')) {
    if (v == "0" || v == "1") samplings.push_back(v == "1");
    else { std::fprintf(stderr, "--device-sampling: a list of 0 and 1\n"); return 2; }
  }
  if (jobs < 1 || tokens < 2 || doc_tokens < 1 || !(temperature >= 0 && temperature <= 2) ||
      !(top_p > 0 && top_p <= 1) || !kernels::ParseBackendKind(backend_name).ok() ||
      (weights != "bf16" && weights != "f32") ||
      (weight_format != "checkpoint" && weight_format != "fp8")) {
    std::fprintf(stderr,
                 "--jobs >= 1, --tokens >= 2, --doc >= 1, --temperature in [0, 2], --top-p in "
                 "(0, 1], --backend auto|cpu|cuda, --weights bf16|f32, --weight-format "
                 "checkpoint|fp8\n");
    return 2;
  }
  char tmpl[] = "/tmp/strata_decode_batch_bench_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string dir = tmpl;
  model::RandomModelOptions mo;
  mo.preset = preset;
  mo.seed = 5;
  mo.write_tokenizer = false;
  mo.dtype = weights == "bf16" ? kernels::DType::kBF16 : kernels::DType::kF32;
  if (auto written = model::WriteRandomModel(dir + "/model", mo); !written.ok()) {
    std::fprintf(stderr, "%s\n", written.status().ToString().c_str());
    return 1;
  }
  auto m = model::LoadModel(dir + "/model");
  if (!m.ok()) return 1;
  kernels::BackendOptions bo;
  bo.kind = *kernels::ParseBackendKind(backend_name);  // checked with the flags
  bo.cpu_threads = threads;
  auto made = kernels::MakeBackend(bo);
  if (!made.ok()) {
    std::fprintf(stderr, "%s backend: %s\n", backend_name.c_str(), made.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<kernels::Backend> backend = *std::move(made);
  kvstore::LocalStoreOptions so;
  so.path = dir + "/kv";
  so.sync_writes = false;
  auto store = kvstore::LocalStore::Open(so);
  if (!store.ok()) return 1;
  const int64_t vocab = (*m)->config.vocab_size;
  const std::string doc_id = "0f0e0d0c0b0a09080706050403020100";

  std::vector<std::vector<int32_t>> reference;
  for (const bool sampling : samplings) for (int batch : {1, 16}) {
    WorkerOptions wo;
    wo.max_decode_batch = batch;
    wo.device_sampling = sampling;
    wo.decode_batch_wait_us = batch_wait_us;
    wo.weight_format = weight_format;
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
    // Per job, (time, tokens so far) at each token delta: the steady rate below.
    std::vector<std::vector<std::pair<int64_t, int>>> progress(jobs);
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
        if (temperature > 0) {
          req.mutable_params()->set_temperature(static_cast<float>(temperature));
          req.mutable_params()->set_top_p(static_cast<float>(top_p));
          req.mutable_params()->set_seed(static_cast<uint64_t>(100 + j));
        }
        v1::JobInfo last;
        absl::Status s = (*w)->RunJob(req, [&](const v1::JobEvent& e) {
          if (e.has_snapshot()) {
            last = e.snapshot();
            out[j].assign(last.output_token_ids().begin(), last.output_token_ids().end());
          } else if (e.has_tokens()) {
            const int before = progress[j].empty() ? 0 : progress[j].back().second;
            progress[j].emplace_back(MonotonicNanos(), before + e.tokens().token_ids_size());
          }
          return true;
        });
        if (!s.ok()) {
          std::fprintf(stderr, "job %d: %s\n", j, s.ToString().c_str());
        } else if (last.state() != v1::JobInfo::DONE) {
          std::fprintf(stderr, "job %d: state %s: %s\n", j, v1::JobInfo::State_Name(last.state()).c_str(),
                       last.error_message().c_str());
        }
      });
    }
    for (auto& t : ts) t.join();
    const double seconds = (MonotonicNanos() - start) * 1e-9;
    // Steady rate: tokens made while every job was decoding (from the last job's first token to
    // the first job's last), so the jobs' start and tail do not count.
    int64_t from = 0, to = std::numeric_limits<int64_t>::max();
    for (const auto& p : progress) {
      auto first = std::find_if(p.begin(), p.end(), [](const auto& x) { return x.second > 0; });
      from = std::max(from, first == p.end() ? std::numeric_limits<int64_t>::max() : first->first);
      to = std::min(to, p.empty() ? int64_t{0} : p.back().first);
    }
    auto tokens_at = [](const std::vector<std::pair<int64_t, int>>& p, int64_t t) {
      int n = 0;
      for (const auto& [when, count] : p) {
        if (when > t) break;
        n = count;
      }
      return n;
    };
    int64_t steady_tokens = 0;
    for (const auto& p : progress) steady_tokens += tokens_at(p, to) - tokens_at(p, from);
    // "-" when the jobs never all decoded at once (one finished before another's first token).
    const std::string steady =
        to > from ? absl::StrFormat("%.1f", steady_tokens / ((to - from) * 1e-9)) : std::string("-");
    if (reference.empty()) reference = out;
    bool same = true;
    for (int j = 0; j < jobs; ++j) same &= out[j] == reference[j] && static_cast<int>(out[j].size()) == tokens;
    std::printf("backend=%s preset=%s weights=%s weight_format=%s jobs=%d tokens=%d doc=%d threads=%d temperature=%g top_p=%g "
                "batch_wait_us=%lld device_sampling=%d max_decode_batch=%d: %.3f s, %.1f tokens/s (steady %s), %lld decode "
                "steps in %lld forwards, %lld device picks, tokens equal to the first mode's: %s\n",
                backend->Name().c_str(), preset.c_str(), weights.c_str(), weight_format.c_str(), jobs, tokens, doc_tokens, threads,
                temperature, top_p, static_cast<long long>(batch_wait_us), sampling ? 1 : 0, batch, seconds, jobs * tokens / seconds,
                steady.c_str(),
                static_cast<long long>((*w)->decode_steps()),
                static_cast<long long>((*w)->decode_batches()),
                static_cast<long long>((*w)->device_picks()), same ? "yes" : "NO");
  }
  store->reset();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace strata::worker

int main(int argc, char** argv) { return strata::worker::Run(argc, argv); }
