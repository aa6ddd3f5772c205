// What one-token GEMVs over the Llama-3.1-8B shapes cost with bf16 weights and with fp8 e4m3
// weights (a per-row f32 scale), on the GPU it runs on: the measurements behind matmul.cu's
// GemvFp8Kernel (a micro-benchmark on the CUDA runtime and the backend's device helpers; the
// production GEMVs are in matmul.cu). Two kernel shapes:
// - rows: matmul.cu's GemvRowsKernel: one warp per weight row, rows handed out in turn over a
//   grid of every resident warp, 8 16-byte loads in flight per lane read past L1, f32
//   activations, a warp shuffle sum. A 16-byte chunk holds 8 bf16 or 16 fp8 weights.
// - mma: the products on tensor cores, 16 rows per block (GemvMma below), with variants by warps
//   per block, a persistent grid (GemvFp8Kernel's form), bulk L2 prefetch of each row group and
//   predicated (branch-free) weight loads.
// - production: matmul.cu's LaunchMatMul itself (its objects are linked in), for one token and for
//   8 and 16 tokens (a batched decode step: GemvMmaKernel, GemvFp8Kernel).
// Variants measured and dropped since (two chunks per row per step, 8-row groups, bf16 predicated
// loads in the row and mma GEMVs): bench/RESULTS.md and bench/results/session2[23]_h200.txt.
// Every shape's weights in both types stay resident, each in enough copies that no rep finds it
// in L2. Per variant and shape the figure is the median over reps of one GEMV (CUDA events), GB/s
// counting the weight bytes; then the 32 layers' four GEMVs launched back to back (each layer
// another copy), as a decode step issues them, plus the LM head. A check compares every variant
// with a host dot product of the activations it multiplies (f32, or rounded to bf16 / f16) on a
// few rows; outputs are poisoned before each variant.
// With pollute_gib > 0 each shape is also timed right after a kernel that reads touch_pages
// (default 230: 3.6 MiB, one layer's page fills at 512K) random 16 KiB pages of a pollute_gib GiB
// pinned host buffer mapped into the device, as the decode step's fill kernel does before the
// layer's o projection, or with where = device of a device buffer, as the step's attention reads
// its page pool.
// Usage: cuda_gemv_weight_bench [reps=50] [pollute_gib=0] [where=host|device] [touch_pages=230]
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cuda/internal/bench_check.h"
#include "kernels/cuda/internal/common.cuh"

namespace {

constexpr int kThreads = 256;

using strata::kernels::cuda_internal::E4m3PairToF16x2;
using strata::kernels::cuda_internal::MmaBf16;
using strata::kernels::cuda_internal::MmaF16;
using strata::kernels::cuda_internal::LoadWeightChunk;
using strata::kernels::cuda_internal::LoadWeightChunkIf;
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

// The same GEMV on tensor cores (the form of matmul.cu's GemvMmaKernel with one n8 tile of which
// one column is the token): a block of 8 warps takes 16 weight rows, its warps contiguous slices
// of their 64-column (FP8) or 32-column (bf16) steps. Per step lane (g, t) (g = lane / 4, t =
// lane % 4) loads 16 bytes of rows g and g + 8 at the step's chunk t and the mma's k order is a
// permutation of those columns, so every load is a plain 16-byte chunk; lanes g == 0 load the
// activations there (column 0 of B), the others give zeros. FP8: each 16-bit pair of e4m3
// weights becomes an f16 pair in one cvt, the activations are rounded to f16, m16n8k16 f16 mmas
// accumulate in f32 and the row's scale multiplies the sum. bf16: the activations split into hi +
// lo bf16 (two mmas, as the production kSplit GEMV) or, ROUND, rounded to bf16 (one). The warps'
// sums are added in warp order in shared memory. (MmaF16, MmaBf16 and E4m3PairToF16x2 are
// internal/common.cuh's.)
__device__ __forceinline__ uint32_t F16Pair(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t Bf16Pair(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Asks L2 for `bytes` (a multiple of 16) from `p` (16-byte aligned) with one bulk prefetch: no
// registers held, nothing waited for.
__device__ __forceinline__ void PrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// PF: each row group's 16 rows are asked of L2 by one bulk prefetch per row when the block takes
// the group (PERSIST: also the block's next group), so the group's bytes are in flight at once;
// without it the compiler issues a warp's weight loads one step (2 x 16 bytes per lane) ahead of
// their use (seen in the SASS), which leaves a small grid latency-bound.
template <bool FP8, bool ROUND, int kUnroll, int WARPS = 8, bool PERSIST = false, bool PF = false,
          bool NB = false>
__global__ void __launch_bounds__(WARPS * 32)
    GemvMma(const float* __restrict__ x, const uint4* __restrict__ w,
            const float* __restrict__ scale, float* __restrict__ out, int64_t k, int64_t m) {
  __shared__ float part[WARPS][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t chunks = k / (FP8 ? 16 : 8);
  const int64_t steps = (chunks + 3) / 4;
  const int64_t per = (steps + WARPS - 1) / WARPS;
  const int64_t s0 = warp * per;
  const int64_t s1 = s0 + per < steps ? s0 + per : steps;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  const bool xl = g == 0;
  const int64_t groups = (m + 15) / 16;
  // PERSIST: the grid fills the GPU once and each block takes row groups in turn.
  auto prefetch_group = [&](int64_t grp) {
    const int64_t r = grp * 16 + threadIdx.x;
    if (PF && threadIdx.x < 16 && grp < groups && r < m) {
      PrefetchL2(w + r * chunks, static_cast<uint32_t>(chunks * 16));
    }
  };
  if (PF) prefetch_group(blockIdx.x);
  for (int64_t grp = blockIdx.x; grp < groups; grp += PERSIST ? gridDim.x : groups) {
    if (PF && PERSIST) prefetch_group(grp + gridDim.x);
    const int64_t row0 = grp * 16;
    const bool va = row0 + g < m, vb = row0 + g + 8 < m;
    const uint4* wa = w + (va ? row0 + g : 0) * chunks;
    const uint4* wb = w + (vb ? row0 + g + 8 : 0) * chunks;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = s0; b < s1; b += kUnroll) {
      uint4 ra[kUnroll], rb[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t ch = (b + u) * 4 + t;
        const bool in_k = b + u < s1 && ch < chunks;
        if (NB) {
          ra[u] = LoadWeightChunkIf(wa + ch, va && in_k);
          rb[u] = LoadWeightChunkIf(wb + ch, vb && in_k);
        } else {
          ra[u] = va && in_k ? LoadWeightChunk(wa + ch) : make_uint4(0, 0, 0, 0);
          rb[u] = vb && in_k ? LoadWeightChunk(wb + ch) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t ch = (b + u) * 4 + t;
        const bool ld = xl && b + u < s1 && ch < chunks;
        const uint32_t wa4[4] = {ra[u].x, ra[u].y, ra[u].z, ra[u].w};
        const uint32_t wb4[4] = {rb[u].x, rb[u].y, rb[u].z, rb[u].w};
        if constexpr (FP8) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // columns 16 ch + 4 i + {0..3}
            const float4 xv = ld ? __ldg(x4 + ch * 4 + i) : make_float4(0, 0, 0, 0);
            const uint32_t a[4] = {E4m3PairToF16x2(wa4[i] & 0xffff),
                                   E4m3PairToF16x2(wb4[i] & 0xffff),
                                   E4m3PairToF16x2(wa4[i] >> 16), E4m3PairToF16x2(wb4[i] >> 16)};
            MmaF16(c, a, F16Pair(xv.x, xv.y), F16Pair(xv.z, xv.w));
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // columns 8 ch + 4 h + {0..3}
            const float4 xv = ld ? __ldg(x4 + ch * 2 + h) : make_float4(0, 0, 0, 0);
            const uint32_t a[4] = {wa4[2 * h], wb4[2 * h], wa4[2 * h + 1], wb4[2 * h + 1]};
            const __nv_bfloat162 h01 = __floats2bfloat162_rn(xv.x, xv.y),
                                 h23 = __floats2bfloat162_rn(xv.z, xv.w);
            MmaBf16(c, a, *reinterpret_cast<const uint32_t*>(&h01),
                    *reinterpret_cast<const uint32_t*>(&h23));
            if constexpr (!ROUND) {
              const float2 f01 = __bfloat1622float2(h01), f23 = __bfloat1622float2(h23);
              MmaBf16(c, a, Bf16Pair(xv.x - f01.x, xv.y - f01.y),
                      Bf16Pair(xv.z - f23.x, xv.w - f23.y));
            }
          }
        }
      }
    }
    // c[0]: row g, token 0 (lanes t == 0); c[2]: row g + 8.
    if (t == 0) {
      part[warp][g] = c[0];
      part[warp][g + 8] = c[2];
    }
    __syncthreads();
    if (threadIdx.x < 16) {
      const int64_t o = row0 + threadIdx.x;
      if (o < m) {
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) sum += part[v][threadIdx.x];
        out[o] = FP8 ? sum * scale[o] : sum;
      }
    }
    if (PERSIST) __syncthreads();  // part is reused by the next group
  }
}

// One block per page: reads the 16 KiB page pages[b] of mapped pinned host memory (16-byte loads)
// and folds it into sink[b], as a page fill reads its pages.
__global__ void TouchHostPages(const uint4* __restrict__ host, const int64_t* __restrict__ pages,
                               uint4* __restrict__ sink) {
  const uint4* page = host + pages[blockIdx.x] * 1024;
  uint32_t acc = 0;
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) {
    const uint4 v = page[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = make_uint4(acc, 0, 0, 0);  // keeps the loads
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

struct Variant {
  const char* name;
  bool fp8;
  int act;  // the activations the check multiplies: 0 f32, 1 rounded to bf16, 2 rounded to f16
  void (*launch)(const float* x, const uint4* w, const float* scale, float* out, int64_t k,
                 int64_t m, cudaStream_t stream);
};

template <bool FP8, int kUnroll>
void LaunchRows(const float* x, const uint4* w, const float* scale, float* out, int64_t k,
                int64_t m, cudaStream_t stream) {
  GemvRows<FP8, kUnroll><<<Blocks<FP8, kUnroll>(m), kThreads, 0, stream>>>(x, w, scale, out, k, m);
}

template <bool FP8, bool ROUND, int kUnroll, int WARPS = 8, bool PERSIST = false, bool PF = false,
          bool NB = false>
void LaunchMma(const float* x, const uint4* w, const float* scale, float* out, int64_t k,
               int64_t m, cudaStream_t stream) {
  auto* kernel = GemvMma<FP8, ROUND, kUnroll, WARPS, PERSIST, PF, NB>;
  int64_t blocks = (m + 15) / 16;
  if (PERSIST) {
    static const int64_t full = [&] {
      int per_sm = 0, sms = 0, device = 0;
      CUDA_BENCH_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, WARPS * 32, 0));
      CUDA_BENCH_CHECK(cudaGetDevice(&device));
      CUDA_BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      return static_cast<int64_t>(sms) * per_sm;
    }();
    blocks = std::min(blocks, full);
  }
  kernel<<<static_cast<unsigned>(blocks), WARPS * 32, 0, stream>>>(x, w, scale, out, k, m);
}

// The production path: kernels/cuda/matmul.cu's LaunchMatMul for N tokens (one token:
// GemvFp8OneKernel for fp8 weights, GemvRowsKernel of the default kSplit precision for bf16 ones;
// 2-16 tokens: GemvMmaKernel for bf16 weights, GemvFp8Kernel for fp8 ones, as a batched decode
// step's projections). The N tokens' activations are the same vector, so every token's outputs
// are token 0's.
template <bool FP8, int N = 1>
void LaunchProduction(const float* x, const uint4* w, const float* scale, float* out, int64_t k,
                      int64_t m, cudaStream_t stream) {
  namespace ci = strata::kernels::cuda_internal;
  const ci::GpuResult r = ci::LaunchMatMul(
      nullptr, x, w, FP8 ? ci::FloatType::kFP8E4M3 : ci::FloatType::kBF16, nullptr,
      ci::FloatType::kF32, out, N, k, m, nullptr, stream, /*round_activations=*/false,
      FP8 ? scale : nullptr);
  if (!r.ok()) {
    std::fprintf(stderr, "LaunchMatMul failed: %s (line %d)\n", cudaGetErrorString(r.cuda), r.line);
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int pollute_gib = argc > 2 ? std::atoi(argv[2]) : 0;
  const bool pollute_device = argc > 3 && std::strcmp(argv[3], "device") == 0;
  const int touch_pages = argc > 4 ? std::atoi(argv[4]) : 230;
  if (reps < 1 || pollute_gib < 0 || touch_pages < 1 ||
      (argc > 3 && !pollute_device && std::strcmp(argv[3], "host") != 0)) {
    std::fprintf(stderr,
                 "usage: cuda_gemv_weight_bench [reps>=1] [pollute_gib>=0] [host|device] "
                 "[touch_pages>=1]\n");
    return 2;
  }
  const Shape shapes[] = {{"q|k|v", 6144, 4096},     {"o", 4096, 4096},
                          {"gate|up", 28672, 4096},  {"down", 4096, 14336},
                          {"lm_head", 128256, 4096}};
  constexpr int kShapes = 5, kLayerShapes = 4;  // the last one is the LM head
  const Variant variants[] = {
      {"bf16 rows", false, 0, LaunchRows<false, 8>},
      {"bf16 mma round", false, 1, LaunchMma<false, true, 4>},
      {"bf16 production", false, 0, LaunchProduction<false>},
      {"fp8 rows", true, 0, LaunchRows<true, 8>},
      {"fp8 mma", true, 2, LaunchMma<true, false, 4>},
      {"fp8 mma 16w", true, 2, LaunchMma<true, false, 4, 16>},
      {"fp8 mma persist", true, 2, LaunchMma<true, false, 4, 8, true>},
      {"fp8 mma pf", true, 2, LaunchMma<true, false, 4, 8, false, true>},
      {"fp8 production", true, 2, LaunchProduction<true>},
      {"fp8 persist nb", true, 2, LaunchMma<true, false, 4, 8, true, false, true>},
      {"bf16 production n8", false, 0, LaunchProduction<false, 8>},
      {"bf16 production n16", false, 0, LaunchProduction<false, 16>},
      {"fp8 production n8", true, 2, LaunchProduction<true, 8>},
      {"fp8 production n16", true, 2, LaunchProduction<true, 16>},
  };
  constexpr int kMaxTokens = 16;  // of any variant
  constexpr int kVariants = sizeof(variants) / sizeof(variants[0]);
  std::mt19937 rng(11);
  cudaStream_t stream;
  CUDA_BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CUDA_BENCH_CHECK(cudaEventCreate(&e0));
  CUDA_BENCH_CHECK(cudaEventCreate(&e1));

  // Every shape's weights in both types, each in enough copies that a rotation through them
  // exceeds 4 x a 60 MiB L2; one activation vector and its scales.
  struct Weight {
    std::vector<uint8_t> host;
    std::vector<void*> copies;
    float* scale = nullptr;
    std::vector<float> host_scale;
  };
  Weight weights[kShapes][2];
  int64_t max_k = 0, max_m = 0;
  for (int si = 0; si < kShapes; ++si) {
    const Shape& sh = shapes[si];
    max_k = std::max(max_k, sh.k);
    max_m = std::max(max_m, sh.m);
    for (int fp8 = 0; fp8 < 2; ++fp8) {
      Weight& wt = weights[si][fp8];
      const int64_t bytes = sh.m * sh.k * (fp8 ? 1 : 2);
      const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{240} << 20) / bytes + 1));
      wt.host.resize(bytes);
      std::uniform_int_distribution<int> byte(0, 255);
      for (int64_t i = 0; i < bytes; ++i) {
        int b = byte(rng);
        if (fp8 && ((b & 0x7f) == 0x7f)) b &= 0xfe;  // no NaN codes
        if (!fp8 && (i % 2 == 1)) b = (b & 0x80) | (0x38 + (b & 7));  // bf16 in about [-2, 2]
        wt.host[i] = static_cast<uint8_t>(b);
      }
      for (int c = 0; c < copies; ++c) {
        void* d = nullptr;
        CUDA_BENCH_CHECK(cudaMalloc(&d, bytes));
        CUDA_BENCH_CHECK(cudaMemcpy(d, wt.host.data(), bytes, cudaMemcpyHostToDevice));
        wt.copies.push_back(d);
      }
      std::uniform_real_distribution<float> u(0.01f, 0.03f);
      wt.host_scale.resize(sh.m);
      for (float& v : wt.host_scale) v = u(rng);
      CUDA_BENCH_CHECK(cudaMalloc(&wt.scale, sh.m * 4));
      CUDA_BENCH_CHECK(
          cudaMemcpy(wt.scale, wt.host_scale.data(), sh.m * 4, cudaMemcpyHostToDevice));
    }
  }
  std::vector<float> x(max_k);
  std::uniform_real_distribution<float> ux(-1.0f, 1.0f);
  for (float& v : x) v = ux(rng);
  // Per shape the activations of kMaxTokens tokens ([tokens, k], each row x[0, k)); the outputs.
  float* dxs[kShapes] = {};
  for (int si = 0; si < kShapes; ++si) {
    const int64_t k = shapes[si].k;
    CUDA_BENCH_CHECK(cudaMalloc(&dxs[si], kMaxTokens * k * 4));
    for (int t = 0; t < kMaxTokens; ++t) {
      CUDA_BENCH_CHECK(cudaMemcpy(dxs[si] + t * k, x.data(), k * 4, cudaMemcpyHostToDevice));
    }
  }
  float* dout = nullptr;
  CUDA_BENCH_CHECK(cudaMalloc(&dout, kMaxTokens * max_m * 4));

  auto launch = [&](const Variant& var, int si, int copy) {
    const Weight& wt = weights[si][var.fp8 ? 1 : 0];
    var.launch(dxs[si], static_cast<const uint4*>(wt.copies[copy % wt.copies.size()]), wt.scale,
               dout, shapes[si].k, shapes[si].m, stream);
  };
  // The pollution: a pinned host (or device) buffer and, per rep, touch_pages random 16 KiB pages
  // of it.
  const uint4* host_dev = nullptr;
  int64_t* pages_dev = nullptr;
  uint4* sink = nullptr;
  constexpr int kPageSets = 64;
  if (pollute_gib > 0) {
    void* host = nullptr;
    const size_t bytes = static_cast<size_t>(pollute_gib) << 30;
    if (pollute_device) {
      CUDA_BENCH_CHECK(cudaMalloc(&host, bytes));
      CUDA_BENCH_CHECK(cudaMemset(host, 1, bytes));
      host_dev = static_cast<const uint4*>(host);
    } else {
      CUDA_BENCH_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped));
      std::memset(host, 1, bytes);
      void* dev = nullptr;
      CUDA_BENCH_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
      host_dev = static_cast<const uint4*>(dev);
    }
    std::vector<int64_t> pages(static_cast<size_t>(kPageSets) * touch_pages);
    std::uniform_int_distribution<int64_t> page(0, static_cast<int64_t>(bytes >> 14) - 1);
    for (int64_t& p : pages) p = page(rng);
    CUDA_BENCH_CHECK(cudaMalloc(&pages_dev, pages.size() * 8));
    CUDA_BENCH_CHECK(cudaMemcpy(pages_dev, pages.data(), pages.size() * 8, cudaMemcpyHostToDevice));
    CUDA_BENCH_CHECK(cudaMalloc(&sink, touch_pages * 16));
  }
  auto pollute = [&](int r) {
    TouchHostPages<<<touch_pages, 256, 0, stream>>>(
        host_dev, pages_dev + static_cast<int64_t>(r % kPageSets) * touch_pages, sink);
  };
  // Median ms over n reps of `body` (events around it only); `pre` runs before each rep's first
  // event.
  auto median_ms = [&](int n, const std::function<void(int)>& body,
                       const std::function<void(int)>& pre = nullptr) {
    std::vector<double> t;
    for (int r = 0; r < n + 3; ++r) {
      if (pre) pre(r);
      CUDA_BENCH_CHECK(cudaEventRecord(e0, stream));
      body(r);
      CUDA_BENCH_CHECK(cudaEventRecord(e1, stream));
      CUDA_BENCH_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 3) t.push_back(ms);
    }
    CUDA_BENCH_CHECK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };

  int bad = 0;
  double us[kVariants][kShapes] = {}, seq_us[kVariants] = {}, dirty_us[kVariants][kShapes] = {};
  for (int vi = 0; vi < kVariants; ++vi) {
    const Variant& var = variants[vi];
    for (int si = 0; si < kShapes; ++si) {
      const Shape& sh = shapes[si];
      CUDA_BENCH_CHECK(cudaMemset(dout, 0xff, sh.m * 4));  // poisoned: NaN
      us[vi][si] = 1000.0 * median_ms(reps, [&](int r) { launch(var, si, r); });
      if (pollute_gib > 0) {
        dirty_us[vi][si] =
            1000.0 * median_ms(reps, [&](int r) { launch(var, si, r); }, pollute);
      }
      // Check a few rows against a host dot product (f64) of the activations the kernel
      // multiplies.
      const Weight& wt = weights[si][var.fp8 ? 1 : 0];
      std::vector<float> got(sh.m);
      CUDA_BENCH_CHECK(cudaMemcpy(got.data(), dout, sh.m * 4, cudaMemcpyDeviceToHost));
      for (int64_t o : {int64_t{0}, int64_t{17}, sh.m / 2, sh.m - 1}) {
        double want = 0, mag = 0;
        for (int64_t i = 0; i < sh.k; ++i) {
          const float wv = var.fp8 ? Fp8ToFloat(wt.host[o * sh.k + i])
                                   : Bf16ToFloat(static_cast<uint16_t>(
                                         wt.host[2 * (o * sh.k + i)] |
                                         wt.host[2 * (o * sh.k + i) + 1] << 8));
          const float xv = var.act == 1   ? __bfloat162float(__float2bfloat16_rn(x[i]))
                           : var.act == 2 ? __half2float(__float2half_rn(x[i]))
                                          : x[i];
          want += static_cast<double>(wv) * xv;
          mag += std::fabs(static_cast<double>(wv) * xv);
        }
        if (var.fp8) want *= wt.host_scale[o], mag *= wt.host_scale[o];
        if (!(std::fabs(got[o] - want) <= 1e-5 * mag + 1e-6)) {
          ++bad;
          std::printf("check %s %s row %lld: %g vs %g\n", sh.name, var.name,
                      static_cast<long long>(o), got[o], want);
        }
      }
    }
    // 32 layers' GEMVs back to back (each layer's weights another copy, so cold), as a decode
    // step issues them; the median over reps of the whole sequence.
    seq_us[vi] = 1000.0 * median_ms(std::max(3, reps / 10), [&](int r) {
      for (int layer = 0; layer < 32; ++layer) {
        for (int si = 0; si < kLayerShapes; ++si) launch(var, si, r * 32 + layer);
      }
    });
  }
  std::printf("median us of one cold GEMV (GB/s of weights)\n%-20s", "variant");
  for (const Shape& sh : shapes) std::printf(" | %8s %14s", sh.name, "");
  std::printf(" | 32 layers back to back + lm_head | one at a time\n");
  for (int vi = 0; vi < kVariants; ++vi) {
    std::printf("%-20s", variants[vi].name);
    double one = 0;
    for (int si = 0; si < kShapes; ++si) {
      const Shape& sh = shapes[si];
      const double gbs = sh.m * sh.k * (variants[vi].fp8 ? 1 : 2) / (us[vi][si] * 1e3);
      std::printf(" | %9.2f us %5.0f", us[vi][si], gbs);
      one += si == kShapes - 1 ? us[vi][si] : 32 * us[vi][si];
    }
    std::printf(" | %8.0f us (%.1f per layer) | %8.0f us\n", seq_us[vi] + us[vi][kShapes - 1],
                seq_us[vi] / 32, one);
  }
  if (pollute_gib > 0) {
    std::printf("median us of one cold GEMV right after reading %d random 16 KiB pages of a %d GiB "
                "%s buffer\n%-20s",
                touch_pages, pollute_gib, pollute_device ? "device" : "pinned host", "variant");
    for (const Shape& sh : shapes) std::printf(" | %8s clean -> after", sh.name);
    std::printf("\n");
    for (int vi = 0; vi < kVariants; ++vi) {
      std::printf("%-20s", variants[vi].name);
      for (int si = 0; si < kShapes; ++si) {
        std::printf(" | %8.2f -> %8.2f", us[vi][si], dirty_us[vi][si]);
      }
      std::printf("\n");
    }
  }
  std::printf("check: %d bad rows\n", bad);
  return bad == 0 ? 0 : 1;
}
