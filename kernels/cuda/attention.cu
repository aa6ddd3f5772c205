// Paged attention and partial-result merge on the GPU (math in kernels/backend.h).
//
// Decode (one query token, head_dim 64/128/256, at most 8 query heads per KV head): split-K flash
// decoding. The host plan (CudaBackend::PagedAttention) cuts every KV head's concatenated spans
// into work items of `count` consecutive keys (about 4 items per SM over all heads).
// PagedAttentionDecodeKernel runs one 128-thread block per item, serves all query heads of the
// item's KV head (GQA: K and V are read once per item), and writes per head the item's running
// max m, sum l and unnormalised output o to scratch. PagedAttentionCombineKernel (one block per
// query head) merges the items: M = max m, L = sum l e^(m-M), out = sum e^(m-M) o / L,
// lse = M + log L.
//
// General (any token count, head_dim <= 512): PagedAttentionGeneralKernel, one block per (token,
// query head), tiles of 128 keys with an online softmax, causal mask per key position.
//
// Pools: f32, bf16 or fp8 e4m3 (kernels/backend.h "fp8 KV pools"); for fp8 the host folds k_scale
// into the score scale and the kernels multiply their outputs by v_scale. The split-K decode
// kernels (here and SelectedDecodeKernel below) share their start, tile update (one online-softmax
// step, OnlineSoftmaxRescale / SoftmaxWeight, also used by the general kernel and
// SelectedClusterKernel) and partial write.
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/selection.cuh"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kThreads = 128;  // == kDecodeTile: one key per thread in phase A
static_assert(kThreads == kDecodeTile, "decode tiles hold one key per thread");
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// Index of the span of `head`'s concatenation holding token j (last span starting at <= j).
__device__ __forceinline__ int FindSpan(const AttentionPlan& plan, int head, int j) {
  int lo = plan.span_offsets[head], hi = plan.span_offsets[head + 1] - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (plan.span_start[mid] <= j) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// 8 consecutive elements of a KV row: the raw registers of one aligned load (16 bytes of bf16,
// 8 of fp8, 32 of f32), loaded by LoadRaw8 and converted to f32 by Unpack8 (fp8: exact, via
// f16; the pool's scale is applied by the caller).
template <typename KV>
struct Vec8;
template <>
struct Vec8<__nv_bfloat16> {
  using Raw = uint4;
};
template <>
struct Vec8<__nv_fp8_e4m3> {
  using Raw = uint2;
};
template <>
struct Vec8<float> {
  struct Raw {
    float4 a, b;
  };
};

template <typename KV>
__device__ __forceinline__ typename Vec8<KV>::Raw LoadRaw8(const KV* p) {
  if constexpr (std::is_same<KV, float>::value) {
    const float4* v = reinterpret_cast<const float4*>(p);
    return {__ldg(v), __ldg(v + 1)};
  } else if constexpr (std::is_same<KV, __nv_bfloat16>::value) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    return __ldg(reinterpret_cast<const uint2*>(p));
  }
}

// Two e4m3 codes (low byte first) as f32.
__device__ __forceinline__ float2 Fp8x2ToFloat2(unsigned short v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3);
  return __half22float2(__half2(h));
}

template <typename KV>
__device__ __forceinline__ void Unpack8(const typename Vec8<KV>::Raw& raw, float (&f)[8]) {
  if constexpr (std::is_same<KV, float>::value) {
    f[0] = raw.a.x, f[1] = raw.a.y, f[2] = raw.a.z, f[3] = raw.a.w;
    f[4] = raw.b.x, f[5] = raw.b.y, f[6] = raw.b.z, f[7] = raw.b.w;
  } else if constexpr (std::is_same<KV, __nv_bfloat16>::value) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = __bfloat1622float2(h[j]);
      f[2 * j] = v.x;
      f[2 * j + 1] = v.y;
    }
  } else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(&raw);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = Fp8x2ToFloat2(h[j]);
      f[2 * j] = v.x;
      f[2 * j + 1] = v.y;
    }
  }
}

// 8 consecutive elements of a KV row as f32 (aligned).
template <typename KV>
__device__ __forceinline__ void Load8(const KV* p, float (&f)[8]) {
  Unpack8<KV>(LoadRaw8<KV>(p), f);
}

// N consecutive elements (N = 2, 4 or 8) of a KV row as f32.
template <typename KV, int N>
__device__ __forceinline__ void LoadN(const KV* p, float (&f)[N]) {
  if constexpr (N == 8) {
    Load8<KV>(p, f);
  } else if constexpr (std::is_same<KV, float>::value && N == 4) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  } else if constexpr (std::is_same<KV, float>::value && N == 2) {
    const float2 a = __ldg(reinterpret_cast<const float2*>(p));
    f[0] = a.x, f[1] = a.y;
  } else if constexpr (std::is_same<KV, __nv_bfloat16>::value && N == 4) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  } else if constexpr (std::is_same<KV, __nv_fp8_e4m3>::value && N == 4) {
    const unsigned int raw = __ldg(reinterpret_cast<const unsigned int*>(p));
    const float2 a = Fp8x2ToFloat2(raw & 0xffffu), b = Fp8x2ToFloat2(raw >> 16);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  } else if constexpr (std::is_same<KV, __nv_fp8_e4m3>::value) {  // N == 2
    const float2 a = Fp8x2ToFloat2(__ldg(reinterpret_cast<const unsigned short*>(p)));
    f[0] = a.x, f[1] = a.y;
  } else {  // bf16, N == 2
    const unsigned int raw = __ldg(reinterpret_cast<const unsigned int*>(p));
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw));
    f[0] = a.x, f[1] = a.y;
  }
}

// One step of an online softmax (every attention kernel here): a running max `old_m` meets a tile
// whose largest score is tile_max. Returns the new max and the factor by which the running sum and
// accumulator are rescaled (1 while nothing is attended, 0 on the first attended tile).
struct SoftmaxRescale {
  float m;
  float corr;
};
__device__ __forceinline__ SoftmaxRescale OnlineSoftmaxRescale(float old_m, float tile_max) {
  const float m = fmaxf(old_m, tile_max);
  const float corr = old_m == NegInf() ? (m == NegInf() ? 1.0f : 0.0f) : __expf(old_m - m);
  return {m, corr};
}
// The weight exp(s - m) of a score under running max m: 0 for a masked score (-inf) and while
// nothing is attended (m = -inf).
__device__ __forceinline__ float SoftmaxWeight(float s, float m) {
  return (m == NegInf() || s == NegInf()) ? 0.0f : __expf(s - m);
}

// Phase B of the split-K decode kernels (PagedAttentionDecodeKernel, SelectedDecodeKernel) for one
// tile of kThreads keys: per query head h < group (warps take heads round-robin), the tile's
// scores p_s[h][:] (-inf: not attended) update the running max m_s[h] and sum l_s[h] of an online
// softmax and are replaced by their weights exp(s - m); corr_s[h] receives the factor the head's
// accumulator must be rescaled by. Call between barriers.
__device__ __forceinline__ void SoftmaxTileUpdate(float (*p_s)[kThreads], float* m_s, float* l_s,
                                                  float* corr_s, int group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int h = warp; h < group; h += kWarps) {
    float v[kThreads / 32];
    float tile_m = NegInf();
#pragma unroll
    for (int r = 0; r < kThreads / 32; ++r) {
      v[r] = p_s[h][lane + 32 * r];
      tile_m = fmaxf(tile_m, v[r]);
    }
    const SoftmaxRescale step = OnlineSoftmaxRescale(m_s[h], WarpMax(tile_m));
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kThreads / 32; ++r) {
      const float p = SoftmaxWeight(v[r], step.m);
      p_s[h][lane + 32 * r] = p;
      sum += p;
    }
    sum = WarpSum(sum);
    __syncwarp();
    if (lane == 0) {
      corr_s[h] = step.corr;
      l_s[h] = l_s[h] * step.corr + sum;
      m_s[h] = step.m;
    }
  }
}

// The start of the split-K decode kernels: the queries of KV head g's group into q_s, running
// max -inf and sum 0 per head (visible after the caller's next barrier), accumulators zeroed.
template <int HEAD_DIM, int kMaxG = kDecodeMaxGroup>
__device__ __forceinline__ void StartDecodeBlock(const float* __restrict__ q, int g, int group,
                                                 float (*q_s)[HEAD_DIM], float* m_s, float* l_s,
                                                 float (&acc)[kMaxG][HEAD_DIM / 32]) {
  const int tid = threadIdx.x;
  const float* q_head = q + static_cast<int64_t>(g) * group * HEAD_DIM;
  for (int i = tid; i < group * HEAD_DIM; i += kThreads) {
    q_s[i / HEAD_DIM][i % HEAD_DIM] = q_head[i];
  }
  if (tid < group) {
    m_s[tid] = NegInf();
    l_s[tid] = 0.0f;
  }
#pragma unroll
  for (int h = 0; h < kMaxG; ++h) {
#pragma unroll
    for (int e = 0; e < HEAD_DIM / 32; ++e) acc[h][e] = 0.0f;
  }
}

// Phase C's start in the split-K decode kernels: acc[h][:] *= corr_s[h] for h < group.
template <int kDims, int kMaxG = kDecodeMaxGroup>
__device__ __forceinline__ void RescaleAccumulators(float (&acc)[kMaxG][kDims],
                                                    const float* corr_s, int group) {
#pragma unroll
  for (int h = 0; h < kMaxG; ++h) {
    if (h < group) {
      const float corr = corr_s[h];
#pragma unroll
      for (int e = 0; e < kDims; ++e) acc[h][e] *= corr;
    }
  }
}

// The end of the split-K decode kernels: sums the warps' accumulators acc[h][:] (lane l holding
// dims [l * D / 32, (l + 1) * D / 32)) through red_s and writes the block's partial for each head
// h < group to part[h * (D + 2) ...]: the unnormalised output, then the running max and sum.
// Contains a barrier: call from uniform control flow.
template <int HEAD_DIM, int kMaxG = kDecodeMaxGroup>
__device__ __forceinline__ void WriteDecodePartial(
    const float (&acc)[kMaxG][HEAD_DIM / 32],
    float (*red_s)[kMaxG][HEAD_DIM], const float* m_s, const float* l_s, int group,
    float* __restrict__ part) {
  constexpr int kDimsPerLane = HEAD_DIM / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int h = 0; h < kMaxG; ++h) {
    if (h < group) {
#pragma unroll
      for (int e = 0; e < kDimsPerLane; ++e) red_s[warp][h][lane * kDimsPerLane + e] = acc[h][e];
    }
  }
  __syncthreads();
  for (int i = tid; i < group * HEAD_DIM; i += kThreads) {
    const int h = i / HEAD_DIM, d = i % HEAD_DIM;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red_s[w][h][d];
    part[h * (HEAD_DIM + 2) + d] = sum;
  }
  if (tid < group) {
    part[tid * (HEAD_DIM + 2) + HEAD_DIM] = m_s[tid];
    part[tid * (HEAD_DIM + 2) + HEAD_DIM + 1] = l_s[tid];
  }
}

// Block-wide reductions over kThreads threads; `tmp` has kWarps floats. Every thread gets the
// result. Contains barriers: call from uniform control flow.
__device__ __forceinline__ float BlockMax(float v, float* tmp) {
  v = WarpMax(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) tmp[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = tmp[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, tmp[w]);
  return r;
}
__device__ __forceinline__ float BlockSum(float v, float* tmp) {
  v = WarpSum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) tmp[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) r += tmp[w];
  return r;
}

// One block per work item; the item's tokens are processed in tiles of kThreads keys with an
// online softmax per query head. Per tile: the block loads the metadata of the (at most kThreads)
// spans the tile can touch into shared memory, each thread binary-searches its key's span there,
// scores its key against every query head of the group (A), one warp per head updates the
// running max / sum and turns scores into weights (B), and the warps accumulate weights * V into
// per-warp registers, lanes splitting head_dim (C). The warps' accumulators are summed at the end.
template <typename KV, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads)
    PagedAttentionDecodeKernel(const float* __restrict__ q, const KV* __restrict__ k_pool,
                               const KV* __restrict__ v_pool, AttentionShape shape,
                               AttentionPlan plan, float* __restrict__ scratch) {
  constexpr int kDimsPerLane = HEAD_DIM / 32;
  __shared__ float q_s[kDecodeMaxGroup][HEAD_DIM];
  __shared__ float p_s[kDecodeMaxGroup][kThreads];
  __shared__ int64_t row_s[kThreads];
  __shared__ int64_t span_base_s[kThreads];  // slot * page_size + offset of candidate spans
  __shared__ int32_t span_start_s[kThreads];  // their first token within the head
  __shared__ float m_s[kDecodeMaxGroup], l_s[kDecodeMaxGroup], corr_s[kDecodeMaxGroup];
  __shared__ int next_span_s;
  __shared__ float red_s[kWarps][kDecodeMaxGroup][HEAD_DIM];

  const DecodeWorkItem item = plan.items[blockIdx.x];
  const int g = item.kv_head;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int span_end = plan.span_offsets[g + 1];

  float acc[kDecodeMaxGroup][kDimsPerLane];
  StartDecodeBlock<HEAD_DIM>(q, g, group, q_s, m_s, l_s, acc);

  int span_base = item.first_span;  // span holding the tile's first token (block-uniform)
  for (int tile = 0; tile < item.count; tile += kThreads) {
    const int cnt = min(kThreads, item.count - tile);
    const int tile_begin = item.begin + tile;
    // Spans span_base .. span_base + kThreads - 1 hold every key of the tile (spans are
    // non-empty, so kThreads keys touch at most kThreads spans).
    const int num_cand = min(kThreads, span_end - span_base);
    if (tid < num_cand) {
      const DeviceSpan sp = plan.spans[span_base + tid];
      span_start_s[tid] = plan.span_start[span_base + tid];
      span_base_s[tid] = static_cast<int64_t>(sp.slot) * shape.page_size + sp.offset;
    }
    __syncthreads();  // metadata (and, on the first tile, q_s / m_s / l_s) visible

    // A: one key per thread.
    float s[kDecodeMaxGroup];
#pragma unroll
    for (int h = 0; h < kDecodeMaxGroup; ++h) s[h] = 0.0f;
    if (tid < cnt) {
      const int j = tile_begin + tid;
      int lo = 0, hi = num_cand - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (span_start_s[mid] <= j) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      const int64_t row = span_base_s[lo] + (j - span_start_s[lo]);
      row_s[tid] = row;
      if (tid == cnt - 1) next_span_s = span_base + lo;
      const KV* k = k_pool + row * HEAD_DIM;
#pragma unroll 8
      for (int c = 0; c < HEAD_DIM; c += 8) {
        float kf[8];
        Load8<KV>(k + c, kf);
#pragma unroll
        for (int h = 0; h < kDecodeMaxGroup; ++h) {
          if (h < group) {
#pragma unroll
            for (int e = 0; e < 8; ++e) s[h] += q_s[h][c + e] * kf[e];
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kDecodeMaxGroup; ++h) {
      if (h < group) p_s[h][tid] = tid < cnt ? s[h] * shape.scale : NegInf();
    }
    __syncthreads();

    // B: running max and sum per head; scores become weights exp(s - m).
    SoftmaxTileUpdate(p_s, m_s, l_s, corr_s, group);
    __syncthreads();

    // C: rescale, then acc[h, :] += p[h, t] v_t; warps split the tile's keys, lanes split dims.
    RescaleAccumulators(acc, corr_s, group);
#pragma unroll 4
    for (int t = warp; t < cnt; t += kWarps) {
      float vf[kDimsPerLane];
      LoadN<KV, kDimsPerLane>(v_pool + row_s[t] * HEAD_DIM + lane * kDimsPerLane, vf);
#pragma unroll
      for (int h = 0; h < kDecodeMaxGroup; ++h) {
        if (h < group) {
          const float p = p_s[h][t];
#pragma unroll
          for (int e = 0; e < kDimsPerLane; ++e) acc[h][e] += p * vf[e];
        }
      }
    }
    span_base = next_span_s;
    __syncthreads();  // the next tile rewrites the span metadata, row_s, p_s and next_span_s
  }

  // Sum the warps' accumulators; write (o, m, l) per head.
  WriteDecodePartial<HEAD_DIM>(acc, red_s, m_s, l_s, group,
                               scratch + static_cast<int64_t>(blockIdx.x) * group * (HEAD_DIM + 2));
}

constexpr int kCombineDimsPerThread = 256 / kThreads;  // decode head_dim <= 256

// One block per query head (token 0): merges the partials of every work item of its KV head,
// items in tiles of kThreads (weights e^(m - M) staged in shared memory).
__global__ void __launch_bounds__(kThreads)
    PagedAttentionCombineKernel(AttentionShape shape, AttentionPlan plan,
                                const float* __restrict__ scratch, float* __restrict__ out,
                                float* __restrict__ lse) {
  __shared__ float w_s[kThreads];
  __shared__ float tmp_s[kWarps];
  const int head = blockIdx.x;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int g = head / group, hh = head % group;
  const int d = shape.head_dim, stride = group * (d + 2);
  const int first = plan.item_offsets[g], n = plan.item_offsets[g + 1] - first;
  const float* base = scratch + static_cast<int64_t>(first) * stride + hh * (d + 2);
  const int tid = threadIdx.x;

  float m = NegInf();
  for (int i = tid; i < n; i += kThreads) m = fmaxf(m, base[static_cast<int64_t>(i) * stride + d]);
  const float big_m = BlockMax(m, tmp_s);
  float* o = out + static_cast<int64_t>(head) * d;
  if (big_m == NegInf()) {  // nothing attended (uniform across the block)
    for (int e = tid; e < d; e += kThreads) o[e] = 0.0f;
    if (tid == 0) lse[head] = NegInf();
    return;
  }
  float l_part = 0.0f;
  float acc[kCombineDimsPerThread];
#pragma unroll
  for (int r = 0; r < kCombineDimsPerThread; ++r) acc[r] = 0.0f;
  for (int tile = 0; tile < n; tile += kThreads) {
    const int i = tile + tid;
    float w = 0.0f;
    if (i < n) {
      const float* pi = base + static_cast<int64_t>(i) * stride;
      const float mi = pi[d];
      w = mi == NegInf() ? 0.0f : __expf(mi - big_m);
      l_part += w * pi[d + 1];
    }
    w_s[tid] = w;
    __syncthreads();
    const int cnt = min(kThreads, n - tile);
#pragma unroll
    for (int r = 0; r < kCombineDimsPerThread; ++r) {
      const int e = tid + r * kThreads;
      if (e < d) {
        float a = acc[r];
        for (int j = 0; j < cnt; ++j) a += w_s[j] * base[static_cast<int64_t>(tile + j) * stride + e];
        acc[r] = a;
      }
    }
    __syncthreads();
  }
  const float big_l = BlockSum(l_part, tmp_s);
  const float inv = 1.0f / big_l;
#pragma unroll
  for (int r = 0; r < kCombineDimsPerThread; ++r) {
    const int e = tid + r * kThreads;
    if (e < d) o[e] = acc[r] * inv * shape.v_scale;
  }
  if (tid == 0) lse[head] = big_m + logf(big_l);
}

}  // namespace

// fp8 pools in the general kernel (the f32/bf16/f16 versions are in common.cuh).
template <>
__device__ __forceinline__ float LoadAsFloat<__nv_fp8_e4m3>(const __nv_fp8_e4m3* p, int64_t i) {
  return static_cast<float>(p[i]);
}

namespace {

constexpr int kGeneralDimsPerThread = kAttentionMaxHeadDim / kThreads;

template <typename KV>
__global__ void __launch_bounds__(kThreads)
    PagedAttentionGeneralKernel(const float* __restrict__ q, const KV* __restrict__ k_pool,
                                const KV* __restrict__ v_pool, AttentionShape shape,
                                AttentionPlan plan, float* __restrict__ out,
                                float* __restrict__ lse) {
  __shared__ float q_s[kAttentionMaxHeadDim];
  __shared__ float p_s[kThreads];
  __shared__ int64_t row_s[kThreads];
  __shared__ float tmp_s[kWarps];
  const int head = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
  const int d = shape.head_dim;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int g = head / group;
  const int64_t qrow = static_cast<int64_t>(t) * shape.num_q_heads + head;
  for (int i = tid; i < d; i += kThreads) q_s[i] = q[qrow * d + i];
  const int64_t qpos = shape.causal ? plan.q_positions[t] : 0;
  const int total = plan.head_tokens[g];
  __syncthreads();

  float m = NegInf(), l = 0.0f;
  float acc[kGeneralDimsPerThread];
#pragma unroll
  for (int r = 0; r < kGeneralDimsPerThread; ++r) acc[r] = 0.0f;

  for (int tile = 0; tile < total; tile += kThreads) {
    const int count = min(kThreads, total - tile);
    float s = NegInf();
    if (tid < count) {
      const int j = tile + tid;
      const int si = FindSpan(plan, g, j);
      const DeviceSpan span = plan.spans[si];
      const int in_span = j - plan.span_start[si];
      const int64_t row = static_cast<int64_t>(span.slot) * shape.page_size + span.offset + in_span;
      row_s[tid] = row;
      if (!shape.causal || static_cast<int64_t>(span.position) + in_span <= qpos) {
        const KV* k = k_pool + row * d;
        float dot = 0.0f;
        for (int i = 0; i < d; ++i) dot += q_s[i] * LoadAsFloat(k, i);
        s = dot * shape.scale;
      }
    }
    const SoftmaxRescale step = OnlineSoftmaxRescale(m, BlockMax(s, tmp_s));
    if (step.m == NegInf()) continue;  // uniform: nothing attended so far
    const float p = SoftmaxWeight(s, step.m);
    p_s[tid] = p;
    const float tile_l = BlockSum(p, tmp_s);  // its barriers also publish p_s and row_s
    const float corr = step.corr;
    const float new_m = step.m;
    l = l * corr + tile_l;
#pragma unroll
    for (int r = 0; r < kGeneralDimsPerThread; ++r) {
      const int e = tid + r * kThreads;
      if (e < d) {
        float a = acc[r] * corr;
        for (int j = 0; j < count; ++j) {
          const float pj = p_s[j];
          if (pj != 0.0f) a += pj * LoadAsFloat(v_pool + row_s[j] * d, e);
        }
        acc[r] = a;
      }
    }
    m = new_m;
    __syncthreads();  // p_s and row_s are rewritten by the next tile
  }
  float* o = out + qrow * d;
  const float inv = l > 0.0f ? shape.v_scale / l : 0.0f;
#pragma unroll
  for (int r = 0; r < kGeneralDimsPerThread; ++r) {
    const int e = tid + r * kThreads;
    if (e < d) o[e] = acc[r] * inv;
  }
  if (tid == 0) lse[qrow] = l > 0.0f ? m + logf(l) : NegInf();
}

__global__ void MergeAttentionKernel(MergeParts parts, int64_t rows, int64_t head_dim,
                                     float* __restrict__ out, float* __restrict__ lse) {
  const int64_t r = blockIdx.x;
  float m = NegInf();
  for (int s = 0; s < parts.num_parts; ++s) m = fmaxf(m, parts.lses[s][r]);
  float* o = out + r * head_dim;
  if (m == NegInf()) {
    for (int64_t e = threadIdx.x; e < head_dim; e += blockDim.x) o[e] = 0.0f;
    if (threadIdx.x == 0) lse[r] = NegInf();
    return;
  }
  float sum = 0.0f;
  for (int s = 0; s < parts.num_parts; ++s) sum += expf(parts.lses[s][r] - m);
  const float inv = 1.0f / sum;
  for (int64_t e = threadIdx.x; e < head_dim; e += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < parts.num_parts; ++s) {
      const float w = expf(parts.lses[s][r] - m);
      if (w != 0.0f) acc += w * inv * parts.outs[s][r * head_dim + e];
    }
    o[e] = acc;
  }
  // Every thread has read lses[s][r] above; lse may alias one of them only across rows' own
  // element, which this thread writes last.
  __syncthreads();
  if (threadIdx.x == 0) lse[r] = m + logf(sum);
}

template <typename KV>
cudaError_t LaunchDecodeTyped(const float* q, const void* k_pool, const void* v_pool,
                              const AttentionShape& shape, const AttentionPlan& plan,
                              float* scratch, cudaStream_t stream) {
  const auto* k = static_cast<const KV*>(k_pool);
  const auto* v = static_cast<const KV*>(v_pool);
  const unsigned items = static_cast<unsigned>(plan.num_items);
  switch (shape.head_dim) {
    case 64:
      PagedAttentionDecodeKernel<KV, 64><<<items, kThreads, 0, stream>>>(q, k, v, shape, plan, scratch);
      break;
    case 128:
      PagedAttentionDecodeKernel<KV, 128><<<items, kThreads, 0, stream>>>(q, k, v, shape, plan, scratch);
      break;
    case 256:
      PagedAttentionDecodeKernel<KV, 256><<<items, kThreads, 0, stream>>>(q, k, v, shape, plan, scratch);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

bool DecodeFastPathSupports(const AttentionShape& shape) {
  if (shape.num_tokens != 1 || shape.num_kv_heads <= 0) return false;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  return group >= 1 && group <= kDecodeMaxGroup &&
         (shape.head_dim == 64 || shape.head_dim == 128 || shape.head_dim == 256);
}

int64_t DecodeScratchFloats(const AttentionShape& shape, int num_items) {
  const int group = shape.num_q_heads / shape.num_kv_heads;
  return static_cast<int64_t>(num_items) * group * (shape.head_dim + 2);
}

cudaError_t LaunchPagedAttentionDecode(const float* q, const void* k_pool, const void* v_pool,
                                       FloatType pool_type, const AttentionShape& shape,
                                       const AttentionPlan& plan, float* scratch, float* out,
                                       float* lse, cudaStream_t stream) {
  if (!DecodeFastPathSupports(shape)) return cudaErrorInvalidValue;
  if (plan.num_items > 0) {
    cudaError_t e;
    if (pool_type == FloatType::kBF16) {
      e = LaunchDecodeTyped<__nv_bfloat16>(q, k_pool, v_pool, shape, plan, scratch, stream);
    } else if (pool_type == FloatType::kFP8E4M3) {
      e = LaunchDecodeTyped<__nv_fp8_e4m3>(q, k_pool, v_pool, shape, plan, scratch, stream);
    } else if (pool_type == FloatType::kF32) {
      e = LaunchDecodeTyped<float>(q, k_pool, v_pool, shape, plan, scratch, stream);
    } else {
      return cudaErrorInvalidValue;
    }
    if (e != cudaSuccess) return e;
  }
  PagedAttentionCombineKernel<<<shape.num_q_heads, kThreads, 0, stream>>>(shape, plan, scratch, out,
                                                                          lse);
  return cudaGetLastError();
}

cudaError_t LaunchPagedAttentionGeneral(const float* q, const void* k_pool, const void* v_pool,
                                        FloatType pool_type, const AttentionShape& shape,
                                        const AttentionPlan& plan, float* out, float* lse,
                                        cudaStream_t stream) {
  if (shape.num_tokens == 0 || shape.num_q_heads == 0) return cudaSuccess;
  if (shape.head_dim > kAttentionMaxHeadDim || shape.num_tokens > 65535) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(shape.num_q_heads, shape.num_tokens);
  if (pool_type == FloatType::kBF16) {
    PagedAttentionGeneralKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        q, static_cast<const __nv_bfloat16*>(k_pool), static_cast<const __nv_bfloat16*>(v_pool),
        shape, plan, out, lse);
  } else if (pool_type == FloatType::kFP8E4M3) {
    PagedAttentionGeneralKernel<__nv_fp8_e4m3><<<grid, kThreads, 0, stream>>>(
        q, static_cast<const __nv_fp8_e4m3*>(k_pool), static_cast<const __nv_fp8_e4m3*>(v_pool),
        shape, plan, out, lse);
  } else if (pool_type == FloatType::kF32) {
    PagedAttentionGeneralKernel<float><<<grid, kThreads, 0, stream>>>(
        q, static_cast<const float*>(k_pool), static_cast<const float*>(v_pool), shape, plan, out,
        lse);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchMergeAttention(const MergeParts& parts, int64_t rows, int64_t head_dim,
                                 float* out, float* lse, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (parts.num_parts < 1 || parts.num_parts > kMaxMergeParts || rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  const int threads = head_dim >= 128 ? 128 : 32;
  MergeAttentionKernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(parts, rows, head_dim,
                                                                            out, lse);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal

// ---- Decode attention over a device-resident selection (SelectedAttention) -------------------
// Per KV head the attended tokens are a virtual list: [0, prefix_end), the ids of the middle
// CandidateList, then [suffix_begin, suffix_begin + suffix_len). Two kernels, chosen by the list's
// length (UsesClusterKernel): short lists (the sparse decode step) run SelectedClusterKernel
// below, one thread-block cluster per KV head, one launch; long ones (the dense decode step) the
// split-K kernels here. Split-K: the list is cut into items_per_head work items of `chunk` positions (uniform, so the launch needs no host plan and
// no device-to-host copy); SelectedDecodeKernel is the split-K kernel above with each thread
// mapping its position to a pool row through the page table (invalid ids score -inf and are not
// read) and V rows loaded in batches per warp (all loads of a batch in flight), and
// SelectedCombineKernel merges the items of each query head (warps over items, batched loads).

namespace strata::kernels::cuda_internal {
namespace {

// TokenRow (kernels/cuda/internal/selection.cuh) that also gives the row's slot (for its scales).
__device__ __forceinline__ int64_t TokenRowAndSlot(const int32_t* table, int table_pages,
                                                   int64_t num_slots, int page_size, int g,
                                                   int32_t t, int32_t& slot) {
  if (t < 0) return -1;
  const int32_t page = t / page_size;
  if (page >= table_pages) return -1;
  slot = table[static_cast<int64_t>(g) * table_pages + page];
  if (slot < 0 || slot >= num_slots) return -1;
  return static_cast<int64_t>(slot) * page_size + t % page_size;
}

// SetSelectedAttentionPhaseStamps (launch.h): where the cluster kernel's blocks write their
// phase stamps, null when off.
__device__ unsigned long long* g_selected_phase_stamps = nullptr;
__device__ int g_selected_phase_blocks = 0;

// kSlotScales (fp8 pools with SelectedAttentionShape::slot_scales): each thread reads its row's slot
// pair once in A, the K scale goes into its scores, the V scale into vs_s for C (the weight of
// the row's V); without it the code is the same as before the option existed.
template <typename KV, int HEAD_DIM, bool kSlotScales, int kGroup = 0>
__global__ void __launch_bounds__(kThreads)
    SelectedDecodeKernel(const float* __restrict__ q, const KV* __restrict__ k_pool,
                         const KV* __restrict__ v_pool, const int32_t* __restrict__ table,
                         DeviceCandidates middle, SelectedAttentionShape shape,
                         const int32_t* __restrict__ prefix_len, float* __restrict__ scratch) {
  constexpr int kDimsPerLane = HEAD_DIM / 32;
  // kGroup > 0: compiled for exactly kGroup query heads per KV head (registers and buffers sized
  // to it: fewer registers, more blocks per SM); 0: any group up to the maximum.
  constexpr int kMaxG = kGroup > 0 ? kGroup : kDecodeMaxGroup;
  __shared__ float q_s[kMaxG][HEAD_DIM];
  __shared__ float p_s[kMaxG][kThreads];
  __shared__ int64_t row_s[kThreads];
  __shared__ float vs_s[kSlotScales ? kThreads : 1];  // the rows' slot V scales
  __shared__ float m_s[kMaxG], l_s[kMaxG], corr_s[kMaxG];
  __shared__ float red_s[kWarps][kMaxG][HEAD_DIM];

  const int g = blockIdx.x / shape.items_per_head;
  const int item = blockIdx.x % shape.items_per_head;
  const int group = kGroup > 0 ? kGroup : shape.num_q_heads / shape.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t begin = item * shape.chunk;
  int32_t end = min(shape.total, begin + shape.chunk);
  // Prefix positions [0, list.prefix) are attended; with prefix_len set, the rest of
  // [0, prefix_end) is skipped (and, when nothing follows the prefix, never visited).
  const SelectedList list = SelectedListOf(shape, middle, prefix_len);
  if (middle.count == 0 && shape.suffix_len == 0) end = min(end, list.prefix);

  float acc[kMaxG][kDimsPerLane];
  StartDecodeBlock<HEAD_DIM, kMaxG>(q, g, group, q_s, m_s, l_s, acc);
  __syncthreads();

  for (int32_t tile = begin; tile < end; tile += kThreads) {
    const int cnt = min(kThreads, end - tile);
    // A: one position per thread -> token -> row; scores against every head of the group.
    float s[kMaxG];
#pragma unroll
    for (int h = 0; h < kMaxG; ++h) s[h] = 0.0f;
    int64_t row = -1;
    float ks = 1.0f;  // the row's slot K scale (kSlotScales)
    if (tid < cnt) {
      const int32_t t = SelectedListToken(shape, middle, list, g, tile + tid);
      int32_t slot = 0;
      if constexpr (kSlotScales) {
        row = TokenRowAndSlot(table, shape.table_pages, shape.num_slots, shape.page_size, g, t,
                              slot);
      } else {
        row = t < 0 ? -1
                    : TokenRow(table, shape.table_pages, shape.num_slots, shape.page_size, g, t);
      }
      if (row >= 0) {
        if constexpr (kSlotScales) {
          const float* sc = shape.slot_scales + 2 * static_cast<int64_t>(slot);
          ks = __ldg(sc);
          vs_s[tid] = __ldg(sc + 1);
        }
        const KV* k = k_pool + row * HEAD_DIM;
#pragma unroll 8
        for (int c = 0; c < HEAD_DIM; c += 8) {
          float kf[8];
          Load8<KV>(k + c, kf);
#pragma unroll
          for (int h = 0; h < kMaxG; ++h) {
            if (h < group) {
#pragma unroll
              for (int e = 0; e < 8; ++e) s[h] += q_s[h][c + e] * kf[e];
            }
          }
        }
      }
    }
    row_s[tid] = row;
#pragma unroll
    for (int h = 0; h < kMaxG; ++h) {
      if (h < group) {
        float sc = s[h] * shape.scale;
        if constexpr (kSlotScales) sc *= ks;
        p_s[h][tid] = row >= 0 ? sc : NegInf();
      }
    }
    __syncthreads();

    // B: running max and sum per head; scores become weights exp(s - m).
    SoftmaxTileUpdate(p_s, m_s, l_s, corr_s, group);
    __syncthreads();

    // C: rescale, then acc[h, :] += p[h, t] v_t (kSlotScales: times the row's V scale) over the
    // tile's valid rows.
    RescaleAccumulators<kDimsPerLane, kMaxG>(acc, corr_s, group);
    // V rows in batches of kVBatch per warp, all loads of a batch in flight before the FMAs.
    constexpr int kVBatch = 64 / kDimsPerLane;
    for (int t0 = warp; t0 < cnt; t0 += kWarps * kVBatch) {
      float vf[kVBatch][kDimsPerLane];
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int t = t0 + u * kWarps;
        const int64_t r = t < cnt ? row_s[t] : -1;
        if (r >= 0) {
          LoadN<KV, kDimsPerLane>(v_pool + r * HEAD_DIM + lane * kDimsPerLane, vf[u]);
        } else {
#pragma unroll
          for (int e = 0; e < kDimsPerLane; ++e) vf[u][e] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int t = t0 + u * kWarps;
        if (t < cnt) {
          // Invalid rows: weight 0 and V zeroed; vs_s was not written for them.
          float vs = 1.0f;
          if constexpr (kSlotScales) vs = row_s[t] >= 0 ? vs_s[t] : 0.0f;
#pragma unroll
          for (int h = 0; h < kMaxG; ++h) {
            if (h < group) {
              float p = p_s[h][t];
              if constexpr (kSlotScales) p *= vs;
#pragma unroll
              for (int e = 0; e < kDimsPerLane; ++e) acc[h][e] += p * vf[u][e];
            }
          }
        }
      }
    }
    __syncthreads();  // the next tile rewrites row_s and p_s
  }

  WriteDecodePartial<HEAD_DIM, kMaxG>(acc, red_s, m_s, l_s, group,
                               scratch + static_cast<int64_t>(blockIdx.x) * group * (HEAD_DIM + 2));
}

// One block per query head: merges its KV head's items_per_head partials. The block's max M is
// found first; then warps take items round-robin (lanes split head_dim, several items' loads in
// flight per warp) and their sums meet in shared memory.
__global__ void __launch_bounds__(kThreads)
    SelectedCombineKernel(SelectedAttentionShape shape, const float* __restrict__ scratch,
                          float* __restrict__ out, float* __restrict__ lse) {
  constexpr int kMaxDimsPerLane = 256 / 32;
  __shared__ float tmp_s[kWarps];
  __shared__ float acc_s[kWarps][256];
  __shared__ float l_s[kWarps];
  const int head = blockIdx.x;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int g = head / group, hh = head % group;
  const int d = shape.head_dim, stride = group * (d + 2);
  const int n = shape.items_per_head;
  const float* base = scratch + static_cast<int64_t>(g) * n * stride + hh * (d + 2);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  float m = NegInf();
  for (int i = tid; i < n; i += kThreads) m = fmaxf(m, base[static_cast<int64_t>(i) * stride + d]);
  const float big_m = BlockMax(m, tmp_s);
  float* o = out + static_cast<int64_t>(head) * d;
  if (big_m == NegInf()) {
    for (int e = tid; e < d; e += kThreads) o[e] = 0.0f;
    if (tid == 0) lse[head] = NegInf();
    return;
  }
  const int dims = d / 32;  // d is 64, 128 or 256
  float acc[kMaxDimsPerLane];
#pragma unroll
  for (int r = 0; r < kMaxDimsPerLane; ++r) acc[r] = 0.0f;
  float l = 0.0f;
  constexpr int kBatch = 4;  // items per warp with loads in flight together
  for (int i0 = warp; i0 < n; i0 += kWarps * kBatch) {
    float mi[kBatch], li[kBatch], ov[kBatch][kMaxDimsPerLane];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + u * kWarps;
      mi[u] = NegInf();
      li[u] = 0.0f;
      if (i < n) {
        const float* pi = base + static_cast<int64_t>(i) * stride;
        mi[u] = pi[d];
        li[u] = pi[d + 1];
#pragma unroll
        for (int r = 0; r < kMaxDimsPerLane; ++r) ov[u][r] = r < dims ? pi[lane * dims + r] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (mi[u] == NegInf()) continue;
      const float w = __expf(mi[u] - big_m);
      l += w * li[u];
#pragma unroll
      for (int r = 0; r < kMaxDimsPerLane; ++r) acc[r] += w * ov[u][r];
    }
  }
#pragma unroll
  for (int r = 0; r < kMaxDimsPerLane; ++r) {
    if (r < dims) acc_s[warp][lane * dims + r] = acc[r];
  }
  if (lane == 0) l_s[warp] = l;
  __syncthreads();
  float big_l = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) big_l += l_s[w];
  const float inv = 1.0f / big_l;
  for (int e = tid; e < d; e += kThreads) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += acc_s[w][e];
    o[e] = sum * inv * shape.v_scale;
  }
  if (tid == 0) lse[head] = big_m + logf(big_l);
}

// ---- SelectedAttention, cluster path: one thread-block cluster per KV head --------------------
// SelectedClusterKernel<KV, HEAD_DIM, THREADS, kSlotScales, kGroup>: grid = num_kv_heads clusters
// of `cluster_size` (1 to 16) blocks of THREADS (kClusterThreads = 256 is launched; 512 was
// measured slower on the H100: bench/RESULTS.md "SelectedAttention on one cluster per KV head");
// block r of KV head g's cluster attends the positions [r * per, (r + 1) * per) of the head's
// list (per = ceil(n / cluster_size), n = total, or the device prefix length when nothing follows
// the prefix). The block's keys go through a ring of kClusterStages shared-memory stages of
// ClusterTile::kKeys keys: the prologue resolves the rows of the first kClusterStages tiles (one
// position per thread, parents -> page table) and issues every 16-byte piece of their K and V rows
// as cp.async copies at once (invalid rows are zero-filled, not read), so a block of the sparse
// decode step has all its bytes in flight after two dependent loads.
//   Scores: kThreadsPerKey threads per key, the query heads of the group from shared memory, K
// chunks XOR-swizzled per key so a warp's shared loads do not conflict; softmax: one warp per query
// head; weights * V: every thread accumulates 8 dims of every head over its slice of the keys.
//   When every key of the block is staged at once (at most kClusterStages tiles, as in the sparse
// decode step) and the kernel is compiled for its group (kGroup > 0), the block scores all its
// keys, takes one softmax and one weights * V pass: three barriers in all. Otherwise it walks the
// ring tile by tile with an online softmax, refilling each stage with the tile kClusterStages
// ahead.
//   The merge: every block pushes its partial per query head h (m, l, unnormalised o) into the
// receive area of block h % cluster_size with st.async (distributed shared memory, after a split
// cluster barrier begun at entry that tells every block of the cluster has started and has
// initialised its mbarrier); a block with heads to merge waits on its mbarrier for their bytes
// from every block, merges them from its own shared memory and writes out and lse. A relaxed
// cluster barrier (no memory ordering: on Hopper a release one is a GPU-scope memory barrier)
// only keeps every block until no push can be in flight. No block reads another's shared
// memory. One launch, no global scratch.
constexpr int kClusterStages = 3;
// Auto path choice: the cluster kernel up to this many positions per KV head (16 blocks of at most
// 3 tiles of 64 keys: every position of a bf16/fp8 d <= 128 call is in flight after the
// prologue), the split-K kernel beyond (many more blocks for long lists). Measured on the H100:
// the cluster kernel is faster at 64 and 2368 positions, slower at 8192 (bench/RESULTS.md).
constexpr int32_t kClusterMaxTotal = 3072;
constexpr int kClusterThreads = 256;
constexpr int kClusterRedSlots = 8;  // per-warp partial sums of o kept at once (reduction)
constexpr int kClusterMaxSize = 16;  // blocks per cluster
// Partials a block receives: ceil(group / size) heads of `size` blocks, at most 16 for group <= 8
// and size <= 16 (size >= group: size; size < group: fewer than 2 * group).
constexpr int kClusterRecvSlots = 16;
static_assert(kDecodeMaxGroup <= 8 && kClusterMaxSize <= kClusterRecvSlots);

// kMaxG: the query heads per KV head the block's registers and buffers are sized for; kOneShot:
// scores of every staged key kept at once (kClusterStages * kKeys per head).
template <typename KV, int HEAD_DIM, int THREADS, int kMaxG, bool kOneShot>
struct ClusterTile {
  static constexpr int kWarps = THREADS / 32;
  static constexpr int kRowBytes = HEAD_DIM * static_cast<int>(sizeof(KV));
  static constexpr int kKeys = 16384 / kRowBytes < 64 ? 16384 / kRowBytes : 64;  // 16 to 64
  static constexpr int kTileBytes = kKeys * kRowBytes;                           // <= 16 KiB
  static constexpr int kChunkBytes = 8 * static_cast<int>(sizeof(KV));  // 8 elements
  static constexpr int kChunks = HEAD_DIM / 8;                          // chunks per row
  // Scores: kThreadsPerKey consecutive threads per key, each kChunksPerThread chunks.
  static constexpr int kThreadsPerKey = THREADS / kKeys;
  static constexpr int kChunksPerThread = kChunks / kThreadsPerKey;
  // weights * V: thread = (chunk, slice), slice s takes keys s, s + kSlices, ...
  static constexpr int kSlices = THREADS / kChunks;
  static constexpr int kKeysPerSlice = kKeys / kSlices;
  static constexpr int kUnitsPerRow = kRowBytes / 16;  // 16-byte copies per row
  static constexpr int kUnits = kTileBytes / 16;
  static constexpr int kPKeys = kOneShot ? kClusterStages * kKeys : kKeys;  // scores per head
  static constexpr int kRecvStride = HEAD_DIM + 4;  // a pushed partial: o, m, l, 2 floats pad
  static constexpr size_t kSmemBytes =
      2 * kClusterStages * kTileBytes +                        // K and V stages
      kMaxG * HEAD_DIM * sizeof(float) +                       // q (then the block's o)
      kMaxG * kPKeys * sizeof(float) +                         // scores / weights
      kClusterStages * kKeys * sizeof(int64_t) +               // rows of the staged tiles
      3 * kMaxG * sizeof(float) +                              // m, l, corr
      kClusterRecvSlots * kRecvStride * sizeof(float);         // partials pushed here
  static_assert(kChunksPerThread >= 1 && (kChunksPerThread & (kChunksPerThread - 1)) == 0);
  static_assert(kKeysPerSlice >= 1 && kKeys % kSlices == 0);
  static_assert(kThreadsPerKey <= 32 && kChunks <= 32 && kClusterStages * kKeys <= THREADS);
  static_assert(kWarps >= kMaxG && kWarps <= 2 * kClusterRedSlots && kMaxG <= kDecodeMaxGroup);
  static_assert((3 * kMaxG) % 4 == 0);  // the receive area stays 16-byte aligned
  // The block's reduction of o over warps reuses the stages.
  static_assert(2 * kClusterStages * kTileBytes >=
                kClusterRedSlots * kMaxG * HEAD_DIM * static_cast<int>(sizeof(float)));

  // Chunk c of key t's K row sits at chunk c ^ Swizzle(t) of its stage row: the threads of a key
  // read chunks p + kThreadsPerKey * j, so consecutive keys read different j at once.
  __device__ static __forceinline__ int Swizzle(int t) {
    return kThreadsPerKey * (t & (kChunksPerThread - 1));
  }
};

// 8 consecutive elements of a KV row in shared memory (aligned), as raw registers.
template <typename KV>
__device__ __forceinline__ typename Vec8<KV>::Raw LoadShared8(const unsigned char* p) {
  if constexpr (std::is_same<KV, float>::value) {
    const float4* v = reinterpret_cast<const float4*>(p);
    return {v[0], v[1]};
  } else if constexpr (std::is_same<KV, __nv_bfloat16>::value) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    return *reinterpret_cast<const uint2*>(p);
  }
}

// kSlotScales (fp8 pools with SelectedAttentionShape::slot_scales): the slot (K, V) scale pair of
// each staged row sits in scale_s[stage] (kSlotScaleBytes more dynamic shared memory), read after
// the row's copies are issued (so the pair's load overlaps them); the K scale goes into the
// row's scores, the V scale into its weights for weights * V. Without it the code is unchanged.
// kGroup > 0: compiled for exactly kGroup query heads per KV head (the per-head registers and
// buffers sized to it, and the one-pass path); 0: any group up to kDecodeMaxGroup, from the shape.
template <typename KV, int HEAD_DIM, int THREADS, bool kSlotScales, int kGroup = 0>
__global__ void __launch_bounds__(THREADS, THREADS <= 256 ? 2 : 1)
    SelectedClusterKernel(const float* __restrict__ q, const KV* __restrict__ k_pool,
                          const KV* __restrict__ v_pool, const int32_t* __restrict__ table,
                          DeviceCandidates middle, SelectedAttentionShape shape,
                          const int32_t* __restrict__ prefix_len, int cluster_size,
                          float* __restrict__ out, float* __restrict__ lse) {
  constexpr int kMaxG = kGroup > 0 ? kGroup : kDecodeMaxGroup;
  using T = ClusterTile<KV, HEAD_DIM, THREADS, kMaxG, (kGroup > 0)>;
  constexpr int S = kClusterStages, kKeys = T::kKeys, kPKeys = T::kPKeys;
  // The mbarrier on which the partials pushed to this block complete (one use per launch). Every
  // block of the cluster has started, and initialised it, once this split barrier completes
  // (before the push; the fence releases the initialisation to the cluster).
  __shared__ __align__(8) uint64_t merge_bar;
  if (threadIdx.x == 0) {
    MbarInit(SharedAddr(&merge_bar), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  // Programmatic dependent launch (SelectedPdl): the launch and the block setup overlap the
  // previous kernel's tail; every global read below waits for its completion here (a no-op for
  // a normal launch). The next kernel may be scheduled early too.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* kbuf = smem;
  unsigned char* vbuf = kbuf + S * T::kTileBytes;
  float* q_s = reinterpret_cast<float*>(vbuf + S * T::kTileBytes);  // [group][HEAD_DIM]
  float* p_s = q_s + kMaxG * HEAD_DIM;                                // [group][kPKeys]
  int64_t* row_s = reinterpret_cast<int64_t*>(p_s + kMaxG * kPKeys);  // [S][kKeys]
  float* m_s = reinterpret_cast<float*>(row_s + S * kKeys);
  float* l_s = m_s + kMaxG;
  float* corr_s = l_s + kMaxG;
  float* recv_s = corr_s + kMaxG;  // [kClusterRecvSlots][kRecvStride]
  float2* scale_s = reinterpret_cast<float2*>(recv_s + kClusterRecvSlots * T::kRecvStride);

  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int g = blockIdx.x / cluster_size;
  const int group = kGroup > 0 ? kGroup : shape.num_q_heads / shape.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Phase stamps (profiling, SetSelectedAttentionPhaseStamps): thread 0 only, off by default;
  // the block's pointer sits in shared memory so no register holds it through the kernel.
  __shared__ unsigned long long* stamps_s;
  if (tid == 0) {
    unsigned long long* p = nullptr;
    if (static_cast<int>(blockIdx.x) < g_selected_phase_blocks) p = g_selected_phase_stamps;
    stamps_s = p == nullptr ? nullptr : p + 2 * kSelectedPhases * blockIdx.x;
  }
  auto stamp = [&](int phase) {
    if (tid == 0) {
      unsigned long long* p = stamps_s;
      if (p != nullptr) {
        p[2 * phase] = GlobalTimerNs();
        p[2 * phase + 1] = clock64();
      }
    }
  };
  stamp(0);
  const SelectedList list = SelectedListOf(shape, middle, prefix_len);
  int32_t n = shape.total;
  if (middle.count == 0 && shape.suffix_len == 0) n = min(n, list.prefix);
  const int64_t per = (static_cast<int64_t>(n) + cluster_size - 1) / cluster_size;
  const int32_t begin = static_cast<int32_t>(rank * per < n ? rank * per : n);
  const int32_t end = static_cast<int32_t>(begin + per < n ? begin + per : n);
  const int num_tiles = (end - begin + kKeys - 1) / kKeys;

  // Pool row of position v of the head's list, -1 when not attended (or beyond the block's part).
  auto row_of = [&](int32_t v) -> int64_t {
    if (v >= end) return -1;
    const int32_t t = SelectedListToken(shape, middle, list, g, v);
    return t < 0 ? -1 : TokenRow(table, shape.table_pages, shape.num_slots, shape.page_size, g, t);
  };
  // cp.async of the K and V rows listed in row_s[stage] into `stage`.
  auto issue = [&](int stage) {
    unsigned char* kd = kbuf + stage * T::kTileBytes;
    unsigned char* vd = vbuf + stage * T::kTileBytes;
    const int64_t* rows = row_s + stage * kKeys;
    const unsigned char* kp = reinterpret_cast<const unsigned char*>(k_pool);
    const unsigned char* vp = reinterpret_cast<const unsigned char*>(v_pool);
#pragma unroll 4
    for (int u = tid; u < T::kUnits; u += THREADS) {
      const int t = u / T::kUnitsPerRow, b = (u % T::kUnitsPerRow) * 16;
      const int64_t row = rows[t];
      const int64_t off = row >= 0 ? row * T::kRowBytes + b : 0;
      const int c = b / T::kChunkBytes, within = b % T::kChunkBytes;
      CpAsync16(kd + t * T::kRowBytes + (c ^ T::Swizzle(t)) * T::kChunkBytes + within, kp + off,
                row >= 0);
      CpAsync16(vd + t * T::kRowBytes + b, vp + off, row >= 0);
    }
  };

  // Prologue: q, running statistics, rows of the first S tiles, then all their copies.
  const float* q_head = q + static_cast<int64_t>(g) * group * HEAD_DIM;
  for (int i = tid; i < group * HEAD_DIM / 4; i += THREADS) {
    CpAsync16(q_s + 4 * i, q_head + 4 * i, true);
  }
  if (tid < group) {
    m_s[tid] = NegInf();
    l_s[tid] = 0.0f;
  }
  // The slot (K, V) scales of `row` into scale_s[i] (kSlotScales; (0, 0) for no row).
  auto stage_scales = [&](int i, int64_t row) {
    if constexpr (kSlotScales) {
      float2 sc = make_float2(0.0f, 0.0f);
      if (row >= 0) {
        const float* p = shape.slot_scales + 2 * (row / shape.page_size);
        sc = make_float2(__ldg(p), __ldg(p + 1));
      }
      scale_s[i] = sc;
    }
  };
  int64_t my_row = -1;
  if (tid < S * kKeys) {
    my_row = row_of(begin + tid);
    row_s[tid] = my_row;
  }
  __syncthreads();
#pragma unroll
  for (int st = 0; st < S; ++st) {
    if (st < num_tiles) issue(st);
    CpAsyncCommit();
  }
  if (tid < S * kKeys) stage_scales(tid, my_row);  // visible after the loop's first barrier
  stamp(1);

  float acc[kMaxG][8];
#pragma unroll
  for (int h = 0; h < kMaxG; ++h) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
  }
  const int qk_t = tid / T::kThreadsPerKey, qk_p = tid % T::kThreadsPerKey;
  const int pv_c = tid % T::kChunks, pv_slice = tid / T::kChunks;

  // Scores of key qk_t of stages st0 + s (s < min(NS, count)) against every head of the group
  // into p_s[h][s * pofs_step + qk_t]; each q chunk is read from shared memory once for the NS
  // stages (shared-memory bandwidth, not FMAs, bounds this step). NS: a std::integral_constant.
  auto score_stages = [&](auto ns, int st0, int count, int pofs_step) {
    constexpr int NS = decltype(ns)::value;
    float sc[NS][kMaxG];
#pragma unroll
    for (int st = 0; st < NS; ++st) {
#pragma unroll
      for (int h = 0; h < kMaxG; ++h) sc[st][h] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < T::kChunksPerThread; ++j) {
      const int c = qk_p + T::kThreadsPerKey * j;
      float kf[NS][8];
#pragma unroll
      for (int st = 0; st < NS; ++st) {
        if (st < count) {
          const unsigned char* kt = kbuf + (st0 + st) * T::kTileBytes + qk_t * T::kRowBytes;
          Unpack8<KV>(LoadShared8<KV>(kt + (c ^ T::Swizzle(qk_t)) * T::kChunkBytes), kf[st]);
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxG; ++h) {
        if (h < group) {
          const float* qc = q_s + h * HEAD_DIM + c * 8;
          const float4 qa = *reinterpret_cast<const float4*>(qc);
          const float4 qb = *reinterpret_cast<const float4*>(qc + 4);
#pragma unroll
          for (int st = 0; st < NS; ++st) {
            if (st < count) {
              sc[st][h] += qa.x * kf[st][0] + qa.y * kf[st][1] + qa.z * kf[st][2] +
                           qa.w * kf[st][3] + qb.x * kf[st][4] + qb.y * kf[st][5] +
                           qb.z * kf[st][6] + qb.w * kf[st][7];
            }
          }
        }
      }
    }
#pragma unroll
    for (int st = 0; st < NS; ++st) {
      if (st < count) {
#pragma unroll
        for (int h = 0; h < kMaxG; ++h) {
          if (h < group) {
#pragma unroll
            for (int o = T::kThreadsPerKey / 2; o > 0; o >>= 1) {
              sc[st][h] += __shfl_xor_sync(0xffffffffu, sc[st][h], o);
            }
          }
        }
        if (qk_p == 0) {
          const int row = (st0 + st) * kKeys + qk_t;
          const bool ok = row_s[row] >= 0;
          float scale = shape.scale;
          if constexpr (kSlotScales) scale *= scale_s[row].x;
#pragma unroll
          for (int h = 0; h < kMaxG; ++h) {
            if (h < group) p_s[h * kPKeys + st * pofs_step + qk_t] = ok ? sc[st][h] * scale : NegInf();
          }
        }
      }
    }
  };
  // Online softmax over p_s[h][0, count), one warp per query head: the scores become weights under
  // the new running max; corr_s[h] gets the factor for the head's accumulator.
  auto softmax = [&](int count) {
    if (warp < group) {
      constexpr int kPerLane = (kPKeys + 31) / 32;
      float v[kPerLane];
      float tile_m = NegInf();
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int idx = lane + 32 * r;
        v[r] = idx < count ? p_s[warp * kPKeys + idx] : NegInf();
        tile_m = fmaxf(tile_m, v[r]);
      }
      const SoftmaxRescale step = OnlineSoftmaxRescale(m_s[warp], WarpMax(tile_m));
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        const int idx = lane + 32 * r;
        const float w = SoftmaxWeight(v[r], step.m);
        if (idx < count) p_s[warp * kPKeys + idx] = w;
        sum += w;
      }
      sum = WarpSum(sum);
      __syncwarp();  // every lane has read m_s[warp]
      if (lane == 0) {
        corr_s[warp] = step.corr;
        l_s[warp] = l_s[warp] * step.corr + sum;
        m_s[warp] = step.m;
      }
    }
  };
  // acc[h][:] += sum over the slice's keys of stage `st` of w[h][pofs + t] * V[t, 8 dims], the V
  // chunks of up to 4 keys loaded first.
  auto pv_stage = [&](int st, int pofs) {
    const unsigned char* vt = vbuf + st * T::kTileBytes + pv_c * T::kChunkBytes;
    constexpr int kBatch = T::kKeysPerSlice < 4 ? T::kKeysPerSlice : 4;
#pragma unroll
    for (int k0 = 0; k0 < T::kKeysPerSlice; k0 += kBatch) {
      float vf[kBatch][8];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        Unpack8<KV>(LoadShared8<KV>(vt + (pv_slice + T::kSlices * (k0 + k)) * T::kRowBytes),
                    vf[k]);
      }
      float vs[kBatch];  // the keys' slot V scales (kSlotScales)
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        vs[k] = 1.0f;
        if constexpr (kSlotScales) {
          vs[k] = scale_s[st * kKeys + pv_slice + T::kSlices * (k0 + k)].y;
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxG; ++h) {
        if (h < group) {
#pragma unroll
          for (int k = 0; k < kBatch; ++k) {
            float w = p_s[h * kPKeys + pofs + pv_slice + T::kSlices * (k0 + k)];
            if constexpr (kSlotScales) w *= vs[k];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[h][e] += w * vf[k][e];
          }
        }
      }
    }
  };

  if (T::kPKeys >= S * kKeys && num_tiles <= S) {
    // One pass: every key of the block is staged; one softmax (its corr is 0 or 1 on a zero acc).
    CpAsyncWait<0>();
    __syncthreads();  // every tile (and q) visible to every thread
    stamp(2);
    score_stages(std::integral_constant<int, S>{}, 0, num_tiles, kKeys);
    __syncthreads();
    softmax(num_tiles * kKeys);
    __syncthreads();
#pragma unroll
    for (int st = 0; st < S; ++st) {
      if (st < num_tiles) pv_stage(st, st * kKeys);
    }
  } else {
    for (int i = 0; i < num_tiles; ++i) {
      const int st = i % S;
      CpAsyncWait<S - 1>();
      __syncthreads();  // tile i (and q) visible to every thread
      if (i == 0) stamp(2);
      score_stages(std::integral_constant<int, 1>{}, st, 1, 0);
      __syncthreads();
      softmax(kKeys);
      __syncthreads();
#pragma unroll
      for (int h = 0; h < kMaxG; ++h) {
        if (h < group) {
          const float corr = corr_s[h];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[h][e] *= corr;
        }
      }
      pv_stage(st, 0);
      // Refill this stage with tile i + S.
      const int next = i + S;
      int64_t next_row = -1;
      if (next < num_tiles && tid < kKeys) {
        next_row = row_of(begin + next * kKeys + tid);
        row_s[st * kKeys + tid] = next_row;
      }
      __syncthreads();  // the stage's K, V, rows, scales and the weights are no longer read
      if (next < num_tiles) issue(st);
      CpAsyncCommit();
      if (next < num_tiles && tid < kKeys) stage_scales(st * kKeys + tid, next_row);
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  stamp(3);

  // The block's o per head: the slices of a warp meet by shuffles, the warps in the stages
  // (kClusterRedSlots slots: warps beyond write first, the others add theirs).
#pragma unroll
  for (int h = 0; h < kMaxG; ++h) {
    if (h < group) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
#pragma unroll
        for (int o = T::kChunks; o < 32; o <<= 1) {
          acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], o);
        }
      }
    }
  }
  float* red = reinterpret_cast<float*>(kbuf);  // [kClusterRedSlots][group][HEAD_DIM]
  auto write_red = [&](bool add) {
    if (lane < T::kChunks) {
      const int slot = warp % kClusterRedSlots;
#pragma unroll
      for (int h = 0; h < kMaxG; ++h) {
        if (h < group) {
          float* r = red + (slot * group + h) * HEAD_DIM + lane * 8;
          float4 a = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
          float4 b = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
          if (add) {
            const float4 ra = *reinterpret_cast<const float4*>(r);
            const float4 rb = *reinterpret_cast<const float4*>(r + 4);
            a = make_float4(a.x + ra.x, a.y + ra.y, a.z + ra.z, a.w + ra.w);
            b = make_float4(b.x + rb.x, b.y + rb.y, b.z + rb.z, b.w + rb.w);
          }
          *reinterpret_cast<float4*>(r) = a;
          *reinterpret_cast<float4*>(r + 4) = b;
        }
      }
    }
  };
  if constexpr (T::kWarps > kClusterRedSlots) {
    if (warp >= kClusterRedSlots) write_red(false);
    __syncthreads();
    if (warp < kClusterRedSlots) write_red(true);
  } else {
    write_red(false);
  }
  __syncthreads();
  float* o_s = q_s;  // q is no longer read
  for (int i = tid; i < group * HEAD_DIM; i += THREADS) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kClusterRedSlots; ++w) {
      if (w < T::kWarps) sum += red[w * group * HEAD_DIM + i];
    }
    o_s[i] = sum;
  }
  __syncthreads();
  stamp(4);

  // Push: head h's partial (o, m, l) goes to slot (h / cluster_size) * cluster_size + rank of
  // block h % cluster_size's receive area, by st.async completing on that block's merge_bar (no
  // cluster barrier with memory ordering: on Hopper its release is a GPU-scope memory barrier);
  // a merging block waits on merge_bar for the bytes of its `mine` heads from every block.
  const int mine = rank < group ? (group - rank + cluster_size - 1) / cluster_size : 0;
  constexpr int kPieces = HEAD_DIM / 4;  // float4 pieces of a head's o
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every block has started
  if (tid == 0 && mine > 0 && cluster_size > 1) {
    MbarExpect(SharedAddr(&merge_bar), mine * cluster_size * (kPieces + 1) * sizeof(float4));
  }
  if (cluster_size == 1) {
    // A cluster of one block (st.async needs a cluster of at least two): plain stores.
    for (int i = tid; i < group * (kPieces + 1); i += THREADS) {
      const int h = i / (kPieces + 1), c = i % (kPieces + 1);
      const float4 v = c < kPieces ? *reinterpret_cast<const float4*>(o_s + h * HEAD_DIM + 4 * c)
                                   : make_float4(m_s[h], l_s[h], 0.0f, 0.0f);
      *reinterpret_cast<float4*>(recv_s + h * T::kRecvStride + 4 * c) = v;
    }
    __syncthreads();
  } else {
    for (int i = tid; i < group * (kPieces + 1); i += THREADS) {
      const int h = i / (kPieces + 1), c = i % (kPieces + 1);
      const int slot = (h / cluster_size) * cluster_size + rank;
      const int to = h % cluster_size;
      const float4 v = c < kPieces ? *reinterpret_cast<const float4*>(o_s + h * HEAD_DIM + 4 * c)
                                   : make_float4(m_s[h], l_s[h], 0.0f, 0.0f);
      StAsync16(MapToRank(SharedAddr(recv_s + slot * T::kRecvStride + 4 * c), to),
                make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z),
                           __float_as_uint(v.w)),
                MapToRank(SharedAddr(&merge_bar), to));
    }
    // No block leaves while pushes to another may be in flight: every block arrives at a
    // relaxed cluster barrier once nothing more can reach it (a merging block after its bytes
    // arrived) and waits for it just before leaving, by when the others have long arrived.
    if (mine == 0) {
      asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
      stamp(5);
      stamp(6);
      stamp(7);
      return;
    }
    MbarWait(SharedAddr(&merge_bar), 0);  // every partial of this block's heads received
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  }
  stamp(5);

  // Merge heads rank, rank + cluster_size, ... from the receive area: warp j < mine weighs head
  // j's partials (one lane per block: e^(m_r - M), into the partial's m slot; M, L), then thread =
  // (head, dim) sums the weighted o. The stages are free for M and L.
  float* stat_s = reinterpret_cast<float*>(kbuf);  // [mine][2]: M, L
  if (warp < mine) {
    float* part = recv_s + warp * cluster_size * T::kRecvStride;
    const float mr = lane < cluster_size ? part[lane * T::kRecvStride + HEAD_DIM] : NegInf();
    const float lr = lane < cluster_size ? part[lane * T::kRecvStride + HEAD_DIM + 1] : 0.0f;
    const float big_m = WarpMax(mr);
    const float w = mr == NegInf() ? 0.0f : __expf(mr - big_m);
    const float big_l = WarpSum(w * lr);
    if (lane < cluster_size) part[lane * T::kRecvStride + HEAD_DIM] = w;
    if (lane == 0) {
      stat_s[2 * warp] = big_m;
      stat_s[2 * warp + 1] = big_l;
    }
  }
  __syncthreads();
  for (int i = tid; i < mine * HEAD_DIM; i += THREADS) {
    const int j = i / HEAD_DIM, d = i % HEAD_DIM;
    const float* part = recv_s + j * cluster_size * T::kRecvStride;
    float sum = 0.0f;
    for (int r = 0; r < cluster_size; ++r) {
      const float w = part[r * T::kRecvStride + HEAD_DIM];
      if (w != 0.0f) sum += w * part[r * T::kRecvStride + d];
    }
    const float big_m = stat_s[2 * j], big_l = stat_s[2 * j + 1];
    const int head = g * group + rank + j * cluster_size;
    out[static_cast<int64_t>(head) * HEAD_DIM + d] =
        big_m == NegInf() ? 0.0f : sum * (1.0f / big_l) * shape.v_scale;
    if (d == 0) lse[head] = big_m == NegInf() ? NegInf() : big_m + logf(big_l);
  }
  stamp(6);
  if (cluster_size > 1) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
  stamp(7);
}

// Which kernel runs a call: STRATA_SELECTED_ATTENTION=split|cluster|cluster8|cluster16 (read
// once) forces one (cluster8/16 also the cluster size); otherwise the cluster kernel up to
// kClusterMaxTotal positions per KV head.
enum class SelectedPath { kAuto, kSplit, kCluster, kCluster8, kCluster16 };
SelectedPath ForcedSelectedPath() {
  static const SelectedPath path = [] {
    const char* v = std::getenv("STRATA_SELECTED_ATTENTION");
    const std::string_view s = v == nullptr ? "" : v;
    return s == "split"       ? SelectedPath::kSplit
           : s == "cluster"   ? SelectedPath::kCluster
           : s == "cluster8"  ? SelectedPath::kCluster8
           : s == "cluster16" ? SelectedPath::kCluster16
                              : SelectedPath::kAuto;
  }();
  return path;
}
// The cluster kernel is launched with programmatic stream serialization when
// STRATA_SELECTED_PDL=1 (read once; off by default until measured in the pipelines).
bool SelectedPdl() {
  static const bool on = [] {
    const char* v = std::getenv("STRATA_SELECTED_PDL");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return on;
}
// The cluster and split-K kernels compiled for group 4 (head_dim 64 and 128) run those calls
// unless STRATA_SELECTED_GROUP_KERNELS=0 (read once; for A/B timing).
bool GroupClusterKernels() {
  static const bool on = [] {
    const char* v = std::getenv("STRATA_SELECTED_GROUP_KERNELS");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on;
}
bool UsesClusterKernel(const SelectedAttentionShape& shape) {
  const SelectedPath p = ForcedSelectedPath();
  if (p == SelectedPath::kSplit) return false;
  if (p != SelectedPath::kAuto) return true;
  return shape.total <= kClusterMaxTotal;
}

constexpr int kMaxDevices = 64;

template <typename KV, int HEAD_DIM, int THREADS, bool kSlotScales, int kGroup = 0>
cudaError_t LaunchClusterTyped(const float* q, const void* k_pool, const void* v_pool,
                               const int32_t* table, const DeviceCandidates& middle,
                               const SelectedAttentionShape& shape, const int32_t* prefix_len,
                               float* out, float* lse, cudaStream_t stream) {
  using T =
      ClusterTile<KV, HEAD_DIM, THREADS, (kGroup > 0 ? kGroup : kDecodeMaxGroup), (kGroup > 0)>;
  auto* kernel = SelectedClusterKernel<KV, HEAD_DIM, THREADS, kSlotScales, kGroup>;
  // The slot scale pairs of the staged rows (kSlotScales) follow T's layout.
  constexpr size_t kSmemBytes =
      T::kSmemBytes + (kSlotScales ? kClusterStages * T::kKeys * sizeof(float2) : 0);
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  // Per device, once: the shared-memory and cluster-size attributes, and how many 16-block
  // clusters fit at once (0: use 8-block clusters). Racing first calls set the same values.
  static std::atomic<int> max_clusters16[kMaxDevices];  // 0: unknown, else count + 1
  if (max_clusters16[device].load(std::memory_order_acquire) == 0) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kSmemBytes));
    if (e != cudaSuccess) return e;
    const int count = MaxActiveClusters(kernel, 16, THREADS, kSmemBytes);
    max_clusters16[device].store(count + 1, std::memory_order_release);
  }
  const int fit16 = max_clusters16[device].load(std::memory_order_acquire) - 1;
  // Blocks per KV head: about one tile of keys per block, at most 16 (8 unless 16-block clusters
  // of every KV head fit on the device at once).
  const SelectedPath forced = ForcedSelectedPath();
  int max_size = fit16 >= shape.num_kv_heads ? 16 : 8;
  if (forced == SelectedPath::kCluster8) max_size = 8;
  if (forced == SelectedPath::kCluster16 && fit16 > 0) max_size = 16;
  const int64_t want = (static_cast<int64_t>(shape.total) + T::kKeys - 1) / T::kKeys;
  const int size = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_size, want)));

  // The cluster dimension is set for size 1 too (the kernel reads its rank in the cluster).
  const ClusterLaunchConfig launch(dim3(static_cast<unsigned>(shape.num_kv_heads) * size),
                                   dim3(THREADS), kSmemBytes, stream, size, SelectedPdl());
  return cudaLaunchKernelEx(&launch.cfg, kernel, q, static_cast<const KV*>(k_pool),
                            static_cast<const KV*>(v_pool), table, middle, shape, prefix_len, size,
                            out, lse);
}

template <typename KV, int THREADS, bool kSlotScales>
cudaError_t LaunchClusterDims(const float* q, const void* k_pool, const void* v_pool,
                              const int32_t* table, const DeviceCandidates& middle,
                              const SelectedAttentionShape& shape, const int32_t* prefix_len,
                              float* out, float* lse, cudaStream_t stream) {
  switch (shape.head_dim) {
    case 64:
      // Group 4 (Llama-3.2 1B and 3B, Llama-3.1 8B, Mistral 7B): builds of their own.
      if (shape.num_q_heads == 4 * shape.num_kv_heads && GroupClusterKernels()) {
        return LaunchClusterTyped<KV, 64, THREADS, kSlotScales, 4>(
            q, k_pool, v_pool, table, middle, shape, prefix_len, out, lse, stream);
      }
      return LaunchClusterTyped<KV, 64, THREADS, kSlotScales>(q, k_pool, v_pool, table, middle, shape,
                                                 prefix_len, out, lse, stream);
    case 128:
      if (shape.num_q_heads == 4 * shape.num_kv_heads && GroupClusterKernels()) {
        return LaunchClusterTyped<KV, 128, THREADS, kSlotScales, 4>(
            q, k_pool, v_pool, table, middle, shape, prefix_len, out, lse, stream);
      }
      return LaunchClusterTyped<KV, 128, THREADS, kSlotScales>(q, k_pool, v_pool, table, middle, shape,
                                                  prefix_len, out, lse, stream);
    case 256:
      return LaunchClusterTyped<KV, 256, THREADS, kSlotScales>(q, k_pool, v_pool, table, middle, shape,
                                                  prefix_len, out, lse, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename KV, bool kSlotScales = false>
cudaError_t LaunchCluster(const float* q, const void* k_pool, const void* v_pool,
                          const int32_t* table, const DeviceCandidates& middle,
                          const SelectedAttentionShape& shape, const int32_t* prefix_len,
                          float* out, float* lse, cudaStream_t stream) {
  return LaunchClusterDims<KV, kClusterThreads, kSlotScales>(q, k_pool, v_pool, table, middle, shape,
                                                prefix_len, out, lse, stream);
}

// SelectedDecodeKernel for HEAD_DIM: the group-4 build for group4 (built for head_dim 64 and 128
// only), else the generic one.
template <typename KV, int HEAD_DIM, bool kSlotScales>
void LaunchDecodeBuild(bool group4, unsigned blocks, const float* q, const KV* k, const KV* v,
                       const int32_t* table, const DeviceCandidates& middle,
                       const SelectedAttentionShape& shape, const int32_t* prefix_len,
                       float* scratch, cudaStream_t stream) {
  if constexpr (HEAD_DIM <= 128) {
    if (group4) {
      SelectedDecodeKernel<KV, HEAD_DIM, kSlotScales, 4><<<blocks, kThreads, 0, stream>>>(
          q, k, v, table, middle, shape, prefix_len, scratch);
      return;
    }
  }
  SelectedDecodeKernel<KV, HEAD_DIM, kSlotScales><<<blocks, kThreads, 0, stream>>>(
      q, k, v, table, middle, shape, prefix_len, scratch);
}

template <typename KV, bool kSlotScales = false>
cudaError_t LaunchSelectedTyped(const float* q, const void* k_pool, const void* v_pool,
                                const int32_t* table, const DeviceCandidates& middle,
                                const SelectedAttentionShape& shape, const int32_t* prefix_len,
                                float* scratch, cudaStream_t stream) {
  const auto* k = static_cast<const KV*>(k_pool);
  const auto* v = static_cast<const KV*>(v_pool);
  const unsigned blocks = static_cast<unsigned>(shape.num_kv_heads) * shape.items_per_head;
  // Group 4 (Llama-3.2 1B and 3B, Llama-3.1 8B, Mistral 7B) with head_dim 64 or 128: builds of
  // their own, as the cluster kernel's (STRATA_SELECTED_GROUP_KERNELS=0: the generic one).
  const bool group4 = shape.num_q_heads == 4 * shape.num_kv_heads && GroupClusterKernels();
  switch (shape.head_dim) {
    case 64:
      LaunchDecodeBuild<KV, 64, kSlotScales>(group4, blocks, q, k, v, table, middle, shape,
                                             prefix_len, scratch, stream);
      break;
    case 128:
      LaunchDecodeBuild<KV, 128, kSlotScales>(group4, blocks, q, k, v, table, middle, shape,
                                              prefix_len, scratch, stream);
      break;
    case 256:
      LaunchDecodeBuild<KV, 256, kSlotScales>(false, blocks, q, k, v, table, middle, shape,
                                              prefix_len, scratch, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t SetSelectedAttentionPhaseStamps(unsigned long long* stamps, int max_blocks) {
  cudaError_t e = cudaMemcpyToSymbol(g_selected_phase_stamps, &stamps, sizeof(stamps));
  if (e != cudaSuccess) return e;
  const int blocks = stamps == nullptr ? 0 : max_blocks;
  return cudaMemcpyToSymbol(g_selected_phase_blocks, &blocks, sizeof(blocks));
}

bool SelectedAttentionSupports(int num_q_heads, int num_kv_heads, int head_dim) {
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return false;
  const int group = num_q_heads / num_kv_heads;
  return group >= 1 && group <= kDecodeMaxGroup &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

int64_t SelectedAttentionScratchFloats(const SelectedAttentionShape& shape) {
  if (UsesClusterKernel(shape)) return 0;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  return static_cast<int64_t>(shape.num_kv_heads) * shape.items_per_head * group *
         (shape.head_dim + 2);
}

cudaError_t LaunchSelectedAttention(const float* q, const void* k_pool, const void* v_pool,
                                    FloatType pool_type, const int32_t* page_table,
                                    const DeviceCandidates& middle,
                                    const SelectedAttentionShape& shape,
                                    const int32_t* prefix_len, float* scratch, float* out,
                                    float* lse, cudaStream_t stream) {
  if (shape.num_q_heads == 0) return cudaSuccess;
  if (!SelectedAttentionSupports(shape.num_q_heads, shape.num_kv_heads, shape.head_dim) ||
      shape.items_per_head < 1 || shape.chunk < 1) {
    return cudaErrorInvalidValue;
  }
  // Per-slot scales: fp8 pools only, through their own instantiations (the others unchanged).
  const bool slot_scales = shape.slot_scales != nullptr;
  if (slot_scales && pool_type != FloatType::kFP8E4M3) return cudaErrorInvalidValue;
  if (UsesClusterKernel(shape)) {
    if (slot_scales) {
      return LaunchCluster<__nv_fp8_e4m3, true>(q, k_pool, v_pool, page_table, middle, shape,
                                                prefix_len, out, lse, stream);
    }
    if (pool_type == FloatType::kBF16) {
      return LaunchCluster<__nv_bfloat16>(q, k_pool, v_pool, page_table, middle, shape,
                                          prefix_len, out, lse, stream);
    } else if (pool_type == FloatType::kFP8E4M3) {
      return LaunchCluster<__nv_fp8_e4m3>(q, k_pool, v_pool, page_table, middle, shape,
                                          prefix_len, out, lse, stream);
    } else if (pool_type == FloatType::kF32) {
      return LaunchCluster<float>(q, k_pool, v_pool, page_table, middle, shape, prefix_len,
                                  out, lse, stream);
    }
    return cudaErrorInvalidValue;
  }
  cudaError_t e;
  if (SelectedDecodeMmaSupports(shape, pool_type)) {
    e = LaunchSelectedDecodeMma(q, k_pool, v_pool, pool_type, page_table, middle, shape,
                                prefix_len, scratch, stream);
  } else if (slot_scales) {
    e = LaunchSelectedTyped<__nv_fp8_e4m3, true>(q, k_pool, v_pool, page_table, middle, shape,
                                                 prefix_len, scratch, stream);
  } else if (pool_type == FloatType::kBF16) {
    e = LaunchSelectedTyped<__nv_bfloat16>(q, k_pool, v_pool, page_table, middle, shape,
                                           prefix_len, scratch, stream);
  } else if (pool_type == FloatType::kFP8E4M3) {
    e = LaunchSelectedTyped<__nv_fp8_e4m3>(q, k_pool, v_pool, page_table, middle, shape,
                                           prefix_len, scratch, stream);
  } else if (pool_type == FloatType::kF32) {
    e = LaunchSelectedTyped<float>(q, k_pool, v_pool, page_table, middle, shape, prefix_len,
                                   scratch, stream);
  } else {
    return cudaErrorInvalidValue;
  }
  if (e != cudaSuccess) return e;
  SelectedCombineKernel<<<shape.num_q_heads, kThreads, 0, stream>>>(shape, scratch, out, lse);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
