// Pieces shared by the server commands (`strata coordinator`, `kvstore`, `worker`, `serve`):
// backend choice, port files, the stop signals. Not thread-safe beyond what each function says.
#ifndef STRATA_CLI_SERVER_RUNTIME_H_
#define STRATA_CLI_SERVER_RUNTIME_H_

#include <atomic>
#include <csignal>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cli/flags.h"
#include "kernels/backend.h"
#include "kvstore/backend_page_allocator.h"
#include "kvstore/host_cache.h"
#include "kvstore/metrics.h"
#include "kvstore/tiered_store.h"
#include "model/config.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "worker/worker.h"

namespace strata::cli {

// The engine flags of a worker, shared by `strata worker` and `strata serve` (its embedded
// worker): page size, prefill chunk, jobs, host tier, CPU threads, lazy mount, device selection.
struct WorkerEngineFlags {
  int64_t page_size = 64;
  int64_t prefill_chunk = 0;
  int64_t max_jobs = 4;
  int64_t host_cache_bytes = int64_t{1} << 30;
  int64_t threads = 0;
  bool lazy_mount = false;
  int64_t lazy_cache_pages = 0;
  int64_t lazy_shared_documents = 1;
  std::string device_selection = "auto";
  std::string decode_graph = "auto";
  std::string shard_placement = "auto";
  bool device_sampling = true;
  std::string matmul_precision = "split";
  std::string weight_format = "checkpoint";
  std::string prefill_policy = "dense";
  int64_t prefill_budget_tokens = 2048;
  std::string kv_page_dtype = "bf16";
  std::string kv_cache_dtype = "bf16";
  int64_t max_decode_batch = 16;
  int64_t decode_batch_wait_us = 1000;

  // Registers --page-size, --prefill-chunk, --max-jobs, --host-cache-bytes (the tier in front of
  // `durable_tier`, named in its help), --threads, --lazy-mount, --lazy-cache-pages,
  // --lazy-shared-documents and
  // --device-selection (auto|on|off: WorkerOptions::device_selection), --decode-graph (auto|on|off:
  // WorkerOptions::decode_graph), --shard-placement (auto|host|device:
  // WorkerOptions::shard_placement), --device-sampling (WorkerOptions::device_sampling) and
  // --matmul-precision
  // (split|bf16: WorkerOptions::matmul_precision), --weight-format (checkpoint|fp8:
  // WorkerOptions::weight_format), --prefill-policy (dense|quest|tokenselect:
  // WorkerOptions::prefill_policy), --prefill-budget-tokens, --kv-page-dtype (bf16|fp8:
  // WorkerOptions::kv_page_dtype), --kv-cache-dtype (bf16|fp8: WorkerOptions::kv_cache_dtype),
  // --max-decode-batch and --decode-batch-wait-us
  // (WorkerOptions::max_decode_batch, decode_batch_wait_us).
  void Register(FlagSet* flags, const std::string& durable_tier);
  // Sets the WorkerOptions fields these flags control (the others are left as they are);
  // WorkerOptions::Validate reports bad values.
  void ApplyTo(worker::WorkerOptions* options) const;
};

// The CUDA backend on device 0 when the plugin libstrata_cuda.so loads and a GPU is present, else
// the CPU backend (`threads` CPU threads; 0 = every usable core). Logs the choice.
std::unique_ptr<kernels::Backend> MakeWorkerBackend(int threads);

// For a worker on a GPU backend whose shard placement (WorkerOptions::shard_placement) is not
// "host": a second instance of the CUDA backend, for mounted shards and selection answers
// (worker::Worker::Create's shard_backend). Null on the CPU backend, for "host", or when the
// instance cannot be made (logged; with "auto" the shards then stay in host memory).
std::unique_ptr<kernels::Backend> MakeShardBackend(const kernels::Backend& worker_backend,
                                                   const std::string& placement);

// Writes `line` to `path` atomically (temp file + rename). Internal on failure.
absl::Status WriteLineFile(const std::string& path, const std::string& line);
// The --port-file of every server: "<grpc_port> <metrics_port>\n", written atomically.
absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port);

// Serves `registry` on `listen` as Prometheus /metrics. Empty `listen`: nothing is started,
// *exposer stays null and *port 0. Unavailable when the address cannot be bound.
absl::Status StartMetrics(const std::string& listen, std::shared_ptr<prometheus::Registry> registry,
                          std::unique_ptr<prometheus::Exposer>* exposer, int* port);

// Tier H of a worker: a host cache of `capacity_bytes` in front of the durable tier (`local` or
// `remote`; the other null). store() is what the worker reads and writes through: the tiered
// store, or `durable` itself when capacity_bytes is 0 (no host tier). With `backend` (not null;
// it must outlive the tier), the cached pages live in its AllocateHost memory -- pinned on CUDA
// -- carved in blocks of `page_bytes` (the encoded bytes of one of the worker's pages): the GPU
// page cache of a lazy-mount job then reads them in place, and a job whose document is whole in
// the tier runs the device-managed cache (worker/lazy_attention.h).
// The encoded bytes of one KV page of a worker serving `config` with pages of `page_size` tokens
// (`page_dtype`: bf16 or fp8, WorkerOptions::kv_page_dtype); 0 for sizes a page cannot have (HostTier then keeps the
// default allocator and the worker refuses the page size itself).
size_t WorkerPageBytes(const model::ModelConfig& config, int64_t page_size, const std::string& page_dtype);

class HostTier {
 public:
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(int64_t capacity_bytes,
                                                          kvstore::KvMetrics* metrics,
                                                          kvstore::PageStore* local,
                                                          kvstore::PageStore* remote,
                                                          kernels::Backend* backend = nullptr,
                                                          size_t page_bytes = 0);
  kvstore::PageStore* store() const { return store_; }
  // The tier's allocator of backend host memory; null without one (no backend or page size).
  const kvstore::BackendPageAllocator* allocator() const { return allocator_.get(); }
  // Stops and joins the pinning thread (below).
  ~HostTier();

 private:
  std::unique_ptr<kvstore::BackendPageAllocator> allocator_;  // outlives the cache
  std::unique_ptr<kvstore::HostCache> cache_;
  std::unique_ptr<kvstore::TieredStore> tiered_;
  kvstore::PageStore* store_ = nullptr;
  // On a device backend the tier's whole capacity is pinned by this thread from the start
  // (BackendPageAllocator::Reserve): pinning holds up the device work enqueued meanwhile, so
  // pinning page by page while a prefill writes through the tier slowed the prefill's forward by
  // ~80% on the H100 (bench/RESULTS.md). The worker serves meanwhile.
  std::atomic<bool> stop_pinning_{false};
  std::thread pinner_;
};

// Blocks SIGINT and SIGTERM in this thread and every thread started after it; returns the set to
// sigwait on.
sigset_t BlockStopSignals();

// Waits for the first stop signal of `set` (as blocked by BlockStopSignals) and returns it. From
// then on SIGINT and SIGTERM only print a note to stderr ("already stopping"): a second signal
// during a drain must not kill the process with half-finished work (send SIGKILL to stop at once).
int WaitForStopSignal(const sigset_t& set);

}  // namespace strata::cli

#endif  // STRATA_CLI_SERVER_RUNTIME_H_
