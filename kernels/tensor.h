// Tensor views, element types and host-side conversions shared by every backend.
//
// A TensorView is a non-owning, dense, row-major view: `data` points at shape[0]*...*shape[rank-1]
// elements of `dtype`, in the memory of the backend that made it (host memory for the CPU backend,
// device memory for CUDA). Views are plain values; thread-compatible.
#ifndef STRATA_KERNELS_TENSOR_H_
#define STRATA_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

namespace strata::kernels {

enum class DType : uint8_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kFP8E4M3 = 3,  // OCP e4m3fn (no infinities, max 448)
  kI32 = 4,
};

// Bytes per element.
size_t DTypeSize(DType t);
// "f32", "bf16", "f16", "fp8_e4m3", "i32".
const char* DTypeName(DType t);

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};

  TensorView() = default;
  TensorView(void* d, DType t, std::initializer_list<int64_t> dims);

  int64_t dim(int i) const { return shape[i]; }
  int64_t NumElements() const;
  size_t Bytes() const { return static_cast<size_t>(NumElements()) * DTypeSize(dtype); }
  template <typename T>
  T* As() const {
    return static_cast<T*>(data);
  }
  // "bf16[4,128]"
  std::string DebugString() const;
};

// Exact host-side conversions. bf16/f16 round to nearest even; fp8 e4m3 saturates to +-448
// (NaN stays NaN).
float BF16ToF32(uint16_t v);
uint16_t F32ToBF16(float v);
float F16ToF32(uint16_t v);
uint16_t F32ToF16(float v);
float FP8E4M3ToF32(uint8_t v);
uint8_t F32ToFP8E4M3(float v);
// bf16 rounded toward +inf (up) or -inf (!up); NaN stays NaN, values beyond the largest finite bf16
// round to +-inf on their side.
uint16_t F32ToBF16Directed(float v, bool up);
// Minmax summary rows [min(head_dim), max(head_dim)] f32 to bf16 rounded outward (every min toward
// -inf, every max toward +inf), so each row still bounds the keys it summarises
// (ScoreSummariesParams).
void MinMaxRowsToBF16(const float* rows, int64_t num_rows, int64_t head_dim, uint16_t* out);

// Row-wise fp8 quantisation of a [rows, cols] matrix of `src_type` (f32|bf16|f16) at `src`, the
// weight form MatMul takes for fp8_e4m3: scales[r] = (largest finite |x| of row r) / 448, or 1
// when the row has no finite non-zero value, and dst[r, c] = F32ToFP8E4M3(x[r, c] / scales[r])
// (so the largest element maps to +-448; infinities saturate to +-448, NaN stays NaN). Rows are
// independent, so quantising the rows of a stacked matrix equals stacking quantised parts.
void QuantizeRowsToFP8E4M3(const void* src, DType src_type, int64_t rows, int64_t cols,
                           uint8_t* dst, float* scales);

// Converts `n` elements of `src_type` at `src` to f32 at `dst`.
void ConvertToF32(const void* src, DType src_type, float* dst, int64_t n);
// Converts `n` f32 elements at `src` to `dst_type` at `dst`.
void ConvertFromF32(const float* src, void* dst, DType dst_type, int64_t n);

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_TENSOR_H_
