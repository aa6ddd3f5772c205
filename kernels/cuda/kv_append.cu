// AppendKv on the GPU: f32 K/V rows of new tokens converted into their KvCache pool rows, one
// thread per element (K and V; with RoPE the keys rotated on the way and the queries' pairs
// rotated in place by the same kernel). The bf16 rounding is kernels::F32ToBF16's and the fp8
// e4m3 one kernels::F32ToFP8E4M3's (nearest even, saturated to +-448, NaN -> 0x7f), bit for bit.
//
// EncodeFp8Pages: the persisted fp8 pages of bf16 pool pages (kernels/backend.h), one block per
// page; the CPU twin is kernels/cpu/kv_append.cc.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/kv_append.h"

namespace strata::kernels::cuda_internal {
namespace {

__device__ __forceinline__ uint16_t F32ToBF16Bits(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

__device__ __forceinline__ uint8_t F32ToFp8Bits(float v) {
  if (isnan(v)) return 0x7f;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Items [0, total): K elements, [total, 2 total): V elements, then with RoPE the pairs of q
// (q_pairs items, rotated in place as RopeKernel rotates them). A K element under RoPE is
// RopeKernel's rotation of its pair, computed from k without writing k.
template <FloatType T>
__global__ void AppendKvKernel(const float* __restrict__ k, const float* __restrict__ v,
                               void* k_pool, void* v_pool, int64_t total, int64_t heads,
                               int64_t head_dim, int64_t page_size, int64_t first,
                               int64_t slots_per_head, const int32_t* first_device,
                               float k_scale, float v_scale, RopeArgs rope) {
  bool write = true;
  if (first_device != nullptr) {
    // The position read on the device; `first` is its largest allowed value.
    const int64_t f = *first_device;
    write = f >= 0 && f <= first;
    first = write ? f : 0;
  }
  const int64_t half = head_dim / 2;
  const bool rotate = rope.inv_freq != nullptr;
  const int64_t items = 2 * total + (rotate ? rope.q_pairs : 0);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < items;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (e >= 2 * total) {  // a pair of q: [n, q_heads, head_dim], rotated in place
      const int64_t pe = e - 2 * total;
      const int64_t i = pe % half, row = pe / half;  // row: token * q_heads + head
      float c, s;
      RopeCosSin(rope.positions[row / rope.q_heads], rope.inv_freq, i, rope.factor, &c, &s);
      RopeRotatePair(rope.q + row * head_dim, i, half, c, s);
      continue;
    }
    if (!write) continue;
    const bool is_v = e >= total;
    const int64_t j = is_v ? e - total : e;  // element of [n, heads, head_dim]
    const int64_t c = j % head_dim;
    const int64_t g = (j / head_dim) % heads;
    const int64_t t = j / (head_dim * heads);
    const int64_t pos = first + t;
    const int64_t slot = g * slots_per_head + pos / page_size;
    const int64_t dst = (slot * page_size + pos % page_size) * head_dim + c;
    float x;
    if (is_v) {
      x = v[j];
    } else if (!rotate) {
      x = k[j];
    } else {
      const int64_t i = c < half ? c : c - half;
      const float x1 = k[j - c + i], x2 = k[j - c + i + half];
      float cs, sn;
      RopeCosSin(rope.positions[t], rope.inv_freq, i, rope.factor, &cs, &sn);
      x = c < half ? x1 * cs - x2 * sn : x2 * cs + x1 * sn;
    }
    void* pool = is_v ? v_pool : k_pool;
    if constexpr (T == FloatType::kBF16) {
      static_cast<uint16_t*>(pool)[dst] = F32ToBF16Bits(x);
    } else if constexpr (T == FloatType::kFP8E4M3) {
      static_cast<uint8_t*>(pool)[dst] = F32ToFp8Bits(x / (is_v ? v_scale : k_scale));
    } else {
      static_cast<float*>(pool)[dst] = x;
    }
  }
}

template <FloatType T>
void Launch(unsigned blocks, int threads, const float* k, const float* v, void* k_pool,
            void* v_pool, int64_t total, int64_t heads, int64_t head_dim, int64_t page_size,
            int64_t first, int64_t slots_per_head, const int32_t* first_device, float k_scale,
            float v_scale, const RopeArgs& rope, cudaStream_t stream) {
  AppendKvKernel<T><<<blocks, threads, 0, stream>>>(k, v, k_pool, v_pool, total, heads, head_dim,
                                                    page_size, first, slots_per_head,
                                                    first_device, k_scale, v_scale, rope);
}

}  // namespace

cudaError_t LaunchAppendKv(const float* k, const float* v, void* k_pool, void* v_pool,
                           FloatType pool_type, int64_t n, int64_t heads, int64_t head_dim,
                           int64_t page_size, int64_t first, int64_t slots_per_head,
                           cudaStream_t stream, const int32_t* first_device, float k_scale,
                           float v_scale, const RopeArgs& rope) {
  const int64_t total = n * heads * head_dim;
  const int64_t items = 2 * total + (rope.inv_freq != nullptr ? rope.q_pairs : 0);
  if (items == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t want = (items + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want < 65535 ? want : 65535);
  switch (pool_type) {
    case FloatType::kBF16:
      Launch<FloatType::kBF16>(blocks, kThreads, k, v, k_pool, v_pool, total, heads, head_dim,
                               page_size, first, slots_per_head, first_device, k_scale, v_scale,
                               rope, stream);
      break;
    case FloatType::kFP8E4M3:
      Launch<FloatType::kFP8E4M3>(blocks, kThreads, k, v, k_pool, v_pool, total, heads, head_dim,
                                  page_size, first, slots_per_head, first_device, k_scale,
                                  v_scale, rope, stream);
      break;
    case FloatType::kF32:
      Launch<FloatType::kF32>(blocks, kThreads, k, v, k_pool, v_pool, total, heads, head_dim,
                              page_size, first, slots_per_head, first_device, k_scale, v_scale,
                              rope, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

namespace {

__device__ __forceinline__ float Bf16Bits(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

__device__ __forceinline__ float Fp8Value(uint8_t c) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
  return __half2float(__half(h));
}

// One block per item; blockDim.x is a multiple of d, so thread t reads channel t % d in every
// row it visits (rows t / d, t / d + blockDim.x / d, ...). Pass 1: amax and NaN of K and V (block
// reductions); pass 2: the codes, and for K the decoded values' min / max per channel, kept with
// the row they came from so that the combination across threads picks what a sequential
// std::min / std::max over the rows keeps (the first row among equal values: +0 and -0).
__global__ void EncodeFp8PagesKernel(const uint16_t* __restrict__ k_pool, const uint16_t* __restrict__ v_pool,
                                     int64_t page, int64_t d, int64_t first_slot, int64_t head_stride,
                                     int64_t count, int last_valid, uint8_t* __restrict__ codes,
                                     float* __restrict__ scales, float* __restrict__ summaries) {
  __shared__ float red_amax[2][32];
  __shared__ int red_nan[2][32];
  __shared__ float s_scale[2];
  __shared__ float lo_v[1024], hi_v[1024];
  __shared__ int lo_r[1024], hi_r[1024];
  const int64_t i = blockIdx.x;
  const int64_t g = i / count, j = i % count;
  const int64_t slot = first_slot + g * head_stride + j;
  const int64_t valid = j == count - 1 ? last_valid : page;
  const int64_t elems = page * d;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const uint16_t* src[2] = {k_pool + slot * elems, v_pool + slot * elems};
  for (int h = 0; h < 2; ++h) {
    float amax = 0.0f;
    int nan = 0;
    for (int64_t e = tid; e < valid * d; e += nt) {
      const float x = Bf16Bits(src[h][e]);
      nan |= isnan(x) ? 1 : 0;
      amax = fmaxf(amax, fabsf(x));
    }
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    nan = __any_sync(0xffffffffu, nan) ? 1 : 0;
    if (lane == 0) red_amax[h][warp] = amax, red_nan[h][warp] = nan;
  }
  __syncthreads();
  if (tid < 2) {
    float amax = 0.0f;
    int nan = 0;
    for (int w = 0; w < (nt + 31) / 32; ++w) amax = fmaxf(amax, red_amax[tid][w]), nan |= red_nan[tid][w];
    const float a = nan ? __int_as_float(0x7fc00000) : amax;
    const float scale = (isfinite(a) && a > 0.0f) ? a / 448.0f : 1.0f;
    s_scale[tid] = scale;
    scales[i * 2 + tid] = scale;
  }
  __syncthreads();
  float lo = __int_as_float(0x7f800000), hi = __int_as_float(0xff800000);
  int lo_row = INT_MAX, hi_row = INT_MAX;
  for (int h = 0; h < 2; ++h) {
    const float scale = s_scale[h];
    uint8_t* out = codes + (i * 2 + h) * elems;
    for (int64_t e = tid; e < elems; e += nt) {
      const int64_t t = e / d;
      const float x = t < valid ? Bf16Bits(src[h][e]) : 0.0f;
      const uint8_t c = F32ToFp8Bits(x / scale);
      out[e] = c;
      if (h == 0 && t < valid) {
        const float v = Fp8Value(c) * scale;
        if (v < lo) lo = v, lo_row = static_cast<int>(t);
        if (hi < v) hi = v, hi_row = static_cast<int>(t);
      }
    }
  }
  lo_v[tid] = lo, hi_v[tid] = hi, lo_r[tid] = lo_row, hi_r[tid] = hi_row;
  __syncthreads();
  if (tid < d) {
    float l = __int_as_float(0x7f800000), u = __int_as_float(0xff800000);
    int lr = INT_MAX, ur = INT_MAX;
    for (int k = tid; k < nt; k += static_cast<int>(d)) {
      if (lo_v[k] < l || (lo_v[k] == l && lo_r[k] < lr)) l = lo_v[k], lr = lo_r[k];
      if (u < hi_v[k] || (hi_v[k] == u && hi_r[k] < ur)) u = hi_v[k], ur = hi_r[k];
    }
    summaries[i * 2 * d + tid] = l;
    summaries[i * 2 * d + d + tid] = u;
  }
}

}  // namespace

cudaError_t LaunchEncodeFp8Pages(const uint16_t* k_pool, const uint16_t* v_pool, int64_t page_size,
                                 int64_t head_dim, int64_t first_slot, int64_t head_slot_stride,
                                 int num_heads, int64_t count, int last_valid, uint8_t* codes,
                                 float* scales, float* summaries, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(num_heads) * count;
  if (items == 0) return cudaSuccess;
  if (head_dim < 1 || head_dim > 1024 || items > 0x7fffffff) return cudaErrorInvalidValue;
  const int threads = static_cast<int>(head_dim * (head_dim >= 256 ? 1 : 256 / head_dim));
  EncodeFp8PagesKernel<<<static_cast<unsigned>(items), threads, 0, stream>>>(
      k_pool, v_pool, page_size, head_dim, first_slot, head_slot_stride, count, last_valid, codes, scales,
      summaries);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
