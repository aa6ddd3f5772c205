#include "kernels/backend_factory.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"

namespace strata::kernels {
namespace {

// The plugin's entry point (kernels/cuda/plugin.cc).
using CreateFn = int (*)(int device, Backend** out, char* error, size_t error_len);
constexpr char kCreateSymbol[] = "StrataCreateCudaBackend";
constexpr char kPluginName[] = "libstrata_cuda.so";

std::string ExecutableDir() {
  std::vector<char> buf(4096);
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return "";
  std::string path(buf.data(), static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

std::vector<std::string> PluginCandidates(const BackendOptions& o) {
  if (!o.cuda_plugin.empty()) return {o.cuda_plugin};
  std::vector<std::string> out;
  if (const char* env = std::getenv("STRATA_CUDA_PLUGIN"); env != nullptr && *env != '\0') {
    out.push_back(env);
  }
  const std::string dir = ExecutableDir();
  if (!dir.empty()) {
    out.push_back(absl::StrCat(dir, "/", kPluginName));
    out.push_back(absl::StrCat(dir, "/../lib/", kPluginName));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCuda(const BackendOptions& o) {
  std::string tried;
  for (const std::string& path : PluginCandidates(o)) {
    if (access(path.c_str(), R_OK) != 0) {
      absl::StrAppend(&tried, tried.empty() ? "" : ", ", path, " (absent)");
      continue;
    }
    // Loaded once and never unloaded: backends made by it may live until process exit.
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      absl::StrAppend(&tried, tried.empty() ? "" : ", ", path, " (", dlerror(), ")");
      continue;
    }
    auto create = reinterpret_cast<CreateFn>(dlsym(handle, kCreateSymbol));
    if (create == nullptr) {
      return absl::UnavailableError(absl::StrCat(path, " has no ", kCreateSymbol));
    }
    Backend* backend = nullptr;
    char error[512] = {0};
    const int code = create(o.device, &backend, error, sizeof(error));
    if (code != 0 || backend == nullptr) {
      return absl::Status(static_cast<absl::StatusCode>(code == 0 ? 14 : code),
                          absl::StrCat("CUDA backend: ", error));
    }
    return std::unique_ptr<Backend>(backend);
  }
  return absl::UnavailableError(absl::StrCat("CUDA plugin ", kPluginName, " not loadable: ",
                                             tried.empty() ? "no candidate path" : tried));
}

}  // namespace

absl::StatusOr<BackendKind> ParseBackendKind(absl::string_view name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", std::string(name), "' (auto, cpu, cuda)"));
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options,
                                                     std::string* why_not_cuda) {
  if (why_not_cuda != nullptr) why_not_cuda->clear();
  switch (options.kind) {
    case BackendKind::kCpu:
      if (why_not_cuda != nullptr) *why_not_cuda = "cpu backend requested";
      return MakeCpuBackend(options.cpu_threads);
    case BackendKind::kCuda:
      return MakeCuda(options);
    case BackendKind::kAuto: {
      absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCuda(options);
      if (cuda.ok()) return cuda;
      if (why_not_cuda != nullptr) *why_not_cuda = std::string(cuda.status().message());
      return MakeCpuBackend(options.cpu_threads);
    }
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

}  // namespace strata::kernels
