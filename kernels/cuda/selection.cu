// Device-resident sparse selection on the GPU (semantics in kernels/backend.h; CPU twin in
// kernels/cpu/selection.cc).
//
// Scoring (ScoreSummaries, ScoreKeys): one warp per candidate; the block holds the scaled queries
// of its KV head's group in shared memory, lanes split head_dim, and each query head's sum is a
// warp reduction. Grid: (candidate blocks, KV heads).
//
// VoteTopK: one 1024-thread block per KV head. (1) per query head, max and sum of exp over the
// candidates (online, block-reduced); (2) per candidate the vote and a 32-bit key that orders
// candidates by vote (invalid ones get key 0, below every valid one); keys live in shared memory
// when they fit, else in scratch; (3) a 4-pass radix select (8 bits per pass, warp-aggregated
// shared-memory histograms) finds the k-th largest key T and how many keys equal to T are taken;
// (4) each thread owns a contiguous run of candidates, and two block scans give every taken
// candidate its output slot, so ties at T go to the lowest indices and the output is in index
// order.
#include <cfloat>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/selection.cuh"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kTopKThreads = 1024;
constexpr int kTopKWarps = kTopKThreads / 32;
// Keys of one head kept in shared memory up to this many candidates (128 KiB).
constexpr int64_t kTopKSharedKeys = 32768;

__device__ __forceinline__ float NegInfF() { return __int_as_float(0xff800000); }

template <typename KV>
__device__ __forceinline__ float LoadF(const KV* p, int64_t i);
template <>
__device__ __forceinline__ float LoadF<float>(const float* p, int64_t i) {
  return __ldg(p + i);
}
template <>
__device__ __forceinline__ float LoadF<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

// Writes acc[h] (h < group) of the warp's candidate i: lane h writes head h.
__device__ __forceinline__ void WriteScores(const float (&acc)[kSelectMaxGroup], int group,
                                            int lane, int g, int32_t count, int32_t i,
                                            float* scores) {
#pragma unroll
  for (int h = 0; h < kSelectMaxGroup; ++h) {
    if (h < group && lane == h) {
      scores[(static_cast<int64_t>(g) * group + h) * count + i] = acc[h];
    }
  }
}

__global__ void __launch_bounds__(kScoreThreads)
    ScoreSummariesKernel(const float* __restrict__ q, const float* __restrict__ summaries,
                         int group, int d, int64_t num_items, DeviceCandidates c, float scale,
                         float* __restrict__ scores) {
  extern __shared__ float qs[];  // [group, d], scaled
  const int g = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* qg = q + static_cast<int64_t>(g) * group * d;
  for (int i = tid; i < group * d; i += kScoreThreads) qs[i] = scale * qg[i];
  __syncthreads();
  for (int32_t i = blockIdx.x * kScoreWarps + warp; i < c.count; i += gridDim.x * kScoreWarps) {
    const int32_t id = CandidateIdAt(c, g, i);  // warp-uniform
    float acc[kSelectMaxGroup];
    if (id < 0 || id >= num_items) {
#pragma unroll
      for (int h = 0; h < kSelectMaxGroup; ++h) acc[h] = NegInfF();
    } else {
#pragma unroll
      for (int h = 0; h < kSelectMaxGroup; ++h) acc[h] = 0.0f;
      const float* s = summaries + (static_cast<int64_t>(g) * num_items + id) * 2 * d;
      for (int e = lane; e < d; e += 32) {
        const float mn = __ldg(s + e), mx = __ldg(s + d + e);
#pragma unroll
        for (int h = 0; h < kSelectMaxGroup; ++h) {
          if (h < group) {
            const float v = qs[h * d + e];
            acc[h] += fmaxf(v * mn, v * mx);
          }
        }
      }
#pragma unroll
      for (int h = 0; h < kSelectMaxGroup; ++h) {
        if (h < group) acc[h] = WarpSum(acc[h]);
      }
    }
    WriteScores(acc, group, lane, g, c.count, i, scores);
  }
}

template <typename KV>
__global__ void __launch_bounds__(kScoreThreads)
    ScoreKeysKernel(const float* __restrict__ q, const KV* __restrict__ k_pool, int64_t num_slots,
                    int page_size, const int32_t* __restrict__ table, int table_pages, int group,
                    int d, DeviceCandidates c, float scale, float* __restrict__ scores) {
  extern __shared__ float qs[];
  const int g = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* qg = q + static_cast<int64_t>(g) * group * d;
  for (int i = tid; i < group * d; i += kScoreThreads) qs[i] = scale * qg[i];
  __syncthreads();
  for (int32_t i = blockIdx.x * kScoreWarps + warp; i < c.count; i += gridDim.x * kScoreWarps) {
    const int32_t t = CandidateIdAt(c, g, i);
    const int64_t row = TokenRow(table, table_pages, num_slots, page_size, g, t);
    float acc[kSelectMaxGroup];
    if (row < 0) {
#pragma unroll
      for (int h = 0; h < kSelectMaxGroup; ++h) acc[h] = NegInfF();
    } else {
#pragma unroll
      for (int h = 0; h < kSelectMaxGroup; ++h) acc[h] = 0.0f;
      const KV* k = k_pool + row * d;
      for (int e = lane; e < d; e += 32) {
        const float kv = LoadF<KV>(k, e);
#pragma unroll
        for (int h = 0; h < kSelectMaxGroup; ++h) {
          if (h < group) acc[h] += qs[h * d + e] * kv;
        }
      }
#pragma unroll
      for (int h = 0; h < kSelectMaxGroup; ++h) {
        if (h < group) acc[h] = WarpSum(acc[h]);
      }
    }
    WriteScores(acc, group, lane, g, c.count, i, scores);
  }
}

// Exclusive block scan over kTopKThreads threads; `warp_s` has kTopKWarps ints. Returns the
// exclusive prefix and sets *total. Contains barriers.
__device__ __forceinline__ int BlockExclusiveScan(int v, int* warp_s, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) warp_s[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = warp_s[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_s[lane] = w;
  }
  __syncthreads();
  *total = warp_s[kTopKWarps - 1];
  return x - v + (warp > 0 ? warp_s[warp - 1] : 0);
}

// Merges an online-softmax pair (m, l) with (m2, l2).
__device__ __forceinline__ void MergeMl(float& m, float& l, float m2, float l2) {
  const float mm = fmaxf(m, m2);
  if (mm == NegInfF()) return;
  l = (m == NegInfF() ? 0.0f : l * expf(m - mm)) + (m2 == NegInfF() ? 0.0f : l2 * expf(m2 - mm));
  m = mm;
}

__global__ void __launch_bounds__(kTopKThreads)
    VoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c, int k,
                   float* __restrict__ vote_out, int32_t* __restrict__ selected,
                   uint32_t* __restrict__ global_keys, bool shared_keys) {
  extern __shared__ uint32_t keys_s[];
  __shared__ float m_s[kSelectMaxGroup], inv_s[kSelectMaxGroup];
  __shared__ float red_m[kTopKWarps], red_l[kTopKWarps];
  __shared__ uint32_t hist[256];
  __shared__ int scan_s[kTopKWarps];
  __shared__ uint32_t prefix_s, remaining_s;
  const int g = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t n = c.count;
  uint32_t* keys = shared_keys ? keys_s : global_keys + static_cast<int64_t>(g) * n;
  const float* sg = scores + static_cast<int64_t>(g) * group * n;

  // (1) max and sum of exp per query head.
  for (int h = 0; h < group; ++h) {
    const float* s = sg + static_cast<int64_t>(h) * n;
    float m = NegInfF(), l = 0.0f;
    for (int32_t i = tid; i < n; i += kTopKThreads) {
      const float x = s[i];
      if (x > NegInfF()) {  // NaN and -inf are skipped
        if (x > m) {
          l = m == NegInfF() ? 0.0f : l * expf(m - x);
          m = x;
        }
        l += expf(x - m);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
      MergeMl(m, l, m2, l2);
    }
    if (lane == 0) {
      red_m[warp] = m;
      red_l[warp] = l;
    }
    __syncthreads();
    if (tid == 0) {
      float bm = red_m[0], bl = red_l[0];
      for (int w = 1; w < kTopKWarps; ++w) MergeMl(bm, bl, red_m[w], red_l[w]);
      m_s[h] = bm;
      inv_s[h] = bm == NegInfF() ? 0.0f : 1.0f / bl;
    }
    __syncthreads();
  }

  // (2) votes and keys.
  for (int32_t i = tid; i < n; i += kTopKThreads) {
    float v = 0.0f;
    bool valid = false;
    for (int h = 0; h < group; ++h) {
      const float x = sg[static_cast<int64_t>(h) * n + i];
      if (x > NegInfF()) {
        valid = true;
        v += expf(x - m_s[h]) * inv_s[h];
      }
    }
    if (!(v >= 0.0f)) v = 0.0f;  // NaN (from +inf scores) ranks as 0
    valid = valid && CandidateIdAt(c, g, i) >= 0;
    keys[i] = valid ? __float_as_uint(v) + 1u : 0u;
    if (vote_out != nullptr) vote_out[static_cast<int64_t>(g) * n + i] = v;
  }
  __syncthreads();

  // (3) radix select of the k-th largest key.
  const int32_t kk = min(k, n);
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
  if (kk > 0) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += kTopKThreads) hist[b] = 0;
      __syncthreads();
      // Warp-uniform trip count so that every lane joins __match_any_sync.
      for (int32_t base = warp * 32; base < n; base += kTopKThreads) {
        const int32_t i = base + lane;
        uint32_t bin = 256;  // no bin
        if (i < n) {
          const uint32_t key = keys[i];
          if ((key & mask) == prefix) bin = (key >> shift) & 255u;
        }
        const unsigned same = __match_any_sync(0xffffffffu, bin);
        if (bin < 256 && lane == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
      }
      __syncthreads();
      if (tid == 0) {
        uint32_t cum = 0;
        int b = 255;
        for (; b > 0; --b) {
          if (cum + hist[b] >= remaining) break;
          cum += hist[b];
        }
        prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
        remaining_s = remaining - cum;
      }
      __syncthreads();
      prefix = prefix_s;
      remaining = remaining_s;
      mask |= 255u << shift;
    }
  }
  const uint32_t threshold = prefix;  // the k-th largest key (0 when kk == 0)
  const uint32_t need_eq = remaining;  // keys equal to threshold to take (lowest indices first)

  // (4) compaction in index order: thread tid owns [tid * per, (tid + 1) * per).
  const int32_t per = (n + kTopKThreads - 1) / kTopKThreads;
  const int32_t lo = min(n, tid * per), hi = min(n, lo + per);
  int eq_count = 0;
  if (threshold != 0) {
    for (int32_t i = lo; i < hi; ++i) eq_count += keys[i] == threshold;
  }
  int eq_total = 0;
  int eq_before = BlockExclusiveScan(eq_count, scan_s, &eq_total);
  int take_count = 0;
  {
    int e = eq_before;
    for (int32_t i = lo; i < hi; ++i) {
      const uint32_t key = keys[i];
      if (key > threshold) {
        ++take_count;
      } else if (threshold != 0 && key == threshold) {
        if (static_cast<uint32_t>(e) < need_eq) ++take_count;
        ++e;
      }
    }
  }
  int taken_total = 0;
  int pos = BlockExclusiveScan(take_count, scan_s, &taken_total);
  int32_t* out = selected + static_cast<int64_t>(g) * k;
  if (kk > 0) {
    int e = eq_before;
    for (int32_t i = lo; i < hi; ++i) {
      const uint32_t key = keys[i];
      bool take = key > threshold;
      if (!take && threshold != 0 && key == threshold) {
        take = static_cast<uint32_t>(e) < need_eq;
        ++e;
      }
      if (take && pos < k) out[pos++] = CandidateIdAt(c, g, i);
    }
  }
  for (int32_t j = (kk > 0 ? taken_total : 0) + tid; j < k; j += kTopKThreads) out[j] = -1;
}

unsigned ScoreBlocks(int32_t count) {
  int64_t blocks = (static_cast<int64_t>(count) + kScoreWarps * 2 - 1) / (kScoreWarps * 2);
  if (blocks < 1) blocks = 1;
  if (blocks > 4096) blocks = 4096;
  return static_cast<unsigned>(blocks);
}

}  // namespace

cudaError_t LaunchScoreSummaries(const float* q, const float* summaries, int num_kv_heads,
                                 int group, int head_dim, int64_t num_items,
                                 const DeviceCandidates& c, float scale, float* scores,
                                 cudaStream_t stream) {
  if (c.count == 0 || num_kv_heads == 0) return cudaSuccess;
  if (group < 1 || group > kSelectMaxGroup || num_kv_heads > 65535) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(group) * head_dim * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(ScoreBlocks(c.count), num_kv_heads);
  ScoreSummariesKernel<<<grid, kScoreThreads, smem, stream>>>(q, summaries, group, head_dim,
                                                              num_items, c, scale, scores);
  return cudaGetLastError();
}

cudaError_t LaunchScoreKeys(const float* q, const void* k_pool, FloatType pool_type,
                            int64_t num_slots, int page_size, const int32_t* page_table,
                            int table_pages, int num_kv_heads, int group, int head_dim,
                            const DeviceCandidates& c, float scale, float* scores,
                            cudaStream_t stream) {
  if (c.count == 0 || num_kv_heads == 0) return cudaSuccess;
  if (group < 1 || group > kSelectMaxGroup || num_kv_heads > 65535) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(group) * head_dim * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  const dim3 grid(ScoreBlocks(c.count), num_kv_heads);
  if (pool_type == FloatType::kBF16) {
    ScoreKeysKernel<__nv_bfloat16><<<grid, kScoreThreads, smem, stream>>>(
        q, static_cast<const __nv_bfloat16*>(k_pool), num_slots, page_size, page_table,
        table_pages, group, head_dim, c, scale, scores);
  } else if (pool_type == FloatType::kF32) {
    ScoreKeysKernel<float><<<grid, kScoreThreads, smem, stream>>>(
        q, static_cast<const float*>(k_pool), num_slots, page_size, page_table, table_pages,
        group, head_dim, c, scale, scores);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int64_t VoteTopKScratchBytes(int num_kv_heads, int64_t n) {
  return n <= kTopKSharedKeys ? 0 : static_cast<int64_t>(num_kv_heads) * n * sizeof(uint32_t);
}

cudaError_t LaunchVoteTopK(const float* scores, int num_kv_heads, int group,
                           const DeviceCandidates& c, int k, float* vote, int32_t* selected,
                           void* scratch, cudaStream_t stream) {
  if (num_kv_heads == 0) return cudaSuccess;
  if (group < 1 || group > kSelectMaxGroup || k < 0) return cudaErrorInvalidValue;
  if (k == 0 && c.count == 0) return cudaSuccess;
  const bool shared_keys = c.count <= kTopKSharedKeys;
  if (!shared_keys && scratch == nullptr) return cudaErrorInvalidValue;
  const size_t smem = shared_keys ? static_cast<size_t>(c.count) * sizeof(uint32_t) : 0;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        VoteTopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  VoteTopKKernel<<<num_kv_heads, kTopKThreads, smem, stream>>>(
      scores, group, c, k, vote, selected, static_cast<uint32_t*>(scratch), shared_keys);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
