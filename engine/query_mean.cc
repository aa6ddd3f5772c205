// The mean query of a chunk; see engine/query_mean.h.
#include "engine/query_mean.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace strata::engine {

using kernels::DType;
using kernels::TensorView;

void MeanQuery(const float* q, int num_tokens, int64_t row, std::vector<float>* out, int64_t stride) {
  if (stride == 0) stride = row;
  out->assign(static_cast<size_t>(row), 0.0f);
  for (int t = 0; t < num_tokens; ++t) {
    const float* qt = q + static_cast<size_t>(t) * stride;
    for (int64_t i = 0; i < row; ++i) (*out)[i] += qt[i];
  }
  for (float& x : *out) x /= static_cast<float>(num_tokens);
}

absl::StatusOr<TensorView> DeviceQueryMean::Mean(const TensorView& q, kernels::Stream stream) {
  if (q.dtype != DType::kF32 || q.rank != 3 || q.dim(0) < 1 || q.dim(1) != hq_ || q.dim(2) != d_ ||
      q.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceQueryMean: q must be f32 [m >= 1, ", hq_, ", ", d_, "], got ", q.DebugString()));
  }
  const int64_t m = q.dim(0);
  if (m == 1) return TensorView(q.data, DType::kF32, {hq_, d_});
  constexpr int64_t kMaxParts = 64;  // MergeAttention's part limit on the CUDA backend
  if (m != rows_) {
    // Plan: each level merges up to 64 parts of R consecutive rows (the last part shifted back to
    // end at the last row, its rows already covered by the part before given lse -inf), so level
    // output row r is the weighted mean of its owned input rows; an input row's lse is the log of
    // the number of query rows it already averages, so the last level's row is the mean of all.
    plan_.clear();
    std::vector<float> lse_host;
    std::vector<double> weight(static_cast<size_t>(m), 1.0);
    int64_t n = m;
    int64_t widest = 1;
    while (n > 1) {
      MergeLevel lv;
      const int64_t k = std::min(kMaxParts, n);
      const int64_t r_out = (n + k - 1) / k;
      const int64_t parts = (n + r_out - 1) / r_out;
      lv.rows_out = r_out;
      lv.lse_offset = static_cast<int64_t>(lse_host.size());
      std::vector<double> next(static_cast<size_t>(r_out), 0.0);
      for (int64_t s = 0; s < parts; ++s) {
        const int64_t start = std::min(s * r_out, n - r_out);
        lv.starts.push_back(start);
        for (int64_t r = 0; r < r_out; ++r) {
          const int64_t row = start + r;
          const bool owned = row >= s * r_out;
          const float l = owned ? static_cast<float>(std::log(weight[row]))
                                : -std::numeric_limits<float>::infinity();
          for (int h = 0; h < hq_; ++h) lse_host.push_back(l);
          if (owned) next[r] += weight[row];
        }
      }
      widest = std::max(widest, r_out);
      plan_.push_back(std::move(lv));
      weight = std::move(next);
      n = r_out;
    }
    const size_t f = sizeof(float);
    if (lse_ == nullptr || lse_->bytes() < lse_host.size() * f) {
      STRATA_ASSIGN_OR_RETURN(lse_, backend_->Allocate(lse_host.size() * f));
    }
    const size_t out_bytes = static_cast<size_t>(widest) * hq_ * d_ * f;
    for (int i = 0; i < 2; ++i) {
      if (out_[i] == nullptr || out_[i]->bytes() < out_bytes) {
        STRATA_ASSIGN_OR_RETURN(out_[i], backend_->Allocate(out_bytes));
        STRATA_ASSIGN_OR_RETURN(out_lse_[i], backend_->Allocate(static_cast<size_t>(widest) * hq_ * f));
      }
    }
    rows_ = 0;  // until the upload succeeded
    STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(lse_->data(), lse_host.data(), lse_host.size() * f, stream));
    rows_ = m;
  }
  const float* in = static_cast<const float*>(q.data);
  const float* lse_base = static_cast<const float*>(lse_->data());
  std::vector<TensorView> outs, lses;
  int buf = 0;
  for (const MergeLevel& lv : plan_) {
    const int64_t r = lv.rows_out;
    outs.clear();
    lses.clear();
    for (size_t s = 0; s < lv.starts.size(); ++s) {
      outs.emplace_back(const_cast<float*>(in + lv.starts[s] * hq_ * d_), DType::kF32,
                        std::initializer_list<int64_t>{r, hq_, d_});
      lses.emplace_back(const_cast<float*>(lse_base + lv.lse_offset + s * r * hq_), DType::kF32,
                        std::initializer_list<int64_t>{r, hq_});
    }
    kernels::MergeAttentionParams mp;
    mp.outs = outs.data();
    mp.lses = lses.data();
    mp.num_parts = static_cast<int>(outs.size());
    mp.out = out_[buf]->View(DType::kF32, {r, hq_, d_});
    mp.lse = out_lse_[buf]->View(DType::kF32, {r, hq_});
    STRATA_RETURN_IF_ERROR(backend_->MergeAttention(mp, stream));
    in = static_cast<const float*>(out_[buf]->data());
    buf ^= 1;
  }
  return TensorView(const_cast<float*>(in), DType::kF32, {hq_, d_});
}

}  // namespace strata::engine
