// The job state machine (DESIGN.md section 2):
//
//   QUEUED -> PREFILLING -> DECODING -> DONE
//      |          |            |
//      +----------+------------+--> FAILED | CANCELLED
//   PREFILLING / DECODING -> QUEUED on kRequeue (the worker was lost or handed the job back).
//
// DONE, FAILED and CANCELLED are terminal: no event leaves them. Pure functions; thread-safe.
#ifndef STRATA_COORDINATOR_JOB_STATE_H_
#define STRATA_COORDINATOR_JOB_STATE_H_

#include "absl/status/statusor.h"
#include "strata/v1/api.pb.h"

namespace strata::coordinator {

using JobState = v1::JobInfo::State;

enum class JobTransition {
  kStartPrefill,  // a leader worker accepted the job
  kStartDecode,   // the prompt is prefilled; the first token is being generated
  kComplete,      // generation finished (length or stop)
  kFail,          // the job failed (worker error, invalid model output, ...)
  kCancel,        // the client cancelled
  kRequeue,       // the leader was lost or handed the job back: run it again from the start
};

const char* JobTransitionName(JobTransition t);

// True for DONE, FAILED and CANCELLED.
bool IsTerminal(JobState s);

// The state after `t` in state `from`. FAILED_PRECONDITION when `t` is not allowed in `from`
// (any transition out of a terminal state, e.g. cancelling a finished job); INVALID_ARGUMENT for
// STATE_UNSPECIFIED or an out-of-range state.
absl::StatusOr<JobState> NextJobState(JobState from, JobTransition t);

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_JOB_STATE_H_
