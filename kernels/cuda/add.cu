// Elementwise f32 addition on the GPU. out may alias a or b (each element is read, then written,
// by the same thread).
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

}  // namespace

cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddKernel<<<GridFor(n, 256), 256, 0, stream>>>(a, b, out, n);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
