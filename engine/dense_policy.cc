// The dense attention policy: every cached token of every KV head. See engine/attention_policy.h.
#include <memory>
#include <string>

#include "engine/attention_policy.h"

namespace strata::engine {
namespace {

class DensePolicy : public AttentionPolicy {
 public:
  std::string Name() const override { return "dense"; }

  absl::Status OnAppend(int layer, const KvCache& cache, int64_t first, int64_t end) override {
    return absl::OkStatus();
  }

  absl::Status Select(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      const KvCache& cache, Selection* out) override {
    if (layer < 0 || layer >= cache.options().num_layers) {
      return absl::InvalidArgumentError("dense policy: layer out of range");
    }
    out->Clear();
    const int hkv = cache.options().num_kv_heads;
    const int64_t len = cache.length(layer);
    out->offsets.push_back(0);
    for (int g = 0; g < hkv; ++g) {
      cache.AppendSpans(layer, g, 0, len, &out->spans);
      out->offsets.push_back(static_cast<int32_t>(out->spans.size()));
    }
    // Counted per KV head: tokens visible to the call vs tokens attended.
    counters_.candidate_tokens += len * hkv;
    counters_.selected_tokens += len * hkv;
    return absl::OkStatus();
  }

  const SelectionCounters& counters() const override { return counters_; }
  bool ReadsQuery() const override { return false; }

 private:
  SelectionCounters counters_;
};

}  // namespace

std::unique_ptr<AttentionPolicy> MakeDensePolicy() { return std::make_unique<DensePolicy>(); }

}  // namespace strata::engine
