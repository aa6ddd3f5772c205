// Device helpers shared by the kernels of kernels/cuda (private). Included by .cu files only.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_COMMON_CUH_
#define STRATA_KERNELS_CUDA_INTERNAL_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/internal/launch.h"

namespace strata::kernels::cuda_internal {

// Element `i` of a float array of type T, as f32.
template <typename T>
__device__ __forceinline__ float LoadAsFloat(const T* p, int64_t i);
template <>
__device__ __forceinline__ float LoadAsFloat<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float LoadAsFloat<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <>
__device__ __forceinline__ float LoadAsFloat<__half>(const __half* p, int64_t i) {
  return __half2float(p[i]);
}

// Rotary embedding ("rotate half"), shared by RopeKernel (rope.cu) and AppendKvKernel
// (kv_append.cu): cos and sin of pair i at `position`, each times `factor`. The angle is the f32
// product position * inv_freq[i] as on the CPU; sincosf is the accurate (non-intrinsic) one.
__device__ __forceinline__ void RopeCosSin(int32_t position, const float* inv_freq, int64_t i,
                                           float factor, float* c, float* s) {
  const float a = static_cast<float>(position) * inv_freq[i];
  sincosf(a, s, c);
  *c *= factor;
  *s *= factor;
}

// Pair i of the head vector `v` (elements i and i + half) rotated in place by (c, s).
__device__ __forceinline__ void RopeRotatePair(float* v, int64_t i, int64_t half, float c,
                                               float s) {
  const float x1 = v[i], x2 = v[i + half];
  v[i] = x1 * c - x2 * s;
  v[i + half] = x2 * c + x1 * s;
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialization
// (LaunchDependent) may be scheduled while the previous kernel on the stream is still running;
// GridDepWait blocks until that kernel has completed and its writes are visible, so everything
// before it must touch only memory the previous kernel does not write (it is a no-op after a
// normal launch). GridDepLaunchDependents lets such a next kernel be scheduled before this one
// ends (the next one still waits for this one's completion in its own GridDepWait).
__device__ __forceinline__ void GridDepWait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void GridDepLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// The launch configuration of a cudaLaunchKernelEx call (host code): `grid`, `block`, `smem` bytes
// of dynamic shared memory on `stream`, as thread block clusters of `cluster` blocks along x when
// cluster >= 1 (0: no cluster attribute), with programmatic stream serialization allowed when
// `dependent` (see GridDepWait). cfg.attrs points into this object, so it is neither copied nor
// moved: make it where the launch is, then cudaLaunchKernelEx(&launch.cfg, kernel, ...).
struct ClusterLaunchConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attrs[2] = {};

  ClusterLaunchConfig(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int cluster,
                      bool dependent) {
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    unsigned n = 0;
    if (cluster >= 1) {
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = static_cast<unsigned>(cluster);
      attrs[n].val.clusterDim.y = 1;
      attrs[n].val.clusterDim.z = 1;
      ++n;
    }
    if (dependent) {
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    cfg.attrs = attrs;
    cfg.numAttrs = n;
  }
  ClusterLaunchConfig(const ClusterLaunchConfig&) = delete;
  ClusterLaunchConfig& operator=(const ClusterLaunchConfig&) = delete;
};

// Launches `kernel` on `stream`, with programmatic stream serialization allowed when `dependent`
// (see GridDepWait) and, for cluster > 1, thread block clusters of `cluster` blocks along x.
template <typename... KArgs, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(KArgs...), dim3 grid, dim3 block, int cluster,
                            bool dependent, cudaStream_t stream, Args... args) {
  const ClusterLaunchConfig launch(grid, block, 0, stream, cluster > 1 ? cluster : 0, dependent);
  return cudaLaunchKernelEx(&launch.cfg, kernel, static_cast<KArgs>(args)...);
}

// Profiling stamps: %globaltimer (ns, one clock for every SM) and the SM a thread runs on.
__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t SmId() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Exchanges between the blocks of a cluster without a cluster barrier (whose release compiles to
// a GPU-scope memory barrier and whose acquire invalidates L1): each block pushes its data into
// every block's receive slot with st.async, which completes bytes on the receiver's mbarrier; the
// receiver's wait (acquire) then sees them. Addresses are shared::cta (u32) of this block; the
// remote ones come from mapa. Only in clusters of two blocks or more (compute-sanitizer reports
// an st.async in a one-block cluster as an invalid write); a block must not leave while pushes
// to it may still arrive.
__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t MapToRank(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// The local arrival of a use of `bar` that expects `bytes` from st.async.
__device__ __forceinline__ void MbarExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void StAsync16(uint32_t remote, uint4 v, uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
      "[%5];" ::"r"(remote),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
      : "memory");
}
__device__ __forceinline__ void StAsync4(uint32_t remote, uint32_t v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   remote),
               "r"(v), "r"(remote_bar)
               : "memory");
}

__device__ __forceinline__ void StAsync8(uint32_t remote, float2 v, uint32_t remote_bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
          remote),
      "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(remote_bar)
      : "memory");
}

// The tx-count of `bar` raised by `bytes` without an arrival (a thread's share of a use whose
// single arrival comes later), and a plain arrival.
__device__ __forceinline__ void MbarExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One bulk copy (the TMA unit) of `bytes` (a multiple of 16; both addresses 16-byte aligned) from
// global memory to this block's shared memory at `dst`, completing on the mbarrier `bar`.
__device__ __forceinline__ void BulkCopyToShared(uint32_t dst, const void* src, uint32_t bytes,
                                                 uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// Asynchronous 16-byte copies global -> shared (cp.async.cg: L2 only); valid == false
// zero-fills the destination and reads nothing. Commit groups and wait for all but the newest N.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  CpAsync16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// How many clusters of `size` blocks of `kernel` (`threads` per block, `smem` bytes of dynamic
// shared memory) fit on the current device at once, once the non-portable cluster size is
// allowed; 0 when it is refused. Clears the error a refusal leaves.
template <typename... KArgs>
int MaxActiveClusters(void (*kernel)(KArgs...), int size, int threads, size_t smem) {
  int count = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
      cudaSuccess) {
    const ClusterLaunchConfig launch(dim3(static_cast<unsigned>(size) * 16),
                                     dim3(static_cast<unsigned>(threads)), smem, nullptr, size,
                                     false);
    if (cudaOccupancyMaxActiveClusters(&count, kernel, &launch.cfg) != cudaSuccess) count = 0;
  }
  cudaGetLastError();
  return count;
}

// A 16-byte chunk of a weight that is read once (the GEMVs' rows): not kept in L1 (the
// activations are), fetched from DRAM in 256-byte L2 requests.
__device__ __forceinline__ uint4 LoadWeightChunk(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// LoadWeightChunk(p) when `ok`, else zeros, as one predicated load without a branch: the loads of
// an unrolled step stay in one basic block, so ptxas may issue them all before their first use
// (`ok ? LoadWeightChunk(p) : zeros` puts each load behind its own branch, and the loads then go
// out one step ahead of their use; bench/RESULTS.md, session 22). kL2Bytes: the L2 fetch size, 256
// or 128. The fp8 GEMVs (matmul.cu's LoadFp8Steps) take 128: a warp load reads 64 bytes of each of
// eight rows, and after a kernel that read scattered device memory (the decode step's attention
// over its page pool) the one-token GEMV's 256-byte fetches ran 9-13% slower on gate|up and the LM
// head, 128-byte ones 1-6%, and no slower without that kernel (H200, bench/RESULTS.md session 24:
// the 8B graph step at 128K 7.22 -> 6.84 ms, without a document 3.05 -> 2.90 ms); the 2-16 token
// GEMV gained 3-6% from them in session 25.
#define STRATA_WEIGHT_CHUNK_IF_ASM(l2)                                                    \
  "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"          \
  " mov.b32 %2, 0;\n mov.b32 %3, 0;\n"                                                     \
  " @q ld.global.nc.L1::no_allocate.L2::" l2 ".v4.u32 {%0, %1, %2, %3}, [%4];\n}"
template <int kL2Bytes = 256>
__device__ __forceinline__ uint4 LoadWeightChunkIf(const uint4* p, bool ok) {
  static_assert(kL2Bytes == 256 || kL2Bytes == 128, "L2 fetch of 256 or 128 bytes");
  uint4 r;
  if constexpr (kL2Bytes == 256) {
    asm(STRATA_WEIGHT_CHUNK_IF_ASM("256B") : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "r"(static_cast<int>(ok)));
  } else {
    asm(STRATA_WEIGHT_CHUNK_IF_ASM("128B") : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p), "r"(static_cast<int>(ok)));
  }
  return r;
}
#undef STRATA_WEIGHT_CHUNK_IF_ASM

// c += a * b for one m16n8k16 tile (PTX ISA "Matrix Fragments for mma.m16n8k16"), f32
// accumulators: bf16 inputs (MmaBf16) or f16 ones (MmaF16).
__device__ __forceinline__ void MmaBf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void MmaF16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 codes (the low byte first) as an f16 pair (the low half first), exactly: one cvt.
__device__ __forceinline__ uint32_t E4m3PairToF16x2(uint32_t pair16) {
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(static_cast<unsigned short>(pair16)));
  return r;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Grid size for a grid-stride loop over n elements with `threads` per block.
inline unsigned int GridFor(int64_t n, int threads) {
  int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 65535LL * 16) blocks = 65535LL * 16;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned int>(blocks);
}

// Calls body.template operator()<T>() with T the device type of `t` (float/bf16/half).
#define STRATA_DISPATCH_FLOAT_TYPE(t, T, ...)              \
  switch (t) {                                             \
    case ::strata::kernels::cuda_internal::FloatType::kF32: { \
      using T = float;                                     \
      __VA_ARGS__;                                         \
      break;                                               \
    }                                                      \
    case ::strata::kernels::cuda_internal::FloatType::kBF16: { \
      using T = __nv_bfloat16;                             \
      __VA_ARGS__;                                         \
      break;                                               \
    }                                                      \
    case ::strata::kernels::cuda_internal::FloatType::kF16: { \
      using T = __half;                                    \
      __VA_ARGS__;                                         \
      break;                                               \
    }                                                      \
    default:                                               \
      return cudaErrorInvalidValue;                        \
  }

// dst[i] = src[i] for the chunk of kThreadsT * kUnrollT vectors from `base` (indices below n),
// each thread issuing all its loads before its stores (many loads in flight per thread: the copy
// kernels over pinned host memory read at the link's rate only so). Shared by the page fills
// (page_copy.cu PageCopyKernel, page_cache.cu ResolveCopyKernel), the small-copy kernel
// (page_copy.cu CopyKernel) and host_read_bench.cu.
template <int kThreadsT, int kUnrollT, typename V>
__device__ __forceinline__ void CopyChunk(V* __restrict__ dst, const V* __restrict__ src,
                                          int64_t base, int64_t n) {
  V r[kUnrollT];
#pragma unroll
  for (int u = 0; u < kUnrollT; ++u) {
    const int64_t i = base + u * kThreadsT + threadIdx.x;
    if (i < n) r[u] = src[i];
  }
#pragma unroll
  for (int u = 0; u < kUnrollT; ++u) {
    const int64_t i = base + u * kThreadsT + threadIdx.x;
    if (i < n) dst[i] = r[u];
  }
}

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_COMMON_CUH_
