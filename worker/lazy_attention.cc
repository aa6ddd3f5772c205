// Lazy mount of a READY document through the GPU page cache; see worker/lazy_attention.h.
#include "worker/lazy_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/query_mean.h"
#include "kvstore/backend_page_allocator.h"
#include "worker/internal/host_parallel.h"

namespace strata::worker {
namespace {

// The cache's source: the worker's page store, counting the pages each tier served. A page no
// tier holds is DataLoss (the document is READY, so every page was persisted).
class TierCountingStore final : public kvstore::PageStore {
 public:
  TierCountingStore(kvstore::PageStore* store, kvstore::DocumentId document)
      : store_(store), tiered_(dynamic_cast<kvstore::TieredStore*>(store)), document_(document) {}
  const char* tier() const override { return store_->tier(); }
  absl::Status GetPages(absl::Span<const kvstore::PageKey> keys, std::vector<kvstore::PageRef>* out) override {
    if (tiered_ != nullptr) {
      STRATA_RETURN_IF_ERROR(tiered_->GetPages(keys, out, &counts_));
    } else {
      STRATA_RETURN_IF_ERROR(store_->GetPages(keys, out));
      (std::string(store_->tier()) == "remote" ? counts_.remote : counts_.local) += static_cast<int64_t>(keys.size());
    }
    if (out->size() != keys.size()) return absl::InternalError("lazy mount: short GetPages answer");
    for (size_t i = 0; i < keys.size(); ++i) {
      if ((*out)[i] != nullptr) continue;
      const kvstore::PageKey& k = keys[i];
      return absl::DataLossError(absl::StrCat("document ", document_.ToHex(), " page (layer ", k.layer, ", head ",
                                              k.kv_head, ", page ", k.page_index, ") is missing from the store"));
    }
    return absl::OkStatus();
  }
  absl::Status Put(absl::Span<const kvstore::PageWrite>, absl::Span<const kvstore::SummaryWrite>) override {
    return absl::FailedPreconditionError("lazy mount: the page cache's source is read-only");
  }
  absl::Status GetSummaries(absl::Span<const kvstore::SummaryKey> keys, std::vector<kvstore::PageRef>* out) override {
    return store_->GetSummaries(keys, out);
  }
  const kvstore::TierCounts& counts() const { return counts_; }

 private:
  kvstore::PageStore* const store_;
  kvstore::TieredStore* const tiered_;
  const kvstore::DocumentId document_;
  kvstore::TierCounts counts_;
};

// The source of a device-managed cache: every page of the document, peeked from the host tier
// once (HostCache::PeekPages) and served from those references, so that the cache's one lookup
// of each page at Create neither counts as host-tier traffic nor reorders its LRU.
class HeldPagesStore final : public kvstore::PageStore {
 public:
  HeldPagesStore(kvstore::DocumentId document, int num_kv_heads, int64_t num_pages, std::vector<kvstore::PageRef> pages)
      : document_(document), num_kv_heads_(num_kv_heads), num_pages_(num_pages), pages_(std::move(pages)) {}
  const char* tier() const override { return "host"; }
  absl::Status GetPages(absl::Span<const kvstore::PageKey> keys, std::vector<kvstore::PageRef>* out) override {
    out->assign(keys.size(), nullptr);
    for (size_t i = 0; i < keys.size(); ++i) {
      const kvstore::PageKey& k = keys[i];
      if (!(k.document == document_) || k.kv_head >= static_cast<uint32_t>(num_kv_heads_) ||
          static_cast<int64_t>(k.page_index) >= num_pages_) {
        continue;
      }
      const size_t flat = (static_cast<size_t>(k.layer) * num_kv_heads_ + k.kv_head) * num_pages_ + k.page_index;
      if (flat < pages_.size()) (*out)[i] = pages_[flat];
    }
    return absl::OkStatus();
  }
  absl::Status Put(absl::Span<const kvstore::PageWrite>, absl::Span<const kvstore::SummaryWrite>) override {
    return absl::FailedPreconditionError("lazy mount: the page cache's source is read-only");
  }
  absl::Status GetSummaries(absl::Span<const kvstore::SummaryKey> keys, std::vector<kvstore::PageRef>* out) override {
    out->assign(keys.size(), nullptr);
    return absl::OkStatus();
  }
  void Release() { pages_.clear(); }  // the cache holds its own references after Create

 private:
  const kvstore::DocumentId document_;
  const int num_kv_heads_;
  const int64_t num_pages_;
  std::vector<kvstore::PageRef> pages_;  // flat (layer, kv head, page)
};

// Every page of the document in flat (layer, kv head, page) order when `store`'s host tier holds
// all of them in memory of a BackendPageAllocator on `backend` (so the device can read them in
// place); an empty vector otherwise. Stops at the first page that is absent.
std::vector<kvstore::PageRef> PeekWholeDocument(kvstore::PageStore* store, kernels::Backend* backend,
                                                const kvstore::DocumentId& document, int num_layers,
                                                int num_kv_heads, int64_t num_pages,
                                                kvstore::PageAllocator** allocator) {
  auto* tiered = dynamic_cast<kvstore::TieredStore*>(store);
  kvstore::HostCache* host = tiered != nullptr ? tiered->host() : nullptr;
  auto* alloc = host != nullptr ? dynamic_cast<kvstore::BackendPageAllocator*>(host->allocator()) : nullptr;
  if (alloc == nullptr || alloc->backend() != backend) return {};
  std::vector<kvstore::PageRef> all;
  all.reserve(static_cast<size_t>(num_layers) * num_kv_heads * num_pages);
  std::vector<kvstore::PageKey> keys(static_cast<size_t>(num_pages));
  std::vector<kvstore::PageRef> got;
  for (int l = 0; l < num_layers; ++l) {
    for (int g = 0; g < num_kv_heads; ++g) {
      for (int64_t p = 0; p < num_pages; ++p) {
        keys[static_cast<size_t>(p)] =
            kvstore::PageKey{document, static_cast<uint32_t>(l), static_cast<uint32_t>(g), static_cast<uint32_t>(p)};
      }
      host->PeekPages(keys, &got);
      for (const kvstore::PageRef& r : got) {
        if (r == nullptr || r->allocator() != alloc) return {};
        all.push_back(r);
      }
    }
  }
  *allocator = alloc;
  return all;
}

}  // namespace

struct LazyDocumentShare::Impl {
  // What a share is made for: the document and shapes of its first job (every later job must match).
  struct Key {
    kvstore::DocumentId document;
    int64_t document_tokens;
    int page_size, num_layers, num_kv_heads, head_dim;
    uint32_t summary_kind;
    kernels::DType summary_dtype;
    kernels::Backend* backend;
    bool operator==(const Key& k) const {
      return document == k.document && document_tokens == k.document_tokens && page_size == k.page_size &&
             num_layers == k.num_layers && num_kv_heads == k.num_kv_heads && head_dim == k.head_dim &&
             summary_kind == k.summary_kind && summary_dtype == k.summary_dtype && backend == k.backend;
    }
  };
  std::mutex mu;
  std::optional<Key> key;  // set by the first job
  std::vector<std::unique_ptr<kernels::Buffer>> summaries;  // per layer, null until loaded
  int64_t summary_bytes = 0;
  // The summaries on the host, read once for the jobs' host choosers and the device upload.
  std::shared_ptr<engine::MinMaxSummaryCache> host_summaries;
  std::unique_ptr<HeldPagesStore> held;           // resident mode: what the cache's Create read
  std::unique_ptr<kvstore::GpuPageCache> cache;   // resident mode: the device-managed cache
  int64_t synced_fills = 0;                       // cache fills as of the last SyncStats
};

int64_t AutoCachePages(int num_layers, int64_t per_call) {
  return std::max(kAutoCacheMinPages, kAutoCacheSteps * std::max(num_layers, 0) * std::max<int64_t>(per_call, 0));
}

LazyDocumentShare::LazyDocumentShare() : impl_(std::make_unique<Impl>()) {}
LazyDocumentShare::~LazyDocumentShare() {
  if (impl_ == nullptr) return;
  impl_->cache.reset();  // before the source it was made from
  impl_->held.reset();
}
bool LazyDocumentShare::resident() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->cache != nullptr;
}
int64_t LazyDocumentShare::summary_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->summary_bytes;
}
int64_t LazyDocumentShare::device_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  int64_t bytes = impl_->summary_bytes;
  if (impl_->cache != nullptr) bytes += impl_->cache->page_bytes() * impl_->cache->options().num_slots;
  return bytes;
}

struct LazyDocumentAttention::State {
  LazyAttentionOptions o;
  kernels::Backend* backend = nullptr;
  int64_t num_pages = 0;       // per (layer, KV head)
  int64_t window_first = 1;    // first window page
  int64_t k = 0;               // middle pages chosen per head
  std::unique_ptr<TierCountingStore> source;
  // Summaries and, in resident mode, the device-managed cache: shared with the document's other
  // jobs (LazyAttentionOptions::share) or private.
  std::shared_ptr<LazyDocumentShare> share;
  // Resident mode: `cache` is the share's device-managed cache; the pages this job filled from the
  // host tier (SyncStats: the cache's fills since the share's last sync before this job).
  bool managed = false;
  int64_t start_fills = 0;
  kvstore::TierCounts managed_counts;
  std::unique_ptr<kvstore::GpuPageCache> own_cache;  // host-managed: this job's cache
  kvstore::GpuPageCache* cache = nullptr;            // own_cache or the share's
  double setup_seconds = 0;  // Create: the residency check, the cache, the summaries
  engine::PageChooser host_chooser;
  std::unique_ptr<engine::GpuCacheAttention> hook;
  engine::SelectionCounters counters;
  int64_t device_choices = 0;
  // Device chooser: scores, the selection and its host copy (the layers' summaries [hkv, pages,
  // 2 d] f32 are in the share, loaded on first use).
  std::unique_ptr<kernels::Buffer> scores, selected;
  std::vector<int32_t> host_selected;
  // The device chooser's selection cache (LazyAttentionOptions::cache_theta <= 1): the layers'
  // kept selections replace `selected` for one-token choices.
  std::unique_ptr<engine::DeviceSelectionCache> selection_cache;
  int64_t synced_cache_hits = 0, synced_cache_lookups = 0;  // of selection_cache, in `counters`
  // The device chooser's chunk query (a prompt chunk's mean query), made on first use.
  std::unique_ptr<engine::DeviceQueryMean> query_mean;

  // Whether a choice has middle pages to pick: candidates [1, window_first) and a budget.
  bool HasMiddle() const { return k > 0 && window_first > 1; }
  int32_t PageTokens(int64_t p) const {
    return static_cast<int32_t>(std::min<int64_t>(o.page_size, o.document_tokens - p * o.page_size));
  }
  void Count(const std::vector<int32_t>& pages) {
    counters.candidate_tokens += o.document_tokens;
    for (int32_t p : pages) counters.selected_tokens += PageTokens(p);
  }
  // The summaries of `layer` in backend memory, read from the store and uploaded on first use
  // by any job of the share. The buffer lives as long as the share. `assembled`: the layer's
  // AssembleSummaries, when the caller made it already (otherwise made here, under the share's lock).
  absl::StatusOr<kernels::Buffer*> Summaries(int layer, std::vector<uint8_t>* assembled = nullptr);
  // The summaries of `layer` as the device keeps them, [hkv, pages, 2 d] in o.summary_dtype, from
  // the share's host summaries (thread-safe; no lock of the share held).
  absl::StatusOr<std::vector<uint8_t>> AssembleSummaries(int layer);
  absl::Status ChooseOnDevice(int layer, const kernels::TensorView& q, std::vector<std::vector<int32_t>>* pages,
                              engine::DeviceTokenSelection* selection);
  // The device selection of a one-token choice for a device-managed cache: page 0, the `selected`
  // middle pages (token ids through fanout page_size; none when `middle` is false) and the
  // window pages; with `count`, counts the tokens they name per KV head (every middle page is
  // full, and EnqueueMinMaxPageTopK keeps k <= window_first - 1 distinct valid pages).
  void FillSelection(bool middle, const kernels::TensorView& chosen, engine::DeviceTokenSelection* selection,
                     bool count);
  // The counters of one token's device choice (FillSelection with count).
  void CountOneToken(bool middle);
  // Backend buffers of the device chooser (scores [hq, middle candidates], the selection [hkv, k],
  // the selection cache).
  absl::Status EnsureChooserBuffers(int hq);
  // Counts the selection-cache lookups of `checks` replayed one-token choices.
  void CountReplayedChecks(int64_t checks) {
    if (selection_cache != nullptr) selection_cache->CountChecks(checks);
  }
  // A prompt chunk selects without the selection cache: the layer's next one-token choice selects.
  absl::Status InvalidateSelectionCache(int layer) {
    return selection_cache != nullptr ? selection_cache->Invalidate(layer, nullptr) : absl::OkStatus();
  }
};

void LazyDocumentAttention::State::CountOneToken(bool middle) {
  const int64_t P = o.page_size;
  const int64_t prefix_end = std::min<int64_t>(o.document_tokens, P);
  const int64_t suffix_begin = std::min<int64_t>(window_first * P, o.document_tokens);
  const int64_t per_head = prefix_end + (middle ? k * P : 0) + (o.document_tokens - suffix_begin);
  counters.candidate_tokens += o.num_kv_heads * o.document_tokens;
  counters.selected_tokens += o.num_kv_heads * per_head;
}

void LazyDocumentAttention::State::FillSelection(bool middle, const kernels::TensorView& chosen,
                                                 engine::DeviceTokenSelection* sel, bool count) {
  const int64_t P = o.page_size;
  sel->valid = true;
  sel->prefix_end = std::min<int64_t>(o.document_tokens, P);
  if (middle) {
    sel->middle.parents = chosen;
    sel->middle.fanout = static_cast<int>(P);
  }
  sel->middle.begin = P;
  sel->middle.end = middle ? window_first * P : P;
  sel->suffix_begin = std::min<int64_t>(window_first * P, o.document_tokens);
  sel->suffix_end = o.document_tokens;
  if (count) CountOneToken(middle);
}

absl::Status LazyDocumentAttention::State::EnsureChooserBuffers(int hq) {
  const int64_t n = window_first - 1;
  const size_t score_bytes = static_cast<size_t>(hq) * std::max<int64_t>(n, 0) * sizeof(float);
  if (score_bytes > 0 && (scores == nullptr || scores->bytes() < score_bytes)) {
    STRATA_ASSIGN_OR_RETURN(scores, backend->Allocate(score_bytes));
  }
  if (selected == nullptr && k > 0) {
    STRATA_ASSIGN_OR_RETURN(selected, backend->Allocate(static_cast<size_t>(o.num_kv_heads) * k * sizeof(int32_t)));
  }
  if (selection_cache == nullptr && k > 0 && o.cache_theta <= 1.0) {
    STRATA_ASSIGN_OR_RETURN(selection_cache,
                            engine::DeviceSelectionCache::Create(backend, o.num_layers, o.num_kv_heads,
                                                                 hq / o.num_kv_heads, o.head_dim, k, o.cache_theta));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> LazyDocumentAttention::State::AssembleSummaries(int layer) {
  engine::MinMaxSummaryCache* host_summaries = share->impl_->host_summaries.get();  // set at creation
  const int hkv = o.num_kv_heads, d = o.head_dim;
  const size_t head_floats = static_cast<size_t>(num_pages) * 2 * d;
  const bool bf16 = o.summary_dtype == kernels::DType::kBF16;
  std::vector<uint8_t> out(static_cast<size_t>(hkv) * head_floats * (bf16 ? sizeof(uint16_t) : sizeof(float)));
  for (int g = 0; g < hkv; ++g) {  // [hkv, pages, 2 d], each head read once for the share
    STRATA_ASSIGN_OR_RETURN(const std::vector<float>* head, host_summaries->Get(layer, g));
    if (bf16) {
      // The host cache already rounded every row outward, so the conversion is exact.
      kernels::ConvertFromF32(head->data(), reinterpret_cast<uint16_t*>(out.data()) + g * head_floats,
                              kernels::DType::kBF16, static_cast<int64_t>(head_floats));
    } else {
      std::memcpy(out.data() + g * head_floats * sizeof(float), head->data(), head_floats * sizeof(float));
    }
  }
  return out;
}

absl::StatusOr<kernels::Buffer*> LazyDocumentAttention::State::Summaries(int layer, std::vector<uint8_t>* assembled) {
  LazyDocumentShare::Impl& sh = *share->impl_;
  std::lock_guard<std::mutex> lock(sh.mu);
  if (sh.summaries[layer] != nullptr) return sh.summaries[layer].get();
  std::vector<uint8_t> made;
  if (assembled == nullptr) {
    STRATA_ASSIGN_OR_RETURN(made, AssembleSummaries(layer));
    assembled = &made;
  }
  const size_t bytes = assembled->size();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> buffer, backend->Allocate(bytes));
  STRATA_RETURN_IF_ERROR(backend->CopyToDevice(buffer->data(), assembled->data(), bytes, nullptr));
  sh.summary_bytes += static_cast<int64_t>(bytes);
  sh.summaries[layer] = std::move(buffer);
  return sh.summaries[layer].get();
}

absl::Status LazyDocumentAttention::State::ChooseOnDevice(int layer, const kernels::TensorView& q,
                                                          std::vector<std::vector<int32_t>>* pages,
                                                          engine::DeviceTokenSelection* selection) {
  const int hkv = o.num_kv_heads, d = o.head_dim;
  if (layer < 0 || layer >= o.num_layers || q.rank != 3 || q.dim(2) != d || q.dim(1) % hkv != 0 ||
      (pages != nullptr && static_cast<int>(pages->size()) != hkv) || (pages == nullptr && selection == nullptr)) {
    return absl::InvalidArgumentError("lazy mount: device chooser called with a bad layer or query shape");
  }
  const int num_tokens = static_cast<int>(q.dim(0));
  const int hq = static_cast<int>(q.dim(1));
  // A prompt chunk chooses once, on the device, with its mean query (engine/query_mean.h; the host
  // chooser does the same), without the selection cache, whose layer entries it invalidates; with
  // a device-managed cache its selection serves every token of the chunk
  // (GpuCacheAttentionOptions::chunk_selection).
  const bool chunk = num_tokens != 1;
  const int64_t n = window_first - 1;  // middle candidates [1, window_first)
  const int group = hq / hkv;
  kernels::TensorView chosen;
  if (HasMiddle()) {
    STRATA_ASSIGN_OR_RETURN(kernels::Buffer* layer_summaries, Summaries(layer));
    STRATA_RETURN_IF_ERROR(EnsureChooserBuffers(hq));
    kernels::TensorView q2(q.data, kernels::DType::kF32, {hq, d});
    const kernels::TensorView sums =
        layer_summaries->View(o.summary_dtype, {hkv, num_pages, 2 * d});
    const kernels::TensorView sc = scores->View(kernels::DType::kF32, {hkv, group, n});
    if (chunk) {
      if (query_mean == nullptr) query_mean = std::make_unique<engine::DeviceQueryMean>(backend, hq, d);
      STRATA_ASSIGN_OR_RETURN(q2, query_mean->Mean(q, nullptr));
      STRATA_RETURN_IF_ERROR(InvalidateSelectionCache(layer));
    }
    if (!chunk && selection_cache != nullptr) {
      // The selection cache's check in the selection op (on CUDA inside its kernel).
      STRATA_ASSIGN_OR_RETURN(chosen, engine::EnqueueCachedMinMaxPageTopK(
                                          backend, q2, sums, window_first, k, sc,
                                          *selection_cache, layer));
    } else {
      chosen = selected->View(kernels::DType::kI32, {hkv, k});
      STRATA_RETURN_IF_ERROR(
          engine::EnqueueMinMaxPageTopK(backend, q2, sums, window_first, k, sc, chosen));
    }
  } else if (chunk) {
    STRATA_RETURN_IF_ERROR(InvalidateSelectionCache(layer));
  }
  if (!chunk) ++device_choices;
  if (pages == nullptr) {
    // Device-managed cache: the selection stays on the device (nothing read on the host).
    FillSelection(HasMiddle(), chosen, selection, /*count=*/true);
    return absl::OkStatus();
  }
  if (HasMiddle()) {
    host_selected.resize(static_cast<size_t>(hkv) * k);
    STRATA_RETURN_IF_ERROR(
        backend->CopyToHost(host_selected.data(), chosen.data, host_selected.size() * sizeof(int32_t), nullptr));
  } else {
    host_selected.assign(static_cast<size_t>(hkv) * std::max<int64_t>(k, 0), -1);
  }
  for (int g = 0; g < hkv; ++g) {
    std::vector<int32_t>& out = (*pages)[g];
    engine::AppendChosenPages(host_selected.data() + static_cast<size_t>(g) * k, k, window_first, num_pages, &out);
    Count(out);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LazyDocumentAttention>> LazyDocumentAttention::Create(const LazyAttentionOptions& o,
                                                                                    kernels::Backend* backend) {
  if (o.store == nullptr || backend == nullptr) {
    return absl::InvalidArgumentError("LazyDocumentAttention: store and backend are required");
  }
  if (o.document_tokens <= 0 || o.page_size <= 0 || o.num_layers <= 0 || o.num_kv_heads <= 0 ||
      o.num_kv_heads > 4096 || o.head_dim <= 0 || o.capacity_pages < 0 || o.budget_pages < 0 || o.window_pages < 0) {
    return absl::InvalidArgumentError("LazyDocumentAttention: non-positive sizes");
  }
  if (o.summary_dtype != kernels::DType::kF32 && o.summary_dtype != kernels::DType::kBF16) {
    return absl::InvalidArgumentError("LazyDocumentAttention: summary_dtype must be f32 or bf16");
  }
  if (!(o.cache_theta > 0.0)) {
    return absl::InvalidArgumentError("LazyDocumentAttention: cache_theta must be > 0 (> 1: no selection cache)");
  }
  auto st = std::make_unique<State>();
  st->o = o;
  st->backend = backend;
  st->num_pages = (o.document_tokens + o.page_size - 1) / o.page_size;
  st->window_first = std::max<int64_t>(1, st->num_pages - o.window_pages);
  st->k = std::min<int64_t>(o.budget_pages, st->window_first - 1);
  st->source = std::make_unique<TierCountingStore>(o.store, o.document);

  const int64_t total = static_cast<int64_t>(o.num_layers) * o.num_kv_heads * st->num_pages;
  const bool device = o.device_path < 0 ? backend->Name() != "cpu" : o.device_path > 0;
  const int64_t per_call =
      static_cast<int64_t>(o.num_kv_heads) *
      std::min<int64_t>(st->num_pages, 1 + static_cast<int64_t>(o.budget_pages) + o.window_pages);
  kvstore::GpuCacheOptions go;
  go.document = o.document;
  go.num_layers = o.num_layers;
  go.num_kv_heads = o.num_kv_heads;
  go.pages_per_head = st->num_pages;
  go.page_size = o.page_size;
  go.head_dim = o.head_dim;
  const int64_t capacity = o.capacity_pages > 0 ? o.capacity_pages : AutoCachePages(o.num_layers, per_call);
  go.num_slots = std::max(std::min(capacity, total), per_call);
  go.max_batch_pages = static_cast<int>(std::min<int64_t>(1024, go.num_slots));
  go.source = st->source.get();
  go.metrics = o.metrics;
  go.additive_gauges = true;

  const Stopwatch setup;
  double peek_seconds = 0, cache_seconds = 0, summary_seconds = 0;  // resident mode's first job
  st->share = o.share != nullptr ? o.share : std::make_shared<LazyDocumentShare>();
  {
    LazyDocumentShare::Impl& sh = *st->share->impl_;
    std::lock_guard<std::mutex> lock(sh.mu);
    const LazyDocumentShare::Impl::Key key{o.document,     o.document_tokens, o.page_size,
                                           o.num_layers,   o.num_kv_heads,    o.head_dim,
                                           o.summary_kind, o.summary_dtype,   backend};
    if (!sh.key.has_value()) {
      sh.key = key;
      sh.summaries.resize(static_cast<size_t>(o.num_layers));
      sh.host_summaries = std::make_shared<engine::MinMaxSummaryCache>(
          o.store, o.document, o.summary_kind, o.num_layers, o.num_kv_heads, o.head_dim, st->num_pages,
          /*bf16_bounds=*/o.summary_dtype == kernels::DType::kBF16);
    } else if (!(*sh.key == key)) {
      return absl::InvalidArgumentError("LazyDocumentAttention: the share belongs to another document or shape");
    }
    // The host chooser (every call of the host path) reads the share's summaries.
    engine::MinMaxChooserOptions co;
    co.num_layers = o.num_layers;
    co.num_kv_heads = o.num_kv_heads;
    co.head_dim = o.head_dim;
    co.num_pages = st->num_pages;
    co.budget_pages = o.budget_pages;
    co.window_pages = o.window_pages;
    co.summaries = sh.host_summaries;
    co.cache_theta = o.cache_theta;
    co.cache_counters = &st->counters;
    st->host_chooser = engine::MakeMinMaxChooser(co);
    // Resident mode: the share's device-managed cache when it has one large enough for this job's
    // calls; otherwise, when the host tier holds the whole document where the device can read
    // it, a new one for the share.
    if (device && o.device_managed != 0) {
      if (sh.cache == nullptr) {
        kvstore::PageAllocator* in_place = nullptr;
        const Stopwatch peek;
        std::vector<kvstore::PageRef> all =
            PeekWholeDocument(o.store, backend, o.document, o.num_layers, o.num_kv_heads, st->num_pages, &in_place);
        peek_seconds = peek.ElapsedSeconds();
        if (static_cast<int64_t>(all.size()) == total) {
          const Stopwatch made_in;
          sh.held = std::make_unique<HeldPagesStore>(o.document, o.num_kv_heads, st->num_pages, std::move(all));
          kvstore::GpuCacheOptions mo = go;
          mo.source = sh.held.get();
          mo.hold_source_pages = true;
          mo.in_place_allocator = in_place;
          mo.device_managed = true;
          absl::StatusOr<std::unique_ptr<kvstore::GpuPageCache>> made = kvstore::GpuPageCache::Create(mo, backend);
          sh.held->Release();  // the cache holds the pages now (or failed)
          if (!made.ok()) return made.status();
          sh.cache = *std::move(made);
          sh.synced_fills = 0;
          cache_seconds = made_in.ElapsedSeconds();
        }
      }
      if (sh.cache != nullptr && sh.cache->options().num_slots >= per_call) {
        st->managed = true;
        st->cache = sh.cache.get();
        st->start_fills = sh.synced_fills;
      } else if (o.device_managed > 0) {
        return absl::FailedPreconditionError(
            sh.cache == nullptr
                ? "LazyDocumentAttention: device_managed needs every page of the document in the host tier, in "
                  "memory of a BackendPageAllocator on this backend"
                : "LazyDocumentAttention: the share's device-managed cache has fewer slots than one call needs");
      }
    } else if (o.device_managed > 0) {
      return absl::FailedPreconditionError("LazyDocumentAttention: device_managed needs the device path");
    }
  }
  if (!st->managed) {
    STRATA_ASSIGN_OR_RETURN(st->own_cache, kvstore::GpuPageCache::Create(go, backend));
    st->cache = st->own_cache.get();
  }

  engine::GpuCacheAttentionOptions ao;
  ao.document_tokens = o.document_tokens;
  ao.max_pages_per_chunk = 0;  // the cache's slots: one chunk per call (slots >= one call's need)
  State* s = st.get();
  ao.chooser = [s](int layer, int kv_head, const float* q, int num_tokens, int num_q_heads,
                   std::vector<int32_t>* pages) -> absl::Status {
    STRATA_RETURN_IF_ERROR(s->host_chooser(layer, kv_head, q, num_tokens, num_q_heads, pages));
    s->Count(*pages);
    return absl::OkStatus();
  };
  ao.device_path = device;
  ao.chunk_selection = st->managed;  // a prompt chunk: one device choice for all its tokens
  if (device) {
    ao.device_chooser = [s](int layer, const kernels::TensorView& q, std::vector<std::vector<int32_t>>* pages,
                            engine::DeviceTokenSelection* selection) {
      return s->ChooseOnDevice(layer, q, pages, selection);
    };
    if (st->managed && st->HasMiddle()) {
      // Every layer's summaries up front: a decode step then queues device work only. The reads
      // from the store (most of the time at long documents) run in parallel over (layer, head).
      const Stopwatch sums;
      std::shared_ptr<engine::MinMaxSummaryCache> host = st->share->impl_->host_summaries;
      const int64_t entries = static_cast<int64_t>(o.num_layers) * o.num_kv_heads;
      std::vector<absl::Status> read(static_cast<size_t>(entries));
#pragma omp parallel for schedule(dynamic) num_threads(internal::HostTeam(entries))
      for (int64_t i = 0; i < entries; ++i) {
        read[static_cast<size_t>(i)] =
            host->Get(static_cast<int>(i / o.num_kv_heads), static_cast<int>(i % o.num_kv_heads)).status();
      }
      for (const absl::Status& s : read) STRATA_RETURN_IF_ERROR(s);
      // Each layer's device form assembled in parallel (conversion to bf16: most of the host
      // work), uploaded one at a time under the share's lock.
      std::vector<absl::Status> uploaded(static_cast<size_t>(o.num_layers));
#pragma omp parallel for schedule(dynamic) num_threads(internal::HostTeam(o.num_layers))
      for (int l = 0; l < o.num_layers; ++l) {
        absl::StatusOr<std::vector<uint8_t>> layer = st->AssembleSummaries(l);
        uploaded[static_cast<size_t>(l)] = layer.ok() ? st->Summaries(l, &*layer).status() : layer.status();
      }
      for (const absl::Status& s : uploaded) STRATA_RETURN_IF_ERROR(s);
      summary_seconds = sums.ElapsedSeconds();
    }
  }
  STRATA_ASSIGN_OR_RETURN(st->hook, engine::GpuCacheAttention::Create(ao, st->cache, backend));
  st->setup_seconds = setup.ElapsedSeconds();
  if (cache_seconds > 0) {
    STRATA_LOG(INFO) << "lazy mount: device-managed cache for document " << o.document.ToHex() << " made in "
                     << st->setup_seconds << " s (" << total << " host-tier pages peeked in " << peek_seconds
                     << " s, cache " << cache_seconds << " s, summaries of " << o.num_layers << " layers "
                     << summary_seconds << " s)";
  }
  return std::unique_ptr<LazyDocumentAttention>(new LazyDocumentAttention(std::move(st)));
}

LazyDocumentAttention::LazyDocumentAttention(std::unique_ptr<State> state) : state_(std::move(state)) {}

LazyDocumentAttention::~LazyDocumentAttention() {
  if (state_ == nullptr) return;
  // The hook and the cache go before the source they read from.
  state_->hook.reset();
  state_->own_cache.reset();
}

absl::Status LazyDocumentAttention::Attend(int layer, const float* q, int num_tokens, int num_q_heads,
                                           int64_t q_begin, std::vector<engine::AttentionPartial>* parts) {
  const LazyAttentionOptions& o = state_->o;
  if (layer < 0 || layer >= o.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("LazyDocumentAttention: layer ", layer, " out of range"));
  }
  return state_->hook->Attend(layer, q, num_tokens, num_q_heads, q_begin, parts);
}

bool LazyDocumentAttention::AttendsOnDevice() const { return state_->hook->AttendsOnDevice(); }
bool LazyDocumentAttention::CapturableOnDevice() const { return state_->hook->CapturableOnDevice(); }
bool LazyDocumentAttention::device_managed() const { return state_->managed; }
double LazyDocumentAttention::setup_seconds() const { return state_->setup_seconds; }

absl::Status LazyDocumentAttention::SyncStats() {
  State& s = *state_;
  if (s.selection_cache != nullptr) {  // the device chooser's selection cache since the last sync
    STRATA_ASSIGN_OR_RETURN(const int64_t hits, s.selection_cache->ReadHits(nullptr));
    const int64_t lookups = s.selection_cache->lookups();
    s.counters.cache_hits += hits - s.synced_cache_hits;
    s.counters.cache_lookups += lookups - s.synced_cache_lookups;
    s.synced_cache_hits = hits;
    s.synced_cache_lookups = lookups;
  }
  if (!state_->managed) return absl::OkStatus();
  LazyDocumentShare::Impl& sh = *state_->share->impl_;
  std::lock_guard<std::mutex> lock(sh.mu);
  STRATA_RETURN_IF_ERROR(state_->cache->SyncDeviceStats());
  // Every fill read a host-tier page. Exact while the share's jobs run one after another; jobs
  // running at once on the document count each other's fills too.
  sh.synced_fills = state_->cache->stats().fills;
  state_->managed_counts.host = sh.synced_fills - state_->start_fills;
  return absl::OkStatus();
}

absl::Status LazyDocumentAttention::AttendOnDevice(int layer, const kernels::TensorView& q, int64_t q_begin,
                                                   const kernels::TensorView& out, const kernels::TensorView& lse) {
  if (layer < 0 || layer >= state_->o.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("LazyDocumentAttention: layer ", layer, " out of range"));
  }
  return state_->hook->AttendOnDevice(layer, q, q_begin, out, lse);
}

absl::Status LazyDocumentAttention::PrepareCapture(int num_q_heads) {
  State& s = *state_;
  if (!s.managed) return absl::FailedPreconditionError("LazyDocumentAttention: graph mode needs resident mode");
  // Create uploaded every layer's summaries (resident mode); the chooser's buffers are sized by
  // the query heads, known only here.
  return s.HasMiddle() ? s.EnsureChooserBuffers(num_q_heads) : absl::OkStatus();
}

void LazyDocumentAttention::OnReplayedStep(int64_t /*q_begin*/) {
  State& s = *state_;
  for (int l = 0; l < s.o.num_layers; ++l) {
    s.CountOneToken(s.HasMiddle());
    ++s.device_choices;
  }
  if (s.HasMiddle()) s.CountReplayedChecks(s.o.num_layers);
}

const kvstore::TierCounts& LazyDocumentAttention::pages() const {
  return state_->managed ? state_->managed_counts : state_->source->counts();
}
int64_t LazyDocumentAttention::cache_hits() const { return state_->cache->stats().hits; }
int64_t LazyDocumentAttention::cache_misses() const {
  const kvstore::GpuCacheStats s = state_->cache->stats();
  return s.lookups - s.hits;
}
const engine::SelectionCounters& LazyDocumentAttention::counters() const { return state_->counters; }
int64_t LazyDocumentAttention::slots() const { return state_->cache->options().num_slots; }
int64_t LazyDocumentAttention::device_choices() const { return state_->device_choices; }
const kvstore::GpuPageCache& LazyDocumentAttention::cache() const { return *state_->cache; }

}  // namespace strata::worker
