// Test helper: calls grpc.health.v1.Health/Check through a generic stub (the Debian packages ship
// no generated health stubs). Thread-safe.
#ifndef STRATA_KVSTORE_TESTING_GRPC_HEALTH_H_
#define STRATA_KVSTORE_TESTING_GRPC_HEALTH_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"

namespace strata::kvstore::testing {

// Returns the serving status enum of `service` ("" = the whole server): 1 SERVING,
// 2 NOT_SERVING; the gRPC error (e.g. NOT_FOUND for an unknown service) otherwise.
absl::StatusOr<int> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                const std::string& service, int64_t timeout_ms = 5000);

}  // namespace strata::kvstore::testing

#endif  // STRATA_KVSTORE_TESTING_GRPC_HEALTH_H_
