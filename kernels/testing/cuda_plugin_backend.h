// The CUDA backend for tests, loaded as the plugin (kernels/backend_factory.h): the library named
// by STRATA_CUDA_PLUGIN (how the GPU machine's bundle points at its copy) or else
// `default_plugin` (the build's libstrata_cuda.so).
#ifndef STRATA_KERNELS_TESTING_CUDA_PLUGIN_BACKEND_H_
#define STRATA_KERNELS_TESTING_CUDA_PLUGIN_BACKEND_H_

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace strata::kernels::testing {

// nullptr, with the reason in *why, when there is no GPU (or no GPU `device`) or the plugin does
// not load.
std::unique_ptr<Backend> CudaPluginBackendOrNull(const char* default_plugin, std::string* why, int device = 0);

}  // namespace strata::kernels::testing

#endif  // STRATA_KERNELS_TESTING_CUDA_PLUGIN_BACKEND_H_
