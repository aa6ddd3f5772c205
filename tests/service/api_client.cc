#include "tests/service/api_client.h"

#include <chrono>

#include "gtest/gtest.h"

namespace strata::tests {

std::shared_ptr<grpc::Channel> ChannelTo(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

void Deadline(grpc::ClientContext* ctx, int seconds) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

v1::DocumentInfo UploadTokensTo(const std::string& address, const std::vector<int32_t>& ids,
                                v1::DocumentInfo::PrefillMode mode) {
  auto stub = v1::DocumentService::NewStub(ChannelTo(address));
  grpc::ClientContext ctx;
  Deadline(&ctx, 30);
  v1::DocumentUploadResponse resp;
  auto writer = stub->Upload(&ctx, &resp);
  v1::DocumentUploadRequest req;
  if (mode != v1::DocumentInfo::PREFILL_MODE_UNSPECIFIED) req.mutable_options()->set_prefill_mode(mode);
  req.mutable_tokens()->mutable_ids()->Assign(ids.begin(), ids.end());
  writer->Write(req);
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  return resp.document();
}

JobRun GenerateOn(const std::string& address, const v1::JobSubmitRequest& req, int deadline_seconds,
                  const std::function<void(const JobRun&)>& on_tokens) {
  auto stub = v1::JobService::NewStub(ChannelTo(address));
  grpc::ClientContext ctx;
  Deadline(&ctx, deadline_seconds);
  JobRun run;
  const auto start = std::chrono::steady_clock::now();
  auto reader = stub->Generate(&ctx, req);
  v1::JobEvent e;
  while (reader->Read(&e)) {
    if (run.job_id.empty()) run.job_id = e.job_id();
    if (e.has_tokens()) {
      if (run.ttft_seconds < 0) {
        run.ttft_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
      for (int32_t t : e.tokens().token_ids()) run.tokens.push_back(t);
      if (on_tokens) on_tokens(run);
    } else if (e.has_snapshot()) {
      run.final = e.snapshot();
      if (!e.snapshot().leader_worker_id().empty()) run.leader = e.snapshot().leader_worker_id();
    }
  }
  run.status = reader->Finish();
  return run;
}

}  // namespace strata::tests
