// RMS normalisation on the GPU: one block per row; f32 sum of squares reduced across the block.
// The block has up to 1024 threads, sized so that each thread handles about four elements of the
// row (at batch 1 the one block is the whole kernel, so a wide block shortens its serial loop),
// with 16-byte loads and stores when the row is float4-aligned. Each thread writes only the
// elements it read, so out may alias in. With a residual, each thread first adds it to its
// elements of in (written back; the same f32 add as the Add kernel), so the residual add of a
// transformer block costs no launch of its own.
#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kMaxThreads = 1024;

// VEC: hidden % 4 == 0 and in/out 16-byte aligned; thread j takes the float4s j, j + blockDim.x,
// ... of the row.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kMaxThreads)
    RmsNormKernel(float* in, const float* __restrict__ residual, const T* __restrict__ weight,
                  float* out, int64_t hidden, float eps) {
  __shared__ float warp_sums[kMaxThreads / 32];
  // The next kernel (a GEMV launched as a programmatic dependent) may start prefetching its
  // weights now; it waits for this kernel's output before reading it.
  GridDepLaunchDependents();
  const int nthreads = blockDim.x;
  float* x = in + static_cast<int64_t>(blockIdx.x) * hidden;
  const float* r = residual != nullptr ? residual + static_cast<int64_t>(blockIdx.x) * hidden
                                       : nullptr;
  float* y = out + static_cast<int64_t>(blockIdx.x) * hidden;
  float sum = 0.0f;
  if (VEC) {
    float4* x4 = reinterpret_cast<float4*>(x);
    for (int64_t i = threadIdx.x; i < hidden / 4; i += nthreads) {
      float4 v = x4[i];
      if (r != nullptr) {
        const float4 a = reinterpret_cast<const float4*>(r)[i];
        v.x = __fadd_rn(v.x, a.x);
        v.y = __fadd_rn(v.y, a.y);
        v.z = __fadd_rn(v.z, a.z);
        v.w = __fadd_rn(v.w, a.w);
        x4[i] = v;
      }
      sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += nthreads) {
      float v = x[i];
      if (r != nullptr) {
        v = __fadd_rn(v, r[i]);
        x[i] = v;
      }
      sum += v * v;
    }
  }
  sum = WarpSum(sum);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  float total = 0.0f;
  const int nwarps = nthreads >> 5;
  for (int w = 0; w < nwarps; ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(hidden) + eps);
  if (VEC) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* y4 = reinterpret_cast<float4*>(y);
    for (int64_t i = threadIdx.x; i < hidden / 4; i += nthreads) {
      const float4 v = x4[i];
      float4 r;
      r.x = LoadAsFloat(weight, 4 * i) * (v.x * inv);
      r.y = LoadAsFloat(weight, 4 * i + 1) * (v.y * inv);
      r.z = LoadAsFloat(weight, 4 * i + 2) * (v.z * inv);
      r.w = LoadAsFloat(weight, 4 * i + 3) * (v.w * inv);
      y4[i] = r;
    }
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += nthreads) {
      y[i] = LoadAsFloat(weight, i) * (x[i] * inv);
    }
  }
}

}  // namespace

cudaError_t LaunchRmsNorm(float* in, const float* residual, const void* weight,
                          FloatType weight_type, float* out, int64_t num_tokens, int64_t hidden,
                          float eps, cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  if (num_tokens > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vec = hidden % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(residual) % 16 == 0;
  int64_t threads = ((hidden + 3) / 4 + 31) / 32 * 32;
  if (threads < 32) threads = 32;
  if (threads > kMaxThreads) threads = kMaxThreads;
  const unsigned blocks = static_cast<unsigned>(num_tokens);
  const unsigned nt = static_cast<unsigned>(threads);
  if (vec) {
    STRATA_DISPATCH_FLOAT_TYPE(weight_type, T,
        RmsNormKernel<T, true><<<blocks, nt, 0, stream>>>(
            in, residual, static_cast<const T*>(weight), out, hidden, eps));
  } else {
    STRATA_DISPATCH_FLOAT_TYPE(weight_type, T,
        RmsNormKernel<T, false><<<blocks, nt, 0, stream>>>(
            in, residual, static_cast<const T*>(weight), out, hidden, eps));
  }
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
