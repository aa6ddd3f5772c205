// VoteRankKey (kernels/vote_rank.h): monotone in the vote, 24 bits, votes within a bin tie, the
// ends clamp, and invalid votes rank as 0.
#include "kernels/vote_rank.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace strata::kernels {
namespace {

TEST(VoteRankTest, MonotoneAndTwentyFourBits) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> exponent(-30.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) {
    const float a = std::exp2(exponent(rng)), b = std::exp2(exponent(rng));
    const uint32_t ka = VoteRankKey(a), kb = VoteRankKey(b);
    ASSERT_GE(ka, 1u);
    ASSERT_LT(ka, 1u << kVoteRankBits);
    if (a < b) ASSERT_LE(ka, kb) << a << " " << b;
    // Two votes more than two bins apart (relative 2^-18) in the covered range rank apart.
    if (a >= 0x1p-25f && b < 64.0f && b > a * (1.0f + 0x1p-18f)) ASSERT_LT(ka, kb) << a << " " << b;
  }
}

TEST(VoteRankTest, ResolutionAndEnds) {
  // Within one bin (the top 19 mantissa bits equal): a tie.
  EXPECT_EQ(VoteRankKey(1.0f), VoteRankKey(std::nextafter(1.0f, 2.0f)));
  EXPECT_EQ(VoteRankKey(1.0f), VoteRankKey(1.0f + 0x1p-20f));
  // One bin up.
  EXPECT_EQ(VoteRankKey(1.0f + 0x1p-19f), VoteRankKey(1.0f) + 1);
  // The binade below 2^-25 and anything not a positive vote rank as 0 (key 1).
  EXPECT_EQ(VoteRankKey(0x1p-25f), 2u);
  EXPECT_EQ(VoteRankKey(std::nextafter(0x1p-25f, 0.0f)), 1u);
  EXPECT_EQ(VoteRankKey(0.0f), 1u);
  EXPECT_EQ(VoteRankKey(-0.0f), 1u);
  EXPECT_EQ(VoteRankKey(-1.0f), 1u);
  EXPECT_EQ(VoteRankKey(std::numeric_limits<float>::quiet_NaN()), 1u);
  EXPECT_EQ(VoteRankKey(std::numeric_limits<float>::denorm_min()), 1u);
  // 2^6 and above: the top key.
  EXPECT_EQ(VoteRankKey(64.0f), 0xffffffu);
  EXPECT_EQ(VoteRankKey(std::numeric_limits<float>::infinity()), 0xffffffu);
  EXPECT_LT(VoteRankKey(std::nextafter(64.0f, 0.0f)), 0xffffffu);
  EXPECT_EQ(kVoteRankPasses * 8, kVoteRankBits);
}

TEST(VoteRankTest, BeforeBreaksTiesByLowerIndex) {
  EXPECT_TRUE(VoteRankBefore(5, 9, 4, 1));
  EXPECT_FALSE(VoteRankBefore(4, 1, 5, 9));
  EXPECT_TRUE(VoteRankBefore(5, 1, 5, 9));
  EXPECT_FALSE(VoteRankBefore(5, 9, 5, 1));
  EXPECT_FALSE(VoteRankBefore(5, 3, 5, 3));
}

}  // namespace
}  // namespace strata::kernels
