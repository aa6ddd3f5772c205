// Token sampling on the device (kernels/backend.h SampleParams), the CUDA twin of
// kernels/cpu/sampling.cc (engine::Sampler's algorithm). No sort of the vocabulary: every cut in
// the candidates' order (logit descending, id ascending) is found from a histogram of an
// order-preserving key of the logit.
//
//   1. SampleArgmaxKernel (one block per row): the best candidate (largest logit, lowest id) and
//      the candidate count. Greedy rows (and rows with no candidate) are finished here.
//   2. SampleProbKernel (grid over rows x chunks): p_i = exp(l_i / T - l_max / T) in double for
//      every candidate, with engine::Sampler's arithmetic (no FMA contraction), into scratch, and
//      each candidate's count and p added to its bin of the row's histogram (the top kBinBits
//      bits of the key; zeroed by a memset before).
//   3. SampleSelectKernel (one block per row): each cut (top-k count, top-p mass, the draw
//      u * kept) is the first element, in candidate order, at which a running sum of weights
//      reaches a target. The block scans the bins' sums (each thread a run of bins) to find the
//      bin where the sum crosses; the candidates of that bin are gathered into shared memory,
//      sorted (bitonic, key descending then id ascending) and scanned for the element.
//      A bin of more than kGather candidates (many equal or nearly equal logits) sends the row
//      to the slower exact search of RadixSelect: four passes of an 8-bit digit histogram over
//      the vocabulary per cut, then one more for the id among ties.
// Sums are taken in another order than the CPU's sequential ones, so the token can differ from
// the CPU twin only where a target falls within double rounding of a cumulative sum.
#include <cstdint>

#include "kernels/cuda/internal/sampling.h"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kThreads = 1024;
constexpr int kProbThreads = 256;
constexpr int kProbChunk = 4096;
constexpr int kBinBitsMax = 16;  // histogram bins per row: up to 2^16
constexpr int kGather = 2 * kThreads;  // candidates of one bin sorted in shared memory
constexpr int kRun = 64;               // bins per run (a thread's share of 2^16 bins)
static_assert(kRun << 10 == 1 << kBinBitsMax && kThreads == 1024);

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
                     const RowState* __restrict__ state, double* __restrict__ probs,
                     double* __restrict__ bin_mass, int* __restrict__ bin_count,
                     double* __restrict__ run_mass, int* __restrict__ run_count, int bin_bits) {
  // The block's sums per run (kRun bins), added to the row's once at the end.
  __shared__ double s_mass[kThreads];
  __shared__ int s_count[kThreads];
  const int row = blockIdx.y;
  const RowState st = state[row];
  const DeviceSampleRow o = Clamp(opts[row]);
  if (st.count == 0 || o.temperature == 0.0) return;
  const int bins = 1 << bin_bits, runs = bins / kRun;
  for (int r = threadIdx.x; r < runs; r += kProbThreads) s_mass[r] = 0.0, s_count[r] = 0;
  __syncthreads();
  const double inv_t = 1.0 / o.temperature;
  const float c0 = FloatOfKey(st.max_key);
  const double max_l = static_cast<double>(c0) * inv_t;
  const float* l = logits + static_cast<int64_t>(row) * vocab;
  double* p = probs + static_cast<int64_t>(row) * vocab;
  double* mass = bin_mass + static_cast<int64_t>(row) * bins;
  int* count = bin_count + static_cast<int64_t>(row) * bins;
  const int shift = 32 - bin_bits;
  const int begin = blockIdx.x * kProbChunk;
  const int end = min(vocab, begin + kProbChunk);
  for (int i = begin + threadIdx.x; i < end; i += kProbThreads) {
    const float li = l[i];
    const double pi = ProbOf(li, c0, inv_t, max_l);
    p[i] = pi;
    const uint32_t k = KeyOf(li);
    if (k != 0u) {
      const int bin = static_cast<int>(k >> shift);
      atomicAdd(&mass[bin], pi);
      atomicAdd(&count[bin], 1);
      atomicAdd(&s_mass[bin / kRun], pi);
      atomicAdd(&s_count[bin / kRun], 1);
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < runs; r += kProbThreads) {
    if (s_count[r] != 0) {
      atomicAdd(&run_mass[static_cast<int64_t>(row) * runs + r], s_mass[r]);
      atomicAdd(&run_count[static_cast<int64_t>(row) * runs + r], s_count[r]);
    }
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
__device__ bool RadixSelect(const float* __restrict__ l, const double* __restrict__ p, int vocab,
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

// The whole row by RadixSelect (the exact search without a histogram of the row): the fallback of
// SampleSelectKernel when a bin holds too many candidates to gather.
__device__ void SampleRowRadix(const float* __restrict__ l, const double* __restrict__ p, int vocab,
                               const RowState& st, const DeviceSampleRow& o, int32_t* token,
                               SelectShared& sh) {
  Cut cut{0u, 0x7fffffff};  // every candidate
  if (o.top_k > 0 && o.top_k < st.count) {
    Cut c;
    if (RadixSelect(l, p, vocab, cut, Weight::kCount, 1.0, static_cast<double>(o.top_k), false,
                    &c, sh)) {
      cut = c;
    }
  }
  double mass;
  int count;
  if (o.top_p < 1.0) {
    KeptSums(l, p, vocab, cut, &mass, &count, sh);
    Cut c;
    if (RadixSelect(l, p, vocab, cut, Weight::kQ, mass, o.top_p, false, &c, sh)) cut = c;
  }
  KeptSums(l, p, vocab, cut, &mass, &count, sh);
  const double u = o.u * mass;
  Cut c;
  if (!RadixSelect(l, p, vocab, cut, Weight::kP, 1.0, u, true, &c, sh)) {
    // Rounding at the very top of the range: the last kept element.
    RadixSelect(l, p, vocab, cut, Weight::kCount, 1.0, static_cast<double>(count), false, &c, sh);
  }
  if (threadIdx.x == 0) *token = c.id;
}

// ---- The histogram path (SampleSelectKernel) --------------------------------------------------
// Bins in candidate order: position pos = bins - 1 - bin (largest keys first). Runs of kRun
// positions: thread t owns run t, whose sums (over every candidate) SampleProbKernel also keeps,
// in run_mass / run_count (index runs - 1 - t, so that the runs' bins are `bin >> kRunBits`). A cut
// (key, id) keeps the candidates before it and itself: `mass` / `count` are the p and count of the
// kept candidates of its bin, `run_mass` / `run_count` those of its run.
struct BinCut {
  bool on = false;
  Cut cut{0u, 0x7fffffff};
  int bin = 0;
  double mass = 0.0;
  int count = 0;
  double run_mass = 0.0;
  int run_count = 0;
};

struct Found {
  bool found = false;
  bool overflow = false;  // the crossing bin held more than kGather candidates
  BinCut at;              // the element (as the cut that would end at it)
};

struct FastShared {
  unsigned long long comp[kGather];  // (key << 32) | ~id: sorting descending gives the order
  double run_m[kRun];                // the crossing run's bins (kept part)
  int run_n[kRun];
  double warp_d[2][33];
  int warp_i[33];
  int gn;
  int bin;       // the crossing bin, its index within the run
  int bin_j;
  double before; // weight before the crossing run, then before the crossing bin
  double mass_at;
};

// Inclusive sums of two doubles over the lanes of a warp, in lane order.
__device__ __forceinline__ void WarpScan2(double& a, double& b) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double ya = __shfl_up_sync(0xffffffffu, a, o);
    const double yb = __shfl_up_sync(0xffffffffu, b, o);
    if (lane >= o) a += ya, b += yb;
  }
}

// Exclusive sums over the block of two doubles (a, b), in thread order; totals to *ta, *tb.
__device__ void BlockScan2(double a, double b, double* ea, double* eb, double* ta, double* tb,
                           FastShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double xa = a, xb = b;
  WarpScan2(xa, xb);
  __syncthreads();  // warp_d free
  if (lane == 31) sh.warp_d[0][warp] = xa, sh.warp_d[1][warp] = xb;
  __syncthreads();
  if (warp == 0) {
    const double wa = sh.warp_d[0][lane], wb = sh.warp_d[1][lane];
    double sa = wa, sb = wb;
    WarpScan2(sa, sb);
    sh.warp_d[0][lane] = sa - wa;
    sh.warp_d[1][lane] = sb - wb;
    if (lane == 31) sh.warp_d[0][32] = sa, sh.warp_d[1][32] = sb;
  }
  __syncthreads();
  *ea = sh.warp_d[0][warp] + xa - a;
  *eb = sh.warp_d[1][warp] + xb - b;
  *ta = sh.warp_d[0][32];
  *tb = sh.warp_d[1][32];
}

__device__ int BlockMinI(int v, FastShared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.warp_i[threadIdx.x >> 5] = v;
  __syncthreads();
  int m = sh.warp_i[0];
  for (int w = 1; w < kThreads / 32; ++w) m = min(m, sh.warp_i[w]);
  return m;
}

// The row's histogram.
struct Bins {
  const double* mass;
  const int* count;
  int n;      // bins (a multiple of kRun)
  int shift;  // bin = key >> shift
  __device__ int BinAt(int pos) const { return n - 1 - pos; }
  __device__ int PosOf(int bin) const { return n - 1 - bin; }
  __device__ int RunOf(int bin) const { return PosOf(bin) / kRun; }
};

// Mass and count of bin position `pos` kept under `c`.
__device__ __forceinline__ void BinKept(const Bins& b, const BinCut& c, int pos, double* m,
                                        int* n) {
  const int bin = b.BinAt(pos);
  if (!c.on || bin > c.bin) {
    *m = b.mass[bin];
    *n = b.count[bin];
  } else if (bin == c.bin) {
    *m = c.mass;
    *n = c.count;
  } else {
    *m = 0.0;
    *n = 0;
  }
}

// Run t (this thread's) kept under `c`; `full_*` are its sums without a cut.
__device__ __forceinline__ void RunKept(const Bins& b, const BinCut& c, double full_mass,
                                        int full_count, double* m, int* n) {
  const int t = static_cast<int>(threadIdx.x);
  const int cut_run = c.on ? b.RunOf(c.bin) : kThreads;
  *m = t < cut_run ? full_mass : t == cut_run ? c.run_mass : 0.0;
  *n = t < cut_run ? full_count : t == cut_run ? c.run_count : 0;
}

__device__ __forceinline__ double WeightOf(Weight w, double mass, int count, double total) {
  return w == Weight::kCount ? static_cast<double>(count)
                             : w == Weight::kQ ? __ddiv_rn(mass, total) : mass;
}

// The first kept candidate (under `c`) at which the running sum of weights crosses `target`:
// the run from the runs' sums, the bin from the run's bins, then the bin's candidates gathered,
// sorted and scanned.
__device__ Found FastSelect(const float* __restrict__ l, const double* __restrict__ p, int vocab,
                            const Bins& b, const BinCut& c, double full_mass, int full_count,
                            Weight w, double total, double target, bool strict, FastShared& sh) {
  Found f;
  const int tid = static_cast<int>(threadIdx.x);
  double run_mass;
  int run_count;
  RunKept(b, c, full_mass, full_count, &run_mass, &run_count);
  const double run_w = WeightOf(w, run_mass, run_count, total);
  double excl_w, excl_m, all_w, all_m;
  BlockScan2(run_w, run_mass, &excl_w, &excl_m, &all_w, &all_m, sh);
  const int first =
      BlockMinI(run_count > 0 && Crosses(excl_w + run_w, target, strict) ? tid : kThreads, sh);
  if (first == kThreads) return f;  // never crosses
  // The run's bins (kept part) into shared memory; thread 0 finds the bin: the first where the
  // sum crosses (or, through rounding, the run's last bin with kept candidates).
  if (tid < kRun) {
    double m = 0.0;
    int n = 0;
    const int pos = first * kRun + tid;
    if (pos < b.n) BinKept(b, c, pos, &m, &n);
    sh.run_m[tid] = m;
    sh.run_n[tid] = n;
  }
  if (tid == first) sh.before = excl_w;
  __syncthreads();
  if (tid == 0) {
    double acc = sh.before, bw = 0.0;
    int bj = -1;
    for (int j = 0; j < kRun; ++j) {
      const int n = sh.run_n[j];
      if (n == 0) continue;
      const double x = WeightOf(w, sh.run_m[j], n, total);
      bj = j, bw = acc;
      if (Crosses(acc + x, target, strict)) break;
      acc += x;
    }
    sh.bin_j = bj;
    sh.bin = b.BinAt(first * kRun + bj);
    sh.before = bw;
    sh.gn = 0;
  }
  __syncthreads();
  const int bin = sh.bin;
  const double before = sh.before;
  // Gather the bin's kept candidates.
  auto consider = [&](uint32_t k, int i) {
    if (k == 0u || static_cast<int>(k >> b.shift) != bin) return;
    if (c.on && !Kept(k, i, c.cut)) return;
    const int slot = atomicAdd(&sh.gn, 1);
    if (slot < kGather) {
      sh.comp[slot] =
          (static_cast<unsigned long long>(k) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    }
  };
  int tail = 0;
  if ((reinterpret_cast<uintptr_t>(l) & 15u) == 0) {
    const int n4 = vocab >> 2;
    const float4* l4 = reinterpret_cast<const float4*>(l);
#pragma unroll 4
    for (int j = tid; j < n4; j += kThreads) {
      const float4 v = l4[j];
      consider(KeyOf(v.x), 4 * j);
      consider(KeyOf(v.y), 4 * j + 1);
      consider(KeyOf(v.z), 4 * j + 2);
      consider(KeyOf(v.w), 4 * j + 3);
    }
    tail = 4 * n4;
  }
  for (int i = tail + tid; i < vocab; i += kThreads) consider(KeyOf(l[i]), i);
  __syncthreads();
  const int gn = sh.gn;
  if (gn > kGather || gn == 0) {
    f.overflow = true;  // gn == 0 cannot happen (the bin has kept candidates); be safe
    return f;
  }
  int n2 = 2;
  while (n2 < gn) n2 <<= 1;
  for (int e = gn + tid; e < n2; e += kThreads) sh.comp[e] = 0ull;
  __syncthreads();
  // Bitonic sort, descending.
  for (int k = 2; k <= n2; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int e = tid; e < n2; e += kThreads) {
        const int x = e ^ j;
        if (x > e) {
          const unsigned long long a = sh.comp[e], z = sh.comp[x];
          const bool desc = (e & k) == 0;
          if (desc ? a < z : a > z) sh.comp[e] = z, sh.comp[x] = a;
        }
      }
      __syncthreads();
    }
  }
  // Running sums in order: thread t takes elements 2t and 2t + 1 (kGather = 2 * kThreads).
  double wv[2], mv[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int e = 2 * tid + q;
    wv[q] = 0.0, mv[q] = 0.0;
    if (e < gn) {
      const int id = static_cast<int>(0xffffffffu - static_cast<uint32_t>(sh.comp[e]));
      mv[q] = p[id];
      wv[q] = WeightOf(w, mv[q], 1, total);
    }
  }
  double ew, em, tw, tm;
  BlockScan2(wv[0] + wv[1], mv[0] + mv[1], &ew, &em, &tw, &tm, sh);
  int hit = kGather;
  if (2 * tid < gn && Crosses(before + ew + wv[0], target, strict)) {
    hit = 2 * tid;
  } else if (2 * tid + 1 < gn && Crosses(before + ew + wv[0] + wv[1], target, strict)) {
    hit = 2 * tid + 1;
  }
  int e = BlockMinI(hit, sh);
  if (e == kGather) e = gn - 1;  // rounding: the bin's sum crossed, its elements' did not
  // The kept mass of the bin up to and including element e.
  if (2 * tid == e || 2 * tid + 1 == e) {
    sh.mass_at = em + mv[0] + (e == 2 * tid + 1 ? mv[1] : 0.0);
  }
  __syncthreads();
  const unsigned long long ce = sh.comp[e];
  f.found = true;
  f.at.on = true;
  f.at.cut = Cut{static_cast<uint32_t>(ce >> 32),
                 static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(ce))};
  f.at.bin = bin;
  f.at.mass = sh.mass_at;
  f.at.count = e + 1;
  // The run's kept sums under the new cut: its bins before the cut bin, and the cut bin's part.
  double rm = f.at.mass;
  int rn = f.at.count;
  for (int j = 0; j < sh.bin_j; ++j) rm += sh.run_m[j], rn += sh.run_n[j];
  f.at.run_mass = rm;
  f.at.run_count = rn;
  __syncthreads();  // sh reused by the next call
  return f;
}

__global__ void __launch_bounds__(kThreads)
    SampleSelectKernel(const float* __restrict__ logits, int vocab,
                       const DeviceSampleRow* __restrict__ opts,
                       const RowState* __restrict__ state, const double* __restrict__ probs,
                       const double* __restrict__ bin_mass, const int* __restrict__ bin_count,
                       const double* __restrict__ run_mass, const int* __restrict__ run_count,
                       int bin_bits, int32_t* __restrict__ tokens) {
  __shared__ FastShared fs;
  __shared__ SelectShared sh;
  const int row = blockIdx.x;
  const RowState st = state[row];
  const DeviceSampleRow o = Clamp(opts[row]);
  if (st.count == 0 || o.temperature == 0.0) return;
  const float* l = logits + static_cast<int64_t>(row) * vocab;
  const double* p = probs + static_cast<int64_t>(row) * vocab;
  Bins b;
  b.n = 1 << bin_bits;
  b.shift = 32 - bin_bits;
  b.mass = bin_mass + static_cast<int64_t>(row) * b.n;
  b.count = bin_count + static_cast<int64_t>(row) * b.n;
  const int runs = b.n / kRun;
  const int t = static_cast<int>(threadIdx.x);
  const int64_t my_run = static_cast<int64_t>(row) * runs + runs - 1 - t;
  const double full_mass = t < runs ? run_mass[my_run] : 0.0;
  const int full_count = t < runs ? run_count[my_run] : 0;
  BinCut cut;
  bool overflow = false;
  if (o.top_k > 0 && o.top_k < st.count) {
    const Found f = FastSelect(l, p, vocab, b, cut, full_mass, full_count, Weight::kCount, 1.0,
                               static_cast<double>(o.top_k), false, fs);
    overflow = f.overflow;
    if (f.found) cut = f.at;
  }
  // Sums of the kept set: mass, then count.
  auto kept_sums = [&](double* mass, double* count) {
    double m;
    int n;
    RunKept(b, cut, full_mass, full_count, &m, &n);
    double em, en;
    BlockScan2(m, static_cast<double>(n), &em, &en, mass, count, fs);
  };
  if (!overflow && o.top_p < 1.0) {
    double total, count;
    kept_sums(&total, &count);
    const Found f = FastSelect(l, p, vocab, b, cut, full_mass, full_count, Weight::kQ, total,
                               o.top_p, false, fs);
    overflow = f.overflow;
    if (f.found) cut = f.at;
  }
  int32_t token = -1;
  if (!overflow) {
    double kept, count;
    kept_sums(&kept, &count);
    Found f = FastSelect(l, p, vocab, b, cut, full_mass, full_count, Weight::kP, 1.0, o.u * kept,
                         true, fs);
    if (!f.found && !f.overflow) {
      // Rounding at the very top of the range: the last kept element.
      f = FastSelect(l, p, vocab, b, cut, full_mass, full_count, Weight::kCount, 1.0, count,
                     false, fs);
    }
    overflow = f.overflow || !f.found;
    token = f.at.cut.id;
  }
  if (overflow) {
    SampleRowRadix(l, p, vocab, st, o, tokens + row, sh);
  } else if (threadIdx.x == 0) {
    tokens[row] = token;
  }
}

size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

// Histogram bits for a vocabulary: about one bin per candidate, 8 to kBinBitsMax.
int BinBits(int vocab) {
  int bits = 8;
  while (bits < kBinBitsMax && (1 << bits) < vocab) ++bits;
  return bits;
}

}  // namespace

size_t SampleScratchBytes(int rows, int vocab) {
  const size_t bins = size_t{1} << BinBits(vocab);
  return AlignUp(sizeof(RowState) * static_cast<size_t>(rows)) +
         AlignUp(sizeof(double) * static_cast<size_t>(rows) * static_cast<size_t>(vocab)) +
         (sizeof(double) + sizeof(int)) * static_cast<size_t>(rows) * (bins + bins / kRun);
}

cudaError_t LaunchSample(const float* logits, int rows, int vocab, const DeviceSampleRow* opts,
                         int32_t* tokens, void* scratch, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int bits = BinBits(vocab);
  const size_t bins = size_t{1} << bits, runs = bins / kRun;
  char* base = static_cast<char*>(scratch);
  auto* state = reinterpret_cast<RowState*>(base);
  base += AlignUp(sizeof(RowState) * static_cast<size_t>(rows));
  auto* probs = reinterpret_cast<double*>(base);
  base += AlignUp(sizeof(double) * static_cast<size_t>(rows) * static_cast<size_t>(vocab));
  // The histograms (zeroed each call): bin mass, run mass, bin count, run count.
  auto* bin_mass = reinterpret_cast<double*>(base);
  double* run_mass = bin_mass + static_cast<size_t>(rows) * bins;
  auto* bin_count = reinterpret_cast<int*>(run_mass + static_cast<size_t>(rows) * runs);
  int* run_count = bin_count + static_cast<size_t>(rows) * bins;
  cudaError_t e = cudaMemsetAsync(
      bin_mass, 0, (sizeof(double) + sizeof(int)) * static_cast<size_t>(rows) * (bins + runs),
      stream);
  if (e != cudaSuccess) return e;
  SampleArgmaxKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, opts, tokens, state);
  const dim3 grid((vocab + kProbChunk - 1) / kProbChunk, rows);
  SampleProbKernel<<<grid, kProbThreads, 0, stream>>>(logits, vocab, opts, state, probs, bin_mass,
                                                      bin_count, run_mass, run_count, bits);
  SampleSelectKernel<<<rows, kThreads, 0, stream>>>(logits, vocab, opts, state, probs, bin_mass,
                                                    bin_count, run_mass, run_count, bits, tokens);
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
