// Device helpers of the device-resident selection ops (kernels/cuda/selection.cu and the
// selected-attention kernel in attention.cu). Included by .cu files only.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_SELECTION_CUH_
#define STRATA_KERNELS_CUDA_INTERNAL_SELECTION_CUH_

#include <cstdint>

#include "kernels/cuda/internal/launch.h"

namespace strata::kernels::cuda_internal {

// The id of candidate i of KV head g (kernels::CandidateList), or -1 when it is invalid.
__device__ __forceinline__ int32_t CandidateIdAt(const DeviceCandidates& c, int g, int32_t i) {
  int64_t id;
  if (c.parents == nullptr) {
    id = static_cast<int64_t>(c.begin) + i;
  } else {
    const int32_t parent = c.parents[static_cast<int64_t>(g) * c.num_parents + i / c.fanout];
    if (parent < 0) return -1;
    id = static_cast<int64_t>(parent) * c.fanout + i % c.fanout;
  }
  return id >= c.begin && id < c.end ? static_cast<int32_t>(id) : -1;
}

// Pool row of token t of KV head g through the page table, or -1 when the page is outside the
// table or the slot outside the pool.
__device__ __forceinline__ int64_t TokenRow(const int32_t* table, int table_pages,
                                            int64_t num_slots, int page_size, int g, int32_t t) {
  if (t < 0) return -1;
  const int32_t page = t / page_size;
  if (page >= table_pages) return -1;
  const int32_t slot = table[static_cast<int64_t>(g) * table_pages + page];
  if (slot < 0 || slot >= num_slots) return -1;
  return static_cast<int64_t>(slot) * page_size + t % page_size;
}

// A SelectedAttention call's list per KV head (SelectedAttentionShape) as virtual positions:
// [0, prefix_end) the prefix, then the middle's candidates up to mid_end, then the suffix from
// suffix_begin. `prefix` is where the prefix's attended part ends: prefix_end, or the device
// length *prefix_len clamped to [0, prefix_end] when it is set.
struct SelectedList {
  int32_t prefix;
  int32_t mid_end;
};
__device__ __forceinline__ SelectedList SelectedListOf(const SelectedAttentionShape& shape,
                                                      const DeviceCandidates& middle,
                                                      const int32_t* prefix_len) {
  return {prefix_len == nullptr ? shape.prefix_end : max(0, min(shape.prefix_end, *prefix_len)),
          shape.prefix_end + middle.count};
}
// The token at virtual position v of KV head g's list, or -1 where nothing is attended (the
// prefix past its device length, an invalid candidate).
__device__ __forceinline__ int32_t SelectedListToken(const SelectedAttentionShape& shape,
                                                     const DeviceCandidates& middle,
                                                     const SelectedList& list, int g, int32_t v) {
  if (v < shape.prefix_end) return v < list.prefix ? v : -1;
  if (v < list.mid_end) return CandidateIdAt(middle, g, v - shape.prefix_end);
  return shape.suffix_begin + (v - list.mid_end);
}

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_SELECTION_CUH_
