// Test helper: runs `strata kvstore` as a child process on 127.0.0.1 with a free port, and a
// temporary directory that is removed afterwards. The child is always killed and waited for (the
// destructor sends SIGKILL if it still runs). Thread-compatible.
#ifndef STRATA_TESTS_KVSTORE_KVSTORE_PROCESS_H_
#define STRATA_TESTS_KVSTORE_KVSTORE_PROCESS_H_

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"

namespace strata::tests {

// A temporary directory, removed (recursively) by the destructor unless STRATA_TEST_KEEP_TMP is
// set in the environment (then its path is printed, for debugging).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class KvstoreProcess {
 public:
  KvstoreProcess() = default;
  ~KvstoreProcess();  // Kill(SIGKILL) when still running

  // Starts `strata kvstore --data <data_dir>` and waits (up to 20 s) until it serves.
  absl::Status Start(const std::string& data_dir, const std::string& extra_flags = "");
  // Sends `signal` and waits for the exit. Returns the exit status as waitpid reports it.
  int Stop(int signal);
  bool running() const { return pid_ > 0; }
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string log_path() const { return log_path_; }
  // The last `max_bytes` of the child's stdout/stderr (for failure messages).
  std::string LogTail(size_t max_bytes = 4000) const;

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
  std::string log_path_;
};

// True when `status` (from waitpid) is a normal exit with code 0.
bool ExitedCleanly(int status);

}  // namespace strata::tests

#endif  // STRATA_TESTS_KVSTORE_KVSTORE_PROCESS_H_
