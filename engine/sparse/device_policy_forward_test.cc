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

// TokenSelect with a 64-token budget, 16 sinks, a 32-token window, segments of 4 pages (two-level
// from 16 pages) and no selection cache: small enough to select on a short test sequence.
PolicyOptions SmallTokenSelect(int page) {
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
  return o;
}

TEST(DevicePolicyForwardTest, DecodeThroughDevicePolicyMatchesHostPolicy) {
  test_model::RefModel ref;
  auto m = test_model::MakeModel(DType::kF32, false, false, &ref);
  const model::ModelConfig& c = m->config;
  auto backend = kernels::MakeCpuBackend(1);
  TransformerOptions topt;
  topt.prefill_chunk_size = 64;
  STRATA_ASSERT_OK_AND_ASSIGN(auto tf, Transformer::Create(c, m->weights, backend.get(), topt));
  const int prompt = 700, steps = 4, page = 16;
  const PolicyOptions o = SmallTokenSelect(page);
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

TEST(DevicePolicyForwardTest, PrefillChunksThroughDevicePolicyMatchHostPolicy) {
  test_model::RefModel ref;
  auto m = test_model::MakeModel(DType::kF32, false, false, &ref);
  const model::ModelConfig& c = m->config;
  auto backend = kernels::MakeCpuBackend(1);
  TransformerOptions topt;
  topt.prefill_chunk_size = 96;  // chunks of 96 and a last one of 41
  STRATA_ASSERT_OK_AND_ASSIGN(auto tf, Transformer::Create(c, m->weights, backend.get(), topt));
  const int prompt = 617, page = 16;
  const PolicyOptions o = SmallTokenSelect(page);
  std::mt19937 rng(7);
  std::vector<int32_t> ids(prompt);
  for (int32_t& x : ids) x = static_cast<int32_t>(rng() % c.vocab_size);
  const int64_t V = c.vocab_size;

  // All prompt logits: through the host policy, or the DevicePolicy (dense host policy told of
  // appends only), or dense.
  auto run = [&](const PolicyOptions& po, bool device, bool dense) -> std::vector<float> {
    auto cache = std::move(KvCache::Create(tf->MakeCacheOptions(prompt, page),
                                           backend.get())).value();
    std::unique_ptr<AttentionPolicy> policy =
        dense || device ? MakeDensePolicy()
                        : std::move(MakeAttentionPolicy(po, c.num_layers, c.num_heads,
                                                        c.num_kv_heads, c.head_dim)).value();
    std::unique_ptr<DevicePolicy> dp;
    ForwardOptions fo;
    if (device) {
      dp = std::move(DevicePolicy::Create(po, cache->options(), c.num_heads, backend.get()))
               .value();
      fo.device_policy = dp.get();
      fo.device_prefill = true;
    }
    std::vector<float> logits(static_cast<size_t>(prompt) * V, NAN);
    EXPECT_TRUE(tf->Forward(ids.data(), prompt, 0, cache.get(), policy.get(), logits.data(),
                            true, fo).ok());
    if (device && po.token_budget < prompt) {
      EXPECT_GT(dp->counters().candidate_tokens, dp->counters().selected_tokens);
    }
    return logits;
  };
  const std::vector<float> host = run(o, false, false), device = run(o, true, false);
  const std::vector<float> dense = run(o, false, true);
  PolicyOptions all = o;
  all.token_budget = prompt;
  const std::vector<float> device_all = run(all, true, false);
  double worst = 0, from_dense = 0, all_from_dense = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    ASSERT_TRUE(std::isfinite(device[i])) << i;
    worst = std::max(worst, std::fabs(static_cast<double>(host[i]) - device[i]));
    from_dense = std::max(from_dense, std::fabs(static_cast<double>(dense[i]) - device[i]));
    all_from_dense =
        std::max(all_from_dense, std::fabs(static_cast<double>(dense[i]) - device_all[i]));
  }
  EXPECT_LE(worst, 1e-4);
  EXPECT_GT(from_dense, 1e-3);
  EXPECT_LE(all_from_dense, 1e-5);
}

}  // namespace
}  // namespace strata::engine::sparse
