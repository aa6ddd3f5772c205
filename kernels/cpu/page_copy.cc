// PageCopy on the CPU: the specification of the GPU page cache's fill op (kernels/backend.h).
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::kernels {

absl::Status CpuSupportsPageCopy(const PageCopyParams& p) {
  constexpr const char* kOp = "PageCopy";
  const TensorView& k = p.k_pool;
  const TensorView& v = p.v_pool;
  if (k.dtype != DType::kF32 && k.dtype != DType::kBF16 && k.dtype != DType::kFP8E4M3) {
    return absl::UnimplementedError(absl::StrCat(kOp, ": pool dtype ", DTypeName(k.dtype),
                                                 " unsupported (f32|bf16|fp8_e4m3)"));
  }
  if (k.rank != 3 || v.rank != 3 || v.dtype != k.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": k_pool ", k.DebugString(), " and v_pool ",
                                                   v.DebugString(), " must be rank 3, same dtype"));
  }
  for (int i = 0; i < 3; ++i) {
    if (k.shape[i] != v.shape[i] || k.shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": k_pool ", k.DebugString(),
                                                     " and v_pool ", v.DebugString(),
                                                     " must have the same non-negative shape"));
    }
  }
  if (p.num_pages < 0 || p.num_table_updates < 0 || p.table_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": negative count"));
  }
  const int64_t num_slots = k.dim(0);
  if (p.num_pages > 0) {
    if (k.data == nullptr || v.data == nullptr || p.slots == nullptr ||
        (p.staging == nullptr && p.sources == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": null pool, staging or slots"));
    }
    const size_t page_bytes = PageCopyBytes(k.dim(1), k.dim(2), k.dtype);
    if (p.sources != nullptr) {
      for (int i = 0; i < p.num_pages; ++i) {
        if (p.sources[i] == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(kOp, ": sources[", i, "] is null"));
        }
      }
    } else if (page_bytes * static_cast<size_t>(p.num_pages) > p.staging_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", p.num_pages, " pages of ",
                                                     page_bytes, " bytes exceed staging of ",
                                                     p.staging_bytes, " bytes"));
    }
    for (int i = 0; i < p.num_pages; ++i) {
      if (p.slots[i] < 0 || p.slots[i] >= num_slots) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": slots[", i, "] = ", p.slots[i],
                                                       " outside [0, ", num_slots, ")"));
      }
    }
  }
  if (p.num_table_updates > 0) {
    if (p.table == nullptr || p.table_index == nullptr || p.table_value == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": null table or table updates"));
    }
    for (int j = 0; j < p.num_table_updates; ++j) {
      if (p.table_index[j] < 0 || p.table_index[j] >= p.table_size) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": table_index[", j, "] = ",
                                                       p.table_index[j], " outside [0, ",
                                                       p.table_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuPageCopy(const PageCopyParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsPageCopy(p));
  const size_t half = p.k_pool.Bytes() == 0
                          ? 0
                          : static_cast<size_t>(p.k_pool.dim(1) * p.k_pool.dim(2)) *
                                DTypeSize(p.k_pool.dtype);
  const char* src = static_cast<const char*>(p.staging);
  char* k = static_cast<char*>(p.k_pool.data);
  char* v = static_cast<char*>(p.v_pool.data);
  for (int i = 0; i < p.num_pages; ++i) {
    const size_t slot = static_cast<size_t>(p.slots[i]);
    const char* page = p.sources != nullptr ? static_cast<const char*>(p.sources[i])
                                            : src + 2 * half * i;
    std::memcpy(k + slot * half, page, half);
    std::memcpy(v + slot * half, page + half, half);
  }
  for (int j = 0; j < p.num_table_updates; ++j) p.table[p.table_index[j]] = p.table_value[j];
  return absl::OkStatus();
}

}  // namespace strata::kernels
