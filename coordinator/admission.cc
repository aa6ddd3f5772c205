#include "coordinator/admission.h"

#include "absl/strings/str_cat.h"

namespace strata::coordinator {

absl::Status AdmissionLimits::Validate() const {
  if (max_pending_jobs <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_pending_jobs must be > 0, got ", max_pending_jobs));
  }
  if (max_pending_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_pending_tokens must be > 0, got ", max_pending_tokens));
  }
  return absl::OkStatus();
}

absl::Status AdmissionPolicy::operator()(const QueueSnapshot& queue, const CapacitySnapshot& capacity,
                                         const JobDemand& job) const {
  if (capacity.draining) {
    return absl::UnavailableError("server is draining; submit to another replica or retry later");
  }
  if (queue.pending_jobs + 1 > limits_.max_pending_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat("job queue is full (", queue.pending_jobs,
                                                     " unfinished jobs, limit ",
                                                     limits_.max_pending_jobs, ")"));
  }
  if (queue.pending_tokens + job.context_tokens > limits_.max_pending_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "token queue is full (", queue.pending_tokens, " tokens pending + ", job.context_tokens,
        " requested > limit ", limits_.max_pending_tokens, ")"));
  }
  if (capacity.live_workers > 0 && job.context_tokens > capacity.total_capacity_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job context of ", job.context_tokens, " tokens exceeds the capacity of the ",
        capacity.live_workers, " live workers (", capacity.total_capacity_tokens, " tokens)"));
  }
  return absl::OkStatus();
}

}  // namespace strata::coordinator
