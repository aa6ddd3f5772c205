// The CUDA backend's factory (implementation in kernels/cuda/, target strata::kernels_cuda, built
// only where nvcc is found; targets linking it see STRATA_HAVE_CUDA=1).
//
// Thread-safety: MakeCudaBackend may be called from any thread; the backend it returns follows
// the Backend contract (kernels/backend.h).
#ifndef STRATA_KERNELS_CUDA_BACKEND_H_
#define STRATA_KERNELS_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::kernels {

// A Backend on CUDA device `device` (0-based), with its own non-blocking stream (used for
// Stream == nullptr), cuBLAS handle and stream-ordered scratch memory pool.
// Unavailable: no CUDA device/driver, or `device` out of range. Internal/ResourceExhausted: the
// stream, cuBLAS handle or pool could not be created.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_CUDA_BACKEND_H_
