#include "kvstore/testing/grpc_health.h"

#include <chrono>
#include <future>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/status_conversion.h"

namespace strata::kvstore::testing {

absl::StatusOr<int> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                const std::string& service, int64_t timeout_ms) {
  // HealthCheckRequest { string service = 1; } encoded by hand.
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    request.push_back(static_cast<char>(service.size()));  // services here are < 128 bytes
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buffer,
                 &response_buffer, [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status status = done.get_future().get();
  if (!status.ok()) return proto::FromGrpcStatus(status);
  std::vector<grpc::Slice> slices;
  if (!response_buffer.Dump(&slices).ok()) return absl::InternalError("bad health response");
  std::string response;
  for (const grpc::Slice& s : slices) {
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse { ServingStatus status = 1; }: 0x08 <varint>, or empty for UNKNOWN (0).
  if (response.empty()) return 0;
  if (response.size() < 2 || response[0] != '\x08') {
    return absl::InternalError("unexpected health response");
  }
  return static_cast<int>(response[1]);
}

}  // namespace strata::kvstore::testing
