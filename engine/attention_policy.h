// Attention policies: which cached tokens each attention call attends (DESIGN.md section 3).
//
// The transformer forward calls, per layer:
//   1. cache.Append(layer, k, v) for the new tokens, then policy->OnAppend(...) so summaries are
//      built as pages fill;
//   2. policy->Select(...) with the queries of the new tokens, which fills `Selection` with the
//      spans of every KV head to attend (the new tokens themselves included; causality is
//      enforced by PagedAttention through positions);
//   3. PagedAttention over those spans.
// `dense` selects every cached token, so its output is exact. Sparse policies (engine/sparse/)
// select sinks + window + pages chosen from summaries within a token budget.
//
// A policy object belongs to one sequence (it holds per-sequence state such as summaries and the
// selection cache). Thread-compatible.
#ifndef STRATA_ENGINE_ATTENTION_POLICY_H_
#define STRATA_ENGINE_ATTENTION_POLICY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/kv_cache.h"
#include "kernels/backend.h"

namespace strata::engine {

// The spans to attend, for every KV head of one layer, in CSR form ready for PagedAttention.
struct Selection {
  std::vector<kernels::KvSpan> spans;
  std::vector<int32_t> offsets;  // [num_kv_heads + 1]
  void Clear() {
    spans.clear();
    offsets.clear();
  }
};

// What selection did, summed over calls (exported as metrics by the service).
struct SelectionCounters {
  int64_t candidate_tokens = 0;   // tokens that could have been attended
  int64_t selected_tokens = 0;    // tokens actually attended
  int64_t cache_lookups = 0;      // selection-cache lookups
  int64_t cache_hits = 0;         // selection-cache hits
};

class AttentionPolicy {
 public:
  virtual ~AttentionPolicy() = default;
  virtual std::string Name() const = 0;

  // Tokens [first, end) of `layer` were appended to `cache`.
  virtual absl::Status OnAppend(int layer, const KvCache& cache, int64_t first, int64_t end) = 0;

  // Chooses the spans for queries q of `layer`: q is host f32 [num_tokens, num_q_heads,
  // head_dim] (after RoPE), at positions [q_begin, q_begin + num_tokens); the cache already
  // holds their keys. On return `out` holds spans for every KV head.
  virtual absl::Status Select(int layer, const float* q, int num_tokens, int num_q_heads,
                              int64_t q_begin, const KvCache& cache, Selection* out) = 0;

  virtual const SelectionCounters& counters() const = 0;

  // Whether Select reads `q` (false lets the forward skip copying the query to the host).
  virtual bool ReadsQuery() const { return true; }
};

// Attends every cached token (exact attention).
std::unique_ptr<AttentionPolicy> MakeDensePolicy();

}  // namespace strata::engine

#endif  // STRATA_ENGINE_ATTENTION_POLICY_H_
