// SwiGLU on the GPU: out = silu(gate) * up elementwise (accurate expf). out may alias gate.
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

__global__ void SwiGluKernel(const float* gate, const float* up, float* out, int64_t n) {
  GridDepLaunchDependents();  // the down projection's GEMV may start prefetching its weights
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

}  // namespace

cudaError_t LaunchSwiGlu(const float* gate, const float* up, float* out, int64_t n,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  SwiGluKernel<<<GridFor(n, 256), 256, 0, stream>>>(gate, up, out, n);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
