#include "coordinator/job_state.h"

#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;
using v1::JobInfo;

// Given a job in `given`, when `when` happens, then it is in `then`.
struct Scenario {
  JobState given;
  JobTransition when;
  JobState then;
};

TEST(JobStateTest, AllowedTransitions) {
  const std::vector<Scenario> scenarios = {
      {JobInfo::QUEUED, JobTransition::kStartPrefill, JobInfo::PREFILLING},
      {JobInfo::QUEUED, JobTransition::kCancel, JobInfo::CANCELLED},
      {JobInfo::QUEUED, JobTransition::kFail, JobInfo::FAILED},
      {JobInfo::PREFILLING, JobTransition::kStartDecode, JobInfo::DECODING},
      {JobInfo::PREFILLING, JobTransition::kCancel, JobInfo::CANCELLED},
      {JobInfo::PREFILLING, JobTransition::kFail, JobInfo::FAILED},
      {JobInfo::PREFILLING, JobTransition::kRequeue, JobInfo::QUEUED},
      {JobInfo::DECODING, JobTransition::kComplete, JobInfo::DONE},
      {JobInfo::DECODING, JobTransition::kCancel, JobInfo::CANCELLED},
      {JobInfo::DECODING, JobTransition::kFail, JobInfo::FAILED},
      {JobInfo::DECODING, JobTransition::kRequeue, JobInfo::QUEUED},
  };
  for (const Scenario& s : scenarios) {
    SCOPED_TRACE(JobInfo::State_Name(s.given) + " + " + JobTransitionName(s.when));
    STRATA_ASSERT_OK_AND_ASSIGN(JobState next, NextJobState(s.given, s.when));
    EXPECT_EQ(next, s.then);
  }
}

TEST(JobStateTest, RefusedTransitionsInLiveStates) {
  const std::vector<std::pair<JobState, JobTransition>> refused = {
      {JobInfo::QUEUED, JobTransition::kStartDecode},
      {JobInfo::QUEUED, JobTransition::kComplete},
      {JobInfo::QUEUED, JobTransition::kRequeue},
      {JobInfo::PREFILLING, JobTransition::kStartPrefill},
      {JobInfo::PREFILLING, JobTransition::kComplete},
      {JobInfo::DECODING, JobTransition::kStartPrefill},
      {JobInfo::DECODING, JobTransition::kStartDecode},
  };
  for (const auto& [given, when] : refused) {
    SCOPED_TRACE(JobInfo::State_Name(given) + " + " + JobTransitionName(when));
    EXPECT_THAT(NextJobState(given, when), StatusIs(absl::StatusCode::kFailedPrecondition));
  }
}

TEST(JobStateTest, TerminalStatesAcceptNothing) {
  for (JobState given : {JobInfo::DONE, JobInfo::FAILED, JobInfo::CANCELLED}) {
    EXPECT_TRUE(IsTerminal(given));
    for (JobTransition when :
         {JobTransition::kStartPrefill, JobTransition::kStartDecode, JobTransition::kComplete,
          JobTransition::kFail, JobTransition::kCancel, JobTransition::kRequeue}) {
      SCOPED_TRACE(JobInfo::State_Name(given) + " + " + JobTransitionName(when));
      EXPECT_THAT(NextJobState(given, when),
                  StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("finished")));
    }
  }
}

TEST(JobStateTest, LiveStatesAreNotTerminal) {
  EXPECT_FALSE(IsTerminal(JobInfo::QUEUED));
  EXPECT_FALSE(IsTerminal(JobInfo::PREFILLING));
  EXPECT_FALSE(IsTerminal(JobInfo::DECODING));
}

TEST(JobStateTest, UnspecifiedStateIsInvalid) {
  EXPECT_THAT(NextJobState(JobInfo::STATE_UNSPECIFIED, JobTransition::kCancel),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(NextJobState(static_cast<JobState>(99), JobTransition::kCancel),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// A full life: queued, prefilled, decoded, done; then a late cancel is refused.
TEST(JobStateTest, FullLifeThenLateCancel) {
  JobState s = JobInfo::QUEUED;
  for (JobTransition t :
       {JobTransition::kStartPrefill, JobTransition::kStartDecode, JobTransition::kComplete}) {
    STRATA_ASSERT_OK_AND_ASSIGN(s, NextJobState(s, t));
  }
  EXPECT_EQ(s, JobInfo::DONE);
  EXPECT_THAT(NextJobState(s, JobTransition::kCancel), StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace strata::coordinator
