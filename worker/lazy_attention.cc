// Lazy mount of a READY document; see worker/lazy_attention.h.
#include "worker/lazy_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kvstore/page_format.h"

namespace strata::worker {

absl::StatusOr<std::unique_ptr<LazyDocumentAttention>> LazyDocumentAttention::Create(
    const LazyAttentionOptions& o, kernels::Backend* backend) {
  if (o.store == nullptr || !o.chooser || backend == nullptr) {
    return absl::InvalidArgumentError("LazyDocumentAttention: store, chooser and backend are required");
  }
  if (backend->Name() != "cpu") {
    return absl::InvalidArgumentError("LazyDocumentAttention: the page cache is host memory (CPU backend only)");
  }
  if (o.document_tokens <= 0 || o.page_size <= 0 || o.num_layers <= 0 || o.num_kv_heads <= 0 ||
      o.num_kv_heads > 4096 || o.head_dim <= 0 || o.capacity_pages <= 0) {
    return absl::InvalidArgumentError("LazyDocumentAttention: non-positive sizes");
  }
  std::unique_ptr<LazyDocumentAttention> a(new LazyDocumentAttention(o, backend));
  // Slots are allocated as pages arrive (a small document never takes capacity_pages of memory).
  return a;
}

absl::Status LazyDocumentAttention::Resident(const std::vector<kvstore::PageKey>& keys, std::vector<int32_t>* slots) {
  const int P = options_.page_size, d = options_.head_dim;
  const size_t page_floats = static_cast<size_t>(P) * d;
  slots->assign(keys.size(), -1);
  auto id_of = [&](const kvstore::PageKey& k) {
    return ((static_cast<uint64_t>(k.layer) * options_.num_kv_heads + k.kv_head) << 32) | k.page_index;
  };
  // Hits first: they move to the front, so evictions below never take a page of this call.
  std::vector<size_t> miss;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto it = map_.find(id_of(keys[i]));
    if (it == map_.end()) {
      miss.push_back(i);
      continue;
    }
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    (*slots)[i] = it->second.slot;
    ++hits_;
  }
  if (miss.empty()) return absl::OkStatus();
  misses_ += static_cast<int64_t>(miss.size());
  std::vector<kvstore::PageKey> fetch;
  fetch.reserve(miss.size());
  for (size_t i : miss) fetch.push_back(keys[i]);
  std::vector<kvstore::PageRef> got;
  if (auto* tiered = dynamic_cast<kvstore::TieredStore*>(options_.store); tiered != nullptr) {
    STRATA_RETURN_IF_ERROR(tiered->GetPages(fetch, &got, &pages_));
  } else {
    STRATA_RETURN_IF_ERROR(options_.store->GetPages(fetch, &got));
    (std::string(options_.store->tier()) == "remote" ? pages_.remote : pages_.local) +=
        static_cast<int64_t>(fetch.size());
  }
  if (got.size() != fetch.size()) return absl::InternalError("LazyDocumentAttention: short GetPages answer");
  // Grow the pool when the capacity (or this call's need) allows more slots.
  const int64_t need = static_cast<int64_t>(keys.size());
  const int64_t want = std::min<int64_t>(std::max(options_.capacity_pages, need),
                                         static_cast<int64_t>(map_.size() + miss.size()));
  if (want > slots_) {
    k_pool_.resize(static_cast<size_t>(want) * page_floats, 0.0f);
    v_pool_.resize(static_cast<size_t>(want) * page_floats, 0.0f);
    for (int64_t s = want - 1; s >= slots_; --s) free_.push_back(static_cast<int32_t>(s));
    slots_ = want;
  }
  for (size_t j = 0; j < miss.size(); ++j) {
    const kvstore::PageKey& k = fetch[j];
    if (got[j] == nullptr) {
      return absl::DataLossError(absl::StrCat("document ", options_.document.ToHex(), " page (layer ", k.layer,
                                              ", head ", k.kv_head, ", page ", k.page_index,
                                              ") is missing from the store"));
    }
    int32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      // The least recently used page; never one of this call (those are at the front).
      const uint64_t victim = lru_.back();
      lru_.pop_back();
      auto it = map_.find(victim);
      slot = it->second.slot;
      map_.erase(it);
    }
    absl::Status s = kvstore::DecodePage(got[j]->view(), &k_pool_[static_cast<size_t>(slot) * page_floats],
                                         &v_pool_[static_cast<size_t>(slot) * page_floats]);
    if (!s.ok()) {
      free_.push_back(slot);
      return s;
    }
    lru_.push_front(id_of(k));
    map_[id_of(k)] = Entry{slot, lru_.begin()};
    (*slots)[miss[j]] = slot;
  }
  return absl::OkStatus();
}

absl::Status LazyDocumentAttention::Attend(int layer, const float* q, int num_tokens, int num_q_heads,
                                           int64_t q_begin, std::vector<engine::AttentionPartial>* parts) {
  const int hkv = options_.num_kv_heads, d = options_.head_dim, P = options_.page_size;
  if (layer < 0 || layer >= options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("LazyDocumentAttention: layer ", layer, " out of range"));
  }
  if (num_tokens < 1 || q == nullptr || num_q_heads <= 0 || num_q_heads % hkv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LazyDocumentAttention: ", num_q_heads, " query heads for ", hkv, " KV heads"));
  }
  if (q_begin < options_.document_tokens) {
    return absl::InvalidArgumentError("LazyDocumentAttention: queries inside the document");
  }
  const int64_t num_pages = (options_.document_tokens + P - 1) / P;
  std::vector<kvstore::PageKey> keys;
  std::vector<int32_t> offsets(static_cast<size_t>(hkv) + 1, 0);
  std::vector<int32_t> chosen;
  for (int g = 0; g < hkv; ++g) {
    chosen.clear();
    STRATA_RETURN_IF_ERROR(options_.chooser(layer, g, q, num_tokens, num_q_heads, &chosen));
    offsets[g] = static_cast<int32_t>(keys.size());
    for (int32_t p : chosen) {
      if (p < 0 || p >= num_pages) {
        return absl::InvalidArgumentError(absl::StrCat("LazyDocumentAttention: chooser picked page ", p, " of ",
                                                       num_pages));
      }
      keys.push_back(kvstore::PageKey{options_.document, static_cast<uint32_t>(layer), static_cast<uint32_t>(g),
                                      static_cast<uint32_t>(p)});
    }
    counters_.candidate_tokens += options_.document_tokens;
  }
  offsets[hkv] = static_cast<int32_t>(keys.size());
  std::vector<int32_t> slots;
  STRATA_RETURN_IF_ERROR(Resident(keys, &slots));
  std::vector<kernels::KvSpan> spans(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const int64_t first = static_cast<int64_t>(keys[i].page_index) * P;
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(P, options_.document_tokens - first));
    spans[i] = kernels::KvSpan{slots[i], 0, len, static_cast<int32_t>(first)};
    counters_.selected_tokens += len;
  }
  const size_t q_floats = static_cast<size_t>(num_tokens) * num_q_heads * d;
  const size_t lse_floats = static_cast<size_t>(num_tokens) * num_q_heads;
  parts->resize(1);
  engine::AttentionPartial& out = (*parts)[0];
  out.o.resize(q_floats);
  out.lse.resize(lse_floats);
  positions_.resize(static_cast<size_t>(num_tokens));
  for (int i = 0; i < num_tokens; ++i) positions_[i] = static_cast<int32_t>(q_begin + i);
  kernels::PagedAttentionParams a;
  a.q = kernels::TensorView(const_cast<float*>(q), kernels::DType::kF32, {num_tokens, num_q_heads, d});
  a.k_pool = kernels::TensorView(k_pool_.data(), kernels::DType::kF32, {slots_, P, d});
  a.v_pool = kernels::TensorView(v_pool_.data(), kernels::DType::kF32, {slots_, P, d});
  a.spans = spans.data();
  a.span_offsets = offsets.data();
  a.num_kv_heads = hkv;
  a.q_positions = positions_.data();
  a.causal = true;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d));
  a.out = kernels::TensorView(out.o.data(), kernels::DType::kF32, {num_tokens, num_q_heads, d});
  a.lse = kernels::TensorView(out.lse.data(), kernels::DType::kF32, {num_tokens, num_q_heads});
  STRATA_RETURN_IF_ERROR(backend_->PagedAttention(a, nullptr));
  return backend_->Synchronize(nullptr);
}

}  // namespace strata::worker
