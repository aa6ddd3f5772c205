// libstrata_cuda.so: the CUDA backend as a dlopen plugin (see kernels/backend_factory.h for why).
// One C entry point; the Backend object it returns is owned by the caller and deleted through its
// virtual destructor, which lives in this library.
#include <cstdio>
#include <cstring>

#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

extern "C" __attribute__((visibility("default"))) int StrataCreateCudaBackend(
    int device, strata::kernels::Backend** out, char* error, size_t error_len) {
  *out = nullptr;
  absl::StatusOr<std::unique_ptr<strata::kernels::Backend>> backend =
      strata::kernels::MakeCudaBackend(device);
  if (!backend.ok()) {
    if (error != nullptr && error_len > 0) {
      std::snprintf(error, error_len, "%s", std::string(backend.status().message()).c_str());
    }
    return static_cast<int>(backend.status().code());
  }
  *out = backend->release();
  return 0;
}
