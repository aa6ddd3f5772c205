#include "kernels/tensor.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace strata::kernels {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kFP8E4M3:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
    case DType::kI32:
      return "i32";
  }
  return "?";
}

TensorView::TensorView(void* d, DType t, std::initializer_list<int64_t> dims) : data(d), dtype(t) {
  rank = 0;
  for (int64_t v : dims) {
    if (rank < kMaxRank) shape[rank++] = v;
  }
}

int64_t TensorView::NumElements() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return rank == 0 ? 0 : n;
}

std::string TensorView::DebugString() const {
  std::string s = DTypeName(dtype);
  s += "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  s += "]";
  return s;
}

static inline float Bf16ToF32Inline(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t F32ToBf16Inline(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t F32ToBF16Directed(float v, bool up) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  uint16_t t = static_cast<uint16_t>(bits >> 16);  // truncation: toward zero
  const bool negative = (bits >> 31) != 0;
  // Away from zero by one bf16 ulp when bits were dropped and the direction is away from zero.
  if ((bits & 0xffffu) != 0 && up != negative) ++t;
  return t;
}

void MinMaxRowsToBF16(const float* rows, int64_t num_rows, int64_t head_dim, uint16_t* out) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* in = rows + r * 2 * head_dim;
    uint16_t* o = out + r * 2 * head_dim;
    for (int64_t e = 0; e < head_dim; ++e) {
      o[e] = F32ToBF16Directed(in[e], /*up=*/false);
      o[head_dim + e] = F32ToBF16Directed(in[head_dim + e], /*up=*/true);
    }
  }
}

float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | mant << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // f16 subnormal or zero: units of 2^-24, exact scaling then RNE
    float a;
    std::memcpy(&a, &abs, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  abs += rounding;
  return static_cast<uint16_t>(sign | ((abs - 0x38000000u) >> 13));
}

static inline float Fp8E4M3ToF32Inline(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v >> 7) << 31;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t mant = v & 0x7u;
  uint32_t bits;
  if (exp == 0xf && mant == 0x7) {
    bits = sign | 0x7fc00000u;  // NaN
  } else if (exp == 0) {
    float f = static_cast<float>(mant) * (1.0f / 512.0f);  // subnormal: mant * 2^-9, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else {
    bits = sign | ((exp + 120u) << 23) | (mant << 20);  // 2^(exp - 7) * (1 + mant / 8)
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Nearest e4m3 code (ties to the even code), saturated to +-448 (no infinities in e4m3fn); NaN
// gives 0x7f. Every path is computed and one selected (no branches, so the conversion loop runs
// at about a nanosecond per element).
static inline uint8_t F32ToFp8E4M3Inline(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7fffffffu;
  // Normal codes (2^-6 <= a < 448): exponent e4m3 = f32 exponent - 127 + 7 (1..15 here) and 3 of
  // the 23 mantissa bits, in one subtraction; the 20 dropped bits round to nearest even (a carry
  // moves into the exponent). a < 448 never rounds past 0x7e (448).
  uint32_t code = (abs >> 20) - (120u << 3);
  const uint32_t rest = abs & 0xfffffu;
  code += static_cast<uint32_t>(rest > 0x80000u) | (static_cast<uint32_t>(rest == 0x80000u) & code);
  // Subnormal codes (and 8, the smallest normal), a < 2^-6: a * 2^9 (exact, < 8) to the nearest
  // integer, ties to even, by adding 2^23 in the default rounding mode.
  float a;
  std::memcpy(&a, &abs, 4);
  const float shifted = a * 512.0f + 8388608.0f;
  uint32_t sub;
  std::memcpy(&sub, &shifted, 4);
  sub -= 0x4b000000u;  // the bits of 2^23
  const uint32_t out = abs > 0x7f800000u    ? 0x7fu                // NaN
                       : abs >= 0x43e00000u ? (sign | 0x7eu)        // >= 448, inf: max finite
                       : abs < 0x3c800000u  ? (sign | sub)          // < 2^-6
                                            : (sign | code);
  return static_cast<uint8_t>(out);
}

// FP8E4M3ToF32 of every code, made once: the fp8 conversion loop reads it.
static const float* Fp8E4M3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = Fp8E4M3ToF32Inline(static_cast<uint8_t>(i));
    return t;
  }();
  return table.data();
}

// The public conversions; the loops below use the inline forms directly (a call to an exported
// function in a -fPIC library is not inlined, which kept these loops scalar: 1.9 ns per bf16
// element instead of a vectorized shift).
float BF16ToF32(uint16_t v) { return Bf16ToF32Inline(v); }
uint16_t F32ToBF16(float v) { return F32ToBf16Inline(v); }
float FP8E4M3ToF32(uint8_t v) { return Fp8E4M3ToF32Inline(v); }
uint8_t F32ToFP8E4M3(float v) { return F32ToFp8E4M3Inline(v); }

void QuantizeRowsToFP8E4M3(const void* src, DType src_type, int64_t rows, int64_t cols,
                           uint8_t* dst, float* scales) {
  const int64_t elem = static_cast<int64_t>(DTypeSize(src_type));
  // Rows are independent; threads take them in static chunks (the result does not depend on the
  // thread count).
#pragma omp parallel if (rows * cols >= (int64_t{1} << 20))
  {
    std::vector<float> x(static_cast<size_t>(cols));  // one row, per thread
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      ConvertToF32(static_cast<const char*>(src) + r * cols * elem, src_type, x.data(), cols);
      float amax = 0.0f;
      for (float v : x) {
        if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
      }
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      scales[r] = scale;
      uint8_t* out = dst + r * cols;
      for (int64_t c = 0; c < cols; ++c) out[c] = F32ToFp8E4M3Inline(x[c] / scale);
    }
  }
}

void ConvertToF32(const void* src, DType src_type, float* dst, int64_t n) {
  switch (src_type) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32Inline(s[i]);
      return;
    }
    case DType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToF32(s[i]);
      return;
    }
    case DType::kFP8E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(src);
      const float* table = Fp8E4M3Table();
      for (int64_t i = 0; i < n; ++i) dst[i] = table[s[i]];
      return;
    }
    case DType::kI32: {
      const int32_t* s = static_cast<const int32_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
      return;
    }
  }
}

void ConvertFromF32(const float* src, void* dst, DType dst_type, int64_t n) {
  switch (dst_type) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16Inline(src[i]);
      return;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToF16(src[i]);
      return;
    }
    case DType::kFP8E4M3: {
      uint8_t* d = static_cast<uint8_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = F32ToFp8E4M3Inline(src[i]);
      return;
    }
    case DType::kI32: {
      int32_t* d = static_cast<int32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<int32_t>(src[i]);
      return;
    }
  }
}

}  // namespace strata::kernels
