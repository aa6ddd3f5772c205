// MatMul paths of the CPU backend against each other (kernels/cpu/internal/matmul.h):
// plain row-dot loops vs converted blocks + OpenBLAS sgemm, for f32 and bf16 weights, from decode
// (1 token) to prefill (512 tokens) on a 2048 x 2048 projection, on one thread and on all cores.
// dtype: 0 = f32, 1 = bf16; path: 1 = row-dot loops, 2 = converted blocks + sgemm. Reports FLOP/s and the weight
// bytes read per second.
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/backend.h"
#include "kernels/cpu/internal/matmul.h"

namespace strata::kernels {
namespace {

void BM_MatMul(benchmark::State& state) {
  const int64_t n = state.range(0), k = 2048, m = 2048;
  const DType dt = static_cast<DType>(state.range(1));
  const auto path = static_cast<cpu_internal::MatMulPath>(state.range(2));
  auto backend = MakeCpuBackend(static_cast<int>(state.range(3)));  // threads; 0 = all cores
  std::vector<float> in(n * k), out(n * m), wf(m * k);
  for (int64_t i = 0; i < n * k; ++i) in[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
  for (int64_t i = 0; i < m * k; ++i) wf[i] = static_cast<float>((i * 53) % 97) / 97.0f - 0.5f;
  std::vector<uint8_t> w(m * k * DTypeSize(dt));
  ConvertFromF32(wf.data(), w.data(), dt, m * k);
  MatMulParams p{TensorView(in.data(), DType::kF32, {n, k}), TensorView(w.data(), dt, {m, k}),
                 TensorView(), TensorView(out.data(), DType::kF32, {n, m})};
  // One op through the backend so it sets the thread counts, then the chosen path directly.
  if (!backend->MatMul(p, nullptr).ok()) state.SkipWithError("MatMul failed");
  for (auto _ : state) {
    if (!cpu_internal::MatMulWithPath(p, path).ok()) state.SkipWithError("MatMul failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * n * m * k * 1e-9 * state.iterations(),
                                                benchmark::Counter::kIsRate);
  state.counters["weightGBps"] = benchmark::Counter(
      1e-9 * m * k * DTypeSize(dt) * state.iterations(), benchmark::Counter::kIsRate);
}

void Args(benchmark::internal::Benchmark* b) {
  for (int64_t threads : {1, 0})
  for (int64_t n : {1, 4, 64, 512}) {
    for (int dt : {static_cast<int>(DType::kF32), static_cast<int>(DType::kBF16)}) {
      for (int path : {static_cast<int>(cpu_internal::MatMulPath::kRowDot),
                       static_cast<int>(cpu_internal::MatMulPath::kBlockedBlas)}) {
        b->Args({n, dt, path, threads});
      }
    }
  }
  b->ArgNames({"tokens", "dtype", "path", "threads"})->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(BM_MatMul)->Apply(Args);

}  // namespace
}  // namespace strata::kernels

BENCHMARK_MAIN();
