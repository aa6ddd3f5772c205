// CPU reference paged attention and partial-result merge (math in kernels/backend.h).
//
// Paged attention: each (token, query head) row scores its keys span by span and folds them into a
// numerically stable online softmax (running max, rescaled sum and accumulator, all f32). OpenMP
// work items are a KV head and a block of up to kTokenBlock query tokens with every query head of
// the group: each span's K rows are converted to f32 once per item into a transposed tile (so a
// row's scores are vector updates across the span's keys, dim by dim) and its V rows once, and
// all of the item's rows read them from cache (a row alone streamed every key of its head from
// memory). A row's arithmetic does not depend on the blocking. Spans are validated before
// anything is written.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/internal/checks.h"
#include "kernels/cpu/internal/exp.h"

namespace strata::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTokenBlock = 16;  // query tokens per work item (fewer when there are few tokens)

// Baseline x86-64 and AVX2 builds of RowSpan, chosen at load time (GCC target_clones): the same
// operations in the same order (AVX2 without FMA, so no contraction), hence the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define STRATA_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define STRATA_CPU_CLONES
#endif

// Eight floats as one GCC vector (AVX: one register; baseline x86-64: two), elementwise
// arithmetic only, so the values are those of the scalar loops.
// (Loaded through memcpy at the call sites: a function returning F8 by value would change the
// ABI between the two builds, which GCC warns about.)
typedef float F8 __attribute__((vector_size(32)));

// One row's update by one span of n keys: the scores q . k * scale from the span's keys
// transposed (kt[e * ld + j]: dim e of key j), then the online softmax's running max *m, sum *l
// and accumulator a[head_dim] over the V rows vrow[j]. sc holds n scores of scratch.
STRATA_CPU_CLONES
void RowSpan(const float* qr, const float* kt, int64_t ld, const float* const* vrow, int n, int head_dim,
             float scale, float* sc, float* m, float* l, float* a) {
  // Eight keys at a time with their sums in registers across the dims (each score still sums
  // its dims in order), then the rest one by one.
  int j0 = 0;
  for (; j0 + 8 <= n; j0 += 8) {
    F8 s8 = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int e = 0; e < head_dim; ++e) {
      F8 k8;
      std::memcpy(&k8, kt + e * ld + j0, sizeof(k8));
      s8 += qr[e] * k8;
    }
    std::memcpy(sc + j0, &s8, sizeof(s8));
  }
  for (; j0 < n; ++j0) {
    float s1 = 0.0f;
    for (int e = 0; e < head_dim; ++e) s1 += qr[e] * kt[e * ld + j0];
    sc[j0] = s1;
  }
  // The max in eight lanes (vectorises; max does not depend on the order).
  float lane_max[8] = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int u = 0; u < 8; ++u) {
      sc[j + u] *= scale;
      lane_max[u] = sc[j + u] > lane_max[u] ? sc[j + u] : lane_max[u];
    }
  }
  for (; j < n; ++j) {
    sc[j] *= scale;
    lane_max[0] = sc[j] > lane_max[0] ? sc[j] : lane_max[0];
  }
  float span_max = kNegInf;
  for (const float x : lane_max) span_max = x > span_max ? x : span_max;
  const float new_m = span_max > *m ? span_max : *m;
  if (new_m == kNegInf) return;  // all scores -inf (only with infinite inputs)
  const float correction = std::exp(*m - new_m);  // exp(-inf) = 0 on the first span
  *l *= correction;
  for (int e = 0; e < head_dim; ++e) a[e] *= correction;
  for (int k = 0; k < n; ++k) sc[k] = cpu_internal::ExpNonPositive(sc[k] - new_m);  // the weights, in place
  for (int k = 0; k < n; ++k) *l += sc[k];
  // Eight dims at a time with their sums in registers across the keys (each dim still adds its
  // keys in order), then the rest one by one.
  int e0 = 0;
  for (; e0 + 8 <= head_dim; e0 += 8) {
    F8 a8;
    std::memcpy(&a8, a + e0, sizeof(a8));
    for (int k = 0; k < n; ++k) {
      F8 v8;
      std::memcpy(&v8, vrow[k] + e0, sizeof(v8));
      a8 += sc[k] * v8;
    }
    std::memcpy(a + e0, &a8, sizeof(a8));
  }
  for (; e0 < head_dim; ++e0) {
    float a1 = a[e0];
    for (int k = 0; k < n; ++k) a1 += sc[k] * vrow[k][e0];
    a[e0] = a1;
  }
  *m = new_m;
}

absl::Status ValidatePagedAttention(const PagedAttentionParams& p) {
  if (p.q.data == nullptr || p.k_pool.data == nullptr || p.v_pool.data == nullptr ||
      p.out.data == nullptr || p.lse.data == nullptr) {
    return absl::InvalidArgumentError("paged attention: null tensor");
  }
  if (p.q.rank != 3 || p.q.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: q must be f32 [tokens, heads, dim], got ", p.q.DebugString()));
  }
  const int64_t num_tokens = p.q.dim(0), num_q_heads = p.q.dim(1), head_dim = p.q.dim(2);
  if (p.k_pool.rank != 3 || (p.k_pool.dtype != DType::kF32 && p.k_pool.dtype != DType::kBF16 &&
                             p.k_pool.dtype != DType::kFP8E4M3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: k_pool must be f32|bf16|fp8_e4m3 [slots, page, dim], got ",
                     p.k_pool.DebugString()));
  }
  STRATA_RETURN_IF_ERROR(CheckKvScales(p.k_pool.dtype, p.k_scale, p.v_scale, "paged attention"));
  if (p.v_pool.rank != 3 || p.v_pool.dtype != p.k_pool.dtype ||
      p.v_pool.dim(0) != p.k_pool.dim(0) || p.v_pool.dim(1) != p.k_pool.dim(1) ||
      p.v_pool.dim(2) != p.k_pool.dim(2)) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention: v_pool ", p.v_pool.DebugString(),
                                                   " does not match k_pool ", p.k_pool.DebugString()));
  }
  if (p.k_pool.dim(2) != head_dim) {
    return absl::InvalidArgumentError("paged attention: pool head_dim differs from q head_dim");
  }
  if (p.out.rank != 3 || p.out.dtype != DType::kF32 || p.out.dim(0) != num_tokens ||
      p.out.dim(1) != num_q_heads || p.out.dim(2) != head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: out must be f32 like q, got ", p.out.DebugString()));
  }
  if (p.lse.rank != 2 || p.lse.dtype != DType::kF32 || p.lse.dim(0) != num_tokens ||
      p.lse.dim(1) != num_q_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: lse must be f32 [tokens, heads], got ", p.lse.DebugString()));
  }
  if (p.num_kv_heads <= 0 || num_q_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention: num_q_heads ", num_q_heads,
                                                   " not a multiple of num_kv_heads ",
                                                   p.num_kv_heads));
  }
  if (p.span_offsets == nullptr) {
    return absl::InvalidArgumentError("paged attention: null span_offsets");
  }
  if (p.causal && num_tokens > 0 && p.q_positions == nullptr) {
    return absl::InvalidArgumentError("paged attention: causal needs q_positions");
  }
  if (p.span_offsets[0] < 0) return absl::InvalidArgumentError("paged attention: negative offset");
  for (int g = 0; g < p.num_kv_heads; ++g) {
    if (p.span_offsets[g + 1] < p.span_offsets[g]) {
      return absl::InvalidArgumentError("paged attention: span_offsets not non-decreasing");
    }
  }
  const int32_t total = p.span_offsets[p.num_kv_heads];
  if (total > p.span_offsets[0] && p.spans == nullptr) {
    return absl::InvalidArgumentError("paged attention: null spans");
  }
  const int64_t num_slots = p.k_pool.dim(0), page_size = p.k_pool.dim(1);
  for (int32_t i = p.span_offsets[0]; i < total; ++i) {
    const KvSpan& s = p.spans[i];
    if (s.slot < 0 || s.slot >= num_slots || s.offset < 0 || s.length < 0 ||
        static_cast<int64_t>(s.offset) + s.length > page_size) {
      return absl::InvalidArgumentError(absl::StrCat("paged attention: span ", i, " (slot ", s.slot,
                                                     ", offset ", s.offset, ", length ", s.length,
                                                     ") outside pool of ", num_slots, " slots x ",
                                                     page_size, " tokens"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKvScales(DType pool_dtype, float k_scale, float v_scale, const char* op) {
  const bool fp8 = pool_dtype == DType::kFP8E4M3;
  for (const float sc : {k_scale, v_scale}) {
    if (fp8 ? !(std::isfinite(sc) && sc > 0.0f) : sc != 1.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": k_scale / v_scale must be finite and > 0 for fp8 pools and 1 for ",
                       DTypeName(pool_dtype), " pools, got ", k_scale, " / ", v_scale));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuPagedAttention(const PagedAttentionParams& p) {
  absl::Status st = ValidatePagedAttention(p);
  if (!st.ok()) return st;
  const int num_tokens = static_cast<int>(p.q.dim(0));
  const int num_q_heads = static_cast<int>(p.q.dim(1));
  const int head_dim = static_cast<int>(p.q.dim(2));
  const int group = num_q_heads / p.num_kv_heads;
  const int64_t page_size = p.k_pool.dim(1);
  const float* q = p.q.As<const float>();
  float* out = p.out.As<float>();
  float* lse = p.lse.As<float>();
  // Work items: a KV head and a block of query tokens (every query head of the group). Each span
  // of the head is converted to f32 once per item and then serves all of the item's rows, which
  // keeps it in cache; each row's arithmetic is the same as a row alone would do.
  const int block = num_tokens >= 4 * kTokenBlock ? kTokenBlock : std::max(1, (num_tokens + 3) / 4);
  const int blocks = (num_tokens + block - 1) / block;
  const int64_t items = static_cast<int64_t>(p.num_kv_heads) * blocks;
  const bool direct = p.k_pool.dtype == DType::kF32;  // rows read in place, no conversion

#pragma omp parallel
  {
    const int rows = block * group;
    std::vector<float> acc(static_cast<size_t>(rows) * head_dim), m(rows), l(rows), scores(page_size);
    // The span's keys transposed, [head_dim][page_size] (f32, fp8 dequantised), so that a row's
    // scores are a loop over dims of vector updates across the keys; V rows by pointer.
    std::vector<float> kt(static_cast<size_t>(page_size) * head_dim), krow_buf(head_dim);
    std::vector<float> vbuf(direct ? 0 : page_size * head_dim);
    std::vector<const float*> vrow(page_size);
    std::vector<int64_t> qpos(rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int g = static_cast<int>(item / blocks);
      const int t0 = static_cast<int>(item % blocks) * block;
      const int t1 = std::min(num_tokens, t0 + block);
      const int n_rows = (t1 - t0) * group;
      // Row i: token t0 + i / group, query head g * group + i % group.
      int64_t qpos_max = INT64_MIN;
      for (int i = 0; i < n_rows; ++i) {
        qpos[i] = p.causal ? p.q_positions[t0 + i / group] : 0;
        qpos_max = std::max(qpos_max, qpos[i]);
        m[i] = kNegInf;
        l[i] = 0.0f;
        std::fill(acc.begin() + static_cast<int64_t>(i) * head_dim,
                  acc.begin() + static_cast<int64_t>(i + 1) * head_dim, 0.0f);
      }
      for (int32_t si = p.span_offsets[g]; si < p.span_offsets[g + 1]; ++si) {
        const KvSpan& s = p.spans[si];
        // Keys any row of the item attends (causal: positions <= the largest query position).
        int n_any = s.length;
        if (p.causal) {
          const int64_t allowed = qpos_max - s.position + 1;
          if (allowed <= 0) continue;
          if (allowed < n_any) n_any = static_cast<int>(allowed);
        }
        if (n_any <= 0) continue;
        const int64_t base = static_cast<int64_t>(s.slot) * page_size + s.offset;
        for (int j = 0; j < n_any; ++j) {
          const float* kr = cpu_internal::LoadPoolRow(p.k_pool, base + j, head_dim, krow_buf.data(), p.k_scale);
          for (int e = 0; e < head_dim; ++e) kt[static_cast<size_t>(e) * page_size + j] = kr[e];
          vrow[j] = cpu_internal::LoadPoolRow(p.v_pool, base + j, head_dim,
                                              direct ? nullptr : vbuf.data() + j * head_dim, p.v_scale);
        }
        for (int i = 0; i < n_rows; ++i) {
          int n = n_any;
          if (p.causal) {
            const int64_t allowed = qpos[i] - s.position + 1;  // keys with position <= qpos
            if (allowed <= 0) continue;
            if (allowed < n) n = static_cast<int>(allowed);
          }
          const int64_t r = static_cast<int64_t>(t0 + i / group) * num_q_heads + g * group + i % group;
          RowSpan(q + r * head_dim, kt.data(), page_size, vrow.data(), n, head_dim, p.scale, scores.data(),
                  &m[i], &l[i], acc.data() + static_cast<int64_t>(i) * head_dim);
        }
      }
      for (int i = 0; i < n_rows; ++i) {
        const int64_t r = static_cast<int64_t>(t0 + i / group) * num_q_heads + g * group + i % group;
        const float* a = acc.data() + static_cast<int64_t>(i) * head_dim;
        float* o = out + r * head_dim;
        if (l[i] > 0.0f) {
          const float inv = 1.0f / l[i];
          for (int e = 0; e < head_dim; ++e) o[e] = a[e] * inv;
          lse[r] = m[i] + std::log(l[i]);
        } else {
          for (int e = 0; e < head_dim; ++e) o[e] = 0.0f;
          lse[r] = kNegInf;
        }
      }
    }
  }
  return absl::OkStatus();
}

static absl::Status ValidateMergeAttention(const MergeAttentionParams& p) {
  if (p.num_parts < 1 || p.outs == nullptr || p.lses == nullptr) {
    return absl::InvalidArgumentError("merge attention: need num_parts >= 1 and non-null parts");
  }
  if (p.out.data == nullptr || p.lse.data == nullptr || p.out.rank != 3 ||
      p.out.dtype != DType::kF32 || p.lse.rank != 2 || p.lse.dtype != DType::kF32 ||
      p.lse.dim(0) != p.out.dim(0) || p.lse.dim(1) != p.out.dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat("merge attention: bad outputs ",
                                                   p.out.DebugString(), " ", p.lse.DebugString()));
  }
  for (int s = 0; s < p.num_parts; ++s) {
    const TensorView& o = p.outs[s];
    const TensorView& l = p.lses[s];
    if (o.data == nullptr || l.data == nullptr || o.rank != 3 || o.dtype != DType::kF32 ||
        l.rank != 2 || l.dtype != DType::kF32 || o.dim(0) != p.out.dim(0) ||
        o.dim(1) != p.out.dim(1) || o.dim(2) != p.out.dim(2) || l.dim(0) != p.lse.dim(0) ||
        l.dim(1) != p.lse.dim(1)) {
      return absl::InvalidArgumentError(absl::StrCat("merge attention: part ", s, " ",
                                                     o.DebugString(), " ", l.DebugString(),
                                                     " does not match output ", p.out.DebugString()));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuMergeAttention(const MergeAttentionParams& p) {
  absl::Status st = ValidateMergeAttention(p);
  if (!st.ok()) return st;
  const int64_t rows = p.out.dim(0) * p.out.dim(1);
  const int head_dim = static_cast<int>(p.out.dim(2));
  float* out = p.out.As<float>();
  float* lse = p.lse.As<float>();
#pragma omp parallel
  {
    std::vector<float> acc(head_dim), w(p.num_parts);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float m = kNegInf;
      for (int s = 0; s < p.num_parts; ++s) {
        const float ls = p.lses[s].As<const float>()[r];
        if (ls > m) m = ls;
      }
      float* o = out + r * head_dim;
      if (m == kNegInf) {
        for (int i = 0; i < head_dim; ++i) o[i] = 0.0f;
        lse[r] = kNegInf;
        continue;
      }
      float sum = 0.0f;
      for (int s = 0; s < p.num_parts; ++s) {
        w[s] = std::exp(p.lses[s].As<const float>()[r] - m);
        sum += w[s];
      }
      for (int i = 0; i < head_dim; ++i) acc[i] = 0.0f;
      for (int s = 0; s < p.num_parts; ++s) {
        if (w[s] == 0.0f) continue;
        const float* os = p.outs[s].As<const float>() + r * head_dim;
        const float ws = w[s] / sum;
        for (int i = 0; i < head_dim; ++i) acc[i] += ws * os[i];
      }
      for (int i = 0; i < head_dim; ++i) o[i] = acc[i];
      lse[r] = m + std::log(sum);
    }
  }
  return absl::OkStatus();
}

}  // namespace strata::kernels
