// Host-side entry point of kernels/cuda/page_cache.cu (private to kernels/cuda): the ResolvePages
// op of kernels/backend.h (the device-managed GPU page cache step).
//
// Thread-safety: stateless; concurrent launches on different streams are fine if they do not
// share a cache state.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_PAGE_CACHE_H_
#define STRATA_KERNELS_CUDA_INTERNAL_PAGE_CACHE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/internal/launch.h"

namespace strata::kernels::cuda_internal {

// Device pointers of one ResolvePages call; the host has validated shapes and ranges.
struct ResolveArgs {
  int32_t* table = nullptr;
  int32_t* slot_page = nullptr;
  uint32_t* slot_stamp = nullptr;
  uint8_t* slot_ref = nullptr;
  int64_t num_slots = 0;
  long long* counters = nullptr;  // kernels::PageCacheCounter order
  int32_t* scratch = nullptr;
  int64_t scratch_pages = 0;
  const void* const* sources = nullptr;
  const float* page_scales = nullptr;  // [table_size, 2] or null (then slot_scales is null)
  float* slot_scales = nullptr;        // [num_slots, 2]
  void* k_pool = nullptr;
  void* v_pool = nullptr;
  int64_t half_bytes = 0;  // K (or V) bytes of one page
  int64_t table_base = 0;
  int num_kv_heads = 0;
  int64_t pages_per_head = 0;
  int page_size = 0;
  int64_t prefix_end = 0;
  DeviceCandidates middle;
  int64_t suffix_begin = 0;
  int64_t suffix_end = 0;
};

// Two launches on `stream`: one block finds hits, misses and victims and updates the table; a
// grid copies the missed pages from their sources (host memory through the mapping) into their
// slots. Fixed launch shapes (capturable in a CUDA graph). Returns the launch status.
cudaError_t LaunchResolvePages(const ResolveArgs& args, cudaStream_t stream);

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_PAGE_CACHE_H_
