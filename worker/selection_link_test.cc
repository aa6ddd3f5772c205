// The selection link's transport alone (worker/selection_link.h), with serving functions of the
// test's own instead of a worker: answers in order, a server's error as the client's reason, the
// read deadline, Shutdown ending live streams and refusing new ones, bad addresses.
#include "worker/selection_link.h"

#include <stdlib.h>

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
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (server->streams() > 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(server->streams(), 1);
  EXPECT_EQ(echo.ended.load(), 1);
  STRATA_ASSERT_OK_AND_ASSIGN(auto again, SelectionLink::Connect(Address(*server), absl::Seconds(5)));
  ASSERT_TRUE(again->Write(Open().SerializeAsString()));
  ASSERT_TRUE(again->Write(Query(1, 0, "q").SerializeAsString()));
  ASSERT_TRUE(again->Read(absl::Now() + absl::Seconds(10), &resp, &why)) << why;
  EXPECT_EQ(resp.step(), 1u);
  EXPECT_THAT(SelectionLinkServer::Start("127.0.0.1:0", echo.Fn(), 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
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
