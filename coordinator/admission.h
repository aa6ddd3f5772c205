// Admission control: a pure functor over (queue, capacity snapshot) deciding whether a new job is
// accepted (STYLE.md section 1: scheduling and admission policies are pure functors).
//
// A job is refused with RESOURCE_EXHAUSTED when the queue is full (jobs or tokens), or when the
// live workers together cannot hold its context; with UNAVAILABLE while the server drains. With no
// live workers a job is admitted (it waits QUEUED until workers register) as long as the queue has
// room. Immutable after construction; thread-safe.
#ifndef STRATA_COORDINATOR_ADMISSION_H_
#define STRATA_COORDINATOR_ADMISSION_H_

#include <cstdint>

#include "absl/status/status.h"

namespace strata::coordinator {

struct AdmissionLimits {
  // Jobs not yet finished (queued or running), at most. Default: 1024.
  int64_t max_pending_jobs = 1024;
  // Context tokens (document + prompt + max_tokens) of unfinished jobs, summed, at most.
  // Bounds the work the queue can hold. Default: 64M tokens.
  int64_t max_pending_tokens = int64_t{64} << 20;

  // InvalidArgument unless both limits are positive.
  absl::Status Validate() const;
};

// The unfinished jobs, as the coordinator counts them when the request arrives.
struct QueueSnapshot {
  int64_t pending_jobs = 0;
  int64_t pending_tokens = 0;
};

// What the live workers can hold.
struct CapacitySnapshot {
  int64_t live_workers = 0;
  // Sum of the live workers' capacity_tokens.
  int64_t total_capacity_tokens = 0;
  bool draining = false;
};

// The demand of the job being admitted.
struct JobDemand {
  // Document tokens + prompt tokens + max_tokens.
  int64_t context_tokens = 0;
};

class AdmissionPolicy {
 public:
  explicit AdmissionPolicy(const AdmissionLimits& limits) : limits_(limits) {}

  // OK: admit. UNAVAILABLE while draining. RESOURCE_EXHAUSTED (message says which limit) when
  // the queue is full in jobs or tokens, or when live workers exist and the job's context exceeds
  // their total capacity.
  absl::Status operator()(const QueueSnapshot& queue, const CapacitySnapshot& capacity,
                          const JobDemand& job) const;

  const AdmissionLimits& limits() const { return limits_; }

 private:
  AdmissionLimits limits_;
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_ADMISSION_H_
