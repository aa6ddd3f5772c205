// Page and segment summaries of one KV head of one layer, built incrementally as keys arrive, and
// the scores of a query against them (DESIGN.md section 3, step 2).
//
//   minmax: per-channel min and max of the keys; score = scale * sum_i max(q_i min_i, q_i max_i),
//           an upper bound of scale * q.k over the page (Quest).
//   mean:   sum of the keys (centroid = sum / tokens); score = scale * q.centroid + log(tokens).
//   rf:     sum of positive random features phi(k) (RADAR, Eq. 4):
//             phi(x) = exp(w_i^T x' - |x'|^2 / 2) / sqrt(n),  x' = x / d^(1/4),  w_i ~ N(0, I_d),
//           so that E[phi(q).phi(k)] = exp(q.k / sqrt(d)); score = log(phi(q) . sum phi(k)), the
//           log of the estimated attention mass of the page (log mean + log tokens).
// Segments group `segment_pages` consecutive pages; a segment summary is the merge of its page
// summaries (elementwise min/max; sums add, which is the length-weighted mean), recomputed from the
// page summaries whenever one of its pages changes, so keys are never re-read. The last page and
// segment may be partial; their token counts say so.
//
// Thread-compatible. RandomFeatures is immutable after construction (thread-safe to share).
#ifndef STRATA_ENGINE_SPARSE_SUMMARIES_H_
#define STRATA_ENGINE_SPARSE_SUMMARIES_H_

#include <cstdint>
#include <vector>

#include "engine/sparse/policy.h"

namespace strata::engine::sparse {

// A seeded Gaussian projection Omega [n, d] and the positive feature map built on it.
class RandomFeatures {
 public:
  RandomFeatures(int head_dim, int num_features, uint64_t seed);

  int head_dim() const { return head_dim_; }
  int num_features() const { return num_features_; }
  const float* omega() const { return omega_.data(); }  // [n, d] row-major

  // out [rows, n] = phi(x_r) for x [rows, head_dim] f32. For keys (log_shift == nullptr) the
  // exponent is clamped at 60 to stay finite. For queries pass log_shift [rows]: each row is
  // scaled by exp(-max exponent of the row) (so values are <= 1/sqrt(n)) and the shift is stored
  // there; the true features are out * exp(log_shift).
  void Featurize(const float* x, int64_t rows, float* out, float* log_shift) const;

 private:
  int head_dim_;
  int num_features_;
  std::vector<float> omega_;
};

// Floats per summary for `kind` (0 for kNone/kDefault).
int SummaryDim(SummaryKind kind, int head_dim, int rf_features);

// a <- merge(a, b) for two summaries of `kind` with `dim` floats.
void MergeSummary(SummaryKind kind, int dim, float* a, const float* b);

// A query prepared for scoring against summaries of one kind: minmax/mean keep scale * q; rf keeps
// the (shifted) features phi(q) and the shift.
struct PreparedQuery {
  std::vector<float> v;
  float log_shift = 0.0f;
};
void PrepareQuery(SummaryKind kind, const RandomFeatures* rf, const float* q, int head_dim,
                  float scale, PreparedQuery* out);

// The score of a summary with `tokens` tokens (see the header comment); -inf when tokens == 0.
float ScoreSummary(SummaryKind kind, const PreparedQuery& q, const float* summary, int64_t tokens,
                   int dim);

class HeadSummaries {
 public:
  // kind must be kMinMax, kMean or kRf; rf must be non-null for kRf (and outlive this object).
  HeadSummaries(SummaryKind kind, int head_dim, int page_size, int segment_pages,
                const RandomFeatures* rf);

  // Adds the keys of tokens [length(), length() + n): keys f32 [n, head_dim].
  void Append(const float* keys, int64_t n);

  SummaryKind kind() const { return kind_; }
  int dim() const { return dim_; }
  int page_size() const { return page_size_; }
  int segment_pages() const { return segment_pages_; }
  int64_t length() const { return length_; }
  int64_t num_pages() const { return (length_ + page_size_ - 1) / page_size_; }
  int64_t num_segments() const {
    const int64_t seg_tokens = static_cast<int64_t>(page_size_) * segment_pages_;
    return (length_ + seg_tokens - 1) / seg_tokens;
  }
  const float* page(int64_t p) const { return &pages_[p * dim_]; }
  const float* segment(int64_t s) const { return &segments_[s * dim_]; }
  int64_t page_tokens(int64_t p) const;
  int64_t segment_tokens(int64_t s) const;

 private:
  void AddToPage(int64_t page, const float* key_or_features, bool first);

  SummaryKind kind_;
  int head_dim_;
  int page_size_;
  int segment_pages_;
  const RandomFeatures* rf_;
  int dim_;
  int64_t length_ = 0;
  std::vector<float> pages_;     // [num_pages, dim]
  std::vector<float> segments_;  // [num_segments, dim]
};

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_SUMMARIES_H_
