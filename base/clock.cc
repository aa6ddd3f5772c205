#include "base/clock.h"

#include <time.h>

#include "absl/strings/str_cat.h"

namespace strata {

absl::Status ValidateTtlSeconds(int64_t ttl_seconds) {
  if (ttl_seconds >= 0 && ttl_seconds <= kMaxTtlSeconds) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("ttl_seconds = ", ttl_seconds, " is outside [0, ",
                                                 kMaxTtlSeconds, "] (100 years)"));
}

int64_t MonotonicNanos() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

int64_t WallMicros() {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000LL + ts.tv_nsec / 1000;
}

}  // namespace strata
