// Attention over document shards, for a document sharded over several workers (DESIGN.md
// sections 1 and 3; internal.proto ShardSelection):
//
// - MountedShard: the KV of one shard (every layer and KV head), loaded from the page store
//   into a KvCache (bf16, or fp8 with WorkerOptions::kv_cache_dtype) whose index i holds the
//   token at absolute position first_token() + i, on the backend that attends it: a CPU backend
//   (host memory) or, placed on the device, the worker's GPU backend instance for shards, whose
//   calls are serialised by backend_mu().
//   Immutable once built; shared (shared_ptr) by every session that attends to it.
// - ShardSession: one selection stream's (or one leader part's) attention over a MountedShard
//   with the job's policy and this shard's share of the token budget. Answers a layer's queries
//   with a partial (o, lse) over the shard's keys only:
//     dense:  every token of the shard;
//     sparse: the policy's sinks only when the shard holds tokens [0, S) (first_token == 0), no
//             window (the window, the prompt and the generated tokens belong to the leader), and
//             the middle chosen from the shard's summaries within the shard's budget, scored with
//             the mean query of the call. The shard's last token is always attended (the sparse
//             policy's window of the one mean query it is given).
//   Summaries are built per session from the mounted keys (the policy's OnAppend), as a
//   single-worker job builds them at mount. On a shard placed on the device (device_selection())
//   quest and tokenselect (minmax summaries) select and attend there through
//   engine::sparse::DevicePolicy::AttendFollowing (summaries, scoring and top-k on the backend;
//   the same selection as the host policy but for the device policy's documented differences; a
//   one-token query, a decode step, is one fused selection-and-attention kernel on CUDA and uses
//   the selection cache, as a job's decode step); dense attends every token there (a one-token
//   query through the shard's page table with SelectedAttention, on CUDA the paged decode
//   kernel). Each layer's one-token step there, with the query's copy in and the results' copies
//   out, is recorded as a CUDA graph at its first call and replayed after. The worker
//   gives any other policy a host-memory copy of the shard.
// - LeaderAttention: the leader's engine::ExternalAttention over every shard of a ShardMap.
//   Shards held by this worker are attended in process (ShardSession over a local mount); every
//   other shard through one selection stream to its holder (SelectionOpen, then one LayerQuery
//   per layer and step): over the holder's selection link (worker/selection_link.h) when the map
//   gives its address and it connects, else over the gRPC ShardSelection stream. Per layer it
//   sends the query to every peer first, attends the local shards, then reads the peers'
//   answers, so peers work in parallel. When a peer's stream fails (write or read fails:
//   UNAVAILABLE, EOF, cancelled, the holder's error, a malformed answer), the
//   leader mounts that shard locally from the persisted pages (MountFn; no prefill) and
//   recomputes the layer's partial itself; the shard stays local for the rest of the job. A
//   peer that does not answer within Options::peer_timeout_ms is failed over the same way (the
//   leader reads the answers on its own thread; a link's read waits until the deadline, and a
//   watchdog thread polling every 10 ms cancels a gRPC stream whose answer is overdue).
//
// Tensors on the wire are little-endian f32 (internal.proto). Thread-compatible, except that
// MountedShard is immutable and safe to share; sessions over one device-placed shard (or several
// shards on one backend instance) may run on different threads: each session queues its work on
// a stream of its own with the shard's backend_mu() held and waits for it without the lock, so
// that the sessions' GPU work overlaps.
#ifndef STRATA_WORKER_SHARD_ATTENTION_H_
#define STRATA_WORKER_SHARD_ATTENTION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/attention_policy.h"
#include "engine/kv_cache.h"
#include "engine/sparse/device_policy.h"
#include "engine/sparse/policy.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kvstore/document_id.h"
#include "kvstore/tiered_store.h"
#include "model/config.h"
#include "strata/v1/internal.pb.h"

namespace strata::worker {

// The engine policy options of a job's policy (an empty name is dense); page_size is the KV page
// size. InvalidArgument for unknown names or invalid options.
absl::StatusOr<engine::sparse::PolicyOptions> JobPolicyOptions(const v1::SelectionPolicy& policy, int page_size);
// The host policy of a job (an empty name is dense) for a model, built from JobPolicyOptions.
// InvalidArgument for unknown names or invalid options.
absl::StatusOr<std::unique_ptr<engine::AttentionPolicy>> MakeJobPolicy(const v1::SelectionPolicy& policy,
                                                                       const model::ModelConfig& config,
                                                                       int page_size);
// True for the dense policy (empty name or "dense").
bool IsDensePolicy(const v1::SelectionPolicy& policy);

// "<document hex>:<first_page>:<end_page>": the key of a shard range.
std::string ShardKey(const v1::ShardRange& range);

// Scratch buffers of PagedAttention calls over a cache in backend memory: q, out and lse on the
// backend and their host staging (AllocateHost: pinned on CUDA, so the copies do not wait and one
// stream wait serves the call).
struct AttendScratch {
  std::unique_ptr<kernels::Buffer> q, out, lse;
  std::unique_ptr<kernels::Buffer> q_host, out_host, lse_host;
  size_t capacity_tokens = 0;
  std::vector<int32_t> positions;
};

// Backend addresses of a call's queries (copied in), output and lse: the host arrays themselves
// on the CPU backend, else AttendScratch's buffers.
struct CallViews {
  void* q = nullptr;
  void* out = nullptr;
  void* lse = nullptr;
  bool host = true;
};

// PagedAttention of host queries q [n, hq, d] at absolute positions [q_begin, q_begin + n) over
// `selection` (spans with absolute positions) of `layer` of `cache`, causal; the partial goes to
// `out` (host). Errors of the backend are passed through.
absl::Status AttendSelection(kernels::Backend* backend, const engine::KvCache& cache, int layer,
                             const engine::Selection& selection, const float* q, int n, int num_q_heads,
                             int64_t q_begin, AttendScratch* scratch, engine::AttentionPartial* out);

class MountedShard {
 public:
  // `cache` holds the shard's tokens, index i = position first_token + i, in every layer; it
  // lives on `backend`. `backend_mu`, when set, must be held around every call on `backend`
  // (a GPU backend instance shared by the worker's shard sessions); null for a backend safe to
  // call from several threads at once (CPU). device_selection: sparse sessions select on
  // `backend` (DevicePolicy) instead of with a host policy.
  MountedShard(const v1::ShardRange& range, const kvstore::DocumentId& document, int64_t first_token,
               std::unique_ptr<engine::KvCache> cache, const kvstore::TierCounts& loaded,
               kernels::Backend* backend, absl::Mutex* backend_mu = nullptr, bool device_selection = false)
      : range_(range), document_(document), first_token_(first_token), cache_(std::move(cache)), loaded_(loaded),
        backend_(backend), backend_mu_(backend_mu), device_selection_(device_selection) {}

  const v1::ShardRange& range() const { return range_; }
  const kvstore::DocumentId& document() const { return document_; }
  int64_t first_token() const { return first_token_; }
  int64_t num_tokens() const { return cache_->length(0); }
  const engine::KvCache& cache() const { return *cache_; }
  // Pages read from each tier when this mount was loaded.
  const kvstore::TierCounts& loaded() const { return loaded_; }
  kernels::Backend* backend() const { return backend_; }
  absl::Mutex* backend_mu() const { return backend_mu_; }
  bool device_selection() const { return device_selection_; }

 private:
  const v1::ShardRange range_;
  const kvstore::DocumentId document_;
  const int64_t first_token_;
  const std::unique_ptr<engine::KvCache> cache_;
  const kvstore::TierCounts loaded_;
  kernels::Backend* const backend_;
  absl::Mutex* const backend_mu_;
  const bool device_selection_;
};

// Whether a session with `policy` can select on a device-placed shard (MountedShard::
// device_selection): dense, or quest / tokenselect with minmax summaries (the policies
// engine::sparse::DevicePolicy runs). False for an invalid policy.
bool DeviceShardPolicy(const v1::SelectionPolicy& policy, int page_size);

// Where a ShardSession's answers to LayerQuery messages went (Answer), and with the stream's
// part (send) what a shard holder spent per answer: queue, the host's part (the query checked
// and copied, the selection and attention queued on the backend; on a backend that runs ops as
// they are called, all the work); wait, then waiting for the backend's results; send, writing
// the answers to the selection stream (filled by the stream's owner).
struct ShardAnswerTiming {
  int64_t answers = 0;
  double queue_seconds = 0, wait_seconds = 0, send_seconds = 0;
};

class ShardSession {
 public:
  // `budget_tokens` is this shard's share of the job's budget (0: the policy's budget_tokens, or
  // the policy default); tokenselect in parts asked for (SelectionPolicy.partitions) keeps
  // ceil(share / parts) tokens per part, as the policy does for any budget; by default the parts
  // are chosen for the share (PolicyOptions::EffectivePartitions). Attends on the shard's backend. InvalidArgument for a bad policy, or for
  // a policy a device-selection shard cannot run (DeviceShardPolicy).
  static absl::StatusOr<std::unique_ptr<ShardSession>> Create(std::shared_ptr<const MountedShard> shard,
                                                              const v1::SelectionPolicy& policy,
                                                              uint32_t budget_tokens,
                                                              const model::ModelConfig& config);

  // Partial attention of the queries of `layer` (host f32 [n, num_q_heads, head_dim] after RoPE,
  // positions [q_begin, q_begin + n)) over this shard; adds what selection did to *counters.
  // InvalidArgument for a bad layer, shape or n < 1. Attend is Start, then Finish.
  absl::Status Attend(int layer, const float* q, int n, int num_q_heads, int64_t q_begin,
                      engine::AttentionPartial* out, engine::SelectionCounters* counters);
  // Start queues the work on the session's stream and returns (on a backend that runs ops as
  // they are called, it does it all); Finish waits for it and completes *out and *counters, which
  // must stay valid in between. A Start while one is pending finishes that one first.
  absl::Status Start(int layer, const float* q, int n, int num_q_heads, int64_t q_begin,
                     engine::AttentionPartial* out, engine::SelectionCounters* counters);
  absl::Status Finish();

  // The same for one LayerQuery of a selection stream (validates the byte sizes against the
  // model): fills step, layer, o, lse, selected_tokens, candidate_tokens. The first answer of a
  // session also reports in pages_fetched the pages read from the tiers when the session's mount
  // was loaded for it (see set_report_pages).
  absl::Status Answer(const v1::LayerQuery& query, v1::SelectionResponse* response);
  // Called by Answer with what each answer's selection did (e.g. to count selection-cache
  // lookups where they happen; the leader counts candidate and selected tokens from the answer).
  void set_on_answer(std::function<void(const engine::SelectionCounters&)> fn) { on_answer_ = std::move(fn); }
  // What Answer spent so far (send_seconds stays 0 here).
  const ShardAnswerTiming& answer_timing() const { return answer_timing_; }
  void set_report_pages(const kvstore::TierCounts& pages) {
    report_pages_ = pages;
    has_report_pages_ = true;
  }

  const MountedShard& shard() const { return *shard_; }

  ~ShardSession();
  ShardSession(const ShardSession&) = delete;
  ShardSession& operator=(const ShardSession&) = delete;

 private:
  ShardSession(std::shared_ptr<const MountedShard> shard, const model::ModelConfig& config)
      : shard_(std::move(shard)), config_(config), backend_(shard_->backend()) {}
  // Attend's work queued on stream_ (with the shard backend's lock held): the selection (on the
  // host, or the device's whole step) and the attention, and the results' copies into the
  // staging (*v: where they are; *before: the device policy's counters before it).
  absl::Status Queue(int layer, const float* q, int n, int num_q_heads, int64_t q_begin,
                     engine::AttentionPartial* out, engine::SelectionCounters* counters, CallViews* v,
                     engine::SelectionCounters* before);
  // A one-token query on a device-selection shard as the replay of the layer's recorded step
  // (recorded on its first call): the query's copy in, DevicePolicy::Attend and the results'
  // copies out, from step_scratch_ (pending_.scratch then points there), as one graph launch
  // instead of their separate calls. False when the backend records no graphs (then graphs_on_
  // is cleared and Queue takes the calls).
  absl::StatusOr<bool> QueueStepGraph(int layer, const float* q, int num_q_heads, engine::AttentionPartial* out,
                                      CallViews* v);
  // A one-token step's attention on stream_ for the query staged at v.q: the device policy's
  // (DevicePolicy::AttendFollowing), or dense over every token of the shard (dense_table_).
  absl::Status QueueStep(int layer, const CallViews& v, int num_q_heads);

  std::shared_ptr<const MountedShard> shard_;
  const model::ModelConfig config_;
  kernels::Backend* const backend_;
  std::unique_ptr<engine::AttentionPolicy> policy_;  // host selection; null: dense or device_
  std::unique_ptr<engine::sparse::DevicePolicy> device_;  // device selection
  // Dense sessions on a device-selection shard: the shard cache's page table (KvCache::PageTable,
  // every layer's) on its backend, for one-token steps.
  std::unique_ptr<kernels::Buffer> dense_table_;
  kernels::Stream stream_ = nullptr;  // the session's own stream on the shard's backend
  // A started call (Start), until Finish.
  struct Pending {
    bool active = false;
    CallViews v;
    engine::SelectionCounters before;
    engine::AttentionPartial* out = nullptr;
    engine::SelectionCounters* counters = nullptr;
    const AttendScratch* scratch = nullptr;  // the staging the results land in
  } pending_;
  engine::Selection selection_;
  AttendScratch scratch_;
  // One-token steps replayed from graphs (QueueStepGraph): per layer the recorded step, and the
  // one-token staging they read and write (never reallocated: the graphs hold its addresses).
  // STRATA_SHARD_STEP_GRAPHS=0 turns them off (A/B).
  bool graphs_on_ = true;
  std::vector<std::unique_ptr<kernels::Graph>> step_graphs_;
  AttendScratch step_scratch_;
  std::vector<float> qmean_;
  std::vector<float> q_copy_;  // Answer's queries when the message's bytes are not float-aligned
  engine::AttentionPartial partial_;
  kvstore::TierCounts report_pages_;
  bool has_report_pages_ = false;
  std::function<void(const engine::SelectionCounters&)> on_answer_;
  ShardAnswerTiming answer_timing_;
};

class LeaderAttention : public engine::ExternalAttention {
 public:
  // Mounts a shard on this worker from the store (or returns the existing mount) and adds the
  // pages it read to *pages.
  using MountFn = std::function<absl::StatusOr<std::shared_ptr<const MountedShard>>(const v1::ShardRange&,
                                                                                   kvstore::TierCounts* pages)>;
  struct Options {
    std::string job_id;
    std::string self_worker_id;
    v1::SelectionPolicy policy;
    const model::ModelConfig* config = nullptr;
    // Mounts the shards attended here; each session attends on its shard's backend.
    MountFn mount;
    // A peer that does not answer a query within this time is failed over (its stream is
    // cancelled). Default 60 s.
    int64_t peer_timeout_ms = 60000;
  };

  // Opens the parts of every shard of `map` (local mounts for shards of self_worker_id or with
  // an empty worker id, streams for the others; calls fail fast, so a peer that cannot be
  // reached fails over at its first query). Errors of local mounts are passed through.
  static absl::StatusOr<std::unique_ptr<LeaderAttention>> Create(const Options& options, const v1::ShardMap& map);
  ~LeaderAttention() override;  // closes the streams

  absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      std::vector<engine::AttentionPartial>* parts) override;
  // Sends the layer's queries to the peers and starts the local shards' sessions now (Attend then
  // waits for both), so that the jobs of a batched forward wait at the same time and the local
  // shards' GPU work runs beside the leader's own attention.
  absl::Status Prepare(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin) override;

  // Selection counters summed over every shard (local and peers' answers).
  const engine::SelectionCounters& counters() const { return counters_; }
  // Pages read from each tier for this job: local mounts made for it and the peers' reports.
  const kvstore::TierCounts& pages() const { return pages_; }
  // Peers whose stream failed and whose shard was mounted here instead.
  int failovers() const { return failovers_; }
  // Wall time of the Attend calls: in all, in the local shards' sessions, and waiting for the
  // peers' answers after them (what the peers' round trips add to a layer).
  struct Timing {
    int64_t calls = 0;
    double attend_seconds = 0, local_seconds = 0, wait_seconds = 0;
  };
  const Timing& timing() const { return timing_; }

  struct Part;

 private:
  explicit LeaderAttention(const Options& options);
  absl::Status Failover(Part* part, const std::string& why);
  // Starts the thread that cancels a peer's stream whose answer is overdue (Part::NextAnswer).
  void StartWatchdog();
  // The queries of a layer to every peer (step 1 of Attend; advances step_ at layer 0).
  absl::Status SendQueries(int layer, const float* q, int n, int num_q_heads, int64_t q_begin);

  const Options options_;
  std::vector<std::unique_ptr<Part>> parts_;
  uint64_t step_ = 0;
  bool first_call_ = true;
  int prepared_layer_ = -1;  // the layer whose queries Prepare sent, until its Attend
  engine::SelectionCounters counters_;
  kvstore::TierCounts pages_;
  int failovers_ = 0;
  Timing timing_;
  std::string request_bytes_;  // a layer's query serialized for the selection links
  std::thread watchdog_;
  absl::Mutex watch_mu_;
  bool stopping_ ABSL_GUARDED_BY(watch_mu_) = false;
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_SHARD_ATTENTION_H_
