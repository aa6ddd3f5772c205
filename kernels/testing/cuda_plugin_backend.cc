#include "kernels/testing/cuda_plugin_backend.h"

#include <cstdlib>

#include "kernels/backend_factory.h"

namespace strata::kernels::testing {

std::unique_ptr<Backend> CudaPluginBackendOrNull(const char* default_plugin, std::string* why, int device) {
  BackendOptions options;
  options.kind = BackendKind::kCuda;
  options.device = device;
  const char* env = std::getenv("STRATA_CUDA_PLUGIN");
  options.cuda_plugin = env != nullptr && *env != '\0' ? env : default_plugin;
  absl::StatusOr<std::unique_ptr<Backend>> b = MakeBackend(options);
  if (!b.ok()) {
    *why = b.status().ToString();
    return nullptr;
  }
  return std::move(b).value();
}

}  // namespace strata::kernels::testing
