// The SM clock under load for the CUDA micro-benchmarks of kernels/cuda (cluster_latency_bench.cu,
// key_read_bench.cu), which time their kernels in clock64() cycles: one block spinning for a known
// number of cycles, timed by CUDA events. Included by one .cu file per program.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_BENCH_CLOCK_CUH_
#define STRATA_KERNELS_CUDA_INTERNAL_BENCH_CLOCK_CUH_

#include <cuda_runtime.h>

#include "kernels/cuda/internal/bench_check.h"

namespace strata::kernels::cuda_internal {
namespace {

__global__ void BenchSpinKernel(long long cycles, long long* out) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  if (threadIdx.x == 0) out[blockIdx.x] = clock64() - t0;
}

// GHz: 2e7 cycles of one warp's spin over their event time (after a warm-up spin).
inline double MeasureSmClockGhz() {
  long long* d_spin = nullptr;
  CUDA_BENCH_CHECK(cudaMalloc(&d_spin, sizeof(long long)));
  cudaEvent_t e0, e1;
  CUDA_BENCH_CHECK(cudaEventCreate(&e0));
  CUDA_BENCH_CHECK(cudaEventCreate(&e1));
  BenchSpinKernel<<<1, 32>>>(1000000, d_spin);
  CUDA_BENCH_CHECK(cudaDeviceSynchronize());
  CUDA_BENCH_CHECK(cudaEventRecord(e0));
  BenchSpinKernel<<<1, 32>>>(20000000, d_spin);
  CUDA_BENCH_CHECK(cudaEventRecord(e1));
  CUDA_BENCH_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_BENCH_CHECK(cudaEventDestroy(e0));
  CUDA_BENCH_CHECK(cudaEventDestroy(e1));
  CUDA_BENCH_CHECK(cudaFree(d_spin));
  return 20000000.0 / (ms * 1e6);
}

}  // namespace
}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_BENCH_CLOCK_CUH_
