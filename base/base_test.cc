#include "base/status_macros.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/clock.h"
#include "base/cpu_limit.h"
#include "base/logging.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"

namespace strata {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  STRATA_ASSIGN_OR_RETURN(int h, Half(x));
  STRATA_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckEven(int x) {
  STRATA_RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

// A cgroup tree in a temp dir with the given files (path relative to the root -> content).
std::string FakeCgroup(const std::string& name, const std::vector<std::pair<std::string, std::string>>& files) {
  const std::filesystem::path root = std::filesystem::path(::testing::TempDir()) / ("strata_cgroup_" + name);
  std::filesystem::remove_all(root);
  for (const auto& [path, content] : files) {
    std::filesystem::create_directories((root / path).parent_path());
    std::ofstream(root / path) << content;
  }
  std::filesystem::create_directories(root);
  return root.string();
}

TEST(CpuLimitTest, CgroupQuotaCoresReadsV2ThenV1) {
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v2", {{"cpu.max", "800000 100000\n"}})), 8);
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v2_round", {{"cpu.max", "150000 100000\n"}})), 2);  // 1.5 cores
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v2_max", {{"cpu.max", "max 100000\n"}})), 0);
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v2_bad", {{"cpu.max", "lots 100000\n"}})), 0);
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v2_short", {{"cpu.max", "400000"}})), 0);
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v1", {{"cpu/cpu.cfs_quota_us", "400000\n"},
                                               {"cpu/cpu.cfs_period_us", "100000\n"}})),
            4);
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("v1_unlimited", {{"cpu/cpu.cfs_quota_us", "-1\n"},
                                                         {"cpu/cpu.cfs_period_us", "100000\n"}})),
            0);
  EXPECT_EQ(CgroupQuotaCores(FakeCgroup("none", {})), 0);
  EXPECT_EQ(CgroupQuotaCores("/nonexistent/strata/cgroup"), 0);
  for (const char* name : {"v2", "v2_round", "v2_max", "v2_bad", "v2_short", "v1", "v1_unlimited", "none"}) {
    std::filesystem::remove_all(std::filesystem::path(::testing::TempDir()) / (std::string("strata_cgroup_") + name));
  }
}

TEST(CpuLimitTest, UsableCoresIsPositiveAndWithinTheQuota) {
  const int cores = UsableCores();
  EXPECT_GE(cores, 1);
  EXPECT_EQ(UsableCores(), cores);  // read once
  const int quota = CgroupQuotaCores();
  if (quota > 0) EXPECT_LE(cores, quota);
}

TEST(StatusMacrosTest, AssignOrReturnPropagates) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("odd")));
}

TEST(StatusMacrosTest, ReturnIfError) {
  STRATA_EXPECT_OK(CheckEven(4));
  EXPECT_THAT(CheckEven(3), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(StatusMacrosTest, AnnotateKeepsCode) {
  absl::Status s = Annotate(absl::NotFoundError("x"), "layer 3");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("layer 3: x")));
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
}

TEST(ClockTest, TtlSecondsOutsideZeroToAHundredYearsAreRefused) {
  EXPECT_TRUE(ValidateTtlSeconds(0).ok());
  EXPECT_TRUE(ValidateTtlSeconds(kMaxTtlSeconds).ok());
  for (int64_t ttl : {int64_t{-1}, kMaxTtlSeconds + 1, INT64_MAX, INT64_MIN}) {
    const absl::Status s = ValidateTtlSeconds(ttl);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << ttl;
    EXPECT_NE(s.message().find("ttl_seconds"), std::string_view::npos) << s;
  }
}

TEST(ClockTest, MonotonicAdvances) {
  Stopwatch sw;
  int64_t a = MonotonicNanos();
  int64_t b = MonotonicNanos();
  EXPECT_LE(a, b);
  EXPECT_GE(sw.ElapsedNanos(), 0);
  EXPECT_GT(WallMicros(), 1600000000LL * 1000000LL);
}

TEST(LoggingTest, CheckFailureAborts) {
  EXPECT_DEATH(STRATA_CHECK(1 == 2) << "boom", "Check failed: 1 == 2 boom");
}

}  // namespace
}  // namespace strata
