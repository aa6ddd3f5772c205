// End-to-end tests of `strata serve` (coordinator + worker + embedded KV store in one process) on
// a tiny random model made by `strata make-model` in a temp dir. The server is a child process on
// 127.0.0.1 (ports from --port-file); clients are the public gRPC API and the `strata` client
// commands run as child processes.
//
// Every child is killed (SIGKILL if it did not stop) and waited for; every wait is bounded.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/testing/random_requests.h"
#include "strata/v1/api.grpc.pb.h"
#include "tests/service/api_client.h"
#include "tests/service/child_process.h"

namespace strata {
namespace {

using tests::ChannelTo;
using tests::ChildProcess;
using tests::Deadline;
using tests::FreePort;
using tests::GenerateOn;
using tests::HttpGet;
using tests::JobRun;
using tests::Metric;
using tests::UploadTokensTo;

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char tmpl[] = "/tmp/strata_serve_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = new std::string(tmpl);
    ChildProcess make({STRATA_BINARY, "make-model", "--preset", "tiny", "--seed", "3", "--out", *dir_ + "/model"},
               *dir_ + "/make.out", *dir_ + "/make.err");
    std::printf("model seed=3 dir=%s\n", dir_->c_str());
    auto code = make.Wait(std::chrono::seconds(60));
    ASSERT_TRUE(code.has_value() && *code == 0) << make.Err();
    server_ = new ChildProcess({STRATA_BINARY, "serve", "--model", *dir_ + "/model", "--data", *dir_ + "/data", "--listen",
                         "127.0.0.1:0", "--metrics-listen", absl::StrCat("127.0.0.1:", FreePort()), "--port-file", *dir_ + "/ports",
                         "--no-sync", "--prefill-chunk", "128", "--max-tokens-limit", "512",
                         "--drain-timeout-seconds", "2"},
                        *dir_ + "/serve.out", *dir_ + "/serve.err");
    ASSERT_TRUE(server_->WaitForPorts(*dir_ + "/ports", std::chrono::seconds(60), &grpc_port_, &metrics_port_))
        << server_->Err();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    if (dir_ != nullptr) std::filesystem::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }

  std::string Address() const { return absl::StrCat("127.0.0.1:", grpc_port_); }
  std::shared_ptr<grpc::Channel> Channel() const { return ChannelTo(Address()); }
  v1::DocumentInfo UploadTokens(const std::vector<int32_t>& ids) { return UploadTokensTo(Address(), ids); }
  JobRun Generate(const v1::JobSubmitRequest& req) { return GenerateOn(Address(), req, 120); }

  static std::string* dir_;
  static ChildProcess* server_;
  static int grpc_port_;
  static int metrics_port_;
};
std::string* ServeTest::dir_ = nullptr;
ChildProcess* ServeTest::server_ = nullptr;
int ServeTest::grpc_port_ = 0;
int ServeTest::metrics_port_ = 0;

TEST_F(ServeTest, AnswersMatchLocalGenerateAndSecondJobReusesPersistedKv) {
  const std::string metrics0 = HttpGet(metrics_port_, "/metrics");
  ASSERT_TRUE(absl::StrContains(metrics0, "200 OK")) << metrics0;
  std::vector<int32_t> doc;
  for (int i = 0; i < 700; ++i) doc.push_back(3 + (i * 97 + 13) % 480);
  const std::vector<int32_t> prompt = {40, 41, 42, 43, 44, 45};
  v1::DocumentInfo info = UploadTokens(doc);
  ASSERT_EQ(info.num_tokens(), doc.size());

  v1::JobSubmitRequest req;
  req.set_document_id(info.document_id());
  req.mutable_prompt_tokens()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  req.mutable_params()->set_max_tokens(12);
  req.mutable_params()->set_temperature(0);
  req.mutable_policy()->set_name("dense");
  // The first job waits for the document's prefill (its TTFT includes it).
  JobRun first = Generate(req);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message() << server_->Err();
  ASSERT_EQ(first.final.state(), v1::JobInfo::DONE) << first.final.error_message();
  const std::string metrics1 = HttpGet(metrics_port_, "/metrics");
  JobRun second = Generate(req);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  ASSERT_EQ(second.final.state(), v1::JobInfo::DONE) << second.final.error_message();
  const std::string metrics2 = HttpGet(metrics_port_, "/metrics");
  EXPECT_EQ(second.tokens, first.tokens);
  EXPECT_EQ(second.final.usage().cached_tokens(), doc.size());
  EXPECT_EQ(second.final.usage().prompt_tokens(), doc.size() + prompt.size());
  EXPECT_EQ(second.final.usage().mean_attended_tokens() > doc.size(), true);
  // No document prefill for the second job: only its prompt went through prefill.
  EXPECT_EQ(Metric(metrics2, "strata_prefill_tokens_total") - Metric(metrics1, "strata_prefill_tokens_total"),
            static_cast<double>(prompt.size()));
  EXPECT_LT(second.ttft_seconds, first.ttft_seconds);
  std::printf("TTFT first job (includes the %zu-token document prefill) = %.3f s; second job (READY document) = %.3f s\n",
              doc.size(), first.ttft_seconds, second.ttft_seconds);

  // The same tokens as `strata generate` on document + prompt.
  std::vector<int32_t> all = doc;
  all.insert(all.end(), prompt.begin(), prompt.end());
  ChildProcess gen({STRATA_BINARY, "generate", "--model", *dir_ + "/model", "--token-ids", absl::StrJoin(all, ","),
             "--max-tokens", "12", "--chunk-size", "128"},
            *dir_ + "/gen.out", *dir_ + "/gen.err");
  auto code = gen.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(code.has_value() && *code == 0) << gen.Err();
  std::string expected = first.final.output_text();
  if (expected.empty() || expected.back() != '\n') expected += '\n';
  EXPECT_EQ(gen.Out(), expected);
  EXPECT_TRUE(absl::StrContains(gen.Err(), absl::StrCat("generated_tokens=", first.tokens.size())) ||
              first.final.finish_reason() == v1::JobInfo::STOP)
      << gen.Err();

  // Metrics moved.
  EXPECT_GT(Metric(metrics2, "strata_decode_tokens_total"), Metric(metrics0, "strata_decode_tokens_total"));
  // The second job's pages come from the host tier (kept there since the prefill persisted them).
  EXPECT_GT(Metric(metrics2, "strata_kv_hits_total{tier=\"host\"}"),
            Metric(metrics1, "strata_kv_hits_total{tier=\"host\"}"));
  EXPECT_EQ(Metric(metrics2, "strata_kv_hits_total{tier=\"host\"}") -
                Metric(metrics1, "strata_kv_hits_total{tier=\"host\"}"),
            Metric(metrics2, "strata_kv_lookups_total{tier=\"host\"}") -
                Metric(metrics1, "strata_kv_lookups_total{tier=\"host\"}"));
  EXPECT_GT(Metric(metrics2, "strata_attention_selected_tokens_total"),
            Metric(metrics1, "strata_attention_selected_tokens_total"));
  EXPECT_GE(Metric(metrics1, "strata_prefill_tokens_total"), static_cast<double>(doc.size()));
}

TEST_F(ServeTest, BadRequestsGetTheRightCodes) {
  auto stub = v1::JobService::NewStub(Channel());
  std::vector<int32_t> doc;
  for (int i = 0; i < 100; ++i) doc.push_back(5 + i);
  v1::DocumentInfo info = UploadTokens(doc);
  auto submit = [&](const v1::JobSubmitRequest& r) {
    grpc::ClientContext ctx;
    Deadline(&ctx, 10);
    v1::JobInfo out;
    return stub->Submit(&ctx, r, &out).error_code();
  };
  v1::JobSubmitRequest base;
  base.set_document_id(info.document_id());
  base.mutable_prompt_tokens()->add_ids(7);
  base.mutable_params()->set_max_tokens(2);

  v1::JobSubmitRequest unknown_doc = base;
  unknown_doc.set_document_id("00000000000000000000000000000000");
  EXPECT_EQ(submit(unknown_doc), grpc::StatusCode::NOT_FOUND);
  v1::JobSubmitRequest bad_policy = base;
  bad_policy.mutable_policy()->set_name("nonsense");
  EXPECT_EQ(submit(bad_policy), grpc::StatusCode::INVALID_ARGUMENT);
  v1::JobSubmitRequest too_many = base;
  too_many.mutable_params()->set_max_tokens(100000);
  EXPECT_EQ(submit(too_many), grpc::StatusCode::INVALID_ARGUMENT);
  v1::JobSubmitRequest bad_factor = base;
  bad_factor.mutable_policy()->set_name("tokenselect");
  bad_factor.mutable_policy()->set_candidate_factor(17);
  EXPECT_EQ(submit(bad_factor), grpc::StatusCode::INVALID_ARGUMENT);
  v1::JobSubmitRequest bad_parts = base;
  bad_parts.mutable_policy()->set_name("tokenselect");
  bad_parts.mutable_policy()->set_partitions(6);
  EXPECT_EQ(submit(bad_parts), grpc::StatusCode::INVALID_ARGUMENT);
  bad_parts.mutable_policy()->set_partitions(128);
  EXPECT_EQ(submit(bad_parts), grpc::StatusCode::INVALID_ARGUMENT);

  JobRun done = Generate(base);
  ASSERT_TRUE(done.status.ok()) << done.status.error_message();
  ASSERT_EQ(done.final.state(), v1::JobInfo::DONE) << done.final.error_message();
  grpc::ClientContext ctx;
  Deadline(&ctx, 10);
  v1::JobCancelRequest cancel;
  cancel.set_job_id(done.final.job_id());
  v1::JobInfo out;
  EXPECT_EQ(stub->Cancel(&ctx, cancel, &out).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

// `strata kvstore --deferred-mib` below 1 is a usage error (exit 2) that names the flag; nothing
// is served.
TEST_F(ServeTest, KvstoreRefusesABadDeferredBudget) {
  ChildProcess kv({STRATA_BINARY, "kvstore", "--listen", "127.0.0.1:0", "--data", *dir_ + "/kv-bad", "--deferred-mib",
                   "0"},
                  *dir_ + "/kv-bad.out", *dir_ + "/kv-bad.err");
  const std::optional<int> code = kv.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 2) << kv.Err();
  EXPECT_TRUE(absl::StrContains(kv.Err(), "--deferred-mib")) << kv.Err();
}

// `strata generate --kv-dtype`: an fp8 KV cache generates, dense and with a host sparse policy
// (which reads its codes times the cache's scales); an unknown dtype is a usage error (exit 2).
TEST_F(ServeTest, GenerateKvDtypes) {
  struct Run {
    std::vector<std::string> extra;
    int code;
    const char* err;  // a piece of stderr
  };
  const Run runs[] = {
      {{"--kv-dtype", "fp8"}, 0, "kv=fp8"},
      {{"--kv-dtype", "fp8", "--policy", "quest", "--budget", "16"}, 0, "kv=fp8"},
      {{"--kv-dtype", "fp8", "--policy", "radar", "--budget", "16"}, 0, "kv=fp8"},
      {{"--kv-dtype", "fp9"}, 2, "--kv-dtype: 'fp9'"},
  };
  int i = 0;
  for (const Run& r : runs) {
    std::vector<std::string> args = {STRATA_BINARY, "generate", "--model", *dir_ + "/model",
                                     "--token-ids", "5,6,7,8,9", "--max-tokens", "3"};
    args.insert(args.end(), r.extra.begin(), r.extra.end());
    const std::string base = absl::StrCat(*dir_, "/gen_kv", i++);
    ChildProcess gen(args, base + ".out", base + ".err");
    auto code = gen.Wait(std::chrono::seconds(60));
    ASSERT_TRUE(code.has_value()) << absl::StrJoin(r.extra, " ");
    EXPECT_EQ(*code, r.code) << absl::StrJoin(r.extra, " ") << ": " << gen.Err();
    EXPECT_TRUE(absl::StrContains(gen.Err(), r.err)) << gen.Err();
  }
}

// `strata generate --partitions`: tokenselect in parts generates, with a budget the parts divide
// and one they do not (rounded up); a count that is not a power of two is a usage error (exit 2)
// naming the option.
TEST_F(ServeTest, GeneratePartitions) {
  struct Run {
    std::vector<std::string> extra;
    int code;
    const char* err;  // a piece of stderr
  };
  const Run runs[] = {
      {{"--policy", "tokenselect", "--budget", "16", "--partitions", "4"}, 0, ""},
      {{"--policy", "tokenselect", "--budget", "16", "--partitions", "3"}, 2,
       "tokenselect_partitions 3"},
      {{"--policy", "tokenselect", "--budget", "18", "--partitions", "4"}, 0, ""},
  };
  int i = 0;
  for (const Run& r : runs) {
    std::vector<std::string> args = {STRATA_BINARY, "generate", "--model", *dir_ + "/model",
                                     "--token-ids", "5,6,7,8,9", "--max-tokens", "3"};
    args.insert(args.end(), r.extra.begin(), r.extra.end());
    const std::string base = absl::StrCat(*dir_, "/gen_parts", i++);
    ChildProcess gen(args, base + ".out", base + ".err");
    auto code = gen.Wait(std::chrono::seconds(60));
    ASSERT_TRUE(code.has_value()) << absl::StrJoin(r.extra, " ");
    EXPECT_EQ(*code, r.code) << absl::StrJoin(r.extra, " ") << ": " << gen.Err();
    EXPECT_TRUE(absl::StrContains(gen.Err(), r.err)) << gen.Err();
  }
}

TEST_F(ServeTest, ClientCommands) {
  const std::string doc_file = *dir_ + "/doc.txt";
  {
    std::ofstream out(doc_file);
    for (int i = 0; i < 40; ++i) out << "The quick brown fox " << i << " jumps over the lazy dog. ";
  }
  ChildProcess ask({STRATA_BINARY, "ask", "--server", Address(), "--doc", doc_file, "--max-tokens", "6", "What is it?"},
            *dir_ + "/ask.out", *dir_ + "/ask.err");
  auto code = ask.Wait(std::chrono::seconds(120));
  ASSERT_TRUE(code.has_value()) << ask.Err();
  EXPECT_EQ(*code, 0) << ask.Err();
  EXPECT_TRUE(absl::StrContains(ask.Err(), "cached_tokens=")) << ask.Err();
  EXPECT_TRUE(absl::StrContains(ask.Err(), "state=DONE")) << ask.Err();

  ChildProcess ls({STRATA_BINARY, "doc", "ls", "--server", Address()}, *dir_ + "/ls.out", *dir_ + "/ls.err");
  code = ls.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value() && *code == 0) << ls.Err();
  EXPECT_TRUE(absl::StrContains(ls.Out(), "state=READY")) << ls.Out();

  ChildProcess get({STRATA_BINARY, "doc", "get", "--server", Address(), "ffffffffffffffffffffffffffffffff"},
            *dir_ + "/get.out", *dir_ + "/get.err");
  code = get.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 1);
  EXPECT_TRUE(absl::StrContains(get.Err(), "NOT_FOUND")) << get.Err();

  ChildProcess jobs({STRATA_BINARY, "job", "ls", "--server", Address(), "--state", "DONE"}, *dir_ + "/jobs.out",
             *dir_ + "/jobs.err");
  code = jobs.Wait(std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value() && *code == 0) << jobs.Err();
  EXPECT_TRUE(absl::StrContains(jobs.Out(), "state=DONE")) << jobs.Out();

  // --candidate-factor: a negative value is the client's usage error (exit 2, nothing sent); one
  // past 16 reaches the server, which refuses it (exit 1, INVALID_ARGUMENT naming the field).
  // --partitions the same way: negative is the client's usage error; 3 (not a power of two) is
  // INVALID_ARGUMENT from the server naming the field; 4 answers.
  struct FlagRun {
    const char* flag;
    const char* value;
    int code;
    std::vector<const char*> err;  // pieces of stderr
  };
  const FlagRun flag_runs[] = {
      {"--candidate-factor", "-3", 2, {"--candidate-factor"}},
      {"--candidate-factor", "99", 1, {"INVALID_ARGUMENT", "candidate_factor"}},
      {"--partitions", "-1", 2, {"--partitions"}},
      {"--partitions", "3", 1, {"INVALID_ARGUMENT", "policy.partitions"}},
      {"--partitions", "4", 0, {"state=DONE"}},
  };
  for (const FlagRun& r : flag_runs) {
    SCOPED_TRACE(absl::StrCat(r.flag, " ", r.value));
    ChildProcess child({STRATA_BINARY, "ask", "--server", Address(), "--doc", doc_file, "--policy", "tokenselect",
                        "--max-tokens", "4", r.flag, r.value, "What is it?"},
                       *dir_ + "/factor.out", *dir_ + "/factor.err");
    code = child.Wait(std::chrono::seconds(60));
    const std::string err = child.Err();
    ASSERT_TRUE(code.has_value());
    EXPECT_EQ(*code, r.code) << err;
    for (const char* piece : r.err) EXPECT_TRUE(absl::StrContains(err, piece)) << err;
  }
}

// Reads "<grpc_port> <metrics_port>" from a port file, waiting up to 60 s; 0 on failure.
int WaitPort(ChildProcess* child, const std::string& path) {
  int grpc = 0;
  return child->WaitForPorts(path, std::chrono::seconds(60), &grpc, nullptr) ? grpc : 0;
}

// Separate processes: `strata kvstore`, `strata serve --no-worker` (the coordinator with the gRPC
// worker transport) and `strata worker` using the KV store service as its page store.
TEST(WorkerProcessTest, WorkerWithRemoteKvStore) {
  char tmpl[] = "/tmp/strata_worker_proc_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{dir};
  {
    ChildProcess make({STRATA_BINARY, "make-model", "--preset", "tiny", "--seed", "4", "--out", dir + "/model"},
               dir + "/make.out", dir + "/make.err");
    auto code = make.Wait(std::chrono::seconds(60));
    ASSERT_TRUE(code.has_value() && *code == 0) << make.Err();
  }
  ChildProcess kv({STRATA_BINARY, "kvstore", "--listen", "127.0.0.1:0", "--data", dir + "/kv", "--port-file", dir + "/kv.ports",
            "--no-sync"},
           dir + "/kv.out", dir + "/kv.err");
  const int kv_port = WaitPort(&kv, dir + "/kv.ports");
  ASSERT_GT(kv_port, 0) << kv.Err();
  ChildProcess coord({STRATA_BINARY, "serve", "--no-worker", "--model", dir + "/model", "--data", dir + "/coord", "--listen",
               "127.0.0.1:0", "--port-file", dir + "/coord.ports", "--no-sync", "--drain-timeout-seconds", "2"},
              dir + "/coord.out", dir + "/coord.err");
  const int coord_port = WaitPort(&coord, dir + "/coord.ports");
  ASSERT_GT(coord_port, 0) << coord.Err();
  ChildProcess worker({STRATA_BINARY, "worker", "--listen", "127.0.0.1:0", "--coordinator",
                absl::StrCat("127.0.0.1:", coord_port), "--kvstore", absl::StrCat("127.0.0.1:", kv_port), "--model",
                dir + "/model", "--worker-id", "w1", "--port-file", dir + "/worker.ports"},
               dir + "/worker.out", dir + "/worker.err");
  ASSERT_GT(WaitPort(&worker, dir + "/worker.ports"), 0) << worker.Err();

  const std::string doc_ids = "5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,"
                              "34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,"
                              "62,63,64,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80";
  const std::string server = absl::StrCat("127.0.0.1:", coord_port);
  for (int round = 0; round < 2; ++round) {
    ChildProcess ask({STRATA_BINARY, "ask", "--server", server, "--doc-token-ids", doc_ids, "--max-tokens", "4",
               "--ignore-eos", "hello"},
              dir + "/ask.out", dir + "/ask.err");
    auto code = ask.Wait(std::chrono::seconds(120));
    ASSERT_TRUE(code.has_value()) << ask.Err();
    EXPECT_EQ(*code, 0) << ask.Err() << worker.Err();
    EXPECT_TRUE(absl::StrContains(ask.Err(), "cached_tokens=76")) << ask.Err();
    // 2 pages x 2 layers x 2 KV heads. The prefill put them into the worker's host tier on the
    // way to the KV store service, so both jobs find them in host memory.
    EXPECT_TRUE(absl::StrContains(ask.Err(), "pages_fetched(gpu/host/disk/remote)=0/8/0/0")) << ask.Err();
    // The job's selection-cache counts (Usage) are printed with the rest of its usage.
    EXPECT_TRUE(absl::StrContains(ask.Err(), "selection_cache(hits/lookups)=")) << ask.Err();
  }
  auto code = worker.StopWith(SIGTERM, std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << worker.Err();
  code = coord.StopWith(SIGTERM, std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << coord.Err();
  kv.StopWith(SIGTERM, std::chrono::seconds(30));
}

// A tiny model (seed 5) in a temporary folder and `strata serve` over it on loopback (free ports,
// --no-sync, 128-token prefill chunks, a 2 s drain) with the `extra` flags; the folder is removed
// and the server killed if still running when it goes.
struct TinyServe {
  std::string dir;
  std::unique_ptr<ChildProcess> server;
  int grpc_port = 0, metrics_port = 0;
  std::string address() const { return absl::StrCat("127.0.0.1:", grpc_port); }
  ~TinyServe() {
    server.reset();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }
};
void StartTinyServe(const std::vector<std::string>& extra, TinyServe* s) {
  char tmpl[] = "/tmp/strata_tiny_serve_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  s->dir = tmpl;
  const std::string& dir = s->dir;
  ChildProcess make({STRATA_BINARY, "make-model", "--preset", "tiny", "--seed", "5", "--out", dir + "/model"},
                    dir + "/make.out", dir + "/make.err");
  auto made = make.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(made.has_value() && *made == 0) << make.Err();
  std::vector<std::string> args = {
      STRATA_BINARY, "serve", "--model", dir + "/model", "--data", dir + "/data", "--listen", "127.0.0.1:0",
      "--metrics-listen", absl::StrCat("127.0.0.1:", FreePort()), "--port-file", dir + "/ports", "--no-sync",
      "--prefill-chunk", "128", "--drain-timeout-seconds", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  s->server = std::make_unique<ChildProcess>(args, dir + "/serve.out", dir + "/serve.err");
  ASSERT_TRUE(s->server->WaitForPorts(dir + "/ports", std::chrono::seconds(60), &s->grpc_port, &s->metrics_port))
      << s->server->Err();
}

// Uploads a document of n token ids (3 + (89 i + 7) mod 480) to the server at `address`.
v1::DocumentInfo UploadTinyDocument(const std::string& address, int n) {
  std::vector<int32_t> doc;
  for (int i = 0; i < n; ++i) doc.push_back(3 + (i * 89 + 7) % 480);
  return UploadTokensTo(address, doc);
}
// A greedy question about `document_id` (prompt 40..43, max_tokens tokens, no stop at EOS) under
// `policy` with a 128-token budget and a 64-token window.
v1::JobSubmitRequest TinyQuestion(const std::string& document_id, const std::string& policy,
                                  int max_tokens) {
  v1::JobSubmitRequest req;
  req.set_document_id(document_id);
  for (int32_t t : {40, 41, 42, 43}) req.mutable_prompt_tokens()->add_ids(t);
  req.mutable_params()->set_max_tokens(max_tokens);
  req.mutable_params()->set_temperature(0);
  req.mutable_params()->set_ignore_eos(true);
  req.mutable_policy()->set_name(policy);
  req.mutable_policy()->set_budget_tokens(128);
  req.mutable_policy()->set_window_tokens(64);
  return req;
}

// `strata serve` with fp8 pages, the lazy mount and selection on the backend (the CPU twins): the
// prefill leaves the whole document in the worker's host tier (pages in backend host memory, as
// the command sets it up), so quest jobs run the device-managed page cache; the second question
// finds its pages in the document's kept GPU state and fetches none.
TEST(ResidentServeTest, Fp8LazyJobsRunTheDeviceManagedCacheAndTheSecondFetchesNothing) {
  TinyServe serve;
  ASSERT_NO_FATAL_FAILURE(
      StartTinyServe({"--kv-page-dtype", "fp8", "--lazy-mount", "--device-selection", "on"}, &serve));
  ChildProcess& server = *serve.server;
  const int metrics_port = serve.metrics_port;
  const std::string address = serve.address();
  const v1::DocumentInfo info = UploadTinyDocument(address, 900);
  ASSERT_EQ(info.num_tokens(), 900u);
  const v1::JobSubmitRequest req = TinyQuestion(info.document_id(), "quest", 8);
  const JobRun first = GenerateOn(address, req, 120);
  ASSERT_TRUE(first.status.ok()) << first.status.error_message() << server.Err();
  ASSERT_EQ(first.final.state(), v1::JobInfo::DONE) << first.final.error_message();
  const JobRun second = GenerateOn(address, req, 120);
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  ASSERT_EQ(second.final.state(), v1::JobInfo::DONE) << second.final.error_message();
  EXPECT_EQ(second.tokens, first.tokens);
  EXPECT_EQ(first.tokens.size(), 8u);
  const v1::PagesByTier& f1 = first.final.usage().pages_fetched();
  const v1::PagesByTier& f2 = second.final.usage().pages_fetched();
  EXPECT_GT(f1.host(), 0u);  // every fill from the host tier
  EXPECT_EQ(f1.disk(), 0u);
  EXPECT_EQ(f2.host() + f2.disk() + f2.remote(), 0u);  // all still in the document's kept cache
  EXPECT_LT(first.final.usage().mean_attended_tokens(), 900.0);
  const std::string metrics = HttpGet(metrics_port, "/metrics");
  EXPECT_EQ(Metric(metrics, "strata_lazy_jobs_total{cache=\"resident\"}"), 2.0) << metrics;
  EXPECT_EQ(Metric(metrics, "strata_lazy_jobs_total{cache=\"host_managed\"}"), 0.0);
  EXPECT_TRUE(absl::StrContains(server.Err(), "device-managed page cache")) << server.Err();
  auto code = server.StopWith(SIGTERM, std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value()) << server.Err();
  EXPECT_EQ(*code, 0) << server.Err();
}

// `strata serve --kv-cache-dtype fp8`: full-mount jobs attend fp8 KV caches (the flag parsed,
// validated and applied end to end); a dense and a quest question finish, twice each with the
// same tokens (the second from persisted KV).
TEST(Fp8CacheServeTest, DenseAndQuestJobsFinishOverFp8Caches) {
  TinyServe serve;
  ASSERT_NO_FATAL_FAILURE(StartTinyServe({"--kv-cache-dtype", "fp8"}, &serve));
  ChildProcess& server = *serve.server;
  const std::string& dir = serve.dir;
  const std::string address = serve.address();
  const v1::DocumentInfo info = UploadTinyDocument(address, 700);
  ASSERT_EQ(info.num_tokens(), 700u);
  for (const char* policy : {"dense", "quest"}) {
    SCOPED_TRACE(policy);
    const v1::JobSubmitRequest req = TinyQuestion(info.document_id(), policy, 6);
    const JobRun first = GenerateOn(address, req, 120);
    ASSERT_TRUE(first.status.ok()) << first.status.error_message() << server.Err();
    ASSERT_EQ(first.final.state(), v1::JobInfo::DONE) << first.final.error_message();
    EXPECT_EQ(first.tokens.size(), 6u);
    const JobRun second = GenerateOn(address, req, 120);
    ASSERT_TRUE(second.status.ok()) << second.status.error_message();
    EXPECT_EQ(second.tokens, first.tokens);
  }
  auto code = server.StopWith(SIGTERM, std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value()) << server.Err();
  EXPECT_EQ(*code, 0) << server.Err();
  // A bad value is refused at startup.
  ChildProcess bad({STRATA_BINARY, "serve", "--model", dir + "/model", "--data", dir + "/data2", "--listen",
                    "127.0.0.1:0", "--kv-cache-dtype", "f32"},
                   dir + "/bad.out", dir + "/bad.err");
  auto bad_code = bad.Wait(std::chrono::seconds(60));
  ASSERT_TRUE(bad_code.has_value());
  EXPECT_NE(*bad_code, 0);
  EXPECT_TRUE(absl::StrContains(bad.Err(), "kv_cache_dtype")) << bad.Err();
}

// Random requests through the whole server (coordinator, a real worker running the jobs, the KV
// store, the tokenizer): random ones and valid ones with a few fields changed (jobs on a document
// with every policy and odd sampling, text and token uploads, document and job operations) get an
// answer or a canonical error, never UNKNOWN, INTERNAL or UNIMPLEMENTED; the server stays up and
// still answers a question on the document with the same tokens as before.
TEST_F(ServeTest, RandomRequestsThroughTheWholeServer) {
  std::vector<int32_t> doc;
  for (int i = 0; i < 300; ++i) doc.push_back(3 + (i * 89 + 7) % 480);
  const v1::DocumentInfo info = UploadTokens(doc);
  v1::JobSubmitRequest ask;
  ask.set_document_id(info.document_id());
  ask.mutable_prompt_tokens()->add_ids(40);
  ask.mutable_prompt_tokens()->add_ids(41);
  ask.mutable_params()->set_max_tokens(6);
  ask.mutable_params()->set_temperature(0);
  const JobRun before = Generate(ask);
  ASSERT_EQ(before.final.state(), v1::JobInfo::DONE) << before.final.error_message() << server_->Err();

  proto::testing::RandomRequestOptions o;
  o.known_strings = {info.document_id(), before.job_id, "tokenselect", "quest", "dense", "streaming", "radar"};
  auto seed = [&o](const std::string& method, const google::protobuf::Message& m) {
    o.seeds[method].push_back({m.SerializeAsString()});
  };
  for (const char* policy : {"dense", "tokenselect", "quest", "streaming"}) {
    v1::JobSubmitRequest r = ask;
    r.mutable_policy()->set_name(policy);
    r.mutable_policy()->set_budget_tokens(64);
    r.mutable_params()->set_temperature(0.8f);
    r.mutable_params()->set_top_p(0.9f);
    r.mutable_params()->set_seed(7);
    seed("Submit", r);
    seed("Generate", r);
  }
  v1::JobSubmitRequest text = ask;
  text.set_prompt_text("What does it say?");
  seed("Generate", text);
  v1::DocumentUploadRequest upload;
  upload.set_text("A short document about foxes and dogs. ");
  o.seeds["Upload"].push_back({upload.SerializeAsString()});
  o.seeds["Upload"].push_back({upload.SerializeAsString(), upload.SerializeAsString()});
  v1::DocumentGetRequest get;
  get.set_document_id(info.document_id());
  seed("Get", get);
  seed("Watch", get);
  const std::vector<proto::testing::RandomCall> calls = proto::testing::CallServicesWithRandomRequests(
      Channel(), {"strata.v1.JobService", "strata.v1.DocumentService"}, 40, 20261130, o, 3.0);
  EXPECT_EQ(calls.size(), 40u * (6 + 6));
  const std::vector<proto::testing::RandomCall> bad = proto::testing::UnexpectedCodes(calls);
  EXPECT_TRUE(bad.empty()) << proto::testing::Describe(bad) << server_->Err();
  EXPECT_GT(proto::testing::CountAnswered(calls), 10);
  ASSERT_FALSE(server_->Exited()) << server_->Err();
  // The document may have been deleted (Delete names it now and then); then it is uploaded again.
  {
    grpc::ClientContext ctx;
    Deadline(&ctx, 10);
    v1::DocumentInfo now;
    if (!v1::DocumentService::NewStub(Channel())->Get(&ctx, get, &now).ok()) UploadTokens(doc);
  }
  const JobRun after = Generate(ask);
  ASSERT_EQ(after.final.state(), v1::JobInfo::DONE) << after.final.error_message() << server_->Err();
  EXPECT_EQ(after.tokens, before.tokens);
}

// Runs last (gtest runs tests in declaration order): SIGTERM drains and exits 0.
TEST_F(ServeTest, ZzSigtermStops) {
  auto code = server_->StopWith(SIGTERM, std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value()) << server_->Err();
  EXPECT_EQ(*code, 0) << server_->Err();
}

}  // namespace
}  // namespace strata
