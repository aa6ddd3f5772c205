#include "kvstore/internal/keys.h"

namespace strata::kvstore::internal {
namespace {

void PutU16(std::string* s, uint32_t v) {
  s->push_back(static_cast<char>((v >> 8) & 0xff));
  s->push_back(static_cast<char>(v & 0xff));
}
void PutU32(std::string* s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s->push_back(static_cast<char>((v >> shift) & 0xff));
}
void PageSuffix(std::string* s, const PageKey& k) {
  PutU16(s, k.layer);
  PutU16(s, k.kv_head);
  PutU32(s, k.page_index);
}
void SummarySuffix(std::string* s, const SummaryKey& k) {
  PutU16(s, k.layer);
  PutU16(s, k.kv_head);
  PutU32(s, k.kind);
  PutU32(s, k.index);
}

}  // namespace

std::string PageKeyBytes(const PageKey& k) {
  std::string s(k.document.AsBytes());
  PageSuffix(&s, k);
  return s;
}

std::string SummaryKeyBytes(const SummaryKey& k) {
  std::string s(k.document.AsBytes());
  SummarySuffix(&s, k);
  return s;
}

std::string PageIndexKey(const PageKey& k) {
  std::string s = IndexPrefix(k.document, 'p');
  PageSuffix(&s, k);
  return s;
}

std::string SummaryIndexKey(const SummaryKey& k) {
  std::string s = IndexPrefix(k.document, 's');
  SummarySuffix(&s, k);
  return s;
}

std::string IndexPrefix(const DocumentId& doc, char type) {
  std::string s(doc.AsBytes());
  s.push_back(type);
  return s;
}

std::string DocumentRangeBegin(const DocumentId& doc) { return std::string(doc.AsBytes()); }

std::string DocumentRangeEnd(const DocumentId& doc) {
  // Longer than any key suffix, so every key with this document prefix sorts before it.
  std::string s(doc.AsBytes());
  s.append(16, '\xff');
  return s;
}

}  // namespace strata::kvstore::internal
