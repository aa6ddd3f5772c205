// UTF-8 and Unicode helpers for the tokenizer: lossy UTF-8 repair, code point iteration,
// character classes, Unicode normalization forms (utf8proc) and the GPT-2 byte-to-unicode
// alphabet of byte-level BPE.
//
// Pure functions over immutable tables; thread-safe.
#ifndef STRATA_MODEL_INTERNAL_TOKENIZER_UNICODE_H_
#define STRATA_MODEL_INTERNAL_TOKENIZER_UNICODE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::model::internal {

// Appends the UTF-8 encoding of code point `cp` (must be a Unicode scalar value).
void AppendUtf8(uint32_t cp, std::string* out);

// Decodes the code point at `s[*pos]` (which must be valid UTF-8) and advances `*pos` past it.
uint32_t NextCodepoint(absl::string_view s, size_t* pos);

// Byte length of the UTF-8 character whose lead byte is `lead` (1 for invalid lead bytes).
int Utf8CharLen(unsigned char lead);

// True when `s` is well-formed UTF-8.
bool IsValidUtf8(absl::string_view s);

// Returns `s` with every maximal ill-formed subsequence replaced by U+FFFD (the Unicode
// "substitution of maximal subparts" practice; Rust's String::from_utf8_lossy and Python's
// errors="replace" do the same).
std::string Utf8Lossy(absl::string_view s);

// Like Utf8Lossy over a stream prefix: converts `s` into `*out`, but stops before a trailing
// sequence that is a valid but incomplete prefix of a character (more bytes may complete it).
// Returns the number of bytes of `s` consumed.
size_t Utf8LossyPrefix(absl::string_view s, std::string* out);

// Unicode White_Space (the set Rust's char::is_whitespace and regex \s use).
bool IsUnicodeWhitespace(uint32_t cp);
// Regex \w: letters, marks, numbers, connector punctuation.
bool IsWordChar(uint32_t cp);

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };
// Normalizes valid UTF-8 text. Internal error if utf8proc fails.
absl::StatusOr<std::string> NormalizeUnicode(absl::string_view s, NormalizationForm form);

// GPT-2 bytes_to_unicode: the UTF-8 string of the printable character standing for byte `b`.
const std::string& ByteLevelChar(uint8_t b);
// Inverse of ByteLevelChar for one code point: the byte, or -1 when `cp` is not in the alphabet.
int ByteLevelByte(uint32_t cp);

}  // namespace strata::model::internal

#endif  // STRATA_MODEL_INTERNAL_TOKENIZER_UNICODE_H_
