// Paged KV cache. See engine/kv_cache.h.
//
// Slot layout: slot = kv_head * pages_per_head + page, so the pages of one KV head are contiguous
// in the pool and SlotOf is pure arithmetic. Appends stage the new rows on the host (converting
// f32 -> pool dtype) and copy them into the pools page run by page run with the backend's
// CopyToDevice, which is a memcpy for the CPU backend and works unchanged for device pools.
#include "engine/kv_cache.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace strata::engine {

using kernels::DType;
using kernels::KvSpan;
using kernels::TensorView;

absl::Status KvCacheOptions::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: num_layers ", num_layers,
                                                   ", num_kv_heads ", num_kv_heads, ", head_dim ",
                                                   head_dim, " must all be positive"));
  }
  if (page_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: page_size ", page_size, " <= 0"));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: dtype ", kernels::DTypeName(dtype),
                                                   " (want f32, bf16 or fp8_e4m3)"));
  }
  for (const float s : {k_scale, v_scale}) {
    if (!(std::isfinite(s) && s > 0.0f) || (dtype != DType::kFP8E4M3 && s != 1.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv cache: scales ", k_scale, ", ", v_scale,
          " (finite and > 0 for fp8_e4m3, 1 for other dtypes)"));
    }
  }
  if (max_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: max_tokens ", max_tokens, " <= 0"));
  }
  const int64_t pages = (max_tokens + page_size - 1) / page_size;
  if (pages * num_kv_heads > INT32_MAX) {
    return absl::InvalidArgumentError("kv cache: too many page slots for int32 slot ids");
  }
  return absl::OkStatus();
}

namespace {
std::atomic<uint64_t> next_cache_id{1};
}  // namespace

KvCache::KvCache(const KvCacheOptions& options, kernels::Backend* backend)
    : options_(options), backend_(backend), id_(next_cache_id.fetch_add(1)) {}

KvCache::~KvCache() {
  // A PageCopy may still read the mirror: let it finish before the buffers go (best effort).
  if (tail_pages_ != nullptr) backend_->Synchronize(nullptr).IgnoreError();
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheOptions& options,
                                                         kernels::Backend* backend) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (backend == nullptr) return absl::InvalidArgumentError("kv cache: null backend");
  std::unique_ptr<KvCache> cache(new KvCache(options, backend));
  cache->pages_per_head_ = (options.max_tokens + options.page_size - 1) / options.page_size;
  cache->lengths_.assign(options.num_layers, 0);
  const size_t bytes = static_cast<size_t>(cache->pages_per_head_) * options.num_kv_heads *
                       options.page_size * options.head_dim * kernels::DTypeSize(options.dtype);
  for (int l = 0; l < options.num_layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> k, backend->Allocate(bytes));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> v, backend->Allocate(bytes));
    cache->k_pools_.push_back(std::move(k));
    cache->v_pools_.push_back(std::move(v));
  }
  if (backend->Name() != "cpu") {
    const size_t page_bytes =
        kernels::PageCopyBytes(options.page_size, options.head_dim, options.dtype);
    const size_t heads = static_cast<size_t>(options.num_layers) * options.num_kv_heads;
    auto pages = backend->AllocateHost(heads * page_bytes);
    auto slots = backend->AllocateHost(heads * sizeof(int32_t));
    if (pages.ok() && slots.ok()) {  // else: the synchronous path for every page
      std::memset((*pages)->data(), 0, heads * page_bytes);  // finite rows past the length
      cache->tail_pages_ = *std::move(pages);
      cache->tail_slots_ = *std::move(slots);
      cache->tail_page_bytes_ = page_bytes;
    }
  }
  return cache;
}

void KvCache::StoreRow(const float* x, float scale, char* dst) {
  const int d = options_.head_dim;
  // fp8 as AppendKv writes it: F32ToFP8E4M3 of the f32 quotient (x / 1 is x), through
  // ConvertFromF32's loop rather than a call per element.
  if (options_.dtype == DType::kFP8E4M3 && scale != 1.0f) {
    scaled_row_.resize(static_cast<size_t>(d));
    for (int e = 0; e < d; ++e) scaled_row_[e] = x[e] / scale;
    x = scaled_row_.data();
  }
  kernels::ConvertFromF32(x, dst, options_.dtype, d);
}

int64_t KvCache::num_pages(int layer) const {
  return (lengths_[layer] + options_.page_size - 1) / options_.page_size;
}

absl::Status KvCache::AppendPages(int layer, int64_t n, const void* staging, size_t staging_bytes,
                                  int32_t* slots) {
  if (layer < 0 || layer >= options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: layer ", layer, " out of range"));
  }
  const int hkv = options_.num_kv_heads, page = options_.page_size;
  const int64_t begin = lengths_[layer];
  if (n < 0 || begin % page != 0) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: AppendPages of ", n, " tokens after ",
                                                   begin, " (whole pages of ", page, " only)"));
  }
  if (begin + n > options_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("kv cache: ", begin, " + ", n,
                                                     " tokens exceed max_tokens ",
                                                     options_.max_tokens));
  }
  if (n == 0) return absl::OkStatus();
  const int64_t pages = (n + page - 1) / page;
  const size_t page_bytes = kernels::PageCopyBytes(page, options_.head_dim, options_.dtype);
  const size_t need = static_cast<size_t>(pages) * hkv * page_bytes;
  if (staging == nullptr || slots == nullptr || staging_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: AppendPages of ", pages, " pages x ",
                                                   hkv, " KV heads needs ", need,
                                                   " bytes of staging, got ", staging_bytes));
  }
  const int64_t first_page = begin / page;
  if (pages * hkv > INT32_MAX) return absl::InvalidArgumentError("kv cache: AppendPages of too many pages");
  for (int64_t j = 0; j < pages; ++j) {
    for (int g = 0; g < hkv; ++g) slots[j * hkv + g] = SlotOf(layer, g, first_page + j);
  }
  if (tail_pages_ != nullptr) {
    // The mirror of each KV head's last page (Append's path without AppendKv continues a page
    // from it): the staging page that is now the last. Without AppendKv an earlier Append's
    // PageCopy may still read the mirror: wait for it first.
    if (!device_append_) STRATA_RETURN_IF_ERROR(backend_->Synchronize(nullptr));
    const char* last = static_cast<const char*>(staging) + static_cast<size_t>(pages - 1) * hkv * page_bytes;
    std::memcpy(static_cast<char*>(tail_pages_->data()) + static_cast<size_t>(layer) * hkv * tail_page_bytes_,
                last, static_cast<size_t>(hkv) * page_bytes);
  }
  kernels::PageCopyParams pc;
  pc.staging = staging;
  pc.staging_bytes = need;
  pc.slots = slots;
  pc.num_pages = static_cast<int>(pages * hkv);
  pc.k_pool = k_pool(layer);
  pc.v_pool = v_pool(layer);
  STRATA_RETURN_IF_ERROR(backend_->PageCopy(pc, nullptr));
  lengths_[layer] = begin + n;
  return absl::OkStatus();
}

absl::Status KvCache::EnqueueAppendAt(int layer, const TensorView& k, const TensorView& v,
                                      const int32_t* index_device,
                                      const kernels::RopeParams& rope) {
  if (layer < 0 || layer >= options_.num_layers || index_device == nullptr) {
    return absl::InvalidArgumentError("kv cache: EnqueueAppendAt needs a layer and an index");
  }
  const int hkv = options_.num_kv_heads, d = options_.head_dim;
  for (const TensorView* t : {&k, &v}) {
    if (t->data == nullptr || t->rank != 3 || t->dtype != DType::kF32 || t->dim(0) != 1 ||
        t->dim(1) != hkv || t->dim(2) != d) {
      return absl::InvalidArgumentError(absl::StrCat("kv cache: EnqueueAppendAt wants f32 [1, ",
                                                     hkv, ", ", d, "], got ", t->DebugString()));
    }
  }
  if (tail_pages_ == nullptr) {
    return absl::UnimplementedError("kv cache: EnqueueAppendAt needs a device backend");
  }
  kernels::AppendKvParams ap;
  ap.k = k;
  ap.v = v;
  ap.k_pool = k_pool(layer);
  ap.v_pool = v_pool(layer);
  ap.first = options_.max_tokens - 1;  // the largest index the kernel may read
  ap.slots_per_head = pages_per_head_;
  ap.first_device = index_device;
  ap.rope = rope;
  ap.k_scale = options_.k_scale;
  ap.v_scale = options_.v_scale;
  return backend_->AppendKv(ap, nullptr);
}

absl::Status KvCache::CommitAppend(int64_t n) {
  for (int64_t len : lengths_) {
    if (n < 0 || len + n > options_.max_tokens) {
      return absl::ResourceExhaustedError(absl::StrCat("kv cache: ", len, " + ", n,
                                                       " tokens exceed max_tokens ",
                                                       options_.max_tokens));
    }
  }
  for (int64_t& len : lengths_) len += n;
  return absl::OkStatus();
}

absl::Status KvCache::Append(int layer, const TensorView& k, const TensorView& v) {
  if (layer < 0 || layer >= options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: layer ", layer, " out of range"));
  }
  const int hkv = options_.num_kv_heads, d = options_.head_dim, page = options_.page_size;
  for (const TensorView* t : {&k, &v}) {
    if (t->data == nullptr || t->rank != 3 || t->dtype != DType::kF32 || t->dim(1) != hkv ||
        t->dim(2) != d || t->dim(0) != k.dim(0)) {
      return absl::InvalidArgumentError(absl::StrCat("kv cache: append wants f32 [n, ", hkv, ", ",
                                                     d, "], got ", t->DebugString()));
    }
  }
  const int64_t n = k.dim(0);
  const int64_t begin = lengths_[layer];
  if (begin + n > options_.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("kv cache: ", begin, " + ", n,
                                                     " tokens exceed max_tokens ",
                                                     options_.max_tokens));
  }
  if (n == 0) return absl::OkStatus();
  if (tail_pages_ != nullptr && device_append_) {
    // Device backends: one conversion kernel straight into the pools.
    kernels::AppendKvParams ap;
    ap.k = k;
    ap.v = v;
    ap.k_pool = k_pool(layer);
    ap.v_pool = v_pool(layer);
    ap.first = begin;
    ap.slots_per_head = pages_per_head_;
    ap.k_scale = options_.k_scale;
    ap.v_scale = options_.v_scale;
    const absl::Status st = backend_->AppendKv(ap, nullptr);
    if (st.ok()) {
      lengths_[layer] = begin + n;
      return absl::OkStatus();
    }
    if (!absl::IsUnimplemented(st)) return st;
    // The backend lacks the op (for this pool dtype): then the first append already finds out,
    // before AppendKv wrote anything, so the mirror below holds every page it continues.
    device_append_ = false;
  }
  // Bring the new rows to the host (a copy for the CPU backend too; small next to attention): one
  // copy when v follows k. This copy waits for the stream, so any PageCopy of an earlier Append
  // still reading this layer's mirror has finished before the mirror is rewritten below.
  const size_t elems = static_cast<size_t>(n) * hkv * d;
  host_rows_.resize(2 * elems);
  float* hk = host_rows_.data();
  float* hv = hk + elems;
  if (v.data == static_cast<const float*>(k.data) + elems) {
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(hk, k.data, 2 * elems * sizeof(float), nullptr));
  } else {
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(hk, k.data, elems * sizeof(float), nullptr));
    STRATA_RETURN_IF_ERROR(backend_->CopyToHost(hv, v.data, elems * sizeof(float), nullptr));
  }
  const size_t esize = kernels::DTypeSize(options_.dtype);
  const size_t row_bytes = static_cast<size_t>(d) * esize;
  stage_k_.resize(static_cast<size_t>(page) * row_bytes);
  stage_v_.resize(stage_k_.size());
  char* kpool = static_cast<char*>(k_pools_[layer]->data());
  char* vpool = static_cast<char*>(v_pools_[layer]->data());
  const int64_t end = begin + n;
  const int64_t last_page = (end - 1) / page;
  for (int g = 0; g < hkv; ++g) {
    char* mirror = tail_pages_ == nullptr
                       ? nullptr
                       : static_cast<char*>(tail_pages_->data()) +
                             (static_cast<size_t>(layer) * hkv + g) * tail_page_bytes_;
    for (int64_t pos = begin; pos < end;) {
      const int64_t p = pos / page, off = pos % page;
      const int64_t run = std::min<int64_t>(page - off, end - pos);
      // The run lands in the mirror when this is the page the append ends in (written by the
      // PageCopy below), else in the staging rows (written now).
      const bool tail = mirror != nullptr && p == last_page;
      char* dk = tail ? mirror + off * row_bytes : reinterpret_cast<char*>(stage_k_.data());
      char* dv = tail ? mirror + (static_cast<size_t>(page) + off) * row_bytes
                      : reinterpret_cast<char*>(stage_v_.data());
      for (int64_t i = 0; i < run; ++i) {
        const size_t src = (static_cast<size_t>(pos - begin + i) * hkv + g) * d;
        StoreRow(hk + src, options_.k_scale, dk + i * row_bytes);
        StoreRow(hv + src, options_.v_scale, dv + i * row_bytes);
      }
      if (!tail) {
        const size_t dst = (static_cast<size_t>(SlotOf(layer, g, p)) * page + off) * row_bytes;
        const size_t bytes = static_cast<size_t>(run) * row_bytes;
        STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(kpool + dst, dk, bytes, nullptr));
        STRATA_RETURN_IF_ERROR(backend_->CopyToDevice(vpool + dst, dv, bytes, nullptr));
        // The staging rows are reused: wait for the copies before refilling them. (A page before
        // the last is filled to its end here, so no later append continues it from the mirror.)
        STRATA_RETURN_IF_ERROR(backend_->Synchronize(nullptr));
      }
      pos += run;
    }
  }
  if (tail_pages_ != nullptr) {
    // Every KV head's last page (its earlier rows are in the mirror from earlier appends; rows
    // past `end` are stale and land in pool positions no span covers until they are written).
    int32_t* slots = static_cast<int32_t*>(tail_slots_->data()) + static_cast<size_t>(layer) * hkv;
    for (int g = 0; g < hkv; ++g) slots[g] = SlotOf(layer, g, last_page);
    kernels::PageCopyParams pc;
    pc.staging = static_cast<const char*>(tail_pages_->data()) +
                 static_cast<size_t>(layer) * hkv * tail_page_bytes_;
    pc.staging_bytes = static_cast<size_t>(hkv) * tail_page_bytes_;
    pc.slots = slots;
    pc.num_pages = hkv;
    pc.k_pool = k_pool(layer);
    pc.v_pool = v_pool(layer);
    STRATA_RETURN_IF_ERROR(backend_->PageCopy(pc, nullptr));
  }
  lengths_[layer] = begin + n;
  return absl::OkStatus();
}

TensorView KvCache::k_pool(int layer) const {
  return TensorView(k_pools_[layer]->data(), options_.dtype,
                    {pages_per_head_ * options_.num_kv_heads, options_.page_size,
                     options_.head_dim});
}

TensorView KvCache::v_pool(int layer) const {
  return TensorView(v_pools_[layer]->data(), options_.dtype,
                    {pages_per_head_ * options_.num_kv_heads, options_.page_size,
                     options_.head_dim});
}

int32_t KvCache::SlotOf(int layer, int kv_head, int64_t page) const {
  return static_cast<int32_t>(kv_head * pages_per_head_ + page);
}

std::vector<int32_t> KvCache::PageTable(int64_t width) const {
  const int64_t hkv = options_.num_kv_heads, cols = std::min(width, pages_per_head_);
  std::vector<int32_t> table(static_cast<size_t>(hkv * std::max<int64_t>(width, 0)), -1);
  for (int64_t g = 0; g < hkv; ++g) {
    for (int64_t p = 0; p < cols; ++p) table[g * width + p] = SlotOf(0, static_cast<int>(g), p);
  }
  return table;
}

void KvCache::AppendSpans(int layer, int kv_head, int64_t begin, int64_t end,
                          std::vector<KvSpan>* spans) const {
  begin = std::max<int64_t>(begin, 0);
  end = std::min<int64_t>(end, lengths_[layer]);
  const int page = options_.page_size;
  for (int64_t pos = begin; pos < end;) {
    const int64_t p = pos / page, off = pos % page;
    const int64_t run = std::min<int64_t>(page - off, end - pos);
    KvSpan s;
    s.slot = SlotOf(layer, kv_head, p);
    s.offset = static_cast<int32_t>(off);
    s.length = static_cast<int32_t>(run);
    s.position = static_cast<int32_t>(pos);
    spans->push_back(s);
    pos += run;
  }
}

}  // namespace strata::engine
