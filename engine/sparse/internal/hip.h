// HiP's hierarchical top-k estimation (HiP paper S3.1, Algorithm 1; DIGEST section 4.1), adapted
// to one KV head with a group of query heads.
//
// Over the middle [begin, end): split it into k = budget / block equal chunks; then repeatedly
// split every chunk longer than `block` into two halves ("branches"), score each branch by its
// representative key block (the `block` tokens around its centre; per query head the max of
// q.k over the block), combine the group's heads by head soft vote, and keep the k best branches.
// Stop when every kept branch is at most `block` tokens. At most k * block <= budget tokens.
// Thread-compatible (pure function).
#ifndef STRATA_ENGINE_SPARSE_INTERNAL_HIP_H_
#define STRATA_ENGINE_SPARSE_INTERNAL_HIP_H_

#include <cstdint>
#include <vector>

#include "engine/sparse/internal/common.h"

namespace strata::engine::sparse {

struct HipResult {
  std::vector<Range> ranges;  // sorted, disjoint
  int64_t keys_read = 0;      // key rows read to score representatives
};

// queries: [group, head_dim] f32, already multiplied by the attention scale.
HipResult HipSelect(const HeadRows& keys, const float* queries, int group, int64_t begin,
                    int64_t end, int budget, int block);

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_INTERNAL_HIP_H_
