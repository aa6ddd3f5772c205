// Small helpers shared by the sparse policies: token ranges, host access to the keys of one KV
// head, and the head soft vote. Thread-compatible.
#ifndef STRATA_ENGINE_SPARSE_INTERNAL_COMMON_H_
#define STRATA_ENGINE_SPARSE_INTERNAL_COMMON_H_

#include <cstdint>
#include <vector>

#include "kernels/tensor.h"

namespace strata::engine::sparse {

// Tokens [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Token-major rows of one KV head (keys or values) in host memory: row t at data + t * head_dim
// elements of f32, bf16 or fp8 e4m3. In a KvCache pool the pages of one KV head are contiguous
// slots, so this is the head's first slot. An fp8 row's values are its codes times `scale` (the
// cache's k_scale or v_scale, KvCacheOptions); f32 and bf16 rows ignore it.
struct HeadRows {
  const void* data = nullptr;
  kernels::DType dtype = kernels::DType::kF32;
  int head_dim = 0;
  float scale = 1.0f;

  // Copies row t to dst as f32.
  void Read(int64_t t, float* dst) const;
  // Copies rows [t, t + n) to dst [n, head_dim] as f32.
  void ReadRows(int64_t t, int64_t n, float* dst) const;
  // q . row(t) in f32 (an fp8 row: q . (its values as f32), the same sum as over an f32 row
  // holding them).
  float Dot(int64_t t, const float* q) const;
};

// Head soft vote: scores [num_heads][n] (row-major, -inf allowed); out[j] = sum_h softmax_h(j).
void SoftVote(const float* scores, int num_heads, int64_t n, float* out);

// Candidate indices in the order every top-k by vote uses (kernels/vote_rank.h: the vote's rank
// key descending, ties to the lower index): the first min(take, n) of them sorted so, the rest in
// no particular order.
std::vector<int64_t> RankByVote(const float* vote, int64_t n, int64_t take);

// Sorted, de-duplicated tokens -> maximal runs of consecutive tokens.
std::vector<Range> RangesFromSortedTokens(const std::vector<int64_t>& tokens);

// Clips sorted disjoint ranges to [lo, hi) (dropping empty ones).
std::vector<Range> ClipRanges(const std::vector<Range>& ranges, int64_t lo, int64_t hi);

// Total tokens of the ranges.
int64_t CountTokens(const std::vector<Range>& ranges);

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_INTERNAL_COMMON_H_
