// Tensor-core flash attention for paged prefill (kernels/cuda/flash_prefill.cu; private to
// kernels/cuda). Serves kernels::PagedAttentionParams as they are: q f32 [tokens, heads, dim],
// K/V in page slots of a bf16 or fp8 e4m3 pool (fp8: converted to bf16 as each tile lands in
// shared memory, exactly; k_scale folded into the scale, v_scale into the outputs), addressed through the AttentionPlan that
// CudaBackend::PagedAttention builds (CSR spans per KV head); writes the same (out, lse) partial
// as the CPU reference (kernels/backend.h), with bf16 rounding of q and of the softmax weights
// (f32 accumulation), so results match the reference to bf16 tolerance, not exactly.
//
// Algorithm (FlashAttention-2 forward): one 128-thread block per (query head, tile of
// kFlashBlockM = 128 query tokens); each of the 4 warps owns 32 query rows (two m16 blocks, so
// every K/V fragment read from shared memory feeds two MMAs). Keys of the head's concatenated
// spans are streamed in tiles of 32 or 64 keys through shared memory (cp.async, double buffered); S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 in, f32 accumulate)
// with an online softmax in registers. Causal masking is per key position (any span layout:
// dense causal prefill and block-sparse selected pages alike); key tiles whose smallest position
// lies after every query of the block are skipped, and tiles wholly before every query skip the
// mask. A pre-pass kernel computes, per (KV head, key tile), the first span and the min / max
// key position into scratch.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_FLASH_PREFILL_H_
#define STRATA_KERNELS_CUDA_INTERNAL_FLASH_PREFILL_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/cuda/internal/launch.h"

namespace strata::kernels::cuda_internal {

inline constexpr int kFlashBlockM = 128;  // query tokens per thread block
inline constexpr int kFlashMinBlockN = 32;  // keys per shared-memory tile: 32 or 64
inline constexpr int kFlashMaxBlockN = 64;
inline constexpr int kFlashDefaultBlockN128 = 64;  // default tile for head_dim 128 (64: 64)

// Benchmark knob: keys per tile (32 or 64; anything else restores the defaults). Process-wide,
// not synchronised: set it only while no flash launch is in flight on another thread. Affects
// speed only (tests run both).
void SetFlashPrefillBlockN(int keys);

// True when the flash kernel handles this shape: bf16 or fp8 e4m3 pool, head_dim 64 or 128, at
// least one token. (q, k_pool and v_pool must also be 16-byte aligned; the caller checks that.)
bool FlashPrefillSupports(const AttentionShape& shape, FloatType pool_type);

// Bytes of device scratch LaunchFlashPrefill needs when the longest KV head has
// `max_head_tokens` keys (0 when there are no keys).
int64_t FlashPrefillScratchBytes(const AttentionShape& shape, int64_t max_head_tokens);

// Enqueues the pre-pass and the flash kernel. `plan` as for LaunchPagedAttentionGeneral (spans,
// span_start, span_offsets, head_tokens, q_positions when causal); `scratch` holds
// FlashPrefillScratchBytes(shape, max_head_tokens) bytes, 16-byte aligned. Returns
// cudaErrorInvalidValue for shapes FlashPrefillSupports rejects.
cudaError_t LaunchFlashPrefill(const float* q, const void* k_pool, const void* v_pool,
                               FloatType pool_type, const AttentionShape& shape,
                               const AttentionPlan& plan, int64_t max_head_tokens, void* scratch,
                               float* out, float* lse, cudaStream_t stream);

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_FLASH_PREFILL_H_
