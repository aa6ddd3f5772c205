#include "kvstore/backend_page_allocator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace strata::kvstore {

BackendPageAllocator::BackendPageAllocator(kernels::Backend* backend, size_t block_bytes,
                                           size_t chunk_bytes)
    : backend_(backend), block_bytes_((std::max<size_t>(block_bytes, 1) + 63) / 64 * 64) {
  chunk_bytes_ = std::max(block_bytes_, (chunk_bytes + block_bytes_ - 1) / block_bytes_ * block_bytes_);
}

BackendPageAllocator::~BackendPageAllocator() = default;

void* BackendPageAllocator::Allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > block_bytes_) {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> b = backend_->AllocateHost(bytes);
    if (!b.ok() || (*b)->data() == nullptr) return nullptr;
    void* p = (*b)->data();
    reserved_ += bytes;
    large_.emplace(p, *std::move(b));
    return p;
  }
  if (free_.empty()) {
    std::unique_ptr<kernels::Buffer> chunk = NewChunk();
    if (chunk == nullptr) return nullptr;
    AddChunk(std::move(chunk));
  }
  void* p = free_.back();
  free_.pop_back();
  return p;
}

std::unique_ptr<kernels::Buffer> BackendPageAllocator::NewChunk() {
  absl::StatusOr<std::unique_ptr<kernels::Buffer>> chunk = backend_->AllocateHost(chunk_bytes_);
  if (!chunk.ok() || (*chunk)->data() == nullptr) return nullptr;
  return *std::move(chunk);
}

void BackendPageAllocator::AddChunk(std::unique_ptr<kernels::Buffer> chunk) {
  char* base = static_cast<char*>(chunk->data());
  // AllocateHost memory is at least 64-byte aligned on both backends; blocks are multiples of 64.
  for (size_t off = chunk_bytes_; off >= block_bytes_; off -= block_bytes_) {
    free_.push_back(base + off - block_bytes_);  // the chunk's lowest address handed out first
  }
  reserved_ += chunk_bytes_;
  chunks_.push_back(std::move(chunk));
}

absl::Status BackendPageAllocator::Reserve(size_t bytes, const std::atomic<bool>* stop) {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reserved_ >= bytes) return absl::OkStatus();
    }
    if (stop != nullptr && stop->load()) return absl::CancelledError("host page allocator: reservation stopped");
    std::unique_ptr<kernels::Buffer> chunk = NewChunk();  // pinned outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    if (chunk == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host page allocator: ", reserved_, " of ", bytes,
                                                       " bytes reserved; the backend's AllocateHost failed"));
    }
    AddChunk(std::move(chunk));
  }
}

void BackendPageAllocator::Free(void* p, size_t bytes) {
  if (p == nullptr) return;
  std::unique_ptr<kernels::Buffer> dropped;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > block_bytes_) {
    auto it = large_.find(p);
    if (it == large_.end()) return;  // not ours: ignore rather than corrupt the free list
    reserved_ -= it->second->bytes();
    dropped = std::move(it->second);
    large_.erase(it);
    return;
  }
  free_.push_back(p);
}

size_t BackendPageAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

}  // namespace strata::kvstore
