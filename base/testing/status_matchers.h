// GoogleTest matchers for absl::Status / absl::StatusOr (test-only target strata::base_testing).
//
//   EXPECT_THAT(DoThing(), StatusIs(absl::StatusCode::kInvalidArgument));
//   EXPECT_THAT(DoThing(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("layer")));
//   STRATA_ASSERT_OK(DoThing());
//   STRATA_ASSERT_OK_AND_ASSIGN(auto x, MakeX());
#ifndef STRATA_BASE_TESTING_STATUS_MATCHERS_H_
#define STRATA_BASE_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace strata::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER_P(StatusIs, code, "") {
  const absl::Status& s = ::strata::testing::GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& s = ::strata::testing::GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code &&
         ::testing::Matches(message_matcher)(std::string(s.message()));
}

}  // namespace strata::testing

#define STRATA_ASSERT_OK(expr)                                        \
  do {                                                                \
    const ::absl::Status strata_s_ = ::strata::testing::GetStatus((expr));\
    ASSERT_TRUE(strata_s_.ok()) << strata_s_;                         \
  } while (0)
#define STRATA_EXPECT_OK(expr)                                           \
  do {                                                                   \
    const ::absl::Status strata_s_ = ::strata::testing::GetStatus((expr)); \
    EXPECT_TRUE(strata_s_.ok()) << strata_s_;                            \
  } while (0)

#define STRATA_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  STRATA_ASSERT_OK_AND_ASSIGN_IMPL_(STRATA_STATUS_CONCAT_(strata_sor_, __LINE__), lhs, expr)
#define STRATA_ASSERT_OK_AND_ASSIGN_IMPL_(sor, lhs, expr) \
  auto sor = (expr);                                      \
  ASSERT_TRUE(sor.ok()) << sor.status();                  \
  lhs = std::move(sor).value()

#endif  // STRATA_BASE_TESTING_STATUS_MATCHERS_H_
