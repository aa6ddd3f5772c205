// Host-side entry points of kernels/cuda/page_copy.cu (private to kernels/cuda): the PageCopy op
// of kernels/backend.h, and the copy kernel of CudaBackend's small host <-> device copies. Kept
// out of launch.h so that the page-cache op does not touch the header every other kernel includes.
//
// Thread-safety: stateless; concurrent launches on different streams are fine.
#ifndef STRATA_KERNELS_CUDA_INTERNAL_PAGE_COPY_H_
#define STRATA_KERNELS_CUDA_INTERNAL_PAGE_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace strata::kernels::cuda_internal {

// Device-visible pointers (device memory, or mapped pinned host memory through its device
// address) of one PageCopy. The host has validated every slot and table index.
struct PageCopyArgs {
  const void* staging = nullptr;   // mapped host: num_pages x (K half, V half)
  const void* const* sources = nullptr;  // mapped host: [num_pages] page addresses, or null
  bool sources_aligned = true;     // every sources[i] is 16-byte aligned
  const int32_t* slots = nullptr;  // mapped host: [num_pages]
  int num_pages = 0;
  void* k_pool = nullptr;          // device
  void* v_pool = nullptr;          // device
  int64_t half_bytes = 0;          // bytes of K (or V) of one page: page_size * head_dim * elem
  int32_t* table = nullptr;        // device
  const int32_t* table_index = nullptr;  // mapped host: [num_table_updates]
  const int32_t* table_value = nullptr;  // mapped host: [num_table_updates]
  int num_table_updates = 0;
};

// One kernel copies every page half (16-byte vectors when sizes and addresses allow, else bytes)
// from the mapped staging into its slot; a second small kernel applies the table updates. Both
// on `stream`; returns the launch status.
cudaError_t LaunchPageCopy(const PageCopyArgs& args, cudaStream_t stream);

// One kernel copies `bytes` from src to dst, device-visible addresses (device memory, or mapped
// pinned host memory through its device address): a small copy between the host and the device
// as a kernel instead of a copy-engine transfer, which inside a CUDA graph costs a transition of
// several microseconds before and after it (bench/RESULTS.md, session 35). 16-byte vectors when
// the addresses and size allow, else 4-byte words, else bytes. Returns the launch status.
cudaError_t LaunchCopyBytes(void* dst, const void* src, size_t bytes, cudaStream_t stream);

}  // namespace strata::kernels::cuda_internal

#endif  // STRATA_KERNELS_CUDA_INTERNAL_PAGE_COPY_H_
