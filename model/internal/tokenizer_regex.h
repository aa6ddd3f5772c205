// A compiled PCRE2 regular expression (UTF + UCP, JIT when available) for the tokenizer's Split
// and ByteLevel pre-tokenizers and Replace normalizers.
//
// Immutable after Compile; FindAll is safe to call from many threads (each call uses its own
// match data).
#ifndef STRATA_MODEL_INTERNAL_TOKENIZER_REGEX_H_
#define STRATA_MODEL_INTERNAL_TOKENIZER_REGEX_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct pcre2_real_code_8;

namespace strata::model::internal {

class Regex {
 public:
  // InvalidArgument (with PCRE2's message and offset) when `pattern` does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) byte spans of all non-overlapping, non-empty matches in `text`
  // (valid UTF-8), left to right. Internal error if PCRE2 fails (e.g. a match limit).
  absl::Status FindAll(absl::string_view text, std::vector<std::pair<size_t, size_t>>* spans) const;

  const std::string& pattern() const { return pattern_; }

 private:
  Regex(std::string pattern, pcre2_real_code_8* code) : pattern_(std::move(pattern)), code_(code) {}
  std::string pattern_;
  pcre2_real_code_8* code_;
};

}  // namespace strata::model::internal

#endif  // STRATA_MODEL_INTERNAL_TOKENIZER_REGEX_H_
