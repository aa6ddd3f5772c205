// Normalizers, pre-tokenizers, post-processors and decoders of Hugging Face tokenizer.json.
#include "model/internal/tokenizer_pipeline.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/internal/tokenizer_regex.h"
#include "model/internal/tokenizer_unicode.h"
#include "nlohmann/json.hpp"

namespace strata::model::internal {

using json = nlohmann::json;
using Spans = std::vector<std::pair<size_t, size_t>>;

const char kGpt2Regex[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char kLlama3Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------
// JSON helpers

absl::StatusOr<std::string> JsonString(const json& obj, const char* key, absl::string_view what) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": field \"", key, "\" must be a string"));
  }
  return it->get<std::string>();
}

absl::StatusOr<std::string> JsonStringOr(const json& obj, const char* key, const std::string& dflt,
                                         absl::string_view what) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return dflt;
  if (!it->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": field \"", key, "\" must be a string"));
  }
  return it->get<std::string>();
}

absl::StatusOr<bool> JsonBoolOr(const json& obj, const char* key, bool dflt,
                                absl::string_view what) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": field \"", key, "\" must be a bool"));
  }
  return it->get<bool>();
}

absl::StatusOr<int64_t> JsonIntOr(const json& obj, const char* key, int64_t dflt,
                                  absl::string_view what) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return dflt;
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": field \"", key, "\" must be an integer"));
  }
  return it->get<int64_t>();
}

namespace {

absl::StatusOr<std::string> TypeOf(const json& j, absl::string_view what) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, " must be an object"));
  return JsonString(j, "type", what);
}

// A Hugging Face pattern: {"String": s} or {"Regex": r}.
struct Pattern {
  std::string literal;           // when regex == nullptr
  std::unique_ptr<Regex> regex;  // when set

  absl::Status Find(absl::string_view text, Spans* spans) const {
    if (regex != nullptr) return regex->FindAll(text, spans);
    if (literal.empty()) return absl::OkStatus();
    size_t pos = 0;
    while ((pos = text.find(literal, pos)) != absl::string_view::npos) {
      spans->emplace_back(pos, pos + literal.size());
      pos += literal.size();
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<Pattern> ParsePattern(const json& obj, absl::string_view what) {
  auto it = obj.find("pattern");
  if (it == obj.end() || !it->is_object() || it->size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}"));
  }
  Pattern p;
  if (it->contains("String") && (*it)["String"].is_string()) {
    p.literal = (*it)["String"].get<std::string>();
    return p;
  }
  if (it->contains("Regex") && (*it)["Regex"].is_string()) {
    STRATA_ASSIGN_OR_RETURN(p.regex, Regex::Compile((*it)["Regex"].get<std::string>()));
    return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}"));
}

// Replaces every match of `pattern` in `*text` by `content`.
absl::Status ReplaceAll(const Pattern& pattern, const std::string& content, std::string* text) {
  Spans spans;
  STRATA_RETURN_IF_ERROR(pattern.Find(*text, &spans));
  if (spans.empty()) return absl::OkStatus();
  std::string out;
  out.reserve(text->size());
  size_t prev = 0;
  for (const auto& [b, e] : spans) {
    out.append(*text, prev, b - prev);
    out += content;
    prev = e;
  }
  out.append(*text, prev, std::string::npos);
  *text = std::move(out);
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> SingleChar(const std::string& s, absl::string_view what) {
  if (s.empty() || !IsValidUtf8(s)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be one character"));
  }
  size_t pos = 0;
  const uint32_t cp = NextCodepoint(s, &pos);
  if (pos != s.size())
    return absl::InvalidArgumentError(absl::StrCat(what, " must be one character"));
  return cp;
}

// ---------------------------------------------------------------------------------------------
// Normalizers

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalizationForm form) : form_(form) {}
  absl::Status Normalize(std::string* text) const override {
    STRATA_ASSIGN_OR_RETURN(*text, NormalizeUnicode(*text, form_));
    return absl::OkStatus();
  }

 private:
  NormalizationForm form_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  absl::Status Normalize(std::string* text) const override {
    if (!text->empty()) text->insert(0, prepend_);
    return absl::OkStatus();
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  absl::Status Normalize(std::string* text) const override {
    return ReplaceAll(pattern_, content_, text);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps)
      : steps_(std::move(steps)) {}
  absl::Status Normalize(std::string* text) const override {
    for (const auto& s : steps_) STRATA_RETURN_IF_ERROR(s->Normalize(text));
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Hugging Face NormalizedString::split: cuts `in` around `matches` according to `behavior` and
// emits the non-empty parts.
absl::Status SplitPiece(const Piece& in, const Spans& matches, SplitBehavior behavior, bool invert,
                        PieceSink emit) {
  auto piece = [&in](size_t begin, size_t end) {
    return Piece{in.text.substr(begin, end - begin), in.at_origin && begin == 0};
  };
  if (behavior == SplitBehavior::kIsolated) {  // the common case, without intermediate lists
    size_t prev = 0;
    for (const auto& [b, e] : matches) {
      if (prev != b) STRATA_RETURN_IF_ERROR(emit(piece(prev, b)));
      if (e > b) STRATA_RETURN_IF_ERROR(emit(piece(b, e)));
      prev = e;
    }
    if (prev < in.text.size()) STRATA_RETURN_IF_ERROR(emit(piece(prev, in.text.size())));
    return absl::OkStatus();
  }
  struct Part {
    size_t begin, end;
    bool flag;  // is_match on input; "remove" on output
  };
  std::vector<Part> parts;
  parts.reserve(2 * matches.size() + 1);
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) parts.push_back({prev, b, false});
    parts.push_back({b, e, true});
    prev = e;
  }
  if (prev != in.text.size()) parts.push_back({prev, in.text.size(), false});
  if (invert) {
    for (Part& p : parts) p.flag = !p.flag;
  }
  std::vector<Part> result;
  result.reserve(parts.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      break;  // handled above
    case SplitBehavior::kRemoved:
      result = parts;
      break;
    case SplitBehavior::kContiguous:
      for (const Part& p : parts) {
        if (p.flag == previous_match && !result.empty()) {
          result.back().end = p.end;
        } else {
          result.push_back({p.begin, p.end, false});
        }
        previous_match = p.flag;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Part& p : parts) {
        if (p.flag && !previous_match && !result.empty()) {
          result.back().end = p.end;
        } else {
          result.push_back({p.begin, p.end, false});
        }
        previous_match = p.flag;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->flag && !previous_match && !result.empty()) {
          result.back().begin = it->begin;
        } else {
          result.push_back({it->begin, it->end, false});
        }
        previous_match = it->flag;
      }
      std::reverse(result.begin(), result.end());
      break;
  }
  for (const Part& p : result) {
    if (p.flag || p.end <= p.begin) continue;
    STRATA_RETURN_IF_ERROR(emit(piece(p.begin, p.end)));
  }
  return absl::OkStatus();
}

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  absl::Status PreTokenize(Piece piece, PieceSink emit) const override {
    Spans spans;
    STRATA_RETURN_IF_ERROR(pattern_.Find(piece.text, &spans));
    return SplitPiece(piece, spans, behavior_, invert_, emit);
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  absl::Status PreTokenize(Piece piece, PieceSink emit) const override {
    if (add_prefix_space_ && (piece.text.empty() || piece.text[0] != ' ')) {
      piece.text.insert(0, " ");
    }
    auto map_and_emit = [&emit](Piece p) {
      std::string mapped;
      mapped.reserve(p.text.size() + p.text.size() / 2);
      for (char c : p.text) mapped += ByteLevelChar(static_cast<uint8_t>(c));
      p.text = std::move(mapped);
      return emit(std::move(p));
    };
    if (regex_ == nullptr) {
      if (piece.text.empty()) return absl::OkStatus();
      return map_and_emit(std::move(piece));
    }
    Spans spans;
    STRATA_RETURN_IF_ERROR(regex_->FindAll(piece.text, &spans));
    return SplitPiece(piece, spans, SplitBehavior::kIsolated, false, map_and_emit);
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

absl::StatusOr<PrependScheme> ParsePrependScheme(const json& j, absl::string_view what) {
  if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
    STRATA_ASSIGN_OR_RETURN(std::string s, JsonString(j, "prepend_scheme", what));
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    return absl::InvalidArgumentError(absl::StrCat(what, ": unsupported prepend_scheme ", s));
  }
  STRATA_ASSIGN_OR_RETURN(bool add, JsonBoolOr(j, "add_prefix_space", true, what));
  return add ? PrependScheme::kAlways : PrependScheme::kNever;
}

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  absl::Status PreTokenize(Piece piece, PieceSink emit) const override {
    std::string replaced;
    replaced.reserve(piece.text.size() + 8);
    for (char c : piece.text) {
      if (c == ' ') {
        replaced += replacement_;
      } else {
        replaced.push_back(c);
      }
    }
    const bool starts = replaced.compare(0, replacement_.size(), replacement_) == 0;
    if (!starts && (scheme_ == PrependScheme::kAlways ||
                    (scheme_ == PrependScheme::kFirst && piece.at_origin))) {
      replaced.insert(0, replacement_);
    }
    Piece out{std::move(replaced), piece.at_origin};
    if (out.text.empty()) return absl::OkStatus();
    if (!split_) return emit(std::move(out));
    Spans spans;
    size_t pos = 0;
    while ((pos = out.text.find(replacement_, pos)) != std::string::npos) {
      spans.emplace_back(pos, pos + replacement_.size());
      pos += replacement_.size();
    }
    return SplitPiece(out, spans, SplitBehavior::kMergedWithNext, false, emit);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  absl::Status PreTokenize(Piece piece, PieceSink emit) const override {
    return Run(0, std::move(piece), emit);
  }

 private:
  absl::Status Run(size_t step, Piece piece, PieceSink emit) const {
    if (step == steps_.size()) return emit(std::move(piece));
    return steps_[step]->PreTokenize(std::move(piece), [this, step, &emit](Piece p) {
      return Run(step + 1, std::move(p), emit);
    });
  }
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// ---------------------------------------------------------------------------------------------
// Post-processors

class TemplatePostProcessor : public PostProcessor {
 public:
  // `items`: a sequence of id lists, with an empty optional meaning "the sequence $A".
  struct Item {
    bool is_sequence = false;
    std::vector<int32_t> ids;
  };
  explicit TemplatePostProcessor(std::vector<Item> items) : items_(std::move(items)) {}
  void Process(std::vector<int32_t>* ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    std::vector<int32_t> out;
    out.reserve(ids->size() + 4);
    for (const Item& item : items_) {
      if (item.is_sequence) {
        out.insert(out.end(), ids->begin(), ids->end());
      } else {
        out.insert(out.end(), item.ids.begin(), item.ids.end());
      }
    }
    *ids = std::move(out);
  }

 private:
  std::vector<Item> items_;
};

class NoopPostProcessor : public PostProcessor {
 public:
  void Process(std::vector<int32_t>*, bool) const override {}
};

class SequencePostProcessor : public PostProcessor {
 public:
  explicit SequencePostProcessor(std::vector<std::unique_ptr<PostProcessor>> steps)
      : steps_(std::move(steps)) {}
  void Process(std::vector<int32_t>* ids, bool add_special_tokens) const override {
    for (const auto& s : steps_) s->Process(ids, add_special_tokens);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

absl::StatusOr<std::unique_ptr<PostProcessor>> ParseTemplate(const json& j) {
  constexpr absl::string_view kWhat = "TemplateProcessing";
  auto single = j.find("single");
  if (single == j.end() || !single->is_array()) {
    return absl::InvalidArgumentError("TemplateProcessing: \"single\" must be an array");
  }
  auto specials = j.find("special_tokens");
  std::vector<TemplatePostProcessor::Item> items;
  for (const json& piece : *single) {
    if (!piece.is_object() || piece.size() != 1) {
      return absl::InvalidArgumentError("TemplateProcessing: bad item in \"single\"");
    }
    if (piece.contains("Sequence")) {
      const json& seq = piece["Sequence"];
      if (!seq.is_object()) return absl::InvalidArgumentError("TemplateProcessing: bad Sequence");
      STRATA_ASSIGN_OR_RETURN(std::string id, JsonString(seq, "id", kWhat));
      if (id != "A") {
        return absl::InvalidArgumentError(
            "TemplateProcessing: \"single\" may only refer to sequence A");
      }
      items.push_back({true, {}});
    } else if (piece.contains("SpecialToken")) {
      const json& st = piece["SpecialToken"];
      if (!st.is_object()) {
        return absl::InvalidArgumentError("TemplateProcessing: bad SpecialToken");
      }
      STRATA_ASSIGN_OR_RETURN(std::string name, JsonString(st, "id", kWhat));
      if (specials == j.end() || !specials->is_object() || !specials->contains(name) ||
          !(*specials)[name].is_object() || !(*specials)[name].contains("ids") ||
          !(*specials)[name]["ids"].is_array()) {
        return absl::InvalidArgumentError(absl::StrCat("TemplateProcessing: special token \"", name,
                                                       "\" missing from special_tokens"));
      }
      TemplatePostProcessor::Item item;
      for (const json& id : (*specials)[name]["ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
          return absl::InvalidArgumentError("TemplateProcessing: bad special token id");
        }
        item.ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
      items.push_back(std::move(item));
    } else {
      return absl::InvalidArgumentError("TemplateProcessing: bad item in \"single\"");
    }
  }
  return std::unique_ptr<PostProcessor>(new TemplatePostProcessor(std::move(items)));
}

// BertProcessing / RobertaProcessing: cls $A sep, with "cls": [token, id], "sep": [token, id].
absl::StatusOr<std::unique_ptr<PostProcessor>> ParseClsSep(const json& j, absl::string_view what) {
  std::vector<TemplatePostProcessor::Item> items;
  int32_t cls = 0, sep = 0;
  for (const char* key : {"cls", "sep"}) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_array() || it->size() != 2 || !(*it)[1].is_number_integer() ||
        (*it)[1].get<int64_t>() < 0 || (*it)[1].get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": \"", key, "\" must be [token, id]"));
    }
    (key[0] == 'c' ? cls : sep) = static_cast<int32_t>((*it)[1].get<int64_t>());
  }
  items.push_back({false, {cls}});
  items.push_back({true, {}});
  items.push_back({false, {sep}});
  return std::unique_ptr<PostProcessor>(new TemplatePostProcessor(std::move(items)));
}

// ---------------------------------------------------------------------------------------------
// Decoders

void ByteLevelTokenBytes(std::string* token) {
  std::string bytes;
  bytes.reserve(token->size());
  size_t pos = 0;
  while (pos < token->size()) {
    const int b = ByteLevelByte(NextCodepoint(*token, &pos));
    if (b < 0) return;  // a character outside the alphabet: the token's own bytes are used
    bytes.push_back(static_cast<char>(b));
  }
  *token = std::move(bytes);
}

class ByteLevelDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (std::string& t : *tokens) {
      ByteLevelTokenBytes(&t);
      bytes += t;
    }
    tokens->assign(1, Utf8Lossy(bytes));
  }
  void StreamToken(std::string* token, bool) const override { ByteLevelTokenBytes(token); }
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) StreamToken(&t, false);
  }
  void StreamToken(std::string* token, bool) const override {
    // Token strings are valid UTF-8 here, and the patterns were compiled at parse time; a
    // matching failure (only a PCRE2 resource limit) leaves the token unchanged.
    ReplaceAll(pattern_, content_, token).IgnoreError();
  }

 private:
  Pattern pattern_;
  std::string content_;
};

}  // namespace

int ByteFallbackValue(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return -1;
  return hi * 16 + lo;
}

namespace {

class ByteFallbackDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string run;
    size_t run_len = 0;
    auto flush = [&]() {
      if (run_len == 0) return;
      if (IsValidUtf8(run)) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run_len; ++i) out.push_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_len = 0;
    };
    for (std::string& t : *tokens) {
      const int b = ByteFallbackValue(t);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        ++run_len;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    *tokens = std::move(out);
  }
  void StreamToken(std::string* token, bool) const override {
    const int b = ByteFallbackValue(*token);
    if (b >= 0) token->assign(1, static_cast<char>(b));
  }
  bool HasByteFallback() const override { return true; }
};

class FuseDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const std::string& t : *tokens) all += t;
    tokens->assign(1, std::move(all));
  }
  void StreamToken(std::string*, bool) const override {}
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, int64_t start, int64_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      StripStart(&t);
      for (int64_t i = 0; i < stop_; ++i) {
        if (t.size() >= content_.size() &&
            t.compare(t.size() - content_.size(), content_.size(), content_) == 0) {
          t.resize(t.size() - content_.size());
        } else {
          break;
        }
      }
    }
  }
  // Only the leading strip of the first token can be applied to a stream.
  void StreamToken(std::string* token, bool first) const override {
    if (first) StripStart(token);
  }

 private:
  void StripStart(std::string* t) const {
    size_t cut = 0;
    for (int64_t i = 0; i < start_; ++i) {
      if (t->compare(cut, content_.size(), content_) == 0 && cut + content_.size() <= t->size()) {
        cut += content_.size();
      } else {
        break;
      }
    }
    t->erase(0, cut);
  }
  std::string content_;  // one character
  int64_t start_, stop_;
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) StreamToken(&(*tokens)[i], i == 0);
  }
  void StreamToken(std::string* token, bool first) const override {
    const bool drop = first && scheme_ != PrependScheme::kNever;
    std::string out;
    out.reserve(token->size());
    size_t pos = 0;
    while (pos < token->size()) {
      if (token->compare(pos, replacement_.size(), replacement_) == 0) {
        if (!drop) out.push_back(' ');
        pos += replacement_.size();
      } else {
        out.push_back((*token)[pos++]);
      }
    }
    *token = std::move(out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps)
      : steps_(std::move(steps)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& s : steps_) s->DecodeChain(tokens);
  }
  void StreamToken(std::string* token, bool first) const override {
    for (const auto& s : steps_) s->StreamToken(token, first);
  }
  bool HasByteFallback() const override {
    for (const auto& s : steps_) {
      if (s->HasByteFallback()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

template <typename T>
absl::StatusOr<std::vector<std::unique_ptr<T>>> ParseList(
    const json& j, const char* key, absl::string_view what,
    absl::StatusOr<std::unique_ptr<T>> (*parse)(const json&)) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": \"", key, "\" must be an array"));
  }
  std::vector<std::unique_ptr<T>> steps;
  for (const json& e : *it) {
    STRATA_ASSIGN_OR_RETURN(auto step, parse(e));
    steps.push_back(std::move(step));
  }
  return steps;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const json& j) {
  STRATA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, "normalizer"));
  if (type == "NFC")
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalizationForm::kNfc));
  if (type == "NFD")
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalizationForm::kNfd));
  if (type == "NFKC") {
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalizationForm::kNfkc));
  }
  if (type == "NFKD") {
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalizationForm::kNfkd));
  }
  if (type == "Prepend") {
    STRATA_ASSIGN_OR_RETURN(std::string prepend, JsonString(j, "prepend", "Prepend normalizer"));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(std::move(prepend)));
  }
  if (type == "Replace") {
    STRATA_ASSIGN_OR_RETURN(Pattern pattern, ParsePattern(j, "Replace normalizer"));
    STRATA_ASSIGN_OR_RETURN(std::string content, JsonString(j, "content", "Replace normalizer"));
    return std::unique_ptr<Normalizer>(
        new ReplaceNormalizer(std::move(pattern), std::move(content)));
  }
  if (type == "Sequence") {
    STRATA_ASSIGN_OR_RETURN(
        auto steps,
        ParseList<Normalizer>(j, "normalizers", "Sequence normalizer", &ParseNormalizer));
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(steps)));
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported normalizer type \"", type, "\""));
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const json& j) {
  STRATA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, "pre_tokenizer"));
  if (type == "ByteLevel") {
    constexpr absl::string_view kWhat = "ByteLevel pre_tokenizer";
    STRATA_ASSIGN_OR_RETURN(bool prefix, JsonBoolOr(j, "add_prefix_space", true, kWhat));
    STRATA_ASSIGN_OR_RETURN(bool use_regex, JsonBoolOr(j, "use_regex", true, kWhat));
    std::unique_ptr<Regex> regex;
    if (use_regex) {
      STRATA_ASSIGN_OR_RETURN(regex, Regex::Compile(kGpt2Regex));
    }
    return std::unique_ptr<PreTokenizer>(new ByteLevelPreTokenizer(prefix, std::move(regex)));
  }
  if (type == "Split") {
    constexpr absl::string_view kWhat = "Split pre_tokenizer";
    STRATA_ASSIGN_OR_RETURN(Pattern pattern, ParsePattern(j, kWhat));
    STRATA_ASSIGN_OR_RETURN(std::string b, JsonString(j, "behavior", kWhat));
    STRATA_ASSIGN_OR_RETURN(bool invert, JsonBoolOr(j, "invert", false, kWhat));
    SplitBehavior behavior;
    if (b == "Removed") {
      behavior = SplitBehavior::kRemoved;
    } else if (b == "Isolated") {
      behavior = SplitBehavior::kIsolated;
    } else if (b == "MergedWithPrevious") {
      behavior = SplitBehavior::kMergedWithPrevious;
    } else if (b == "MergedWithNext") {
      behavior = SplitBehavior::kMergedWithNext;
    } else if (b == "Contiguous") {
      behavior = SplitBehavior::kContiguous;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("Split pre_tokenizer: unsupported behavior ", b));
    }
    return std::unique_ptr<PreTokenizer>(
        new SplitPreTokenizer(std::move(pattern), behavior, invert));
  }
  if (type == "Metaspace") {
    constexpr absl::string_view kWhat = "Metaspace pre_tokenizer";
    STRATA_ASSIGN_OR_RETURN(std::string rep, JsonString(j, "replacement", kWhat));
    STRATA_RETURN_IF_ERROR(SingleChar(rep, "Metaspace replacement").status());
    STRATA_ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(j, kWhat));
    STRATA_ASSIGN_OR_RETURN(bool split, JsonBoolOr(j, "split", true, kWhat));
    return std::unique_ptr<PreTokenizer>(new MetaspacePreTokenizer(std::move(rep), scheme, split));
  }
  if (type == "Sequence") {
    STRATA_ASSIGN_OR_RETURN(
        auto steps,
        ParseList<PreTokenizer>(j, "pretokenizers", "Sequence pre_tokenizer", &ParsePreTokenizer));
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(steps)));
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported pre_tokenizer type \"", type, "\""));
}

absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(const json& j) {
  STRATA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, "post_processor"));
  if (type == "TemplateProcessing") return ParseTemplate(j);
  if (type == "ByteLevel") return std::unique_ptr<PostProcessor>(new NoopPostProcessor());
  if (type == "BertProcessing" || type == "RobertaProcessing") return ParseClsSep(j, type);
  if (type == "Sequence") {
    STRATA_ASSIGN_OR_RETURN(
        auto steps,
        ParseList<PostProcessor>(j, "processors", "Sequence post_processor", &ParsePostProcessor));
    return std::unique_ptr<PostProcessor>(new SequencePostProcessor(std::move(steps)));
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported post_processor type \"", type, "\""));
}

absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const json& j) {
  STRATA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, "decoder"));
  if (type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevelDecoder());
  if (type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallbackDecoder());
  if (type == "Fuse") return std::unique_ptr<Decoder>(new FuseDecoder());
  if (type == "Replace") {
    STRATA_ASSIGN_OR_RETURN(Pattern pattern, ParsePattern(j, "Replace decoder"));
    STRATA_ASSIGN_OR_RETURN(std::string content, JsonString(j, "content", "Replace decoder"));
    return std::unique_ptr<Decoder>(new ReplaceDecoder(std::move(pattern), std::move(content)));
  }
  if (type == "Strip") {
    constexpr absl::string_view kWhat = "Strip decoder";
    STRATA_ASSIGN_OR_RETURN(std::string content, JsonString(j, "content", kWhat));
    STRATA_RETURN_IF_ERROR(SingleChar(content, "Strip content").status());
    STRATA_ASSIGN_OR_RETURN(int64_t start, JsonIntOr(j, "start", 0, kWhat));
    STRATA_ASSIGN_OR_RETURN(int64_t stop, JsonIntOr(j, "stop", 0, kWhat));
    if (start < 0 || stop < 0) return absl::InvalidArgumentError("Strip decoder: negative count");
    return std::unique_ptr<Decoder>(new StripDecoder(std::move(content), start, stop));
  }
  if (type == "Metaspace") {
    constexpr absl::string_view kWhat = "Metaspace decoder";
    STRATA_ASSIGN_OR_RETURN(std::string rep, JsonString(j, "replacement", kWhat));
    STRATA_RETURN_IF_ERROR(SingleChar(rep, "Metaspace replacement").status());
    STRATA_ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(j, kWhat));
    return std::unique_ptr<Decoder>(new MetaspaceDecoder(std::move(rep), scheme));
  }
  if (type == "Sequence") {
    STRATA_ASSIGN_OR_RETURN(auto steps,
                            ParseList<Decoder>(j, "decoders", "Sequence decoder", &ParseDecoder));
    return std::unique_ptr<Decoder>(new SequenceDecoder(std::move(steps)));
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported decoder type \"", type, "\""));
}

}  // namespace strata::model::internal
