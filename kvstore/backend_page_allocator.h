// A PageAllocator whose memory comes from Backend::AllocateHost: pinned host memory the device can
// read in place on CUDA (plain memory on the CPU backend). Give it to the host tier
// (HostCacheOptions::allocator) and to the GPU page cache (GpuCacheOptions::in_place_allocator) and
// the cache's fills read host-tier pages where they lie, without gathering them into staging.
//
// Requests of at most `block_bytes` (a page: PageShape::EncodedBytes()) get a fixed-size block
// carved from chunks of `chunk_bytes` obtained with AllocateHost (pinning memory is slow, so it is
// done a chunk at a time); freed blocks are reused, chunks are kept until the allocator is
// destroyed. Larger requests (summaries, say) get an AllocateHost buffer of their own. Blocks are
// 64-byte aligned. Every byte it hands out is AllocateHost memory.
//
// Thread-safe (one mutex). The backend must outlive the allocator, and the allocator every buffer
// it handed out.
#ifndef STRATA_KVSTORE_BACKEND_PAGE_ALLOCATOR_H_
#define STRATA_KVSTORE_BACKEND_PAGE_ALLOCATOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kvstore/page_store.h"

namespace strata::kvstore {

class BackendPageAllocator final : public PageAllocator {
 public:
  // block_bytes > 0; chunk_bytes is rounded up to a whole number of blocks (at least one).
  BackendPageAllocator(kernels::Backend* backend, size_t block_bytes,
                       size_t chunk_bytes = size_t{256} << 20);
  ~BackendPageAllocator() override;

  void* Allocate(size_t bytes) override;  // nullptr when AllocateHost fails
  void Free(void* p, size_t bytes) override;

  size_t block_bytes() const { return block_bytes_; }
  // The backend whose AllocateHost memory this is (a device-managed GPU page cache on the same
  // backend can read it in place).
  kernels::Backend* backend() const { return backend_; }
  // Obtains chunks now until at least `bytes` are reserved (blocks then come from them without
  // pinning anything). On CUDA, pinning (cudaHostAlloc) runs at a few GB/s and holds up the
  // device work other threads enqueue meanwhile, so a host tier filled while the GPU prefills
  // slows the prefill; reserving its capacity before (at worker start) moves that cost there.
  // ResourceExhausted when AllocateHost fails (what was obtained stays reserved); Cancelled when
  // *stop turns true between chunks. Pins without holding the allocator's lock, so Allocate and
  // Free go on meanwhile (a thread can reserve while the tier fills).
  absl::Status Reserve(size_t bytes, const std::atomic<bool>* stop = nullptr);
  // Bytes obtained from AllocateHost so far (chunks and large buffers).
  size_t reserved_bytes() const;

 private:
  kernels::Backend* backend_;
  size_t block_bytes_;
  size_t chunk_bytes_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<kernels::Buffer>> chunks_;                   // guarded by mu_
  std::vector<void*> free_;                                                // guarded by mu_
  absl::flat_hash_map<void*, std::unique_ptr<kernels::Buffer>> large_;    // guarded by mu_
  size_t reserved_ = 0;                                                    // guarded by mu_
  // Obtains one chunk (mu_ not held) or nullptr when AllocateHost failed.
  std::unique_ptr<kernels::Buffer> NewChunk();
  // Adds a chunk's blocks to the free list (mu_ held).
  void AddChunk(std::unique_ptr<kernels::Buffer> chunk);
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_BACKEND_PAGE_ALLOCATOR_H_
