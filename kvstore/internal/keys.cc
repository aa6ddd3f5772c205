#include "kvstore/internal/keys.h"

#include <cstring>

namespace strata::kvstore::internal {
namespace {

uint8_t* WriteU16(uint8_t* at, uint32_t v) {
  at[0] = static_cast<uint8_t>((v >> 8) & 0xff);
  at[1] = static_cast<uint8_t>(v & 0xff);
  return at + 2;
}
uint8_t* WriteU32(uint8_t* at, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) *at++ = static_cast<uint8_t>((v >> shift) & 0xff);
  return at;
}
uint32_t ReadU16(const uint8_t* at) { return uint32_t{at[0]} << 8 | at[1]; }
uint32_t ReadU32(const uint8_t* at) { return ReadU16(at) << 16 | ReadU16(at + 2); }

// doc | type | key[16, size): the index entry of the page or summary whose key bytes are key.
std::string IndexKey(const DocumentId& doc, char type, const uint8_t* key, size_t size) {
  std::string s = IndexPrefix(doc, type);
  s.append(reinterpret_cast<const char*>(key) + 16, size - 16);
  return s;
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

bool ReadSummaryKey(const DocumentId& doc, const uint8_t* bytes, size_t size, SummaryKey* k) {
  if (size != kSummaryKeySize) return false;
  *k = SummaryKey{doc, ReadU16(bytes + 24), ReadU16(bytes + 26), ReadU32(bytes + 20), ReadU32(bytes + 16)};
  return true;
}

std::string PageIndexKey(const PageKey& k) {
  uint8_t key[kPageKeySize];
  WritePageKey(k, key);
  return IndexKey(k.document, 'p', key, kPageKeySize);
}

std::string SummaryIndexKey(const SummaryKey& k) {
  uint8_t key[kSummaryKeySize];
  WriteSummaryKey(k, key);
  return IndexKey(k.document, 's', key, kSummaryKeySize);
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
