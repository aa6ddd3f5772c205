// Rotary embedding in place on the GPU ("rotate half"): one thread per (token, head, pair).
// The angle and rotation are RopeCosSin / RopeRotatePair (internal/common.cuh).
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

__global__ void RopeKernel(float* x, const int32_t* __restrict__ positions,
                           const float* __restrict__ inv_freq, float attention_factor,
                           int64_t total, int64_t num_heads, int64_t half) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % half;
    const int64_t row = e / half;  // token * num_heads + head
    float c, s;
    RopeCosSin(positions[row / num_heads], inv_freq, i, attention_factor, &c, &s);
    RopeRotatePair(x + row * 2 * half, i, half, c, s);
  }
}

}  // namespace

cudaError_t LaunchRope(float* x, const int32_t* positions, const float* inv_freq,
                       float attention_factor, int64_t num_tokens, int64_t num_heads,
                       int64_t head_dim, cudaStream_t stream) {
  const int64_t half = head_dim / 2;
  const int64_t total = num_tokens * num_heads * half;
  if (total == 0) return cudaSuccess;
  RopeKernel<<<GridFor(total, 256), 256, 0, stream>>>(x, positions, inv_freq, attention_factor,
                                                      total, num_heads, half);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
