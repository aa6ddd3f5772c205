// Attention-fidelity benchmark (DESIGN.md section 8): how close each sparse policy's attention is
// to dense attention on synthetic but structured data, from 4K to 1M tokens.
//
// Workload (per context length and KV head; GQA group of 4 query heads per KV head, d = 128, the
// Llama-3.1-8B shape has 32 query / 8 KV heads): keys and queries are built in a pre-RoPE space
// and then rotated at their positions with Llama 3.1 RoPE (theta 500000, llama3 scaling factor 8;
// trained to 128K) or, above 128K with WorkloadParams::rope = kContextMatched, with the plain RoPE
// theta of a Llama-3-8B trained for that context (Gradient's 262K/524K/1048K/4194K models).
//   - semantic content (topics, sinks, needles) lives in the low-frequency rotary pairs 48..62,
//     so it survives rotation over long distances better than the high-frequency pairs, which
//     carry only noise;
//   - a shared bias along the lowest-frequency pair: ordinary keys carry it and every query is
//     anti-aligned with it, so ordinary (background) logits sit WorkloadParams::background_logit
//     below a neutral key at head scale 1 (sinks and needles do not carry it);
//   - a query temperature by context length (WorkloadParams::length_rule): none, or Llama 4's
//     attention temperature tuning t(L) = 1 + 0.1 ln(1 + floor(L / 8192)), applied as
//     t(L) / t(128K) so that every profile has the same logits at the 128K calibration point;
//   - clustered keys with locality: the sequence is a chain of topic runs (geometric lengths,
//     mean 512 tokens), each run's keys = its topic centre (one of 64) + noise;
//   - attention sinks: the first 4 tokens carry a large key along a sink direction that every
//     query also contains;
//   - planted needles: 16 runs of 1-4 tokens at random positions whose keys align with needle
//     directions; each query head targets 4 of them;
//   - per-head scale differences: the 4 query heads of a group are scaled by 0.7, 1.0, 1.4, 2.0;
//   - values: the topic's value centre + unit Gaussian noise.
// Profiles (WorkloadProfile; sources and measurements in bench/RESULTS.md, "Calibrating the
// workload"):
//   calibrated (default)  background_logit -8.5, no length rule, context-matched RoPE. The
//                         background level is chosen so that, at 128K tokens, the oracle's best
//                         4096 tokens (sinks + window + 3776 middle) hold 0.967 of the attention
//                         mass, which is what MInference (Jiang et al. 2024, sec. 2.1) measured for
//                         LLaMA-3-8B at 128K (top-4K columns: 96.8% of the attention). Above 128K
//                         the RoPE base follows the context (Men et al. 2024: a context L needs a
//                         base of at least ~0.0424 L^1.628). Logits do not change with the length:
//                         Llama 3.x has no length-dependent attention temperature, so the background
//                         mass grows with N beyond 128K (an extrapolation: no published top-k mass
//                         at 1M for a Llama-3-class model was found).
//   calibrated-logtemp    calibrated plus Llama 4's shipped temperature rule relative to 128K
//                         (transformers Llama4TextConfig.attn_temperature_tuning: attn_scale 0.1,
//                         floor_scale 8192; Scalable-Softmax, Nakanishi 2025: softmax attention
//                         fades as n grows and a learned scale grows like log n): the same logits at
//                         128K, sharper above (x1.158 at 1M), flatter below (x0.78 under 8K).
//   diffuse               the workload before calibration (background_logit -3.98 = -3 * 15 /
//                         sqrt(128), Llama 3.1 RoPE at every length), kept for comparison with
//                         the rows recorded before (it reproduces them exactly).
// Every head of the suite is a retrieval-type head (planted needles). Real layers also hold many
// streaming heads that attend to sinks and recent tokens only (DuoAttention, Xiao et al. 2024;
// fewer than 5% of heads are retrieval heads, Wu et al. 2024); the suite does not model them, so
// per-layer averages of a real model would be easier than these rows.
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
#include "absl/strings/string_view.h"

namespace strata::bench {

// How the query temperature depends on the context length L.
enum class LengthRule {
  kConstant,  // logits do not depend on L (Llama 3.x)
  kLlama4,    // query scaled by t(L) / t(128K), t(L) = 1 + 0.1 ln(1 + floor(L / 8192)) (Llama 4)
};

// Which rotary embedding the workload uses at a context length.
enum class RopeRule {
  kLlama31,         // Llama 3.1 (theta 500000, llama3 scaling factor 8; trained to 128K) everywhere
  kContextMatched,  // Llama 3.1 up to 128K; above, the plain RoPE theta of a Llama-3-8B trained for
                    // that context (Gradient's 262K/524K/1048K/4194K models: 207.1M, 1.06B,
                    // 2.80B, 45.2B)
};

// Parameters of the synthetic workload that the calibration sets (see the header comment).
struct WorkloadParams {
  std::string profile = "calibrated";
  // Logit of background tokens relative to a neutral key, at head scale 1 (before the per-head
  // scale and the length rule). In [-40, 0]. Default (calibrated): -8.5.
  double background_logit = -8.5;
  LengthRule length_rule = LengthRule::kConstant;
  RopeRule rope = RopeRule::kContextMatched;
};

// "calibrated", "calibrated-logtemp" or "diffuse"; InvalidArgument otherwise.
absl::StatusOr<WorkloadParams> WorkloadProfile(const std::string& name);
// The plain RoPE theta `rule` uses at context length L, or 0 where it uses Llama 3.1's RoPE.
double RopeThetaFor(RopeRule rule, int64_t context);
// The query temperature of `rule` at context length L (1 for kConstant).
double QueryTemperature(LengthRule rule, int64_t context);

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
  // tokenselect's independent parts (PolicyOptions::tokenselect_partitions); < 0 keeps the
  // policy default (by the budget), 0 is that too, else a power of two in [1, 64].
  int tokenselect_partitions = -1;
  // The keys the policies see (their summaries and scores): false, the cache's bf16 keys; true,
  // each page's keys as an fp8 e4m3 page holds them (kvstore/page_format.h: per-page scale
  // amax / 448), decoded back to bf16: what selecting from fp8 keys costs in fidelity. The dense
  // truth and every attended output use the bf16 keys. Page sizes must divide 8192.
  bool fp8_selection_keys = false;
  uint64_t seed = 1;
  // The synthetic workload (profile "calibrated" unless set; see WorkloadProfile).
  WorkloadParams workload;

  // InvalidArgument for empty lists, non-positive sizes or unknown policy names.
  absl::Status Validate() const;
};

struct FidelityRow {
  std::string profile;  // WorkloadParams::profile of the run
  std::string policy;
  std::string selection_keys = "bf16";  // the keys the policy saw: "bf16" or "fp8"
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

// FidelityOptions::fp8_selection_keys from its flag's value: "bf16" -> false, "fp8" -> true;
// InvalidArgument otherwise.
absl::StatusOr<bool> ParseSelectionKeys(absl::string_view name);

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
