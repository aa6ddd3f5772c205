// Device-resident sparse selection ops, CPU reference (the specification of the CUDA twins in
// kernels/cuda/selection.cu and kernels/cuda/attention.cu). Semantics in kernels/backend.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/internal/checks.h"
#include "kernels/vote_rank.h"

namespace strata::kernels {

using cpu_internal::CheckDim;
using cpu_internal::CheckDType;
using cpu_internal::CheckRank;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kMaxCandidates = int64_t{1} << 30;

// Pool row of token t of KV head g, or -1 when its page or slot is outside the table or pool.
int64_t RowOf(const TensorView& table, const TensorView& pool, int g, int64_t t) {
  const int64_t page_size = pool.dim(1);
  if (t < 0) return -1;
  const int64_t page = t / page_size;
  if (page >= table.dim(1)) return -1;
  const int64_t slot = table.As<const int32_t>()[g * table.dim(1) + page];
  if (slot < 0 || slot >= pool.dim(0)) return -1;
  return slot * page_size + t % page_size;
}

// The q [num_q_heads, head_dim] / group checks shared by the scoring ops.
absl::Status CheckQuery(const TensorView& q, int64_t num_kv_heads, const char* op) {
  STRATA_RETURN_IF_ERROR(CheckRank(q, 2, op, "q"));
  STRATA_RETURN_IF_ERROR(CheckDType(q, DType::kF32, op, "q"));
  if (num_kv_heads <= 0 || q.dim(0) % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", num_kv_heads,
                                                   " KV heads do not divide ", q.dim(0),
                                                   " query heads"));
  }
  if (q.dim(1) <= 0) return absl::InvalidArgumentError(absl::StrCat(op, ": head_dim must be > 0"));
  return absl::OkStatus();
}

absl::Status CheckScores(const TensorView& scores, int64_t num_kv_heads, int64_t group,
                         int64_t count, const char* op) {
  STRATA_RETURN_IF_ERROR(CheckRank(scores, 3, op, "scores"));
  STRATA_RETURN_IF_ERROR(CheckDType(scores, DType::kF32, op, "scores"));
  STRATA_RETURN_IF_ERROR(CheckDim(scores, 0, num_kv_heads, op, "scores"));
  STRATA_RETURN_IF_ERROR(CheckDim(scores, 1, group, op, "scores"));
  STRATA_RETURN_IF_ERROR(CheckDim(scores, 2, count, op, "scores"));
  return absl::OkStatus();
}

// f32|bf16|fp8_e4m3 pools (every op of this file reads fp8 pools; see kernels/backend.h).
absl::Status CheckPool(const TensorView& pool, const char* op, const char* name) {
  STRATA_RETURN_IF_ERROR(CheckRank(pool, 3, op, name));
  if (pool.dtype != DType::kF32 && pool.dtype != DType::kBF16 &&
      pool.dtype != DType::kFP8E4M3) {
    return absl::UnimplementedError(absl::StrCat(op, ": pool dtype ", DTypeName(pool.dtype),
                                                 " unsupported (f32|bf16|fp8_e4m3)"));
  }
  if (pool.dim(1) <= 0) return absl::InvalidArgumentError(absl::StrCat(op, ": page_size <= 0"));
  return absl::OkStatus();
}

absl::Status CheckTable(const TensorView& table, int64_t num_kv_heads, const char* op) {
  STRATA_RETURN_IF_ERROR(CheckRank(table, 2, op, "page_table"));
  STRATA_RETURN_IF_ERROR(CheckDType(table, DType::kI32, op, "page_table"));
  STRATA_RETURN_IF_ERROR(CheckDim(table, 0, num_kv_heads, op, "page_table"));
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCandidateList(const CandidateList& c, int64_t num_kv_heads, const char* op) {
  if (c.fanout < 1) return absl::InvalidArgumentError(absl::StrCat(op, ": fanout < 1"));
  if (c.begin < 0 || c.end < c.begin || c.end > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": candidate range [", c.begin, ", ", c.end, ") invalid"));
  }
  if (c.parents.data != nullptr) {
    STRATA_RETURN_IF_ERROR(CheckRank(c.parents, 2, op, "parents"));
    STRATA_RETURN_IF_ERROR(CheckDType(c.parents, DType::kI32, op, "parents"));
    STRATA_RETURN_IF_ERROR(CheckDim(c.parents, 0, num_kv_heads, op, "parents"));
  }
  if (c.Count() > kMaxCandidates) {
    return absl::UnimplementedError(absl::StrCat(op, ": more than 2^30 candidates per head"));
  }
  return absl::OkStatus();
}

int64_t CandidateId(const CandidateList& c, int g, int64_t i) {
  int64_t id;
  if (c.parents.data == nullptr) {
    id = c.begin + i;
  } else {
    const int64_t parent = c.parents.As<const int32_t>()[g * c.parents.dim(1) + i / c.fanout];
    if (parent < 0) return -1;
    id = parent * c.fanout + i % c.fanout;
  }
  return id >= c.begin && id < c.end ? id : -1;
}

absl::Status CpuSupportsScoreSummaries(const ScoreSummariesParams& p) {
  constexpr const char* kOp = "ScoreSummaries";
  STRATA_RETURN_IF_ERROR(CheckRank(p.summaries, 3, kOp, "summaries"));
  if (p.summaries.dtype != DType::kBF16) {
    STRATA_RETURN_IF_ERROR(CheckDType(p.summaries, DType::kF32, kOp, "summaries"));
  }
  const int64_t hkv = p.summaries.dim(0);
  STRATA_RETURN_IF_ERROR(CheckQuery(p.q, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckDim(p.summaries, 2, 2 * p.q.dim(1), kOp, "summaries"));
  STRATA_RETURN_IF_ERROR(CheckCandidateList(p.candidates, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckScores(p.scores, hkv, p.q.dim(0) / hkv, p.candidates.Count(), kOp));
  if (!std::isfinite(p.scale)) return absl::InvalidArgumentError("ScoreSummaries: scale not finite");
  return absl::OkStatus();
}

absl::Status CpuSupportsScoreKeys(const ScoreKeysParams& p) {
  constexpr const char* kOp = "ScoreKeys";
  STRATA_RETURN_IF_ERROR(CheckPool(p.k_pool, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.page_table, 2, kOp, "page_table"));
  const int64_t hkv = p.page_table.dim(0);
  STRATA_RETURN_IF_ERROR(CheckTable(p.page_table, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckQuery(p.q, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckDim(p.k_pool, 2, p.q.dim(1), kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckCandidateList(p.candidates, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckScores(p.scores, hkv, p.q.dim(0) / hkv, p.candidates.Count(), kOp));
  if (!std::isfinite(p.scale)) return absl::InvalidArgumentError("ScoreKeys: scale not finite");
  return absl::OkStatus();
}

absl::Status CpuSupportsVoteTopK(const VoteTopKParams& p) {
  constexpr const char* kOp = "VoteTopK";
  STRATA_RETURN_IF_ERROR(CheckRank(p.scores, 3, kOp, "scores"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.scores, DType::kF32, kOp, "scores"));
  const int64_t hkv = p.scores.dim(0);
  if (hkv <= 0 || p.scores.dim(1) <= 0) {
    return absl::InvalidArgumentError("VoteTopK: scores need >= 1 KV head and >= 1 query head");
  }
  STRATA_RETURN_IF_ERROR(CheckCandidateList(p.candidates, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckDim(p.scores, 2, p.candidates.Count(), kOp, "scores"));
  if (p.k < 0 || p.k > kMaxCandidates) {
    return absl::InvalidArgumentError(absl::StrCat("VoteTopK: k ", p.k, " out of range"));
  }
  STRATA_RETURN_IF_ERROR(CheckRank(p.selected, 2, kOp, "selected"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.selected, DType::kI32, kOp, "selected"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.selected, 0, hkv, kOp, "selected"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.selected, 1, p.k, kOp, "selected"));
  const int parts = p.partitions;
  if (!ValidPartitions(parts)) {
    return absl::InvalidArgumentError(
        absl::StrCat("VoteTopK: partitions ", parts, " is not a power of two in [1, 64]"));
  }
  if (p.k % parts != 0 ||
      (p.candidates.parents.data != nullptr && p.candidates.parents.dim(1) % parts != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "VoteTopK: k ", p.k, " and the parents' count must be multiples of partitions ", parts));
  }
  if (p.vote.data != nullptr) {
    STRATA_RETURN_IF_ERROR(CheckRank(p.vote, 2, kOp, "vote"));
    STRATA_RETURN_IF_ERROR(CheckDType(p.vote, DType::kF32, kOp, "vote"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.vote, 0, hkv, kOp, "vote"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.vote, 1, p.candidates.Count(), kOp, "vote"));
  }
  return absl::OkStatus();
}

absl::Status CpuSupportsSelectedAttention(const SelectedAttentionParams& p) {
  constexpr const char* kOp = "SelectedAttention";
  STRATA_RETURN_IF_ERROR(CheckRank(p.q, 3, kOp, "q"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.q, DType::kF32, kOp, "q"));
  if (p.q.dim(0) != 1) return absl::InvalidArgumentError("SelectedAttention: one query token only");
  STRATA_RETURN_IF_ERROR(CheckPool(p.k_pool, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckKvScales(p.k_pool.dtype, p.k_scale, p.v_scale, kOp));
  STRATA_RETURN_IF_ERROR(CheckRank(p.v_pool, 3, kOp, "v_pool"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.v_pool, p.k_pool.dtype, kOp, "v_pool"));
  for (int i = 0; i < 3; ++i) {
    STRATA_RETURN_IF_ERROR(CheckDim(p.v_pool, i, p.k_pool.dim(i), kOp, "v_pool"));
  }
  STRATA_RETURN_IF_ERROR(CheckDim(p.k_pool, 2, p.q.dim(2), kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.page_table, 2, kOp, "page_table"));
  const int64_t hkv = p.page_table.dim(0);
  STRATA_RETURN_IF_ERROR(CheckTable(p.page_table, hkv, kOp));
  if (hkv <= 0 || p.q.dim(1) % hkv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("SelectedAttention: ", hkv,
                                                   " KV heads do not divide ", p.q.dim(1),
                                                   " query heads"));
  }
  STRATA_RETURN_IF_ERROR(CheckCandidateList(p.middle, hkv, kOp));
  if (p.prefix_end < 0 || p.suffix_begin < 0 || p.suffix_end < p.suffix_begin ||
      p.prefix_end > kMaxCandidates || p.suffix_end - p.suffix_begin > kMaxCandidates ||
      p.suffix_end > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError("SelectedAttention: bad prefix or suffix range");
  }
  STRATA_RETURN_IF_ERROR(CheckRank(p.out, 3, kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.out, DType::kF32, kOp, "out"));
  for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(CheckDim(p.out, i, p.q.dim(i), kOp, "out"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.lse, 2, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.lse, DType::kF32, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.lse, 0, 1, kOp, "lse"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.lse, 1, p.q.dim(1), kOp, "lse"));
  if (!std::isfinite(p.scale)) {
    return absl::InvalidArgumentError("SelectedAttention: scale not finite");
  }
  if (p.slot_scales != nullptr && p.k_pool.dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError("SelectedAttention: slot_scales need fp8 pools");
  }
  return absl::OkStatus();
}

absl::Status CpuScoreSummaries(const ScoreSummariesParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsScoreSummaries(p));
  const int hkv = static_cast<int>(p.summaries.dim(0));
  const int group = static_cast<int>(p.q.dim(0) / hkv);
  const int64_t d = p.q.dim(1), items = p.summaries.dim(1), n = p.candidates.Count();
  const float* q = p.q.As<const float>();
  float* out = p.scores.As<float>();
  std::vector<float> v(d), s(2 * d);
  for (int g = 0; g < hkv; ++g) {
    if (p.skip_heads != nullptr && p.skip_heads[g] != 0) continue;
    for (int j = 0; j < group; ++j) {
      const float* qh = q + (static_cast<int64_t>(g) * group + j) * d;
      for (int64_t e = 0; e < d; ++e) v[e] = p.scale * qh[e];
      float* o = out + (static_cast<int64_t>(g) * group + j) * n;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t c = CandidateId(p.candidates, g, i);
        if (c < 0 || c >= items) {
          o[i] = kNegInf;
          continue;
        }
        cpu_internal::LoadF32(p.summaries, (static_cast<int64_t>(g) * items + c) * 2 * d, 2 * d, s.data());
        float acc = 0.0f;
        for (int64_t e = 0; e < d; ++e) acc += std::max(v[e] * s[e], v[e] * s[d + e]);
        o[i] = acc;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuScoreKeys(const ScoreKeysParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsScoreKeys(p));
  const int hkv = static_cast<int>(p.page_table.dim(0));
  const int group = static_cast<int>(p.q.dim(0) / hkv);
  const int64_t d = p.q.dim(1), n = p.candidates.Count();
  const float* q = p.q.As<const float>();
  float* out = p.scores.As<float>();
  std::vector<float> kbuf(d);
  for (int g = 0; g < hkv; ++g) {
    if (p.skip_heads != nullptr && p.skip_heads[g] != 0) continue;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = CandidateId(p.candidates, g, i);
      const int64_t row = t < 0 ? -1 : RowOf(p.page_table, p.k_pool, g, t);
      // The stored values (an fp8 pool's scale is the caller's: kernels/backend.h).
      const float* k = row < 0 ? nullptr
                               : cpu_internal::LoadPoolRow(p.k_pool, row, static_cast<int>(d),
                                                           kbuf.data(), 1.0f);
      for (int j = 0; j < group; ++j) {
        float* o = out + (static_cast<int64_t>(g) * group + j) * n;
        if (row < 0) {
          o[i] = kNegInf;
          continue;
        }
        const float* qh = q + (static_cast<int64_t>(g) * group + j) * d;
        float acc = 0.0f;
        for (int64_t e = 0; e < d; ++e) acc += (p.scale * qh[e]) * k[e];
        o[i] = acc;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuVoteTopK(const VoteTopKParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsVoteTopK(p));
  const int hkv = static_cast<int>(p.scores.dim(0));
  const int group = static_cast<int>(p.scores.dim(1));
  const int64_t n = p.scores.dim(2), k = p.k;
  const int parts = p.partitions;
  const int64_t part_k = k / parts;
  const float* scores = p.scores.As<const float>();
  std::vector<float> vote(n);
  std::vector<char> valid(n);
  std::vector<uint32_t> rank(n);
  // Each part's candidate indices, ascending (VoteTopKParams::partitions; the same for every
  // KV head).
  std::vector<std::vector<int64_t>> part_members(parts);
  for (int part = 0; part < parts; ++part) {
    std::vector<int64_t>& members = part_members[part];
    if (parts == 1) {
      for (int64_t i = 0; i < n; ++i) members.push_back(i);
    } else if (p.candidates.parents.data == nullptr) {
      for (int64_t i = ((part - p.candidates.begin) % parts + parts) % parts; i < n; i += parts) {
        members.push_back(i);
      }
    } else {
      const int64_t span = p.candidates.parents.dim(1) / parts * p.candidates.fanout;
      for (int64_t i = part * span; i < (part + 1) * span; ++i) members.push_back(i);
    }
  }
  std::vector<int64_t> order;
  for (int g = 0; g < hkv; ++g) {
    if (p.skip_heads != nullptr && p.skip_heads[g] != 0) continue;
    std::fill(vote.begin(), vote.end(), 0.0f);
    std::fill(valid.begin(), valid.end(), 0);
    int32_t* sel = p.selected.As<int32_t>() + static_cast<int64_t>(g) * k;
    for (int part = 0; part < parts; ++part) {
      const std::vector<int64_t>& members = part_members[part];
      for (int j = 0; j < group; ++j) {
        const float* s = scores + (static_cast<int64_t>(g) * group + j) * n;
        float m = kNegInf;
        for (int64_t i : members) {
          if (s[i] > m) m = s[i];  // NaN never wins
          if (s[i] > kNegInf) valid[i] = 1;
        }
        if (m == kNegInf) continue;
        double total = 0.0;
        for (int64_t i : members) {
          if (s[i] > kNegInf) total += std::exp(s[i] - m);
        }
        const float inv = static_cast<float>(1.0 / total);
        for (int64_t i : members) {
          if (s[i] > kNegInf) vote[i] += std::exp(s[i] - m) * inv;
        }
      }
      order.clear();
      for (int64_t i : members) {
        if (valid[i] && CandidateId(p.candidates, g, i) >= 0) order.push_back(i);
      }
      const int64_t take = std::min<int64_t>(part_k, static_cast<int64_t>(order.size()));
      for (int64_t i : order) rank[i] = VoteRankKey(vote[i]);
      std::partial_sort(order.begin(), order.begin() + take, order.end(),
                        [&](int64_t a, int64_t b) { return VoteRankBefore(rank[a], a, rank[b], b); });
      std::sort(order.begin(), order.begin() + take);
      int32_t* part_sel = sel + part * part_k;
      for (int64_t i = 0; i < part_k; ++i) {
        part_sel[i] = i < take ? static_cast<int32_t>(CandidateId(p.candidates, g, order[i])) : -1;
      }
    }
    if (p.vote.data != nullptr) {
      std::copy(vote.begin(), vote.end(), p.vote.As<float>() + static_cast<int64_t>(g) * n);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSelectedAttention(const SelectedAttentionParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsSelectedAttention(p));
  const int hkv = static_cast<int>(p.page_table.dim(0));
  const int hq = static_cast<int>(p.q.dim(1));
  const int group = hq / hkv;
  const int64_t d = p.q.dim(2), n_mid = p.middle.Count();
  const float* q = p.q.As<const float>();
  float* out = p.out.As<float>();
  float* lse = p.lse.As<float>();
  // The prefix read from memory when prefix_len is set (backend memory is host memory here).
  const int64_t prefix_end =
      p.prefix_len == nullptr
          ? p.prefix_end
          : std::clamp<int64_t>(static_cast<int64_t>(*p.prefix_len), 0, p.prefix_end);
  // The scales of pool row r (slot r / page_size): the pool's, times the slot's (slot_scales).
  const int64_t page_rows = p.k_pool.dim(1);
  auto k_scale_of = [&](int64_t r) {
    return p.slot_scales == nullptr ? p.k_scale : p.k_scale * p.slot_scales[2 * (r / page_rows)];
  };
  auto v_scale_of = [&](int64_t r) {
    return p.slot_scales == nullptr ? p.v_scale
                                    : p.v_scale * p.slot_scales[2 * (r / page_rows) + 1];
  };
  // KV heads are independent: one per OpenMP iteration (the team the backend set up).
#pragma omp parallel
  {
  std::vector<int64_t> rows;
  std::vector<float> s, acc(d), kf, vf;
  std::vector<const float*> krow, vrow;
#pragma omp for schedule(static)
  for (int g = 0; g < hkv; ++g) {
    rows.clear();
    auto add = [&](int64_t t) {
      const int64_t r = RowOf(p.page_table, p.k_pool, g, t);
      if (r >= 0) rows.push_back(r);
    };
    for (int64_t t = 0; t < prefix_end; ++t) add(t);
    for (int64_t i = 0; i < n_mid; ++i) {
      const int64_t t = CandidateId(p.middle, g, i);
      if (t >= 0) add(t);
    }
    for (int64_t t = p.suffix_begin; t < p.suffix_end; ++t) add(t);
    s.resize(rows.size());
    // The group's rows as scaled f32, converted once for its query heads (f32 pools: in place).
    kf.resize(rows.size() * d);
    vf.resize(rows.size() * d);
    krow.resize(rows.size());
    vrow.resize(rows.size());
    for (size_t r = 0; r < rows.size(); ++r) {
      krow[r] = cpu_internal::LoadPoolRow(p.k_pool, rows[r], static_cast<int>(d), &kf[r * d], k_scale_of(rows[r]));
      vrow[r] = cpu_internal::LoadPoolRow(p.v_pool, rows[r], static_cast<int>(d), &vf[r * d], v_scale_of(rows[r]));
    }
    for (int j = 0; j < group; ++j) {
      const int h = g * group + j;
      const float* qh = q + static_cast<int64_t>(h) * d;
      float m = kNegInf;
      for (size_t r = 0; r < rows.size(); ++r) {
        float dot = 0.0f;
        const float* kr = krow[r];
        for (int64_t e = 0; e < d; ++e) dot += qh[e] * kr[e];
        s[r] = p.scale * dot;
        m = std::max(m, s[r]);
      }
      float* o = out + static_cast<int64_t>(h) * d;
      if (rows.empty() || m == kNegInf) {
        std::fill(o, o + d, 0.0f);
        lse[h] = kNegInf;
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      double l = 0.0;
      for (size_t r = 0; r < rows.size(); ++r) {
        const float w = std::exp(s[r] - m);
        l += w;
        const float* vr = vrow[r];
        for (int64_t e = 0; e < d; ++e) acc[e] += w * vr[e];
      }
      for (int64_t e = 0; e < d; ++e) o[e] = static_cast<float>(acc[e] / l);
      lse[h] = m + static_cast<float>(std::log(l));
    }
  }
  }  // omp parallel
  return absl::OkStatus();
}

absl::Status CpuSupportsSelectionCacheCheck(const SelectionCacheCheckParams& p) {
  constexpr const char* kOp = "SelectionCacheCheck";
  STRATA_RETURN_IF_ERROR(CheckRank(p.cached_q, 2, kOp, "cached_q"));
  STRATA_RETURN_IF_ERROR(CheckDType(p.cached_q, DType::kF32, kOp, "cached_q"));
  const int64_t hkv = p.cached_q.dim(0);
  STRATA_RETURN_IF_ERROR(CheckQuery(p.q, hkv, kOp));
  STRATA_RETURN_IF_ERROR(CheckDim(p.cached_q, 1, p.q.dim(0) / hkv * p.q.dim(1), kOp, "cached_q"));
  for (const auto& [v, name] : {std::pair<const TensorView*, const char*>{&p.valid, "valid"},
                                {&p.reuse, "reuse"}}) {
    STRATA_RETURN_IF_ERROR(CheckRank(*v, 1, kOp, name));
    STRATA_RETURN_IF_ERROR(CheckDType(*v, DType::kI32, kOp, name));
    STRATA_RETURN_IF_ERROR(CheckDim(*v, 0, hkv, kOp, name));
  }
  if (!std::isfinite(p.theta)) {
    return absl::InvalidArgumentError("SelectionCacheCheck: theta not finite");
  }
  return absl::OkStatus();
}

double SelectionCacheCosine(const float* q, const float* cached, int64_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (int64_t i = 0; i < n; ++i) {
    ab += static_cast<double>(q[i]) * cached[i];
    aa += static_cast<double>(q[i]) * q[i];
    bb += static_cast<double>(cached[i]) * cached[i];
  }
  return aa == 0 || bb == 0 ? 0.0 : ab / std::sqrt(aa * bb);
}

absl::Status CpuSelectionCacheCheck(const SelectionCacheCheckParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsSelectionCacheCheck(p));
  const int64_t hkv = p.cached_q.dim(0), n = p.cached_q.dim(1);
  const float* q = p.q.As<const float>();
  float* cached = p.cached_q.As<float>();
  int32_t* valid = p.valid.As<int32_t>();
  int32_t* reuse = p.reuse.As<int32_t>();
  int64_t hits = 0;
  for (int64_t g = 0; g < hkv; ++g) {
    const float* a = q + g * n;
    float* c = cached + g * n;
    const bool hit = valid[g] != 0 && SelectionCacheCosine(a, c, n) >= p.theta;  // NaN: false
    reuse[g] = hit ? 1 : 0;
    if (hit) {
      ++hits;
    } else {
      std::copy(a, a + n, c);
      valid[g] = 1;
    }
  }
  if (p.hit_count != nullptr) *p.hit_count += hits;
  return absl::OkStatus();
}

absl::Status CpuSupportsUpdateSummaries(const UpdateSummariesParams& p) {
  constexpr const char* kOp = "UpdateSummaries";
  STRATA_RETURN_IF_ERROR(CheckPool(p.k_pool, kOp, "k_pool"));
  STRATA_RETURN_IF_ERROR(CheckRank(p.page_table, 2, kOp, "page_table"));
  const int64_t hkv = p.page_table.dim(0), d = p.k_pool.dim(2), page = p.k_pool.dim(1);
  STRATA_RETURN_IF_ERROR(CheckTable(p.page_table, hkv, kOp));
  if (hkv <= 0 || d <= 0) return absl::InvalidArgumentError("UpdateSummaries: empty shape");
  if (p.first < 0 || p.end < p.first || p.end > p.page_table.dim(1) * page ||
      p.end > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("UpdateSummaries: tokens [", p.first, ", ",
                                                   p.end, ") outside the table"));
  }
  const int64_t pages = (p.end + page - 1) / page;
  STRATA_RETURN_IF_ERROR(CheckRank(p.pages, 3, kOp, "pages"));
  if (p.pages.dtype != DType::kBF16) STRATA_RETURN_IF_ERROR(CheckDType(p.pages, DType::kF32, kOp, "pages"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.pages, 0, hkv, kOp, "pages"));
  STRATA_RETURN_IF_ERROR(CheckDim(p.pages, 2, 2 * d, kOp, "pages"));
  if (p.pages.dim(1) < pages) {
    return absl::InvalidArgumentError(absl::StrCat("UpdateSummaries: ", p.pages.dim(1),
                                                   " page rows < ", pages));
  }
  if (p.segment_pages < 1) return absl::InvalidArgumentError("UpdateSummaries: segment_pages < 1");
  if (p.segments.data != nullptr) {
    STRATA_RETURN_IF_ERROR(CheckRank(p.segments, 3, kOp, "segments"));
    STRATA_RETURN_IF_ERROR(CheckDType(p.segments, p.pages.dtype, kOp, "segments"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.segments, 0, hkv, kOp, "segments"));
    STRATA_RETURN_IF_ERROR(CheckDim(p.segments, 2, 2 * d, kOp, "segments"));
    if (p.segments.dim(1) < (pages + p.segment_pages - 1) / p.segment_pages) {
      return absl::InvalidArgumentError("UpdateSummaries: too few segment rows");
    }
  }
  return absl::OkStatus();
}

absl::Status CpuUpdateSummaries(const UpdateSummariesParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsUpdateSummaries(p));
  if (p.first == p.end) return absl::OkStatus();
  const int hkv = static_cast<int>(p.page_table.dim(0));
  const int64_t d = p.k_pool.dim(2), page = p.k_pool.dim(1);
  const int64_t total_pages = (p.end + page - 1) / page;
  const int64_t pb = p.first / page, pe = total_pages;
  const bool bf16 = p.pages.dtype == DType::kBF16;
  // A row [min(d), max(d)] to its place in a f32 or bf16 (rounded outward) tensor.
  auto store = [&](const TensorView& t, int64_t row, const float* r) {
    if (!bf16) {
      std::copy(r, r + 2 * d, t.As<float>() + row * 2 * d);
      return;
    }
    MinMaxRowsToBF16(r, 1, d, t.As<uint16_t>() + row * 2 * d);
  };
  std::vector<float> rv(2 * d), qv(2 * d), kbuf(d);
  float* const r = rv.data();
  const float* const q = qv.data();
  for (int g = 0; g < hkv; ++g) {
    for (int64_t pg = pb; pg < pe; ++pg) {
      bool any = false;
      for (int64_t t = pg * page; t < std::min(p.end, (pg + 1) * page); ++t) {
        const int64_t row = RowOf(p.page_table, p.k_pool, g, t);
        if (row < 0) continue;
        const float* kv =  // stored values, as ScoreKeys
            cpu_internal::LoadPoolRow(p.k_pool, row, static_cast<int>(d), kbuf.data(), 1.0f);
        for (int64_t e = 0; e < d; ++e) {
          const float x = kv[e];
          if (!any || x < r[e]) r[e] = x;
          if (!any || x > r[d + e]) r[d + e] = x;
        }
        any = true;
      }
      if (!any) std::fill(r, r + 2 * d, 0.0f);
      store(p.pages, g * p.pages.dim(1) + pg, r);
    }
    if (p.segments.data == nullptr) continue;
    const int64_t gs = p.segment_pages;
    for (int64_t sg = pb / gs; sg < (pe + gs - 1) / gs; ++sg) {
      for (int64_t pg = sg * gs; pg < std::min(pe, (sg + 1) * gs); ++pg) {
        cpu_internal::LoadF32(p.pages, (g * p.pages.dim(1) + pg) * 2 * d, 2 * d, qv.data());
        for (int64_t e = 0; e < d; ++e) {
          if (pg == sg * gs || q[e] < r[e]) r[e] = q[e];
          if (pg == sg * gs || q[d + e] > r[d + e]) r[d + e] = q[d + e];
        }
      }
      store(p.segments, g * p.segments.dim(1) + sg, r);
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
