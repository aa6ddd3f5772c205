// The MatMul implementations of the CPU backend, exposed for tests and measurements. CpuMatMul
// picks one (kAuto); the others exist so tests can check every path against a naive reference
// and so the paths can be timed against each other. Thread-safe (stateless).
#ifndef STRATA_KERNELS_CPU_INTERNAL_MATMUL_H_
#define STRATA_KERNELS_CPU_INTERNAL_MATMUL_H_

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace strata::kernels::cpu_internal {

enum class MatMulPath {
  kAuto,  // tiny products: kRowDot (one thread); f32 weights: BLAS; bf16/f16: kRowDot for
          // few tokens, kBlockedBlas otherwise
  kRowDot,   // plain loops: each output row of the weight converted once, dotted with every token
  kBlockedBlas,  // blocks of weight rows converted to f32, then sgemm per block (OpenBLAS)
};

// Tokens up to which kAuto uses kRowDot for bf16/f16 weights (decode-sized batches).
inline constexpr int64_t kRowDotMaxTokens = 4;

// Runs `path` (rounding the activations first when p.precision asks for it; see
// MatMulPrecision).
absl::Status MatMulWithPath(const MatMulParams& p, MatMulPath path);

// out[i] = in[i] rounded to weight_type (bf16|f16, round to nearest even; f16 for fp8_e4m3) and
// back to f32, for i in [0, n): the activations MatMulPrecision::kRoundActivations (and every
// fp8-weight MatMul) multiplies. f32: a copy. `out` may alias `in`.
void RoundActivations(const float* in, DType weight_type, int64_t n, float* out);

}  // namespace strata::kernels::cpu_internal

#endif  // STRATA_KERNELS_CPU_INTERNAL_MATMUL_H_
