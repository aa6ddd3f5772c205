// The transformer forward of a Llama-family decoder (Llama 2/3, Mistral, Qwen2) on a
// kernels::Backend.
//
// Per layer: RMSNorm, Q/K/V projections (+bias), RoPE, KvCache::Append, policy->OnAppend,
// policy->Select, PagedAttention, O projection, residual add, RMSNorm, gate/up projections,
// SwiGLU, down projection, residual add; then the final norm and the LM head. Prefill is chunked:
// each chunk of at most `prefill_chunk_size` tokens is appended to the cache and then attends to
// everything the policy selects (causality through positions, so with the dense policy the result
// is exact and independent of the chunk size).
//
// Weights are uploaded to the backend once, at construction (for the CPU backend the host views
// of the checkpoint are used in place: they already are backend memory). Thread-compatible: one
// Transformer runs one Forward at a time (it owns its scratch buffers); it may serve many
// sequences one after the other, each with its own KvCache and AttentionPolicy.
#ifndef STRATA_ENGINE_TRANSFORMER_H_
#define STRATA_ENGINE_TRANSFORMER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/attention_policy.h"
#include "engine/kv_cache.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/weights.h"

namespace strata::engine {

namespace sparse {
class DevicePolicy;  // engine/sparse/device_policy.h
}  // namespace sparse

// What the Transformer stores its projection matrices as: q/k/v/o and gate/up/down of every
// layer and the LM head (the embedding table and the norms stay as the checkpoint has them).
enum class WeightFormat : int {
  kCheckpoint = 0,  // as loaded (f32|bf16|f16)
  // fp8 e4m3 with one f32 scale per row, quantised at load (kernels::QuantizeRowsToFP8E4M3):
  // half the bytes of bf16 for every decode step to read. Every MatMul then rounds its
  // activations to f16 and scales each output (kernels::MatMulParams); logits move by about the
  // weights' rounding (e4m3 keeps 4 significant bits: bench/RESULTS.md measures the drift).
  kFP8 = 1,
};

struct TransformerOptions {
  // Query tokens per prefill chunk. Larger chunks amortise weight reads (faster prefill) but
  // need scratch memory proportional to chunk * (hidden + intermediate). Default: 512.
  int64_t prefill_chunk_size = 512;

  // Opt-in: one-token Forward calls on a device backend run as a replayed graph (issue #6). The
  // step's inputs (token id, position, cache index and length) are written to backend memory that
  // the graph reads; the whole step (embedding, every layer with KvCache::EnqueueAppendAt and a
  // dense SelectedAttention over the cache's [0, length) with a device length, final norm and LM
  // head) is captured on first use (Backend::BeginCapture / EndCapture) and replayed afterwards,
  // then the logits are copied to the host. A graph belongs to one cache (and external hook):
  // the graphs of the 16 most recently used caches (or batches) are kept, so concurrent sequences
  // decoding in turn replay their own; a new cache captures again. ForwardBatch's steps run the
  // same way: one graph for the batch's rows (ordered by cache), recorded for that set of caches
  // and hooks and replayed while the same sequences decode together. Only where the result is
  // the plain forward's: the policy is "dense", no device policy, and no external attention
  // unless it is on the device and capturable (ExternalAttention::CapturableOnDevice: its
  // AttendOnDevice is recorded once per layer with the step, its partial merged on the device);
  // other calls (and every call when the backend cannot capture, e.g. the CPU backend) take the
  // normal path. Logits match the normal path to rounding (attention through another kernel),
  // not bit for bit.
  bool decode_graph = false;

  // Precision of every MatMul of the forward (projections, MLP, LM head; prefill chunks, decode
  // steps, ForwardBatch and the decode graph alike), for bf16/f16 checkpoints (f32 weights ignore
  // it): kSplit (default) multiplies the f32 activations (the CUDA backend keeps ~16 bits of each
  // through two GEMMs), kRoundActivations rounds each activation to the weight's type first and
  // runs one bf16 GEMM on the CUDA backend (faster prefill; logits move by about the rounding of
  // the activations, see kernels/backend.h MatMulPrecision). One setting for all token counts:
  // decode steps round too (in the GEMV's loads, no extra pass), so a sequence sees one
  // arithmetic from prefill to decode.
  kernels::MatMulPrecision matmul_precision = kernels::MatMulPrecision::kSplit;

  // The form the projection matrices are kept in (see WeightFormat). With kFP8,
  // matmul_precision does not apply to them.
  WeightFormat weight_format = WeightFormat::kCheckpoint;

  // InvalidArgument when prefill_chunk_size < 1 or matmul_precision or weight_format is not one
  // of its enum's.
  absl::Status Validate() const;
};

// Flag spellings of kernels::MatMulPrecision: "split" (kSplit) and "bf16" (kRoundActivations:
// rounded to the weight's type, bf16 for bf16 checkpoints and f16 for f16 ones).
// InvalidArgument for any other name.
absl::StatusOr<kernels::MatMulPrecision> ParseMatMulPrecision(absl::string_view name);
const char* MatMulPrecisionName(kernels::MatMulPrecision p);

// Flag spellings of WeightFormat: "checkpoint" and "fp8". InvalidArgument for any other name.
absl::StatusOr<WeightFormat> ParseWeightFormat(absl::string_view name);
const char* WeightFormatName(WeightFormat f);

// One partial attention result over a set of keys (host memory, f32): o [n, num_q_heads,
// head_dim] and lse [n, num_q_heads] with -inf where nothing was attended (the form of
// kernels::PagedAttentionParams out / lse). Partials over disjoint key sets merge exactly with
// Backend::MergeAttention.
struct AttentionPartial {
  std::vector<float> o;
  std::vector<float> lse;
};

// Attention to keys that are not in the KvCache given to Forward (e.g. document shards held by
// other workers, or an anchor prefix held in another cache). Per layer, Forward passes the
// layer's queries (after RoPE) and merges the returned partials with the local attention output
// using Backend::MergeAttention; the key sets must be disjoint from the cache's for the merge to
// be exact. Implementations are called from inside Forward (one call per layer per chunk).
class ExternalAttention {
 public:
  ExternalAttention();
  ExternalAttention(const ExternalAttention&) : ExternalAttention() {}  // a copy is another hook
  ExternalAttention& operator=(const ExternalAttention&) { return *this; }
  virtual ~ExternalAttention() = default;
  // A number no other ExternalAttention of this process has had (decode graphs record the hook's
  // device buffers, so a graph is keyed by the hook's lifetime, not its address).
  uint64_t instance_id() const { return instance_id_; }
  // q: host f32 [num_tokens, num_q_heads, head_dim] at absolute positions [q_begin, q_begin +
  // num_tokens). Appends zero or more partials to `parts` (each sized for num_tokens x
  // num_q_heads); `parts` may hold vectors from an earlier call to reuse: the implementation
  // resizes it. Errors end the forward.
  virtual absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads,
                              int64_t q_begin, std::vector<AttentionPartial>* parts) = 0;
  // Called by Forward for each segment whose external attention takes host queries, for all of
  // a forward's segments before the first of their Attend calls of the layer, with the arguments
  // that Attend will get: an implementation may start remote work here (worker::LeaderAttention
  // sends the queries to its peers) so that the segments of a batch wait for their answers at
  // the same time instead of one after another. Default: nothing. Errors end the forward.
  virtual absl::Status Prepare(int layer, const float* q, int num_tokens, int num_q_heads,
                               int64_t q_begin) {
    return absl::OkStatus();
  }

  // Optional device path. When AttendsOnDevice() is true, Forward calls AttendOnDevice instead of
  // Attend and nothing crosses to the host: q is backend memory f32 [num_tokens, num_q_heads,
  // head_dim] (after RoPE) at positions [q_begin, q_begin + num_tokens); the implementation
  // writes exactly one partial to `out` [num_tokens, num_q_heads, head_dim] and `lse`
  // [num_tokens, num_q_heads] (backend memory f32; lse -inf where nothing was attended), queued
  // on the backend's default stream, and Forward merges it on the device. Errors end the forward.
  virtual bool AttendsOnDevice() const { return false; }
  // Whether AttendOnDevice queues device work only -- no host reads, waits or allocations, and
  // nothing that depends on q_begin -- so that the one-token decode step can be captured in a
  // graph with it (TransformerOptions::decode_graph) and replayed for later tokens.
  virtual bool CapturableOnDevice() const { return false; }
  virtual absl::Status AttendOnDevice(int layer, const kernels::TensorView& q, int64_t q_begin,
                                      const kernels::TensorView& out,
                                      const kernels::TensorView& lse) {
    return absl::UnimplementedError("ExternalAttention::AttendOnDevice");
  }
  // Graph mode (CapturableOnDevice hooks): PrepareCapture runs before a one-token step of a model
  // with num_q_heads query heads is recorded with AttendOnDevice in it, and allocates and uploads what AttendOnDevice would on first use
  // (nothing may be allocated or copied synchronously while capturing); an error leaves the step
  // to the normal path. OnReplayedStep runs after each later replay of the recorded step, for a
  // token at q_begin: the host-side accounting AttendOnDevice does per layer (counters), as if it
  // had run for every layer.
  virtual absl::Status PrepareCapture(int num_q_heads) { return absl::OkStatus(); }
  virtual void OnReplayedStep(int64_t q_begin) {}

 private:
  uint64_t instance_id_;
};

// Optional arguments of Transformer::Forward. The defaults give the plain forward.
struct ForwardOptions {
  // Absolute position of the cache's first token: cache index i holds the token at position
  // cache_first_position + i, and start_pos must equal cache_first_position + cache length.
  // The policy sees cache-relative positions (q_begin - cache_first_position); spans and RoPE use
  // absolute positions. Keys before cache_first_position are attended only through `external`.
  int64_t cache_first_position = 0;
  // Null: attention is over the cache only (exactly the plain forward).
  ExternalAttention* external = nullptr;
  // Null: every row attends through `policy` + PagedAttention. Set: the policy is told of every
  // append, and a one-token segment (a decode step) attends through its device-side selection
  // (engine/sparse/device_policy.h) instead; chunks of several tokens still use `policy` (on the
  // CUDA backend, whose device pools the host policies cannot read, that must be a dense policy)
  // unless device_prefill is set.
  sparse::DevicePolicy* device_policy = nullptr;
  // With device_policy set: segments of several tokens (prefill chunks) attend through
  // DevicePolicy::AttendChunk too (selection with the chunk's mean query on the backend, one host
  // wait per layer for the selection, then PagedAttention over its spans) instead of `policy`,
  // which is then only told of appends. Off by default (chunks use `policy`, as the worker's
  // prompt chunks do).
  bool device_prefill = false;
  // Set (all_logits must be false): the last token's logits [1, vocab] f32 stay in backend
  // memory, readable through Transformer::device_logits() until the next call (e.g. for
  // Backend::Sample), and logits_out is not written (it may be null). The call then returns
  // without waiting for the device.
  bool logits_on_device = false;
  // Set (one-token calls only): the token id is read from backend memory at this address when the
  // step runs, e.g. the output of the previous step's Backend::Sample, and `ids` is not read (it
  // may be null). The caller can then queue the next step before the sampled token reaches the
  // host. With decode_graph the replayed step reads it on the device (no host wait; an id outside
  // the vocabulary then gives the backend's Embedding result, NaN rows on CUDA); otherwise the id
  // is first copied to the host (a wait) and checked as `ids` are.
  const int32_t* device_token = nullptr;
};

class Transformer {
 public:
  // Validates config and options, checks every weight view's shape against the config, uploads
  // the weights and allocates scratch buffers for one chunk. `weights` (its host memory maps)
  // must outlive the Transformer when the backend is the CPU backend; `backend` must outlive it.
  // InvalidArgument on inconsistent config/weights/options; ResourceExhausted when memory runs
  // out.
  static absl::StatusOr<std::unique_ptr<Transformer>> Create(const model::ModelConfig& config,
                                                             const model::ModelWeights& weights,
                                                             kernels::Backend* backend,
                                                             const TransformerOptions& options);
  ~Transformer();

  const model::ModelConfig& config() const { return config_; }
  const TransformerOptions& options() const { return options_; }
  kernels::Backend* backend() const { return backend_; }
  // One-token steps that ran as a graph replay (decode_graph; each row of a batched replay
  // counts), for tests and benchmarks.
  int64_t graph_steps() const { return graph_steps_; }
  // Graphs captured (decode_graph): one per cache (or batch of caches), again when its graph was
  // dropped for more recently used ones (the most recent kMaxDecodeGraphs keep theirs).
  int64_t graph_captures() const { return graph_captures_; }
  // The logits of the last Forward with ForwardOptions::logits_on_device: [1, vocab] f32 in
  // backend memory (an empty view before the first such call; a ForwardBatch with sampled items
  // overwrites them).
  kernels::TensorView device_logits() const;
  // The token `row` draws from device_logits() (after a Forward with logits_on_device), picked on
  // the backend as BatchItem::sample's are; -1 where every logit is NaN or -inf.
  // FailedPrecondition before any such Forward.
  absl::StatusOr<int32_t> PickToken(const kernels::SampleRow& row);

  // KvCache options matching this model (layers, KV heads, head_dim).
  KvCacheOptions MakeCacheOptions(int64_t max_tokens, int page_size = 64,
                                  kernels::DType dtype = kernels::DType::kF32) const;

  // Runs `n` tokens `ids` (host memory) at positions [start_pos, start_pos + n) of the sequence
  // whose KV is in `cache` (start_pos must equal cache->length of every layer), appending their
  // KV. Writes f32 logits to `logits_out` (host memory): [n, vocab] when all_logits, else [1,
  // vocab] for the last token. InvalidArgument for n < 1, ids outside the vocabulary, a
  // start_pos that does not match the cache, or a cache of another shape; ResourceExhausted when
  // the cache is full; errors of the backend and policy are passed through. On error the cache
  // may hold part of the tokens: discard the sequence.
  absl::Status Forward(const int32_t* ids, int64_t n, int64_t start_pos, KvCache* cache,
                       AttentionPolicy* policy, float* logits_out, bool all_logits);
  // The same with ForwardOptions (a cache that starts after position 0, attention to external
  // keys). InvalidArgument also for cache_first_position < 0.
  absl::Status Forward(const int32_t* ids, int64_t n, int64_t start_pos, KvCache* cache,
                       AttentionPolicy* policy, float* logits_out, bool all_logits,
                       const ForwardOptions& options);

  // One decode step of several sequences at once (batched projections and MLP; attention per
  // sequence through its own cache, policy and options). Each item's token `id` runs at position
  // `pos` of its sequence (pos must equal cache_first_position + cache length) and its last-token
  // logits [vocab] go to logits_out (host). Per row the arithmetic is that of Forward with n = 1
  // except that the matrix products run over all rows together (the CPU backend may then round
  // differently than its one-row path). InvalidArgument (nothing appended) for 0 or more than
  // prefill_chunk_size items, an item that Forward would refuse, or a cache used twice; other
  // errors may leave some caches with the token appended: discard those sequences.
  // An item with sample and token set gets the token *sample draws (Backend::Sample: what
  // engine::Sampler picks with those options and that uniform) instead of its logits: one Sample
  // over the batch's logits, which stay in backend memory, and only the tokens come back (a
  // backend without Sample copies the rows to the host for the CPU twin, kernels::CpuSample);
  // -1 where every logit is NaN or -inf. Its logits_out may be null and is not written.
  struct BatchItem {
    int32_t id = 0;
    int64_t pos = 0;
    KvCache* cache = nullptr;
    AttentionPolicy* policy = nullptr;
    ForwardOptions options;
    float* logits_out = nullptr;
    const kernels::SampleRow* sample = nullptr;  // host memory
    int32_t* token = nullptr;
  };
  absl::Status ForwardBatch(std::vector<BatchItem>& items);

 private:
  Transformer(const model::ModelConfig& config, const TransformerOptions& options,
              kernels::Backend* backend);
  absl::Status Init(const model::ModelWeights& weights);
  absl::Status Upload(const kernels::TensorView& host, kernels::TensorView* out);
  // backend_->MatMul on the default stream with options_.matmul_precision and the weight's
  // row scales (`weight_scale`: data null unless the weight is fp8).
  absl::Status MatMul(kernels::MatMulParams p, const kernels::TensorView& weight_scale);
  // With WeightFormat::kFP8, replaces the host matrix *w by its fp8 rows (host memory owned by
  // host_quantized_) and sets *scale to their scales; otherwise leaves *w and clears *scale.
  absl::Status QuantizeForUpload(kernels::TensorView* w, kernels::TensorView* scale);
  // Uploads the row scales `parts` of matrices (data null: none, nothing uploaded) into *outs;
  // when the matrices were uploaded fused, the scales are fused too, into *fused (else *fused is
  // cleared).
  absl::Status UploadScales(const std::vector<const kernels::TensorView*>& parts,
                            const std::vector<kernels::TensorView*>& outs, bool matrices_fused,
                            kernels::TensorView* fused);
  // Uploads `parts` (same rank, dtype and trailing dimension) one after another into one buffer:
  // *fused views it all ([sum of dim 0(, cols)]) and *outs[i] part i. Returns false (nothing
  // uploaded) when the parts cannot be fused: host memory, a null part, or differing dtype/shape.
  absl::StatusOr<bool> UploadFused(const std::vector<const kernels::TensorView*>& parts,
                                   const std::vector<kernels::TensorView*>& outs,
                                   kernels::TensorView* fused);
  absl::Status ForwardChunk(const int32_t* ids, int64_t n, int64_t start_pos, KvCache* cache,
                            AttentionPolicy* policy, float* logits_out, bool all_logits,
                            const ForwardOptions& options);
  // Rows [row0, row0 + n) of the chunk belong to one sequence.
  struct Segment {
    KvCache* cache = nullptr;
    AttentionPolicy* policy = nullptr;
    const ForwardOptions* options = nullptr;
    int64_t row0 = 0;
    int64_t n = 0;
    int64_t start_pos = 0;
  };
  // Embedding and every layer for `n` rows made of `segs`; the final hidden states stay in x_.
  absl::Status RunLayers(const int32_t* ids, int64_t n, const std::vector<Segment>& segs);
  // A layer's tail after its attention output projection (o): x += o inside the post-attention
  // norm into xn, then gate and up (one fused GEMV for one row), SwiGLU and down into o, over the
  // first n rows of the chunk scratch. RunLayers and RecordGraphStep share it.
  absl::Status Mlp(int layer, int64_t n);
  // Final norm and LM head of rows [first, first + rows) of x_ into logits_out (host), or with
  // logits_out null into the first rows of logits_ (backend memory, not waited for).
  absl::Status Logits(int64_t first, int64_t rows, float* logits_out);
  // logits_ holds at least `rows` rows. Growing it moves it, so the decode graphs (which recorded
  // its address) are dropped; never called while a graph is being captured.
  absl::Status EnsureLogitsRows(int64_t rows);
  // Merges rows [row0, row0 + n) of attn_/lse_ (the local attention) with the external partials
  // into the same rows of merged_ / merged_lse_. *staged: set when the partials' copy from
  // part_host_ was queued without waiting (the caller covers it with part_mark_), left as is
  // otherwise (may be null when nothing can be staged: no parts).
  absl::Status MergeExternal(int64_t row0, int64_t n, const std::vector<AttentionPartial>& parts,
                             bool* staged);
  // The same for a partial already in backend memory (rows [row0, row0 + n) of ext_o_/ext_lse_,
  // from ExternalAttention::AttendOnDevice).
  absl::Status MergeDevicePartial(int64_t row0, int64_t n);
  // decode_graph: runs the one-token step as a replayed graph. Returns false (nothing done) when
  // the step cannot run as a graph (then the caller takes the normal path).
  absl::StatusOr<bool> ForwardGraphStep(int32_t id, int64_t pos, KvCache* cache,
                                        AttentionPolicy* policy, float* logits_out,
                                        const ForwardOptions& options);
  // One row of a graph step: a sequence's next token (ForwardBatch's items, or Forward's one).
  struct GraphRow {
    int32_t id = 0;
    int64_t pos = 0;
    KvCache* cache = nullptr;
    AttentionPolicy* policy = nullptr;
    const ForwardOptions* options = nullptr;
  };
  // decode_graph: runs one token of each row as one replayed graph (captured on the first step of
  // these caches and hooks in this order), its logits left in rows [0, rows) of logits_, and the
  // caches, policies and hooks' host accounting advanced as the normal path does. Returns false
  // (nothing done) when a row cannot run in a graph: a policy other than dense, a device policy,
  // an external hook that is not capturable, more rows than prefill_chunk_size, a device_token
  // with several rows, a host-memory backend, or captures refused before. ResourceExhausted when
  // a cache is full.
  absl::StatusOr<bool> ReplayGraphRows(const std::vector<GraphRow>& rows,
                                       const int32_t* device_token);
  // Queues (or, while capturing, records) the one-token step of `rows` reading step_ on the
  // default stream: row r's token at step_[r], its position at step_[n + r], its cache index at
  // step_[2n + r] and length at step_[3n + r] (n rows; the id at *device_token instead for one
  // row with one). A row's CapturableOnDevice hook is attended (and merged) beside its local
  // attention in every layer; page_tables[r] is row r's cache slot layout.
  absl::Status RecordGraphStep(const std::vector<GraphRow>& rows,
                               const std::vector<kernels::Buffer*>& page_tables,
                               const int32_t* device_token);
  // ForwardBatch's results: row r of the step's logits (logits_ when `on_device`, else the rows
  // still to be computed from x_) belongs to items[order[r]]; draws the sampled items' tokens and
  // copies the others' logits to their logits_out.
  absl::Status FinishBatch(std::vector<BatchItem>& items, const std::vector<int64_t>& order,
                           bool on_device);

  model::ModelConfig config_;
  TransformerOptions options_;
  kernels::Backend* backend_;
  bool host_memory_;  // backend memory is host memory (CPU backend)

  // Weights as backend views.
  kernels::TensorView embed_tokens_, final_norm_, lm_head_;
  std::vector<model::LayerWeights> layers_;
  std::vector<std::unique_ptr<kernels::Buffer>> weight_buffers_;

  // Scratch for one chunk (backend memory).
  kernels::TensorView inv_freq_;
  // qkv_: the rows of one call as [n, q] then [n, k] then [n, v] (so for one token the fused
  // projection's output [q | k | v], and v right after k for KvCache::Append's single read-back);
  // gate_up_: [n, ffn] gate rows then [n, ffn] up rows likewise.
  std::unique_ptr<kernels::Buffer> x_, xn_, qkv_, attn_, lse_, o_, gate_up_, ids_, pos_,
      logits_, inv_freq_buf_;
  // Rows logits_ holds (EnsureLogitsRows): as many as a call has asked for, not the chunk's (an
  // 8K-token chunk's logits in f32 take 3.9 GiB for a 128K vocabulary; a prefill asks for one).
  int64_t logits_rows_ = 0;
  // Device backends: per layer, views of q_proj|k_proj|v_proj (and their biases) and of
  // gate_proj|up_proj stored as one matrix each (the per-projection views in layers_ point into
  // them), for one-token steps: one GEMV instead of three or two. data null when not fused
  // (CPU backend, or differing dtypes / biases).
  struct FusedWeights {
    kernels::TensorView qkv, qkv_bias, gate_up;
    kernels::TensorView qkv_scale, gate_up_scale;  // fp8 row scales of the fused matrices
  };
  std::vector<FusedWeights> fused_;
  // WeightFormat::kFP8: per layer the row scales of each projection ([rows] f32, backend
  // memory; data null otherwise), and the LM head's.
  struct LayerScales {
    kernels::TensorView q, k, v, o, gate, up, down;
  };
  std::vector<LayerScales> scales_;
  kernels::TensorView lm_head_scale_;
  // Host fp8 rows and scales made by QuantizeForUpload: kept while a host-memory backend reads
  // them in place, dropped after each upload otherwise.
  std::deque<std::vector<uint8_t>> host_quantized_;  // a deque: references stay valid
  // Host memory for copies between the host and backend memory: AllocateHost memory, whose copies
  // go directly and need not wait, or where the backend gives none (AllocateHost failed once) a
  // plain vector, whose copies wait.
  class HostStaging {
   public:
    // At least `floats` floats (what it held is dropped when it grows).
    absl::Status Reserve(kernels::Backend* be, size_t floats);
    float* data() { return pinned_ != nullptr ? static_cast<float*>(pinned_->data()) : plain_.data(); }
    // floats [from, from + n) of data() to `dst` (backend memory) on the default stream. Returns
    // true when the copy is queued without waiting (pinned memory: the caller keeps those floats
    // unchanged until a later mark is waited for), false when it is done.
    absl::StatusOr<bool> CopyIn(kernels::Backend* be, void* dst, size_t from, size_t n);
    // `n` floats of `src` (backend memory) into data(), waited for.
    absl::Status CopyOut(kernels::Backend* be, const void* src, size_t n);

   private:
    std::unique_ptr<kernels::Buffer> pinned_;
    std::vector<float> plain_;
    bool plain_only_ = false;
  };
  // The layer's queries on the host when backend memory is not host memory (a host policy's
  // Select, an external attention).
  HostStaging q_host_;
  std::vector<int32_t> positions_host_;
  Selection selection_;
  // External attention (allocated on first use): partials in backend memory and the merge output.
  std::vector<std::vector<AttentionPartial>> segment_parts_;
  std::vector<float> batch_logits_;
  // ForwardBatch's and PickToken's draws (BatchItem::sample): the rows' SampleRows and their
  // tokens, sized for prefill_chunk_size rows at first use.
  std::unique_ptr<kernels::Buffer> sample_rows_, sample_tokens_;
  std::vector<int32_t> picked_;
  // The tokens `sample` (host, [rows]) draws from `logits` ([rows, vocab], backend memory) into
  // picked_: one Backend::Sample, or kernels::CpuSample over the rows copied to the host where the
  // backend cannot sample; -1 for a row whose logits are all NaN or -inf.
  absl::Status PickRows(const kernels::TensorView& logits, const kernels::SampleRow* sample);
  // MergeExternal's staging on device backends: the host partials of a layer's segments go into
  // part_host_ and reach part_dev_ in one copy per segment (that does not wait where part_host_ is
  // pinned). Rows [r0, r0 + n) of a layer own floats [r0 * R, (r0 + n) * R) of both, R =
  // part_cap_ * (hq * d + hq), so the segments of one layer never share staging; part_mark_ (a
  // backend mark after a layer's copies, -1 when none is pending) is waited for before the next
  // layer writes there. Grown (after a wait for the default stream) when a call needs more rows or
  // parts.
  HostStaging part_host_;
  std::unique_ptr<kernels::Buffer> part_dev_;
  int64_t part_rows_cap_ = 0, part_cap_ = 0;
  int64_t part_mark_ = -1;
  std::unique_ptr<kernels::Buffer> merged_, merged_lse_;
  // ExternalAttention::AttendOnDevice partials (rows of the chunk), allocated on first use, and
  // per segment whether its partial is there.
  std::unique_ptr<kernels::Buffer> ext_o_, ext_lse_;
  std::vector<uint8_t> segment_device_part_;
  // decode_graph state: step_ holds int32 {token ids, positions, cache indices, cache indices + 1}
  // of a step's rows (each group n values for n rows; room for prefill_chunk_size rows) in
  // backend memory (shared by every graph: replays are serial on the default stream). graphs_: the
  // captured steps of the most recently used rows of caches (least recent first, at most
  // kMaxDecodeGraphs), each for the cache and external hook `key` names (by ids never reused), with
  // that cache's slot layout [num_kv_heads, pages_per_head] in `page_table`.
  struct DecodeGraphKey {
    // Per row in order: KvCache::id(), then ExternalAttention::instance_id() or 0.
    std::vector<uint64_t> ids;
    const int32_t* device_token = nullptr;  // ForwardOptions::device_token the graph reads
    bool operator==(const DecodeGraphKey& o) const {
      return ids == o.ids && device_token == o.device_token;
    }
  };
  struct DecodeGraph {
    DecodeGraphKey key;
    std::vector<std::unique_ptr<kernels::Buffer>> page_tables;  // per row
    std::unique_ptr<kernels::Graph> graph;
  };
  static constexpr size_t kMaxDecodeGraphs = 16;
  std::unique_ptr<kernels::Buffer> step_;
  // The step's values go to step_ by a copy that does not wait (Backend::CopyToDeviceAsync) from
  // one of two host slots (AllocateHost memory), used in turn; a slot is rewritten only after the
  // mark recorded behind its last copy (step_mark_, -1: none pending) has been waited for.
  std::unique_ptr<kernels::Buffer> step_host_;
  int64_t step_mark_[2] = {-1, -1};
  int step_slot_ = 0;
  std::vector<DecodeGraph> graphs_;
  bool graph_unavailable_ = false;        // a one-row capture failed: normal path from then on
  bool batch_graph_unavailable_ = false;  // the same for steps of several rows
  int64_t graph_steps_ = 0;
  int64_t graph_captures_ = 0;
};

}  // namespace strata::engine

#endif  // STRATA_ENGINE_TRANSFORMER_H_
