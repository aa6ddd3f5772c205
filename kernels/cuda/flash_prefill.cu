// Tensor-core flash attention for paged prefill: see kernels/cuda/internal/flash_prefill.h.
//
// Shared-memory tiles are [rows][D] bf16 with the 16-byte chunks of a row XOR-swizzled by
// (row & 7), so that ldmatrix (8 rows, one chunk each) and the cp.async writes are free of bank
// conflicts. Fragment layouts are those of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16"): a thread holds rows lane/4 and lane/4 + 8 of each of its warp's m16 blocks
// and columns 2*(lane%4), +1 of every 8-column tile. Each warp owns 16 * kMBlocks rows, so that
// every K and V fragment loaded from shared memory feeds kMBlocks MMAs.
#include <cstdint>

#include "kernels/cuda/internal/common.cuh"
#include "kernels/cuda/internal/flash_prefill.h"

namespace strata::kernels::cuda_internal {
namespace {

constexpr int kBlockM = kFlashBlockM;
constexpr int kMBlocks = 2;                  // m16 row blocks per warp (K/V fragments reused)
constexpr int kWarps = kBlockM / (16 * kMBlocks);
constexpr int kThreads = kWarps * 32;
constexpr int kMetaThreads = 128;
constexpr int64_t kPosNone = INT64_MAX;          // padding keys: masked for every query
constexpr int64_t kPosAll = INT64_MAX - 1;       // non-causal queries: every real key attended
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kThreads >= kFlashMaxBlockN, "the row/position pass uses one thread per key");

int g_block_n = 0;  // SetFlashPrefillBlockN

// Per (KV head, key tile) metadata written by the pre-pass (arrays of num_kv_heads *
// tiles_per_head, head-major).
struct TileMeta {
  int64_t* min_pos;     // smallest key position in the tile (kPosNone: tile past the head's end)
  int64_t* max_pos;     // largest key position (kPosNone when the tile is partial)
  int32_t* first_span;  // index into plan.spans of the span holding the tile's first key
  int tiles_per_head;
  int block_n;          // keys per tile
};

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Element offset of (row, 8-element chunk) in a swizzled [rows][D] bf16 tile.
template <int D>
__device__ __forceinline__ int Swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 2^x (MUFU.EX2, about 2 ulp; 2^-inf = 0), well inside the bf16 rounding of the weights.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Index of the span of `head`'s concatenation holding token j (last span starting at <= j),
// searched in [lo, hi].
__device__ __forceinline__ int SearchSpan(const int32_t* span_start, int lo, int hi, int j) {
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (span_start[mid] <= j) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Pre-pass: one thread per (KV head, key tile).
__global__ void __launch_bounds__(kMetaThreads)
    FlashTileMetaKernel(AttentionPlan plan, int num_kv_heads, TileMeta meta) {
  const int64_t total = static_cast<int64_t>(num_kv_heads) * meta.tiles_per_head;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int g = static_cast<int>(idx / meta.tiles_per_head);
    const int i = static_cast<int>(idx % meta.tiles_per_head);
    const int n = plan.head_tokens[g];
    const int bn = meta.block_n;
    const int64_t j0 = static_cast<int64_t>(i) * bn;
    if (j0 >= n) {
      meta.min_pos[idx] = kPosNone;
      meta.max_pos[idx] = kPosNone;
      meta.first_span[idx] = 0;
      continue;
    }
    const int j1 = j0 + bn < n ? static_cast<int>(j0) + bn : n;
    const int end = plan.span_offsets[g + 1];
    int s = SearchSpan(plan.span_start, plan.span_offsets[g], end - 1, static_cast<int>(j0));
    meta.first_span[idx] = s;
    int64_t mn = kPosNone, mx = INT64_MIN;
    for (; s < end && plan.span_start[s] < j1; ++s) {
      const DeviceSpan sp = plan.spans[s];
      const int st = plan.span_start[s];
      const int a = max(static_cast<int>(j0), st), b = min(j1, st + sp.length);
      if (a >= b) continue;
      mn = min(mn, static_cast<int64_t>(sp.position) + (a - st));
      mx = max(mx, static_cast<int64_t>(sp.position) + (b - 1 - st));
    }
    if (j1 - j0 < bn) mx = kPosNone;  // padding keys of a partial tile need the mask
    meta.min_pos[idx] = mn;
    meta.max_pos[idx] = mx;
  }
}

__device__ __forceinline__ int64_t WarpMin64(int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int64_t WarpMax64(int64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Eight fp8 e4m3 codes (a uint2, code i in byte i) as eight bf16 values (a uint4, element i in
// halfword i): e4m3 -> f16 is exact (cvt.rn.f16x2.e4m3x2), and every e4m3 value (3 mantissa bits,
// |x| <= 448, no smaller than 2^-9) is a bf16 value, so f16 -> f32 -> bf16 is exact too.
__device__ __forceinline__ uint32_t E4m3x2ToBf16x2(uint32_t pair16) {
  const uint32_t h = E4m3PairToF16x2(pair16);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return PackBf16(f.x, f.y);
}
__device__ __forceinline__ uint4 E4m3x8ToBf16x8(uint2 c) {
  return make_uint4(E4m3x2ToBf16x2(c.x & 0xffffu), E4m3x2ToBf16x2(c.x >> 16),
                    E4m3x2ToBf16x2(c.y & 0xffffu), E4m3x2ToBf16x2(c.y >> 16));
}

// kF8: the pools hold fp8 e4m3 codes (one byte per element; shape.scale carries k_scale and
// the outputs are multiplied by shape.v_scale), converted to bf16 as they land in the same
// shared-memory tiles as bf16 rows (register-staged loads instead of cp.async); else bf16.
template <int D, int BN, bool kF8>
__global__ void __launch_bounds__(kThreads, 2)
    FlashPrefillKernel(const float* __restrict__ q, const void* __restrict__ k_pool_raw,
                       const void* __restrict__ v_pool_raw, AttentionShape shape,
                       AttentionPlan plan, TileMeta meta, float* __restrict__ out,
                       float* __restrict__ lse) {
  const auto* k_pool = static_cast<const __nv_bfloat16*>(k_pool_raw);
  const auto* v_pool = static_cast<const __nv_bfloat16*>(v_pool_raw);
  constexpr int kChunks = D / 8;   // 16-byte chunks per row
  constexpr int kDTiles = D / 8;   // n8 tiles of the output
  constexpr int kSTiles = BN / 8;
  constexpr int kRows = 2 * kMBlocks;  // rows per thread: lane/4 and lane/4 + 8 of each m-block
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kBlockM][D]
  __nv_bfloat16* k_s = q_s + kBlockM * D;                            // [2][BN][D]
  __nv_bfloat16* v_s = k_s + 2 * BN * D;                        // [2][BN][D]
  __shared__ int64_t row_s[2][BN];   // pool row of each key of the tile (-1: padding)
  __shared__ int64_t kpos_s[2][BN];  // its position (kPosNone: padding)
  __shared__ int64_t red_s[3][kWarps];
  __shared__ int64_t qpos_s[kBlockM];     // position of each query row (INT64_MIN: padding)

  const int head = blockIdx.x;
  const int q_tile = gridDim.y - 1 - blockIdx.y;  // the longest causal rows start first
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int g = head / group;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int t0 = q_tile * kBlockM;
  const int n_keys = plan.head_tokens[g];
  const int n_tiles = (n_keys + BN - 1) / BN;
  const int span_end = plan.span_offsets[g + 1];
  const int64_t meta_base = static_cast<int64_t>(g) * meta.tiles_per_head;
  const int warp_row0 = warp * 16 * kMBlocks;  // this warp's first row in the block

  // Q tile: f32 -> bf16 (round to nearest), rows past num_tokens zero.
  for (int i = tid; i < kBlockM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int t = t0 + r;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (t < shape.num_tokens) {
      const float4* src = reinterpret_cast<const float4*>(
          q + (static_cast<int64_t>(t) * shape.num_q_heads + head) * D + c * 8);
      const float4 a = __ldg(src), b = __ldg(src + 1);
      packed = make_uint4(PackBf16(a.x, a.y), PackBf16(a.z, a.w), PackBf16(b.x, b.y),
                          PackBf16(b.z, b.w));
    }
    *reinterpret_cast<uint4*>(q_s + Swz<D>(r, c)) = packed;
  }

  // Query positions: this thread's rows, and the block's min / max over real tokens.
  auto qpos_of = [&](int t) -> int64_t {
    if (t >= shape.num_tokens) return INT64_MIN;  // padding row: attends nothing
    return shape.causal ? static_cast<int64_t>(plan.q_positions[t]) : kPosAll;
  };
  auto row_of = [&](int i) { return warp_row0 + (i >> 1) * 16 + (i & 1) * 8 + (lane >> 2); };
  for (int i = tid; i < kBlockM; i += kThreads) qpos_s[i] = qpos_of(t0 + i);
  int64_t q_min = kPosNone, q_max = INT64_MIN;
  // Last key tile that some query of the block attends (tiles beyond it are all masked).
  int last = -1;
  if (shape.causal) {
    for (int i = tid; i < kBlockM; i += kThreads) {
      if (t0 + i < shape.num_tokens) {
        const int64_t p = qpos_of(t0 + i);
        q_min = min(q_min, p);
        q_max = max(q_max, p);
      }
    }
    q_min = WarpMin64(q_min);
    q_max = WarpMax64(q_max);
    if (lane == 0) {
      red_s[0][warp] = q_min;
      red_s[1][warp] = q_max;
    }
    __syncthreads();
    q_min = red_s[0][0];
    q_max = red_s[1][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      q_min = min(q_min, red_s[0][w]);
      q_max = max(q_max, red_s[1][w]);
    }
    int64_t my_last = -1;
    for (int i = tid; i < n_tiles; i += kThreads) {
      if (meta.min_pos[meta_base + i] <= q_max) my_last = i;
    }
    my_last = WarpMax64(my_last);
    if (lane == 0) red_s[2][warp] = my_last;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) last = max(last, static_cast<int>(red_s[2][w]));
  } else {
    q_min = q_max = kPosAll;
    last = n_tiles - 1;
  }
  // The first attended tile at or after i (-1: none).
  auto next_tile = [&](int i) -> int {
    for (; i <= last; ++i) {
      if (meta.min_pos[meta_base + i] <= q_max) return i;
    }
    return -1;
  };

  // Stages key tile i into buffer b: rows / positions (one thread per key), then cp.async of
  // K and V (padding keys zero-filled, so that 0-weight * V stays finite).
  auto load_tile = [&](int i, int b) {
    if (tid < BN) {
      const int j = i * BN + tid;
      int64_t row = -1, pos = kPosNone;
      if (j < n_keys) {
        const int fs = meta.first_span[meta_base + i];
        const int s = SearchSpan(plan.span_start, fs, min(fs + BN, span_end) - 1, j);
        const DeviceSpan sp = plan.spans[s];
        const int in_span = j - plan.span_start[s];
        row = static_cast<int64_t>(sp.slot) * shape.page_size + sp.offset + in_span;
        pos = static_cast<int64_t>(sp.position) + in_span;
      }
      row_s[b][tid] = row;
      kpos_s[b][tid] = pos;
    }
    __syncthreads();
    if constexpr (kF8) {
      // Every load of the tile first (8 bytes of codes per chunk), then the conversions, so the
      // loads are in flight together; padding keys read as code 0 (0.0).
      constexpr int kPer = BN * kChunks / kThreads;
      static_assert(BN * kChunks % kThreads == 0, "chunks split evenly over the threads");
      const auto* k8 = static_cast<const uint8_t*>(k_pool_raw);
      const auto* v8 = static_cast<const uint8_t*>(v_pool_raw);
      uint2 kc[kPer], vc[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int c = tid + u * kThreads;
        const int64_t row = row_s[b][c / kChunks];
        kc[u] = vc[u] = make_uint2(0, 0);
        if (row >= 0) {
          const int64_t off = row * D + (c % kChunks) * 8;
          kc[u] = __ldg(reinterpret_cast<const uint2*>(k8 + off));
          vc[u] = __ldg(reinterpret_cast<const uint2*>(v8 + off));
        }
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int c = tid + u * kThreads;
        const int dst = b * BN * D + Swz<D>(c / kChunks, c % kChunks);
        *reinterpret_cast<uint4*>(k_s + dst) = E4m3x8ToBf16x8(kc[u]);
        *reinterpret_cast<uint4*>(v_s + dst) = E4m3x8ToBf16x8(vc[u]);
      }
    } else {
      for (int c = tid; c < BN * kChunks; c += kThreads) {
        const int r = c / kChunks, ch = c % kChunks;
        const int64_t row = row_s[b][r];
        const int64_t off = row >= 0 ? row * D + ch * 8 : 0;
        const int dst = b * BN * D + Swz<D>(r, ch);
        CpAsync16(SmemAddr(k_s + dst), k_pool + off, row >= 0);
        CpAsync16(SmemAddr(v_s + dst), v_pool + off, row >= 0);
      }
    }
    CpAsyncCommit();  // (an empty group for fp8: the waits below count groups either way)
  };

  float o[kMBlocks][kDTiles][4];
#pragma unroll
  for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) o[mb][j][0] = o[mb][j][1] = o[mb][j][2] = o[mb][j][3] = 0.0f;
  }
  float m[kRows], l[kRows];  // running max (log2 domain) and this thread's part of the sum
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    m[i] = NegInf();
    l[i] = 0.0f;
  }
  const float scale2 = shape.scale * kLog2e;

  int cur = next_tile(0);
  int buf = 0;
  if (cur >= 0) load_tile(cur, 0);
  while (cur >= 0) {
    const int nxt = next_tile(cur + 1);
    if (nxt >= 0) {
      load_tile(nxt, buf ^ 1);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // tile `cur` (and, first time, q_s) visible to every warp

    const __nv_bfloat16* kb = k_s + buf * BN * D;
    const __nv_bfloat16* vb = v_s + buf * BN * D;
    // S = Q K^T for this warp's rows x 64 keys; each K fragment serves every m-block.
    float s[kMBlocks][kSTiles][4];
#pragma unroll
    for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) s[mb][j][0] = s[mb][j][1] = s[mb][j][2] = s[mb][j][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[kMBlocks][4];
#pragma unroll
      for (int mb = 0; mb < kMBlocks; ++mb) {
        Ldsm4(a[mb], SmemAddr(q_s + Swz<D>(warp_row0 + mb * 16 + (lane & 15), 2 * kk + (lane >> 4))));
      }
#pragma unroll
      for (int np = 0; np < kSTiles / 2; ++np) {
        uint32_t b[4];
        Ldsm4(b, SmemAddr(kb + Swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                      2 * kk + ((lane >> 3) & 1))));
#pragma unroll
        for (int mb = 0; mb < kMBlocks; ++mb) {
          MmaBf16(s[mb][2 * np], a[mb], b[0], b[1]);
          MmaBf16(s[mb][2 * np + 1], a[mb], b[2], b[3]);
        }
      }
    }
    // Scale into the log2 domain; mask where some key may lie after some query.
    const bool need_mask = meta.max_pos[meta_base + cur] > q_min;
#pragma unroll
    for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mb][j][e] *= scale2;
        if (need_mask) {
          const int col = j * 8 + 2 * (lane & 3);
          const int64_t p0 = kpos_s[buf][col], p1 = kpos_s[buf][col + 1];
          const int64_t qa = qpos_s[row_of(2 * mb)], qb = qpos_s[row_of(2 * mb + 1)];
          if (p0 > qa) s[mb][j][0] = NegInf();
          if (p1 > qa) s[mb][j][1] = NegInf();
          if (p0 > qb) s[mb][j][2] = NegInf();
          if (p1 > qb) s[mb][j][3] = NegInf();
        }
      }
    }
    // Online softmax per row (a quad of lanes shares a row).
#pragma unroll
    for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * mb + h;
        float tm = m[i];
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) tm = fmaxf(tm, fmaxf(s[mb][j][2 * h], s[mb][j][2 * h + 1]));
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
        tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
        const float base = tm == NegInf() ? 0.0f : tm;
        const float corr = Exp2(m[i] - base);  // 0 when m was -inf
        m[i] = tm;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          s[mb][j][2 * h] = Exp2(s[mb][j][2 * h] - base);
          s[mb][j][2 * h + 1] = Exp2(s[mb][j][2 * h + 1] - base);
          sum += s[mb][j][2 * h] + s[mb][j][2 * h + 1];
        }
        l[i] = l[i] * corr + sum;
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          o[mb][j][2 * h] *= corr;
          o[mb][j][2 * h + 1] *= corr;
        }
      }
    }
    // O += P V: P as bf16 A fragments (16 keys each), V through ldmatrix.trans; each V
    // fragment serves every m-block.
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[kMBlocks][4];
#pragma unroll
      for (int mb = 0; mb < kMBlocks; ++mb) {
        a[mb][0] = PackBf16(s[mb][2 * kc][0], s[mb][2 * kc][1]);
        a[mb][1] = PackBf16(s[mb][2 * kc][2], s[mb][2 * kc][3]);
        a[mb][2] = PackBf16(s[mb][2 * kc + 1][0], s[mb][2 * kc + 1][1]);
        a[mb][3] = PackBf16(s[mb][2 * kc + 1][2], s[mb][2 * kc + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t b[4];
        Ldsm4T(b, SmemAddr(vb + Swz<D>(kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                       2 * dp + (lane >> 4))));
#pragma unroll
        for (int mb = 0; mb < kMBlocks; ++mb) {
          MmaBf16(o[mb][2 * dp], a[mb], b[0], b[1]);
          MmaBf16(o[mb][2 * dp + 1], a[mb], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // buffer `buf` is refilled two tiles from now; row_s/kpos_s next tile
    cur = nxt;
    buf ^= 1;
  }

  // Normalise and write this thread's rows.
#pragma unroll
  for (int mb = 0; mb < kMBlocks; ++mb) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * mb + h;
      float sum = l[i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int t = t0 + row_of(i);
      if (t >= shape.num_tokens) continue;
      // shape.v_scale: an fp8 pool's V dequantisation (1 for bf16 pools, so exact there).
      const float inv = sum > 0.0f ? shape.v_scale / sum : 0.0f;
      const int64_t row = static_cast<int64_t>(t) * shape.num_q_heads + head;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        const int col = j * 8 + 2 * (lane & 3);
        *reinterpret_cast<float2*>(out + row * D + col) =
            make_float2(o[mb][j][2 * h] * inv, o[mb][j][2 * h + 1] * inv);
      }
      if ((lane & 3) == 0) lse[row] = sum > 0.0f ? (m[i] + log2f(sum)) * kLn2 : NegInf();
    }
  }
}

int64_t TilesPerHead(int64_t max_head_tokens, int block_n) {
  return (max_head_tokens + block_n - 1) / block_n;
}

template <int D, int BN, bool kF8>
cudaError_t LaunchTyped(const float* q, const void* k, const void* v, const AttentionShape& shape,
                        const AttentionPlan& plan, const TileMeta& meta, float* out, float* lse,
                        cudaStream_t stream) {
  constexpr int kSmem = (kBlockM + 4 * BN) * D * static_cast<int>(sizeof(__nv_bfloat16));
  cudaError_t e = cudaFuncSetAttribute(FlashPrefillKernel<D, BN, kF8>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (e != cudaSuccess) return e;
  const dim3 grid(shape.num_q_heads, (shape.num_tokens + kBlockM - 1) / kBlockM);
  FlashPrefillKernel<D, BN, kF8><<<grid, kThreads, kSmem, stream>>>(q, k, v, shape, plan, meta,
                                                                     out, lse);
  return cudaGetLastError();
}

template <bool kF8>
cudaError_t LaunchForPool(const float* q, const void* k, const void* v, int block_n,
                          const AttentionShape& shape, const AttentionPlan& plan,
                          const TileMeta& meta, float* out, float* lse, cudaStream_t stream) {
  if (shape.head_dim == 64) {
    return block_n == 32
               ? LaunchTyped<64, 32, kF8>(q, k, v, shape, plan, meta, out, lse, stream)
               : LaunchTyped<64, 64, kF8>(q, k, v, shape, plan, meta, out, lse, stream);
  }
  return block_n == 32 ? LaunchTyped<128, 32, kF8>(q, k, v, shape, plan, meta, out, lse, stream)
                       : LaunchTyped<128, 64, kF8>(q, k, v, shape, plan, meta, out, lse, stream);
}

// Keys per tile for head_dim D: the knob if set, else the default.
int BlockN(int head_dim) {
  if (g_block_n == 32 || g_block_n == 64) return g_block_n;
  return head_dim == 128 ? kFlashDefaultBlockN128 : 64;
}

}  // namespace

void SetFlashPrefillBlockN(int keys) { g_block_n = keys; }

bool FlashPrefillSupports(const AttentionShape& shape, FloatType pool_type) {
  return (pool_type == FloatType::kBF16 || pool_type == FloatType::kFP8E4M3) &&
         (shape.head_dim == 64 || shape.head_dim == 128) &&
         shape.num_tokens >= 1 && shape.num_tokens <= 65535 * kBlockM &&
         shape.num_q_heads >= 1 && shape.num_q_heads <= 65535 && shape.num_kv_heads >= 1 &&
         shape.num_q_heads % shape.num_kv_heads == 0;
}

int64_t FlashPrefillScratchBytes(const AttentionShape& shape, int64_t max_head_tokens) {
  // Sized for the smallest tile, so that any BlockN() fits.
  const int64_t n =
      static_cast<int64_t>(shape.num_kv_heads) * TilesPerHead(max_head_tokens, kFlashMinBlockN);
  return n * (2 * sizeof(int64_t) + sizeof(int32_t)) + 16;
}

cudaError_t LaunchFlashPrefill(const float* q, const void* k_pool, const void* v_pool,
                               FloatType pool_type, const AttentionShape& shape,
                               const AttentionPlan& plan, int64_t max_head_tokens, void* scratch,
                               float* out, float* lse, cudaStream_t stream) {
  if (!FlashPrefillSupports(shape, pool_type) || max_head_tokens < 0 ||
      max_head_tokens > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const int block_n = BlockN(shape.head_dim);
  const int64_t tiles = TilesPerHead(max_head_tokens, block_n);
  const int64_t n = static_cast<int64_t>(shape.num_kv_heads) * tiles;
  TileMeta meta;
  meta.min_pos = static_cast<int64_t*>(scratch);
  meta.max_pos = meta.min_pos + n;
  meta.first_span = reinterpret_cast<int32_t*>(meta.max_pos + n);
  meta.tiles_per_head = static_cast<int>(tiles);
  meta.block_n = block_n;
  if (n > 0) {
    FlashTileMetaKernel<<<GridFor(n, kMetaThreads), kMetaThreads, 0, stream>>>(
        plan, shape.num_kv_heads, meta);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return pool_type == FloatType::kFP8E4M3
             ? LaunchForPool<true>(q, k_pool, v_pool, block_n, shape, plan, meta, out, lse, stream)
             : LaunchForPool<false>(q, k_pool, v_pool, block_n, shape, plan, meta, out, lse,
                                    stream);
}

}  // namespace strata::kernels::cuda_internal
