// Times CudaBackend::PagedAttention for one decode token (Llama-3.1-8B shape: 32 query heads,
// 8 KV heads, head_dim 128, bf16 pool, 64-token pages, random data) at several context lengths,
// over (a) every page of the context ("dense") and (b) a 2048-token budget of 32 random pages per
// KV head ("budget"). Three figures per row, medians:
//   gpu_us   device time of one call: a 256 MiB memset flushes L2, a host function holds the
//            stream until the call has been enqueued, and CUDA events bracket the call (plan
//            copy, split-K kernel, combine kernel and the gaps between them; no host time);
//   host_us  host time of the call (validation, planning, enqueueing);
//   b2b_us   calls enqueued back to back without flush or sync, total event time / calls
//            (the steady state: host-bound or device-bound, whichever is slower).
// The budget case is also swept over the split-K items per SM (CudaBackend::SetDecodeItemsPerSm).
//
// Usage: cuda_attention_bench [--ncu] [context ...]   (default contexts: 32768 131072)
//   --ncu: few iterations and no host gate, for running under Nsight Compute.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {
namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kPage = 64, kBudget = 2048;
int g_warmup = 5, g_runs = 50;
bool g_ncu = false;

#define BENCH_CHECK(cond, what)                          \
  do {                                                   \
    if (!(cond)) {                                       \
      std::fprintf(stderr, "failed: %s\n", what);        \
      std::exit(1);                                      \
    }                                                    \
  } while (0)

// Holds a stream (cudaLaunchHostFunc) until Open(): the calls enqueued behind it then run back
// to back on the device.
struct Gate {
  std::atomic<bool> open{false};
  static void CUDART_CB Wait(void* self) {
    auto* g = static_cast<Gate*>(self);
    while (!g->open.load(std::memory_order_acquire)) {
    }
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int Run(int argc, char** argv) {
  std::vector<int64_t> contexts;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--ncu") {
      g_ncu = true;
      g_warmup = 2;
      g_runs = 3;
    } else {
      contexts.push_back(std::atoll(argv[i]));
    }
  }
  if (contexts.empty()) contexts = {32768, 131072};
  auto made = MakeCudaBackend(0);
  if (!made.ok()) {
    std::printf("no CUDA GPU: %s\n", made.status().ToString().c_str());
    return 0;
  }
  auto backend = std::move(made).value();
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  void* flush = nullptr;
  const size_t flush_bytes = size_t{256} << 20;
  BENCH_CHECK(cudaMalloc(&flush, flush_bytes) == cudaSuccess, "cudaMalloc flush");
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaStream_t stream = nullptr;  // the backend's own stream is used for nullptr below
  auto* cuda = static_cast<CudaBackend*>(backend.get());
  auto s_or = cuda->CreateStream();
  BENCH_CHECK(s_or.ok(), "CreateStream");
  stream = static_cast<cudaStream_t>(s_or.value());

  std::printf("%-8s %-7s %8s %8s %9s %9s %9s %8s %7s\n", "context", "keys", "tokens/h",
              "items/SM", "gpu_us", "host_us", "b2b_us", "MiB", "GB/s");
  std::mt19937 rng(1234);
  for (int64_t context : contexts) {
    const int64_t pages_per_head = context / kPage;
    const int64_t slots = pages_per_head * kKvHeads;
    const int64_t elems = slots * kPage * kHeadDim;
    // Random bf16 in [-1, 1) (never zeros: zeros can time faster than real data).
    std::vector<uint16_t> host(elems);
    uint32_t x = 2463534242u;
    for (int64_t i = 0; i < elems; ++i) {
      x ^= x << 13, x ^= x >> 17, x ^= x << 5;
      const float f = static_cast<float>(x >> 8) / 8388608.0f - 1.0f;
      host[i] = F32ToBF16(f);
    }
    auto k = backend->Allocate(elems * 2);
    auto v = backend->Allocate(elems * 2);
    BENCH_CHECK(k.ok() && v.ok(), "pool allocation");
    BENCH_CHECK(backend->CopyToDevice(k.value()->data(), host.data(), elems * 2, nullptr).ok(), "k");
    BENCH_CHECK(backend->CopyToDevice(v.value()->data(), host.data() + 1, (elems - 1) * 2, nullptr).ok(), "v");
    std::vector<float> qh(kQHeads * kHeadDim);
    std::uniform_real_distribution<float> ud(-1, 1);
    for (float& f : qh) f = ud(rng);
    auto q = backend->Allocate(qh.size() * 4);
    auto out = backend->Allocate(qh.size() * 4);
    auto lse = backend->Allocate(kQHeads * 4);
    BENCH_CHECK(q.ok() && out.ok() && lse.ok(), "q/out/lse allocation");
    BENCH_CHECK(backend->CopyToDevice(q.value()->data(), qh.data(), qh.size() * 4, nullptr).ok(), "q");

    for (int mode = 0; mode < 2; ++mode) {
      const bool dense = mode == 0;
      std::vector<KvSpan> spans;
      std::vector<int32_t> offsets(kKvHeads + 1, 0);
      for (int g = 0; g < kKvHeads; ++g) {
        offsets[g] = static_cast<int32_t>(spans.size());
        std::vector<int32_t> pages(pages_per_head);
        for (int64_t i = 0; i < pages_per_head; ++i) pages[i] = static_cast<int32_t>(i);
        if (!dense) {
          std::shuffle(pages.begin(), pages.end(), rng);
          pages.resize(std::min<int64_t>(kBudget / kPage, pages_per_head));
          std::sort(pages.begin(), pages.end());
        }
        for (int32_t pg : pages) {
          spans.push_back({static_cast<int32_t>(g * pages_per_head + pg), 0, kPage, pg * kPage});
        }
      }
      offsets[kKvHeads] = static_cast<int32_t>(spans.size());
      const int64_t tokens_per_head = spans.size() / kKvHeads * kPage;
      int32_t qpos = static_cast<int32_t>(context);
      PagedAttentionParams p;
      p.q = q.value()->View(DType::kF32, {1, kQHeads, kHeadDim});
      p.k_pool = k.value()->View(DType::kBF16, {slots, kPage, kHeadDim});
      p.v_pool = v.value()->View(DType::kBF16, {slots, kPage, kHeadDim});
      p.spans = spans.data();
      p.span_offsets = offsets.data();
      p.num_kv_heads = kKvHeads;
      p.q_positions = &qpos;
      p.causal = true;
      p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
      p.out = out.value()->View(DType::kF32, {1, kQHeads, kHeadDim});
      p.lse = lse.value()->View(DType::kF32, {1, kQHeads});
      const double mib =
          static_cast<double>(tokens_per_head) * kKvHeads * kHeadDim * 2 * 2 / (1 << 20);
      std::vector<int> sweep = {4};
      if (!dense && !g_ncu) sweep = {1, 2, 4, 8, 16};
      for (int items_per_sm : sweep) {
        cuda->SetDecodeItemsPerSm(items_per_sm);
        // Ungated warm-up first: a call that has to grow the pinned staging ring (cudaMallocHost /
        // cudaFreeHost synchronise the device) must not run while the gate holds the stream.
        for (int it = 0; it < 8; ++it) {
          const absl::Status st = backend->PagedAttention(p, stream);
          BENCH_CHECK(st.ok(), st.ToString().c_str());
        }
        BENCH_CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "warm-up");
        std::vector<double> gpu_us, host_us;
        for (int it = 0; it < g_warmup + g_runs; ++it) {
          BENCH_CHECK(cudaMemsetAsync(flush, it & 0xff, flush_bytes, stream) == cudaSuccess, "flush");
          Gate gate;
          if (!g_ncu) {
            BENCH_CHECK(cudaLaunchHostFunc(stream, Gate::Wait, &gate) == cudaSuccess, "gate");
          }
          BENCH_CHECK(cudaEventRecord(e0, stream) == cudaSuccess, "event");
          const auto h0 = std::chrono::steady_clock::now();
          const absl::Status st = backend->PagedAttention(p, stream);
          const auto h1 = std::chrono::steady_clock::now();
          BENCH_CHECK(cudaEventRecord(e1, stream) == cudaSuccess, "event");
          gate.open.store(true, std::memory_order_release);
          BENCH_CHECK(st.ok(), st.ToString().c_str());
          BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "sync");
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          if (it >= g_warmup) {
            gpu_us.push_back(ms * 1000.0);
            host_us.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count());
          }
        }
        // Back to back: the steady state of repeated calls.
        double b2b = 0;
        if (!g_ncu) {
          const int calls = 50;
          BENCH_CHECK(cudaEventRecord(e0, stream) == cudaSuccess, "event");
          for (int c = 0; c < calls; ++c) {
            const absl::Status st = backend->PagedAttention(p, stream);
            BENCH_CHECK(st.ok(), st.ToString().c_str());
          }
          BENCH_CHECK(cudaEventRecord(e1, stream) == cudaSuccess, "event");
          BENCH_CHECK(cudaEventSynchronize(e1) == cudaSuccess, "sync");
          float ms = 0;
          cudaEventElapsedTime(&ms, e0, e1);
          b2b = ms * 1000.0 / calls;
        }
        std::vector<float> o(qh.size());
        BENCH_CHECK(backend->CopyToHost(o.data(), out.value()->data(), o.size() * 4, stream).ok(),
                    "out");
        for (float f : o) BENCH_CHECK(std::isfinite(f), "non-finite output");
        const double med = Median(gpu_us);
        std::printf("%-8lld %-7s %8lld %8d %9.1f %9.1f %9.1f %8.1f %7.0f\n",
                    static_cast<long long>(context), dense ? "dense" : "budget",
                    static_cast<long long>(tokens_per_head), items_per_sm, med, Median(host_us),
                    b2b, mib, mib * 1.048576e6 / (med * 1e3));
        std::fflush(stdout);
      }
      cuda->SetDecodeItemsPerSm(0);
    }
  }
  cudaFree(flush);
  BENCH_CHECK(cuda->DestroyStream(stream).ok(), "DestroyStream");
  return 0;
}

}  // namespace
}  // namespace strata::kernels

int main(int argc, char** argv) { return strata::kernels::Run(argc, argv); }
