// Helpers of the CUDA backend's timing programs (kernels/cuda/*_bench_main.cc): a check that ends
// the program, a stream gate for back-to-back timing, the median of samples and an allocation
// that must succeed. Header-only; plain programs, not tests.
#ifndef STRATA_KERNELS_CUDA_TESTING_BENCH_UTIL_H_
#define STRATA_KERNELS_CUDA_TESTING_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "kernels/backend.h"

// Ends the program with "failed: <what>" when `cond` is false.
#define BENCH_CHECK(cond, what)                   \
  do {                                            \
    if (!(cond)) {                                \
      std::fprintf(stderr, "failed: %s\n", what); \
      std::exit(1);                               \
    }                                             \
  } while (0)

namespace strata::kernels::bench {

// Holds a stream (cudaLaunchHostFunc(stream, Gate::Wait, &gate)) until `open` is set: the calls
// enqueued behind it then run back to back on the device.
struct Gate {
  std::atomic<bool> open{false};
  static void CUDART_CB Wait(void* self) {
    auto* g = static_cast<Gate*>(self);
    while (!g->open.load(std::memory_order_acquire)) {
    }
  }
};

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// At least 256 bytes of backend memory; ends the program when the allocation fails.
inline std::unique_ptr<Buffer> MustAllocate(Backend& b, size_t bytes) {
  auto r = b.Allocate(std::max<size_t>(bytes, 256));
  BENCH_CHECK(r.ok(), "allocation");
  return std::move(r).value();
}

}  // namespace strata::kernels::bench

#endif  // STRATA_KERNELS_CUDA_TESTING_BENCH_UTIL_H_
