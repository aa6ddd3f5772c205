#include "cli/server_runtime.h"

#include <pthread.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "kernels/backend_factory.h"

namespace strata::cli {

std::unique_ptr<kernels::Backend> MakeWorkerBackend(int threads) {
  kernels::BackendOptions options;
  options.kind = kernels::BackendKind::kAuto;
  options.cpu_threads = threads;
  std::string why_not_cuda;
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::MakeBackend(options, &why_not_cuda);
  if (!backend.ok()) {  // kAuto only fails if even the CPU backend cannot be made
    STRATA_LOG(ERROR) << "backend: " << backend.status() << "; using cpu";
    return kernels::MakeCpuBackend(threads);
  }
  if (why_not_cuda.empty()) {
    STRATA_LOG(INFO) << "backend: " << (*backend)->Name();
  } else {
    STRATA_LOG(INFO) << "backend: cpu (" << why_not_cuda << ")";
  }
  return *std::move(backend);
}

absl::Status WriteLineFile(const std::string& path, const std::string& line) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  std::fprintf(f, "%s\n", line.c_str());
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port) {
  return WriteLineFile(path, absl::StrCat(grpc_port, " ", metrics_port));
}

sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

}  // namespace strata::cli
