// The transport cost of one sharded decode layer: the leader sends a LayerQuery over a
// ShardSelection stream and waits for the SelectionResponse, against a peer that answers at once
// (no attention), on loopback gRPC. Isolates what a sharded decode step pays per layer and peer
// on top of the peer's attention (bench/RESULTS.md).
//
//   shard_rtt_bench [--heads 32] [--dim 128] [--rounds 4000] [--modes reader,direct,async,tcp,link]
//                   [--peer sync|callback] [--peers 1]
//
// The peer: --peer sync (default) a synchronous ShardSelection service, as worker/service.cc's
// (a handler thread blocked in Read per stream); --peer callback the callback API (a reactor
// whose read completions build the answer and start its write on gRPC's own thread).
// Modes (the leader's side):
//   reader  as LeaderAttention did until session 31: Write, then a reader thread that Reads every
//           answer into a queue the leader waits on with a deadline (absl::Mutex);
//   direct  as LeaderAttention does since: Write, then Read on the leader's own thread (its
//           deadline is a watchdog's, off the round trip's path);
//   async   the asynchronous API: Write and Read started on one CompletionQueue that the leader's
//           own thread waits on with a deadline (AsyncNext);
//   tcp     the floor: the same bytes (query, then answer) over a plain loopback TCP socket with
//           TCP_NODELAY, no gRPC;
//   link    the selection link (worker/selection_link.h: framed SelectionRequest /
//           SelectionResponse messages over TCP), against a link server answering the same way
//           (the leader's wait spins for STRATA_SELECTION_LINK_SPIN_US, as a worker's).
// --peers N > 1 times one layer's fan-out to N peers (a server each) in the direct and async
// modes: from the first write to the last answer (RunFanout).
// Prints, per mode, the round trip's median, 90th and 99th percentile in microseconds.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "strata/v1/internal.grpc.pb.h"
#include "worker/selection_link.h"

namespace {

namespace v1 = strata::v1;

// The answer to a query: o / lse of its shape (o the query's own bytes, lse zeros).
void EchoAnswer(const v1::LayerQuery& q, int heads, v1::SelectionResponse* resp) {
  resp->set_step(q.step());
  resp->set_layer(q.layer());
  resp->set_o(q.q());  // same size as o
  resp->set_lse(std::string(static_cast<size_t>(q.num_tokens()) * heads * sizeof(float), '\0'));
}

// Answers each LayerQuery at once with o / lse of the query's shape.
class EchoSelection final : public v1::ShardSelection::Service {
 public:
  explicit EchoSelection(int heads) : heads_(heads) {}
  grpc::Status Select(grpc::ServerContext* context,
                      grpc::ServerReaderWriter<v1::SelectionResponse, v1::SelectionRequest>* stream) override {
    v1::SelectionRequest req;
    while (!context->IsCancelled() && stream->Read(&req)) {
      if (!req.has_query()) continue;  // the open message
      v1::SelectionResponse resp;
      EchoAnswer(req.query(), heads_, &resp);
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }

 private:
  const int heads_;
};

// The same answers from gRPC's callback API: each read completes on a gRPC thread, which builds
// the answer and starts its write there (no hand-over to a handler thread blocked in Read).
class CallbackEchoSelection final : public v1::ShardSelection::CallbackService {
 public:
  explicit CallbackEchoSelection(int heads) : heads_(heads) {}
  grpc::ServerBidiReactor<v1::SelectionRequest, v1::SelectionResponse>* Select(
      grpc::CallbackServerContext* context) override {
    class Reactor final : public grpc::ServerBidiReactor<v1::SelectionRequest, v1::SelectionResponse> {
     public:
      explicit Reactor(int heads) : heads_(heads) { StartRead(&req_); }
      void OnReadDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        if (!req_.has_query()) {  // the open message
          StartRead(&req_);
          return;
        }
        EchoAnswer(req_.query(), heads_, &resp_);
        StartWrite(&resp_);
      }
      void OnWriteDone(bool ok) override {
        if (!ok) {
          Finish(grpc::Status::OK);
          return;
        }
        StartRead(&req_);
      }
      void OnDone() override { delete this; }

     private:
      const int heads_;
      v1::SelectionRequest req_;
      v1::SelectionResponse resp_;
    };
    return new Reactor(heads_);
  }

 private:
  const int heads_;
};

struct Stats {
  double p50 = 0, p90 = 0, p99 = 0;
};
Stats Percentiles(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double f) { return us[std::min(us.size() - 1, static_cast<size_t>(f * us.size()))]; };
  return {at(0.5), at(0.9), at(0.99)};
}

// Round i's one-token query (layer i % 32).
v1::SelectionRequest QueryRequest(int i, const std::vector<float>& q) {
  v1::SelectionRequest req;
  v1::LayerQuery* lq = req.mutable_query();
  lq->set_step(static_cast<uint64_t>(i));
  lq->set_layer(static_cast<uint32_t>(i % 32));
  lq->set_num_tokens(1);
  lq->set_q(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float));
  return req;
}

// Moves all n bytes at p through fd (write, else read); false when the socket fails or closes.
bool TransferAll(int fd, char* p, size_t n, bool write) {
  while (n > 0) {
    const ssize_t r = write ? ::write(fd, p, n) : ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A ShardSelection stub for `address` without message size limits.
std::unique_ptr<v1::ShardSelection::Stub> SelectionStub(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return v1::ShardSelection::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

// The tcp mode: a thread echoes query-sized messages with answer-sized ones on one connection.
int RunTcp(int heads, int dim, int rounds) {
  const size_t q_bytes = static_cast<size_t>(heads) * dim * sizeof(float);
  const size_t a_bytes = q_bytes + static_cast<size_t>(heads) * sizeof(float);
  const int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (ls < 0 || bind(ls, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(ls, 1) != 0 ||
      getsockname(ls, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::fprintf(stderr, "tcp: cannot listen on loopback\n");
    return 1;
  }
  const int one = 1;
  std::thread peer([&] {
    const int c = accept(ls, nullptr, nullptr);
    if (c < 0) return;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::vector<char> in(q_bytes), out(a_bytes);
    while (TransferAll(c, in.data(), q_bytes, false) && TransferAll(c, out.data(), a_bytes, true)) {
    }
    close(c);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::fprintf(stderr, "tcp: cannot connect\n");
    return 1;
  }
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> q(q_bytes, 1), a(a_bytes);
  std::vector<double> us;
  const int warmup = std::min(200, rounds / 4);
  for (int i = 0; i < warmup + rounds; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!TransferAll(fd, q.data(), q_bytes, true) || !TransferAll(fd, a.data(), a_bytes, false)) {
      std::fprintf(stderr, "tcp round %d failed\n", i);
      return 1;
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  close(fd);
  peer.join();
  close(ls);
  const Stats s = Percentiles(us);
  std::printf("RTT %-8s heads %d dim %d rounds %d: p50 %.1f us  p90 %.1f us  p99 %.1f us\n", "tcp", heads, dim,
              rounds, s.p50, s.p90, s.p99);
  return 0;
}

// The link mode: a SelectionLinkServer answering each query at once, as EchoSelection does.
int RunLink(int heads, int dim, int rounds) {
  auto server = strata::worker::SelectionLinkServer::Start(
      "127.0.0.1:0", [heads](const auto& read, const auto& write) {
        v1::SelectionRequest req;
        while (read(&req)) {
          if (!req.has_query()) continue;  // the open message
          v1::SelectionResponse resp;
          EchoAnswer(req.query(), heads, &resp);
          if (!write(resp)) break;
        }
        return absl::OkStatus();
      });
  if (!server.ok()) {
    std::fprintf(stderr, "link: %s\n", server.status().ToString().c_str());
    return 1;
  }
  auto link = strata::worker::SelectionLink::Connect("127.0.0.1:" + std::to_string((*server)->port()),
                                                     absl::Seconds(5));
  v1::SelectionRequest open;
  open.mutable_open()->set_job_id("rtt");
  if (!link.ok() || !(*link)->Write(open.SerializeAsString())) {
    std::fprintf(stderr, "link: cannot connect\n");
    return 1;
  }
  const std::vector<float> q(static_cast<size_t>(heads) * dim, 1.0f);
  std::vector<double> us;
  std::string bytes, why;
  v1::SelectionResponse resp;
  const int warmup = std::min(200, rounds / 4);
  for (int i = 0; i < warmup + rounds; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    QueryRequest(i, q).SerializeToString(&bytes);
    if (!(*link)->Write(bytes) || !(*link)->Read(absl::Now() + absl::Seconds(10), &resp, &why) ||
        resp.step() != static_cast<uint64_t>(i) || resp.o().size() != q.size() * sizeof(float)) {
      std::fprintf(stderr, "link round %d failed: %s\n", i, why.c_str());
      return 1;
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  link->reset();
  (*server)->Shutdown();
  const Stats s = Percentiles(us);
  std::printf("RTT %-8s heads %d dim %d rounds %d: p50 %.1f us  p90 %.1f us  p99 %.1f us\n", "link", heads, dim,
              rounds, s.p50, s.p90, s.p99);
  return 0;
}

// The async mode: one stream on a CompletionQueue; tags 1 = start, 2 = write, 3 = read.
int RunAsync(const std::string& address, int heads, int dim, int rounds) {
  auto stub = SelectionStub(address);
  grpc::ClientContext context;
  grpc::CompletionQueue cq;
  auto wait = [&](void* want) {
    void* tag = nullptr;
    bool ok = false;
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
    return cq.AsyncNext(&tag, &ok, deadline) == grpc::CompletionQueue::GOT_EVENT && ok && tag == want;
  };
  void* const kStart = reinterpret_cast<void*>(1);
  void* const kWrite = reinterpret_cast<void*>(2);
  void* const kRead = reinterpret_cast<void*>(3);
  auto stream = stub->AsyncSelect(&context, &cq, kStart);
  if (!wait(kStart)) return 1;
  v1::SelectionRequest open;
  open.mutable_open()->set_job_id("rtt");
  stream->Write(open, kWrite);
  if (!wait(kWrite)) return 1;
  std::vector<float> q(static_cast<size_t>(heads) * dim, 0.5f);
  std::vector<double> us;
  const int warmup = std::min(200, rounds / 4);
  for (int i = 0; i < warmup + rounds; ++i) {
    const v1::SelectionRequest req = QueryRequest(i, q);
    v1::SelectionResponse resp;
    const auto t0 = std::chrono::steady_clock::now();
    stream->Write(req, kWrite);
    stream->Read(&resp, kRead);
    // Both complete, in either order.
    int done = 0;
    while (done < 2) {
      void* tag = nullptr;
      bool ok = false;
      const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
      if (cq.AsyncNext(&tag, &ok, deadline) != grpc::CompletionQueue::GOT_EVENT || !ok) {
        std::fprintf(stderr, "async round %d failed\n", i);
        return 1;
      }
      ++done;
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (resp.step() != static_cast<uint64_t>(i) || resp.o().size() != q.size() * sizeof(float)) {
      std::fprintf(stderr, "bad answer at round %d\n", i);
      return 1;
    }
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  context.TryCancel();
  grpc::Status status;
  stream->Finish(&status, kStart);
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  const Stats s = Percentiles(us);
  std::printf("RTT %-8s heads %d dim %d rounds %d: p50 %.1f us  p90 %.1f us  p99 %.1f us\n", "async", heads, dim,
              rounds, s.p50, s.p90, s.p99);
  return 0;
}

// --peers N > 1: one layer's fan-out to N peers (one stream and server each). direct: the query
// written to each peer in turn with the synchronous API, then each answer read, as
// LeaderAttention does; async: every write and read started at once on one CompletionQueue.
// The round trip is from the first write to the last answer.
int RunFanout(const std::vector<std::string>& addresses, const std::string& mode, int heads, int dim, int rounds) {
  const int n = static_cast<int>(addresses.size());
  std::vector<std::unique_ptr<v1::ShardSelection::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  for (const std::string& a : addresses) {
    stubs.push_back(SelectionStub(a));
    contexts.push_back(std::make_unique<grpc::ClientContext>());
  }
  v1::SelectionRequest open;
  open.mutable_open()->set_job_id("rtt");
  std::vector<float> q(static_cast<size_t>(heads) * dim, 0.5f);
  std::vector<double> us;
  const int warmup = std::min(200, rounds / 4);
  std::vector<v1::SelectionResponse> resp(static_cast<size_t>(n));
  auto check = [&](int i) {
    for (const v1::SelectionResponse& r : resp) {
      if (r.step() != static_cast<uint64_t>(i) || r.o().size() != q.size() * sizeof(float)) {
        std::fprintf(stderr, "bad answer at round %d\n", i);
        return false;
      }
    }
    return true;
  };
  if (mode == "direct") {
    std::vector<std::unique_ptr<grpc::ClientReaderWriter<v1::SelectionRequest, v1::SelectionResponse>>> streams;
    for (int p = 0; p < n; ++p) {
      streams.push_back(stubs[p]->Select(contexts[p].get()));
      if (!streams.back()->Write(open)) return 1;
    }
    for (int i = 0; i < warmup + rounds; ++i) {
      const v1::SelectionRequest req = QueryRequest(i, q);
      const auto t0 = std::chrono::steady_clock::now();
      for (int p = 0; p < n; ++p) {
        if (!streams[p]->Write(req)) return 1;
      }
      for (int p = 0; p < n; ++p) {
        if (!streams[p]->Read(&resp[p])) return 1;
      }
      const auto t1 = std::chrono::steady_clock::now();
      if (!check(i)) return 1;
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    for (int p = 0; p < n; ++p) {
      streams[p]->WritesDone();
      contexts[p]->TryCancel();
      streams[p]->Finish().ok();
    }
  } else {
    grpc::CompletionQueue cq;
    std::vector<std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::SelectionRequest, v1::SelectionResponse>>> streams;
    auto wait_all = [&](int events) {
      for (int e = 0; e < events; ++e) {
        void* tag = nullptr;
        bool ok = false;
        const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(5);
        if (cq.AsyncNext(&tag, &ok, deadline) != grpc::CompletionQueue::GOT_EVENT || !ok) return false;
      }
      return true;
    };
    for (int p = 0; p < n; ++p) streams.push_back(stubs[p]->AsyncSelect(contexts[p].get(), &cq, nullptr));
    if (!wait_all(n)) return 1;
    for (int p = 0; p < n; ++p) streams[p]->Write(open, nullptr);
    if (!wait_all(n)) return 1;
    for (int i = 0; i < warmup + rounds; ++i) {
      const v1::SelectionRequest req = QueryRequest(i, q);
      const auto t0 = std::chrono::steady_clock::now();
      for (int p = 0; p < n; ++p) {
        streams[p]->Write(req, nullptr);
        streams[p]->Read(&resp[p], nullptr);
      }
      if (!wait_all(2 * n)) {
        std::fprintf(stderr, "async fan-out round %d failed\n", i);
        return 1;
      }
      const auto t1 = std::chrono::steady_clock::now();
      if (!check(i)) return 1;
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    for (int p = 0; p < n; ++p) contexts[p]->TryCancel();
    std::vector<grpc::Status> status(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) streams[p]->Finish(&status[p], nullptr);
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
  }
  const Stats s = Percentiles(us);
  std::printf("RTT %-8s heads %d dim %d rounds %d peers %d: p50 %.1f us  p90 %.1f us  p99 %.1f us\n", mode.c_str(),
              heads, dim, rounds, n, s.p50, s.p90, s.p99);
  return 0;
}

int Run(const std::string& address, const std::string& mode, int heads, int dim, int rounds) {
  auto stub = SelectionStub(address);
  grpc::ClientContext context;
  auto stream = stub->Select(&context);
  v1::SelectionRequest open;
  open.mutable_open()->set_job_id("rtt");
  if (!stream->Write(open)) {
    std::fprintf(stderr, "open failed\n");
    return 1;
  }
  // The reader mode's queue, as LeaderAttention::Part keeps it.
  absl::Mutex mu;
  std::deque<v1::SelectionResponse> answers;
  bool closed = false;
  std::thread reader;
  if (mode == "reader") {
    reader = std::thread([&] {
      v1::SelectionResponse resp;
      while (stream->Read(&resp)) {
        absl::MutexLock lock(&mu);
        answers.push_back(std::move(resp));
        resp = v1::SelectionResponse();
      }
      absl::MutexLock lock(&mu);
      closed = true;
    });
  }
  std::vector<float> q(static_cast<size_t>(heads) * dim, 0.5f);
  std::vector<double> us;
  const int warmup = std::min(200, rounds / 4);
  for (int i = 0; i < warmup + rounds; ++i) {
    const v1::SelectionRequest req = QueryRequest(i, q);
    const auto t0 = std::chrono::steady_clock::now();
    if (!stream->Write(req)) {
      std::fprintf(stderr, "write failed\n");
      return 1;
    }
    v1::SelectionResponse resp;
    if (mode == "reader") {
      absl::MutexLock lock(&mu);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !answers.empty() || closed; };
      if (!mu.AwaitWithDeadline(absl::Condition(&ready), absl::Now() + absl::Seconds(5)) || answers.empty()) {
        std::fprintf(stderr, "no answer\n");
        return 1;
      }
      resp = std::move(answers.front());
      answers.pop_front();
    } else if (!stream->Read(&resp)) {
      std::fprintf(stderr, "read failed\n");
      return 1;
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (resp.step() != static_cast<uint64_t>(i) || resp.o().size() != q.size() * sizeof(float)) {
      std::fprintf(stderr, "bad answer at round %d\n", i);
      return 1;
    }
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  stream->WritesDone();
  context.TryCancel();
  if (reader.joinable()) reader.join();
  stream->Finish().ok();
  const Stats s = Percentiles(us);
  std::printf("RTT %-8s heads %d dim %d rounds %d: p50 %.1f us  p90 %.1f us  p99 %.1f us\n", mode.c_str(), heads,
              dim, rounds, s.p50, s.p90, s.p99);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int heads = 32, dim = 128, rounds = 4000, peers = 1;
  std::string modes = "reader,direct,async,tcp,link", peer = "sync";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    bool ok = true;
    if (flag == "--heads") ok = absl::SimpleAtoi(value, &heads);
    else if (flag == "--dim") ok = absl::SimpleAtoi(value, &dim);
    else if (flag == "--rounds") ok = absl::SimpleAtoi(value, &rounds);
    else if (flag == "--modes") modes = value;
    else if (flag == "--peer") peer = value;
    else if (flag == "--peers") ok = absl::SimpleAtoi(value, &peers);
    else ok = false;
    if (!ok || heads < 1 || dim < 1 || rounds < 1 || (peer != "sync" && peer != "callback") || peers < 1 ||
        peers > 16) {
      std::fprintf(stderr, "usage: shard_rtt_bench [--heads 32] [--dim 128] [--rounds 4000] "
                   "[--modes reader,direct,async,tcp,link] [--peer sync|callback] [--peers 1..16]\n");
      return 2;
    }
  }
  // One server per peer (each service instance serves its own server).
  std::vector<std::unique_ptr<EchoSelection>> services;
  std::vector<std::unique_ptr<CallbackEchoSelection>> callback_services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::string> addresses;
  for (int p = 0; p < peers; ++p) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(256 << 20);
    if (peer == "callback") {
      callback_services.push_back(std::make_unique<CallbackEchoSelection>(heads));
      builder.RegisterService(callback_services.back().get());
    } else {
      services.push_back(std::make_unique<EchoSelection>(heads));
      builder.RegisterService(services.back().get());
    }
    servers.push_back(builder.BuildAndStart());
    if (servers.back() == nullptr || port == 0) {
      std::fprintf(stderr, "cannot serve on 127.0.0.1\n");
      return 1;
    }
    addresses.push_back("127.0.0.1:" + std::to_string(port));
  }
  for (const std::string& mode : std::vector<std::string>(absl::StrSplit(modes, ','))) {
    if (mode != "reader" && mode != "direct" && mode != "async" && mode != "tcp" && mode != "link") {
      std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
      return 2;
    }
    if (peers > 1 && mode != "direct" && mode != "async") continue;  // fan-out: direct and async only
    const int rc = peers > 1        ? RunFanout(addresses, mode, heads, dim, rounds)
                   : mode == "async" ? RunAsync(addresses[0], heads, dim, rounds)
                   : mode == "tcp"   ? RunTcp(heads, dim, rounds)
                   : mode == "link"  ? RunLink(heads, dim, rounds)
                                     : Run(addresses[0], mode, heads, dim, rounds);
    if (rc != 0) return rc;
  }
  for (auto& server : servers) server->Shutdown(std::chrono::system_clock::now());
  return 0;
}
