// The compute backend: one interface, a CPU reference implementation and a CUDA one.
//
// Every op takes a params struct whose tensor fields carry a shape comment, and has a
// Supports() twin that says, without running anything, whether this backend can run it with
// those dtypes and shapes (InvalidArgument / Unimplemented otherwise). Ops return
// InvalidArgument for malformed params and never read or write outside the views they are given.
//
// The CPU backend (kernels/cpu/) is the specification: plain loops, f32 accumulation. The CUDA
// backend (kernels/cuda/, same file names) must match it within each op's tolerance.
//
// Memory: tensors live in backend memory obtained from Allocate(); for the CPU backend that is
// host memory. Copy*() move bytes between host and backend memory.
//
// Thread-compatibility: a Backend may be used from several threads only with external
// synchronisation, except that ops on different Streams of the CUDA backend may overlap. The
// backend is chosen once at process start (MakeBackend) and never per call.
#ifndef STRATA_KERNELS_BACKEND_H_
#define STRATA_KERNELS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace strata::kernels {

// An opaque stream handle (cudaStream_t for CUDA; ignored by the CPU backend). nullptr = default.
using Stream = void*;

// Owned backend memory. Freed by the destructor.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual void* data() = 0;
  virtual size_t bytes() const = 0;
  TensorView View(DType t, std::initializer_list<int64_t> dims) { return TensorView(data(), t, dims); }
};

// out[i, :] = table[ids[i], :]
struct EmbeddingParams {
  const int32_t* ids = nullptr;  // [num_tokens], backend memory; each in [0, vocab)
  TensorView table;              // [vocab, hidden] f32|bf16|f16
  TensorView out;                // [num_tokens, hidden] f32
};

// out = in / sqrt(mean(in^2) + eps) * weight, row by row. With `residual` (the residual add of a
// transformer block fused into the next norm) in += residual first, elementwise in f32 and written
// back to in, then in is normalised: the results of Add({in, residual, in}) then RmsNorm, bit for
// bit on each backend.
struct RmsNormParams {
  TensorView in;      // [num_tokens, hidden] f32 (written when residual is set)
  TensorView weight;  // [hidden] f32|bf16|f16
  TensorView out;     // [num_tokens, hidden] f32 (may alias in)
  float eps = 1e-6f;
  TensorView residual;  // [num_tokens, hidden] f32, or data == nullptr (none); must not alias out
};

// What MatMul does with the f32 activations when the weight is bf16|f16 (f32 weights ignore it:
// the product is always in f32).
enum class MatMulPrecision : int {
  // The activations are used as f32 (the default). The CPU backend multiplies in f32; the CUDA
  // backend reads them as f32 in its decode GEMV and, for more tokens, splits each into hi + lo in
  // the weight's type (two tensor-core GEMMs, ~16 significant bits kept).
  kSplit = 0,
  // Each activation is first rounded to the weight's type (bf16 or f16, round to nearest even;
  // f16 overflows to +-inf beyond +-65504), then multiplied with f32 accumulation and f32 output:
  // what inference engines run (one bf16 GEMM on the CUDA backend). Every backend and every
  // token count rounds the same way, so backends agree to accumulation order.
  kRoundActivations = 1,
};

// out[n, o] = sum_i in[n, i] * weight[o, i] (+ bias[o]); weight is stored as Hugging Face stores
// nn.Linear weights. Accumulation in f32. The bias is added in f32 after the product (never
// rounded by `precision`).
//
// fp8_e4m3 weights (quantised rows, kernels::QuantizeRowsToFP8E4M3) carry one f32 scale per row:
//   out[n, o] = weight_scale[o] * sum_i f16(in[n, i]) * f32(weight[o, i]) (+ bias[o])
// where f16() rounds each activation to f16 (nearest even; beyond +-65504 it overflows to +-inf):
// the products are exact in f32, so backends agree to accumulation order; the scale multiplies
// the f32 sum, then the bias is added. `precision` does not apply to them.
struct MatMulParams {
  TensorView in;      // [num_tokens, in_features] f32
  TensorView weight;  // [out_features, in_features] f32|bf16|f16|fp8_e4m3
  TensorView bias;    // [out_features] f32|bf16|f16, or data == nullptr
  TensorView out;     // [num_tokens, out_features] f32
  // See MatMulPrecision; a value outside the enum is InvalidArgument.
  MatMulPrecision precision = MatMulPrecision::kSplit;
  // [out_features] f32: required with fp8_e4m3 weights, data == nullptr with any other.
  TensorView weight_scale;
};

// Rotary embedding in place, "rotate half" convention (pairs (i, i + head_dim/2)) as in Hugging
// Face Llama: for each token t, head h, i < head_dim/2, with a = positions[t] * inv_freq[i]:
//   x1' = x1 cos a - x2 sin a;  x2' = x2 cos a + x1 sin a
struct RopeParams {
  TensorView x;                        // [num_tokens, num_heads, head_dim] f32, rotated in place
  const int32_t* positions = nullptr;  // [num_tokens], backend memory
  TensorView inv_freq;                 // [head_dim / 2] f32 (already includes rope scaling)
  float attention_factor = 1.0f;       // multiplies cos and sin (1 for llama3 / default rope)
};

// out = silu(gate) * up, elementwise; silu(x) = x / (1 + exp(-x)).
struct SwiGluParams {
  TensorView gate;  // [num_tokens, intermediate] f32
  TensorView up;    // [num_tokens, intermediate] f32
  TensorView out;   // [num_tokens, intermediate] f32 (may alias gate)
};

// out = a + b, elementwise.
// out = a_scale * a + b_scale * b, elementwise (f32; with both scales 1, the plain sum a + b).
struct AddParams {
  TensorView a;    // [n...] f32
  TensorView b;    // same shape, f32
  TensorView out;  // same shape, f32 (may alias a or b)
  float a_scale = 1.0f;  // finite
  float b_scale = 1.0f;  // finite
};

// A run of consecutive tokens of one KV head held in one page slot of the pool.
struct KvSpan {
  int32_t slot = 0;      // page slot in k_pool / v_pool
  int32_t offset = 0;    // first token of the run inside the page
  int32_t length = 0;    // tokens in the run; offset + length <= page_size
  int32_t position = 0;  // absolute sequence position of the run's first token
};

// Attention of a block of query tokens over a set of KV spans per KV head (paged attention).
// For query token t and query head h (KV head g = h / (num_q_heads / num_kv_heads)), over every
// key j in the spans of g with (!causal || pos(j) <= q_positions[t]):
//   s_j = scale * q[t,h,:] . k_j,   lse[t,h] = log(sum_j exp(s_j)),
//   out[t,h,:] = sum_j exp(s_j - lse[t,h]) v_j.
// When no key is attended, out is 0 and lse is -inf. The (out, lse) pair is a *partial* result:
// partials over disjoint key sets merge exactly with MergeAttention.
struct PagedAttentionParams {
  TensorView q;                          // [num_tokens, num_q_heads, head_dim] f32
  TensorView k_pool;                     // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3
  TensorView v_pool;                     // [num_slots, page_size, head_dim] same dtype as k_pool
  const KvSpan* spans = nullptr;         // host memory: spans of all KV heads, grouped by head
  const int32_t* span_offsets = nullptr; // host memory: [num_kv_heads + 1] CSR offsets into spans
  int num_kv_heads = 0;
  const int32_t* q_positions = nullptr;  // host memory: [num_tokens] absolute positions
  bool causal = true;
  float scale = 0.0f;                    // usually 1 / sqrt(head_dim)
  TensorView out;                        // [num_tokens, num_q_heads, head_dim] f32
  TensorView lse;                        // [num_tokens, num_q_heads] f32
  // Per-tensor dequantisation scales of fp8 pools (see "fp8 KV pools" below): k_j and v_j above
  // are stored * k_scale and stored * v_scale. Finite and > 0; ignored (must stay 1) for f32|bf16.
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// fp8 KV pools (DType::kFP8E4M3, OCP e4m3fn). A pool element holds value / scale rounded to e4m3
// (nearest even, saturated to +-448, NaN kept: kernels::F32ToFP8E4M3), one scale per pool (per
// tensor, as vLLM's fp8 KV cache), and is read as stored * scale. Supported: PagedAttention
// (CPU; CUDA decode fast path and the general kernel: the tensor-core prefill kernel is bf16 only,
// so fp8 prefill runs the general kernel), SelectedAttention (CPU, CUDA), AppendKv (CPU, CUDA; writes
// F32ToFP8E4M3(x / scale) bit for bit), PageCopy (bytes), and the selection ops that read keys:
// ScoreKeys, UpdateSummaries and SelectStages (CPU, CUDA; on CUDA SelectStages runs them in its one
// kernel with the attention). Those read the *stored* values: ScoreKeys scores stored keys (a caller
// folds k_scale into scale, as the selection's scale then matches the attention's scale * k_scale)
// and UpdateSummaries summarises stored keys (a minmax bound scales with k_scale > 0).

// Merges partial attention results over disjoint key sets:
//   LSE = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - LSE) * out_s.
struct MergeAttentionParams {
  const TensorView* outs = nullptr;  // num_parts views, each [num_tokens, num_heads, head_dim] f32
  const TensorView* lses = nullptr;  // num_parts views, each [num_tokens, num_heads] f32
  int num_parts = 0;
  TensorView out;                    // [num_tokens, num_heads, head_dim] f32
  TensorView lse;                    // [num_tokens, num_heads] f32
};

// Fills page slots of a pool from host memory and updates a device page table, as one op (the
// miss path of the GPU page cache, kvstore/gpu_cache.h). For i < num_pages, staging page i is
// K [page_size, head_dim] followed by V [page_size, head_dim] in the pools' dtype, at byte offset
// i * PageCopyBytes(...) of `staging`:
//   k_pool[slots[i], :, :] = K of staging page i;  v_pool[slots[i], :, :] = V of staging page i
// then, for j < num_table_updates: table[table_index[j]] = table_value[j].
// `staging`, `slots`, `table_index` and `table_value` must be memory from AllocateHost (the CUDA
// backend reads them from the device through the host mapping, so nothing else is copied) and
// must stay unchanged until the op has completed on its stream (Synchronize). When two entries
// name the same slot (or table index) which write lands is unspecified. InvalidArgument for
// out-of-range slots or indices, a short staging buffer, or (CUDA) staging that is not
// AllocateHost memory.
// With `sources` set, page i is read from sources[i] instead (PageCopyBytes bytes, K then V, as a
// staging page; e.g. a page of the host tier read in place) and `staging` is ignored: the array
// and every page it points to must be AllocateHost memory, unchanged until the op completes.
struct PageCopyParams {
  const void* staging = nullptr;          // AllocateHost memory, staging_bytes long
  size_t staging_bytes = 0;
  const void* const* sources = nullptr;   // AllocateHost memory: [num_pages], or null
  const int32_t* slots = nullptr;         // AllocateHost memory: [num_pages], in [0, num_slots)
  int num_pages = 0;
  TensorView k_pool;                      // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3
  TensorView v_pool;                      // same shape and dtype as k_pool
  int32_t* table = nullptr;               // backend memory: [table_size] int32; may be null
  int64_t table_size = 0;                 //   when num_table_updates == 0
  const int32_t* table_index = nullptr;   // AllocateHost memory: [num_table_updates]
  const int32_t* table_value = nullptr;   // AllocateHost memory: [num_table_updates]
  int num_table_updates = 0;
};

// Bytes of one staging page of PageCopyParams: 2 * page_size * head_dim * sizeof(dtype).
inline size_t PageCopyBytes(int64_t page_size, int64_t head_dim, DType dtype) {
  return static_cast<size_t>(2 * page_size * head_dim) * DTypeSize(dtype);
}

// ---- Device-resident sparse selection (DESIGN.md section 3; engine/sparse/policy.h) ----------
// These ops run the stages of the sparse policies' selection on backend memory so that a decode
// step needs no host round trip (and, on CUDA, can be captured in a graph): score page or segment
// summaries (Quest minmax bound), score candidate keys (TokenSelect), soft-vote the query heads of
// each KV head and keep the top k, and attend over the selection. Each stage's output feeds the
// next through a CandidateList. The CPU twins are in kernels/cpu/selection.cc (the specification);
// the CUDA ones in kernels/cuda/selection.cu and kernels/cuda/attention.cu.

// The candidates of each KV head, described by values in backend memory. Candidate i
// (0 <= i < Count()) of KV head g has the id
//   parents.data == nullptr:  begin + i
//   otherwise:                parents[g, i / fanout] * fanout + i % fanout
// and is *invalid* when its parent is negative or its id is outside [begin, end). Examples: the
// pages of the top segments (parents = segment ids, fanout = pages per segment, [begin, end) = the
// middle's pages); the tokens of the top pages (fanout = page size, range = the middle's tokens);
// a token list (fanout 1).
struct CandidateList {
  TensorView parents;   // [num_kv_heads, num_parents] i32, or data == nullptr (a plain range)
  int fanout = 1;       // >= 1
  int64_t begin = 0;    // valid ids are [begin, end)
  int64_t end = 0;
  int64_t Count() const { return parents.data != nullptr ? parents.dim(1) * fanout : end - begin; }
};

// Quest scores of minmax summaries (one row per page or segment): for KV head g, query head
// h = g * group + j (group = num_q_heads / num_kv_heads) and candidate i with id c,
//   scores[g, j, i] = sum_e max(v_e * min[g, c, e], v_e * max[g, c, e]),  v = scale * q[h]
// (the upper bound of scale * q.k over the keys summarised), or -inf when i is invalid or
// c >= num_items. bf16 summaries take half the bytes; rounded outward (min toward -inf, max toward
// +inf: engine::MinMaxSummariesToBf16) they still bound every key, a little more loosely.
struct ScoreSummariesParams {
  TensorView q;           // [num_q_heads, head_dim] f32
  TensorView summaries;   // [num_kv_heads, num_items, 2 * head_dim] f32|bf16: per-channel min, then max
  CandidateList candidates;
  float scale = 0.0f;
  TensorView scores;      // [num_kv_heads, group, candidates.Count()] f32
  // Optional, backend memory: [num_kv_heads] i32 (e.g. SelectionCacheCheckParams::reuse). A KV
  // head g with skip_heads[g] != 0 is left untouched: its rows of the outputs keep the values they
  // had (the previous step's). nullptr = every head is computed.
  const int32_t* skip_heads = nullptr;
};

// Key scores (TokenSelect): candidate ids are token positions; token t of KV head g is row
// page_table[g, t / page_size] * page_size + t % page_size of the pool, and
//   scores[g, j, i] = (scale * q[g * group + j]) . k_row
// or -inf when i is invalid, t / page_size >= table_pages or the slot is outside the pool.
struct ScoreKeysParams {
  TensorView q;           // [num_q_heads, head_dim] f32
  TensorView k_pool;      // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3 (stored values)
  TensorView page_table;  // [num_kv_heads, table_pages] i32: pool slot of each logical page
  CandidateList candidates;
  float scale = 0.0f;
  TensorView scores;      // [num_kv_heads, group, candidates.Count()] f32
  // Optional, backend memory: [num_kv_heads] i32 (e.g. SelectionCacheCheckParams::reuse). A KV
  // head g with skip_heads[g] != 0 is left untouched: its rows of the outputs keep the values they
  // had (the previous step's). nullptr = every head is computed.
  const int32_t* skip_heads = nullptr;
};

// Head soft vote and top-k, per KV head g (engine/sparse's SoftVote):
//   vote[i] = sum_j softmax_i(scores[g, j, :])[i]   (a head whose scores are all -inf adds 0).
// Candidate i is valid when candidates says so and some head's score is not -inf (NaN counts as
// -inf). Ranking is by vote (its 24-bit rank key, kernels/vote_rank.h), descending, ties to the
// lower index. selected[g, :] holds the ids of
// the (at most k) best valid candidates in ascending index order, then -1 up to k.
// Whether `parts` is a valid count of independent selection parts (VoteTopKParams::partitions,
// SelectStagesParams::partitions, PolicyOptions::tokenselect_partitions): a power of two in
// [1, 64].
inline bool ValidPartitions(int64_t parts) { return parts >= 1 && parts <= 64 && (parts & (parts - 1)) == 0; }

struct VoteTopKParams {
  TensorView scores;      // [num_kv_heads, group, n] f32 (n = candidates.Count())
  CandidateList candidates;
  int64_t k = 0;          // >= 0
  TensorView selected;    // [num_kv_heads, k] i32 (output)
  TensorView vote;        // [num_kv_heads, n] f32 (output), or data == nullptr
  // Optional, backend memory: [num_kv_heads] i32 (e.g. SelectionCacheCheckParams::reuse). A KV
  // head g with skip_heads[g] != 0 is left untouched: its rows of the outputs (selected, vote) keep the values they
  // had (the previous step's). nullptr = every head is computed.
  const int32_t* skip_heads = nullptr;
  // Independent parts P (a power of two, 1 to 64; k a multiple of P, and with parents their count
  // too). With P > 1 the candidates of each KV head split into P parts and part j keeps its own
  // k / P best, ranked as above by the soft vote over the part's candidates alone (each query
  // head's softmax taken over the part), in selected[g, j * k / P, (j + 1) * k / P): its ids in
  // ascending index order, then -1. Candidate i of a plain range is in part (begin + i) % P (ids
  // dealt in turn, so each part spans the whole range); with parents, in part (i / fanout) /
  // (num_parents / P): the children of parents [j * num_parents / P, (j + 1) * num_parents / P),
  // which is part j of a partitioned selection before it. vote, when set, is the part's vote.
  int partitions = 1;
};

// Minmax summaries (the input of ScoreSummaries) kept up to date on the backend as keys arrive.
// For KV head g, page p holds tokens [p * P, (p + 1) * P) (P = page_size) read from pool row
// page_table[g, p] * P + t % P. After tokens [first, end) were appended, every page holding one of
// them gets its row recomputed from the keys of its tokens below `end`: per-channel min, then
// max (a page none of whose tokens can be read, its slot being outside the pool, gets zeros); and
// every segment (segment_pages consecutive pages) holding such a page gets the elementwise min /
// max of the rows of its pages below ceil(end / P). bf16 rows are rounded outward (min toward
// -inf, max toward +inf; F32ToBF16Directed), which is exact for a bf16 pool.
struct UpdateSummariesParams {
  TensorView k_pool;      // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3 (stored values)
  TensorView page_table;  // [num_kv_heads, table_pages] i32, table_pages * P >= end
  int64_t first = 0;      // 0 <= first <= end
  int64_t end = 0;
  TensorView pages;       // [num_kv_heads, max_pages >= ceil(end / P), 2 * head_dim] f32|bf16 (in/out)
  TensorView segments;    // [num_kv_heads, max_segments, 2 * head_dim], pages' dtype (in/out), or null data
  int segment_pages = 1;  // >= 1
};

// Decode attention (one query token) over a device-resident selection. KV head g attends to the
// tokens [0, prefix_end), the valid ids of `middle` and [suffix_begin, suffix_end), each token t
// read from pool row page_table[g, t / page_size] * page_size + t % page_size; tokens whose page is
// outside the table or whose slot is outside the pool are skipped. The caller keeps the three sets
// disjoint (a token listed twice is attended twice). Math, out and lse as PagedAttention (out 0
// and lse -inf when nothing is attended); no causal mask (list only tokens the query may see).
// Middle ids are clipped: an id outside [middle.begin, middle.end) is invalid (CandidateList) and
// skipped, so a selection made for an earlier, wider middle (a reused selection, see
// SelectionCacheCheckParams) attends exactly its ids inside the current middle (for page parents:
// the page's tokens inside it), as the host policy's ClipRanges does for token ids.
struct SelectedAttentionParams {
  TensorView q;           // [1, num_q_heads, head_dim] f32
  TensorView k_pool;      // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3
  TensorView v_pool;      // same shape and dtype as k_pool
  TensorView page_table;  // [num_kv_heads, table_pages] i32
  int64_t prefix_end = 0;
  CandidateList middle;
  int64_t suffix_begin = 0;
  int64_t suffix_end = 0;
  float scale = 0.0f;
  TensorView out;         // [1, num_q_heads, head_dim] f32
  TensorView lse;         // [1, num_q_heads] f32
  // Optional, backend memory (one int32): when set, the prefix is
  // [0, min(prefix_end, *prefix_len)) (a negative value: no prefix token), the value read when the
  // op runs, in stream order. The launch shape then depends on prefix_end (the bound) only, so
  // one call can be captured in a CUDA graph and replayed as the value changes: e.g. the dense
  // decode step over an engine::KvCache, prefix_end = its capacity, *prefix_len = its length,
  // page_table[g, p] = its SlotOf(layer, g, p).
  const int32_t* prefix_len = nullptr;
  // Dequantisation scales of fp8 pools, as PagedAttentionParams (finite, > 0; 1 for f32|bf16).
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  // Optional, backend memory [num_slots, 2] f32, fp8 pools only: per-slot dequantisation scales
  // (K, V), multiplied into k_scale / v_scale for the rows of that slot: k_j = stored * k_scale *
  // slot_scales[2 * slot_j], v_j = stored * v_scale * slot_scales[2 * slot_j + 1] (slot_j = the
  // pool slot token j is read from). For pools filled with pages that carry their own scales (the
  // kvstore fp8 page format, through ResolvePages with page_scales). nullptr = none. Each value
  // must be finite and > 0 (not checked: read on the device). InvalidArgument with f32|bf16 pools.
  const float* slot_scales = nullptr;
};

// The selection cache (TokenSelect's query-similarity reuse; engine/sparse/policy.h cache_theta),
// per KV head g with q_g = q[g * group : (g + 1) * group, :] flattened ([group * head_dim]):
//   hit = valid[g] != 0 && cos(q_g, cached_q[g]) >= theta
// where cos = q.c / sqrt(|q|^2 |c|^2) (0 when either norm is 0; NaN is not a hit). Then
//   reuse[g] = hit ? 1 : 0;  if !hit: cached_q[g] = q_g and valid[g] = 1;  if hit_count: += hits.
// The caller runs its selection with skip_heads = reuse right after, so a head that missed selects
// (and its new selection belongs to the query just cached) and a head that hit keeps last step's
// selection. valid = 0 (e.g. zeroed by CopyToDevice) forces the next call to select. Reads and
// writes backend memory only (capturable in a CUDA graph). The CPU twin accumulates in double;
// CUDA in double too, in another order, and compares squares (q.c and theta^2 |q|^2 |c|^2, by
// sign) instead of dividing: a cosine within ~1e-12 of theta may go either way.
struct SelectionCacheCheckParams {
  TensorView q;                  // [num_q_heads, head_dim] f32
  TensorView cached_q;           // [num_kv_heads, group * head_dim] f32 (in/out)
  TensorView valid;              // [num_kv_heads] i32 (in/out)
  float theta = 0.9f;            // finite
  TensorView reuse;              // [num_kv_heads] i32 (output)
  // Optional, backend memory: one int64 incremented by the number of hits of the call.
  int64_t* hit_count = nullptr;
};
// The cosine above over n host floats, as the CPU twin computes it (double accumulation; 0 when a
// norm is 0; NaN when an input is). For host-side twins of the cache (engine::MakeMinMaxChooser).
double SelectionCacheCosine(const float* q, const float* cached, int64_t n);

// A chain of selection stages as one op (a decode step's middle selection: segments -> pages ->
// tokens). Stage s scores its candidates, as ScoreSummaries over `summaries` or, when
// summaries.data is null, as ScoreKeys over `k_pool` through `page_table`, into `scores`, then
// keeps the top k by head soft vote into `selected` as VoteTopK does (no vote output). Stage
// s > 0's candidates must be stage s - 1's selection: candidates.parents is a view of stage s - 1's
// `selected` (same data, [num_kv_heads, k of s - 1]); fanout and [begin, end) are the stage's.
// The result is that of those ScoreSummaries / ScoreKeys and VoteTopK calls in order with the
// same params (SelectStagesOpByOp, the default), except that `scores` is scratch: its contents
// afterwards are unspecified. skip_heads as in those ops. The CUDA backend runs the whole chain as
// one kernel where the shape allows (kernels/cuda/selection.cu SelectStagesKernel), which merges
// the softmax statistics of the vote in another order: as between VoteTopK kernels, a vote may
// differ in the last bits, so a near-tie at the k-th place may go the other way.
inline constexpr int kMaxSelectStages = 3;
struct SelectStage {
  TensorView summaries;   // ScoreSummaries' summaries, or data == nullptr for a key stage
  TensorView k_pool;      // key stage: ScoreKeys' k_pool and page_table
  TensorView page_table;
  CandidateList candidates;
  int64_t k = 0;          // >= 0
  TensorView scores;      // [num_kv_heads, group, candidates.Count()] f32 (scratch)
  TensorView selected;    // [num_kv_heads, k] i32 (output)
};
struct SelectStagesParams {
  TensorView q;           // [num_q_heads, head_dim] f32
  float scale = 0.0f;
  SelectStage stages[kMaxSelectStages];
  int num_stages = 0;     // 1 to kMaxSelectStages
  const int32_t* skip_heads = nullptr;
  // Optional: the decode step's attention over the selection. When set, the op then runs
  // SelectedAttention(*attend) in stream order (skip_heads does not apply to it: a skipped head
  // attends the selection it kept), with the same result as that call after this op;
  // attend->middle.parents is normally the last stage's `selected`. attend's params are checked
  // first (CpuSupportsSelectedAttention, by SelectStagesOpByOp and the CUDA kernel path; none of
  // its checks depends on the stages' results): params it refuses fail the op with its error
  // (e.g. InvalidArgument) before any stage runs, and nothing is written; CUDA's own limits of the separate op (Unimplemented)
  // are checked where it runs, after the stages. The CUDA backend runs it in the selection's
  // kernel where the shape allows (the middle the last stage's selection, the stages' q and
  // scale, bf16 or fp8 pools (fp8: every key stage's pool fp8 too), head_dim 128, no prefix_len
  // or slot_scales, a bounded share of positions per block; kernels/cuda/selection.cu), else as
  // the separate op.
  const SelectedAttentionParams* attend = nullptr;
  // Every stage's top-k in P independent parts (VoteTopKParams::partitions; each stage's k a
  // multiple of P): stage s > 0's part j is the children of stage s - 1's part j, so the chain
  // selects P disjoint parts of the middle, each from its own candidates. 1 = one part.
  int partitions = 1;
  // Optional, for the attention in parts (partitions > 1 with attend): a 4-byte aligned i32
  // [num_kv_heads] view of backend memory that is zero before the call and that the call leaves
  // zero (any other view: InvalidArgument). The CUDA
  // kernel's blocks count their arrivals there, so that the last one of each KV head merges the
  // parts' partial outputs (without it a second kernel merges them, ~1 us more per call on the
  // H200). Calls that may run at the same time (other streams) must not share one. Unused by
  // the CPU backend.
  TensorView arrivals;
  // Optional: the selection cache's check of this call's query first (cache_check->q the same
  // data as q; skip_heads then null): the op is SelectionCacheCheck(*cache_check) followed by
  // this op with skip_heads = cache_check->reuse, in stream order (SelectStagesAfterCacheCheck).
  // Every op's params are checked before the check writes the cache's state, so params refused
  // fail the op with nothing written. The CUDA backend runs it inside the partitioned kernel
  // where that kernel attends with arrivals (every block of a KV head computes the same cosine;
  // the head's last block to arrive updates the cache's state) and inside the one-part cluster
  // kernel for quest's form and the page chooser's (block 0 of each KV head's cluster updates
  // it), elsewhere as its own op first, as the CPU backend does
  // (STRATA_SELECT_CHECK_IN_KERNEL=0: always as its own op).
  const SelectionCacheCheckParams* cache_check = nullptr;
};

// ---- The GPU page cache on the device (kvstore/gpu_cache.h, device-managed mode) -------------
// The whole state of a page cache in backend memory, so that a decode step makes the pages its
// selection names resident with no host round trip (and can be captured in a CUDA graph).
// Pages have flat indices in [0, table_size) (kvstore::GpuPageCache: (layer * num_kv_heads +
// kv_head) * pages_per_head + page); slots are [0, num_slots). Every pointer is backend memory
// except `sources`' targets (see below). The CPU twin is kernels/cpu/page_cache.cc.
struct PageCacheState {
  int32_t* table = nullptr;        // [table_size]: the slot holding each page, or -1
  int64_t table_size = 0;
  int32_t* slot_page = nullptr;    // [num_slots]: the page (flat index) in each slot, or -1
  uint32_t* slot_stamp = nullptr;  // [num_slots]: the last call (counters[kEpoch]) that pinned it
  uint8_t* slot_ref = nullptr;     // [num_slots]: clock reference bits
  int64_t num_slots = 0;
  int64_t* counters = nullptr;     // [PageCacheCounter::kCount], see below
  // One call's misses: [1 + 2 * scratch_pages] int32 (count, pages, victims). A call with more
  // distinct misses than scratch_pages leaves the rest unresolved.
  int32_t* scratch = nullptr;
  int64_t scratch_pages = 0;
  // [table_size]: the address of each page's bytes (K [page_size, head_dim] then V, the pools'
  // dtype, as a PageCopy staging page), readable by the backend: AllocateHost memory on CUDA
  // (read through the host mapping over PCIe; its device address must equal its host address).
  const void* const* sources = nullptr;
  TensorView k_pool;  // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3
  TensorView v_pool;  // same shape and dtype
  // Optional, for pages with scales of their own (fp8 pages of the kvstore page format): the
  // (K, V) scale pair of each page, [table_size, 2] f32, and of each slot, [num_slots, 2] f32
  // (SelectedAttentionParams::slot_scales). A fill also copies its page's pair into its slot's.
  // Both or neither.
  const float* page_scales = nullptr;
  float* slot_scales = nullptr;
};

// The int64 counters of PageCacheState, running totals since they were zeroed.
enum PageCacheCounter : int {
  kPageCacheEpoch = 0,     // ResolvePages calls (the stamp of the current call)
  kPageCacheHand = 1,      // the clock hand, in [0, num_slots)
  kPageCacheLookups = 2,   // distinct pages named, per call
  kPageCacheHits = 3,      // of which resident when the call began
  kPageCacheFills = 4,     // pages copied into slots
  kPageCacheEvictions = 5, // resident pages replaced
  kPageCacheUnresolved = 6,  // misses left without a slot (every slot pinned, or scratch full)
  kPageCacheCounterCount = 7,
};

// Makes resident the pages of one layer that a selection names, as one stream-ordered op: for
// KV head g, the pages t / page_size (those < pages_per_head) of the tokens SelectedAttention
// would attend with the same prefix_end / middle / suffix (kernels/backend.h
// SelectedAttentionParams; no prefix_len), flat index table_base + g * pages_per_head + page.
// Afterwards state.table maps every such page to a slot holding its bytes (except unresolved
// ones), so a SelectedAttention queued after it over the table rows of the layer reads them.
// Semantics (the CPU twin, in this order):
//   1. epoch = ++counters[kEpoch]. Each distinct page named counts one lookup; a resident one
//      (table[page] = s >= 0) counts a hit and gets slot_stamp[s] = epoch (pinned for this call)
//      and slot_ref[s] = 1; the others are the misses.
//   2. Each miss takes the next victim of the clock: the hand passes slots in order from
//      counters[kHand] (wrapping); a slot with slot_stamp = epoch is skipped, a slot with its
//      reference bit set has it cleared and is passed, the first other slot is the victim (the
//      hand stops just past it). After 2 * num_slots slots passed without a victim, the misses
//      left are unresolved (counted; their table entries stay -1). A victim's old page (if any)
//      gets table entry -1 (an eviction); the victim gets the miss: table, slot_page, stamp =
//      epoch, ref = 1, and its K and V bytes copied from sources[page] (a fill).
// Every backend follows these steps exactly (the CUDA kernel orders its misses by naming order
// with a scan), so the state after a call is the same bit for bit. Reads and writes backend
// memory only (capturable in a CUDA graph; no host wait).
struct ResolvePagesParams {
  PageCacheState state;
  int64_t table_base = 0;      // flat index of (layer, head 0, page 0); rows within table_size
  int num_kv_heads = 0;
  int64_t pages_per_head = 0;
  int page_size = 0;           // tokens per page (the pools' dim(1))
  int64_t prefix_end = 0;
  CandidateList middle;
  int64_t suffix_begin = 0;
  int64_t suffix_end = 0;
};

// ---- Token sampling on the backend (engine/sampler.h; kernels/cpu/sampling.cc) --------------
// Per-row sampling options, in backend memory. The semantics are engine::Sampler's exactly
// (engine/sampler.h), with the uniform draw supplied by the caller: temperature 0 (or NaN,
// negative, infinite) is greedy and ignores u; otherwise u is the caller's
// Pcg32::NextUniform() for this step (draw it only for rows with temperature > 0, as
// engine::Sampler does, so the random stream stays the same). Out-of-range options are clamped as
// engine::Sampler's constructor clamps them (top_k < 0 -> 0; top_p NaN/<= 0 -> 1e-9, > 1 -> 1).
struct SampleRow {
  double temperature = 0.0;
  double top_p = 1.0;
  double u = 0.0;     // in [0, 1)
  int64_t top_k = 0;  // 0 = no limit
};

// tokens[r] = the token engine::Sampler picks from logits[r, :] with rows[r]'s options and u.
// NaN and -inf logits are never picked; a row whose logits are all NaN / -inf gets -1 (where
// engine::Sampler returns InvalidArgument). The CPU twin matches engine::Sampler bit for bit; the
// CUDA one sums probabilities in another order, so it can differ only where u * mass or top_p
// falls within double rounding of a cumulative probability.
struct SampleParams {
  TensorView logits;               // [num_rows, vocab] f32, vocab in [1, 2^31)
  const SampleRow* rows = nullptr; // backend memory: [num_rows]
  TensorView tokens;               // [num_rows] i32 (output)
};

// Appends the keys and values of n tokens to the pools of one layer laid out as engine::KvCache
// does: token i (position first + i) of KV head g goes to row (first + i) % page_size of slot
// g * slots_per_head + (first + i) / page_size, converted from f32 to the pool dtype exactly as
// kernels::ConvertFromF32 does (bf16: round to nearest even). Stream-ordered, no host copy.
// InvalidArgument for mismatched shapes or a slot outside the pools.
struct AppendKvParams {
  TensorView k;               // [n, num_kv_heads, head_dim] f32, backend memory
  TensorView v;               // same shape
  TensorView k_pool;          // [num_slots, page_size, head_dim] f32|bf16|fp8_e4m3
  TensorView v_pool;          // same shape and dtype as k_pool
  int64_t first = 0;          // position of token 0 (>= 0)
  int64_t slots_per_head = 0; // slots of KV head g start at g * slots_per_head
  // Optional, backend memory (one int32): when set, the position of token 0 is *first_device,
  // read when the op runs (so the launch can be captured in a CUDA graph and replayed), and
  // `first` is the largest value it may take (the checks above use it); when the value is
  // negative or above `first`, nothing is written.
  const int32_t* first_device = nullptr;
  // fp8 pools: k / k_scale and v / v_scale are stored (F32ToFP8E4M3 of the f32 quotient).
  // Finite and > 0; must stay 1 for f32|bf16 pools.
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  // Optional rotary embedding, when rope.inv_freq.data is set ([head_dim / 2] f32): the keys are
  // appended rotated as Backend::Rope rotates them at rope.positions[t] (backend memory, one per
  // token; k itself is left as it is), and rope.x, when its data is set ([n, heads', head_dim]
  // f32: the same tokens' queries), is rotated in place, whether or not first_device lets the
  // append write. One op for the decode step's Rope and KV append.
  RopeParams rope;
};

// The fp8 e4m3 encoding of persisted KV pages (the payload and scales of kvstore/page_format.h)
// and the minmax summary of their keys as stored, read from bf16 pool pages of one layer. Item
// (g, j), g < num_heads, j < count, at index g * count + j, is the page in slot
// first_slot + g * head_slot_stride + j of k_pool / v_pool; its first `valid` rows count (P for
// every item but each head's last, which has last_valid) and the rest read as 0. For K (and V):
//   scale = amax / 448 over the page's P x d values, or 1 when amax is 0, infinite or NaN;
//   codes = F32ToFP8E4M3(x / scale) for every row (rows past valid: 0);
//   summary (K only) = per channel the min, then the max, over the valid rows of
//     FP8E4M3ToF32(code) * scale, compared as std::min / std::max do (NaN never wins).
// Bit for bit kvstore::EncodePage's bytes and the worker's summary of them. InvalidArgument for
// mismatched shapes or a slot outside the pools.
struct EncodeFp8PagesParams {
  TensorView k_pool;               // [num_slots, page_size, head_dim] bf16
  TensorView v_pool;               // same shape and dtype
  int64_t first_slot = 0;
  int64_t head_slot_stride = 0;
  int num_heads = 0;
  int64_t count = 0;               // pages per head
  int last_valid = 0;              // 1..page_size
  TensorView codes;                // [num_heads * count, 2, page_size, head_dim] fp8_e4m3: K, V
  TensorView scales;               // [num_heads * count, 2] f32: K, V
  TensorView summaries;            // [num_heads * count, 2 * head_dim] f32: min, max
};

// A recorded sequence of ops (a CUDA graph), from Backend::EndCapture. Replay runs the recorded
// ops again on stream `s` with the same views and params: values read from backend memory (ids,
// positions, lengths passed by pointer) are read anew, host values are those of the capture.
// Replay is queued on `s` and does not wait for it. Destroy it before the backend.
class Graph {
 public:
  virtual ~Graph() = default;
  virtual absl::Status Replay(Stream s) = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:<device>".
  virtual std::string Name() const = 0;

  // Memory. Allocate returns ResourceExhausted when the memory is not there.
  virtual absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream s) = 0;
  // Waits for all work queued on `s`.
  virtual absl::Status Synchronize(Stream s) = 0;
  // A stream of its own for work independent of the default stream's (ops queued on it run in
  // order; Synchronize(s) waits for them); the caller destroys it with DestroyStream before the
  // backend. Default: the default stream (nullptr) and a destroy that does nothing, for backends
  // that run each op as it is called.
  virtual absl::StatusOr<Stream> CreateStream() { return Stream(nullptr); }
  virtual absl::Status DestroyStream(Stream s) { return absl::OkStatus(); }
  // Host memory the device can read directly (PageCopy staging): pinned and mapped on CUDA
  // (cudaHostAlloc), plain memory on the CPU. ResourceExhausted when not available.
  virtual absl::StatusOr<std::unique_ptr<Buffer>> AllocateHost(size_t bytes) = 0;
  // Copies that do not wait: queued on `s` after the work queued there before (capturable on
  // CUDA). The host side (src of CopyToDeviceAsync, dst of CopyToHostAsync) should be AllocateHost
  // memory; the caller leaves src unchanged, and reads dst only, once a mark recorded after the
  // copy has been waited for. Default: the waiting copies above.
  virtual absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, Stream s) {
    return CopyToDevice(dst, src, bytes, s);
  }
  virtual absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream s) {
    return CopyToHost(dst, src, bytes, s);
  }
  // A point in the work queued on `s`: WaitMark(mark) returns once everything queued on `s`
  // before RecordMark(s) is done, and ends the mark (each mark is waited for once; a mark never
  // waited for is released with the backend). InvalidArgument for a mark that is not pending.
  // Default: RecordMark waits for `s` itself (for backends whose ops may run later) and returns 0,
  // which WaitMark accepts at once.
  virtual absl::StatusOr<int64_t> RecordMark(Stream s) {
    absl::Status st = Synchronize(s);
    if (!st.ok()) return st;
    return int64_t{0};
  }
  virtual absl::Status WaitMark(int64_t mark) {
    return mark == 0 ? absl::OkStatus() : absl::InvalidArgumentError("WaitMark: not a mark");
  }

  virtual absl::Status Supports(const EmbeddingParams& p) const = 0;
  virtual absl::Status Embedding(const EmbeddingParams& p, Stream s) = 0;
  virtual absl::Status Supports(const RmsNormParams& p) const = 0;
  virtual absl::Status RmsNorm(const RmsNormParams& p, Stream s) = 0;
  virtual absl::Status Supports(const MatMulParams& p) const = 0;
  virtual absl::Status MatMul(const MatMulParams& p, Stream s) = 0;
  virtual absl::Status Supports(const RopeParams& p) const = 0;
  virtual absl::Status Rope(const RopeParams& p, Stream s) = 0;
  virtual absl::Status Supports(const SwiGluParams& p) const = 0;
  virtual absl::Status SwiGlu(const SwiGluParams& p, Stream s) = 0;
  virtual absl::Status Supports(const AddParams& p) const = 0;
  virtual absl::Status Add(const AddParams& p, Stream s) = 0;
  virtual absl::Status Supports(const PagedAttentionParams& p) const = 0;
  virtual absl::Status PagedAttention(const PagedAttentionParams& p, Stream s) = 0;
  virtual absl::Status Supports(const MergeAttentionParams& p) const = 0;
  virtual absl::Status MergeAttention(const MergeAttentionParams& p, Stream s) = 0;

  // Device-resident sparse selection (see above). Backends without them return Unimplemented.
  virtual absl::Status ScoreSummaries(const ScoreSummariesParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": ScoreSummaries");
  }
  virtual absl::Status ScoreKeys(const ScoreKeysParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": ScoreKeys");
  }
  virtual absl::Status VoteTopK(const VoteTopKParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": VoteTopK");
  }
  virtual absl::Status SelectedAttention(const SelectedAttentionParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": SelectedAttention");
  }
  virtual absl::Status UpdateSummaries(const UpdateSummariesParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": UpdateSummaries");
  }
  virtual absl::Status SelectionCacheCheck(const SelectionCacheCheckParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": SelectionCacheCheck");
  }
  // Default: SelectStagesOpByOp (below).
  virtual absl::Status SelectStages(const SelectStagesParams& p, Stream s);
  // The GPU page cache on the device (above). Backends without it return Unimplemented.
  virtual absl::Status ResolvePages(const ResolvePagesParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": ResolvePages");
  }
  // Token sampling (above). Backends without it return Unimplemented.
  virtual absl::Status Supports(const SampleParams& p) const {
    return absl::UnimplementedError(Name() + ": Sample");
  }
  virtual absl::Status Sample(const SampleParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": Sample");
  }
  virtual absl::Status Supports(const PageCopyParams& p) const = 0;
  virtual absl::Status PageCopy(const PageCopyParams& p, Stream s) = 0;
  // KV append on the device (above). Backends without it return Unimplemented (engine::KvCache
  // then appends through host copies).
  virtual absl::Status AppendKv(const AppendKvParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": AppendKv");
  }
  // Persisted fp8 page encoding (above). Backends without it return Unimplemented (the worker then
  // copies bf16 pages to the host and encodes them there).
  virtual absl::Status EncodeFp8Pages(const EncodeFp8PagesParams& p, Stream s) {
    return absl::UnimplementedError(Name() + ": EncodeFp8Pages");
  }

  // Graph capture (the one-token decode step, engine::TransformerOptions::decode_graph). Between
  // BeginCapture(s) and EndCapture(s) the ops queued on `s` by this thread are recorded instead
  // of run; ops that wait for the stream (Copy*, Synchronize) fail during a capture and make
  // EndCapture fail too. Other threads' ops are neither recorded nor disturbed: on CUDA, a capture
  // of the default stream (nullptr) records on a private stream that stands in for it in the
  // capturing thread only. EndCapture must follow every successful BeginCapture. Backends without
  // graphs return Unimplemented.
  virtual absl::Status BeginCapture(Stream s) {
    return absl::UnimplementedError(Name() + ": BeginCapture");
  }
  virtual absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream s) {
    return absl::UnimplementedError(Name() + ": EndCapture");
  }

  // Concurrent branches of one stream's work (and of a captured graph). ForkStream(s) returns a
  // stream whose ops start after everything queued on `s` so far and may run beside the ops
  // queued on `s` afterwards; JoinStream(side, s) makes the ops queued on `s` afterwards wait for
  // everything queued on `side`, and ends the fork (`side` must not be used after it). Every fork
  // must be joined, on its error paths too, before `s` is synchronized or its capture ends.
  // Default (the CPU backend): `s` itself and nothing to join, so the ops run in order.
  virtual absl::StatusOr<Stream> ForkStream(Stream s) { return s; }
  virtual absl::Status JoinStream(Stream side, Stream s) { return absl::OkStatus(); }
};

// Backend::SelectStages as the calls it stands for: checks the chain (1 to kMaxSelectStages
// stages; stage s > 0's candidates.parents the data and shape of stage s - 1's selected;
// InvalidArgument otherwise), then per stage ScoreSummaries or ScoreKeys and VoteTopK on `b`,
// then SelectedAttention(*attend) when set, returning the first error. attend's params are
// checked (CpuSupportsSelectedAttention) before any stage runs, so an attention those checks
// refuse writes nothing; a refusal of `b`'s own (e.g. Unimplemented) comes after the stages.
absl::Status SelectStagesOpByOp(Backend& b, const SelectStagesParams& p, Stream s);
// The chain checks of SelectStagesOpByOp alone (the ops check the rest).
absl::Status CheckSelectStagesChain(const SelectStagesParams& p);
// Every stage's op params as the ops one by one check them (the CpuSupports* twins of
// ScoreSummaries or ScoreKeys, then VoteTopK, stage by stage), for a backend that runs the stages
// otherwise and must refuse what they refuse, with the same error, before writing anything.
absl::Status CheckSelectStagesOps(const SelectStagesParams& p);
// SelectStages with p.cache_check set, on any backend: the check's params and every op's params
// of the stages and the attention (the CpuSupports* twins) checked, then b.SelectionCacheCheck,
// then b.SelectStages of p with the check's reuse flags as skip_heads and no cache_check.
absl::Status SelectStagesAfterCacheCheck(Backend& b, const SelectStagesParams& p, Stream s);
// The params of the ops stage i of p stands for (SelectStagesOpByOp's calls): ScoreSummaries
// (summaries.data set) or ScoreKeys, then VoteTopK (no vote output).
ScoreSummariesParams StageScoreSummariesParams(const SelectStagesParams& p, int i);
ScoreKeysParams StageScoreKeysParams(const SelectStagesParams& p, int i);
VoteTopKParams StageVoteTopKParams(const SelectStagesParams& p, int i);

// The CPU reference backend. `num_threads` <= 0 means all cores (OpenMP default).
std::unique_ptr<Backend> MakeCpuBackend(int num_threads = 0);

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_BACKEND_H_
