// Public-API client helpers of the multi-process service tests: upload a document and run a job
// through Generate against a server at an address, with deadlines on every call.
#ifndef STRATA_TESTS_SERVICE_API_CLIENT_H_
#define STRATA_TESTS_SERVICE_API_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "strata/v1/api.grpc.pb.h"

namespace strata::tests {

std::shared_ptr<grpc::Channel> ChannelTo(const std::string& address);
// Sets a deadline `seconds` from now.
void Deadline(grpc::ClientContext* ctx, int seconds);

// Uploads token ids (prefill `mode`) to the server at `address` within 30 s; returns the
// document (empty when the upload failed, which is a test failure).
v1::DocumentInfo UploadTokensTo(const std::string& address, const std::vector<int32_t>& ids,
                                v1::DocumentInfo::PrefillMode mode = v1::DocumentInfo::PREFILL_MODE_UNSPECIFIED);

// One Generate call read to its end.
struct JobRun {
  v1::JobInfo final;        // the last snapshot
  std::string job_id;
  std::string leader;       // from the snapshots
  double ttft_seconds = -1;  // from the call to the first token event
  std::vector<int32_t> tokens;
  grpc::Status status;
};
// Runs `req` through Generate on `address` within `deadline_seconds`; `on_tokens` (optional) is
// called after every token event with the run so far.
JobRun GenerateOn(const std::string& address, const v1::JobSubmitRequest& req, int deadline_seconds,
                  const std::function<void(const JobRun&)>& on_tokens = nullptr);

}  // namespace strata::tests

#endif  // STRATA_TESTS_SERVICE_API_CLIENT_H_
