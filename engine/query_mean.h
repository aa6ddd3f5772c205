// The mean query of a chunk of queries, the one query with which a prefill chunk selects
// (TokenSelect's chunk-wise selection; DESIGN.md section 3). Every chunk chooser uses it: the
// host sparse policies (engine/sparse/policy.h), DevicePolicy::AttendChunk, the lazy mount's page
// choosers (engine::MakeMinMaxChooser, worker/lazy_attention.h) and the sharded leader
// (worker/shard_attention.h).
//
// MeanQuery (host): the sum over tokens in token order in f32, then divided by the count.
// DeviceQueryMean (backend memory): a tree of Backend::MergeAttention calls with equal weights
// through the parts' lse, so the mean stays on the device (no host round trip); it differs from
// the host's running sum in rounding (~1e-7 relative), so a near-tie in a vote may go the other
// way.
#ifndef STRATA_ENGINE_QUERY_MEAN_H_
#define STRATA_ENGINE_QUERY_MEAN_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace strata::engine {

// out = the mean over num_tokens >= 1 rows of `row` floats of q (host f32), row t starting at
// q + t * stride (stride 0: rows back to back, stride = row), e.g. one KV head's query heads of a
// chunk [num_tokens, num_q_heads, head_dim].
void MeanQuery(const float* q, int num_tokens, int64_t row, std::vector<float>* out, int64_t stride = 0);

// The mean over the rows of q [m, num_q_heads, head_dim] f32 in backend memory, kept in buffers
// of its own (reused while m stays the same). Thread-compatible.
class DeviceQueryMean {
 public:
  DeviceQueryMean(kernels::Backend* backend, int num_q_heads, int head_dim)
      : backend_(backend), hq_(num_q_heads), d_(head_dim) {}

  // [num_q_heads, head_dim] in backend memory: q itself for m == 1, else this object's buffer
  // (valid until the next call). InvalidArgument for a q of another shape or dtype; the backend's
  // errors (allocation, the lse upload on a new m, MergeAttention).
  absl::StatusOr<kernels::TensorView> Mean(const kernels::TensorView& q, kernels::Stream stream);

 private:
  struct MergeLevel {  // rows out, part starts; the parts' lse at lse_offset floats
    int64_t rows_out = 0;
    std::vector<int64_t> starts;
    int64_t lse_offset = 0;
  };
  kernels::Backend* backend_;
  int hq_, d_;
  int64_t rows_ = 0;  // the plan's m (0: none)
  std::vector<MergeLevel> plan_;
  std::unique_ptr<kernels::Buffer> lse_, out_[2], out_lse_[2];
};

}  // namespace strata::engine

#endif  // STRATA_ENGINE_QUERY_MEAN_H_
