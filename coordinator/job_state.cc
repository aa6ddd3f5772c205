#include "coordinator/job_state.h"

#include "absl/strings/str_cat.h"

namespace strata::coordinator {

const char* JobTransitionName(JobTransition t) {
  switch (t) {
    case JobTransition::kStartPrefill: return "start_prefill";
    case JobTransition::kStartDecode: return "start_decode";
    case JobTransition::kComplete: return "complete";
    case JobTransition::kFail: return "fail";
    case JobTransition::kCancel: return "cancel";
    case JobTransition::kRequeue: return "requeue";
  }
  return "unknown";
}

bool IsTerminal(JobState s) {
  return s == v1::JobInfo::DONE || s == v1::JobInfo::FAILED || s == v1::JobInfo::CANCELLED;
}

absl::StatusOr<JobState> NextJobState(JobState from, JobTransition t) {
  if (from == v1::JobInfo::STATE_UNSPECIFIED || !v1::JobInfo::State_IsValid(from)) {
    return absl::InvalidArgumentError(absl::StrCat("invalid job state ", static_cast<int>(from)));
  }
  if (IsTerminal(from)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job already finished (", v1::JobInfo::State_Name(from), "); cannot ", JobTransitionName(t)));
  }
  auto refuse = [&]() -> absl::StatusOr<JobState> {
    return absl::FailedPreconditionError(absl::StrCat(
        "job in state ", v1::JobInfo::State_Name(from), " cannot ", JobTransitionName(t)));
  };
  switch (t) {
    case JobTransition::kCancel: return v1::JobInfo::CANCELLED;
    case JobTransition::kFail: return v1::JobInfo::FAILED;
    case JobTransition::kStartPrefill:
      if (from == v1::JobInfo::QUEUED) return v1::JobInfo::PREFILLING;
      return refuse();
    case JobTransition::kStartDecode:
      if (from == v1::JobInfo::PREFILLING) return v1::JobInfo::DECODING;
      return refuse();
    case JobTransition::kComplete:
      if (from == v1::JobInfo::DECODING) return v1::JobInfo::DONE;
      return refuse();
    case JobTransition::kRequeue:
      if (from == v1::JobInfo::PREFILLING || from == v1::JobInfo::DECODING) return v1::JobInfo::QUEUED;
      return refuse();
  }
  return refuse();
}

}  // namespace strata::coordinator
