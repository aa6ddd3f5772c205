// MatMul on the GPU: out[n, o] = sum_i in[n, i] * weight[o, i] (+ bias[o]), f32 accumulation.
//
// f32 weights: one cublasGemmEx in f32. bf16/f16 weights: for decode-sized batches
// (num_tokens <= kGemvMaxTokens) each weight row is read once: one token by GemvKernel (a block
// per row, 16-byte loads when the rows are aligned, split over the block's threads, dotted with
// the f32 activation) or, with aligned rows of a small weight, GemvRowsKernel (a warp per row on
// a grid that fills the GPU once); 2..8 tokens with aligned rows by GemvMmaKernel (16 rows per
// block on tensor cores, the activations split into hi + lo as below; GemvKernel for the others,
// every product in f32), and so are 9..16 tokens with aligned rows (two n8 tiles: the weights
// read once instead of twice by the split GEMMs); for more tokens the
// activations are split into hi + lo in the weight's type and two cuBLAS GEMMs (bf16/f16 inputs,
// f32 accumulation and output) add up W·hi + W·lo, which keeps ~16 significant bits of each
// activation instead of the 8 (bf16) or 11 (f16) of a single rounding.
//
// fp8 e4m3 weights (a scale per row, MatMulParams): 1..16 tokens by GemvFp8Kernel (tensor cores,
// one byte per weight read), more tokens by f16 cuBLAS GEMMs over blocks of rows converted to f16.
//
// MatMulPrecision::kRoundActivations (round_activations): the GEMV rounds each activation to the
// weight's type as it loads it (GemvKernel's ROUND instance); more tokens take RoundKernel (f32 ->
// the weight's type, once per activation, into scratch) and ONE cuBLAS GEMM, the single bf16 GEMM
// of inference engines (half the tensor-core work of the split and half its scratch).
#include <cublas_v2.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "kernels/cuda/internal/common.cuh"

namespace strata::kernels::cuda_internal {
namespace {

__device__ __forceinline__ float LoadAny(const void* p, FloatType t, int64_t i) {
  switch (t) {
    case FloatType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case FloatType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// x rounded to T (round to nearest even).
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}

// x rounded to T and back to f32: what kRoundActivations multiplies.
template <typename T>
__device__ __forceinline__ float RoundTo(float x) {
  const T r = FromFloat<T>(x);
  return LoadAsFloat(&r, 0);
}

// The activation as the GEMV multiplies it: as is, or rounded to T (ROUND).
template <typename T, bool ROUND>
__device__ __forceinline__ float Act(float x) {
  if constexpr (ROUND) {
    return RoundTo<T>(x);
  } else {
    return x;
  }
}

template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& raw, float (&f)[8]);
template <>
__device__ __forceinline__ void Unpack8<__nv_bfloat16>(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __bfloat1622float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}
template <>
__device__ __forceinline__ void Unpack8<__half>(const uint4& raw, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __half22float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

constexpr int kGemvMaxThreads = 256;
constexpr int kGemvUnroll = 4;

// One block per output feature (weight row). The block's threads split the row: thread j takes
// the 16-byte chunks j, j + blockDim.x, ... (VEC: 8 weights per load; k % 8 == 0, aligned) or the
// elements j, j + blockDim.x, ... (scalar), with kGemvUnroll loads in flight before any is used,
// so a long row (k = 14336: 28 KB in bf16) is read by up to 256 threads at once instead of one
// warp. Each thread keeps one f32 partial per token; the warps reduce by shuffles and thread t
// adds token t's warp sums from shared memory (fixed order, so the result does not depend on
// timing).
// blockDim.x is a multiple of 32, at most kGemvMaxThreads. MAXN: tokens the kernel is compiled
// for (n <= MAXN); the one-token decode step uses MAXN = 1, which needs fewer registers (more
// blocks resident per SM) than MAXN = kGemvMaxTokens. ROUND: each activation is rounded to T
// before the product (MatMulPrecision::kRoundActivations).
template <typename T, bool VEC, int MAXN, bool ROUND>
__global__ void __launch_bounds__(kGemvMaxThreads)
    GemvKernel(const float* __restrict__ in, const T* __restrict__ w, const void* bias,
               FloatType bias_type, float* __restrict__ out, int n, int64_t k, int64_t m,
               bool dependent) {
  __shared__ float warp_sums[MAXN][kGemvMaxThreads / 32];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int nthreads = blockDim.x;
  const int64_t o = blockIdx.x;
  const T* row = w + o * k;
  // The weights do not depend on the previous kernel: with a dependent launch (GemvPdlEnabled)
  // this block's row streams into L2 while that kernel finishes; then wait for its output (the
  // activations).
  if (dependent) {
    const char* bytes = reinterpret_cast<const char*>(row);
    const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
    for (int64_t b = static_cast<int64_t>(tid) * 128; b < row_bytes;
         b += static_cast<int64_t>(nthreads) * 128) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(bytes + b));
    }
    GridDepWait();
  }
  float acc[MAXN];
#pragma unroll
  for (int t = 0; t < MAXN; ++t) acc[t] = 0.0f;
  if (VEC) {
    const uint4* row4 = reinterpret_cast<const uint4*>(row);
    const int64_t k8 = k / 8;
    for (int64_t c0 = tid; c0 < k8; c0 += static_cast<int64_t>(nthreads) * kGemvUnroll) {
      uint4 raw[kGemvUnroll];
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u) {
        const int64_t c = c0 + static_cast<int64_t>(nthreads) * u;
        raw[u] = c < k8 ? __ldg(row4 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kGemvUnroll; ++u) {
        const int64_t c = c0 + static_cast<int64_t>(nthreads) * u;
        if (c < k8) {
          float wf[8];
          Unpack8<T>(raw[u], wf);
#pragma unroll
          for (int t = 0; t < MAXN; ++t) {
            if (t < n) {
              const float4* x4 = reinterpret_cast<const float4*>(in + t * k) + 2 * c;
              const float4 a = x4[0], b = x4[1];
              acc[t] += wf[0] * Act<T, ROUND>(a.x) + wf[1] * Act<T, ROUND>(a.y) +
                        wf[2] * Act<T, ROUND>(a.z) + wf[3] * Act<T, ROUND>(a.w) +
                        wf[4] * Act<T, ROUND>(b.x) + wf[5] * Act<T, ROUND>(b.y) +
                        wf[6] * Act<T, ROUND>(b.z) + wf[7] * Act<T, ROUND>(b.w);
            }
          }
        }
      }
    }
  } else {
    for (int64_t i = tid; i < k; i += nthreads) {
      const float wv = LoadAsFloat(row, i);
#pragma unroll
      for (int t = 0; t < MAXN; ++t) {
        if (t < n) acc[t] += wv * Act<T, ROUND>(in[t * k + i]);
      }
    }
  }
  const int nwarps = nthreads >> 5;
#pragma unroll
  for (int t = 0; t < MAXN; ++t) {
    if (t < n) {
      const float s = WarpSum(acc[t]);
      if (lane == 0) warp_sums[t][warp] = s;
    }
  }
  __syncthreads();
  if (tid < n) {
    float s = 0.0f;
    for (int j = 0; j < nwarps; ++j) s += warp_sums[tid][j];
    const float b = bias != nullptr ? LoadAny(bias, bias_type, o) : 0.0f;
    out[static_cast<int64_t>(tid) * m + o] = s + b;
  }
}

constexpr int kGemvRowThreads = 256;
constexpr int kGemvRowUnroll = 8;


// The one-token GEMV with 16-byte rows (n = 1, VEC): one warp per weight row, the rows handed
// out in turn to a grid sized to fill the GPU once (every warp resident, each taking rows
// o, o + warps, ...), each lane with kGemvRowUnroll 16-byte loads in flight. No block barrier, no
// shared memory: a warp's shuffle sum is the row's (fixed order). For the 8B step's small
// projections (4096 or 6144 rows of 8 KB) a block per row left short-lived blocks and a tail;
// here each SM streams its rows back to back. ROUND as GemvKernel.
template <typename T, bool ROUND>
__global__ void __launch_bounds__(kGemvRowThreads)
    GemvRowsKernel(const float* __restrict__ in, const T* __restrict__ w, const void* bias,
                   FloatType bias_type, float* __restrict__ out, int64_t k, int64_t m,
                   bool dependent) {
  constexpr int kWarps = kGemvRowThreads / 32;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t k8 = k / 8;
  if (dependent) {
    // As GemvKernel: the warp's first row into L2 while the previous kernel finishes.
    if (first < m) {
      const char* bytes = reinterpret_cast<const char*>(w + first * k);
      const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
      for (int64_t b = static_cast<int64_t>(lane) * 128; b < row_bytes; b += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(bytes + b));
      }
    }
    GridDepWait();
  }
  const float4* x4 = reinterpret_cast<const float4*>(in);
  for (int64_t o = first; o < m; o += warps) {
    const uint4* row4 = reinterpret_cast<const uint4*>(w + o * k);
    float acc = 0.0f;
    for (int64_t c0 = lane; c0 < k8; c0 += 32 * kGemvRowUnroll) {
      uint4 raw[kGemvRowUnroll];
#pragma unroll
      for (int u = 0; u < kGemvRowUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        raw[u] = c < k8 ? LoadWeightChunk(row4 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kGemvRowUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        if (c < k8) {
          float wf[8];
          Unpack8<T>(raw[u], wf);
          const float4 a = __ldg(x4 + 2 * c), b = __ldg(x4 + 2 * c + 1);
          acc += wf[0] * Act<T, ROUND>(a.x) + wf[1] * Act<T, ROUND>(a.y) +
                 wf[2] * Act<T, ROUND>(a.z) + wf[3] * Act<T, ROUND>(a.w) +
                 wf[4] * Act<T, ROUND>(b.x) + wf[5] * Act<T, ROUND>(b.y) +
                 wf[6] * Act<T, ROUND>(b.z) + wf[7] * Act<T, ROUND>(b.w);
        }
      }
    }
    acc = WarpSum(acc);
    if (lane == 0) out[o] = acc + (bias != nullptr ? LoadAny(bias, bias_type, o) : 0.0f);
  }
}

// ---- Several tokens on tensor cores --------------------------------------------------------

constexpr int kMmaWarps = 8;   // warps per block: k-slices of the block's 16 weight rows
constexpr int64_t kMmaMaxTokens = 16;  // two n8 tiles
constexpr int kMmaUnroll = 4;  // 32-column steps with their loads in flight per warp

// Two floats as a packed pair of T (the first in the low half).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float a, float b);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// c += A (16 x 16, row-major fragments a) * B (16 x 8, column-major fragments b), f32 accumulate.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);
template <>
__device__ __forceinline__ void Mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  MmaBf16(c, a, b0, b1);
}
template <>
__device__ __forceinline__ void Mma16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                 uint32_t b0, uint32_t b1) {
  MmaF16(c, a, b0, b1);
}

// The tensor-core GEMVs' block epilogue: c[i] holds the warp's sums for rows g (c[i][0], c[i][1])
// and g + 8 (c[i][2], c[i][3]), tokens 8i + 2t and 8i + 2t + 1; the warps' sums are added in warp
// order through shared memory `part` (the result does not depend on timing), then
// out[j, row0 + r] = sum (* scale[row], fp8 weights) + bias.
template <int TILES>
__device__ __forceinline__ void StoreMmaRows(float (&part)[kMmaWarps][16][8 * TILES],
                                             const float (&c)[TILES][4], int warp, int g, int t,
                                             int64_t row0, int n, int64_t m, const float* scale,
                                             const void* bias, FloatType bias_type, float* out) {
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    part[warp][g][8 * i + 2 * t] = c[i][0];
    part[warp][g][8 * i + 2 * t + 1] = c[i][1];
    part[warp][g + 8][8 * i + 2 * t] = c[i][2];
    part[warp][g + 8][8 * i + 2 * t + 1] = c[i][3];
  }
  __syncthreads();
  if (threadIdx.x < 16 * 8 * TILES) {
    const int r = threadIdx.x / (8 * TILES), j = threadIdx.x % (8 * TILES);
    const int64_t o = row0 + r;
    if (j < n && o < m) {
      float sum = 0.0f;
#pragma unroll
      for (int v = 0; v < kMmaWarps; ++v) sum += part[v][r][j];
      if (scale != nullptr) sum *= scale[o];
      out[static_cast<int64_t>(j) * m + o] =
          sum + (bias != nullptr ? LoadAny(bias, bias_type, o) : 0.0f);
    }
  }
}

// 2..16 tokens (n <= 8 * TILES), 16-byte rows (k % 8 == 0, aligned): the products on tensor
// cores. A block takes 16 weight rows, its warps contiguous slices of their 32-column steps. Per
// step, lane (g, t) (g = lane / 4, t = lane % 4) loads 16 bytes of rows g and g + 8 at columns
// [8t, 8t + 8) and the activations there of tokens g (and g + 8 with TILES = 2: a second n8 tile
// against the same weight fragments): the mma's k order is a permutation of the columns (A's
// fragment positions {2t, 2t+1, 2t+8, 2t+9} of each of the step's two k16 halves s hold columns
// 8t + 4s + {0..3}, and B's the same columns), so every load is a plain 16-byte chunk. The
// activations are split as the cuBLAS path splits them (hi = x in T, lo = x - hi in T: two mmas,
// ~16 bits of each activation), or rounded to T once (ROUND). The warps' 16 x 8 TILES sums are
// added in warp order in shared memory (the result does not depend on timing), bias last.
template <typename T, bool ROUND, int TILES>
__global__ void __launch_bounds__(kMmaWarps * 32)
    GemvMmaKernel(const float* __restrict__ in, const T* __restrict__ w, const void* bias,
                  FloatType bias_type, float* __restrict__ out, int n, int64_t k, int64_t m) {
  constexpr int kUnroll = kMmaUnroll / TILES;  // the same registers for loads in flight
  __shared__ float part[kMmaWarps][16][8 * TILES];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * 16;
  const bool va = row0 + g < m, vb = row0 + g + 8 < m;
  const uint4* wa = reinterpret_cast<const uint4*>(w + (va ? row0 + g : 0) * k);
  const uint4* wb = reinterpret_cast<const uint4*>(w + (vb ? row0 + g + 8 : 0) * k);
  bool vx[TILES];
  const float4* x4[TILES];
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    vx[i] = g + 8 * i < n;
    x4[i] = reinterpret_cast<const float4*>(in + (vx[i] ? g + 8 * i : 0) * k);
  }
  const int64_t k8 = k / 8;
  const int64_t steps = (k8 + 3) / 4;
  const int64_t per = (steps + kMmaWarps - 1) / kMmaWarps;
  const int64_t s0 = warp * per;
  const int64_t s1 = s0 + per < steps ? s0 + per : steps;
  float c[TILES][4];
#pragma unroll
  for (int i = 0; i < TILES; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
  for (int64_t b = s0; b < s1; b += kUnroll) {
    uint4 ra[kUnroll], rb[kUnroll];
    float4 xa[TILES][kUnroll], xb[TILES][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t ch = (b + u) * 4 + t;  // the lane's 16-byte chunk of its rows
      const bool in_k = b + u < s1 && ch < k8;
      ra[u] = va && in_k ? LoadWeightChunk(wa + ch) : make_uint4(0, 0, 0, 0);
      rb[u] = vb && in_k ? LoadWeightChunk(wb + ch) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int i = 0; i < TILES; ++i) {
        xa[i][u] = vx[i] && in_k ? __ldg(x4[i] + 2 * ch) : make_float4(0, 0, 0, 0);
        xb[i][u] = vx[i] && in_k ? __ldg(x4[i] + 2 * ch + 1) : make_float4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // the step's two k16 halves: columns 8t + 4h + {0..3}
        const uint32_t a[4] = {h == 0 ? ra[u].x : ra[u].z, h == 0 ? rb[u].x : rb[u].z,
                               h == 0 ? ra[u].y : ra[u].w, h == 0 ? rb[u].y : rb[u].w};
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
          const float4 x = h == 0 ? xa[i][u] : xb[i][u];
          const T h0 = FromFloat<T>(x.x), h1 = FromFloat<T>(x.y), h2 = FromFloat<T>(x.z),
                  h3 = FromFloat<T>(x.w);
          const float f0 = LoadAsFloat(&h0, 0), f1 = LoadAsFloat(&h1, 0),
                      f2 = LoadAsFloat(&h2, 0), f3 = LoadAsFloat(&h3, 0);
          Mma16816<T>(c[i], a, PackPair<T>(f0, f1), PackPair<T>(f2, f3));
          if (!ROUND) {
            Mma16816<T>(c[i], a, PackPair<T>(x.x - f0, x.y - f1), PackPair<T>(x.z - f2, x.w - f3));
          }
        }
      }
    }
  }
  StoreMmaRows<TILES>(part, c, warp, g, t, row0, n, m, nullptr, bias, bias_type, out);
}

// ---- fp8 e4m3 weights -----------------------------------------------------------------------

// The fp8 GEMVs' weight loads: lane t's 16-byte chunks (chunk 4 step + t) of rows g (`wa`, `ra`)
// and g + 8 (`wb`, `rb`) for the kUnroll steps from `b`, predicated (zeros past step s1, past the
// row's `chunks` or for a row past the matrix: `va`, `vb`), each load asking L2 for 128 bytes
// (LoadWeightChunkIf<128>: sessions 24 and 25 measured both fp8 GEMVs faster than with 256).
template <int kUnroll>
__device__ __forceinline__ void LoadFp8Steps(const uint4* wa, const uint4* wb, bool va, bool vb,
                                             int64_t b, int64_t s1, int64_t chunks, int t,
                                             uint4 (&ra)[kUnroll], uint4 (&rb)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t ch = (b + u) * 4 + t;
    const bool in_k = b + u < s1 && ch < chunks;
    ra[u] = LoadWeightChunkIf<128>(wa + ch, va && in_k);
    rb[u] = LoadWeightChunkIf<128>(wb + ch, vb && in_k);
  }
}

// The m16n8k16 A fragment of one 32-bit word of rows g (`wa`) and g + 8 (`wb`): their codes
// {0, 1} at positions {2t, 2t+1} and {2, 3} at {2t+8, 2t+9}, each pair one cvt to f16x2.
__device__ __forceinline__ void Fp8Fragment(uint32_t wa, uint32_t wb, uint32_t (&a)[4]) {
  a[0] = E4m3PairToF16x2(wa & 0xffffu);
  a[1] = E4m3PairToF16x2(wb & 0xffffu);
  a[2] = E4m3PairToF16x2(wa >> 16);
  a[3] = E4m3PairToF16x2(wb >> 16);
}

// 1..16 tokens (n <= 8 * TILES) with fp8 weights in 16-byte rows (k % 16 == 0, aligned; f32
// activations aligned): GemvMmaKernel's layout with 16 e4m3 weights per 16-byte chunk. A block
// takes groups of 16 weight rows in turn (two at once, below), its warps contiguous slices of their
// 64-column steps; per step lane (g, t) loads 16 bytes of rows g and g + 8 at chunk 4 * step + t,
// and each 16-bit pair of codes becomes an f16 pair in one cvt (e4m3 is exact in f16). Word i of
// the chunk (columns 16 ch + 4 i + {0..3}) feeds one m16n8k16 f16 mma: A's fragment positions {2t,
// 2t+1} hold its columns {0, 1} and {2t+8, 2t+9} its columns {2, 3} (a permutation of k, matched by
// B), B's column g is token g (+ 8 for the second tile), its activations rounded to f16
// (MatMulParams). f32 accumulation; the warps' sums are added in warp order in shared memory, then
// scaled by the row's scale and the bias added. Read at one byte per weight, the GEMV moves half
// the bytes of bf16 weights and runs on tensor cores: the scalar form (a dot per lane) was
// instruction-bound and slower than bf16 (bench/RESULTS.md, sessions 20-21). The weight loads are
// predicated, not branched (LoadWeightChunkIf) and fetch 128 bytes into L2 (LoadFp8Steps: 8 tokens'
// 32 layers back to back 112.8 -> 105.7 us per layer on the H200 against 256, 16 tokens 168.0 ->
// 163.7). A block takes two row groups at once (kPair): every lane's activation loads, the GEMV's
// L2 traffic (each group reads all n tokens' activations, 4 n bytes per weight byte), serve both
// groups' mmas. With one group per pass the 8- and 16-token GEMVs were bound by those reads, not
// the weights (about 6 TB/s from L2): 32 layers 105.5 -> 97.7 us per layer (8 tokens) and 162.8 ->
// 134.2 (16), the LM head at 16 tokens 352 -> 229 us (114 registers, two blocks per SM;
// bench/RESULTS.md, session 25). One token without a bias takes GemvFp8OneKernel instead.
template <int TILES>
__global__ void __launch_bounds__(kMmaWarps * 32)
    GemvFp8Kernel(const float* __restrict__ in, const uint8_t* __restrict__ w,
                  const float* __restrict__ scale, const void* bias, FloatType bias_type,
                  float* __restrict__ out, int n, int64_t k, int64_t m) {
  constexpr int kUnroll = 4;  // steps whose loads are in flight at once, per row group
  constexpr int kPair = 2;    // row groups at once
  __shared__ float part[kMmaWarps][16][8 * TILES];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  bool vx[TILES];
  const float4* x4[TILES];
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
    vx[i] = g + 8 * i < n;
    x4[i] = reinterpret_cast<const float4*>(in + (vx[i] ? g + 8 * i : 0) * k);
  }
  const int64_t chunks = k / 16;
  const int64_t steps = (chunks + 3) / 4;
  const int64_t per = (steps + kMmaWarps - 1) / kMmaWarps;
  const int64_t s0 = warp * per;
  const int64_t s1 = s0 + per < steps ? s0 + per : steps;
  const int64_t groups = (m + 15) / 16;
  // The grid fills the GPU once (GemvFp8Blocks); each block takes groups of 16 rows in turn, kPair
  // of them (grp and grp + gridDim.x) at once: their mmas share each activation load.
  for (int64_t grp = blockIdx.x; grp < groups; grp += kPair * gridDim.x) {
    int64_t row0[kPair];
    bool va[kPair], vb[kPair];
    const uint4* wa[kPair];
    const uint4* wb[kPair];
    float c[kPair][TILES][4];
#pragma unroll
    for (int q = 0; q < kPair; ++q) {
      row0[q] = (grp + q * static_cast<int64_t>(gridDim.x)) * 16;
      va[q] = row0[q] + g < m;
      vb[q] = row0[q] + g + 8 < m;
      wa[q] = reinterpret_cast<const uint4*>(w + (va[q] ? row0[q] + g : 0) * k);
      wb[q] = reinterpret_cast<const uint4*>(w + (vb[q] ? row0[q] + g + 8 : 0) * k);
#pragma unroll
      for (int i = 0; i < TILES; ++i) c[q][i][0] = c[q][i][1] = c[q][i][2] = c[q][i][3] = 0.0f;
    }
    for (int64_t b = s0; b < s1; b += kUnroll) {
      uint4 ra[kPair][kUnroll], rb[kPair][kUnroll];
#pragma unroll
      for (int q = 0; q < kPair; ++q) {
        LoadFp8Steps<kUnroll>(wa[q], wb[q], va[q], vb[q], b, s1, chunks, t, ra[q], rb[q]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t ch = (b + u) * 4 + t;
        const bool in_k = b + u < s1 && ch < chunks;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t x0[TILES], x1[TILES];
#pragma unroll
          for (int j = 0; j < TILES; ++j) {
            const float4 x =
                vx[j] && in_k ? __ldg(x4[j] + ch * 4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            x0[j] = PackPair<__half>(x.x, x.y);
            x1[j] = PackPair<__half>(x.z, x.w);
          }
#pragma unroll
          for (int q = 0; q < kPair; ++q) {
            const uint32_t wa4[4] = {ra[q][u].x, ra[q][u].y, ra[q][u].z, ra[q][u].w};
            const uint32_t wb4[4] = {rb[q][u].x, rb[q][u].y, rb[q][u].z, rb[q][u].w};
            uint32_t a[4];
            Fp8Fragment(wa4[i], wb4[i], a);
#pragma unroll
            for (int j = 0; j < TILES; ++j) Mma16816<__half>(c[q][j], a, x0[j], x1[j]);
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kPair; ++q) {
      if (row0[q] < m) {  // the same in the whole block
        StoreMmaRows<TILES>(part, c[q], warp, g, t, row0[q], n, m, scale, bias, bias_type, out);
        __syncthreads();  // part is written again for the next group
      }
    }
  }
}

// One token, no bias (the decode step's projections): GemvFp8Kernel's layout and arithmetic for
// token 0 only (lanes g == 0 load its activations), eight steps of predicated weight loads at once
// and a short epilogue (lanes t == 0 hold rows g and g + 8 in c[0] and c[2]). With these ptxas
// keeps the loads in flight (72 registers; with GemvFp8Kernel's epilogue, one group per pass as it
// then was, ptxas kept 48 and issued the loads one step ahead of their use): 32 layers' GEMVs back
// to back 82.6 -> 75.1 us per layer on the H200 (measured as cuda_gemv_weight_bench's variant "fp8
// persist nb u8", which became this kernel; the bench now times it as "fp8 production";
// bench/RESULTS.md, session 22). Its loads fetch 128 bytes into L2, not 256 (LoadFp8Steps: session
// 24).
__global__ void __launch_bounds__(kMmaWarps * 32)
    GemvFp8OneKernel(const float* __restrict__ in, const uint8_t* __restrict__ w8,
                     const float* __restrict__ scale, float* __restrict__ out, int64_t k,
                     int64_t m) {
  constexpr int kUnroll = 8;
  __shared__ float part[kMmaWarps][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint4* w = reinterpret_cast<const uint4*>(w8);
  const int64_t chunks = k / 16;
  const int64_t steps = (chunks + 3) / 4;
  const int64_t per = (steps + kMmaWarps - 1) / kMmaWarps;
  const int64_t s0 = warp * per;
  const int64_t s1 = s0 + per < steps ? s0 + per : steps;
  const float4* x4 = reinterpret_cast<const float4*>(in);
  const bool xl = g == 0;
  const int64_t groups = (m + 15) / 16;
  for (int64_t grp = blockIdx.x; grp < groups; grp += gridDim.x) {
    const int64_t row0 = grp * 16;
    const bool va = row0 + g < m, vb = row0 + g + 8 < m;
    const uint4* wa = w + (va ? row0 + g : 0) * chunks;
    const uint4* wb = w + (vb ? row0 + g + 8 : 0) * chunks;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = s0; b < s1; b += kUnroll) {
      uint4 ra[kUnroll], rb[kUnroll];
      LoadFp8Steps<kUnroll>(wa, wb, va, vb, b, s1, chunks, t, ra, rb);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t ch = (b + u) * 4 + t;
        const bool ld = xl && b + u < s1 && ch < chunks;
        const uint32_t wa4[4] = {ra[u].x, ra[u].y, ra[u].z, ra[u].w};
        const uint32_t wb4[4] = {rb[u].x, rb[u].y, rb[u].z, rb[u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // columns 16 ch + 4 i + {0..3}
          const float4 xv = ld ? __ldg(x4 + ch * 4 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          uint32_t a[4];
          Fp8Fragment(wa4[i], wb4[i], a);
          Mma16816<__half>(c, a, PackPair<__half>(xv.x, xv.y), PackPair<__half>(xv.z, xv.w));
        }
      }
    }
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
        for (int v = 0; v < kMmaWarps; ++v) sum += part[v][threadIdx.x];
        out[o] = sum * scale[o];
      }
    }
    __syncthreads();  // part is written again for the next group
  }
}

// Environment integer `name` (read once by the caller's static), `fallback` when unset or bad.
int64_t EnvInt(const char* name, int64_t fallback);

// Blocks of `kernel` (`threads` each, no dynamic shared memory) one SM holds at once (at least 1;
// 1 when the query fails). Callers keep it in a static: it is the kernel's, not the call's.
int BlocksPerSm(const void* kernel, int threads) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) != cudaSuccess) {
    cudaGetLastError();
    n = 1;
  }
  return n < 1 ? 1 : n;
}

// SMs of the current GPU (1 when the query fails).
int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    sms = 1;
  }
  return sms < 1 ? 1 : sms;
}

// The fp8 GEMVs' grid, `per_sm` being the launched kernel's BlocksPerSm: every block resident
// STRATA_GEMV_FP8_WAVES times (read once; default 1: SMs x resident blocks, each block taking row
// groups in turn; 0: one block per row group), fewer for few groups. Measured on the H200
// (bench/RESULTS.md, session 21): 32 layers' GEMVs back to back 86.5 -> 82.7 us per layer and the
// LM head 148 -> 134 us against a block per row group. In the 8B document step (session 23) a cap
// of 2 blocks per SM and the shared-memory carveout (0 or 100) were no faster (tried, removed).
unsigned GemvFp8Blocks(int per_sm, int64_t m) {
  static const int64_t waves = EnvInt("STRATA_GEMV_FP8_WAVES", 1);
  const int64_t groups = (m + 15) / 16;
  const int64_t full = static_cast<int64_t>(SmCount()) * per_sm * waves;
  return static_cast<unsigned>(groups < full || waves <= 0 ? groups : full);
}

// out[i] = w[i] as f16 (exact) for i in [0, n): rows of fp8 weights for a cuBLAS GEMM. VEC: 16
// codes per thread and iteration (n % 16 == 0, w and out 16-byte aligned), one cvt per pair.
template <bool VEC>
__global__ void Fp8ToF16Kernel(const uint8_t* __restrict__ w, __half* __restrict__ out,
                               int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    const uint4* w16 = reinterpret_cast<const uint4*>(w);
    uint4* o16 = reinterpret_cast<uint4*>(out);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n / 16;
         i += stride) {
      const uint4 c = w16[i];
      const uint32_t words[4] = {c.x, c.y, c.z, c.w};
      uint32_t h[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        h[2 * j] = E4m3PairToF16x2(words[j] & 0xffffu);
        h[2 * j + 1] = E4m3PairToF16x2(words[j] >> 16);
      }
      o16[2 * i] = make_uint4(h[0], h[1], h[2], h[3]);
      o16[2 * i + 1] = make_uint4(h[4], h[5], h[6], h[7]);
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += stride) {
      const __half_raw h =
          __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(w[i]), __NV_E4M3);
      out[i] = __half(h);
    }
  }
}

// out[t, o] = out[t, o] * scale[o] (+ bias[o]): the fp8 GEMM's epilogue, a token row per
// blockIdx.y (strided), no division per element. VEC: 4 outputs per thread (m % 4 == 0, out and
// scale 16-byte aligned).
template <bool VEC>
__global__ void ScaleBiasKernel(float* out, const float* __restrict__ scale, const void* bias,
                                FloatType bias_type, int64_t n, int64_t m) {
  const int64_t per = VEC ? m / 4 : m;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
    float* row = out + t * m;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per;
         i += stride) {
      if constexpr (VEC) {
        float4 v = reinterpret_cast<const float4*>(row)[i];
        const float4 sc = reinterpret_cast<const float4*>(scale)[i];
        const int64_t o = 4 * i;
        const bool b = bias != nullptr;
        v.x = v.x * sc.x + (b ? LoadAny(bias, bias_type, o) : 0.0f);
        v.y = v.y * sc.y + (b ? LoadAny(bias, bias_type, o + 1) : 0.0f);
        v.z = v.z * sc.z + (b ? LoadAny(bias, bias_type, o + 2) : 0.0f);
        v.w = v.w * sc.w + (b ? LoadAny(bias, bias_type, o + 3) : 0.0f);
        reinterpret_cast<float4*>(row)[i] = v;
      } else {
        row[i] = row[i] * scale[i] + (bias != nullptr ? LoadAny(bias, bias_type, i) : 0.0f);
      }
    }
  }
}

// Rows of fp8 weights converted to f16 per cuBLAS GEMM: at most 32 MiB of f16 scratch, a
// multiple of 128 rows where that is at least 128 (only the last block ends in a part tile).
int64_t Fp8GemmBlockRows(int64_t k, int64_t m) {
  int64_t rows = (int64_t{32} << 20) / (2 * (k > 0 ? k : 1));
  if (rows >= 128) rows -= rows % 128;
  if (rows < 16) rows = 16;
  return rows < m ? rows : m;
}

// Environment integer `name` (read once by the caller's static), `fallback` when unset or bad.
int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return *end == '\0' ? static_cast<int64_t>(x) : fallback;
}

// GemvRowsKernel serves the one-token 16-byte case for weights of at most
// STRATA_GEMV_ROWS_MAX_MIB MiB (read once; default 64: the 8B step's q|k|v and o, the 1B step's
// all but gate|up and the LM head). Measured on the H200 (bench/RESULTS.md, session 17): q|k|v
// 15.9 -> 14.8 us, o 12.1 -> 11.3 us, but gate|up 57 -> 63 us and the LM head 236 -> 257 us, so
// the larger weights keep a block per row; 0: never (A/B). Launched as a programmatic dependent
// (STRATA_GEMV_PDL=1 for both kernels) it was slower in the replayed step.
bool GemvRowsFor(int64_t weight_bytes) {
  static const int64_t max_bytes = EnvInt("STRATA_GEMV_ROWS_MAX_MIB", 64) << 20;
  return weight_bytes <= max_bytes;
}

// GemvRowsKernel's grid: every warp resident once (SMs x resident blocks), fewer for few rows.
template <typename T, bool ROUND>
unsigned GemvRowsBlocks(int64_t m) {
  static const int per_sm =
      BlocksPerSm(reinterpret_cast<const void*>(GemvRowsKernel<T, ROUND>), kGemvRowThreads);
  const int64_t warps = kGemvRowThreads / 32;
  const int64_t want = (m + warps - 1) / warps;
  const int64_t full = static_cast<int64_t>(SmCount()) * per_sm;
  return static_cast<unsigned>(want < full ? want : full);
}

// Threads per GEMV block for rows of k elements: enough that each thread has about kGemvUnroll
// loads per row (16-byte chunks when vec, else elements / 8), a multiple of 32 in [32, 256].
int GemvThreads(int64_t k, bool vec) {
  const int64_t chunks = vec ? k / 8 : (k + 7) / 8;
  int64_t t = (chunks + kGemvUnroll - 1) / kGemvUnroll;
  t = (t + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > kGemvMaxThreads) t = kGemvMaxThreads;
  return static_cast<int>(t);
}

// GEMVs are launched as programmatic dependents (GemvKernel's weight prefetch overlaps the
// previous kernel, whose RmsNorm / SwiGlu trigger their dependents at entry) only with
// STRATA_GEMV_PDL=1 in the environment (read once). Measured on the H100 (bench/RESULTS.md,
// session 7): the eager 8B step 6.83 -> 6.70 ms, but the replayed CUDA graph of the step, the
// decode path, 6.00 -> 6.14 ms, so it is off by default.
bool GemvPdlEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("STRATA_GEMV_PDL");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return enabled;
}

// Picks the GemvKernel instance for n tokens and vec (see GemvKernel).
template <typename T, bool ROUND>
cudaError_t LaunchGemv(const float* in, const T* w, const void* bias, FloatType bias_type,
                       float* out, int n, int64_t k, int64_t m, bool vec, unsigned blocks,
                       int threads, cudaStream_t stream) {
  auto* kernel = n == 1 ? (vec ? GemvKernel<T, true, 1, ROUND> : GemvKernel<T, false, 1, ROUND>)
                        : (vec ? GemvKernel<T, true, kGemvMaxTokens, ROUND>
                               : GemvKernel<T, false, kGemvMaxTokens, ROUND>);
  const bool dependent = GemvPdlEnabled();
  if (n == 1 && vec && GemvRowsFor(m * k * static_cast<int64_t>(sizeof(T)))) {
    return LaunchDependent(GemvRowsKernel<T, ROUND>, dim3(GemvRowsBlocks<T, ROUND>(m)),
                           dim3(kGemvRowThreads), 1, dependent, stream, in, w, bias, bias_type,
                           out, k, m, dependent);
  }
  return LaunchDependent(kernel, dim3(blocks), dim3(static_cast<unsigned>(threads)), 1, dependent,
                         stream, in, w, bias, bias_type, out, n, k, m, dependent);
}

template <typename T>
cudaError_t LaunchGemvPrecision(const float* in, const T* w, const void* bias,
                                FloatType bias_type, float* out, int n, int64_t k, int64_t m,
                                bool vec, unsigned blocks, int threads, bool round,
                                cudaStream_t stream) {
  if (round) {
    return LaunchGemv<T, true>(in, w, bias, bias_type, out, n, k, m, vec, blocks, threads, stream);
  }
  return LaunchGemv<T, false>(in, w, bias, bias_type, out, n, k, m, vec, blocks, threads, stream);
}

// 2..kMmaMaxTokens tokens with 16-byte rows take GemvMmaKernel unless STRATA_GEMV_MMA=0 (read
// once; A/B: then GemvKernel, every product in f32, up to kGemvMaxTokens and the split cuBLAS
// GEMMs beyond).
bool GemvMmaEnabled() {
  static const bool enabled = EnvInt("STRATA_GEMV_MMA", 1) != 0;
  return enabled;
}

template <typename T>
cudaError_t LaunchGemvMma(const float* in, const T* w, const void* bias, FloatType bias_type,
                          float* out, int n, int64_t k, int64_t m, unsigned blocks, bool round,
                          cudaStream_t stream) {
  auto* kernel = n > 8 ? (round ? GemvMmaKernel<T, true, 2> : GemvMmaKernel<T, false, 2>)
                       : (round ? GemvMmaKernel<T, true, 1> : GemvMmaKernel<T, false, 1>);
  kernel<<<blocks, kMmaWarps * 32, 0, stream>>>(in, w, bias, bias_type, out, n, k, m);
  return cudaGetLastError();
}

template <typename T>
__global__ void SplitHiLoKernel(const float* __restrict__ in, T* __restrict__ hi,
                                T* __restrict__ lo, int64_t n);
template <>
__global__ void SplitHiLoKernel<__nv_bfloat16>(const float* __restrict__ in,
                                               __nv_bfloat16* __restrict__ hi,
                                               __nv_bfloat16* __restrict__ lo, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = in[i];
    const __nv_bfloat16 h = __float2bfloat16_rn(x);
    hi[i] = h;
    lo[i] = __float2bfloat16_rn(x - __bfloat162float(h));
  }
}
template <>
__global__ void SplitHiLoKernel<__half>(const float* __restrict__ in, __half* __restrict__ hi,
                                        __half* __restrict__ lo, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = in[i];
    const __half h = __float2half_rn(x);
    hi[i] = h;
    lo[i] = __float2half_rn(x - __half2float(h));
  }
}

// out[i] = in[i] rounded to T (round to nearest even): the one-GEMM path of kRoundActivations.
// Four elements per thread and iteration when in is 16-byte aligned and n % 4 == 0 (VEC).
template <typename T, bool VEC>
__global__ void RoundKernel(const float* __restrict__ in, T* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (VEC) {
    const float4* in4 = reinterpret_cast<const float4*>(in);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n / 4;
         i += stride) {
      const float4 v = in4[i];
      out[4 * i] = FromFloat<T>(v.x);
      out[4 * i + 1] = FromFloat<T>(v.y);
      out[4 * i + 2] = FromFloat<T>(v.z);
      out[4 * i + 3] = FromFloat<T>(v.w);
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += stride) {
      out[i] = FromFloat<T>(in[i]);
    }
  }
}

// RoundKernel over n elements on `stream`: the vector instance when `in` is 16-byte aligned and
// n % 4 == 0, else the scalar one.
template <typename T>
void LaunchRound(const float* in, T* out, int64_t n, cudaStream_t stream) {
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0) {
    RoundKernel<T, true><<<GridFor(n / 4, 256), 256, 0, stream>>>(in, out, n);
  } else {
    RoundKernel<T, false><<<GridFor(n, 256), 256, 0, stream>>>(in, out, n);
  }
}

__global__ void AddBiasKernel(float* out, const void* bias, FloatType bias_type, int64_t n,
                              int64_t m) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n * m;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] += LoadAny(bias, bias_type, i % m);
  }
}

cudaDataType_t CudaType(FloatType t) {
  switch (t) {
    case FloatType::kBF16:
      return CUDA_R_16BF;
    case FloatType::kF16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

#define STRATA_GPU_RESULT_CUDA(expr)             \
  do {                                           \
    const cudaError_t e_ = (expr);               \
    if (e_ != cudaSuccess) {                     \
      GpuResult r_;                              \
      r_.cuda = e_;                              \
      r_.file = __FILE__;                        \
      r_.line = __LINE__;                        \
      return r_;                                 \
    }                                            \
  } while (0)

#define STRATA_GPU_RESULT_BLAS(expr)             \
  do {                                           \
    const cublasStatus_t e_ = (expr);            \
    if (e_ != CUBLAS_STATUS_SUCCESS) {           \
      GpuResult r_;                              \
      r_.blas = e_;                              \
      r_.file = __FILE__;                        \
      r_.line = __LINE__;                        \
      return r_;                                 \
    }                                            \
  } while (0)

// Whether LaunchMatMul takes GemvMmaKernel for these operands (bf16/f16 weights, 2..16 tokens,
// 16-byte rows of weights and activations, not switched off).
bool TakesGemvMma(FloatType weight_type, int64_t num_tokens, int64_t in_features,
                  const void* weight, const float* in) {
  const bool vec = in_features % 8 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(in) % 16 == 0;
  return (weight_type == FloatType::kBF16 || weight_type == FloatType::kF16) && vec &&
         num_tokens >= 2 && num_tokens <= kMmaMaxTokens && GemvMmaEnabled();
}

// Whether LaunchMatMul takes GemvFp8Kernel (fp8 weights, 1..16 tokens, 16-byte rows of weights
// and 16-byte aligned activations); other fp8 operands take the f16 cuBLAS path.
bool TakesGemvFp8(FloatType weight_type, int64_t num_tokens, int64_t in_features,
                  const void* weight, const float* in) {
  return weight_type == FloatType::kFP8E4M3 && num_tokens >= 1 && num_tokens <= kMmaMaxTokens &&
         in_features % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(in) % 16 == 0;
}

}  // namespace

int64_t MatMulScratchBytes(FloatType weight_type, int64_t num_tokens, int64_t in_features,
                           int64_t out_features, bool round_activations, const void* weight,
                           const float* in) {
  if (weight_type == FloatType::kFP8E4M3) {
    if (TakesGemvFp8(weight_type, num_tokens, in_features, weight, in)) return 0;
    return (num_tokens + Fp8GemmBlockRows(in_features, out_features)) * in_features * 2;
  }
  if (weight_type == FloatType::kF32 || num_tokens <= kGemvMaxTokens) return 0;
  if (TakesGemvMma(weight_type, num_tokens, in_features, weight, in)) return 0;
  return (round_activations ? 1 : 2) * num_tokens * in_features * 2;
}

GpuResult LaunchMatMul(cublasHandle_t blas, const float* in, const void* weight,
                       FloatType weight_type, const void* bias, FloatType bias_type, float* out,
                       int64_t num_tokens, int64_t in_features, int64_t out_features,
                       void* scratch, cudaStream_t stream, bool round_activations,
                       const float* weight_scale) {
  const int64_t n = num_tokens, k = in_features, m = out_features;
  if (n == 0 || m == 0) return GpuResult();
  if (n > 0x7fffffff || k > 0x7fffffff || m > 0x7fffffff) {
    STRATA_GPU_RESULT_CUDA(cudaErrorInvalidValue);
  }
  if (k == 0) {  // empty sums: out = bias (or 0); cuBLAS would scale the poisoned out by beta
    STRATA_GPU_RESULT_CUDA(cudaMemsetAsync(out, 0, n * m * sizeof(float), stream));
    if (bias != nullptr) {
      AddBiasKernel<<<GridFor(n * m, 256), 256, 0, stream>>>(out, bias, bias_type, n, m);
      STRATA_GPU_RESULT_CUDA(cudaGetLastError());
    }
    return GpuResult();
  }
  const bool vec = k % 8 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(in) % 16 == 0;
  if (weight_type == FloatType::kFP8E4M3) {
    const auto* w8 = static_cast<const uint8_t*>(weight);
    if (TakesGemvFp8(weight_type, n, k, weight, in)) {
      static const int one_per_sm =
          BlocksPerSm(reinterpret_cast<const void*>(GemvFp8OneKernel), kMmaWarps * 32);
      static const int per_sm_1 =
          BlocksPerSm(reinterpret_cast<const void*>(GemvFp8Kernel<1>), kMmaWarps * 32);
      static const int per_sm_2 =
          BlocksPerSm(reinterpret_cast<const void*>(GemvFp8Kernel<2>), kMmaWarps * 32);
      if (n == 1 && bias == nullptr) {
        GemvFp8OneKernel<<<GemvFp8Blocks(one_per_sm, m), kMmaWarps * 32, 0, stream>>>(
            in, w8, weight_scale, out, k, m);
      } else {
        auto* kernel = n > 8 ? GemvFp8Kernel<2> : GemvFp8Kernel<1>;
        kernel<<<GemvFp8Blocks(n > 8 ? per_sm_2 : per_sm_1, m), kMmaWarps * 32, 0, stream>>>(
            in, w8, weight_scale, bias, bias_type, out, static_cast<int>(n), k, m);
      }
      STRATA_GPU_RESULT_CUDA(cudaGetLastError());
      return GpuResult();
    }
    // More tokens (or unaligned rows): the activations rounded to f16 once, then blocks of rows
    // converted to f16 (exact) and one f16 GEMM each (f32 accumulation), then scale and bias.
    const int64_t elems = n * k;
    auto* x16 = static_cast<__half*>(scratch);
    __half* w16 = x16 + elems;
    LaunchRound(in, x16, elems, stream);
    STRATA_GPU_RESULT_CUDA(cudaGetLastError());
    const int64_t block = Fp8GemmBlockRows(k, m);
    const float one = 1.0f, zero = 0.0f;
    for (int64_t r0 = 0; r0 < m; r0 += block) {
      const int64_t rows = m - r0 < block ? m - r0 : block;
      const uint8_t* src = w8 + r0 * k;
      const int64_t codes = rows * k;
      if (codes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(w16) % 16 == 0) {
        Fp8ToF16Kernel<true><<<GridFor(codes / 16, 256), 256, 0, stream>>>(src, w16, codes);
      } else {
        Fp8ToF16Kernel<false><<<GridFor(codes, 256), 256, 0, stream>>>(src, w16, codes);
      }
      STRATA_GPU_RESULT_CUDA(cudaGetLastError());
      STRATA_GPU_RESULT_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows),
                                          static_cast<int>(n), static_cast<int>(k), &one, w16,
                                          CUDA_R_16F, static_cast<int>(k), x16, CUDA_R_16F,
                                          static_cast<int>(k), &zero, out + r0, CUDA_R_32F,
                                          static_cast<int>(m), CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT));
    }
    const bool vec_scale = m % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(weight_scale) % 16 == 0;
    const int64_t per_row = vec_scale ? m / 4 : m;
    const dim3 scale_grid(static_cast<unsigned>(std::min<int64_t>((per_row + 255) / 256, 1024)),
                          static_cast<unsigned>(std::min<int64_t>(n, 65535)));
    if (vec_scale) {
      ScaleBiasKernel<true><<<scale_grid, 256, 0, stream>>>(out, weight_scale, bias, bias_type, n,
                                                            m);
    } else {
      ScaleBiasKernel<false><<<scale_grid, 256, 0, stream>>>(out, weight_scale, bias, bias_type,
                                                             n, m);
    }
    STRATA_GPU_RESULT_CUDA(cudaGetLastError());
    return GpuResult();
  }
  if (TakesGemvMma(weight_type, n, k, weight, in)) {
    const unsigned blocks = static_cast<unsigned>((m + 15) / 16);
    const int nn = static_cast<int>(n);
    if (weight_type == FloatType::kBF16) {
      STRATA_GPU_RESULT_CUDA(LaunchGemvMma(in, static_cast<const __nv_bfloat16*>(weight), bias,
                                           bias_type, out, nn, k, m, blocks, round_activations,
                                           stream));
    } else {
      STRATA_GPU_RESULT_CUDA(LaunchGemvMma(in, static_cast<const __half*>(weight), bias, bias_type,
                                           out, nn, k, m, blocks, round_activations, stream));
    }
    return GpuResult();
  }
  if (weight_type != FloatType::kF32 && n <= kGemvMaxTokens) {
    const unsigned blocks = static_cast<unsigned>(m);
    const int threads = GemvThreads(k, vec);
    const int nn = static_cast<int>(n);
    if (weight_type == FloatType::kBF16) {
      STRATA_GPU_RESULT_CUDA(LaunchGemvPrecision(in, static_cast<const __nv_bfloat16*>(weight),
                                                 bias, bias_type, out, nn, k, m, vec, blocks,
                                                 threads, round_activations, stream));
    } else {
      STRATA_GPU_RESULT_CUDA(LaunchGemvPrecision(in, static_cast<const __half*>(weight), bias,
                                                 bias_type, out, nn, k, m, vec, blocks, threads,
                                                 round_activations, stream));
    }
    return GpuResult();
  }

  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t wt = CudaType(weight_type);
  if (weight_type == FloatType::kF32) {
    STRATA_GPU_RESULT_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m),
                                        static_cast<int>(n), static_cast<int>(k), &one, weight, wt,
                                        static_cast<int>(k), in, CUDA_R_32F, static_cast<int>(k),
                                        &zero, out, CUDA_R_32F, static_cast<int>(m),
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else if (round_activations) {
    const int64_t elems = n * k;
    if (weight_type == FloatType::kBF16) {
      LaunchRound(in, static_cast<__nv_bfloat16*>(scratch), elems, stream);
    } else {
      LaunchRound(in, static_cast<__half*>(scratch), elems, stream);
    }
    STRATA_GPU_RESULT_CUDA(cudaGetLastError());
    STRATA_GPU_RESULT_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m),
                                        static_cast<int>(n), static_cast<int>(k), &one, weight, wt,
                                        static_cast<int>(k), scratch, wt, static_cast<int>(k),
                                        &zero, out, CUDA_R_32F, static_cast<int>(m),
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else {
    const int64_t elems = n * k;
    char* hi = static_cast<char*>(scratch);
    char* lo = hi + elems * 2;
    if (weight_type == FloatType::kBF16) {
      SplitHiLoKernel<__nv_bfloat16><<<GridFor(elems, 256), 256, 0, stream>>>(
          in, reinterpret_cast<__nv_bfloat16*>(hi), reinterpret_cast<__nv_bfloat16*>(lo), elems);
    } else {
      SplitHiLoKernel<__half><<<GridFor(elems, 256), 256, 0, stream>>>(
          in, reinterpret_cast<__half*>(hi), reinterpret_cast<__half*>(lo), elems);
    }
    STRATA_GPU_RESULT_CUDA(cudaGetLastError());
    STRATA_GPU_RESULT_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m),
                                        static_cast<int>(n), static_cast<int>(k), &one, weight, wt,
                                        static_cast<int>(k), hi, wt, static_cast<int>(k), &zero,
                                        out, CUDA_R_32F, static_cast<int>(m), CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
    STRATA_GPU_RESULT_BLAS(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m),
                                        static_cast<int>(n), static_cast<int>(k), &one, weight, wt,
                                        static_cast<int>(k), lo, wt, static_cast<int>(k), &one,
                                        out, CUDA_R_32F, static_cast<int>(m), CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
  }
  if (bias != nullptr) {
    AddBiasKernel<<<GridFor(n * m, 256), 256, 0, stream>>>(out, bias, bias_type, n, m);
    STRATA_GPU_RESULT_CUDA(cudaGetLastError());
  }
  return GpuResult();
}

}  // namespace strata::kernels::cuda_internal
