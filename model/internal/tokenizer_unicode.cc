// UTF-8 and Unicode helpers for the tokenizer.
#include "model/internal/tokenizer_unicode.h"

#include <array>
#include <cstdlib>

#include "absl/status/status.h"
#include "utf8proc.h"

namespace strata::model::internal {
namespace {

enum class Scan { kComplete, kTruncated, kInvalid };

// Classifies the UTF-8 sequence starting at p[0] (n > 0 bytes available). On kComplete `*len`
// is the character length; on kTruncated all n bytes are a valid prefix of a character; on
// kInvalid `*len` is the length of the maximal ill-formed subpart to replace by one U+FFFD.
Scan ScanUtf8(const unsigned char* p, size_t n, size_t* len) {
  const unsigned c = p[0];
  if (c < 0x80) {
    *len = 1;
    return Scan::kComplete;
  }
  int need;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
  } else if (c == 0xE0) {
    need = 2;
    lo = 0xA0;
  } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
    need = 2;
  } else if (c == 0xED) {
    need = 2;
    hi = 0x9F;
  } else if (c == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (c >= 0xF1 && c <= 0xF3) {
    need = 3;
  } else if (c == 0xF4) {
    need = 3;
    hi = 0x8F;
  } else {
    *len = 1;
    return Scan::kInvalid;
  }
  size_t i = 1;
  for (int k = 0; k < need; ++k, ++i) {
    if (i >= n) {
      *len = i;
      return Scan::kTruncated;
    }
    const unsigned b = p[i];
    const unsigned l = k == 0 ? lo : 0x80;
    const unsigned h = k == 0 ? hi : 0xBF;
    if (b < l || b > h) {
      *len = i;
      return Scan::kInvalid;
    }
  }
  *len = i;
  return Scan::kComplete;
}

constexpr char kReplacement[] = "\xEF\xBF\xBD";

struct ByteLevelTables {
  std::array<std::string, 256> encode;
  std::array<int16_t, 324> decode;  // code points of the alphabet are all < 324
  ByteLevelTables() {
    decode.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256u + n++;
      AppendUtf8(cp, &encode[b]);
      decode[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables* t = new ByteLevelTables();
  return *t;
}

}  // namespace

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

int Utf8CharLen(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

uint32_t NextCodepoint(absl::string_view s, size_t* pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + *pos;
  const int len = Utf8CharLen(p[0]);
  if (*pos + len > s.size()) {  // not valid UTF-8; never happens on sanitized text
    ++*pos;
    return 0xFFFD;
  }
  uint32_t cp;
  switch (len) {
    case 1:
      cp = p[0];
      break;
    case 2:
      cp = ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
      break;
    case 3:
      cp = ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
      break;
    default:
      cp = ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
  }
  *pos += len;
  return cp;
}

bool IsValidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    if (ScanUtf8(p + i, s.size() - i, &len) != Scan::kComplete) return false;
    i += len;
  }
  return true;
}

std::string Utf8Lossy(absl::string_view s) {
  std::string out;
  const size_t used = Utf8LossyPrefix(s, &out);
  if (used < s.size()) out += kReplacement;  // a truncated final sequence
  return out;
}

size_t Utf8LossyPrefix(absl::string_view s, std::string* out) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  out->reserve(out->size() + s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t run = i;
    while (run < s.size() && p[run] < 0x80) ++run;
    if (run > i) {
      out->append(s.data() + i, run - i);
      i = run;
      if (i == s.size()) break;
    }
    size_t len;
    switch (ScanUtf8(p + i, s.size() - i, &len)) {
      case Scan::kComplete:
        out->append(s.data() + i, len);
        i += len;
        break;
      case Scan::kInvalid:
        out->append(kReplacement);
        i += len;
        break;
      case Scan::kTruncated:
        return i;
    }
  }
  return i;
}

bool IsUnicodeWhitespace(uint32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool IsWordChar(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return cp == 0x200C || cp == 0x200D;  // Join_Control
  }
}

absl::StatusOr<std::string> NormalizeUnicode(absl::string_view s, NormalizationForm form) {
  if (s.empty()) return std::string();
  // Pure ASCII is invariant under every normalization form.
  bool ascii = true;
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return std::string(s);
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalizationForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalizationForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalizationForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalizationForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    return absl::InternalError(std::string("utf8proc: ") + utf8proc_errmsg(n));
  }
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

const std::string& ByteLevelChar(uint8_t b) { return Tables().encode[b]; }

int ByteLevelByte(uint32_t cp) {
  if (cp >= Tables().decode.size()) return -1;
  return Tables().decode[cp];
}

}  // namespace strata::model::internal
