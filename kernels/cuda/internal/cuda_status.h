// CUDA / cuBLAS error codes to absl::Status, with the failing expression and file:line
// (private to kernels/cuda). Thread-safe (stateless).
//
//   STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(...));
//   STRATA_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
//
// Codes: cudaErrorMemoryAllocation / CUBLAS_STATUS_ALLOC_FAILED -> ResourceExhausted; no device,
// driver too old, device unavailable -> Unavailable; everything else -> Internal.
// CudaErrorToStatus also clears the runtime's last-error state (cudaGetLastError).
#ifndef STRATA_KERNELS_CUDA_INTERNAL_CUDA_STATUS_H_
#define STRATA_KERNELS_CUDA_INTERNAL_CUDA_STATUS_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace strata::kernels::cuda_internal {

absl::Status CudaErrorToStatus(cudaError_t e, const char* expr, const char* file, int line);
absl::Status CublasErrorToStatus(cublasStatus_t e, const char* expr, const char* file, int line);

}  // namespace strata::kernels::cuda_internal

#define STRATA_CUDA_RETURN_IF_ERROR(expr)                                                    \
  do {                                                                                       \
    const cudaError_t strata_cuda_err_ = (expr);                                             \
    if (strata_cuda_err_ != cudaSuccess) {                                                   \
      return ::strata::kernels::cuda_internal::CudaErrorToStatus(strata_cuda_err_, #expr,    \
                                                                 __FILE__, __LINE__);        \
    }                                                                                        \
  } while (0)

#define STRATA_CUBLAS_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                       \
    const cublasStatus_t strata_cublas_err_ = (expr);                                        \
    if (strata_cublas_err_ != CUBLAS_STATUS_SUCCESS) {                                       \
      return ::strata::kernels::cuda_internal::CublasErrorToStatus(strata_cublas_err_, #expr, \
                                                                   __FILE__, __LINE__);      \
    }                                                                                        \
  } while (0)

#endif  // STRATA_KERNELS_CUDA_INTERNAL_CUDA_STATUS_H_
