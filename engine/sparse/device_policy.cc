// DevicePolicy: see engine/sparse/device_policy.h.
#include "engine/sparse/device_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace strata::engine::sparse {

using kernels::CandidateList;
using kernels::DType;
using kernels::KvSpan;
using kernels::TensorView;

DevicePolicy::DevicePolicy(const PolicyOptions& options, const KvCacheOptions& cache,
                           int num_q_heads, kernels::Backend* backend)
    : options_(options),
      cache_options_(cache),
      hq_(num_q_heads),
      hkv_(cache.num_kv_heads),
      group_(cache.num_kv_heads > 0 ? num_q_heads / cache.num_kv_heads : 1),
      d_(cache.head_dim),
      page_(cache.page_size),
      seg_pages_(options.EffectiveSegmentPages()),
      parts_(options.kind == PolicyKind::kTokenSelect ? options.EffectivePartitions(group_) : 1),
      max_pages_((cache.max_tokens + cache.page_size - 1) / cache.page_size),
      max_segs_(0),
      wanted_pages_(0),
      policy_wanted_pages_(0),
      kept_tokens_(0),
      backend_(backend),
      mean_query_(backend, num_q_heads, cache.head_dim) {
  cache_on_ = options.cache_theta <= 1.0;
  max_segs_ = (max_pages_ + seg_pages_ - 1) / seg_pages_;
  const int64_t wanted = options.kind == PolicyKind::kTokenSelect
                             ? static_cast<int64_t>(options.token_budget) *
                                   options.tokenselect_candidate_factor
                             : options.token_budget;
  policy_wanted_pages_ = (wanted + page_ - 1) / page_;
  // Every stage's k a multiple of the parts (SelectStagesParams::partitions): part j keeps
  // ceil(policy_wanted_pages_ / parts) pages, as the host policy's TokenSelectParts does.
  wanted_pages_ = RoundUpToParts(policy_wanted_pages_);
  kept_tokens_ = RoundUpToParts(options.token_budget);
}

int64_t DevicePolicy::RoundUpToParts(int64_t n) const { return (n + parts_ - 1) / parts_ * parts_; }

DevicePolicy::~DevicePolicy() = default;

absl::StatusOr<std::unique_ptr<DevicePolicy>> DevicePolicy::Create(const PolicyOptions& options,
                                                                   const KvCacheOptions& cache,
                                                                   int num_q_heads,
                                                                   kernels::Backend* backend) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  STRATA_RETURN_IF_ERROR(cache.Validate());
  if (backend == nullptr) return absl::InvalidArgumentError("DevicePolicy: null backend");
  if (options.kind != PolicyKind::kQuest && options.kind != PolicyKind::kTokenSelect) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: policy ",
                                                   PolicyName(options.kind),
                                                   " has no device version (quest|tokenselect)"));
  }
  if (options.EffectiveSummary() != SummaryKind::kMinMax) {
    return absl::InvalidArgumentError("DevicePolicy: only minmax summaries run on the device");
  }
  if (options.page_size != cache.page_size) {
    return absl::InvalidArgumentError("DevicePolicy: policy and cache page sizes differ");
  }
  if (num_q_heads <= 0 || num_q_heads % cache.num_kv_heads != 0) {
    return absl::InvalidArgumentError("DevicePolicy: KV heads must divide query heads");
  }
  for (int l : options.dense_layers) {
    if (l >= cache.num_layers) return absl::InvalidArgumentError("DevicePolicy: bad dense layer");
  }
  std::unique_ptr<DevicePolicy> p(new DevicePolicy(options, cache, num_q_heads, backend));
  STRATA_RETURN_IF_ERROR(p->Init());
  return p;
}

absl::Status DevicePolicy::Init() {
  const int layers = cache_options_.num_layers;
  dense_layer_.assign(layers, false);
  for (int l : options_.dense_layers) dense_layer_[l] = true;
  table_.resize(layers);
  pages_.resize(layers);
  segs_.resize(layers);
  table_ready_.assign(layers, false);
  // bf16 and fp8 pools: bf16 summaries (the min and max of bf16 keys, or of fp8 e4m3 codes, are
  // bf16 values: the same bounds in half the bytes, and the form the fused selection kernel
  // reads); f32 pools keep f32 summaries.
  summary_dtype_ = cache_options_.dtype == DType::kBF16 || cache_options_.dtype == DType::kFP8E4M3
                       ? DType::kBF16
                       : DType::kF32;
  const size_t row = static_cast<size_t>(2) * d_ * kernels::DTypeSize(summary_dtype_);
  for (int l = 0; l < layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(table_[l], backend_->Allocate(sizeof(int32_t) * hkv_ * max_pages_));
    STRATA_ASSIGN_OR_RETURN(pages_[l], backend_->Allocate(row * hkv_ * max_pages_));
    STRATA_ASSIGN_OR_RETURN(segs_[l], backend_->Allocate(row * hkv_ * max_segs_));
  }
  const size_t f = sizeof(float);
  STRATA_ASSIGN_OR_RETURN(seg_scores_, backend_->Allocate(f * hkv_ * group_ * max_segs_));
  // The segment stage keeps at most every segment, rounded up to a multiple of the parts.
  const int64_t max_kept_segs = RoundUpToParts(max_segs_);
  STRATA_ASSIGN_OR_RETURN(page_scores_,
                          backend_->Allocate(f * hkv_ * group_ * max_kept_segs * seg_pages_));
  STRATA_ASSIGN_OR_RETURN(tok_scores_,
                          backend_->Allocate(f * hkv_ * group_ * wanted_pages_ * page_));
  STRATA_ASSIGN_OR_RETURN(top_segs_, backend_->Allocate(sizeof(int32_t) * hkv_ * max_kept_segs));
  STRATA_ASSIGN_OR_RETURN(top_pages_, backend_->Allocate(sizeof(int32_t) * hkv_ * wanted_pages_));
  STRATA_ASSIGN_OR_RETURN(top_tokens_,
                          backend_->Allocate(sizeof(int32_t) * hkv_ * kept_tokens_));
  if (parts_ > 1) {
    // Zero once; every call that uses them leaves them zero.
    STRATA_ASSIGN_OR_RETURN(arrivals_, backend_->Allocate(sizeof(int32_t) * hkv_));
    const std::vector<int32_t> zeros(static_cast<size_t>(hkv_), 0);
    STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(arrivals_->data(), zeros.data(),
                                                  sizeof(int32_t) * hkv_, nullptr));
  }
  if (cache_on_) {
    // Per layer: the cached queries (invalid: the first step selects), the step's reuse flags
    // and the layer's own final selection (kept across steps).
    const int64_t kept = options_.kind == PolicyKind::kTokenSelect ? kept_tokens_ : wanted_pages_;
    STRATA_ASSIGN_OR_RETURN(sel_cache_, DeviceSelectionCache::Create(
                                            backend_, layers, hkv_, group_, d_,
                                            std::max<int64_t>(1, kept), options_.cache_theta));
  }
  return absl::OkStatus();
}

absl::Status DevicePolicy::ReadCacheHits(kernels::Stream stream) {
  if (!cache_on_) return absl::OkStatus();
  STRATA_ASSIGN_OR_RETURN(const int64_t hits, sel_cache_->ReadHits(stream));
  counters_.cache_lookups = sel_cache_->lookups();
  counters_.cache_hits = hits;
  return absl::OkStatus();
}

absl::Status DevicePolicy::QueueCacheHitsRead(kernels::Stream stream) {
  if (!cache_on_) return absl::OkStatus();
  queued_lookups_ = sel_cache_->lookups();
  return sel_cache_->QueueHitsRead(stream);
}

void DevicePolicy::TakeCacheHits() {
  if (!cache_on_) return;
  counters_.cache_lookups = queued_lookups_;
  counters_.cache_hits = sel_cache_->QueuedHits();
}

absl::Status DevicePolicy::CheckCache(int layer, const KvCache& cache) const {
  const KvCacheOptions& c = cache.options();
  if (layer < 0 || layer >= cache_options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: layer ", layer, " out of range"));
  }
  if (c.num_layers != cache_options_.num_layers || c.num_kv_heads != hkv_ || c.head_dim != d_ ||
      c.page_size != page_ || c.max_tokens > cache_options_.max_tokens) {
    return absl::InvalidArgumentError("DevicePolicy: cache shape differs from the policy's");
  }
  return absl::OkStatus();
}

absl::Status DevicePolicy::OnAppend(int layer, const KvCache& cache, int64_t first, int64_t end,
                                    kernels::Stream stream) {
  STRATA_RETURN_IF_ERROR(CheckCache(layer, cache));
  if (first < 0 || end < first || end != cache.length(layer)) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: append [", first, ", ", end,
                                                   ") does not end at the cache length ",
                                                   cache.length(layer)));
  }
  if (!table_ready_[layer]) {
    const std::vector<int32_t> t = cache.PageTable(max_pages_);
    STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(table_[layer]->data(), t.data(),
                                                  t.size() * sizeof(int32_t), stream));
    table_ready_[layer] = true;
  }
  if (dense_layer_[layer]) return absl::OkStatus();
  kernels::UpdateSummariesParams u;
  u.k_pool = cache.k_pool(layer);
  u.page_table = table_[layer]->View(DType::kI32, {hkv_, max_pages_});
  u.first = first;
  u.end = end;
  u.pages = pages_[layer]->View(summary_dtype_, {hkv_, max_pages_, 2 * d_});
  u.segments = segs_[layer]->View(summary_dtype_, {hkv_, max_segs_, 2 * d_});
  u.segment_pages = seg_pages_;
  return backend_->UpdateSummaries(u, stream);
}

absl::Status DevicePolicy::Attend(int layer, const TensorView& q, const KvCache& cache,
                                  const TensorView& out, const TensorView& lse,
                                  kernels::Stream stream) {
  STRATA_RETURN_IF_ERROR(CheckCache(layer, cache));
  if (q.rank != 3 || q.dim(0) != 1 || q.dim(1) != hq_ || q.dim(2) != d_) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: q must be f32 [1, ", hq_, ", ",
                                                   d_, "], got ", q.DebugString()));
  }
  const int64_t len = cache.length(layer);
  if (len < 1) return absl::InvalidArgumentError("DevicePolicy: empty cache");
  if (!table_ready_[layer]) {
    return absl::FailedPreconditionError("DevicePolicy: Attend before any OnAppend of the layer");
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
  const StepPlan plan = PlanStep(layer, len);
  const int64_t sink_end = plan.sink_end, window_begin = plan.window_begin;
  const TensorView pt = table_[layer]->View(DType::kI32, {hkv_, max_pages_});

  kernels::SelectedAttentionParams at;
  at.q = q;
  at.k_pool = cache.k_pool(layer);
  at.v_pool = cache.v_pool(layer);
  at.page_table = pt;
  at.scale = scale;
  at.k_scale = cache.options().k_scale;  // fp8 caches (1 otherwise)
  at.v_scale = cache.options().v_scale;
  at.out = out;
  at.lse = lse;
  if (plan.exact) {
    // Everything (the whole middle fits in the budget): exact attention.
    at.prefix_end = len;
    STRATA_RETURN_IF_ERROR(backend_->SelectedAttention(at, stream));
    CountStep(plan, len);
    return absl::OkStatus();
  }
  TensorView q2 = q;
  q2.rank = 2;
  q2.shape[0] = hq_;
  q2.shape[1] = d_;
  q2.shape[2] = 0;
  // The selection cache's check, the selection and the attention over it as one op (on CUDA one
  // kernel where it fits, the check inside it where the kernel has a form with it: in parts with
  // the attention, or quest's in one part; else a kernel of its own before it).
  kernels::SelectionCacheCheckParams cc;
  if (cache_on_) {
    STRATA_ASSIGN_OR_RETURN(cc, sel_cache_->CheckParams(layer, q2));
  }
  at.prefix_end = sink_end;
  at.suffix_begin = window_begin;
  at.suffix_end = len;
  STRATA_RETURN_IF_ERROR(SelectMiddle(layer, q2, cache, sink_end, window_begin,
                                      cache_on_ ? &cc : nullptr, &at, stream)
                             .status());
  if (cache_on_) sel_cache_->CountChecks(1);
  CountStep(plan, len);
  return absl::OkStatus();
}

DevicePolicy::StepPlan DevicePolicy::PlanStep(int layer, int64_t len) const {
  StepPlan plan;
  plan.sink_end = std::min<int64_t>(options_.sink_tokens, len);
  plan.window_begin = std::clamp<int64_t>(len - 1 - options_.window_tokens, plan.sink_end, len);
  plan.exact = dense_layer_[layer] || plan.window_begin - plan.sink_end <= options_.token_budget;
  return plan;
}

void DevicePolicy::CountStep(const StepPlan& plan, int64_t len, int sign) {
  counters_.candidate_tokens += sign * hkv_ * len;
  if (plan.exact) {
    counters_.selected_tokens += sign * hkv_ * len;
    return;
  }
  const int64_t planned =
      options_.kind == PolicyKind::kTokenSelect
          ? std::min<int64_t>(kept_tokens_, wanted_pages_ * page_)
          : std::min<int64_t>(wanted_pages_ * page_, plan.window_begin - plan.sink_end);
  counters_.selected_tokens += sign * hkv_ * (plan.sink_end + planned + (len - plan.window_begin));
}

absl::Status DevicePolicy::NoteReplayedAttend(int layer, const KvCache& cache) {
  return CountOutsideAttend(layer, cache, 1);
}

absl::Status DevicePolicy::DiscardRecordedAttend(int layer, const KvCache& cache) {
  return CountOutsideAttend(layer, cache, -1);
}

absl::Status DevicePolicy::CountOutsideAttend(int layer, const KvCache& cache, int sign) {
  STRATA_RETURN_IF_ERROR(CheckCache(layer, cache));
  const int64_t len = cache.length(layer);
  if (len < 1) return absl::InvalidArgumentError("DevicePolicy: empty cache");
  const StepPlan plan = PlanStep(layer, len);
  if (!plan.exact && cache_on_) sel_cache_->CountChecks(sign);
  CountStep(plan, len, sign);
  return absl::OkStatus();
}

absl::StatusOr<CandidateList> DevicePolicy::SelectMiddle(
    int layer, const TensorView& q2, const KvCache& cache, int64_t sink_end, int64_t window_begin,
    const kernels::SelectionCacheCheckParams* check, kernels::SelectedAttentionParams* attend,
    kernels::Stream stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
  const TensorView pt = table_[layer]->View(DType::kI32, {hkv_, max_pages_});
  const int64_t p0 = sink_end / page_, p1 = (window_begin + page_ - 1) / page_;
  bool two_level = p1 - p0 > options_.two_level_min_pages && seg_pages_ > 1;
  int64_t s0 = 0, s1 = 0, keep = 0;
  if (two_level) {
    s0 = p0 / seg_pages_;
    s1 = (p1 - 1) / seg_pages_ + 1;
    // The host policy's segment count (RankPages), from its wanted pages (not rounded to the
    // parts); with parts, each part keeps ceil(of it / parts) of its own segments (k a multiple
    // of the parts; a part with fewer segments fills its share with -1).
    const int64_t keep_all = std::min<int64_t>(
        s1 - s0, std::max<int64_t>(options_.min_segments,
                                   (options_.segment_factor * policy_wanted_pages_ +
                                    seg_pages_ - 1) /
                                       seg_pages_));
    keep = RoundUpToParts(keep_all);
    // Keeping every segment makes every page of the middle a candidate, which is what scoring
    // the pages directly does: the segment stage (two launches) is skipped, same candidates. Not
    // with parts: they are dealt by segment here and would be dealt by page without the stage.
    if (parts_ == 1 && keep >= s1 - s0) two_level = false;
  }

  // The stages as one backend op (on CUDA one kernel): [segments ->] pages [-> tokens].
  kernels::SelectStagesParams sp;
  sp.partitions = parts_;
  sp.q = q2;
  sp.scale = scale * cache.options().k_scale;  // fp8 caches: the stored keys' scores
  sp.cache_check = check;
  if (arrivals_ != nullptr) sp.arrivals = arrivals_->View(kernels::DType::kI32, {hkv_});
  // With the selection cache's check, the final top-k goes to the layer's own buffer so that a
  // head that reuses keeps it across steps; the intermediate stages use the shared scratch.
  const bool keep_final = check != nullptr;
  int64_t page_cands = p1 - p0;
  int n = 0;
  if (two_level) {
    kernels::SelectStage& st = sp.stages[n++];
    st.summaries = segs_[layer]->View(summary_dtype_, {hkv_, max_segs_, 2 * d_});
    st.candidates.begin = s0;
    st.candidates.end = s1;
    st.k = keep;
    st.scores = seg_scores_->View(DType::kF32, {hkv_, group_, s1 - s0});
    st.selected = top_segs_->View(DType::kI32, {hkv_, keep});
    page_cands = keep * seg_pages_;
  }
  kernels::SelectStage& pages = sp.stages[n++];
  pages.summaries = pages_[layer]->View(summary_dtype_, {hkv_, max_pages_, 2 * d_});
  if (two_level) {
    pages.candidates.parents = sp.stages[0].selected;
    pages.candidates.fanout = seg_pages_;
  }
  pages.candidates.begin = p0;
  pages.candidates.end = p1;
  pages.k = wanted_pages_;
  pages.scores = page_scores_->View(DType::kF32, {hkv_, group_, page_cands});
  pages.selected = keep_final && options_.kind == PolicyKind::kQuest
                       ? sel_cache_->kept(layer)
                       : top_pages_->View(DType::kI32, {hkv_, wanted_pages_});
  CandidateList middle;
  middle.parents = pages.selected;
  middle.fanout = page_;
  middle.begin = sink_end;
  middle.end = window_begin;
  if (options_.kind == PolicyKind::kTokenSelect) {
    kernels::SelectStage& keys = sp.stages[n++];
    keys.k_pool = cache.k_pool(layer);
    keys.page_table = pt;
    keys.candidates = middle;
    keys.k = kept_tokens_;
    keys.scores = tok_scores_->View(DType::kF32, {hkv_, group_, wanted_pages_ * page_});
    keys.selected = keep_final ? sel_cache_->kept(layer)
                               : top_tokens_->View(DType::kI32, {hkv_, kept_tokens_});
    middle = CandidateList();
    middle.parents = keys.selected;
    middle.begin = sink_end;
    middle.end = window_begin;
  }
  sp.num_stages = n;
  if (attend != nullptr) {
    attend->middle = middle;
    sp.attend = attend;
  }
  STRATA_RETURN_IF_ERROR(backend_->SelectStages(sp, stream));
  return middle;
}

absl::Status DevicePolicy::AttendChunk(int layer, const TensorView& q, int64_t q_begin,
                                       const KvCache& cache, int64_t position_offset,
                                       const TensorView& out, const TensorView& lse,
                                       kernels::Stream stream) {
  STRATA_RETURN_IF_ERROR(CheckCache(layer, cache));
  STRATA_RETURN_IF_ERROR(CheckQueryViews(q, out, lse));
  return AttendQueries(layer, q, q_begin, /*following=*/false, cache, position_offset, out, lse,
                       stream);
}

absl::Status DevicePolicy::CheckQueryViews(const TensorView& q, const TensorView& out,
                                           const TensorView& lse) const {
  if (q.dtype != DType::kF32 || q.rank != 3 || q.dim(0) < 1 || q.dim(1) != hq_ ||
      q.dim(2) != d_ || q.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: chunk q must be f32 [m >= 1, ",
                                                   hq_, ", ", d_, "], got ", q.DebugString()));
  }
  const int64_t m = q.dim(0);
  if (out.dtype != DType::kF32 || out.rank != 3 || out.dim(0) != m || out.dim(1) != hq_ ||
      out.dim(2) != d_ || lse.dtype != DType::kF32 || lse.rank != 2 || lse.dim(0) != m ||
      lse.dim(1) != hq_) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: chunk out/lse must be f32 [",
                                                   m, ", ", hq_, ", ", d_, "] / [", m, ", ", hq_,
                                                   "], got ", out.DebugString(), " / ",
                                                   lse.DebugString()));
  }
  return absl::OkStatus();
}

absl::Status DevicePolicy::AttendFollowing(int layer, const TensorView& q, const KvCache& cache,
                                           const TensorView& out, const TensorView& lse,
                                           kernels::Stream stream) {
  STRATA_RETURN_IF_ERROR(CheckCache(layer, cache));
  if (cache.length(layer) < 1) {
    return absl::InvalidArgumentError("DevicePolicy: AttendFollowing over an empty layer");
  }
  STRATA_RETURN_IF_ERROR(CheckQueryViews(q, out, lse));
  // One query: the decode step's selection and attention are the same (the window [length - 1 -
  // W, length) either way, and nothing is masked), with no read-back.
  if (q.dim(0) == 1) return Attend(layer, q, cache, out, lse, stream);
  return AttendQueries(layer, q, cache.length(layer) - 1, /*following=*/true, cache, 0, out, lse,
                       stream);
}

absl::Status DevicePolicy::AttendQueries(int layer, const TensorView& q, int64_t q_begin,
                                         bool following, const KvCache& cache,
                                         int64_t position_offset, const TensorView& out,
                                         const TensorView& lse, kernels::Stream stream) {
  const int64_t m = q.dim(0);
  const int64_t len = cache.length(layer);
  if (!following && (q_begin < 0 || q_begin + m > len)) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: chunk [", q_begin, ", ",
                                                   q_begin + m, ") not in the cache of length ",
                                                   len));
  }
  if (position_offset < 0 ||
      position_offset + len > static_cast<int64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat("DevicePolicy: position offset ",
                                                   position_offset, " out of range"));
  }
  if (!table_ready_[layer]) {
    return absl::FailedPreconditionError("DevicePolicy: AttendChunk before any OnAppend");
  }
  if (cache_on_) {
    // The chunk path neither uses nor fills the selection cache: the next decode step selects.
    STRATA_RETURN_IF_ERROR(sel_cache_->Invalidate(layer, stream));
  }
  const int64_t sink_end = std::min<int64_t>(options_.sink_tokens, len);
  const int64_t window_begin =
      std::clamp<int64_t>(q_begin - options_.window_tokens, sink_end, len);
  const bool exact = dense_layer_[layer] || window_begin - sink_end <= options_.token_budget;
  std::vector<KvSpan>& spans = chunk_selection_.spans;
  chunk_selection_.Clear();
  chunk_selection_.offsets.push_back(0);
  int64_t attended = 0;
  if (exact) {
    for (int g = 0; g < hkv_; ++g) {
      cache.AppendSpans(layer, g, 0, len, &spans);
      chunk_selection_.offsets.push_back(static_cast<int32_t>(spans.size()));
    }
    attended = hkv_ * len;
  } else {
    STRATA_ASSIGN_OR_RETURN(const TensorView qm, mean_query_.Mean(q, stream));
    STRATA_ASSIGN_OR_RETURN(const CandidateList middle,
                            SelectMiddle(layer, qm, cache, sink_end, window_begin, nullptr,
                                         nullptr, stream));
    const int64_t per_head = middle.parents.dim(1);
    selected_host_.resize(static_cast<size_t>(hkv_ * per_head));
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(selected_host_.data(), middle.parents.data,
                                                selected_host_.size() * sizeof(int32_t),
                                                stream));
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int g = 0; g < hkv_; ++g) {
      // The middle's token runs: each valid parent id p covers [p * fanout, (p + 1) * fanout)
      // clipped to [sink_end, window_begin); sorted and joined where adjacent.
      ranges.clear();
      for (int64_t i = 0; i < per_head; ++i) {
        const int64_t p = selected_host_[g * per_head + i];
        if (p < 0) continue;
        const int64_t b = std::max(p * middle.fanout, sink_end);
        const int64_t e = std::min((p + 1) * middle.fanout, window_begin);
        if (b < e) ranges.emplace_back(b, e);
      }
      std::sort(ranges.begin(), ranges.end());
      cache.AppendSpans(layer, g, 0, sink_end, &spans);
      int64_t run_b = -1, run_e = -1, taken = 0;
      for (const auto& [b, e] : ranges) {
        if (b < run_e) return absl::InternalError("DevicePolicy: overlapping selection");
        if (b == run_e) {
          run_e = e;
          continue;
        }
        if (run_b >= 0) {
          cache.AppendSpans(layer, g, run_b, run_e, &spans);
          taken += run_e - run_b;
        }
        run_b = b;
        run_e = e;
      }
      if (run_b >= 0) {
        cache.AppendSpans(layer, g, run_b, run_e, &spans);
        taken += run_e - run_b;
      }
      cache.AppendSpans(layer, g, window_begin, len, &spans);
      chunk_selection_.offsets.push_back(static_cast<int32_t>(spans.size()));
      attended += sink_end + taken + (len - window_begin);
    }
  }
  if (position_offset != 0) {
    for (KvSpan& s : spans) s.position += static_cast<int32_t>(position_offset);
  }
  // Following queries come after every cached token: nothing to mask (positions unused).
  chunk_positions_.resize(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) {
    chunk_positions_[i] = following ? 0 : static_cast<int32_t>(position_offset + q_begin + i);
  }
  kernels::PagedAttentionParams ap;
  ap.q = q;
  ap.k_pool = cache.k_pool(layer);
  ap.v_pool = cache.v_pool(layer);
  ap.spans = spans.data();
  ap.span_offsets = chunk_selection_.offsets.data();
  ap.num_kv_heads = hkv_;
  ap.q_positions = chunk_positions_.data();
  ap.causal = !following;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(d_));
  ap.k_scale = cache.options().k_scale;
  ap.v_scale = cache.options().v_scale;
  ap.out = out;
  ap.lse = lse;
  STRATA_RETURN_IF_ERROR(backend_->PagedAttention(ap, stream));
  counters_.candidate_tokens += hkv_ * len;
  counters_.selected_tokens += attended;
  return absl::OkStatus();
}

}  // namespace strata::engine::sparse
