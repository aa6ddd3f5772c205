// Sparse attention policies (DESIGN.md section 3) and their factory.
//
// Every policy attends, for each KV head of a layer, to
//   sinks:  tokens [0, S)
//   window: tokens [max(S, q_begin - W), length): the W tokens before the first query token plus
//           the query tokens themselves (so a prefill chunk always attends to itself)
//   middle: a query-dependent choice of at most B tokens of [S, window start), made by the policy.
// When the whole middle fits in B it is attended entirely (the result is then exact). The spans of
// one KV head never overlap, so PagedAttention over them is softmax over the chosen set.
//
// Policies (PolicyKind):
//   dense       every token (exact).
//   streaming   sinks + window only (StreamingLLM).
//   quest       pages ranked by the minmax upper bound of q.k (Quest), top pages within B.
//   radar       pages ranked by random-feature summaries phi(q)^T mean phi(k) (RADAR), top pages.
//   tokenselect token-level head soft vote (TokenSelect): per KV head, sum over its query heads of
//               the per-head softmax of q.k over the candidate keys, top B tokens. Candidates are
//               the keys of pages preselected by a summary (default minmax: DESIGN.md section 3,
//               step 4, refine over selected pages only) or all middle keys (summary = none, as in
//               the paper, which keeps every key resident).
//   hip         hierarchical top-k (HiP): split the middle into k = B/block chunks, repeatedly halve
//               every chunk, score each branch by its centre key block, keep the top k branches,
//               until branches are single blocks.
//   subgen      query-independent streaming state (SubGen): online clusters of keys of radius
//               delta with t reservoir samples each, plus s value samples by |v|^2 (l2 sampling);
//               the sampled tokens (at most B) are attended exactly. Lossy; see subgen notes in
//               engine/sparse/internal/subgen.h.
// Page ranking (quest, radar, tokenselect candidates) is two-level once the middle has more than
// `two_level_min_pages` pages (default 4096): segments of G pages (merged summaries) are scored
// first, then the pages inside the best segments. With GQA the query heads of a KV head are
// combined by head soft vote (sum over heads of the per-head softmax of the page/branch/token
// scores).
// With several query tokens (chunked prefill) selection uses the mean query of the chunk.
//
// Deviations from the papers (see also bench/RESULTS.md): radar uses fixed segments of G pages
// with merged summaries instead of rebuilding sqrt(t)-token segments (so keys are never re-read,
// DIGEST 6.3) and ranks pages inside the best segments; its feature map is the one-sided map of
// the paper (Eq. 4), not the code's two-sided one. hip has no separate mask-refresh interval: the
// selection cache decides reuse, as for the other query-aware policies. GQA is always handled by
// head soft vote over the group's query heads (one selection per KV head).
//
// Selection cache (TokenSelect): per (layer, KV head) the last query (the group's query heads,
// concatenated) and its middle selection are kept; the selection is reused while
// cosine(query, cached query) >= theta.
//
// Counters (per KV head and call): candidate_tokens += tokens in the cache, selected_tokens +=
// tokens attended; cache_lookups / cache_hits count selection-cache lookups.
//
// Sparse policies read keys (and values, for subgen) from the cache's pools on the host, so they
// need host-readable pools (the CPU backend). Thread-compatible.
#ifndef STRATA_ENGINE_SPARSE_POLICY_H_
#define STRATA_ENGINE_SPARSE_POLICY_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/attention_policy.h"

namespace strata::engine::sparse {

enum class PolicyKind { kDense, kStreaming, kQuest, kRadar, kTokenSelect, kHip, kSubGen };

// How pages (and segments) are summarised for scoring.
enum class SummaryKind {
  kDefault,  // the policy's own: DefaultSummary(kind)
  kNone,    // no summaries (streaming, hip, subgen; tokenselect over all keys)
  kMinMax,  // per-channel min and max of keys; score = upper bound of q.k (Quest)
  kMean,    // centroid of keys; score = q.centroid + log(tokens)
  kRf,      // mean of positive random features (RADAR); score = log(phi(q).mean phi(k)) + log(tokens)
};

// "dense", "streaming", "quest", "radar", "tokenselect", "hip", "subgen". InvalidArgument otherwise.
absl::StatusOr<PolicyKind> ParsePolicyName(absl::string_view name);
const char* PolicyName(PolicyKind kind);
// "none", "minmax", "mean", "rf". InvalidArgument otherwise.
absl::StatusOr<SummaryKind> ParseSummaryKind(absl::string_view name);
const char* SummaryName(SummaryKind kind);
// The summary a policy uses unless told otherwise: quest and tokenselect minmax, radar rf, others
// none.
SummaryKind DefaultSummary(PolicyKind kind);

// Defaults (tokenselect over minmax-preselected pages, P = 64, B = 2048, 512-token segments, 128
// first-level segments) were chosen from the fidelity benchmark; see bench/RESULTS.md.
struct PolicyOptions {
  PolicyKind kind = PolicyKind::kTokenSelect;
  // Page summary. quest/radar need one; tokenselect accepts none (all keys) or any; the others
  // ignore it. Default: kDefault (DefaultSummary(kind)).
  SummaryKind summary = SummaryKind::kDefault;
  // Token budget B for the middle (sinks and window come on top). Default: 2048.
  int token_budget = 2048;
  // Sinks S (first tokens, always attended). Default: 64.
  int sink_tokens = 64;
  // Window W (tokens before the first query token, always attended). Default: 256.
  int window_tokens = 256;
  // Page size P; must equal the KvCache page size. Default: 64.
  int page_size = 64;
  // Pages per segment G for two-level scoring; 0 = max(1, 512 / page_size) (512-token
  // segments). 1024-token segments (RADAR's sqrt(t) at 1M) span several topic runs, whose minmax
  // envelope outranked segments holding needles at 1M tokens in the fidelity benchmark; 512-token
  // segments recover the single-level result for the same bytes (bench/RESULTS.md). Default: 0.
  int segment_pages = 0;
  // Two-level scoring once the middle has more pages than this. Default: 4096 (256K tokens of
  // 64-token pages): up to there the GPU scores every page in less time than the extra segment
  // stage costs (H200, session 39: 128K quest 34.3 -> 23.5 µs, tokenselect 52.9 -> 41.6; 256K
  // 34.4 -> 26.1 and 53.2 -> 46.7), at the same attention-mass recall (bench/RESULTS.md).
  int two_level_min_pages = 4096;
  // Segments kept at the first level: max(min_segments, segment_factor * B / (P * G)).
  // Defaults: 128 and 4 (8 lost most needles at 1M tokens in the fidelity benchmark).
  int min_segments = 128;
  int segment_factor = 4;
  // Random-feature dimension n and seed of the Gaussian projection (one projection per head_dim,
  // shared by all layers). Defaults: 2048 (RADAR's default n) and 0x5eed.
  int rf_features = 2048;
  uint64_t rf_seed = 0x5eed;
  // Selection cache threshold theta on the cosine similarity of queries; > 1 disables the cache.
  // Default: 0.9 (TokenSelect's code).
  double cache_theta = 0.9;
  // Layers that always use dense attention (e.g. {0, 1}). Default: none.
  std::vector<int> dense_layers;
  // tokenselect with a summary: candidate pages hold up to this many times B tokens, 1 to 16.
  // Default: 4 (bench/RESULTS.md, session 23: 2 is 12-14% faster on selecting steps, less exact).
  int tokenselect_candidate_factor = 4;
  // tokenselect with a summary: the selection split into this many independent parts, 1 to 64
  // (a power of two). Part j holds the pages (two-level: the segments) whose index is j modulo
  // the parts, and keeps its own share of the candidates and of the budget, ranked by a soft vote
  // over its own candidates (see TokenSelectParts in policy.cc). Each part keeps
  // ceil(token_budget / parts) tokens: a budget that is not a multiple of the parts is rounded up
  // to one (at most parts - 1 tokens more). 1 = the exact head soft vote over every candidate.
  // 0 (the default since session 39) = by the budget, EffectivePartitions(group): 16 at the default
  // B = 2048, one GPU block per part and KV head and no top-k across blocks (H200, 8B shape: 128K
  // 41.6 -> 37.6 µs, 1M 55.0 -> 45.5 per selecting step) for 0.1-0.5 points of attention-mass
  // recall (bench/RESULTS.md "Session 39"); fewer parts for smaller budgets, whose shares would
  // be too small to rank well.
  int tokenselect_partitions = 0;
  // hip: key block size b_k (tokens per leaf block). Default: 2 (HiP code's block_size_k).
  int hip_block = 2;
  // subgen: samples per cluster t, value samples s (0 = B / 4), cluster radius delta relative to
  // the running RMS key norm, RNG seed. Defaults: 1, 0, 0.5, 0x5b6e.
  int subgen_samples_per_cluster = 1;
  int subgen_value_samples = 0;
  double subgen_radius = 0.5;
  uint64_t subgen_seed = 0x5b6e;

  // Pages per segment actually used: segment_pages, or max(1, 512 / page_size) when it is 0.
  int EffectiveSegmentPages() const {
    return segment_pages > 0 ? segment_pages : (page_size > 0 ? std::max(1, 512 / page_size) : 1);
  }
  // tokenselect's parts for KV heads of `group` query heads: tokenselect_partitions, or for 0 the
  // largest power of two P <= 16 that divides the budget with at least 128 tokens per part (B =
  // 2048: 16; 1024: 8; 2000: 8; 1990: 2; below 256 or odd: 1), so that the default never rounds
  // the budget up, and 1 where parts would not run on every backend (kernels/part_limits.h: more
  // than 4 query heads per KV head, or more than 4096 candidate tokens in a part).
  int EffectivePartitions(int group) const;
  // The effective summary: DefaultSummary(kind) for kDefault, else summary.
  SummaryKind EffectiveSummary() const {
    return summary == SummaryKind::kDefault ? DefaultSummary(kind) : summary;
  }
  // InvalidArgument for non-positive sizes, a summary the policy cannot use, theta <= 0, ...
  absl::Status Validate() const;
};

// Costs of the selections made so far, for benchmarks (not exported as metrics).
struct SelectionStats {
  int64_t summary_bytes = 0;  // summary bytes scanned (counted as bf16: 2 bytes per value)
  int64_t key_bytes = 0;      // key bytes read for scoring (bf16)
  int64_t selections = 0;     // (layer, KV head) selections that ran (cache misses included)
  double select_seconds = 0;  // wall time inside Select
};

// An AttentionPolicy with benchmark hooks.
class SparsePolicy : public AttentionPolicy {
 public:
  // Changes B for later calls and clears the selection cache (used by budget sweeps).
  virtual void SetTokenBudget(int token_budget) = 0;
  virtual const SelectionStats& stats() const = 0;
  virtual void ResetStats() = 0;
};

// Makes a policy for one sequence of a model with these head counts. The cache passed to
// OnAppend/Select must have num_layers layers, num_kv_heads KV heads, head_dim and page_size as
// given (InvalidArgument from those calls otherwise). InvalidArgument for invalid options or
// shapes (num_q_heads % num_kv_heads != 0, head_dim <= 0, ...).
absl::StatusOr<std::unique_ptr<AttentionPolicy>> MakeAttentionPolicy(const PolicyOptions& options,
                                                                     int num_layers,
                                                                     int num_q_heads,
                                                                     int num_kv_heads,
                                                                     int head_dim);
// The same, with the benchmark hooks of SparsePolicy.
absl::StatusOr<std::unique_ptr<SparsePolicy>> MakeSparsePolicy(const PolicyOptions& options,
                                                               int num_layers, int num_q_heads,
                                                               int num_kv_heads, int head_dim);

}  // namespace strata::engine::sparse

#endif  // STRATA_ENGINE_SPARSE_POLICY_H_
