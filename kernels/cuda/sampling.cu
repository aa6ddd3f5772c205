// Token sampling on the device (kernels/backend.h SampleParams), the CUDA twin of
// kernels/cpu/sampling.cc (engine::Sampler's algorithm). No sort: every cut in the candidates'
// order (logit descending, id ascending) is found by a radix threshold search on the logit.
//
//   1. SampleArgmaxKernel (one block per row): the best candidate (largest logit, lowest id) and
//      the candidate count. Greedy rows (and rows with no candidate) are finished here.
//   2. SampleProbKernel (grid over rows x chunks): p_i = exp(l_i / T - l_max / T) in double for
//      every candidate, with engine::Sampler's arithmetic (no FMA contraction), into scratch.
//   3. SampleSelectKernel (one block per row): Select() finds the first element, in candidate
//      order, at which a running sum of weights (1 for top-k, p / total for top-p, p for the draw)
//      reaches a target: four passes of an 8-bit digit histogram of an order-preserving key of
//      the logit fix the cut value; one more pass finds the id among ties of that value.
//      top-k cut, total, top-p cut, kept mass, then the draw u * kept.
// Sums are taken in another order than the CPU's sequential ones, so the token can differ from
// the CPU twin only where a target falls within double rounding of a cumulative sum.
#include <cstdint>

#include "kernels/cuda/internal/sampling.h"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kThreads = 1024;
constexpr int kProbThreads = 256;
constexpr int kProbChunk = 4096;

struct RowState {
  uint32_t max_key;  // key of the largest candidate logit
  int32_t argmax;
  int32_t count;     // candidates (not NaN, not -inf)
  int32_t pad;
};

// Order-preserving key of a logit: larger logit -> larger key; -0 and +0 share one key; NaN and
// -inf (never candidates) get 0, below every candidate.
__device__ __forceinline__ uint32_t KeyOf(float f) {
  if (isnan(f) || f == -INFINITY) return 0u;
  if (f == 0.0f) f = 0.0f;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float FloatOfKey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// engine::Sampler's clamping of the options.
__device__ __forceinline__ DeviceSampleRow Clamp(DeviceSampleRow r) {
  if (!(r.temperature >= 0.0) || isinf(r.temperature)) r.temperature = 0.0;
  if (r.top_k < 0) r.top_k = 0;
  if (!(r.top_p > 0.0)) r.top_p = 1e-9;
  if (!(r.top_p <= 1.0)) r.top_p = 1.0;
  return r;
}

// The probability numerator of a logit, exactly as engine::Sampler computes it.
__device__ __forceinline__ double ProbOf(float l, float c0, double inv_t, double max_l) {
  if (isinf(max_l)) return static_cast<double>(l) == static_cast<double>(c0) ? 1.0 : 0.0;
  return exp(__dsub_rn(__dmul_rn(static_cast<double>(l), inv_t), max_l));
}

__device__ double BlockSumD(double v, double* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
  return s;
}

__device__ int BlockSumI(int v, int* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  int s = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
  return s;
}

__global__ void __launch_bounds__(kThreads)
    SampleArgmaxKernel(const float* __restrict__ logits, int vocab,
                       const DeviceSampleRow* __restrict__ opts, int32_t* __restrict__ tokens,
                       RowState* __restrict__ state) {
  const int row = blockIdx.x;
  const float* l = logits + static_cast<int64_t>(row) * vocab;
  uint32_t best = 0u;
  int best_id = 0x7fffffff;
  int count = 0;
  // Each thread visits its ids in increasing order, so a strictly larger key is the only update.
  if ((reinterpret_cast<uintptr_t>(l) & 15u) == 0) {
    const int n4 = vocab >> 2;
    const float4* l4 = reinterpret_cast<const float4*>(l);
    for (int j = threadIdx.x; j < n4; j += kThreads) {
      const float4 v = l4[j];
      const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t k = KeyOf(e[q]);
        count += k != 0u;
        if (k > best) best = k, best_id = 4 * j + q;
      }
    }
    for (int i = 4 * n4 + threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t k = KeyOf(l[i]);
      count += k != 0u;
      if (k > best || (k == best && k != 0u && i < best_id)) best = k, best_id = i;
    }
  } else {
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t k = KeyOf(l[i]);
      count += k != 0u;
      if (k > best) best = k, best_id = i;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t ok = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
    if (ok > best || (ok == best && oi < best_id)) best = ok, best_id = oi;
    count += __shfl_xor_sync(0xffffffffu, count, o);
  }
  __shared__ uint32_t s_key[32];
  __shared__ int s_id[32], s_count[32];
  if ((threadIdx.x & 31) == 0) {
    s_key[threadIdx.x >> 5] = best;
    s_id[threadIdx.x >> 5] = best_id;
    s_count[threadIdx.x >> 5] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      if (s_key[w] > best || (s_key[w] == best && s_id[w] < best_id)) best = s_key[w], best_id = s_id[w];
      count += s_count[w];
    }
    state[row] = RowState{best, best_id, count, 0};
    const DeviceSampleRow o = Clamp(opts[row]);
    if (count == 0) {
      tokens[row] = -1;
    } else if (o.temperature == 0.0) {
      tokens[row] = best_id;
    }
  }
}

__global__ void __launch_bounds__(kProbThreads)
    SampleProbKernel(const float* __restrict__ logits, int vocab,
                     const DeviceSampleRow* __restrict__ opts,
                     const RowState* __restrict__ state, double* __restrict__ probs) {
  const int row = blockIdx.y;
  const RowState st = state[row];
  const DeviceSampleRow o = Clamp(opts[row]);
  if (st.count == 0 || o.temperature == 0.0) return;
  const double inv_t = 1.0 / o.temperature;
  const float c0 = FloatOfKey(st.max_key);
  const double max_l = static_cast<double>(c0) * inv_t;
  const float* l = logits + static_cast<int64_t>(row) * vocab;
  double* p = probs + static_cast<int64_t>(row) * vocab;
  const int begin = blockIdx.x * kProbChunk;
  const int end = min(vocab, begin + kProbChunk);
  for (int i = begin + threadIdx.x; i < end; i += kProbThreads) {
    p[i] = ProbOf(l[i], c0, inv_t, max_l);
  }
}

enum class Weight { kCount, kQ, kP };

// The kept set: candidates with key > key, or key == key and id <= id.
struct Cut {
  uint32_t key;
  int32_t id;
};

__device__ __forceinline__ bool Kept(uint32_t k, int i, Cut c) {
  return k != 0u && (k > c.key || (k == c.key && i <= c.id));
}

__device__ __forceinline__ bool Crosses(double acc, double target, bool strict) {
  return strict ? acc > target : acc >= target;
}

struct SelectShared {
  double hist[256];
  int count[256];
  double red_d[32];
  int red_i[32];
  int scan[kThreads];
  uint32_t digit;
  int found;
  double before;
  int tie_index;
  int result_id;
};

// The first kept element (candidate order) at which the running sum of weights crosses `target`;
// returns false (and leaves *out alone) when the sum never crosses it.
__device__ bool Select(const float* __restrict__ l, const double* __restrict__ p, int vocab,
                       Cut cut, Weight w, double total, double target, bool strict, Cut* out,
                       SelectShared& sh) {
  uint32_t prefix = 0u, mask = 0u;
  double before = 0.0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += kThreads) sh.hist[d] = 0.0, sh.count[d] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t k = KeyOf(l[i]);
      if (!Kept(k, i, cut) || (k & mask) != prefix) continue;
      const int d = (k >> shift) & 255;
      const double x = w == Weight::kCount ? 1.0 : w == Weight::kQ ? __ddiv_rn(p[i], total) : p[i];
      atomicAdd(&sh.hist[d], x);
      atomicAdd(&sh.count[d], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      sh.found = 0;
      for (int d = 255; d >= 0; --d) {
        if (sh.count[d] == 0) continue;
        if (Crosses(before + sh.hist[d], target, strict)) {
          sh.found = 1;
          sh.digit = static_cast<uint32_t>(d);
          break;
        }
        before += sh.hist[d];
      }
      sh.before = before;
    }
    __syncthreads();
    if (!sh.found) return false;
    prefix |= sh.digit << shift;
    mask |= 255u << shift;
    before = sh.before;
    __syncthreads();
  }
  // prefix is the cut key; `before` the weight of kept elements above it. All ties have one weight.
  if (threadIdx.x == 0) {
    const int n = sh.count[sh.digit];
    sh.tie_index = -1;
    if (w == Weight::kCount) {
      double acc = before;
      int j = 0;
      for (; j < n; ++j) {
        acc += 1.0;
        if (Crosses(acc, target, strict)) break;
      }
      sh.tie_index = j < n ? j : n - 1;
    }
  }
  __syncthreads();
  // The ties' weight (they share the logit, hence the probability): read at the first tie.
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int lo = min(vocab, static_cast<int>(threadIdx.x) * chunk);
  const int hi = min(vocab, lo + chunk);
  int mine = 0;
  int first_tie = 0x7fffffff;
  for (int i = lo; i < hi; ++i) {
    if (Kept(KeyOf(l[i]), i, cut) && KeyOf(l[i]) == prefix) {
      ++mine;
      if (first_tie == 0x7fffffff) first_tie = i;
    }
  }
  if (w != Weight::kCount) {
    int f = first_tie;
    for (int o = 16; o > 0; o >>= 1) f = min(f, __shfl_xor_sync(0xffffffffu, f, o));
    if ((threadIdx.x & 31) == 0) sh.red_i[threadIdx.x >> 5] = f;
    __syncthreads();
    if (threadIdx.x == 0) {
      int g = 0x7fffffff;
      for (int q = 0; q < kThreads / 32; ++q) g = min(g, sh.red_i[q]);
      const double x = w == Weight::kQ ? __ddiv_rn(p[g], total) : p[g];
      const int n = sh.count[sh.digit];
      double acc = before;
      int j = 0;
      for (; j < n; ++j) {
        acc += x;
        if (Crosses(acc, target, strict)) break;
      }
      sh.tie_index = j < n ? j : n - 1;
    }
    __syncthreads();
  }
  // Exclusive scan of the per-thread tie counts (contiguous id chunks), then the owner finds it.
  sh.scan[threadIdx.x] = mine;
  __syncthreads();
  for (int o = 1; o < kThreads; o <<= 1) {
    const int v = threadIdx.x >= static_cast<unsigned>(o) ? sh.scan[threadIdx.x - o] : 0;
    __syncthreads();
    sh.scan[threadIdx.x] += v;
    __syncthreads();
  }
  const int excl = sh.scan[threadIdx.x] - mine;
  const int want = sh.tie_index;
  if (want >= excl && want < excl + mine) {
    int seen = excl;
    for (int i = lo; i < hi; ++i) {
      if (Kept(KeyOf(l[i]), i, cut) && KeyOf(l[i]) == prefix) {
        if (seen == want) {
          sh.result_id = i;
          break;
        }
        ++seen;
      }
    }
  }
  __syncthreads();
  *out = Cut{prefix, sh.result_id};
  __syncthreads();
  return true;
}

// Weight of the kept set: total probability (or count).
__device__ void KeptSums(const float* __restrict__ l, const double* __restrict__ p, int vocab,
                         Cut cut, double* mass, int* count, SelectShared& sh) {
  double m = 0.0;
  int c = 0;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    if (Kept(KeyOf(l[i]), i, cut)) m += p[i], ++c;
  }
  *mass = BlockSumD(m, sh.red_d);
  *count = BlockSumI(c, sh.red_i);
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    SampleSelectKernel(const float* __restrict__ logits, int vocab,
                       const DeviceSampleRow* __restrict__ opts,
                       const RowState* __restrict__ state, const double* __restrict__ probs,
                       int32_t* __restrict__ tokens) {
  __shared__ SelectShared sh;
  const int row = blockIdx.x;
  const RowState st = state[row];
  const DeviceSampleRow o = Clamp(opts[row]);
  if (st.count == 0 || o.temperature == 0.0) return;
  const float* l = logits + static_cast<int64_t>(row) * vocab;
  const double* p = probs + static_cast<int64_t>(row) * vocab;
  Cut cut{0u, 0x7fffffff};  // every candidate
  if (o.top_k > 0 && o.top_k < st.count) {
    Cut c;
    if (Select(l, p, vocab, cut, Weight::kCount, 1.0, static_cast<double>(o.top_k), false, &c,
               sh)) {
      cut = c;
    }
  }
  double mass;
  int count;
  if (o.top_p < 1.0) {
    KeptSums(l, p, vocab, cut, &mass, &count, sh);
    Cut c;
    if (Select(l, p, vocab, cut, Weight::kQ, mass, o.top_p, false, &c, sh)) cut = c;
  }
  KeptSums(l, p, vocab, cut, &mass, &count, sh);
  const double u = o.u * mass;
  Cut c;
  if (!Select(l, p, vocab, cut, Weight::kP, 1.0, u, true, &c, sh)) {
    // Rounding at the very top of the range: the last kept element.
    Select(l, p, vocab, cut, Weight::kCount, 1.0, static_cast<double>(count), false, &c, sh);
  }
  if (threadIdx.x == 0) tokens[row] = c.id;
}

size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

size_t SampleScratchBytes(int rows, int vocab) {
  return AlignUp(sizeof(RowState) * static_cast<size_t>(rows)) +
         sizeof(double) * static_cast<size_t>(rows) * static_cast<size_t>(vocab);
}

cudaError_t LaunchSample(const float* logits, int rows, int vocab, const DeviceSampleRow* opts,
                         int32_t* tokens, void* scratch, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  auto* state = static_cast<RowState*>(scratch);
  auto* probs = reinterpret_cast<double*>(static_cast<char*>(scratch) +
                                          AlignUp(sizeof(RowState) * static_cast<size_t>(rows)));
  SampleArgmaxKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, opts, tokens, state);
  const dim3 grid((vocab + kProbChunk - 1) / kProbChunk, rows);
  SampleProbKernel<<<grid, kProbThreads, 0, stream>>>(logits, vocab, opts, state, probs);
  SampleSelectKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, opts, state, probs, tokens);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
