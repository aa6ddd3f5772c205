#include "cli/worker_runtime.h"

#include <pthread.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#if defined(STRATA_HAVE_CUDA)
#include "kernels/cuda_backend.h"
#endif

namespace strata::cli {

std::unique_ptr<kernels::Backend> MakeWorkerBackend(int threads) {
#if defined(STRATA_HAVE_CUDA)
  auto cuda = kernels::MakeCudaBackend(0);
  if (cuda.ok()) {
    STRATA_LOG(INFO) << "backend: cuda (device 0)";
    return *std::move(cuda);
  }
  STRATA_LOG(INFO) << "backend: cpu (no CUDA device: " << cuda.status() << ")";
#else
  STRATA_LOG(INFO) << "backend: cpu (built without CUDA)";
#endif
  return kernels::MakeCpuBackend(threads);
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

sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

}  // namespace strata::cli
