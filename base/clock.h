// Monotonic and wall clocks, and a stopwatch. Thread-safe (stateless functions).
#ifndef STRATA_BASE_CLOCK_H_
#define STRATA_BASE_CLOCK_H_

#include <cstdint>

#include "absl/status/status.h"

namespace strata {

// Monotonic time in nanoseconds since an arbitrary epoch (CLOCK_MONOTONIC).
int64_t MonotonicNanos();
// Wall-clock time in microseconds since the Unix epoch (CLOCK_REALTIME).
int64_t WallMicros();

// The longest time to live a request may give a document: 100 years, so that now + ttl in
// microseconds stays far inside int64. The services refuse longer ones (INVALID_ARGUMENT).
inline constexpr int64_t kMaxTtlSeconds = int64_t{100} * 365 * 86400;
// OK for a time to live in [0, kMaxTtlSeconds]; INVALID_ARGUMENT naming ttl_seconds otherwise.
absl::Status ValidateTtlSeconds(int64_t ttl_seconds);

// Measures elapsed monotonic time from construction or the last Reset().
class Stopwatch {
 public:
  Stopwatch() : start_(MonotonicNanos()) {}
  void Reset() { start_ = MonotonicNanos(); }
  int64_t ElapsedNanos() const { return MonotonicNanos() - start_; }
  double ElapsedSeconds() const { return ElapsedNanos() * 1e-9; }

 private:
  int64_t start_;
};

}  // namespace strata

#endif  // STRATA_BASE_CLOCK_H_
