// CUDA / cuBLAS error codes to absl::Status.
#include "kernels/cuda/internal/cuda_status.h"

#include <cublas_v2.h>

#include "absl/strings/str_cat.h"

namespace strata::kernels::cuda_internal {

absl::Status CudaErrorToStatus(cudaError_t e, const char* expr, const char* file, int line) {
  // Reset the runtime's last-error state, so that a failed call that did not break the context
  // (e.g. an oversized cudaMalloc) is not reported again by the next launch check. Sticky errors
  // (a faulted kernel) persist regardless.
  cudaGetLastError();
  const std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                       cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorSystemNotReady:
    case cudaErrorInitializationError:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CublasErrorToStatus(cublasStatus_t e, const char* expr, const char* file, int line) {
  const std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                       cublasGetStatusName(e), " (", cublasGetStatusString(e), ")");
  switch (e) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(msg);
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace strata::kernels::cuda_internal
