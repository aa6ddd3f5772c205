#include "cli/server_runtime.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>

#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "kernels/backend_factory.h"
#include "kvstore/page_format.h"

namespace strata::cli {

std::unique_ptr<kernels::Backend> MakeWorkerBackend(int threads) {
  kernels::BackendOptions options;
  options.kind = kernels::BackendKind::kAuto;
  options.cpu_threads = threads;
  std::string why_not_cuda;
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::MakeBackend(options, &why_not_cuda);
  if (!backend.ok()) {  // kAuto only fails if even the CPU backend cannot be made
    STRATA_LOG(ERROR) << "backend: " << backend.status() << "; using cpu";
    return kernels::MakeCpuBackend(threads);
  }
  if (why_not_cuda.empty()) {
    STRATA_LOG(INFO) << "backend: " << (*backend)->Name();
  } else {
    STRATA_LOG(INFO) << "backend: cpu (" << why_not_cuda << ")";
  }
  return *std::move(backend);
}

std::unique_ptr<kernels::Backend> MakeShardBackend(const kernels::Backend& worker_backend,
                                                   const std::string& placement) {
  if (worker_backend.Name() == "cpu" || placement == "host") return nullptr;
  kernels::BackendOptions options;
  options.kind = kernels::BackendKind::kCuda;
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::MakeBackend(options);
  if (!backend.ok()) {
    STRATA_LOG(WARNING) << "shard backend: " << backend.status() << "; mounted shards stay in host memory";
    return nullptr;
  }
  STRATA_LOG(INFO) << "shard backend: " << (*backend)->Name() << " (mounted shards on the device)";
  return *std::move(backend);
}

absl::Status WriteLineFile(const std::string& path, const std::string& line) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  std::fprintf(f, "%s\n", line.c_str());
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port) {
  return WriteLineFile(path, absl::StrCat(grpc_port, " ", metrics_port));
}

absl::Status StartMetrics(const std::string& listen, std::shared_ptr<prometheus::Registry> registry,
                          std::unique_ptr<prometheus::Exposer>* exposer, int* port) {
  *port = 0;
  if (listen.empty()) return absl::OkStatus();
  try {  // prometheus-cpp reports bind failures by throwing
    *exposer = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  (*exposer)->RegisterCollectable(registry);
  const std::vector<int> ports = (*exposer)->GetListeningPorts();
  *port = ports.empty() ? 0 : ports[0];
  return absl::OkStatus();
}

size_t WorkerPageBytes(const model::ModelConfig& config, int64_t page_size, const std::string& page_dtype) {
  kvstore::PageShape shape;
  shape.dtype = worker::ParseKvDType(page_dtype).value_or(kernels::DType::kBF16);
  shape.page_size = page_size >= 1 && page_size <= 65535 ? static_cast<int>(page_size) : 0;
  shape.head_dim = config.head_dim >= 1 && config.head_dim <= 65535 ? static_cast<int>(config.head_dim) : 0;
  return shape.Validate().ok() ? shape.EncodedBytes() : 0;
}

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(int64_t capacity_bytes,
                                                           kvstore::KvMetrics* metrics,
                                                           kvstore::PageStore* local,
                                                           kvstore::PageStore* remote,
                                                           kernels::Backend* backend,
                                                           size_t page_bytes) {
  auto tier = std::make_unique<HostTier>();
  tier->store_ = local != nullptr ? local : remote;
  if (capacity_bytes <= 0) return tier;
  kvstore::HostCacheOptions hco;
  hco.capacity_bytes = capacity_bytes;
  hco.metrics = metrics;
  if (backend != nullptr && page_bytes > 0) {
    // Pinned chunks of at most 256 MiB, and none larger than the tier.
    const size_t chunk = std::min<size_t>(size_t{256} << 20, static_cast<size_t>(capacity_bytes));
    tier->allocator_ = std::make_unique<kvstore::BackendPageAllocator>(backend, page_bytes, chunk);
    hco.allocator = tier->allocator_.get();
    if (backend->Name() != "cpu") {
      kvstore::BackendPageAllocator* alloc = tier->allocator_.get();
      std::atomic<bool>* stop = &tier->stop_pinning_;
      tier->pinner_ = std::thread([alloc, stop, capacity_bytes] {
        const int64_t t0 = MonotonicNanos();
        const absl::Status s = alloc->Reserve(static_cast<size_t>(capacity_bytes), stop);
        const double gib = static_cast<double>(alloc->reserved_bytes()) / (1 << 30);
        if (s.ok()) {
          STRATA_LOG(INFO) << "host tier: " << gib << " GiB pinned in " << (MonotonicNanos() - t0) * 1e-9 << " s";
        } else if (!absl::IsCancelled(s)) {
          STRATA_LOG(WARNING) << "host tier: " << gib << " GiB pinned up front, then " << s
                              << "; the rest is pinned as pages arrive";
        }
      });
    }
  }
  absl::StatusOr<std::unique_ptr<kvstore::HostCache>> cache = kvstore::HostCache::Create(hco);
  if (!cache.ok()) return cache.status();
  tier->cache_ = *std::move(cache);
  kvstore::TieredStoreOptions tso;
  tso.host = tier->cache_.get();
  tso.local = local;
  tso.remote = remote;
  absl::StatusOr<std::unique_ptr<kvstore::TieredStore>> tiered = kvstore::TieredStore::Create(tso);
  if (!tiered.ok()) return tiered.status();
  tier->tiered_ = *std::move(tiered);
  tier->store_ = tier->tiered_.get();
  return tier;
}

HostTier::~HostTier() {
  stop_pinning_ = true;
  if (pinner_.joinable()) pinner_.join();
}

void WorkerEngineFlags::Register(FlagSet* flags, const std::string& durable_tier) {
  flags->Int("page-size", &page_size, "tokens per KV page (must match the coordinator)");
  flags->Int("prefill-chunk", &prefill_chunk,
             "prefill chunk size (tokens; progress is reported per chunk; 0: 512 on the CPU backend, 4096 on a GPU)");
  flags->Int("max-jobs", &max_jobs, "jobs the worker leads at the same time");
  flags->Int("host-cache-bytes", &host_cache_bytes,
             absl::StrCat("host-memory page tier in front of ", durable_tier,
                          " (bytes; 0: none; on a GPU worker pinned memory, all of it pinned from the start on a "
                          "thread of its own)"));
  flags->Int("threads", &threads, "CPU backend threads (0: every usable core, the CPU limit where one is set)");
  flags->Bool("lazy-mount", &lazy_mount,
              "quest/tokenselect jobs on a whole document load only its minmax summaries and fetch chosen "
              "pages on demand (opt-in; page-level choice, see docs/design.md)");
  flags->Int("lazy-cache-pages", &lazy_cache_pages,
             "with --lazy-mount: GPU page cache slots per job (0: four decode steps' pages for the model and "
             "budget; clock eviction; at least one layer step's pages)");
  flags->Int("lazy-shared-documents", &lazy_shared_documents,
             "with --lazy-mount: documents whose device state (summaries, resident page cache) stays between "
             "questions while no job uses it (0: none; jobs on one document share it while > 0)");
  flags->String("device-selection", &device_selection,
                "auto|on|off: quest/tokenselect decode steps select on the backend (auto: when it is not the "
                "CPU backend; on: also on the CPU backend)");
  flags->String("shard-placement", &shard_placement,
                "auto|host|device: where mounted document shards live and are attended for other workers' "
                "jobs (auto: on the GPU, through a second backend instance, when the worker has one; host: "
                "host memory on the CPU backend; device: on the GPU, failing without one)");
  flags->String("decode-graph", &decode_graph,
                "auto|on|off: a job's decode steps run as one replayed CUDA graph when capturable, a batch of "
                "concurrent jobs' steps as one graph (auto: when the backend is not the CPU backend)");
  flags->Bool("device-sampling", &device_sampling,
              "decode steps draw their token on the backend (the job's temperature, top-k, top-p and seeded "
              "stream, as the host sampler), alone or batched, so only the token comes back instead of the "
              "vocabulary's logits");
  flags->String("matmul-precision", &matmul_precision,
                "split|bf16: split keeps f32 activations (two GEMMs per projection on the GPU); bf16 rounds "
                "them to bf16 for one GEMM (faster prefill, logits move slightly)");
  flags->String("weight-format", &weight_format,
                "checkpoint|fp8: projection matrices as loaded, or fp8 e4m3 rows with per-row scales quantised at "
                "load (half the weight bytes per decode step, logits move by the rounding; keep it the same across "
                "the workers of a cluster, like --kv-page-dtype)");
  flags->String("prefill-policy", &prefill_policy,
                "dense|quest|tokenselect: attention of document prefill (dense: exact; quest/tokenselect: each "
                "chunk selects --prefill-budget-tokens earlier tokens per layer and KV head with its mean query; "
                "the persisted KV is approximate)");
  flags->String("kv-page-dtype", &kv_page_dtype,
                "bf16|fp8: element type of the KV pages the worker persists (fp8: e4m3 with per-page scales, half "
                "the bytes in every tier, lossy; must match across the workers of a cluster, like --page-size)");
  flags->String("kv-cache-dtype", &kv_cache_dtype,
                "bf16|fp8: element type of the worker's job KV caches (the whole document with the full mount) "
                "and mounted shards (fp8: e4m3 at scale 1, half the memory and bytes per decode step, lossy; per "
                "worker, the pages stay --kv-page-dtype)");
  flags->Int("prefill-budget-tokens", &prefill_budget_tokens,
             "token budget of a sparse --prefill-policy (per layer and KV head, besides sinks and window)");
  flags->Int("max-decode-batch", &max_decode_batch,
             "decode steps of concurrent jobs run as one batched forward, at most this many (1: each alone)");
  flags->Int("decode-batch-wait-us", &decode_batch_wait_us,
             "a decode batch waits up to this long (microseconds) for the steps of the other decoding jobs, so "
             "concurrent jobs decode in full batches (0: batch what is pending; a job decoding alone never waits)");
}

void WorkerEngineFlags::ApplyTo(worker::WorkerOptions* options) const {
  options->page_size = static_cast<int>(page_size);
  options->prefill_chunk_size = prefill_chunk;
  options->max_jobs = static_cast<uint32_t>(max_jobs);
  options->lazy_mount = lazy_mount;
  options->lazy_cache_pages = lazy_cache_pages;
  // Out-of-int range values become -1 here, which WorkerOptions::Validate rejects.
  options->lazy_shared_documents = lazy_shared_documents >= 0 && lazy_shared_documents <= (int64_t{1} << 20)
                                       ? static_cast<int>(lazy_shared_documents)
                                       : -1;
  options->device_selection = device_selection;
  options->decode_graph = decode_graph;
  options->shard_placement = shard_placement;
  options->device_sampling = device_sampling;
  options->matmul_precision = matmul_precision;
  options->weight_format = weight_format;
  options->prefill_policy = prefill_policy;
  options->kv_page_dtype = kv_page_dtype;
  options->kv_cache_dtype = kv_cache_dtype;
  // Out-of-int range values become 0 here, which WorkerOptions::Validate rejects.
  options->max_decode_batch =
      max_decode_batch >= 1 && max_decode_batch <= (int64_t{1} << 20) ? static_cast<int>(max_decode_batch) : 0;
  options->decode_batch_wait_us = decode_batch_wait_us;
  // Out-of-int range values become 0 here, which WorkerOptions::Validate rejects.
  options->prefill_budget_tokens =
      prefill_budget_tokens >= 1 && prefill_budget_tokens <= (int64_t{1} << 30) ? static_cast<int>(prefill_budget_tokens) : 0;
}

sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

namespace {
void NoteRepeatedStopSignal(int) {
  static constexpr char kNote[] = "strata: already stopping (send SIGKILL to stop at once)\n";
  ssize_t ignored = write(STDERR_FILENO, kNote, sizeof(kNote) - 1);
  (void)ignored;
}
}  // namespace

int WaitForStopSignal(const sigset_t& set) {
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  struct sigaction action = {};
  action.sa_handler = NoteRepeatedStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  return sig;
}

}  // namespace strata::cli
