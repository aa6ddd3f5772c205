// ASSERT that a Status / StatusOr expression is OK, copying the status first (safe for
// temporaries). Test-only.
#ifndef STRATA_COORDINATOR_TESTING_ASSERT_OK_H_
#define STRATA_COORDINATOR_TESTING_ASSERT_OK_H_

#include "absl/status/status.h"
#include "base/testing/status_matchers.h"

#define COORD_ASSERT_OK(expr)                                                  \
  do {                                                                         \
    const ::absl::Status coord_status_ = ::strata::testing::GetStatus((expr)); \
    ASSERT_TRUE(coord_status_.ok()) << coord_status_;                          \
  } while (0)

#endif  // STRATA_COORDINATOR_TESTING_ASSERT_OK_H_
