// The CPU reference backend (kernels::MakeCpuBackend) and the free functions behind its ops.
//
// CpuBackend implements kernels::Backend on host memory. Each op lives in kernels/cpu/<op>.cc as
// a free function Cpu<Op>(params) that validates its params (the same checks as Supports) and
// then runs; the class only forwards to them. Accumulation is always f32. Ops parallelise with
// OpenMP over the thread count given to MakeCpuBackend.
//
// Thread-compatibility: the free functions are thread-safe (they touch only the memory in their
// params). A CpuBackend follows the Backend contract (external synchronisation).
#ifndef STRATA_KERNELS_CPU_CPU_BACKEND_H_
#define STRATA_KERNELS_CPU_CPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::kernels {

// Validation twins (what Supports() returns): OkStatus when the op can run on these params,
// InvalidArgument for malformed shapes/dtypes/pointers, Unimplemented for a dtype the CPU
// backend does not handle.
absl::Status CpuSupportsEmbedding(const EmbeddingParams& p);
absl::Status CpuSupportsRmsNorm(const RmsNormParams& p);
absl::Status CpuSupportsMatMul(const MatMulParams& p);
absl::Status CpuSupportsRope(const RopeParams& p);
absl::Status CpuSupportsSwiGlu(const SwiGluParams& p);
absl::Status CpuSupportsAdd(const AddParams& p);

// The ops. Each validates first (the matching CpuSupports*) and returns its error unchanged;
// on success the outputs are written as backend.h specifies.
absl::Status CpuEmbedding(const EmbeddingParams& p);
absl::Status CpuRmsNorm(const RmsNormParams& p);
absl::Status CpuMatMul(const MatMulParams& p);
absl::Status CpuRope(const RopeParams& p);
absl::Status CpuSwiGlu(const SwiGluParams& p);
absl::Status CpuAdd(const AddParams& p);

// Attention, implemented in kernels/cpu/attention.cc (by the attention owner). Each validates
// its params itself (InvalidArgument for malformed ones) and then computes (out, lse) exactly as
// backend.h specifies. CpuBackend::Supports() for these two runs shape/dtype checks kept in
// cpu_backend.cc.
absl::Status CpuPagedAttention(const PagedAttentionParams& p);
// The k_scale / v_scale check of the attention ops (kernels/backend.h, fp8 KV pools): finite and
// > 0 for fp8 pools, exactly 1 otherwise; InvalidArgument naming `op` when not.
absl::Status CheckKvScales(DType pool_dtype, float k_scale, float v_scale, const char* op);
absl::Status CpuMergeAttention(const MergeAttentionParams& p);

// PageCopy (kernels/cpu/page_copy.cc): the validation shared with the CUDA backend (shapes,
// dtypes, staging size, every slot and table index in range; reads the host arrays) and the op.
absl::Status CpuSupportsPageCopy(const PageCopyParams& p);
absl::Status CpuPageCopy(const PageCopyParams& p);

// ResolvePages (kernels/cpu/page_cache.cc): the validation shared with the CUDA backend (state
// arrays present, pools [num_slots, page_size, d], the layer's rows inside the table, the
// selection well formed; it reads no state values) and the op.
absl::Status CpuSupportsResolvePages(const ResolvePagesParams& p);
absl::Status CpuResolvePages(const ResolvePagesParams& p);

// AppendKv (kernels/cpu/kv_append.cc): the validation shared with the CUDA backend (shapes, dtypes,
// scales, every slot inside the pools) and the op (ConvertFromF32 of each row; fp8: of x / scale).
absl::Status CpuSupportsAppendKv(const AppendKvParams& p);
absl::Status CpuAppendKv(const AppendKvParams& p);
// EncodeFp8Pages (kernels/cpu/kv_append.cc): the validation shared with the CUDA backend and the op.
absl::Status CpuSupportsEncodeFp8Pages(const EncodeFp8PagesParams& p);
absl::Status CpuEncodeFp8Pages(const EncodeFp8PagesParams& p);

// Device-resident sparse selection (kernels/cpu/selection.cc; semantics in kernels/backend.h).
// The CpuSupports* twins are also the validation of the CUDA backend's versions.
absl::Status CpuSupportsScoreSummaries(const ScoreSummariesParams& p);
absl::Status CpuSupportsScoreKeys(const ScoreKeysParams& p);
absl::Status CpuSupportsVoteTopK(const VoteTopKParams& p);
absl::Status CpuSupportsSelectedAttention(const SelectedAttentionParams& p);
absl::Status CpuScoreSummaries(const ScoreSummariesParams& p);
absl::Status CpuScoreKeys(const ScoreKeysParams& p);
absl::Status CpuVoteTopK(const VoteTopKParams& p);
absl::Status CpuSelectedAttention(const SelectedAttentionParams& p);
absl::Status CpuSupportsUpdateSummaries(const UpdateSummariesParams& p);
absl::Status CpuUpdateSummaries(const UpdateSummariesParams& p);
absl::Status CpuSupportsSelectionCacheCheck(const SelectionCacheCheckParams& p);
absl::Status CpuSelectionCacheCheck(const SelectionCacheCheckParams& p);
// InvalidArgument unless `c` is well formed for `num_kv_heads` heads (fanout >= 1, range inside
// [0, 2^31), parents i32 [num_kv_heads, *]); Unimplemented beyond 2^30 candidates per head.
absl::Status CheckCandidateList(const CandidateList& c, int64_t num_kv_heads, const char* op);
// The id of candidate i of KV head g (host-readable parents), or -1 when it is invalid.
int64_t CandidateId(const CandidateList& c, int g, int64_t i);

// Token sampling (kernels/cpu/sampling.cc; semantics in kernels/backend.h). CpuSupportsSample is
// also the CUDA backend's validation. ClampSampleRow applies engine::Sampler's clamping.
absl::Status CpuSupportsSample(const SampleParams& p);
absl::Status CpuSample(const SampleParams& p);
SampleRow ClampSampleRow(const SampleRow& row);

// Host memory owned by a CpuBackend allocation (64-byte aligned).
class CpuBuffer : public Buffer {
 public:
  explicit CpuBuffer(size_t bytes);
  ~CpuBuffer() override;
  CpuBuffer(const CpuBuffer&) = delete;
  CpuBuffer& operator=(const CpuBuffer&) = delete;
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class CpuBackend : public Backend {
 public:
  // num_threads <= 0: every usable core (base/cpu_limit.h UsableCores: the CPU affinity, capped
  // by the cgroup's CPU quota, e.g. a Kubernetes CPU limit).
  explicit CpuBackend(int num_threads);

  std::string Name() const override { return "cpu"; }

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status Synchronize(Stream s) override;
  // Plain host memory (same as Allocate).
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
  absl::Status ScoreSummaries(const ScoreSummariesParams& p, Stream s) override;
  absl::Status ScoreKeys(const ScoreKeysParams& p, Stream s) override;
  absl::Status VoteTopK(const VoteTopKParams& p, Stream s) override;
  absl::Status SelectedAttention(const SelectedAttentionParams& p, Stream s) override;
  absl::Status UpdateSummaries(const UpdateSummariesParams& p, Stream s) override;
  absl::Status SelectionCacheCheck(const SelectionCacheCheckParams& p, Stream s) override;
  absl::Status Supports(const SampleParams& p) const override;
  absl::Status Sample(const SampleParams& p, Stream s) override;
  absl::Status Supports(const PageCopyParams& p) const override;
  absl::Status PageCopy(const PageCopyParams& p, Stream s) override;
  absl::Status ResolvePages(const ResolvePagesParams& p, Stream s) override;
  absl::Status AppendKv(const AppendKvParams& p, Stream s) override;
  absl::Status EncodeFp8Pages(const EncodeFp8PagesParams& p, Stream s) override;

 private:
  // Sets the OpenMP thread count for the calling thread before an op of `work` elements (or
  // multiply-adds): one thread below cpu_internal::kParallelMinWork, else num_threads_.
  void ApplyThreads(int64_t work) const;
  int num_threads_;
};

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_CPU_CPU_BACKEND_H_
