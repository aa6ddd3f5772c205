// Elementwise f32 addition on the GPU, out = a + b or, with scales, fmaf(sa, a, sb * b) (the CPU
// twin's order of operations). out may alias a or b (each element is read, then written, by the
// same thread).
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

__global__ void ScaledAddKernel(const float* a, const float* b, float* out, int64_t n, float sa,
                                float sb) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = fmaf(sa, a[i], __fmul_rn(sb, b[i]));
  }
}

}  // namespace

cudaError_t LaunchAdd(const float* a, const float* b, float* out, int64_t n, float a_scale,
                      float b_scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (a_scale == 1.0f && b_scale == 1.0f) {
    AddKernel<<<GridFor(n, 256), 256, 0, stream>>>(a, b, out, n);
  } else {
    ScaledAddKernel<<<GridFor(n, 256), 256, 0, stream>>>(a, b, out, n, a_scale, b_scale);
  }
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
