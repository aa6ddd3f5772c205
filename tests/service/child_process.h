// Test helper for the multi-process service tests: a child process (fork + execv) whose stdout and
// stderr go to files, plus the small loopback helpers those tests share (HTTP GET, a free port,
// one Prometheus series value).
//
// Contract of ChildProcess: the constructor forks and execs `args[0]` with `args` (no PATH search;
// exit code 127 when exec fails); every wait is bounded by the timeout it is given (polling every
// 20 ms); the destructor sends SIGKILL to a child that has not been reaped yet and waits for it,
// so no process outlives the object (and the test). Thread-compatible; not copyable.
#ifndef STRATA_TESTS_SERVICE_CHILD_PROCESS_H_
#define STRATA_TESTS_SERVICE_CHILD_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace strata::tests {

// The whole content of a file ("" when it cannot be read).
std::string ReadFileOrEmpty(const std::string& path);

class ChildProcess {
 public:
  // Starts `args` with stdout truncated into `out_path` and stderr into `err_path`. When the two
  // paths are equal, the file is opened once and both streams share it (one log).
  ChildProcess(std::vector<std::string> args, const std::string& out_path, const std::string& err_path);
  ~ChildProcess();  // SIGKILL + waitpid when the child was not reaped yet
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Reaps the child without blocking; true once it has exited (the code is then kept).
  bool Exited();
  // Waits up to `timeout` for the exit; the exit code (128 + signal when killed by a signal), or
  // nullopt on timeout (the child is left running; the destructor kills it).
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  // Sends `sig`, then Wait(timeout).
  std::optional<int> StopWith(int sig, std::chrono::milliseconds timeout);
  // Waits up to `timeout` until `port_file` holds "<grpc_port> <metrics_port>" with a grpc port
  // > 0, and stores them. When `metrics_port` is null only the first number is read. False when
  // the child exited or time ran out.
  bool WaitForPorts(const std::string& port_file, std::chrono::milliseconds timeout, int* grpc_port,
                    int* metrics_port);

  std::string Out() const { return ReadFileOrEmpty(out_path_); }
  std::string Err() const { return ReadFileOrEmpty(err_path_); }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  int code_ = -1;
  std::string out_path_;
  std::string err_path_;
};

// GET http://127.0.0.1:port/path with HTTP/1.0 (5 s send/receive timeouts); the whole response
// (headers and body), or "" on failure.
std::string HttpGet(int port, const std::string& path);

// A 127.0.0.1 TCP port that was free a moment ago (0 on failure). For servers that cannot bind
// port 0 (prometheus-cpp's civetweb) or must get the same port again after a restart.
int FreePort();

// Value of the Prometheus exposition line that starts with `series` followed by a space (0 when
// absent or unparsable).
double Metric(const std::string& text, const std::string& series);

}  // namespace strata::tests

#endif  // STRATA_TESTS_SERVICE_CHILD_PROCESS_H_
