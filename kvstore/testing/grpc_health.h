// Test helpers: grpc.health.v1.Health/Check and server reflection through a generic stub (the
// Debian packages ship no generated health or reflection stubs). Thread-safe.
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

// Lists the services the server exposes through gRPC server reflection (v1alpha, the version
// gRPC 1.51 serves). Returns the raw ListServiceResponse bytes (service names appear verbatim).
absl::StatusOr<std::string> ListServicesByReflection(const std::shared_ptr<grpc::Channel>& channel,
                                                     int64_t timeout_ms = 5000);

}  // namespace strata::kvstore::testing

#endif  // STRATA_KVSTORE_TESTING_GRPC_HEALTH_H_
