#include "kernels/testing/capturing_backend.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace strata::kernels::testing {
namespace {

class RecordedGraph : public Graph {
 public:
  explicit RecordedGraph(std::vector<std::function<absl::Status()>> ops) : ops_(std::move(ops)) {}
  absl::Status Replay(Stream) override {
    for (const auto& op : ops_) {
      if (absl::Status s = op(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::function<absl::Status()>> ops_;
};

}  // namespace

CapturingBackend::CapturingBackend(int threads)
    : ForwardingBackend("capturing-cpu", MakeCpuBackend(threads)) {}

absl::Status CapturingBackend::RunOrRecord(std::function<absl::Status()> op) {
  if (!capturing_) return op();
  ops_.push_back(std::move(op));
  ++recorded_ops_;
  return absl::OkStatus();
}

absl::Status CapturingBackend::CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) {
  if (capturing_) {
    capture_error_.Update(absl::FailedPreconditionError("CopyToDevice while capturing"));
    return capture_error_;
  }
  return ForwardingBackend::CopyToDevice(dst, src, bytes, s);
}

absl::Status CapturingBackend::CopyToHost(void* dst, const void* src, size_t bytes, Stream s) {
  if (capturing_) {
    capture_error_.Update(absl::FailedPreconditionError("CopyToHost while capturing"));
    return capture_error_;
  }
  return ForwardingBackend::CopyToHost(dst, src, bytes, s);
}

absl::Status CapturingBackend::CopyToDeviceAsync(void* dst, const void* src, size_t bytes, Stream s) {
  Backend* t = target();
  return RunOrRecord([t, dst, src, bytes]() { return t->CopyToDeviceAsync(dst, src, bytes, nullptr); });
}

absl::Status CapturingBackend::CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream s) {
  Backend* t = target();
  return RunOrRecord([t, dst, src, bytes]() { return t->CopyToHostAsync(dst, src, bytes, nullptr); });
}

absl::Status CapturingBackend::Synchronize(Stream s) {
  if (capturing_) {
    capture_error_.Update(absl::FailedPreconditionError("Synchronize while capturing"));
    return capture_error_;
  }
  return ForwardingBackend::Synchronize(s);
}

// Ops whose parameters are views of backend memory and values: recorded as they are (checked
// first, so that a bad call fails where it is made, as on a device backend).
#define STRATA_RECORD_OP(Params, Op)                                                  \
  absl::Status CapturingBackend::Op(const Params& p, Stream s) {                      \
    if (capturing_) {                                                                 \
      if (absl::Status ok = target()->Supports(p); !ok.ok()) return ok;               \
    }                                                                                 \
    Backend* t = target();                                                            \
    return RunOrRecord([t, p]() { return t->Op(p, nullptr); });                       \
  }
STRATA_RECORD_OP(EmbeddingParams, Embedding)
STRATA_RECORD_OP(RmsNormParams, RmsNorm)
STRATA_RECORD_OP(MatMulParams, MatMul)
STRATA_RECORD_OP(RopeParams, Rope)
STRATA_RECORD_OP(SwiGluParams, SwiGlu)
STRATA_RECORD_OP(AddParams, Add)
STRATA_RECORD_OP(PageCopyParams, PageCopy)
#undef STRATA_RECORD_OP

#define STRATA_RECORD_OPTIONAL_OP(Params, Op)                                         \
  absl::Status CapturingBackend::Op(const Params& p, Stream s) {                      \
    Backend* t = target();                                                            \
    return RunOrRecord([t, p]() { return t->Op(p, nullptr); });                       \
  }
STRATA_RECORD_OPTIONAL_OP(ScoreSummariesParams, ScoreSummaries)
STRATA_RECORD_OPTIONAL_OP(ScoreKeysParams, ScoreKeys)
STRATA_RECORD_OPTIONAL_OP(VoteTopKParams, VoteTopK)
STRATA_RECORD_OPTIONAL_OP(UpdateSummariesParams, UpdateSummaries)
STRATA_RECORD_OPTIONAL_OP(SelectionCacheCheckParams, SelectionCacheCheck)
STRATA_RECORD_OPTIONAL_OP(EncodeFp8PagesParams, EncodeFp8Pages)
STRATA_RECORD_OPTIONAL_OP(SelectedAttentionParams, SelectedAttention)
STRATA_RECORD_OPTIONAL_OP(ResolvePagesParams, ResolvePages)
STRATA_RECORD_OPTIONAL_OP(AppendKvParams, AppendKv)
STRATA_RECORD_OPTIONAL_OP(SampleParams, Sample)
#undef STRATA_RECORD_OPTIONAL_OP

absl::Status CapturingBackend::SelectStages(const SelectStagesParams& p, Stream s) {
  // The attention's and the cache check's parameters are the caller's: copied.
  std::shared_ptr<SelectedAttentionParams> attend;
  if (p.attend != nullptr) attend = std::make_shared<SelectedAttentionParams>(*p.attend);
  std::shared_ptr<SelectionCacheCheckParams> check;
  if (p.cache_check != nullptr) check = std::make_shared<SelectionCacheCheckParams>(*p.cache_check);
  Backend* t = target();
  return RunOrRecord([t, p, attend, check]() {
    SelectStagesParams q = p;
    q.attend = attend.get();
    q.cache_check = check.get();
    return t->SelectStages(q, nullptr);
  });
}

absl::Status CapturingBackend::Supports(const SampleParams& p) const {
  return target()->Supports(p);
}

absl::Status CapturingBackend::PagedAttention(const PagedAttentionParams& p, Stream s) {
  if (capturing_) {
    capture_error_.Update(absl::FailedPreconditionError(
        "PagedAttention while capturing (its spans are host arrays of the call)"));
    return capture_error_;
  }
  return ForwardingBackend::PagedAttention(p, s);
}

absl::Status CapturingBackend::MergeAttention(const MergeAttentionParams& p, Stream s) {
  if (capturing_) {
    if (absl::Status ok = target()->Supports(p); !ok.ok()) return ok;
  }
  // The part views are an array of the caller's: copied.
  std::vector<TensorView> outs(p.outs, p.outs + p.num_parts), lses(p.lses, p.lses + p.num_parts);
  Backend* t = target();
  return RunOrRecord([t, p, outs, lses]() {
    MergeAttentionParams q = p;
    q.outs = outs.data();
    q.lses = lses.data();
    return t->MergeAttention(q, nullptr);
  });
}

absl::Status CapturingBackend::BeginCapture(Stream s) {
  if (s != nullptr) return absl::InvalidArgumentError("CapturingBackend: the default stream only");
  if (capturing_) return absl::FailedPreconditionError("CapturingBackend: already capturing");
  capturing_ = true;
  capture_error_ = absl::OkStatus();
  ops_.clear();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Graph>> CapturingBackend::EndCapture(Stream s) {
  if (!capturing_) return absl::FailedPreconditionError("CapturingBackend: not capturing");
  capturing_ = false;
  std::vector<std::function<absl::Status()>> ops = std::move(ops_);
  ops_.clear();
  if (!capture_error_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("CapturingBackend: the capture is broken: ", capture_error_.message()));
  }
  return std::unique_ptr<Graph>(new RecordedGraph(std::move(ops)));
}

}  // namespace strata::kernels::testing
