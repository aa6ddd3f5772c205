// Device-resident sparse selection on the GPU (semantics in kernels/backend.h; CPU twin in
// kernels/cpu/selection.cc).
//
// Scoring (ScoreSummaries, ScoreKeys): for head_dim 64/128 (128 only for f32 keys) and 16-byte
// aligned rows, FastScoreKernel gives each candidate 8 lanes that read 16-byte vectors (128
// contiguous bytes per load across the 8 lanes, all of a lane's loads in flight before the FMAs)
// and reduce in 3 shuffles; other shapes take a warp per candidate. The block holds the scaled
// queries of its KV head's group in shared memory. Grid: (candidate blocks, KV heads).
//
// VoteTopK: one block per KV head of 64 to 1024 threads (about 8 candidates per thread); warp w
// owns a contiguous range of 32-candidate chunks, lane l the candidate chunk * 32 + l. (1) per
// query head the max score, (2) the sum of exp(score - max), each reduced per warp with shuffles
// and across warps once for all heads (two barriers per step); (3) per candidate the vote and a
// 32-bit key that orders candidates by vote (invalid ones get key 0, below every valid one), kept
// in shared memory up to 32K candidates, else in scratch, and the histogram of the keys' top
// bytes; (4) a radix select (8 bits per pass, warp-aggregated shared-memory histograms, double
// buffered, the bin found by one warp's scan; it stops as soon as every key equal to the prefix
// found so far is taken) gives the prefix of the k-th largest key and how many keys equal to it
// are taken; (5) each warp counts its keys above and equal to the prefix, every warp scans those
// per-warp counts, and ballots give every taken candidate its output slot, so ties go to the
// lowest indices and the output is in index order. Every thread reads back only the keys it
// wrote, so steps 3-5 need no barrier for the keys.
#include <algorithm>
#include <cfloat>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/selection.cuh"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kTopKMaxThreads = 1024;
constexpr int kTopKMaxWarps = kTopKMaxThreads / 32;
// VoteTopK block size: about this many candidates per thread, 64 to 1024 threads.
constexpr int kTopKPerThread = 8;
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

// Warp-uniform inclusive scan of v over the 32 lanes.
__device__ __forceinline__ int WarpInclusiveScan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Adds one to bin `bin` (< 256; 256 = none) of `hist` for every lane of the warp, one shared
// atomic per distinct bin. Every lane of the warp must call it.
__device__ __forceinline__ void WarpHistogramAdd(uint32_t* hist, uint32_t bin) {
  const unsigned same = __match_any_sync(0xffffffffu, bin);
  if (bin < 256 && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
}

// Block shape of VoteTopKKernel: one block per KV head; warp w owns the 32-candidate chunks
// [w * cpw, (w + 1) * cpw), lane l candidate chunk * 32 + l (loads coalesced, and the warps'
// ranges are in index order, which the compaction uses).
struct TopKShape {
  int32_t n, chunks, c0, c1;
};

__device__ __forceinline__ TopKShape MakeTopKShape(int32_t n) {
  const int nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  TopKShape s;
  s.n = n;
  s.chunks = (n + 31) / 32;
  const int32_t cpw = (s.chunks + nwarps - 1) / nwarps;
  s.c0 = min(s.chunks, warp * cpw);
  s.c1 = min(s.chunks, s.c0 + cpw);
  return s;
}

constexpr int kTopKBatch = 8;  // chunks whose loads a lane has in flight at once

__global__ void __launch_bounds__(kTopKMaxThreads)
    VoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c, int k,
                   float* __restrict__ vote_out, int32_t* __restrict__ selected,
                   uint32_t* __restrict__ global_keys, bool shared_keys) {
  extern __shared__ uint32_t keys_s[];
  __shared__ float red_s[kSelectMaxGroup][kTopKMaxWarps];
  __shared__ float m_s[kSelectMaxGroup], inv_s[kSelectMaxGroup];
  __shared__ uint32_t hist[2][256];
  __shared__ int cnt_s[2][kTopKMaxWarps];
  __shared__ uint32_t prefix_s, mask_s, remaining_s;
  __shared__ int done_s;
  const int g = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  const int32_t n = c.count;
  const TopKShape sh = MakeTopKShape(n);
  uint32_t* keys = shared_keys ? keys_s : global_keys + static_cast<int64_t>(g) * n;
  const float* sg = scores + static_cast<int64_t>(g) * group * n;
  for (int b = tid; b < 256; b += blockDim.x) hist[0][b] = 0;  // first radix pass (step 3)

  // (1) max over the valid scores (> -inf; NaN never wins) of each query head: per warp, then
  // across warps (no barrier between heads).
  for (int h = 0; h < group; ++h) {
    const float* s = sg + static_cast<int64_t>(h) * n;
    float m = NegInfF();
    for (int32_t ch = sh.c0; ch < sh.c1; ch += kTopKBatch) {
      float x[kTopKBatch];
#pragma unroll
      for (int j = 0; j < kTopKBatch; ++j) {
        const int32_t i = (ch + j) * 32 + lane;
        x[j] = ch + j < sh.c1 && i < n ? s[i] : NegInfF();
      }
#pragma unroll
      for (int j = 0; j < kTopKBatch; ++j) {
        if (x[j] > m) m = x[j];
      }
    }
    m = WarpMax(m);
    if (lane == 0) red_s[h][warp] = m;
  }
  __syncthreads();
  for (int h = warp; h < group; h += nwarps) {
    const float m = WarpMax(lane < nwarps ? red_s[h][lane] : NegInfF());
    if (lane == 0) m_s[h] = m;
  }
  __syncthreads();
  // (2) sum of exp(score - max) of each query head, the same way.
  for (int h = 0; h < group; ++h) {
    const float* s = sg + static_cast<int64_t>(h) * n;
    const float mh = m_s[h];
    float l = 0.0f;
    for (int32_t ch = sh.c0; ch < sh.c1 && mh > NegInfF(); ch += kTopKBatch) {
      float x[kTopKBatch];
#pragma unroll
      for (int j = 0; j < kTopKBatch; ++j) {
        const int32_t i = (ch + j) * 32 + lane;
        x[j] = ch + j < sh.c1 && i < n ? s[i] : NegInfF();
      }
#pragma unroll
      for (int j = 0; j < kTopKBatch; ++j) {
        if (x[j] > NegInfF()) l += expf(x[j] - mh);
      }
    }
    l = WarpSum(l);
    if (lane == 0) red_s[h][warp] = l;
  }
  __syncthreads();
  for (int h = warp; h < group; h += nwarps) {
    const float l = WarpSum(lane < nwarps ? red_s[h][lane] : 0.0f);
    if (lane == 0) inv_s[h] = m_s[h] == NegInfF() ? 0.0f : 1.0f / l;
  }
  __syncthreads();

  // (3) votes and keys (a 32-bit key that orders candidates by vote; invalid ones get key 0,
  // below every valid one), and the histogram of the keys' top bytes (first radix pass).
  for (int32_t ch = sh.c0; ch < sh.c1; ch += kTopKBatch) {
    float v[kTopKBatch];
    bool valid[kTopKBatch];
#pragma unroll
    for (int j = 0; j < kTopKBatch; ++j) v[j] = 0.0f, valid[j] = false;
    for (int h = 0; h < group; ++h) {
      const float* s = sg + static_cast<int64_t>(h) * n;
      const float mh = m_s[h], ih = inv_s[h];
      float x[kTopKBatch];
#pragma unroll
      for (int j = 0; j < kTopKBatch; ++j) {
        const int32_t i = (ch + j) * 32 + lane;
        x[j] = ch + j < sh.c1 && i < n ? s[i] : NegInfF();
      }
#pragma unroll
      for (int j = 0; j < kTopKBatch; ++j) {
        if (x[j] > NegInfF()) {
          valid[j] = true;
          v[j] += expf(x[j] - mh) * ih;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kTopKBatch; ++j) {
      if (ch + j < sh.c1) {  // warp-uniform
        const int32_t i = (ch + j) * 32 + lane;
        uint32_t key = 0;
        if (i < n) {
          float vj = v[j];
          if (!(vj >= 0.0f)) vj = 0.0f;  // NaN (from +inf scores) ranks as 0
          const bool ok = valid[j] && CandidateIdAt(c, g, i) >= 0;
          key = ok ? __float_as_uint(vj) + 1u : 0u;
          keys[i] = key;
          if (vote_out != nullptr) vote_out[static_cast<int64_t>(g) * n + i] = vj;
        }
        WarpHistogramAdd(hist[0], key != 0 ? key >> 24 : 256u);
      }
    }
  }

  // (4) radix select over the non-zero keys, 8 bits per pass from the top: after a pass, the
  // keys whose bits under `mask` exceed `prefix` are all taken, and `remaining` of those equal to
  // `prefix` under `mask` are (the lowest indices). Stops early once every key equal to the
  // prefix is taken (for instance when there are at most k valid keys).
  const int32_t kk = min(k, n);
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
  if (kk == 0) {
    prefix = 0xffffffffu, mask = 0xffffffffu, remaining = 0;  // nothing compares above
  }
  for (int pass = 0; pass < 4 && kk > 0; ++pass) {
    const int shift = 24 - 8 * pass;
    uint32_t* hc = hist[pass & 1];
    if (pass > 0) {
      // Each thread reads back only the keys it wrote in step 3: no barrier needed for them.
      for (int32_t ch = sh.c0; ch < sh.c1; ++ch) {
        const int32_t i = ch * 32 + lane;
        uint32_t bin = 256;
        if (i < n) {
          const uint32_t key = keys[i];
          if (key != 0 && (key & mask) == prefix) bin = (key >> shift) & 255u;
        }
        WarpHistogramAdd(hc, bin);
      }
    }
    for (int b = tid; b < 256; b += blockDim.x) hist[(pass + 1) & 1][b] = 0;  // next pass
    __syncthreads();
    if (warp == 0) {
      // Lane L owns bins 255 - 8L .. 248 - 8L (descending); the first lane whose bins reach
      // `remaining` (counting from the top) walks its bins.
      uint32_t cb[8], own = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        cb[j] = hc[255 - 8 * lane - j];
        own += cb[j];
      }
      uint32_t incl = own;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const uint32_t total = __shfl_sync(0xffffffffu, incl, 31);
      const uint32_t before = incl - own;
      const unsigned hit = __ballot_sync(0xffffffffu, incl >= remaining);
      if (total <= remaining) {
        // Every key still in the running is taken (only in pass 0: at most k valid keys).
        if (lane == 0) {
          prefix_s = prefix, mask_s = mask, remaining_s = total, done_s = 1;
        }
      } else if (lane == __ffs(hit) - 1) {
        uint32_t cum = before, count = cb[7];
        int b = 248 - 8 * lane;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (cum + cb[j] >= remaining) {
            b = 255 - 8 * lane - j;
            count = cb[j];
            break;
          }
          cum += cb[j];
        }
        prefix_s = prefix | (static_cast<uint32_t>(b) << shift);
        mask_s = mask | (255u << shift);
        remaining_s = remaining - cum;
        done_s = count == remaining - cum || shift == 0;
      }
    }
    __syncthreads();
    prefix = prefix_s, mask = mask_s, remaining = remaining_s;
    if (done_s) break;
  }
  const int need_eq = static_cast<int>(remaining);

  // (5) compaction in index order: per warp, the counts of keys above the prefix and equal to
  // it; every warp scans the per-warp counts, then writes its taken candidates through ballots.
  const unsigned lt = (1u << lane) - 1u;
  int gt = 0, eq = 0;
  for (int32_t ch = sh.c0; ch < sh.c1; ++ch) {
    const int32_t i = ch * 32 + lane;
    const uint32_t key = i < n ? keys[i] : 0u;
    gt += __popc(__ballot_sync(0xffffffffu, key != 0 && (key & mask) > prefix));
    eq += __popc(__ballot_sync(0xffffffffu, key != 0 && (key & mask) == prefix));
  }
  if (lane == 0) cnt_s[0][warp] = gt, cnt_s[1][warp] = eq;
  __syncthreads();
  const int wgt = lane < nwarps ? cnt_s[0][lane] : 0, weq = lane < nwarps ? cnt_s[1][lane] : 0;
  const int eq_incl = WarpInclusiveScan(weq);
  const int eq_before = eq_incl - weq;
  const int take_w = wgt + min(weq, max(0, need_eq - eq_before));
  const int take_incl = WarpInclusiveScan(take_w);
  const int taken_total = __shfl_sync(0xffffffffu, take_incl, 31);
  int eq_run = __shfl_sync(0xffffffffu, eq_before, warp);
  int pos = __shfl_sync(0xffffffffu, take_incl - take_w, warp);
  int32_t* out = selected + static_cast<int64_t>(g) * k;
  for (int32_t ch = sh.c0; ch < sh.c1; ++ch) {
    const int32_t i = ch * 32 + lane;
    const uint32_t key = i < n ? keys[i] : 0u;
    const bool is_gt = key != 0 && (key & mask) > prefix;
    const bool is_eq = key != 0 && (key & mask) == prefix;
    const unsigned eq_mask = __ballot_sync(0xffffffffu, is_eq);
    const bool take = is_gt || (is_eq && eq_run + __popc(eq_mask & lt) < need_eq);
    const unsigned take_mask = __ballot_sync(0xffffffffu, take);
    const int p = pos + __popc(take_mask & lt);
    if (take && p < k) out[p] = CandidateIdAt(c, g, i);
    eq_run += __popc(eq_mask);
    pos += __popc(take_mask);
  }
  for (int32_t j = taken_total + tid; j < k; j += blockDim.x) out[j] = -1;
}

// Fast path of both scoring ops: 8 lanes per candidate (4 candidates per warp at a time), each
// lane reading 16-byte vectors so that the 8 lanes of a candidate cover 128 contiguous bytes per
// load, every load of a lane in flight before the FMAs; the 8 partial sums meet in 3 shuffles.
// kMinMax: rows are f32 summaries [min(D), max(D)]; otherwise KV rows of D elements of T (keys).
constexpr int kSubLanes = 8;
constexpr int kFastCandidatesPerBlock = kScoreWarps * (32 / kSubLanes);

template <typename T>
__device__ __forceinline__ void Load16(const T* p, float (&f)[16 / sizeof(T)]);
template <>
__device__ __forceinline__ void Load16<float>(const float* p, float (&f)[4]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
}
template <>
__device__ __forceinline__ void Load16<__nv_bfloat16>(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __bfloat1622float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

template <typename T, int D, bool kMinMax>
__global__ void __launch_bounds__(kScoreThreads)
    FastScoreKernel(const float* __restrict__ q, const T* __restrict__ rows, int64_t num_items,
                    int64_t num_slots, int page_size, const int32_t* __restrict__ table,
                    int table_pages, int group, DeviceCandidates c, float scale,
                    float* __restrict__ scores) {
  constexpr int kEpl = 16 / sizeof(T);              // elements per lane per load
  constexpr int kSteps = D / (kSubLanes * kEpl);    // loads per lane per row (per half for minmax)
  static_assert(kSteps >= 1 && D % (kSubLanes * kEpl) == 0, "head_dim must fill the lanes");
  __shared__ __align__(16) float qs[kSelectMaxGroup * D];
  const int g = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane / kSubLanes, sl = lane % kSubLanes;
  const float* qg = q + static_cast<int64_t>(g) * group * D;
  for (int i = tid; i < group * D; i += kScoreThreads) qs[i] = scale * qg[i];
  __syncthreads();
  const int32_t per_iter = gridDim.x * kFastCandidatesPerBlock;
  for (int32_t base = blockIdx.x * kFastCandidatesPerBlock; base < c.count; base += per_iter) {
    const int32_t i = base + warp * (32 / kSubLanes) + sub;
    const T* row = nullptr;
    if (i < c.count) {
      const int32_t id = CandidateIdAt(c, g, i);
      if constexpr (kMinMax) {
        if (id >= 0 && id < num_items) row = rows + (static_cast<int64_t>(g) * num_items + id) * 2 * D;
      } else {
        const int64_t r = TokenRow(table, table_pages, num_slots, page_size, g, id);
        if (r >= 0) row = rows + r * D;
      }
    }
    float a[kMinMax ? 2 * kSteps : kSteps][kEpl];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int e = (j * kSubLanes + sl) * kEpl;
      if (row != nullptr) {
        Load16<T>(row + e, a[j]);
        if constexpr (kMinMax) Load16<T>(row + D + e, a[kSteps + j]);
      }
    }
    float acc[kSelectMaxGroup];
#pragma unroll
    for (int h = 0; h < kSelectMaxGroup; ++h) acc[h] = 0.0f;
    if (row != nullptr) {
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        const int e = (j * kSubLanes + sl) * kEpl;
#pragma unroll
        for (int h = 0; h < kSelectMaxGroup; ++h) {
          if (h < group) {
#pragma unroll
            for (int x = 0; x < kEpl; ++x) {
              const float v = qs[h * D + e + x];
              if constexpr (kMinMax) {
                acc[h] += fmaxf(v * a[j][x], v * a[kSteps + j][x]);
              } else {
                acc[h] += v * a[j][x];
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kSelectMaxGroup; ++h) {
      if (h < group) {
#pragma unroll
        for (int o = kSubLanes / 2; o > 0; o >>= 1) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], o);
      }
    }
    if (i < c.count && sl == 0) {
      for (int h = 0; h < group; ++h) {
        scores[(static_cast<int64_t>(g) * group + h) * c.count + i] =
            row != nullptr ? acc[h] : NegInfF();
      }
    }
  }
}

unsigned FastScoreBlocks(int32_t count) {
  int64_t blocks = (static_cast<int64_t>(count) + kFastCandidatesPerBlock - 1) / kFastCandidatesPerBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 256)));
}

unsigned ScoreBlocks(int32_t count) {
  int64_t blocks = (static_cast<int64_t>(count) + kScoreWarps * 2 - 1) / (kScoreWarps * 2);
  if (blocks < 1) blocks = 1;
  if (blocks > 4096) blocks = 4096;
  return static_cast<unsigned>(blocks);
}

// UpdateSummaries: one block per (page, KV head), thread e owns channels e, e + 128, ...; then
// one block per (segment, KV head) merges its pages' rows.
constexpr int kSumThreads = 128;

template <typename KV>
__global__ void __launch_bounds__(kSumThreads)
    PageSummaryKernel(const KV* __restrict__ k_pool, int64_t num_slots, int page_size, int d,
                      const int32_t* __restrict__ table, int table_pages, int64_t end,
                      int64_t page_begin, float* __restrict__ pages, int64_t max_pages) {
  const int g = blockIdx.y;
  const int64_t pg = page_begin + blockIdx.x;
  float* r = pages + (static_cast<int64_t>(g) * max_pages + pg) * 2 * d;
  const int64_t t0 = pg * page_size, t1 = min(end, t0 + page_size);
  for (int e = threadIdx.x; e < d; e += kSumThreads) {
    float lo = 0.0f, hi = 0.0f;
    bool any = false;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row = TokenRow(table, table_pages, num_slots, page_size, g, static_cast<int32_t>(t));
      if (row < 0) continue;
      const float x = LoadF<KV>(k_pool, row * d + e);
      lo = any ? fminf(lo, x) : x;
      hi = any ? fmaxf(hi, x) : x;
      any = true;
    }
    r[e] = lo;
    r[d + e] = hi;
  }
}

__global__ void __launch_bounds__(kSumThreads)
    SegmentSummaryKernel(const float* __restrict__ pages, int64_t max_pages, int d,
                         int64_t seg_begin, int64_t total_pages, int segment_pages,
                         float* __restrict__ segments, int64_t max_segments) {
  const int g = blockIdx.y;
  const int64_t sg = seg_begin + blockIdx.x;
  float* r = segments + (static_cast<int64_t>(g) * max_segments + sg) * 2 * d;
  const int64_t p0 = sg * segment_pages, p1 = min(total_pages, p0 + segment_pages);
  for (int e = threadIdx.x; e < d; e += kSumThreads) {
    float lo = 0.0f, hi = 0.0f;
    for (int64_t pg = p0; pg < p1; ++pg) {
      const float* q = pages + (static_cast<int64_t>(g) * max_pages + pg) * 2 * d;
      lo = pg == p0 ? q[e] : fminf(lo, q[e]);
      hi = pg == p0 ? q[d + e] : fmaxf(hi, q[d + e]);
    }
    r[e] = lo;
    r[d + e] = hi;
  }
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
  const bool aligned = reinterpret_cast<uintptr_t>(summaries) % 16 == 0;
  const dim3 fast_grid(FastScoreBlocks(c.count), num_kv_heads);
  if (aligned && head_dim == 128) {
    FastScoreKernel<float, 128, true><<<fast_grid, kScoreThreads, 0, stream>>>(
        q, summaries, num_items, 0, 1, nullptr, 0, group, c, scale, scores);
  } else if (aligned && head_dim == 64) {
    FastScoreKernel<float, 64, true><<<fast_grid, kScoreThreads, 0, stream>>>(
        q, summaries, num_items, 0, 1, nullptr, 0, group, c, scale, scores);
  } else {
    const dim3 grid(ScoreBlocks(c.count), num_kv_heads);
    ScoreSummariesKernel<<<grid, kScoreThreads, smem, stream>>>(q, summaries, group, head_dim,
                                                                num_items, c, scale, scores);
  }
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
  const dim3 fast_grid(FastScoreBlocks(c.count), num_kv_heads);
  const bool aligned = reinterpret_cast<uintptr_t>(k_pool) % 16 == 0;
  if (aligned && pool_type == FloatType::kBF16 && head_dim == 128) {
    FastScoreKernel<__nv_bfloat16, 128, false><<<fast_grid, kScoreThreads, 0, stream>>>(
        q, static_cast<const __nv_bfloat16*>(k_pool), 0, num_slots, page_size, page_table,
        table_pages, group, c, scale, scores);
  } else if (aligned && pool_type == FloatType::kBF16 && head_dim == 64) {
    FastScoreKernel<__nv_bfloat16, 64, false><<<fast_grid, kScoreThreads, 0, stream>>>(
        q, static_cast<const __nv_bfloat16*>(k_pool), 0, num_slots, page_size, page_table,
        table_pages, group, c, scale, scores);
  } else if (aligned && pool_type == FloatType::kF32 && head_dim == 128) {
    FastScoreKernel<float, 128, false><<<fast_grid, kScoreThreads, 0, stream>>>(
        q, static_cast<const float*>(k_pool), 0, num_slots, page_size, page_table, table_pages,
        group, c, scale, scores);
  } else if (pool_type == FloatType::kBF16) {
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
  const int64_t wanted = (static_cast<int64_t>(c.count) + kTopKPerThread - 1) / kTopKPerThread;
  const int threads = static_cast<int>(
      std::clamp<int64_t>((wanted + 31) / 32 * 32, 64, kTopKMaxThreads));
  VoteTopKKernel<<<num_kv_heads, threads, smem, stream>>>(
      scores, group, c, k, vote, selected, static_cast<uint32_t*>(scratch), shared_keys);
  return cudaGetLastError();
}

cudaError_t LaunchUpdateSummaries(const void* k_pool, FloatType pool_type, int64_t num_slots,
                                  int page_size, int head_dim, const int32_t* page_table,
                                  int table_pages, int num_kv_heads, int64_t end,
                                  int64_t page_begin, int64_t page_end, float* pages,
                                  int64_t max_pages, float* segments, int64_t max_segments,
                                  int segment_pages, cudaStream_t stream) {
  if (page_end <= page_begin || num_kv_heads == 0) return cudaSuccess;
  if (num_kv_heads > 65535 || page_end - page_begin > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(page_end - page_begin), num_kv_heads);
  if (pool_type == FloatType::kBF16) {
    PageSummaryKernel<__nv_bfloat16><<<grid, kSumThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(k_pool), num_slots, page_size, head_dim, page_table,
        table_pages, end, page_begin, pages, max_pages);
  } else if (pool_type == FloatType::kF32) {
    PageSummaryKernel<float><<<grid, kSumThreads, 0, stream>>>(
        static_cast<const float*>(k_pool), num_slots, page_size, head_dim, page_table,
        table_pages, end, page_begin, pages, max_pages);
  } else {
    return cudaErrorInvalidValue;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || segments == nullptr) return e;
  const int64_t s0 = page_begin / segment_pages;
  const int64_t s1 = (page_end + segment_pages - 1) / segment_pages;
  const dim3 sgrid(static_cast<unsigned>(s1 - s0), num_kv_heads);
  SegmentSummaryKernel<<<sgrid, kSumThreads, 0, stream>>>(pages, max_pages, head_dim, s0,
                                                          page_end, segment_pages, segments,
                                                          max_segments);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
