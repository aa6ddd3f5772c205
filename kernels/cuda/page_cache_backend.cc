// CudaBackend::ResolvePages (declared in kernels/cuda/cuda_backend.h): the CPU twin's validation
// (kernels/cpu/page_cache.cc), then the two launches of kernels/cuda/page_cache.cu. Nothing is read
// on the host, so the op can be captured in a CUDA graph.
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/cuda_status.h"
#include "kernels/cuda/internal/page_cache.h"

namespace strata::kernels {

absl::Status CudaBackend::ResolvePages(const ResolvePagesParams& p, Stream s) {
  STRATA_RETURN_IF_ERROR(CpuSupportsResolvePages(p));
  STRATA_RETURN_IF_ERROR(MakeCurrent());
  const PageCacheState& st = p.state;
  cuda_internal::ResolveArgs a;
  a.table = st.table;
  a.slot_page = st.slot_page;
  a.slot_stamp = st.slot_stamp;
  a.slot_ref = st.slot_ref;
  a.num_slots = st.num_slots;
  a.counters = reinterpret_cast<long long*>(st.counters);
  a.scratch = st.scratch;
  a.scratch_pages = st.scratch_pages;
  a.sources = st.sources;
  a.page_scales = st.page_scales;
  a.slot_scales = st.slot_scales;
  a.k_pool = st.k_pool.data;
  a.v_pool = st.v_pool.data;
  a.half_bytes =
      st.k_pool.dim(1) * st.k_pool.dim(2) * static_cast<int64_t>(DTypeSize(st.k_pool.dtype));
  if (a.half_bytes % 16 == 0 &&
      ((reinterpret_cast<uintptr_t>(a.k_pool) | reinterpret_cast<uintptr_t>(a.v_pool)) & 15) != 0) {
    return absl::InvalidArgumentError("ResolvePages: pools not 16-byte aligned");
  }
  // Items named per call (pages of the prefix and suffix, middle candidates): the kernel marks a
  // missing page with -2 - item in its table entry.
  const int64_t P = p.page_size;
  const int64_t items =
      p.num_kv_heads *
      ((p.prefix_end + P - 1) / P + p.middle.Count() +
       (p.suffix_end > p.suffix_begin ? (p.suffix_end - 1) / P - p.suffix_begin / P + 1 : 0));
  if (items > (int64_t{1} << 31) - 3) {
    return absl::UnimplementedError(absl::StrCat("ResolvePages: ", items, " items per call"));
  }
  a.table_base = p.table_base;
  a.num_kv_heads = p.num_kv_heads;
  a.pages_per_head = p.pages_per_head;
  a.page_size = p.page_size;
  a.prefix_end = p.prefix_end;
  const CandidateList& c = p.middle;
  a.middle.parents = c.parents.data != nullptr ? c.parents.As<const int32_t>() : nullptr;
  a.middle.num_parents = c.parents.data != nullptr ? static_cast<int32_t>(c.parents.dim(1)) : 0;
  a.middle.fanout = c.fanout;
  a.middle.begin = static_cast<int32_t>(c.begin);
  a.middle.end = static_cast<int32_t>(c.end);
  a.middle.count = static_cast<int32_t>(c.Count());
  a.suffix_begin = p.suffix_begin;
  a.suffix_end = p.suffix_end;
  STRATA_CUDA_RETURN_IF_ERROR(cuda_internal::LaunchResolvePages(a, ToCuda(s)));
  return absl::OkStatus();
}

}  // namespace strata::kernels
