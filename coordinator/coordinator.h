// The coordinator's logic, independent of gRPC: the public document and job operations, the
// worker registry RPCs, and the scheduling loop that places documents on workers and dispatches
// jobs to leaders through a WorkerClient. The gRPC services (coordinator/service.h) are thin
// adapters over this class.
//
// State lives in the Catalog (RocksDB); unfinished jobs and documents not yet READY are also
// indexed in memory. On Start, jobs that were PREFILLING or DECODING (their workers' streams died
// with the previous process) go back to QUEUED, and PREFILLING documents back to PENDING.
//
// Documents: a PENDING document is placed in shards (placement.h) and its shards are prefilled
// on their holders: all at once with an anchor (ANCHOR mode), or shard i only once shard i-1 is
// durable (EXACT mode). Once every shard is durable the document is READY and each holder is asked
// to mount its shards (WorkerClient::MountShard). A job on a READY document is dispatched once
// every shard is mounted; its RunJobRequest carries the shard map with the holders' addresses.
// Mounts are tracked in memory only: after a restart, and whenever a worker registers again,
// READY documents are mounted again. When a worker is dropped (heartbeat timeout or deregister),
// the jobs it led go back to the queue and its shards of READY documents move to live workers
// (ShardMap.version + 1), which mount them from the KV store: nothing is prefilled again. For one
// heartbeat timeout after Start, shards of workers that have not registered yet are not moved
// (the workers of the previous process are registering again).
//
// Without live workers nothing is executed: documents stay PENDING and jobs stay QUEUED.
//
// Thread-safe: one mutex guards the in-memory state; WorkerClient calls are made after it is
// released. Observers are called with the mutex held: they must not block or call back into the
// Coordinator.
#ifndef STRATA_COORDINATOR_COORDINATOR_H_
#define STRATA_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/admission.h"
#include "coordinator/catalog.h"
#include "coordinator/job_state.h"
#include "coordinator/placement.h"
#include "coordinator/validation.h"
#include "coordinator/worker_client.h"
#include "coordinator/worker_registry.h"
#include "strata/v1/api.pb.h"
#include "strata/v1/internal.pb.h"

namespace strata::model {
class Tokenizer;
}

namespace strata::coordinator {

struct CoordinatorMetrics;

struct CoordinatorOptions {
  ValidationLimits limits;
  AdmissionLimits admission;
  PlacementOptions placement;
  WorkerRegistryOptions registry;
  // Namespaces document ids (the model served): the same tokens under another namespace are
  // another document. Default: "default".
  std::string model_namespace = "default";
  // Fingerprint of the model served. Non-empty: workers registering another model are refused
  // (FAILED_PRECONDITION). Empty: any model is accepted. Default: empty.
  std::string model_fingerprint;
  // Tokenizer for text uploads and prompts; not owned; must outlive the Coordinator.
  // nullptr: text is refused with FAILED_PRECONDITION (token ids still work).
  const model::Tokenizer* tokenizer = nullptr;
  // Seeds job ids and default sampler seeds; 0: from std::random_device.
  uint64_t random_seed = 0;
  // Prefill mode of documents uploaded without one: ANCHOR or EXACT. Default: ANCHOR.
  v1::DocumentInfo::PrefillMode default_prefill_mode = v1::DocumentInfo::ANCHOR;
  // ANCHOR mode: every shard after the first is sent the document's first
  // min(anchor_tokens, tokens of the first shard) tokens as its anchor. Star Attention uses an
  // anchor as long as a context block; the cap keeps the extra prefill of a shard small
  // (4096 tokens: 1/16 of a default 64K-token shard). Default: 4096; at least 1.
  int64_t anchor_tokens = 4096;
  // How often Tick deletes unpinned documents whose expire time has passed (and that no
  // unfinished job uses). Default: 60 s.
  int64_t collect_interval_nanos = 60'000'000'000;

  // Validates every sub-option; InvalidArgument naming the bad one.
  absl::Status Validate() const;
};

// Receives a job's events. Called with the coordinator's lock held: must not block or call the
// Coordinator. After Unwatch returns, no further calls are made.
class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // Events without sequence numbers (the stream numbers them). A snapshot with a terminal state
  // is the last event.
  virtual void OnJobEvent(const v1::JobEvent& event) = 0;
};

// Receives a document's state changes (same contract as JobObserver). `status` is OK with the
// new state, or NOT_FOUND once when the document is deleted (the last call).
class DocumentObserver {
 public:
  virtual ~DocumentObserver() = default;
  virtual void OnDocument(const absl::Status& status, const v1::DocumentInfo& info) = 0;
};

// Content of an upload or inline document: text or token ids.
struct DocumentContent {
  bool is_text = false;
  std::string text;
  std::vector<int32_t> tokens;
};

class Coordinator {
 public:
  // `catalog` must be non-null. `workers` may be null: there is no worker transport, so nothing
  // is placed or dispatched (documents stay PENDING, jobs QUEUED). `metrics` may be null. `now` gives monotonic
  // nanoseconds (the registry's clock); `wall_micros` gives wall-clock microseconds.
  Coordinator(const CoordinatorOptions& options, std::unique_ptr<Catalog> catalog,
              WorkerClient* workers, CoordinatorMetrics* metrics, NowFn now,
              std::function<int64_t()> wall_micros);
  ~Coordinator();

  // Loads unfinished jobs and documents from the catalog (see the header comment).
  absl::Status Start();

  // --- Documents ---
  // Stores a document (content-addressed). INVALID_ARGUMENT: empty, bad token ids, negative TTL;
  // RESOURCE_EXHAUSTED: more tokens than max_document_tokens; FAILED_PRECONDITION: text without
  // a tokenizer; UNAVAILABLE: draining.
  absl::StatusOr<v1::DocumentUploadResponse> UploadDocument(const v1::DocumentUploadOptions& options,
                                                            const DocumentContent& content);
  absl::StatusOr<v1::DocumentInfo> GetDocument(const std::string& document_id);
  absl::StatusOr<v1::DocumentListResponse> ListDocuments(const v1::DocumentListRequest& request);
  // FAILED_PRECONDITION while an unfinished job uses the document.
  absl::Status DeleteDocument(const std::string& document_id);
  absl::StatusOr<v1::DocumentInfo> PinDocument(const v1::DocumentPinRequest& request);
  // Registers `observer` and sends it the current state. NOT_FOUND / INVALID_ARGUMENT as Get.
  absl::Status WatchDocument(const std::string& document_id, DocumentObserver* observer);
  void UnwatchDocument(const std::string& document_id, DocumentObserver* observer);

  // --- Jobs ---
  // Validates and admits a job (QUEUED). Codes as documented on JobService.Submit.
  absl::StatusOr<v1::JobInfo> SubmitJob(const v1::JobSubmitRequest& request);
  absl::StatusOr<v1::JobInfo> GetJob(const std::string& job_id);
  absl::StatusOr<v1::JobListResponse> ListJobs(const v1::JobListRequest& request);
  // FAILED_PRECONDITION for a finished job. The leader worker (if any) is told to stop.
  absl::StatusOr<v1::JobInfo> CancelJob(const std::string& job_id);
  // Registers `observer` and sends it a snapshot at once.
  absl::Status WatchJob(const std::string& job_id, JobObserver* observer);
  void UnwatchJob(const std::string& job_id, JobObserver* observer);

  // --- Workers (internal WorkerRegistry service) ---
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(const v1::RegisterWorkerRequest& request);
  // Also reconciles the heartbeat's mounted_shards: a shard the worker was asked to mount (and
  // said it did, two heartbeat intervals ago or earlier) but no longer reports is mounted again.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::Status DeregisterWorker(const v1::DeregisterWorkerRequest& request);

  // One round of the scheduling loop: expires silent workers (their jobs are requeued, their
  // shards moved), places PENDING documents, has READY documents' shards mounted and dispatches
  // QUEUED jobs whose documents are READY and mounted. The server calls it periodically; tests
  // call it directly.
  void Tick();

  // Stops admitting work (uploads and submissions get UNAVAILABLE) and dispatching.
  void StartDrain();
  bool draining() const;
  // Jobs currently PREFILLING or DECODING.
  int64_t RunningJobs() const;
  // Hands every running job back: it returns to QUEUED in the catalog (the next coordinator
  // dispatches it again) and its leader is told to stop. Used when the drain times out.
  void HandBackRunningJobs();

  const ValidationLimits& limits() const { return options_.limits; }

 private:
  struct LiveJob {
    v1::JobRecord record;
    uint64_t dispatch_epoch = 0;  // increments on every dispatch; stale callbacks are ignored
  };
  struct LiveDocument {
    v1::DocumentRecord record;
    uint64_t dispatch_epoch = 0;
    std::vector<bool> shard_done;
    std::vector<v1::PrefillShardProgress> shard_progress;
    v1::ShardMap map;
  };
  using Action = std::function<void()>;
  // A MountShard the coordinator asked a holder for; key: (document id, shard index).
  struct ShardMount {
    enum State { kInFlight, kMounted, kFailed };
    std::string worker_id;
    v1::ShardRange range;
    State state = kInFlight;
    uint64_t call = 0;              // identifies the call: stale completions are ignored
    int64_t retry_after_nanos = 0;  // kFailed: not asked again before this
    // kMounted: when the mount completed, and whether the worker reports it in its heartbeats
    // (false when it answered UNIMPLEMENTED: it mounts only when it runs a job).
    int64_t mounted_nanos = 0;
    bool reported = true;
  };
  using MountKey = std::pair<std::string, int>;

  absl::StatusOr<std::vector<int32_t>> Tokenize(const DocumentContent& content, bool add_special,
                                                absl::string_view what) const;
  std::string DocumentIdFor(const std::vector<int32_t>& tokens) const;
  std::string NewJobId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Writes a job record and notifies watchers (snapshot). Updates metrics on state changes.
  absl::Status SaveJob(LiveJob& job, JobState old_state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SaveDocument(LiveDocument& doc) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyJob(const v1::JobEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyDocument(const v1::DocumentInfo& info) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies `t` to a live job; removes it from the live set when terminal.
  absl::Status TransitionJob(const std::string& job_id, JobTransition t, std::vector<Action>* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RequeueJobsOfWorker(const std::string& worker_id, std::vector<Action>* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetDocumentsOnWorker(const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DispatchDocuments(std::vector<Action>* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The document's effective prefill mode (records written before modes existed: the default).
  v1::DocumentInfo::PrefillMode PrefillModeOf(const v1::DocumentInfo& info) const;
  // Queues the prefill of shard `shard` of `doc` (its map is set) on its holder.
  void SendPrefill(const std::string& document_id, const LiveDocument& doc, int shard,
                   const std::vector<int32_t>& tokens, const v1::WorkerInfo& worker, std::vector<Action>* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The READY document's shard map with every holder registered (shards of dropped workers are
  // moved first, and the moved map stored) and the holders' current addresses filled in.
  // UNAVAILABLE while that cannot be done yet (just restarted; no room); NOT_FOUND without a map.
  absl::StatusOr<v1::ShardMap> ServingShardMap(const std::string& document_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // True when every shard of `map` is mounted by its holder; otherwise asks the holders that have
  // not mounted theirs to mount them (no call while one is in flight or a failed one is recent).
  bool EnsureMounted(const v1::ShardMap& map, std::vector<Action>* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves shards of dropped workers and mounts the shards of every READY document.
  void ReconcileShards(std::vector<Action>* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker restarted or is gone: what it had mounted is not mounted any more.
  void ForgetMountsOfWorker(const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks the holders to unmount the document's shards and forgets its mounts.
  void UnmountDocument(const std::string& document_id, std::vector<Action>* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DispatchJobs(std::vector<Action>* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailJobsOnDocument(const std::string& document_id, const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deletes expired unpinned documents (see collect_interval_nanos).
  void CollectExpiredDocuments(std::vector<Action>* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deletes a document from the catalog and memory, tells its watchers and has its shards
  // unmounted.
  absl::Status EraseDocument(const std::string& document_id, std::vector<Action>* actions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Worker callbacks.
  void OnPrefillProgress(const std::string& document_id, uint64_t epoch, int shard,
                         const v1::PrefillShardProgress& progress);
  void OnPrefillDone(const std::string& document_id, uint64_t epoch, int shard, const absl::Status& status);
  void OnJobEventFromWorker(const std::string& job_id, uint64_t epoch, const v1::JobEvent& event);
  void OnJobDone(const std::string& job_id, uint64_t epoch, const absl::Status& status);
  void OnMountDone(const std::string& document_id, int shard, uint64_t call, const absl::Status& status);

  const CoordinatorOptions options_;
  const std::unique_ptr<Catalog> catalog_;
  WorkerClient* const workers_;
  CoordinatorMetrics* const metrics_;
  const NowFn now_;
  const std::function<int64_t()> wall_micros_;
  const AdmissionPolicy admission_;
  WorkerRegistry registry_;

  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_collect_nanos_ ABSL_GUARDED_BY(mu_) = 0;
  // now_() at Start (the grace period for workers registering again begins there).
  int64_t start_nanos_ ABSL_GUARDED_BY(mu_) = 0;
  // ReconcileShards runs in the next Tick when set, else at next_reconcile_nanos_.
  bool reconcile_needed_ ABSL_GUARDED_BY(mu_) = true;
  int64_t next_reconcile_nanos_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_mount_call_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<MountKey, ShardMount> mounts_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, LiveJob> live_jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, LiveDocument> live_documents_ ABSL_GUARDED_BY(mu_);
  // Jobs led by each worker (for load and requeue on failure).
  std::map<std::string, std::set<std::string>> jobs_by_worker_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<JobObserver*>> job_watchers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<DocumentObserver*>> document_watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_COORDINATOR_H_
