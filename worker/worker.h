// The worker's engine side (DESIGN.md section 1, strata-worker), independent of gRPC: prefills
// document shards and persists their KV to a page store, mounts shards and answers selection
// requests over them, and runs jobs as their leader (attention over every shard of the document,
// the prompt, decode, streamed events).
//
// One Transformer serves every call. A forward (one prefill chunk or one decode step) holds the
// engine mutex, so concurrent jobs and prefills interleave chunk by chunk; decode steps of
// concurrent jobs that wait at the same time run as one batched forward (DecodeStep,
// WorkerOptions::max_decode_batch). Selection answers (ShardSession) do not take the
// engine mutex: they use their own scratch buffers, so a leader blocked in a forward waiting for
// a peer never deadlocks with that peer's own forward.
//
// Shards (internal.proto ShardRange): tokens [first_page * P, min(end_page * P, num_tokens)) of
// a document of num_tokens = shard_map.num_tokens tokens (when shard_map.num_tokens is 0 the
// shard must start at page 0 and is the whole document).
//
// PrefillShard, by mode (for the shard starting at page 0 both modes are the same: the shard's
// tokens at positions [0, n)):
//   EXACT:  the shards before this one must already be durable in the store (the coordinator runs
//           exact shards in order; FAILED_PRECONDITION naming the missing page otherwise). Their
//           pages (every layer and KV head) are loaded into the KV cache, then the shard's tokens
//           run at their absolute positions with full attention to everything before them.
//   ANCHOR (and UNSPECIFIED): anchor_token_ids (the document's first a tokens, a <= the shard's
//           first token) are prefilled at positions [0, a) into a separate cache, then the shard's
//           tokens at their absolute positions attend to the anchor and to themselves (Star
//           Attention phase 1). The anchor's KV is discarded. An empty anchor: the shard attends
//           only to itself.
// The shard's tokens attend densely (exact), or with WorkerOptions::prefill_policy quest or
// tokenselect through a chunk-wise sparse selection over the cache (in EXACT mode the loaded
// earlier shards and the shard's own earlier chunks; in ANCHOR mode the shard's own earlier
// chunks, the anchor still attended entirely); the KV is then approximate.
// Only the shard's own pages (and their minmax summaries) are persisted. Every call first
// creates the document in the catalog (CreateDocument with the whole document's num_tokens and
// one summary per page: idempotent across the shards' workers). READY: after its shard is
// durable, each worker calls FinalizeDocument; the store makes the document READY only when
// every page and summary of every shard is stored (FAILED_PRECONDITION otherwise, which
// PrefillShard treats as "other shards still missing" and still returns OK with complete =
// true). The worker whose shard is durable last therefore makes the document READY; finalizing
// is idempotent. A document already READY is not prefilled again.
//
// Mounts: MountShard loads the shard's pages from the store (through the tiers: the host cache
// serves pages read or written recently) into a KvCache of kv_cache_dtype (MountedShard in
// worker/shard_attention.h), placed per WorkerOptions::shard_placement: on a GPU worker given a
// shard backend (a second instance of its backend), in that backend's memory, where selection
// answers and the leader's own shards select (dense, quest, tokenselect) and attend; else in host
// memory on a CPU backend (the worker's own when it is the CPU backend, else a CPU backend of its
// own). Either way answers run concurrently with forwards and must not share the forwards' GPU
// backend instance (the CUDA backend is not thread-safe; taking the engine mutex instead would
// deadlock two leaders waiting on each other): calls on the shard backend are serialised by a
// mutex of their own. No summaries are held at mount: a selection stream with a sparse
// policy builds them from the mounted keys when it opens (summary_bytes is 0). Mounted shards are
// reported in Load().mounted_tokens and in the heartbeat's mounted_shards. A selection stream or
// a leader that needs a shard that is not mounted mounts it on demand (not counted against
// capacity_tokens; MountShard itself refuses mounts beyond capacity_tokens with
// RESOURCE_EXHAUSTED). A MountShard with whole_document (the coordinator sets it when every shard
// of the document is on this worker) loads nothing: the jobs on such a document read it
// themselves (below), so a loaded copy would only cost host memory and mount time (at 512K on an
// 8B model, 64 GB of bf16 keys and values). The shard is held: checked and counted as a mount
// (Load, heartbeats, capacity_tokens), and with the lazy mount the document's lazy state is
// prepared then, as a first default-policy (quest) job would make it, into the share kept for
// its jobs (LazyDocumentShare: summaries on the backend and, when the host tier holds every
// page, the device-managed page cache), so that the first question starts warm; a failure there
// is logged and the first job makes it. UnmountShard of the document's last held shard drops
// its idle share.
//
// RunJob, as leader:
//   - a map whose shards all belong to this worker (worker_id equal to this worker's or empty),
//     e.g. a one-shard document: the whole document is loaded into the job's KV cache and every
//     layer attends through the job's AttentionPolicy (as a single process does), or, with
//     device selection (WorkerOptions::device_selection), decode steps select and attend with
//     backend ops and prompt chunks attend densely. On a device backend (not "cpu") the host
//     policies cannot read the cache: policies other than dense and streaming need device
//     selection there (quest/tokenselect that cannot select on the device attend densely,
//     logged once; radar, hip, subgen and non-minmax summaries fail the job with
//     FAILED_PRECONDITION).
//     Decode steps of concurrent jobs batch as usual (ForwardBatch honours each item's device
//     policy).
//   - a map with shards on other workers: the job's KV cache holds only the prompt and generated
//     tokens (positions from num_tokens on), attended densely; every document shard is attended
//     through LeaderAttention (worker/shard_attention.h): shards of this worker in process, the
//     others through one selection stream per peer (its selection link from
//     selection_link_address, else the ShardSelection gRPC stream at worker_address), with
//     the job's policy and each shard's share of the budget (proportional to its tokens); the
//     partials are merged with Backend::MergeAttention. With the dense policy the merge is exact
//     up to float rounding. A peer whose stream fails is replaced by a local mount of its shard
//     from the persisted pages (no prefill); the job continues with the same result. So is a
//     peer that does not answer within WorkerOptions::peer_timeout_ms.
//     The shards must cover [0, ceil(num_tokens / P)) in order (INVALID_ARGUMENT otherwise).
//
// KV dtype: pages are persisted in bf16 (kvstore/page_format.h) and every KV cache here is bf16,
// so a job on a READY document attends exactly the KV a fresh prefill would. `strata generate`
// defaults to an f32 KV cache (engine::GenerateOptions::kv_dtype): compare worker output with a
// bf16 reference (GenerateOptions::kv_dtype = kBF16), as worker_test.cc does.
// With each page a minmax summary (kind SUMMARY_KIND_MINMAX = 1: f32 min[d] then max[d] of the
// page's keys) is persisted.
//
// Thread-safe.
#ifndef STRATA_WORKER_WORKER_H_
#define STRATA_WORKER_WORKER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kvstore/metrics.h"
#include "kvstore/page_store.h"
#include "model/model.h"
#include "strata/v1/internal.pb.h"
#include "worker/lazy_attention.h"
#include "worker/shard_attention.h"

namespace prometheus {
class Counter;
class Histogram;
class Registry;
}  // namespace prometheus

namespace strata::worker {

// The element types of WorkerOptions::kv_page_dtype and kv_cache_dtype by their spelling: "bf16"
// (kBF16) or "fp8" (kFP8E4M3). InvalidArgument for any other name.
absl::StatusOr<kernels::DType> ParseKvDType(absl::string_view name);

struct WorkerOptions {
  // Stable id, [A-Za-z0-9._-]{1,128}. Required.
  std::string worker_id = "worker-0";
  // Address of its Worker service as the coordinator should dial it ("host:port").
  std::string address;
  // Tokens per KV page; must equal the coordinator's page size. Default 64.
  int page_size = 64;
  // Query tokens per prefill chunk (progress is reported per chunk). 0 (the default): 512 on the
  // CPU backend, 4096 on another backend (on the H100, 8B shape, a 64K document's forward took
  // 7.5 s in 4096-token chunks against 10.1 s in 512-token ones; bench/RESULTS.md).
  int64_t prefill_chunk_size = 0;
  // Jobs led at the same time (reported to the coordinator). Default 4.
  uint32_t max_jobs = 4;
  // Document tokens it can hold (reported to the coordinator). Default 2^20.
  uint64_t capacity_tokens = uint64_t{1} << 20;
  // Pages read from the store per GetPages call when mounting. Default 256.
  int mount_batch_pages = 256;
  // Decode steps of concurrent jobs run as one batched forward, at most this many (and at most
  // prefill_chunk_size) at a time; 1 runs every step alone. Default 16.
  int max_decode_batch = 16;
  // A batch's leader waits up to this long for the steps of the other jobs in their decode loop
  // (they are between two steps on the host: streaming the last token, drawing on the host) so
  // that concurrent jobs decode in full batches instead of ones and twos; a job decoding alone
  // never waits. 0: batch what is pending. Default 1000 us.
  int64_t decode_batch_wait_us = 1000;
  // As leader: a peer that does not answer a selection query within this time is failed over
  // (its shard mounted here from the store). Default 60 s.
  int64_t peer_timeout_ms = 60000;
  // Lazy mount (opt-in; worker/lazy_attention.h): a job whose shards all belong to this worker
  // and whose policy is quest or tokenselect with minmax summaries (the default summary) loads
  // only the document's persisted minmax summaries; per layer and step the chosen pages are
  // fetched through the tiers (host tier first; pages read from the durable tier are inserted
  // into it) into the job's GPU page cache (kvstore/gpu_cache.h) on the worker's backend, of
  // lazy_cache_pages slots (0, the default: four decode steps' pages for the job's model and
  // budget; clock eviction; raised to one layer call's need when smaller, and capped at the
  // document's pages). On a backend other than the CPU backend the decode steps
  // choose pages with the backend's selection ops over summaries held in its memory.
  // Selection is MakeMinMaxChooser's (page 0, ceil(window_tokens / P) last pages and the
  // ceil(budget_tokens / P) pages of highest head soft vote), not the engine policy's. Dense and
  // other policies keep loading every page. The selection runs on the backend on a device
  // backend (and on the CPU backend with device_selection "on"); there, when the host tier
  // (a TieredStore's HostCache in a BackendPageAllocator of this backend: pinned on CUDA) holds
  // every page of the document, the job's page cache is device-managed: no per-layer host round
  // trip (worker/lazy_attention.h, resident mode). Default false.
  bool lazy_mount = false;
  int64_t lazy_cache_pages = 0;
  // Documents whose lazy-job state (worker/lazy_attention.h LazyDocumentShare: summaries in
  // backend memory and one host copy for the choosers, the resident mode's device-managed cache)
  // the worker keeps while no job uses
  // them, most recently used first, so that the next question on the document starts warm
  // (>= 0; 0: every job builds its own). Jobs running on a document share its state either way
  // when this is > 0. Default 1.
  int lazy_shared_documents = 1;
  // Device selection (engine/sparse/device_policy.h): a job whose KV cache holds the whole
  // document (one-worker map, not lazy) or that has no document, whose policy is quest or
  // tokenselect with minmax summaries and whose context can outgrow sinks + window + budget,
  // selects and attends each decode step with backend ops (minmax summaries kept in backend
  // memory, built as the document's pages load and updated on every append; nothing read on the
  // host); its prompt chunks attend densely. "auto": on when the backend is not the CPU backend
  // (on the CPU the host policy is the reference); "on": also on the CPU backend (whose selection
  // ops are the reference twins); "off": never. The backend is probed once at Create (one quest
  // and one tokenselect step of the model's shape); when the probe or DevicePolicy::Create fails
  // the job falls back (logged once): to the host policy on the CPU backend, to dense attention
  // on a device backend (whose pools the host policies cannot read). Default "auto".
  std::string device_selection = "auto";
  // Decode steps as replayed CUDA graphs (engine::TransformerOptions::decode_graph): "auto"
  // (default): on when the backend is not the CPU backend; "on"; "off". A step runs as a graph
  // when its attention can be captured: the dense policy over the job's own tokens plus, for a
  // lazy-mount job in resident mode, the device-managed page cache of its document; a batch of
  // concurrent jobs' steps runs as one graph when every step in it can. Other steps (device
  // selection over a full mount, host-managed page caches) take the normal path. A job's cache,
  // or a set of jobs decoding together, is captured once, at its first decode step; logits follow
  // the normal path to float rounding.
  std::string decode_graph = "auto";
  // Where mounted shards live and are attended (selection answers to other leaders, and the
  // shards a leader attends itself): "auto" (default): on the device when Worker::Create was
  // given a shard backend (a second instance of the worker's GPU backend, so that answers run
  // beside the worker's own forwards), else in host memory on a CPU backend; "host": always in
  // host memory; "device": on the shard backend, or, on a CPU worker, on its own backend with the
  // device selection path (worker/shard_attention.h; for tests); InvalidArgument on a GPU worker
  // given no shard backend. On the device, dense, quest and tokenselect (minmax) sessions select
  // and attend there; a session with another policy reads a host-memory copy of the shard, kept
  // for later such sessions and counted as a mount.
  std::string shard_placement = "auto";
  // Decode steps draw their token on the backend (Backend::Sample over the step's logits in
  // backend memory, with the job's temperature, top-k, top-p and the next uniform of its seeded
  // stream, as engine::Sampler would draw it; the token comes back instead of the vocabulary's
  // logits): every decode step's rows go to Transformer::ForwardBatch with BatchItem::sample (a
  // step alone is a batch of one). Greedy tokens are engine::Sampler's exactly; random
  // draws on the CUDA backend can differ from the host's only where the uniform falls within
  // double rounding of a cumulative probability (kernels/backend.h SampleParams). false: every
  // token from the host logits through engine::Sampler.
  bool device_sampling = true;
  // Precision of the model's matrix products (engine::TransformerOptions::matmul_precision):
  // "split" (default: f32 activations, two GEMMs on the CUDA backend) or "bf16" (activations
  // rounded to the weight type, one GEMM; faster prefill, logits move by the rounding).
  std::string matmul_precision = "split";
  // Form of the projection matrices (engine::TransformerOptions::weight_format): "checkpoint"
  // (default: as loaded) or "fp8" (e4m3 rows with per-row scales, quantised at load: half the
  // weight bytes per decode step; logits move by the weights' rounding). The KV a worker persists
  // depends on it: like kv_page_dtype, keep it the same across the workers of a cluster.
  std::string weight_format = "checkpoint";
  // Attention of document prefill (PrefillShard, the shard's own tokens): "dense" (default:
  // exact), "quest" or "tokenselect" (DESIGN.md section 3: each chunk selects, per layer and KV
  // head, at most prefill_budget_tokens middle tokens of the earlier context with the chunk's mean
  // query; sinks and window as the PolicyOptions defaults, no selection cache). On the CPU backend
  // the host policy's chunk path (engine::sparse::MakeAttentionPolicy); on another backend a
  // DevicePolicy with ForwardOptions::device_prefill, when the device-selection probe at Create
  // passed (run for this even with device_selection "off"); otherwise, or when the policy cannot
  // be made, the prefill is dense (logged once). A sparse-prefilled document's KV is approximate;
  // the store does not record how it was prefilled, and every later job reads the same bytes.
  std::string prefill_policy = "dense";
  // Token budget B of a sparse prefill_policy (>= 1). Default: 2048 (PolicyOptions default).
  int prefill_budget_tokens = 2048;
  // Element type of the KV pages this worker persists (the document's KvLayout; a job's document
  // must have this worker's layout, as for page_size): "bf16" (default, exact for the bf16 KV the
  // engine computes) or "fp8" (e4m3 with per-page K and V scales, kvstore/page_format.h: half the
  // bytes in every tier and over PCIe, lossy). fp8 pages are decoded to bf16 where a job loads them
  // into its KvCache (full mount) or into a host-managed page cache (lazy mount); a resident lazy
  // job's device-managed cache keeps them as fp8 with per-slot scales. Their minmax summaries bound
  // the stored (dequantised) keys.
  std::string kv_page_dtype = "bf16";
  // Element type of the KV caches of this worker's jobs (with the full mount the whole document,
  // else the prompt and generated tokens) and of the shards it mounts for other workers' sharded
  // jobs: "bf16" (default) or "fp8" (e4m3 at per-tensor scale 1, KvCacheOptions: half the memory,
  // half the bytes each decode step reads, lossy: answers can differ from bf16 ones). Pages load
  // into it decoded and rounded to e4m3; the job's own tokens are appended as e4m3 too. Every
  // attention and selection path reads fp8 caches (engine/kv_cache.h). A worker's own choice: the
  // persisted pages stay kv_page_dtype, prefill caches stay bf16, and lazy-mount jobs read the
  // document's pages as their page cache holds them.
  std::string kv_cache_dtype = "bf16";

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
  // strata_decode_graph_steps_total: decode steps replayed as a CUDA graph (WorkerOptions::decode_graph).
  prometheus::Counter* decode_graph_steps;
  // strata_lazy_jobs_total{cache="host_managed"|"resident"}: lazy-mount jobs by their page cache.
  prometheus::Counter* lazy_jobs_host_managed;
  prometheus::Counter* lazy_jobs_resident;
  // strata_time_to_first_token_seconds / strata_inter_token_latency_seconds as the leader sees
  // them: from the start of RunJob (mount + prompt; no queueing) to the first token, and between
  // consecutive tokens. Buckets as docs/metrics.md.
  prometheus::Histogram* time_to_first_token;
  prometheus::Histogram* inter_token_latency;
  // strata_page_load_seconds{use="mount"|"prefill"|"job"}: loading a document's stored pages into
  // a KV cache (Worker::LoadPages): a shard's mount, the earlier shards an exact prefill attends,
  // a full-mount job's document.
  prometheus::Histogram* page_load_mount;
  prometheus::Histogram* page_load_prefill;
  prometheus::Histogram* page_load_job;
  // strata_shard_attention_layers_total and strata_shard_attention_seconds_total{part="local"|
  // "peers"}: a sharded job's leader, per layer call of its attention over the document's shards
  // (LeaderAttention::Timing): the calls, the seconds in its own shards' sessions, and the seconds
  // then spent waiting for the peers' answers. Added when the job ends.
  prometheus::Counter* shard_attention_layers;
  prometheus::Counter* shard_attention_local_seconds;
  prometheus::Counter* shard_attention_peer_seconds;
  // strata_shard_answers_total and strata_shard_answer_seconds_total{part="queue"|"wait"|"send"}:
  // the other side, a worker answering a leader's layer queries over a selection stream (link or
  // gRPC; ShardAnswerTiming). Added when the stream ends.
  prometheus::Counter* shard_answers;
  prometheus::Counter* shard_answer_queue_seconds;
  prometheus::Counter* shard_answer_wait_seconds;
  prometheus::Counter* shard_answer_send_seconds;
  // strata_shard_selection_streams_total{transport="link"|"grpc"}: those streams that opened a
  // session, by transport (the selection link or the gRPC ShardSelection stream), at their end.
  prometheus::Counter* selection_streams_link;
  prometheus::Counter* selection_streams_grpc;
  // The KV tier metrics (strata_kv_*) of the worker's registry, set by the owner after
  // construction: lazy-mount jobs count their GPU page caches there (tier "gpu"). Null: each
  // lazy job counts into a private registry. Not owned.
  kvstore::KvMetrics* kv = nullptr;
};

// The model fingerprint a worker with `weight_format` serves under (WorkerInfo, the documents it
// creates): the checkpoint's for "checkpoint", else the checkpoint's + "+" + the format's name
// (engine::WeightFormatName: "+fp8"), whose KV and answers differ from the checkpoint's, so a
// coordinator never mixes the two (its model_fingerprint and default namespace must name the same
// form).
std::string ServedFingerprint(const std::string& model_fingerprint, const std::string& weight_format);

class Worker {
 public:
  using ProgressFn = std::function<void(const v1::PrefillShardProgress&)>;
  // Returns false when the receiver is gone (the job stops, CANCELLED).
  using EventFn = std::function<bool(const v1::JobEvent&)>;

  // `model`, `backend`, `store`, `catalog` must outlive the Worker; `metrics` may be null.
  // The store's catalog holds the documents' metadata (LocalStore or RemoteStore). `store` is
  // usually a kvstore::TieredStore with a host cache in front of the durable tier; the tiers
  // count their own lookups and hits (kvstore/metrics.h).
  // shard_backend (optional, not owned, must outlive the worker): a second instance of the
  // worker's GPU backend for mounted shards (WorkerOptions::shard_placement).
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const WorkerOptions& options,
                                                        const model::Model* model,
                                                        kernels::Backend* backend,
                                                        kvstore::PageStore* store,
                                                        kvstore::DocumentCatalog* catalog,
                                                        WorkerMetrics* metrics,
                                                        kernels::Backend* shard_backend = nullptr);
  ~Worker();

  // What the worker registers with (internal.proto WorkerInfo).
  v1::WorkerInfo Info() const;
  // Sets the address reported in Info() (when the port is known only after the server started).
  void SetAddress(const std::string& address);
  // The selection link's port (WorkerServer sets it; 0: none). Info() reports the link at the
  // reported address's host and this port.
  void SetSelectionLinkPort(int port);
  v1::WorkerLoad Load() const;
  const WorkerOptions& options() const { return options_; }
  // ServedFingerprint of the model and options_.weight_format.
  std::string served_fingerprint() const;

  // Prefills the shard (mode as in the file comment) and persists its pages and summaries;
  // returns OK once they are durable (progress: the shard's tokens prefilled and pages
  // persisted; the last call has complete = true). The document is READY once every shard is
  // durable (file comment). A document already READY in the store is not prefilled again.
  // INVALID_ARGUMENT: bad ids, token ids outside the vocabulary, page size mismatch, a range
  // outside the document or token_ids not of the range's length, an anchor longer than the
  // shard's first token; FAILED_PRECONDITION: EXACT mode with a page of an earlier shard missing
  // from the store; CANCELLED when `cancelled` becomes true; store errors are passed through.
  absl::Status PrefillShard(const v1::PrefillShardRequest& request, const ProgressFn& on_progress,
                            const std::atomic<bool>* cancelled);

  // Runs a job as its leader: attends to the document (READY in the store; never prefilled
  // here) as the file comment says for one-worker and sharded maps, runs the prompt, decodes and
  // streams events: PrefillProgress, TokenDelta, and a final JobInfo snapshot (DONE / CANCELLED /
  // FAILED) with usage (cached_tokens = the document's tokens; pages_fetched = pages read from
  // the tiers for this job, by this worker and, for shards mounted on demand for it, by its
  // peers). Returns the status of the call: OK after a terminal snapshot was sent (also for
  // CANCELLED and FAILED jobs); an error only when no terminal snapshot could be sent. FAILED
  // with INVALID_ARGUMENT for a sharded map that does not cover the document in order.
  absl::Status RunJob(const v1::RunJobRequest& request, const EventFn& on_event);

  // Stops a running job (it ends with a CANCELLED snapshot). False when unknown.
  bool CancelJob(const std::string& job_id);

  // Mounts the shard (file comment). Idempotent. NOT_FOUND: unknown document;
  // FAILED_PRECONDITION: layout mismatch; INVALID_ARGUMENT: a range outside the document;
  // DATA_LOSS: a page missing from the store; RESOURCE_EXHAUSTED beyond capacity_tokens.
  // With request.whole_document (every shard of the document is on this worker) no page is
  // loaded: the shard is held (reported and counted as mounted) and, with the lazy mount, the
  // document's lazy state is prepared for its first job (file comment, "Mounts").
  absl::StatusOr<v1::MountShardResponse> MountShard(const v1::MountShardRequest& request);
  // Forgets the mount (streams still using it keep it until they end). OK when not mounted.
  absl::Status UnmountShard(const v1::UnmountShardRequest& request);
  // The shards mounted now.
  std::vector<v1::ShardRange> MountedShards() const;

  // A selection session for a selection stream (link or gRPC) opened with `open` (mounts the shard on
  // demand). INVALID_ARGUMENT when num_q_heads / head_dim do not match the model or the policy
  // is bad; mount errors as MountShard.
  absl::StatusOr<std::unique_ptr<ShardSession>> OpenSelection(const v1::SelectionOpen& open);
  // What a selection stream of `job_id` answered, at its end (ShardAnswerTiming), over
  // `transport` ("link": the selection link, "grpc": the ShardSelection stream). Counted in
  // strata_shard_selection_streams_total{transport}, strata_shard_answers_total and
  // strata_shard_answer_seconds_total{part="queue"|"wait"|"send"}, and logged.
  void RecordShardAnswers(const std::string& job_id, const ShardAnswerTiming& timing, const std::string& transport);

  // PeerPages: the pages of `request` through this worker's store (the host cache first, then
  // its durable tiers), in request order, at most 64 pages per message; pages no tier holds are
  // marked absent. `write` returns false when the caller went away (the call ends CANCELLED).
  // INVALID_ARGUMENT: a bad document id, more than 65536 keys, a layer or KV head outside the
  // model; store errors are passed through.
  absl::Status GetPeerPages(const v1::GetPagesRequest& request,
                            const std::function<bool(const v1::GetPagesResponse&)>& write);

  // Peer streams that failed during jobs led here and whose shard was mounted here instead.
  int64_t failovers() const { return failovers_.load(); }
  // Batched decode forwards run, and the decode steps they carried (steps / batches is the mean
  // batch size).
  int64_t decode_batches() const { return decode_batches_.load(); }
  int64_t decode_steps() const { return decode_steps_.load(); }
  // Test hook: a decode batch starts only once `steps` steps are pending, or after 2 s (0, the
  // default: at once), so that tests of batching do not depend on the threads' timing.
  void SetDecodeBatchGateForTesting(int steps) { batch_gate_for_testing_.store(steps); }
  // OK when jobs may select on the backend (WorkerOptions::device_selection allows it here and
  // the probe at Create passed); otherwise why not.
  const absl::Status& device_selection_status() const { return device_selection_; }
  // Jobs that ran their decode steps with device selection.
  int64_t device_selection_jobs() const { return device_selection_jobs_.load(); }
  // Lazy-mount jobs whose document was whole in the host tier: device-managed page cache
  // (worker/lazy_attention.h, resident mode).
  int64_t resident_lazy_jobs() const { return resident_lazy_jobs_.load(); }
  // Documents whose lazy-job device state the worker holds now (in use or kept idle).
  int64_t lazy_shared_documents() const;
  // Decode steps that ran as a replayed graph, and graphs captured (WorkerOptions::decode_graph).
  int64_t decode_graph_steps();
  int64_t decode_graph_captures();
  // Decode steps whose token came back instead of their logits (WorkerOptions::device_sampling).
  int64_t device_picks() const { return device_picks_.load(); }

 private:
  struct JobResult;
  // The element type of job and shard caches (WorkerOptions::kv_cache_dtype).
  kernels::DType CacheDType() const {
    return ParseKvDType(options_.kv_cache_dtype).value_or(kernels::DType::kBF16);
  }
  Worker(const WorkerOptions& options, const model::Model* model, kernels::Backend* backend,
         kvstore::PageStore* store, kvstore::DocumentCatalog* catalog, WorkerMetrics* metrics);
  absl::Status RunJobInner(const v1::RunJobRequest& request, const EventFn& on_event,
                           const std::atomic<bool>& cancelled, JobResult* result);
  // One decode step of a job, batched with the steps of other jobs waiting at the same time:
  // the first caller that finds no batch running takes every waiting step (up to the batch
  // limit) and runs them with Transformer::ForwardBatch under the engine mutex; the others wait
  // for their result. When a batch fails, each step whose cache is untouched is run alone so a
  // bad step fails only its own job.
  // With `row` (WorkerOptions::device_sampling) the token it draws on the backend goes to
  // *device_token (else -1: the logits are on the host, to be sampled there with the same row).
  struct DecodeRequest;
  absl::Status DecodeStep(const engine::Transformer::BatchItem& item, const kernels::SampleRow* row,
                          int32_t* device_token);

  // The mount of `range` (existing, or loaded from the store now); adds the pages read to *pages.
  // `device`: placed on the device (DevicePlaced); a host mount asked of a worker that places
  // shards on the device is a host copy (host_copies_), shared by such sessions. A device mount
  // that runs out of device memory (ResourceExhausted) is made in host memory instead (logged
  // once); its sessions then select on the host.
  absl::StatusOr<std::shared_ptr<const MountedShard>> GetOrMount(const v1::ShardRange& range,
                                                                 kvstore::TierCounts* pages,
                                                                 bool check_capacity, bool device);
  // Where a LoadPages call's time went (seconds, added to): in all, and waiting for the store's
  // reads (which run ahead on other threads); the rest verified and copied pages into the cache.
  struct LoadTimes {
    double seconds = 0, fetch_wait_seconds = 0;
  };
  // Appends tokens [first_page * P, min(end_page * P, doc_tokens)) of every layer of document
  // `id` from the store to `cache` (policy->OnAppend and device->OnAppend for those not null). A
  // missing page is an error with `missing_code`, a corrupt one DataLoss. Adds the pages read per
  // tier to *pages and, when `times` is set, the time taken to *times. The store is read on other
  // threads, four batches (STRATA_LOAD_READERS) of WorkerOptions::mount_batch_pages pages of every
  // KV head of a layer ahead; a bf16 cache takes the stored pages through KvCache::AppendPages.
  // Pages read below the host tier go into it only with `fill_host` (a job's full mount, which a
  // later question on the document may repeat; not a shard's mount or an exact prefill's load).
  absl::Status LoadPages(const kvstore::DocumentId& id, int64_t doc_tokens, int64_t first_page, int64_t end_page,
                         kernels::Backend* backend, engine::KvCache* cache, engine::AttentionPolicy* policy,
                         engine::sparse::DevicePolicy* device, const std::atomic<bool>* cancelled,
                         absl::StatusCode missing_code, bool fill_host, kvstore::TierCounts* pages,
                         LoadTimes* times = nullptr);
  // Logs `what` once per worker (the device-selection fallbacks; `flag`: the once-flag, null for
  // fallback_logged_).
  void LogFallbackOnce(const std::string& what, std::atomic<bool>* flag = nullptr);
  // The attention of a document prefill over a cache made with `cache_options` (the cache of
  // cache_first_position 0 or the shard's first token), per WorkerOptions::prefill_policy: sets
  // *policy (dense, or the host policy on the CPU backend) and *device (null, or the DevicePolicy
  // whose AttendChunk the chunks use). Falls back to dense (logged once) when the sparse policy
  // cannot be made here. Never fails for a valid WorkerOptions.
  void MakePrefillAttention(const engine::KvCacheOptions& cache_options,
                            std::unique_ptr<engine::AttentionPolicy>* policy,
                            std::unique_ptr<engine::sparse::DevicePolicy>* device);
  // The backend of shards mounted in host memory (WorkerOptions::shard_placement host, host
  // copies, shards that did not fit on the device): backend_ when it is the CPU backend, else
  // host_backend_ (see the file comment).
  kernels::Backend* shard_backend() const { return host_backend_ != nullptr ? host_backend_.get() : backend_; }
  // Whether a session with `policy` (null: a mount without a session, MountShard) attends a
  // device-placed shard (WorkerOptions::shard_placement).
  bool DevicePlaced(const v1::SelectionPolicy* policy) const;

  const WorkerOptions options_;
  const model::Model* const model_;
  kernels::Backend* const backend_;
  kvstore::PageStore* const store_;
  kvstore::DocumentCatalog* const catalog_;
  WorkerMetrics* const metrics_;
  std::unique_ptr<engine::Transformer> transformer_;
  std::unique_ptr<kernels::Backend> host_backend_;  // null when backend_ is the CPU backend
  // Device-placed shards (WorkerOptions::shard_placement): shards_on_device_, on
  // shard_device_ (a GPU instance, its calls serialised by shard_device_mu_; null on a CPU
  // worker, whose shards then use backend_).
  bool shards_on_device_ = false;
  kernels::Backend* shard_device_ = nullptr;
  absl::Mutex shard_device_mu_;
  std::atomic<bool> shard_fallback_logged_{false};

  // Held for each forward.
  absl::Mutex engine_mu_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> jobs_ ABSL_GUARDED_BY(mu_);
  int prefilling_ ABSL_GUARDED_BY(mu_) = 0;
  std::string address_ ABSL_GUARDED_BY(mu_);
  int selection_link_port_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<const MountedShard>> mounted_ ABSL_GUARDED_BY(mu_);
  // Host-memory copies of shards for sessions whose policy cannot select on the device, on a
  // worker that places shards there (GetOrMount); counted and listed as mounts.
  std::map<std::string, std::shared_ptr<const MountedShard>> host_copies_ ABSL_GUARDED_BY(mu_);
  // Shards of documents whole on this worker, held without pages (MountShard's whole_document).
  struct HeldShard {
    v1::ShardRange range;
    int64_t tokens = 0;     // the shard's
    std::string share_key;  // LazyShareKey of its document
  };
  std::map<std::string, HeldShard> held_ ABSL_GUARDED_BY(mu_);
  // Tokens of mounted_, host_copies_ and held_ shards not also in either.
  uint64_t MountedTokens() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A shard range checked against the catalog (document known, layout, pages inside it) and,
  // with check_capacity, against capacity_tokens.
  struct ShardSpan {
    kvstore::DocumentId id;
    int64_t doc_tokens = 0, t0 = 0, t1 = 0;  // the document's tokens; the shard's [t0, t1)
  };
  absl::StatusOr<ShardSpan> CheckShard(const v1::ShardRange& range, bool check_capacity);
  absl::StatusOr<v1::MountShardResponse> HoldWholeDocument(const v1::ShardRange& range);
  std::atomic<int64_t> failovers_{0};
  absl::Mutex batch_mu_;
  std::vector<DecodeRequest*> pending_ ABSL_GUARDED_BY(batch_mu_);
  bool batch_running_ ABSL_GUARDED_BY(batch_mu_) = false;
  int decoding_jobs_ ABSL_GUARDED_BY(batch_mu_) = 0;  // jobs in their decode loop
  std::atomic<int> batch_gate_for_testing_{0};
  std::atomic<int64_t> decode_batches_{0}, decode_steps_{0}, device_picks_{0};
  absl::Status device_selection_;  // set once in Create
  // Whether a sparse prefill_policy may use a DevicePolicy here (the probe's result on a backend
  // other than the CPU backend; set once in Create).
  absl::Status device_prefill_ = absl::FailedPreconditionError("prefill_policy is dense");
  std::atomic<bool> prefill_fallback_logged_{false};
  std::atomic<int64_t> device_selection_jobs_{0};
  std::atomic<int64_t> resident_lazy_jobs_{0};
  // Lazy-job device state per document (WorkerOptions::lazy_shared_documents), most recently
  // used first; "document hex:tokens" -> share.
  std::list<std::pair<std::string, std::shared_ptr<LazyDocumentShare>>> lazy_shares_ ABSL_GUARDED_BY(mu_);
  // The share of a document for a new lazy job (null when sharing is off); drops the idle shares
  // beyond the limit.
  std::shared_ptr<LazyDocumentShare> AcquireLazyShare(const std::string& key);
  static std::string LazyShareKey(const kvstore::DocumentId& doc_id, int64_t doc_tokens);
  // A lazy job's options on the document for `policy` (its budget, window and theta; the share
  // acquired).
  absl::StatusOr<LazyAttentionOptions> LazyOptions(const kvstore::DocumentId& doc_id, int64_t doc_tokens,
                                                   const v1::SelectionPolicy& policy);
  // Makes the document's lazy state as the first default-policy job would and keeps it in its
  // share; the share's summary bytes (0 when sharing is off).
  absl::StatusOr<int64_t> PrepareLazyDocument(const kvstore::DocumentId& doc_id, int64_t doc_tokens);
  void TrimLazyShares() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::atomic<bool> fallback_logged_{false};
};

}  // namespace strata::worker

#endif  // STRATA_WORKER_WORKER_H_
