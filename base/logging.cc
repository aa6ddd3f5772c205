#include "base/logging.h"

#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace strata {
namespace {

LogSeverity LevelFromEnv() {
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  if (env == nullptr) return LogSeverity::kInfo;
  if (std::strcmp(env, "WARNING") == 0) return LogSeverity::kWarning;
  if (std::strcmp(env, "ERROR") == 0) return LogSeverity::kError;
  return LogSeverity::kInfo;
}

std::atomic<int>& MinLevel() {
  static std::atomic<int> level{static_cast<int>(LevelFromEnv())};
  return level;
}

}  // namespace

void SetMinLogLevel(LogSeverity level) { MinLevel().store(static_cast<int>(level)); }
LogSeverity MinLogLevel() { return static_cast<LogSeverity>(MinLevel().load()); }

namespace internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity) : severity_(severity) {
  static const char kLetters[] = {'I', 'W', 'E', 'F'};
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm;
  localtime_r(&tv.tv_sec, &tm);
  const char* base = std::strrchr(file, '/');
  char prefix[96];
  std::snprintf(prefix, sizeof(prefix), "%c%02d%02d %02d:%02d:%02d.%06ld %s:%d] ",
                kLetters[static_cast<int>(severity)], tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                tm.tm_min, tm.tm_sec, static_cast<long>(tv.tv_usec), base ? base + 1 : file, line);
  stream_ << prefix;
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string line = stream_.str();
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace internal
}  // namespace strata
