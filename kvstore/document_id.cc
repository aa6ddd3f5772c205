#include "kvstore/document_id.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "xxhash.h"

namespace strata::kvstore {
namespace {

DocumentId FromHash(XXH128_hash_t h) {
  DocumentId id;
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);  // big-endian, platform independent
  std::memcpy(id.bytes.data(), c.digest, 16);
  return id;
}

void UpdateU64(XXH3_state_t* s, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  XXH3_128bits_update(s, b, 8);
}

}  // namespace

absl::Status KvLayout::Validate() const {
  if (num_layers < 1 || num_layers > 65535 || num_kv_heads < 1 || num_kv_heads > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: num_layers and num_kv_heads must be in [1, 65535], got ", num_layers, ", ",
        num_kv_heads));
  }
  return page.Validate();
}

std::string DocumentId::ToHex() const {
  static const char kHex[] = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[2 * i] = kHex[bytes[i] >> 4];
    s[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return s;
}

absl::StatusOr<DocumentId> DocumentId::FromHex(absl::string_view hex) {
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("document id must be 32 hex characters, got ", hex.size()));
  }
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  DocumentId id;
  for (int i = 0; i < 16; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(absl::StrCat("document id is not hex: '", hex, "'"));
    }
    id.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return id;
}

absl::StatusOr<DocumentIdentity> ComputeDocumentIdentity(absl::string_view model_fingerprint,
                                                         const KvLayout& layout,
                                                         absl::Span<const int32_t> tokens) {
  if (absl::Status s = layout.Validate(); !s.ok()) return s;
  if (model_fingerprint.empty()) return absl::InvalidArgumentError("empty model fingerprint");
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  static constexpr char kDomain[] = "strata.document.v1";
  XXH3_128bits_update(&state, kDomain, sizeof(kDomain) - 1);
  UpdateU64(&state, model_fingerprint.size());
  XXH3_128bits_update(&state, model_fingerprint.data(), model_fingerprint.size());
  UpdateU64(&state, static_cast<uint64_t>(layout.num_layers));
  UpdateU64(&state, static_cast<uint64_t>(layout.num_kv_heads));
  UpdateU64(&state, static_cast<uint64_t>(layout.page.head_dim));
  UpdateU64(&state, static_cast<uint64_t>(layout.page.page_size));
  UpdateU64(&state, static_cast<uint64_t>(layout.page.dtype));
  DocumentId h = FromHash(XXH3_128bits_digest(&state));

  DocumentIdentity out;
  const size_t p = static_cast<size_t>(layout.page.page_size);
  out.page_chain.reserve((tokens.size() + p - 1) / p);
  std::vector<uint8_t> buf;
  for (size_t begin = 0; begin < tokens.size(); begin += p) {
    const size_t end = std::min(tokens.size(), begin + p);
    buf.assign(h.bytes.begin(), h.bytes.end());
    for (size_t t = begin; t < end; ++t) {
      const uint32_t v = static_cast<uint32_t>(tokens[t]);
      for (int i = 0; i < 4; ++i) buf.push_back(static_cast<uint8_t>(v >> (8 * i)));
    }
    h = FromHash(XXH3_128bits(buf.data(), buf.size()));
    out.page_chain.push_back(h);
  }
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, h.bytes.data(), h.bytes.size());
  XXH3_128bits_update(&state, "end", 3);
  UpdateU64(&state, tokens.size());
  out.id = FromHash(XXH3_128bits_digest(&state));
  return out;
}

}  // namespace strata::kvstore
