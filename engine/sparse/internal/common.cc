// See engine/sparse/internal/common.h.
#include "engine/sparse/internal/common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/vote_rank.h"

namespace strata::engine::sparse {

namespace {

// q . k over n elements, k[i] = load(i) as f32: 8 independent partial sums so the compiler can
// vectorise (f32 rounding differs slightly from one sequential chain), the same order for every
// element type.
template <typename Load>
float Dot8(const float* q, int n, Load load) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float tail = 0.0f;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += q[i + j] * load(i + j);
  }
  for (; i < n; ++i) tail += q[i] * load(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

}  // namespace

void HeadRows::Read(int64_t t, float* dst) const { ReadRows(t, 1, dst); }

void HeadRows::ReadRows(int64_t t, int64_t n, float* dst) const {
  const int64_t count = n * head_dim;
  const char* src = static_cast<const char*>(data) + t * head_dim * kernels::DTypeSize(dtype);
  if (dtype == kernels::DType::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  kernels::ConvertToF32(src, dtype, dst, count);
  if (dtype == kernels::DType::kFP8E4M3 && scale != 1.0f) {
    for (int64_t i = 0; i < count; ++i) dst[i] *= scale;
  }
}

float HeadRows::Dot(int64_t t, const float* q) const {
  if (dtype == kernels::DType::kF32) {
    const float* k = static_cast<const float*>(data) + t * head_dim;
    return Dot8(q, head_dim, [k](int i) { return k[i]; });
  }
  if (dtype == kernels::DType::kBF16) {
    // The f32 value is the 16 bits shifted up (exact).
    const uint16_t* k = static_cast<const uint16_t*>(data) + t * head_dim;
    return Dot8(q, head_dim, [k](int i) {
      const uint32_t bits = static_cast<uint32_t>(k[i]) << 16;
      float x;
      std::memcpy(&x, &bits, sizeof(x));
      return x;
    });
  }
  // fp8: the row's values first (as an f32 row holds them), then the same sum.
  constexpr int kStack = 512;
  float stack[kStack];
  std::vector<float> heap;
  float* row = stack;
  if (head_dim > kStack) {
    heap.resize(static_cast<size_t>(head_dim));
    row = heap.data();
  }
  ReadRows(t, 1, row);
  return Dot8(q, head_dim, [row](int i) { return row[i]; });
}

void SoftVote(const float* scores, int num_heads, int64_t n, float* out) {
  std::fill(out, out + n, 0.0f);
  for (int h = 0; h < num_heads; ++h) {
    const float* s = scores + h * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
    if (m == -std::numeric_limits<float>::infinity()) continue;
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - m);
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) out[j] += std::exp(s[j] - m) * inv;
  }
}

std::vector<int64_t> RankByVote(const float* vote, int64_t n, int64_t take) {
  std::vector<uint32_t> key(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) key[i] = kernels::VoteRankKey(vote[i]);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  take = std::clamp<int64_t>(take, 0, n);
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int64_t a, int64_t b) {
    return kernels::VoteRankBefore(key[a], a, key[b], b);
  });
  return order;
}

std::vector<Range> RangesFromSortedTokens(const std::vector<int64_t>& tokens) {
  std::vector<Range> out;
  for (int64_t t : tokens) {
    if (!out.empty() && out.back().end == t) {
      ++out.back().end;
    } else if (out.empty() || out.back().end < t) {
      out.push_back(Range{t, t + 1});
    }
  }
  return out;
}

std::vector<Range> ClipRanges(const std::vector<Range>& ranges, int64_t lo, int64_t hi) {
  std::vector<Range> out;
  for (const Range& r : ranges) {
    const Range c{std::max(r.begin, lo), std::min(r.end, hi)};
    if (c.end > c.begin) out.push_back(c);
  }
  return out;
}

int64_t CountTokens(const std::vector<Range>& ranges) {
  int64_t n = 0;
  for (const Range& r : ranges) n += r.size();
  return n;
}

}  // namespace strata::engine::sparse
