// RMS normalisation on the GPU: one block per row; f32 sum of squares reduced across the block.
// Each thread writes only the elements it read, so out may alias in.
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void RmsNormKernel(const float* in, const T* __restrict__ weight, float* out,
                              int64_t hidden, float eps) {
  __shared__ float warp_sums[kThreads / 32];
  const float* x = in + static_cast<int64_t>(blockIdx.x) * hidden;
  float* y = out + static_cast<int64_t>(blockIdx.x) * hidden;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += kThreads) sum += x[i] * x[i];
  sum = WarpSum(sum);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += kThreads) y[i] = LoadAsFloat(weight, i) * (x[i] * inv);
}

}  // namespace

cudaError_t LaunchRmsNorm(const float* in, const void* weight, FloatType weight_type, float* out,
                          int64_t num_tokens, int64_t hidden, float eps, cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  if (num_tokens > 0x7fffffff) return cudaErrorInvalidValue;
  STRATA_DISPATCH_FLOAT_TYPE(weight_type, T,
      RmsNormKernel<T><<<static_cast<unsigned>(num_tokens), kThreads, 0, stream>>>(
          in, static_cast<const T*>(weight), out, hidden, eps));
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
