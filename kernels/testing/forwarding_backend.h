// A Backend for tests that forwards memory, copies and the core ops (those every backend has) to
// another backend, under a name of its own, and has none of the optional ops (selection, page
// cache, sampling, graphs: the Backend defaults). Tests derive from it to change one behaviour: a
// "device" backend without the optional ops, an AllocateHost that fails.
#ifndef STRATA_KERNELS_TESTING_FORWARDING_BACKEND_H_
#define STRATA_KERNELS_TESTING_FORWARDING_BACKEND_H_

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace strata::kernels::testing {

class ForwardingBackend : public Backend {
 public:
  ForwardingBackend(std::string name, std::unique_ptr<Backend> target);
  ~ForwardingBackend() override;

  std::string Name() const override { return name_; }
  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status Synchronize(Stream s) override;
  absl::StatusOr<std::unique_ptr<Buffer>> AllocateHost(size_t bytes) override;

  absl::Status Supports(const EmbeddingParams& p) const override;
  absl::Status Embedding(const EmbeddingParams& p, Stream s) override;
  absl::Status Supports(const RmsNormParams& p) const override;
  absl::Status RmsNorm(const RmsNormParams& p, Stream s) override;
  absl::Status Supports(const MatMulParams& p) const override;
  absl::Status MatMul(const MatMulParams& p, Stream s) override;
  absl::Status Supports(const RopeParams& p) const override;
  absl::Status Rope(const RopeParams& p, Stream s) override;
  absl::Status Supports(const SwiGluParams& p) const override;
  absl::Status SwiGlu(const SwiGluParams& p, Stream s) override;
  absl::Status Supports(const AddParams& p) const override;
  absl::Status Add(const AddParams& p, Stream s) override;
  absl::Status Supports(const PagedAttentionParams& p) const override;
  absl::Status PagedAttention(const PagedAttentionParams& p, Stream s) override;
  absl::Status Supports(const MergeAttentionParams& p) const override;
  absl::Status MergeAttention(const MergeAttentionParams& p, Stream s) override;
  absl::Status Supports(const PageCopyParams& p) const override;
  absl::Status PageCopy(const PageCopyParams& p, Stream s) override;

 protected:
  Backend* target() const { return target_.get(); }

 private:
  std::string name_;
  std::unique_ptr<Backend> target_;
};

}  // namespace strata::kernels::testing

#endif  // STRATA_KERNELS_TESTING_FORWARDING_BACKEND_H_
