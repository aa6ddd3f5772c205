#include "kvstore/testing/test_pages.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "kvstore/page_format.h"

namespace strata::kvstore::testing {

KvLayout SmallLayout(int layers, int heads, int page_size, int head_dim) {
  KvLayout l;
  l.num_layers = layers;
  l.num_kv_heads = heads;
  l.page = PageShape{kernels::DType::kBF16, page_size, head_dim};
  return l;
}

std::string MakePage(const KvLayout& layout, uint64_t num_tokens, uint32_t layer,
                     uint32_t kv_head, uint32_t page_index, uint64_t seed) {
  const uint64_t p = layout.page.page_size;
  const int n = static_cast<int>(std::min<uint64_t>(p, num_tokens - page_index * p));
  const int d = layout.page.head_dim;
  std::mt19937_64 rng(seed * 1000003 + layer * 7919 + kv_head * 104729 + page_index);
  std::vector<uint16_t> k(static_cast<size_t>(n) * d), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<uint16_t>(rng() & 0xbfff);  // no Inf/NaN exponents
    v[i] = static_cast<uint16_t>(rng() & 0xbfff);
  }
  absl::StatusOr<std::string> page =
      EncodePage(layout.page, kernels::TensorView(k.data(), kernels::DType::kBF16, {n, d}),
                 kernels::TensorView(v.data(), kernels::DType::kBF16, {n, d}));
  STRATA_CHECK(page.ok()) << page.status();
  return *std::move(page);
}

std::string MakeSummary(uint32_t layer, uint32_t kv_head, uint32_t kind, uint32_t index,
                        uint64_t seed) {
  return absl::StrCat("summary:", seed, ":", layer, ":", kv_head, ":", kind, ":", index);
}

v1::CreateDocumentRequest MakeDocumentRequest(const KvLayout& layout, uint64_t num_tokens,
                                              uint64_t seed, int64_t ttl_seconds) {
  std::vector<int32_t> tokens(num_tokens);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 32000);
  absl::StatusOr<DocumentIdentity> id = ComputeDocumentIdentity("test-model", layout, tokens);
  STRATA_CHECK(id.ok()) << id.status();
  v1::CreateDocumentRequest r;
  r.set_document_id(id->id.ToHex());
  r.set_model_fingerprint("test-model");
  *r.mutable_layout() = LayoutToProto(layout);
  r.set_num_tokens(num_tokens);
  v1::SummarySpec* spec = r.add_summaries();
  spec->set_kind(1);
  spec->set_count(static_cast<uint32_t>((num_tokens + layout.page.page_size - 1) /
                                        layout.page.page_size));
  r.set_ttl_seconds(ttl_seconds);
  return r;
}

void MakeDocumentWrites(const v1::CreateDocumentRequest& request, uint64_t seed,
                        std::vector<PageWrite>* pages, std::vector<SummaryWrite>* summaries) {
  absl::StatusOr<KvLayout> layout = LayoutFromProto(request.layout());
  STRATA_CHECK(layout.ok());
  absl::StatusOr<DocumentId> doc = DocumentId::FromHex(request.document_id());
  STRATA_CHECK(doc.ok());
  const uint64_t p = layout->page.page_size;
  const uint32_t num_pages = static_cast<uint32_t>((request.num_tokens() + p - 1) / p);
  for (uint32_t l = 0; l < static_cast<uint32_t>(layout->num_layers); ++l) {
    for (uint32_t h = 0; h < static_cast<uint32_t>(layout->num_kv_heads); ++h) {
      for (uint32_t i = 0; i < num_pages; ++i) {
        PageWrite w;
        w.key = PageKey{*doc, l, h, i};
        w.data = *PageBuffer::Copy(MakePage(*layout, request.num_tokens(), l, h, i, seed));
        pages->push_back(std::move(w));
        SummaryWrite s;
        s.key = SummaryKey{*doc, l, h, 1, i};
        s.data = *PageBuffer::Copy(MakeSummary(l, h, 1, i, seed));
        summaries->push_back(std::move(s));
      }
    }
  }
}

}  // namespace strata::kvstore::testing
