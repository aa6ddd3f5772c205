// A Backend for tests that runs the CPU backend's ops but behaves like a device backend with
// graphs: its name is not "cpu" (so engine::Transformer treats its memory as backend memory and
// takes its device paths, e.g. TransformerOptions::decode_graph), and BeginCapture / EndCapture
// record the ops queued in between, with their parameters, into a Graph whose Replay runs them
// again in order (reading whatever backend memory holds then, as a replayed CUDA graph does).
// While capturing, the waiting copies and Synchronize fail (a capture must not wait or copy
// synchronously, as on CUDA) and the asynchronous copies are recorded, and ops that read host arrays the caller owns only during the call
// (PagedAttention's spans) are refused. Besides the core ops it forwards those a decode graph
// step can use: the selection ops (summaries, keys, votes, the selection cache, SelectStages),
// AppendKv, SelectedAttention, ResolvePages, EncodeFp8Pages and Sample. The graph machinery of the
// engine and the worker (one-token and batched graph steps, document hooks recorded in them) can
// then be checked in CI on machines without a GPU.
#ifndef STRATA_KERNELS_TESTING_CAPTURING_BACKEND_H_
#define STRATA_KERNELS_TESTING_CAPTURING_BACKEND_H_

#include <functional>
#include <memory>
#include <vector>

#include "kernels/testing/forwarding_backend.h"

namespace strata::kernels::testing {

class CapturingBackend : public ForwardingBackend {
 public:
  // Runs the ops on a CPU backend with `threads` threads.
  explicit CapturingBackend(int threads = 1);

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream s) override;
  // Recorded while capturing (run at each replay, as a CUDA graph's copy nodes), else run now.
  absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status Synchronize(Stream s) override;

  absl::Status Embedding(const EmbeddingParams& p, Stream s) override;
  absl::Status RmsNorm(const RmsNormParams& p, Stream s) override;
  absl::Status MatMul(const MatMulParams& p, Stream s) override;
  absl::Status Rope(const RopeParams& p, Stream s) override;
  absl::Status SwiGlu(const SwiGluParams& p, Stream s) override;
  absl::Status Add(const AddParams& p, Stream s) override;
  absl::Status PagedAttention(const PagedAttentionParams& p, Stream s) override;
  absl::Status MergeAttention(const MergeAttentionParams& p, Stream s) override;
  absl::Status PageCopy(const PageCopyParams& p, Stream s) override;
  absl::Status ScoreSummaries(const ScoreSummariesParams& p, Stream s) override;
  absl::Status ScoreKeys(const ScoreKeysParams& p, Stream s) override;
  absl::Status VoteTopK(const VoteTopKParams& p, Stream s) override;
  absl::Status UpdateSummaries(const UpdateSummariesParams& p, Stream s) override;
  absl::Status SelectionCacheCheck(const SelectionCacheCheckParams& p, Stream s) override;
  absl::Status SelectStages(const SelectStagesParams& p, Stream s) override;
  absl::Status EncodeFp8Pages(const EncodeFp8PagesParams& p, Stream s) override;
  absl::Status SelectedAttention(const SelectedAttentionParams& p, Stream s) override;
  absl::Status ResolvePages(const ResolvePagesParams& p, Stream s) override;
  absl::Status AppendKv(const AppendKvParams& p, Stream s) override;
  absl::Status Supports(const SampleParams& p) const override;
  absl::Status Sample(const SampleParams& p, Stream s) override;
  using ForwardingBackend::Supports;

  absl::Status BeginCapture(Stream s) override;
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream s) override;

  // Ops recorded by captures so far.
  int64_t recorded_ops() const { return recorded_ops_; }

 private:
  // Runs `op` now, or records it while capturing.
  absl::Status RunOrRecord(std::function<absl::Status()> op);

  bool capturing_ = false;
  absl::Status capture_error_;  // the first op refused while capturing
  std::vector<std::function<absl::Status()>> ops_;
  int64_t recorded_ops_ = 0;
};

}  // namespace strata::kernels::testing

#endif  // STRATA_KERNELS_TESTING_CAPTURING_BACKEND_H_
