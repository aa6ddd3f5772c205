// What one-token GEMVs over the Llama-3.1-8B shapes cost with bf16 weights and with fp8 e4m3
// weights (a per-row f32 scale), on the GPU it runs on: a feasibility measurement for fp8 weights
// (a micro-benchmark on the CUDA runtime and the backend's device helpers; the production GEMVs
// are in matmul.cu).
// Both use the same kernel shape as matmul.cu's GemvRowsKernel: one warp per weight row, rows
// handed out in turn over a grid of every resident warp, 8 16-byte loads in flight per lane read
// past L1, f32 activations, a warp shuffle sum. A 16-byte chunk holds 8 bf16 or 16 fp8 weights.
// Each shape rotates over enough copies of its weight that no rep finds it in L2; the figure is
// the median over reps of one GEMV (CUDA events), and GB/s counts the weight bytes. A check
// compares both kernels with a host dot product on a few rows.
// The fp8 kernel runs twice: with 8 and with 16 loads in flight per lane (an fp8 row of 4096
// weights is 8 chunks per lane: one round of 8 loads, then nothing in flight while it computes).
// Usage: cuda_gemv_weight_bench [reps=50]
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/internal/bench_check.h"
#include "kernels/cuda/internal/common.cuh"

namespace {

constexpr int kThreads = 256;

using strata::kernels::cuda_internal::LoadWeightChunk;
using strata::kernels::cuda_internal::WarpSum;

// FP8: 16 weights per chunk, out = scale[row] * dot; else 8 bf16 weights per chunk. UNROLL
// 16-byte loads in flight per lane.
template <bool FP8, int kUnroll = 8>
__global__ void __launch_bounds__(kThreads)
    GemvRows(const float* __restrict__ x, const uint4* __restrict__ w,
             const float* __restrict__ scale, float* __restrict__ out, int64_t k, int64_t m) {
  constexpr int kPer = FP8 ? 16 : 8;  // weights per 16-byte chunk
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t chunks = k / kPer;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5); o < m;
       o += warps) {
    const uint4* row = w + o * chunks;
    float acc = 0.0f;
    for (int64_t c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        raw[u] = c < chunks ? LoadWeightChunk(row + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        if (c >= chunks) continue;
        const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
        if constexpr (FP8) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float4 a = __ldg(x4 + c * 4 + q);
            const __nv_fp8x2_storage_t lo = static_cast<__nv_fp8x2_storage_t>(words[q] & 0xffff);
            const __nv_fp8x2_storage_t hi = static_cast<__nv_fp8x2_storage_t>(words[q] >> 16);
            const float2 f0 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(lo, __NV_E4M3)));
            const float2 f1 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(hi, __NV_E4M3)));
            acc += f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w;
          }
        } else {
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const float4 a = __ldg(x4 + c * 2 + q);
            const float2 f0 = __bfloat1622float2(
                *reinterpret_cast<const __nv_bfloat162*>(&words[2 * q]));
            const float2 f1 = __bfloat1622float2(
                *reinterpret_cast<const __nv_bfloat162*>(&words[2 * q + 1]));
            acc += f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w;
          }
        }
      }
    }
    acc = WarpSum(acc);
    if (lane == 0) out[o] = FP8 ? acc * scale[o] : acc;
  }
}

template <bool FP8, int kUnroll>
unsigned Blocks(int64_t m) {
  int per_sm = 0, sms = 0, device = 0;
  CUDA_BENCH_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, GemvRows<FP8, kUnroll>, kThreads, 0));
  CUDA_BENCH_CHECK(cudaGetDevice(&device));
  CUDA_BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t want = (m + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<unsigned>(std::min<int64_t>(want, static_cast<int64_t>(sms) * per_sm));
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float Fp8ToFloat(uint8_t c) {  // e4m3, finite codes only
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  const float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return s ? -v : v;
}

struct Shape {
  const char* name;
  int64_t m, k;
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  if (reps < 1) {
    std::fprintf(stderr, "usage: cuda_gemv_weight_bench [reps>=1]\n");
    return 2;
  }
  const Shape shapes[] = {{"q|k|v", 6144, 4096},     {"o", 4096, 4096},
                          {"gate|up", 28672, 4096},  {"down", 4096, 14336},
                          {"lm_head", 128256, 4096}};
  std::mt19937 rng(11);
  cudaStream_t stream;
  CUDA_BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CUDA_BENCH_CHECK(cudaEventCreate(&e0));
  CUDA_BENCH_CHECK(cudaEventCreate(&e1));
  int bad = 0;
  double layer_us[3] = {0, 0, 0}, head_us[3] = {0, 0, 0};
  std::printf("%-8s %8s %6s | %10s %8s | %10s %8s | %16s %8s | %s\n", "weight", "rows", "cols",
              "bf16 us", "GB/s", "fp8 us", "GB/s", "fp8 16-deep us", "GB/s", "fp8/bf16");
  for (const Shape& sh : shapes) {
    double us[3] = {0, 0, 0};
    for (int variant = 0; variant < 3; ++variant) {
      const int fp8 = variant > 0 ? 1 : 0;
      const int64_t bytes = sh.m * sh.k * (fp8 ? 1 : 2);
      // Copies enough that a rotation through them exceeds 4 x a 60 MiB L2.
      const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{240} << 20) / bytes + 1));
      std::vector<uint8_t> host(bytes);
      std::uniform_int_distribution<int> byte(0, 255);
      for (int64_t i = 0; i < bytes; ++i) {
        int b = byte(rng);
        if (fp8 && ((b & 0x7f) == 0x7f)) b &= 0xfe;  // no NaN codes
        if (!fp8 && (i % 2 == 1)) b = (b & 0x80) | (0x38 + (b & 7));  // bf16 in about [-2, 2]
        host[i] = static_cast<uint8_t>(b);
      }
      std::vector<float> x(sh.k), scale(sh.m);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (float& v : x) v = u(rng);
      for (float& v : scale) v = 0.01f + 0.01f * (u(rng) + 1.0f);
      std::vector<void*> w(copies);
      for (int c = 0; c < copies; ++c) {
        CUDA_BENCH_CHECK(cudaMalloc(&w[c], bytes));
        CUDA_BENCH_CHECK(cudaMemcpy(w[c], host.data(), bytes, cudaMemcpyHostToDevice));
      }
      float *dx = nullptr, *ds = nullptr, *dout = nullptr;
      CUDA_BENCH_CHECK(cudaMalloc(&dx, sh.k * 4));
      CUDA_BENCH_CHECK(cudaMalloc(&ds, sh.m * 4));
      CUDA_BENCH_CHECK(cudaMalloc(&dout, sh.m * 4));
      CUDA_BENCH_CHECK(cudaMemcpy(dx, x.data(), sh.k * 4, cudaMemcpyHostToDevice));
      CUDA_BENCH_CHECK(cudaMemcpy(ds, scale.data(), sh.m * 4, cudaMemcpyHostToDevice));
      const unsigned blocks = variant == 2   ? Blocks<true, 16>(sh.m)
                              : variant == 1 ? Blocks<true, 8>(sh.m)
                                             : Blocks<false, 8>(sh.m);
      auto launch = [&](int c) {
        const uint4* wc = static_cast<const uint4*>(w[c]);
        if (variant == 2) {
          GemvRows<true, 16><<<blocks, kThreads, 0, stream>>>(dx, wc, ds, dout, sh.k, sh.m);
        } else if (variant == 1) {
          GemvRows<true, 8><<<blocks, kThreads, 0, stream>>>(dx, wc, ds, dout, sh.k, sh.m);
        } else {
          GemvRows<false, 8><<<blocks, kThreads, 0, stream>>>(dx, wc, ds, dout, sh.k, sh.m);
        }
      };
      std::vector<double> t;
      for (int r = 0; r < reps + 5; ++r) {
        CUDA_BENCH_CHECK(cudaEventRecord(e0, stream));
        launch(r % copies);
        CUDA_BENCH_CHECK(cudaEventRecord(e1, stream));
        CUDA_BENCH_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 5) t.push_back(ms * 1000.0);
      }
      std::sort(t.begin(), t.end());
      us[variant] = t[t.size() / 2];
      // Check a few rows against a host dot product (f64).
      std::vector<float> got(sh.m);
      CUDA_BENCH_CHECK(cudaMemcpy(got.data(), dout, sh.m * 4, cudaMemcpyDeviceToHost));
      for (int64_t o : {int64_t{0}, sh.m / 2, sh.m - 1}) {
        double want = 0, mag = 0;
        for (int64_t i = 0; i < sh.k; ++i) {
          const float wv = fp8 ? Fp8ToFloat(host[o * sh.k + i])
                               : Bf16ToFloat(static_cast<uint16_t>(host[2 * (o * sh.k + i)] |
                                                                   host[2 * (o * sh.k + i) + 1] << 8));
          want += static_cast<double>(wv) * x[i];
          mag += std::fabs(static_cast<double>(wv) * x[i]);
        }
        if (fp8) want *= scale[o], mag *= scale[o];
        if (std::fabs(got[o] - want) > 1e-5 * mag + 1e-6) {
          ++bad;
          std::printf("check %s %s row %lld: %g vs %g\n", sh.name, fp8 ? "fp8" : "bf16",
                      static_cast<long long>(o), got[o], want);
        }
      }
      for (void* p : w) CUDA_BENCH_CHECK(cudaFree(p));
      CUDA_BENCH_CHECK(cudaFree(dx));
      CUDA_BENCH_CHECK(cudaFree(ds));
      CUDA_BENCH_CHECK(cudaFree(dout));
    }
    const double gb16 = sh.m * sh.k * 2 / (us[0] * 1e3), gb8 = sh.m * sh.k / (us[1] * 1e3),
                 gb8d = sh.m * sh.k / (us[2] * 1e3);
    std::printf("%-8s %8lld %6lld | %10.2f %8.0f | %10.2f %8.0f | %16.2f %8.0f | %.3f\n", sh.name,
                static_cast<long long>(sh.m), static_cast<long long>(sh.k), us[0], gb16, us[1],
                gb8, us[2], gb8d, std::min(us[1], us[2]) / us[0]);
    for (int f = 0; f < 3; ++f) {
      if (std::strcmp(sh.name, "lm_head") == 0) {
        head_us[f] = us[f];
      } else {
        layer_us[f] += us[f];
      }
    }
  }
  std::printf("32 layers + lm_head: bf16 %.0f us, fp8 %.0f us, fp8 16-deep %.0f us (cold weights, "
              "one GEMV at a time)\n",
              32 * layer_us[0] + head_us[0], 32 * layer_us[1] + head_us[1],
              32 * layer_us[2] + head_us[2]);
  std::printf("check: %d bad rows\n", bad);
  return bad == 0 ? 0 : 1;
}
