// MatMul: out[n, o] = sum_i in[n, i] * weight[o, i] (+ bias[o]), f32 accumulation.
//
// f32 weights go to OpenBLAS sgemm (sgemv for one token), block by block. bf16/f16 weights: for a few
// tokens (decode) every weight row is converted once and dotted with each token (memory bound:
// the weight is read once, at its storage width); for more tokens blocks of kBlockRows weight rows
// are converted to f32 and multiplied with sgemm. Threads: OpenMP over blocks of output rows,
// OpenBLAS single-threaded inside each.
//
// fp8_e4m3 weights: the activations are rounded to f16 (as kRoundActivations for f16 weights),
// the rows converted to f32 like bf16 ones (every product exact in f32), and each output
// multiplied by its row's weight_scale before the bias.
//
// MatMulPrecision::kRoundActivations with bf16/f16 weights: the activations are first rounded to
// the weight's type (RoundActivations, into a copy), then the same paths run on the rounded
// values; every product is then exact in f32 (8 + 8 or 11 + 11 significant bits), so only the
// accumulation order differs from any other backend.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"
#include "kernels/cpu/internal/matmul.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;
using cpu_internal::CheckWeightDType;

absl::Status CpuSupportsMatMul(const MatMulParams& p) {
  constexpr const char* kOp = "MatMul";
  STRATA_RETURN_IF_ERROR(CheckRank(p.in, 2, kOp, "in"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.weight, 2, kOp, "weight"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 2, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.in, DType::kF32, kOp, "in"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  if (p.weight.dtype == DType::kFP8E4M3) {
    if (p.weight_scale.data == nullptr && p.weight.dim(0) > 0) {
      return absl::InvalidArgumentError("MatMul: fp8_e4m3 weights need weight_scale");
    }
    STRATA_RETURN_IF_ERROR(CheckRank(p.weight_scale, 1, kOp, "weight_scale"));
    STRATA_RETURN_IF_ERROR(CheckDType(p.weight_scale, DType::kF32, kOp, "weight_scale"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.weight_scale, 0, p.weight.dim(0), kOp, "weight_scale"));
  } else {
    STRATA_RETURN_IF_ERROR(CheckWeightDType(p.weight, kOp, "weight"));
    if (p.weight_scale.data != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "MatMul: weight_scale is for fp8_e4m3 weights, not ", DTypeName(p.weight.dtype)));
    }
  }
  STRATA_RETURN_IF_ERROR(CheckDim(p.weight, 1, p.in.dim(1), kOp, "weight"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.out, 0, p.in.dim(0), kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.out, 1, p.weight.dim(0), kOp, "out"));
  if (p.precision != MatMulPrecision::kSplit &&
      p.precision != MatMulPrecision::kRoundActivations) {
    return absl::InvalidArgumentError(absl::StrCat("MatMul: unknown precision ",
                                                   static_cast<int>(p.precision)));
  }
  if (p.bias.data != nullptr) {
    STRATA_RETURN_IF_ERROR(CheckRank(p.bias, 1, kOp, "bias"));
    STRATA_RETURN_IF_ERROR(CheckWeightDType(p.bias, kOp, "bias"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.bias, 0, p.weight.dim(0), kOp, "bias"));
  }
  return absl::OkStatus();
}

namespace cpu_internal {
namespace {

constexpr int64_t kBlockRows = 128;

// Dot product with 8 independent partial sums (lets the compiler vectorise without
// reassociation flags; also the reference order every path of this file shares).
inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

void RowDot(const MatMulParams& p) {
  const int64_t n = p.in.dim(0), k = p.in.dim(1), m = p.weight.dim(0);
  const float* in = p.in.As<const float>();
  float* out = p.out.As<float>();
#pragma omp parallel if (n * m * k >= kParallelMinWork)
  {
    std::vector<float> row(p.weight.dtype == DType::kF32 ? 0 : k);
#pragma omp for schedule(static)
    for (int64_t o = 0; o < m; ++o) {
      const float* w;
      if (p.weight.dtype == DType::kF32) {
        w = p.weight.As<const float>() + o * k;
      } else {
        LoadF32(p.weight, o * k, k, row.data());
        w = row.data();
      }
      for (int64_t t = 0; t < n; ++t) out[t * m + o] = Dot(in + t * k, w, k);
    }
  }
}

void BlockedBlas(const MatMulParams& p) {
  const int64_t n = p.in.dim(0), k = p.in.dim(1), m = p.weight.dim(0);
  const float* in = p.in.As<const float>();
  float* out = p.out.As<float>();
  const bool f32 = p.weight.dtype == DType::kF32;
  // Output rows are split into blocks; each OpenMP thread runs single-threaded sgemm on its
  // blocks (OpenBLAS is kept at one thread, see CpuBackend::ApplyThreads: its own workers
  // spin-wait after every call and fight the OpenMP team for cores).
  const int64_t block = std::min(kBlockRows, m);
  const int64_t num_blocks = (m + block - 1) / block;
#pragma omp parallel if (n * m * k >= kParallelMinWork)
  {
    std::vector<float> wf(f32 ? 0 : block * k);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t o0 = b * block;
      const int64_t rows = std::min(block, m - o0);
      const float* w;
      if (f32) {
        w = p.weight.As<const float>() + o0 * k;
      } else {
        for (int64_t r = 0; r < rows; ++r) LoadF32(p.weight, (o0 + r) * k, k, wf.data() + r * k);
        w = wf.data();
      }
      if (n == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, rows, k, 1.0f, w, k, in, 1, 0.0f, out + o0, 1);
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, rows, k, 1.0f, in, k, w, k, 0.0f,
                    out + o0, m);
      }
    }
  }
}

// fp8 weights: out[:, o] *= weight_scale[o] (before the bias).
void ApplyWeightScale(const MatMulParams& p) {
  if (p.weight.dtype != DType::kFP8E4M3) return;
  const int64_t n = p.out.dim(0), m = p.out.dim(1);
  const float* scale = p.weight_scale.As<const float>();
  float* out = p.out.As<float>();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < m; ++o) out[t * m + o] *= scale[o];
  }
}

void AddBias(const MatMulParams& p) {
  if (p.bias.data == nullptr) return;
  const int64_t n = p.out.dim(0), m = p.out.dim(1);
  std::vector<float> bias(m);
  LoadF32(p.bias, 0, m, bias.data());
  float* out = p.out.As<float>();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < m; ++o) out[t * m + o] += bias[o];
  }
}

}  // namespace

void RoundActivations(const float* in, DType weight_type, int64_t n, float* out) {
  if (weight_type == DType::kBF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = BF16ToF32(F32ToBF16(in[i]));
  } else if (weight_type == DType::kF16 || weight_type == DType::kFP8E4M3) {
    for (int64_t i = 0; i < n; ++i) out[i] = F16ToF32(F32ToF16(in[i]));
  } else if (out != in) {
    std::copy(in, in + n, out);
  }
}

absl::Status MatMulWithPath(const MatMulParams& p, MatMulPath path) {
  STRATA_RETURN_IF_ERROR(CpuSupportsMatMul(p));
  const int64_t n = p.in.dim(0), k = p.in.dim(1), m = p.weight.dim(0);
  if (n == 0 || m == 0) return absl::OkStatus();
  if (k == 0) {
    std::fill(p.out.As<float>(), p.out.As<float>() + n * m, 0.0f);
    AddBias(p);
    return absl::OkStatus();
  }
  if (path == MatMulPath::kAuto) {
    const bool small = n * m * k < kParallelMinWork;  // not worth waking BLAS threads
    path = (small || (p.weight.dtype != DType::kF32 && n <= kRowDotMaxTokens))
               ? MatMulPath::kRowDot
               : MatMulPath::kBlockedBlas;
  }
  MatMulParams q = p;
  std::vector<float> rounded;
  if ((p.precision == MatMulPrecision::kRoundActivations && p.weight.dtype != DType::kF32) ||
      p.weight.dtype == DType::kFP8E4M3) {
    rounded.resize(static_cast<size_t>(n * k));
    RoundActivations(p.in.As<const float>(), p.weight.dtype, n * k, rounded.data());
    q.in = TensorView(rounded.data(), DType::kF32, {n, k});
  }
  if (path == MatMulPath::kRowDot) {
    RowDot(q);
  } else {
    BlockedBlas(q);
  }
  ApplyWeightScale(q);
  AddBias(q);
  return absl::OkStatus();
}

}  // namespace cpu_internal

absl::Status CpuMatMul(const MatMulParams& p) {
  return cpu_internal::MatMulWithPath(p, cpu_internal::MatMulPath::kAuto);
}

}  // namespace strata::kernels
