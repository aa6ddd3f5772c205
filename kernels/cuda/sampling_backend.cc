// CudaBackend::Sample (declared in kernels/cuda/cuda_backend.h): the CPU twin's validation
// (kernels/cpu/sampling.cc), this backend's limits, scratch from the stream-ordered pool, then the
// launches of kernels/cuda/sampling.cu. Nothing reads device memory on the host, so the op can be
// captured in a CUDA graph.
#include <cstddef>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/cuda_status.h"
#include "kernels/cuda/internal/sampling.h"

namespace strata::kernels {

using cuda_internal::DeviceSampleRow;
static_assert(sizeof(SampleRow) == sizeof(DeviceSampleRow));
static_assert(offsetof(SampleRow, temperature) == offsetof(DeviceSampleRow, temperature));
static_assert(offsetof(SampleRow, top_p) == offsetof(DeviceSampleRow, top_p));
static_assert(offsetof(SampleRow, u) == offsetof(DeviceSampleRow, u));
static_assert(offsetof(SampleRow, top_k) == offsetof(DeviceSampleRow, top_k));

absl::Status CudaBackend::Supports(const SampleParams& p) const {
  STRATA_RETURN_IF_ERROR(CpuSupportsSample(p));
  if (p.logits.dim(0) > 65535) return absl::UnimplementedError("Sample: > 65535 rows");
  return absl::OkStatus();
}

absl::Status CudaBackend::Sample(const SampleParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(Supports(p));
  const int rows = static_cast<int>(p.logits.dim(0));
  const int vocab = static_cast<int>(p.logits.dim(1));
  if (rows == 0) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const cudaStream_t stream = ToCuda(s);
  STRATA_ASSIGN_OR_RETURN(void* scratch,
                          AllocScratch(cuda_internal::SampleScratchBytes(rows, vocab), stream));
  const cudaError_t e = cuda_internal::LaunchSample(
      p.logits.As<const float>(), rows, vocab, reinterpret_cast<const DeviceSampleRow*>(p.rows),
      p.tokens.As<int32_t>(), scratch, stream);
  STRATA_RETURN_IF_ERROR(FreeScratch(scratch, stream));
  STRATA_CUDA_RETURN_IF_ERROR(e);
  return absl::OkStatus();
}

}  // namespace strata::kernels
