// Attention-fidelity benchmark (DESIGN.md section 8): how close each sparse policy's attention is
// to dense attention on synthetic but structured data, from 4K to 1M tokens.
//
// Workload (per context length and KV head; GQA group of 4 query heads per KV head, d = 128, the
// Llama-3.1-8B shape has 32 query / 8 KV heads): keys and queries are built in a pre-RoPE space
// and then rotated with Llama 3.1 RoPE (theta 500000, llama3 scaling factor 8) at their positions.
//   - semantic content (topics, sinks, needles) lives in the low-frequency rotary pairs 48..62,
//     so it survives rotation over long distances better than the high-frequency pairs, which
//     carry only noise;
//   - a shared bias along the lowest-frequency pair: ordinary keys carry it and every query is
//     anti-aligned with it, lowering ordinary logits by about 4 (scale 1) against sinks/needles;
//   - clustered keys with locality: the sequence is a chain of topic runs (geometric lengths,
//     mean 512 tokens), each run's keys = its topic centre (one of 64) + noise;
//   - attention sinks: the first 4 tokens carry a large key along a sink direction that every
//     query also contains;
//   - planted needles: 16 runs of 1-4 tokens at random positions whose keys align with needle
//     directions; each query head targets 4 of them;
//   - per-head scale differences: the 4 query heads of a group are scaled by 0.7, 1.0, 1.4, 2.0;
//   - values: the topic's value centre + unit Gaussian noise.
// Keys and values are generated procedurally, one KV head at a time, and streamed into a bf16
// KvCache (so memory stays ~1 GiB at 1M tokens); every policy builds its summaries through
// OnAppend as the cache fills, then selects for one decode query at the last position.
//
// Metrics per (policy, budget, page size, context), averaged over the evaluated query heads:
//   mass_recall   sum of the true softmax probabilities of the attended tokens;
//   topk_recall   fraction of the true top-k tokens (k = topk) that are attended;
//   rel_error     |o_S - o| / |o|, o = dense output, o_S = attention restricted to the set;
//   bytes_per_step  per layer and decode step for 8 KV heads: summary bytes scanned + key bytes
//                 read for scoring + K and V of the attended tokens, all counted as bf16;
//   select_ms     selection CPU time per layer and step (8 KV heads), one thread.
// The pseudo-policy "oracle" attends sinks + window + each query head's own true top-B middle
// tokens: an upper bound for any selection of B middle tokens (per query head; real policies
// choose one set per KV head), to show what a budget can reach at all.
// Thread-compatible; RunFidelity uses OpenMP internally.
#ifndef STRATA_BENCH_FIDELITY_H_
#define STRATA_BENCH_FIDELITY_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace strata::bench {

struct FidelityOptions {
  std::vector<int64_t> contexts = {4096, 32768, 131072};
  std::vector<int> budgets = {1024, 2048, 4096};
  std::vector<int> page_sizes = {16, 32, 64};
  // "name" or "name:summary" (engine/sparse/policy.h), e.g. "quest", "tokenselect:rf".
  std::vector<std::string> policies = {"oracle",      "streaming",        "quest", "quest:mean",
                                       "radar",       "tokenselect",      "tokenselect:none",
                                       "tokenselect:rf", "hip",           "subgen"};
  // KV heads evaluated per context (each with its 4 query heads); the bytes and time columns are
  // scaled to the model's 8 KV heads. Default: 2.
  int kv_heads = 2;
  int sink_tokens = 64;
  int window_tokens = 256;
  int topk = 64;
  // subgen's per-token clustering is O(clusters * d); skipped above this context. Default: 131072.
  int64_t subgen_max_context = 131072;
  // Random-feature dimension for rf summaries. Default: 2048.
  int rf_features = 2048;
  // Two-level page ranking knobs (PolicyOptions); < 0 keeps the policy default.
  int segment_pages = -1;
  int two_level_min_pages = -1;
  int min_segments = -1;
  int segment_factor = -1;
  int tokenselect_candidate_factor = -1;
  uint64_t seed = 1;

  // InvalidArgument for empty lists, non-positive sizes or unknown policy names.
  absl::Status Validate() const;
};

struct FidelityRow {
  std::string policy;
  int64_t context = 0;
  int budget = 0;
  int page_size = 0;
  double mass_recall = 0;
  double topk_recall = 0;
  double rel_error = 0;
  double bytes_per_step = 0;
  double select_ms = 0;
  double attended_tokens = 0;  // per KV head, sinks + window + middle
};

// Runs the benchmark; progress lines go to `log` (may be null). Rows come in context, page size,
// policy, budget order. InvalidArgument for invalid options; ResourceExhausted if memory fails.
absl::StatusOr<std::vector<FidelityRow>> RunFidelity(const FidelityOptions& options,
                                                     std::ostream* log);

// A fixed-width table of the rows (one line each, with a header).
std::string FormatFidelityTable(const std::vector<FidelityRow>& rows);
// One JSON object (one line, no trailing newline) with every field of the row.
std::string FidelityRowJson(const FidelityRow& row);

}  // namespace strata::bench

#endif  // STRATA_BENCH_FIDELITY_H_
