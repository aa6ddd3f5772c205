// See engine/sparse/internal/common.h.
#include "engine/sparse/internal/common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace strata::engine::sparse {

void HeadRows::Read(int64_t t, float* dst) const {
  if (dtype == kernels::DType::kF32) {
    const float* src = static_cast<const float*>(data) + t * head_dim;
    std::copy(src, src + head_dim, dst);
  } else {
    kernels::ConvertToF32(static_cast<const uint16_t*>(data) + t * head_dim, dtype, dst, head_dim);
  }
}

float HeadRows::Dot(int64_t t, const float* q) const {
  float acc = 0.0f;
  if (dtype == kernels::DType::kF32) {
    const float* k = static_cast<const float*>(data) + t * head_dim;
    for (int i = 0; i < head_dim; ++i) acc += q[i] * k[i];
  } else {
    // bf16: the f32 value is the 16 bits shifted up (exact).
    const uint16_t* k = static_cast<const uint16_t*>(data) + t * head_dim;
    for (int i = 0; i < head_dim; ++i) {
      const uint32_t bits = static_cast<uint32_t>(k[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      acc += q[i] * f;
    }
  }
  return acc;
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
