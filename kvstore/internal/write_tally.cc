#include "kvstore/internal/write_tally.h"

namespace strata::kvstore::internal {

std::unique_ptr<WriteTally> WriteTally::Make(const v1::Document& doc) {
  std::unique_ptr<WriteTally> t(new WriteTally());
  t->layers_ = doc.layout().num_layers();
  t->kv_heads_ = doc.layout().num_kv_heads();
  const uint64_t heads = uint64_t{t->layers_} * t->kv_heads_;
  for (const v1::SummarySpec& s : doc.summaries()) {
    t->kinds_.push_back({s.kind(), t->summaries_per_head_});
    t->summaries_per_head_ += s.count();
    if (t->summaries_per_head_ > kMaxBits) return nullptr;
  }
  if (heads > kMaxBits || doc.num_pages() > kMaxBits) return nullptr;
  t->page_bits_ = doc.num_pages() * heads;
  if (t->page_bits_ > kMaxBits || t->summaries_per_head_ * heads > kMaxBits - t->page_bits_) {
    return nullptr;
  }
  const uint64_t words = (t->page_bits_ + t->summaries_per_head_ * heads + 63) / 64;
  t->words_ = std::make_unique<std::atomic<uint64_t>[]>(words);  // value-initialized: zero
  return t;
}

bool WriteTally::Set(uint64_t bit) {
  const uint64_t mask = uint64_t{1} << (bit % 64);
  return (words_[bit / 64].fetch_or(mask, std::memory_order_relaxed) & mask) == 0;
}

void WriteTally::AddPage(const PageKey& k) {
  const uint64_t bit = (uint64_t{k.page_index} * layers_ + k.layer) * kv_heads_ + k.kv_head;
  if (Set(bit)) pages_.fetch_add(1, std::memory_order_relaxed);
}

void WriteTally::AddSummary(const SummaryKey& k) {
  for (const Kind& kind : kinds_) {
    if (kind.kind != k.kind) continue;
    const uint64_t head = uint64_t{k.layer} * kv_heads_ + k.kv_head;
    if (Set(page_bits_ + head * summaries_per_head_ + kind.offset + k.index)) {
      summaries_.fetch_add(1, std::memory_order_relaxed);
    }
    return;
  }
}

}  // namespace strata::kvstore::internal
