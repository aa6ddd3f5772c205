// Times causal prefill attention through CudaBackend::PagedAttention (Llama-3.1-8B shape: 32
// query heads, 8 KV heads, head_dim 128; one chunk of n tokens at positions 0..n-1 over a bf16
// page pool of 64-token pages, spans = every page of the chunk, random data) and reports
// TFLOP/s with the causal FLOP count 2 * 2 * n^2 / 2 * d per query head, for the flash kernel
// with 32- and 64-key tiles (cuda_internal::SetFlashPrefillBlockN) and its default. Each figure is the
// median of CUDA-event times around single calls (plan copy, tile pre-pass and flash kernel;
// q is read as f32 and out written as f32, as the op's interface has them).
// With --general N it also times the general (scalar) kernel at contexts <= N once
// (CudaBackend::PrefillPath::kGeneral) and prints the largest |flash - general| difference of
// out and lse there, a check of the flash kernel at the benchmark shape.
//
// With --chunk C it also times chunked prefill: the last C tokens of each context as the query
// chunk over all of its keys (FLOPs 2 * 2 * d * (C * (n - C) + C^2 / 2) per query head).
//
// Usage: cuda_prefill_bench [--general N] [--chunk C] [--runs R] [context ...]
//        (default contexts 8192 16384 32768)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/flash_prefill.h"
#include "kernels/cuda/testing/bench_util.h"
#include "kernels/cuda_backend.h"
#include "kernels/tensor.h"

namespace strata::kernels {
namespace {

using bench::Median;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kPage = 64;

int Run(int argc, char** argv) {
  std::vector<int64_t> contexts;
  int64_t general_max = 0, chunk = 0;
  int runs = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--general" && i + 1 < argc) {
      general_max = std::atoll(argv[++i]);
    } else if (a == "--chunk" && i + 1 < argc) {
      chunk = std::atoll(argv[++i]);
    } else if (a == "--runs" && i + 1 < argc) {
      runs = std::max(1, std::atoi(argv[++i]));
    } else {
      contexts.push_back(std::atoll(argv[i]));
    }
  }
  if (contexts.empty()) contexts = {8192, 16384, 32768};
  auto made = CudaBackend::Create(0);
  if (!made.ok()) {
    std::printf("no CUDA GPU: %s\n", made.status().ToString().c_str());
    return 0;
  }
  CudaBackend* cuda = made.value().get();
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto s_or = cuda->CreateStream();
  BENCH_CHECK(s_or.ok(), "CreateStream");
  const Stream stream = s_or.value();

  std::printf("%-8s %-8s %10s %10s\n", "context", "kernel", "ms", "TFLOP/s");
  std::mt19937 rng(1234);
  for (const int64_t n : contexts) {
    const int64_t pages = (n + kPage - 1) / kPage;
    const int64_t slots = pages * kKvHeads;
    const int64_t pool_elems = slots * kPage * kHeadDim;
    std::vector<uint16_t> pool(pool_elems);
    uint32_t x = 2463534242u;
    for (int64_t i = 0; i < pool_elems; ++i) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      pool[i] = F32ToBF16(static_cast<float>(x >> 8) / 8388608.0f - 1.0f);
    }
    const int64_t q_elems = n * kQHeads * kHeadDim;
    std::vector<float> qh(q_elems);
    std::uniform_real_distribution<float> ud(-1, 1);
    for (float& f : qh) f = ud(rng);
    auto k = cuda->Allocate(pool_elems * 2);
    auto v = cuda->Allocate(pool_elems * 2);
    auto q = cuda->Allocate(q_elems * 4);
    auto out = cuda->Allocate(q_elems * 4);
    auto lse = cuda->Allocate(n * kQHeads * 4);
    BENCH_CHECK(k.ok() && v.ok() && q.ok() && out.ok() && lse.ok(), "allocation");
    BENCH_CHECK(cuda->CopyToDevice(k.value()->data(), pool.data(), pool_elems * 2, nullptr).ok(), "k");
    std::rotate(pool.begin(), pool.begin() + 1, pool.end());
    BENCH_CHECK(cuda->CopyToDevice(v.value()->data(), pool.data(), pool_elems * 2, nullptr).ok(), "v");
    BENCH_CHECK(cuda->CopyToDevice(q.value()->data(), qh.data(), q_elems * 4, nullptr).ok(), "q");

    std::vector<KvSpan> spans;
    std::vector<int32_t> offsets(kKvHeads + 1, 0);
    for (int g = 0; g < kKvHeads; ++g) {
      offsets[g] = static_cast<int32_t>(spans.size());
      for (int64_t i = 0; i < pages; ++i) {
        const int32_t len = static_cast<int32_t>(std::min<int64_t>(kPage, n - i * kPage));
        spans.push_back({static_cast<int32_t>(g * pages + i), 0, len, static_cast<int32_t>(i * kPage)});
      }
    }
    offsets[kKvHeads] = static_cast<int32_t>(spans.size());
    std::vector<int32_t> q_pos(n);
    for (int64_t t = 0; t < n; ++t) q_pos[t] = static_cast<int32_t>(t);
    PagedAttentionParams p;
    p.q = q.value()->View(DType::kF32, {n, kQHeads, kHeadDim});
    p.k_pool = k.value()->View(DType::kBF16, {slots, kPage, kHeadDim});
    p.v_pool = v.value()->View(DType::kBF16, {slots, kPage, kHeadDim});
    p.spans = spans.data();
    p.span_offsets = offsets.data();
    p.num_kv_heads = kKvHeads;
    p.q_positions = q_pos.data();
    p.causal = true;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    p.out = out.value()->View(DType::kF32, {n, kQHeads, kHeadDim});
    p.lse = lse.value()->View(DType::kF32, {n, kQHeads});
    const double flops = 2.0 * 2.0 * static_cast<double>(n) * n / 2.0 * kHeadDim * kQHeads;

    auto time_calls = [&](int warmup, int timed) {
      std::vector<double> ms;
      for (int it = 0; it < warmup + timed; ++it) {
        BENCH_CHECK(cudaEventRecord(e0, static_cast<cudaStream_t>(stream)) == cudaSuccess, "event");
        const absl::Status st = cuda->PagedAttention(p, stream);
        BENCH_CHECK(st.ok(), st.ToString().c_str());
        BENCH_CHECK(cudaEventRecord(e1, static_cast<cudaStream_t>(stream)) == cudaSuccess, "event");
        BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "sync");
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        if (it >= warmup) ms.push_back(t);
      }
      return Median(ms);
    };

    cuda->SetPrefillPath(CudaBackend::PrefillPath::kAuto);
    // The flash kernel with 32- and 64-key tiles, then the default (its output is kept).
    for (const int block_n : {32, 64, 0}) {
      cuda_internal::SetFlashPrefillBlockN(block_n);
      const double flash_ms = time_calls(2, runs);
      std::printf("%-8lld %-8s %10.3f %10.1f\n", static_cast<long long>(n),
                  block_n == 32 ? "flash32" : block_n == 64 ? "flash64" : "flash", flash_ms,
                  flops / (flash_ms * 1e-3) / 1e12);
      std::fflush(stdout);
    }
    std::vector<float> fo(q_elems), fl(n * kQHeads);
    BENCH_CHECK(cuda->CopyToHost(fo.data(), out.value()->data(), q_elems * 4, stream).ok(), "out");
    BENCH_CHECK(cuda->CopyToHost(fl.data(), lse.value()->data(), fl.size() * 4, stream).ok(), "lse");
    for (float f : fo) BENCH_CHECK(std::isfinite(f), "non-finite flash output");

    if (n <= general_max) {
      cuda->SetPrefillPath(CudaBackend::PrefillPath::kGeneral);
      const double gen_ms = time_calls(0, 1);
      std::printf("%-8lld %-8s %10.3f %10.1f\n", static_cast<long long>(n), "general", gen_ms,
                  flops / (gen_ms * 1e-3) / 1e12);
      std::vector<float> go(q_elems), gl(n * kQHeads);
      BENCH_CHECK(cuda->CopyToHost(go.data(), out.value()->data(), q_elems * 4, stream).ok(), "out");
      BENCH_CHECK(cuda->CopyToHost(gl.data(), lse.value()->data(), gl.size() * 4, stream).ok(), "lse");
      double d_out = 0, d_lse = 0;
      for (int64_t i = 0; i < q_elems; ++i) d_out = std::max<double>(d_out, std::fabs(fo[i] - go[i]));
      for (size_t i = 0; i < gl.size(); ++i) d_lse = std::max<double>(d_lse, std::fabs(fl[i] - gl[i]));
      std::printf("%-8lld max |flash - general|: out %.3g, lse %.3g\n", static_cast<long long>(n),
                  d_out, d_lse);
      std::fflush(stdout);
      cuda->SetPrefillPath(CudaBackend::PrefillPath::kAuto);
    }

    if (chunk > 0 && chunk < n) {
      // Chunked prefill: the last `chunk` tokens over every key of the context.
      const int64_t skip = n - chunk;
      PagedAttentionParams c = p;
      c.q.data = static_cast<float*>(q.value()->data()) + skip * kQHeads * kHeadDim;
      c.q.shape[0] = chunk;
      c.out.data = static_cast<float*>(out.value()->data()) + skip * kQHeads * kHeadDim;
      c.out.shape[0] = chunk;
      c.lse.data = static_cast<float*>(lse.value()->data()) + skip * kQHeads;
      c.lse.shape[0] = chunk;
      c.q_positions = q_pos.data() + skip;
      const double chunk_flops = 2.0 * 2.0 * kHeadDim * kQHeads *
                                 (static_cast<double>(chunk) * skip + chunk * chunk / 2.0);
      const PagedAttentionParams saved = p;
      p = c;
      const double chunk_ms = time_calls(2, runs);
      p = saved;
      std::printf("%-8lld %-8s %10.3f %10.1f   (last %lld tokens over the whole context)\n",
                  static_cast<long long>(n), "chunk", chunk_ms,
                  chunk_flops / (chunk_ms * 1e-3) / 1e12, static_cast<long long>(chunk));
      std::fflush(stdout);
    }
  }
  BENCH_CHECK(cuda->DestroyStream(stream).ok(), "DestroyStream");
  return 0;
}

}  // namespace
}  // namespace strata::kernels

int main(int argc, char** argv) { return strata::kernels::Run(argc, argv); }
