// The selection link's transport alone (worker/selection_link.h), with serving functions of the
// test's own instead of a worker: answers in order, a server's error as the client's reason, the
// read deadline, Shutdown ending live streams and refusing new ones, bad addresses, and bytes no
// link sends (malformed frames, random bytes, headers of huge frames) answered without harm.
#include "worker/selection_link.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <random>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::worker {
namespace {

using ::strata::testing::StatusIs;

v1::SelectionRequest Open() {
  v1::SelectionRequest r;
  r.mutable_open()->set_job_id("link-test");
  return r;
}

v1::SelectionRequest Query(uint64_t step, uint32_t layer, const std::string& q) {
  v1::SelectionRequest r;
  r.mutable_query()->set_step(step);
  r.mutable_query()->set_layer(layer);
  r.mutable_query()->set_num_tokens(1);
  r.mutable_query()->set_q(q);
  return r;
}

// Answers every query after the open with its step, layer and bytes (o = q); counts the streams
// that ended.
struct Echo {
  std::atomic<int> ended{0};
  SelectionStreamFn Fn() {
    return [this](const auto& read, const auto& write) {
      v1::SelectionRequest req;
      while (read(&req)) {
        if (!req.has_query()) continue;
        v1::SelectionResponse resp;
        resp.set_step(req.query().step());
        resp.set_layer(req.query().layer());
        resp.set_o(req.query().q());
        if (!write(resp)) break;
      }
      ++ended;
      return absl::OkStatus();
    };
  }
};

std::string Address(const SelectionLinkServer& s) { return absl::StrCat("127.0.0.1:", s.port()); }

// A plain TCP connection to a server on loopback, for bytes that SelectionLink never sends.
class RawConnection {
 public:
  explicit RawConnection(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    const timeval ten_s{10, 0};
    if (connected_) setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &ten_s, sizeof(ten_s));
  }
  ~RawConnection() {
    if (fd_ >= 0) close(fd_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return connected_; }
  bool Send(const std::string& bytes) {
    for (size_t at = 0; at < bytes.size();) {
      const ssize_t r = send(fd_, bytes.data() + at, bytes.size() - at, MSG_NOSIGNAL);
      if (r <= 0) return false;
      at += static_cast<size_t>(r);
    }
    return true;
  }
  void EndWrites() { shutdown(fd_, SHUT_WR); }
  // Everything the server sends until it closes the connection; "<timeout>" appended when it
  // has not closed it within 10 s.
  std::string ReadToEnd() {
    std::string out;
    char buf[4096];
    while (true) {
      const ssize_t r = recv(fd_, buf, sizeof(buf), 0);
      if (r == 0) return out;
      if (r < 0) return out + "<timeout>";
      out.append(buf, static_cast<size_t>(r));
    }
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// The server's stream count once it is `want`, or after 10 s of waiting for it.
int StreamsOnceThey(const SelectionLinkServer& server, int want) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (server.streams() != want && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  return server.streams();
}

constexpr char kLinkPreface[] = "STL1";

// A frame as the wire format has it: length (or `length` when not negative), kind, 3 zero bytes.
std::string Frame(uint8_t kind, const std::string& payload, int64_t length = -1) {
  const uint32_t len = length >= 0 ? static_cast<uint32_t>(length) : static_cast<uint32_t>(payload.size());
  std::string f(8, '\0');
  for (int i = 0; i < 4; ++i) f[i] = static_cast<char>(len >> (8 * i));
  f[4] = static_cast<char>(kind);
  return f + payload;
}

// The frames in `bytes` as (kind, payload); false when the bytes are not whole frames.
bool SplitFrames(const std::string& bytes, std::vector<std::pair<uint8_t, std::string>>* frames) {
  for (size_t at = 0; at < bytes.size();) {
    if (bytes.size() - at < 8) return false;
    uint32_t len = 0;
    for (int i = 0; i < 4; ++i) len |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
    if (bytes[at + 5] != 0 || bytes[at + 6] != 0 || bytes[at + 7] != 0 || bytes.size() - at - 8 < len) return false;
    frames->emplace_back(static_cast<uint8_t>(bytes[at + 4]), bytes.substr(at + 8, len));
    at += 8 + len;
  }
  return true;
}

// The stream's end that `bytes` hold: the status of its one error frame (kind 3); INTERNAL
// naming what was wrong when the bytes are not exactly that.
absl::Status ErrorFrameOf(const std::string& bytes) {
  std::vector<std::pair<uint8_t, std::string>> frames;
  if (!SplitFrames(bytes, &frames)) return absl::InternalError(absl::StrCat("not whole frames: ", bytes.size(), " bytes"));
  if (frames.size() != 1 || frames[0].first != 3 || frames[0].second.size() < 4) {
    return absl::InternalError(absl::StrCat(frames.size(), " frames, not one error frame"));
  }
  uint32_t code = 0;
  for (int i = 0; i < 4; ++i) code |= static_cast<uint32_t>(static_cast<unsigned char>(frames[0].second[i])) << (8 * i);
  return absl::Status(static_cast<absl::StatusCode>(code), frames[0].second.substr(4));
}

// The resident set of this process, bytes (0 when /proc cannot say).
int64_t ResidentBytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long pages = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : 0;
}

TEST(SelectionLinkTest, AnswersComeBackInOrderOnEachConnection) {
  Echo echo;
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn()));
  ASSERT_GT(server->port(), 0);
  STRATA_ASSERT_OK_AND_ASSIGN(auto a, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  STRATA_ASSERT_OK_AND_ASSIGN(auto b, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  ASSERT_TRUE(a->Write(Open().SerializeAsString()));
  ASSERT_TRUE(b->Write(Open().SerializeAsString()));
  // Queries of 0 bytes to 1 MiB, several in flight on one connection before its answers are read.
  const std::string big(1 << 20, 'x');
  for (uint64_t step = 0; step < 3; ++step) {
    for (uint32_t layer = 0; layer < 4; ++layer) {
      ASSERT_TRUE(a->Write(Query(step, layer, layer == 3 ? big : std::string(layer * 100, 'q')).SerializeAsString()));
    }
    ASSERT_TRUE(b->Write(Query(step, 9, "b").SerializeAsString()));
    for (uint32_t layer = 0; layer < 4; ++layer) {
      v1::SelectionResponse resp;
      std::string why;
      ASSERT_TRUE(a->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
      EXPECT_EQ(resp.step(), step);
      EXPECT_EQ(resp.layer(), layer);
      EXPECT_EQ(resp.o().size(), layer == 3 ? big.size() : layer * 100);
    }
    v1::SelectionResponse resp;
    std::string why;
    ASSERT_TRUE(b->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
    EXPECT_EQ(resp.o(), "b");
  }
  a.reset();  // the client closes: its stream ends on the server
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (echo.ended.load() < 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(echo.ended.load(), 1);
}

TEST(SelectionLinkTest, EndsThatSpinBeforeBlockingAnswerTheSame) {
  setenv("STRATA_SELECTION_LINK_SPIN_US", "300", 1);  // read when a server or link is made
  Echo echo;
  auto server = SelectionLinkServer::Start("127.0.0.1:0", echo.Fn());
  auto link = server.ok() ? SelectionLink::Connect(Address(**server), absl::Seconds(5))
                          : absl::StatusOr<std::unique_ptr<SelectionLink>>(server.status());
  unsetenv("STRATA_SELECTION_LINK_SPIN_US");
  STRATA_ASSERT_OK(link.status());
  ASSERT_TRUE((*link)->Write(Open().SerializeAsString()));
  for (uint64_t step = 0; step < 50; ++step) {
    ASSERT_TRUE((*link)->Write(Query(step, 1, "q").SerializeAsString()));
    if (step % 10 == 0) absl::SleepFor(absl::Milliseconds(2));  // past the spin: the reads block
    v1::SelectionResponse resp;
    std::string why;
    ASSERT_TRUE((*link)->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
    EXPECT_EQ(resp.step(), step);
  }
}

TEST(SelectionLinkTest, TheServersErrorIsTheClientsReason) {
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto server, SelectionLinkServer::Start("127.0.0.1:0", [](const auto& read, const auto&) {
        v1::SelectionRequest req;
        if (!read(&req)) return absl::OkStatus();
        return absl::NotFoundError("no such shard");
      }));
  STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  ASSERT_TRUE(link->Write(Open().SerializeAsString()));
  v1::SelectionResponse resp;
  std::string why;
  EXPECT_FALSE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why));
  EXPECT_NE(why.find("NOT_FOUND"), std::string::npos) << why;
  EXPECT_NE(why.find("no such shard"), std::string::npos) << why;
  // The link is unusable after a failed read.
  EXPECT_FALSE(link->Write(Query(0, 0, "q").SerializeAsString()));
  EXPECT_FALSE(link->Read(absl::Now() + absl::Seconds(1), &resp, &why));
}

TEST(SelectionLinkTest, ReadGivesUpAtItsDeadline) {
  // A holder that reads every query and never answers.
  STRATA_ASSERT_OK_AND_ASSIGN(auto server,
                              SelectionLinkServer::Start("127.0.0.1:0", [](const auto& read, const auto&) {
                                v1::SelectionRequest req;
                                while (read(&req)) {
                                }
                                return absl::OkStatus();
                              }));
  STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  ASSERT_TRUE(link->Write(Open().SerializeAsString()));
  ASSERT_TRUE(link->Write(Query(0, 0, "q").SerializeAsString()));
  v1::SelectionResponse resp;
  std::string why;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(link->Read(absl::Now() + absl::Milliseconds(200), &resp, &why));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(why, "no answer before the deadline");
  EXPECT_GE(waited, 0.15);
  EXPECT_LT(waited, 5.0);
}

TEST(SelectionLinkTest, ShutdownEndsLiveStreamsAndRefusesNewOnes) {
  Echo echo;
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn()));
  const std::string address = Address(*server);
  STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(address, absl::Seconds(5)));
  ASSERT_TRUE(link->Write(Open().SerializeAsString()));
  ASSERT_TRUE(link->Write(Query(0, 0, "q").SerializeAsString()));
  v1::SelectionResponse resp;
  std::string why;
  ASSERT_TRUE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
  server->Shutdown();
  EXPECT_EQ(echo.ended.load(), 1);  // Shutdown joined the stream's thread
  EXPECT_FALSE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why));
  EXPECT_EQ(why, "link closed");
  EXPECT_THAT(SelectionLink::Connect(address, absl::Seconds(1)).status(), StatusIs(absl::StatusCode::kUnavailable));
  server->Shutdown();  // idempotent
}

TEST(SelectionLinkTest, StreamsPastTheLimitAreRefused) {
  Echo echo;
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn(), /*max_streams=*/2));
  std::vector<std::unique_ptr<SelectionLink>> links;
  for (int i = 0; i < 3; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
    links.push_back(std::move(link));
    if (i == 2) break;  // refused at once: the server does not read it
    ASSERT_TRUE(links.back()->Write(Open().SerializeAsString()));
    ASSERT_TRUE(links.back()->Write(Query(0, 0, "q").SerializeAsString()));
    // The accept loop has registered this connection before the next one comes.
    v1::SelectionResponse resp;
    std::string why;
    ASSERT_TRUE(links.back()->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
  }
  v1::SelectionResponse resp;
  std::string why;
  EXPECT_FALSE(links[2]->Read(absl::Now() + absl::Seconds(10), &resp, &why));
  EXPECT_NE(why.find("RESOURCE_EXHAUSTED"), std::string::npos) << why;
  EXPECT_EQ(server->streams(), 2);
  // A slot frees when a stream ends (the serving function has returned and the server has
  // marked the stream done; the function's own counter moves before that).
  links[0].reset();
  ASSERT_EQ(StreamsOnceThey(*server, 1), 1);
  EXPECT_EQ(echo.ended.load(), 1);
  STRATA_ASSERT_OK_AND_ASSIGN(auto again, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  ASSERT_TRUE(again->Write(Open().SerializeAsString()));
  ASSERT_TRUE(again->Write(Query(1, 0, "q").SerializeAsString()));
  ASSERT_TRUE(again->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
  EXPECT_EQ(resp.step(), 1u);
  EXPECT_THAT(SelectionLinkServer::Start("127.0.0.1:0", echo.Fn(), 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(SelectionLinkTest, MalformedBytesEndTheStreamWithInvalidArgument) {
  Echo echo;
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn()));
  const std::string open = Open().SerializeAsString();
  struct Case {
    const char* what;
    std::string bytes;
    const char* reason;
  };
  std::string reserved = Frame(1, open);
  reserved[6] = 1;  // a header's reserved bytes are zero
  const std::vector<Case> cases = {
      {"bad preface", "HTTP/1.1 GET /", "bad preface"},
      {"unknown kind", kLinkPreface + Frame(9, open), "not a SelectionRequest"},
      {"a response frame from the client", kLinkPreface + Frame(2, open), "not a SelectionRequest"},
      {"payload that does not parse", kLinkPreface + Frame(1, std::string("\xff\xff\xff\xff", 4)),
       "not a SelectionRequest"},
      {"frame above the limit", kLinkPreface + Frame(1, "", int64_t{kSelectionLinkMaxFrame} + 1), "malformed frame"},
      {"reserved header bytes set", kLinkPreface + reserved, "malformed frame"},
      {"closed mid-frame", kLinkPreface + Frame(1, "abc", 100), "malformed frame"},
      {"closed mid-frame after an open", kLinkPreface + Frame(1, open) + Frame(1, "abc", 100), "malformed frame"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawConnection raw(server->port());
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.Send(c.bytes));
    raw.EndWrites();
    const absl::Status end = ErrorFrameOf(raw.ReadToEnd());
    EXPECT_EQ(end.code(), absl::StatusCode::kInvalidArgument) << end;
    EXPECT_NE(end.message().find(c.reason), std::string::npos) << end;
  }
  {
    // A stream that ends between frames ends quietly: no error frame, and the serving function
    // saw its end.
    RawConnection raw(server->port());
    ASSERT_TRUE(raw.connected());
    ASSERT_TRUE(raw.Send(kLinkPreface + Frame(1, open) + Frame(1, Query(7, 2, "xyz").SerializeAsString())));
    raw.EndWrites();
    std::vector<std::pair<uint8_t, std::string>> frames;
    ASSERT_TRUE(SplitFrames(raw.ReadToEnd(), &frames));
    ASSERT_EQ(frames.size(), 1u);
    EXPECT_EQ(frames[0].first, 2);
    v1::SelectionResponse resp;
    ASSERT_TRUE(resp.ParseFromString(frames[0].second));
    EXPECT_EQ(resp.step(), 7u);
    EXPECT_EQ(resp.o(), "xyz");
  }
  EXPECT_EQ(StreamsOnceThey(*server, 0), 0);
}

TEST(SelectionLinkTest, RandomBytesNeverHarmTheServer) {
  Echo echo;
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn()));
  std::mt19937 rng(20261130);
  const std::string query = Query(3, 1, "q").SerializeAsString();
  for (int i = 0; i < 200; ++i) {
    SCOPED_TRACE(i);
    std::string bytes = kLinkPreface;
    if (i % 4 == 0) bytes.clear();  // random bytes from the first one
    const int frames = static_cast<int>(rng() % 4);
    for (int f = 0; f < frames; ++f) {
      std::string payload(rng() % 64, '\0');
      for (char& ch : payload) ch = static_cast<char>(rng());
      if (rng() % 3 == 0) payload = query;  // now and then a real request among the noise
      const uint8_t kind = static_cast<uint8_t>(rng() % 3 == 0 ? rng() : 1);
      const int64_t length = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 200) : -1;
      bytes += Frame(kind, payload, length);
    }
    std::string tail(rng() % 16, '\0');
    for (char& ch : tail) ch = static_cast<char>(rng());
    bytes += tail;
    RawConnection raw(server->port());
    ASSERT_TRUE(raw.connected());
    raw.Send(bytes);  // the server may close before taking every byte
    raw.EndWrites();
    const std::string reply = raw.ReadToEnd();
    // Whatever came back is whole frames: answers (kind 2), then at most one error frame last.
    std::vector<std::pair<uint8_t, std::string>> got;
    ASSERT_TRUE(SplitFrames(reply, &got)) << reply.size() << " bytes";
    for (size_t k = 0; k < got.size(); ++k) {
      EXPECT_TRUE(got[k].first == 2 || (got[k].first == 3 && k + 1 == got.size())) << int{got[k].first};
    }
  }
  // The server still serves a well-behaved link, and no stream is left behind.
  STRATA_ASSERT_OK_AND_ASSIGN(auto link, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  ASSERT_TRUE(link->Write(Open().SerializeAsString()));
  ASSERT_TRUE(link->Write(Query(9, 0, "fine").SerializeAsString()));
  v1::SelectionResponse resp;
  std::string why;
  ASSERT_TRUE(link->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
  EXPECT_EQ(resp.o(), "fine");
  link.reset();
  EXPECT_EQ(StreamsOnceThey(*server, 0), 0);
}

TEST(SelectionLinkTest, HeadersOfHugeFramesCostNoMemoryUntilTheirBytesCome) {
  Echo echo;
  STRATA_ASSERT_OK_AND_ASSIGN(auto server, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn()));
  const int64_t before = ResidentBytes();
  ASSERT_GT(before, 0);
  // Four connections each announce a frame of the largest size and send one byte of it.
  std::vector<std::unique_ptr<RawConnection>> raws;
  for (int i = 0; i < 4; ++i) {
    raws.push_back(std::make_unique<RawConnection>(server->port()));
    ASSERT_TRUE(raws.back()->connected());
    ASSERT_TRUE(raws.back()->Send(kLinkPreface + Frame(1, "x", kSelectionLinkMaxFrame)));
  }
  ASSERT_EQ(StreamsOnceThey(*server, 4), 4);
  absl::SleepFor(absl::Milliseconds(200));  // the serving threads have read the headers
  // Reading payloads as their bytes come holds at most a step per connection, not 4 x 256 MiB.
  EXPECT_LT(ResidentBytes() - before, int64_t{64} << 20);
  for (auto& raw : raws) {
    raw->EndWrites();
    const absl::Status end = ErrorFrameOf(raw->ReadToEnd());
    EXPECT_EQ(end.code(), absl::StatusCode::kInvalidArgument) << end;
  }
}

TEST(SelectionLinkTest, BadAddresses) {
  Echo echo;
  EXPECT_THAT(SelectionLinkServer::Start("no-port", echo.Fn()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SelectionLinkServer::Start("127.0.0.1:99999", echo.Fn()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SelectionLink::Connect("127.0.0.1", absl::Seconds(1)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SelectionLink::Connect(":80", absl::Seconds(1)).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  // A port in use: the second server cannot listen there.
  STRATA_ASSERT_OK_AND_ASSIGN(auto first, SelectionLinkServer::Start("127.0.0.1:0", echo.Fn()));
  EXPECT_THAT(SelectionLinkServer::Start(Address(*first), echo.Fn()).status(),
              StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace strata::worker
