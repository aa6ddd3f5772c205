// Device-resident sparse selection on the GPU (semantics in kernels/backend.h; CPU twin in
// kernels/cpu/selection.cc).
//
// Scoring (ScoreSummaries, ScoreKeys): for head_dim 64/128 (128 only for f32 keys) and 16-byte
// aligned rows, FastScoreKernel gives each candidate 8 lanes that read 16-byte vectors (128
// contiguous bytes per load across the 8 lanes); a block of 256 threads takes 1 to 16 rounds of
// 32 candidates and issues all their loads (up to 16 per lane) before the FMAs. Other shapes take
// a warp per candidate. The block holds the scaled queries of its KV head's group in shared
// memory. Grid: (candidate blocks, KV heads). ScoreKeys on bf16 keys of head_dim 128 with group
// <= 4 and power-of-two page size and fanout (the tokenselect shape) takes PagedKeyScoreKernel
// instead: the queries in registers, ids and rows by shifts, no barrier.
//
// VoteTopK (kernel by size: TopKKernelFor, near the end): for group <= 4 up to 2048 candidates,
// RegisterVoteTopKKernel (one block per KV head, everything in registers, one barrier per step), up
// to 8192 its cluster form ClusterRegisterVoteTopKKernel. Otherwise up to 1024 candidates per KV
// head, BitonicVoteTopKKernel (below): one block per KV head, votes in registers, a bitonic sort of
// unique 64-bit (vote key, index) keys, the first k flagged and compacted in index order. Up to
// 65536, ClusterVoteTopKKernel (below; as one block up to 2048): a cluster of 1 to 8 blocks per KV
// head, candidates in registers, histograms and counts merged in the leader block's shared memory
// (distributed shared memory), one cluster barrier per step. Beyond that, VoteTopKKernel: one block
// per KV head of 64 to 1024 threads (about 8 candidates per thread); warp w owns a contiguous range
// of 32-candidate chunks, lane l the candidate chunk * 32 + l. (1) per query head the max score,
// (2) the sum of exp(score - max), each reduced per warp with shuffles and across warps once for
// all heads (two barriers per step); (3) per candidate the vote and a 32-bit key that orders
// candidates by vote (VoteKey32: the 24-bit rank key of kernels/vote_rank.h in the top bits;
// invalid ones get key 0, below every valid one), kept in shared memory up to 32K candidates, else
// in scratch, and the histogram of the keys' top bytes; (4) a radix select (8 bits per pass, three
// passes, warp-aggregated shared-memory histograms, double buffered, the bin found by one warp's
// scan; it stops as soon as every key equal to the prefix found so far is taken) gives the prefix
// of the k-th largest key and how many keys equal to it are taken; (5) each warp counts its keys
// above and equal to the prefix, every warp scans those per-warp counts, and ballots give every
// taken candidate its output slot, so ties go to the lowest indices and the output is in index
// order. Every thread reads back only the keys it wrote, so steps 3-5 need no barrier for the keys.
//
// SelectStages (a decode step's whole chain of scoring and top-k stages) runs as one kernel,
// SelectStagesKernel (near the end): one thread-block cluster per KV head, each stage scored
// across the cluster's blocks and selected by a radix select over the cluster; with
// SelectStagesParams::attend, the decode step's attention over the selection follows in the same
// kernel.
//
// With SelectStagesParams::partitions (tokenselect in independent parts), PartStagesKernel (at
// the end) runs one part per block instead, with no top-k across blocks, and VoteTopK in parts is
// PartVoteTopKKernel.
//
// The fast scoring kernels and the cluster top-k can be launched with programmatic dependent
// launch (LaunchDependent, opt-in: STRATA_SELECTION_PDL=1): each may then be scheduled while the
// previous kernel of the stream finishes and waits (griddepcontrol.wait) before its first global
// access. Measured on the H100 it made the pipeline graphs slower, so it is off by default.
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/selection.cuh"
#include "kernels/part_limits.h"
#include "kernels/vote_rank.h"

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

// The 32-bit radix key of a valid candidate's vote: its rank key (kernels/vote_rank.h, >= 1) in
// the top kVoteRankBits bits, so the 8-bit radix passes from the top are over with
// kVoteRankPasses of them (the last at shift kVoteKeyLastShift); invalid candidates get key 0.
constexpr int kVoteKeyLastShift = 32 - 8 * kVoteRankPasses;
static_assert(kVoteRankBits == 8 * kVoteRankPasses, "rank keys are whole radix digits");
__device__ __forceinline__ uint32_t VoteKey32(float vote) {
  return VoteRankKey(vote) << (32 - kVoteRankBits);
}

// Programmatic dependent launch is off unless STRATA_SELECTION_PDL=1 is in the environment (read
// once): on the H100 it made the replayed pipeline graphs slower (bench/RESULTS.md).
bool SelectionPdlEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("STRATA_SELECTION_PDL");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return enabled;
}

// LaunchDependent (common.cuh) with programmatic serialization when SelectionPdlEnabled().
template <typename... KArgs, typename... Args>
cudaError_t LaunchSelection(void (*kernel)(KArgs...), dim3 grid, dim3 block, int cluster,
                            cudaStream_t stream, Args... args) {
  return LaunchDependent(kernel, grid, block, cluster, SelectionPdlEnabled(), stream, args...);
}

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
template <>
__device__ __forceinline__ float LoadF<__nv_fp8_e4m3>(const __nv_fp8_e4m3* p, int64_t i) {
  return static_cast<float>(p[i]);  // the stored value (kernels/backend.h "fp8 KV pools")
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

template <typename T>
__global__ void __launch_bounds__(kScoreThreads)
    ScoreSummariesKernel(const float* __restrict__ q, const T* __restrict__ summaries,
                         int group, int d, int64_t num_items, DeviceCandidates c, float scale,
                         float* __restrict__ scores) {
  extern __shared__ float qs[];  // [group, d], scaled
  const int g = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
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
      const T* s = summaries + (static_cast<int64_t>(g) * num_items + id) * 2 * d;
      for (int e = lane; e < d; e += 32) {
        const float mn = LoadAsFloat(s, e), mx = LoadAsFloat(s, d + e);
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
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
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
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
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
          key = ok ? VoteKey32(vj) : 0u;
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
  for (int pass = 0; pass < kVoteRankPasses && kk > 0; ++pass) {
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
        done_s = count == remaining - cum || shift == kVoteKeyLastShift;
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

// ---- VoteTopK over a thread-block cluster per KV head (sm_90) ----------------------------------
// ClusterVoteTopKKernel<kPer>: grid (cluster, KV heads), one cluster of `cs` <= 8 blocks per KV
// head; thread t of cluster block b owns the kPer consecutive candidates starting at
// (b * blockDim + t) * kPer (so blocks, threads and a thread's candidates are in index order),
// and keeps their keys in registers for the whole kernel. All remote (distributed shared memory)
// traffic goes to the leader block (rank 0):
//   (1) per query head, each block's (max, sum of exp(score - max)) of its scores (per warp:
//       shuffles of the max, then of the sum; across warps one rescale) is written to the
//       leader; after a cluster barrier every block merges the cs partials into the head's max
//       and 1 / sum (exponentials in this kernel are __expf: relative error ~1e-6);
//   (2) votes and keys as VoteTopKKernel (invalid candidates get key 0);
//   (3) radix select, 8 bits per pass from the top: a block histogram in shared memory (one
//       atomic per warp for the warp's most common bin), added bin by bin into the leader's
//       histogram of the pass, a cluster barrier, then every block reads the leader's histogram
//       and finds the same bin (so every block takes the same number of passes);
//   (4) compaction: a block scan of each thread's (above, equal) counts, the block totals
//       published to the leader, a cluster barrier; every thread then knows how many candidates
//       lower blocks and lower threads take and writes its own in index order; ties (keys equal
//       to the k-th) go to the lowest indices.
// A last cluster barrier keeps the leader's shared memory alive until every block has read it.
constexpr int kClusterMax = 8;
constexpr int kClusterTopKMaxThreads = 512;
constexpr int kClusterTopKMaxWarps = kClusterTopKMaxThreads / 32;
// Candidates per KV head up to which VoteTopK takes the cluster kernel (8 blocks of 512 threads
// with 16 candidates each); beyond, VoteTopKKernel.
constexpr int64_t kClusterTopKMaxCandidates = int64_t{kClusterMax} * kClusterTopKMaxThreads * 16;

__device__ __forceinline__ uint32_t WarpInclusiveScanU(uint32_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// kPacked: hp holds 128 words, bin b in the 16-bit half b & 1 of word b / 2 (counts < 65536).
template <bool kPacked = false>
__device__ __forceinline__ void HistAddAt(uint32_t* hp, uint32_t bin, uint32_t count) {
  if constexpr (kPacked) {
    atomicAdd(&hp[bin >> 1], count << (16 * (bin & 1u)));
  } else {
    atomicAdd(&hp[bin], count);
  }
}

// Adds one to bin `bin` (< 256; 256 = none) of `hist` for every lane: one atomic for all lanes
// that share the first active lane's bin (in the early passes most keys share a few bins), one
// per lane for the others. Every lane of the warp must call it.
template <bool kPacked = false>
__device__ __forceinline__ void WarpHistogramAddCommon(uint32_t* hist, uint32_t bin) {
  const unsigned active = __ballot_sync(0xffffffffu, bin < 256);
  if (active == 0) return;  // warp-uniform
  const int leader = __ffs(active) - 1;
  const uint32_t lb = __shfl_sync(0xffffffffu, bin, leader);
  const unsigned same = __ballot_sync(0xffffffffu, bin == lb);
  const int lane = threadIdx.x & 31;
  if (lane == leader) {
    HistAddAt<kPacked>(hist, lb, static_cast<uint32_t>(__popc(same)));
  } else if (bin < 256 && bin != lb) {
    HistAddAt<kPacked>(hist, bin, 1u);
  }
}

__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// ids[j] = CandidateIdAt(c, g, first + j), or -1 for first + j >= c.count; one division for all.
template <int kPer>
__device__ __forceinline__ void ConsecutiveCandidateIds(const DeviceCandidates& c, int g,
                                                        int32_t first, int32_t (&ids)[kPer]) {
  if (c.parents == nullptr) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t id = static_cast<int64_t>(c.begin) + first + j;
      ids[j] = first + j < c.count && id < c.end ? static_cast<int32_t>(id) : -1;
    }
    return;
  }
  const int32_t* pr = c.parents + static_cast<int64_t>(g) * c.num_parents;
  int32_t pi = first / c.fanout, off = first - pi * c.fanout;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    int32_t id = -1;
    if (first + j < c.count) {
      const int32_t parent = pr[pi];
      const int64_t v = static_cast<int64_t>(parent) * c.fanout + off;
      if (parent >= 0 && v >= c.begin && v < c.end) id = static_cast<int32_t>(v);
    }
    ids[j] = id;
    if (++off == c.fanout) off = 0, ++pi;
  }
}

// Step (1) of the one-block and cluster top-k kernels, per warp: for every query head h of the
// group, the max and the sum of exp(x - max) of the scores the warp's lanes hold (lane l: kPer
// consecutive scores from `mine`, row h at mine + h * n; entries at first + j >= n count as
// -inf), written to red_m[h * stride + warp] and red_l[h * stride + warp] by lane 0. With one or
// two warps per SM scheduler nothing hides latency, so the kernel's time is its longest dependent
// chain: heads go 4 at a time (independent chains interleave), a warp first takes its max
// (shuffles of fmaxf), then the sum of exp(x - max) (shuffles of adds).
template <int kPer>
__device__ __forceinline__ void WarpSoftmaxStats(const float* mine, int32_t n, int32_t first,
                                                 int group, int lane, int warp, int stride,
                                                 float* red_m, float* red_l) {
#pragma unroll 1
  for (int h0 = 0; h0 < group; h0 += 4) {
    float x[4][kPer], m[4], l[4];
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        x[hh][j] = h0 + hh < group && first + j < n ? mine[static_cast<int64_t>(h0 + hh) * n + j]
                                                    : NegInfF();
      }
    }
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
      m[hh] = NegInfF();
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (x[hh][j] > m[hh]) m[hh] = x[hh][j];  // NaN never wins
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) m[hh] = fmaxf(m[hh], __shfl_xor_sync(0xffffffffu, m[hh], o));
    }
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
      l[hh] = 0.0f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (x[hh][j] > NegInfF()) l[hh] += __expf(x[hh][j] - m[hh]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int hh = 0; hh < 4; ++hh) {
        if (h0 + hh < group) {
          red_m[(h0 + hh) * stride + warp] = m[hh];
          red_l[(h0 + hh) * stride + warp] = l[hh];
        }
      }
    }
  }
}

// The statistics of head h merged across the block's warps (red_* as WarpSoftmaxStats wrote them;
// call after a barrier): every lane of the calling warp gets the block's max in *m and the sum of
// exp(x - *m) in *l.
__device__ __forceinline__ void MergeWarpSoftmaxStats(const float* red_m, const float* red_l,
                                                      int stride, int h, int lane, int nwarps,
                                                      float* m, float* l) {
  const float mw = lane < nwarps ? red_m[h * stride + lane] : NegInfF();
  float lw = lane < nwarps ? red_l[h * stride + lane] : 0.0f;
  float mb = mw;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  lw = mw > NegInfF() ? lw * __expf(mw - mb) : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lw += __shfl_xor_sync(0xffffffffu, lw, o);
  *m = mb;
  *l = lw;
}

// Step (2) of the one-block and cluster top-k kernels: the head soft vote of the lane's kPer
// candidates (row h of the scores at mine + h * n; m_s[h] / inv_s[h]: head h's max and 1 / sum of
// exp(x - max)) and its 32-bit key, which orders candidates by vote: VoteKey32(vote), or 0 for
// a candidate that no head scores above -inf or whose bit in id_ok is clear (an invalid id), or
// that lies at or beyond n. The votes go to vote_out[j] (j < n - first) when vote_out is set.
template <int kPer>
__device__ __forceinline__ void VoteKeys(const float* mine, int32_t n, int32_t first, int group,
                                         const float* m_s, const float* inv_s, uint32_t id_ok,
                                         float* vote_out, uint32_t (&key)[kPer]) {
  float v[kPer];
  uint32_t any = 0;  // bit j: some head's score of candidate j is > -inf
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = 0.0f;
#pragma unroll 1
  for (int h0 = 0; h0 < group; h0 += 4) {
#pragma unroll
    for (int hh = 0; hh < 4; ++hh) {
      if (h0 + hh < group) {
        const float mh = m_s[h0 + hh], ih = inv_s[h0 + hh];
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const float x = first + j < n ? mine[static_cast<int64_t>(h0 + hh) * n + j] : NegInfF();
          if (x > NegInfF()) {
            any |= 1u << j;
            v[j] += __expf(x - mh) * ih;
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    float vj = v[j];
    if (!(vj >= 0.0f)) vj = 0.0f;  // NaN (from +inf scores) ranks as 0
    const bool ok = ((id_ok & any) >> j) & 1u;
    key[j] = ok ? VoteKey32(vj) : 0u;
    if (vote_out != nullptr && first + j < n) vote_out[j] = vj;
  }
}

template <int kPer>
__global__ void __launch_bounds__(kClusterTopKMaxThreads)
    ClusterVoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c, int k,
                          float* __restrict__ vote_out, int32_t* __restrict__ selected) {
  namespace cg = cooperative_groups;
  __shared__ float red_m[kSelectMaxGroup][kClusterTopKMaxWarps];
  __shared__ float red_l[kSelectMaxGroup][kClusterTopKMaxWarps];
  __shared__ float part_m[kClusterMax * kSelectMaxGroup];  // leader: [rank][head]
  __shared__ float part_l[kClusterMax * kSelectMaxGroup];
  __shared__ float m_s[kSelectMaxGroup], inv_s[kSelectMaxGroup];
  __shared__ uint32_t lhist[kVoteRankPasses * 256];  // this block's histogram of each pass
  __shared__ uint32_t chist[kVoteRankPasses * 256];  // leader: the cluster's histogram of each pass
  __shared__ uint32_t wsum_s[kClusterTopKMaxWarps];
  __shared__ uint32_t ccount[kClusterMax];  // leader: (above << 16 | equal) of each block
  __shared__ uint32_t rcount_s[kClusterMax];
  __shared__ uint32_t prefix_s, mask_s, remaining_s;
  __shared__ int done_s;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = blockIdx.y;
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  for (int b = tid; b < kVoteRankPasses * 256; b += blockDim.x) lhist[b] = 0, chist[b] = 0;
  // Every block of the cluster must have started (and the leader zeroed its histograms) before
  // any block touches the leader's shared memory: arrive here, wait before the first remote write.
  ClusterArrive();
  GridDepWait();
  GridDepLaunchDependents();
  if (c.skip != nullptr && c.skip[g] != 0) {  // a reused head: the whole cluster (same g)
    ClusterWait();  // matches the arrive above; every block of the cluster arrived
    return;
  }
  const int32_t n = c.count;
  const int32_t first = (rank * static_cast<int32_t>(blockDim.x) + tid) * kPer;
  const float* sg = scores + static_cast<int64_t>(g) * group * n;
  float* part_m0 = cluster.map_shared_rank(part_m, 0);
  float* part_l0 = cluster.map_shared_rank(part_l, 0);
  uint32_t* chist0 = cluster.map_shared_rank(chist, 0);
  uint32_t* ccount0 = cluster.map_shared_rank(ccount, 0);

  int32_t ids[kPer];  // ids of this thread's candidates, -1 when invalid or beyond n
  ConsecutiveCandidateIds<kPer>(c, g, first, ids);
  uint32_t id_ok = 0;  // bit j: ids[j] >= 0
#pragma unroll
  for (int j = 0; j < kPer; ++j) id_ok |= ids[j] >= 0 ? 1u << j : 0u;

  // (1) softmax statistics of each query head (WarpSoftmaxStats); partials meet with __expf
  // rescaling only across warps and blocks.
  const float* mine = sg + first;
  WarpSoftmaxStats<kPer>(mine, n, first, group, lane, warp, kClusterTopKMaxWarps, &red_m[0][0],
                         &red_l[0][0]);
  __syncthreads();
  ClusterWait();
  // Across warps: warp w merges head w (and w + nwarps, ...) and writes it to the leader.
  for (int h = warp; h < group; h += nwarps) {
    float mb, lw;
    MergeWarpSoftmaxStats(&red_m[0][0], &red_l[0][0], kClusterTopKMaxWarps, h, lane, nwarps, &mb,
                          &lw);
    if (lane == 0) {
      part_m0[rank * kSelectMaxGroup + h] = mb;
      part_l0[rank * kSelectMaxGroup + h] = lw;
    }
  }
  cluster.sync();
  // Across blocks: warp 0, lane h * P + r (P = cs rounded up to a power of two) holds block r's
  // partial of head h; a segmented max, rescale and sum over each P lanes.
  if (warp == 0) {
    int p2 = 1;
    while (p2 < cs) p2 <<= 1;
    const int r = lane % p2;
    for (int hb = 0; hb < group; hb += 32 / p2) {
      const int h = hb + lane / p2;
      const bool have = h < group && r < cs;
      const float mr = have ? part_m0[r * kSelectMaxGroup + h] : NegInfF();
      float lr = have ? part_l0[r * kSelectMaxGroup + h] : 0.0f;
      float mh = mr;
      for (int o = p2 / 2; o > 0; o >>= 1) mh = fmaxf(mh, __shfl_xor_sync(0xffffffffu, mh, o));
      lr = mr > NegInfF() ? lr * __expf(mr - mh) : 0.0f;
      for (int o = p2 / 2; o > 0; o >>= 1) lr += __shfl_xor_sync(0xffffffffu, lr, o);
      if (r == 0 && h < group) {
        m_s[h] = mh;
        inv_s[h] = mh == NegInfF() ? 0.0f : 1.0f / lr;
      }
    }
  }
  __syncthreads();

  // (2) votes and keys.
  uint32_t key[kPer];
  VoteKeys<kPer>(mine, n, first, group, m_s, inv_s, id_ok,
                 vote_out == nullptr ? nullptr : vote_out + static_cast<int64_t>(g) * n + first,
                 key);

  // (3) radix select of the k-th largest key over the cluster (see VoteTopKKernel step 4).
  const int32_t kk = min(k, n);
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
  if (kk == 0) prefix = 0xffffffffu, mask = 0xffffffffu, remaining = 0;  // nothing is taken
#pragma unroll 1
  for (int pass = 0; pass < kVoteRankPasses && kk > 0; ++pass) {
    const int shift = 24 - 8 * pass;
    uint32_t* lh = lhist + pass * 256;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const uint32_t bin =
          key[j] != 0 && (key[j] & mask) == prefix ? (key[j] >> shift) & 255u : 256u;
      WarpHistogramAddCommon(lh, bin);
    }
    __syncthreads();
    for (int b = tid; b < 256; b += blockDim.x) {
      const uint32_t cnt = lh[b];
      if (cnt != 0) atomicAdd(&chist0[pass * 256 + b], cnt);
    }
    cluster.sync();
    if (warp == 0) {
      const uint32_t* hc = chist0 + pass * 256;
      uint32_t cb[8], own = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        cb[j] = hc[255 - 8 * lane - j];
        own += cb[j];
      }
      const uint32_t incl = WarpInclusiveScanU(own);
      const uint32_t total = __shfl_sync(0xffffffffu, incl, 31);
      const uint32_t before = incl - own;
      const unsigned hit = __ballot_sync(0xffffffffu, incl >= remaining);
      if (total <= remaining) {
        if (lane == 0) prefix_s = prefix, mask_s = mask, remaining_s = total, done_s = 1;
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
        done_s = count == remaining - cum || shift == kVoteKeyLastShift;
      }
    }
    __syncthreads();
    prefix = prefix_s, mask = mask_s, remaining = remaining_s;
    if (done_s) break;
  }
  const uint32_t need_eq = remaining;

  // (4) compaction in index order.
  uint32_t gt = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (key[j] != 0) {
      gt += (key[j] & mask) > prefix;
      eq += (key[j] & mask) == prefix;
    }
  }
  const uint32_t own = (gt << 16) | eq;  // per block at most 512 * 16 of each: no carry
  const uint32_t incl = WarpInclusiveScanU(own);
  if (lane == 31) wsum_s[warp] = incl;
  __syncthreads();
  const uint32_t wv = lane < nwarps ? wsum_s[lane] : 0u;
  const uint32_t wincl = WarpInclusiveScanU(wv);
  const uint32_t before = __shfl_sync(0xffffffffu, wincl - wv, warp) + incl - own;
  const uint32_t block_total = __shfl_sync(0xffffffffu, wincl, 31);
  if (tid == 0) ccount0[rank] = block_total;
  cluster.sync();
  if (tid < cs) rcount_s[tid] = ccount0[tid];
  __syncthreads();
  ClusterArrive();  // this block is done with the leader's shared memory
  uint32_t eq_run = 0, eq_before_block = 0, take_before_block = 0, taken_total = 0;
  for (int r = 0; r < cs; ++r) {
    const uint32_t gr = rcount_s[r] >> 16, er = rcount_s[r] & 0xffffu;
    const uint32_t take = gr + min(er, need_eq > eq_run ? need_eq - eq_run : 0u);
    if (r < rank) take_before_block += take;
    if (r == rank) eq_before_block = eq_run;
    eq_run += er;
    taken_total += take;
  }
  const uint32_t rem_block = need_eq > eq_before_block ? need_eq - eq_before_block : 0u;
  uint32_t pos = take_before_block + (before >> 16) + min(before & 0xffffu, rem_block);
  uint32_t eq_seen = eq_before_block + (before & 0xffffu);
  int32_t* out = selected + static_cast<int64_t>(g) * k;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    bool take = false;
    if (key[j] != 0) {
      const uint32_t km = key[j] & mask;
      if (km > prefix) {
        take = true;
      } else if (km == prefix) {
        take = eq_seen < need_eq;
        ++eq_seen;
      }
    }
    if (take) {
      if (pos < static_cast<uint32_t>(k)) out[pos] = ids[j];
      ++pos;
    }
  }
  const int64_t stride = static_cast<int64_t>(cs) * blockDim.x;
  for (int64_t j = taken_total + static_cast<int64_t>(rank) * blockDim.x + tid; j < k;
       j += stride) {
    out[j] = -1;
  }
  ClusterWait();
}

// ---- VoteTopK with everything in registers (group <= 4): one block or a cluster per KV head ---
// RegisterVoteTopKKernel<kPer> (one block of T = n / kPer threads, rounded up to a warp, at most
// 1024) and ClusterRegisterVoteTopKKernel<kPer> (the same over a cluster of cs = 2 to 8 blocks,
// grid (cs, KV heads)): thread t of block b owns candidates [kPer (b T + t), + kPer) and keeps
// their scores (up to 4 query heads), ids and keys in registers for the whole kernel. Written
// for a short chain of dependent steps and few instructions (the older one-block kernels reload
// scores and merge partials in one warp, then broadcast through extra barriers):
//   (1) per warp, the max and the sum of exp(x - max) of every query head (shuffles, heads
//       interleaved); one barrier (cluster: a cluster barrier); then EVERY warp merges all the
//       per-warp partials itself (cluster: read from every block's shared memory), so no
//       broadcast barrier;
//   (2) votes and 32-bit keys from the registers, exactly as VoteKeys (invalid: key 0);
//   (3) radix select, 8 bits per pass from the top, one histogram per pass in shared memory
//       (zeroed before the first barrier, so a pass never waits for the previous pass's
//       readers): shared atomics (RegHistAdd), one barrier, every warp scans the 256 bins (8 per
//       lane, two 16-byte loads) and finds the same bin; the cluster kernel adds a cluster
//       barrier and thread b sums bin b over the blocks into the block's own copy first. Stops
//       as soon as every key equal to the prefix is taken;
//   (4) compaction in index order: per-thread (above, equal) counts, a warp scan, one barrier,
//       a scan of the per-warp totals (cluster: and of the lower blocks' totals, after a cluster
//       barrier); a thread writes its taken ids from gt_before + min(eq_before, need_eq) on, so
//       ties (keys equal to the k-th) go to the lowest indices. The cluster kernel ends with a
//       cluster barrier so that no block's shared memory goes away while another reads it.
// Nothing is written to another block's shared memory.
constexpr int kRegTopKMaxGroup = 4;
constexpr int kRegTopKMaxThreads = 1024;
constexpr int kRegTopKMaxWarps = kRegTopKMaxThreads / 32;
constexpr int64_t kRegTopKMaxCandidates = int64_t{kRegTopKMaxThreads} * 8;
// The default takes RegisterVoteTopKKernel up to kRegTopKDefaultMaxCandidates and
// ClusterRegisterVoteTopKKernel up to kRegClusterDefaultMaxCandidates (timings: TopKKernelFor).
constexpr int64_t kRegTopKDefaultMaxCandidates = 2048;
constexpr int64_t kRegClusterDefaultMaxCandidates = 8192;
constexpr int kRegClusterMaxThreads = 512;
constexpr int kRegClusterMaxWarps = kRegClusterMaxThreads / 32;
constexpr int64_t kRegClusterMaxCandidates = int64_t{kClusterMax} * kRegClusterMaxThreads * 8;

// Histogram add of the register kernels: 0 WarpHistogramAddCommon (one atomic for the first
// active lane's bin, one per lane for the others), 1 warp-aggregated through __match_any_sync,
// 2 aggregated in passes 0-1 (most keys still in the running) and one plain atomic per key from
// pass 2 on (few keys left). Chosen by STRATA_SELECTION_REG_HIST (A/B timing). Every lane of the
// warp must call it.
template <bool kPacked = false>
__device__ __forceinline__ void RegHistAdd(uint32_t* hp, uint32_t bin, int mode, int pass) {
  if (mode == 1 || (mode == 2 && pass < 2)) {
    if (__ballot_sync(0xffffffffu, bin < 256) == 0) return;  // warp-uniform
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    if (bin < 256 && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) {
      HistAddAt<kPacked>(hp, bin, static_cast<uint32_t>(__popc(peers)));
    }
  } else if (mode == 2) {
    if (bin < 256) HistAddAt<kPacked>(hp, bin, 1u);
  } else {
    WarpHistogramAddCommon<kPacked>(hp, bin);
  }
}

// exp(x) as __expf computes it (x times log2(e) rounded to f32, then ex2.approx), except that
// results below 2^-126 are 0: one MUFU.EX2 without __expf's fix-up for subnormal results. Used
// where a subnormal term cannot matter (a softmax sum with a term of 1, a vote that ranks as 0
// below 2^-25; kernels/vote_rank.h).
__device__ __forceinline__ float ExpFtz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// (m, l) and another partial softmax statistic (m2, l2) merged into (m, l), l rescaled to the
// larger max.
__device__ __forceinline__ void MergeSoftmaxPair(float& m, float& l, float m2, float l2) {
  const float mn = fmaxf(m, m2);
  if (!(mn > NegInfF())) return;  // both empty
  l = (m > NegInfF() ? l * __expf(m - mn) : 0.0f) + (m2 > NegInfF() ? l2 * __expf(m2 - mn) : 0.0f);
  m = mn;
}

// Step (1a): x[h][j] = score of query head h (< group) of candidate first + j (< n; -inf
// beyond), then the warp's max and sum of exp(x - max) of every head in m[h] / l[h] (every lane).
template <int kPer>
__device__ __forceinline__ void RegWarpStats(const float (&x)[kRegTopKMaxGroup][kPer],
                                             float (&m)[kRegTopKMaxGroup],
                                             float (&l)[kRegTopKMaxGroup]);

template <int kPer>
__device__ __forceinline__ void RegLoadAndWarpStats(const float* mine, int32_t n, int32_t first,
                                                    int group, float (&x)[kRegTopKMaxGroup][kPer],
                                                    float (&m)[kRegTopKMaxGroup],
                                                    float (&l)[kRegTopKMaxGroup]) {
  constexpr int G = kRegTopKMaxGroup;
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      x[h][j] = h < group && first + j < n ? mine[static_cast<int64_t>(h) * n + j] : NegInfF();
    }
  }
  RegWarpStats<kPer>(x, m, l);
}

// The warp's max and sum of exp(x - max) of every head of x in m[h] / l[h] (every lane; -inf
// entries count for nothing).
template <int kPer>
__device__ __forceinline__ void RegWarpStats(const float (&x)[kRegTopKMaxGroup][kPer],
                                             float (&m)[kRegTopKMaxGroup],
                                             float (&l)[kRegTopKMaxGroup]) {
  constexpr int G = kRegTopKMaxGroup;
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = NegInfF();
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (x[h][j] > m[h]) m[h] = x[h][j];  // NaN never wins
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) m[h] = fmaxf(m[h], __shfl_xor_sync(0xffffffffu, m[h], o));
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    l[h] = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      l[h] += x[h][j] > NegInfF() ? ExpFtz(x[h][j] - m[h]) : 0.0f;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) l[h] += __shfl_xor_sync(0xffffffffu, l[h], o);
  }
}

// Step (1b): each lane holds some partials (m[h], l[h]; -inf / 0 for none); every lane gets the
// merged max in mb[h] and 1 / (sum of exp(x - mb)) in inv[h] (0 for a head without a valid
// score).
__device__ __forceinline__ void RegWarpMerge(const float (&m)[kRegTopKMaxGroup],
                                             float (&l)[kRegTopKMaxGroup],
                                             float (&mb)[kRegTopKMaxGroup],
                                             float (&inv)[kRegTopKMaxGroup]) {
  constexpr int G = kRegTopKMaxGroup;
#pragma unroll
  for (int h = 0; h < G; ++h) mb[h] = m[h];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) mb[h] = fmaxf(mb[h], __shfl_xor_sync(0xffffffffu, mb[h], o));
  }
#pragma unroll
  for (int h = 0; h < G; ++h) l[h] = m[h] > NegInfF() ? l[h] * ExpFtz(m[h] - mb[h]) : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) l[h] += __shfl_xor_sync(0xffffffffu, l[h], o);
  }
#pragma unroll
  for (int h = 0; h < G; ++h) inv[h] = mb[h] == NegInfF() ? 0.0f : 1.0f / l[h];
}

// Step (2): the head soft vote of each candidate and its key (VoteKeys' order of operations: heads
// in order; NaN votes rank as 0; no valid score or an invalid id: key 0); votes to
// vote_out[j] (j < n - first) when vote_out is set.
template <int kPer>
__device__ __forceinline__ void RegVoteKeys(const float (&x)[kRegTopKMaxGroup][kPer],
                                            const float (&mb)[kRegTopKMaxGroup],
                                            const float (&inv)[kRegTopKMaxGroup],
                                            const int32_t (&ids)[kPer], int32_t n, int32_t first,
                                            float* vote_out, uint32_t (&key)[kPer]) {
  // Branch-free: every exponential is taken (an invalid score's is discarded by the select), so
  // the warp issues them back to back instead of one branch per head and candidate.
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    float v = 0.0f;
    bool any = false;
#pragma unroll
    for (int h = 0; h < kRegTopKMaxGroup; ++h) {
      const bool ok = x[h][j] > NegInfF();
      const float e = ExpFtz(x[h][j] - mb[h]);
      any = any || ok;
      v = fmaf(ok ? e : 0.0f, inv[h], v);
    }
    if (!(v >= 0.0f)) v = 0.0f;
    key[j] = any && ids[j] >= 0 ? VoteKey32(v) : 0u;
    if (vote_out != nullptr && first + j < n) vote_out[j] = v;
  }
}

// Bins of pass `pass` (shift 24 - 8 pass) of the keys still in the running (key != 0 and equal
// to prefix under mask) added to hp.
template <int kPer, bool kPacked = false>
__device__ __forceinline__ void RegHistogram(const uint32_t (&key)[kPer], uint32_t prefix,
                                             uint32_t mask, int pass, int hist_mode,
                                             uint32_t* hp) {
  const int shift = 24 - 8 * pass;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const uint32_t bin =
        key[j] != 0 && (key[j] & mask) == prefix ? (key[j] >> shift) & 255u : 256u;
    RegHistAdd<kPacked>(hp, bin, hist_mode, pass);
  }
}

// RegFindBin (below) with the bins already in registers: lane L holds cb[j] = the count of bin
// 255 - 8L - j (descending).
__device__ __forceinline__ bool RegFindBinOf(const uint32_t (&cb)[8], int pass, uint32_t* prefix,
                                             uint32_t* mask, uint32_t* remaining) {
  const int lane = threadIdx.x & 31;
  uint32_t own = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) own += cb[j];
  const uint32_t incl = WarpInclusiveScanU(own);
  const uint32_t total = __shfl_sync(0xffffffffu, incl, 31);
  if (total <= *remaining) {  // every key still in the running is taken (warp-uniform)
    *remaining = total;
    return true;
  }
  const unsigned hit = __ballot_sync(0xffffffffu, incl >= *remaining);
  const int src = __ffs(hit) - 1;
  uint32_t cum = incl - own, count = 0;
  int b = 0;
  bool found = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (!found) {
      if (cum + cb[j] >= *remaining) {
        b = 255 - 8 * lane - j;
        count = cb[j];
        found = true;
      } else {
        cum += cb[j];
      }
    }
  }
  b = __shfl_sync(0xffffffffu, b, src);
  count = __shfl_sync(0xffffffffu, count, src);
  cum = __shfl_sync(0xffffffffu, cum, src);
  const int shift = 24 - 8 * pass;
  *prefix |= static_cast<uint32_t>(b) << shift;
  *mask |= 255u << shift;
  *remaining -= cum;
  return count == *remaining || pass == kVoteRankPasses - 1;
}

// Step (3), after pass `pass`'s histogram hp (256 bins, 16-byte aligned) is complete: every lane
// of the calling warp finds the same bin. Returns true when the select is over (every key in the
// running is taken, or every key equal to the new prefix is); *remaining is then the number of
// keys equal to *prefix under *mask that are taken.
__device__ __forceinline__ bool RegFindBin(const uint32_t* hp, int pass, uint32_t* prefix,
                                           uint32_t* mask, uint32_t* remaining) {
  const int lane = threadIdx.x & 31;
  // Lane L owns bins 255 - 8L .. 248 - 8L (descending): cb[j] = bin 255 - 8L - j.
  const uint4 lo = *reinterpret_cast<const uint4*>(hp + 248 - 8 * lane);
  const uint4 hi = *reinterpret_cast<const uint4*>(hp + 252 - 8 * lane);
  const uint32_t cb[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x};
  return RegFindBinOf(cb, pass, prefix, mask, remaining);
}

// (above << 16 | equal) counts of the thread's keys against prefix under mask.
template <int kPer>
__device__ __forceinline__ uint32_t RegCounts(const uint32_t (&key)[kPer], uint32_t prefix,
                                              uint32_t mask) {
  uint32_t gt = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (key[j] != 0) {
      gt += (key[j] & mask) > prefix;
      eq += (key[j] & mask) == prefix;
    }
  }
  return (gt << 16) | eq;
}

// Step (4): `before` = (above << 16 | equal) counts of every candidate before the thread's: its
// taken ids get the output positions gt_before + min(eq_before, need_eq) on, in index order;
// emit(pos, id, j) is called for each one with pos < k (j: its index in key and ids).
template <int kPer, typename Emit>
__device__ __forceinline__ void RegForEachTaken(const uint32_t (&key)[kPer],
                                                const int32_t (&ids)[kPer], uint32_t prefix,
                                                uint32_t mask, uint32_t need_eq, uint32_t before,
                                                int k, Emit emit) {
  uint32_t eq_seen = before & 0xffffu;
  uint32_t pos = (before >> 16) + min(eq_seen, need_eq);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    bool take = false;
    if (key[j] != 0) {
      const uint32_t km = key[j] & mask;
      if (km > prefix) {
        take = true;
      } else if (km == prefix) {
        take = eq_seen < need_eq;
        ++eq_seen;
      }
    }
    if (take) {
      if (pos < static_cast<uint32_t>(k)) emit(pos, ids[j], j);
      ++pos;
    }
  }
}

// RegForEachTaken writing the ids to out.
template <int kPer>
__device__ __forceinline__ void RegWriteTaken(const uint32_t (&key)[kPer],
                                              const int32_t (&ids)[kPer], uint32_t prefix,
                                              uint32_t mask, uint32_t need_eq, uint32_t before,
                                              int k, int32_t* out) {
  RegForEachTaken<kPer>(key, ids, prefix, mask, need_eq, before, k,
                        [&](uint32_t pos, int32_t id, int) { out[pos] = id; });
}

template <int kPer>
__global__ void __launch_bounds__(kRegTopKMaxThreads)
    RegisterVoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c, int k,
                           float* __restrict__ vote_out, int32_t* __restrict__ selected,
                           int hist_mode) {
  constexpr int G = kRegTopKMaxGroup;
  __shared__ float red_m[G][kRegTopKMaxWarps], red_l[G][kRegTopKMaxWarps];
  __shared__ __align__(16) uint32_t hist[kVoteRankPasses][256];
  __shared__ uint32_t wsum_s[kRegTopKMaxWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = blockIdx.x;
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
  for (int b = tid; b < kVoteRankPasses * 256; b += blockDim.x) (&hist[0][0])[b] = 0;
  const int32_t n = c.count;
  const int32_t first = tid * kPer;
  float x[G][kPer], m[G], l[G];
  RegLoadAndWarpStats<kPer>(scores + static_cast<int64_t>(g) * group * n + first, n, first, group,
                            x, m, l);
  int32_t ids[kPer];  // -1 when invalid or beyond n
  ConsecutiveCandidateIds<kPer>(c, g, first, ids);
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) red_m[h][warp] = m[h], red_l[h][warp] = l[h];
  }
  __syncthreads();  // also orders the histogram zeroing before any pass
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = lane < nwarps ? red_m[h][lane] : NegInfF();
    l[h] = lane < nwarps ? red_l[h][lane] : 0.0f;
  }
  float mb[G], inv[G];
  RegWarpMerge(m, l, mb, inv);
  uint32_t key[kPer];
  RegVoteKeys<kPer>(x, mb, inv, ids, n, first,
                    vote_out == nullptr ? nullptr : vote_out + static_cast<int64_t>(g) * n + first,
                    key);

  const int32_t kk = min(k, n);
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
  if (kk == 0) prefix = 0xffffffffu, mask = 0xffffffffu, remaining = 0;  // nothing is taken
#pragma unroll 1
  for (int pass = 0; pass < kVoteRankPasses && kk > 0; ++pass) {
    RegHistogram<kPer>(key, prefix, mask, pass, hist_mode, hist[pass]);
    __syncthreads();
    if (RegFindBin(hist[pass], pass, &prefix, &mask, &remaining)) break;
  }

  const uint32_t own = RegCounts<kPer>(key, prefix, mask);  // <= 8192 of each: no carry
  const uint32_t incl = WarpInclusiveScanU(own);
  if (lane == 31) wsum_s[warp] = incl;
  __syncthreads();
  const uint32_t wv = lane < nwarps ? wsum_s[lane] : 0u;
  const uint32_t wincl = WarpInclusiveScanU(wv);
  const uint32_t before = __shfl_sync(0xffffffffu, wincl - wv, warp) + incl - own;
  const uint32_t total = __shfl_sync(0xffffffffu, wincl, 31);
  const uint32_t taken_total = (total >> 16) + min(total & 0xffffu, remaining);
  int32_t* out = selected + static_cast<int64_t>(g) * k;
  RegWriteTaken<kPer>(key, ids, prefix, mask, remaining, before, k, out);
  for (int64_t j = taken_total + tid; j < k; j += blockDim.x) out[j] = -1;
}

__device__ __forceinline__ void ClusterSync() {
  ClusterArrive();
  ClusterWait();
}

template <int kPer>
__global__ void __launch_bounds__(kRegClusterMaxThreads)
    ClusterRegisterVoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c,
                                  int k, float* __restrict__ vote_out,
                                  int32_t* __restrict__ selected, int hist_mode) {
  namespace cg = cooperative_groups;
  constexpr int G = kRegTopKMaxGroup;
  constexpr int W = kRegClusterMaxWarps;
  __shared__ float red_m[G][W], red_l[G][W];
  // This block's histogram of each pass, and the cluster's (this block's copy).
  __shared__ __align__(16) uint32_t hist[kVoteRankPasses][256];
  __shared__ __align__(16) uint32_t hsum[kVoteRankPasses][256];
  __shared__ uint32_t wsum_s[W];
  __shared__ uint32_t btot_s;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = blockIdx.y;
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  GridDepWait();
  GridDepLaunchDependents();
  // A reused head: every block of the cluster (same g) returns before any cluster barrier.
  if (c.skip != nullptr && c.skip[g] != 0) return;
  for (int b = tid; b < kVoteRankPasses * 256; b += blockDim.x) (&hist[0][0])[b] = 0;
  const int32_t n = c.count;
  const int32_t first = (rank * static_cast<int32_t>(blockDim.x) + tid) * kPer;
  float x[G][kPer], m[G], l[G];
  RegLoadAndWarpStats<kPer>(scores + static_cast<int64_t>(g) * group * n + first, n, first, group,
                            x, m, l);
  int32_t ids[kPer];
  ConsecutiveCandidateIds<kPer>(c, g, first, ids);
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) red_m[h][warp] = m[h], red_l[h][warp] = l[h];
  }
  ClusterSync();  // every block started, zeroed its histograms and wrote its partials
  // Lane e merges the partials e, e + 32, ... of the cs x nwarps (block-major), then the warp.
#pragma unroll
  for (int h = 0; h < G; ++h) m[h] = NegInfF(), l[h] = 0.0f;
  for (int e = lane; e < cs * nwarps; e += 32) {
    const int r = e / nwarps, w = e - r * nwarps;
    const float* rm = cluster.map_shared_rank(&red_m[0][0], r);
    const float* rl = cluster.map_shared_rank(&red_l[0][0], r);
#pragma unroll
    for (int h = 0; h < G; ++h) MergeSoftmaxPair(m[h], l[h], rm[h * W + w], rl[h * W + w]);
  }
  float mb[G], inv[G];
  RegWarpMerge(m, l, mb, inv);
  uint32_t key[kPer];
  RegVoteKeys<kPer>(x, mb, inv, ids, n, first,
                    vote_out == nullptr ? nullptr : vote_out + static_cast<int64_t>(g) * n + first,
                    key);

  const int32_t kk = min(k, n);
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
  if (kk == 0) prefix = 0xffffffffu, mask = 0xffffffffu, remaining = 0;
#pragma unroll 1
  for (int pass = 0; pass < kVoteRankPasses && kk > 0; ++pass) {
    RegHistogram<kPer>(key, prefix, mask, pass, hist_mode, hist[pass]);
    ClusterSync();
    for (int b = tid; b < 256; b += blockDim.x) {
      uint32_t s = 0;
      for (int r = 0; r < cs; ++r) s += cluster.map_shared_rank(&hist[pass][0], r)[b];
      hsum[pass][b] = s;
    }
    __syncthreads();
    if (RegFindBin(hsum[pass], pass, &prefix, &mask, &remaining)) break;
  }

  // <= 32768 of each over the cluster: no carry.
  const uint32_t own = RegCounts<kPer>(key, prefix, mask);
  const uint32_t incl = WarpInclusiveScanU(own);
  if (lane == 31) wsum_s[warp] = incl;
  __syncthreads();
  const uint32_t wv = lane < nwarps ? wsum_s[lane] : 0u;
  const uint32_t wincl = WarpInclusiveScanU(wv);
  const uint32_t block_total = __shfl_sync(0xffffffffu, wincl, 31);
  if (tid == 0) btot_s = block_total;
  ClusterSync();
  const uint32_t bt = lane < cs ? *cluster.map_shared_rank(&btot_s, lane) : 0u;
  ClusterArrive();  // this block is done reading the others' shared memory
  const uint32_t bincl = WarpInclusiveScanU(bt);
  const uint32_t total = __shfl_sync(0xffffffffu, bincl, 31);
  const uint32_t before = __shfl_sync(0xffffffffu, bincl - bt, rank) +
                          __shfl_sync(0xffffffffu, wincl - wv, warp) + incl - own;
  const uint32_t taken_total = (total >> 16) + min(total & 0xffffu, remaining);
  int32_t* out = selected + static_cast<int64_t>(g) * k;
  RegWriteTaken<kPer>(key, ids, prefix, mask, remaining, before, k, out);
  const int64_t stride = static_cast<int64_t>(cs) * blockDim.x;
  for (int64_t j = taken_total + static_cast<int64_t>(rank) * blockDim.x + tid; j < k;
       j += stride) {
    out[j] = -1;
  }
  ClusterWait();
}

// ---- VoteTopK by a bitonic sort of unique 64-bit keys (n <= 8192) ------------------------------
// BitonicVoteTopKKernel<E>: one block of T = N / E threads per KV head (E = 2, 4 or 8 candidates
// per thread; N = n rounded up to a power of two, at least 32 * E, T <= 1024), thread t owns
// candidates [Et, Et + E) in registers:
//   (1) per query head the max and the sum of exp(score - max) of the valid scores (heads 4 at a
//       time, per warp with shuffles, across warps through shared memory, one barrier), then
//       votes and the 32-bit vote keys exactly as the other kernels (invalid candidates: key 0);
//   (2) composite keys (vote key << 32 | 0xffffffff - index) are unique, and descending order is
//       vote descending with ties to the lower index; padding entries (index >= n) are 0, below
//       every candidate. A bitonic sort into descending order over the N keys: partner strides
//       below E inside a thread's registers, E to 16E through warp shuffles, 32E and up through
//       shared memory (double buffered, one barrier per stride; rows padded by one entry per E so
//       that a warp's accesses are free of bank conflicts);
//   (3) sorted entry r is taken when r < k and its vote key is not 0 (so min(k, valid) entries):
//       its index gets a flag in shared memory; after a barrier each thread counts its own E
//       flags, a block scan (warp shuffles, one barrier) gives its output slot, and it writes its
//       taken ids in index order; then -1 up to k.
constexpr int kBitonicMaxCandidates = 8192;
constexpr int kBitonicMaxThreads = 1024;
constexpr int kBitonicMaxWarps = kBitonicMaxThreads / 32;

__host__ __device__ constexpr int BitonicPadded(int i, int per) { return i + i / per; }

// Dynamic shared memory of BitonicVoteTopKKernel<per> for N sorted entries: two padded key
// buffers (only when N > 32 * per, for the strides from 32 * per up) and N flag bytes.
int64_t BitonicSmemBytes(int nsort, int per) {
  const int64_t bufs = nsort > 32 * per ? 2 * int64_t{BitonicPadded(nsort, per)} * 8 : 0;
  return bufs + nsort;
}

// Compare-exchange so that the entry of the lower index holds the larger key when `desc`.
__device__ __forceinline__ void BitonicCx(uint64_t& a, uint64_t& b, bool desc) {
  const bool swap = desc ? a < b : a > b;
  const uint64_t lo = swap ? b : a, hi = swap ? a : b;
  a = lo, b = hi;
}

template <int kPer>
__global__ void __launch_bounds__(kBitonicMaxThreads)
    BitonicVoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c, int k,
                          int nsort, float* __restrict__ vote_out, int32_t* __restrict__ selected) {
  extern __shared__ __align__(16) unsigned char bit_smem[];
  __shared__ float red_m[kSelectMaxGroup][kBitonicMaxWarps];
  __shared__ float red_l[kSelectMaxGroup][kBitonicMaxWarps];
  __shared__ float m_s[kSelectMaxGroup], inv_s[kSelectMaxGroup];
  __shared__ uint32_t wsum_s[kBitonicMaxWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = blockIdx.x;
  const int32_t n = c.count;
  const int32_t first = tid * kPer;
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
  constexpr int kWarpSpan = 32 * kPer;  // strides below it stay inside a warp
  const bool bufs = nsort > kWarpSpan;
  uint64_t* buf0 = reinterpret_cast<uint64_t*>(bit_smem);
  uint64_t* buf1 = buf0 + BitonicPadded(nsort, kPer);
  unsigned char* flags = bit_smem + (bufs ? 2 * int64_t{BitonicPadded(nsort, kPer)} * 8 : 0);
#pragma unroll
  for (int j = 0; j < kPer; ++j) flags[first + j] = 0;
  const float* mine = scores + static_cast<int64_t>(g) * group * n + first;

  int32_t ids[kPer];
  ConsecutiveCandidateIds<kPer>(c, g, first, ids);

  // (1) softmax statistics (as ClusterVoteTopKKernel, one block).
  WarpSoftmaxStats<kPer>(mine, n, first, group, lane, warp, kBitonicMaxWarps, &red_m[0][0],
                         &red_l[0][0]);
  __syncthreads();
  for (int h = warp; h < group; h += nwarps) {
    float mb, lw;
    MergeWarpSoftmaxStats(&red_m[0][0], &red_l[0][0], kBitonicMaxWarps, h, lane, nwarps, &mb,
                          &lw);
    if (lane == 0) {
      m_s[h] = mb;
      inv_s[h] = mb == NegInfF() ? 0.0f : 1.0f / lw;
    }
  }
  __syncthreads();
  uint32_t id_ok = 0;  // bit j: ids[j] >= 0
#pragma unroll
  for (int j = 0; j < kPer; ++j) id_ok |= ids[j] >= 0 ? 1u << j : 0u;
  uint32_t vkey[kPer];
  VoteKeys<kPer>(mine, n, first, group, m_s, inv_s, id_ok,
                 vote_out == nullptr ? nullptr : vote_out + static_cast<int64_t>(g) * n + first,
                 vkey);
  uint64_t key[kPer];  // unique: the vote key, then the index reversed (ties to the lower index)
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    key[j] = first + j < n ? (static_cast<uint64_t>(vkey[j]) << 32) |
                                 (0xffffffffu - static_cast<uint32_t>(first + j))
                           : 0ull;
  }

  // (2) bitonic sort, descending. Entry i = kPer * tid + j pairs with i ^ stride.
  int parity = 0;
#pragma unroll 1
  for (int size = 2; size <= nsort; size <<= 1) {
#pragma unroll 1
    for (int stride = size >> 1; stride >= kWarpSpan; stride >>= 1) {
      uint64_t* b = parity ? buf1 : buf0;
      parity ^= 1;
#pragma unroll
      for (int j = 0; j < kPer; ++j) b[BitonicPadded(first + j, kPer)] = key[j];
      __syncthreads();
      const int pfirst = first ^ stride;
      const bool desc = (first & size) == 0, lower = (first & stride) == 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const uint64_t y = b[BitonicPadded(pfirst + j, kPer)];
        const bool keep_max = desc == lower;
        key[j] = keep_max ? (key[j] > y ? key[j] : y) : (key[j] < y ? key[j] : y);
      }
    }
#pragma unroll 1
    for (int stride = min(size >> 1, kWarpSpan / 2); stride >= kPer; stride >>= 1) {
      const int lm = stride / kPer;
      const bool desc = (first & size) == 0, lower = (first & stride) == 0;
      const bool keep_max = desc == lower;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const uint64_t y = __shfl_xor_sync(0xffffffffu, key[j], lm);
        key[j] = keep_max ? (key[j] > y ? key[j] : y) : (key[j] < y ? key[j] : y);
      }
    }
    // size >= kPer: the direction is the same for the thread's entries; size < kPer: entry i's
    // direction is (i & size) == 0, i.e. (j & size) == 0.
    const bool desc = (first & size) == 0;
#pragma unroll
    for (int stride = kPer / 2; stride > 0; stride >>= 1) {
      if (stride < size) {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          if ((j & stride) == 0) {
            BitonicCx(key[j], key[j | stride], size < kPer ? ((j & size) == 0) : desc);
          }
        }
      }
    }
  }

  // (3) flags of the taken entries, then compaction in index order.
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (first + j < k && (key[j] >> 32) != 0) {
      flags[0xffffffffu - static_cast<uint32_t>(key[j])] = 1;
    }
  }
  __syncthreads();
  uint32_t fl = 0;  // bit j: entry first + j is taken
#pragma unroll
  for (int j = 0; j < kPer; ++j) fl |= static_cast<uint32_t>(flags[first + j]) << j;
  const uint32_t own = __popc(fl);
  const uint32_t incl = WarpInclusiveScanU(own);
  if (lane == 31) wsum_s[warp] = incl;
  __syncthreads();
  const uint32_t wv = lane < nwarps ? wsum_s[lane] : 0u;
  const uint32_t wincl = WarpInclusiveScanU(wv);
  uint32_t pos = __shfl_sync(0xffffffffu, wincl - wv, warp) + incl - own;
  const uint32_t taken_total = __shfl_sync(0xffffffffu, wincl, 31);
  int32_t* out = selected + static_cast<int64_t>(g) * k;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if ((fl >> j) & 1u) out[pos++] = ids[j];
  }
  for (int64_t j = taken_total + tid; j < k; j += blockDim.x) out[j] = -1;
}

// Fast path of both scoring ops: 8 lanes per candidate (4 candidates per warp and round), each
// lane reading 16-byte vectors so that the 8 lanes of a candidate cover 128 contiguous bytes per
// load; a block takes kRounds rounds of 32 candidates at once and issues every load of every
// round (ids, then page-table entries, then rows) before the first FMA, so a lane has up to 16
// loads of 16 bytes in flight. The 8 partial sums of a candidate meet in 3 shuffles; lane h % 8
// writes the score of head h. kMinMax: rows are f32 or bf16 summaries [min(D), max(D)]; otherwise KV rows
// of D elements of T (keys). Launched with programmatic dependent launch: the first global access
// waits for the previous kernel (GridDepWait).
constexpr int kSubLanes = 8;
constexpr int kFastCandidatesPerBlock = kScoreWarps * (32 / kSubLanes);

template <typename T>
__device__ __forceinline__ void Convert16(const uint4& raw, float (&f)[16 / sizeof(T)]);
template <>
__device__ __forceinline__ void Convert16<float>(const uint4& raw, float (&f)[4]) {
  f[0] = __uint_as_float(raw.x), f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z), f[3] = __uint_as_float(raw.w);
}
template <>
__device__ __forceinline__ void Convert16<__nv_bfloat16>(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = __bfloat1622float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

// Loads per lane per candidate of FastScoreKernel, and rounds per block (up to 16 loads in flight).
template <typename T, int D, bool kMinMax>
constexpr int FastLoads() {
  return (kMinMax ? 2 : 1) * D / (kSubLanes * (16 / static_cast<int>(sizeof(T))));
}
// bf16 summary rows take the f32 rows' rounds (the same candidates per block, so as many blocks;
// half the loads in flight): with 16 loads in flight they would give half the blocks, which made
// the latency-bound segment and page scoring slower on the H100 (6.9 against 4.7 us for 1024
// segments x 8 KV heads, session 7).
template <typename T, int D, bool kMinMax>
constexpr int FastRounds() {
  if constexpr (kMinMax && sizeof(T) == 2) {
    return FastLoads<float, D, true>() >= 16 ? 1 : 16 / FastLoads<float, D, true>();
  } else {
    return FastLoads<T, D, kMinMax>() >= 16 ? 1 : 16 / FastLoads<T, D, kMinMax>();
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
  constexpr int kLoads = FastLoads<T, D, kMinMax>();
  constexpr int kRounds = FastRounds<T, D, kMinMax>();
  constexpr int kPerBlock = kFastCandidatesPerBlock * kRounds;
  __shared__ __align__(16) float qs[kSelectMaxGroup * D];
  const int g = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane / kSubLanes, sl = lane % kSubLanes;
  GridDepWait();
  GridDepLaunchDependents();
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
  const float* qg = q + static_cast<int64_t>(g) * group * D;
  for (int i = tid; i < group * D; i += kScoreThreads) qs[i] = scale * qg[i];
  bool staged = false;  // qs is read only after the block's first barrier
  for (int32_t base = blockIdx.x * kPerBlock; base < c.count; base += gridDim.x * kPerBlock) {
    int32_t idx[kRounds];
    int32_t id[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      idx[r] = base + r * kFastCandidatesPerBlock + warp * (32 / kSubLanes) + sub;
      id[r] = idx[r] < c.count ? CandidateIdAt(c, g, idx[r]) : -1;
    }
    const T* row[kRounds];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      row[r] = nullptr;
      if constexpr (kMinMax) {
        if (id[r] >= 0 && id[r] < num_items) {
          row[r] = rows + (static_cast<int64_t>(g) * num_items + id[r]) * 2 * D;
        }
      } else {
        const int64_t rr = TokenRow(table, table_pages, num_slots, page_size, g, id[r]);
        if (rr >= 0) row[r] = rows + rr * D;
      }
    }
    uint4 raw[kRounds][kLoads];
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        const int e = (j * kSubLanes + sl) * kEpl;
        if (row[r] != nullptr) {
          raw[r][j] = __ldg(reinterpret_cast<const uint4*>(row[r] + e));
          if constexpr (kMinMax) raw[r][kSteps + j] = __ldg(reinterpret_cast<const uint4*>(row[r] + D + e));
        } else {
          raw[r][j] = make_uint4(0, 0, 0, 0);
          if constexpr (kMinMax) raw[r][kSteps + j] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    if (!staged) {
      __syncthreads();  // every thread of the block runs the same iterations
      staged = true;
    }
#pragma unroll
    for (int r = 0; r < kRounds; ++r) {
      float a[kSteps][kEpl], b[kMinMax ? kSteps : 1][kEpl];
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        Convert16<T>(raw[r][j], a[j]);
        if constexpr (kMinMax) Convert16<T>(raw[r][kSteps + j], b[j]);
      }
      // Heads in a loop, not unrolled (code size: see ClusterVoteTopKKernel).
#pragma unroll 1
      for (int h = 0; h < group; ++h) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kSteps; ++j) {
          const float* qv = qs + h * D + (j * kSubLanes + sl) * kEpl;
#pragma unroll
          for (int x = 0; x < kEpl; x += 4) {
            const float4 v4 = *reinterpret_cast<const float4*>(qv + x);
            const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
            for (int y = 0; y < 4; ++y) {
              if constexpr (kMinMax) {
                acc += fmaxf(v[y] * a[j][x + y], v[y] * b[j][x + y]);
              } else {
                acc += v[y] * a[j][x + y];
              }
            }
          }
        }
#pragma unroll
        for (int o = kSubLanes / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (idx[r] < c.count && (h % kSubLanes) == sl) {
          scores[(static_cast<int64_t>(g) * group + h) * c.count + idx[r]] =
              row[r] != nullptr ? acc : NegInfF();
        }
      }
    }
  }
}

template <typename T, int D, bool kMinMax>
unsigned FastScoreBlocks(int32_t count) {
  constexpr int kPerBlock = kFastCandidatesPerBlock * FastRounds<T, D, kMinMax>();
  const int64_t blocks = (static_cast<int64_t>(count) + kPerBlock - 1) / kPerBlock;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535)));
}

// Launches FastScoreKernel<T, D, kMinMax> with programmatic dependent launch.
template <typename T, int D, bool kMinMax>
cudaError_t LaunchFastScore(const float* q, const T* rows, int64_t num_items, int64_t num_slots,
                            int page_size, const int32_t* table, int table_pages,
                            int num_kv_heads, int group, const DeviceCandidates& c, float scale,
                            float* scores, cudaStream_t stream) {
  const dim3 grid(FastScoreBlocks<T, D, kMinMax>(c.count), num_kv_heads);
  return LaunchSelection(FastScoreKernel<T, D, kMinMax>, grid, dim3(kScoreThreads), 1, stream, q,
                         rows, num_items, num_slots, page_size, table, table_pages, group, c,
                         scale, scores);
}

// ScoreKeys fast path for bf16 keys of head_dim 128, group <= 4 and power-of-two page size and
// fanout (the tokenselect shape): PagedKeyScoreKernel. 8 lanes per candidate, lane s of a
// candidate owns dims [8s, 8s + 8) and [64 + 8s, 64 + 8s + 8) (two 16-byte loads, 128 contiguous
// bytes per load across the 8 lanes) and keeps the scaled query of every head of the group for
// those 16 dims in registers (no shared memory, no barrier); candidate ids and page-table
// entries come from shifts and masks instead of divisions (Nsight counted 3,300 instructions
// per warp in FastScoreKernel for 8192 keys, IMAD/ISETP more than the FFMAs). A block of 256
// threads takes kKeyRounds rounds of 32 candidates and issues all their loads before the FMAs.
// The 4 heads' partial sums meet in 4 shuffles (a transposing reduction: lane s ends with head
// 2 * (s >> 2 & 1) + (s >> 1 & 1)), and even lanes write.
// kKeyRounds: 8 (H100, 8192 keys x 8 KV heads, graph of the op alone: 7.3-7.4 us against 8.9
// with 4 and 12.2 with 2; STRATA_SELECTION_KEY_ROUNDS=2|4 for A/B timing).
template <int kKeyRounds>
__global__ void __launch_bounds__(kScoreThreads, 2)
    PagedKeyScoreKernel(const float* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
                        int64_t num_slots, int page_shift, const int32_t* __restrict__ table,
                        int table_pages, int group, DeviceCandidates c, int fanout_shift,
                        float scale, float* __restrict__ scores) {
  constexpr int D = 128;
  constexpr int kKeyCandidatesPerBlock = kScoreWarps * (32 / kSubLanes) * kKeyRounds;
  const int g = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane / kSubLanes, sl = lane % kSubLanes;
  GridDepWait();
  GridDepLaunchDependents();
  if (c.skip != nullptr && c.skip[g] != 0) return;  // a reused head: whole block
  // Scaled query of each head for the lane's 16 dims (heads >= group: zeros, never written).
  float qr[4][16];
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const float* qh = q + (static_cast<int64_t>(g) * group + h) * D;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (h < group) f = *reinterpret_cast<const float4*>(qh + half * 64 + sl * 8 + v * 4);
        qr[h][half * 8 + v * 4 + 0] = scale * f.x;
        qr[h][half * 8 + v * 4 + 1] = scale * f.y;
        qr[h][half * 8 + v * 4 + 2] = scale * f.z;
        qr[h][half * 8 + v * 4 + 3] = scale * f.w;
      }
    }
  }
  const int32_t page_mask = (1 << page_shift) - 1, fanout_mask = (1 << fanout_shift) - 1;
  const int hsel = ((sl >> 2) & 1) * 2 + ((sl >> 1) & 1);  // head this lane ends with
  const bool writer = (sl & 1) == 0 && hsel < group;
  for (int32_t base = blockIdx.x * kKeyCandidatesPerBlock; base < c.count;
       base += gridDim.x * kKeyCandidatesPerBlock) {
    int32_t idx[kKeyRounds];
    const __nv_bfloat16* row[kKeyRounds];
#pragma unroll
    for (int r = 0; r < kKeyRounds; ++r) {
      idx[r] = base + r * (kScoreWarps * (32 / kSubLanes)) + warp * (32 / kSubLanes) + sub;
      int64_t id = -1;
      if (idx[r] < c.count) {
        if (c.parents == nullptr) {
          id = static_cast<int64_t>(c.begin) + idx[r];
        } else {
          const int32_t parent =
              c.parents[static_cast<int64_t>(g) * c.num_parents + (idx[r] >> fanout_shift)];
          if (parent >= 0) {
            id = (static_cast<int64_t>(parent) << fanout_shift) + (idx[r] & fanout_mask);
          }
        }
        if (id < c.begin || id >= c.end) id = -1;
      }
      row[r] = nullptr;
      if (id >= 0) {
        const int32_t page = static_cast<int32_t>(id >> page_shift);
        if (page < table_pages) {
          const int32_t slot = table[static_cast<int64_t>(g) * table_pages + page];
          if (slot >= 0 && slot < num_slots) {
            row[r] = k_pool + ((static_cast<int64_t>(slot) << page_shift) +
                               (static_cast<int32_t>(id) & page_mask)) * D;
          }
        }
      }
    }
    uint4 raw[kKeyRounds][2];
#pragma unroll
    for (int r = 0; r < kKeyRounds; ++r) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        raw[r][half] = row[r] != nullptr
                           ? __ldg(reinterpret_cast<const uint4*>(row[r] + half * 64 + sl * 8))
                           : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int r = 0; r < kKeyRounds; ++r) {
      float kf[16];
      Convert16<__nv_bfloat16>(raw[r][0], *reinterpret_cast<float(*)[8]>(&kf[0]));
      Convert16<__nv_bfloat16>(raw[r][1], *reinterpret_cast<float(*)[8]>(&kf[8]));
      float a[4];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        a[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < 16; ++e) a[h] = fmaf(qr[h][e], kf[e], a[h]);
      }
      // Transposing reduction over the candidate's 8 lanes.
      const bool upper = (sl & 4) != 0, mid = (sl & 2) != 0;
      const float s0 = upper ? a[0] : a[2], s1 = upper ? a[1] : a[3];
      float b0 = (upper ? a[2] : a[0]) + __shfl_xor_sync(0xffffffffu, s0, 4);
      float b1 = (upper ? a[3] : a[1]) + __shfl_xor_sync(0xffffffffu, s1, 4);
      float cc = (mid ? b1 : b0) + __shfl_xor_sync(0xffffffffu, mid ? b0 : b1, 2);
      cc += __shfl_xor_sync(0xffffffffu, cc, 1);
      if (writer && idx[r] < c.count) {
        scores[(static_cast<int64_t>(g) * group + hsel) * c.count + idx[r]] =
            row[r] != nullptr ? cc : NegInfF();
      }
    }
  }
}

// log2(v) for a power of two v >= 1, else -1.
int Log2Exact(int64_t v) {
  if (v < 1 || (v & (v - 1)) != 0) return -1;
  int s = 0;
  while ((int64_t{1} << s) < v) ++s;
  return s;
}

// PagedKeyScoreKernel for ScoreKeys where it applies, unless STRATA_SELECTION_KEYS=generic (A/B
// timing and tests of FastScoreKernel); read at every launch.
bool PagedKeyScoreEnabled() {
  const char* e = std::getenv("STRATA_SELECTION_KEYS");
  return e == nullptr || std::string_view(e) != "generic";
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

// A summary row's min (rounded toward -inf) and max (toward +inf) stored as S.
template <typename S>
__device__ __forceinline__ void StoreMinMax(S* r, int d, int e, float lo, float hi);
template <>
__device__ __forceinline__ void StoreMinMax<float>(float* r, int d, int e, float lo, float hi) {
  r[e] = lo;
  r[d + e] = hi;
}
template <>
__device__ __forceinline__ void StoreMinMax<__nv_bfloat16>(__nv_bfloat16* r, int d, int e,
                                                           float lo, float hi) {
  r[e] = __float2bfloat16_rd(lo);
  r[d + e] = __float2bfloat16_ru(hi);
}

template <typename KV, typename S>
__global__ void __launch_bounds__(kSumThreads)
    PageSummaryKernel(const KV* __restrict__ k_pool, int64_t num_slots, int page_size, int d,
                      const int32_t* __restrict__ table, int table_pages, int64_t end,
                      int64_t page_begin, S* __restrict__ pages, int64_t max_pages) {
  const int g = blockIdx.y;
  const int64_t pg = page_begin + blockIdx.x;
  S* r = pages + (static_cast<int64_t>(g) * max_pages + pg) * 2 * d;
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
    StoreMinMax(r, d, e, lo, hi);
  }
}

template <typename S>
__global__ void __launch_bounds__(kSumThreads)
    SegmentSummaryKernel(const S* __restrict__ pages, int64_t max_pages, int d,
                         int64_t seg_begin, int64_t total_pages, int segment_pages,
                         S* __restrict__ segments, int64_t max_segments) {
  const int g = blockIdx.y;
  const int64_t sg = seg_begin + blockIdx.x;
  S* r = segments + (static_cast<int64_t>(g) * max_segments + sg) * 2 * d;
  const int64_t p0 = sg * segment_pages, p1 = min(total_pages, p0 + segment_pages);
  for (int e = threadIdx.x; e < d; e += kSumThreads) {
    float lo = 0.0f, hi = 0.0f;
    for (int64_t pg = p0; pg < p1; ++pg) {
      const S* q = pages + (static_cast<int64_t>(g) * max_pages + pg) * 2 * d;
      const float a = LoadAsFloat(q, e), b = LoadAsFloat(q, d + e);
      lo = pg == p0 ? a : fminf(lo, a);
      hi = pg == p0 ? b : fmaxf(hi, b);
    }
    StoreMinMax(r, d, e, lo, hi);  // exact: the rows are S already
  }
}

// ---- SelectStages: every stage of a decode step's selection in one kernel -------------------
// SelectStagesKernel: grid (cs, KV heads), one cluster of cs (8 or 16) blocks of 256 threads per
// KV head g (kernels/backend.h SelectStagesParams). At the start each block builds the query's
// tensor-core operands (StageATables) and initialises its mbarriers. For each stage in order,
// block r owns the stage's candidates [r * per, (r + 1) * per) (per = ceil(n / cs) <= 1024) and
//   (1) scores them into shared memory on tensor cores (StageScoreMma below: bf16 rows, the
//       query split into three bf16 parts, f32 accumulation; fp8 key rows as f16 with the
//       query's parts f16, SelectStagesKernel<*, true>), within f32 rounding of the scores of
//       ScoreSummaries / ScoreKeys;
//   (2) warp h < 4 takes head h's max (from each lane's max of the scores it wrote in (1),
//       reduced per warp) and sum of exp(x - max) over the block's scores; the block's
//       partials go to every block (st.async onto its mbarrier); every warp merges the cs
//       partials in block order (every block gets the same bits); thread t takes the block's
//       candidates [4t, 4t + 4) and computes votes and 32-bit keys as RegisterVoteTopKKernel;
//   (3) radix select, 8 bits per pass from the top: the block's histogram of the pass as 128
//       words of two 16-bit counts (a block holds <= 1024 keys, the cluster <= 16384), pushed by
//       warp 0 to every block (16 bytes per lane and block, double-buffered slots); every warp
//       sums the cs copies of its lane's bins (248 - 8L .. 255 - 8L) and finds the same bin
//       from registers (RegFindBinOf);
//   (4) compaction as ClusterRegisterVoteTopKKernel: per-thread (above, equal) counts, a block
//       scan, block totals pushed to every block; the taken ids go to the stage's `selected` in
//       index order (ties to the lowest indices), -1 up to k, and, when a stage or the attention
//       follows, to the shared memory of the (one or two) blocks whose candidates or rows are
//       their children, as that stage's parents (RegForEachTaken).
// SelectStagesKernel<kStagesAttendRows | kStagesAttendScored> then attends the last stage's
// selection (DeviceSelectAttend; the section before the kernel); a skipped head skips the stages
// and attends its kept selection.
// Why pushes and not cluster barriers: on Hopper barrier.cluster.arrive.release compiles to a
// GPU-scope memory barrier (MEMBAR.ALL.GPU) and wait.acquire invalidates L1; the H200 measured
// 190 ns per cluster barrier without memory traffic and 700-900 ns after a global store
// (cuda_cluster_latency_bench). The kernel keeps one split relaxed barrier at the start (the
// mbarriers initialised before any push) and one at the end (no block leaves while another may
// still push to it). A receive slot is written again only after its reader has pushed something
// the writer waited for since (the per-stage order of pushes), so no barrier guards reuse.
constexpr int kStagesThreads = 256;
constexpr int kStagesWarps = kStagesThreads / 32;
constexpr int kStagesPer = 4;  // candidates per thread
constexpr int kStagesMaxPerBlock = kStagesThreads * kStagesPer;
constexpr int kStagesMaxCluster = 16;
static_assert(kStagesWarps == kScoreWarps, "the scoring rounds assume 8 warps");

// CandidateIdAt with the KV head's parents at `parents` (nullptr: a plain range): the first
// stage's from global memory, a later stage's from the block's copy in shared memory.
__device__ __forceinline__ int32_t StageCandidateId(const DeviceCandidates& c,
                                                    const int32_t* parents, int32_t i) {
  int64_t id;
  if (parents == nullptr) {
    id = static_cast<int64_t>(c.begin) + i;
  } else {
    const int32_t parent = parents[i / c.fanout];
    if (parent < 0) return -1;
    id = static_cast<int64_t>(parent) * c.fanout + i % c.fanout;
  }
  return id >= c.begin && id < c.end ? static_cast<int32_t>(id) : -1;
}

// ---- Stage scoring on tensor cores ---------------------------------------------------------
// A stage's scores are one small matrix product per block: scores[h, i] = Q'[h, :] . R[i, :] over
// K columns, R[i, :] the candidate's bf16 row. Keys (K = 128): Q' = v = scale * q of head h.
// Minmax summaries (K = 256, the row [min | max]): since max(v min, v max) = min(v, 0) min +
// max(v, 0) max whenever min <= max, Q' = [min(v, 0) | max(v, 0)] (the bound is a dot product).
// Q' is f32: it is split into three bf16 parts (hi, mid, lo; x = hi + mid + lo exactly for
// normal values), rows 4s + h of the 16-row A operand of mma.m16n8k16 (rows 12-15 zero), so each
// product with a bf16 row element is exact and the f32 accumulation leaves a score within f32
// rounding of the CUDA-core one. Each warp takes tiles of 8 candidates: lane l loads 16 bytes at
// columns 32p + 8(l % 4) of candidate l / 4's row for every 32-column group p, which are the B
// fragments of the group's two mmas once the K order inside the group is permuted (A and B alike:
// a dot product does not depend on the order of its terms). Non-finite summary values (a row with
// inf or NaN) are not supported: 0 * inf is NaN here where the CUDA-core bound ignores it.
constexpr int kStagesTileN = 8;  // candidates per mma tile

// The stages' and the attention's products on fp8 pools (SelectStagesKernel<*, true>): the e4m3
// codes become f16 exactly (one cvt per two), so the mmas are f16 ones, and the query's three
// parts are f16 (hi + mid + lo = x exactly for the scaled values below). f16's range is narrow, so
// each head's query is scaled by 2^s_h (s_h = 14 - floor(log2 max |x|), at most 100: the largest
// part below 2^15) and its scores by 2^-s_h after the sum (both exact). Mma is the product of the
// kernel's pool format: bf16 rows and bf16 parts, or fp8 rows as f16 and f16 parts.
template <bool kF8>
__device__ __forceinline__ void MmaOf(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  if constexpr (kF8) {
    MmaF16(d, a, b0, b1);
  } else {
    MmaBf16(d, a, b0, b1);
  }
}

// The two e4m3 codes in the low 16 bits of v (low byte first) as two f16 (low half first). The
// same conversion as common.cuh's E4m3PairToF16x2, kept in the intrinsic's form: the fp8 forms
// of SelectStagesKernel were measured with it (its PTX moves the halves separately), and this
// kernel's time moves with its code.
__device__ __forceinline__ uint32_t Fp8x2ToHalf2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu),
                                                   __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// Eight e4m3 codes (two words, low byte first) as eight f16: the 16 bytes of a B fragment load.
__device__ __forceinline__ uint4 Fp8x8ToHalf8(uint32_t w0, uint32_t w1) {
  return make_uint4(Fp8x2ToHalf2(w0), Fp8x2ToHalf2(w0 >> 16), Fp8x2ToHalf2(w1),
                    Fp8x2ToHalf2(w1 >> 16));
}

// An fp8 key row is read by lane t of a tile as bytes [16t, 16t + 16) and [64 + 16t, 80 + 16t)
// (two 16-byte loads instead of the bf16 row's four), whose halves are the B fragments of column
// groups 0 and 1, then 2 and 3. So the fp8 key table (and an fp8 K staging row converted for the
// attention) holds dim 64 (p / 2) + 16t + 8 (p % 2) + e at column 32p + 8t + e.
__device__ __forceinline__ int Fp8KeyColumn(int dim) {
  const int hi = dim >> 6, t = (dim >> 4) & 3, half = (dim >> 3) & 1, e = dim & 7;
  return 32 * (2 * hi + half) + 8 * t + e;
}

// The A operands of a kernel's stages in shared memory, built once per block: bf16 rows
// 4 * part + h (part 0 hi, 1 mid, 2 lo of head h; rows 12-15 zero) of Q' for summaries (K = 256)
// and for keys (K = 128), rows padded so that the 16-byte fragment loads of a warp do not
// conflict.
constexpr int kStagesSumStride = 256 + 32, kStagesKeyStride = 128 + 32;  // bf16 per row

// kF8: the key table is f16 for fp8 keys (columns as Fp8KeyColumn), head h's query scaled by
// 2^s_h, its products to be scaled by key_descale[h] = 2^-s_h (MmaOf above;
// written here, read after the caller's next __syncthreads).
// kSummaries false: the key table only (sum_a is not written; SelectedDecodeMmaKernel);
// kThreadsT: the threads of the calling block.
template <bool kF8 = false, bool kSummaries = true, int kThreadsT = kStagesThreads>
__device__ __forceinline__ void StageATables(const float* q, float scale, int g, int group,
                                             __nv_bfloat16* sum_a, __nv_bfloat16* key_a,
                                             float* key_descale = nullptr) {
  constexpr int D = 128;
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.0f);
  for (int i = threadIdx.x; i < 4 * D; i += kThreadsT) {
    const int h = i / D, dim = i % D;
    const float x = h < group ? scale * q[(static_cast<int64_t>(g) * group + h) * D + dim] : 0.0f;
    if constexpr (kF8) {
      // Head h (the same in the whole warp) scaled by 2^s_h: every warp of the head finds its
      // max itself (no barrier); the head's first warp writes the pair.
      const int lane = threadIdx.x & 31;
      float m = 0.0f;
      if (h < group) {
#pragma unroll
        for (int j = 0; j < D / 32; ++j) {
          m = fmaxf(m, fabsf(scale * q[(static_cast<int64_t>(g) * group + h) * D + lane + 32 * j]));
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const int sh = m > 0.0f && m <= FLT_MAX ? min(100, 14 - ilogbf(m)) : 0;
      const float up = ldexpf(1.0f, sh);
      if (dim == 0) key_descale[h] = ldexpf(1.0f, -sh);
      __half* t = reinterpret_cast<__half*>(key_a);
      const int c = Fp8KeyColumn(dim);
      const float xk = x * up;
      const __half hi = __float2half_rn(xk);
      const float r1 = xk - __half2float(hi);
      const __half mid = __float2half_rn(r1);
      const __half lo = __float2half_rn(r1 - __half2float(mid));
      t[(0 * 4 + h) * kStagesKeyStride + c] = hi;
      t[(1 * 4 + h) * kStagesKeyStride + c] = mid;
      t[(2 * 4 + h) * kStagesKeyStride + c] = lo;
      t[(3 * 4 + h) * kStagesKeyStride + c] = __float2half_rn(0.0f);
    }
    // Summaries: column dim pairs with min (min(x, 0)), column D + dim with max (max(x, 0)).
    const float xs[3] = {fminf(x, 0.0f), fmaxf(x, 0.0f), x};
    const int col[3] = {dim, D + dim, dim};
#pragma unroll
    for (int w = kSummaries ? 0 : 2; w < (kF8 ? 2 : 3); ++w) {
      const __nv_bfloat16 hi = __float2bfloat16_rn(xs[w]);
      const float r1 = xs[w] - __bfloat162float(hi);
      const __nv_bfloat16 mid = __float2bfloat16_rn(r1);
      const __nv_bfloat16 lo = __float2bfloat16_rn(r1 - __bfloat162float(mid));
      __nv_bfloat16* t = w < 2 ? sum_a : key_a;
      const int stride = w < 2 ? kStagesSumStride : kStagesKeyStride;
      t[(0 * 4 + h) * stride + col[w]] = hi;
      t[(1 * 4 + h) * stride + col[w]] = mid;
      t[(2 * 4 + h) * stride + col[w]] = lo;
      t[(3 * 4 + h) * stride + col[w]] = zero;
    }
  }
}

// The lane's A fragments of column group p (K columns 32p .. 32p + 31, two mmas: a[0], a[1])
// from a table of StageATables: row r = lane / 4 and row r + 8, columns 32p + 8(lane % 4) + 0..7
// (mma 0: k 2t, 2t + 1 -> +0, +1 and k 8 + 2t, 9 + 2t -> +2, +3; mma 1: +4 .. +7).
__device__ __forceinline__ void StageAFragments(const __nv_bfloat16* table, int stride, int p,
                                                uint32_t (&a)[2][4]) {
  const int lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3;
  const uint4 u = *reinterpret_cast<const uint4*>(table + r * stride + 32 * p + 8 * t);
  const uint4 v = *reinterpret_cast<const uint4*>(table + (r + 8) * stride + 32 * p + 8 * t);
  a[0][0] = u.x, a[0][1] = v.x, a[0][2] = u.y, a[0][3] = v.y;
  a[1][0] = u.z, a[1][1] = v.z, a[1][2] = u.w, a[1][3] = v.w;
}

// One tile's scores from its two mma accumulators (c[0], c[1]: the column group's two halves of
// K) into sc[h][first + i] (i < 8, first + i < count; -inf where the row is invalid). `ok`: the
// lane's row (candidate first + lane / 4) is valid.
// kF8: the sums are scaled by descale (the lane's head's 2^-s_h). kScStride: sc's row length.
template <bool kF8 = false, int kScStride = kStagesMaxPerBlock>
__device__ __forceinline__ void StageStoreTile(const float (&c)[2][4], bool ok, int32_t first,
                                               int32_t count, int group,
                                               float (*sc)[kScStride], float& vmax,
                                               float descale = 1.0f) {
  const int lane = threadIdx.x & 31, r = lane >> 2, t = lane & 3;
  float cc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) cc[e] = c[0][e] + c[1][e];
  // Lane l < 16: head r, candidates 2t and 2t + 1 of the tile: part 0 (row r, here), part 1
  // (row r + 4, lane l + 16's cc[0 / 1]), part 2 (row r + 8, here).
  const float mid0 = __shfl_down_sync(0xffffffffu, cc[0], 16);
  const float mid1 = __shfl_down_sync(0xffffffffu, cc[1], 16);
  const bool ok0 = __shfl_sync(0xffffffffu, ok, 4 * (2 * t)) != 0;
  const bool ok1 = __shfl_sync(0xffffffffu, ok, 4 * (2 * t + 1)) != 0;
  const int32_t i0 = first + 2 * t;
  if (lane < 16 && r < group) {
    float s0 = ok0 ? cc[0] + (mid0 + cc[2]) : NegInfF();
    float s1 = ok1 ? cc[1] + (mid1 + cc[3]) : NegInfF();
    if constexpr (kF8) s0 *= descale, s1 *= descale;
    if (i0 < count) sc[r][i0] = s0, vmax = fmaxf(vmax, s0);  // NaN never wins
    if (i0 + 1 < count) sc[r][i0 + 1] = s1, vmax = fmaxf(vmax, s1);
  }
}

// Scores of candidates [first, first + count) of the stage into sc[h][i - first]: row_of(i) is
// the bf16 row of candidate i (nullptr: invalid, score -inf). K = 32 * kGroups; the A operand
// comes from `table` (StageATables) one column group at a time, so the registers hold the row
// loads of kTiles tiles (32 16-byte loads in flight per lane) instead. Returns the max of the
// scores the lane wrote (head lane / 4 for lanes < 16; -inf for the others), as fmaxf takes it.
// kF8 (fp8 keys, kGroups 4): row_of gives the candidate's 128-byte fp8 row, read as two 16-byte
// loads per lane (Fp8KeyColumn) and converted to f16 group by group before its mmas; the table is
// StageATables<true>'s and key_descale its per-head 2^-s_h. kTilesT: tiles per warp whose rows
// are loaded at once (0: 32 / kGroups, 32 loads in flight per lane); kScStride: sc's row length.
template <int kGroups, bool kF8 = false, int kTilesT = 0, int kScStride = kStagesMaxPerBlock,
          typename RowOf>
__device__ __forceinline__ float StageScoreMma(const __nv_bfloat16* table, int stride, int group,
                                               int32_t count, RowOf row_of,
                                               float (*sc)[kScStride],
                                               const float* key_descale = nullptr) {
  static_assert(!kF8 || kGroups == 4, "fp8 rows are keys");
  float vmax = NegInfF();
  // Tiles whose rows are loaded at once. (fp8 rows over 16 tiles at once, the same 32 loads in
  // flight per lane, accumulated 4 tiles at a time: 0.2 us faster scoring but 0.7 us slower
  // steps for its 20 KB of code; bench/RESULTS.md, session 30.)
  constexpr int kTiles = kTilesT > 0 ? kTilesT : 32 / kGroups;
  constexpr int kLoads = kF8 ? 2 : kGroups;  // 16-byte loads per lane and tile
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, t = lane & 3;
  const int32_t tiles = (count + kStagesTileN - 1) / kStagesTileN;
  for (int32_t t0 = warp * kTiles; t0 < tiles; t0 += kStagesWarps * kTiles) {
    uint4 b[kTiles][kLoads];
    bool ok[kTiles];
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      const int32_t i = (t0 + u) * kStagesTileN + r;
      const auto* row = i < count ? row_of(i) : nullptr;
      ok[u] = row != nullptr;
#pragma unroll
      for (int p = 0; p < kLoads; ++p) {
        const int off = kF8 ? 64 * p + 16 * t : 32 * p + 8 * t;  // elements of the row
        b[u][p] = row != nullptr ? __ldg(reinterpret_cast<const uint4*>(row + off))
                                 : make_uint4(0, 0, 0, 0);
      }
    }
    float c[kTiles][2][4];
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
#pragma unroll
      for (int e = 0; e < 4; ++e) c[u][0][e] = 0.0f, c[u][1][e] = 0.0f;
    }
#pragma unroll
    for (int p = 0; p < kGroups; ++p) {
      uint32_t a[2][4];
      StageAFragments(table, stride, p, a);
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        uint4 bp;
        if constexpr (kF8) {
          const uint4& raw = b[u][p >> 1];
          bp = (p & 1) ? Fp8x8ToHalf8(raw.z, raw.w) : Fp8x8ToHalf8(raw.x, raw.y);
        } else {
          bp = b[u][p];
        }
        MmaOf<kF8>(c[u][0], a[0], bp.x, bp.y);
        MmaOf<kF8>(c[u][1], a[1], bp.z, bp.w);
      }
    }
    const float ds = kF8 ? key_descale[r & 3] : 1.0f;
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      StageStoreTile<kF8, kScStride>(c[u], ok[u], (t0 + u) * kStagesTileN, count, group, sc,
                                     vmax, ds);
    }
  }
  return vmax;
}

// ---- The attention after the stages (SelectStagesKernel<kStagesAttend*>, DeviceSelectAttend) --
// Block r stages its share of the fixed positions (prefix, then suffix) in rows
// [0, kSelectAttendMaxFixed) and of the middle in the rows after, K and V rows of 128 bf16
// kAttendPitch apart (bulk copies, one pair per row; rows of invalid positions zero-filled). The
// fixed rows are copied during the first stage (DeviceSelectAttend::fixed_early, the default;
// else, and for a skipped head, while the last stage's ids arrive), the middle's once those ids
// are in every block's shared memory, in tiles of kAttendTile rows, each completing on its own
// mbarrier. Warp w attends rows [16w, 16w + 16) of each tile on tensor cores with an online
// softmax per head (AttendRows); the warps' partials merge in shared memory, the blocks' in
// block h's shared memory for query head h (st.async onto its mbarrier), which writes out and
// lse. Measured on the H200 against the separate SelectedAttention kernel (bench/RESULTS.md,
// session 14): 24.3 against 29.1 us per layer at 128K quest; the same code with CUDA-core
// arithmetic was no faster than the separate kernel (half the blocks per KV head).
// Where the last stage is a key stage over the attention's own pool and table and the middle is
// its token ids (tokenselect), the middle's scores are that stage's (kStagesAttendScored below:
// the same products in the same order, so the same bits): the block that took a token pushes its
// scores into the first 16 bytes of its K staging row and its pool row into row_s at the block
// that attends it, and that block copies only the V rows. Session 28 (H200): 43.5 -> 41.9 us
// per layer at 128K tokenselect, 55.9 -> 54.8 at 1M; cold steps no slower.
constexpr int kAttendRows = kSelectAttendMaxFixed + kSelectAttendMaxMiddle;
constexpr int kAttendGroups = 2;                                 // 8-row groups per warp and tile
constexpr int kAttendTile = 8 * kAttendGroups * kStagesWarps;    // middle rows per mbarrier
constexpr int kAttendPitch = 128 + 8;  // bf16 per staging row: ldmatrix rows on distinct banks
constexpr int kAttendMidTiles = kSelectAttendMaxMiddle / kAttendTile;
constexpr int kAttendPartStride = 132;  // floats per partial: o[128], m, l, 2 unused
// SelectStagesKernel's dynamic shared memory: the double-buffered pass histogram slots (after the
// stages, the attention's receive area); with the attention, then its staging area (K rows, V
// rows, their pool rows).
constexpr int kStagesDynamicSmem = 2 * kStagesMaxCluster * 32 * sizeof(uint4);
constexpr int kStagesAttendSmem = kStagesDynamicSmem + 2 * kAttendRows * kAttendPitch * 2 +
                                  kAttendRows * 8;
static_assert(kStagesMaxCluster * kAttendPartStride * 4 <= kStagesDynamicSmem,
              "the attention's receive area fits the histogram slots");
static_assert(kStagesWarps * kRegTopKMaxGroup * kAttendPartStride * 4 <=
                  kAttendRows * kAttendPitch * 2,
              "the warps' partials fit the K rows");
static_assert(kAttendGroups == 2, "AttendRows takes 16 rows");
static_assert(kSelectAttendMaxMiddle % kAttendTile == 0 && kSelectAttendMaxFixed <= kAttendTile &&
                  kSelectAttendMaxFixed % (8 * kAttendGroups) == 0,
              "the attention's tiles give each warp whole row groups");

// Where an fp8 pool's 128-byte row lands in its staging row (AttendIssueRow, kF8).
constexpr int kAttendFp8Offset = 2 * kAttendPitch - 128;  // the last 128 bytes of a staging row

// A warp's online-softmax state: m and l of head h = (lane / 4) % 4 (the same in the lanes of
// a head), and acc[j] the mma accumulator of dims 8j .. 8j + 7: c[0], c[1] hold row lane / 4
// (part (lane / 16) of head h: the weights are split in two bf16 parts), dims 8j + 2(lane % 4)
// and + 1; c[2], c[3] rows 8-15 of A, which are zero.
struct AttendState {
  float m, l;
  float acc[16][4];
  // Nothing attended yet: m -inf, l and acc zero.
  __device__ __forceinline__ void Reset() {
    m = __int_as_float(0xff800000);
    l = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    }
  }
  // The warp's partial of head (lane / 4) % 4 into pw[0, 130) (the unnormalised output, then m
  // and l), written by lanes < 16: lane 4h + t adds the lo part (lane + 16's) to the hi part of
  // dims 8j + 2t, + 1. Every lane of the warp calls it (shuffles).
  __device__ __forceinline__ void WritePartial(float* pw) const {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float o0 = acc[j][0] + __shfl_down_sync(0xffffffffu, acc[j][0], 16);
      const float o1 = acc[j][1] + __shfl_down_sync(0xffffffffu, acc[j][1], 16);
      if (lane < 16) *reinterpret_cast<float2*>(pw + 8 * j + 2 * (lane & 3)) = make_float2(o0, o1);
    }
    if (lane < 16 && (lane & 3) == 0) pw[128] = m, pw[129] = l;
  }
};

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Rows [r0, r0 + 16) of the staging area (rows of kAttendPitch bf16; rows >= end or with
// row_s < 0 are not attended, and their K and V are zero, not garbage) into the warp's state, on
// tensor cores. Scores: as StageScoreMma (the query split in three bf16 parts, key_a of
// StageATables, so they are the CUDA-core products within f32 rounding), two tiles of 8 rows;
// lanes 4h + t and 16 + 4h + t then hold head h's scores of rows 2t, 2t + 1, 8 + 2t, 9 + 2t. One
// online-softmax step; the weights, split in two bf16 parts (hi in rows 0-3 of A, lo in rows
// 4-7), times V (ldmatrix.trans of the V rows, 16 dims at a time) into acc.
// kF8 (fp8 pools): the K rows (Fp8KeyColumn order) and V rows are f16 (ConvertFp8Rows), the key
// table StageATables<true>'s with key_descale its per-head 2^-s_h, the weights' parts f16.
// kDecode (SelectedDecodeMmaKernel, many tiles per warp): the accumulator is rescaled only when
// some lane's max moved (a long list's max settles early) and only in rows 0-7 (rows 8-15 of A
// are zero, so theirs stay zero); with kF8 the K rows stay fp8 where they landed (at
// kAttendFp8Offset, as a key stage reads them: ConvertFp8Rows converts only V), each lane
// converting its B fragments in registers.
template <bool kF8 = false, bool kDecode = false>
__device__ __forceinline__ void AttendRows(const __nv_bfloat16* k_s, const __nv_bfloat16* v_s,
                                           const int64_t* row_s, int r0, int end,
                                           const __nv_bfloat16* key_a, int group,
                                           AttendState& st, bool scored = false,
                                           const float* key_descale = nullptr) {
  const int lane = threadIdx.x & 31, g8 = lane >> 2, t = lane & 3;
  float sc[4];  // rows 2t, 2t + 1, 8 + 2t, 9 + 2t of the 16
  if (scored) {
    // The scores the key stage computed (the same products in the same order), pushed to the
    // first floats of each row's K staging row (SelectStagesKernel<kStagesAttendScored>).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + 8 * (i >> 1) + 2 * t + (i & 1);
      sc[i] = reinterpret_cast<const float*>(k_s + r * kAttendPitch)[g8 & 3];
    }
  } else {
    // Scores: c[n][m] for tile n (rows r0 + 8n ..), the group's two mmas m.
    float c[2][2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) c[n][0][e] = 0.0f, c[n][1][e] = 0.0f;
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      uint32_t a[2][4];
      StageAFragments(key_a, kStagesKeyStride, p, a);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        uint4 b;
        if constexpr (kF8 && kDecode) {
          // Bytes 64 (p / 2) + 16t of the fp8 row: column group p's fragments (Fp8KeyColumn).
          const uint4 raw = *reinterpret_cast<const uint4*>(
              reinterpret_cast<const unsigned char*>(k_s + (r0 + 8 * n + g8) * kAttendPitch) +
              kAttendFp8Offset + 64 * (p >> 1) + 16 * t);
          b = (p & 1) ? Fp8x8ToHalf8(raw.z, raw.w) : Fp8x8ToHalf8(raw.x, raw.y);
        } else {
          b = *reinterpret_cast<const uint4*>(k_s + (r0 + 8 * n + g8) * kAttendPitch + 32 * p +
                                              8 * t);
        }
        MmaOf<kF8>(c[n][0], a[0], b.x, b.y);
        MmaOf<kF8>(c[n][1], a[1], b.z, b.w);
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float cc[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) cc[e] = c[n][0][e] + c[n][1][e];
      const float mid0 = __shfl_down_sync(0xffffffffu, cc[0], 16);
      const float mid1 = __shfl_down_sync(0xffffffffu, cc[1], 16);
      float s0 = cc[0] + (mid0 + cc[2]), s1 = cc[1] + (mid1 + cc[3]);  // lanes < 16
      if constexpr (kF8) {
        const float ds = key_descale[g8 & 3];
        s0 *= ds, s1 *= ds;
      }
      sc[2 * n] = __shfl_sync(0xffffffffu, s0, lane & 15);
      sc[2 * n + 1] = __shfl_sync(0xffffffffu, s1, lane & 15);
    }
  }
  const int h = g8 & 3;
  float tmax = NegInfF();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + 8 * (i >> 1) + 2 * t + (i & 1);
    if (!(r < end && h < group && row_s[r] >= 0)) sc[i] = NegInfF();
    tmax = fmaxf(tmax, sc[i]);
  }
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
  tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
  const float m_new = fmaxf(st.m, tmax);
  const float corr = st.m == NegInfF() ? (m_new == NegInfF() ? 1.0f : 0.0f) : __expf(st.m - m_new);
  float w[4], tsum = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = (sc[i] == NegInfF() || m_new == NegInfF()) ? 0.0f : __expf(sc[i] - m_new);
    tsum += w[i];
  }
  tsum += __shfl_xor_sync(0xffffffffu, tsum, 1);
  tsum += __shfl_xor_sync(0xffffffffu, tsum, 2);
  st.l = st.l * corr + tsum;
  st.m = m_new;
  // A: row g8 = 4 * part + h, k = the 16 rows: a0 = rows 2t, 2t + 1; a2 = 8 + 2t, 9 + 2t.
  const bool lo = lane >= 16;
  float wp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float hi = kF8 ? __half2float(__float2half_rn(w[i]))
                         : __bfloat162float(__float2bfloat16_rn(w[i]));
    wp[i] = lo ? w[i] - hi : w[i];
  }
  uint32_t a[4];
  if constexpr (kF8) {
    const __half2 p0 = __floats2half2_rn(wp[0], wp[1]), p1 = __floats2half2_rn(wp[2], wp[3]);
    a[0] = *reinterpret_cast<const uint32_t*>(&p0), a[2] = *reinterpret_cast<const uint32_t*>(&p1);
  } else {
    a[0] = PackBf16(wp[0], wp[1]), a[2] = PackBf16(wp[2], wp[3]);
  }
  a[1] = 0u, a[3] = 0u;
  // ldmatrix.x4.trans: lane l gives row (l & 7) + 8 ((l >> 3) & 1) of the 16, dims + 8 (l >> 4).
  const uint32_t vrow = SharedAddr(v_s + (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kAttendPitch +
                                   8 * (lane >> 4));
  if constexpr (kDecode) {
    if (__any_sync(0xffffffffu, corr != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 16; ++j) st.acc[j][0] *= corr, st.acc[j][1] *= corr;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st.acc[j][e] *= corr;
    }
  }
#pragma unroll
  for (int d = 0; d < 8; ++d) {  // dims 16d .. 16d + 15
    uint32_t b0, b1, b2, b3;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                 : "r"(vrow + 32 * d));
    MmaOf<kF8>(st.acc[2 * d], a, b0, b1);
    MmaOf<kF8>(st.acc[2 * d + 1], a, b2, b3);
  }
}

static_assert(5 + kVoteRankPasses + 1 == kSelectStagesPhasesPerStage,
              "a stage's phase stamps: start, scored, local, received, keys, each pass, end");
static_assert(3 + 2 * kAttendMidTiles + 1 == kSelectStagesAttendPhases,
              "the attention's phase stamps: rows, fixed landed and attended, each tile landed and "
              "attended, merged");

// The first of block `rank`'s share of the fixed positions (prefix, then suffix) over cs blocks
// in *f0, and how many there are.
__device__ __forceinline__ int32_t AttendFixedShare(const DeviceSelectAttend& at, int cs, int rank,
                                                    int32_t* f0) {
  const int32_t nf = at.prefix_end + at.suffix_len;
  const int32_t fc = (nf + cs - 1) / cs;
  *f0 = min(nf, rank * fc);
  return min(nf, *f0 + fc) - *f0;
}

// The pool row of fixed position f of KV head g (prefix, then suffix), or -1.
__device__ __forceinline__ int64_t AttendFixedRow(const DeviceSelectAttend& at, int g, int32_t f) {
  const int32_t t = f < at.prefix_end ? f : at.suffix_begin + (f - at.prefix_end);
  return TokenRow(at.table, at.table_pages, at.num_slots, at.page_size, g, t);
}

// Staging row r gets pool row `row` by two bulk copies (K, V: 256 bytes each) completing on
// `bar` (whose tx-count the calling thread raises by their bytes), or zeros (row < 0: the row is
// not attended, but AttendRows still reads its K and V).
// kVOnly: the V row only (a scored middle row: its K staging row holds its scores, which a
// zero fill must not overwrite).
// kF8 (fp8 pools): the 128-byte rows land at byte kAttendFp8Offset of their staging rows (zeros
// there for row < 0), which ConvertFp8Rows turns into f16 rows in place.
static_assert(kAttendFp8Offset % 16 == 0 && kAttendFp8Offset >= 16,
              "bulk copies need 16-byte alignment; a scored K row's first 16 bytes hold scores");
template <bool kVOnly = false, bool kF8 = false>
__device__ __forceinline__ void AttendIssueRow(const DeviceSelectAttend& at, __nv_bfloat16* k_s,
                                               __nv_bfloat16* v_s, int r, int64_t row,
                                               uint32_t bar) {
  if constexpr (kF8) {
    unsigned char* k = reinterpret_cast<unsigned char*>(k_s + r * kAttendPitch) + kAttendFp8Offset;
    unsigned char* v = reinterpret_cast<unsigned char*>(v_s + r * kAttendPitch) + kAttendFp8Offset;
    if (row >= 0) {
      MbarExpectTx(bar, (kVOnly ? 1 : 2) * 128);
      if (!kVOnly) {
        BulkCopyToShared(SharedAddr(k), static_cast<const unsigned char*>(at.k_pool) + row * 128,
                         128, bar);
      }
      BulkCopyToShared(SharedAddr(v), static_cast<const unsigned char*>(at.v_pool) + row * 128,
                       128, bar);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (!kVOnly) reinterpret_cast<uint4*>(k)[i] = make_uint4(0, 0, 0, 0);
        reinterpret_cast<uint4*>(v)[i] = make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  if (row >= 0) {
    MbarExpectTx(bar, (kVOnly ? 1 : 2) * 128 * sizeof(__nv_bfloat16));
    if (!kVOnly) {
      BulkCopyToShared(SharedAddr(k_s + r * kAttendPitch),
                       static_cast<const __nv_bfloat16*>(at.k_pool) + row * 128, 256, bar);
    }
    BulkCopyToShared(SharedAddr(v_s + r * kAttendPitch),
                     static_cast<const __nv_bfloat16*>(at.v_pool) + row * 128, 256, bar);
  } else {
    uint4* k = reinterpret_cast<uint4*>(k_s + r * kAttendPitch);
    uint4* v = reinterpret_cast<uint4*>(v_s + r * kAttendPitch);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (!kVOnly) k[i] = make_uint4(0, 0, 0, 0);
      v[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

// kF8: the warp's staging rows [r0, r0 + 16), landed as fp8 at kAttendFp8Offset, become the f16
// rows AttendRows<true> reads, in place: V in dim order, K (unless with_k is false: a scored
// middle's K rows hold scores) in Fp8KeyColumn order. Every lane reads its four 16-byte pieces of
// each before any lane writes (a row's f16 form overlaps its fp8 bytes).
__device__ __forceinline__ void ConvertFp8Rows(__nv_bfloat16* k_s, __nv_bfloat16* v_s, int r0,
                                               bool with_k) {
  const int lane = threadIdx.x & 31;
  uint4 kr[4], vr[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j, r = r0 + (i >> 3), c = i & 7;  // row, 16-byte piece
    const int off = r * kAttendPitch * 2 + kAttendFp8Offset + 16 * c;
    vr[j] = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(v_s) + off);
    if (with_k) {
      kr[j] = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(k_s) + off);
    }
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = lane + 32 * j, r = r0 + (i >> 3), c = i & 7;
    // Piece c holds dims 16c .. 16c + 15.
    uint4* v = reinterpret_cast<uint4*>(v_s + r * kAttendPitch + 16 * c);
    v[0] = Fp8x8ToHalf8(vr[j].x, vr[j].y);
    v[1] = Fp8x8ToHalf8(vr[j].z, vr[j].w);
    if (with_k) {
      __nv_bfloat16* k = k_s + r * kAttendPitch;
      *reinterpret_cast<uint4*>(k + Fp8KeyColumn(16 * c)) = Fp8x8ToHalf8(kr[j].x, kr[j].y);
      *reinterpret_cast<uint4*>(k + Fp8KeyColumn(16 * c + 8)) = Fp8x8ToHalf8(kr[j].z, kr[j].w);
    }
  }
  __syncwarp();
}

// SetSelectStagesPhaseStamps (launch.h).
__device__ long long* g_stages_phase_stamps = nullptr;
__device__ int g_stages_phase_blocks = 0;

// The selection cache's check for KV head g by a block of 256 threads (kernels/backend.h
// SelectionCacheCheckParams): the cosine of q_g with cached_q[g] (double sums, block reduction),
// then reuse[g], and on a miss the copy of q_g and valid[g] = 1. The same arithmetic in
// SelectionCacheCheckKernel, SelectStagesKernel and PartStagesKernel, so all decide alike: each thread sums its elements i = tid, tid + 256, ...
// in order (CacheCheckAdd), the warps reduce by shuffles and write shared scratch
// (CacheCheckReduce), and after a barrier every thread sums the warps' values in warp order
// (CacheCheckDecide: no second barrier, every thread gets the same answer).
constexpr int kCacheCheckThreads = 256;

struct CacheCheckSums {
  double ab = 0, aa = 0, bb = 0;
};

__device__ __forceinline__ void CacheCheckAdd(CacheCheckSums& s, float a, float c) {
  const double x = a, y = c;
  s.ab += x * y;
  s.aa += x * x;
  s.bb += y * y;
}

// The warp's sums to red[.][warp] (lane 0 writes); the caller's barrier comes next.
__device__ __forceinline__ void CacheCheckReduce(CacheCheckSums s,
                                                 double (*red)[kCacheCheckThreads / 32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    s.ab += __shfl_xor_sync(0xffffffffu, s.ab, o);
    s.aa += __shfl_xor_sync(0xffffffffu, s.aa, o);
    s.bb += __shfl_xor_sync(0xffffffffu, s.bb, o);
  }
  if (lane == 0) {
    red[0][warp] = s.ab;
    red[1][warp] = s.aa;
    red[2][warp] = s.bb;
  }
}

// The decision from red after the barrier that follows CacheCheckReduce: whether the query has
// cosine >= theta with the cached query where was_valid (an invalid entry's cached values, read
// regardless, never decide).
__device__ __forceinline__ bool CacheCheckDecide(const double (*red)[kCacheCheckThreads / 32],
                                                 bool was_valid, float theta) {
  double sab = 0, saa = 0, sbb = 0;
  for (int w = 0; w < kCacheCheckThreads / 32; ++w) {
    sab += red[0][w];
    saa += red[1][w];
    sbb += red[2][w];
  }
  // cosine = sab / sqrt(saa * sbb) (0 where saa or sbb is 0) >= theta, decided by squares
  // (no square root, no division: session 51). saa * sbb <= 512 * FLT_MAX^4 cannot overflow,
  // so it is infinite or NaN only where an input is, and then the cosine is NaN: false.
  const double t = theta;
  if (saa == 0 || sbb == 0) return was_valid && 0.0 >= t;
  const double p = saa * sbb;
  if (!(p <= DBL_MAX)) return false;
  const double lhs = sab * sab, rhs = t * t * p;
  return was_valid && (t > 0 ? sab > 0 && lhs >= rhs : sab >= 0 || lhs <= rhs);
}

// The check's update for one KV head after its decision `hit` (every thread of the block): the
// reuse flag and hit count, and on a miss the query cached and marked valid.
__device__ __forceinline__ void CacheCheckUpdate(const float* a, float* c, int n, bool hit,
                                                 int32_t* valid_g, int32_t* reuse_g,
                                                 unsigned long long* hit_count) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    *reuse_g = hit ? 1 : 0;
    if (hit && hit_count != nullptr) atomicAdd(hit_count, 1ull);
  }
  if (!hit) {
    for (int i = tid; i < n; i += blockDim.x) c[i] = a[i];
    if (tid == 0) *valid_g = 1;
  }
}

// SelectStagesKernel's attention: none; the K and V rows of every attended position; or, when
// the last stage scored the middle's tokens in the attention's own pool (a key stage, the middle
// its token ids), the middle's scores from that stage: each block pushes, with the ids it takes,
// their scores (to the first floats of their K staging rows) and pool rows to the block that
// attends them, which copies only their V rows (the fixed rows and a skipped head's middle as
// kStagesAttendRows).
constexpr int kStagesNoAttend = 0, kStagesAttendRows = 1, kStagesAttendScored = 2;

// kF8: every key stage's pool and the attention's are fp8 (SelectStageKind::kKeysFP8,
// DeviceSelectAttend::fp8): the key table, key scoring and attention of MmaOf<true> above.
// kCheck: the selection cache's check in the kernel (at.check; an instance of its own, so the
// forms without it compile as they did before the check came in).
template <int kAttend, bool kF8 = false, bool kCheck = false>
__global__ void __launch_bounds__(kStagesThreads, 1)
    SelectStagesKernel(const float* __restrict__ q, float scale, int group,
                       const __grid_constant__ DeviceSelectStages st,
                       const __grid_constant__ DeviceSelectAttend at,
                       const int32_t* __restrict__ skip, int hist_mode) {
  namespace cg = cooperative_groups;
  constexpr int G = kRegTopKMaxGroup, P = kStagesPer, W = kStagesWarps;
  __shared__ float sc[G][kStagesMaxPerBlock];  // the block's scores of the stage
  __shared__ __align__(16) __nv_bfloat16 sum_a[16 * kStagesSumStride];  // StageATables
  __shared__ __align__(16) __nv_bfloat16 key_a[16 * kStagesKeyStride];
  __shared__ float key_descale[G];  // kF8: per head 2^-s_h (StageATables<true>)
  __shared__ __align__(16) float part_s[2 * G];  // the block's max per head, then its sum
  __shared__ __align__(16) uint32_t hist[kVoteRankPasses][128];  // per pass, bins 2i | 2i + 1 << 16
  __shared__ uint32_t wsum_s[W];
  __shared__ float wmax_s[W][G];  // each warp's max of the scores it wrote, per head
  // Receive slots, one per block of the cluster: partials, and block totals; the pass
  // histograms (double buffered: a block pushes pass p + 2 only after every block pushed pass
  // p + 1, which each does after reading pass p) are in dynamic shared memory.
  __shared__ __align__(16) float recv_part[kStagesMaxCluster][2 * G];
  __shared__ uint32_t recv_tot[kStagesMaxCluster];
  // The last stage's selection, the next stage's parents (every block pushes its taken ids).
  __shared__ int32_t parents_s[kSelectStagesMaxParents];
  // mbarriers: 0-2 the passes (3 unused), 4 the partials, 5 the totals, 6 the
  // selection; the attention's: 7 the blocks' partials, 8 the fixed rows, then one per middle
  // tile.
  constexpr int kFixedBar = 8, kTileBar = 9, kBars = kTileBar + kAttendMidTiles;
  __shared__ __align__(8) uint64_t mbar[kBars];
  // [2][kStagesMaxCluster][32]; kAttend: after the stages, the attention's receive area
  // [cs][kAttendPartStride] f32, then the attention's staging area (below).
  extern __shared__ __align__(16) uint4 recv_hist[];
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = blockIdx.y;
  const int rank = static_cast<int>(cluster.block_rank());
  const int cs = static_cast<int>(cluster.num_blocks());
  GridDepWait();
  GridDepLaunchDependents();
  // A reused head: every block of the cluster (same g) returns before any cluster barrier, or,
  // with an attention, skips the stages and attends the kept selection. Reused by the caller's
  // flags, or by the selection cache's check in the kernel (kCheck, at.check): every block of the
  // cluster computes the same decision first (the fixed rows' early copy and the stages depend
  // on it), and the cluster's block 0 updates the cache's state: a hit's at once (no cached
  // query to write), a miss's after the first cluster barrier's wait (every block has read the
  // cached query by then), from the query each thread keeps from the check (session 52: before,
  // at the end, after the last cluster barrier, from global memory). The check's scratch is
  // recv_part: no block pushes to it before the first cluster barrier's wait, which every
  // block's arrival below precedes.
  bool skipped;
  // The check's query, thread tid's elements tid + j * kStagesThreads, kept for a miss's update.
  constexpr int kStagesCheckPer = G * 128 / kStagesThreads;
  float check_a[kStagesCheckPer];
  if constexpr (kCheck) {
    static_assert(sizeof(recv_part) >= sizeof(double) * 3 * (kCacheCheckThreads / 32) + 4 &&
                      kStagesThreads == kCacheCheckThreads,
                  "the check's scratch and block size");
    auto* red = reinterpret_cast<double (*)[kCacheCheckThreads / 32]>(&recv_part[0][0]);
    int* valid_s = reinterpret_cast<int*>(&red[3][0]);
    const int n = group * 128;
    const int64_t row = static_cast<int64_t>(g) * n;
    int valid = 0;
    if (tid == 0) valid = at.check.valid[g];
    CacheCheckSums sums;
#pragma unroll
    for (int j = 0; j < kStagesCheckPer; ++j) {
      const int i = tid + j * kStagesThreads;
      check_a[j] = i < n ? at.check.q[row + i] : 0.0f;
      if (i < n) CacheCheckAdd(sums, check_a[j], at.check.cached[row + i]);
    }
    CacheCheckReduce(sums, red);
    if (tid == 0) *valid_s = valid;
    __syncthreads();
    skipped = CacheCheckDecide(red, *valid_s != 0, at.check.theta);
    // A hit writes no cached query: the cluster's block 0 updates the cache's state at once.
    if (skipped && rank == 0) {
      CacheCheckUpdate(nullptr, nullptr, 0, true, at.check.valid + g, at.check.reuse + g,
                       at.check.hits);
    }
  } else {
    skipped = skip != nullptr && skip[g] != 0;
  }
  if (!kAttend && skipped) return;
  // Phase stamps (profiling): thread 0 only; the pointer is null unless SetSelectStagesPhaseStamps.
  long long* stamps = nullptr;
  if (tid == 0) {
    const int b = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
    if (b < g_stages_phase_blocks) stamps = g_stages_phase_stamps + b * kSelectStagesPhases;
  }
  auto stamp = [&](int phase) {
    if (stamps != nullptr) stamps[phase] = clock64();
  };
  stamp(0);
  // The attention's staging area: K rows, V rows (kAttendPitch bf16 apart), the rows' pool rows.
  __nv_bfloat16* const k_s =
      reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<unsigned char*>(recv_hist) +
                                       kStagesDynamicSmem);
  __nv_bfloat16* const v_s = k_s + kAttendRows * kAttendPitch;
  int64_t* const row_s = reinterpret_cast<int64_t*>(v_s + kAttendRows * kAttendPitch);
  // The block's fixed positions: with at.fixed_early copied during the first stage (the
  // page-table entry loaded at the start), else before the wait for the middle's ids. Thread
  // kFixedThread0 + i copies fixed row i: warps the first stage's statistics leave idle.
  constexpr int kFixedThread0 = G * 32;
  static_assert(kFixedThread0 + kSelectAttendMaxFixed <= kStagesThreads, "fixed-row threads");
  const int ft = tid - kFixedThread0;
  auto fixed_row_of = [&]() -> int64_t {
    int32_t f0 = 0;
    const int32_t f_count = AttendFixedShare(at, cs, rank, &f0);
    return ft >= 0 && ft < f_count ? AttendFixedRow(at, g, f0 + ft) : -1;
  };
  const bool fixed_early = kAttend && at.fixed_early != 0 && !skipped;
  int64_t fixed_row = -1;
  if (fixed_early) fixed_row = fixed_row_of();
  // The fixed rows' copies onto mbar[kFixedBar] (row_s and the tx-counts before a barrier after
  // which thread 0 arrives).
  auto fixed_rows = [&](int64_t row) {
    if (ft >= 0 && ft < kSelectAttendMaxFixed) {
      row_s[ft] = row;
      AttendIssueRow<false, kF8>(at, k_s, v_s, ft, row, SharedAddr(&mbar[kFixedBar]));
    }
  };
  // The split query (also the attention's: same q and scale), read after the first stage's
  // barrier (the attention's: after its own).
  StageATables<kF8>(q, scale, g, group, sum_a, key_a, key_descale);
  static_assert(kBars <= 32, "one lane of warp 0 per mbarrier");
  if (tid < kBars) {
    MbarInit(SharedAddr(&mbar[tid]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Every block's mbarriers must be initialised before any block pushes to them: the barrier is
  // split (the fences above release the initialisation), its wait comes before the first push;
  // the block's own first uses come after the first stage's __syncthreads.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  uint32_t phases = 0;  // bit i: the parity of mbar[i]'s current phase
  // Waits for the current use of mbar[i] (every thread), then flips its parity.
  auto wait_bar = [&](int i) {
    MbarWait(SharedAddr(&mbar[i]), (phases >> i) & 1u);
    phases ^= 1u << i;
  };

  const int num_stages = kAttend && skipped ? 0 : st.num_stages;
  int32_t middle_taken = 0;  // kStagesAttendScored: the block's middle rows pushed to it
#pragma unroll 1
  for (int si = 0; si < num_stages; ++si) {
    const DeviceSelectStage& stage = st.stage[si];
    const int32_t n = stage.c.count;
    const int32_t per = (n + cs - 1) / cs;
    const int32_t block_first = min(n, rank * per);
    const int32_t block_count = min(n, block_first + per) - block_first;
    for (int i = tid; i < kVoteRankPasses * 128; i += kStagesThreads) (&hist[0][0])[i] = 0;
    __syncthreads();  // the scores of the last stage read; parents_s's -1 tail written
    const DeviceCandidates& c = stage.c;
    // The parents: the first stage's from global memory, a later one's pushed by every block at
    // the end of the last stage.
    const int32_t* parents = c.parents == nullptr ? nullptr
                             : si == 0 ? c.parents + static_cast<int64_t>(g) * c.num_parents
                                       : parents_s;
    if (si > 0) wait_bar(6);
    const int phase0 = 1 + si * kSelectStagesPhasesPerStage;
    stamp(phase0);
    float vmax;  // the lane's max of the scores it wrote (StageScoreMma)
    if (stage.kind != SelectStageKind::kSummariesBF16) {  // kKeysBF16, or kKeysFP8 with kF8
      using KeyRow = typename std::conditional<kF8, unsigned char, __nv_bfloat16>::type;
      const KeyRow* k_pool = static_cast<const KeyRow*>(stage.rows);
      const int page_shift = stage.page_shift, fanout_shift = stage.fanout_shift;
      const int32_t page_mask = (1 << page_shift) - 1, fanout_mask = (1 << fanout_shift) - 1;
      vmax = StageScoreMma<4, kF8>(key_a, kStagesKeyStride, group, block_count,
                       [&](int32_t i) -> const KeyRow* {
        const int32_t idx = block_first + i;
        int64_t id;
        if (parents == nullptr) {
          id = static_cast<int64_t>(c.begin) + idx;
        } else {
          const int32_t parent = parents[idx >> fanout_shift];
          if (parent < 0) return nullptr;
          id = (static_cast<int64_t>(parent) << fanout_shift) + (idx & fanout_mask);
        }
        if (id < c.begin || id >= c.end) return nullptr;
        const int32_t page = static_cast<int32_t>(id >> page_shift);
        if (page >= stage.table_pages) return nullptr;
        const int32_t slot = stage.table[static_cast<int64_t>(g) * stage.table_pages + page];
        if (slot < 0 || slot >= stage.num_items) return nullptr;
        return k_pool + ((static_cast<int64_t>(slot) << page_shift) +
                         (static_cast<int32_t>(id) & page_mask)) * 128;
      }, sc, key_descale);
    } else {
      const __nv_bfloat16* rows = static_cast<const __nv_bfloat16*>(stage.rows);
      vmax = StageScoreMma<8>(sum_a, kStagesSumStride, group, block_count,
                       [&](int32_t i) -> const __nv_bfloat16* {
        const int32_t id = StageCandidateId(c, parents, block_first + i);
        return id >= 0 && id < stage.num_items
                   ? rows + (static_cast<int64_t>(g) * stage.num_items + id) * 256
                   : nullptr;
      }, sc);
    }
    // The warp's max per head: lanes 4h .. 4h + 3 (< 16) hold head h's.
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));
    vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
    if (lane < 16 && (lane & 3) == 0) wmax_s[warp][lane >> 2] = vmax;
    __syncthreads();  // sc and wmax_s complete
    stamp(phase0 + 1);

    // (2) The block's softmax statistics: warp h < 4 takes head h: the max of the warps' maxima
    // of the scoring, then the sum of exp(x - max) over the block's scores (lanes stride 32),
    // into part_s; one cluster barrier; then every warp merges the cs block partials in block
    // order (every block gets the same bits).
    if (warp < G) {
      const int h = warp;
      const bool on = h < group;
      // Four loads in flight per lane and four independent sum chains: the loads are
      // unconditional (an index past the block's count reads a stale score of the row, which
      // the select drops), so they share one basic block and issue back to back.
      const int32_t count = on ? block_count : 0;
      const float* row = sc[h];
      auto load4 = [&](int32_t i0, float (&v)[4]) {
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = row[min(i0 + 32 * u, kStagesMaxPerBlock - 1)];
      };
      float bm = NegInfF();
#pragma unroll
      for (int w = 0; w < W; ++w) bm = fmaxf(bm, wmax_s[w][h]);  // -inf for h >= group
      float bl4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int32_t i0 = lane; i0 < count; i0 += 128) {
        float v[4];
        load4(i0, v);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const bool ok = i0 + 32 * u < count && v[u] > NegInfF();
          const float e = ExpFtz(v[u] - bm);
          bl4[u] += ok ? e : 0.0f;
        }
      }
      const float bl = WarpSum((bl4[0] + bl4[1]) + (bl4[2] + bl4[3]));
      if (lane == 0) part_s[h] = bm, part_s[G + h] = bl;
    }
    // The attention's fixed rows copied by warps the statistics leave idle.
    if (fixed_early && si == 0 && warp >= G) fixed_rows(fixed_row);
    __syncthreads();  // part_s complete
    if (fixed_early && si == 0 && tid == 0) MbarArrive(SharedAddr(&mbar[kFixedBar]));
    if (si == 0) {
      asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // mbarriers ready
      // A miss (the stages run only then): every block of the cluster has read the cached query
      // (each arrived after its check), so block 0 writes the query kept from the check.
      if (kCheck && rank == 0) {
        const int n = group * 128;
        float* const cached = at.check.cached + static_cast<int64_t>(g) * n;
#pragma unroll
        for (int j = 0; j < kStagesCheckPer; ++j) {
          const int i = tid + j * kStagesThreads;
          if (i < n) cached[i] = check_a[j];
        }
        if (tid == 0) at.check.valid[g] = 1, at.check.reuse[g] = 0;
      }
    }
    if (tid == 0) MbarExpect(SharedAddr(&mbar[4]), cs * 2 * G * sizeof(float));
    if (warp == 0 && lane < 2 * cs) {  // lane 2r + j: half j of the partials to block r
      const int r = lane >> 1, j = lane & 1;
      const uint4 v = reinterpret_cast<const uint4*>(part_s)[j];
      StAsync16(MapToRank(SharedAddr(&recv_part[rank][4 * j]), r),
                v, MapToRank(SharedAddr(&mbar[4]), r));
    }
    stamp(phase0 + 2);
    // The thread's candidates (scores and ids) meanwhile.
    const int32_t lfirst = tid * P;
    float x[G][P];
    int32_t ids[P];
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const bool in = lfirst + j < block_count;
#pragma unroll
      for (int h = 0; h < G; ++h) x[h][j] = in && h < group ? sc[h][lfirst + j] : NegInfF();
      ids[j] = in ? StageCandidateId(c, parents, block_first + lfirst + j) : -1;
    }
    // kStagesAttendScored's last stage (a key stage over the attention's pool and table): each
    // candidate's page-table entry, loaded now for the pool row pushed with it if it is taken
    // (-1: not in the attention's middle or past the table; checked against the pool there).
    const bool scored = kAttend == kStagesAttendScored && si + 1 == st.num_stages;
    int32_t slot4[P];
#pragma unroll
    for (int j = 0; j < P; ++j) {
      slot4[j] = -1;
      if (scored && ids[j] >= at.middle.begin && ids[j] < at.middle.end &&
          (ids[j] >> stage.page_shift) < at.table_pages) {
        slot4[j] =
            at.table[static_cast<int64_t>(g) * at.table_pages + (ids[j] >> stage.page_shift)];
      }
    }
    wait_bar(4);  // every block's partials received
    stamp(phase0 + 3);
    // Lane L holds block L % cs's partials, so each segment of cs lanes merges all of them in the
    // same order (log2(cs) shuffle steps instead of 5).
    float mb[G], inv[G];
    {
      const float4* rp = reinterpret_cast<const float4*>(recv_part[lane % cs]);
      const float4 a = rp[0], b = rp[1];
      const float m[G] = {a.x, a.y, a.z, a.w};
      float l[G] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int h = 0; h < G; ++h) mb[h] = m[h];
      for (int o = cs >> 1; o > 0; o >>= 1) {
#pragma unroll
        for (int h = 0; h < G; ++h) mb[h] = fmaxf(mb[h], __shfl_xor_sync(0xffffffffu, mb[h], o));
      }
#pragma unroll
      for (int h = 0; h < G; ++h) l[h] = m[h] > NegInfF() ? l[h] * ExpFtz(m[h] - mb[h]) : 0.0f;
      for (int o = cs >> 1; o > 0; o >>= 1) {
#pragma unroll
        for (int h = 0; h < G; ++h) l[h] += __shfl_xor_sync(0xffffffffu, l[h], o);
      }
#pragma unroll
      for (int h = 0; h < G; ++h) inv[h] = mb[h] == NegInfF() ? 0.0f : 1.0f / l[h];
    }
    uint32_t key[P];
    RegVoteKeys<P>(x, mb, inv, ids, n, block_first + lfirst, nullptr, key);
    stamp(phase0 + 4);

    // (3) Radix select over the cluster.
    const int32_t kk = min(stage.k, n);
    uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
    if (kk == 0) prefix = 0xffffffffu, mask = 0xffffffffu, remaining = 0;  // nothing is taken
#pragma unroll 1
    for (int pass = 0; pass < kVoteRankPasses && kk > 0; ++pass) {
      RegHistogram<P, true>(key, prefix, mask, pass, hist_mode, hist[pass]);
      __syncthreads();  // the block's histogram of the pass complete
      uint4* slots = recv_hist + (pass & 1) * kStagesMaxCluster * 32;
      if (tid == 0) MbarExpect(SharedAddr(&mbar[pass]), cs * 32 * sizeof(uint4));
      if (warp == 0) {  // lane L pushes its 16 bytes (bins 8L .. 8L + 7) to every block
        const uint4 v = reinterpret_cast<const uint4*>(hist[pass])[lane];
        const uint32_t dst = SharedAddr(&slots[rank * 32 + lane]);
        const uint32_t bar = SharedAddr(&mbar[pass]);
        for (int r = 0; r < cs; ++r) StAsync16(MapToRank(dst, r), v, MapToRank(bar, r));
      }
      wait_bar(pass);  // every block's histogram received
      // Every warp sums the blocks' bins 248 - 8L .. 255 - 8L (words 124 - 4L ..) and finds the
      // same bin (same data, same order).
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      for (int r = 0; r < cs; ++r) {
        const uint4 v = slots[r * 32 + 31 - lane];
        w[0] += v.x, w[1] += v.y, w[2] += v.z, w[3] += v.w;
      }
      const uint32_t cb[8] = {w[3] >> 16, w[3] & 0xffffu, w[2] >> 16, w[2] & 0xffffu,
                              w[1] >> 16, w[1] & 0xffffu, w[0] >> 16, w[0] & 0xffffu};
      const bool done = RegFindBinOf(cb, pass, &prefix, &mask, &remaining);
      stamp(phase0 + 5 + pass);
      if (done) break;  // the same in every warp and block
    }

    // (4) Compaction in index order over the cluster; <= 8192 of each: no carry.
    const uint32_t own = RegCounts<P>(key, prefix, mask);
    const uint32_t incl = WarpInclusiveScanU(own);
    if (lane == 31) wsum_s[warp] = incl;
    __syncthreads();
    const uint32_t wv = lane < W ? wsum_s[lane] : 0u;
    const uint32_t wincl = WarpInclusiveScanU(wv);
    const uint32_t block_total = __shfl_sync(0xffffffffu, wincl, 31);
    if (tid == 0) MbarExpect(SharedAddr(&mbar[5]), cs * sizeof(uint32_t));
    if (warp == 0 && lane < cs) {
      StAsync4(MapToRank(SharedAddr(&recv_tot[rank]), lane), block_total,
               MapToRank(SharedAddr(&mbar[5]), lane));
    }
    wait_bar(5);  // every block's total received
    const uint32_t bt = lane < cs ? recv_tot[lane] : 0u;
    const uint32_t bincl = WarpInclusiveScanU(bt);
    const uint32_t total = __shfl_sync(0xffffffffu, bincl, 31);
    const uint32_t before = __shfl_sync(0xffffffffu, bincl - bt, rank) +
                            __shfl_sync(0xffffffffu, wincl - wv, warp) + incl - own;
    const uint32_t taken_total = (total >> 16) + min(total & 0xffffu, remaining);
    int32_t* out = stage.selected + static_cast<int64_t>(g) * stage.k;
    // The taken ids to `selected` in index order (ties to the lowest indices) and, for the next
    // stage or the attention, to the parents_s of the blocks that read them (below);
    // kStagesAttendScored's last stage instead pushes each taken id's scores (16 bytes) and pool
    // row (8 bytes) to the block that attends its position (mc positions a block; middle_taken of
    // them in this block's share).
    const bool last = !kAttend && si + 1 == st.num_stages;
    const int32_t mc = (stage.k + cs - 1) / cs;
    // pos / mc in f32 (StageDivByShare: exact, as pos < k <= kSelectStagesMaxParents with an
    // attention (LaunchSelectStages) keeps pos / mc < cs <= 16).
    const float inv_mc = 1.0f / static_cast<float>(max(mc, 1));
    if (scored) {
      const int32_t m0 = min(stage.k, rank * mc);
      middle_taken = max(0, min(min(stage.k, m0 + mc), static_cast<int32_t>(taken_total)) - m0);
    }
    // What follows reads the ids as parents: block b takes its elements [b * per_next,
    // (b + 1) * per_next) of n_next, element e the child of id e / fan_next, so each id goes only
    // to the (one or two) blocks whose elements are its children, and a block waits only for its
    // own parents (the next stage's candidates, or the attention's middle). n_next is at most
    // cs * kStagesMaxPerBlock or cs * kSelectAttendMaxMiddle (LaunchSelectStages), and equals
    // k * fan_next.
    int32_t n_next = 0, fan_next = 1;
    if (si + 1 < st.num_stages) {
      n_next = st.stage[si + 1].c.count;
      fan_next = max(1, st.stage[si + 1].c.fanout);
    } else if (kAttend) {
      n_next = at.middle.count;
      fan_next = 1 << at.fanout_shift;
    }
    const int32_t per_next = StageBlockShare(n_next, cs);
    if (!last && tid == 0) {
      const uint32_t own_parents =
          scored ? 0u
                 : static_cast<uint32_t>(OwnParentCount(n_next, fan_next, per_next, rank,
                                                        static_cast<int32_t>(taken_total)));
      MbarExpect(SharedAddr(&mbar[6]), scored ? middle_taken * (16 + 8)
                                              : own_parents * sizeof(int32_t));
    }
    RegForEachTaken<P>(key, ids, prefix, mask, remaining, before, stage.k,
                       [&](uint32_t pos, int32_t id, int j) {
                         out[pos] = id;
                         if (scored) {
                           const int b = StageDivByShare(pos, inv_mc);
                           const int r = kSelectAttendMaxFixed + static_cast<int>(pos) - b * mc;
                           const int32_t slot = slot4[j];
                           const int64_t row =
                               slot >= 0 && slot < at.num_slots
                                   ? (static_cast<int64_t>(slot) << stage.page_shift) +
                                         (id & ((1 << stage.page_shift) - 1))
                                   : -1;
                           const int32_t i = lfirst + j;
                           const uint4 v = make_uint4(
                               __float_as_uint(sc[0][i]), __float_as_uint(sc[1][i]),
                               __float_as_uint(sc[2][i]), __float_as_uint(sc[3][i]));
                           const uint32_t bar = MapToRank(SharedAddr(&mbar[6]), b);
                           StAsync16(MapToRank(SharedAddr(k_s + r * kAttendPitch), b), v, bar);
                           const uint64_t u = static_cast<uint64_t>(row);
                           StAsync8(MapToRank(SharedAddr(&row_s[r]), b),
                                    make_float2(__uint_as_float(static_cast<uint32_t>(u)),
                                                __uint_as_float(static_cast<uint32_t>(u >> 32))),
                                    bar);
                         } else if (!last) {
                           const uint32_t dst = SharedAddr(&parents_s[pos]);
                           const uint32_t bar = SharedAddr(&mbar[6]);
                           int b0, b1;
                           ParentReaderBlocks(n_next, fan_next, per_next, cs,
                                              static_cast<int32_t>(pos), &b0, &b1);
                           for (int r = b0; r <= b1; ++r) {
                             StAsync4(MapToRank(dst, r), static_cast<uint32_t>(id),
                                      MapToRank(bar, r));
                           }
                         }
                       });
    for (int64_t j = taken_total + static_cast<int64_t>(rank) * kStagesThreads + tid; j < stage.k;
         j += static_cast<int64_t>(cs) * kStagesThreads) {
      out[j] = -1;
    }
    if (!last && !scored) {
      for (int32_t j = static_cast<int32_t>(taken_total) + tid; j < stage.k; j += kStagesThreads) {
        parents_s[j] = -1;  // visible after the next stage's (or the attention's) first barrier
      }
    }
    stamp(phase0 + 8);
  }

  if constexpr (kAttend) {
    // The ids of the middle: the last stage's in parents_s, or a skipped head's kept ones. The
    // fixed rows (unless copied during the first stage) while the ids arrive; a skipped head's
    // after the start barrier (which orders thread 0's mbarrier initialisation before them).
    const int32_t* ids = parents_s;
    if (skipped) {
      ids = at.middle.parents + static_cast<int64_t>(g) * at.middle.num_parents;
      asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // mbarriers ready
    }
    if (!fixed_early) fixed_rows(fixed_row_of());
    // kF8 with K rows for the middle (not kStagesAttendScored): fixed rows copied during the first
    // stage are converted while the middle's ids arrive (session 30, H200: 128K quest 26.0 ->
    // 25.7 us, but tokenselect 41.7 -> 42.3 there: its middle's V copies wait for it).
    const bool fixed_converted = kF8 && kAttend == kStagesAttendRows && fixed_early;
    if constexpr (kF8) {
      int32_t f0 = 0;
      if (fixed_converted) {
        wait_bar(kFixedBar);
        const int r0 = 8 * kAttendGroups * warp;
        if (r0 < AttendFixedShare(at, cs, rank, &f0)) ConvertFp8Rows(k_s, v_s, r0, true);
      }
    }
    if (!skipped) {
      wait_bar(6);
      __syncthreads();  // parents_s's -1 tail written
    }
    const int32_t nm = at.middle.count, mc = (nm + cs - 1) / cs;
    const int32_t m0 = min(nm, rank * mc), m_count = min(nm, m0 + mc) - m0;
    // kStagesAttendScored: the middle's scores and pool rows were pushed with its ids.
    const bool scored = kAttend == kStagesAttendScored && !skipped;
    if (scored && tid < kSelectAttendMaxMiddle) {
      const int r = kSelectAttendMaxFixed + tid;
      int64_t row = -1;
      if (tid < middle_taken) {
        row = row_s[r];
      } else {
        row_s[r] = -1;
      }
      AttendIssueRow<true, kF8>(at, k_s, v_s, r, row,
                                SharedAddr(&mbar[kTileBar + tid / kAttendTile]));
    } else if (tid < kSelectAttendMaxMiddle) {  // staging row kSelectAttendMaxFixed + tid
      int64_t row = -1;
      if (tid < m_count) {
        const int32_t i = m0 + tid;
        const int32_t parent = ids[i >> at.fanout_shift];
        if (parent >= 0) {
          const int64_t id = (static_cast<int64_t>(parent) << at.fanout_shift) +
                             (i & ((1 << at.fanout_shift) - 1));
          if (id >= at.middle.begin && id < at.middle.end) {
            row = TokenRow(at.table, at.table_pages, at.num_slots, at.page_size, g,
                           static_cast<int32_t>(id));
          }
        }
      }
      row_s[kSelectAttendMaxFixed + tid] = row;
      AttendIssueRow<false, kF8>(at, k_s, v_s, kSelectAttendMaxFixed + tid, row,
                                 SharedAddr(&mbar[kTileBar + tid / kAttendTile]));
    }
    __syncthreads();  // row_s and every tx-count complete
    if (tid == 0) {
      if (!fixed_early) MbarArrive(SharedAddr(&mbar[kFixedBar]));
      for (int t = 0; t < kAttendMidTiles; ++t) MbarArrive(SharedAddr(&mbar[kTileBar + t]));
    }
    constexpr int A0 = 1 + kSelectStagesMax * kSelectStagesPhasesPerStage;  // attention's stamps
    stamp(A0);
    if (!fixed_converted) wait_bar(kFixedBar);  // the fixed rows
    stamp(A0 + 1);
    AttendState ast;
    ast.Reset();
    {
      int32_t f0 = 0;
      const int32_t f_count = AttendFixedShare(at, cs, rank, &f0);
      const int r0 = 8 * kAttendGroups * warp;
      if (r0 < f_count) {
        if (kF8 && !fixed_converted) ConvertFp8Rows(k_s, v_s, r0, true);
        AttendRows<kF8>(k_s, v_s, row_s, r0, f_count, key_a, group, ast, false, key_descale);
      }
    }
    stamp(A0 + 2);
#pragma unroll
    for (int t = 0; t < kAttendMidTiles; ++t) {
      wait_bar(kTileBar + t);  // tile t resident
      stamp(A0 + 3 + 2 * t);
      const int r0 = kSelectAttendMaxFixed + t * kAttendTile + 8 * kAttendGroups * warp;
      if (r0 < kSelectAttendMaxFixed + m_count) {
        if constexpr (kF8) ConvertFp8Rows(k_s, v_s, r0, !scored);
        AttendRows<kF8>(k_s, v_s, row_s, r0, kSelectAttendMaxFixed + m_count, key_a, group, ast,
                        scored, key_descale);
      }
      stamp(A0 + 4 + 2 * t);
    }
    // The warps' partials (over the K rows, no longer read), then the block's per head pushed to
    // block h (cs >= group) with st.async; block h merges the cs partials of head h.
    __syncthreads();
    float* part_w = reinterpret_cast<float*>(k_s);  // [W][G][kAttendPartStride]
    ast.WritePartial(part_w + (warp * G + (lane >> 2 & 3)) * kAttendPartStride);
    float* recv = reinterpret_cast<float*>(recv_hist);  // [cs][kAttendPartStride]
    if (tid == 0 && rank < group) {
      MbarExpect(SharedAddr(&mbar[7]), cs * 130 * sizeof(float));
    }
    __syncthreads();
    {
      const int h = tid >> 6, pair = tid & 63;
      if (h < group) {
        float mx = NegInfF();
#pragma unroll
        for (int w = 0; w < W; ++w) mx = fmaxf(mx, part_w[(w * G + h) * kAttendPartStride + 128]);
        float o0 = 0.0f, o1 = 0.0f, l = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const float* pw = part_w + (w * G + h) * kAttendPartStride;
          const float mw = pw[128];
          if (mw > NegInfF()) {
            const float e = __expf(mw - mx);
            const float2 ov = *reinterpret_cast<const float2*>(pw + 2 * pair);
            o0 += e * ov.x, o1 += e * ov.y, l += e * pw[129];
          }
        }
        const uint32_t bar = MapToRank(SharedAddr(&mbar[7]), h);
        StAsync8(MapToRank(SharedAddr(recv + rank * kAttendPartStride + 2 * pair), h),
                 make_float2(o0, o1), bar);
        if (pair == 0) {
          StAsync8(MapToRank(SharedAddr(recv + rank * kAttendPartStride + 128), h),
                   make_float2(mx, l), bar);
        }
      }
    }
    if (rank < group) {
      wait_bar(7);  // every block's partial of head `rank`
      if (tid < 128) {
        float mx = NegInfF();
        for (int b = 0; b < cs; ++b) mx = fmaxf(mx, recv[b * kAttendPartStride + 128]);
        float o = 0.0f, l = 0.0f;
        for (int b = 0; b < cs; ++b) {
          const float mb = recv[b * kAttendPartStride + 128];
          if (mb > NegInfF()) {
            const float e = __expf(mb - mx);
            o += e * recv[b * kAttendPartStride + tid];
            l += e * recv[b * kAttendPartStride + 129];
          }
        }
        const int64_t qh = static_cast<int64_t>(g) * group + rank;
        at.out[qh * 128 + tid] = l > 0.0f ? o / l * at.v_scale : 0.0f;
        if (tid == 0) at.lse[qh] = l > 0.0f ? mx + logf(l) : NegInfF();
      }
    }
    stamp(A0 + 3 + 2 * kAttendMidTiles);
  }
  // No block leaves while another may still push to it or read what it pushed.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// ---- Split-K decode over long lists on tensor cores (LaunchSelectedDecodeMma) -----------------
// The split-K decode kernel's work items (SelectedAttentionShape: KV head g, virtual positions
// [item * chunk, ...) of prefix + middle + suffix), attended with AttendRows: each warp runs a
// pipeline of its own over rows 16w + 64k of the item (k = 0, 1, ...), kDecodeMmaStages tiles
// of 16 K and V rows in flight per warp (bulk copies completing on the warp's mbarrier of the
// stage), so a block of four warps keeps up to 12 tiles (96 KB of bf16 rows) in flight and no
// barrier is taken until the warps' partials merge. AttendRows<kF8, true>: the accumulator is
// rescaled only when a max moves. bf16 pools, or fp8 (V rows converted to f16 in place by
// ConvertFp8Rows, K rows read as fp8); head_dim 128, at most 4 query heads per KV head, no
// per-slot scales (SelectedDecodeMmaSupports). The scores are the CUDA-core products within f32
// rounding (the query in three parts, StageATables), the weights in two parts: the result is the
// CUDA-core kernel's to rounding, written in its partial format for SelectedCombineKernel.
// H200 (bench/RESULTS.md, session 33): 1M tokens bf16 1.24 ms (72% of HBM bandwidth), against
// 2.00 ms for the CUDA-core group-4 kernel. Tried there: two stages per warp at three blocks per
// SM (slower: 1.61 ms), or at two (the same within 1.5%).
constexpr int kDecodeMmaWarps = 4;
constexpr int kDecodeMmaThreads = 32 * kDecodeMmaWarps;
constexpr int kDecodeMmaRows = 16;   // rows per tile: one AttendRows
constexpr int kDecodeMmaStages = 3;  // tiles in flight per warp
constexpr int kDecodeMmaBars = kDecodeMmaWarps * kDecodeMmaStages;
// Dynamic shared memory: the key table, the fp8 descales, the mbarriers, the tiles' pool rows,
// then the tiles' K and V staging rows (16-byte aligned for the bulk copies and ldmatrix): 111 KB,
// two blocks per SM.
constexpr int kDecodeMmaKeyA = 0;
constexpr int kDecodeMmaDescale = kDecodeMmaKeyA + 16 * kStagesKeyStride * 2;
constexpr int kDecodeMmaBar = kDecodeMmaDescale + 16;
constexpr int kDecodeMmaRowIds = kDecodeMmaBar + kDecodeMmaBars * 8;
constexpr int kDecodeMmaTiles = kDecodeMmaRowIds + kDecodeMmaBars * kDecodeMmaRows * 8;
constexpr int kDecodeMmaTileBytes = 2 * kDecodeMmaRows * kAttendPitch * 2;  // K rows, V rows
constexpr int kDecodeMmaSmem = kDecodeMmaTiles + kDecodeMmaBars * kDecodeMmaTileBytes;
static_assert(kDecodeMmaTiles % 16 == 0 && kDecodeMmaTileBytes % 16 == 0,
              "bulk copies and ldmatrix need 16-byte aligned rows");
static_assert(kDecodeMmaWarps * 4 * kAttendPartStride * 4 <= kDecodeMmaBars * kDecodeMmaTileBytes,
              "the warps' partials fit the staging rows");

template <bool kF8>
__global__ void __launch_bounds__(kDecodeMmaThreads, 2)
    SelectedDecodeMmaKernel(const float* __restrict__ q, const void* __restrict__ k_pool,
                            const void* __restrict__ v_pool, const int32_t* __restrict__ table,
                            DeviceCandidates middle, SelectedAttentionShape shape,
                            const int32_t* __restrict__ prefix_len, float* __restrict__ scratch) {
  extern __shared__ __align__(128) unsigned char dsmem[];
  auto* key_a = reinterpret_cast<__nv_bfloat16*>(dsmem + kDecodeMmaKeyA);
  auto* key_descale = reinterpret_cast<float*>(dsmem + kDecodeMmaDescale);
  auto* mbar = reinterpret_cast<uint64_t*>(dsmem + kDecodeMmaBar);
  auto* row_ids = reinterpret_cast<int64_t*>(dsmem + kDecodeMmaRowIds);
  unsigned char* tiles_s = dsmem + kDecodeMmaTiles;

  const int g = blockIdx.x / shape.items_per_head;
  const int item = blockIdx.x % shape.items_per_head;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t begin = item * shape.chunk;
  int32_t end = min(shape.total, begin + shape.chunk);
  // As SelectedDecodeKernel: with prefix_len set only [0, list.prefix) of the prefix is attended.
  const SelectedList list = SelectedListOf(shape, middle, prefix_len);
  if (middle.count == 0 && shape.suffix_len == 0) end = min(end, list.prefix);

  if (tid < kDecodeMmaBars) MbarInit(SharedAddr(&mbar[tid]), 1);
  StageATables<kF8, false, kDecodeMmaThreads>(q, shape.scale, g, group, nullptr, key_a,
                                              key_descale);
  __syncthreads();

  constexpr int32_t kStride = kDecodeMmaRows * kDecodeMmaWarps;  // positions per round
  const int32_t wbase = begin + kDecodeMmaRows * warp;
  const int tiles = wbase < end ? (end - wbase + kStride - 1) / kStride : 0;
  const auto* kp = static_cast<const unsigned char*>(k_pool);
  const auto* vp = static_cast<const unsigned char*>(v_pool);
  constexpr int kRowBytes = kF8 ? 128 : 256;
  constexpr int kRowOffset = kF8 ? kAttendFp8Offset : 0;  // bytes into a staging row
  auto k_tile = [&](int s) {
    return reinterpret_cast<__nv_bfloat16*>(tiles_s +
                                            (warp * kDecodeMmaStages + s) * kDecodeMmaTileBytes);
  };
  // Tile k of this warp into stage k % kDecodeMmaStages: lane r < 16 resolves position
  // wbase + k * kStride + r and issues its K and V rows, or zero-fills them (not attended).
  auto issue = [&](int k) {
    const int s = k % kDecodeMmaStages;
    __nv_bfloat16* k_s = k_tile(s);
    __nv_bfloat16* v_s = k_s + kDecodeMmaRows * kAttendPitch;
    const uint32_t bar = SharedAddr(&mbar[warp * kDecodeMmaStages + s]);
    if (lane < kDecodeMmaRows) {
      const int32_t v = wbase + k * kStride + lane;
      int64_t row = -1;
      if (v < end) {
        const int32_t t = SelectedListToken(shape, middle, list, g, v);
        if (t >= 0) {
          row = TokenRow(table, shape.table_pages, shape.num_slots, shape.page_size, g, t);
        }
      }
      row_ids[(warp * kDecodeMmaStages + s) * kDecodeMmaRows + lane] = row;
      unsigned char* kd = reinterpret_cast<unsigned char*>(k_s + lane * kAttendPitch) + kRowOffset;
      unsigned char* vd = reinterpret_cast<unsigned char*>(v_s + lane * kAttendPitch) + kRowOffset;
      if (row >= 0) {
        MbarExpectTx(bar, 2 * kRowBytes);
        BulkCopyToShared(SharedAddr(kd), kp + row * kRowBytes, kRowBytes, bar);
        BulkCopyToShared(SharedAddr(vd), vp + row * kRowBytes, kRowBytes, bar);
      } else {
#pragma unroll
        for (int i = 0; i < kRowBytes / 16; ++i) {
          reinterpret_cast<uint4*>(kd)[i] = make_uint4(0, 0, 0, 0);
          reinterpret_cast<uint4*>(vd)[i] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    __syncwarp();
    if (lane == 0) MbarArrive(bar);
  };

  AttendState st;
  st.Reset();
  for (int k = 0; k < min(tiles, kDecodeMmaStages); ++k) issue(k);
  for (int k = 0; k < tiles; ++k) {
    const int s = k % kDecodeMmaStages;
    MbarWait(SharedAddr(&mbar[warp * kDecodeMmaStages + s]), (k / kDecodeMmaStages) & 1);
    __nv_bfloat16* k_s = k_tile(s);
    __nv_bfloat16* v_s = k_s + kDecodeMmaRows * kAttendPitch;
    if constexpr (kF8) ConvertFp8Rows(k_s, v_s, 0, false);  // V only: K is read in place
    AttendRows<kF8, true>(k_s, v_s, row_ids + (warp * kDecodeMmaStages + s) * kDecodeMmaRows,
                          0, kDecodeMmaRows, key_a, group, st, false, key_descale);
    // Every lane's generic accesses to the stage (reads; fp8 V rewritten in place; zero fills)
    // are ordered before the bulk copies that refill it: each lane's proxy fence, then the warp's
    // barrier, then the copies.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (k + kDecodeMmaStages < tiles) issue(k + kDecodeMmaStages);
  }

  // The warps' partials (over the staging rows, no longer read), then the block's per head in
  // the split-K partial format: the unnormalised output, the max, the sum.
  __syncthreads();
  float* part_w = reinterpret_cast<float*>(tiles_s);  // [warps][4][kAttendPartStride]
  st.WritePartial(part_w + (warp * 4 + (lane >> 2 & 3)) * kAttendPartStride);
  __syncthreads();
  float* part = scratch + static_cast<int64_t>(blockIdx.x) * group * (128 + 2);
  for (int i = tid; i < group * 128; i += kDecodeMmaThreads) {
    const int h = i >> 7, d = i & 127;
    float mx = NegInfF();
#pragma unroll
    for (int w = 0; w < kDecodeMmaWarps; ++w) {
      mx = fmaxf(mx, part_w[(w * 4 + h) * kAttendPartStride + 128]);
    }
    float o = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeMmaWarps; ++w) {
      const float* pw = part_w + (w * 4 + h) * kAttendPartStride;
      if (pw[128] > NegInfF()) {
        const float e = __expf(pw[128] - mx);
        o += e * pw[d];
        l += e * pw[129];
      }
    }
    part[h * 130 + d] = o;
    if (d == 0) part[h * 130 + 128] = mx, part[h * 130 + 129] = l;
  }
}

}  // namespace

bool SelectedDecodeMmaSupports(const SelectedAttentionShape& shape, FloatType pool_type) {
  static const bool on = [] {
    const char* v = std::getenv("STRATA_SELECTED_DECODE_MMA");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on && shape.head_dim == 128 && shape.num_kv_heads > 0 &&
         shape.num_q_heads % shape.num_kv_heads == 0 &&
         shape.num_q_heads / shape.num_kv_heads <= 4 && shape.slot_scales == nullptr &&
         (pool_type == FloatType::kBF16 || pool_type == FloatType::kFP8E4M3);
}

cudaError_t LaunchSelectedDecodeMma(const float* q, const void* k_pool, const void* v_pool,
                                    FloatType pool_type, const int32_t* table,
                                    const DeviceCandidates& middle,
                                    const SelectedAttentionShape& shape, const int32_t* prefix_len,
                                    float* scratch, cudaStream_t stream) {
  if (!SelectedDecodeMmaSupports(shape, pool_type)) return cudaErrorInvalidValue;
  const bool fp8 = pool_type == FloatType::kFP8E4M3;
  auto* kernel = fp8 ? SelectedDecodeMmaKernel<true> : SelectedDecodeMmaKernel<false>;
  constexpr int smem = kDecodeMmaSmem;
  // The shared-memory attribute, once per device and form (racing first calls set the same).
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> ready[2][kMaxDevices];
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!ready[fp8][device].load(std::memory_order_acquire)) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    ready[fp8][device].store(true, std::memory_order_release);
  }
  const unsigned blocks = static_cast<unsigned>(shape.num_kv_heads) * shape.items_per_head;
  kernel<<<blocks, kDecodeMmaThreads, smem, stream>>>(q, k_pool, v_pool, table, middle,
                                                                 shape, prefix_len, scratch);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchScoreSummariesOf(const float* q, const T* summaries, int num_kv_heads,
                                   int group, int head_dim, int64_t num_items,
                                   const DeviceCandidates& c, float scale, float* scores,
                                   size_t smem, cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(summaries) % 16 == 0;
  if (aligned && head_dim == 128) {
    return LaunchFastScore<T, 128, true>(q, summaries, num_items, 0, 1, nullptr, 0, num_kv_heads,
                                         group, c, scale, scores, stream);
  } else if (aligned && head_dim == 64) {
    return LaunchFastScore<T, 64, true>(q, summaries, num_items, 0, 1, nullptr, 0, num_kv_heads,
                                        group, c, scale, scores, stream);
  }
  const dim3 grid(ScoreBlocks(c.count), num_kv_heads);
  ScoreSummariesKernel<T><<<grid, kScoreThreads, smem, stream>>>(q, summaries, group, head_dim,
                                                                 num_items, c, scale, scores);
  return cudaGetLastError();
}

cudaError_t LaunchScoreSummaries(const float* q, const void* summaries, FloatType summary_type,
                                 int num_kv_heads, int group, int head_dim, int64_t num_items,
                                 const DeviceCandidates& c, float scale, float* scores,
                                 cudaStream_t stream) {
  if (c.count == 0 || num_kv_heads == 0) return cudaSuccess;
  if (group < 1 || group > kSelectMaxGroup || num_kv_heads > 65535) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(group) * head_dim * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  if (summary_type == FloatType::kBF16) {
    return LaunchScoreSummariesOf(q, static_cast<const __nv_bfloat16*>(summaries), num_kv_heads,
                                  group, head_dim, num_items, c, scale, scores, smem, stream);
  }
  if (summary_type != FloatType::kF32) return cudaErrorInvalidValue;
  return LaunchScoreSummariesOf(q, static_cast<const float*>(summaries), num_kv_heads, group,
                                head_dim, num_items, c, scale, scores, smem, stream);
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
  const bool aligned = reinterpret_cast<uintptr_t>(k_pool) % 16 == 0;
  const int page_shift = Log2Exact(page_size);
  const int fanout_shift = c.parents == nullptr ? 0 : Log2Exact(c.fanout);
  if (aligned && pool_type == FloatType::kBF16 && head_dim == 128 && group <= 4 &&
      page_shift >= 0 && fanout_shift >= 0 && PagedKeyScoreEnabled()) {
    int rounds = 8;
    if (const char* e = std::getenv("STRATA_SELECTION_KEY_ROUNDS")) {
      const std::string_view v(e);
      rounds = v == "2" ? 2 : v == "4" ? 4 : 8;
    }
    const int64_t per_block = int64_t{kScoreWarps} * (32 / kSubLanes) * rounds;
    const int64_t blocks =
        std::min<int64_t>((static_cast<int64_t>(c.count) + per_block - 1) / per_block, 65535);
    auto* kernel_fn = rounds == 2   ? PagedKeyScoreKernel<2>
                      : rounds == 8 ? PagedKeyScoreKernel<8>
                                    : PagedKeyScoreKernel<4>;
    return LaunchSelection(kernel_fn, dim3(static_cast<unsigned>(blocks), num_kv_heads),
                           dim3(kScoreThreads), 1, stream, q,
                           static_cast<const __nv_bfloat16*>(k_pool), num_slots, page_shift,
                           page_table, table_pages, group, c, fanout_shift, scale, scores);
  }
  if (aligned && pool_type == FloatType::kBF16 && head_dim == 128) {
    return LaunchFastScore<__nv_bfloat16, 128, false>(
        q, static_cast<const __nv_bfloat16*>(k_pool), 0, num_slots, page_size, page_table,
        table_pages, num_kv_heads, group, c, scale, scores, stream);
  } else if (aligned && pool_type == FloatType::kBF16 && head_dim == 64) {
    return LaunchFastScore<__nv_bfloat16, 64, false>(
        q, static_cast<const __nv_bfloat16*>(k_pool), 0, num_slots, page_size, page_table,
        table_pages, num_kv_heads, group, c, scale, scores, stream);
  } else if (aligned && pool_type == FloatType::kF32 && head_dim == 128) {
    return LaunchFastScore<float, 128, false>(q, static_cast<const float*>(k_pool), 0, num_slots,
                                              page_size, page_table, table_pages, num_kv_heads,
                                              group, c, scale, scores, stream);
  } else if (pool_type == FloatType::kBF16) {
    ScoreKeysKernel<__nv_bfloat16><<<grid, kScoreThreads, smem, stream>>>(
        q, static_cast<const __nv_bfloat16*>(k_pool), num_slots, page_size, page_table,
        table_pages, group, head_dim, c, scale, scores);
  } else if (pool_type == FloatType::kF32) {
    ScoreKeysKernel<float><<<grid, kScoreThreads, smem, stream>>>(
        q, static_cast<const float*>(k_pool), num_slots, page_size, page_table, table_pages,
        group, head_dim, c, scale, scores);
  } else if (pool_type == FloatType::kFP8E4M3) {
    ScoreKeysKernel<__nv_fp8_e4m3><<<grid, kScoreThreads, smem, stream>>>(
        q, static_cast<const __nv_fp8_e4m3*>(k_pool), num_slots, page_size, page_table,
        table_pages, group, head_dim, c, scale, scores);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// VoteTopK's kernel by size, from the H100 graph timings of each op (bench/RESULTS.md, "VoteTopK
// by size: bitonic sort and the cluster kernel as one block"): BitonicVoteTopKKernel up to
// kBitonicDefaultMaxCandidates (128 candidates: 4.9 us against 7.9; 1024: 9.9 against 15.0 for
// the 2-block cluster), ClusterVoteTopKKernel as a single block of up to 512 threads up to
// kClusterOneBlockDefaultMaxCandidates (2048: 10.8-11.7 us against 15.5-17.3 for the 4-block
// cluster and 17.2 for the bitonic kernel), the cluster kernel up to kClusterTopKMaxCandidates
// (8192: 21.0 us against 36.3 as one block and 70 bitonic), VoteTopKKernel beyond. For group <= 4
// (bench/RESULTS.md, "Selection ops: register top-k"): RegisterVoteTopKKernel up to 2048
// (1024: 7.1 us against 9.8 bitonic; 2048: 8.7-9.2 against 10.8-11.6, and against 12.0-25.4
// for its 2- and 4-block cluster form), ClusterRegisterVoteTopKKernel from 2049 to 8192
// candidates (8192: 15.2-15.4 us with 8 blocks against 20.9-21.1 for the cluster kernel, 17.0
// with 4 blocks and 22.3 with 2; only 8192 was measured in that range).
// STRATA_SELECTION_TOPK=bitonic (or cluster, cluster1, block) in the environment forces that
// kernel wherever it can run (bitonic and cluster1: n <= 8192; cluster: n <= 65536), for A/B
// timing; cluster1 is the cluster kernel as one block.
constexpr int64_t kBitonicDefaultMaxCandidates = 1024;
constexpr int64_t kClusterOneBlockDefaultMaxCandidates = 2048;

// 0 none, 1 cluster, 2 block, 3 bitonic, 4 cluster1, 5 reg, 6 regcluster.
int TopKChoiceByName(std::string_view s) {
  return s == "cluster" ? 1 : s == "block" ? 2 : s == "bitonic" ? 3 : s == "cluster1" ? 4
         : s == "reg" ? 5 : s == "regcluster" ? 6 : 0;
}

// The kernel forced for n candidates (TopKChoiceByName; 0 none), read at every launch (tests
// switch it): STRATA_SELECTION_TOPK_MAP="N1:choice[:blocks],N2:..." (the first entry with n <= N
// decides; blocks: the cluster size of regcluster), else STRATA_SELECTION_TOPK=choice
// everywhere. For A/B timing of mixed choices in one pipeline. *cluster_blocks (when set) gets
// the entry's blocks, or is left alone.
int TopKOverride(int64_t n, int* cluster_blocks = nullptr) {
  if (const char* m = std::getenv("STRATA_SELECTION_TOPK_MAP")) {
    std::string_view s(m);
    while (!s.empty()) {
      const size_t comma = s.find(',');
      const std::string_view e = s.substr(0, comma);
      s = comma == std::string_view::npos ? std::string_view() : s.substr(comma + 1);
      const size_t c1 = e.find(':');
      if (c1 == std::string_view::npos) continue;
      if (n > std::strtoll(std::string(e.substr(0, c1)).c_str(), nullptr, 10)) continue;
      const std::string_view rest = e.substr(c1 + 1);
      const size_t c2 = rest.find(':');
      if (cluster_blocks != nullptr && c2 != std::string_view::npos) {
        *cluster_blocks = std::atoi(std::string(rest.substr(c2 + 1)).c_str());
      }
      return TopKChoiceByName(rest.substr(0, c2));
    }
  }
  const char* e = std::getenv("STRATA_SELECTION_TOPK");
  return e == nullptr ? 0 : TopKChoiceByName(e);
}

// The register kernels' histogram add (RegHistAdd): STRATA_SELECTION_REG_HIST=0|1|2, default 2
// (H100, graph of the op alone: 1024 candidates 7.1 us against 7.6 with 0 and 7.7 with 1; 2048:
// 8.7 / 9.5 / 9.0 at 1M).
int RegHistMode() {
  const char* e = std::getenv("STRATA_SELECTION_REG_HIST");
  if (e == nullptr) return 2;
  const std::string_view s(e);
  return s == "0" ? 0 : s == "1" ? 1 : 2;
}

// The most a part may take for PartStagesKernel to select it by one warp (PartWarpTopK; the
// part must also hold at most 256 candidates): 16, or STRATA_SELECT_PART_WARP_TOPK=N (0: never,
// the block's radix select for every stage; A/B timing).
int PartWarpTopKMax() {
  const char* e = std::getenv("STRATA_SELECT_PART_WARP_TOPK");
  return e == nullptr ? 16 : std::max(0, std::atoi(e));
}

// Whether PartStagesKernel looks up a key stage's page slots while the stage before is selected
// by one warp (PartSlotPrefetchMask): yes, or STRATA_SELECT_PART_PREFETCH=0 (A/B timing).
bool PartSlotPrefetchOn() {
  const char* e = std::getenv("STRATA_SELECT_PART_PREFETCH");
  return e == nullptr || std::string_view(e) != "0";
}

// Blocks per cluster of ClusterRegisterVoteTopKKernel: about 256 threads of 4 candidates per
// block, 2 to 8 blocks; STRATA_SELECTION_REG_CLUSTER=2|4|8 asks for that many (A/B timing).
// STRATA_SELECTION_TOPK_MAP's blocks take precedence.
int RegClusterBlocksFor(int64_t n) {
  int cs = static_cast<int>(std::clamp<int64_t>((n + 1023) / 1024, 2, kClusterMax));
  if (const char* e = std::getenv("STRATA_SELECTION_REG_CLUSTER")) {
    const std::string_view s(e);
    cs = s == "2" ? 2 : s == "4" ? 4 : s == "8" ? 8 : cs;
  }
  int mapped = 0;
  TopKOverride(n, &mapped);
  if (mapped == 2 || mapped == 4 || mapped == 8) cs = mapped;
  return cs;
}

// Candidates per thread of RegisterVoteTopKKernel: the fewest of 2, 4, 8 that keep the block
// within 1024 threads, at least 4 from 1025 candidates on;
// STRATA_SELECTION_REG_PER=2|4|8 asks for that many where the block stays within 1024 threads
// (A/B timing).
int RegisterPerFor(int64_t n) {
  int per = n <= 1024 ? 2 : n <= 4096 ? 4 : 8;
  if (const char* e = std::getenv("STRATA_SELECTION_REG_PER")) {
    const std::string_view s(e);
    const int want = s == "2" ? 2 : s == "4" ? 4 : s == "8" ? 8 : 0;
    if (want != 0 && (n + want - 1) / want <= kRegTopKMaxThreads) per = want;
  }
  return per;
}

// Candidates per thread of the bitonic kernel: 2 up to 1024 candidates (H100: 4.9 us at 128
// against 7.2 with 4 and 10.1 with 8; 9.9 / 10.0 / 11.0 at 1024), 4 up to 4096 (2048: 17.2 us
// against 19.6 with 2), else 8 (the block stays within 1024 threads);
// STRATA_SELECTION_BITONIC_PER=2|4|8 asks for more (A/B timing).
int BitonicPerFor(int64_t n) {
  int per = n <= 1024 ? 2 : n <= 4096 ? 4 : 8;
  if (const char* e = std::getenv("STRATA_SELECTION_BITONIC_PER")) {
    const std::string_view s(e);
    const int want = s == "2" ? 2 : s == "4" ? 4 : s == "8" ? 8 : 0;
    per = std::max(per, want);
  }
  return per;
}

// The cluster kernel as a single block (no cluster barriers) can run up to this many candidates
// (512 threads of 16 candidates).
constexpr int64_t kClusterOneBlockMaxCandidates = int64_t{kClusterTopKMaxThreads} * 16;

// 0 block, 1 cluster, 2 bitonic, 3 cluster kernel as one block, 4 register kernel, 5 register
// cluster kernel (4 and 5: group <= 4 only).
int TopKKernelFor(int64_t n, int group = kSelectMaxGroup) {
  const int o = TopKOverride(n);
  const bool reg_ok = group <= kRegTopKMaxGroup && n <= kRegTopKMaxCandidates;
  if (o == 5 && reg_ok) return 4;
  if (o == 6 && group <= kRegTopKMaxGroup && n <= kRegClusterMaxCandidates && n > 1) return 5;
  if (o == 0 && reg_ok && n <= kRegTopKDefaultMaxCandidates) return 4;
  if (o == 0 && group <= kRegTopKMaxGroup && n <= kRegClusterDefaultMaxCandidates) return 5;
  if (o == 3 && n <= kBitonicMaxCandidates) return 2;
  if (o == 4 && n <= kClusterOneBlockMaxCandidates) return 3;
  if (o == 2) return 0;
  if (o == 1) return n <= kClusterTopKMaxCandidates ? 1 : 0;
  if (n <= kBitonicDefaultMaxCandidates) return 2;
  if (n <= kClusterOneBlockDefaultMaxCandidates) return 3;
  return n <= kClusterTopKMaxCandidates ? 1 : 0;
}

int64_t VoteTopKScratchBytes(int num_kv_heads, int64_t n) {
  if (n <= kTopKSharedKeys || TopKKernelFor(n) != 0) return 0;
  return static_cast<int64_t>(num_kv_heads) * n * sizeof(uint32_t);
}

cudaError_t LaunchVoteTopK(const float* scores, int num_kv_heads, int group,
                           const DeviceCandidates& c, int k, float* vote, int32_t* selected,
                           void* scratch, cudaStream_t stream) {
  if (num_kv_heads == 0) return cudaSuccess;
  if (group < 1 || group > kSelectMaxGroup || k < 0) return cudaErrorInvalidValue;
  if (k == 0 && c.count == 0) return cudaSuccess;
  const int kernel = TopKKernelFor(c.count, group);
  if (kernel == 4) {
    const int per = RegisterPerFor(c.count);
    const int threads = static_cast<int>(
        std::clamp<int64_t>((c.count + per * 32 - 1) / (per * 32) * 32, 32, kRegTopKMaxThreads));
    auto* kernel_fn = per == 2   ? RegisterVoteTopKKernel<2>
                      : per == 4 ? RegisterVoteTopKKernel<4>
                                 : RegisterVoteTopKKernel<8>;
    kernel_fn<<<num_kv_heads, threads, 0, stream>>>(scores, group, c, k, vote, selected,
                                                    RegHistMode());
    return cudaGetLastError();
  }
  if (kernel == 5) {
    const int64_t n = c.count;
    int cs = RegClusterBlocksFor(n);
    int per = 4;
    if (const char* e = std::getenv("STRATA_SELECTION_REG_PER")) {
      const std::string_view s(e);
      per = s == "2" ? 2 : s == "8" ? 8 : 4;
    }
    // Fit the block limit: more candidates per thread, then more blocks.
    while ((n + int64_t{cs} * per - 1) / (int64_t{cs} * per) > kRegClusterMaxThreads &&
           (per < 8 || cs < kClusterMax)) {
      if (per < 8) {
        per *= 2;
      } else {
        cs = std::min(cs * 2, kClusterMax);
      }
    }
    const int64_t per_block = (n + cs - 1) / cs;
    const int threads = static_cast<int>(std::clamp<int64_t>(
        ((per_block + per - 1) / per + 31) / 32 * 32, 32, kRegClusterMaxThreads));
    auto* kernel_fn = per == 2   ? ClusterRegisterVoteTopKKernel<2>
                      : per == 4 ? ClusterRegisterVoteTopKKernel<4>
                                 : ClusterRegisterVoteTopKKernel<8>;
    return LaunchSelection(kernel_fn, dim3(cs, num_kv_heads), dim3(threads), cs, stream, scores,
                           group, c, k, vote, selected, RegHistMode());
  }
  if (kernel == 2) {
    const int per = BitonicPerFor(c.count);
    int nsort = 32 * per;
    while (nsort < c.count) nsort <<= 1;
    const int64_t smem = BitonicSmemBytes(nsort, per);
    auto* kernel_fn = per == 2 ? BitonicVoteTopKKernel<2>
                      : per == 4 ? BitonicVoteTopKKernel<4> : BitonicVoteTopKKernel<8>;
    if (smem > 48 * 1024) {
      const cudaError_t e = cudaFuncSetAttribute(
          kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    kernel_fn<<<num_kv_heads, nsort / per, smem, stream>>>(scores, group, c, k, nsort, vote,
                                                          selected);
    return cudaGetLastError();
  }
  if (kernel == 1 || kernel == 3) {
    // Cluster kernel: about 128 threads per block and 4 (n <= 16K) or 16 candidates per thread;
    // as one block (kernel 3, n <= 8192): 4 (n <= 2048) or 16 candidates per thread.
    const int64_t n = c.count;
    int per = n <= 16384 ? 4 : 16;
    int cs = static_cast<int>(std::clamp<int64_t>((n + per * 128 - 1) / (per * 128), 1,
                                                  kClusterMax));
    if (kernel == 3) per = n <= 2048 ? 4 : 16, cs = 1;
    const int64_t per_block = (n + cs - 1) / cs;
    const int threads = static_cast<int>(std::clamp<int64_t>(
        ((per_block + per - 1) / per + 31) / 32 * 32, 32, kClusterTopKMaxThreads));
    const dim3 grid(cs, num_kv_heads);
    if (per == 4) {
      return LaunchSelection(ClusterVoteTopKKernel<4>, grid, dim3(threads), cs, stream, scores,
                             group, c, k, vote, selected);
    }
    return LaunchSelection(ClusterVoteTopKKernel<16>, grid, dim3(threads), cs, stream, scores,
                           group, c, k, vote, selected);
  }
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

namespace {
constexpr int kStagesMaxDevices = 64;
// What SelectStagesKernel can do on a device, found once per device: whether <kStagesNoAttend>
// can have its shared memory (else the callers run the ops one by one); whether both attending
// forms can; how many 16-block clusters of each fit at once (attending: the fewer of the two).
struct StagesDeviceInfo {
  bool usable = false;
  bool attend = false;
  int fit16 = 0;
  int attend_fit16 = 0;
};
std::once_flag g_stages_once[kStagesMaxDevices];
StagesDeviceInfo g_stages_info[kStagesMaxDevices];

// The current device's StagesDeviceInfo, or nullptr (no device, or past kStagesMaxDevices).
const StagesDeviceInfo* StagesInfo() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kStagesMaxDevices) {
    cudaGetLastError();
    return nullptr;
  }
  std::call_once(g_stages_once[device], [device] {
    StagesDeviceInfo& in = g_stages_info[device];
    // Static plus dynamic shared memory is above the default 48 KiB. A refused attribute is not
    // the caller's error.
    auto allow = [](const void* kernel, int bytes) {
      const bool ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           bytes) == cudaSuccess;
      cudaGetLastError();
      return ok;
    };
    // Both pool formats' instantiations (bf16, fp8), so a shape runs on either or neither, and
    // the instances with the selection cache's check (kCheck: LaunchSelectStages).
    in.usable = allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesNoAttend>),
                      kStagesDynamicSmem) &&
                allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesNoAttend, true>),
                      kStagesDynamicSmem) &&
                allow(reinterpret_cast<const void*>(
                          SelectStagesKernel<kStagesNoAttend, false, true>),
                      kStagesDynamicSmem);
    in.attend =
        in.usable &&
        allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesAttendRows, false, true>),
              kStagesAttendSmem) &&
        allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesAttendRows, true, true>),
              kStagesAttendSmem) &&
        allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesAttendRows>),
              kStagesAttendSmem) &&
        allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesAttendScored>),
              kStagesAttendSmem) &&
        allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesAttendRows, true>),
              kStagesAttendSmem) &&
        allow(reinterpret_cast<const void*>(SelectStagesKernel<kStagesAttendScored, true>),
              kStagesAttendSmem);
    // Clusters of 16 blocks resident at once: the fewest over the instances of a form.
    in.fit16 =
        in.usable
            ? std::min(
                  {MaxActiveClusters(SelectStagesKernel<kStagesNoAttend>, 16, kStagesThreads,
                                     kStagesDynamicSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesNoAttend, true>, 16,
                                     kStagesThreads, kStagesDynamicSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesNoAttend, false, true>, 16,
                                     kStagesThreads, kStagesDynamicSmem)})
            : 0;
    in.attend_fit16 =
        in.attend
            ? std::min(
                  {MaxActiveClusters(SelectStagesKernel<kStagesAttendRows>, 16, kStagesThreads,
                                     kStagesAttendSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesAttendScored>, 16, kStagesThreads,
                                     kStagesAttendSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesAttendRows, true>, 16,
                                     kStagesThreads, kStagesAttendSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesAttendScored, true>, 16,
                                     kStagesThreads, kStagesAttendSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesAttendRows, false, true>, 16,
                                     kStagesThreads, kStagesAttendSmem),
                   MaxActiveClusters(SelectStagesKernel<kStagesAttendRows, true, true>, 16,
                                     kStagesThreads, kStagesAttendSmem)})
            : 0;
  });
  return &g_stages_info[device];
}

// Blocks per cluster on a device described by `in` (SelectStagesClusterBlocks).
int ClusterBlocksOf(const StagesDeviceInfo* in, int num_kv_heads) {
  if (in == nullptr || !in->usable) return 0;
  const char* e = std::getenv("STRATA_SELECT_STAGES_CLUSTER");
  if (e != nullptr && std::string_view(e) == "8") return 8;
  return in->fit16 >= num_kv_heads ? 16 : 8;
}

// Whether the attention's shares fit cs-block clusters (SelectStagesCanAttend).
bool AttendFits(const StagesDeviceInfo* in, int cs, int num_kv_heads, int64_t fixed,
                int64_t middle) {
  return in != nullptr && in->attend && cs > 0 && (cs == 8 || in->attend_fit16 >= num_kv_heads) &&
         fixed >= 0 && middle >= 0 && (fixed + cs - 1) / cs <= kSelectAttendMaxFixed &&
         (middle + cs - 1) / cs <= kSelectAttendMaxMiddle;
}
}  // namespace

int SelectStagesClusterBlocks(int num_kv_heads) {
  return ClusterBlocksOf(StagesInfo(), num_kv_heads);
}

bool SelectStagesAttendScored(const DeviceSelectStages& stages, const DeviceSelectAttend& a) {
  if (stages.num_stages < 1 || stages.num_stages > kSelectStagesMax) return false;
  const DeviceSelectStage& last = stages.stage[stages.num_stages - 1];
  const char* e = std::getenv("STRATA_SELECT_ATTEND_SCORES");
  return (e == nullptr || std::string_view(e) != "0") &&
         last.kind != SelectStageKind::kSummariesBF16 && a.fanout_shift == 0 &&
         last.rows == a.k_pool && last.table == a.table && last.table_pages == a.table_pages &&
         (int64_t{1} << last.page_shift) == a.page_size && last.num_items == a.num_slots;
}

cudaError_t SetSelectStagesPhaseStamps(long long* stamps, int max_blocks) {
  cudaError_t e = cudaMemcpyToSymbol(g_stages_phase_stamps, &stamps, sizeof(stamps));
  if (e != cudaSuccess) return e;
  const int blocks = stamps == nullptr ? 0 : max_blocks;
  return cudaMemcpyToSymbol(g_stages_phase_blocks, &blocks, sizeof(blocks));
}

int64_t SelectStagesMaxCandidates(int num_kv_heads) {
  return int64_t{SelectStagesClusterBlocks(num_kv_heads)} * kStagesMaxPerBlock;
}

bool SelectStagesCanAttend(int num_kv_heads, int64_t fixed, int64_t middle) {
  const StagesDeviceInfo* in = StagesInfo();
  return AttendFits(in, ClusterBlocksOf(in, num_kv_heads), num_kv_heads, fixed, middle);
}

cudaError_t LaunchSelectStages(const float* q, float scale, int num_kv_heads, int group,
                               const DeviceSelectStages& stages, const int32_t* skip,
                               const DeviceSelectAttend* attend, cudaStream_t stream,
                               const DeviceCacheCheck* check) {
  if (num_kv_heads == 0 || stages.num_stages == 0) return cudaSuccess;
  if (group < 1 || group > kRegTopKMaxGroup || num_kv_heads > 65535 || stages.num_stages < 0 ||
      stages.num_stages > kSelectStagesMax ||
      (check != nullptr && (skip != nullptr || check->cached == nullptr || check->q != q ||
                            check->valid == nullptr || check->reuse == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const StagesDeviceInfo* info = StagesInfo();
  const int cs = ClusterBlocksOf(info, num_kv_heads);
  if (cs == 0) return cudaErrorInvalidValue;
  // The pool format: fp8 where a key stage or the attention reads fp8, and then all of them.
  bool f8 = attend != nullptr && attend->fp8 != 0, bf16 = attend != nullptr && !f8;
  for (int s = 0; s < stages.num_stages; ++s) {
    f8 = f8 || stages.stage[s].kind == SelectStageKind::kKeysFP8;
    bf16 = bf16 || stages.stage[s].kind == SelectStageKind::kKeysBF16;
  }
  if (f8 && bf16) return cudaErrorInvalidValue;
  for (int s = 0; s < stages.num_stages; ++s) {
    const DeviceSelectStage& st = stages.stage[s];
    if (st.c.count < 0 || st.c.count > int64_t{cs} * kStagesMaxPerBlock || st.k < 0 ||
        (s + 1 < stages.num_stages && st.k > kSelectStagesMaxParents) ||
        reinterpret_cast<uintptr_t>(st.rows) % 16 != 0) {
      return cudaErrorInvalidValue;
    }
  }
  if (attend != nullptr) {
    const DeviceSelectAttend& a = *attend;
    const DeviceSelectStage& last = stages.stage[stages.num_stages - 1];
    if (a.out == nullptr || a.lse == nullptr || a.table == nullptr ||
        a.page_size < 1 || a.prefix_end < 0 || a.suffix_len < 0 || a.fanout_shift < 0 ||
        a.fanout_shift > 20 || a.middle.parents != last.selected ||
        a.middle.num_parents != last.k || last.k > kSelectStagesMaxParents ||
        a.middle.count != (int64_t{last.k} << a.fanout_shift) ||
        !AttendFits(info, cs, num_kv_heads, int64_t{a.prefix_end} + a.suffix_len,
                    a.middle.count) ||
        reinterpret_cast<uintptr_t>(a.k_pool) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(a.v_pool) % 16 != 0) {
      return cudaErrorInvalidValue;
    }
  }
  const bool scored = attend != nullptr && SelectStagesAttendScored(stages, *attend);
  // The check in the kernel where the form has an instance with it (the page chooser's selection
  // without an attention over bf16 summaries; quest's with the K and V rows in either pool
  // format), else as its own kernel first, its reuse flags the skip flags.
  const bool check_in_kernel =
      check != nullptr && !scored && (attend != nullptr || !f8);
  if (check != nullptr && !check_in_kernel) {
    const cudaError_t checked =
        LaunchSelectionCacheCheck(check->q, check->cached, check->valid, check->reuse,
                                  reinterpret_cast<int64_t*>(check->hits), num_kv_heads,
                                  group * 128, check->theta, stream);
    if (checked != cudaSuccess) return checked;
    skip = check->reuse;
  }
  const ClusterLaunchConfig launch(dim3(cs, num_kv_heads), dim3(kStagesThreads),
                                   attend != nullptr ? kStagesAttendSmem : kStagesDynamicSmem,
                                   stream, cs, /*dependent=*/false);
  // The kernel takes the check with the attention's params (DeviceSelectAttend::check).
  DeviceSelectAttend a = attend != nullptr ? *attend : DeviceSelectAttend{};
  a.check = check_in_kernel ? *check : DeviceCacheCheck{};
  if (check_in_kernel) {
    return cudaLaunchKernelEx(
        &launch.cfg,
        attend == nullptr ? SelectStagesKernel<kStagesNoAttend, false, true>
        : f8              ? SelectStagesKernel<kStagesAttendRows, true, true>
                          : SelectStagesKernel<kStagesAttendRows, false, true>,
        q, scale, group, stages, a, skip, RegHistMode());
  }
  if (attend != nullptr) {
    return cudaLaunchKernelEx(
        &launch.cfg,
        f8 ? (scored ? SelectStagesKernel<kStagesAttendScored, true>
                     : SelectStagesKernel<kStagesAttendRows, true>)
           : (scored ? SelectStagesKernel<kStagesAttendScored> : SelectStagesKernel<kStagesAttendRows>),
        q, scale, group, stages, a, skip, RegHistMode());
  }
  return cudaLaunchKernelEx(&launch.cfg,
                            f8 ? SelectStagesKernel<kStagesNoAttend, true>
                               : SelectStagesKernel<kStagesNoAttend>,
                            q, scale, group, stages, a, skip, RegHistMode());
}

namespace {

// One block per KV head.
__global__ void __launch_bounds__(kCacheCheckThreads)
    SelectionCacheCheckKernel(const float* __restrict__ q, float* __restrict__ cached,
                              int32_t* __restrict__ valid, int32_t* __restrict__ reuse,
                              unsigned long long* hit_count, int n, float theta) {
  __shared__ double red[3][kCacheCheckThreads / 32];
  const int g = blockIdx.x;
  const float* a = q + static_cast<int64_t>(g) * n;
  float* c = cached + static_cast<int64_t>(g) * n;
  const bool was_valid = valid[g] != 0;
  CacheCheckSums sums;
  for (int i = threadIdx.x; i < n; i += kCacheCheckThreads) CacheCheckAdd(sums, a[i], c[i]);
  CacheCheckReduce(sums, red);
  __syncthreads();
  const bool hit = CacheCheckDecide(red, was_valid, theta);
  CacheCheckUpdate(a, c, n, hit, valid + g, reuse + g, hit_count);
}

}  // namespace

cudaError_t LaunchSelectionCacheCheck(const float* q, float* cached_q, int32_t* valid,
                                      int32_t* reuse, int64_t* hit_count, int num_kv_heads,
                                      int n, float theta, cudaStream_t stream) {
  if (num_kv_heads == 0) return cudaSuccess;
  if (num_kv_heads < 0 || num_kv_heads > 0x7fffffff || n < 0) return cudaErrorInvalidValue;
  SelectionCacheCheckKernel<<<num_kv_heads, kCacheCheckThreads, 0, stream>>>(
      q, cached_q, valid, reuse, reinterpret_cast<unsigned long long*>(hit_count), n, theta);
  return cudaGetLastError();
}

template <typename S>
cudaError_t LaunchUpdateSummariesOf(const void* k_pool, FloatType pool_type, int64_t num_slots,
                                    int page_size, int head_dim, const int32_t* page_table,
                                    int table_pages, int num_kv_heads, int64_t end,
                                    int64_t page_begin, int64_t page_end, S* pages,
                                    int64_t max_pages, S* segments, int64_t max_segments,
                                    int segment_pages, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(page_end - page_begin), num_kv_heads);
  if (pool_type == FloatType::kBF16) {
    PageSummaryKernel<__nv_bfloat16, S><<<grid, kSumThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(k_pool), num_slots, page_size, head_dim, page_table,
        table_pages, end, page_begin, pages, max_pages);
  } else if (pool_type == FloatType::kF32) {
    PageSummaryKernel<float, S><<<grid, kSumThreads, 0, stream>>>(
        static_cast<const float*>(k_pool), num_slots, page_size, head_dim, page_table,
        table_pages, end, page_begin, pages, max_pages);
  } else if (pool_type == FloatType::kFP8E4M3) {
    PageSummaryKernel<__nv_fp8_e4m3, S><<<grid, kSumThreads, 0, stream>>>(
        static_cast<const __nv_fp8_e4m3*>(k_pool), num_slots, page_size, head_dim, page_table,
        table_pages, end, page_begin, pages, max_pages);
  } else {
    return cudaErrorInvalidValue;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || segments == nullptr) return e;
  const int64_t s0 = page_begin / segment_pages;
  const int64_t s1 = (page_end + segment_pages - 1) / segment_pages;
  const dim3 sgrid(static_cast<unsigned>(s1 - s0), num_kv_heads);
  SegmentSummaryKernel<S><<<sgrid, kSumThreads, 0, stream>>>(pages, max_pages, head_dim, s0,
                                                             page_end, segment_pages, segments,
                                                             max_segments);
  return cudaGetLastError();
}

cudaError_t LaunchUpdateSummaries(const void* k_pool, FloatType pool_type, int64_t num_slots,
                                  int page_size, int head_dim, const int32_t* page_table,
                                  int table_pages, int num_kv_heads, int64_t end,
                                  int64_t page_begin, int64_t page_end, void* pages,
                                  FloatType summary_type, int64_t max_pages, void* segments,
                                  int64_t max_segments, int segment_pages, cudaStream_t stream) {
  if (page_end <= page_begin || num_kv_heads == 0) return cudaSuccess;
  if (num_kv_heads > 65535 || page_end - page_begin > 0x7fffffff) return cudaErrorInvalidValue;
  if (summary_type == FloatType::kBF16) {
    return LaunchUpdateSummariesOf(k_pool, pool_type, num_slots, page_size, head_dim, page_table,
                                   table_pages, num_kv_heads, end, page_begin, page_end,
                                   static_cast<__nv_bfloat16*>(pages), max_pages,
                                   static_cast<__nv_bfloat16*>(segments), max_segments,
                                   segment_pages, stream);
  }
  if (summary_type != FloatType::kF32) return cudaErrorInvalidValue;
  return LaunchUpdateSummariesOf(k_pool, pool_type, num_slots, page_size, head_dim, page_table,
                                 table_pages, num_kv_heads, end, page_begin, page_end,
                                 static_cast<float*>(pages), max_pages,
                                 static_cast<float*>(segments), max_segments, segment_pages,
                                 stream);
}

namespace {

// ---- Partitioned selection: one block per part (kernels/backend.h partitions) -----------------
// With P parts no top-k crosses a block. PartVoteTopKKernel (VoteTopK with partitions): grid
// (P, KV heads), block j takes part j's candidates (VoteTopKParams::partitions: a plain range's
// ids dealt in turn, or the children of parents block j), kPartPer per thread in registers, and
// selects as RegisterVoteTopKKernel (statistics, radix passes, compaction in index order) over
// the part alone. PartStagesKernel (SelectStages with partitions): grid (P, KV heads), block j
// runs part j of every stage: its candidates' ids into shared memory (stage 0 from the range,
// a later stage the children of the block's own previous selection), their scores on tensor
// cores (StageScoreMma, SelectStagesKernel's products, so non-finite summary values are not
// supported either; kPartSumTiles / kPartKeyTiles tiles of a warp's row loads in flight, which
// the kernel's 128 registers hold; a key stage's pool rows looked up first; on CUDA cores, with
// every load of a round issued before the FMAs, the key stage took 8.2 us at 128K against 2.8:
// session 40), the same register top-k with its candidates spread over every thread
// (PartStagesKernel<*, 2>: two per thread where every stage's part fits 512, else eight), or
// for a part of at most 256 candidates keeping at most 16 (the page and segment stages) one
// warp's top-k with no barrier (PartWarpTopK: the kp largest keys one warp max at a time); and
// with the attention, block j scores its share of the fixed rows the same way, attends them and
// its own middle (the last stage's scores kept for them), and writes its per-head partial (o,
// max, sum) to global memory, where the KV head's last block to arrive (or a second kernel)
// merges them. Nothing else crosses blocks, so a stage costs block barriers only.
constexpr int kPartThreads = 256;
constexpr int kPartWarps = kPartThreads / 32;
constexpr int kPartPer = 8;
constexpr int kPartMaxCands = kPartThreads * kPartPer;  // a stage's candidates per part
constexpr int kPartSmallPer = 2;  // PartStagesKernel's shorter form: up to 512 per part
constexpr int kPartOpMaxThreads = 512;  // PartVoteTopKKernel: up to 4096 per part
constexpr int kPartG = kRegTopKMaxGroup;
constexpr int kPartSumTiles = 2;  // StageScoreMma tiles in flight per warp: summaries (8 loads each)
constexpr int kPartKeyTiles = 4;  // keys (4 loads each for bf16 rows, 2 for fp8)
static_assert(kPartG == kMaxPartGroup && kPartOpMaxThreads * kPartPer == kMaxPartCandidates,
              "kernels/part_limits.h states what the part kernels hold");

// Index of the t-th candidate of part `part` (VoteTopKParams::partitions), or -1 past the part.
__device__ __forceinline__ int32_t PartCandidateIndex(const DeviceCandidates& c, int parts,
                                                      int part, int32_t t) {
  if (parts == 1) return t < c.count ? t : -1;
  if (c.parents == nullptr) {
    const int32_t first = ((part - c.begin) % parts + parts) % parts;
    const int64_t i = first + static_cast<int64_t>(t) * parts;
    return i < c.count ? static_cast<int32_t>(i) : -1;
  }
  const int32_t span = c.num_parents / parts * c.fanout;
  return t < span ? part * span + t : -1;
}
__host__ __device__ inline int32_t PartCandidateCount(int32_t count, int32_t begin,
                                                      const int32_t* parents, int32_t num_parents,
                                                      int32_t fanout, int parts, int part) {
  if (parts == 1) return count;
  if (parents == nullptr) {
    const int32_t first = ((part - begin) % parts + parts) % parts;
    return count > first ? (count - first + parts - 1) / parts : 0;
  }
  return num_parents / parts * fanout;
}

// The register top-k of one part: thread t holds up to kPer consecutive candidates (thread order
// is index order) with scores x (-inf where none) and ids (-1 when invalid); keeps the kp best by
// soft vote over the block's candidates and calls emit(pos, id, j) for each taken one (pos < kp,
// index order), then stamp(phase) at its steps (profiling). Returns how many were taken. hist
// (3 x 256 words, 16-byte aligned) must be zero; red_m / red_l / wsum are [kPartG][32] / [32]
// scratch. Every thread of the block calls it.
template <int kPer, typename Emit, typename Stamp>
__device__ __forceinline__ int32_t PartTopK(const float (&x)[kPartG][kPer],
                                            const int32_t (&ids)[kPer], int32_t n, int kp,
                                            int hist_mode, uint32_t (*hist)[256],
                                            float (*red_m)[32], float (*red_l)[32],
                                            uint32_t* wsum, float* vote_regs, Emit emit,
                                            Stamp stamp) {
  constexpr int G = kPartG;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = blockDim.x >> 5;
  float m[G], l[G];
  RegWarpStats<kPer>(x, m, l);
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) red_m[h][warp] = m[h], red_l[h][warp] = l[h];
  }
  __syncthreads();
  stamp(2);
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = lane < nwarps ? red_m[h][lane] : NegInfF();
    l[h] = lane < nwarps ? red_l[h][lane] : 0.0f;
  }
  float mb[G], inv[G];
  RegWarpMerge(m, l, mb, inv);
  uint32_t key[kPer];
  RegVoteKeys<kPer>(x, mb, inv, ids, n, tid * kPer, vote_regs, key);
  stamp(4);
  const int32_t kk = min(kp, n);
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(kk);
  if (kk <= 0) prefix = 0xffffffffu, mask = 0xffffffffu, remaining = 0;
#pragma unroll 1
  for (int pass = 0; pass < kVoteRankPasses && kk > 0; ++pass) {
    RegHistogram<kPer>(key, prefix, mask, pass, hist_mode, hist[pass]);
    __syncthreads();
    const bool done = RegFindBin(hist[pass], pass, &prefix, &mask, &remaining);
    stamp(5 + pass);
    if (done) break;
  }
  const uint32_t own = RegCounts<kPer>(key, prefix, mask);
  const uint32_t incl = WarpInclusiveScanU(own);
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  const uint32_t wv = lane < nwarps ? wsum[lane] : 0u;
  const uint32_t wincl = WarpInclusiveScanU(wv);
  const uint32_t before = __shfl_sync(0xffffffffu, wincl - wv, warp) + incl - own;
  const uint32_t total = __shfl_sync(0xffffffffu, wincl, 31);
  RegForEachTaken<kPer>(key, ids, prefix, mask, remaining, before, kp, emit);
  return min(kp, static_cast<int32_t>((total >> 16) + min(total & 0xffffu, remaining)));
}

// PartTopK by one warp, for a stage whose part is small (n <= kPartWarpCands candidates, kp at
// most PartStagesKernel's warp_kp): the scores come from xs ([h][t], row length kPartMaxCands)
// and the ids from ids_s; lane l holds candidates t = 32 j + l (j < 8). The statistics and votes
// are PartTopK's (RegWarpStats over the warp's candidates, which are all of them; RegVoteKeys);
// then each key gets the candidate's 255 - t in its low 8 bits (VoteKey32 leaves them zero), so
// keys are distinct and a larger one ranks before, ties to the lower index as in PartTopK; the
// kp largest are found one per step by the warp's max (redux.sync) of the keys below the last
// one found, and taken in index order by ballots: no block barrier and no histogram. Emits as
// PartTopK, with the candidate's index in xs too (emit(pos, id, t)), stamps as it (2 statistics,
// 4 keys, 5 the kp-th key found), and returns how many were taken. Every lane of the warp calls
// it.
constexpr int kPartWarpCands = 256;
// Whether PartStagesKernel selects a stage of n candidates per part, kp taken, by one warp.
__host__ __device__ inline bool PartStageByWarp(int kp, int64_t n, int warp_kp, bool attend_last) {
  return kp <= warp_kp && n <= kPartWarpCands && !attend_last;
}
template <typename Emit, typename Stamp>
__device__ __forceinline__ int32_t PartWarpTopK(const float* xs, const int32_t* ids_s, int32_t n,
                                                int kp, int group, Emit emit, Stamp stamp) {
  constexpr int G = kPartG, J = kPartWarpCands / 32;
  const int lane = threadIdx.x & 31;
  float x[G][J];
  int32_t ids[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int32_t t = 32 * j + lane;
    ids[j] = t < n ? ids_s[t] : -1;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      x[h][j] = h < group && t < n ? xs[h * kPartMaxCands + t] : NegInfF();
    }
  }
  float m[G], l[G], inv[G];
  RegWarpStats<J>(x, m, l);
#pragma unroll
  for (int h = 0; h < G; ++h) inv[h] = m[h] == NegInfF() ? 0.0f : 1.0f / l[h];
  stamp(2);
  uint32_t key[J];
  RegVoteKeys<J>(x, m, inv, ids, n, 0, nullptr, key);
  stamp(4);
  // key < 0xffffff00 (a vote is at most the group size, far below 2^6), so every key with its
  // index is below the first bound.
#pragma unroll
  for (int j = 0; j < J; ++j) key[j] = key[j] != 0 ? key[j] | (255u - (32u * j + lane)) : 0u;
  const int32_t kk = min(kp, n);
  uint32_t bound = 0xffffffffu;  // the last key found: the ones taken are those >= it
  int32_t found = 0;
#pragma unroll 1
  for (; found < kk; ++found) {
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) mine = max(mine, key[j] < bound ? key[j] : 0u);
    const uint32_t best = __reduce_max_sync(0xffffffffu, mine);
    if (best == 0) break;  // no valid candidate left (warp-uniform)
    bound = best;
  }
  stamp(5);
  uint32_t pos = 0;
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const bool take = found > 0 && key[j] != 0 && key[j] >= bound;
    const unsigned b = __ballot_sync(0xffffffffu, take);
    if (take) emit(pos + __popc(b & below), ids[j], 32 * j + lane);
    pos += __popc(b);
  }
  return found;
}

__global__ void __launch_bounds__(kPartOpMaxThreads)
    PartVoteTopKKernel(const float* __restrict__ scores, int group, DeviceCandidates c, int k,
                       int parts, float* __restrict__ vote_out, int32_t* __restrict__ selected,
                       int hist_mode) {
  constexpr int G = kPartG;
  __shared__ float red_m[G][32], red_l[G][32];
  __shared__ __align__(16) uint32_t hist[kVoteRankPasses][256];
  __shared__ uint32_t wsum[32];
  const int tid = threadIdx.x, part = blockIdx.x, g = blockIdx.y;
  if (c.skip != nullptr && c.skip[g] != 0) return;
  for (int b = tid; b < kVoteRankPasses * 256; b += blockDim.x) (&hist[0][0])[b] = 0;
  const int32_t n = PartCandidateCount(c.count, c.begin, c.parents, c.num_parents, c.fanout,
                                       parts, part);
  float x[G][kPartPer];
  int32_t ids[kPartPer], idx[kPartPer];
#pragma unroll
  for (int j = 0; j < kPartPer; ++j) {
    const int32_t t = tid * kPartPer + j;
    idx[j] = t < n ? PartCandidateIndex(c, parts, part, t) : -1;
    ids[j] = idx[j] >= 0 ? CandidateIdAt(c, g, idx[j]) : -1;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      x[h][j] = h < group && idx[j] >= 0
                    ? scores[(static_cast<int64_t>(g) * group + h) * c.count + idx[j]]
                    : NegInfF();
    }
  }
  const int kp = k / parts;
  int32_t* out = selected + static_cast<int64_t>(g) * k + static_cast<int64_t>(part) * kp;
  float votes[kPartPer];
  const int32_t taken =
      PartTopK<kPartPer>(x, ids, n, kp, hist_mode, hist, red_m, red_l, wsum, votes,
                                 [&](uint32_t pos, int32_t id, int) { out[pos] = id; },
                                 [](int) {});
  for (int32_t j = taken + tid; j < kp; j += blockDim.x) out[j] = -1;
  if (vote_out != nullptr) {
#pragma unroll
    for (int j = 0; j < kPartPer; ++j) {
      if (idx[j] >= 0) vote_out[static_cast<int64_t>(g) * c.count + idx[j]] = votes[j];
    }
  }
}

// Four e4m3 codes (a word, low byte first) as floats: their stored values.
__device__ __forceinline__ void Fp8x4ToFloat(uint32_t w, float (&f)[4]) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu),
                                                    __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16),
                                                    __NV_E4M3);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

// Shared memory of PartStagesKernel (dynamic, kPartStagesSmem bytes).
constexpr int kPartMaxTaken = 1024;  // a stage's k / P
constexpr int kPartMaxFixed = 256;   // a block's share of the fixed rows
constexpr int kPartMaxRows = kPartMaxFixed + kPartMaxTaken;
constexpr int kPartMaxAttendParts = 16;  // parts of the kernel with the attention
// One part's partial of one query head in DeviceSelectAttend::merge_partials: o[128], then the
// max and the sum of its softmax.
constexpr int kPartPartialFloats = 130;
struct PartStagesShared {
  // The stages' tensor-core A operands (StageATables): summaries, keys (f16 for fp8 keys).
  __align__(16) __nv_bfloat16 sum_a[16 * kStagesSumStride];
  __align__(16) __nv_bfloat16 key_a[16 * kStagesKeyStride];
  float key_descale[kPartG];
  float xs[kPartG * kPartMaxCands];  // a stage's scores [h][t]; then the attention's [h][r]
  int32_t ids[kPartMaxCands];
  int64_t crow[kPartMaxCands];  // a key stage's pool rows of the candidates (-1: none)
  int32_t sel[kPartMaxTaken];
  union {
    int64_t rows[kPartMaxRows];  // the attention's pool rows (written from the last stage's top-k)
    // The slot prefetch (PartSlotPrefetchMask; read by the next stage's start, before any row is
    // written): the next key stage's page slot of each candidate of a warp top-k stage (-1:
    // none), and each taken candidate's index among them.
    struct {
      int32_t slot[kPartWarpCands];
      int32_t taken_at[kPartWarpCands];
    } pre;
  };
  float red_m[kPartG][32], red_l[kPartG][32];
  // Read as uint4 (RegFindBin): 16-byte aligned whatever fields come before.
  __align__(16) uint32_t hist[kVoteRankPasses][256];
  uint32_t wsum[32];
  float stat_m[kPartG], stat_l[kPartG];
  double check_red[3][kCacheCheckThreads / 32];  // the selection cache's check (CacheCheckReduce)
  // The check's query of KV head g, kept for its update at the kernel's end (a miss caches it).
  float check_q[kPartG * 128];
  // at.check, read at the start with the check's other params: its update at the kernel's end
  // takes its pointers from here, not from the params' constant bank (whose line can miss there).
  DeviceCacheCheck check;
  int32_t taken;
  int32_t merge_last;  // the merge through global memory: this block arrived last
};
static_assert(kPartThreads == kCacheCheckThreads && kPartG * 128 <= 2 * kPartThreads,
              "the check's block size and two elements per thread");
constexpr int kPartStagesSmem = static_cast<int>(sizeof(PartStagesShared));
// Two blocks per SM with their shared memory (plus the 1 KiB per block the runtime reserves) in
// the 196 KiB carveout, which leaves the SM 60 KiB of L1 for the loads in flight. Session 42
// (H200): a form 2 KiB larger per block, over the 228 KiB carveout (28 KiB of L1), took 29.7 us
// per layer at 128K (26.3 -> 27.5 over fp8 pools); the same code made 13 KiB smaller, within
// the 196 KiB one, 28.2 (27.0).
constexpr int kPartStagesSmemMost = 196 * 1024 / 2 - 1024;
static_assert(kPartStagesSmem <= kPartStagesSmemMost, "two blocks per SM in the 196 KiB carveout");
static_assert(kPartG * kPartMaxRows <= kPartG * kPartMaxCands, "attention rows fit xs");
static_assert(kPartWarps * kPartG * 128 <= kPartG * kPartMaxCands, "partials fit xs");

// Merges KV head g's parts' partials ([g][part][h][130]) into out / lse: threads [64 h, 64 h +
// 64) query head h, two dims each.
__device__ __noinline__ void PartMergeHeads(const float* partials, int g, int group, int parts,
                                            float v_scale, float* out, float* lse) {
  const int tid = threadIdx.x, h = tid >> 6, pair = tid & 63;
  if (h >= group) return;
  const float* const base =
      partials + (static_cast<int64_t>(g) * parts * kPartG + h) * kPartPartialFloats;
  float2 v[kPartMaxAttendParts], ml[kPartMaxAttendParts];
#pragma unroll
  for (int b = 0; b < kPartMaxAttendParts; ++b) {
    const float* pb = base + b * kPartG * kPartPartialFloats;
    v[b] = b < parts ? __ldcg(reinterpret_cast<const float2*>(pb + 2 * pair))
                     : make_float2(0.0f, 0.0f);
    ml[b] = b < parts ? __ldcg(reinterpret_cast<const float2*>(pb + 128))
                      : make_float2(NegInfF(), 0.0f);
  }
  float mx = NegInfF();
#pragma unroll
  for (int b = 0; b < kPartMaxAttendParts; ++b) mx = fmaxf(mx, ml[b].x);
  float o0 = 0.0f, o1 = 0.0f, l = 0.0f;
#pragma unroll
  for (int b = 0; b < kPartMaxAttendParts; ++b) {
    const float e = ml[b].x > NegInfF() ? __expf(ml[b].x - mx) : 0.0f;
    o0 += e * v[b].x, o1 += e * v[b].y;
    l += e * ml[b].y;
  }
  const int64_t qh = static_cast<int64_t>(g) * group + h;
  out[qh * 128 + 2 * pair] = l > 0.0f ? o0 / l * v_scale : 0.0f;
  out[qh * 128 + 2 * pair + 1] = l > 0.0f ? o1 / l * v_scale : 0.0f;
  if (pair == 0) lse[qh] = l > 0.0f ? mx + logf(l) : NegInfF();
}

// Pool row of token t of KV head g through a page table, or -1 (RowOf of the CPU twin).
__device__ __forceinline__ int64_t PartPoolRow(const int32_t* table, int table_pages,
                                               int page_shift, int64_t num_slots, int g,
                                               int32_t t) {
  if (t < 0) return -1;
  const int32_t page = t >> page_shift;
  if (page >= table_pages) return -1;
  const int32_t slot = table[static_cast<int64_t>(g) * table_pages + page];
  if (slot < 0 || slot >= num_slots) return -1;
  return (static_cast<int64_t>(slot) << page_shift) + (t & ((1 << page_shift) - 1));
}

// PartStagesKernel's integers that would take a division by `parts` or by a stage's fanout,
// computed on the host per launch (PartPlanOf): in the kernel each such division is a chain of
// ~25 dependent instructions on the stage's critical path (Nsight Compute, session 48, 128K:
// about 0.9 us of the step's warp time in the stage loop's head and its candidate ids). Stage
// 0's per-part count and first index still divide (see the stage loop).
struct PartPlan {
  int32_t kp[kSelectStagesMax];            // stage s's k / parts
  int32_t fanout_shift[kSelectStagesMax];  // log2 of stage s's fanout, or -1 where not a power of 2
  int32_t fixed_per;  // the attention's fixed rows per part, ceil(fixed / parts)
  int32_t attend_kp;  // the attention's middle.num_parents / parts
};

// At most 128 registers per thread, room for two blocks per SM. While the parts merged in
// clusters, the launch needed each cluster's P blocks resident at once (a form at 170 registers
// took 58.3 us for the 128K step against 37.6; session 40). Without clusters the 8B shape's 128
// blocks have an SM each, and the form with up to 255 registers was still slower (session 44,
// H200: 25.0-25.1 us against 24.2-24.5 at 128K); grids of more blocks than SMs keep two per SM.
template <bool kAttend, int kPer, bool kF8>
__global__ void __launch_bounds__(kPartThreads, 2)
    PartStagesKernel(const float* __restrict__ q, float scale, int group, int parts,
                     DeviceSelectStages st, DeviceSelectAttend at, const int32_t* skip,
                     int hist_mode, int warp_kp, uint32_t prefetch_mask,
                     const __grid_constant__ PartPlan plan) {
  constexpr int G = kPartG;
  extern __shared__ __align__(16) unsigned char part_smem[];
  PartStagesShared& sh = *reinterpret_cast<PartStagesShared*>(part_smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int part = blockIdx.x, g = blockIdx.y;
  // --stage-phases (SetSelectStagesPhaseStamps): clock64 at SelectStagesKernel's stamp slots
  // (per stage: 0 ids ready, 1 scored, 8 selected; the attention's: 0 rows listed, 2 scored,
  // 4 softmax, 6 values, 7 merged).
  long long* stamps = nullptr;
  if (tid == 0) {
    const int b = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
    if (b < g_stages_phase_blocks) stamps = g_stages_phase_stamps + b * kSelectStagesPhases;
  }
  auto stamp = [&](int phase) {
    if (stamps != nullptr) stamps[phase] = clock64();
  };
  stamp(0);
  if (stamps != nullptr) {
    stamps[kSelectStagesPlaceSlot] = SmId();
    stamps[kSelectStagesPlaceSlot + 1] = GlobalTimerNs();
  }
  // Skipped: the KV head reuses its kept selection, by the caller's flags or by the selection
  // cache's check in the kernel (at.check; every block of g computes the same decision, and g's
  // last block to arrive updates the cache's state below, after every block has read it). The
  // check's loads go first and its sums after StageATables, so their L2 round trips overlap
  // (one barrier, then every thread decides; deciding after stage 0's first barrier instead, and
  // leaving the stage loop there on a hit: session 45's form spilled registers in the small
  // form, session 48's did not but made reuse steps 0.6 us and plain steps 0.3 us slower).
  static_assert(2 * kPartThreads >= G * 128, "the check's two values per thread");
  const bool checked = kAttend && at.check.cached != nullptr;
  float check_a[2] = {0.0f, 0.0f}, check_c[2] = {0.0f, 0.0f};
  int32_t check_valid = 0;
  if (checked) {
    const int64_t row = static_cast<int64_t>(g) * group * 128;
    check_valid = at.check.valid[g];  // every thread: one broadcast load per warp
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int i = tid + j * kPartThreads;
      if (i < group * 128) {
        check_a[j] = at.check.q[row + i];
        check_c[j] = at.check.cached[row + i];
      }
    }
  }
  if (kAttend && tid == 0) sh.check = at.check;  // read by the update after the next barriers
  bool skipped = !checked && skip != nullptr && skip[g] != 0;
  if (!kAttend && skipped) return;
  // The parts' partials of the attention go to global memory (at.merge_partials), merged there
  // by the KV head's last block to arrive (at.merge_arrivals) or else by PartMergeKernel,
  // launched after this kernel as its programmatic dependent.
  if (kAttend && at.merge_arrivals == nullptr) {
    GridDepLaunchDependents();  // PartMergeKernel may launch
  }
  StageATables<kF8, true, kPartThreads>(q, scale, g, group, sh.sum_a, sh.key_a, sh.key_descale);
  if (checked) {
    CacheCheckSums sums;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (tid + j * kPartThreads < group * 128) {
        CacheCheckAdd(sums, check_a[j], check_c[j]);
        sh.check_q[tid + j * kPartThreads] = check_a[j];
      }
    }
    CacheCheckReduce(sums, sh.check_red);
    __syncthreads();
    skipped = CacheCheckDecide(sh.check_red, check_valid != 0, at.check.theta);
  }
  // Attention rows: the block's share of the fixed rows first, then its middle.
  int32_t f0 = 0, f_count = 0;
  if constexpr (kAttend) {
    const int32_t fixed = at.prefix_end + at.suffix_len;
    const int32_t per = plan.fixed_per;
    f0 = min(fixed, part * per);
    f_count = min(fixed - f0, per);
  }
  const int num_stages = skipped ? 0 : st.num_stages;
  for (int s = 0; s < num_stages; ++s) {
    const DeviceSelectStage& sg = st.stage[s];
    const DeviceCandidates& c = sg.c;
    const int kp = plan.kp[s];
    const bool last = s + 1 == st.num_stages;
    // The part's candidate ids.
    int32_t n;
    // The stage before looked up this stage's page slots (PartSlotPrefetchMask).
    const bool slots_ready = s > 0 && ((prefetch_mask >> (s - 1)) & 1u) != 0;
    if (s == 0) {
      // Stage 0's divisions stay: taking its first index and count from the plan too cut its
      // start phase by ~0.4 us but made stage 1's top-k ~0.45 us slower (the compiler's
      // schedule of that code; session 48, H200, 128K).
      n = PartCandidateCount(c.count, c.begin, nullptr, 0, 1, parts, part);
      for (int32_t t = tid; t < n; t += kPartThreads) {
        const int32_t i = PartCandidateIndex(c, parts, part, t);
        const int64_t id = static_cast<int64_t>(c.begin) + i;
        sh.ids[t] = id < c.end ? static_cast<int32_t>(id) : -1;
      }
    } else {
      const int kprev = plan.kp[s - 1];
      const int fanout = c.fanout, shift = plan.fanout_shift[s];
      n = kprev * fanout;
      for (int32_t t = tid; t < n; t += kPartThreads) {
        // t / fanout and t % fanout, by a shift where the fanout is a power of 2 (the page and
        // segment stages' always is).
        const int32_t pi = shift >= 0 ? t >> shift : t / fanout;
        const int32_t parent = sh.sel[pi];
        const int64_t id = static_cast<int64_t>(parent) * fanout + (t - pi * fanout);
        const bool valid = parent >= 0 && id >= c.begin && id < c.end;
        sh.ids[t] = valid ? static_cast<int32_t>(id) : -1;
        if (slots_ready) {  // the parent is the id's page (c.fanout is the page size)
          const int32_t slot = valid ? sh.pre.slot[sh.pre.taken_at[pi]] : -1;
          const int32_t within = static_cast<int32_t>(id) & (fanout - 1);
          sh.crow[t] = slot >= 0 ? (static_cast<int64_t>(slot) << sg.page_shift) + within : -1;
        }
      }
    }
    if (sg.kind != SelectStageKind::kSummariesBF16 && !slots_ready) {
      // The pool rows up front (every table read of the stage in flight at once, not one
      // round trip before each round of key loads).
      __syncthreads();
      for (int32_t t = tid; t < n; t += kPartThreads) {
        const int64_t r =
            PartPoolRow(sg.table, sg.table_pages, sg.page_shift, sg.num_items, g, sh.ids[t]);
        sh.crow[t] = r;
      }
    }
    for (int b = tid; b < kVoteRankPasses * 256; b += kPartThreads) (&sh.hist[0][0])[b] = 0;
    __syncthreads();
    const int phase0 = 1 + s * kSelectStagesPhasesPerStage;
    stamp(phase0);
    // On tensor cores (StageScoreMma: the products of SelectStagesKernel), with the tiles of a
    // warp's loads in flight at once sized to the kernel's 128 registers.
    auto* sc = reinterpret_cast<float (*)[kPartMaxCands]>(sh.xs);
    if (sg.kind == SelectStageKind::kSummariesBF16) {
      const __nv_bfloat16* rows = static_cast<const __nv_bfloat16*>(sg.rows) +
                                  static_cast<int64_t>(g) * sg.num_items * 256;
      StageScoreMma<8, false, kPartSumTiles, kPartMaxCands>(
          sh.sum_a, kStagesSumStride, group, n,
          [&](int32_t t) -> const __nv_bfloat16* {
            const int32_t id = sh.ids[t];
            return id >= 0 && id < sg.num_items ? rows + static_cast<int64_t>(id) * 256 : nullptr;
          },
          sc);
    } else {
      using KeyRow = typename std::conditional<kF8, unsigned char, __nv_bfloat16>::type;
      const KeyRow* pool = static_cast<const KeyRow*>(sg.rows);
      StageScoreMma<4, kF8, kPartKeyTiles, kPartMaxCands>(
          sh.key_a, kStagesKeyStride, group, n,
          [&](int32_t t) -> const KeyRow* {
            const int64_t r = sh.crow[t];
            return r >= 0 ? pool + r * 128 : nullptr;
          },
          sc, sh.key_descale);
    }
    __syncthreads();
    stamp(phase0 + 1);
    int32_t* out = sg.selected + static_cast<int64_t>(g) * sg.k + static_cast<int64_t>(part) * kp;
    if (PartStageByWarp(kp, n, warp_kp, kAttend && last)) {
      // A small part (tokenselect's page stage, and its segment stage from 512K: 128 or 64
      // candidates, 8 taken): warp 0 selects alone (PartWarpTopK), with no barrier until the
      // stage's end. Session 41 (H200, graph us per layer, against the block's radix select in
      // the same call): 128K 27.9 -> 27.2, 1M 35.0 -> 32.4; over fp8 pools 27.8 -> 26.0 and
      // 34.3 -> 30.6.
      // Where the next stage is a key stage whose candidates are the pages of this one's (its
      // fanout the page size; PartSlotPrefetchMask), warps 1-7 look up the page slots of every
      // candidate meanwhile, so that stage's pool rows need no table read of their own.
      if (warp == 0) {
        const int32_t taken = PartWarpTopK(sh.xs, sh.ids, n, kp, group,
                                           [&](uint32_t pos, int32_t id, int32_t t) {
                                             out[pos] = id;
                                             sh.sel[pos] = id;
                                             sh.pre.taken_at[pos] = t;
                                           },
                                           [&](int ph) { stamp(phase0 + ph); });
        for (int32_t j = taken + lane; j < kp; j += 32) {
          out[j] = -1;
          sh.sel[j] = -1;
        }
        if (lane == 0) sh.taken = taken;
      } else if (((prefetch_mask >> s) & 1u) != 0) {
        const DeviceSelectStage& nx = st.stage[s + 1];
#pragma unroll 1
        for (int32_t t = tid - 32; t < n; t += kPartThreads - 32) {
          const int32_t page = sh.ids[t];
          int32_t slot = -1;
          if (page >= 0 && page < nx.table_pages) {
            slot = __ldg(nx.table + static_cast<int64_t>(g) * nx.table_pages + page);
            if (slot >= nx.num_items) slot = -1;
          }
          sh.pre.slot[t] = slot;
        }
      }
      __syncthreads();
      stamp(phase0 + kSelectStagesPhasesPerStage - 1);
      continue;
    }
    // Thread t holds candidates [per t, per t + per): spread over every warp (a warp's
    // histogram adds cost per slot that holds keys), in index order.
    const int per = (n + kPartThreads - 1) / kPartThreads;
    float x[G][kPer];
    int32_t ids[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int32_t t = tid * per + j;
      const bool in = j < per && t < n;
      ids[j] = in ? sh.ids[t] : -1;
#pragma unroll
      for (int h = 0; h < G; ++h) {
        x[h][j] = h < group && in ? sh.xs[h * kPartMaxCands + t] : NegInfF();
      }
    }
    // The attention's middle rows follow the fixed ones; their scores are the last stage's (xs
    // is free once every thread holds its scores: PartTopK's first barrier).
    const int32_t r_mid = f_count;
    const int32_t taken = PartTopK<kPer>(
        x, ids, n, kp, hist_mode, sh.hist, sh.red_m, sh.red_l, sh.wsum, nullptr,
        [&](uint32_t pos, int32_t id, int j) {
          out[pos] = id;
          sh.sel[pos] = id;
          if (kAttend && last) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
              if (h < group) sh.xs[h * kPartMaxRows + r_mid + pos] = x[h][j];
            }
            const int64_t vr =
                id >= at.middle.begin && id < at.middle.end ? sh.crow[tid * per + j] : -1;
            sh.rows[r_mid + pos] = vr;
          }
        },
        [&](int ph) { stamp(phase0 + ph); });
    for (int32_t j = taken + tid; j < kp; j += kPartThreads) {
      out[j] = -1;
      sh.sel[j] = -1;
    }
    if (tid == 0) sh.taken = taken;
    __syncthreads();
    stamp(phase0 + kSelectStagesPhasesPerStage - 1);
  }
  constexpr int A0 = 1 + kSelectStagesMax * kSelectStagesPhasesPerStage;
  if constexpr (kAttend) {
    const int page_shift = __ffs(at.page_size) - 1;
    const int kp = plan.attend_kp;
    int32_t m_count;
    int32_t r_score = 0, n_score = f_count;  // rows [r_score, + n_score) need K scores
    if (skipped) {
      // The kept selection: this part's ids of the middle, scored from K rows below.
      m_count = kp;
      const int32_t* kept = at.middle.parents + static_cast<int64_t>(g) * at.middle.num_parents +
                            static_cast<int64_t>(part) * kp;
      for (int32_t r = tid; r < kp; r += kPartThreads) {
        const int32_t id = kept[r];
        sh.rows[f_count + r] =
            id >= at.middle.begin && id < at.middle.end
                ? PartPoolRow(at.table, at.table_pages, page_shift, at.num_slots, g, id)
                : -1;
      }
      n_score += kp;
    } else {
      m_count = sh.taken;
    }
    for (int32_t f = tid; f < f_count; f += kPartThreads) {
      const int32_t fi = f0 + f;
      const int32_t t = fi < at.prefix_end ? fi : at.suffix_begin + (fi - at.prefix_end);
      sh.rows[f] = PartPoolRow(at.table, at.table_pages, page_shift, at.num_slots, g, t);
    }
    __syncthreads();
    stamp(A0);
    const int32_t rows_n = f_count + m_count;
    {
      using KeyRow = typename std::conditional<kF8, unsigned char, __nv_bfloat16>::type;
      const KeyRow* kpool = static_cast<const KeyRow*>(at.k_pool);
      StageScoreMma<4, kF8, kPartKeyTiles, kPartMaxRows>(
          sh.key_a, kStagesKeyStride, group, n_score,
          [&](int32_t t) -> const KeyRow* {
            const int64_t r = sh.rows[r_score + t];
            return r >= 0 ? kpool + r * 128 : nullptr;
          },
          reinterpret_cast<float (*)[kPartMaxRows]>(sh.xs + r_score), sh.key_descale);
    }
    __syncthreads();
    stamp(A0 + 2);
    // Per head (warp h): max, then p = exp(x - max) in place and their sum. A row without a
    // readable K row (rows[r] < 0) has score -inf already, except the middle's kept scores.
    if (warp < group) {
      float* xh = sh.xs + warp * kPartMaxRows;
      float mx = NegInfF();
      for (int32_t r = lane; r < rows_n; r += 32) {
        if (sh.rows[r] < 0) xh[r] = NegInfF();
        mx = fmaxf(mx, xh[r]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      float sum = 0.0f;
      for (int32_t r = lane; r < rows_n; r += 32) {
        const float p = xh[r] > NegInfF() ? __expf(xh[r] - mx) : 0.0f;
        xh[r] = p;
        sum += p;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0) sh.stat_m[warp] = mx, sh.stat_l[warp] = sum;
    }
    __syncthreads();
    stamp(A0 + 4);
    // o[h][8 sub .. + 8) over the warp's rows: a half-warp per row (lane = 16 half + sub: 16 B
    // of bf16 or 8 B of fp8 codes each), four loads per thread in flight, so a warp has eight
    // rows in flight (rows 2 warp + 16 u + half of each round of 64). A whole warp per row, four
    // rows in flight, took 2.1 us at 128K (session 41, H200): five rounds of L2 round trips.
    const int half = lane >> 4, sub = lane & 15;
    float o[G][8];
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) o[h][j] = 0.0f;
    }
#pragma unroll 1
    for (int32_t r0 = 2 * warp + half; r0 < rows_n; r0 += 8 * kPartWarps) {
      uint4 raw[4];
      float pr[4][G];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int32_t r = r0 + u * 2 * kPartWarps;
        const int64_t row = r < rows_n ? sh.rows[r] : -1;
        if constexpr (kF8) {  // eight codes per lane (v_scale comes in at the merge)
          const uint2 w = row >= 0 ? __ldg(reinterpret_cast<const uint2*>(
                                               static_cast<const uint8_t*>(at.v_pool) + row * 128) +
                                           sub)
                                   : make_uint2(0u, 0u);
          raw[u] = make_uint4(w.x, w.y, 0u, 0u);
        } else {
          raw[u] = row >= 0 ? __ldg(reinterpret_cast<const uint4*>(
                                        static_cast<const __nv_bfloat16*>(at.v_pool) + row * 128) +
                                    sub)
                            : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
          pr[u][h] = h < group && row >= 0 ? sh.xs[h * kPartMaxRows + r] : 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float f[8];
        if constexpr (kF8) {
          float a[4], b[4];
          Fp8x4ToFloat(raw[u].x, a);
          Fp8x4ToFloat(raw[u].y, b);
#pragma unroll
          for (int j = 0; j < 4; ++j) f[j] = a[j], f[4 + j] = b[j];
        } else {
          const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
            f[2 * j] = v.x, f[2 * j + 1] = v.y;
          }
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
#pragma unroll
          for (int j = 0; j < 8; ++j) o[h][j] = fmaf(pr[u][h], f[j], o[h][j]);
        }
      }
    }
    // The two half-warps' sums of the same dims.
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) o[h][j] += __shfl_xor_sync(0xffffffffu, o[h][j], 16);
    }
    __syncthreads();  // every warp is done with xs' probabilities
    stamp(A0 + 6);
    float* red_o = sh.xs;  // [warp][h][128]
#pragma unroll
    for (int h = 0; h < G; ++h) {
      if (h < group && half == 0) {
        float4* const d = reinterpret_cast<float4*>(red_o + (warp * G + h) * 128 + 8 * sub);
        d[0] = make_float4(o[h][0], o[h][1], o[h][2], o[h][3]);
        d[1] = make_float4(o[h][4], o[h][5], o[h][6], o[h][7]);
      }
    }
    __syncthreads();
    // The block's partial of head h (threads [64 h, 64 h + 64), two dims each) to global memory
    // ([g][part][h][130]: o, then max and sum) for PartMergeHeads (by the last block to arrive,
    // or PartMergeKernel).
    {
      const int h = tid >> 6, pair = tid & 63;
      if (h < group) {
        float o0 = 0.0f, o1 = 0.0f;
#pragma unroll
        for (int w = 0; w < kPartWarps; ++w) {
          const float2 v = *reinterpret_cast<const float2*>(red_o + (w * G + h) * 128 + 2 * pair);
          o0 += v.x, o1 += v.y;
        }
        float* const mine = at.merge_partials +
                            ((static_cast<int64_t>(g) * parts + part) * G + h) * kPartPartialFloats;
        *reinterpret_cast<float2*>(mine + 2 * pair) = make_float2(o0, o1);
        if (pair == 0) {
          *reinterpret_cast<float2*>(mine + 128) = make_float2(sh.stat_m[h], sh.stat_l[h]);
        }
      }
    }
    if (at.merge_arrivals != nullptr) {
      // The KV head's last block to arrive merges, then leaves the counter zero for the next
      // launch. Thread 0's add after the barrier is a release (the block's partials before its
      // arrival) and an acquire (the last block's reads, after the next barrier, after every
      // arrival): one acq_rel add instead of two full fences around a relaxed one.
      __syncthreads();
      if (tid == 0) {
        uint32_t before;
        asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;"
                     : "=r"(before)
                     : "l"(at.merge_arrivals + g)
                     : "memory");
        sh.merge_last = before == static_cast<uint32_t>(parts - 1) ? 1 : 0;
      }
      __syncthreads();
      if (sh.merge_last != 0) {
        // The check's update before the merge, its stores draining while the merge reads the
        // partials, with the query and the pointers from shared memory (session 51, H200, 128K:
        // loading the query from L2 here, after the merge, cost a selecting step ~0.3 us).
        const DeviceCacheCheck& ck = sh.check;
        if (ck.cached != nullptr) {
          const int n = group * 128;
          const int64_t row = static_cast<int64_t>(g) * n;
          CacheCheckUpdate(sh.check_q, ck.cached + row, n, skipped, ck.valid + g, ck.reuse + g,
                           ck.hits);
        }
        PartMergeHeads(at.merge_partials, g, group, parts, at.v_scale, at.out, at.lse);
        if (tid == 0) at.merge_arrivals[g] = 0;
      }
    }
    stamp(A0 + 7);
    if (stamps != nullptr) stamps[kSelectStagesPlaceSlot + 2] = GlobalTimerNs();
  }
}

// The attention's partials of PartStagesKernel ([g][part][h][130]:
// o, then max and sum) merged into out / lse: block g, threads [64 h, 64 h + 64) query head h
// of KV head g, two dims each. Launched as the part kernel's programmatic dependent, so its
// launch overlaps that kernel; it reads nothing before GridDepWait (that grid done, its writes
// visible).
__global__ void __launch_bounds__(kPartThreads)
    PartMergeKernel(const float* partials, int group, int parts, float v_scale, float* out,
                    float* lse) {
  GridDepWait();
  PartMergeHeads(partials, blockIdx.x, group, parts, v_scale, out, lse);
}

}  // namespace

cudaError_t LaunchPartVoteTopK(const float* scores, int num_kv_heads, int group,
                               const DeviceCandidates& c, int k, int parts, float* vote,
                               int32_t* selected, cudaStream_t stream) {
  if (num_kv_heads == 0) return cudaSuccess;
  if (group < 1 || group > kPartG || parts < 1 || parts > 64 || k % parts != 0 ||
      num_kv_heads > 65535) {
    return cudaErrorInvalidValue;
  }
  int32_t most = 0;
  for (int j = 0; j < parts; ++j) {
    most = std::max(most, PartCandidateCount(c.count, c.begin, c.parents, c.num_parents,
                                             c.fanout, parts, j));
  }
  if (most > kPartOpMaxThreads * kPartPer) return cudaErrorInvalidValue;
  const int threads = std::max(32, (most + kPartPer - 1) / kPartPer + 31) / 32 * 32;
  return LaunchSelection(PartVoteTopKKernel, dim3(parts, num_kv_heads),
                         dim3(std::min(threads, kPartOpMaxThreads)), 0, stream, scores, group, c,
                         k, parts, vote, selected, RegHistMode());
}

namespace {

// The most candidates any part of stage s holds: stage 0's range in parts that differ by one
// (part 0 is not always one of the larger: PartCandidateCount), a later stage the children of
// the stage before's k / P.
int64_t PartStageMostCandidates(const DeviceSelectStages& stages, int parts, int s) {
  return s == 0 ? (int64_t{stages.stage[0].c.count} + parts - 1) / parts
                : int64_t{stages.stage[s - 1].k / parts} * stages.stage[s].c.fanout;
}

}  // namespace

bool PartStagesFits(int num_kv_heads, int group, int parts, const DeviceSelectStages& stages,
                    const DeviceSelectAttend* attend) {
  if (num_kv_heads < 1 || num_kv_heads > 65535 || group < 1 || group > kPartG || parts < 2 ||
      parts > 64 || stages.num_stages < 1 || stages.num_stages > kSelectStagesMax) {
    return false;
  }
  bool bf16_keys = false, fp8_keys = false;
  for (int s = 0; s < stages.num_stages; ++s) {
    const DeviceSelectStage& sg = stages.stage[s];
    bf16_keys = bf16_keys || sg.kind == SelectStageKind::kKeysBF16;
    fp8_keys = fp8_keys || sg.kind == SelectStageKind::kKeysFP8;
    if ((bf16_keys && fp8_keys) || sg.k % parts != 0 ||
        sg.k / parts > kPartMaxTaken || reinterpret_cast<uintptr_t>(sg.rows) % 16 != 0) {
      return false;
    }
    if (PartStageMostCandidates(stages, parts, s) > kPartMaxCands) return false;
    if (s == 0 ? sg.c.parents != nullptr
               : sg.c.parents != stages.stage[s - 1].selected ||
                     sg.c.num_parents != stages.stage[s - 1].k) {
      return false;
    }
  }
  if (attend != nullptr) {
    const DeviceSelectAttend& a = *attend;
    const DeviceSelectStage& last = stages.stage[stages.num_stages - 1];
    const int64_t fixed = int64_t{a.prefix_end} + a.suffix_len;
    if (parts > kPartMaxAttendParts || a.fanout_shift != 0 ||
        last.kind != (a.fp8 != 0 ? SelectStageKind::kKeysFP8 : SelectStageKind::kKeysBF16) ||
        a.middle.parents != last.selected ||
        a.middle.num_parents != last.k || last.rows != a.k_pool || last.table != a.table ||
        last.table_pages != a.table_pages || (int64_t{1} << last.page_shift) != a.page_size ||
        last.num_items != a.num_slots || (fixed + parts - 1) / parts > kPartMaxFixed ||
        a.out == nullptr || a.lse == nullptr ||
        reinterpret_cast<uintptr_t>(a.v_pool) % 16 != 0) {
      return false;
    }
  }
  return true;
}

namespace {

// Every PartStagesKernel instantiation's dynamic shared memory on the current device, set once
// per device; the first error, if any.
cudaError_t PartStagesAttributes() {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device < 0 || device >= kStagesMaxDevices) return cudaErrorInvalidDevice;
  static std::once_flag once[kStagesMaxDevices];
  static cudaError_t result[kStagesMaxDevices];
  std::call_once(once[device], [&] {
    result[device] = cudaSuccess;
    for (const void* k :
         {reinterpret_cast<const void*>(PartStagesKernel<false, kPartPer, false>),
          reinterpret_cast<const void*>(PartStagesKernel<true, kPartPer, false>),
          reinterpret_cast<const void*>(PartStagesKernel<false, kPartSmallPer, false>),
          reinterpret_cast<const void*>(PartStagesKernel<true, kPartSmallPer, false>),
          reinterpret_cast<const void*>(PartStagesKernel<false, kPartPer, true>),
          reinterpret_cast<const void*>(PartStagesKernel<true, kPartPer, true>),
          reinterpret_cast<const void*>(PartStagesKernel<false, kPartSmallPer, true>),
          reinterpret_cast<const void*>(PartStagesKernel<true, kPartSmallPer, true>)}) {
      const cudaError_t ke =
          cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kPartStagesSmem);
      if (ke != cudaSuccess && result[device] == cudaSuccess) result[device] = ke;
    }
    cudaGetLastError();
  });
  return result[device];
}

// The PartStagesKernel instantiation for the pool format (fp8 or bf16) and the candidates per
// thread (kPartSmallPer or kPartPer).
template <bool kAttend>
auto PartStagesForm(bool f8, bool small) {
  return f8 ? (small ? PartStagesKernel<kAttend, kPartSmallPer, true>
                     : PartStagesKernel<kAttend, kPartPer, true>)
            : (small ? PartStagesKernel<kAttend, kPartSmallPer, false>
                     : PartStagesKernel<kAttend, kPartPer, false>);
}

// Bit s set: every block selects stage s by one warp (PartStageByWarp, with the most candidates
// any part holds) and stage s + 1 is a key stage whose candidates are the pages of stage s's (its
// fanout the page size), so PartStagesKernel's warps 1-7 look up their page slots meanwhile.
uint32_t PartSlotPrefetchMask(const DeviceSelectStages& stages, int parts, int warp_kp) {
  if (!PartSlotPrefetchOn()) return 0;
  uint32_t mask = 0;
  for (int s = 0; s + 1 < stages.num_stages; ++s) {
    const DeviceSelectStage& nx = stages.stage[s + 1];
    if (PartStageByWarp(stages.stage[s].k / parts, PartStageMostCandidates(stages, parts, s),
                        warp_kp, false) &&
        nx.kind != SelectStageKind::kSummariesBF16 && nx.page_shift >= 0 &&
        nx.page_shift < 31 && nx.c.fanout == (1 << nx.page_shift)) {
      mask |= 1u << s;
    }
  }
  return mask;
}

// The launch's PartPlan (after PartStagesFits: parts >= 2, every stage's k a multiple of parts).
PartPlan PartPlanOf(const DeviceSelectStages& stages, int parts, const DeviceSelectAttend* attend) {
  PartPlan plan{};
  for (int s = 0; s < stages.num_stages; ++s) {
    const DeviceSelectStage& sg = stages.stage[s];
    plan.kp[s] = sg.k / parts;
    const int32_t f = sg.c.fanout;
    plan.fanout_shift[s] = f > 0 && (f & (f - 1)) == 0 ? __builtin_ctz(static_cast<uint32_t>(f)) : -1;
  }
  if (attend != nullptr) {
    const int64_t fixed = int64_t{attend->prefix_end} + attend->suffix_len;
    plan.fixed_per = static_cast<int32_t>((fixed + parts - 1) / parts);
    plan.attend_kp = attend->middle.num_parents / parts;
  }
  return plan;
}

}  // namespace

int64_t PartMergeScratchFloats(int num_kv_heads, int parts) {
  return int64_t{num_kv_heads} * parts * kPartG * kPartPartialFloats;
}

cudaError_t LaunchPartStages(const float* q, float scale, int num_kv_heads, int group, int parts,
                             const DeviceSelectStages& stages, const int32_t* skip,
                             const DeviceSelectAttend* attend, cudaStream_t stream) {
  if (num_kv_heads == 0) return cudaSuccess;
  if (!PartStagesFits(num_kv_heads, group, parts, stages, attend)) return cudaErrorInvalidValue;
  if (const cudaError_t attr = PartStagesAttributes(); attr != cudaSuccess) return attr;
  // Candidates per thread: kPartSmallPer where every stage's largest part fits (the shorter
  // code), else kPartPer.
  bool small = true;
  for (int s = 0; s < stages.num_stages; ++s) {
    small = small && PartStageMostCandidates(stages, parts, s) <= kPartThreads * kPartSmallPer;
  }
  if (const char* e = std::getenv("STRATA_SELECT_PART_PER")) small = small && std::string_view(e) != "8";
  const int warp_kp = PartWarpTopKMax();
  // The pool format (PartStagesFits: every key stage and the attention read one).
  bool f8 = attend != nullptr && attend->fp8 != 0;
  for (int s = 0; s < stages.num_stages; ++s) {
    f8 = f8 || stages.stage[s].kind == SelectStageKind::kKeysFP8;
  }
  const ClusterLaunchConfig launch(dim3(parts, num_kv_heads), dim3(kPartThreads), kPartStagesSmem,
                                   stream, 0, /*dependent=*/false);
  const uint32_t prefetch = PartSlotPrefetchMask(stages, parts, warp_kp);
  if (attend == nullptr) {
    return cudaLaunchKernelEx(&launch.cfg, PartStagesForm<false>(f8, small), q, scale, group,
                              parts, stages, DeviceSelectAttend{}, skip, RegHistMode(), warp_kp,
                              prefetch, PartPlanOf(stages, parts, nullptr));
  }
  // Every block's partials to attend->merge_partials, merged by the kernel's last blocks
  // (merge_arrivals) or else by PartMergeKernel, its programmatic dependent.
  if (attend->merge_partials == nullptr) return cudaErrorInvalidValue;
  const cudaError_t e =
      cudaLaunchKernelEx(&launch.cfg, PartStagesForm<true>(f8, small), q, scale, group, parts,
                         stages, *attend, skip, RegHistMode(), warp_kp, prefetch,
                         PartPlanOf(stages, parts, attend));
  if (e != cudaSuccess || attend->merge_arrivals != nullptr) return e;
  return LaunchDependent(PartMergeKernel, dim3(num_kv_heads), dim3(kPartThreads), 0,
                         /*dependent=*/true, stream, attend->merge_partials, group, parts,
                         attend->v_scale, attend->out, attend->lse);
}

}  // namespace strata::kernels::cuda_internal
