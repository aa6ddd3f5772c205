// Minimal leveled logging and invariant checks (Abseil 20220623 has no absl/log).
//
//   STRATA_LOG(INFO) << "loaded " << n << " tensors";
//   STRATA_CHECK(ptr != nullptr) << "why";   // aborts: only for broken invariants, never request data
//   STRATA_DCHECK(i < n);                     // compiled out in NDEBUG builds
//
// Lines go to stderr as "I1122 11:35:00.123456 file.cc:42] message". Thread-safe: each line is
// written with one write(2). The minimum level comes from STRATA_LOG_LEVEL (INFO|WARNING|ERROR)
// or SetMinLogLevel().
#ifndef STRATA_BASE_LOGGING_H_
#define STRATA_BASE_LOGGING_H_

#include <sstream>

namespace strata {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

void SetMinLogLevel(LogSeverity level);
LogSeverity MinLogLevel();

namespace internal {

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  ~LogMessage();  // writes the line; aborts for kFatal
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Swallows the stream when the level is disabled.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace strata

#define STRATA_LOG_SEVERITY_INFO ::strata::LogSeverity::kInfo
#define STRATA_LOG_SEVERITY_WARNING ::strata::LogSeverity::kWarning
#define STRATA_LOG_SEVERITY_ERROR ::strata::LogSeverity::kError
#define STRATA_LOG_SEVERITY_FATAL ::strata::LogSeverity::kFatal

#define STRATA_LOG(level)                                                         \
  !(STRATA_LOG_SEVERITY_##level >= ::strata::MinLogLevel())                       \
      ? (void)0                                                                   \
      : ::strata::internal::LogVoidify() &                                        \
            ::strata::internal::LogMessage(__FILE__, __LINE__, STRATA_LOG_SEVERITY_##level).stream()

#define STRATA_CHECK(cond)                                                                 \
  (cond) ? (void)0                                                                         \
         : ::strata::internal::LogVoidify() &                                              \
               ::strata::internal::LogMessage(__FILE__, __LINE__, ::strata::LogSeverity::kFatal) \
                       .stream()                                                           \
                   << "Check failed: " #cond " "

#ifdef NDEBUG
#define STRATA_DCHECK(cond) \
  while (false) STRATA_CHECK(cond)
#else
#define STRATA_DCHECK(cond) STRATA_CHECK(cond)
#endif

#endif  // STRATA_BASE_LOGGING_H_
