// See engine/sparse/internal/hip.h.
#include "engine/sparse/internal/hip.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace strata::engine::sparse {

HipResult HipSelect(const HeadRows& keys, const float* queries, int group, int64_t begin,
                    int64_t end, int budget, int block) {
  HipResult res;
  const int64_t n = end - begin;
  if (n <= 0 || budget <= 0) return res;
  if (n <= budget) {
    res.ranges.push_back(Range{begin, end});
    return res;
  }
  block = std::clamp(block, 1, budget);
  const int64_t k = budget / block;
  const int d = keys.head_dim;
  std::vector<Range> chunks;
  chunks.reserve(k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t b = begin + static_cast<int64_t>(std::llround(static_cast<double>(i) * n / k));
    const int64_t e =
        begin + static_cast<int64_t>(std::llround(static_cast<double>(i + 1) * n / k));
    if (e > b) chunks.push_back(Range{b, e});
  }
  std::vector<Range> branches;
  std::vector<float> scores, vote;
  while (true) {
    bool all_leaves = true;
    for (const Range& c : chunks) all_leaves &= c.size() <= block;
    if (all_leaves && static_cast<int64_t>(chunks.size()) <= k) break;
    branches.clear();
    for (const Range& c : chunks) {
      if (c.size() > block) {
        const int64_t mid = c.begin + (c.size() + 1) / 2;
        branches.push_back(Range{c.begin, mid});
        branches.push_back(Range{mid, c.end});
      } else {
        branches.push_back(c);
      }
    }
    const int64_t nb = static_cast<int64_t>(branches.size());
    scores.assign(static_cast<size_t>(group) * nb, -std::numeric_limits<float>::infinity());
#pragma omp parallel for schedule(static) if (nb > 256)
    for (int64_t i = 0; i < nb; ++i) {
      const Range& br = branches[i];
      // Representative block: `block` tokens centred on the branch centre, inside the branch.
      const int64_t len = std::min<int64_t>(block, br.size());
      const int64_t centre = br.begin + br.size() / 2;
      const int64_t rb = std::clamp<int64_t>(centre - len / 2, br.begin, br.end - len);
      for (int64_t t = rb; t < rb + len; ++t) {
        for (int h = 0; h < group; ++h) {
          const float s = keys.Dot(t, queries + static_cast<size_t>(h) * d);
          float& dst = scores[static_cast<size_t>(h) * nb + i];
          dst = std::max(dst, s);
        }
      }
    }
    for (const Range& br : branches) res.keys_read += std::min<int64_t>(block, br.size());
    vote.resize(nb);
    SoftVote(scores.data(), group, nb, vote.data());
    const int64_t keep = std::min<int64_t>(k, nb);
    const std::vector<int64_t> order = RankByVote(vote.data(), nb, keep);
    chunks.clear();
    for (int64_t i = 0; i < keep; ++i) chunks.push_back(branches[order[i]]);
  }
  std::sort(chunks.begin(), chunks.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  res.ranges = chunks;
  return res;
}

}  // namespace strata::engine::sparse
