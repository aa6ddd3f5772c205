#include "kvstore/internal/keys.h"

#include <cstring>

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
  PutU32(s, k.page_index);
  PutU16(s, k.layer);
  PutU16(s, k.kv_head);
}
void SummarySuffix(std::string* s, const SummaryKey& k) {
  PutU32(s, k.index);
  PutU32(s, k.kind);
  PutU16(s, k.layer);
  PutU16(s, k.kv_head);
}
uint8_t* WriteU16(uint8_t* at, uint32_t v) {
  at[0] = static_cast<uint8_t>((v >> 8) & 0xff);
  at[1] = static_cast<uint8_t>(v & 0xff);
  return at + 2;
}
uint8_t* WriteU32(uint8_t* at, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) *at++ = static_cast<uint8_t>((v >> shift) & 0xff);
  return at;
}

}  // namespace

void WritePageKey(const PageKey& k, uint8_t* out) {
  std::memcpy(out, k.document.bytes.data(), 16);
  WriteU16(WriteU16(WriteU32(out + 16, k.page_index), k.layer), k.kv_head);
}

void WriteSummaryKey(const SummaryKey& k, uint8_t* out) {
  std::memcpy(out, k.document.bytes.data(), 16);
  WriteU16(WriteU16(WriteU32(WriteU32(out + 16, k.index), k.kind), k.layer), k.kv_head);
}

std::string PageKeyBytes(const PageKey& k) {
  std::string s(kPageKeySize, '\0');
  WritePageKey(k, reinterpret_cast<uint8_t*>(s.data()));
  return s;
}

std::string SummaryKeyBytes(const SummaryKey& k) {
  std::string s(kSummaryKeySize, '\0');
  WriteSummaryKey(k, reinterpret_cast<uint8_t*>(s.data()));
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
