// AppendKv on the GPU: f32 K/V rows of new tokens converted into their KvCache pool rows, one
// thread per element (K and V). The bf16 rounding is kernels::F32ToBF16's, bit for bit.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/internal/kv_append.h"

namespace strata::kernels::cuda_internal {
namespace {

__device__ __forceinline__ uint16_t F32ToBF16Bits(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

template <bool BF16>
__global__ void AppendKvKernel(const float* __restrict__ k, const float* __restrict__ v,
                               void* k_pool, void* v_pool, int64_t total, int64_t heads,
                               int64_t head_dim, int64_t page_size, int64_t first,
                               int64_t slots_per_head, const int32_t* first_device) {
  if (first_device != nullptr) {
    // The position read on the device; `first` is its largest allowed value.
    const int64_t f = *first_device;
    if (f < 0 || f > first) return;
    first = f;
  }
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < 2 * total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool is_v = e >= total;
    const int64_t j = is_v ? e - total : e;  // element of [n, heads, head_dim]
    const int64_t c = j % head_dim;
    const int64_t g = (j / head_dim) % heads;
    const int64_t pos = first + j / (head_dim * heads);
    const int64_t slot = g * slots_per_head + pos / page_size;
    const int64_t dst = (slot * page_size + pos % page_size) * head_dim + c;
    const float x = is_v ? v[j] : k[j];
    void* pool = is_v ? v_pool : k_pool;
    if (BF16) {
      static_cast<uint16_t*>(pool)[dst] = F32ToBF16Bits(x);
    } else {
      static_cast<float*>(pool)[dst] = x;
    }
  }
}

}  // namespace

cudaError_t LaunchAppendKv(const float* k, const float* v, void* k_pool, void* v_pool, bool bf16,
                           int64_t n, int64_t heads, int64_t head_dim, int64_t page_size,
                           int64_t first, int64_t slots_per_head, cudaStream_t stream,
                           const int32_t* first_device) {
  const int64_t total = n * heads * head_dim;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t want = (2 * total + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);
  if (bf16) {
    AppendKvKernel<true><<<blocks, kThreads, 0, stream>>>(k, v, k_pool, v_pool, total, heads,
                                                          head_dim, page_size, first,
                                                          slots_per_head, first_device);
  } else {
    AppendKvKernel<false><<<blocks, kThreads, 0, stream>>>(k, v, k_pool, v_pool, total, heads,
                                                           head_dim, page_size, first,
                                                           slots_per_head, first_device);
  }
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
