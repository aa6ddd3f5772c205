#include "kvstore/internal/rocksdb_status.h"

#include "absl/strings/str_cat.h"

namespace strata::kvstore::internal {

absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat(context, ": rocksdb: ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsInvalidArgument() || s.IsNotSupported()) return absl::InvalidArgumentError(msg);
  if (s.IsBusy() || s.IsTimedOut() || s.IsTryAgain()) return absl::UnavailableError(msg);
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace strata::kvstore::internal
