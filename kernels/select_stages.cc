// Backend::SelectStages' default: the chain and the attention's params checked, then
// ScoreSummaries / ScoreKeys and VoteTopK per stage, then the attention (semantics in
// kernels/backend.h SelectStagesParams).
#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::kernels {

absl::Status CheckSelectStagesChain(const SelectStagesParams& p) {
  if (p.num_stages < 1 || p.num_stages > kMaxSelectStages) {
    return absl::InvalidArgumentError(absl::StrCat("SelectStages: num_stages must be 1 to ",
                                                   kMaxSelectStages, ", got ", p.num_stages));
  }
  for (int i = 1; i < p.num_stages; ++i) {
    const TensorView& parents = p.stages[i].candidates.parents;
    const TensorView& prev = p.stages[i - 1].selected;
    if (parents.data == nullptr || parents.data != prev.data || parents.rank != 2 ||
        prev.rank != 2 || parents.dim(0) != prev.dim(0) || parents.dim(1) != prev.dim(1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectStages: stage ", i, "'s candidates must have stage ", i - 1,
          "'s selected as parents, got parents ", parents.DebugString(), " and selected ",
          prev.DebugString()));
    }
  }
  const TensorView& arrivals = p.arrivals;
  // The CUDA kernel adds to them atomically: a misaligned counter would fault the device.
  if (arrivals.data != nullptr &&
      (arrivals.dtype != DType::kI32 || arrivals.rank != 1 || p.stages[0].selected.rank < 1 ||
       arrivals.dim(0) != p.stages[0].selected.dim(0) ||
       reinterpret_cast<uintptr_t>(arrivals.data) % alignof(int32_t) != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectStages: arrivals must be a 4-byte aligned i32 [num_kv_heads] view, got ",
        arrivals.DebugString()));
  }
  if (p.cache_check != nullptr) {
    if (p.skip_heads != nullptr) {
      return absl::InvalidArgumentError(
          "SelectStages: skip_heads and cache_check both set (the check's reuse flags are the "
          "skip flags)");
    }
    const SelectionCacheCheckParams& cc = *p.cache_check;
    const bool same_q = cc.q.data == p.q.data && cc.q.dtype == p.q.dtype &&
                        cc.q.rank == p.q.rank &&
                        std::equal(cc.q.shape, cc.q.shape + kMaxRank, p.q.shape);
    if (!same_q) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectStages: cache_check must check the call's own query (the same data and shape), "
          "got ", cc.q.DebugString(), " for q ", p.q.DebugString()));
    }
    // Its reuse flags are the stages' skip flags, one per KV head of the call.
    if (cc.cached_q.rank < 1 || p.stages[0].selected.rank < 1 ||
        cc.cached_q.dim(0) != p.stages[0].selected.dim(0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectStages: cache_check's cache must hold the call's KV heads, got cached_q ",
          cc.cached_q.DebugString(), " for selected ", p.stages[0].selected.DebugString()));
    }
  }
  return absl::OkStatus();
}

namespace {
// The fields ScoreSummariesParams and ScoreKeysParams share, from stage i of p.
template <typename ScoreParams>
ScoreParams StageScoreCommon(const SelectStagesParams& p, int i) {
  ScoreParams a;
  a.q = p.q;
  a.candidates = p.stages[i].candidates;
  a.scale = p.scale;
  a.scores = p.stages[i].scores;
  a.skip_heads = p.skip_heads;
  return a;
}
}  // namespace

ScoreSummariesParams StageScoreSummariesParams(const SelectStagesParams& p, int i) {
  ScoreSummariesParams a = StageScoreCommon<ScoreSummariesParams>(p, i);
  a.summaries = p.stages[i].summaries;
  return a;
}

ScoreKeysParams StageScoreKeysParams(const SelectStagesParams& p, int i) {
  ScoreKeysParams k = StageScoreCommon<ScoreKeysParams>(p, i);
  k.k_pool = p.stages[i].k_pool;
  k.page_table = p.stages[i].page_table;
  return k;
}

VoteTopKParams StageVoteTopKParams(const SelectStagesParams& p, int i) {
  const SelectStage& st = p.stages[i];
  VoteTopKParams t;
  t.scores = st.scores;
  t.candidates = st.candidates;
  t.k = st.k;
  t.selected = st.selected;
  t.skip_heads = p.skip_heads;
  t.partitions = p.partitions;
  return t;
}

absl::Status CheckSelectStagesOps(const SelectStagesParams& p) {
  for (int i = 0; i < p.num_stages; ++i) {
    if (p.stages[i].summaries.data != nullptr) {
      STRATA_RETURN_IF_ERROR(CpuSupportsScoreSummaries(StageScoreSummariesParams(p, i)));
    } else {
      STRATA_RETURN_IF_ERROR(CpuSupportsScoreKeys(StageScoreKeysParams(p, i)));
    }
    STRATA_RETURN_IF_ERROR(CpuSupportsVoteTopK(StageVoteTopKParams(p, i)));
  }
  return absl::OkStatus();
}

absl::Status SelectStagesAfterCacheCheck(Backend& b, const SelectStagesParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CheckSelectStagesChain(p));
  if (p.cache_check == nullptr) return b.SelectStages(p, s);
  SelectStagesParams after = p;
  after.skip_heads = p.cache_check->reuse.As<const int32_t>();
  after.cache_check = nullptr;
  // Every op's params before the check writes the cache's state (none of these checks reads a
  // result), so that params refused fail the op with nothing written.
  STRATA_RETURN_IF_ERROR(CpuSupportsSelectionCacheCheck(*p.cache_check));
  STRATA_RETURN_IF_ERROR(CheckSelectStagesOps(after));
  if (after.attend != nullptr) STRATA_RETURN_IF_ERROR(CpuSupportsSelectedAttention(*after.attend));
  STRATA_RETURN_IF_ERROR(b.SelectionCacheCheck(*p.cache_check, s));
  return b.SelectStages(after, s);
}

absl::Status SelectStagesOpByOp(Backend& b, const SelectStagesParams& p, Stream s) {
  if (p.cache_check != nullptr) return SelectStagesAfterCacheCheck(b, p, s);
  STRATA_RETURN_IF_ERROR(CheckSelectStagesChain(p));
  // The attention's params before any stage runs (none of the checks reads the stages' results),
  // so that an attention they refuse fails the op and every output keeps what it had.
  if (p.attend != nullptr) STRATA_RETURN_IF_ERROR(CpuSupportsSelectedAttention(*p.attend));
  for (int i = 0; i < p.num_stages; ++i) {
    if (p.stages[i].summaries.data != nullptr) {
      STRATA_RETURN_IF_ERROR(b.ScoreSummaries(StageScoreSummariesParams(p, i), s));
    } else {
      STRATA_RETURN_IF_ERROR(b.ScoreKeys(StageScoreKeysParams(p, i), s));
    }
    STRATA_RETURN_IF_ERROR(b.VoteTopK(StageVoteTopKParams(p, i), s));
  }
  if (p.attend != nullptr) STRATA_RETURN_IF_ERROR(b.SelectedAttention(*p.attend, s));
  return absl::OkStatus();
}

absl::Status Backend::SelectStages(const SelectStagesParams& p, Stream s) {
  return SelectStagesOpByOp(*this, p, s);
}

}  // namespace strata::kernels
