// CudaBackend: device memory, streams, host-side validation and planning, and the launch of every
// op's kernels (kernels/cuda/<op>.cu).
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/internal/cuda_status.h"
#include "kernels/cuda/internal/flash_prefill.h"
#include "kernels/cuda/internal/kv_append.h"
#include "kernels/cuda/internal/launch.h"
#include "kernels/cuda/internal/page_copy.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {

using cuda_internal::AttentionPlan;
using cuda_internal::AttentionShape;
using cuda_internal::DecodeWorkItem;
using cuda_internal::DeviceSpan;
using cuda_internal::FloatType;

namespace {

constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();

FloatType ToFloatType(DType t) {
  switch (t) {
    case DType::kBF16:
      return FloatType::kBF16;
    case DType::kF16:
      return FloatType::kF16;
    case DType::kFP8E4M3:
      return FloatType::kFP8E4M3;
    default:
      return FloatType::kF32;
  }
}

absl::Status CheckView(const TensorView& v, int rank, DType dtype, const char* op,
                       const char* name) {
  if (v.rank != rank || v.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " must be ", DTypeName(dtype),
                                                   " of rank ", rank, ", got ", v.DebugString()));
  }
  for (int i = 0; i < rank; ++i) {
    if (v.shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has a negative dimension"));
    }
  }
  if (v.NumElements() > 0 && v.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has null data"));
  }
  return absl::OkStatus();
}

absl::Status CheckSame(const TensorView& a, const TensorView& b, int dims, const char* op,
                       const char* name) {
  for (int i = 0; i < dims; ++i) {
    if (a.shape[i] != b.shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " ", b.DebugString(),
                                                     " does not match ", a.DebugString()));
    }
  }
  return absl::OkStatus();
}

// Shape/dtype/pointer checks of PagedAttention (the CPU backend's, plus this backend's limits).
absl::Status CheckPagedAttentionShape(const PagedAttentionParams& p) {
  constexpr const char* kOp = "PagedAttention";
  STRATA_RETURN_IF_ERROR(CheckView(p.q, 3, DType::kF32, kOp, "q"));
  STRATA_RETURN_IF_ERROR(CheckView(p.out, 3, DType::kF32, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckView(p.lse, 2, DType::kF32, kOp, "lse"));
  if (p.k_pool.dtype != DType::kF32 && p.k_pool.dtype != DType::kBF16 &&
      p.k_pool.dtype != DType::kFP8E4M3) {
    return absl::UnimplementedError(
        absl::StrCat("PagedAttention: pool dtype ", DTypeName(p.k_pool.dtype), " unsupported"));
  }
  STRATA_RETURN_IF_ERROR(CheckKvScales(p.k_pool.dtype, p.k_scale, p.v_scale, kOp));
  STRATA_RETURN_IF_ERROR(CheckView(p.k_pool, 3, p.k_pool.dtype, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckView(p.v_pool, 3, p.k_pool.dtype, kOp, "v_pool"));
  STRATA_RETURN_IF_ERROR(CheckSame(p.k_pool, p.v_pool, 3, kOp, "v_pool"));
  STRATA_RETURN_IF_ERROR(CheckSame(p.q, p.out, 3, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckSame(p.q, p.lse, 2, kOp, "lse"));
  if (p.k_pool.dim(2) != p.q.dim(2)) {
    return absl::InvalidArgumentError("PagedAttention: pool head_dim differs from q head_dim");
  }
  if (p.num_kv_heads <= 0 || p.q.dim(1) % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttention: num_kv_heads ", p.num_kv_heads,
                                                   " must divide num_q_heads ", p.q.dim(1)));
  }
  if (p.span_offsets == nullptr) {
    return absl::InvalidArgumentError("PagedAttention: span_offsets is null");
  }
  if (p.causal && p.q.dim(0) > 0 && p.q_positions == nullptr) {
    return absl::InvalidArgumentError("PagedAttention: causal needs q_positions");
  }
  if (!std::isfinite(p.scale)) {
    return absl::InvalidArgumentError("PagedAttention: scale must be finite");
  }
  if (p.q.dim(2) > cuda_internal::kAttentionMaxHeadDim) {
    return absl::UnimplementedError(absl::StrCat("PagedAttention: head_dim ", p.q.dim(2),
                                                 " > ", cuda_internal::kAttentionMaxHeadDim));
  }
  if (p.q.dim(0) > 65535 || p.q.dim(1) > 65535) {
    return absl::UnimplementedError("PagedAttention: more than 65535 tokens or heads per call");
  }
  return absl::OkStatus();
}

// Span contents (host memory): offsets non-decreasing, every span inside the pool.
absl::Status CheckSpans(const PagedAttentionParams& p) {
  if (p.span_offsets[0] < 0) return absl::InvalidArgumentError("PagedAttention: negative offset");
  for (int g = 0; g < p.num_kv_heads; ++g) {
    if (p.span_offsets[g + 1] < p.span_offsets[g]) {
      return absl::InvalidArgumentError("PagedAttention: span_offsets not non-decreasing");
    }
  }
  const int32_t total = p.span_offsets[p.num_kv_heads];
  if (total > p.span_offsets[0] && p.spans == nullptr) {
    return absl::InvalidArgumentError("PagedAttention: null spans");
  }
  const int64_t num_slots = p.k_pool.dim(0), page_size = p.k_pool.dim(1);
  int64_t tokens = 0;
  for (int32_t i = p.span_offsets[0]; i < total; ++i) {
    const KvSpan& s = p.spans[i];
    if (s.slot < 0 || s.slot >= num_slots || s.offset < 0 || s.length < 0 ||
        static_cast<int64_t>(s.offset) + s.length > page_size) {
      return absl::InvalidArgumentError(absl::StrCat("PagedAttention: span ", i, " (slot ", s.slot,
                                                     ", offset ", s.offset, ", length ", s.length,
                                                     ") outside pool of ", num_slots, " slots x ",
                                                     page_size, " tokens"));
    }
    tokens += s.length;
  }
  if (tokens > kIntMax) {
    return absl::UnimplementedError("PagedAttention: more than 2^31 keys in one call");
  }
  return absl::OkStatus();
}

absl::Status CheckMerge(const MergeAttentionParams& p) {
  constexpr const char* kOp = "MergeAttention";
  STRATA_RETURN_IF_ERROR(CheckView(p.out, 3, DType::kF32, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckView(p.lse, 2, DType::kF32, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckSame(p.out, p.lse, 2, kOp, "lse"));
  if (p.num_parts < 1 || p.outs == nullptr || p.lses == nullptr) {
    return absl::InvalidArgumentError("MergeAttention: needs at least one part");
  }
  if (p.num_parts > cuda_internal::kMaxMergeParts) {
    return absl::UnimplementedError(absl::StrCat("MergeAttention: ", p.num_parts, " parts > ",
                                                 cuda_internal::kMaxMergeParts));
  }
  for (int s = 0; s < p.num_parts; ++s) {
    STRATA_RETURN_IF_ERROR(CheckView(p.outs[s], 3, DType::kF32, kOp, "outs[s]"));
    STRATA_RETURN_IF_ERROR(CheckView(p.lses[s], 2, DType::kF32, kOp, "lses[s]"));
    STRATA_RETURN_IF_ERROR(CheckSame(p.out, p.outs[s], 3, kOp, "outs[s]"));
    STRATA_RETURN_IF_ERROR(CheckSame(p.lse, p.lses[s], 2, kOp, "lses[s]"));
  }
  if (p.out.dim(0) * p.out.dim(1) > kIntMax) {
    return absl::UnimplementedError("MergeAttention: more than 2^31 rows");
  }
  return absl::OkStatus();
}

// The PagedAttention plan in host memory, as int32 words; each section starts on a 16-byte
// boundary (see cuda_internal::AttentionPlan for the layout).
struct HostPlan {
  std::vector<int32_t> words;
  size_t spans = 0, span_start = 0, span_offsets = 0, head_tokens = 0, q_positions = 0,
         items = 0, item_offsets = 0;
  int num_items = 0;
  bool decode = false;

  size_t Section(size_t n_words) {
    const size_t at = (words.size() + 3) / 4 * 4;
    words.resize(at + n_words, 0);
    return at;
  }
};

}  // namespace

// Host-side buffers of PagedAttention planning, kept across calls so that a decode step does not
// allocate (vectors keep their capacity).
struct AttentionPlanCache {
  HostPlan plan;
  std::vector<DeviceSpan> spans;
  std::vector<int32_t> span_start, span_offsets, head_tokens, item_offsets;
  std::vector<DecodeWorkItem> items;
};

namespace {

// Fills cache->plan for `p` (validated). items_per_sm: split-K work items aimed for per SM.
void BuildPlan(const PagedAttentionParams& p, bool decode_ok, int num_sms, int items_per_sm,
               AttentionPlanCache* cache) {
  HostPlan& plan = cache->plan;
  plan.words.clear();
  plan.num_items = 0;
  plan.decode = false;
  const int num_tokens = static_cast<int>(p.q.dim(0));
  const int nkv = p.num_kv_heads;
  // With one query token the causal limit is applied here, per span, so the kernels see only
  // attended keys; the general kernel also masks per key.
  const bool cut = p.causal && num_tokens == 1;
  const int64_t qpos = cut ? p.q_positions[0] : 0;
  std::vector<DeviceSpan>& spans = cache->spans;
  std::vector<int32_t>& span_start = cache->span_start;
  std::vector<int32_t>& span_offsets = cache->span_offsets;
  std::vector<int32_t>& head_tokens = cache->head_tokens;
  spans.clear();
  span_start.clear();
  span_offsets.assign(nkv + 1, 0);
  head_tokens.assign(nkv, 0);
  for (int g = 0; g < nkv; ++g) {
    span_offsets[g] = static_cast<int32_t>(spans.size());
    int32_t tokens = 0;
    for (int32_t i = p.span_offsets[g]; i < p.span_offsets[g + 1]; ++i) {
      const KvSpan& s = p.spans[i];
      int64_t len = s.length;
      if (cut) len = std::min<int64_t>(len, std::max<int64_t>(0, qpos - s.position + 1));
      if (len <= 0) continue;
      spans.push_back({s.slot, s.offset, static_cast<int32_t>(len), s.position});
      span_start.push_back(tokens);
      tokens += static_cast<int32_t>(len);
    }
    head_tokens[g] = tokens;
  }
  span_offsets[nkv] = static_cast<int32_t>(spans.size());

  // Split-K work items: about kDecodeItemsPerSm per SM over all heads. Chunks below one tile are
  // powers of two (>= 16 keys), longer ones whole tiles.
  std::vector<DecodeWorkItem>& items = cache->items;
  std::vector<int32_t>& item_offsets = cache->item_offsets;
  items.clear();
  item_offsets.assign(nkv + 1, 0);
  if (decode_ok) {
    int64_t total = 0;
    for (int g = 0; g < nkv; ++g) total += head_tokens[g];
    const int64_t target = std::max(1, items_per_sm * num_sms);
    const int64_t want = std::max<int64_t>(1, (total + target - 1) / target);
    const int64_t tile = cuda_internal::kDecodeTile;
    int64_t chunk = 16;
    if (want <= tile) {
      while (chunk < want) chunk *= 2;
    } else {
      chunk = (want + tile - 1) / tile * tile;
    }
    plan.decode = true;
    for (int g = 0; g < nkv; ++g) {
      item_offsets[g] = static_cast<int32_t>(items.size());
      int32_t si = span_offsets[g];  // span holding token b
      for (int64_t b = 0; b < head_tokens[g]; b += chunk) {
        while (span_start[si] + spans[si].length <= b) ++si;
        items.push_back({g, static_cast<int32_t>(b),
                         static_cast<int32_t>(std::min<int64_t>(chunk, head_tokens[g] - b)), si});
      }
    }
    item_offsets[nkv] = static_cast<int32_t>(items.size());
    plan.num_items = static_cast<int>(items.size());
  }

  auto put = [&plan](size_t at, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(plan.words.data() + at, src, bytes);
  };
  plan.spans = plan.Section(spans.size() * 4);
  plan.span_start = plan.Section(span_start.size());
  plan.span_offsets = plan.Section(span_offsets.size());
  plan.head_tokens = plan.Section(head_tokens.size());
  plan.q_positions = plan.Section(p.causal ? num_tokens : 0);
  plan.items = plan.Section(items.size() * 4);
  plan.item_offsets = plan.Section(item_offsets.size());
  put(plan.spans, spans.data(), spans.size() * sizeof(DeviceSpan));
  put(plan.span_start, span_start.data(), span_start.size() * 4);
  put(plan.span_offsets, span_offsets.data(), span_offsets.size() * 4);
  put(plan.head_tokens, head_tokens.data(), head_tokens.size() * 4);
  if (p.causal) put(plan.q_positions, p.q_positions, static_cast<size_t>(num_tokens) * 4);
  put(plan.items, items.data(), items.size() * sizeof(DecodeWorkItem));
  put(plan.item_offsets, item_offsets.data(), item_offsets.size() * 4);
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

CudaBuffer::~CudaBuffer() {
  if (data_ == nullptr) return;
  if (cudaSetDevice(device_) != cudaSuccess || cudaFree(data_) != cudaSuccess) {
    STRATA_LOG(ERROR) << "cudaFree of " << bytes_ << " bytes on device " << device_ << " failed";
  }
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky-free error state of the failed query
    return absl::UnavailableError(absl::StrCat("no CUDA device: ",
                                               e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " requested, ", count, " present"));
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  int num_sms = 0;
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device, num_sms));
  STRATA_RETURN_IF_ERROR(backend->Init());
  return backend;
}

CudaBackend::CudaBackend(int device, int num_sms) : device_(device), num_sms_(num_sms) {}

absl::Status CudaBackend::Init() {
  plan_cache_ = std::make_unique<AttentionPlanCache>();
  // STRATA_DECODE_ITEMS_PER_SM (A/B timing): the split-K decode kernels' items per SM.
  if (const char* v = std::getenv("STRATA_DECODE_ITEMS_PER_SM"); v != nullptr) SetDecodeItemsPerSm(std::atoi(v));
  // The backend's own stream at the device's greatest priority, ForkStream's side streams at its
  // least: where both branches of a fork have blocks waiting, the block scheduler places the
  // main branch's first (a cluster kernel there is not held up by a small kernel beside it).
  int least = 0, greatest = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  side_priority_ = least;
  main_priority_ = greatest;
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
  STRATA_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas_));
  cudaMemPoolProps props;
  std::memset(&props, 0, sizeof(props));
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device_;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
  // Keep freed scratch in the pool across synchronisations (no return to the driver).
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
  // Pinned staging sized for typical plans up front: growing it later (cudaFreeHost /
  // cudaMallocHost) synchronises the device.
  for (Pinned& b : pinned_) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&b.copied, cudaEventDisableTiming));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&b.data, kPinnedInitialBytes));
    b.bytes = kPinnedInitialBytes;
  }
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  // Best effort: errors here have no caller to go to.
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (Pinned& b : pinned_) {
    if (b.copied != nullptr) {
      cudaEventSynchronize(b.copied);
      cudaEventDestroy(b.copied);
    }
    if (b.data != nullptr) cudaFreeHost(b.data);
  }
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (pool_ != nullptr) {
    cudaDeviceSynchronize();  // scratch freed on other streams returns to the pool first
    cudaMemPoolDestroy(pool_);
  }
  for (cudaStream_t side : side_streams_) {
    cudaStreamSynchronize(side);
    cudaStreamDestroy(side);
  }
  if (fork_event_ != nullptr) cudaEventDestroy(fork_event_);
  for (auto& [id, ev] : marks_) cudaEventDestroy(ev);
  for (cudaEvent_t ev : free_events_) cudaEventDestroy(ev);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaBackend::SetDecodeItemsPerSm(int n) {
  decode_items_per_sm_ = n >= 1 ? n : 0;
}

std::string CudaBackend::Name() const { return absl::StrCat("cuda:", device_); }

absl::Status CudaBackend::MakeCurrent() const {
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaBackend::AllocScratch(size_t bytes, cudaStream_t stream) {
  void* p = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMallocFromPoolAsync(&p, std::max<size_t>(bytes, 256), pool_, stream));
  return p;
}

absl::Status CudaBackend::FreeScratch(void* p, cudaStream_t stream) {
  STRATA_CUDA_RETURN_IF_ERROR(cudaFreeAsync(p, stream));
  return absl::OkStatus();
}

absl::StatusOr<int> CudaBackend::PinnedStaging(size_t bytes) {
  const int i = pinned_next_;
  pinned_next_ = (pinned_next_ + 1) % kPinnedRing;
  Pinned& b = pinned_[i];
  if (b.pending) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b.copied));
    b.pending = false;
  }
  if (b.bytes < bytes) {
    if (b.data != nullptr) STRATA_CUDA_RETURN_IF_ERROR(cudaFreeHost(b.data));
    b.data = nullptr;
    b.bytes = 0;
    const size_t want = std::max<size_t>(RoundUp(bytes, 4096) * 2, 64 * 1024);
    STRATA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&b.data, want));
    b.bytes = want;
  }
  return i;
}

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::Allocate(size_t bytes) {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  void* p = nullptr;
  if (bytes > 0) STRATA_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
  return std::unique_ptr<Buffer>(new CudaBuffer(device_, p, bytes));
}

namespace {

bool InIdentityMappedHostBuffer(const void* p);  // below

// Copies up to this size between AllocateHost memory and device memory that do not wait run as
// a kernel (LaunchCopyBytes) instead of on a copy engine: inside a CUDA graph a copy-engine node
// costs a transition of several microseconds before the next kernel (the shard holder's step
// graph, bench/RESULTS.md session 35). STRATA_KERNEL_COPIES=0 keeps every copy on the copy engine.
constexpr size_t kKernelCopyMaxBytes = 256 * 1024;

bool KernelCopies() {
  static const bool on = [] {
    const char* e = std::getenv("STRATA_KERNEL_COPIES");
    return e == nullptr || std::string(e) != "0";
  }();
  return on;
}

bool IsDeviceMemory(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// Whether a copy that does not wait runs as a kernel: small, one side in a live AllocateHost
// buffer (identity-mapped, so the kernel reads or writes it through the host address) and the
// other in device memory.
bool CopyByKernel(void* dst, const void* src, size_t bytes) {
  if (bytes > kKernelCopyMaxBytes || !KernelCopies()) return false;
  const bool src_host = InIdentityMappedHostBuffer(src);
  if (src_host == InIdentityMappedHostBuffer(dst)) return false;
  return IsDeviceMemory(src_host ? dst : src);
}

}  // namespace

// One copy on the stream of `s` (any direction, cudaMemcpyDefault), waited for when `wait`.
absl::Status CudaBackend::QueueCopy(const char* op, void* dst, const void* src, size_t bytes,
                                    Stream s, bool wait) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": null"));
  }
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  if (!wait && CopyByKernel(dst, src, bytes)) {
    STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchCopyBytes(dst, src, bytes, ToCuda(s)));
    return absl::OkStatus();
  }
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ToCuda(s)));
  if (wait) STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* src, size_t bytes, Stream s) {
  return QueueCopy("CopyToDevice", dst, src, bytes, s, /*wait=*/true);
}

absl::Status CudaBackend::CopyToHost(void* dst, const void* src, size_t bytes, Stream s) {
  return QueueCopy("CopyToHost", dst, src, bytes, s, /*wait=*/true);
}

absl::Status CudaBackend::CopyToDeviceAsync(void* dst, const void* src, size_t bytes, Stream s) {
  return QueueCopy("CopyToDeviceAsync", dst, src, bytes, s, /*wait=*/false);
}

absl::Status CudaBackend::CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream s) {
  return QueueCopy("CopyToHostAsync", dst, src, bytes, s, /*wait=*/false);
}

absl::StatusOr<int64_t> CudaBackend::RecordMark(Stream s) {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  cudaEvent_t ev = nullptr;
  if (free_events_.empty()) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  } else {
    ev = free_events_.back();
    free_events_.pop_back();
  }
  const cudaError_t e = cudaEventRecord(ev, ToCuda(s));
  if (e != cudaSuccess) {
    free_events_.push_back(ev);
    STRATA_CUDA_RETURN_IF_ERROR(e);
  }
  const int64_t id = next_mark_++;
  marks_.emplace(id, ev);
  return id;
}

absl::Status CudaBackend::WaitMark(int64_t mark) {
  auto it = marks_.find(mark);
  if (it == marks_.end()) return absl::InvalidArgumentError("WaitMark: not a pending mark");
  const cudaEvent_t ev = it->second;
  marks_.erase(it);
  free_events_.push_back(ev);  // ended even if the wait fails
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev));
  return absl::OkStatus();
}

namespace {

// The live AllocateHost buffers whose device address is their host address, so that PageCopy can
// check a page address with a map lookup instead of a cudaPointerGetAttributes call per page
// (about 0.4 us each on the H100 host; 7,400 pages per decode token of the 8B bench).
std::mutex& HostRangesMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::map<uintptr_t, size_t>& HostRanges() {  // begin -> bytes; guarded by HostRangesMutex()
  static auto* ranges = new std::map<uintptr_t, size_t>;
  return *ranges;
}
// Whether p lies in one of those buffers.
bool InIdentityMappedHostBuffer(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(HostRangesMutex());
  const std::map<uintptr_t, size_t>& r = HostRanges();
  auto it = r.upper_bound(a);
  if (it == r.begin()) return false;
  --it;
  return a - it->first < it->second;
}

// Pinned, mapped host memory from cudaHostAlloc (CudaBackend::AllocateHost).
class CudaHostBuffer : public Buffer {
 public:
  CudaHostBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {
    void* dev = nullptr;
    if (data_ != nullptr && bytes_ > 0 &&
        cudaHostGetDevicePointer(&dev, data_, 0) == cudaSuccess && dev == data_) {
      std::lock_guard<std::mutex> lock(HostRangesMutex());
      HostRanges()[reinterpret_cast<uintptr_t>(data_)] = bytes_;
      registered_ = true;
    }
    cudaGetLastError();  // a failed query leaves no sticky error
  }
  ~CudaHostBuffer() override {
    if (registered_) {
      std::lock_guard<std::mutex> lock(HostRangesMutex());
      HostRanges().erase(reinterpret_cast<uintptr_t>(data_));
    }
    if (data_ != nullptr) cudaFreeHost(data_);  // best effort: no caller to report to
  }
  CudaHostBuffer(const CudaHostBuffer&) = delete;
  CudaHostBuffer& operator=(const CudaHostBuffer&) = delete;
  void* data() override { return data_; }
  size_t bytes() const override { return bytes_; }

 private:
  void* data_;
  size_t bytes_;
  bool registered_ = false;
};

// The device address of `p`, which must lie in pinned, mapped host memory. InvalidArgument for
// any other memory (pageable host memory, device memory).
absl::StatusOr<const void*> MappedHostPointer(const void* p, const char* name) {
  cudaPointerAttributes attr;
  const cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat("PageCopy: ", name, " is not host memory from "
                                                   "AllocateHost (", cudaGetErrorString(e), ")"));
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("PageCopy: ", name, " is not pinned, mapped host memory from AllocateHost"));
  }
  const char* host = static_cast<const char*>(attr.hostPointer);
  const char* dev = static_cast<const char*>(attr.devicePointer);
  // Whether the runtime reports the allocation's base or `p` itself, this is p's device address.
  return dev + (static_cast<const char*>(p) - (host != nullptr ? host : static_cast<const char*>(p)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Buffer>> CudaBackend::AllocateHost(size_t bytes) {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  void* p = nullptr;
  if (bytes > 0) {
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  }
  return std::unique_ptr<Buffer>(new CudaHostBuffer(p, bytes));
}

absl::Status CudaBackend::Synchronize(Stream s) {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ToCuda(s)));
  return absl::OkStatus();
}

absl::StatusOr<Stream> CudaBackend::CreateStream() {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  cudaStream_t s = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return static_cast<Stream>(s);
}

absl::Status CudaBackend::DestroyStream(Stream s) {
  if (s == nullptr) return absl::InvalidArgumentError("DestroyStream: null stream");
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamDestroy(static_cast<cudaStream_t>(s)));
  return absl::OkStatus();
}

// ---- Elementwise and row ops ---------------------------------------------------------------

absl::Status CudaBackend::Supports(const EmbeddingParams& p) const {
  STRATA_RETURN_IF_ERROR(CpuSupportsEmbedding(p));
  if (p.out.dim(0) > kIntMax) return absl::UnimplementedError("Embedding: more than 2^31 tokens");
  return absl::OkStatus();
}

absl::Status CudaBackend::Embedding(const EmbeddingParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchEmbedding(
      p.ids, p.table.data, ToFloatType(p.table.dtype), p.table.dim(0), p.table.dim(1),
      p.out.As<float>(), p.out.dim(0), ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Supports(const RmsNormParams& p) const {
  STRATA_RETURN_IF_ERROR(CpuSupportsRmsNorm(p));
  if (p.in.dim(0) > kIntMax) return absl::UnimplementedError("RmsNorm: more than 2^31 rows");
  return absl::OkStatus();
}

absl::Status CudaBackend::RmsNorm(const RmsNormParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchRmsNorm(
      p.in.As<float>(), p.residual.As<const float>(), p.weight.data, ToFloatType(p.weight.dtype),
      p.out.As<float>(), p.in.dim(0), p.in.dim(1), p.eps, ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Supports(const MatMulParams& p) const {
  STRATA_RETURN_IF_ERROR(CpuSupportsMatMul(p));
  if (p.in.dim(0) > kIntMax || p.in.dim(1) > kIntMax || p.weight.dim(0) > kIntMax) {
    return absl::UnimplementedError("MatMul: a dimension exceeds 2^31 - 1 (cuBLAS int sizes)");
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::MatMul(const MatMulParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const cudaStream_t stream = ToCuda(s);
  const FloatType wt = ToFloatType(p.weight.dtype);
  const int64_t n = p.in.dim(0), k = p.in.dim(1), m = p.weight.dim(0);
  const bool round = p.precision == MatMulPrecision::kRoundActivations;
  const int64_t scratch_bytes = cuda_internal::MatMulScratchBytes(
      wt, n, k, m, round, p.weight.data, p.in.As<const float>());
  void* scratch = nullptr;
  if (scratch_bytes > 0 && k > 0) {
    STRATA_ASSIGN_OR_RETURN(scratch, AllocScratch(scratch_bytes, stream));
  }
  STRATA_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas_, stream));
  const cuda_internal::GpuResult r = cuda_internal::LaunchMatMul(
      blas_, p.in.As<const float>(), p.weight.data, wt, p.bias.data, ToFloatType(p.bias.dtype),
      p.out.As<float>(), n, k, m, scratch, stream, round, p.weight_scale.As<const float>());
  if (scratch != nullptr) STRATA_RETURN_IF_ERROR(FreeScratch(scratch, stream));
  if (r.cuda != cudaSuccess) {
    return cuda_internal::CudaErrorToStatus(r.cuda, "LaunchMatMul", r.file, r.line);
  }
  if (r.blas != CUBLAS_STATUS_SUCCESS) {
    return cuda_internal::CublasErrorToStatus(r.blas, "cublasGemmEx", r.file, r.line);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Supports(const RopeParams& p) const { return CpuSupportsRope(p); }

absl::Status CudaBackend::Rope(const RopeParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchRope(
      p.x.As<float>(), p.positions, p.inv_freq.As<const float>(), p.attention_factor, p.x.dim(0),
      p.x.dim(1), p.x.dim(2), ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Supports(const SwiGluParams& p) const { return CpuSupportsSwiGlu(p); }

absl::Status CudaBackend::SwiGlu(const SwiGluParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchSwiGlu(
      p.gate.As<const float>(), p.up.As<const float>(), p.out.As<float>(), p.gate.NumElements(),
      ToCuda(s)));
  return absl::OkStatus();
}

absl::Status CudaBackend::Supports(const AddParams& p) const { return CpuSupportsAdd(p); }

absl::Status CudaBackend::Add(const AddParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchAdd(p.a.As<const float>(),
                                                       p.b.As<const float>(), p.out.As<float>(),
                                                       p.a.NumElements(), p.a_scale, p.b_scale,
                                                       ToCuda(s)));
  return absl::OkStatus();
}

// ---- Attention -------------------------------------------------------------------------------

absl::Status CudaBackend::Supports(const PagedAttentionParams& p) const {
  return CheckPagedAttentionShape(p);
}

absl::Status CudaBackend::PagedAttention(const PagedAttentionParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CheckPagedAttentionShape(p));
  STRATA_RETURN_IF_ERROR(CheckSpans(p));
  const int num_tokens = static_cast<int>(p.q.dim(0));
  const int num_q_heads = static_cast<int>(p.q.dim(1));
  if (num_tokens == 0 || num_q_heads == 0) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const cudaStream_t stream = ToCuda(s);

  AttentionShape shape;
  shape.num_tokens = num_tokens;
  shape.num_q_heads = num_q_heads;
  shape.num_kv_heads = p.num_kv_heads;
  shape.head_dim = static_cast<int>(p.q.dim(2));
  shape.num_slots = p.k_pool.dim(0);
  shape.page_size = p.k_pool.dim(1);
  shape.causal = p.causal;
  shape.scale = p.scale * p.k_scale;  // k_scale, v_scale: 1 unless the pools are fp8
  shape.v_scale = p.v_scale;
  const bool aligned = reinterpret_cast<uintptr_t>(p.k_pool.data) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.v_pool.data) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.q.data) % 16 == 0;
  const FloatType pool_dtype = ToFloatType(p.k_pool.dtype);
  // Tensor-core flash kernel for several tokens (or one, when forced); see SetPrefillPath.
  const bool flash = aligned && prefill_path_ != PrefillPath::kGeneral &&
                     (num_tokens > 1 || prefill_path_ == PrefillPath::kFlash) &&
                     cuda_internal::FlashPrefillSupports(shape, pool_dtype);
  const bool decode_ok = aligned && !flash && cuda_internal::DecodeFastPathSupports(shape);
  BuildPlan(p, decode_ok, num_sms_,
            decode_items_per_sm_ > 0 ? decode_items_per_sm_ : cuda_internal::kDecodeItemsPerSm,
            plan_cache_.get());
  const HostPlan& host = plan_cache_->plan;
  int64_t max_head_tokens = 0;
  for (int32_t n : plan_cache_->head_tokens) max_head_tokens = std::max<int64_t>(max_head_tokens, n);

  // Device scratch: the plan, then (decode) the split-K partials or (flash) the tile metadata.
  const size_t plan_bytes = RoundUp(host.words.size() * sizeof(int32_t), 256);
  const size_t partial_bytes =
      host.decode ? cuda_internal::DecodeScratchFloats(shape, host.num_items) * sizeof(float)
      : flash     ? cuda_internal::FlashPrefillScratchBytes(shape, max_head_tokens)
                  : 0;
  STRATA_ASSIGN_OR_RETURN(void* scratch, AllocScratch(plan_bytes + partial_bytes, stream));
  auto launch = [&]() -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(const int ring, PinnedStaging(host.words.size() * sizeof(int32_t)));
    Pinned& staging = pinned_[ring];
    std::memcpy(staging.data, host.words.data(), host.words.size() * sizeof(int32_t));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scratch, staging.data,
                                                host.words.size() * sizeof(int32_t),
                                                cudaMemcpyHostToDevice, stream));
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(staging.copied, stream));
    staging.pending = true;

    const int32_t* words = static_cast<const int32_t*>(scratch);
    AttentionPlan plan;
    plan.spans = reinterpret_cast<const DeviceSpan*>(words + host.spans);
    plan.span_start = words + host.span_start;
    plan.span_offsets = words + host.span_offsets;
    plan.head_tokens = words + host.head_tokens;
    plan.q_positions = words + host.q_positions;
    plan.items = reinterpret_cast<const DecodeWorkItem*>(words + host.items);
    plan.item_offsets = words + host.item_offsets;
    plan.num_items = host.num_items;
    const FloatType pool_type = ToFloatType(p.k_pool.dtype);
    if (host.decode) {
      float* partials = reinterpret_cast<float*>(static_cast<char*>(scratch) + plan_bytes);
      STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchPagedAttentionDecode(
          p.q.As<const float>(), p.k_pool.data, p.v_pool.data, pool_type, shape, plan, partials,
          p.out.As<float>(), p.lse.As<float>(), stream));
    } else if (flash) {
      STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchFlashPrefill(
          p.q.As<const float>(), p.k_pool.data, p.v_pool.data, pool_type, shape, plan,
          max_head_tokens, static_cast<char*>(scratch) + plan_bytes, p.out.As<float>(),
          p.lse.As<float>(), stream));
    } else {
      STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchPagedAttentionGeneral(
          p.q.As<const float>(), p.k_pool.data, p.v_pool.data, pool_type, shape, plan,
          p.out.As<float>(), p.lse.As<float>(), stream));
    }
    return absl::OkStatus();
  };
  const absl::Status st = launch();
  const absl::Status freed = FreeScratch(scratch, stream);
  STRATA_RETURN_IF_ERROR(st);
  return freed;
}

absl::Status CudaBackend::Supports(const MergeAttentionParams& p) const { return CheckMerge(p); }

absl::Status CudaBackend::MergeAttention(const MergeAttentionParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CheckMerge(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  cuda_internal::MergeParts parts;
  std::memset(&parts, 0, sizeof(parts));
  parts.num_parts = p.num_parts;
  for (int i = 0; i < p.num_parts; ++i) {
    parts.outs[i] = p.outs[i].As<const float>();
    parts.lses[i] = p.lses[i].As<const float>();
  }
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchMergeAttention(
      parts, p.out.dim(0) * p.out.dim(1), p.out.dim(2), p.out.As<float>(), p.lse.As<float>(),
      ToCuda(s)));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend, CudaBackend::Create(device));
  return std::unique_ptr<Backend>(std::move(backend));
}

// ---- PageCopy (GPU page cache fills) -------------------------------------------------------

namespace {

// The page sources of a PageCopy: the staging buffer, or (sources set) the array and every page it
// names must be mapped host memory whose device address is its host address (true of
// cudaHostAlloc memory under unified addressing), because the kernel reads sources[i] as is.
// Returns whether every page address is 16-byte aligned.
absl::StatusOr<bool> CheckPageSources(const PageCopyParams& p) {
  if (p.sources == nullptr) {
    STRATA_RETURN_IF_ERROR(MappedHostPointer(p.staging, "staging").status());
    return true;
  }
  STRATA_RETURN_IF_ERROR(MappedHostPointer(p.sources, "sources").status());
  bool aligned = true;
  for (int i = 0; i < p.num_pages; ++i) {
    aligned = aligned && (reinterpret_cast<uintptr_t>(p.sources[i]) & 15) == 0;
    if (InIdentityMappedHostBuffer(p.sources[i])) continue;  // a live AllocateHost buffer
    STRATA_ASSIGN_OR_RETURN(const void* dev, MappedHostPointer(p.sources[i], "sources[i]"));
    if (dev != p.sources[i]) {
      return absl::InvalidArgumentError(
          "PageCopy: sources[i] has a device address other than its host address");
    }
  }
  return aligned;
}

}  // namespace

absl::Status CudaBackend::Supports(const PageCopyParams& p) const {
  STRATA_RETURN_IF_ERROR(CpuSupportsPageCopy(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  if (p.num_pages > 0) {
    STRATA_RETURN_IF_ERROR(CheckPageSources(p).status());
    STRATA_RETURN_IF_ERROR(MappedHostPointer(p.slots, "slots").status());
  }
  if (p.num_table_updates > 0) {
    STRATA_RETURN_IF_ERROR(MappedHostPointer(p.table_index, "table_index").status());
    STRATA_RETURN_IF_ERROR(MappedHostPointer(p.table_value, "table_value").status());
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::PageCopy(const PageCopyParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsPageCopy(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  cuda_internal::PageCopyArgs a;
  if (p.num_pages > 0) {
    STRATA_ASSIGN_OR_RETURN(a.sources_aligned, CheckPageSources(p));
    if (p.sources != nullptr) {
      STRATA_ASSIGN_OR_RETURN(const void* sources, MappedHostPointer(p.sources, "sources"));
      a.sources = static_cast<const void* const*>(sources);
    } else {
      STRATA_ASSIGN_OR_RETURN(a.staging, MappedHostPointer(p.staging, "staging"));
    }
    STRATA_ASSIGN_OR_RETURN(const void* slots, MappedHostPointer(p.slots, "slots"));
    a.slots = static_cast<const int32_t*>(slots);
    a.num_pages = p.num_pages;
    a.k_pool = p.k_pool.data;
    a.v_pool = p.v_pool.data;
    a.half_bytes = p.k_pool.dim(1) * p.k_pool.dim(2) * static_cast<int64_t>(DTypeSize(p.k_pool.dtype));
  }
  if (p.num_table_updates > 0) {
    STRATA_ASSIGN_OR_RETURN(const void* index, MappedHostPointer(p.table_index, "table_index"));
    STRATA_ASSIGN_OR_RETURN(const void* value, MappedHostPointer(p.table_value, "table_value"));
    a.table = p.table;
    a.table_index = static_cast<const int32_t*>(index);
    a.table_value = static_cast<const int32_t*>(value);
    a.num_table_updates = p.num_table_updates;
  }
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchPageCopy(a, ToCuda(s)));
  return absl::OkStatus();
}

// ---- AppendKv (KV cache appends) -------------------------------------------------------------

absl::Status CudaBackend::AppendKv(const AppendKvParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsAppendKv(p));  // shapes, dtypes, scales, slots
  const int64_t n = p.k.dim(0), heads = p.k.dim(1), d = p.k.dim(2), page = p.k_pool.dim(1);
  cuda_internal::RopeArgs rope;
  if (p.rope.inv_freq.data != nullptr) {
    rope.inv_freq = p.rope.inv_freq.As<const float>();
    rope.positions = p.rope.positions;
    rope.factor = p.rope.attention_factor;
    if (p.rope.x.data != nullptr) {
      rope.q = p.rope.x.As<float>();
      rope.q_heads = p.rope.x.dim(1);
      rope.q_pairs = p.rope.x.dim(0) * p.rope.x.dim(1) * (d / 2);
    }
  }
  if ((n == 0 || heads == 0 || d == 0) && rope.q_pairs == 0) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchAppendKv(
      p.k.As<const float>(), p.v.As<const float>(), p.k_pool.data, p.v_pool.data,
      ToFloatType(p.k_pool.dtype), n, heads, d, page, p.first, p.slots_per_head, ToCuda(s),
      p.first_device, p.k_scale, p.v_scale, rope));
  return absl::OkStatus();
}

absl::Status CudaBackend::EncodeFp8Pages(const EncodeFp8PagesParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsEncodeFp8Pages(p));  // shapes, dtypes, slots
  const int64_t page = p.k_pool.dim(1), d = p.k_pool.dim(2);
  if (static_cast<int64_t>(p.num_heads) * p.count == 0) return absl::OkStatus();
  if (d > 1024) return absl::UnimplementedError("EncodeFp8Pages: head_dim above 1024");
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchEncodeFp8Pages(
      p.k_pool.As<const uint16_t>(), p.v_pool.As<const uint16_t>(), page, d, p.first_slot, p.head_slot_stride,
      p.num_heads, p.count, p.last_valid, p.codes.As<uint8_t>(), p.scales.As<float>(), p.summaries.As<float>(),
      ToCuda(s)));
  return absl::OkStatus();
}

// ---- Graph capture ---------------------------------------------------------------------------

namespace {

class CudaGraph : public Graph {
 public:
  CudaGraph(cudaGraph_t graph, cudaGraphExec_t exec, CudaBackend* backend)
      : graph_(graph), exec_(exec), backend_(backend) {}
  ~CudaGraph() override {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  absl::Status Replay(Stream s) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, backend_->ToCudaStream(s)));
    return absl::OkStatus();
  }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  CudaBackend* backend_;
};

}  // namespace

namespace {
// BeginCapture(nullptr)'s private stream, standing in for its backend's own stream in this thread.
thread_local const CudaBackend* capture_owner = nullptr;
thread_local cudaStream_t capture_stream = nullptr;
}  // namespace

cudaStream_t CudaBackend::ToCuda(Stream s) const {
  if (s != nullptr) return static_cast<cudaStream_t>(s);
  return capture_owner == this ? capture_stream : stream_;
}

absl::Status CudaBackend::BeginCapture(Stream s) {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  if (s != nullptr || capture_owner != nullptr) {
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaStreamBeginCapture(ToCuda(s), cudaStreamCaptureModeThreadLocal));
    return absl::OkStatus();
  }
  cudaStream_t cs = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithPriority(&cs, cudaStreamNonBlocking, main_priority_));
  const cudaError_t e = cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    cudaStreamDestroy(cs);
    STRATA_CUDA_RETURN_IF_ERROR(e);
  }
  capture_owner = this;
  capture_stream = cs;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Graph>> CudaBackend::EndCapture(Stream s) {
  cudaGraph_t graph = nullptr;
  const cudaStream_t cs = ToCuda(s);
  const cudaError_t e = cudaStreamEndCapture(cs, &graph);
  if (s == nullptr && capture_owner == this) {
    capture_owner = nullptr;
    capture_stream = nullptr;
    cudaStreamDestroy(cs);  // nothing was queued on it to run
  }
  if (e != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();  // the capture's failure is reported here; clear it
    return absl::InternalError(absl::StrCat("EndCapture: ", cudaGetErrorString(e)));
  }
  cudaGraphExec_t exec = nullptr;
  // Each node keeps the priority of the stream it was captured on (ForkStream's branches).
  const cudaError_t ie =
      cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
  if (ie != cudaSuccess) {
    cudaGraphDestroy(graph);
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaGraphInstantiate: ", cudaGetErrorString(ie)));
  }
  return std::unique_ptr<Graph>(new CudaGraph(graph, exec, this));
}

// ---- Forked streams ----------------------------------------------------------------------------

absl::StatusOr<Stream> CudaBackend::ForkStream(Stream s) {
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  if (fork_event_ == nullptr) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming));
  }
  if (side_free_.empty()) {
    cudaStream_t side = nullptr;
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, side_priority_));
    side_streams_.push_back(side);
    side_free_.push_back(side);
  }
  cudaStream_t side = side_free_.back();
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_event_, ToCuda(s)));
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, fork_event_, 0));
  side_free_.pop_back();
  return static_cast<Stream>(side);
}

absl::Status CudaBackend::JoinStream(Stream side, Stream s) {
  cudaStream_t cs = static_cast<cudaStream_t>(side);
  if (std::find(side_streams_.begin(), side_streams_.end(), cs) == side_streams_.end() ||
      std::find(side_free_.begin(), side_free_.end(), cs) != side_free_.end()) {
    return absl::InvalidArgumentError("JoinStream: not a stream forked by this backend");
  }
  side_free_.push_back(cs);  // joined even if the calls below fail: the fork is over
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_event_, cs));
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ToCuda(s), fork_event_, 0));
  return absl::OkStatus();
}

}  // namespace strata::kernels
