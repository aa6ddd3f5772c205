// Latency of the synchronisation steps a cluster-wide selection kernel is built from, on the GPU
// it runs on (a micro-benchmark: no Strata code, plain CUDA runtime):
//   cluster_sync   barrier.cluster arrive.release + wait.acquire, all threads, per barrier
//   block_sync     __syncthreads, per barrier
//   dsmem_chain    one thread: a chain of dependent loads from another block's shared memory
//   dsmem_fan16    every thread: 16 independent loads, one from each block of the cluster, summed
//                  (the histogram exchange of one radix pass), per round
//   smem_chain     one thread: a chain of dependent loads from its own shared memory
//   atomics+sync   two shared atomics per thread, then a cluster barrier (release / acquire)
//   stores+sync    one global store per thread, then a cluster barrier (release / acquire)
//   atomics+relax, atomics+fence, stores+relax: the arrive relaxed (no release), or relaxed
//                  after fence.acq_rel.cluster
// Each kernel loops `iters` times between two clock64() reads; the figure is cycles per step
// (median over blocks of thread 0), converted to ns at the measured SM clock.
// Usage: cuda_cluster_latency_bench [threads=256]
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/internal/bench_check.h"
#include "kernels/cuda/internal/bench_clock.cuh"

namespace cg = cooperative_groups;


__device__ __forceinline__ void Arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void Wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// mode 0: cluster barriers; 1: block barriers; 2: dependent remote loads (thread 0);
// 3: 16 independent remote loads per thread; 4: dependent local loads (thread 0);
// 5: two shared atomics per thread, then a cluster barrier; 6: one global store per thread, then
// a cluster barrier; 7: as 5 with a relaxed arrive (no release); 8: as 5 with a relaxed arrive
// after fence.acq_rel.cluster; 9: as 6 with a relaxed arrive.
__global__ void LatencyKernel(int mode, int iters, long long* cycles, unsigned* sink,
                              unsigned* global) {
  __shared__ unsigned buf[1024];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) buf[i] = (i * 7 + 1) & 1023;
  cluster.sync();
  unsigned acc = 0;
  long long t0 = 0, t1 = 0;
  if (mode == 0) {
    t0 = clock64();
    for (int i = 0; i < iters; ++i) {
      Arrive();
      Wait();
    }
    t1 = clock64();
  } else if (mode == 1) {
    t0 = clock64();
    for (int i = 0; i < iters; ++i) __syncthreads();
    t1 = clock64();
  } else if (mode == 2) {
    if (threadIdx.x == 0) {
      const unsigned* remote = cluster.map_shared_rank(buf, (rank + 1) % cs);
      unsigned idx = 0;
      t0 = clock64();
      for (int i = 0; i < iters; ++i) idx = remote[idx];
      t1 = clock64();
      acc = idx;
    }
  } else if (mode == 3) {
    const unsigned* r[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) r[j] = cluster.map_shared_rank(buf, j % cs);
    unsigned idx = threadIdx.x & 1023;
    t0 = clock64();
    for (int i = 0; i < iters; ++i) {
      unsigned s = 0;
#pragma unroll
      for (int j = 0; j < 16; ++j) s += r[j][(idx + j) & 1023];
      idx = s & 1023;
    }
    t1 = clock64();
    acc = idx;
  } else if (mode == 4) {
    if (threadIdx.x == 0) {
      unsigned idx = 0;
      t0 = clock64();
      for (int i = 0; i < iters; ++i) idx = buf[idx];
      t1 = clock64();
      acc = idx;
    }
  } else {
    unsigned* mine = global + (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 32;
    t0 = clock64();
    for (int i = 0; i < iters; ++i) {
      if (mode == 6 || mode == 9) {
        mine[i & 31] = i;
      } else {
        atomicAdd(&buf[(threadIdx.x * 5 + i) & 255], 1u);
        atomicAdd(&buf[256 + ((threadIdx.x * 3 + i) & 255)], 1u);
      }
      if (mode == 8) asm volatile("fence.acq_rel.cluster;" ::: "memory");
      if (mode == 5 || mode == 6) {
        Arrive();
      } else {
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
      }
      Wait();
    }
    t1 = clock64();
  }
  cluster.sync();  // no block leaves while another may read its shared memory
  if (threadIdx.x == 0) {
    cycles[blockIdx.x] = t1 - t0;
    sink[blockIdx.x] = acc;
  }
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 256;
  cudaDeviceProp prop;
  CUDA_BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  CUDA_BENCH_CHECK(cudaFuncSetAttribute(LatencyKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const double ghz = strata::kernels::cuda_internal::MeasureSmClockGhz();
  std::printf("device: %s, %d SMs, SM clock under load ~%.2f GHz, %d threads per block\n",
              prop.name, prop.multiProcessorCount, ghz, threads);
  const char* names[10] = {"cluster_sync", "block_sync",   "dsmem_chain",  "dsmem_fan16",
                           "smem_chain",   "atomics+sync", "stores+sync",  "atomics+relax",
                           "atomics+fence", "stores+relax"};
  unsigned* d_global;
  CUDA_BENCH_CHECK(cudaMalloc(&d_global, size_t{16} * 8 * 1024 * 32 * sizeof(unsigned)));
  const int iters = 2000;
  std::printf("%-13s %8s %8s %10s %10s\n", "step", "cluster", "clusters", "cycles", "ns");
  for (int mode = 0; mode < 10; ++mode) {
    for (int cs : {2, 4, 8, 16}) {
      if (mode == 1 && cs != 16) continue;
      if (mode == 4 && cs != 2) continue;
      if (mode >= 5 && cs != 8 && cs != 16) continue;
      for (int clusters : {1, 8}) {
        const int blocks = cs * clusters;
        long long* d_cycles;
        unsigned* d_sink;
        CUDA_BENCH_CHECK(cudaMalloc(&d_cycles, blocks * sizeof(long long)));
        CUDA_BENCH_CHECK(cudaMalloc(&d_sink, blocks * sizeof(unsigned)));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(threads);
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = cs;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        std::vector<double> per;
        for (int rep = 0; rep < 3; ++rep) {
          CUDA_BENCH_CHECK(cudaLaunchKernelEx(&cfg, LatencyKernel, mode, iters, d_cycles, d_sink, d_global));
          CUDA_BENCH_CHECK(cudaDeviceSynchronize());
          std::vector<long long> c(blocks);
          CUDA_BENCH_CHECK(cudaMemcpy(c.data(), d_cycles, blocks * sizeof(long long),
                           cudaMemcpyDeviceToHost));
          std::sort(c.begin(), c.end());
          per.push_back(static_cast<double>(c[blocks / 2]) / iters);
        }
        std::sort(per.begin(), per.end());
        std::printf("%-13s %8d %8d %10.1f %10.1f\n", names[mode], cs, clusters, per[1],
                    per[1] / ghz);
        CUDA_BENCH_CHECK(cudaFree(d_cycles));
        CUDA_BENCH_CHECK(cudaFree(d_sink));
      }
    }
  }
  return 0;
}
