#include "kernels/testing/forwarding_backend.h"

#include <utility>

namespace strata::kernels::testing {

ForwardingBackend::ForwardingBackend(std::string name, std::unique_ptr<Backend> target)
    : name_(std::move(name)), target_(std::move(target)) {}

ForwardingBackend::~ForwardingBackend() = default;

absl::StatusOr<std::unique_ptr<Buffer>> ForwardingBackend::Allocate(size_t bytes) {
  return target_->Allocate(bytes);
}
absl::Status ForwardingBackend::CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) {
  return target_->CopyToDevice(dst, src, bytes, s);
}
absl::Status ForwardingBackend::CopyToHost(void* dst, const void* src, size_t bytes, Stream s) {
  return target_->CopyToHost(dst, src, bytes, s);
}
absl::Status ForwardingBackend::Synchronize(Stream s) { return target_->Synchronize(s); }
absl::StatusOr<std::unique_ptr<Buffer>> ForwardingBackend::AllocateHost(size_t bytes) {
  return target_->AllocateHost(bytes);
}

#define STRATA_FORWARD_OP(Params, Op)                                                       \
  absl::Status ForwardingBackend::Supports(const Params& p) const { return target_->Supports(p); } \
  absl::Status ForwardingBackend::Op(const Params& p, Stream s) { return target_->Op(p, s); }
STRATA_FORWARD_OP(EmbeddingParams, Embedding)
STRATA_FORWARD_OP(RmsNormParams, RmsNorm)
STRATA_FORWARD_OP(MatMulParams, MatMul)
STRATA_FORWARD_OP(RopeParams, Rope)
STRATA_FORWARD_OP(SwiGluParams, SwiGlu)
STRATA_FORWARD_OP(AddParams, Add)
STRATA_FORWARD_OP(PagedAttentionParams, PagedAttention)
STRATA_FORWARD_OP(MergeAttentionParams, MergeAttention)
STRATA_FORWARD_OP(PageCopyParams, PageCopy)
#undef STRATA_FORWARD_OP

}  // namespace strata::kernels::testing
