// CUDA_BENCH_CHECK for the CUDA micro-benchmarks of kernels/cuda (cluster_latency_bench.cu,
// host_read_bench.cu, gemv_weight_bench.cu, key_read_bench.cu): programs on the CUDA runtime,
// where a failed runtime call ends the run with its file, line, call and error string.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_BENCH_CHECK_H_
#define STRATA_KERNELS_CUDA_INTERNAL_BENCH_CHECK_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_BENCH_CHECK(x)                                                          \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                \
                   cudaGetErrorString(e_));                                         \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

#endif  // STRATA_KERNELS_CUDA_INTERNAL_BENCH_CHECK_H_
