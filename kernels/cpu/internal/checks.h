// Shape/dtype checks and row conversion helpers shared by the CPU ops (private to kernels/cpu).
// Stateless; thread-safe.
#ifndef STRATA_KERNELS_CPU_INTERNAL_CHECKS_H_
#define STRATA_KERNELS_CPU_INTERNAL_CHECKS_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/tensor.h"

namespace strata::kernels::cpu_internal {

// Below this many elements (or multiply-adds) of work an op runs on the calling thread: waking
// the OpenMP team costs more than it saves, and on a loaded machine spinning workers hurt.
inline constexpr int64_t kParallelMinWork = 1 << 15;

inline bool IsFloatWeight(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

// InvalidArgument unless `v` has rank `rank` and non-null data (when it has elements).
inline absl::Status CheckRank(const TensorView& v, int rank, const char* op, const char* name) {
  if (v.rank != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " must have rank ", rank, ", got ", v.DebugString()));
  }
  for (int i = 0; i < rank; ++i) {
    if (v.shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": ", name, " has a negative dimension: ", v.DebugString()));
    }
  }
  if (v.NumElements() > 0 && v.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has null data"));
  }
  return absl::OkStatus();
}

inline absl::Status CheckDType(const TensorView& v, DType want, const char* op, const char* name) {
  if (v.dtype != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " must be ", DTypeName(want),
                                                   ", got ", v.DebugString()));
  }
  return absl::OkStatus();
}

inline absl::Status CheckWeightDType(const TensorView& v, const char* op, const char* name) {
  if (!IsFloatWeight(v.dtype)) {
    return absl::UnimplementedError(absl::StrCat(op, ": ", name, " dtype ", DTypeName(v.dtype),
                                                 " is not supported (f32|bf16|f16)"));
  }
  return absl::OkStatus();
}

inline absl::Status CheckDim(const TensorView& v, int i, int64_t want, const char* op,
                             const char* name) {
  if (v.shape[i] != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " dim ", i, " must be ", want,
                                                   ", got ", v.DebugString()));
  }
  return absl::OkStatus();
}

// Loads row `row` (head_dim elements) of a KV pool (f32|bf16|fp8) as f32 into dst; returns a pointer to f32 data
// (the pool itself for f32 pools, dst otherwise). fp8 elements are dequantised: stored * scale.
inline const float* LoadPoolRow(const TensorView& pool, int64_t row, int head_dim, float* dst,
                            float scale) {
  if (pool.dtype == DType::kF32) return pool.As<const float>() + row * head_dim;
  if (pool.dtype == DType::kFP8E4M3) {
    // ConvertToF32's table loop (a call per element kept this scalar), then the pool's scale.
    ConvertToF32(pool.As<const uint8_t>() + row * head_dim, DType::kFP8E4M3, dst, head_dim);
    for (int i = 0; i < head_dim; ++i) dst[i] *= scale;
    return dst;
  }
  // bf16 -> f32 is exact: the 16 bits become the high half of the f32.
  const uint16_t* src = pool.As<const uint16_t>() + row * head_dim;
  for (int i = 0; i < head_dim; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&dst[i], &bits, sizeof(float));
  }
  return dst;
}

// Converts `n` elements starting at element `offset` of a float tensor (f32|bf16|f16) to f32.
inline void LoadF32(const TensorView& v, int64_t offset, int64_t n, float* dst) {
  const char* base = static_cast<const char*>(v.data) + offset * static_cast<int64_t>(DTypeSize(v.dtype));
  switch (v.dtype) {
    case DType::kF32: {
      const float* s = reinterpret_cast<const float*>(base);
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::kBF16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(base);
      for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        dst[i] = f;
      }
      return;
    }
    default:
      ConvertToF32(base, v.dtype, dst, n);
      return;
  }
}

}  // namespace strata::kernels::cpu_internal

#endif  // STRATA_KERNELS_CPU_INTERNAL_CHECKS_H_
