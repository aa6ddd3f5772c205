// rocksdb::Status -> absl::Status. Stateless; thread-safe.
#ifndef STRATA_KVSTORE_INTERNAL_ROCKSDB_STATUS_H_
#define STRATA_KVSTORE_INTERNAL_ROCKSDB_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "rocksdb/status.h"

namespace strata::kvstore::internal {

// NotFound -> NotFound, Corruption -> DataLoss, InvalidArgument/NotSupported -> InvalidArgument,
// Busy/TimedOut/TryAgain -> Unavailable, IOError with no space -> ResourceExhausted, the rest
// -> Internal. `context` prefixes the message.
absl::Status FromRocksDb(const rocksdb::Status& s, absl::string_view context);

}  // namespace strata::kvstore::internal

#endif  // STRATA_KVSTORE_INTERNAL_ROCKSDB_STATUS_H_
