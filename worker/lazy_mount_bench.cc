// Time to first token of a second question on a persisted document, with the full mount (every
// page loaded into the job's KV cache) and the lazy mount (WorkerOptions::lazy_mount: summaries
// only, chosen pages on demand), on a generated model and a LocalStore (disk tier) in a temp dir.
//
//   lazy_mount_bench [--preset tiny] [--doc 32768] [--shard 4096] [--budget 2048] [--reps 3]
//                    [--threads 1]
//
// The document is persisted once by ANCHOR prefill of --shard-token shards with an empty anchor
// (each shard attends to itself; cheap at any length; the KV is then what the jobs read). Each
// question runs on a fresh Worker over the same store (nothing held from earlier jobs; the OS
// file cache is warm after the first read). The job: quest with --budget tokens, a 16-token
// prompt, one generated token. Prints per mode and repetition: TTFT (RunJob start to the first
// token event), pages fetched, and whether the first token equals the full mount's.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/clock.h"
#include "kvstore/local_store.h"
#include "model/random_model.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

constexpr char kDocId[] = "0123456789abcdef0123456789abcdef";

int Run(int argc, char** argv) {
  std::string preset = "tiny";
  int64_t doc_tokens = 32768, shard = 4096;
  int budget = 2048, reps = 3, threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* v = argv[i + 1];
    if (flag == "--preset") preset = v;
    else if (flag == "--doc") doc_tokens = std::atoll(v);
    else if (flag == "--shard") shard = std::atoll(v);
    else if (flag == "--budget") budget = std::atoi(v);
    else if (flag == "--reps") reps = std::atoi(v);
    else if (flag == "--threads") threads = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const int P = 64;
  if (doc_tokens < P || shard < P || shard % P != 0 || reps < 1) {
    std::fprintf(stderr, "bad sizes\n");
    return 2;
  }
  char tmpl[] = "/tmp/strata_lazy_bench_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string dir = tmpl;
  model::RandomModelOptions mo;
  mo.preset = preset;
  mo.write_tokenizer = false;
  if (!model::WriteRandomModel(dir + "/model", mo).ok()) return 1;
  auto model = model::LoadModel(dir + "/model");
  if (!model.ok()) return 1;
  auto backend = kernels::MakeCpuBackend(threads);
  kvstore::LocalStoreOptions so;
  so.path = dir + "/kv";
  auto store = kvstore::LocalStore::Open(so);
  if (!store.ok()) return 1;
  const int vocab = static_cast<int>((*model)->config.vocab_size);
  std::vector<int32_t> doc(static_cast<size_t>(doc_tokens));
  for (int64_t i = 0; i < doc_tokens; ++i) doc[i] = static_cast<int32_t>((i * 37 + 11) % vocab);

  auto make = [&](bool lazy) {
    WorkerOptions wo;
    wo.lazy_mount = lazy;
    return Worker::Create(wo, model->get(), backend.get(), store->get(), store->get(), nullptr);
  };
  {
    auto w = make(false);
    if (!w.ok()) return 1;
    const int64_t t0 = MonotonicNanos();
    for (int64_t s0 = 0; s0 < doc_tokens; s0 += shard) {
      const int64_t s1 = std::min(doc_tokens, s0 + shard);
      v1::PrefillShardRequest r;
      r.mutable_shard()->set_document_id(kDocId);
      r.mutable_shard()->set_first_page(static_cast<uint64_t>(s0 / P));
      r.mutable_shard()->set_end_page(static_cast<uint64_t>((s1 + P - 1) / P));
      r.mutable_shard_map()->set_document_id(kDocId);
      r.mutable_shard_map()->set_page_size(P);
      r.mutable_shard_map()->set_num_tokens(static_cast<uint64_t>(doc_tokens));
      r.set_mode(v1::PREFILL_MODE_ANCHOR);
      r.mutable_token_ids()->Assign(doc.begin() + s0, doc.begin() + s1);
      absl::Status s = (*w)->PrefillShard(r, nullptr, nullptr);
      if (!s.ok()) {
        std::fprintf(stderr, "prefill: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    std::printf("persisted %lld tokens (%s) in %.1f s\n", static_cast<long long>(doc_tokens), preset.c_str(),
                (MonotonicNanos() - t0) * 1e-9);
  }
  int32_t full_first = -1;
  for (int rep = 0; rep < reps; ++rep) {
    for (bool lazy : {false, true}) {
      auto w = make(lazy);
      if (!w.ok()) return 1;
      v1::RunJobRequest r;
      r.set_job_id("q2");
      r.mutable_shard_map()->set_document_id(kDocId);
      r.mutable_shard_map()->set_page_size(P);
      r.mutable_shard_map()->set_num_tokens(static_cast<uint64_t>(doc_tokens));
      r.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(kDocId);
      for (int i = 0; i < 16; ++i) r.add_prompt_token_ids((i * 13 + 5) % vocab);
      r.mutable_params()->set_max_tokens(1);
      r.mutable_params()->set_ignore_eos(true);
      r.mutable_policy()->set_name("quest");
      r.mutable_policy()->set_budget_tokens(static_cast<uint32_t>(budget));
      const int64_t t0 = MonotonicNanos();
      double ttft = -1;
      v1::JobInfo last;
      absl::Status s = (*w)->RunJob(r, [&](const v1::JobEvent& e) {
        if (e.has_tokens() && ttft < 0) ttft = (MonotonicNanos() - t0) * 1e-9;
        if (e.has_snapshot()) last = e.snapshot();
        return true;
      });
      if (!s.ok() || last.state() != v1::JobInfo::DONE || last.output_token_ids_size() < 1) {
        std::fprintf(stderr, "job: %s %s\n", s.ToString().c_str(), last.error_message().c_str());
        return 1;
      }
      const int32_t first = last.output_token_ids(0);
      if (!lazy) full_first = first;
      const v1::PagesByTier& t = last.usage().pages_fetched();
      std::printf("rep %d %-4s ttft %.3f s  pages fetched %llu  first token %d%s\n", rep, lazy ? "lazy" : "full",
                  ttft, static_cast<unsigned long long>(t.host() + t.disk() + t.remote()), first,
                  lazy ? (first == full_first ? " (= full)" : " (!= full)") : "");
    }
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace strata::worker

int main(int argc, char** argv) { return strata::worker::Run(argc, argv); }
