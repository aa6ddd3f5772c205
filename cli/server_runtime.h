// Pieces shared by the server commands (`strata coordinator`, `kvstore`, `worker`, `serve`):
// backend choice, port files, the stop signals. Not thread-safe beyond what each function says.
#ifndef STRATA_CLI_SERVER_RUNTIME_H_
#define STRATA_CLI_SERVER_RUNTIME_H_

#include <csignal>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace strata::cli {

// The CUDA backend on device 0 when the plugin libstrata_cuda.so loads and a GPU is present, else
// the CPU backend (`threads` CPU threads; 0 = all cores). Logs the choice.
std::unique_ptr<kernels::Backend> MakeWorkerBackend(int threads);

// Writes `line` to `path` atomically (temp file + rename). Internal on failure.
absl::Status WriteLineFile(const std::string& path, const std::string& line);
// The --port-file of every server: "<grpc_port> <metrics_port>\n", written atomically.
absl::Status WritePortFile(const std::string& path, int grpc_port, int metrics_port);

// Blocks SIGINT and SIGTERM in this thread and every thread started after it; returns the set to
// sigwait on.
sigset_t BlockStopSignals();

}  // namespace strata::cli

#endif  // STRATA_CLI_SERVER_RUNTIME_H_
