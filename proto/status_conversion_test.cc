#include "proto/status_conversion.h"

#include "gtest/gtest.h"

namespace strata::proto {
namespace {

TEST(StatusConversionTest, EveryCodeRoundTripsWithItsMessage) {
  // Codes 1..16 are the canonical non-OK codes of google/rpc/code.proto.
  for (int code = 1; code <= 16; ++code) {
    absl::Status s(static_cast<absl::StatusCode>(code), "msg " + std::to_string(code));
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    EXPECT_EQ(g.error_message(), "msg " + std::to_string(code));
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
}

TEST(StatusConversionTest, NamedCodesMatch) {
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::DataLossError("x")).error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "y")).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(StatusConversionTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

}  // namespace
}  // namespace strata::proto
