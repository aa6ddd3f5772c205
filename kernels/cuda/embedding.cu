// Embedding lookup on the GPU: out[i, :] = f32(table[ids[i], :]); one block per token.
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

template <typename T>
__global__ void EmbeddingKernel(const int32_t* __restrict__ ids, const T* __restrict__ table,
                                int64_t vocab, int64_t hidden, float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  float* o = out + t * hidden;
  if (id < 0 || id >= vocab) {
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
    return;
  }
  const T* row = table + static_cast<int64_t>(id) * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = LoadAsFloat(row, i);
}

}  // namespace

cudaError_t LaunchEmbedding(const int32_t* ids, const void* table, FloatType table_type,
                            int64_t vocab, int64_t hidden, float* out, int64_t num_tokens,
                            cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  if (num_tokens > 0x7fffffff) return cudaErrorInvalidValue;
  const int threads = hidden >= 256 ? 256 : 128;
  STRATA_DISPATCH_FLOAT_TYPE(table_type, T,
      EmbeddingKernel<T><<<static_cast<unsigned>(num_tokens), threads, 0, stream>>>(
          ids, static_cast<const T*>(table), vocab, hidden, out));
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
