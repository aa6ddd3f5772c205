// ResolvePages on the CPU: the specification of the GPU page cache's device-managed step
// (kernels/backend.h, "The GPU page cache on the device"), and the validation the CUDA backend
// shares.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"

namespace strata::kernels {

absl::Status CpuSupportsResolvePages(const ResolvePagesParams& p) {
  constexpr const char* kOp = "ResolvePages";
  const PageCacheState& st = p.state;
  if (st.table == nullptr || st.slot_page == nullptr || st.slot_stamp == nullptr ||
      st.slot_ref == nullptr || st.counters == nullptr || st.scratch == nullptr ||
      st.sources == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": null state array"));
  }
  if (st.table_size <= 0 || st.table_size > (int64_t{1} << 31) - 1 || st.num_slots <= 0 ||
      st.num_slots > (int64_t{1} << 31) - 1 || st.scratch_pages < 0 ||
      st.scratch_pages > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": table_size ", st.table_size,
                                                   ", num_slots ", st.num_slots, ", scratch_pages ",
                                                   st.scratch_pages, " out of range"));
  }
  const TensorView& k = st.k_pool;
  const TensorView& v = st.v_pool;
  if (k.dtype != DType::kF32 && k.dtype != DType::kBF16 && k.dtype != DType::kFP8E4M3) {
    return absl::UnimplementedError(
        absl::StrCat(kOp, ": pool dtype ", DTypeName(k.dtype), " unsupported (f32|bf16|fp8_e4m3)"));
  }
  if (k.data == nullptr || v.data == nullptr || k.rank != 3 || v.rank != 3 || v.dtype != k.dtype ||
      k.dim(0) != st.num_slots || v.dim(0) != st.num_slots || k.dim(1) != v.dim(1) ||
      k.dim(2) != v.dim(2) || k.dim(1) != p.page_size || k.dim(2) <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": pools ", k.DebugString(), " / ",
                                                   v.DebugString(), " must be [", st.num_slots,
                                                   ", ", p.page_size, ", head_dim], same dtype"));
  }
  if (p.num_kv_heads <= 0 || p.pages_per_head <= 0 || p.page_size <= 0 || p.table_base < 0 ||
      p.table_base + p.num_kv_heads * p.pages_per_head > st.table_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": ", p.num_kv_heads, " heads x ", p.pages_per_head, " pages from table entry ",
        p.table_base, " do not fit a table of ", st.table_size));
  }
  if ((st.page_scales == nullptr) != (st.slot_scales == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": page_scales and slot_scales go together"));
  }
  STRATA_RETURN_IF_ERROR(CheckCandidateList(p.middle, p.num_kv_heads, kOp));
  if (p.prefix_end < 0 || p.suffix_begin < 0 || p.suffix_end < p.suffix_begin ||
      p.prefix_end > (int64_t{1} << 31) - 1 || p.suffix_end > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": bad prefix or suffix range"));
  }
  return absl::OkStatus();
}

absl::Status CpuResolvePages(const ResolvePagesParams& p) {
  STRATA_RETURN_IF_ERROR(CpuSupportsResolvePages(p));
  const PageCacheState& st = p.state;
  int64_t* counters = st.counters;
  const uint32_t epoch = static_cast<uint32_t>(++counters[kPageCacheEpoch]);
  const int64_t P = p.page_size, pph = p.pages_per_head, n = st.num_slots;

  // 1. Lookups, hits and the distinct misses, in naming order (head by head: prefix pages, the
  // middle's candidates, suffix pages).
  std::vector<int64_t> misses;
  std::vector<int64_t> missed;  // flat indices marked -2 while this call runs
  auto name = [&](int g, int64_t page) {
    if (page < 0 || page >= pph) return;
    const int64_t flat = p.table_base + g * pph + page;
    const int32_t slot = st.table[flat];
    if (slot >= 0) {
      if (st.slot_stamp[slot] != epoch) {
        st.slot_stamp[slot] = epoch;
        ++counters[kPageCacheLookups];
        ++counters[kPageCacheHits];
      }
      st.slot_ref[slot] = 1;
    } else if (slot == -1) {
      st.table[flat] = -2;  // seen in this call
      ++counters[kPageCacheLookups];
      missed.push_back(flat);
      if (static_cast<int64_t>(misses.size()) < st.scratch_pages) {
        misses.push_back(flat);
      } else {
        ++counters[kPageCacheUnresolved];
      }
    }
  };
  for (int g = 0; g < p.num_kv_heads; ++g) {
    for (int64_t t = 0; t < p.prefix_end; t += P) name(g, t / P);
    const int64_t count = p.middle.Count();
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = CandidateId(p.middle, g, i);
      if (id >= 0) name(g, id / P);
    }
    if (p.suffix_end > p.suffix_begin) {
      for (int64_t page = p.suffix_begin / P; page <= (p.suffix_end - 1) / P; ++page) {
        name(g, page);
      }
    }
  }
  for (int64_t flat : missed) st.table[flat] = -1;

  // 2. A victim for each miss from the clock, then the fills.
  const size_t half = static_cast<size_t>(P * st.k_pool.dim(2)) * DTypeSize(st.k_pool.dtype);
  char* k_pool = static_cast<char*>(st.k_pool.data);
  char* v_pool = static_cast<char*>(st.v_pool.data);
  int64_t hand = counters[kPageCacheHand];
  if (hand < 0 || hand >= n) hand = 0;
  int32_t* count_out = st.scratch;
  int32_t* pages_out = st.scratch + 1;
  int32_t* victims_out = st.scratch + 1 + st.scratch_pages;
  int64_t taken = 0;
  for (int64_t flat : misses) {
    int64_t victim = -1;
    for (int64_t passed = 0; passed < 2 * n; ++passed) {
      const int64_t s = hand;
      hand = hand + 1 == n ? 0 : hand + 1;
      if (st.slot_stamp[s] == epoch) continue;
      if (st.slot_ref[s] != 0) {
        st.slot_ref[s] = 0;
        continue;
      }
      victim = s;
      break;
    }
    if (victim < 0) {
      // Every slot is pinned: the hand went round twice; the rest stay unresolved.
      counters[kPageCacheUnresolved] += static_cast<int64_t>(misses.size()) - taken;
      break;
    }
    const int32_t old = st.slot_page[victim];
    if (old >= 0) {
      st.table[old] = -1;
      ++counters[kPageCacheEvictions];
    }
    st.slot_page[victim] = static_cast<int32_t>(flat);
    st.table[flat] = static_cast<int32_t>(victim);
    st.slot_stamp[victim] = epoch;
    st.slot_ref[victim] = 1;
    const char* src = static_cast<const char*>(st.sources[flat]);
    std::memcpy(k_pool + victim * half, src, half);
    std::memcpy(v_pool + victim * half, src + half, half);
    if (st.page_scales != nullptr) {
      st.slot_scales[2 * victim] = st.page_scales[2 * flat];
      st.slot_scales[2 * victim + 1] = st.page_scales[2 * flat + 1];
    }
    pages_out[taken] = static_cast<int32_t>(flat);
    victims_out[taken] = static_cast<int32_t>(victim);
    ++taken;
  }
  *count_out = static_cast<int32_t>(taken);
  counters[kPageCacheFills] += taken;
  counters[kPageCacheHand] = hand;
  return absl::OkStatus();
}

}  // namespace strata::kernels
