#include "engine/gpu_cache_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "engine/query_mean.h"
#include "kernels/vote_rank.h"

namespace strata::engine {

absl::StatusOr<std::unique_ptr<GpuCacheAttention>> GpuCacheAttention::Create(
    const GpuCacheAttentionOptions& options, kvstore::GpuPageCache* cache,
    kernels::Backend* backend) {
  if (cache == nullptr || backend == nullptr) {
    return absl::InvalidArgumentError("GpuCacheAttention: null cache or backend");
  }
  const kvstore::GpuCacheOptions& c = cache->options();
  if (options.document_tokens <= 0 ||
      options.document_tokens > c.pages_per_head * static_cast<int64_t>(c.page_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GpuCacheAttention: document_tokens ", options.document_tokens, " outside [1, ",
        c.pages_per_head * c.page_size, "] (the cache's page table)"));
  }
  if (options.max_pages_per_chunk < 0) {
    return absl::InvalidArgumentError("GpuCacheAttention: max_pages_per_chunk < 0");
  }
  if (c.device_managed && (!options.device_path || !options.device_chooser || c.stream != nullptr)) {
    return absl::InvalidArgumentError(
        "GpuCacheAttention: a device-managed cache needs device_path, a device_chooser and the "
        "cache on the default stream");
  }
  return std::unique_ptr<GpuCacheAttention>(new GpuCacheAttention(options, cache, backend));
}

namespace {

absl::Status Grow(kernels::Backend* backend, size_t bytes, std::unique_ptr<kernels::Buffer>* buf) {
  if (*buf != nullptr && (*buf)->bytes() >= bytes) return absl::OkStatus();
  STRATA_ASSIGN_OR_RETURN(*buf, backend->Allocate(bytes));
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuCacheAttention::ChoosePages(int layer, const float* q_host,
                                            const kernels::TensorView* q_device, int num_tokens,
                                            int num_q_heads,
                                            std::vector<kvstore::GpuPageId>* ids,
                                            DeviceTokenSelection* selection) {
  const int hkv = cache_->options().num_kv_heads;
  const int64_t num_pages =
      (options_.document_tokens + cache_->options().page_size - 1) / cache_->options().page_size;
  ids->clear();
  head_pages_.resize(hkv);
  for (std::vector<int32_t>& v : head_pages_) v.clear();
  DeviceTokenSelection unused;
  if (q_device != nullptr && options_.device_chooser) {
    STRATA_RETURN_IF_ERROR(options_.device_chooser(
        layer, *q_device, &head_pages_, selection != nullptr ? selection : &unused));
    if (static_cast<int>(head_pages_.size()) != hkv) {
      return absl::InvalidArgumentError(absl::StrCat("GpuCacheAttention: device chooser returned ",
                                                     head_pages_.size(), " heads of ", hkv));
    }
  } else {
    for (int g = 0; g < hkv; ++g) {
      if (options_.chooser) {
        STRATA_RETURN_IF_ERROR(
            options_.chooser(layer, g, q_host, num_tokens, num_q_heads, &head_pages_[g]));
      } else {
        for (int64_t p = 0; p < num_pages; ++p) head_pages_[g].push_back(static_cast<int32_t>(p));
      }
    }
  }
  for (int g = 0; g < hkv; ++g) {
    for (int32_t p : head_pages_[g]) {
      if (p < 0 || p >= num_pages) {
        return absl::InvalidArgumentError(
            absl::StrCat("GpuCacheAttention: chooser picked page ", p, " of ", num_pages));
      }
      ids->push_back(kvstore::GpuPageId{layer, g, p});
    }
  }
  return absl::OkStatus();
}

absl::Status GpuCacheAttention::AttendChunk(absl::Span<const kvstore::GpuPageId> part,
                                            const std::vector<int32_t>& slots,
                                            const kernels::TensorView& q,
                                            const int32_t* positions,
                                            const kernels::TensorView& out,
                                            const kernels::TensorView& lse) {
  const kvstore::GpuCacheOptions& c = cache_->options();
  const int hkv = c.num_kv_heads, P = c.page_size;
  spans_.clear();
  offsets_.assign(hkv + 1, 0);
  size_t j = 0;
  for (int g = 0; g < hkv; ++g) {
    offsets_[g] = static_cast<int32_t>(spans_.size());
    for (; j < part.size() && part[j].kv_head == g; ++j) {
      const int64_t first = static_cast<int64_t>(part[j].page) * P;
      const int32_t len =
          static_cast<int32_t>(std::min<int64_t>(P, options_.document_tokens - first));
      spans_.push_back(kernels::KvSpan{slots[j], 0, len, static_cast<int32_t>(first)});
    }
  }
  offsets_[hkv] = static_cast<int32_t>(spans_.size());
  kernels::PagedAttentionParams a;
  a.q = q;
  a.k_pool = cache_->k_pool();
  a.v_pool = cache_->v_pool();
  a.spans = spans_.data();
  a.span_offsets = offsets_.data();
  a.num_kv_heads = hkv;
  a.q_positions = positions;
  a.causal = true;
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.out = out;
  a.lse = lse;
  return backend_->PagedAttention(a, nullptr);
}

absl::Status GpuCacheAttention::Attend(int layer, const float* q, int num_tokens, int num_q_heads,
                                       int64_t q_begin, std::vector<AttentionPartial>* parts) {
  const kvstore::GpuCacheOptions& c = cache_->options();
  const int hkv = c.num_kv_heads, d = c.head_dim;
  if (num_tokens < 1 || num_q_heads <= 0 || num_q_heads % hkv != 0 || q == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("GpuCacheAttention: ", num_q_heads,
                                                   " query heads for ", hkv, " KV heads"));
  }
  if (q_begin < options_.document_tokens) {
    return absl::InvalidArgumentError("GpuCacheAttention: queries inside the document");
  }
  ++counters_.calls;

  // The pages of every head, in head order.
  std::vector<kvstore::GpuPageId> ids;
  STRATA_RETURN_IF_ERROR(ChoosePages(layer, q, nullptr, num_tokens, num_q_heads, &ids));

  // Host q into backend memory once; outputs per chunk come back to the partials.
  const size_t q_floats = static_cast<size_t>(num_tokens) * num_q_heads * d;
  const size_t lse_floats = static_cast<size_t>(num_tokens) * num_q_heads;
  STRATA_RETURN_IF_ERROR(Grow(backend_, q_floats * sizeof(float), &q_buf_));
  STRATA_RETURN_IF_ERROR(Grow(backend_, q_floats * sizeof(float), &out_buf_));
  STRATA_RETURN_IF_ERROR(Grow(backend_, lse_floats * sizeof(float), &lse_buf_));
  STRATA_RETURN_IF_ERROR(
      backend_->CopyToDevice(q_buf_->data(), q, q_floats * sizeof(float), nullptr));
  std::vector<int32_t> positions(num_tokens);
  for (int i = 0; i < num_tokens; ++i) positions[i] = static_cast<int32_t>(q_begin + i);

  const int64_t chunk =
      options_.max_pages_per_chunk > 0 ? options_.max_pages_per_chunk : c.num_slots;
  parts->clear();
  std::vector<int32_t> slots;
  for (size_t begin = 0; begin < ids.size(); begin += static_cast<size_t>(chunk)) {
    const size_t end = std::min(ids.size(), begin + static_cast<size_t>(chunk));
    const absl::Span<const kvstore::GpuPageId> part(ids.data() + begin, end - begin);
    STRATA_RETURN_IF_ERROR(cache_->Acquire(part, kvstore::MissPolicy::kWait, &slots));
    absl::Status s = AttendChunk(
        part, slots, q_buf_->View(kernels::DType::kF32, {num_tokens, num_q_heads, d}),
        positions.data(), out_buf_->View(kernels::DType::kF32, {num_tokens, num_q_heads, d}),
        lse_buf_->View(kernels::DType::kF32, {num_tokens, num_q_heads}));
    AttentionPartial p;
    if (s.ok()) {
      p.o.resize(q_floats);
      p.lse.resize(lse_floats);
      // CopyToHost waits for the attention, so the pins may go afterwards.
      s = backend_->CopyToHost(p.o.data(), out_buf_->data(), q_floats * sizeof(float), nullptr);
      if (s.ok()) {
        s = backend_->CopyToHost(p.lse.data(), lse_buf_->data(), lse_floats * sizeof(float),
                                 nullptr);
      }
    }
    const absl::Status r = cache_->Release(slots);
    STRATA_RETURN_IF_ERROR(s);
    STRATA_RETURN_IF_ERROR(r);
    parts->push_back(std::move(p));
    ++counters_.chunks;
    counters_.pages_attended += static_cast<int64_t>(part.size());
  }
  return absl::OkStatus();
}

absl::Status GpuCacheAttention::AttendOnDevice(int layer, const kernels::TensorView& q,
                                               int64_t q_begin, const kernels::TensorView& out,
                                               const kernels::TensorView& lse) {
  if (!options_.device_path) {
    return absl::FailedPreconditionError("GpuCacheAttention: device_path is off");
  }
  const kvstore::GpuCacheOptions& c = cache_->options();
  const int hkv = c.num_kv_heads, d = c.head_dim;
  if (q.data == nullptr || q.dtype != kernels::DType::kF32 || q.rank != 3 || q.dim(2) != d ||
      q.dim(0) < 1 || q.dim(1) < 1 || q.dim(1) % hkv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GpuCacheAttention: q must be f32 [tokens, heads (a multiple of ", hkv, "), ", d, "]"));
  }
  const int num_tokens = static_cast<int>(q.dim(0));
  const int num_q_heads = static_cast<int>(q.dim(1));
  if (out.data == nullptr || out.dtype != kernels::DType::kF32 || out.rank != 3 ||
      out.dim(0) != num_tokens || out.dim(1) != num_q_heads || out.dim(2) != d ||
      lse.data == nullptr || lse.dtype != kernels::DType::kF32 || lse.rank != 2 ||
      lse.dim(0) != num_tokens || lse.dim(1) != num_q_heads) {
    return absl::InvalidArgumentError("GpuCacheAttention: out / lse do not match q");
  }
  if (q_begin < options_.document_tokens) {
    return absl::InvalidArgumentError("GpuCacheAttention: queries inside the document");
  }
  ++counters_.calls;
  if (c.device_managed) return AttendDeviceManaged(layer, q, out, lse);

  const size_t q_floats = static_cast<size_t>(num_tokens) * num_q_heads * d;
  const size_t lse_floats = static_cast<size_t>(num_tokens) * num_q_heads;
  const float* q_host = nullptr;
  if (!options_.device_chooser && options_.chooser) {
    q_host_.resize(q_floats);
    STRATA_RETURN_IF_ERROR(
        backend_->CopyToHost(q_host_.data(), q.data, q_floats * sizeof(float), nullptr));
    q_host = q_host_.data();
  }
  std::vector<kvstore::GpuPageId> ids;
  DeviceTokenSelection selection;
  STRATA_RETURN_IF_ERROR(
      ChoosePages(layer, q_host, &q, num_tokens, num_q_heads, &ids, &selection));
  positions_.resize(num_tokens);
  for (int i = 0; i < num_tokens; ++i) positions_[i] = static_cast<int32_t>(q_begin + i);

  // Fills on the default stream are ordered before the attention that reads them.
  const bool ordered = c.stream == nullptr;
  const kvstore::MissPolicy policy =
      ordered ? kvstore::MissPolicy::kOrdered : kvstore::MissPolicy::kWait;
  const int64_t chunk =
      options_.max_pages_per_chunk > 0 ? options_.max_pages_per_chunk : c.num_slots;
  const int64_t num_chunks =
      std::max<int64_t>(1, (static_cast<int64_t>(ids.size()) + chunk - 1) / chunk);
  auto o_view = [&](kernels::Buffer* b) {
    return b->View(kernels::DType::kF32, {num_tokens, num_q_heads, d});
  };
  auto l_view = [&](kernels::Buffer* b) {
    return b->View(kernels::DType::kF32, {num_tokens, num_q_heads});
  };
  if (num_chunks > 1) {
    STRATA_RETURN_IF_ERROR(Grow(backend_, q_floats * sizeof(float), &chunk_o_));
    STRATA_RETURN_IF_ERROR(Grow(backend_, lse_floats * sizeof(float), &chunk_lse_));
    for (int i = 0; i < 2; ++i) {
      STRATA_RETURN_IF_ERROR(Grow(backend_, q_floats * sizeof(float), &acc_o_[i]));
      STRATA_RETURN_IF_ERROR(Grow(backend_, lse_floats * sizeof(float), &acc_lse_[i]));
    }
  }
  if (selection.valid && num_chunks == 1 && num_tokens == 1 && !ids.empty()) {
    // The chooser's device selection over the cache's device page table for this layer (its
    // entries for the acquired pages are written by fills queued before the attention).
    const kernels::SelectedAttentionParams sp = SelectedOverTable(layer, selection, q, out, lse);
    std::vector<int32_t> slots;
    STRATA_RETURN_IF_ERROR(cache_->Acquire(ids, policy, &slots));
    absl::Status s = backend_->SelectedAttention(sp, nullptr);
    if (s.ok() && !ordered) s = backend_->Synchronize(nullptr);
    const absl::Status r = cache_->Release(slots);
    STRATA_RETURN_IF_ERROR(s);
    STRATA_RETURN_IF_ERROR(r);
    ++counters_.chunks;
    ++counters_.selected_attention;
    counters_.pages_attended += static_cast<int64_t>(ids.size());
    return absl::OkStatus();
  }
  if (ids.empty()) {
    // Nothing attended: an empty selection over no keys (lse -inf, out 0) from the kernel itself.
    std::vector<int32_t> none;
    return AttendChunk({}, none, q, positions_.data(), out, lse);
  }
  std::vector<int32_t> slots;
  int64_t index = 0;
  int acc = 0;  // acc_o_[acc] holds the merge of the chunks so far (from the second chunk on)
  for (size_t begin = 0; begin < ids.size(); begin += static_cast<size_t>(chunk), ++index) {
    const size_t end = std::min(ids.size(), begin + static_cast<size_t>(chunk));
    const absl::Span<const kvstore::GpuPageId> part(ids.data() + begin, end - begin);
    STRATA_RETURN_IF_ERROR(cache_->Acquire(part, policy, &slots));
    // Chunk 0 of several goes to acc_o_[0]; later ones to chunk_o_, then merged.
    const bool single = num_chunks == 1;
    kernels::TensorView co = single ? out : (index == 0 ? o_view(acc_o_[0].get())
                                                        : o_view(chunk_o_.get()));
    kernels::TensorView cl = single ? lse : (index == 0 ? l_view(acc_lse_[0].get())
                                                        : l_view(chunk_lse_.get()));
    absl::Status s = AttendChunk(part, slots, q, positions_.data(), co, cl);
    if (s.ok() && index > 0) {
      const bool last = index + 1 == num_chunks;
      const kernels::TensorView outs[2] = {o_view(acc_o_[acc].get()), co};
      const kernels::TensorView lses[2] = {l_view(acc_lse_[acc].get()), cl};
      kernels::MergeAttentionParams mp;
      mp.outs = outs;
      mp.lses = lses;
      mp.num_parts = 2;
      mp.out = last ? out : o_view(acc_o_[acc ^ 1].get());
      mp.lse = last ? lse : l_view(acc_lse_[acc ^ 1].get());
      s = backend_->MergeAttention(mp, nullptr);
      acc ^= 1;
    }
    // kOrdered: a later fill of a released slot is queued on the same stream after this
    // attention. Otherwise the attention must have finished before the slots may be refilled.
    if (s.ok() && !ordered) s = backend_->Synchronize(nullptr);
    const absl::Status r = cache_->Release(slots);
    STRATA_RETURN_IF_ERROR(s);
    STRATA_RETURN_IF_ERROR(r);
    ++counters_.chunks;
    counters_.pages_attended += static_cast<int64_t>(part.size());
  }
  return absl::OkStatus();
}

kernels::SelectedAttentionParams GpuCacheAttention::SelectedOverTable(
    int layer, const DeviceTokenSelection& sel, const kernels::TensorView& q,
    const kernels::TensorView& out, const kernels::TensorView& lse) const {
  const kvstore::GpuCacheOptions& c = cache_->options();
  const int64_t hkv = c.num_kv_heads;
  kernels::SelectedAttentionParams sp;
  sp.q = q;
  sp.k_pool = cache_->k_pool();
  sp.v_pool = cache_->v_pool();
  sp.page_table = kernels::TensorView(
      const_cast<int32_t*>(cache_->device_table()) + layer * hkv * c.pages_per_head,
      kernels::DType::kI32, {hkv, c.pages_per_head});
  sp.prefix_end = sel.prefix_end;
  sp.middle = sel.middle;
  sp.suffix_begin = sel.suffix_begin;
  sp.suffix_end = sel.suffix_end;
  sp.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  sp.slot_scales = cache_->slot_scales();  // fp8 pages: each slot's own scales
  sp.out = out;
  sp.lse = lse;
  return sp;
}

absl::Status GpuCacheAttention::AttendDeviceManaged(int layer, const kernels::TensorView& q,
                                                    const kernels::TensorView& out,
                                                    const kernels::TensorView& lse) {
  const kvstore::GpuCacheOptions& c = cache_->options();
  const int64_t d = c.head_dim;
  const int64_t num_tokens = q.dim(0), hq = q.dim(1);
  const bool one_choice = options_.chunk_selection && num_tokens > 1;
  DeviceTokenSelection sel;
  // The chooser's device selection for `queries`, made resident by the cache.
  auto choose = [&](const kernels::TensorView& queries) -> absl::Status {
    sel = DeviceTokenSelection();
    STRATA_RETURN_IF_ERROR(options_.device_chooser(layer, queries, nullptr, &sel));
    if (!sel.valid) {
      return absl::InvalidArgumentError(
          "GpuCacheAttention: the device chooser gave no device selection (device-managed cache)");
    }
    return cache_->EnqueueResolve(layer, sel.prefix_end, sel.middle, sel.suffix_begin,
                                  sel.suffix_end);
  };
  if (one_choice) STRATA_RETURN_IF_ERROR(choose(q));
  // One token at a time: every document token precedes every query, so rows are independent.
  for (int64_t t = 0; t < num_tokens; ++t) {
    const kernels::TensorView qt(static_cast<float*>(q.data) + t * hq * d, kernels::DType::kF32,
                                 {1, hq, d});
    if (!one_choice) STRATA_RETURN_IF_ERROR(choose(qt));
    const kernels::TensorView ot(static_cast<float*>(out.data) + t * hq * d, kernels::DType::kF32,
                                 {1, hq, d});
    const kernels::TensorView lt(static_cast<float*>(lse.data) + t * hq, kernels::DType::kF32,
                                 {1, hq});
    STRATA_RETURN_IF_ERROR(
        backend_->SelectedAttention(SelectedOverTable(layer, sel, qt, ot, lt), nullptr));
    ++counters_.chunks;
    ++counters_.selected_attention;
  }
  return absl::OkStatus();
}

namespace {

// EnqueueMinMaxPageTopK with the selection cache's check as skip flags or in the op.
absl::Status EnqueueMinMaxStage(kernels::Backend* backend, const kernels::TensorView& q,
                                const kernels::TensorView& summaries, int64_t window_first,
                                int64_t k, const kernels::TensorView& scores,
                                const kernels::TensorView& selected, const int32_t* skip_heads,
                                const kernels::SelectionCacheCheckParams* cache_check) {
  // One SelectStages stage: ScoreSummaries then VoteTopK, which the CUDA backend runs as one
  // kernel for bf16 summaries (kernels/cuda/selection.cu SelectStagesKernel) and as the two ops
  // otherwise.
  kernels::SelectStagesParams sp;
  sp.q = q;
  sp.scale = 1.0f / std::sqrt(static_cast<float>(q.dim(1)));
  sp.num_stages = 1;
  kernels::SelectStage& st = sp.stages[0];
  st.summaries = summaries;
  st.candidates.begin = 1;
  st.candidates.end = window_first;
  st.k = k;
  st.scores = scores;
  st.selected = selected;
  sp.skip_heads = skip_heads;
  sp.cache_check = cache_check;
  return backend->SelectStages(sp, nullptr);
}

}  // namespace

absl::Status EnqueueMinMaxPageTopK(kernels::Backend* backend, const kernels::TensorView& q,
                                   const kernels::TensorView& summaries, int64_t window_first,
                                   int64_t k, const kernels::TensorView& scores,
                                   const kernels::TensorView& selected,
                                   const int32_t* skip_heads) {
  return EnqueueMinMaxStage(backend, q, summaries, window_first, k, scores, selected, skip_heads,
                            nullptr);
}

absl::StatusOr<kernels::TensorView> EnqueueCachedMinMaxPageTopK(
    kernels::Backend* backend, const kernels::TensorView& q, const kernels::TensorView& summaries,
    int64_t window_first, int64_t k, const kernels::TensorView& scores,
    DeviceSelectionCache& cache, int layer) {
  STRATA_ASSIGN_OR_RETURN(const kernels::SelectionCacheCheckParams cc, cache.CheckParams(layer, q));
  const kernels::TensorView kept = cache.kept(layer);
  STRATA_RETURN_IF_ERROR(
      EnqueueMinMaxStage(backend, q, summaries, window_first, k, scores, kept, nullptr, &cc));
  cache.CountChecks(1);
  return kept;
}

void AppendChosenPages(const int32_t* selected, int64_t k, int64_t window_first,
                       int64_t num_pages, std::vector<int32_t>* pages) {
  const size_t start = pages->size();
  pages->push_back(0);
  for (int64_t i = 0; i < k; ++i) {
    if (selected[i] >= 1 && selected[i] < window_first) pages->push_back(selected[i]);  // -1 pads
  }
  for (int64_t p = window_first; p < num_pages; ++p) pages->push_back(static_cast<int32_t>(p));
  std::sort(pages->begin() + static_cast<std::ptrdiff_t>(start), pages->end());
  pages->erase(std::unique(pages->begin() + static_cast<std::ptrdiff_t>(start), pages->end()),
               pages->end());
}

MinMaxSummaryCache::MinMaxSummaryCache(kvstore::PageStore* store, kvstore::DocumentId document,
                                       uint32_t summary_kind, int num_layers, int num_kv_heads,
                                       int head_dim, int64_t num_pages, bool bf16_bounds)
    : store_(store),
      document_(document),
      summary_kind_(summary_kind),
      num_layers_(std::max(0, num_layers)),
      num_kv_heads_(std::max(0, num_kv_heads)),
      head_dim_(head_dim),
      num_pages_(num_pages),
      bf16_bounds_(bf16_bounds),
      entries_(std::make_unique<Entry[]>(static_cast<size_t>(num_layers_) * num_kv_heads_)) {}

bool MinMaxSummaryCache::Matches(int num_layers, int num_kv_heads, int head_dim,
                                 int64_t num_pages) const {
  return num_layers == num_layers_ && num_kv_heads == num_kv_heads_ && head_dim == head_dim_ &&
         num_pages == num_pages_;
}

int64_t MinMaxSummaryCache::bytes() const { return bytes_.load(); }

absl::StatusOr<const std::vector<float>*> MinMaxSummaryCache::Get(int layer, int kv_head) {
  const int d = head_dim_;
  const int64_t n = num_pages_;
  if (layer < 0 || layer >= num_layers_ || kv_head < 0 || kv_head >= num_kv_heads_ || n <= 0 ||
      d <= 0 || store_ == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("MinMaxSummaryCache: layer ", layer,
                                                   ", kv head ", kv_head, " outside the shape"));
  }
  // The entry's lock is held while reading: one read per (layer, kv head); others read at once.
  Entry& entry = entries_[static_cast<size_t>(layer) * num_kv_heads_ + kv_head];
  std::lock_guard<std::mutex> lock(entry.mu);
  std::vector<float>& sum = entry.data;
  if (!sum.empty()) return &sum;
  std::vector<kvstore::SummaryKey> keys(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) {
    keys[p] = kvstore::SummaryKey{document_, static_cast<uint32_t>(layer),
                                  static_cast<uint32_t>(kv_head), summary_kind_,
                                  static_cast<uint32_t>(p)};
  }
  std::vector<kvstore::PageRef> got;
  STRATA_RETURN_IF_ERROR(store_->GetSummaries(keys, &got));
  if (got.size() != keys.size()) return absl::InternalError("MinMaxSummaryCache: short answer");
  std::vector<float> read(static_cast<size_t>(n) * 2 * d);
  for (int64_t p = 0; p < n; ++p) {
    if (got[p] == nullptr || got[p]->size() != 2 * d * sizeof(float)) {
      return absl::NotFoundError(absl::StrCat("MinMaxChooser: no minmax summary of page ", p,
                                              " (layer ", layer, ", kv head ", kv_head, ")"));
    }
    std::memcpy(&read[static_cast<size_t>(p) * 2 * d], got[p]->data(), 2 * d * sizeof(float));
  }
  if (bf16_bounds_) {
    std::vector<uint16_t> rounded(read.size());
    kernels::MinMaxRowsToBF16(read.data(), n, d, rounded.data());
    kernels::ConvertToF32(rounded.data(), kernels::DType::kBF16, read.data(),
                          static_cast<int64_t>(read.size()));
  }
  sum = std::move(read);
  bytes_ += static_cast<int64_t>(sum.size() * sizeof(float));
  return &sum;
}

PageChooser MakeMinMaxChooser(const MinMaxChooserOptions& options) {
  struct Cached {  // selection cache entry of one (layer, kv head)
    bool valid = false;
    std::vector<float> q;        // the group query chosen for
    std::vector<int32_t> pages;  // what was chosen
  };
  struct State {
    MinMaxChooserOptions o;
    std::shared_ptr<MinMaxSummaryCache> summaries;
    std::vector<Cached> cached;  // [layer * num_kv_heads + kv head] when the cache is on
  };
  auto st = std::make_shared<State>();
  st->o = options;
  if (options.cache_theta <= 1.0 && options.num_layers > 0 && options.num_kv_heads > 0) {
    st->cached.resize(static_cast<size_t>(options.num_layers) * options.num_kv_heads);
  }
  st->summaries = options.summaries != nullptr
                      ? options.summaries
                      : std::make_shared<MinMaxSummaryCache>(
                            options.store, options.document, options.summary_kind,
                            options.num_layers, options.num_kv_heads, options.head_dim,
                            options.num_pages);
  return [st](int layer, int kv_head, const float* q, int num_tokens, int num_q_heads,
              std::vector<int32_t>* pages) -> absl::Status {
    const MinMaxChooserOptions& o = st->o;
    const int d = o.head_dim;
    const int64_t n = o.num_pages;
    if (layer < 0 || layer >= o.num_layers || kv_head < 0 || kv_head >= o.num_kv_heads ||
        n <= 0 || d <= 0 || num_q_heads % o.num_kv_heads != 0 ||
        (o.summaries == nullptr && o.store == nullptr) ||
        !st->summaries->Matches(o.num_layers, o.num_kv_heads, d, n)) {
      return absl::InvalidArgumentError(absl::StrCat("MinMaxChooser: layer ", layer, ", kv head ",
                                                     kv_head, " outside the options"));
    }
    const int group = num_q_heads / o.num_kv_heads;
    Cached* entry = st->cached.empty()
                        ? nullptr
                        : &st->cached[static_cast<size_t>(layer) * o.num_kv_heads + kv_head];
    const float* qg = q + static_cast<size_t>(kv_head) * group * d;  // token 0's group query
    const size_t qg_len = static_cast<size_t>(group) * d;
    if (entry != nullptr && num_tokens == 1) {
      if (o.cache_counters != nullptr) ++o.cache_counters->cache_lookups;
      if (entry->valid && entry->q.size() == qg_len &&
          kernels::SelectionCacheCosine(qg, entry->q.data(), static_cast<int64_t>(qg_len)) >=
              o.cache_theta) {  // NaN: false
        if (o.cache_counters != nullptr) ++o.cache_counters->cache_hits;
        pages->insert(pages->end(), entry->pages.begin(), entry->pages.end());
        return absl::OkStatus();
      }
    }
    STRATA_ASSIGN_OR_RETURN(const std::vector<float>* got, st->summaries->Get(layer, kv_head));
    const std::vector<float>& sum = *got;
    // Always: page 0 and the window; the rest by soft vote.
    const int64_t window_first = std::max<int64_t>(1, n - o.window_pages);
    std::vector<double> vote(static_cast<size_t>(n), 0.0);
    std::vector<float> score(static_cast<size_t>(n));
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    // Several tokens (a prompt chunk) choose once with the chunk's mean query (of this KV head's
    // query heads only).
    std::vector<float> mean;
    const float* qc = qg;  // the group's rows [group, d]
    if (num_tokens > 1) {
      MeanQuery(qg, num_tokens, static_cast<int64_t>(qg_len), &mean, static_cast<int64_t>(num_q_heads) * d);
      qc = mean.data();
    }
    for (int j = 0; j < group; ++j) {
      const float* qh = qc + static_cast<size_t>(j) * d;
      float best = -INFINITY;
      for (int64_t p = 0; p < n; ++p) {
        const float* mn = &sum[static_cast<size_t>(p) * 2 * d];
        const float* mx = mn + d;
        float b = 0;
        for (int i = 0; i < d; ++i) b += std::max(qh[i] * mn[i], qh[i] * mx[i]);
        score[p] = b * scale;
        best = std::max(best, score[p]);
      }
      double z = 0;
      for (int64_t p = 0; p < n; ++p) z += std::exp(static_cast<double>(score[p] - best));
      for (int64_t p = 0; p < n; ++p) vote[p] += std::exp(static_cast<double>(score[p] - best)) / z;
    }
    std::vector<int32_t> middle;
    for (int64_t p = 1; p < window_first; ++p) middle.push_back(static_cast<int32_t>(p));
    const size_t k = std::min<size_t>(middle.size(), static_cast<size_t>(std::max(0, o.budget_pages)));
    // Ranked as the device's VoteTopK ranks (kernels/vote_rank.h).
    std::vector<uint32_t> rank(static_cast<size_t>(n));
    for (int32_t p : middle) rank[p] = kernels::VoteRankKey(static_cast<float>(vote[p]));
    std::partial_sort(middle.begin(), middle.begin() + k, middle.end(), [&](int32_t a, int32_t b) {
      return kernels::VoteRankBefore(rank[a], a, rank[b], b);
    });
    middle.resize(k);
    const size_t start = pages->size();
    pages->push_back(0);
    for (int32_t p : middle) pages->push_back(p);
    for (int64_t p = window_first; p < n; ++p) pages->push_back(static_cast<int32_t>(p));
    std::sort(pages->begin() + static_cast<std::ptrdiff_t>(start), pages->end());
    if (entry != nullptr) {
      entry->valid = num_tokens == 1;
      if (entry->valid) {
        entry->q.assign(qg, qg + qg_len);
        entry->pages.assign(pages->begin() + static_cast<std::ptrdiff_t>(start), pages->end());
      }
    }
    return absl::OkStatus();
  };
}

}  // namespace strata::engine
