// Document identity (DESIGN.md section 2): a content hash of the token sequence, chained page by
// page and namespaced by the model fingerprint and the KV layout. The same tokens on the same
// model and layout give the same DocumentId in every process and after restarts.
//
//   h_0     = XXH3-128("strata.document.v1" | len | fingerprint | layout fields)
//   h_{i+1} = XXH3-128(h_i | tokens of page i as little-endian int32)     (pages of P tokens)
//   id      = XXH3-128(h_n | "end" | num_tokens)
//
// The per-page chain values identify every prefix of a document (prefix sharing). Value types and
// stateless functions; thread-safe.
#ifndef STRATA_KVSTORE_DOCUMENT_ID_H_
#define STRATA_KVSTORE_DOCUMENT_ID_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvstore/page_format.h"

namespace strata::kvstore {

// The KV layout of a document: part of its identity.
struct KvLayout {
  int num_layers = 0;
  int num_kv_heads = 0;
  PageShape page;  // dtype, page_size P, head_dim d

  // InvalidArgument unless layers and heads are in [1, 65535] and `page` is valid.
  absl::Status Validate() const;
  bool operator==(const KvLayout& o) const {
    return num_layers == o.num_layers && num_kv_heads == o.num_kv_heads && page == o.page;
  }
};

// 128 bits; hex form is 32 lowercase characters. Ordered bytewise (as stored keys are).
struct DocumentId {
  std::array<uint8_t, 16> bytes{};

  std::string ToHex() const;
  // InvalidArgument unless `hex` is exactly 32 hex characters.
  static absl::StatusOr<DocumentId> FromHex(absl::string_view hex);
  absl::string_view AsBytes() const {
    return absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  bool operator==(const DocumentId& o) const { return bytes == o.bytes; }
  bool operator!=(const DocumentId& o) const { return bytes != o.bytes; }
  bool operator<(const DocumentId& o) const { return bytes < o.bytes; }
};

struct DocumentIdentity {
  DocumentId id;
  // chain[i] = h_{i+1}: the hash of the first i+1 token pages (the last may be partial).
  std::vector<DocumentId> page_chain;
};

// Computes the identity of `tokens` for a model and layout. InvalidArgument on an invalid layout
// or an empty fingerprint.
absl::StatusOr<DocumentIdentity> ComputeDocumentIdentity(absl::string_view model_fingerprint,
                                                         const KvLayout& layout,
                                                         absl::Span<const int32_t> tokens);

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_DOCUMENT_ID_H_
