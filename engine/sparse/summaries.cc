// Page and segment summaries. See engine/sparse/summaries.h.
#include "engine/sparse/summaries.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace strata::engine::sparse {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kMaxKeyExponent = 60.0f;
constexpr int64_t kFeatureBatch = 512;  // rows featurized per GEMM (bounds the scratch memory)

}  // namespace

RandomFeatures::RandomFeatures(int head_dim, int num_features, uint64_t seed)
    : head_dim_(head_dim), num_features_(num_features) {
  std::mt19937_64 rng(seed ^ (static_cast<uint64_t>(head_dim) << 32));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  omega_.resize(static_cast<size_t>(num_features) * head_dim);
  for (float& w : omega_) w = nd(rng);
}

void RandomFeatures::Featurize(const float* x, int64_t rows, float* out, float* log_shift) const {
  const int d = head_dim_, n = num_features_;
  const float in_scale = 1.0f / std::pow(static_cast<float>(d), 0.25f);
  const float out_scale = 1.0f / std::sqrt(static_cast<float>(n));
  // out = (x / d^(1/4)) Omega^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), n, d, in_scale, x, d,
              omega_.data(), d, 0.0f, out, n);
  for (int64_t r = 0; r < rows; ++r) {
    double sq = 0;
    for (int i = 0; i < d; ++i) sq += static_cast<double>(x[r * d + i]) * x[r * d + i];
    const float half_norm = static_cast<float>(0.5 * sq * in_scale * in_scale);
    float* o = out + r * n;
    float shift = 0.0f;
    if (log_shift != nullptr) {
      float m = kNegInf;
      for (int f = 0; f < n; ++f) m = std::max(m, o[f] - half_norm);
      shift = m;
      log_shift[r] = m;
    }
    for (int f = 0; f < n; ++f) {
      float e = o[f] - half_norm - shift;
      if (log_shift == nullptr) e = std::min(e, kMaxKeyExponent);
      o[f] = std::exp(e) * out_scale;
    }
  }
}

int SummaryDim(SummaryKind kind, int head_dim, int rf_features) {
  switch (kind) {
    case SummaryKind::kMinMax:
      return 2 * head_dim;
    case SummaryKind::kMean:
      return head_dim;
    case SummaryKind::kRf:
      return rf_features;
    default:
      return 0;
  }
}

void MergeSummary(SummaryKind kind, int dim, float* a, const float* b) {
  if (kind == SummaryKind::kMinMax) {
    const int d = dim / 2;
    for (int i = 0; i < d; ++i) a[i] = std::min(a[i], b[i]);
    for (int i = d; i < dim; ++i) a[i] = std::max(a[i], b[i]);
  } else {
    for (int i = 0; i < dim; ++i) a[i] += b[i];
  }
}

void PrepareQuery(SummaryKind kind, const RandomFeatures* rf, const float* q, int head_dim,
                  float scale, PreparedQuery* out) {
  if (kind == SummaryKind::kRf) {
    out->v.resize(rf->num_features());
    rf->Featurize(q, 1, out->v.data(), &out->log_shift);
  } else {
    out->v.resize(head_dim);
    for (int i = 0; i < head_dim; ++i) out->v[i] = scale * q[i];
    out->log_shift = 0.0f;
  }
}

float ScoreSummary(SummaryKind kind, const PreparedQuery& q, const float* s, int64_t tokens,
                   int dim) {
  if (tokens <= 0) return kNegInf;
  const float* v = q.v.data();
  switch (kind) {
    case SummaryKind::kMinMax: {
      const int d = dim / 2;
      float acc = 0.0f;
      for (int i = 0; i < d; ++i) acc += std::max(v[i] * s[i], v[i] * s[d + i]);
      return acc;
    }
    case SummaryKind::kMean: {
      float acc = 0.0f;
      for (int i = 0; i < dim; ++i) acc += v[i] * s[i];
      const float t = static_cast<float>(tokens);
      return acc / t + std::log(t);
    }
    case SummaryKind::kRf: {
      float acc = 0.0f;
      for (int i = 0; i < dim; ++i) acc += v[i] * s[i];
      if (!(acc > 0.0f)) return -1e30f;  // underflow: tiny but finite, so it still ranks
      return std::log(acc) + q.log_shift;
    }
    default:
      return kNegInf;
  }
}

HeadSummaries::HeadSummaries(SummaryKind kind, int head_dim, int page_size, int segment_pages,
                             const RandomFeatures* rf)
    : kind_(kind),
      head_dim_(head_dim),
      page_size_(page_size),
      segment_pages_(segment_pages),
      rf_(rf),
      dim_(SummaryDim(kind, head_dim, rf != nullptr ? rf->num_features() : 0)) {}

int64_t HeadSummaries::page_tokens(int64_t p) const {
  return std::min<int64_t>(page_size_, length_ - p * page_size_);
}

int64_t HeadSummaries::segment_tokens(int64_t s) const {
  const int64_t seg_tokens = static_cast<int64_t>(page_size_) * segment_pages_;
  return std::min<int64_t>(seg_tokens, length_ - s * seg_tokens);
}

void HeadSummaries::AddToPage(int64_t page, const float* x, bool first) {
  float* s = &pages_[page * dim_];
  if (kind_ == SummaryKind::kMinMax) {
    if (first) {
      for (int i = 0; i < head_dim_; ++i) s[i] = s[head_dim_ + i] = x[i];
    } else {
      for (int i = 0; i < head_dim_; ++i) {
        s[i] = std::min(s[i], x[i]);
        s[head_dim_ + i] = std::max(s[head_dim_ + i], x[i]);
      }
    }
  } else {
    for (int i = 0; i < dim_; ++i) s[i] += x[i];
  }
}

void HeadSummaries::Append(const float* keys, int64_t n) {
  if (n <= 0) return;
  const int64_t first_page = length_ / page_size_;
  const int64_t end = length_ + n;
  const int64_t pages = (end + page_size_ - 1) / page_size_;
  pages_.resize(pages * dim_, 0.0f);
  std::vector<float> features;
  for (int64_t b = 0; b < n; b += kFeatureBatch) {
    const int64_t rows = std::min(kFeatureBatch, n - b);
    const float* src = keys + b * head_dim_;
    if (kind_ == SummaryKind::kRf) {
      features.resize(rows * dim_);
      rf_->Featurize(src, rows, features.data(), nullptr);
      src = features.data();
    }
    const int stride = kind_ == SummaryKind::kRf ? dim_ : head_dim_;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = length_ + b + r;
      AddToPage(pos / page_size_, src + r * stride, pos % page_size_ == 0);
    }
  }
  length_ = end;
  // Re-merge the segments whose pages changed.
  const int64_t first_seg = first_page / segment_pages_;
  const int64_t segs = num_segments();
  segments_.resize(segs * dim_, 0.0f);
  for (int64_t s = first_seg; s < segs; ++s) {
    float* dst = &segments_[s * dim_];
    const int64_t p0 = s * segment_pages_, p1 = std::min(pages, p0 + segment_pages_);
    std::copy(page(p0), page(p0) + dim_, dst);
    for (int64_t p = p0 + 1; p < p1; ++p) MergeSummary(kind_, dim_, dst, page(p));
  }
}

}  // namespace strata::engine::sparse
