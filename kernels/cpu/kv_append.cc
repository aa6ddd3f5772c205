// AppendKv and EncodeFp8Pages on the CPU: the specification of the KV-cache append op and of the
// persisted fp8 page encoding (kernels/backend.h) and the validation the CUDA backend shares. Rows
// are converted with kernels::ConvertFromF32 / F32ToFP8E4M3, so the CUDA kernels' rounding is
// checked against these.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

absl::Status CpuSupportsAppendKv(const AppendKvParams& p) {
  constexpr const char* kOp = "AppendKv";
  STRATA_RETURN_IF_ERROR(CheckRank(p.k, 3, kOp, "k"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.k, DType::kF32, kOp, "k"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.v, 3, kOp, "v"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.v, DType::kF32, kOp, "v"));
  for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(CheckDim(p.v, i, p.k.dim(i), kOp, "v"));
  if (p.k_pool.dtype != DType::kF32 && p.k_pool.dtype != DType::kBF16 &&
      p.k_pool.dtype != DType::kFP8E4M3) {
    return absl::UnimplementedError(
        absl::StrCat("AppendKv: pool dtype ", DTypeName(p.k_pool.dtype), " unsupported"));
  }
  STRATA_RETURN_IF_ERROR(CheckKvScales(p.k_pool.dtype, p.k_scale, p.v_scale, kOp));
  STRATA_RETURN_IF_ERROR(CheckRank(p.k_pool, 3, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.v_pool, 3, kOp, "v_pool"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.v_pool, p.k_pool.dtype, kOp, "v_pool"));
  for (int i = 0; i < 3; ++i) {
    STRATA_RETURN_IF_ERROR(CheckDim(p.v_pool, i, p.k_pool.dim(i), kOp, "v_pool"));
  }
  const int64_t n = p.k.dim(0), heads = p.k.dim(1), d = p.k.dim(2);
  const int64_t num_slots = p.k_pool.dim(0), page = p.k_pool.dim(1);
  if (p.k_pool.dim(2) != d) {
    return absl::InvalidArgumentError("AppendKv: pool head_dim differs from k head_dim");
  }
  if (p.rope.inv_freq.data != nullptr) {
    // The keys' rotation is Rope's over k; rope.x, when set, is rotated by Rope itself.
    RopeParams keys = p.rope;
    keys.x = p.k;
    STRATA_RETURN_IF_ERROR(CpuSupportsRope(keys));
    if (p.rope.x.data != nullptr) {
      STRATA_RETURN_IF_ERROR(CpuSupportsRope(p.rope));
      STRATA_RETURN_IF_ERROR(CheckDim(p.rope.x, 0, n, kOp, "rope.x"));
      STRATA_RETURN_IF_ERROR(CheckDim(p.rope.x, 2, d, kOp, "rope.x"));
    }
  } else if (p.rope.x.data != nullptr) {
    return absl::InvalidArgumentError("AppendKv: rope.x is set without rope.inv_freq");
  }
  if (n == 0 || heads == 0 || d == 0) return absl::OkStatus();
  if (page <= 0 || p.first < 0 || p.slots_per_head < 0 ||
      p.first > std::numeric_limits<int64_t>::max() / 2 - n) {
    return absl::InvalidArgumentError("AppendKv: bad page size, first position or slot stride");
  }
  const int64_t last_page = (p.first + n - 1) / page;
  // Every slot g * slots_per_head + page, g < heads, page <= last_page, inside the pools, and a
  // head's pages do not run into the next head's slots.
  if ((heads > 1 && last_page >= p.slots_per_head) ||
      (heads - 1) > (num_slots - 1 - last_page) / std::max<int64_t>(p.slots_per_head, 1) ||
      last_page >= num_slots) {
    return absl::InvalidArgumentError(absl::StrCat("AppendKv: positions up to ", p.first + n - 1,
                                                   " of ", heads, " heads (", p.slots_per_head,
                                                   " slots each) exceed ", num_slots, " slots"));
  }
  return absl::OkStatus();
}

absl::Status CpuAppendKv(const AppendKvParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsAppendKv(p));
  const int64_t n = p.k.dim(0), heads = p.k.dim(1), d = p.k.dim(2), page = p.k_pool.dim(1);
  const bool rope = p.rope.inv_freq.data != nullptr;
  if (rope && p.rope.x.data != nullptr) STRATA_RETURN_IF_ERROR(CpuRope(p.rope));
  if (n == 0 || heads == 0 || d == 0) return absl::OkStatus();
  int64_t first = p.first;
  if (p.first_device != nullptr) {  // backend memory is host memory here
    const int64_t f = *p.first_device;
    if (f < 0 || f > p.first) return absl::OkStatus();  // nothing written (backend.h)
    first = f;
  }
  std::vector<float> rotated;
  const float* keys = p.k.As<const float>();
  if (rope) {  // the keys rotated by Rope itself, into a copy
    rotated.assign(keys, keys + n * heads * d);
    RopeParams r = p.rope;
    r.x = TensorView(rotated.data(), DType::kF32, {n, heads, d});
    STRATA_RETURN_IF_ERROR(CpuRope(r));
    keys = rotated.data();
  }
  const size_t es = DTypeSize(p.k_pool.dtype);
  const bool fp8 = p.k_pool.dtype == DType::kFP8E4M3;
  std::vector<float> row(d);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    for (int64_t g = 0; g < heads; ++g) {
      const int64_t dst = ((g * p.slots_per_head + pos / page) * page + pos % page) * d;
      const int64_t src = (i * heads + g) * d;
      for (int kv = 0; kv < 2; ++kv) {
        const float* x = (kv == 0 ? keys : p.v.As<const float>()) + src;
        const float scale = kv == 0 ? p.k_scale : p.v_scale;
        for (int64_t c = 0; c < d; ++c) row[c] = fp8 ? x[c] / scale : x[c];
        ConvertFromF32(row.data(), static_cast<char*>((kv == 0 ? p.k_pool : p.v_pool).data) + dst * es,
                       p.k_pool.dtype, d);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSupportsEncodeFp8Pages(const EncodeFp8PagesParams& p) {
  constexpr const char* kOp = "EncodeFp8Pages";
  STRATA_RETURN_IF_ERROR(CheckRank(p.k_pool, 3, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.k_pool, DType::kBF16, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.v_pool, 3, kOp, "v_pool"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.v_pool, DType::kBF16, kOp, "v_pool"));
  for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(CheckDim(p.v_pool, i, p.k_pool.dim(i), kOp, "v_pool"));
  const int64_t slots = p.k_pool.dim(0), page = p.k_pool.dim(1), d = p.k_pool.dim(2);
  if (p.num_heads < 0 || p.count < 0) return absl::InvalidArgumentError("EncodeFp8Pages: negative num_heads or count");
  const int64_t items = static_cast<int64_t>(p.num_heads) * p.count;
  if (items > 0) {
    if (p.last_valid < 1 || p.last_valid > page) {
      return absl::InvalidArgumentError(absl::StrCat("EncodeFp8Pages: last_valid ", p.last_valid, " not in [1, ", page, "]"));
    }
    const int64_t last_head = p.head_slot_stride * (p.num_heads - 1);
    const int64_t lo = p.first_slot + std::min<int64_t>(0, last_head);
    const int64_t hi = p.first_slot + std::max<int64_t>(0, last_head) + p.count - 1;
    if (lo < 0 || hi >= slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("EncodeFp8Pages: slots [", lo, ", ", hi, "] outside the pools' ", slots));
    }
  }
  STRATA_RETURN_IF_ERROR(CheckRank(p.codes, 4, kOp, "codes"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.codes, DType::kFP8E4M3, kOp, "codes"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.codes, 0, items, kOp, "codes"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.codes, 1, 2, kOp, "codes"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.codes, 2, page, kOp, "codes"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.codes, 3, d, kOp, "codes"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.scales, 2, kOp, "scales"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.scales, DType::kF32, kOp, "scales"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.scales, 0, items, kOp, "scales"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.scales, 1, 2, kOp, "scales"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.summaries, 2, kOp, "summaries"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.summaries, DType::kF32, kOp, "summaries"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.summaries, 0, items, kOp, "summaries"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.summaries, 1, 2 * d, kOp, "summaries"));
  return absl::OkStatus();
}

absl::Status CpuEncodeFp8Pages(const EncodeFp8PagesParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsEncodeFp8Pages(p));
  const int64_t page = p.k_pool.dim(1), d = p.k_pool.dim(2), elems = page * d;
  const int64_t items = static_cast<int64_t>(p.num_heads) * p.count;
  const uint16_t* pools[2] = {static_cast<const uint16_t*>(p.k_pool.data), static_cast<const uint16_t*>(p.v_pool.data)};
  uint8_t* codes = static_cast<uint8_t*>(p.codes.data);
  float* scales = static_cast<float*>(p.scales.data);
  float* summaries = static_cast<float*>(p.summaries.data);
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t g = i / p.count, j = i % p.count;
    const int64_t slot = p.first_slot + g * p.head_slot_stride + j;
    const int64_t valid = j == p.count - 1 ? p.last_valid : page;
    std::vector<float> x(static_cast<size_t>(elems)), decoded(static_cast<size_t>(valid * d));
    for (int h = 0; h < 2; ++h) {
      ConvertToF32(pools[h] + slot * elems, DType::kBF16, x.data(), valid * d);
      std::fill(x.begin() + valid * d, x.end(), 0.0f);
      float amax = 0.0f;
      bool nan = false;
      for (float f : x) {
        nan |= std::isnan(f);
        amax = std::max(amax, std::fabs(f));
      }
      if (nan) amax = std::numeric_limits<float>::quiet_NaN();
      const float scale = (std::isfinite(amax) && amax > 0.0f) ? amax / 448.0f : 1.0f;
      scales[i * 2 + h] = scale;
      uint8_t* out = codes + (i * 2 + h) * elems;
      for (float& f : x) f /= scale;
      ConvertFromF32(x.data(), out, DType::kFP8E4M3, elems);  // F32ToFP8E4M3 of each element
      if (h == 0) {
        ConvertToF32(out, DType::kFP8E4M3, decoded.data(), valid * d);
        float* lo = summaries + i * 2 * d;
        float* hi = lo + d;
        for (int64_t c = 0; c < d; ++c) {
          lo[c] = std::numeric_limits<float>::infinity();
          hi[c] = -std::numeric_limits<float>::infinity();
        }
        for (int64_t t = 0; t < valid; ++t) {
          for (int64_t c = 0; c < d; ++c) {
            const float v = decoded[t * d + c] * scale;
            lo[c] = std::min(lo[c], v);
            hi[c] = std::max(hi[c], v);
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
