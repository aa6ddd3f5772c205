// Sample on the CUDA backend against the CPU twin (which is bit-for-bit engine::Sampler's): random
// logits (normal, few distinct values, NaN / -inf / +inf / -0 entries) and random options over
// vocab sizes 1, 3, 17, 1000 and 128256, several rows per call; the tokens must be identical. Also
// a row with nothing to pick (-1), capture in a CUDA graph and replay, and a timing (printed, see
// bench/RESULTS.md): device Sample vs copying the logits to the host + engine::Sampler, vocab
// 128256, greedy and top-p 0.9. Without a GPU every test reports "no CUDA GPU: skipped".
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/testing/cuda_test_base.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {
namespace {

class CudaSampleTest : public CudaTestBase<::testing::Test> {
 protected:
  // Runs Sample on the GPU for host logits [rows, vocab] and host options; returns the tokens.
  static std::vector<int32_t> RunGpu(const std::vector<float>& logits, int64_t vocab,
                                     const std::vector<SampleRow>& rows) {
    const int64_t n = static_cast<int64_t>(rows.size());
    auto l = gpu_->Allocate(logits.size() * sizeof(float));
    auto r = gpu_->Allocate(rows.size() * sizeof(SampleRow));
    auto t = gpu_->Allocate(rows.size() * sizeof(int32_t));
    EXPECT_TRUE(l.ok() && r.ok() && t.ok());
    if (!l.ok() || !r.ok() || !t.ok()) return {};
    EXPECT_TRUE(gpu_->CopyToDevice((*l)->data(), logits.data(), logits.size() * 4, nullptr).ok());
    EXPECT_TRUE(gpu_->CopyToDevice((*r)->data(), rows.data(), rows.size() * sizeof(SampleRow),
                                   nullptr).ok());
    SampleParams p;
    p.logits = TensorView((*l)->data(), DType::kF32, {n, vocab});
    p.rows = static_cast<const SampleRow*>((*r)->data());
    p.tokens = TensorView((*t)->data(), DType::kI32, {n});
    const absl::Status s = gpu_->Sample(p, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    std::vector<int32_t> out(n, -7);
    EXPECT_TRUE(gpu_->CopyToHost(out.data(), (*t)->data(), n * 4, nullptr).ok());
    return out;
  }

};

std::vector<int32_t> RunCpu(const std::vector<float>& logits, int64_t vocab,
                            const std::vector<SampleRow>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<int32_t> out(n, -7);
  SampleParams p;
  p.logits = TensorView(const_cast<float*>(logits.data()), DType::kF32, {n, vocab});
  p.rows = rows.data();
  p.tokens = TensorView(out.data(), DType::kI32, {n});
  EXPECT_TRUE(CpuSample(p).ok());
  return out;
}

SampleRow RandomRow(std::mt19937& rng, int64_t vocab) {
  SampleRow r;
  const int kind = static_cast<int>(rng() % 6);
  r.temperature = kind == 0 ? 0.0 : std::uniform_real_distribution<double>(0.05, 2.0)(rng);
  if (kind == 2 || kind == 4) r.top_k = 1 + static_cast<int64_t>(rng() % (vocab + 2));
  if (kind == 3 || kind == 4) r.top_p = std::uniform_real_distribution<double>(0.05, 1.0)(rng);
  if (kind == 5) r.top_p = 0.9;
  r.u = static_cast<double>(rng() >> 8) * (1.0 / 16777216.0);
  return r;
}

std::vector<float> RandomLogits(std::mt19937& rng, int64_t vocab, int mode) {
  std::vector<float> l(vocab);
  std::normal_distribution<float> n(0.0f, 3.0f);
  // Mode 1: four values (ties far beyond one histogram bin's gather); mode 3: normal logits rounded
  // to 1/64 (exact ties of about 80 ids each, inside bins the select gathers).
  for (auto& x : l) {
    x = mode == 1 ? static_cast<float>(static_cast<int>(rng() % 4))
        : mode == 3 ? std::round(n(rng) * 64.0f) / 64.0f
                    : n(rng);
  }
  if (mode == 2) {
    for (int i = 0; i < 3; ++i) {
      const int64_t j = rng() % vocab;
      const int k = static_cast<int>(rng() % 4);
      l[j] = k == 0   ? std::numeric_limits<float>::quiet_NaN()
             : k == 1 ? -std::numeric_limits<float>::infinity()
             : k == 2 ? std::numeric_limits<float>::infinity()
                      : -0.0f;
    }
  }
  return l;
}

TEST_F(CudaSampleTest, MatchesCpuTwin) {
  int compared = 0;
  for (const int64_t vocab : {1, 3, 17, 1000, 128256}) {
    std::mt19937 rng(static_cast<uint32_t>(vocab));
    const int trials = vocab > 100000 ? 12 : 60;
    for (int trial = 0; trial < trials; ++trial) {
      const int rows = 1 + static_cast<int>(rng() % 4);
      std::vector<float> logits;
      std::vector<SampleRow> opts;
      for (int r = 0; r < rows; ++r) {
        const auto l = RandomLogits(rng, vocab, trial % 4);
        logits.insert(logits.end(), l.begin(), l.end());
        opts.push_back(RandomRow(rng, vocab));
      }
      const auto want = RunCpu(logits, vocab, opts);
      const auto got = RunGpu(logits, vocab, opts);
      ASSERT_EQ(got.size(), want.size());
      for (int r = 0; r < rows; ++r) {
        EXPECT_EQ(got[r], want[r]) << "vocab " << vocab << " trial " << trial << " row " << r
                                   << " T " << opts[r].temperature << " k " << opts[r].top_k
                                   << " p " << opts[r].top_p << " u " << opts[r].u;
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 300);
}

TEST_F(CudaSampleTest, NothingToPickGivesMinusOne) {
  const std::vector<float> logits = {std::nanf(""), -INFINITY, std::nanf(""), 1.0f, 2.0f, 2.0f};
  std::vector<SampleRow> rows(2);
  rows[0].temperature = 1.0;
  rows[0].u = 0.3;
  const auto got = RunGpu(logits, 3, rows);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], -1);
  EXPECT_EQ(got[1], 1);  // greedy, tie to the lower id
}

TEST_F(CudaSampleTest, CapturedInAGraph) {
  auto* cuda = dynamic_cast<CudaBackend*>(gpu_);
  ASSERT_NE(cuda, nullptr);
  const int64_t vocab = 128256, n = 2;
  std::mt19937 rng(7);
  std::vector<float> logits;
  for (int r = 0; r < n; ++r) {
    const auto l = RandomLogits(rng, vocab, 0);
    logits.insert(logits.end(), l.begin(), l.end());
  }
  std::vector<SampleRow> rows(n);
  rows[0].temperature = 0.8;
  rows[0].top_p = 0.9;
  rows[0].u = 0.25;
  rows[1].temperature = 1.0;
  rows[1].top_k = 50;
  rows[1].u = 0.75;
  STRATA_ASSERT_OK_AND_ASSIGN(auto l, gpu_->Allocate(logits.size() * 4));
  STRATA_ASSERT_OK_AND_ASSIGN(auto r, gpu_->Allocate(n * sizeof(SampleRow)));
  STRATA_ASSERT_OK_AND_ASSIGN(auto t, gpu_->Allocate(n * 4));
  STRATA_ASSERT_OK(gpu_->CopyToDevice(l->data(), logits.data(), logits.size() * 4, nullptr));
  STRATA_ASSERT_OK_AND_ASSIGN(Stream s, cuda->CreateStream());
  auto* stream = static_cast<cudaStream_t>(s);
  SampleParams p;
  p.logits = TensorView(l->data(), DType::kF32, {n, vocab});
  p.rows = static_cast<const SampleRow*>(r->data());
  p.tokens = TensorView(t->data(), DType::kI32, {n});
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status captured = gpu_->Sample(p, s);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  STRATA_ASSERT_OK(captured);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  // Replay with new uniforms written to the same device rows.
  for (int step = 0; step < 3; ++step) {
    rows[0].u = 0.1 + 0.3 * step;
    rows[1].u = 0.9 - 0.3 * step;
    STRATA_ASSERT_OK(gpu_->CopyToDevice(r->data(), rows.data(), n * sizeof(SampleRow), s));
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    std::vector<int32_t> got(n);
    STRATA_ASSERT_OK(gpu_->CopyToHost(got.data(), t->data(), n * 4, s));
    EXPECT_EQ(got, RunCpu(logits, vocab, rows)) << "step " << step;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  STRATA_ASSERT_OK(cuda->DestroyStream(s));
}

// Timing (printed): µs per call of device Sample vs copy to host + engine::Sampler.
TEST_F(CudaSampleTest, Timing) {
  const int64_t vocab = 128256;
  std::mt19937 rng(11);
  const auto logits = RandomLogits(rng, vocab, 0);
  STRATA_ASSERT_OK_AND_ASSIGN(auto l, gpu_->Allocate(vocab * 4));
  STRATA_ASSERT_OK_AND_ASSIGN(auto r, gpu_->Allocate(sizeof(SampleRow)));
  STRATA_ASSERT_OK_AND_ASSIGN(auto t, gpu_->Allocate(4));
  STRATA_ASSERT_OK(gpu_->CopyToDevice(l->data(), logits.data(), vocab * 4, nullptr));
  std::vector<float> host(vocab);
  for (const int mode : {0, 1, 2}) {
    const bool greedy = mode == 0;
    SampleRow row;
    // 0: greedy; 1: temperature 1, top-p 0.9 (most of the vocabulary kept); 2: temperature 0.7,
    // top-k 40, top-p 0.95.
    row.temperature = mode == 0 ? 0.0 : mode == 1 ? 1.0 : 0.7;
    row.top_p = mode == 0 ? 1.0 : mode == 1 ? 0.9 : 0.95;
    row.top_k = mode == 2 ? 40 : 0;
    row.u = 0.5;
    STRATA_ASSERT_OK(gpu_->CopyToDevice(r->data(), &row, sizeof(row), nullptr));
    SampleParams p;
    p.logits = TensorView(l->data(), DType::kF32, {1, vocab});
    p.rows = static_cast<const SampleRow*>(r->data());
    p.tokens = TensorView(t->data(), DType::kI32, {1});
    const int iters = 200;
    for (int i = 0; i < 5; ++i) STRATA_ASSERT_OK(gpu_->Sample(p, nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) STRATA_ASSERT_OK(gpu_->Sample(p, nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    const double dev_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        iters;
    int32_t token = -7;
    STRATA_ASSERT_OK(gpu_->CopyToHost(&token, t->data(), 4, nullptr));
    engine::SamplingOptions o;
    o.temperature = row.temperature;
    o.top_p = row.top_p;
    o.top_k = row.top_k;
    const int host_iters = greedy ? 200 : 20;
    t0 = std::chrono::steady_clock::now();
    int32_t host_token = -7;
    for (int i = 0; i < host_iters; ++i) {
      STRATA_ASSERT_OK(gpu_->CopyToHost(host.data(), l->data(), vocab * 4, nullptr));
      engine::Sampler sampler(o);
      STRATA_ASSERT_OK_AND_ASSIGN(host_token, sampler.Sample(host.data(), vocab));
    }
    const double host_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        host_iters;
    std::printf("sample_timing vocab=%lld mode=%s device_us=%.1f host_copy_plus_sampler_us=%.1f\n",
                static_cast<long long>(vocab), mode == 0   ? "greedy"
                : mode == 1 ? "t1_top_p_0.9"
                            : "t0.7_top_k_40_top_p_0.95",
                dev_us, host_us);
    // The host sampler draws its own uniform; greedy rows must agree. The CPU twin, with u, must.
    if (greedy) {
      EXPECT_EQ(token, host_token);
    }
    EXPECT_EQ(token, RunCpu(logits, vocab, {row})[0]);
  }
}

}  // namespace
}  // namespace strata::kernels
