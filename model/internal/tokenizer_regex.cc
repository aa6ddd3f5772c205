// PCRE2 wrapper for the tokenizer.
#include "model/internal/tokenizer_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"
#include "model/internal/tokenizer_unicode.h"

namespace strata::model::internal {

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(const std::string& pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("regex \"", pattern, "\" does not compile at ",
                                                   offset, ": ",
                                                   reinterpret_cast<const char*>(message)));
  }
  // JIT is an optimization only: when it is unavailable pcre2_match interprets.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return std::unique_ptr<Regex>(new Regex(pattern, code));
}

Regex::~Regex() { pcre2_code_free(code_); }

absl::Status Regex::FindAll(absl::string_view text,
                            std::vector<std::pair<size_t, size_t>>* spans) const {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
  if (md == nullptr) return absl::InternalError("pcre2_match_data_create failed");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  absl::Status status;
  while (pos <= text.size()) {
    const int rc = pcre2_match(code_, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      status = absl::InternalError(absl::StrCat(
          "regex \"", pattern_, "\" failed: ", reinterpret_cast<const char*>(message)));
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t begin = ov[0], end = ov[1];
    if (end > begin) {
      spans->emplace_back(begin, end);
      pos = end;
    } else {
      // Empty match: step over one character so the scan always advances.
      if (begin >= text.size()) break;
      pos = begin + Utf8CharLen(static_cast<unsigned char>(text[begin]));
    }
  }
  pcre2_match_data_free(md);
  return status;
}

}  // namespace strata::model::internal
