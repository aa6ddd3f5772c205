// Sparse attention policies. See engine/sparse/policy.h.
#include "engine/sparse/policy.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/query_mean.h"
#include "engine/sparse/internal/common.h"
#include "engine/sparse/internal/hip.h"
#include "engine/sparse/internal/subgen.h"
#include "engine/sparse/summaries.h"
#include "kernels/backend.h"
#include "kernels/part_limits.h"

namespace strata::engine::sparse {

absl::StatusOr<PolicyKind> ParsePolicyName(absl::string_view name) {
  if (name == "dense") return PolicyKind::kDense;
  if (name == "streaming") return PolicyKind::kStreaming;
  if (name == "quest") return PolicyKind::kQuest;
  if (name == "radar") return PolicyKind::kRadar;
  if (name == "tokenselect") return PolicyKind::kTokenSelect;
  if (name == "hip") return PolicyKind::kHip;
  if (name == "subgen") return PolicyKind::kSubGen;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown policy '", name,
                   "' (want dense|streaming|quest|radar|tokenselect|hip|subgen)"));
}

const char* PolicyName(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kDense: return "dense";
    case PolicyKind::kStreaming: return "streaming";
    case PolicyKind::kQuest: return "quest";
    case PolicyKind::kRadar: return "radar";
    case PolicyKind::kTokenSelect: return "tokenselect";
    case PolicyKind::kHip: return "hip";
    case PolicyKind::kSubGen: return "subgen";
  }
  return "?";
}

absl::StatusOr<SummaryKind> ParseSummaryKind(absl::string_view name) {
  if (name == "none") return SummaryKind::kNone;
  if (name == "minmax") return SummaryKind::kMinMax;
  if (name == "mean") return SummaryKind::kMean;
  if (name == "rf") return SummaryKind::kRf;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown summary '", name, "' (want none|minmax|mean|rf)"));
}

const char* SummaryName(SummaryKind kind) {
  switch (kind) {
    case SummaryKind::kDefault: return "default";
    case SummaryKind::kNone: return "none";
    case SummaryKind::kMinMax: return "minmax";
    case SummaryKind::kMean: return "mean";
    case SummaryKind::kRf: return "rf";
  }
  return "?";
}

SummaryKind DefaultSummary(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kQuest: return SummaryKind::kMinMax;
    case PolicyKind::kTokenSelect: return SummaryKind::kMinMax;
    case PolicyKind::kRadar: return SummaryKind::kRf;
    default: return SummaryKind::kNone;
  }
}

int PolicyOptions::EffectivePartitions(int group) const {
  if (tokenselect_partitions > 0) return tokenselect_partitions;
  if (group > kernels::kMaxPartGroup) return 1;
  int p = 1;
  while (p < 16 && token_budget >= 128 * 2 * p && token_budget % (2 * p) == 0) p *= 2;
  const int64_t candidates = int64_t{token_budget} * tokenselect_candidate_factor;
  return (candidates + p - 1) / p <= kernels::kMaxPartCandidates ? p : 1;
}

absl::Status PolicyOptions::Validate() const {
  auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (token_budget < 0) return bad("policy: token_budget ", token_budget, " < 0");
  if (sink_tokens < 0 || window_tokens < 0) return bad("policy: negative sinks or window");
  if (page_size <= 0) return bad("policy: page_size ", page_size, " <= 0");
  if (segment_pages < 0) return bad("policy: segment_pages < 0");
  if (two_level_min_pages < 0) return bad("policy: two_level_min_pages < 0");
  if (min_segments < 1 || segment_factor < 1) return bad("policy: min_segments, segment_factor >= 1");
  if (rf_features <= 0) return bad("policy: rf_features ", rf_features, " <= 0");
  if (!(cache_theta > 0.0)) return bad("policy: cache_theta must be > 0 (> 1 disables the cache)");
  for (int l : dense_layers) {
    if (l < 0) return bad("policy: negative dense layer ", l);
  }
  if (tokenselect_candidate_factor < 1 || tokenselect_candidate_factor > 16) {
    return bad("policy: tokenselect_candidate_factor ", tokenselect_candidate_factor,
               " is outside [1, 16]");
  }
  if (tokenselect_partitions != 0 && !kernels::ValidPartitions(tokenselect_partitions)) {
    return bad("policy: tokenselect_partitions ", tokenselect_partitions,
               " is neither 0 (by the budget) nor a power of two in [1, 64]");
  }
  if (hip_block < 1) return bad("policy: hip_block < 1");
  if (subgen_samples_per_cluster < 1 || subgen_value_samples < 0 || !(subgen_radius > 0.0)) {
    return bad("policy: subgen needs samples_per_cluster >= 1, value_samples >= 0, radius > 0");
  }
  const SummaryKind s = EffectiveSummary();
  if ((kind == PolicyKind::kQuest || kind == PolicyKind::kRadar) && s == SummaryKind::kNone) {
    return bad("policy: ", PolicyName(kind), " needs a page summary (minmax|mean|rf)");
  }
  if (kind == PolicyKind::kSubGen) {
    const int s_samples = subgen_value_samples > 0 ? subgen_value_samples : token_budget / 4;
    if ((token_budget - s_samples) / subgen_samples_per_cluster < 1) {
      return bad("policy: subgen budget ", token_budget, " leaves no room for clusters");
    }
  }
  return absl::OkStatus();
}

namespace {

using Clock = std::chrono::steady_clock;

class PolicyImpl : public SparsePolicy {
 public:
  PolicyImpl(const PolicyOptions& o, int num_layers, int hq, int hkv, int d)
      : options_(o),
        summary_(o.EffectiveSummary()),
        num_layers_(num_layers),
        hq_(hq),
        hkv_(hkv),
        group_(hq / hkv),
        d_(d),
        scale_(1.0f / std::sqrt(static_cast<float>(d))),
        segment_pages_(o.EffectiveSegmentPages()),
        dense_layer_(num_layers, false),
        heads_(static_cast<size_t>(num_layers) * hkv) {
    for (int l : o.dense_layers) dense_layer_[l] = true;
    if (summary_ == SummaryKind::kRf) {
      rf_ = std::make_unique<RandomFeatures>(d, o.rf_features, o.rf_seed);
    }
  }

  std::string Name() const override {
    std::string name = PolicyName(options_.kind);
    if (options_.summary != SummaryKind::kDefault && summary_ != DefaultSummary(options_.kind) &&
        (options_.kind == PolicyKind::kQuest || options_.kind == PolicyKind::kRadar ||
         options_.kind == PolicyKind::kTokenSelect)) {
      absl::StrAppend(&name, ":", SummaryName(summary_));
    }
    return name;
  }

  absl::Status OnAppend(int layer, const KvCache& cache, int64_t first, int64_t end) override {
    absl::Status st = CheckCache(layer, cache);
    if (!st.ok()) return st;
    if (dense_layer_[layer]) return absl::OkStatus();
    for (int g = 0; g < hkv_; ++g) {
      HeadState& hs = head(layer, g);
      if (UsesSummaries()) SyncSummaries(hs, cache, layer, g);
      if (options_.kind == PolicyKind::kSubGen) SyncSubGen(hs, cache, layer, g);
    }
    return absl::OkStatus();
  }

  absl::Status Select(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      const KvCache& cache, Selection* out) override {
    const Clock::time_point start = Clock::now();
    absl::Status st = CheckCache(layer, cache);
    if (!st.ok()) return st;
    if (num_q_heads != hq_ || num_tokens < 1 || q == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("policy: Select with ", num_tokens,
                                                     " tokens x ", num_q_heads, " heads (want >= 1 x ",
                                                     hq_, ")"));
    }
    const int64_t len = cache.length(layer);
    if (q_begin < 0 || q_begin + num_tokens > len) {
      return absl::InvalidArgumentError(absl::StrCat("policy: queries [", q_begin, ", ",
                                                     q_begin + num_tokens,
                                                     ") not in the cache of length ", len));
    }
    // Mean query of the chunk, [hq, d].
    std::vector<float> qm;
    MeanQuery(q, num_tokens, static_cast<int64_t>(hq_) * d_, &qm);

    const bool dense = dense_layer_[layer] || options_.kind == PolicyKind::kDense;
    const int64_t sink_end = std::min<int64_t>(options_.sink_tokens, len);
    const int64_t window_begin =
        std::clamp<int64_t>(q_begin - options_.window_tokens, sink_end, len);
    out->Clear();
    out->offsets.push_back(0);
    for (int g = 0; g < hkv_; ++g) {
      int64_t attended = 0;
      if (dense) {
        cache.AppendSpans(layer, g, 0, len, &out->spans);
        attended = len;
      } else {
        cache.AppendSpans(layer, g, 0, sink_end, &out->spans);
        std::vector<Range> middle;
        if (window_begin > sink_end) {
          middle = ChooseMiddle(layer, g, &qm[static_cast<size_t>(g) * group_ * d_], sink_end,
                                window_begin, cache);
        }
        for (const Range& r : middle) cache.AppendSpans(layer, g, r.begin, r.end, &out->spans);
        cache.AppendSpans(layer, g, window_begin, len, &out->spans);
        attended = sink_end + CountTokens(middle) + (len - window_begin);
      }
      out->offsets.push_back(static_cast<int32_t>(out->spans.size()));
      counters_.candidate_tokens += len;
      counters_.selected_tokens += attended;
    }
    stats_.select_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    return absl::OkStatus();
  }

  const SelectionCounters& counters() const override { return counters_; }

  void SetTokenBudget(int token_budget) override {
    options_.token_budget = std::max(0, token_budget);
    for (HeadState& hs : heads_) hs.cache_valid = false;
  }
  const SelectionStats& stats() const override { return stats_; }
  void ResetStats() override { stats_ = SelectionStats(); }

 private:
  struct HeadState {
    std::unique_ptr<HeadSummaries> summaries;
    std::unique_ptr<SubGenState> subgen;
    std::vector<float> cached_query;  // [group, d], the mean query the selection was made for
    std::vector<Range> cached;
    bool cache_valid = false;
  };

  HeadState& head(int layer, int g) { return heads_[static_cast<size_t>(layer) * hkv_ + g]; }

  bool UsesSummaries() const {
    switch (options_.kind) {
      case PolicyKind::kQuest:
      case PolicyKind::kRadar:
      case PolicyKind::kTokenSelect:
        return summary_ != SummaryKind::kNone;
      default:
        return false;
    }
  }

  absl::Status CheckCache(int layer, const KvCache& cache) const {
    const KvCacheOptions& c = cache.options();
    if (layer < 0 || layer >= num_layers_) {
      return absl::InvalidArgumentError(absl::StrCat("policy: layer ", layer, " out of range"));
    }
    // Policies that read keys (all but dense and streaming, which name spans only) read f32,
    // bf16 or fp8 rows (HeadRows; fp8 codes times the cache's scales).
    if (c.num_layers != num_layers_ || c.num_kv_heads != hkv_ || c.head_dim != d_ ||
        c.page_size != options_.page_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy: cache shape (layers ", c.num_layers, ", kv heads ", c.num_kv_heads,
          ", head_dim ", c.head_dim, ", page ", c.page_size, ") differs from the policy's (",
          num_layers_, ", ", hkv_, ", ", d_, ", ", options_.page_size, ")"));
    }
    return absl::OkStatus();
  }

  // The keys / values of KV head g of `layer` (fp8 codes times the cache's k_scale / v_scale).
  HeadRows KeyRows(const KvCache& cache, int layer, int g) const {
    return Rows(cache.k_pool(layer), cache.options().k_scale, cache, layer, g);
  }
  HeadRows ValueRows(const KvCache& cache, int layer, int g) const {
    return Rows(cache.v_pool(layer), cache.options().v_scale, cache, layer, g);
  }
  // Rows of KV head g of `layer`: its pages are contiguous slots starting at SlotOf(layer, g, 0).
  HeadRows Rows(const kernels::TensorView& pool, float scale, const KvCache& cache, int layer, int g) const {
    HeadRows r;
    r.dtype = pool.dtype;
    r.head_dim = d_;
    r.scale = scale;
    r.data = static_cast<const char*>(pool.data) + static_cast<size_t>(cache.SlotOf(layer, g, 0)) *
                                                       options_.page_size * d_ *
                                                       kernels::DTypeSize(pool.dtype);
    return r;
  }

  void SyncSummaries(HeadState& hs, const KvCache& cache, int layer, int g) {
    if (hs.summaries == nullptr) {
      hs.summaries = std::make_unique<HeadSummaries>(summary_, d_, options_.page_size,
                                                     segment_pages_, rf_.get());
    }
    const int64_t len = cache.length(layer);
    const HeadRows keys = KeyRows(cache, layer, g);
    constexpr int64_t kBatch = 4096;
    std::vector<float> buf;
    for (int64_t t = hs.summaries->length(); t < len; t += kBatch) {
      const int64_t n = std::min(kBatch, len - t);
      if (keys.dtype == kernels::DType::kF32) {
        hs.summaries->Append(static_cast<const float*>(keys.data) + t * d_, n);
      } else {
        buf.resize(static_cast<size_t>(n) * d_);
        keys.ReadRows(t, n, buf.data());
        hs.summaries->Append(buf.data(), n);
      }
    }
  }

  int SubGenValueSamples() const {
    return options_.subgen_value_samples > 0 ? options_.subgen_value_samples
                                             : options_.token_budget / 4;
  }

  void SyncSubGen(HeadState& hs, const KvCache& cache, int layer, int g) {
    if (hs.subgen == nullptr) {
      const int s = SubGenValueSamples();
      const int t = options_.subgen_samples_per_cluster;
      hs.subgen = std::make_unique<SubGenState>(
          d_, t, s, std::max(1, (options_.token_budget - s) / t), options_.subgen_radius,
          options_.subgen_seed + static_cast<uint64_t>(layer) * 1000003u + g);
    }
    const HeadRows keys = KeyRows(cache, layer, g);
    const HeadRows values = ValueRows(cache, layer, g);
    std::vector<float> k(d_), v(d_);
    for (int64_t t = hs.subgen->tokens_seen(); t < cache.length(layer); ++t) {
      keys.Read(t, k.data());
      values.Read(t, v.data());
      hs.subgen->Add(t, k.data(), v.data());
    }
  }

  // The middle selection of KV head g for its group's mean queries qg [group, d].
  std::vector<Range> ChooseMiddle(int layer, int g, const float* qg, int64_t mid_begin,
                                  int64_t mid_end, const KvCache& cache) {
    const int budget = options_.token_budget;
    if (mid_end - mid_begin <= budget) return {Range{mid_begin, mid_end}};
    if (options_.kind == PolicyKind::kStreaming) return {};
    HeadState& hs = head(layer, g);
    if (options_.kind == PolicyKind::kSubGen) {
      // Query-independent: no selection cache.
      SyncSubGen(hs, cache, layer, g);
      std::vector<int64_t> tokens;
      for (int64_t t : hs.subgen->SampledTokens()) {
        if (t >= mid_begin && t < mid_end) tokens.push_back(t);
      }
      if (static_cast<int64_t>(tokens.size()) > budget) tokens.resize(budget);  // budget shrank
      ++stats_.selections;
      return RangesFromSortedTokens(tokens);
    }
    const size_t qlen = static_cast<size_t>(group_) * d_;
    if (options_.cache_theta <= 1.0) {
      ++counters_.cache_lookups;
      if (hs.cache_valid && Cosine(qg, hs.cached_query.data(), qlen) >= options_.cache_theta) {
        ++counters_.cache_hits;
        return ClipRanges(hs.cached, mid_begin, mid_end);
      }
    }
    ++stats_.selections;
    std::vector<float> qs(qg, qg + qlen);  // scaled queries for key dot products
    for (float& x : qs) x *= scale_;
    std::vector<Range> chosen;
    switch (options_.kind) {
      case PolicyKind::kQuest:
      case PolicyKind::kRadar:
        SyncSummaries(hs, cache, layer, g);
        chosen = FillPages(RankPages(hs, qg, mid_begin, mid_end, budget), mid_begin, mid_end,
                           budget);
        break;
      case PolicyKind::kTokenSelect:
        chosen = TokenSelect(hs, qg, qs.data(), mid_begin, mid_end, cache, layer, g);
        break;
      case PolicyKind::kHip: {
        HipResult r =
            HipSelect(KeyRows(cache, layer, g), qs.data(), group_, mid_begin, mid_end, budget, options_.hip_block);
        stats_.key_bytes += r.keys_read * d_ * 2;
        chosen = std::move(r.ranges);
        break;
      }
      default:
        break;
    }
    if (options_.cache_theta <= 1.0) {
      hs.cached_query.assign(qg, qg + qlen);
      hs.cached = chosen;
      hs.cache_valid = true;
    }
    return chosen;
  }

  static double Cosine(const float* a, const float* b, size_t n) {
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < n; ++i) {
      ab += static_cast<double>(a[i]) * b[i];
      aa += static_cast<double>(a[i]) * a[i];
      bb += static_cast<double>(b[i]) * b[i];
    }
    if (aa == 0 || bb == 0) return 0.0;
    return ab / std::sqrt(aa * bb);
  }

  // Scores `items` summaries for every query head of the group and soft-votes them.
  template <typename SummaryAt, typename TokensAt>
  void VoteSummaries(const std::vector<PreparedQuery>& pq, const std::vector<int64_t>& items,
                     int dim, SummaryAt summary_at, TokensAt tokens_at, std::vector<float>* vote) {
    const int64_t n = static_cast<int64_t>(items.size());
    std::vector<float> scores(static_cast<size_t>(group_) * n);
#pragma omp parallel for schedule(static) if (n > 256)
    for (int64_t i = 0; i < n; ++i) {
      const float* s = summary_at(items[i]);
      const int64_t tokens = tokens_at(items[i]);
      for (int h = 0; h < group_; ++h) {
        scores[static_cast<size_t>(h) * n + i] = ScoreSummary(summary_, pq[h], s, tokens, dim);
      }
    }
    vote->resize(n);
    SoftVote(scores.data(), group_, n, vote->data());
    stats_.summary_bytes += n * dim * 2;
  }

  // Pages overlapping [mid_begin, mid_end), best first (two-level when there are many).
  // With parts > 1, only the pages of part `part` (two-level: of its segments, index % parts ==
  // part) are ranked, and part keeps ceil(keep / parts) segments at the first level.
  std::vector<int64_t> RankPages(HeadState& hs, const float* qg, int64_t mid_begin,
                                 int64_t mid_end, int64_t wanted_tokens, int part = 0,
                                 int parts = 1) {
    const HeadSummaries& s = *hs.summaries;
    const int p = options_.page_size, gsz = segment_pages_;
    const int dim = s.dim();
    std::vector<PreparedQuery> pq(group_);
    for (int h = 0; h < group_; ++h) {
      PrepareQuery(summary_, rf_.get(), qg + static_cast<size_t>(h) * d_, d_, scale_, &pq[h]);
    }
    const int64_t p0 = mid_begin / p, p1 = (mid_end + p - 1) / p;
    std::vector<int64_t> candidates;
    std::vector<float> vote;
    if (p1 - p0 > options_.two_level_min_pages && gsz > 1) {
      const int64_t s0 = p0 / gsz, s1 = (p1 - 1) / gsz + 1;
      std::vector<int64_t> segs;
      for (int64_t sg = s0; sg < s1; ++sg) {
        if (sg % parts == part) segs.push_back(sg);
      }
      VoteSummaries(
          pq, segs, dim, [&](int64_t i) { return s.segment(i); },
          [&](int64_t i) { return s.segment_tokens(i); }, &vote);
      const int64_t wanted_pages = (wanted_tokens + p - 1) / p;
      const int64_t keep_all = std::min<int64_t>(
          s1 - s0, std::max<int64_t>(options_.min_segments,
                                     (options_.segment_factor * wanted_pages + gsz - 1) / gsz));
      const int64_t keep =
          std::min<int64_t>(static_cast<int64_t>(segs.size()), (keep_all + parts - 1) / parts);
      std::vector<int64_t> kept =
          RankByVote(vote.data(), static_cast<int64_t>(segs.size()), keep);
      kept.resize(keep);
      // The kept segments' pages in page order, as the device's page stage has them (parents in
      // index order), so that pages whose votes tie rank the same way on both (the lower page
      // first); segs is ascending, so ascending indices give ascending pages.
      std::sort(kept.begin(), kept.end());
      for (int64_t i : kept) {
        const int64_t seg = segs[i];
        for (int64_t pg = std::max(p0, seg * gsz); pg < std::min(p1, (seg + 1) * gsz); ++pg) {
          candidates.push_back(pg);
        }
      }
    } else {
      for (int64_t pg = p0; pg < p1; ++pg) {
        if (pg % parts == part) candidates.push_back(pg);
      }
    }
    VoteSummaries(
        pq, candidates, dim, [&](int64_t i) { return s.page(i); },
        [&](int64_t i) { return s.page_tokens(i); }, &vote);
    const int64_t nc = static_cast<int64_t>(candidates.size());
    const std::vector<int64_t> order = RankByVote(vote.data(), nc, nc);
    std::vector<int64_t> ranked(order.size());
    for (size_t i = 0; i < order.size(); ++i) ranked[i] = candidates[order[i]];
    return ranked;
  }

  // Takes ranked pages (clipped to the middle) while they fit in `budget` tokens.
  std::vector<Range> FillPages(const std::vector<int64_t>& ranked, int64_t mid_begin,
                               int64_t mid_end, int64_t budget) const {
    const int p = options_.page_size;
    std::vector<Range> out;
    int64_t used = 0;
    for (int64_t pg : ranked) {
      const Range r{std::max(pg * p, mid_begin), std::min((pg + 1) * p, mid_end)};
      if (r.size() <= 0 || used + r.size() > budget) continue;
      out.push_back(r);
      used += r.size();
      if (used == budget) break;
    }
    std::sort(out.begin(), out.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
    return out;
  }

  std::vector<Range> TokenSelect(HeadState& hs, const float* qg, const float* qs,
                                 int64_t mid_begin, int64_t mid_end, const KvCache& cache,
                                 int layer, int g) {
    const int budget = options_.token_budget;
    const int parts = options_.EffectivePartitions(group_);
    if (parts > 1 && summary_ != SummaryKind::kNone) {
      return TokenSelectParts(hs, qg, qs, mid_begin, mid_end, cache, layer, g, parts);
    }
    std::vector<Range> cand;
    if (summary_ == SummaryKind::kNone) {
      cand.push_back(Range{mid_begin, mid_end});
    } else {
      SyncSummaries(hs, cache, layer, g);
      const int64_t wanted = static_cast<int64_t>(budget) * options_.tokenselect_candidate_factor;
      cand = FillPages(RankPages(hs, qg, mid_begin, mid_end, wanted), mid_begin, mid_end, wanted);
    }
    const std::vector<int64_t> tokens = TokensOf(cand);
    if (static_cast<int64_t>(tokens.size()) <= budget) return cand;
    std::vector<int64_t> picked;
    AppendBestTokens(KeyRows(cache, layer, g), tokens, qs, budget, &picked);
    std::sort(picked.begin(), picked.end());
    return RangesFromSortedTokens(picked);
  }

  // The tokens of `ranges`, in order.
  static std::vector<int64_t> TokensOf(const std::vector<Range>& ranges) {
    std::vector<int64_t> tokens;
    tokens.reserve(CountTokens(ranges));
    for (const Range& r : ranges) {
      for (int64_t t = r.begin; t < r.end; ++t) tokens.push_back(t);
    }
    return tokens;
  }

  // Appends to *picked the `take` (<= tokens.size()) of `tokens` with the highest head soft vote
  // of their keys' scores against the group's scaled queries qs, best first.
  void AppendBestTokens(const HeadRows& keys, const std::vector<int64_t>& tokens, const float* qs,
                        int64_t take, std::vector<int64_t>* picked) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    std::vector<float> scores(static_cast<size_t>(group_) * n);
#pragma omp parallel for schedule(static) if (n > 4096)
    for (int64_t j = 0; j < n; ++j) {
      for (int h = 0; h < group_; ++h) {
        scores[static_cast<size_t>(h) * n + j] = keys.Dot(tokens[j], qs + static_cast<size_t>(h) * d_);
      }
    }
    stats_.key_bytes += n * d_ * 2;
    std::vector<float> vote(n);
    SoftVote(scores.data(), group_, n, vote.data());
    const std::vector<int64_t> order = RankByVote(vote.data(), n, take);
    for (int64_t i = 0; i < take; ++i) picked->push_back(tokens[order[i]]);
  }

  // tokenselect in `parts` independent parts (PolicyOptions::EffectivePartitions): part j
  // ranks only its own pages (RankPages' part), takes its best ceil(ceil(candidate_factor * B /
  // page) / parts) pages (as many tokens, whole pages, so that a share smaller than a page still
  // gets one; the device policy's page stage keeps the same count per part) and keeps its
  // ceil(B / parts) best tokens by a soft vote over those candidates alone (the budget rounded up
  // to a multiple of the parts; the device policy's token stage keeps as many). The parts' selections are
  // disjoint; their union is the middle's selection.
  std::vector<Range> TokenSelectParts(HeadState& hs, const float* qg, const float* qs,
                                      int64_t mid_begin, int64_t mid_end, const KvCache& cache,
                                      int layer, int g, int parts) {
    SyncSummaries(hs, cache, layer, g);
    const int64_t budget = options_.token_budget;
    const int64_t part_budget = (budget + parts - 1) / parts;
    const int64_t wanted = budget * options_.tokenselect_candidate_factor;
    const int64_t page = options_.page_size;
    const int64_t part_wanted = ((wanted + page - 1) / page + parts - 1) / parts * page;
    const HeadRows keys = KeyRows(cache, layer, g);
    std::vector<int64_t> picked;
    for (int part = 0; part < parts; ++part) {
      const std::vector<Range> cand =
          FillPages(RankPages(hs, qg, mid_begin, mid_end, wanted, part, parts), mid_begin,
                    mid_end, part_wanted);
      const std::vector<int64_t> tokens = TokensOf(cand);
      if (static_cast<int64_t>(tokens.size()) <= part_budget) {
        picked.insert(picked.end(), tokens.begin(), tokens.end());
      } else {
        AppendBestTokens(keys, tokens, qs, part_budget, &picked);
      }
    }
    std::sort(picked.begin(), picked.end());
    return RangesFromSortedTokens(picked);
  }

  PolicyOptions options_;
  SummaryKind summary_;
  int num_layers_, hq_, hkv_, group_, d_;
  float scale_;
  int segment_pages_;
  std::vector<bool> dense_layer_;
  std::unique_ptr<RandomFeatures> rf_;
  std::vector<HeadState> heads_;
  SelectionCounters counters_;
  SelectionStats stats_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SparsePolicy>> MakeSparsePolicy(const PolicyOptions& options,
                                                               int num_layers, int num_q_heads,
                                                               int num_kv_heads, int head_dim) {
  absl::Status st = options.Validate();
  if (!st.ok()) return st;
  if (num_layers <= 0 || num_q_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 ||
      num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("policy: bad model shape: layers ", num_layers,
                                                   ", q heads ", num_q_heads, ", kv heads ",
                                                   num_kv_heads, ", head_dim ", head_dim));
  }
  for (int l : options.dense_layers) {
    if (l >= num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("policy: dense layer ", l, " >= ", num_layers));
    }
  }
  return std::unique_ptr<SparsePolicy>(
      new PolicyImpl(options, num_layers, num_q_heads, num_kv_heads, head_dim));
}

absl::StatusOr<std::unique_ptr<AttentionPolicy>> MakeAttentionPolicy(const PolicyOptions& options,
                                                                     int num_layers,
                                                                     int num_q_heads,
                                                                     int num_kv_heads,
                                                                     int head_dim) {
  absl::StatusOr<std::unique_ptr<SparsePolicy>> p =
      MakeSparsePolicy(options, num_layers, num_q_heads, num_kv_heads, head_dim);
  if (!p.ok()) return p.status();
  return std::unique_ptr<AttentionPolicy>(std::move(p).value());
}

}  // namespace strata::engine::sparse
