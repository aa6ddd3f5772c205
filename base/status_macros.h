// Status propagation macros (Abseil 20220623 has no ABSL_RETURN_IF_ERROR).
//
//   STRATA_RETURN_IF_ERROR(DoThing());
//   STRATA_ASSIGN_OR_RETURN(Foo foo, MakeFoo());
//
// Both evaluate their argument once. Thread-safe: they touch no shared state.
#ifndef STRATA_BASE_STATUS_MACROS_H_
#define STRATA_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define STRATA_STATUS_CONCAT_INNER_(a, b) a##b
#define STRATA_STATUS_CONCAT_(a, b) STRATA_STATUS_CONCAT_INNER_(a, b)

#define STRATA_RETURN_IF_ERROR(expr)                        \
  do {                                                      \
    ::absl::Status strata_status_ = (expr);                 \
    if (ABSL_PREDICT_FALSE(!strata_status_.ok())) {         \
      return strata_status_;                                \
    }                                                       \
  } while (0)

#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_STATUS_CONCAT_(strata_statusor_, __LINE__), lhs, expr)

#define STRATA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) {                \
    return std::move(statusor).status();                   \
  }                                                        \
  lhs = std::move(statusor).value()

namespace strata {

// Returns `s` with `context` prepended to its message ("context: message"); OK stays OK.
absl::Status Annotate(const absl::Status& s, absl::string_view context);

}  // namespace strata

#endif  // STRATA_BASE_STATUS_MACROS_H_
