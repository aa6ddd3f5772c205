#include "coordinator/placement.h"

#include <map>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata::coordinator {
namespace {

using ::strata::testing::StatusIs;

PlacementOptions Options(int64_t page, int64_t target) {
  PlacementOptions o;
  o.page_size = page;
  o.target_shard_tokens = target;
  return o;
}

// The map covers [0, num_pages) with contiguous, non-empty shards.
void ExpectCovers(const v1::ShardMap& map, int64_t num_pages) {
  uint64_t next = 0;
  for (const auto& a : map.shards()) {
    EXPECT_EQ(a.range().first_page(), next);
    EXPECT_GT(a.range().end_page(), a.range().first_page());
    EXPECT_FALSE(a.worker_id().empty());
    next = a.range().end_page();
  }
  EXPECT_EQ(next, static_cast<uint64_t>(num_pages));
}

TEST(PlacementTest, SmallDocumentIsOneShard) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto map, (PlaceDocument("d", 100, Options(64, 4096), {{"w1", 1000}})));
  ASSERT_EQ(map.shards_size(), 1);
  ExpectCovers(map, 2);
  EXPECT_EQ(map.shards(0).worker_id(), "w1");
  EXPECT_EQ(map.num_tokens(), 100u);
  EXPECT_EQ(map.page_size(), 64u);
}

TEST(PlacementTest, SplitsNearEquallyAndSpreads) {
  // 10000 tokens, P=64 -> 157 pages; target 4096 tokens = 64 pages -> 3 shards of 53, 52, 52.
  std::vector<WorkerCapacity> workers = {{"a", 100000}, {"b", 100000}, {"c", 100000}};
  STRATA_ASSERT_OK_AND_ASSIGN(auto map, (PlaceDocument("d", 10000, Options(64, 4096), workers)));
  ASSERT_EQ(map.shards_size(), 3);
  ExpectCovers(map, 157);
  EXPECT_EQ(map.shards(0).range().end_page() - map.shards(0).range().first_page(), 53u);
  EXPECT_EQ(map.shards(2).range().end_page() - map.shards(2).range().first_page(), 52u);
  std::map<std::string, int> per_worker;
  for (const auto& a : map.shards()) ++per_worker[a.worker_id()];
  EXPECT_EQ(per_worker.size(), 3u);  // equal capacities: one shard each
}

TEST(PlacementTest, PrefersFreeCapacity) {
  std::vector<WorkerCapacity> workers = {{"small", 5000}, {"big", 50000}};
  STRATA_ASSERT_OK_AND_ASSIGN(auto map, (PlaceDocument("d", 8192, Options(64, 4096), workers)));
  ASSERT_EQ(map.shards_size(), 2);
  // big has 50000, takes the first; then big still has 45904 > 5000: takes the second too.
  EXPECT_EQ(map.shards(0).worker_id(), "big");
  EXPECT_EQ(map.shards(1).worker_id(), "big");
}

TEST(PlacementTest, RespectsCapacity) {
  std::vector<WorkerCapacity> workers = {{"a", 4096}, {"b", 4096}};
  STRATA_ASSERT_OK_AND_ASSIGN(auto map, (PlaceDocument("d", 8192, Options(64, 4096), workers)));
  ASSERT_EQ(map.shards_size(), 2);
  EXPECT_NE(map.shards(0).worker_id(), map.shards(1).worker_id());
}

TEST(PlacementTest, FailsWhenAShardFitsNowhere) {
  EXPECT_THAT((PlaceDocument("d", 8192, Options(64, 4096), {{"a", 4096}, {"b", 4000}})),
              StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(PlacementTest, BadInputs) {
  EXPECT_THAT((PlaceDocument("d", 0, Options(64, 4096), {{"a", 1}})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((PlaceDocument("d", 10, Options(0, 4096), {{"a", 100}})),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((PlaceDocument("d", 10, Options(64, 4096), {})), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(PlacementTest, TargetSmallerThanPageGivesOnePagePerShard) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto map, (PlaceDocument("d", 130, Options(64, 10), {{"a", 1000}})));
  ASSERT_EQ(map.shards_size(), 3);
  ExpectCovers(map, 3);
  EXPECT_EQ(ShardTokens(map.shards(2).range(), 64, 130), 2);
}

TEST(LeaderTest, PrefersHolderOfMostTokensWithFreeSlot) {
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto map, (PlaceDocument("d", 12288, Options(64, 4096), {{"a", 4096}, {"b", 8192}})));
  // b holds 8192 tokens, a 4096.
  STRATA_ASSERT_OK_AND_ASSIGN(auto leader, (ChooseLeader(map, {{"a", 0, 4}, {"b", 3, 4}})));
  EXPECT_EQ(leader, "b");
  STRATA_ASSERT_OK_AND_ASSIGN(leader, (ChooseLeader(map, {{"a", 0, 4}, {"b", 4, 4}})));
  EXPECT_EQ(leader, "a");  // b is full
  EXPECT_THAT((ChooseLeader(map, {{"a", 4, 4}, {"b", 4, 4}})), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(LeaderTest, NoDocumentPicksLeastLoaded) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto leader, (ChooseLeader(v1::ShardMap(), {{"b", 2, 4}, {"a", 2, 4}, {"c", 1, 4}})));
  EXPECT_EQ(leader, "c");
  STRATA_ASSERT_OK_AND_ASSIGN(leader, (ChooseLeader(v1::ShardMap(), {{"b", 1, 4}, {"a", 1, 4}})));
  EXPECT_EQ(leader, "a");
}

// Given a document on a, b, c, when b is gone, then only b's shard moves (to the live worker with
// the most free capacity), the version grows by one and the moved shard's address is cleared.
TEST(PlacementTest, ReassignMovesOnlyTheShardsOfGoneWorkers) {
  std::vector<WorkerCapacity> workers = {{"a", 100000}, {"b", 100000}, {"c", 100000}};
  STRATA_ASSERT_OK_AND_ASSIGN(auto map, (PlaceDocument("d", 10000, Options(64, 4096), workers)));
  for (auto& a : *map.mutable_shards()) {
    a.set_worker_address(a.worker_id() + ":1");
    a.set_selection_link_address(a.worker_id() + ":2");
  }
  int on_b = -1;
  for (int i = 0; i < map.shards_size(); ++i) {
    if (map.shards(i).worker_id() == "b") on_b = i;
  }
  ASSERT_GE(on_b, 0);
  STRATA_ASSERT_OK_AND_ASSIGN(auto moved, ReassignShards(map, {{"a", 50000}, {"c", 90000}}));
  EXPECT_EQ(moved.version(), map.version() + 1);
  ASSERT_EQ(moved.shards_size(), map.shards_size());
  for (int i = 0; i < map.shards_size(); ++i) {
    EXPECT_EQ(moved.shards(i).range().first_page(), map.shards(i).range().first_page());
    if (i == on_b) {
      EXPECT_EQ(moved.shards(i).worker_id(), "c");
      EXPECT_TRUE(moved.shards(i).worker_address().empty());
      EXPECT_TRUE(moved.shards(i).selection_link_address().empty());
    } else {
      EXPECT_EQ(moved.shards(i).worker_id(), map.shards(i).worker_id());
      EXPECT_EQ(moved.shards(i).worker_address(), map.shards(i).worker_address());
      EXPECT_EQ(moved.shards(i).selection_link_address(), map.shards(i).selection_link_address());
    }
  }
  // Nothing gone: the same map, same version.
  STRATA_ASSERT_OK_AND_ASSIGN(auto same, ReassignShards(moved, {{"a", 1}, {"c", 1}}));
  EXPECT_EQ(same.version(), moved.version());
  // No room, or no workers at all.
  EXPECT_THAT(ReassignShards(map, {{"a", 10}, {"c", 10}}), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(ReassignShards(map, {}), StatusIs(absl::StatusCode::kUnavailable));
}

}  // namespace
}  // namespace strata::coordinator
