#include "tests/kvstore/kvstore_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"

#ifndef STRATA_BINARY
#error "STRATA_BINARY (path of the strata executable) must be defined by CMake"
#endif

namespace strata::tests {

TempDir::TempDir() {
  char tmpl[] = "/tmp/strata_kvstore_mp.XXXXXX";
  if (mkdtemp(tmpl) != nullptr) path_ = tmpl;
}

TempDir::~TempDir() {
  if (std::getenv("STRATA_TEST_KEEP_TMP") != nullptr) {  // debugging: keep data and logs
    std::fprintf(stderr, "kept %s\n", path_.c_str());
    return;
  }
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

KvstoreProcess::~KvstoreProcess() {
  if (pid_ > 0) Stop(SIGKILL);
}

absl::Status KvstoreProcess::Start(const std::string& data_dir, const std::string& extra_flags) {
  if (pid_ > 0) return absl::FailedPreconditionError("already running");
  const std::string port_file = data_dir + ".port";
  log_path_ = data_dir + ".log";
  std::filesystem::remove(port_file);
  std::vector<std::string> args = {STRATA_BINARY,   "kvstore",          "--listen",
                                   "127.0.0.1:0",   "--data",           data_dir,
                                   "--port-file",   port_file,          "--metrics-listen",
                                   "127.0.0.1:0"};
  for (absl::string_view f : absl::StrSplit(extra_flags, ' ', absl::SkipEmpty())) {
    args.emplace_back(f);
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    const int fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  pid_ = pid;
  const int64_t deadline = MonotonicNanos() + int64_t{20} * 1000000000;
  while (MonotonicNanos() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("strata kvstore exited during start (status ",
                                              status, "); log: ", log_path_));
    }
    if (FILE* f = std::fopen(port_file.c_str(), "r")) {
      const int n = std::fscanf(f, "%d %d", &port_, &metrics_port_);
      std::fclose(f);
      if (n == 2 && port_ > 0) return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Stop(SIGKILL);
  return absl::DeadlineExceededError("strata kvstore did not start within 20 s");
}

int KvstoreProcess::Stop(int signal) {
  if (pid_ <= 0) return -1;
  kill(pid_, signal);
  int status = 0;
  // Bounded wait: escalate to SIGKILL after 15 s.
  const int64_t deadline = MonotonicNanos() + int64_t{15} * 1000000000;
  while (waitpid(pid_, &status, WNOHANG) == 0) {
    if (MonotonicNanos() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  pid_ = -1;
  return status;
}

std::string KvstoreProcess::LogTail(size_t max_bytes) const {
  FILE* f = std::fopen(log_path_.c_str(), "r");
  if (f == nullptr) return "";
  std::string content;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) content.append(buf, n);
  std::fclose(f);
  return content.size() > max_bytes ? content.substr(content.size() - max_bytes) : content;
}

bool ExitedCleanly(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

}  // namespace strata::tests
