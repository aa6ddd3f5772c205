// DevicePolicy on the CUDA backend, whose selection runs as one SelectStages kernel
// (kernels/cuda/selection.cu SelectStagesKernel; STRATA_SELECT_STAGES=require_fused makes a
// fallback to the ops an error), against DevicePolicy on the CPU backend (the ops one by one),
// at the decode shape of an 8B model (4 query heads per KV head, head_dim 128, 64-token pages,
// bf16 cache, the default budget): the same cache contents, one-level (48K tokens) and two-level
// (140K tokens, with two_level_min_pages below its default) page ranking, quest and tokenselect,
// several decode steps; and over fp8 caches (KvCacheOptions fp8_e4m3 with per-tensor scales: the
// kernel's fp8 form on the GPU). The attention runs inside the selection kernel
// (STRATA_SELECT_ATTEND=require_fused). Page scales vary so the ranking has clear winners; a
// query head whose output differs counts as a near-tie swap, and at most a few may. Cases with
// the selection cache on (theta 0.9; on CUDA its check inside the selection kernel where the form
// has it) give half the KV heads a query close to the last step's, so those reuse: both sides
// count the same lookups and hits. Label gpu: skipped without a GPU.
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/kv_cache.h"
#include "engine/sparse/device_policy.h"
#include "gtest/gtest.h"
#include "kernels/testing/cuda_plugin_backend.h"

namespace strata::engine::sparse {
namespace {

using kernels::DType;
using kernels::TensorView;

constexpr int kHq = 16, kHkv = 4, kD = 128, kPage = 64;

// A one-layer cache (bf16, or fp8 with k_scale 1/16 and v_scale 1/8) and the DevicePolicy over
// it, on one backend.
struct Side {
  kernels::Backend* backend = nullptr;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<DevicePolicy> policy;

  absl::Status Init(kernels::Backend* b, const PolicyOptions& o, int64_t max_tokens, DType dtype) {
    backend = b;
    KvCacheOptions co;
    co.num_layers = 1;
    co.num_kv_heads = kHkv;
    co.head_dim = kD;
    co.page_size = kPage;
    co.dtype = dtype;
    co.max_tokens = max_tokens;
    if (dtype == DType::kFP8E4M3) co.k_scale = 1.0f / 16, co.v_scale = 1.0f / 8;
    STRATA_ASSIGN_OR_RETURN(cache, KvCache::Create(co, b));
    STRATA_ASSIGN_OR_RETURN(policy, DevicePolicy::Create(o, co, kHq, b));
    return absl::OkStatus();
  }
  // Appends the host rows k, v [n, kHkv, kD].
  absl::Status Append(const std::vector<float>& k, const std::vector<float>& v, int64_t n) {
    const size_t bytes = k.size() * sizeof(float);
    STRATA_ASSIGN_OR_RETURN(auto dk, backend->Allocate(bytes));
    STRATA_ASSIGN_OR_RETURN(auto dv, backend->Allocate(bytes));
    STRATA_RETURN_IF_ERROR(backend->CopyToDevice(dk->data(), k.data(), bytes, nullptr));
    STRATA_RETURN_IF_ERROR(backend->CopyToDevice(dv->data(), v.data(), bytes, nullptr));
    const int64_t first = cache->length(0);
    STRATA_RETURN_IF_ERROR(cache->Append(0, TensorView(dk->data(), DType::kF32, {n, kHkv, kD}),
                                         TensorView(dv->data(), DType::kF32, {n, kHkv, kD})));
    STRATA_RETURN_IF_ERROR(policy->OnAppend(0, *cache, first, first + n, nullptr));
    return backend->Synchronize(nullptr);
  }
  // Decode attention for q [kHq, kD] (host) into out / lse (host).
  absl::Status Attend(const std::vector<float>& q, std::vector<float>* out,
                      std::vector<float>* lse) {
    STRATA_ASSIGN_OR_RETURN(auto dq, backend->Allocate(q.size() * sizeof(float)));
    STRATA_ASSIGN_OR_RETURN(auto dout, backend->Allocate(q.size() * sizeof(float)));
    STRATA_ASSIGN_OR_RETURN(auto dlse, backend->Allocate(kHq * sizeof(float)));
    STRATA_RETURN_IF_ERROR(
        backend->CopyToDevice(dq->data(), q.data(), q.size() * sizeof(float), nullptr));
    STRATA_RETURN_IF_ERROR(policy->Attend(0, TensorView(dq->data(), DType::kF32, {1, kHq, kD}),
                                          *cache,
                                          TensorView(dout->data(), DType::kF32, {1, kHq, kD}),
                                          TensorView(dlse->data(), DType::kF32, {1, kHq}),
                                          nullptr));
    out->assign(q.size(), NAN);
    lse->assign(kHq, NAN);
    STRATA_RETURN_IF_ERROR(
        backend->CopyToHost(out->data(), dout->data(), out->size() * sizeof(float), nullptr));
    STRATA_RETURN_IF_ERROR(
        backend->CopyToHost(lse->data(), dlse->data(), lse->size() * sizeof(float), nullptr));
    return backend->Synchronize(nullptr);
  }
};

struct Case {
  PolicyKind kind;
  int64_t len;  // tokens before the decode steps
  DType dtype = DType::kBF16;
  int partitions = 1;  // PolicyOptions::tokenselect_partitions (the partitioned kernel)
  int budget = 0;      // PolicyOptions::token_budget (0: the default, 2048)
  float theta = 2.0f;  // PolicyOptions::cache_theta (above 1: every step selects)
};

class DevicePolicyGpuTest : public ::testing::TestWithParam<Case> {};

TEST_P(DevicePolicyGpuTest, FusedSelectionMatchesCpuOps) {
  std::string why;
  std::unique_ptr<kernels::Backend> gpu =
      kernels::testing::CudaPluginBackendOrNull(STRATA_CUDA_PLUGIN_PATH, &why);
  if (gpu == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(0);
  const Case c = GetParam();
  PolicyOptions o;  // the defaults: B 2048, sinks 64, window 256, segments of 8 pages
  o.kind = c.kind;
  // 140K (2188 pages) two-level: the default threshold (4096 pages) would score its pages directly.
  if (c.len > 64 * 1024) o.two_level_min_pages = 1024;
  o.page_size = kPage;
  o.cache_theta = c.theta;
  o.tokenselect_partitions = c.partitions;
  if (c.budget > 0) o.token_budget = c.budget;
  const int steps = 4;
  Side g, h;
  STRATA_ASSERT_OK(g.Init(gpu.get(), o, c.len + steps, c.dtype));
  STRATA_ASSERT_OK(h.Init(cpu.get(), o, c.len + steps, c.dtype));
  std::mt19937 rng(20261128u + static_cast<uint32_t>(c.len) + static_cast<uint32_t>(c.kind));
  std::normal_distribution<float> nd;
  std::lognormal_distribution<float> page_scale(0.0f, 0.5f);
  // Keys scaled per (page, head), so page bounds and token scores have clear winners.
  auto append = [&](int64_t n) {
    std::vector<float> k(static_cast<size_t>(n) * kHkv * kD), v(k.size());
    std::vector<float> scale(kHkv);
    const int64_t first = g.cache->length(0);
    for (int64_t t = 0; t < n; ++t) {
      if (t == 0 || (first + t) % kPage == 0) {
        for (float& s : scale) s = page_scale(rng);
      }
      for (int hh = 0; hh < kHkv; ++hh) {
        for (int e = 0; e < kD; ++e) {
          k[(t * kHkv + hh) * kD + e] = scale[hh] * nd(rng);
          v[(t * kHkv + hh) * kD + e] = nd(rng);
        }
      }
    }
    STRATA_ASSERT_OK(g.Append(k, v, n));
    STRATA_ASSERT_OK(h.Append(k, v, n));
  };
  for (int64_t t = 0; t < c.len; t += 8192) append(std::min<int64_t>(8192, c.len - t));
  setenv("STRATA_SELECT_STAGES", "require_fused", 1);
  setenv("STRATA_SELECT_ATTEND", "require_fused", 1);
  int heads = 0, differ = 0;
  const bool cached = c.theta <= 1.0f;
  std::vector<float> q(kHq * kD);
  for (int step = 0; step < steps; ++step) {
    append(1);
    // With the cache on, the query heads of KV heads below kHkv / 2 move a little from the last
    // step's (cosine ~0.995 per step, above 0.98 with the query their cache holds from step 0:
    // they reuse from step 1 on); the others are drawn afresh (they select).
    for (int i = 0; i < kHq * kD; ++i) {
      const bool close = cached && step > 0 && i / (kHq / kHkv * kD) < kHkv / 2;
      q[i] = close ? 0.995f * q[i] + 0.1f * nd(rng) : nd(rng);
    }
    std::vector<float> go, gl, ho, hl;
    const absl::Status st = g.Attend(q, &go, &gl);
    ASSERT_TRUE(st.ok()) << st;
    STRATA_ASSERT_OK(h.Attend(q, &ho, &hl));
    for (int hq = 0; hq < kHq; ++hq) {
      ++heads;
      bool same = std::fabs(gl[hq] - hl[hq]) <= 2e-3f * (1.0f + std::fabs(hl[hq]));
      for (int e = 0; e < kD; ++e) {
        ASSERT_TRUE(std::isfinite(go[hq * kD + e])) << "step " << step << " head " << hq;
        same = same && std::fabs(go[hq * kD + e] - ho[hq * kD + e]) <= 2e-3f;
      }
      differ += same ? 0 : 1;
    }
  }
  unsetenv("STRATA_SELECT_STAGES");
  unsetenv("STRATA_SELECT_ATTEND");
  if (cached) {
    STRATA_ASSERT_OK(g.policy->ReadCacheHits(nullptr));
    STRATA_ASSERT_OK(h.policy->ReadCacheHits(nullptr));
    EXPECT_EQ(g.policy->counters().cache_lookups, int64_t{steps} * kHkv);
    EXPECT_EQ(h.policy->counters().cache_lookups, int64_t{steps} * kHkv);
    EXPECT_EQ(h.policy->counters().cache_hits, int64_t{steps - 1} * (kHkv / 2));
    EXPECT_EQ(g.policy->counters().cache_hits, h.policy->counters().cache_hits);
  }
  std::printf("  %s %lld tokens, %s cache, %d parts, budget %d: %d of %d query-head outputs "
              "differ from the CPU ops\n",
              c.kind == PolicyKind::kQuest ? "quest" : "tokenselect",
              static_cast<long long>(c.len), kernels::DTypeName(c.dtype), c.partitions,
              o.token_budget, differ, heads);
  EXPECT_LE(differ, heads / 16) << "more outputs differ than near-ties explain";
}

INSTANTIATE_TEST_SUITE_P(Cases, DevicePolicyGpuTest,
                         ::testing::Values(Case{PolicyKind::kQuest, 48 * 1024},
                                           Case{PolicyKind::kTokenSelect, 48 * 1024},
                                           Case{PolicyKind::kQuest, 140 * 1024},
                                           Case{PolicyKind::kTokenSelect, 140 * 1024},
                                           Case{PolicyKind::kQuest, 48 * 1024, DType::kFP8E4M3},
                                           Case{PolicyKind::kTokenSelect, 140 * 1024,
                                                DType::kFP8E4M3},
                                           Case{PolicyKind::kTokenSelect, 48 * 1024,
                                                DType::kBF16, 16},
                                           Case{PolicyKind::kTokenSelect, 140 * 1024,
                                                DType::kBF16, 16},
                                           Case{PolicyKind::kTokenSelect, 140 * 1024,
                                                DType::kBF16, 8},
                                           Case{PolicyKind::kTokenSelect, 140 * 1024,
                                                DType::kFP8E4M3, 16},
                                           // A budget the parts do not divide: each part keeps
                                           // ceil(1990 / 16) = 125 tokens (odd k per block).
                                           Case{PolicyKind::kTokenSelect, 140 * 1024,
                                                DType::kBF16, 16, 1990},
                                           // The selection cache on: quest's one-part kernel
                                           // with the check inside (bf16 and fp8 rows),
                                           // tokenselect in parts (inside the part kernel) and in
                                           // one part (the check's kernel first).
                                           Case{PolicyKind::kQuest, 48 * 1024, DType::kBF16, 1,
                                                0, 0.9f},
                                           Case{PolicyKind::kQuest, 48 * 1024, DType::kFP8E4M3,
                                                1, 0, 0.9f},
                                           Case{PolicyKind::kTokenSelect, 140 * 1024,
                                                DType::kBF16, 16, 0, 0.9f},
                                           Case{PolicyKind::kTokenSelect, 48 * 1024,
                                                DType::kBF16, 1, 0, 0.9f}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.kind == PolicyKind::kQuest ? "quest"
                                                                                 : "tokenselect") +
                                  "_" + std::to_string(i.param.len / 1024) + "K_" +
                                  kernels::DTypeName(i.param.dtype) +
                                  (i.param.partitions > 1
                                       ? "_p" + std::to_string(i.param.partitions)
                                       : std::string()) +
                                  (i.param.budget > 0 ? "_b" + std::to_string(i.param.budget)
                                                      : std::string()) +
                                  (i.param.theta <= 1.0f ? "_cached" : std::string());
                         });

}  // namespace
}  // namespace strata::engine::sparse
