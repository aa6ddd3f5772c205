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
// Then the cost of a whole launch in the shape of the partitioned selection kernel
// (selection.cu PartStagesKernel: grid (16 parts, 8 KV heads), 256 threads, 0 or 85 KiB of
// dynamic shared memory), doing nothing but the merge of the parts' per-head partials (4 query
// heads x 128 floats plus max and sum per part): a graph of 50 launches replayed, microseconds
// per launch (median of 5 replays):
//   empty          thread 0 of each block writes one word (no cluster)
//   empty/c16      the same in clusters of 16 blocks, with the closing cluster barrier
//   dsmem/c16      the kernel's merge: mbarriers set up at the start, partials pushed with
//                  st.async to block h of the cluster, which merges query head h
//   global         no cluster: partials to global memory, a fence and a per-KV-head counter;
//                  the block that arrives last merges every head and resets the counter
//   global+combine no cluster: partials to global memory, then a second kernel (8 blocks)
//                  merges them
// Usage: cuda_cluster_latency_bench [threads=256] [launch]   (launch: only the launch costs)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/internal/bench_check.h"
#include "kernels/cuda/internal/bench_clock.cuh"
#include "kernels/cuda/internal/common.cuh"

namespace cg = cooperative_groups;
using strata::kernels::cuda_internal::ClusterLaunchConfig;
using strata::kernels::cuda_internal::MapToRank;
using strata::kernels::cuda_internal::MbarExpect;
using strata::kernels::cuda_internal::MbarInit;
using strata::kernels::cuda_internal::MbarWait;
using strata::kernels::cuda_internal::SharedAddr;
using strata::kernels::cuda_internal::StAsync8;

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

// ---- Launch costs in the partitioned selection kernel's shape --------------------------------
constexpr int kMergeParts = 16, kMergeHeads = 8, kMergeGroup = 4, kMergeDim = 128;
constexpr int kMergeStride = kMergeDim + 2;  // o[128], max, sum

// The block's partial of query head h: o[d] and (max, sum), made up from its indices.
__device__ __forceinline__ float PartialValue(int part, int g, int h, int d) {
  return static_cast<float>((part * 7 + g * 3 + h + d) & 15) * 0.125f;
}

// Merges query head h of KV head g from parts' partials read by `at(part, i)` (i < 130); thread
// `d2` (< 64) writes dims 2 d2 and 2 d2 + 1.
template <typename At>
__device__ __forceinline__ void MergeHead(int g, int h, int d2, At at, float* out) {
  float mx = -INFINITY;
  for (int b = 0; b < kMergeParts; ++b) mx = fmaxf(mx, at(b, kMergeDim));
  float o0 = 0.0f, o1 = 0.0f, l = 0.0f;
  for (int b = 0; b < kMergeParts; ++b) {
    const float e = __expf(at(b, kMergeDim) - mx);
    o0 += e * at(b, 2 * d2);
    o1 += e * at(b, 2 * d2 + 1);
    l += e * at(b, kMergeDim + 1);
  }
  const int qh = g * kMergeGroup + h;
  out[qh * kMergeDim + 2 * d2] = o0 / l;
  out[qh * kMergeDim + 2 * d2 + 1] = o1 / l;
}

// mode 0 empty, 1 empty in a cluster (closing cluster barrier), 2 dsmem merge (cluster of
// kMergeParts), 3 global merge by the last block, 4 partials to global only (combine after).
__global__ void __launch_bounds__(256) MergeLaunchKernel(int mode, float* partials,
                                                         unsigned* counters, float* out) {
  extern __shared__ __align__(16) unsigned char merge_smem[];
  __shared__ float recv[kMergeParts][kMergeStride];
  __shared__ unsigned long long mbar;
  __shared__ int last;
  const int tid = threadIdx.x, part = blockIdx.x, g = blockIdx.y;
  if (mode == 0) {
    if (tid == 0) out[g * kMergeParts + part] = 1.0f + merge_smem[0] * 0.0f;
    return;
  }
  if (mode == 1) {
    if (tid == 0) out[g * kMergeParts + part] = 1.0f;
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    return;
  }
  const int h = tid >> 6, d2 = tid & 63;
  if (mode == 2) {
    if (tid == 0) {
      MbarInit(SharedAddr(&mbar), 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    if (tid == 0 && part < kMergeGroup) {
      MbarExpect(SharedAddr(&mbar), kMergeParts * kMergeStride * sizeof(float));
    }
    __syncthreads();
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    const uint32_t bar = MapToRank(SharedAddr(&mbar), h);
    StAsync8(MapToRank(SharedAddr(&recv[part][2 * d2]), h),
             make_float2(PartialValue(part, g, h, 2 * d2), PartialValue(part, g, h, 2 * d2 + 1)),
             bar);
    if (d2 == 0) {
      StAsync8(MapToRank(SharedAddr(&recv[part][kMergeDim]), h),
               make_float2(PartialValue(part, g, h, 0), 1.0f), bar);
    }
    if (part < kMergeGroup) {
      MbarWait(SharedAddr(&mbar), 0);
      if (tid < 64) {
        MergeHead(g, part, tid, [&](int b, int i) { return recv[b][i]; }, out);
      }
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    return;
  }
  // Global memory: the block's partials at partials[((g * parts + part) * group + h) * stride].
  float* mine = partials + ((static_cast<int64_t>(g) * kMergeParts + part) * kMergeGroup + h) *
                               kMergeStride;
  mine[2 * d2] = PartialValue(part, g, h, 2 * d2);
  mine[2 * d2 + 1] = PartialValue(part, g, h, 2 * d2 + 1);
  if (d2 == 0) {
    mine[kMergeDim] = PartialValue(part, g, h, 0);
    mine[kMergeDim + 1] = 1.0f;
  }
  if (mode == 4) return;
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&counters[g], 1u) == kMergeParts - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const float* base = partials + static_cast<int64_t>(g) * kMergeParts * kMergeGroup * kMergeStride;
  MergeHead(g, h, d2, [&](int b, int i) {
    return __ldcg(base + (b * kMergeGroup + h) * kMergeStride + i);
  }, out);
  if (tid == 0) counters[g] = 0;
}

// grid (KV heads), 256 threads: merges every query head of KV head g (mode 4's combine kernel).
__global__ void __launch_bounds__(256) MergeCombineKernel(const float* partials, float* out) {
  const int tid = threadIdx.x, g = blockIdx.x, h = tid >> 6, d2 = tid & 63;
  const float* base = partials + static_cast<int64_t>(g) * kMergeParts * kMergeGroup * kMergeStride;
  MergeHead(g, h, d2, [&](int b, int i) {
    return base[(b * kMergeGroup + h) * kMergeStride + i];
  }, out);
}

void LaunchCosts() {
  constexpr int kLaunches = 50, kReplays = 5;
  constexpr size_t kBigSmem = 85 * 1024;
  CUDA_BENCH_CHECK(cudaFuncSetAttribute(MergeLaunchKernel,
                                        cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CUDA_BENCH_CHECK(cudaFuncSetAttribute(
      MergeLaunchKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBigSmem)));
  float *partials, *out;
  unsigned* counters;
  CUDA_BENCH_CHECK(cudaMalloc(&partials, size_t{kMergeHeads} * kMergeParts * kMergeGroup *
                                             kMergeStride * sizeof(float)));
  CUDA_BENCH_CHECK(cudaMalloc(&out, size_t{kMergeHeads} * kMergeParts * kMergeDim * sizeof(float)));
  CUDA_BENCH_CHECK(cudaMalloc(&counters, kMergeHeads * sizeof(unsigned)));
  CUDA_BENCH_CHECK(cudaMemset(counters, 0, kMergeHeads * sizeof(unsigned)));
  cudaStream_t stream;
  CUDA_BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CUDA_BENCH_CHECK(cudaEventCreate(&e0));
  CUDA_BENCH_CHECK(cudaEventCreate(&e1));
  std::printf("launch costs: grid (%d, %d), 256 threads, graph of %d launches, us per launch\n",
              kMergeParts, kMergeHeads, kLaunches);
  std::printf("%-16s %10s %10s\n", "launch", "smem 0", "smem 85K");
  const char* names[5] = {"empty", "empty/c16", "dsmem/c16", "global", "global+combine"};
  for (int mode = 0; mode < 5; ++mode) {
    double us[2];
    for (int big = 0; big < 2; ++big) {
      const size_t smem = big ? kBigSmem : 0;
      const int cluster = mode == 1 || mode == 2 ? kMergeParts : 0;
      cudaGraph_t graph;
      CUDA_BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < kLaunches; ++i) {
        const ClusterLaunchConfig launch(dim3(kMergeParts, kMergeHeads), dim3(256), smem, stream,
                                         cluster, /*dependent=*/false);
        CUDA_BENCH_CHECK(
            cudaLaunchKernelEx(&launch.cfg, MergeLaunchKernel, mode, partials, counters, out));
        if (mode == 4) MergeCombineKernel<<<kMergeHeads, 256, 0, stream>>>(partials, out);
      }
      CUDA_BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec;
      CUDA_BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      CUDA_BENCH_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_BENCH_CHECK(cudaStreamSynchronize(stream));
      std::vector<double> per;
      for (int r = 0; r < kReplays; ++r) {
        CUDA_BENCH_CHECK(cudaEventRecord(e0, stream));
        CUDA_BENCH_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_BENCH_CHECK(cudaEventRecord(e1, stream));
        CUDA_BENCH_CHECK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CUDA_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        per.push_back(ms * 1000.0 / kLaunches);
      }
      std::sort(per.begin(), per.end());
      us[big] = per[kReplays / 2];
      CUDA_BENCH_CHECK(cudaGraphExecDestroy(exec));
      CUDA_BENCH_CHECK(cudaGraphDestroy(graph));
    }
    std::printf("%-16s %10.2f %10.2f\n", names[mode], us[0], us[1]);
  }
  // The merged output of the last launch against the partials' formula (every mode merges the
  // same values): max abs difference over the query heads of KV head 0.
  std::vector<float> got(kMergeGroup * kMergeDim);
  CUDA_BENCH_CHECK(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double worst = 0.0;
  for (int h = 0; h < kMergeGroup; ++h) {
    for (int d = 0; d < kMergeDim; ++d) {
      double mx = -1e30, o = 0.0, l = 0.0;
      auto val = [&](int b, int dd) { return ((b * 7 + h + dd) & 15) * 0.125; };
      for (int b = 0; b < kMergeParts; ++b) mx = std::max(mx, val(b, 0));
      for (int b = 0; b < kMergeParts; ++b) {
        const double e = std::exp(val(b, 0) - mx);
        o += e * val(b, d);
        l += e;
      }
      worst = std::max(worst, std::abs(o / l - got[h * kMergeDim + d]));
    }
  }
  std::printf("merge check (global+combine, KV head 0): max |diff| %.3g\n", worst);
  CUDA_BENCH_CHECK(cudaFree(partials));
  CUDA_BENCH_CHECK(cudaFree(out));
  CUDA_BENCH_CHECK(cudaFree(counters));
  CUDA_BENCH_CHECK(cudaStreamDestroy(stream));
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 256;
  if (argc > 2 && std::string(argv[2]) == "launch") {
    LaunchCosts();
    return 0;
  }
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
        const ClusterLaunchConfig launch(dim3(blocks), dim3(threads), 0, nullptr, cs,
                                         /*dependent=*/false);
        std::vector<double> per;
        for (int rep = 0; rep < 3; ++rep) {
          CUDA_BENCH_CHECK(cudaLaunchKernelEx(&launch.cfg, LatencyKernel, mode, iters, d_cycles,
                                              d_sink, d_global));
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
  LaunchCosts();
  return 0;
}
