// Transformer::Forward with ForwardOptions::device_policy (engine/sparse/device_policy.h) on the CPU
// backend: after the same chunked prefill, decode steps whose attention goes through the
// DevicePolicy give the logits of decode steps through the host tokenselect policy with the same
// options, and differ from dense decoding (the selection is really sparse).
#include <cmath>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/internal/test_model.h"
#include "engine/kv_cache.h"
#include "engine/sparse/device_policy.h"
#include "engine/sparse/policy.h"
#include "engine/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::engine::sparse {
namespace {

using kernels::DType;

TEST(DevicePolicyForwardTest, DecodeThroughDevicePolicyMatchesHostPolicy) {
  test_model::RefModel ref;
  auto m = test_model::MakeModel(DType::kF32, false, false, &ref);
  const model::ModelConfig& c = m->config;
  auto backend = kernels::MakeCpuBackend(1);
  TransformerOptions topt;
  topt.prefill_chunk_size = 64;
  STRATA_ASSERT_OK_AND_ASSIGN(auto tf, Transformer::Create(c, m->weights, backend.get(), topt));
  const int prompt = 700, steps = 4, page = 16;
  PolicyOptions o;
  o.kind = PolicyKind::kTokenSelect;
  o.token_budget = 64;
  o.sink_tokens = 16;
  o.window_tokens = 32;
  o.page_size = page;
  o.segment_pages = 4;
  o.min_segments = 4;
  o.two_level_min_pages = 16;
  o.cache_theta = 2.0;
  std::mt19937 rng(99);
  std::vector<int32_t> ids(prompt + steps);
  for (int32_t& x : ids) x = static_cast<int32_t>(rng() % c.vocab_size);
  const int64_t V = c.vocab_size;

  // Runs the prompt, then `steps` decode steps; returns the decode logits.
  auto run = [&](bool device, bool dense) -> std::vector<float> {
    auto cache = std::move(KvCache::Create(tf->MakeCacheOptions(prompt + steps, page),
                                           backend.get())).value();
    std::unique_ptr<AttentionPolicy> policy =
        dense ? MakeDensePolicy()
              : std::move(MakeAttentionPolicy(o, c.num_layers, c.num_heads, c.num_kv_heads,
                                              c.head_dim)).value();
    std::unique_ptr<DevicePolicy> dp;
    ForwardOptions fo;
    if (device) {
      dp = std::move(DevicePolicy::Create(o, cache->options(), c.num_heads, backend.get())).value();
      fo.device_policy = dp.get();
    }
    std::vector<float> logits(V), out;
    EXPECT_TRUE(tf->Forward(ids.data(), prompt, 0, cache.get(), policy.get(), logits.data(),
                            false, fo).ok());
    for (int s = 0; s < steps; ++s) {
      EXPECT_TRUE(tf->Forward(ids.data() + prompt + s, 1, prompt + s, cache.get(), policy.get(),
                              logits.data(), false, fo).ok());
      out.insert(out.end(), logits.begin(), logits.end());
    }
    return out;
  };
  const std::vector<float> host = run(false, false), device = run(true, false);
  const std::vector<float> dense = run(false, true);
  ASSERT_EQ(host.size(), device.size());
  double worst = 0, from_dense = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(host[i]) - device[i]));
    from_dense = std::max(from_dense, std::fabs(static_cast<double>(dense[i]) - device[i]));
  }
  EXPECT_LE(worst, 1e-4);
  EXPECT_GT(from_dense, 1e-3);
}

}  // namespace
}  // namespace strata::engine::sparse
