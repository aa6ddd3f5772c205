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

absl::StatusOr<std::string> ListServicesByReflection(const std::shared_ptr<grpc::Channel>& channel,
                                                     int64_t timeout_ms) {
  grpc::CompletionQueue cq;
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&cq](void* want) {
    void* tag = nullptr;
    bool ok = false;
    return cq.Next(&tag, &ok) && ok && tag == want;
  };
  int tags[5];
  call->StartCall(&tags[0]);
  bool ok = step(&tags[0]);
  // ServerReflectionRequest { string list_services = 7; } with an empty value.
  const std::string request("\x3a\x00", 2);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  if (ok) {
    call->Write(request_buffer, &tags[1]);
    ok = step(&tags[1]);
  }
  if (ok) {
    call->Read(&response_buffer, &tags[2]);
    ok = step(&tags[2]);
  }
  if (ok) {
    call->WritesDone(&tags[3]);
    ok = step(&tags[3]);
  }
  grpc::Status status;
  call->Finish(&status, &tags[4]);
  step(&tags[4]);
  cq.Shutdown();
  void* tag = nullptr;
  bool drained_ok = false;
  while (cq.Next(&tag, &drained_ok)) {
  }
  if (!status.ok()) return proto::FromGrpcStatus(status);
  if (!ok) return absl::UnavailableError("reflection call failed");
  std::vector<grpc::Slice> slices;
  if (!response_buffer.Dump(&slices).ok()) return absl::InternalError("bad reflection response");
  std::string response;
  for (const grpc::Slice& s : slices) {
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return response;
}

}  // namespace strata::kvstore::testing
