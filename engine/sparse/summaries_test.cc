// Tests of page/segment summaries and random features.
#include "engine/sparse/summaries.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace strata::engine::sparse {
namespace {

constexpr uint32_t kSeed = 424242;

std::vector<float> RandomKeys(std::mt19937& rng, int64_t n, int d, float sigma) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> k(static_cast<size_t>(n) * d);
  for (float& x : k) x = nd(rng);
  return k;
}

// Appends keys in awkward chunk sizes (so pages and segments fill across calls).
void AppendInChunks(HeadSummaries* s, const std::vector<float>& keys, int d, std::mt19937& rng) {
  const int64_t n = static_cast<int64_t>(keys.size()) / d;
  int64_t t = 0;
  while (t < n) {
    const int64_t c = std::min<int64_t>(n - t, std::uniform_int_distribution<int>(1, 40)(rng));
    s->Append(&keys[t * d], c);
    t += c;
  }
}

TEST(SummariesTest, MinMaxBoundNeverBelowTrueMaxScore) {
  std::mt19937 rng(kSeed);
  for (int page : {1, 3, 16}) {
    const int d = 17, n = 301;
    std::vector<float> keys = RandomKeys(rng, n, d, 1.0f);
    HeadSummaries s(SummaryKind::kMinMax, d, page, 4, nullptr);
    AppendInChunks(&s, keys, d, rng);
    ASSERT_EQ(s.length(), n);
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> q = RandomKeys(rng, 1, d, 2.0f);
      PreparedQuery pq;
      PrepareQuery(SummaryKind::kMinMax, nullptr, q.data(), d, 0.25f, &pq);
      for (int64_t p = 0; p < s.num_pages(); ++p) {
        float best = -1e30f;
        for (int64_t t = p * page; t < std::min<int64_t>(n, (p + 1) * page); ++t) {
          float dot = 0;
          for (int i = 0; i < d; ++i) dot += q[i] * keys[t * d + i];
          best = std::max(best, 0.25f * dot);
        }
        const float bound = ScoreSummary(SummaryKind::kMinMax, pq, s.page(p), s.page_tokens(p), s.dim());
        ASSERT_GE(bound, best - 1e-4f) << "page " << p << " page_size " << page << " seed " << kSeed;
        const int64_t seg = p / 4;
        ASSERT_GE(ScoreSummary(SummaryKind::kMinMax, pq, s.segment(seg), s.segment_tokens(seg), s.dim()),
                  best - 1e-4f);
      }
    }
  }
}

TEST(SummariesTest, MergedSegmentSummariesEqualRecomputedFromKeys) {
  std::mt19937 rng(kSeed + 1);
  const int d = 16, page = 5, gpages = 3, n = 5 * 3 * 4 + 7;  // partial last page and segment
  std::vector<float> keys = RandomKeys(rng, n, d, 1.0f);
  RandomFeatures rf(d, 64, 99);
  for (SummaryKind kind : {SummaryKind::kMean, SummaryKind::kRf, SummaryKind::kMinMax}) {
    HeadSummaries s(kind, d, page, gpages, kind == SummaryKind::kRf ? &rf : nullptr);
    AppendInChunks(&s, keys, d, rng);
    const int dim = s.dim();
    std::vector<float> feats(static_cast<size_t>(n) * 64);
    rf.Featurize(keys.data(), n, feats.data(), nullptr);
    ASSERT_EQ(s.num_segments(), 5);
    for (int64_t seg = 0; seg < s.num_segments(); ++seg) {
      const int64_t t0 = seg * page * gpages, t1 = std::min<int64_t>(n, t0 + page * gpages);
      ASSERT_EQ(s.segment_tokens(seg), t1 - t0);
      std::vector<double> want(dim, 0.0);
      if (kind == SummaryKind::kMinMax) {
        for (int i = 0; i < d; ++i) {
          want[i] = 1e30;
          want[d + i] = -1e30;
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        for (int i = 0; i < dim; ++i) {
          if (kind == SummaryKind::kMean) want[i] += keys[t * d + i];
          if (kind == SummaryKind::kRf) want[i] += feats[t * 64 + i];
          if (kind == SummaryKind::kMinMax) {
            const float x = keys[t * d + (i % d)];
            want[i] = i < d ? std::min<double>(want[i], x) : std::max<double>(want[i], x);
          }
        }
      }
      for (int i = 0; i < dim; ++i) {
        ASSERT_NEAR(s.segment(seg)[i], want[i], 1e-4 * (1 + std::fabs(want[i])))
            << SummaryName(kind) << " segment " << seg << " i " << i;
      }
    }
  }
}

TEST(SummariesTest, RandomFeaturesEstimateSoftmaxKernel) {
  // E[phi(q).phi(k)] = exp(q.k / sqrt(d)) (RADAR Lemma 1); with n = 4096 the mean ratio over many
  // pairs must be close to 1.
  std::mt19937 rng(kSeed + 2);
  const int d = 32, n = 4096;
  RandomFeatures rf(d, n, 7);
  double ratio_sum = 0;
  const int pairs = 50;
  for (int i = 0; i < pairs; ++i) {
    std::vector<float> q = RandomKeys(rng, 1, d, 0.4f), k = RandomKeys(rng, 1, d, 0.4f);
    std::vector<float> fq(n), fk(n);
    float shift;
    rf.Featurize(q.data(), 1, fq.data(), &shift);
    rf.Featurize(k.data(), 1, fk.data(), nullptr);
    double est = 0, dot = 0;
    for (int f = 0; f < n; ++f) est += static_cast<double>(fq[f]) * fk[f];
    for (int j = 0; j < d; ++j) dot += q[j] * k[j];
    ratio_sum += est * std::exp(shift) / std::exp(dot / std::sqrt(d));
  }
  EXPECT_NEAR(ratio_sum / pairs, 1.0, 0.05);
}

}  // namespace
}  // namespace strata::engine::sparse
