// Time to first token of a second question on a persisted document, with the full mount (every
// page loaded into the job's KV cache) and the lazy mount (WorkerOptions::lazy_mount: summaries
// only, chosen pages on demand), on a generated model and a LocalStore (disk tier) in a temp dir.
//
//   lazy_mount_bench [--preset tiny] [--doc 32768] [--shard 4096] [--budget 2048] [--reps 3]
//                    [--threads 1] [--tokens 1] [--modes full,lazy,lazy-dev,resident]
//                    [--backend auto|cpu|cuda] [--decode-graph auto|on|off] [--device-sampling 1|0]
//                    [--cache-pages N]
//                    [--kv-page-dtype bf16|fp8] [--host-gib 16] [--prompt 16] [--dir /tmp]
//                    [--prefill-chunk 512] [--prefill-policy dense] [--matmul-precision split]
//                    [--model DIR] [--weights bf16|f32] [--blob-files 1|0] [--ingest 1|0]
//                    [--mount 0|1] [--prepin 0|1] [--temperature 0] [--top-p 1] [--seed 7]
//
// --temperature, --top-p and --seed set the question's SamplingParams (default greedy; the seed is
// set only at temperature > 0, the same for every question, so every mode draws the same stream).
// --cache-pages sets WorkerOptions::lazy_cache_pages (default 0: the worker's automatic size).
// --kv-page-dtype sets WorkerOptions::kv_page_dtype of every worker (the persisted pages' format);
// --host-gib the resident mode's host tier capacity (it must hold the whole document);
// --prompt the question's length in tokens; --dir where the model and the LocalStore go (a
// temporary folder made there and removed at the end). --prefill-chunk, --prefill-policy and
// --matmul-precision set the WorkerOptions of the same names for every worker (the defaults are
// WorkerOptions'); --modes none persists the document and asks nothing. --model loads that model
// folder (e.g. from `strata make-model`) instead of writing a random one of --preset, whose
// weights are --weights (default bf16, as Llama checkpoints ship; the benchmark's runs before
// session 9 used f32 weights, which make the GPU's prefill GEMMs f32 ones). --blob-files sets
// LocalStoreOptions::blob_files, --ingest LocalStoreOptions::ingest_deferred; --prepin 1 pins the
// host tier's whole capacity before the prefill (BackendPageAllocator::Reserve, as `strata serve`
// does from its start on a device backend: the default there) and prints how long it took;
// --prepin 0 pins as pages arrive. --mount 1 sends the resident worker, before its first question,
// the MountShard calls the coordinator makes when the document becomes READY (one per shard, with
// whole_document: every shard on this worker), which prepare the document's lazy state there,
// and prints their time; the first question then starts warm.
//
// --backend cuda runs every worker on the CUDA backend (the plugin from $STRATA_CUDA_PLUGIN or
// next to the binary; then the resident mode's host tier is pinned memory); --decode-graph sets
// WorkerOptions::decode_graph of every worker (default auto: on for CUDA); --device-sampling 0|1 its
// WorkerOptions::device_sampling (default 1).
//
// The document is persisted once by ANCHOR prefill of --shard-token shards with an empty anchor
// (each shard attends to itself; cheap at any length; the KV is then what the jobs read), through
// a tiered store whose Put writes each page to the LocalStore and to the resident mode's host
// tier (as `strata serve` does). Modes:
//   full      a fresh Worker per question, every page loaded (the default mount);
//   lazy      a fresh Worker per question, lazy mount, the host path (CPU backend default);
//   lazy-dev  the same with device_selection "on": the device path through the CPU backend's
//             twins, host-managed page cache, summaries uploaded per question;
//   resident  one Worker for every question, lazy mount with device_selection "on", a host tier in
//             BackendPageAllocator memory holding the whole document (written through at
//             persistence; --host-gib must hold it): the device-managed page cache, and the document's device state
//             kept between questions (WorkerOptions::lazy_shared_documents = 1).
// Nothing else is held between questions (the OS file cache is warm after the first read). The
// job: quest with --budget tokens, a --prompt-token prompt, --tokens generated tokens. Prints per mode
// and repetition: TTFT (RunJob start to the first token event), the decode rate after the first
// token (--tokens > 1), pages fetched, and whether the first token equals the full mount's.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/clock.h"
#include "kernels/backend_factory.h"
#include "kvstore/backend_page_allocator.h"
#include "kvstore/host_cache.h"
#include "kvstore/local_store.h"
#include "kvstore/page_format.h"
#include "kvstore/tiered_store.h"
#include "model/random_model.h"
#include "worker/worker.h"

namespace strata::worker {
namespace {

constexpr char kDocId[] = "0123456789abcdef0123456789abcdef";

int Run(int argc, char** argv) {
  std::string preset = "tiny";
  int64_t cache_pages = 0;
  int64_t doc_tokens = 32768, shard = 4096;
  int budget = 2048, reps = 3, threads = 1, tokens = 1;
  std::string modes = "full,lazy,lazy-dev,resident";
  std::string backend_name = "cpu", decode_graph = "auto", page_dtype = "bf16";
  bool device_sampling = true;
  double host_gib = 16;
  int prompt_tokens = 16;
  std::string parent = "/tmp", model_dir, weights = "bf16";
  bool blob_files = kvstore::LocalStoreOptions().blob_files;
  bool ingest = kvstore::LocalStoreOptions().ingest_deferred;
  bool mount = false;
  int prepin = -1;  // -1: as `strata serve` (on a device backend)
  double temperature = 0, top_p = 1;
  uint64_t seed = 7;
  WorkerOptions defaults;
  int64_t prefill_chunk = defaults.prefill_chunk_size;
  std::string prefill_policy = defaults.prefill_policy, precision = defaults.matmul_precision;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* v = argv[i + 1];
    if (flag == "--preset") preset = v;
    else if (flag == "--doc") doc_tokens = std::atoll(v);
    else if (flag == "--shard") shard = std::atoll(v);
    else if (flag == "--budget") budget = std::atoi(v);
    else if (flag == "--reps") reps = std::atoi(v);
    else if (flag == "--threads") threads = std::atoi(v);
    else if (flag == "--tokens") tokens = std::atoi(v);
    else if (flag == "--modes") modes = v;
    else if (flag == "--backend") backend_name = v;
    else if (flag == "--decode-graph") decode_graph = v;
    else if (flag == "--device-sampling") device_sampling = std::atoi(v) != 0;
    else if (flag == "--cache-pages") cache_pages = std::atoll(v);
    else if (flag == "--kv-page-dtype") page_dtype = v;
    else if (flag == "--host-gib") host_gib = std::atof(v);
    else if (flag == "--prompt") prompt_tokens = std::atoi(v);
    else if (flag == "--dir") parent = v;
    else if (flag == "--prefill-chunk") prefill_chunk = std::atoll(v);
    else if (flag == "--prefill-policy") prefill_policy = v;
    else if (flag == "--matmul-precision") precision = v;
    else if (flag == "--model") model_dir = v;
    else if (flag == "--weights") weights = v;
    else if (flag == "--blob-files") blob_files = std::atoi(v) != 0;
    else if (flag == "--mount") mount = std::atoi(v) != 0;
    else if (flag == "--ingest") ingest = std::atoi(v) != 0;
    else if (flag == "--prepin") prepin = std::atoi(v) != 0 ? 1 : 0;
    else if (flag == "--temperature") temperature = std::atof(v);
    else if (flag == "--top-p") top_p = std::atof(v);
    else if (flag == "--seed") seed = std::strtoull(v, nullptr, 10);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const int P = 64;
  if (doc_tokens < P || shard < P || shard % P != 0 || reps < 1 || tokens < 1 || prompt_tokens < 1 ||
      !(host_gib > 0) || !(temperature >= 0 && temperature <= 2) || !(top_p > 0 && top_p <= 1) ||
      !ParseKvDType(page_dtype).ok() ||
      (weights != "bf16" && weights != "f32")) {
    std::fprintf(stderr, "bad sizes\n");
    return 2;
  }
  std::string tmpl = parent + "/strata_lazy_bench_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    std::fprintf(stderr, "cannot make a folder in %s\n", parent.c_str());
    return 1;
  }
  const std::string dir = tmpl;
  struct RemoveAtExit {  // declared first, so it runs after the store and workers are gone
    std::string dir;
    ~RemoveAtExit() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } remove_at_exit{dir};
  const std::string model_name = model_dir.empty() ? preset : model_dir;
  if (model_dir.empty()) {
    model::RandomModelOptions mo;
    mo.preset = preset;
    mo.write_tokenizer = false;
    mo.dtype = weights == "bf16" ? kernels::DType::kBF16 : kernels::DType::kF32;
    if (!model::WriteRandomModel(dir + "/model", mo).ok()) return 1;
    model_dir = dir + "/model";
  }
  auto model = model::LoadModel(model_dir);
  if (!model.ok()) {
    std::fprintf(stderr, "model: %s\n", model.status().ToString().c_str());
    return 1;
  }
  if (!kernels::ParseBackendKind(backend_name).ok()) {
    std::fprintf(stderr, "--backend auto|cpu|cuda\n");
    return 2;
  }
  kernels::BackendOptions bo;
  bo.kind = *kernels::ParseBackendKind(backend_name);  // checked with the flags
  bo.cpu_threads = threads;
  auto made = kernels::MakeBackend(bo);
  if (!made.ok()) {
    std::fprintf(stderr, "%s backend: %s\n", backend_name.c_str(), made.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<kernels::Backend> backend = *std::move(made);
  std::printf("backend %s, decode graph %s, device sampling %d, temperature %g, top-p %g\n",
              backend->Name().c_str(), decode_graph.c_str(), device_sampling ? 1 : 0, temperature,
              top_p);
  kvstore::LocalStoreOptions so;
  so.path = dir + "/kv";
  so.blob_files = blob_files;
  so.ingest_deferred = ingest;
  auto store = kvstore::LocalStore::Open(so);
  if (!store.ok()) return 1;
  const int vocab = static_cast<int>((*model)->config.vocab_size);
  std::vector<int32_t> doc(static_cast<size_t>(doc_tokens));
  for (int64_t i = 0; i < doc_tokens; ++i) doc[i] = static_cast<int32_t>((i * 37 + 11) % vocab);

  auto make = [&](const std::string& mode, kvstore::PageStore* pages) {
    WorkerOptions wo;
    wo.lazy_mount = mode != "full";
    if (mode == "lazy-dev" || mode == "resident") wo.device_selection = "on";
    wo.decode_graph = decode_graph;
    wo.device_sampling = device_sampling;
    wo.lazy_cache_pages = cache_pages;
    wo.kv_page_dtype = page_dtype;
    wo.prefill_chunk_size = prefill_chunk;
    wo.prefill_policy = prefill_policy;
    wo.matmul_precision = precision;
    return Worker::Create(wo, model->get(), backend.get(), pages, store->get(), nullptr);
  };
  // The resident mode's host tier (pages in backend host memory). The document is persisted
  // through the tiered store, whose Put writes through to it (as `strata serve` does), so the
  // tier holds every page when the first question comes if its capacity allows.
  const model::ModelConfig& c = (*model)->config;
  kvstore::PageShape shape;
  shape.page_size = P;
  shape.head_dim = static_cast<int>(c.head_dim);
  shape.dtype = ParseKvDType(page_dtype).value_or(kernels::DType::kBF16);
  kvstore::BackendPageAllocator alloc(backend.get(), shape.EncodedBytes(), size_t{256} << 20);  // as serve
  kvstore::HostCacheOptions ho;
  ho.capacity_bytes = static_cast<int64_t>(host_gib * (int64_t{1} << 30));
  ho.allocator = &alloc;
  auto host = kvstore::HostCache::Create(ho);
  if (!host.ok()) return 1;
  if (prepin < 0) prepin = backend->Name() != "cpu" ? 1 : 0;
  if (prepin == 1) {
    const int64_t t0 = MonotonicNanos();
    const absl::Status s = alloc.Reserve(static_cast<size_t>(ho.capacity_bytes));
    std::printf("host tier: %.1f GiB pinned up front in %.2f s%s\n", alloc.reserved_bytes() / 1073741824.0,
                (MonotonicNanos() - t0) * 1e-9, s.ok() ? "" : (" (" + s.ToString() + ")").c_str());
  }
  kvstore::TieredStoreOptions to;
  to.host = host->get();
  to.local = store->get();
  auto tiered = kvstore::TieredStore::Create(to);
  if (!tiered.ok()) return 1;
  {
    auto w = make("full", tiered->get());
    if (!w.ok()) {
      std::fprintf(stderr, "worker: %s\n", w.status().ToString().c_str());
      return 1;
    }
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
    std::printf("persisted %lld tokens (%s) in %.1f s (shards of %lld, prefill chunk %lld, policy %s, "
                "matmul %s, %s pages, %s); the host tier holds %lld entries (pages, summaries)\n",
                static_cast<long long>(doc_tokens), model_name.c_str(), (MonotonicNanos() - t0) * 1e-9,
                static_cast<long long>(shard), static_cast<long long>(prefill_chunk),  // 0: the worker's automatic size
                prefill_policy.c_str(), precision.c_str(), page_dtype.c_str(),
                ingest ? "batches ingested as SST files" : "batches through the memtables",
                static_cast<long long>((*host)->num_entries()));
  }
  if (modes == "none") return 0;
  auto resident = make("resident", tiered->get());
  if (!resident.ok()) return 1;
  if (mount) {
    const int64_t t0 = MonotonicNanos();
    uint64_t summary_bytes = 0;
    for (int64_t s0 = 0; s0 < doc_tokens; s0 += shard) {
      v1::MountShardRequest m;
      m.mutable_shard()->set_document_id(kDocId);
      m.mutable_shard()->set_first_page(static_cast<uint64_t>(s0 / P));
      m.mutable_shard()->set_end_page(static_cast<uint64_t>((std::min(doc_tokens, s0 + shard) + P - 1) / P));
      m.set_whole_document(true);
      auto r = (*resident)->MountShard(m);
      if (!r.ok()) {
        std::fprintf(stderr, "mount: %s\n", r.status().ToString().c_str());
        return 1;
      }
      summary_bytes = std::max<uint64_t>(summary_bytes, r->summary_bytes());  // each reports the document's
    }
    std::printf("mounted (whole document on the resident worker) in %.3f s: the document's summaries on the backend, "
                "%.2f MiB\n",
                (MonotonicNanos() - t0) * 1e-9, summary_bytes / 1048576.0);
  }
  int32_t full_first = -1;
  std::vector<int32_t> lazy_dev_tokens;
  for (int rep = 0; rep < reps; ++rep) {
    for (const std::string mode : {"full", "lazy", "lazy-dev", "resident"}) {
      if (("," + modes + ",").find("," + mode + ",") == std::string::npos) continue;
      auto fresh = mode == "resident" ? nullptr : make(mode, store->get());
      if (mode != "resident" && !fresh.ok()) return 1;
      Worker* w = mode == "resident" ? resident->get() : fresh->get();
      v1::RunJobRequest r;
      r.set_job_id("q2");
      r.mutable_shard_map()->set_document_id(kDocId);
      r.mutable_shard_map()->set_page_size(P);
      r.mutable_shard_map()->set_num_tokens(static_cast<uint64_t>(doc_tokens));
      r.mutable_shard_map()->add_shards()->mutable_range()->set_document_id(kDocId);
      for (int i = 0; i < prompt_tokens; ++i) r.add_prompt_token_ids((i * 13 + 5) % vocab);
      r.mutable_params()->set_max_tokens(static_cast<uint32_t>(tokens));
      r.mutable_params()->set_ignore_eos(true);
      if (temperature > 0) {
        r.mutable_params()->set_temperature(static_cast<float>(temperature));
        r.mutable_params()->set_top_p(static_cast<float>(top_p));
        r.mutable_params()->set_seed(seed);
      }
      r.mutable_policy()->set_name("quest");
      r.mutable_policy()->set_budget_tokens(static_cast<uint32_t>(budget));
      r.set_job_id(mode + "-" + std::to_string(rep));
      const int64_t t0 = MonotonicNanos();
      double ttft = -1;
      int64_t first_ns = 0, last_ns = 0;
      v1::JobInfo last;
      absl::Status s = w->RunJob(r, [&](const v1::JobEvent& e) {
        if (e.has_tokens()) {
          last_ns = MonotonicNanos();
          if (ttft < 0) {
            ttft = (last_ns - t0) * 1e-9;
            first_ns = last_ns;
          }
        }
        if (e.has_snapshot()) last = e.snapshot();
        return true;
      });
      if (!s.ok() || last.state() != v1::JobInfo::DONE || last.output_token_ids_size() < 1) {
        std::fprintf(stderr, "job: %s %s\n", s.ToString().c_str(), last.error_message().c_str());
        return 1;
      }
      const int32_t first = last.output_token_ids(0);
      if (mode == "full") full_first = first;
      const v1::PagesByTier& t = last.usage().pages_fetched();
      const int n = last.output_token_ids_size();
      const std::vector<int32_t> ids(last.output_token_ids().begin(), last.output_token_ids().end());
      if (mode == "lazy-dev") lazy_dev_tokens = ids;
      size_t same = 0;
      while (same < ids.size() && same < lazy_dev_tokens.size() && ids[same] == lazy_dev_tokens[same]) ++same;
      char agree[64] = "";
      if (mode == "resident" && !lazy_dev_tokens.empty()) {
        std::snprintf(agree, sizeof(agree), "  first %zu of %zu tokens = lazy-dev", same, ids.size());
      }
      char rate[64] = "";
      if (n > 1 && last_ns > first_ns) {
        std::snprintf(rate, sizeof(rate), "  decode %.1f tok/s", (n - 1) / ((last_ns - first_ns) * 1e-9));
      }
      std::printf("rep %d %-8s ttft %.3f s%s  pages fetched %llu  first token %d%s%s\n", rep, mode.c_str(), ttft,
                  rate, static_cast<unsigned long long>(t.host() + t.disk() + t.remote()), first,
                  mode == "full" ? "" : (first == full_first ? " (= full)" : " (!= full)"), agree);
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::worker

int main(int argc, char** argv) { return strata::worker::Run(argc, argv); }
