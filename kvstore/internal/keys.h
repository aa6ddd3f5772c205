// Key encodings of the KV store (RocksDB column families and the host cache).
//
// All integers are big-endian so that bytewise order is numeric order, and every key starts with
// the 16 document-id bytes, so one document's keys form one contiguous range (range deletes).
// Page and summary keys put the page (summary) index before the layer and KV head: a prefill
// writes a document's pages in page order (each chunk's new pages of every layer and head, with
// their page summaries), so successive memtable flushes cover disjoint, increasing key ranges, and
// a batch of one contiguous page range ingested as SST files overlaps no other batch's files in any
// column family (its index entries as two files, pages' and summaries'); RocksDB puts such files
// at the bottom level and never rewrites them. Store format 3; format 2 had summary keys ordered
// layer | kv_head | kind | index (every batch's summary and index files overlapped, piled up in
// level 0 and stalled writes while compactions merged them); format 1 had page keys ordered
// layer | kv_head | page_index.
//   pages:      doc(16) | page_index(u32) | layer(u16) | kv_head(u16)              24 bytes
//   summaries:  doc(16) | index(u32) | kind(u32) | layer(u16) | kv_head(u16)        28 bytes
//   index:      doc(16) | 'p' | page key suffix (8)   or   doc(16) | 's' | summary suffix (12)
//   documents:  doc(16)
// Stateless; thread-safe.
#ifndef STRATA_KVSTORE_INTERNAL_KEYS_H_
#define STRATA_KVSTORE_INTERNAL_KEYS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvstore/page_store.h"

namespace strata::kvstore::internal {

inline constexpr size_t kPageKeySize = 24;
inline constexpr size_t kSummaryKeySize = 28;

std::string PageKeyBytes(const PageKey& k);
std::string SummaryKeyBytes(const SummaryKey& k);
// The same bytes written to out[0, kPageKeySize) / out[0, kSummaryKeySize), no allocation (the host
// cache's fixed-size map keys).
void WritePageKey(const PageKey& k, uint8_t* out);
void WriteSummaryKey(const SummaryKey& k, uint8_t* out);
// The summary key of document `doc` whose stored bytes are bytes[0, size) (as WriteSummaryKey
// wrote them; the document id bytes are not read). False when size is not kSummaryKeySize.
bool ReadSummaryKey(const DocumentId& doc, const uint8_t* bytes, size_t size, SummaryKey* k);
// Index entries: IndexPrefix, then the page (summary) key's bytes after the document id.
std::string PageIndexKey(const PageKey& k);
std::string SummaryIndexKey(const SummaryKey& k);
// Prefixes of one document's index entries ('p' pages, 's' summaries).
std::string IndexPrefix(const DocumentId& doc, char type);
// [begin, end) covering every key of `doc` in any column family.
std::string DocumentRangeBegin(const DocumentId& doc);
std::string DocumentRangeEnd(const DocumentId& doc);

}  // namespace strata::kvstore::internal

#endif  // STRATA_KVSTORE_INTERNAL_KEYS_H_
