// Conversion between absl::Status and grpc::Status at the RPC edge.
//
// Codes map 1:1 (both follow google/rpc/code.proto); the message is carried unchanged. OK maps to
// OK with no message. Stateless; thread-safe.
#ifndef STRATA_PROTO_STATUS_CONVERSION_H_
#define STRATA_PROTO_STATUS_CONVERSION_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace strata::proto {

// absl -> grpc, same code and message.
grpc::Status ToGrpcStatus(const absl::Status& s);
// grpc -> absl, same code and message.
absl::Status FromGrpcStatus(const grpc::Status& s);

}  // namespace strata::proto

#endif  // STRATA_PROTO_STATUS_CONVERSION_H_
