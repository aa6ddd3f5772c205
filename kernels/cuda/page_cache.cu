// ResolvePages on the GPU (kernels/backend.h, "The GPU page cache on the device"): the step of
// the device-managed GPU page cache, with no host involvement.
//
// Kernel 1 (one block of 1024 threads):
//   a. every thread names pages of the selection (head by head: prefix, middle, suffix; a middle
//      candidate whose predecessor in the same run lies in the same page is skipped); a resident
//      page is a hit (the first thread to stamp its slot with this call's epoch counts it); a
//      missing page is claimed by swapping its table entry from -1 to -2 (one thread wins) and
//      appended to the miss list in scratch;
//   b. victims from the clock, 1024 slots at a time: every thread loads one slot's pin and
//      reference bit, one block scan ranks the window's candidates (unpinned, bit clear) in
//      hand order, the first ones needed become the next misses' victims and the bits of the
//      unpinned slots before the last victim are cleared (exactly the sequential clock of the
//      CPU twin); each victim's thread assigns it to its miss (the old page's entry -1, the new
//      one the slot);
//   c. misses left without a victim are unresolved, and the counters and hand are written
//      (counts summed per warp, no per-item atomics on shared counters).
// Kernel 2 (a fixed grid): copies the pages of the call's misses from sources[page] into their
//   slots, 16-byte loads through the host mapping when aligned, several in flight per thread.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/page_cache.h"
#include "kernels/cuda/internal/selection.cuh"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kResolveThreads = 1024;
constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;
constexpr int kCopyBlocks = 528;  // 4 per SM on an H100

// Counter indices (kernels::PageCacheCounter).
constexpr int kEpoch = 0, kHand = 1, kLookups = 2, kHits = 3, kFills = 4, kEvictions = 5,
              kUnresolved = 6;

// The sum of `v` over the threads of the block below this one (an exclusive scan over the 1024
// threads); *total receives the sum over all. `warp_sums` is shared scratch of 32 ints. Every
// thread must call it.
__device__ __forceinline__ int BlockExclusiveSum(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;  // the warp's total
  __syncthreads();
  if (warp == 0) {
    const int w = warp_sums[lane];
    int t = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += y;
    }
    warp_sums[lane] = t - w;  // exclusive prefix of the warp totals
    if (lane == 31) warp_sums[32] = t;
  }
  __syncthreads();
  const int r = warp_sums[warp] + x - v;
  *total = warp_sums[32];
  __syncthreads();  // warp_sums may be reused by the next call
  return r;
}

__global__ void __launch_bounds__(kResolveThreads) ResolveKernel(ResolveArgs a) {
  __shared__ int n_miss_s;
  __shared__ int count_s[2];  // hits, evictions (warp-aggregated adds)
  __shared__ int last_s;      // the window's last victim
  __shared__ int scan_s[33];
  const int tid = threadIdx.x;
  const int64_t n = a.num_slots;
  // Every thread reads the epoch and hand (thread 0 writes them back at the end); no barrier.
  const long long e = a.counters[kEpoch] + 1;
  const uint32_t epoch = static_cast<uint32_t>(e);
  long long hand;
  {
    const long long h = a.counters[kHand];
    hand = h >= 0 && h < n ? h : 0;
  }
  if (tid < 2) count_s[tid] = 0;
  const int P = a.page_size;
  const int64_t pph = a.pages_per_head;

  // a. Naming. Item idx (head by head: prefix pages, middle candidates, suffix pages, the CPU
  // twin's order) names page NamedPage(idx), or -1.
  const int64_t prefix_pages = (a.prefix_end + P - 1) / P;
  const int64_t suffix_first = a.suffix_begin / P;
  const int64_t suffix_pages =
      a.suffix_end > a.suffix_begin ? (a.suffix_end - 1) / P - suffix_first + 1 : 0;
  // The middle's items. Page runs (parents with a fanout of whole pages) and a plain range are
  // named a page at a time, in the order their first candidates come; other lists (token ids)
  // a candidate at a time, a candidate whose predecessor in the same run names the same page
  // being skipped. The order of the pages' first items is the CPU twin's either way.
  const DeviceCandidates& mc = a.middle;
  const bool page_runs = mc.parents != nullptr && mc.fanout % P == 0;
  const int32_t run_pages = page_runs ? mc.fanout / P : 0;
  const int64_t range_first = mc.begin / P;
  int64_t mid_items;
  if (page_runs) {
    mid_items = static_cast<int64_t>(mc.num_parents) * run_pages;
  } else if (mc.parents == nullptr) {
    mid_items = mc.end > mc.begin ? (mc.end - 1) / P - range_first + 1 : 0;
  } else {
    mid_items = mc.count;
  }
  // Item counts fit in int32 (checked on the host), so the per-item arithmetic is 32-bit.
  const int32_t per_head = static_cast<int32_t>(prefix_pages + mid_items + suffix_pages);
  const int32_t total = per_head * a.num_kv_heads;
  const int32_t n_prefix = static_cast<int32_t>(prefix_pages);
  const int32_t n_mid = static_cast<int32_t>(mid_items);
  // The flat index named by item idx, or -1.
  auto named = [&](int32_t idx) -> int64_t {
    const int g = idx / per_head;
    const int32_t r = idx - g * per_head;
    int64_t page;
    if (r < n_prefix) {
      page = r;
    } else if (r < n_prefix + n_mid) {
      const int32_t m = r - n_prefix;
      if (page_runs) {
        const int32_t j = m / run_pages;
        const int32_t parent = mc.parents[static_cast<int64_t>(g) * mc.num_parents + j];
        if (parent < 0) return -1;
        page = static_cast<int64_t>(parent) * run_pages + (m - j * run_pages);
        // Named when one of its tokens is inside [begin, end).
        if (page * P + P <= mc.begin || page * P >= mc.end) return -1;
      } else if (mc.parents == nullptr) {
        page = range_first + m;
      } else {
        const int32_t id = CandidateIdAt(mc, g, m);
        if (id < 0) return -1;
        if (id % P != 0 && id - 1 >= mc.begin && m > 0 && m % mc.fanout != 0) return -1;
        page = id / P;
      }
    } else {
      page = suffix_first + (r - n_prefix - n_mid);
    }
    if (page < 0 || page >= pph) return -1;
    return a.table_base + static_cast<int64_t>(g) * pph + page;
  };
  // A per-thread count added to count_s[i] once per warp (every thread of the block calls it).
  auto add_count = [&](int i, int v) {
    v = __reduce_add_sync(0xffffffffu, v);
    if ((tid & 31) == 0 && v != 0) atomicAdd(&count_s[i], v);
  };
  // a1. Hits are stamped and counted once (the first thread to stamp the slot); a missing page's
  // entry becomes -2 - (the smallest item naming it).
  // Contiguous ranges of items per thread (a run's candidates share their parent's load).
  const int32_t span = (total + kResolveThreads - 1) / kResolveThreads;
  const int32_t lo = tid * span < total ? tid * span : total;
  const int32_t hi = lo + span < total ? lo + span : total;
  int hits = 0;
  for (int32_t idx = lo; idx < hi; ++idx) {
    const int64_t flat = named(idx);
    if (flat < 0) continue;
    const int32_t slot = *(volatile int32_t*)&a.table[flat];
    if (slot >= 0) {
      a.slot_ref[slot] = 1;
      if (atomicExch(&a.slot_stamp[slot], epoch) != epoch) ++hits;
    } else {
      const int32_t mark = static_cast<int32_t>(-2 - idx);
      const int32_t old = atomicCAS(&a.table[flat], -1, mark);
      if (old != -1) atomicMax(&a.table[flat], mark);
    }
  }
  __syncthreads();  // count_s zeroed; every claim made
  add_count(0, hits);
  // a2. The misses in naming order, each page at its first item: every thread takes a
  // contiguous range of items, counts its first items, and one block scan gives its offset.
  // Beyond scratch_pages they stay unresolved, as in the CPU twin.
  int32_t* misses = a.scratch + 1;
  {
    int count = 0;
    for (int32_t idx = lo; idx < hi; ++idx) {
      const int64_t flat = named(idx);
      if (flat >= 0 && a.table[flat] == -2 - idx) ++count;
    }
    int all = 0;
    int pos = BlockExclusiveSum(count, scan_s, &all);
    for (int32_t idx = lo; idx < hi && count > 0; ++idx) {
      const int64_t flat = named(idx);
      if (flat < 0 || a.table[flat] != -2 - idx) continue;
      if (pos < a.scratch_pages) {
        misses[pos] = static_cast<int32_t>(flat);
      } else {
        a.table[flat] = -1;
      }
      ++pos;
      --count;
    }
    if (tid == 0) n_miss_s = all;
  }
  __syncthreads();
  const int n_miss = n_miss_s;
  const int m = n_miss < a.scratch_pages ? n_miss : static_cast<int>(a.scratch_pages);

  // b. Victims from the clock, a window of up to 1024 slots at a time, exactly as the sequential
  // clock takes them: in hand order, an unpinned slot (stamp != epoch) with a clear reference
  // bit is the next miss's victim, an unpinned slot with its bit set has it cleared and is
  // passed; the rank of a slot among the window's candidates (one block scan) gives its miss.
  // The window stops after the last victim it needs. A victim is stamped at once, so a later
  // window (after the hand wraps) sees it pinned. Each victim is assigned by its thread.
  int32_t* victims = a.scratch + 1 + a.scratch_pages;
  const int window = n < kResolveThreads ? static_cast<int>(n) : kResolveThreads;
  int taken = 0, evictions = 0;
  long long passed = 0;       // slots passed since the last victim (or the call's start)
  long long after_victim = hand;
  bool pinned_out = false;
  while (taken < m && !pinned_out) {  // uniform: every thread computes the same values
    long long s = hand + tid;
    if (s >= n) s -= n;
    bool pinned = true, ref = false;
    if (tid < window) {
      pinned = a.slot_stamp[s] == epoch;
      ref = a.slot_ref[s] != 0;
    }
    const bool cand = !pinned && !ref;
    int found = 0;
    const int rank = BlockExclusiveSum(cand ? 1 : 0, scan_s, &found);
    const int need = m - taken;
    if (cand && rank == (found < need ? found : need) - 1) last_s = tid;
    __syncthreads();
    const bool served = found >= need;
    const int stop = served ? last_s + 1 : window;
    if (cand && rank < need) {
      const int k = taken + rank;
      const int32_t flat = misses[k];
      const int32_t old = a.slot_page[s];
      victims[k] = static_cast<int32_t>(s);
      if (old >= 0) {
        a.table[old] = -1;
        ++evictions;
      }
      a.slot_page[s] = flat;
      a.table[flat] = static_cast<int32_t>(s);
      a.slot_stamp[s] = epoch;
      a.slot_ref[s] = 1;
      if (a.page_scales != nullptr) {
        a.slot_scales[2 * s] = a.page_scales[2 * static_cast<int64_t>(flat)];
        a.slot_scales[2 * s + 1] = a.page_scales[2 * static_cast<int64_t>(flat) + 1];
      }
    } else if (tid < stop && !pinned && ref) {
      a.slot_ref[s] = 0;  // passed by the hand
    }
    if (found > 0) {
      const int last = last_s;
      long long v = hand + last + 1;
      if (v >= n) v -= n;
      after_victim = v;
      passed = served ? 0 : window - last - 1;
    } else {
      passed += window;
      pinned_out = passed >= 2 * n;  // every slot pinned: the hand has gone round twice
    }
    taken += found < need ? found : need;
    if (pinned_out) {
      hand = after_victim;  // the sequential clock stops 2n slots after its last victim
    } else {
      hand += stop;
      if (hand >= n) hand -= n;
    }
    __syncthreads();  // last_s read; the window's stamps and bits before the next window
  }
  add_count(1, evictions);

  // c. Misses left without a victim stay unresolved.
  for (int k = taken + tid; k < m; k += kResolveThreads) a.table[misses[k]] = -1;
  __syncthreads();
  if (tid == 0) {
    const int hits_all = count_s[0];
    const int unresolved = n_miss - taken;
    a.scratch[0] = taken;
    a.counters[kEpoch] = e;
    a.counters[kHand] = hand;
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.counters[kLookups]),
              static_cast<unsigned long long>(hits_all + n_miss));
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.counters[kHits]),
              static_cast<unsigned long long>(hits_all));
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.counters[kFills]),
              static_cast<unsigned long long>(taken));
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.counters[kEvictions]),
              static_cast<unsigned long long>(count_s[1]));
    atomicAdd(reinterpret_cast<unsigned long long*>(&a.counters[kUnresolved]),
              static_cast<unsigned long long>(unresolved));
  }
}

// Work item w: page w / (2 * chunks), half (w / chunks) % 2, chunk w % chunks of
// kCopyThreads * kCopyUnroll vectors.
template <typename V>
__global__ void __launch_bounds__(kCopyThreads) ResolveCopyKernel(ResolveArgs a) {
  const int taken = a.scratch[0];
  const int32_t* pages = a.scratch + 1;
  const int32_t* victims = a.scratch + 1 + a.scratch_pages;
  const int64_t half_vecs = a.half_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t per_chunk = static_cast<int64_t>(kCopyThreads) * kCopyUnroll;
  const int64_t chunks = (half_vecs + per_chunk - 1) / per_chunk;
  const int64_t items = static_cast<int64_t>(taken) * 2 * chunks;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t k = w / (2 * chunks);
    const int half = static_cast<int>((w / chunks) & 1);
    const int64_t chunk = w % chunks;
    const V* src = static_cast<const V*>(a.sources[pages[k]]) + half * half_vecs;
    V* dst = static_cast<V*>(half == 0 ? a.k_pool : a.v_pool) +
             static_cast<int64_t>(victims[k]) * half_vecs;
    CopyChunk<kCopyThreads, kCopyUnroll>(dst, src, chunk * per_chunk, half_vecs);
  }
}

}  // namespace

cudaError_t LaunchResolvePages(const ResolveArgs& a, cudaStream_t stream) {
  ResolveKernel<<<1, kResolveThreads, 0, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  // 16-byte vectors when the page halves allow (the host checked the source addresses when the
  // cache was made: sources_aligned below is part of the contract of the state).
  if (a.half_bytes % 16 == 0) {
    ResolveCopyKernel<uint4><<<kCopyBlocks, kCopyThreads, 0, stream>>>(a);
  } else {
    ResolveCopyKernel<uint8_t><<<kCopyBlocks, kCopyThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace strata::kernels::cuda_internal
