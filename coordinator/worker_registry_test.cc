#include "coordinator/worker_registry.h"

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;

constexpr int64_t kSecond = 1'000'000'000;

class WorkerRegistryTest : public ::testing::Test {
 protected:
  WorkerRegistryTest() : registry_(Options(), [this] { return now_; }) {}
  static WorkerRegistryOptions Options() {
    WorkerRegistryOptions o;
    o.heartbeat_interval_nanos = 1 * kSecond;
    o.heartbeat_timeout_nanos = 3 * kSecond;
    return o;
  }
  static v1::WorkerInfo Info(const std::string& id) {
    v1::WorkerInfo info;
    info.set_worker_id(id);
    info.set_address("127.0.0.1:7000");
    info.set_capacity_tokens(1 << 20);
    info.set_max_jobs(4);
    return info;
  }
  static v1::HeartbeatRequest Beat(const std::string& id, uint64_t lease) {
    v1::HeartbeatRequest r;
    r.set_worker_id(id);
    r.set_lease_id(lease);
    return r;
  }

  int64_t now_ = 100 * kSecond;
  WorkerRegistry registry_;
};

TEST_F(WorkerRegistryTest, RegisterGivesLeaseAndIntervals) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto r, registry_.Register(Info("w1")));
  EXPECT_GT(r.lease_id(), 0u);
  EXPECT_EQ(r.heartbeat_interval_ms(), 1000u);
  EXPECT_EQ(r.heartbeat_timeout_ms(), 3000u);
  EXPECT_EQ(registry_.size(), 1u);
}

TEST_F(WorkerRegistryTest, RejectsMalformedWorkers) {
  v1::WorkerInfo bad = Info("bad id!");
  EXPECT_THAT(registry_.Register(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = Info("w");
  bad.clear_address();
  EXPECT_THAT(registry_.Register(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = Info("w");
  bad.set_capacity_tokens(0);
  EXPECT_THAT(registry_.Register(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = Info("w");
  bad.set_selection_link_address("no-port");
  EXPECT_THAT(registry_.Register(bad), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(registry_.size(), 0u);
}

// Given a registered worker, when it stays silent past the timeout, then it is expired, and its
// next heartbeat is NOT_FOUND.
TEST_F(WorkerRegistryTest, SilentWorkerExpires) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto r, registry_.Register(Info("w1")));
  now_ += 3 * kSecond;  // exactly the timeout: still live
  EXPECT_TRUE(registry_.ExpireStale().empty());
  now_ += 1;
  EXPECT_EQ(registry_.ExpireStale(), std::vector<std::string>{"w1"});
  EXPECT_EQ(registry_.size(), 0u);
  EXPECT_THAT(registry_.Heartbeat(Beat("w1", r.lease_id())), StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(WorkerRegistryTest, HeartbeatsKeepWorkerAliveAndUpdateLoad) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto r, registry_.Register(Info("w1")));
  for (int i = 0; i < 10; ++i) {
    now_ += 2 * kSecond;
    v1::HeartbeatRequest beat = Beat("w1", r.lease_id());
    beat.mutable_load()->set_running_jobs(i);
    ASSERT_TRUE(registry_.Heartbeat(beat).ok());
    EXPECT_TRUE(registry_.ExpireStale().empty());
  }
  STRATA_ASSERT_OK_AND_ASSIGN(WorkerEntry e, registry_.Get("w1"));
  EXPECT_EQ(e.load.running_jobs(), 9u);
}

TEST_F(WorkerRegistryTest, ReRegistrationEndsOldLease) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto first, registry_.Register(Info("w1")));
  STRATA_ASSERT_OK_AND_ASSIGN(auto second, registry_.Register(Info("w1")));
  EXPECT_NE(first.lease_id(), second.lease_id());
  EXPECT_THAT(registry_.Heartbeat(Beat("w1", first.lease_id())), StatusIs(absl::StatusCode::kNotFound));
  STRATA_EXPECT_OK(registry_.Heartbeat(Beat("w1", second.lease_id())));
  EXPECT_THAT(registry_.Deregister("w1", first.lease_id()), StatusIs(absl::StatusCode::kNotFound));
  STRATA_EXPECT_OK(registry_.Deregister("w1", second.lease_id()));
  EXPECT_EQ(registry_.size(), 0u);
}

TEST_F(WorkerRegistryTest, SnapshotIsOrderedById) {
  ASSERT_TRUE(registry_.Register(Info("b")).ok());
  ASSERT_TRUE(registry_.Register(Info("a")).ok());
  auto snap = registry_.Snapshot();
  ASSERT_EQ(snap.size(), 2u);
  EXPECT_EQ(snap[0].info.worker_id(), "a");
  EXPECT_EQ(snap[1].info.worker_id(), "b");
}

TEST(WorkerRegistryOptionsTest, Validate) {
  WorkerRegistryOptions o;
  STRATA_EXPECT_OK(o.Validate());
  o.heartbeat_timeout_nanos = o.heartbeat_interval_nanos;
  EXPECT_THAT(o.Validate(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace strata::coordinator
