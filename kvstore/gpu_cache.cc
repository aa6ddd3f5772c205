#include "kvstore/gpu_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/status_macros.h"
#include "kvstore/page_format.h"

namespace strata::kvstore {

namespace {
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// An fp8 page as the bf16 page of its dequantised K and V (fp8 * scale, rounded to bf16).
absl::StatusOr<PageRef> Fp8PageAsBf16(absl::string_view page) {
  STRATA_ASSIGN_OR_RETURN(PageHeader h, ParsePageHeader(page));
  PageShape shape = h.shape;
  shape.dtype = kernels::DType::kBF16;
  const int64_t elems = static_cast<int64_t>(shape.page_size) * shape.head_dim;
  std::vector<uint16_t> k(static_cast<size_t>(elems)), v(k.size());
  STRATA_RETURN_IF_ERROR(PageToBf16(page, k.data(), v.data()));
  STRATA_ASSIGN_OR_RETURN(
      std::string encoded,
      EncodePage(shape, kernels::TensorView(k.data(), kernels::DType::kBF16, {shape.page_size, shape.head_dim}),
                 kernels::TensorView(v.data(), kernels::DType::kBF16, {shape.page_size, shape.head_dim})));
  return PageBuffer::Copy(encoded);
}
}  // namespace

absl::Status GpuCacheOptions::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0 || pages_per_head <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu cache: num_layers, num_kv_heads and pages_per_head must be > 0, got ", num_layers,
        ", ", num_kv_heads, ", ", pages_per_head));
  }
  if (static_cast<int64_t>(num_layers) * num_kv_heads * pages_per_head > kInt32Max) {
    return absl::InvalidArgumentError("gpu cache: more than 2^31 page-table entries");
  }
  if (page_size <= 0 || head_dim <= 0 || page_size > 65535 || head_dim > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("gpu cache: page_size ", page_size,
                                                   " and head_dim ", head_dim,
                                                   " must be in [1, 65535]"));
  }
  if (num_slots <= 0 || num_slots > kInt32Max) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu cache: num_slots must be in [1, 2^31), got ", num_slots));
  }
  if (max_batch_pages <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu cache: max_batch_pages must be > 0, got ", max_batch_pages));
  }
  if (source == nullptr) return absl::InvalidArgumentError("gpu cache: source is null");
  if (device_managed && (!hold_source_pages || in_place_allocator == nullptr)) {
    return absl::InvalidArgumentError(
        "gpu cache: device_managed needs hold_source_pages and an in_place_allocator");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GpuPageCache>> GpuPageCache::Create(const GpuCacheOptions& options,
                                                                   kernels::Backend* backend) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (backend == nullptr) return absl::InvalidArgumentError("gpu cache: backend is null");
  std::unique_ptr<GpuPageCache> cache(new GpuPageCache(options, backend));
  STRATA_RETURN_IF_ERROR(cache->Init());
  return cache;
}

GpuPageCache::GpuPageCache(const GpuCacheOptions& options, kernels::Backend* backend)
    : options_(options), backend_(backend) {
  pool_dtype_known_ = !options_.device_managed;  // host-managed pools are bf16
  half_bytes_ = static_cast<size_t>(options_.page_size) * options_.head_dim *
                kernels::DTypeSize(kernels::DType::kBF16);
  page_bytes_ = 2 * half_bytes_;
  table_size_ = static_cast<int64_t>(options_.num_layers) * options_.num_kv_heads *
                options_.pages_per_head;
  KvMetrics* metrics = options_.metrics;
  if (metrics == nullptr) {
    own_registry_ = std::make_unique<prometheus::Registry>();
    own_metrics_ = std::make_unique<KvMetrics>(own_registry_.get());
    metrics = own_metrics_.get();
  }
  m_ = metrics->ForTier("gpu");
  fetch_bytes_ = metrics->FetchBytes("host", "gpu");
}

absl::Status GpuPageCache::Init() {
  if (options_.hold_source_pages) {
    // Every page, looked up and checked once, in batches (FetchFromSource reads held_ only when
    // it is complete).
    std::vector<PageRef> held(static_cast<size_t>(table_size_));
    constexpr int64_t kBatch = 65536;
    std::vector<int64_t> ids;
    for (int64_t first = 0; first < table_size_; first += kBatch) {
      const int64_t end = std::min(table_size_, first + kBatch);
      ids.resize(static_cast<size_t>(end - first));
      for (int64_t i = first; i < end; ++i) ids[i - first] = i;
      STRATA_ASSIGN_OR_RETURN(std::vector<PageRef> got, FetchFromSource(ids));
      std::move(got.begin(), got.end(), held.begin() + first);
    }
    held_ = std::move(held);
  }
  // A device-managed cache takes the dtype of its pages (bf16 or fp8: FetchFromSource set it from
  // the first page and checked every other against it); a host-managed one is bf16.
  half_bytes_ = static_cast<size_t>(options_.page_size) * options_.head_dim *
                kernels::DTypeSize(pool_dtype_);
  page_bytes_ = 2 * half_bytes_;
  const size_t n = static_cast<size_t>(options_.num_slots);
  STRATA_ASSIGN_OR_RETURN(k_pool_, backend_->Allocate(n * half_bytes_));
  STRATA_ASSIGN_OR_RETURN(v_pool_, backend_->Allocate(n * half_bytes_));
  STRATA_ASSIGN_OR_RETURN(device_table_,
                          backend_->Allocate(static_cast<size_t>(table_size_) * sizeof(int32_t)));
  table_.assign(static_cast<size_t>(table_size_), -1);
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(device_table_->data(), table_.data(),
                                                table_.size() * sizeof(int32_t), options_.stream));
  slot_page_.assign(n, -1);
  slot_mark_.assign(n, 0);
  release_count_.assign(n, 0);
  id_mark_.assign(static_cast<size_t>(table_size_), 0);
  pins_.assign(n, 0);
  ref_.assign(n, 0);
  fence_.assign(n, 0);
  const size_t batch = static_cast<size_t>(options_.max_batch_pages);
  for (Staging& s : staging_) {
    STRATA_ASSIGN_OR_RETURN(s.pages, backend_->AllocateHost(batch * page_bytes_));
    STRATA_ASSIGN_OR_RETURN(s.slots, backend_->AllocateHost(batch * sizeof(int32_t)));
    STRATA_ASSIGN_OR_RETURN(s.index, backend_->AllocateHost(2 * batch * sizeof(int32_t)));
    STRATA_ASSIGN_OR_RETURN(s.value, backend_->AllocateHost(2 * batch * sizeof(int32_t)));
    STRATA_ASSIGN_OR_RETURN(s.sources, backend_->AllocateHost(batch * sizeof(const void*)));
  }
  if (options_.additive_gauges) {
    published_capacity_ = static_cast<double>(n * page_bytes_);
    m_.capacity_bytes->Increment(published_capacity_);
  } else {
    m_.capacity_bytes->Set(static_cast<double>(n * page_bytes_));
    m_.resident_bytes->Set(0);
  }
  if (options_.device_managed) STRATA_RETURN_IF_ERROR(InitDeviceState());
  return absl::OkStatus();
}

absl::Status GpuPageCache::InitDeviceState() {
  // Every page must be readable by the device where it lies.
  std::vector<const void*> sources(static_cast<size_t>(table_size_));
  const bool vec16 = half_bytes_ % 16 == 0;
  for (int64_t i = 0; i < table_size_; ++i) {
    const PageRef& page = held_[static_cast<size_t>(i)];
    if (page->allocator() != options_.in_place_allocator) {
      return absl::FailedPreconditionError(absl::StrCat(
          "gpu cache: device_managed needs every page in the in-place allocator's memory; page ",
          i, " is not"));
    }
    const char* k = PageKBytes(page->view()).data();
    if (vec16 && (reinterpret_cast<uintptr_t>(k) & 15) != 0) {
      return absl::FailedPreconditionError("gpu cache: device_managed needs 16-byte aligned pages");
    }
    sources[static_cast<size_t>(i)] = k;
  }
  const size_t n = static_cast<size_t>(options_.num_slots);
  const int64_t scratch_pages = options_.num_slots;
  STRATA_ASSIGN_OR_RETURN(d_slot_page_, backend_->Allocate(n * sizeof(int32_t)));
  STRATA_ASSIGN_OR_RETURN(d_stamp_, backend_->Allocate(n * sizeof(uint32_t)));
  STRATA_ASSIGN_OR_RETURN(d_ref_, backend_->Allocate(n));
  STRATA_ASSIGN_OR_RETURN(d_counters_,
                          backend_->Allocate(kernels::kPageCacheCounterCount * sizeof(int64_t)));
  STRATA_ASSIGN_OR_RETURN(d_scratch_, backend_->Allocate(
                                          static_cast<size_t>(1 + 2 * scratch_pages) * 4));
  STRATA_ASSIGN_OR_RETURN(d_sources_, backend_->Allocate(sources.size() * sizeof(void*)));
  const std::vector<int32_t> minus(n, -1);
  const std::vector<uint32_t> zeros(n, 0);
  const std::vector<int64_t> counters(kernels::kPageCacheCounterCount, 0);
  kernels::Stream st = options_.stream;
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(d_slot_page_->data(), minus.data(), n * 4, st));
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(d_stamp_->data(), zeros.data(), n * 4, st));
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(d_ref_->data(), zeros.data(), n, st));
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(d_counters_->data(), counters.data(),
                                                counters.size() * sizeof(int64_t), st));
  STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(d_sources_->data(), sources.data(),
                                                sources.size() * sizeof(void*), st));
  STRATA_RETURN_IF_ERROR(backend_->Synchronize(st));
  kernels::PageCacheState& d = device_state_;
  d.table = static_cast<int32_t*>(device_table_->data());
  d.table_size = table_size_;
  d.slot_page = static_cast<int32_t*>(d_slot_page_->data());
  d.slot_stamp = static_cast<uint32_t*>(d_stamp_->data());
  d.slot_ref = static_cast<uint8_t*>(d_ref_->data());
  d.num_slots = options_.num_slots;
  d.counters = static_cast<int64_t*>(d_counters_->data());
  d.scratch = static_cast<int32_t*>(d_scratch_->data());
  d.scratch_pages = scratch_pages;
  d.sources = static_cast<const void* const*>(d_sources_->data());
  d.k_pool = k_pool();
  d.v_pool = v_pool();
  if (pool_dtype_ == kernels::DType::kFP8E4M3) {
    // Each fp8 page carries its own (K, V) scales (page_format.h); fills copy them per slot.
    std::vector<float> page_scales(static_cast<size_t>(2 * table_size_));
    for (int64_t i = 0; i < table_size_; ++i) {
      STRATA_ASSIGN_OR_RETURN(PageHeader h, ParsePageHeader(held_[static_cast<size_t>(i)]->view()));
      page_scales[2 * i] = h.k_scale;
      page_scales[2 * i + 1] = h.v_scale;
    }
    const std::vector<float> ones(2 * n, 1.0f);
    STRATA_ASSIGN_OR_RETURN(d_page_scales_, backend_->Allocate(page_scales.size() * 4));
    STRATA_ASSIGN_OR_RETURN(d_slot_scales_, backend_->Allocate(ones.size() * 4));
    STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(d_page_scales_->data(), page_scales.data(),
                                                  page_scales.size() * 4, st));
    STRATA_RETURN_IF_ERROR(
        backend_->CopyToDevice(d_slot_scales_->data(), ones.data(), ones.size() * 4, st));
    STRATA_RETURN_IF_ERROR(backend_->Synchronize(st));
    d.page_scales = static_cast<const float*>(d_page_scales_->data());
    d.slot_scales = static_cast<float*>(d_slot_scales_->data());
  }
  synced_counters_ = counters;
  return absl::OkStatus();
}

const float* GpuPageCache::slot_scales() const {
  return d_slot_scales_ != nullptr ? static_cast<const float*>(d_slot_scales_->data()) : nullptr;
}

absl::Status GpuPageCache::EnqueueResolve(int layer, int64_t prefix_end,
                                          const kernels::CandidateList& middle,
                                          int64_t suffix_begin, int64_t suffix_end) {
  if (!options_.device_managed) {
    return absl::FailedPreconditionError("gpu cache: EnqueueResolve needs device_managed");
  }
  if (layer < 0 || layer >= options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("gpu cache: layer ", layer, " of ",
                                                   options_.num_layers));
  }
  // The most distinct pages one head's selection can name; every one must find a victim.
  const int64_t P = options_.page_size, pph = options_.pages_per_head;
  const int64_t prefix_pages = std::min(pph, (std::max<int64_t>(0, prefix_end) + P - 1) / P);
  const int64_t suffix_pages =
      suffix_end > suffix_begin && suffix_begin >= 0 ? (suffix_end - 1) / P - suffix_begin / P + 1
                                                     : 0;
  // A run of f consecutive token ids spans at most ceil(f / P) + 1 pages (f / P when aligned).
  int64_t middle_pages = 0;
  if (middle.parents.data == nullptr) {
    middle_pages = middle.end > middle.begin ? (middle.end - 1) / P - middle.begin / P + 1 : 0;
  } else if (middle.parents.rank == 2) {
    const int64_t f = middle.fanout;
    const int64_t per_parent = f % P == 0 ? f / P : std::min<int64_t>(f, (f + P - 1) / P + 1);
    middle_pages = middle.parents.dim(1) * per_parent;
  }
  const int64_t per_head =
      std::min(pph, prefix_pages + std::min(pph, middle_pages) + std::min(pph, suffix_pages));
  if (per_head * options_.num_kv_heads > options_.num_slots) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gpu cache: a selection of up to ", per_head * options_.num_kv_heads,
        " pages per layer does not fit ", options_.num_slots, " slots"));
  }
  kernels::ResolvePagesParams p;
  std::lock_guard<std::mutex> lock(mu_);
  p.state = device_state_;
  p.table_base = static_cast<int64_t>(layer) * options_.num_kv_heads * pph;
  p.num_kv_heads = options_.num_kv_heads;
  p.pages_per_head = pph;
  p.page_size = options_.page_size;
  p.prefix_end = prefix_end;
  p.middle = middle;
  p.suffix_begin = suffix_begin;
  p.suffix_end = suffix_end;
  return backend_->ResolvePages(p, options_.stream);
}

absl::Status GpuPageCache::SyncDeviceStats() {
  if (!options_.device_managed) {
    return absl::FailedPreconditionError("gpu cache: SyncDeviceStats needs device_managed");
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> c(kernels::kPageCacheCounterCount);
  STRATA_RETURN_IF_ERROR(backend_->CopyToHost(c.data(), d_counters_->data(),
                                              c.size() * sizeof(int64_t), options_.stream));
  STRATA_RETURN_IF_ERROR(backend_->Synchronize(options_.stream));
  auto delta = [&](kernels::PageCacheCounter k) { return c[k] - synced_counters_[k]; };
  const int64_t lookups = delta(kernels::kPageCacheLookups);
  const int64_t hits = delta(kernels::kPageCacheHits);
  const int64_t fills = delta(kernels::kPageCacheFills);
  const int64_t evictions = delta(kernels::kPageCacheEvictions);
  stats_.lookups += lookups;
  stats_.hits += hits;
  stats_.fills += fills;
  stats_.fill_bytes += fills * static_cast<int64_t>(page_bytes_);
  stats_.evictions += evictions;
  stats_.in_place += fills;
  m_.lookups->Increment(static_cast<double>(lookups));
  m_.hits->Increment(static_cast<double>(hits));
  m_.evictions->Increment(static_cast<double>(evictions));
  fetch_bytes_->Increment(static_cast<double>(fills) * static_cast<double>(page_bytes_));
  resident_ = c[kernels::kPageCacheFills] - c[kernels::kPageCacheEvictions];
  synced_counters_ = std::move(c);
  PublishGauges();
  return absl::OkStatus();
}

GpuPageCache::~GpuPageCache() {
  std::lock_guard<std::mutex> lock(mu_);
  // Fills still in flight read the staging buffers freed below: let them land first.
  if (issued_seq_ > completed_seq_) (void)backend_->Synchronize(options_.stream);
  if (options_.additive_gauges) {
    m_.resident_bytes->Decrement(published_resident_);
    m_.capacity_bytes->Decrement(published_capacity_);
  } else {
    m_.resident_bytes->Set(0);
  }
}

absl::StatusOr<int64_t> GpuPageCache::FlatIndex(const GpuPageId& p) const {
  if (p.layer < 0 || p.layer >= options_.num_layers || p.kv_head < 0 ||
      p.kv_head >= options_.num_kv_heads || p.page < 0 || p.page >= options_.pages_per_head) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gpu cache: page (layer ", p.layer, ", kv_head ", p.kv_head, ", page ", p.page,
        ") outside ", options_.num_layers, " layers x ", options_.num_kv_heads, " heads x ",
        options_.pages_per_head, " pages"));
  }
  return (static_cast<int64_t>(p.layer) * options_.num_kv_heads + p.kv_head) *
             options_.pages_per_head +
         p.page;
}

absl::StatusOr<std::vector<PageRef>> GpuPageCache::FetchFromSource(
    const std::vector<int64_t>& missing) {
  if (!held_.empty()) {  // hold_source_pages: every page was looked up and checked at Create
    std::vector<PageRef> pages(missing.size());
    for (size_t i = 0; i < missing.size(); ++i) pages[i] = held_[static_cast<size_t>(missing[i])];
    return pages;
  }
  std::vector<PageKey> keys(missing.size());
  for (size_t i = 0; i < missing.size(); ++i) {
    const int64_t id = missing[i];
    const int64_t lh = id / options_.pages_per_head;
    keys[i].document = options_.document;
    keys[i].layer = static_cast<uint32_t>(lh / options_.num_kv_heads);
    keys[i].kv_head = static_cast<uint32_t>(lh % options_.num_kv_heads);
    keys[i].page_index = static_cast<uint32_t>(id % options_.pages_per_head);
  }
  std::vector<PageRef> pages;
  if (keys.empty()) return pages;
  STRATA_RETURN_IF_ERROR(options_.source->GetPages(keys, &pages));
  if (pages.size() != keys.size()) {
    return absl::InternalError("gpu cache: source returned the wrong number of pages");
  }
  for (size_t i = 0; i < pages.size(); ++i) {
    const PageKey& k = keys[i];
    if (pages[i] == nullptr) {
      return absl::NotFoundError(absl::StrCat("gpu cache: page (layer ", k.layer, ", kv_head ",
                                              k.kv_head, ", page ", k.page_index,
                                              ") is not in the ", options_.source->tier(),
                                              " tier"));
    }
    STRATA_ASSIGN_OR_RETURN(PageHeader h, ParsePageHeader(pages[i]->view()));
    if (h.shape.dtype != kernels::DType::kBF16 && h.shape.dtype != kernels::DType::kFP8E4M3) {
      return absl::UnimplementedError(absl::StrCat(
          "gpu cache: ", kernels::DTypeName(h.shape.dtype), " pages are not supported (bf16, fp8)"));
    }
    if (!pool_dtype_known_) {
      pool_dtype_ = h.shape.dtype;
      pool_dtype_known_ = true;
    }
    if (options_.device_managed && h.shape.dtype != pool_dtype_) {
      return absl::FailedPreconditionError(
          absl::StrCat("gpu cache: a ", kernels::DTypeName(h.shape.dtype), " page among ",
                       kernels::DTypeName(pool_dtype_), " pages"));
    }
    if (h.shape.page_size != options_.page_size || h.shape.head_dim != options_.head_dim) {
      return absl::FailedPreconditionError(
          absl::StrCat("gpu cache: source page of ", h.shape.page_size, " x ", h.shape.head_dim,
                       ", cache pages are ", options_.page_size, " x ", options_.head_dim));
    }
    if (pool_dtype_ == kernels::DType::kBF16 && h.shape.dtype == kernels::DType::kFP8E4M3) {
      // A host-managed cache's pools are bf16: the page dequantised with its scales, as a bf16 page.
      STRATA_ASSIGN_OR_RETURN(pages[i], Fp8PageAsBf16(pages[i]->view()));
    }
  }
  return pages;
}

int32_t GpuPageCache::ClaimSlot() {
  const int64_t n = options_.num_slots;
  if (next_unused_ < n) return static_cast<int32_t>(next_unused_++);
  for (int64_t step = 0; step < 2 * n; ++step) {
    const int64_t s = hand_;
    hand_ = hand_ + 1 == n ? 0 : hand_ + 1;
    if (pins_[s] > 0) continue;
    if (ref_[s] != 0) {
      ref_[s] = 0;
      continue;
    }
    return static_cast<int32_t>(s);
  }
  return -1;
}

uint32_t GpuPageCache::NextEpoch() {
  if (++epoch_ == 0) {  // wrapped: no mark may look current
    std::fill(id_mark_.begin(), id_mark_.end(), 0);
    std::fill(slot_mark_.begin(), slot_mark_.end(), 0);
    epoch_ = 1;
  }
  return epoch_;
}

absl::Status GpuPageCache::WaitLocked() {
  if (issued_seq_ == completed_seq_) return absl::OkStatus();
  Stopwatch watch;
  absl::Status s = backend_->Synchronize(options_.stream);
  stats_.wait_seconds += watch.ElapsedSeconds();
  if (s.ok()) {
    completed_seq_ = issued_seq_;
    for (Staging& st : staging_) st.hold.clear();  // no batch reads them any more
  }
  return s;
}

absl::Status GpuPageCache::Fill(const std::vector<int64_t>& ids,
                                const std::vector<PageRef>& pages, bool pin,
                                std::vector<int32_t>* slot_of, int64_t* filled) {
  slot_of->assign(ids.size(), -1);
  *filled = 0;
  std::vector<int32_t> held;  // slots pinned while this call runs, so it never evicts its own
  auto unpin_held = [&] {
    for (int32_t s : held) {
      if (--pins_[s] == 0) --pinned_;
    }
  };
  size_t i = 0;
  bool out_of_slots = false;
  while (i < ids.size() && !out_of_slots) {
    Staging& st = staging_[next_staging_];
    next_staging_ ^= 1;
    if (st.seq > completed_seq_) {
      absl::Status w = WaitLocked();
      if (!w.ok()) {
        unpin_held();
        return w;
      }
    }
    Stopwatch gather;
    char* dst = static_cast<char*>(st.pages->data());
    auto* slots = static_cast<int32_t*>(st.slots->data());
    auto* index = static_cast<int32_t*>(st.index->data());
    auto* value = static_cast<int32_t*>(st.value->data());
    auto* sources = static_cast<const void**>(st.sources->data());
    st.hold.clear();  // its previous batch has completed (waited for above)
    const size_t first = i;
    int np = 0, nu = 0, in_place = 0;
    int64_t evictions = 0;
    for (; i < ids.size() && np < options_.max_batch_pages; ++i) {
      const int32_t s = ClaimSlot();
      if (s < 0) {
        out_of_slots = true;
        break;
      }
      const int64_t old = slot_page_[s];
      if (old >= 0) {
        table_[old] = -1;
        index[nu] = static_cast<int32_t>(old);
        value[nu] = -1;
        ++nu;
        ++evictions;
      } else {
        ++resident_;
      }
      slot_page_[s] = ids[i];
      table_[ids[i]] = s;
      ref_[s] = 1;
      if (pins_[s]++ == 0) ++pinned_;
      held.push_back(s);
      fence_[s] = issued_seq_ + 1;
      const absl::string_view page = pages[i]->view();
      if (options_.in_place_allocator != nullptr &&
                 pages[i]->allocator() == options_.in_place_allocator) {
        // K and V lie back to back after the header (page_format.h): read them where they are.
        sources[np] = PageKBytes(page).data();
        st.hold.push_back(pages[i]);
        ++in_place;
      } else {
        char* to = dst + static_cast<size_t>(np) * page_bytes_;
        std::memcpy(to, PageKBytes(page).data(), half_bytes_);
        std::memcpy(to + half_bytes_, PageVBytes(page).data(), half_bytes_);
        sources[np] = to;
      }
      slots[np] = s;
      index[nu] = static_cast<int32_t>(ids[i]);
      value[nu] = s;
      ++nu;
      ++np;
      (*slot_of)[i] = s;
    }
    stats_.gather_seconds += gather.ElapsedSeconds();
    stats_.evictions += evictions;
    m_.evictions->Increment(static_cast<double>(evictions));
    if (np == 0) break;
    kernels::PageCopyParams p;
    p.staging = st.pages->data();
    p.staging_bytes = st.pages->bytes();
    // Per-page addresses only when some page is read in place (the CUDA backend then checks
    // every address); otherwise the staging buffer in order.
    if (in_place > 0) p.sources = sources;
    p.slots = slots;
    p.num_pages = np;
    p.k_pool = k_pool();
    p.v_pool = v_pool();
    p.table = static_cast<int32_t*>(device_table_->data());
    p.table_size = table_size_;
    p.table_index = index;
    p.table_value = value;
    p.num_table_updates = nu;
    Stopwatch copy_watch;
    absl::Status copy = backend_->PageCopy(p, options_.stream);
    stats_.copy_seconds += copy_watch.ElapsedSeconds();
    if (!copy.ok()) {
      // The batch's pages never arrived: forget them (their slots become free for the clock).
      for (size_t j = first; j < i; ++j) {
        const int32_t s = (*slot_of)[j];
        if (s < 0) continue;
        table_[ids[j]] = -1;
        slot_page_[s] = -1;
        ref_[s] = 0;
        --resident_;
        (*slot_of)[j] = -1;
      }
      st.hold.clear();
      unpin_held();
      PublishGauges();
      return copy;
    }
    st.seq = ++issued_seq_;
    stats_.fills += np;
    stats_.fill_bytes += static_cast<int64_t>(np) * static_cast<int64_t>(page_bytes_);
    ++stats_.fill_batches;
    stats_.in_place += in_place;
    fetch_bytes_->Increment(static_cast<double>(np) * static_cast<double>(page_bytes_));
    *filled += np;
  }
  if (!pin) unpin_held();
  // With pin, `held` stays pinned once per distinct page; the caller adjusts per occurrence.
  PublishGauges();
  return absl::OkStatus();
}

absl::Status GpuPageCache::Acquire(absl::Span<const GpuPageId> pages, MissPolicy policy,
                                   std::vector<int32_t>* slots) {
  if (options_.device_managed) {
    return absl::FailedPreconditionError(
        "gpu cache: Acquire is for host-managed caches (this one is device_managed)");
  }
  if (slots == nullptr) return absl::InvalidArgumentError("gpu cache: slots is null");
  Stopwatch watch;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> ids(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(ids[i], FlatIndex(pages[i]));
  }
  std::vector<int64_t> missing;
  int64_t unpinned_hits = 0;  // distinct unpinned slots among the hits
  int64_t hits = 0;
  const uint32_t epoch = NextEpoch();
  for (int64_t id : ids) {
    const int32_t s = table_[id];
    if (s >= 0) {
      ++hits;
      if (pins_[s] == 0 && slot_mark_[s] != epoch) {
        slot_mark_[s] = epoch;
        ++unpinned_hits;
      }
    } else if (id_mark_[id] != epoch) {
      id_mark_[id] = epoch;
      missing.push_back(id);
    }
  }
  // kWait and kOrdered are exact (every page gets a slot); only kWait waits on the host.
  const bool wait = policy == MissPolicy::kWait || policy == MissPolicy::kOrdered;
  const bool host_wait = policy == MissPolicy::kWait;
  if (wait) {
    const int64_t available = options_.num_slots - pinned_ - unpinned_hits;
    if (static_cast<int64_t>(missing.size()) > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "gpu cache: ", missing.size(), " pages to fill but only ", available, " of ",
          options_.num_slots, " slots are unpinned (release the previous step's pages, or "
          "make the cache larger)"));
    }
  } else {
    // Best effort: never fetch more than could be placed.
    const int64_t room = std::max<int64_t>(0, options_.num_slots - pinned_ - unpinned_hits);
    if (static_cast<int64_t>(missing.size()) > room) missing.resize(static_cast<size_t>(room));
  }
  Stopwatch gather;
  absl::StatusOr<std::vector<PageRef>> fetched = FetchFromSource(missing);
  stats_.gather_seconds += gather.ElapsedSeconds();
  stats_.source_seconds += gather.ElapsedSeconds();
  if (!fetched.ok()) return fetched.status();

  // From here on the call succeeds unless the backend fails.
  slots->assign(ids.size(), -1);
  bool in_flight = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t s = table_[ids[i]];
    if (s < 0) continue;
    (*slots)[i] = s;
    if (pins_[s]++ == 0) ++pinned_;
    ref_[s] = 1;
    if (fence_[s] > completed_seq_) in_flight = true;
  }
  auto unpin_hits = [&] {
    for (int32_t s : *slots) {
      if (s >= 0 && --pins_[s] == 0) --pinned_;
    }
    slots->assign(ids.size(), -1);
  };
  if (in_flight && policy != MissPolicy::kOrdered) {
    // A hit on a page whose fill (an earlier prefetch or deferred miss) may not have landed
    // (kOrdered: the caller's readers are queued behind it on `stream`).
    absl::Status w = WaitLocked();
    if (!w.ok()) {
      unpin_hits();
      return w;
    }
  }
  std::vector<int32_t> slot_of;
  int64_t filled = 0;
  absl::Status f = Fill(missing, *fetched, wait, &slot_of, &filled);
  if (!f.ok()) {
    unpin_hits();
    return f;
  }
  if (wait && filled != static_cast<int64_t>(missing.size())) {
    // Cannot happen (the capacity was checked above); fail rather than hand out -1.
    unpin_hits();
    return absl::InternalError("gpu cache: fewer pages filled than checked for");
  }
  if (wait) {
    // Fill pinned each new page once; pin again for repeated entries and hand the slots out.
    const uint32_t used = NextEpoch();
    for (size_t i = 0; i < ids.size(); ++i) {
      if ((*slots)[i] >= 0) continue;
      const int32_t s = table_[ids[i]];  // filled above, pinned once by Fill
      (*slots)[i] = s;
      if (id_mark_[ids[i]] == used) {
        ++pins_[s];
      } else {
        id_mark_[ids[i]] = used;
      }
    }
    absl::Status w = host_wait ? WaitLocked() : absl::OkStatus();
    if (!w.ok()) {
      // The pages may not have landed: unpin everything this call pinned.
      for (int32_t s : *slots) {
        if (s >= 0 && --pins_[s] == 0) --pinned_;
      }
      slots->assign(ids.size(), -1);
      return w;
    }
    if (filled > 0 && host_wait) m_.fetch_duration->Observe(watch.ElapsedSeconds());
  }
  stats_.lookups += static_cast<int64_t>(ids.size());
  stats_.hits += hits;
  m_.lookups->Increment(static_cast<double>(ids.size()));
  m_.hits->Increment(static_cast<double>(hits));
  return absl::OkStatus();
}

absl::Status GpuPageCache::Release(absl::Span<const int32_t> slots) {
  if (options_.device_managed) {
    return absl::FailedPreconditionError(
        "gpu cache: Release is for host-managed caches (this one is device_managed)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  // release_count_ is all zero between calls.
  absl::Status error;
  size_t counted = 0;
  for (; counted < slots.size(); ++counted) {
    const int32_t s = slots[counted];
    if (s < 0) continue;
    if (s >= options_.num_slots) {
      error = absl::InvalidArgumentError(
          absl::StrCat("gpu cache: release of slot ", s, " of ", options_.num_slots));
      break;
    }
    if (++release_count_[s] > pins_[s]) {
      error = absl::InvalidArgumentError(absl::StrCat(
          "gpu cache: slot ", s, " released more often than pinned (", pins_[s], ")"));
      ++counted;
      break;
    }
  }
  for (size_t i = 0; i < counted; ++i) {
    const int32_t s = slots[i];
    if (s < 0 || s >= options_.num_slots) continue;
    if (error.ok()) {
      if (--pins_[s] == 0) --pinned_;
    }
    release_count_[s] = 0;
  }
  return error;
}

absl::Status GpuPageCache::Prefetch(absl::Span<const GpuPageId> pages, int64_t* issued) {
  if (options_.device_managed) {
    return absl::FailedPreconditionError(
        "gpu cache: Prefetch is for host-managed caches (this one is device_managed)");
  }
  if (issued != nullptr) *issued = 0;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> missing;
  const uint32_t epoch = NextEpoch();
  for (const GpuPageId& p : pages) {
    STRATA_ASSIGN_OR_RETURN(int64_t id, FlatIndex(p));
    if (table_[id] < 0 && id_mark_[id] != epoch) {
      id_mark_[id] = epoch;
      missing.push_back(id);
    }
  }
  const int64_t room = options_.num_slots - pinned_;
  if (static_cast<int64_t>(missing.size()) > room) missing.resize(static_cast<size_t>(room));
  Stopwatch gather;
  absl::StatusOr<std::vector<PageRef>> fetched = FetchFromSource(missing);
  stats_.gather_seconds += gather.ElapsedSeconds();
  stats_.source_seconds += gather.ElapsedSeconds();
  if (!fetched.ok()) return fetched.status();
  std::vector<int32_t> slot_of;
  int64_t filled = 0;
  STRATA_RETURN_IF_ERROR(Fill(missing, *fetched, /*pin=*/false, &slot_of, &filled));
  if (issued != nullptr) *issued = filled;
  return absl::OkStatus();
}

absl::Status GpuPageCache::WaitForFills() {
  std::lock_guard<std::mutex> lock(mu_);
  return WaitLocked();
}

absl::StatusOr<int32_t> GpuPageCache::SlotOf(const GpuPageId& page) const {
  if (options_.device_managed) {
    return absl::FailedPreconditionError(
        "gpu cache: SlotOf is for host-managed caches (this one is device_managed)");
  }
  STRATA_ASSIGN_OR_RETURN(int64_t id, FlatIndex(page));
  std::lock_guard<std::mutex> lock(mu_);
  return table_[id];
}

kernels::TensorView GpuPageCache::k_pool() const {
  return kernels::TensorView(k_pool_->data(), pool_dtype_,
                             {options_.num_slots, options_.page_size, options_.head_dim});
}

kernels::TensorView GpuPageCache::v_pool() const {
  return kernels::TensorView(v_pool_->data(), pool_dtype_,
                             {options_.num_slots, options_.page_size, options_.head_dim});
}

const int32_t* GpuPageCache::device_table() const {
  return static_cast<const int32_t*>(device_table_->data());
}

int64_t GpuPageCache::resident_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resident_;
}

int64_t GpuPageCache::pinned_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_;
}

GpuCacheStats GpuPageCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void GpuPageCache::PublishGauges() {
  const double resident = static_cast<double>(resident_) * static_cast<double>(page_bytes_);
  if (options_.additive_gauges) {
    m_.resident_bytes->Increment(resident - published_resident_);
    published_resident_ = resident;
  } else {
    m_.resident_bytes->Set(resident);
  }
}

}  // namespace strata::kvstore
