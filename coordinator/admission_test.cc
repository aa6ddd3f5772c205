#include "coordinator/admission.h"

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

AdmissionPolicy Policy() {
  AdmissionLimits limits;
  limits.max_pending_jobs = 3;
  limits.max_pending_tokens = 1000;
  return AdmissionPolicy(limits);
}

TEST(AdmissionTest, AdmitsWithRoom) {
  STRATA_EXPECT_OK((Policy()({2, 500}, {1, 4000, false}, {500})));
}

TEST(AdmissionTest, AdmitsWithoutWorkers) {
  // No worker yet: the job waits QUEUED; only the queue limits apply.
  STRATA_EXPECT_OK((Policy()({0, 0}, {0, 0, false}, {900})));
}

TEST(AdmissionTest, RefusesWhenJobQueueFull) {
  EXPECT_THAT((Policy()({3, 0}, {1, 4000, false}, {1})),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("job queue")));
}

TEST(AdmissionTest, RefusesWhenTokenQueueFull) {
  EXPECT_THAT((Policy()({1, 600}, {1, 4000, false}, {401})),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("token queue")));
  STRATA_EXPECT_OK((Policy()({1, 600}, {1, 4000, false}, {400})));  // exactly at the limit
}

TEST(AdmissionTest, RefusesContextLargerThanLiveCapacity) {
  EXPECT_THAT((Policy()({0, 0}, {2, 300, false}, {301})),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("capacity")));
  STRATA_EXPECT_OK((Policy()({0, 0}, {2, 300, false}, {300})));
}

TEST(AdmissionTest, DrainingIsUnavailable) {
  EXPECT_THAT((Policy()({0, 0}, {1, 4000, true}, {1})), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(AdmissionTest, LimitsValidate) {
  AdmissionLimits limits;
  STRATA_EXPECT_OK(limits.Validate());
  limits.max_pending_jobs = 0;
  EXPECT_THAT(limits.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
  limits = AdmissionLimits();
  limits.max_pending_tokens = -1;
  EXPECT_THAT(limits.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::coordinator
