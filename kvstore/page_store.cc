#include "kvstore/page_store.h"

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace strata::kvstore {
namespace {

class NewAllocator final : public PageAllocator {
 public:
  void* Allocate(size_t bytes) override { return new (std::nothrow) char[bytes == 0 ? 1 : bytes]; }
  void Free(void* p, size_t) override { delete[] static_cast<char*>(p); }
};

}  // namespace

PageAllocator* DefaultPageAllocator() {
  static NewAllocator* const allocator = new NewAllocator();
  return allocator;
}

absl::StatusOr<std::shared_ptr<PageBuffer>> PageBuffer::Allocate(size_t bytes, PageAllocator* allocator) {
  if (allocator == nullptr) allocator = DefaultPageAllocator();
  char* p = static_cast<char*>(allocator->Allocate(bytes));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("page allocator: no memory for ", bytes, " bytes"));
  }
  return std::shared_ptr<PageBuffer>(new PageBuffer(p, bytes, allocator));
}

absl::StatusOr<PageRef> PageBuffer::Copy(absl::string_view bytes, PageAllocator* allocator) {
  absl::StatusOr<std::shared_ptr<PageBuffer>> buffer = Allocate(bytes.size(), allocator);
  if (!buffer.ok()) return buffer.status();
  if (!bytes.empty()) std::memcpy((*buffer)->mutable_data(), bytes.data(), bytes.size());
  return PageRef(*std::move(buffer));
}

std::shared_ptr<const PageBuffer> PageBuffer::Adopt(std::string bytes) {
  return std::shared_ptr<const PageBuffer>(new PageBuffer(std::move(bytes)));
}

PageBuffer::~PageBuffer() {
  if (allocator_ != nullptr) allocator_->Free(data_, size_);
}

v1::KvLayout LayoutToProto(const KvLayout& layout) {
  v1::KvLayout p;
  p.set_num_layers(layout.num_layers);
  p.set_num_kv_heads(layout.num_kv_heads);
  p.set_head_dim(layout.page.head_dim);
  p.set_page_size(layout.page.page_size);
  p.set_dtype(layout.page.dtype == kernels::DType::kFP8E4M3 ? v1::PAGE_DTYPE_FP8_E4M3
                                                            : v1::PAGE_DTYPE_BF16);
  return p;
}

absl::StatusOr<KvLayout> LayoutFromProto(const v1::KvLayout& p) {
  KvLayout layout;
  layout.num_layers = static_cast<int>(std::min<uint32_t>(p.num_layers(), 1u << 20));
  layout.num_kv_heads = static_cast<int>(std::min<uint32_t>(p.num_kv_heads(), 1u << 20));
  layout.page.head_dim = static_cast<int>(std::min<uint32_t>(p.head_dim(), 1u << 20));
  layout.page.page_size = static_cast<int>(std::min<uint32_t>(p.page_size(), 1u << 20));
  switch (p.dtype()) {
    case v1::PAGE_DTYPE_BF16:
      layout.page.dtype = kernels::DType::kBF16;
      break;
    case v1::PAGE_DTYPE_FP8_E4M3:
      layout.page.dtype = kernels::DType::kFP8E4M3;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("layout: unsupported page dtype ",
                                                     static_cast<int>(p.dtype())));
  }
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  return layout;
}

}  // namespace strata::kvstore
