// Host-side entry point of kernels/cuda/kv_append.cu (private to kernels/cuda): the AppendKv op
// of kernels/backend.h, kept out of launch.h.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_KV_APPEND_H_
#define STRATA_KERNELS_CUDA_INTERNAL_KV_APPEND_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/internal/launch.h"

namespace strata::kernels::cuda_internal {

// AppendKvParams::rope for the kernel: inv_freq null means none.
struct RopeArgs {
  const float* inv_freq = nullptr;  // [head_dim / 2] f32 (device)
  const int32_t* positions = nullptr;  // [n] (device)
  float factor = 1.0f;              // RopeParams::attention_factor
  float* q = nullptr;               // [n, q_heads, head_dim] f32 (device), rotated in place
  int64_t q_heads = 1;
  int64_t q_pairs = 0;              // n * q_heads * head_dim / 2 (0 without q)
};

// Writes k, v [n, heads, head_dim] f32 (device) into k_pool / v_pool [slots, page_size,
// head_dim] (device; f32, bf16 or fp8 e4m3 as pool_type says): token i of head g to row
// (first + i) % page_size of slot g * slots_per_head + (first + i) / page_size. bf16 and fp8
// conversions are kernels::F32ToBF16 / F32ToFP8E4M3 bit for bit; fp8 stores x / k_scale
// (x / v_scale), the scales being ignored for other types. With rope.inv_freq the keys are
// stored rotated (RopeKernel's rotation; k is not written) and rope.q is rotated in place, even
// when first_device refuses the append. The host has validated every slot.
// One kernel on `stream`; returns the launch status (cudaErrorInvalidValue for f16).
cudaError_t LaunchAppendKv(const float* k, const float* v, void* k_pool, void* v_pool,
                           FloatType pool_type, int64_t n, int64_t heads, int64_t head_dim,
                           int64_t page_size, int64_t first, int64_t slots_per_head,
                           cudaStream_t stream,
                           const int32_t* first_device = nullptr,  // see AppendKvParams
                           float k_scale = 1.0f, float v_scale = 1.0f,
                           const RopeArgs& rope = RopeArgs());

// EncodeFp8Pages of kernels/backend.h over bf16 pools [slots, page_size, head_dim] (device):
// codes [items, 2, page_size, head_dim], scales [items, 2], summaries [items, 2 * head_dim]
// (device), item g * count + j the page in slot first_slot + g * head_slot_stride + j. The host
// has validated the shapes and slots. One kernel on `stream`; cudaErrorInvalidValue for a head_dim
// above 1024.
cudaError_t LaunchEncodeFp8Pages(const uint16_t* k_pool, const uint16_t* v_pool, int64_t page_size,
                                 int64_t head_dim, int64_t first_slot, int64_t head_slot_stride,
                                 int num_heads, int64_t count, int last_valid, uint8_t* codes,
                                 float* scales, float* summaries, cudaStream_t stream);

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_KV_APPEND_H_
