// The order every top-k by head soft vote uses: VoteTopK and SelectStages on every backend
// (kernels/backend.h), engine/sparse's host policies and the page cache's host chooser.
// Candidates rank by VoteRankKey(vote), descending, ties to the lower index.
//
// The key keeps a vote's binade (31 of them, 2^-25 up to 2^6) and the top 19 bits of its
// mantissa: 24 bits, so votes within about 2^-19 (2e-6) of each other may tie, and every vote
// below 2^-25 ties with 0. What that buys: the GPU's radix selects over these keys finish in
// three 8-bit passes instead of the four a 32-bit float needs (each pass is a histogram exchanged
// across a thread-block cluster; docs/design.md section 10). Why not 16 bits and two passes
// (measured faster): two backends' votes for the same query differ by more than 2^-11 when their
// queries come from different arithmetic (bf16 GEMMs on the GPU, f32 on the CPU), so bins that
// wide made the backends' selections, and greedy tokens, part far more often than exact votes do;
// bins of 2^-19 are below that noise, and ties stay as rare as with the float's own bits.
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
inline constexpr int kVoteRankBits = 24;
inline constexpr int kVoteRankPasses = kVoteRankBits / 8;

// The rank key of a valid candidate's vote: 1 for 0, NaN, negatives and votes below 2^-25;
// 0xffffff for 2^6 and above (a vote is at most the group size); otherwise 2 + (binade << 19 |
// top 19 mantissa bits), which is monotone in the vote. Invalid candidates take key 0 (below
// every valid one) at the callers.
STRATA_VOTE_RANK_FN uint32_t VoteRankKey(float vote) {
  if (!(vote > 0.0f)) return 1u;
  uint32_t bits;
  std::memcpy(&bits, &vote, sizeof(bits));
  const uint32_t e = bits >> 23;  // biased exponent (the sign is 0)
  constexpr uint32_t kLowest = 127u - 25u, kBinades = 31u;
  if (e < kLowest) return 1u;
  if (e >= kLowest + kBinades) return 0xffffffu;
  return 2u + ((e - kLowest) << 19 | ((bits >> 4) & 0x7ffffu));
}

// Whether candidate a ranks before candidate b, given their keys.
STRATA_VOTE_RANK_FN bool VoteRankBefore(uint32_t key_a, int64_t a, uint32_t key_b, int64_t b) {
  return key_a > key_b || (key_a == key_b && a < b);
}

}  // namespace strata::kernels

#undef STRATA_VOTE_RANK_FN

#endif  // STRATA_KERNELS_VOTE_RANK_H_
