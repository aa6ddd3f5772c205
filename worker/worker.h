// The worker's engine side (DESIGN.md section 1, strata-worker), independent of gRPC: prefills
// document shards and persists their KV to a page store, and runs jobs as their leader (mount the
// document's pages from the store into a KvCache, run the prompt, decode, stream events).
//
// One Transformer serves every call. A forward (one prefill chunk or one decode step) holds the
// engine mutex, so concurrent jobs and prefills interleave chunk by chunk and step by step (no
// batching across jobs yet).
//
// Scope of this first version: a document is one shard on one worker (first_page == 0 and the
// shard covers the whole document); shards starting after page 0 are refused with UNIMPLEMENTED.
// The attention of every layer goes through the job's AttentionPolicy (engine/attention_policy.h),
// the one place where a later version fans a layer's query out to the holders of other shards
// (internal.proto ShardSelection) and merges their partial (o, lse).
//
// Pages are persisted in bf16 (kvstore/page_format.h): the KV cache used for prefill and decode
// stores bf16 too, so a job on a READY document attends exactly the KV a fresh prefill would.
// With each page a minmax summary (kind SUMMARY_KIND_MINMAX = 1: f32 min[d] then max[d] of the
// page's keys) is persisted; mounting recomputes summaries from the keys (the policy's OnAppend)
// instead of reading them.
//
// Thread-safe.
#ifndef STRATA_WORKER_WORKER_H_
#define STRATA_WORKER_WORKER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kvstore/page_store.h"
#include "model/model.h"
#include "strata/v1/internal.pb.h"

namespace prometheus {
class Counter;
class Histogram;
class Registry;
}  // namespace prometheus

namespace strata::worker {

struct WorkerOptions {
  // Stable id, [A-Za-z0-9._-]{1,128}. Required.
  std::string worker_id = "worker-0";
  // Address of its Worker service as the coordinator should dial it ("host:port").
  std::string address;
  // Tokens per KV page; must equal the coordinator's page size. Default 64.
  int page_size = 64;
  // Query tokens per prefill chunk (progress is reported per chunk). Default 512.
  int64_t prefill_chunk_size = 512;
  // Jobs led at the same time (reported to the coordinator). Default 4.
  uint32_t max_jobs = 4;
  // Document tokens it can hold (reported to the coordinator). Default 2^20.
  uint64_t capacity_tokens = uint64_t{1} << 20;
  // Pages read from the store per GetPages call when mounting. Default 256.
  int mount_batch_pages = 256;

  // InvalidArgument naming the bad field.
  absl::Status Validate() const;
};

// Worker-side metrics (docs/metrics.md), registered in `registry`. The strata_kv_* tier series
// are counted by the page-store tiers themselves (kvstore/metrics.h).
struct WorkerMetrics {
  explicit WorkerMetrics(prometheus::Registry* registry);
  prometheus::Counter* prefill_tokens;
  prometheus::Counter* decode_tokens;
  prometheus::Counter* candidate_tokens;
  prometheus::Counter* selected_tokens;
  prometheus::Counter* selection_cache_lookups;
  prometheus::Counter* selection_cache_hits;
  // strata_time_to_first_token_seconds / strata_inter_token_latency_seconds as the leader sees
  // them: from the start of RunJob (mount + prompt; no queueing) to the first token, and between
  // consecutive tokens. Buckets as docs/metrics.md.
  prometheus::Histogram* time_to_first_token;
  prometheus::Histogram* inter_token_latency;
};

class Worker {
 public:
  using ProgressFn = std::function<void(const v1::PrefillShardProgress&)>;
  // Returns false when the receiver is gone (the job stops, CANCELLED).
  using EventFn = std::function<bool(const v1::JobEvent&)>;

  // `model`, `backend`, `store`, `catalog` must outlive the Worker; `metrics` may be null.
  // The store's catalog holds the documents' metadata (LocalStore or RemoteStore). `store` is
  // usually a kvstore::TieredStore with a host cache in front of the durable tier; the tiers
  // count their own lookups and hits (kvstore/metrics.h).
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const WorkerOptions& options,
                                                        const model::Model* model,
                                                        kernels::Backend* backend,
                                                        kvstore::PageStore* store,
                                                        kvstore::DocumentCatalog* catalog,
                                                        WorkerMetrics* metrics);
  ~Worker();

  // What the worker registers with (internal.proto WorkerInfo).
  v1::WorkerInfo Info() const;
  // Sets the address reported in Info() (when the port is known only after the server started).
  void SetAddress(const std::string& address);
  v1::WorkerLoad Load() const;
  const WorkerOptions& options() const { return options_; }

  // Prefills the shard and persists every page and summary; returns OK once the document is
  // READY in the store (progress: tokens prefilled, pages persisted; the last call has
  // complete = true). A document already READY in the store is not prefilled again.
  // INVALID_ARGUMENT: bad ids, token ids outside the vocabulary, page size mismatch;
  // UNIMPLEMENTED: a shard that does not start at page 0 or does not cover the document;
  // CANCELLED when `cancelled` becomes true; store errors are passed through.
  absl::Status PrefillShard(const v1::PrefillShardRequest& request, const ProgressFn& on_progress,
                            const std::atomic<bool>* cancelled);

  // Runs a job as its leader: mounts the document (READY in the store; pages loaded, not
  // prefilled), runs the prompt, decodes and streams events: PrefillProgress, TokenDelta, and a
  // final JobInfo snapshot (DONE / CANCELLED / FAILED) with usage. Returns the status of the
  // call: OK after a terminal snapshot was sent (also for CANCELLED and FAILED jobs); an error
  // only when no terminal snapshot could be sent.
  absl::Status RunJob(const v1::RunJobRequest& request, const EventFn& on_event);

  // Stops a running job (it ends with a CANCELLED snapshot). False when unknown.
  bool CancelJob(const std::string& job_id);

 private:
  struct JobResult;
  Worker(const WorkerOptions& options, const model::Model* model, kernels::Backend* backend,
         kvstore::PageStore* store, kvstore::DocumentCatalog* catalog, WorkerMetrics* metrics);
  absl::Status RunJobInner(const v1::RunJobRequest& request, const EventFn& on_event,
                           const std::atomic<bool>& cancelled, JobResult* result);

  const WorkerOptions options_;
  const model::Model* const model_;
  kernels::Backend* const backend_;
  kvstore::PageStore* const store_;
  kvstore::DocumentCatalog* const catalog_;
  WorkerMetrics* const metrics_;
  std::unique_ptr<engine::Transformer> transformer_;

  // Held for each forward.
  absl::Mutex engine_mu_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> jobs_ ABSL_GUARDED_BY(mu_);
  int prefilling_ ABSL_GUARDED_BY(mu_) = 0;
  std::string address_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_WORKER_H_
