// PageCopy on the GPU: the fill of GPU page-cache slots from pinned host staging (and the copy
// kernel of small host <-> device copies, LaunchCopyBytes). The kernel
// reads the staging directly through the host mapping (no cudaMemcpy, no device scratch), many
// 16-byte loads in flight per thread, so the copy runs at PCIe speed in one launch however many
// pages there are (notes/GPU.md: one gather kernel ~ one contiguous copy; per-page memcpys are
// 2-9x slower).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/page_copy.h"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// blockIdx.x = 2 * page + half (0: K, 1: V); blockIdx.y strides over the half in chunks of
// kThreads * kUnroll vectors. All loads of a chunk are issued before its stores.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    PageCopyKernel(const V* __restrict__ staging, const void* const* __restrict__ sources,
                   const int32_t* __restrict__ slots, V* __restrict__ k_pool,
                   V* __restrict__ v_pool, int64_t half_vecs) {
  __shared__ int32_t slot;
  __shared__ const V* page_src;
  const int64_t page = blockIdx.x >> 1;
  const int half = blockIdx.x & 1;
  if (threadIdx.x == 0) {
    slot = slots[page];
    page_src = sources != nullptr ? static_cast<const V*>(sources[page])
                                  : staging + 2 * page * half_vecs;
  }
  __syncthreads();
  const V* src = page_src + half * half_vecs;
  V* dst = (half == 0 ? k_pool : v_pool) + static_cast<int64_t>(slot) * half_vecs;
  const int64_t chunk = static_cast<int64_t>(kThreads) * kUnroll;
  for (int64_t base = blockIdx.y * chunk; base < half_vecs;
       base += static_cast<int64_t>(gridDim.y) * chunk) {
    CopyChunk<kThreads, kUnroll>(dst, src, base, half_vecs);
  }
}

__global__ void TableUpdateKernel(int32_t* table, const int32_t* __restrict__ index,
                                  const int32_t* __restrict__ value, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    table[index[i]] = value[i];
  }
}

// dst[i] = src[i] for i < n, grid-stride by chunks.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    CopyKernel(V* __restrict__ dst, const V* __restrict__ src, int64_t n) {
  const int64_t chunk = static_cast<int64_t>(kThreads) * kUnroll;
  for (int64_t base = blockIdx.x * chunk; base < n; base += static_cast<int64_t>(gridDim.x) * chunk) {
    CopyChunk<kThreads, kUnroll>(dst, src, base, n);
  }
}

template <typename V>
cudaError_t LaunchCopy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(bytes / sizeof(V));
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
  int64_t blocks = (n + per_block - 1) / per_block;
  if (blocks > 1024) blocks = 1024;
  CopyKernel<V><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(static_cast<V*>(dst),
                                                                         static_cast<const V*>(src), n);
  return cudaGetLastError();
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename V>
cudaError_t Launch(const PageCopyArgs& a, cudaStream_t stream) {
  const int64_t half_vecs = a.half_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t chunk = static_cast<int64_t>(kThreads) * kUnroll;
  int64_t chunks = (half_vecs + chunk - 1) / chunk;
  if (chunks > 65535) chunks = 65535;
  const dim3 grid(static_cast<unsigned int>(2 * static_cast<int64_t>(a.num_pages)),
                  static_cast<unsigned int>(chunks));
  PageCopyKernel<V><<<grid, kThreads, 0, stream>>>(
      static_cast<const V*>(a.staging), a.sources, a.slots, static_cast<V*>(a.k_pool),
      static_cast<V*>(a.v_pool), half_vecs);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCopyBytes(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const uintptr_t all = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if ((all & 15) == 0) return LaunchCopy<uint4>(dst, src, bytes, stream);
  if ((all & 3) == 0) return LaunchCopy<uint32_t>(dst, src, bytes, stream);
  return LaunchCopy<uint8_t>(dst, src, bytes, stream);
}

cudaError_t LaunchPageCopy(const PageCopyArgs& a, cudaStream_t stream) {
  if (a.num_pages > 0 && a.half_bytes > 0) {
    // With sources, the host has checked every page address (sources_aligned).
    const bool vec = a.half_bytes % 16 == 0 && a.sources_aligned &&
                     (a.sources != nullptr || Aligned16(a.staging)) && Aligned16(a.k_pool) &&
                     Aligned16(a.v_pool);
    const cudaError_t e = vec ? Launch<uint4>(a, stream) : Launch<uint8_t>(a, stream);
    if (e != cudaSuccess) return e;
  }
  if (a.num_table_updates > 0) {
    int blocks = (a.num_table_updates + kThreads - 1) / kThreads;
    if (blocks > 1024) blocks = 1024;
    TableUpdateKernel<<<blocks, kThreads, 0, stream>>>(a.table, a.table_index, a.table_value,
                                                       a.num_table_updates);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace strata::kernels::cuda_internal
