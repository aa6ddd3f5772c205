// CudaBackend: kernels::Backend on one CUDA device (made by kernels::MakeCudaBackend in
// kernels/cuda_backend.h). Every op validates its params on the host (the CPU backend's checks,
// plus this backend's limits), then enqueues kernels on the op's stream and returns without
// waiting; a kernel or launch failure comes back as Status with file:line.
//
// Streams: Stream == nullptr means the backend's own non-blocking stream (not the legacy default
// stream); any other value is a cudaStream_t of this device, e.g. from CreateStream().
// Memory: Allocate() is cudaMalloc. CopyToDevice/CopyToHost are ordered after earlier work on
// their stream and return once the bytes have arrived (they synchronise that stream), so the
// source may be reused and the destination read as soon as they return.
// Scratch: ops that need temporary device memory (MatMul's split activations, PagedAttention's
// plan and split-K partials) take it from a backend-owned stream-ordered pool
// (cudaMallocFromPoolAsync / cudaFreeAsync on the op's stream), so they stay correct when ops run
// on several streams.
// PagedAttention: spans, span_offsets and q_positions are host memory in the interface. The op
// packs them (and the split-K plan) into a pinned host buffer owned by the backend, copies that
// with one cudaMemcpyAsync into pool scratch on the op's stream and frees the scratch after the
// kernels (stream-ordered). The caller may reuse its host arrays as soon as the call returns. The
// pinned buffers form a ring of 4; one is reused after waiting on the event recorded after the
// copy out of it (so the host may run up to 4 PagedAttention calls ahead of the device). They
// start at 256 KiB each (about 16K spans); a larger plan grows one with cudaFreeHost/cudaMallocHost,
// which synchronise the device.
// MatMul: one cuBLAS handle, bound to the op's stream per call (cublasSetStream), using cuBLAS's
// default workspace. Known limitation: MatMuls on two streams at the same time would share that
// workspace; per-stream workspaces (cublasSetWorkspace, as PyTorch keeps per handle and stream)
// are not implemented yet, so do not overlap MatMuls on different streams.
// Embedding: ids live in device memory, so out-of-range ids cannot be reported without a sync;
// their rows are filled with NaN instead (the CPU backend returns InvalidArgument).
//
// Thread-compatibility: as Backend (external synchronisation of calls into one CudaBackend;
// work on different streams may overlap on the device). Every call makes the backend's device
// current on the calling thread (cudaSetDevice) and leaves it so.
#ifndef STRATA_KERNELS_CUDA_CUDA_BACKEND_H_
#define STRATA_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::kernels {

namespace cuda_internal {
struct DeviceSelectStages;
}  // namespace cuda_internal

struct AttentionPlanCache;  // host-side PagedAttention planning buffers (cuda_backend.cc)

// Device memory from cudaMalloc; freed (cudaFree) by the destructor.
class CudaBuffer : public Buffer {
 public:
  CudaBuffer(int device, void* data, size_t bytes) : device_(device), data_(data), bytes_(bytes) {}
  ~CudaBuffer() override;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  int device_;
  void* data_;
  size_t bytes_;
};

class CudaBackend : public Backend {
 public:
  // See MakeCudaBackend (kernels/cuda_backend.h) for the error codes.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string Name() const override;

  absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t bytes) override;
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status Synchronize(Stream s) override;
  // Pinned host memory mapped into the device's address space (cudaHostAlloc, portable and
  // mapped); freed with cudaFreeHost. What PageCopy reads its staging and index arrays from.
  absl::StatusOr<std::unique_ptr<Buffer>> AllocateHost(size_t bytes) override;
  // cudaMemcpyAsync on the stream of `s`, no synchronisation.
  absl::Status CopyToDeviceAsync(void* dst, const void* src, size_t bytes, Stream s) override;
  absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream s) override;
  // A mark is an event recorded on the stream of `s` (kept for reuse once waited for; ids count
  // up from 1); WaitMark is cudaEventSynchronize.
  absl::StatusOr<int64_t> RecordMark(Stream s) override;
  absl::Status WaitMark(int64_t mark) override;

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
  // Device-resident selection (kernels/cuda/selection.cu, attention.cu). Validation is the CPU
  // twin's (CpuSupports*), plus: at most 16 query heads per KV head for the scoring ops, and
  // SelectedAttention needs head_dim 64/128/256, at most 8 query heads per KV head and 16-byte
  // aligned q and pools (Unimplemented otherwise). Scratch (VoteTopK keys beyond 32K candidates,
  // SelectedAttention partials) comes from the stream-ordered pool, so every op is capturable in
  // a CUDA graph: nothing reads device values on the host.
  absl::Status ScoreSummaries(const ScoreSummariesParams& p, Stream s) override;
  absl::Status ScoreKeys(const ScoreKeysParams& p, Stream s) override;
  absl::Status VoteTopK(const VoteTopKParams& p, Stream s) override;
  absl::Status SelectedAttention(const SelectedAttentionParams& p, Stream s) override;
  absl::Status UpdateSummaries(const UpdateSummariesParams& p, Stream s) override;
  // SelectionCacheCheck: one block per KV head (kernels/cuda/selection.cu); skip_heads of the
  // scoring and top-k ops make the flagged heads' blocks (clusters) exit at the top.
  absl::Status SelectionCacheCheck(const SelectionCacheCheckParams& p, Stream s) override;
  // SelectStages: one cluster kernel for the whole chain (kernels/cuda/selection.cu
  // SelectStagesKernel) for head_dim 128, at most 4 query heads per KV head, bf16 summaries,
  // bf16 or fp8 keys (not both in one call) with power-of-two page size and fanout, 16-byte
  // aligned q and rows, and at most
  // 16 x 1024 candidates per stage (8 x 1024 where 16-block clusters do not fit); otherwise the
  // ops one by one. The checks and errors are those of the ops; the stages' CPU-twin checks and
  // attend's (CpuSupportsSelectedAttention) are made before anything runs, on either path.
  absl::Status SelectStages(const SelectStagesParams& p, Stream s) override;
  // SelectStages with partitions > 1 (selection_backend.cc).
  absl::Status SelectStagesInParts(const SelectStagesParams& p,
                                   const cuda_internal::DeviceSelectStages& d, bool fused,
                                   int64_t hkv, int64_t group, bool bf16_keys, bool fp8_keys,
                                   Stream s);
  // PageCopy: the CPU checks, then every host array must be AllocateHost memory (checked with
  // cudaPointerGetAttributes; InvalidArgument otherwise); one launch reads them through the
  // mapping (kernels/cuda/page_copy.cu) and returns without waiting.
  absl::Status Supports(const PageCopyParams& p) const override;
  absl::Status PageCopy(const PageCopyParams& p, Stream s) override;
  // ResolvePages (kernels/cuda/page_cache.cu, page_cache_backend.cc): the CPU twin's validation,
  // 16-byte aligned pools; then one block for the naming, the clock and the table, and a fixed
  // grid that copies the missed pages from their sources through the host mapping (16-byte loads
  // when a page half is a multiple of 16 bytes: the sources must then be 16-byte aligned, which
  // kvstore::GpuPageCache checks when it builds them; not checked per call). Capturable.
  absl::Status ResolvePages(const ResolvePagesParams& p, Stream s) override;
  // AppendKv: one conversion kernel (kernels/cuda/kv_append.cu); validation on the host.
  absl::Status AppendKv(const AppendKvParams& p, Stream s) override;
  // EncodeFp8Pages: one block per page (kernels/cuda/kv_append.cu); validation on the host
  // (CpuSupportsEncodeFp8Pages), head_dim at most 1024.
  absl::Status EncodeFp8Pages(const EncodeFp8PagesParams& p, Stream s) override;
  // Graph capture: cudaStreamBeginCapture (thread-local mode) on the stream of `s`,
  // cudaStreamEndCapture + cudaGraphInstantiate; Internal when the capture was invalidated (e.g. a
  // synchronising op inside it). For nullptr (the backend's own stream) the capture runs on a
  // private stream of the same priority that stands in for the backend's own stream in this
  // thread only until EndCapture: other threads keep queuing work on the backend's stream (a
  // worker job's page loads beside another job's first graph step) without joining or breaking
  // the capture.
  absl::Status BeginCapture(Stream s) override;
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture(Stream s) override;
  // Fork: a non-blocking side stream of this backend (kept for reuse after its join; the device's
  // least stream priority, the backend's own stream has its greatest) that waits on an event
  // recorded on `s`; Join: an event recorded on the side stream that `s` waits on. In a capture
  // the two become the graph's fork and join edges, and graphs run with each node's priority.
  absl::StatusOr<Stream> ForkStream(Stream s) override;
  absl::Status JoinStream(Stream side, Stream s) override;
  // The cudaStream_t that ops given `s` run on.
  cudaStream_t ToCudaStream(Stream s) const { return ToCuda(s); }

  // Token sampling (kernels/cuda/sampling.cu, sampling_backend.cc): the CPU twin's validation,
  // at most 65535 rows; scratch (8 bytes per logit, and about 0.8 MB per row of histograms at a
  // vocabulary over 2^15) from the stream-ordered pool; capturable in a
  // CUDA graph. A row with nothing to pick gets -1.
  absl::Status Supports(const SampleParams& p) const override;
  absl::Status Sample(const SampleParams& p, Stream s) override;

  // A new non-blocking stream on this device; the caller destroys it with DestroyStream.
  absl::StatusOr<Stream> CreateStream() override;
  absl::Status DestroyStream(Stream s) override;

  // Tuning knob of the decode path: split-K work items the plan aims for per SM (>= 1; other
  // values restore the defaults, cuda_internal::kDecodeItemsPerSm, and kDecodeMmaItemsPerSm for
  // SelectedAttention calls on the tensor-core split-K kernel). Affects speed only.
  void SetDecodeItemsPerSm(int n);

  // Which kernel serves PagedAttention with query tokens off the decode path (speed only; the
  // math is the same up to bf16 rounding). kAuto: the tensor-core flash kernel
  // (kernels/cuda/flash_prefill.cu) for more than one token where it applies (bf16 pool,
  // head_dim 64/128, 16-byte aligned q and pools), else the general kernel. kGeneral: always the
  // general (scalar) kernel, e.g. to compare against. kFlash: as kAuto, and the flash kernel
  // also takes single-token calls (tests use it to cover one token).
  enum class PrefillPath { kAuto, kGeneral, kFlash };
  void SetPrefillPath(PrefillPath path) { prefill_path_ = path; }

  int device() const { return device_; }
  int num_sms() const { return num_sms_; }

 private:
  CudaBackend(int device, int num_sms);
  absl::Status Init();
  absl::Status QueueCopy(const char* op, void* dst, const void* src, size_t bytes, Stream s,
                         bool wait);
  // nullptr: the backend's own stream, or this thread's capture stream during a BeginCapture(nullptr).
  cudaStream_t ToCuda(Stream s) const;
  absl::Status MakeCurrent() const;
  // `bytes` of scratch from the pool, ordered on `stream`; release with FreeScratch on the same
  // stream after the last kernel that uses it.
  absl::StatusOr<void*> AllocScratch(size_t bytes, cudaStream_t stream);
  absl::Status FreeScratch(void* p, cudaStream_t stream);
  // The next pinned staging buffer of the ring, grown to at least `bytes` and not in use by any
  // pending copy. The caller records pinned_[i].copied after its copy and sets pending.
  absl::StatusOr<int> PinnedStaging(size_t bytes);

  int device_;
  int num_sms_;
  cudaStream_t stream_ = nullptr;
  // ForkStream's side streams: all it made, and those not forked now; one event for every fork
  // and join (each record is waited on at once, so one event serves them all).
  std::vector<cudaStream_t> side_streams_;
  std::vector<cudaStream_t> side_free_;
  cudaEvent_t fork_event_ = nullptr;
  int side_priority_ = 0;
  int main_priority_ = 0;  // stream_'s (and the capture streams')
  // RecordMark's events: pending marks by id, and events free for reuse.
  std::map<int64_t, cudaEvent_t> marks_;
  std::vector<cudaEvent_t> free_events_;
  int64_t next_mark_ = 1;
  cublasHandle_t blas_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  // Staging for PagedAttention plans: a ring of pinned buffers, so that the host can plan a few
  // calls ahead of the device; each is reused only after the event recorded after its last copy.
  static constexpr int kPinnedRing = 4;
  static constexpr size_t kPinnedInitialBytes = 256 * 1024;
  struct Pinned {
    void* data = nullptr;
    size_t bytes = 0;
    cudaEvent_t copied = nullptr;  // recorded after the last copy out of `data`
    bool pending = false;
  };
  Pinned pinned_[kPinnedRing];
  int pinned_next_ = 0;
  std::unique_ptr<AttentionPlanCache> plan_cache_;
  // SetDecodeItemsPerSm's count; 0: the defaults (cuda_internal::kDecodeItemsPerSm, and
  // kDecodeMmaItemsPerSm for SelectedAttention's tensor-core split-K kernel).
  int decode_items_per_sm_ = 0;
  PrefillPath prefill_path_ = PrefillPath::kAuto;
};

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_CUDA_CUDA_BACKEND_H_
