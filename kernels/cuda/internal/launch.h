// Host-side entry points of the CUDA kernels in kernels/cuda/*.cu (private to kernels/cuda).
//
// Each LaunchFoo enqueues its kernel(s) on `stream` and returns the launch status
// (cudaGetLastError() after the launch); it never synchronises and never allocates. Arguments are
// plain device pointers and sizes (no Abseil or backend headers here, so the .cu files compile
// quickly); CudaBackend (cuda_backend.cc) validates params before calling any of them. Every
// pointer named "device" points at device memory of the current device.
//
// Thread-safety: stateless; concurrent launches on different streams are fine.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_LAUNCH_H_
#define STRATA_KERNELS_CUDA_INTERNAL_LAUNCH_H_

#include <cstdint>

#include <cublas_api.h>
#include <cuda_runtime_api.h>

namespace strata::kernels::cuda_internal {

// Element type of a float tensor read by a kernel (mirrors kernels::DType's float members).
// kFP8E4M3 (OCP e4m3fn) is read by the attention and selection kernels (KV pools, kernels/backend.h).
enum class FloatType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kFP8E4M3 = 3 };

// ---- embedding.cu --------------------------------------------------------------------------
// out[i, :] = f32(table[ids[i], :]); rows whose id is outside [0, vocab) are filled with NaN
// (the ids live in device memory, so they cannot be checked on the host without a sync).
cudaError_t LaunchEmbedding(const int32_t* ids, const void* table, FloatType table_type,
                            int64_t vocab, int64_t hidden, float* out, int64_t num_tokens,
                            cudaStream_t stream);

// ---- rms_norm.cu ---------------------------------------------------------------------------
// out may alias in; residual (nullptr: none) is added to in first (in is written).
cudaError_t LaunchRmsNorm(float* in, const float* residual, const void* weight,
                          FloatType weight_type, float* out, int64_t num_tokens, int64_t hidden,
                          float eps, cudaStream_t stream);

// ---- matmul.cu -----------------------------------------------------------------------------
// Outcome of LaunchMatMul: the first CUDA or cuBLAS error and where it happened.
struct GpuResult {
  cudaError_t cuda = cudaSuccess;
  cublasStatus_t blas = CUBLAS_STATUS_SUCCESS;
  const char* file = nullptr;
  int line = 0;
  bool ok() const { return cuda == cudaSuccess && blas == CUBLAS_STATUS_SUCCESS; }
};

// Tokens up to which bf16/f16 weights take the GEMV kernel (f32 activations used exactly,
// weights read once at their storage width); above it they take cuBLAS (see LaunchMatMul).
inline constexpr int64_t kGemvMaxTokens = 8;

// Bytes of device scratch LaunchMatMul needs for these operands (0 when it needs none: f32
// weights, the GEMV kernels, and the tensor-core GEMVs of 2..16 tokens (1..16 for fp8 weights),
// which read the f32 activations themselves).
int64_t MatMulScratchBytes(FloatType weight_type, int64_t num_tokens, int64_t in_features,
                           int64_t out_features, bool round_activations, const void* weight,
                           const float* in);

// out[n, o] = sum_i in[n, i] * weight[o, i] (+ bias[o]), f32 accumulation (in_features 0:
// out = bias or 0).
//  - f32 weights: cublasGemmEx in f32 (CUBLAS_COMPUTE_32F, no TF32).
//  - bf16/f16 weights, num_tokens <= kGemvMaxTokens: a GEMV kernel, f32 activations.
//  - bf16/f16 weights, more tokens: the activations are split into hi + lo in the weight's
//    type (x = hi + lo to ~16 significant bits) and two cublasGemmEx calls accumulate
//    W·hi + W·lo in f32 (f16: activations beyond +-65504 overflow).
//  - round_activations (MatMulPrecision::kRoundActivations; bf16/f16 weights only): every
//    activation is rounded to the weight's type first (RNE), in the GEMV's loads or, for more
//    tokens, by one rounding pass into `scratch` followed by ONE cublasGemmEx (f32 accumulation
//    and output). f32 weights ignore it.
//  - fp8 e4m3 weights with `weight_scale` [out_features] (MatMulParams): out = weight_scale[o] *
//    sum_i f16(in) * w (+ bias). 1..16 tokens with 16-byte rows: GemvFp8Kernel (tensor cores,
//    the weights read once at one byte each); otherwise the activations are rounded to f16 into
//    `scratch`, blocks of weight rows converted to f16 (exact) there and multiplied by one f16
//    cublasGemmEx each (f32 accumulation), then scaled. round_activations does not apply.
// `scratch` holds MatMulScratchBytes() bytes. `blas` must be bound to `stream` by the caller.
GpuResult LaunchMatMul(cublasHandle_t blas, const float* in, const void* weight,
                       FloatType weight_type, const void* bias, FloatType bias_type, float* out,
                       int64_t num_tokens, int64_t in_features, int64_t out_features,
                       void* scratch, cudaStream_t stream, bool round_activations = false,
                       const float* weight_scale = nullptr);

// ---- rope.cu -------------------------------------------------------------------------------
cudaError_t LaunchRope(float* x, const int32_t* positions, const float* inv_freq,
                       float attention_factor, int64_t num_tokens, int64_t num_heads,
                       int64_t head_dim, cudaStream_t stream);

// ---- swiglu.cu / add.cu --------------------------------------------------------------------
cudaError_t LaunchSwiGlu(const float* gate, const float* up, float* out, int64_t n,
                         cudaStream_t stream);
cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, float a_scale,
                      float b_scale, cudaStream_t stream);

// ---- attention.cu --------------------------------------------------------------------------
// A span as the kernels read it: the same fields as kernels::KvSpan (16 bytes).
struct DeviceSpan {
  int32_t slot;
  int32_t offset;
  int32_t length;
  int32_t position;
};

// One unit of split-K decode work: `count` (>= 1) consecutive tokens, starting at token `begin` of
// KV head `kv_head`'s concatenated spans; `first_span` is the index (into AttentionPlan::spans) of
// the span holding token `begin`.
struct DecodeWorkItem {
  int32_t kv_head;
  int32_t begin;
  int32_t count;
  int32_t first_span;
};

inline constexpr int kDecodeTile = 128;       // keys per tile of a decode block (one per thread)
inline constexpr int kDecodeItemsPerSm = 4;   // split-K work items the host plan aims for, per SM
// The same for SelectedAttention calls that run the tensor-core split-K kernel
// (SelectedDecodeMmaSupports): its blocks resident per SM, one wave (H200, bench/RESULTS.md
// session 33: 2 against 4 per SM, 32K 50.6 against 58.0 us, no change at 512K and 1M).
inline constexpr int kDecodeMmaItemsPerSm = 2;
inline constexpr int kDecodeMaxGroup = 8;     // query heads per KV head on the decode fast path
inline constexpr int kAttentionMaxHeadDim = 512;

// The paged-attention plan as the kernels read it. All arrays are device memory, laid out by
// CudaBackend::PagedAttention in one buffer:
//   spans[num_spans]               spans of every KV head, grouped by head, empty spans dropped
//                                  (with one query token also cut to the causal limit)
//   span_start[num_spans]          first token of each span within its head's concatenation
//   span_offsets[num_kv_heads + 1] CSR offsets into spans
//   head_tokens[num_kv_heads]      tokens per KV head
//   q_positions[num_tokens]        (general path, causal only)
//   items[num_items]               (decode path) work items grouped by KV head
//   item_offsets[num_kv_heads + 1] (decode path) CSR offsets into items
struct AttentionPlan {
  const DeviceSpan* spans = nullptr;
  const int32_t* span_start = nullptr;
  const int32_t* span_offsets = nullptr;
  const int32_t* head_tokens = nullptr;
  const int32_t* q_positions = nullptr;
  const DecodeWorkItem* items = nullptr;
  const int32_t* item_offsets = nullptr;
  int num_items = 0;
};

struct AttentionShape {
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t num_slots = 0;
  int64_t page_size = 0;
  bool causal = true;
  float scale = 0.0f;    // the host folds an fp8 pool's k_scale into it
  float v_scale = 1.0f;  // fp8 pools: outputs are multiplied by it (V dequantisation)
};

// True when the split-K decode kernel handles this shape (one query token, head_dim 64/128/256,
// at most kDecodeMaxGroup query heads per KV head).
bool DecodeFastPathSupports(const AttentionShape& shape);

// Floats of partial results the decode path writes: num_items * group * (head_dim + 2).
int64_t DecodeScratchFloats(const AttentionShape& shape, int num_items);

// Split-K flash decoding: one thread block per work item computes, for each query head of the
// item's KV head, the item's max score m, sum of exp(s - m) and sum of exp(s - m) v into
// `scratch`; a combine kernel then merges every item of a head into out [1, heads, dim] and lse.
cudaError_t LaunchPagedAttentionDecode(const float* q, const void* k_pool, const void* v_pool,
                                       FloatType pool_type, const AttentionShape& shape,
                                       const AttentionPlan& plan, float* scratch, float* out,
                                       float* lse, cudaStream_t stream);

// Any number of query tokens, any head_dim <= kAttentionMaxHeadDim: one thread block per (token,
// query head), keys in tiles of 128 with an online softmax; causal masking per key position.
cudaError_t LaunchPagedAttentionGeneral(const float* q, const void* k_pool, const void* v_pool,
                                        FloatType pool_type, const AttentionShape& shape,
                                        const AttentionPlan& plan, float* out, float* lse,
                                        cudaStream_t stream);

// MergeAttention: parts passed by value (at most kMaxMergeParts).
inline constexpr int kMaxMergeParts = 64;
struct MergeParts {
  const float* outs[kMaxMergeParts];
  const float* lses[kMaxMergeParts];
  int num_parts;
};
cudaError_t LaunchMergeAttention(const MergeParts& parts, int64_t rows, int64_t head_dim,
                                 float* out, float* lse, cudaStream_t stream);

// ---- selection.cu / attention.cu: device-resident sparse selection -------------------------
// (kernels::ScoreSummariesParams etc. in kernels/backend.h; CudaBackend validates first.)

// kernels::CandidateList as the kernels read it (ids and counts fit in int32 after validation).
struct DeviceCandidates {
  const int32_t* parents = nullptr;  // [num_kv_heads, num_parents] or nullptr (a plain range)
  int32_t num_parents = 0;
  int32_t fanout = 1;
  int32_t begin = 0;
  int32_t end = 0;
  int32_t count = 0;  // candidates per KV head
  // The selection kernels (ScoreSummaries, ScoreKeys, VoteTopK): [num_kv_heads] flags in device
  // memory, a head with a nonzero flag is left untouched (whole blocks / clusters exit before
  // any barrier); nullptr = none. SelectedAttention ignores it.
  const int32_t* skip = nullptr;
};

inline constexpr int kSelectMaxGroup = 16;  // query heads per KV head for the scoring kernels

// summaries: f32 or bf16 (summary_type).
cudaError_t LaunchScoreSummaries(const float* q, const void* summaries, FloatType summary_type,
                                 int num_kv_heads,
                                 int group, int head_dim, int64_t num_items,
                                 const DeviceCandidates& c, float scale, float* scores,
                                 cudaStream_t stream);
cudaError_t LaunchScoreKeys(const float* q, const void* k_pool, FloatType pool_type,
                            int64_t num_slots, int page_size, const int32_t* page_table,
                            int table_pages, int num_kv_heads, int group, int head_dim,
                            const DeviceCandidates& c, float scale, float* scores,
                            cudaStream_t stream);
// Bytes of device scratch LaunchVoteTopK needs (0 when the per-head keys fit in shared memory).
int64_t VoteTopKScratchBytes(int num_kv_heads, int64_t n);
// Soft vote and top-k per KV head (kernels/backend.h VoteTopKParams), by size of c.count: up to
// 1024 one block per KV head (bitonic sort of unique (vote, index) keys), up to 2048 one block per
// KV head (radix select), up to 65536 a cluster of up to 8 blocks per KV head (radix select),
// beyond one block per KV head (radix select, keys in `scratch` beyond 32768);
// STRATA_SELECTION_TOPK=bitonic|cluster1|cluster|block forces one where it can run.
cudaError_t LaunchVoteTopK(const float* scores, int num_kv_heads, int group, const DeviceCandidates& c,
                           int k, float* vote, int32_t* selected, void* scratch,
                           cudaStream_t stream);

// SelectStages (kernels/backend.h SelectStagesParams) as one kernel, SelectStagesKernel in
// selection.cu: one thread-block cluster per KV head runs every stage (scores, soft vote, top-k)
// with no global round trip but the stages' selected ids. Head_dim 128, group <= 4; bf16
// summaries, bf16 or fp8 keys with power-of-two page size and fanout; rows 16-byte aligned. fp8
// key stages and an fp8 attention take the kernel's fp8 form, so its key stages and attention
// read one format: a call mixing bf16 and fp8 pools is refused (cudaErrorInvalidValue).
inline constexpr int kSelectStagesMax = 3;
// The largest k of a stage that has a stage after it (its selection is copied to every block).
inline constexpr int kSelectStagesMaxParents = 2048;
enum class SelectStageKind : int { kSummariesBF16 = 0, kKeysBF16 = 1, kKeysFP8 = 2 };
struct DeviceSelectStage {
  SelectStageKind kind = SelectStageKind::kSummariesBF16;
  // bf16 summaries [num_kv_heads, num_items, 2 * 128] (min, then max), or the K pool
  // [num_items slots, page_size, 128] (bf16, or fp8 e4m3: stored values, scored as ScoreKeys).
  const void* rows = nullptr;
  int64_t num_items = 0;
  const int32_t* table = nullptr;  // keys: page table [num_kv_heads, table_pages]
  int table_pages = 0;
  int page_shift = 0;    // keys: log2(page size)
  int fanout_shift = 0;  // keys: log2(c.fanout)
  DeviceCandidates c;    // stage s > 0: c.parents is stage s - 1's `selected`
  int k = 0;
  int32_t* selected = nullptr;  // [num_kv_heads, k]
};
struct DeviceSelectStages {
  DeviceSelectStage stage[kSelectStagesMax];
  int num_stages = 0;
};
// Where SelectStagesKernel sends a stage's taken ids: what follows (the next stage's candidates,
// or the attention's middle) has n elements, block b of the cs-block cluster takes elements
// [b * per, (b + 1) * per) (per = StageBlockShare(n, cs)), and element e is the child of taken id
// e / fan (n = k * fan). The id at position pos goes to blocks [*b0, *b1] (those whose elements
// include one of its children; pos * fan < n), and block `rank` waits for OwnParentCount of the
// `taken` (<= k) ids. Host and device (selection_test checks them against each other).
__host__ __device__ inline int32_t StageMin(int32_t a, int32_t b) {
#if defined(__CUDA_ARCH__)
  return min(a, b);
#else
  return a < b ? a : b;
#endif
}
__host__ __device__ inline int32_t StageMax(int32_t a, int32_t b) {
#if defined(__CUDA_ARCH__)
  return max(a, b);
#else
  return a < b ? b : a;
#endif
}
__host__ __device__ inline int32_t StageBlockShare(int32_t n, int cs) {
  return StageMax(1, (n + cs - 1) / cs);
}
__host__ __device__ inline void ParentReaderBlocks(int32_t n, int32_t fan, int32_t per, int cs,
                                                   int32_t pos, int* b0, int* b1) {
  const int32_t e0 = pos * fan;
  *b0 = e0 / per;
  *b1 = StageMin(cs - 1, (StageMin(n, e0 + fan) - 1) / per);
}
__host__ __device__ inline int32_t OwnParentCount(int32_t n, int32_t fan, int32_t per, int rank,
                                                  int32_t taken) {
  const int32_t e0 = StageMin(n, rank * per), e1 = StageMin(n, e0 + per);
  if (e1 <= e0) return 0;
  return StageMax(0, StageMin(taken, (e1 - 1) / fan + 1) - e0 / fan);
}
// pos / share as SelectStagesKernel<kStagesAttendScored> computes it, in f32 with inv_share =
// 1.0f / share: floor((pos + 0.5) * inv_share). Exact for pos < share * 16 <= 2^15 (pos + 0.5 is
// exact and at least 1 / (2 share) from a multiple of share; the rounding errs by < 2^-19 below
// 16). selection_test checks it against integer division over every share and pos of the kernel.
__host__ __device__ inline int StageDivByShare(uint32_t pos, float inv_share) {
  return static_cast<int>((static_cast<float>(pos) + 0.5f) * inv_share);
}
// SelectedAttention over the last stage's selection inside the same kernel
// (SelectStagesParams::attend, kernels/backend.h): bf16 or fp8 pools, head_dim 128, the group of the
// stages, no prefix_len and no slot scales; middle.parents is the last stage's `selected`
// (num_parents its k <= kSelectStagesMaxParents, fanout a power of two). Block r of KV head g's
// cluster attends its share of the fixed positions (the prefix, then the suffix: at most
// kSelectAttendMaxFixed) and of the middle (at most kSelectAttendMaxMiddle). out == nullptr: none.
inline constexpr int kSelectAttendMaxFixed = 48;
inline constexpr int kSelectAttendMaxMiddle = 256;
// The attention's query and scale are the stages' (q, scale of LaunchSelectStages: the same
// values as SelectedAttentionParams' q and scale * k_scale). Where the last stage is a key stage
// over this k_pool and table and the middle its token ids (fanout 1), the middle's scores are
// taken from that stage instead of from K rows (STRATA_SELECT_ATTEND_SCORES=0, read at every
// launch, turns that off: A/B timing and tests; the result is the same bits either way).
// The selection cache's check (SelectionCacheCheckParams) as LaunchPartStages and
// LaunchSelectStages run it inside their kernels: q [num_kv_heads, n] (the kernel's own query),
// cached [num_kv_heads, n] (in/out), valid and reuse [num_kv_heads] i32, hits one u64
// (optional), n = group * 128.
struct DeviceCacheCheck {
  const float* q = nullptr;
  float* cached = nullptr;  // null: no check in the kernel
  int32_t* valid = nullptr;
  int32_t* reuse = nullptr;
  unsigned long long* hits = nullptr;
  float theta = 0.0f;
};
struct DeviceSelectAttend {
  const void* k_pool = nullptr;    // bf16, or fp8 e4m3 with fp8 != 0: [num_slots, page_size, 128]
  const void* v_pool = nullptr;
  const int32_t* table = nullptr;  // [num_kv_heads, table_pages]
  int table_pages = 0;
  int page_size = 0;
  int64_t num_slots = 0;
  int32_t prefix_end = 0;
  int32_t suffix_begin = 0;
  int32_t suffix_len = 0;
  int fanout_shift = 0;            // log2(middle.fanout)
  DeviceCandidates middle;
  float v_scale = 1.0f;             // fp8: the V pool's scale (k_scale is in the stages' scale)
  int fp8 = 0;                     // nonzero: the pools are fp8 e4m3 (stored values)
  float* out = nullptr;            // [num_kv_heads * group, 128] f32
  float* lse = nullptr;            // [num_kv_heads * group] f32
  // Nonzero: the fixed rows are copied during the first stage, else while the last stage's ids
  // arrive (STRATA_SELECT_ATTEND_FIXED=late; A/B timing); a skipped head's always the latter.
  int fixed_early = 1;
  // LaunchPartStages only (required there): each block writes its partials here
  // (PartMergeScratchFloats floats), merged by the last block of its KV head (merge_arrivals) or
  // by a second kernel.
  float* merge_partials = nullptr;
  // With merge_partials, optionally (SelectStagesParams::arrivals): one counter per KV head, zero
  // before the launch and left zero; the last block of each KV head to arrive merges its
  // partials, and no second kernel runs.
  uint32_t* merge_arrivals = nullptr;
  // LaunchPartStages, with merge_arrivals, optionally: the selection cache's check in the kernel,
  // its decision for KV head g the skip flag of g's blocks (every block computes the same), its
  // state updated by g's last block to arrive (the kernel's skip argument then null).
  // LaunchSelectStages takes the check as its own argument (a form without an attention has it
  // too) and ignores this one.
  DeviceCacheCheck check;
};
// Whether LaunchSelectStages attends with the middle's scores taken from the last stage
// (SelectStagesKernel<kStagesAttendScored>): a key stage over a's own k_pool and page table
// (same table_pages, page size and slots), the middle its token ids (fanout_shift 0), and
// STRATA_SELECT_ATTEND_SCORES not "0". Host logic only (no device call).
bool SelectStagesAttendScored(const DeviceSelectStages& stages, const DeviceSelectAttend& a);
// Blocks per cluster LaunchSelectStages uses for num_kv_heads clusters on the current device:
// 16 where that many 16-block clusters fit at once, else 8 (STRATA_SELECT_STAGES_CLUSTER=8 asks
// for 8), 0 where the kernel cannot run (its shared memory refused); and the candidates per KV
// head one stage may have: that many blocks of 1024 (0: none).
int SelectStagesClusterBlocks(int num_kv_heads);
int64_t SelectStagesMaxCandidates(int num_kv_heads);
// Partitioned selection (kernels/backend.h VoteTopKParams::partitions, SelectStagesParams::
// partitions), selection.cu: one block per part and KV head, no top-k across blocks.
// LaunchPartVoteTopK: VoteTopK with `parts` parts (a power of two <= 64 dividing k; with parents
// their count too), group <= 4, at most 4096 candidates per part (cudaErrorInvalidValue otherwise).
cudaError_t LaunchPartVoteTopK(const float* scores, int num_kv_heads, int group,
                               const DeviceCandidates& c, int k, int parts, float* vote,
                               int32_t* selected, cudaStream_t stream);
// Whether LaunchPartStages runs this chain: head_dim 128, group <= 4, 2 to 64 parts (with the
// attention 16 at most), bf16 summaries and keys of one format (bf16, or fp8
// e4m3: stored values, PartStagesKernel's fp8 form), stage 0 a plain range, at most 2048
// candidates per part and stage and 1024 taken per part; the attention (optional) over the last
// stage's token ids (a key stage over its own pools and table, of the same format), at most 256
// fixed rows per part.
bool PartStagesFits(int num_kv_heads, int group, int parts, const DeviceSelectStages& stages,
                    const DeviceSelectAttend* attend);
// The floats of DeviceSelectAttend::merge_partials for LaunchPartStages. The parts merge through
// global memory, not in clusters: session 43 (H200) found the hardware placing 8 clusters of 16
// blocks two per SM on 8-16 SMs, the step taking those blocks' time (128K 26.8 us against 24.9
// without clusters); session 44 removed the cluster merge.
int64_t PartMergeScratchFloats(int num_kv_heads, int parts);
// SelectStages with `parts` parts as one kernel (grid (parts, KV heads), no clusters). With the
// attention (attend->merge_partials required): every block's partials written there and merged
// by the last block of its KV head to arrive (attend->merge_arrivals set) or else by a second
// kernel (its programmatic dependent).
cudaError_t LaunchPartStages(const float* q, float scale, int num_kv_heads, int group, int parts,
                             const DeviceSelectStages& stages, const int32_t* skip,
                             const DeviceSelectAttend* attend, cudaStream_t stream);
// Profiling (cuda_attention_bench --stage-phases): while `stamps` (device memory) is set, thread
// 0 of each of the first `max_blocks` blocks of SelectStagesKernel writes clock64() at
// kSelectStagesPhases points to stamps[block * kSelectStagesPhases ...]: entry, then per stage
// (kSelectStagesMax of them, 9 each; a stage not run leaves its slots alone): start, scored, the
// block's own statistics pushed, every block's received, rank keys computed, radix passes 0 to 2
// done (a pass not run leaves its slot alone), end. nullptr turns it off (the default). Not
// thread-safe against concurrent launches.
inline constexpr int kSelectStagesPhasesPerStage = 9;
// With an attention (DeviceSelectAttend), kSelectStagesAttendPhases more stamps follow the
// stages': rows resolved and copies issued, fixed rows landed, attended, then per middle tile
// landed and attended (two tiles of 128), and the partials merged.
inline constexpr int kSelectStagesAttendPhases = 8;
// Then three placement slots (the part kernel; SelectStagesKernel leaves them alone): the SM the
// block ran on (%smid), and %globaltimer (ns, one clock for all SMs) at the block's entry and
// after its last cluster barrier, so the bench can tell blocks that shared an SM and the
// kernel's span from its slowest block.
inline constexpr int kSelectStagesPlaceSlot =
    1 + kSelectStagesMax * kSelectStagesPhasesPerStage + kSelectStagesAttendPhases;
inline constexpr int kSelectStagesPhases = kSelectStagesPlaceSlot + 3;
cudaError_t SetSelectStagesPhaseStamps(long long* stamps, int max_blocks);
// Whether LaunchSelectStages can attend `fixed` prefix + suffix and `middle` positions per KV
// head (the per-block limits above at the cluster size it would use).
bool SelectStagesCanAttend(int num_kv_heads, int64_t fixed, int64_t middle);
// The whole chain on `stream`, then the attention when `attend` is set; cudaErrorInvalidValue
// for a shape it does not run (the caller checks first; see CudaBackend::SelectStages). With
// `check` (its q the stages' q, skip null) the selection cache's check comes first: in the kernel
// where the form has an instance with it (no attention over bf16 rows: the page chooser; the
// attention over K and V rows: quest), each KV head's cluster deciding whether it reuses its kept
// selection, as skip would say, and updating the cache's state; else as its own kernel
// (LaunchSelectionCacheCheck) before it, its reuse flags the skip flags (attend->check is
// ignored).
cudaError_t LaunchSelectStages(const float* q, float scale, int num_kv_heads, int group,
                               const DeviceSelectStages& stages, const int32_t* skip,
                               const DeviceSelectAttend* attend, cudaStream_t stream,
                               const DeviceCacheCheck* check = nullptr);
// Decode attention over [0, prefix_end) + middle + [suffix_begin, suffix_begin + suffix_len) per
// KV head, split into items_per_head work items of `chunk` virtual positions each.
struct SelectedAttentionShape {
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t num_slots = 0;
  int page_size = 0;
  int table_pages = 0;
  int32_t prefix_end = 0;
  int32_t suffix_begin = 0;
  int32_t suffix_len = 0;
  int32_t total = 0;           // prefix_end + middle.count + suffix_len per KV head
  int32_t chunk = 0;           // virtual positions per work item (> 0)
  int32_t items_per_head = 0;  // ceil(total / chunk), >= 1
  float scale = 0.0f;          // the host folds an fp8 pool's k_scale into it
  float v_scale = 1.0f;        // fp8 pools: outputs are multiplied by it
  // fp8 pools only, or null: [num_slots, 2] f32 per-slot (K, V) scales (SelectedAttentionParams::
  // slot_scales), multiplied into the score of (K) and the weight of (V) each row of that slot.
  const float* slot_scales = nullptr;
};
// True for head_dim 64/128/256 and at most kDecodeMaxGroup query heads per KV head.
bool SelectedAttentionSupports(int num_q_heads, int num_kv_heads, int head_dim);
// Floats of split-K partials: num_kv_heads * items_per_head * group * (head_dim + 2).
int64_t SelectedAttentionScratchFloats(const SelectedAttentionShape& shape);
// The split-K work items on tensor cores (selection.cu SelectedDecodeMmaKernel): bf16 or fp8
// pools, head_dim 128, at most 4 query heads per KV head, no slot scales, and
// STRATA_SELECTED_DECODE_MMA not "0" (read once; A/B timing). Same partials as the CUDA-core
// split-K kernel (to rounding), merged by the same combine; LaunchSelectedAttention takes it
// where it applies.
bool SelectedDecodeMmaSupports(const SelectedAttentionShape& shape, FloatType pool_type);
cudaError_t LaunchSelectedDecodeMma(const float* q, const void* k_pool, const void* v_pool,
                                    FloatType pool_type, const int32_t* table,
                                    const DeviceCandidates& middle,
                                    const SelectedAttentionShape& shape, const int32_t* prefix_len,
                                    float* scratch, cudaStream_t stream);
// UpdateSummaries: pages [page_begin, page_end) and segments [seg_begin, seg_end) of every KV
// head are recomputed (pages first, then segments from them); num_pages_total = ceil(end / P).
// The selection cache check (kernels/backend.h SelectionCacheCheckParams): one block per KV
// head; n = group * head_dim; hit_count may be null.
cudaError_t LaunchSelectionCacheCheck(const float* q, float* cached_q, int32_t* valid,
                                      int32_t* reuse, int64_t* hit_count, int num_kv_heads,
                                      int n, float theta, cudaStream_t stream);
cudaError_t LaunchUpdateSummaries(const void* k_pool, FloatType pool_type, int64_t num_slots,
                                  int page_size, int head_dim, const int32_t* page_table,
                                  int table_pages, int num_kv_heads, int64_t end,
                                  int64_t page_begin, int64_t page_end, void* pages,
                                  FloatType summary_type, int64_t max_pages, void* segments,
                                  int64_t max_segments, int segment_pages, cudaStream_t stream);
// Profiling (cuda_selected_attention_bench --phases): while `stamps` (device memory) is set,
// thread 0 of each of the first `max_blocks` blocks of the cluster SelectedAttention kernel writes
// kSelectedPhases (%globaltimer ns, clock64) pairs to stamps[block * 2 * kSelectedPhases ...]:
// entry, rows resolved and copies issued, first tile resident, tiles done, block partial written,
// partials pushed (cluster barrier passed), merge done, exit. nullptr turns it off (the default). Not thread-safe
// against concurrent launches; a profiling switch, not an API.
constexpr int kSelectedPhases = 8;
cudaError_t SetSelectedAttentionPhaseStamps(unsigned long long* stamps, int max_blocks);
cudaError_t LaunchSelectedAttention(const float* q, const void* k_pool, const void* v_pool,
                                    FloatType pool_type, const int32_t* page_table,
                                    const DeviceCandidates& middle,
                                    const SelectedAttentionShape& shape,
                                    const int32_t* prefix_len,  // device int32 or null
                                    float* scratch, float* out, float* lse,
                                    cudaStream_t stream);

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_LAUNCH_H_
