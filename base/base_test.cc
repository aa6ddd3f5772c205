#include "base/status_macros.h"

#include "base/clock.h"
#include "base/logging.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckEven(int x) {
  STRATA_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPropagates) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("odd")));
}

TEST(StatusMacrosTest, ReturnIfError) {
  STRATA_EXPECT_OK(CheckEven(4));
  EXPECT_THAT(CheckEven(3), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StatusMacrosTest, AnnotateKeepsCode) {
  absl::Status s = Annotate(absl::NotFoundError("x"), "layer 3");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("layer 3: x")));
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
}

TEST(ClockTest, MonotonicAdvances) {
  Stopwatch sw;
  int64_t a = MonotonicNanos();
  int64_t b = MonotonicNanos();
  EXPECT_LE(a, b);
  EXPECT_GE(sw.ElapsedNanos(), 0);
  EXPECT_GT(WallMicros(), 1600000000LL * 1000000LL);
}

TEST(LoggingTest, CheckFailureAborts) {
  EXPECT_DEATH(STRATA_CHECK(1 == 2) << "boom", "Check failed: 1 == 2 boom");
}

}  // namespace
}  // namespace strata
