// The order every top-k by head soft vote uses: VoteTopK and SelectStages on every backend
// (kernels/backend.h), engine/sparse's host policies and the page cache's host chooser.
// Candidates rank by VoteRankKey(vote), descending, ties to the lower index.
//
// The key keeps a vote's binade (31 of them, 2^-25 up to 2^6) and the top 11 bits of its
// mantissa: 16 bits, so votes within about 2^-11 (0.05%) of each other may tie, and every vote
// below 2^-25 ties with 0. What that buys: the GPU's radix selects over these keys finish in two
// 8-bit passes instead of the four a 32-bit float needs (each pass is a histogram exchanged
// across a thread-block cluster; docs/design.md section 10). What it costs: at the k-th place a
// candidate may lose to a lower-indexed one whose vote is up to 0.05% smaller, a change of that
// order in the attention mass the selection holds.
//
// Included by .cc and .cu files (host and device code).
#ifndef STRATA_KERNELS_VOTE_RANK_H_
#define STRATA_KERNELS_VOTE_RANK_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_VOTE_RANK_FN __host__ __device__ __forceinline__
#else
#define STRATA_VOTE_RANK_FN inline
#endif

namespace strata::kernels {

// Bits of a rank key (keys are < 2^kVoteRankBits) and the 8-bit radix passes that order them.
inline constexpr int kVoteRankBits = 16;
inline constexpr int kVoteRankPasses = kVoteRankBits / 8;

// The rank key of a valid candidate's vote: 1 for 0, NaN, negatives and votes below 2^-25;
// 0xffff for 2^6 and above (a vote is at most the group size); otherwise 2 + (binade << 11 |
// top 11 mantissa bits), which is monotone in the vote. Invalid candidates take key 0 (below
// every valid one) at the callers.
STRATA_VOTE_RANK_FN uint32_t VoteRankKey(float vote) {
  if (!(vote > 0.0f)) return 1u;
  uint32_t bits;
  std::memcpy(&bits, &vote, sizeof(bits));
  const uint32_t e = bits >> 23;  // biased exponent (the sign is 0)
  constexpr uint32_t kLowest = 127u - 25u, kBinades = 31u;
  if (e < kLowest) return 1u;
  if (e >= kLowest + kBinades) return 0xffffu;
  return 2u + ((e - kLowest) << 11 | ((bits >> 12) & 0x7ffu));
}

// Whether candidate a ranks before candidate b, given their keys.
STRATA_VOTE_RANK_FN bool VoteRankBefore(uint32_t key_a, int64_t a, uint32_t key_b, int64_t b) {
  return key_a > key_b || (key_a == key_b && a < b);
}

}  // namespace strata::kernels

#undef STRATA_VOTE_RANK_FN

#endif  // STRATA_KERNELS_VOTE_RANK_H_
