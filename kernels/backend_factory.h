// Chooses and creates the compute backend once at process start.
//
// The CUDA backend is a plugin, libstrata_cuda.so (kernels/cuda/plugin.cc), loaded with dlopen
// only when a CUDA backend is asked for. Keeping cuBLAS out of the process image matters: loaded
// at startup, cuBLAS 13's static TLS makes glibc refuse threads with small stacks, and
// prometheus-cpp's civetweb threads are such threads (the /metrics endpoint would not start).
// Loaded with dlopen, its TLS is allocated dynamically and the problem does not arise. It also
// lets one `strata` binary run on machines without CUDA libraries (coordinator, KV store).
//
// Thread-safety: MakeBackend may be called from any thread.
#ifndef STRATA_KERNELS_BACKEND_FACTORY_H_
#define STRATA_KERNELS_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace strata::kernels {

enum class BackendKind {
  kAuto,  // CUDA when the plugin loads and a GPU is present, else CPU
  kCpu,
  kCuda,
};

// "auto", "cpu", "cuda". InvalidArgument otherwise.
absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name);

struct BackendOptions {
  BackendKind kind = BackendKind::kAuto;
  // CUDA device index. Default: 0.
  int device = 0;
  // CPU threads; <= 0 = all cores. Default: 0.
  int cpu_threads = 0;
  // Path of libstrata_cuda.so. Empty: $STRATA_CUDA_PLUGIN, then the directory of the running
  // executable, then its ../lib. Default: empty.
  std::string cuda_plugin;
};

// Creates the backend. kCuda: Unavailable when the plugin cannot be loaded or no GPU is present
// (the message says which). kAuto never fails for lack of CUDA; `why_not_cuda`, when non-null,
// receives the reason CUDA was not used (empty when it was).
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options,
                                                     std::string* why_not_cuda = nullptr);

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_BACKEND_FACTORY_H_
