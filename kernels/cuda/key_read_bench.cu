// How fast one SM reads pages of keys (16 KiB: 64 bf16 rows of 128) into the SM, the question
// behind SelectStagesKernel's key stage (one cluster of 8 blocks per KV head, 1024 keys per block
// at tokenselect's 8192 candidates): a micro-benchmark on the CUDA runtime and kernels/cuda's
// mbarrier and bulk-copy helpers (internal/common.cuh).
//   ldg      the warp loads 8 rows x 256 B per step as StageScoreMma does (lane (r, t): row r,
//            16 bytes at 64p + 16t for p < 4; 32 loads of 16 bytes in flight per lane)
//   bulkN    the TMA: each warp owns 16 KiB of shared memory and fills it with bulk copies of N
//            bytes (cp.async.bulk ... complete_tx on the warp's mbarrier), then reads it back in
//            the ldg pattern; one page at a time
//   bulkN/2  the same with two 8 KiB halves per warp: the next half is copied while one is read
// Each block reads `pages` pages at random slots of a 1 GiB pool; 256 threads, one block per SM.
// Figures: per block, clock64 from the first issue to the last read, median and max over blocks
// in microseconds at the measured SM clock, and the block's bytes over the median time (GB/s per
// SM); "warm": the same pages read again right after (L2-resident), "cold": after a 256 MiB
// memset (L2 flushed).
// Usage: cuda_key_read_bench [pages per block = 16]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/cuda/internal/bench_check.h"
#include "kernels/cuda/internal/bench_clock.cuh"
#include "kernels/cuda/internal/common.cuh"

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kPageBytes = 16384;
constexpr int kPageChunks = kPageBytes / 16;  // uint4 per page

using strata::kernels::cuda_internal::BulkCopyToShared;
using strata::kernels::cuda_internal::MbarExpect;
using strata::kernels::cuda_internal::MbarInit;
using strata::kernels::cuda_internal::MbarWait;
using strata::kernels::cuda_internal::SharedAddr;

// The warp's read of kTiles x 8 rows (of 16 uint4) at `src` in the ldg pattern, folded into acc.
template <int kTiles>
__device__ __forceinline__ uint32_t FoldRows(const uint4* src, uint32_t acc) {
  const int lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3;
  uint4 b[kTiles][4];
#pragma unroll
  for (int u = 0; u < kTiles; ++u) {
#pragma unroll
    for (int p = 0; p < 4; ++p) b[u][p] = src[(u * 8 + r) * 16 + 4 * p + t];
  }
#pragma unroll
  for (int u = 0; u < kTiles; ++u) {
#pragma unroll
    for (int p = 0; p < 4; ++p) acc += b[u][p].x ^ b[u][p].y ^ b[u][p].z ^ b[u][p].w;
  }
  return acc;
}

// mode 0: ldg; 1: bulk, one 16 KiB buffer per warp; 2: bulk, two 8 KiB halves per warp.
__global__ void __launch_bounds__(kThreads, 1)
    ReadKernel(int mode, int chunk, const uint4* __restrict__ pool, const int* __restrict__ slots,
               int pages, long long* cycles, uint32_t* sink) {
  extern __shared__ __align__(128) uint4 smem[];  // kWarps x 16 KiB
  __shared__ __align__(8) uint64_t bars[2 * kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int* my = slots + static_cast<int64_t>(blockIdx.x) * pages;
  if (threadIdx.x < 2 * kWarps) MbarInit(SharedAddr(&bars[threadIdx.x]), 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const long long t0 = clock64();
  uint32_t acc = 0;
  if (mode == 0) {
    for (int i = warp; i < pages; i += kWarps) {
      acc = FoldRows<8>(pool + static_cast<int64_t>(my[i]) * kPageChunks, acc);
    }
  } else if (mode == 1) {
    uint4* buf = smem + warp * kPageChunks;
    const uint32_t bar = SharedAddr(&bars[warp]);
    uint32_t parity = 0;
    for (int i = warp; i < pages; i += kWarps) {
      const unsigned char* src =
          reinterpret_cast<const unsigned char*>(pool + static_cast<int64_t>(my[i]) * kPageChunks);
      if (lane == 0) MbarExpect(bar, kPageBytes);
      for (int c = lane; c < kPageBytes / chunk; c += 32) {
        BulkCopyToShared(SharedAddr(buf) + c * chunk, src + c * chunk, chunk, bar);
      }
      MbarWait(bar, parity);
      parity ^= 1u;
      acc = FoldRows<8>(buf, acc);
      __syncwarp();
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
  } else {
    // Half pages h = 0, 1, ... of the warp's pages (i = warp + 8 (h / 2)), half h in buffer h & 1.
    uint4* buf = smem + warp * kPageChunks;
    const int my_pages = pages > warp ? (pages - warp + kWarps - 1) / kWarps : 0;
    const int halves = 2 * my_pages;
    uint32_t parity[2] = {0u, 0u};
    auto issue = [&](int h) {
      const int i = warp + kWarps * (h >> 1);
      const unsigned char* src =
          reinterpret_cast<const unsigned char*>(pool + static_cast<int64_t>(my[i]) * kPageChunks) +
          (h & 1) * (kPageBytes / 2);
      const uint32_t bar = SharedAddr(&bars[2 * warp + (h & 1)]);
      const uint32_t dst = SharedAddr(buf) + (h & 1) * (kPageBytes / 2);
      if (lane == 0) MbarExpect(bar, kPageBytes / 2);
      const int c_bytes = min(chunk, kPageBytes / 2);
      for (int c = lane; c < kPageBytes / 2 / c_bytes; c += 32) {
        BulkCopyToShared(dst + c * c_bytes, src + c * c_bytes, c_bytes, bar);
      }
    };
    if (halves > 0) issue(0);
    if (halves > 1) issue(1);
    for (int h = 0; h < halves; ++h) {
      MbarWait(SharedAddr(&bars[2 * warp + (h & 1)]), parity[h & 1]);
      parity[h & 1] ^= 1u;
      acc = FoldRows<4>(buf + (h & 1) * (kPageChunks / 2), acc);
      __syncwarp();
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      if (h + 2 < halves) issue(h + 2);
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  if (acc == 0x12345678u) sink[blockIdx.x * kThreads + threadIdx.x] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const int pages = argc > 1 ? std::atoi(argv[1]) : 16;
  if (pages < 1 || pages > 64) {
    std::fprintf(stderr, "usage: cuda_key_read_bench [pages per block, 1-64]\n");
    return 2;
  }
  cudaDeviceProp prop;
  CUDA_BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double ghz = strata::kernels::cuda_internal::MeasureSmClockGhz();
  cudaEvent_t e0, e1;
  CUDA_BENCH_CHECK(cudaEventCreate(&e0));
  CUDA_BENCH_CHECK(cudaEventCreate(&e1));
  float ms = 0;
  std::printf("device: %s, %d SMs, SM clock ~%.2f GHz, %d pages (%d KiB) per block\n", prop.name,
              prop.multiProcessorCount, ghz, pages, pages * kPageBytes / 1024);

  const int64_t pool_pages = 65536;  // 1 GiB
  uint4* pool = nullptr;
  CUDA_BENCH_CHECK(cudaMalloc(&pool, pool_pages * kPageBytes));
  CUDA_BENCH_CHECK(cudaMemset(pool, 0x5a, pool_pages * kPageBytes));
  void* flush = nullptr;
  const size_t flush_bytes = size_t{256} << 20;
  CUDA_BENCH_CHECK(cudaMalloc(&flush, flush_bytes));
  const int max_blocks = 132;
  int* d_slots = nullptr;
  long long* d_cycles = nullptr;
  uint32_t* d_sink = nullptr;
  CUDA_BENCH_CHECK(cudaMalloc(&d_slots, sizeof(int) * max_blocks * pages));
  CUDA_BENCH_CHECK(cudaMalloc(&d_cycles, sizeof(long long) * max_blocks));
  CUDA_BENCH_CHECK(cudaMalloc(&d_sink, sizeof(uint32_t) * max_blocks * kThreads));
  const int smem = kWarps * kPageBytes;
  CUDA_BENCH_CHECK(
      cudaFuncSetAttribute(ReadKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::mt19937 rng(7);

  struct Variant {
    const char* name;
    int mode, chunk;
  };
  const Variant variants[] = {{"ldg", 0, 0},           {"bulk16384", 1, 16384},
                              {"bulk4096", 1, 4096},   {"bulk1024", 1, 1024},
                              {"bulk256", 1, 256},     {"bulk8192/2", 2, 8192},
                              {"bulk1024/2", 2, 1024}, {"bulk256/2", 2, 256}};
  std::printf("%-11s %6s %5s %10s %10s %10s %12s\n", "variant", "blocks", "L2", "median_us",
              "max_us", "event_us", "GB/s per SM");
  for (const Variant& v : variants) {
    for (int blocks : {64, 128}) {
      for (int cold = 0; cold < 2; ++cold) {
        std::vector<double> med, mx, ev;
        for (int rep = 0; rep < 7; ++rep) {
          // Distinct random slots per rep.
          std::vector<int> s(static_cast<size_t>(blocks) * pages);
          for (int& x : s) x = static_cast<int>(rng() % pool_pages);
          CUDA_BENCH_CHECK(cudaMemcpy(d_slots, s.data(), s.size() * sizeof(int),
                                      cudaMemcpyHostToDevice));
          if (!cold) {  // the pages read once to make them L2-resident
            ReadKernel<<<blocks, kThreads, smem>>>(v.mode, v.chunk, pool, d_slots, pages,
                                                   d_cycles, d_sink);
          } else {
            CUDA_BENCH_CHECK(cudaMemsetAsync(flush, rep, flush_bytes));
          }
          CUDA_BENCH_CHECK(cudaEventRecord(e0));
          ReadKernel<<<blocks, kThreads, smem>>>(v.mode, v.chunk, pool, d_slots, pages, d_cycles,
                                                 d_sink);
          CUDA_BENCH_CHECK(cudaEventRecord(e1));
          CUDA_BENCH_CHECK(cudaEventSynchronize(e1));
          CUDA_BENCH_CHECK(cudaGetLastError());
          CUDA_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          std::vector<long long> c(blocks);
          CUDA_BENCH_CHECK(cudaMemcpy(c.data(), d_cycles, blocks * sizeof(long long),
                                      cudaMemcpyDeviceToHost));
          std::sort(c.begin(), c.end());
          med.push_back(c[blocks / 2] / (ghz * 1e3));
          mx.push_back(c[blocks - 1] / (ghz * 1e3));
          ev.push_back(ms * 1e3);
        }
        std::sort(med.begin(), med.end());
        std::sort(mx.begin(), mx.end());
        std::sort(ev.begin(), ev.end());
        const double m = med[med.size() / 2];
        std::printf("%-11s %6d %5s %10.2f %10.2f %10.2f %12.1f\n", v.name, blocks,
                    cold ? "cold" : "warm", m, mx[mx.size() / 2], ev[ev.size() / 2],
                    pages * kPageBytes / (m * 1e3));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
