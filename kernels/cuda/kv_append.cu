// AppendKv on the GPU: f32 K/V rows of new tokens converted into their KvCache pool rows, one
// thread per element (K and V). The bf16 rounding is kernels::F32ToBF16's and the fp8 e4m3 one
// kernels::F32ToFP8E4M3's (nearest even, saturated to +-448, NaN -> 0x7f), bit for bit.
#include <cuda_fp8.h>
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

__device__ __forceinline__ uint8_t F32ToFp8Bits(float v) {
  if (isnan(v)) return 0x7f;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

template <FloatType T>
__global__ void AppendKvKernel(const float* __restrict__ k, const float* __restrict__ v,
                               void* k_pool, void* v_pool, int64_t total, int64_t heads,
                               int64_t head_dim, int64_t page_size, int64_t first,
                               int64_t slots_per_head, const int32_t* first_device,
                               float k_scale, float v_scale) {
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
    if constexpr (T == FloatType::kBF16) {
      static_cast<uint16_t*>(pool)[dst] = F32ToBF16Bits(x);
    } else if constexpr (T == FloatType::kFP8E4M3) {
      static_cast<uint8_t*>(pool)[dst] = F32ToFp8Bits(x / (is_v ? v_scale : k_scale));
    } else {
      static_cast<float*>(pool)[dst] = x;
    }
  }
}

template <FloatType T>
void Launch(unsigned blocks, int threads, const float* k, const float* v, void* k_pool,
            void* v_pool, int64_t total, int64_t heads, int64_t head_dim, int64_t page_size,
            int64_t first, int64_t slots_per_head, const int32_t* first_device, float k_scale,
            float v_scale, cudaStream_t stream) {
  AppendKvKernel<T><<<blocks, threads, 0, stream>>>(k, v, k_pool, v_pool, total, heads, head_dim,
                                                    page_size, first, slots_per_head,
                                                    first_device, k_scale, v_scale);
}

}  // namespace

cudaError_t LaunchAppendKv(const float* k, const float* v, void* k_pool, void* v_pool,
                           FloatType pool_type, int64_t n, int64_t heads, int64_t head_dim,
                           int64_t page_size, int64_t first, int64_t slots_per_head,
                           cudaStream_t stream, const int32_t* first_device, float k_scale,
                           float v_scale) {
  const int64_t total = n * heads * head_dim;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t want = (2 * total + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);
  switch (pool_type) {
    case FloatType::kBF16:
      Launch<FloatType::kBF16>(blocks, kThreads, k, v, k_pool, v_pool, total, heads, head_dim,
                               page_size, first, slots_per_head, first_device, k_scale, v_scale,
                               stream);
      break;
    case FloatType::kFP8E4M3:
      Launch<FloatType::kFP8E4M3>(blocks, kThreads, k, v, k_pool, v_pool, total, heads, head_dim,
                                  page_size, first, slots_per_head, first_device, k_scale,
                                  v_scale, stream);
      break;
    case FloatType::kF32:
      Launch<FloatType::kF32>(blocks, kThreads, k, v, k_pool, v_pool, total, heads, head_dim,
                              page_size, first, slots_per_head, first_device, k_scale, v_scale,
                              stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
