// Hugging Face tokenizer.json: parsing, Encode/Decode, and the streaming decoder.
//
// Encode follows Hugging Face `tokenizers`: added tokens are split out of the raw text first
// (leftmost-longest; non-normalized ones before normalization, normalized ones after), each
// remaining piece is normalized, pre-tokenized and run through the BPE model, and the
// post-processor adds its special tokens. Invalid UTF-8 input is repaired first (each maximal
// ill-formed subsequence becomes U+FFFD, as Python's errors="replace" does).
#include "model/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/internal/tokenizer_bpe.h"
#include "model/internal/tokenizer_pipeline.h"
#include "model/internal/tokenizer_unicode.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using json = nlohmann::json;
using internal::BpeModel;
using internal::Decoder;
using internal::Normalizer;
using internal::Piece;
using internal::PostProcessor;
using internal::PreTokenizer;

// What the StreamingDecoder needs beyond the public interface, when the tokenizer is ours.
class StreamSupport {
 public:
  virtual ~StreamSupport() = default;
  // The bytes token `id` adds to a stream; `first`: it is the first token of the output.
  virtual absl::StatusOr<std::string> StreamBytes(int32_t id, bool first) const = 0;
  // True when the decoder turns <0xNN> tokens into raw bytes; runs of them are decoded as a
  // whole (valid UTF-8, or one U+FFFD per byte), so the stream holds a run until it ends.
  virtual bool HasByteFallback() const = 0;
  // True for a <0xNN> token when HasByteFallback().
  virtual bool IsFallbackByte(int32_t id) const = 0;
};

// Ids at or above this are rejected: the id -> token table is dense.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Leftmost-longest matcher over a set of strings (a byte trie), the Aho-Corasick
// MatchKind::LeftmostLongest semantics Hugging Face uses for added tokens.
class TokenMatcher {
 public:
  void Add(const std::string& pattern, int32_t index) {
    if (pattern.empty()) return;
    int32_t node = 0;
    for (unsigned char c : pattern) {
      int32_t next = Child(node, c);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(c, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    if (nodes_[node].terminal < 0) nodes_[node].terminal = index;
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }

  // The longest pattern starting at `pos`: (length, index), or length 0.
  std::pair<size_t, int32_t> LongestAt(absl::string_view text, size_t pos) const {
    std::pair<size_t, int32_t> best{0, -1};
    if (!first_byte_[static_cast<unsigned char>(text[pos])]) return best;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      node = Child(node, static_cast<unsigned char>(text[i]));
      if (node < 0) break;
      if (nodes_[node].terminal >= 0) best = {i + 1 - pos, nodes_[node].terminal};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t terminal = -1;
  };
  int32_t Child(int32_t node, unsigned char c) const {
    for (const auto& [k, v] : nodes_[node].children) {
      if (k == c) return v;
    }
    return -1;
  }
  std::vector<Node> nodes_{1};
  bool first_byte_[256] = {};
  bool empty_ = true;
};

// A run of text, or one added token (id >= 0).
struct Segment {
  int32_t id;
  size_t begin, end;
};

bool EndsWithWordChar(absl::string_view s) {
  if (s.empty()) return false;
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  size_t pos = start;
  return internal::IsWordChar(internal::NextCodepoint(s, &pos));
}

bool StartsWithWordChar(absl::string_view s) {
  if (s.empty()) return false;
  size_t pos = 0;
  return internal::IsWordChar(internal::NextCodepoint(s, &pos));
}

// Start of the whitespace run that ends `s`.
size_t TrailingSpaceStart(absl::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t pos = start;
    if (!internal::IsUnicodeWhitespace(internal::NextCodepoint(s, &pos))) break;
    end = start;
  }
  return end;
}

// Length of the whitespace run that starts `s`.
size_t LeadingSpaceLen(absl::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t next = pos;
    if (!internal::IsUnicodeWhitespace(internal::NextCodepoint(s, &next))) break;
    pos = next;
  }
  return pos;
}

class HfTokenizer : public Tokenizer, public StreamSupport {
 public:
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> Parse(const std::string& json_text);

  absl::StatusOr<std::vector<int32_t>> Encode(const std::string& text,
                                              bool add_special_tokens) const override;
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                     bool skip_special_tokens) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(id_to_token_.size()); }
  int32_t TokenToId(const std::string& token) const override;
  bool IsSpecial(int32_t id) const override {
    return id >= 0 && id < vocab_size() && (flags_[id] & kSpecial) != 0;
  }
  absl::StatusOr<std::string> TokenBytes(int32_t id) const override {
    return StreamBytes(id, false);
  }
  absl::StatusOr<std::string> StreamBytes(int32_t id, bool first) const override;
  bool HasByteFallback() const override {
    return decoder_ != nullptr && decoder_->HasByteFallback();
  }
  bool IsFallbackByte(int32_t id) const override {
    return id >= 0 && id < vocab_size() && (flags_[id] & kFallbackByte) != 0;
  }

 private:
  static constexpr uint8_t kPresent = 1, kSpecial = 2, kFallbackByte = 4;

  absl::Status ParseModel(const json& model);
  absl::Status ParseAddedTokens(const json& added);
  absl::Status CheckId(int32_t id) const {
    if (id < 0 || id >= vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab_size(), ")"));
    }
    return absl::OkStatus();
  }
  // Splits `text` around the added tokens `matcher` finds (Hugging Face find_matches).
  void SplitAdded(const TokenMatcher& matcher, absl::string_view text,
                  std::vector<Segment>* out) const;
  absl::Status EncodePiece(std::string text, bool at_origin, std::vector<int32_t>* ids) const;

  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<PostProcessor> post_processor_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_;
  absl::flat_hash_map<std::string, int32_t> added_ids_;
  TokenMatcher raw_matcher_;         // added tokens with normalized == false
  TokenMatcher normalized_matcher_;  // added tokens with normalized == true (normalized content)
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> flags_;
};

absl::Status HfTokenizer::ParseModel(const json& model) {
  constexpr absl::string_view kWhat = "model";
  if (!model.is_object())
    return absl::InvalidArgumentError("tokenizer.json: \"model\" must be an object");
  STRATA_ASSIGN_OR_RETURN(std::string type, internal::JsonStringOr(model, "type", "", kWhat));
  if (type.empty() && model.contains("merges")) type = "BPE";
  if (type != "BPE") {
    return absl::InvalidArgumentError(absl::StrCat("unsupported model type \"", type, "\""));
  }
  auto dropout = model.find("dropout");
  if (dropout != model.end() && !dropout->is_null()) {
    if (!dropout->is_number() || dropout->get<double>() != 0.0) {
      return absl::InvalidArgumentError("unsupported BPE dropout (only null or 0)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    STRATA_ASSIGN_OR_RETURN(std::string v, internal::JsonStringOr(model, key, "", kWhat));
    if (!v.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("unsupported BPE ", key, " \"", v, "\""));
    }
  }
  internal::BpeOptions options;
  STRATA_ASSIGN_OR_RETURN(options.unk_token, internal::JsonStringOr(model, "unk_token", "", kWhat));
  STRATA_ASSIGN_OR_RETURN(options.fuse_unk, internal::JsonBoolOr(model, "fuse_unk", false, kWhat));
  STRATA_ASSIGN_OR_RETURN(options.byte_fallback,
                          internal::JsonBoolOr(model, "byte_fallback", false, kWhat));
  STRATA_ASSIGN_OR_RETURN(options.ignore_merges,
                          internal::JsonBoolOr(model, "ignore_merges", false, kWhat));

  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    return absl::InvalidArgumentError("BPE model: \"vocab\" must be an object");
  }
  absl::flat_hash_map<std::string, int32_t> vocab;
  vocab.reserve(vocab_it->size());
  int64_t max_id = -1;
  for (auto it = vocab_it->begin(); it != vocab_it->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() >= kMaxTokenId) {
      return absl::InvalidArgumentError(
          absl::StrCat("BPE model: vocab entry \"", it.key(), "\" has no valid id"));
    }
    const int64_t id = it.value().get<int64_t>();
    vocab[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  auto merges_it = model.find("merges");
  std::vector<std::pair<std::string, std::string>> merges;
  if (merges_it != model.end() && !merges_it->is_null()) {
    if (!merges_it->is_array())
      return absl::InvalidArgumentError("BPE model: \"merges\" must be an array");
    merges.reserve(merges_it->size());
    for (const json& m : *merges_it) {
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        const size_t space = s.find(' ');
        if (space == std::string::npos) {
          return absl::InvalidArgumentError(absl::StrCat("BPE model: bad merge \"", s, "\""));
        }
        merges.emplace_back(s.substr(0, space), s.substr(space + 1));
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        return absl::InvalidArgumentError("BPE model: a merge must be \"a b\" or [\"a\", \"b\"]");
      }
    }
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  flags_.assign(id_to_token_.size(), 0);
  for (const auto& [token, id] : vocab) {
    id_to_token_[id] = token;
    flags_[id] |= kPresent;
  }
  STRATA_ASSIGN_OR_RETURN(model_, BpeModel::Create(std::move(vocab), merges, std::move(options)));
  return absl::OkStatus();
}

absl::Status HfTokenizer::ParseAddedTokens(const json& added) {
  if (added.is_null()) return absl::OkStatus();
  if (!added.is_array()) return absl::InvalidArgumentError("\"added_tokens\" must be an array");
  constexpr absl::string_view kWhat = "added token";
  for (const json& t : added) {
    if (!t.is_object()) return absl::InvalidArgumentError("an added token must be an object");
    AddedToken a;
    STRATA_ASSIGN_OR_RETURN(int64_t id, internal::JsonIntOr(t, "id", -1, kWhat));
    if (id < 0 || id >= kMaxTokenId) {
      return absl::InvalidArgumentError("added token: \"id\" must be a non-negative integer");
    }
    a.id = static_cast<int32_t>(id);
    STRATA_ASSIGN_OR_RETURN(a.content, internal::JsonString(t, "content", kWhat));
    STRATA_ASSIGN_OR_RETURN(a.special, internal::JsonBoolOr(t, "special", false, kWhat));
    STRATA_ASSIGN_OR_RETURN(a.lstrip, internal::JsonBoolOr(t, "lstrip", false, kWhat));
    STRATA_ASSIGN_OR_RETURN(a.rstrip, internal::JsonBoolOr(t, "rstrip", false, kWhat));
    STRATA_ASSIGN_OR_RETURN(a.single_word, internal::JsonBoolOr(t, "single_word", false, kWhat));
    STRATA_ASSIGN_OR_RETURN(a.normalized, internal::JsonBoolOr(t, "normalized", !a.special, kWhat));
    if (a.content.empty() || !internal::IsValidUtf8(a.content)) continue;  // never matches
    if (static_cast<size_t>(a.id) >= id_to_token_.size()) {
      id_to_token_.resize(a.id + 1);
      flags_.resize(a.id + 1, 0);
    }
    id_to_token_[a.id] = a.content;
    flags_[a.id] = kPresent | (a.special ? kSpecial : 0);
    added_ids_[a.content] = a.id;
    added_.push_back(std::move(a));
  }
  for (size_t i = 0; i < added_.size(); ++i) {
    const AddedToken& a = added_[i];
    if (!a.normalized) {
      raw_matcher_.Add(a.content, static_cast<int32_t>(i));
    } else {
      std::string content = a.content;
      if (normalizer_ != nullptr) STRATA_RETURN_IF_ERROR(normalizer_->Normalize(&content));
      normalized_matcher_.Add(content, static_cast<int32_t>(i));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::Parse(const std::string& json_text) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("tokenizer.json is not valid JSON");
  if (!root.is_object()) return absl::InvalidArgumentError("tokenizer.json must be a JSON object");
  std::unique_ptr<HfTokenizer> t(new HfTokenizer());
  auto model = root.find("model");
  if (model == root.end()) return absl::InvalidArgumentError("tokenizer.json has no \"model\"");
  STRATA_RETURN_IF_ERROR(t->ParseModel(*model));
  auto field = [&root](const char* key) -> const json* {
    auto it = root.find(key);
    return it == root.end() || it->is_null() ? nullptr : &*it;
  };
  if (const json* j = field("normalizer")) {
    STRATA_ASSIGN_OR_RETURN(t->normalizer_, internal::ParseNormalizer(*j));
  }
  if (const json* j = field("pre_tokenizer")) {
    STRATA_ASSIGN_OR_RETURN(t->pre_tokenizer_, internal::ParsePreTokenizer(*j));
  }
  if (const json* j = field("post_processor")) {
    STRATA_ASSIGN_OR_RETURN(t->post_processor_, internal::ParsePostProcessor(*j));
  }
  if (const json* j = field("decoder")) {
    STRATA_ASSIGN_OR_RETURN(t->decoder_, internal::ParseDecoder(*j));
  }
  if (const json* j = field("added_tokens")) STRATA_RETURN_IF_ERROR(t->ParseAddedTokens(*j));
  if (t->id_to_token_.empty())
    return absl::InvalidArgumentError("tokenizer.json has an empty vocabulary");
  if (t->HasByteFallback()) {
    for (size_t id = 0; id < t->id_to_token_.size(); ++id) {
      if (internal::ByteFallbackValue(t->id_to_token_[id]) >= 0) t->flags_[id] |= kFallbackByte;
    }
  }
  return t;
}

void HfTokenizer::SplitAdded(const TokenMatcher& matcher, absl::string_view text,
                             std::vector<Segment>* out) const {
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto [len, index] = matcher.LongestAt(text, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + len;
    pos = stop;  // the scan resumes after this match, kept or not
    const AddedToken& a = added_[index];
    if (a.single_word) {
      const bool start_space = start == 0 || !EndsWithWordChar(text.substr(0, start));
      const bool stop_space = stop == text.size() || !StartsWithWordChar(text.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (start < start_offset) continue;  // inside whitespace an earlier rstrip took
    if (a.lstrip) start = std::max(TrailingSpaceStart(text.substr(0, start)), start_offset);
    if (a.rstrip) stop += LeadingSpaceLen(text.substr(stop));
    if (start_offset < start) out->push_back(Segment{-1, start_offset, start});
    out->push_back(Segment{a.id, start, stop});
    start_offset = stop;
    pos = std::max(pos, stop);
  }
  if (start_offset < text.size()) out->push_back(Segment{-1, start_offset, text.size()});
}

absl::Status HfTokenizer::EncodePiece(std::string text, bool at_origin,
                                      std::vector<int32_t>* ids) const {
  if (pre_tokenizer_ == nullptr) return model_->Tokenize(text, ids);
  return pre_tokenizer_->PreTokenize(Piece{std::move(text), at_origin}, [this, ids](Piece p) {
    return model_->Tokenize(p.text, ids);
  });
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::Encode(const std::string& text,
                                                         bool add_special_tokens) const {
  std::string repaired;
  absl::string_view input = text;
  if (!internal::IsValidUtf8(text)) {
    repaired = internal::Utf8Lossy(text);
    input = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(input.size() / 3 + 4);
  std::vector<Segment> segments;
  SplitAdded(raw_matcher_, input, &segments);
  std::vector<Segment> inner;
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    std::string piece(input.substr(seg.begin, seg.end - seg.begin));
    const bool at_origin = seg.begin == 0;
    if (normalizer_ != nullptr) STRATA_RETURN_IF_ERROR(normalizer_->Normalize(&piece));
    if (piece.empty()) continue;
    if (normalized_matcher_.empty()) {
      STRATA_RETURN_IF_ERROR(EncodePiece(std::move(piece), at_origin, &ids));
      continue;
    }
    inner.clear();
    SplitAdded(normalized_matcher_, piece, &inner);
    for (const Segment& s : inner) {
      if (s.id >= 0) {
        ids.push_back(s.id);
      } else {
        STRATA_RETURN_IF_ERROR(
            EncodePiece(piece.substr(s.begin, s.end - s.begin), at_origin && s.begin == 0, &ids));
      }
    }
  }
  if (post_processor_ != nullptr) post_processor_->Process(&ids, add_special_tokens);
  return ids;
}

absl::StatusOr<std::string> HfTokenizer::Decode(const std::vector<int32_t>& ids,
                                                bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    STRATA_RETURN_IF_ERROR(CheckId(id));
    if ((flags_[id] & kPresent) == 0) continue;  // a hole in the id space: nothing to show
    if (skip_special_tokens && (flags_[id] & kSpecial) != 0) continue;
    tokens.push_back(id_to_token_[id]);
  }
  if (decoder_ == nullptr) return absl::StrJoin(tokens, " ");
  decoder_->DecodeChain(&tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

absl::StatusOr<std::string> HfTokenizer::StreamBytes(int32_t id, bool first) const {
  STRATA_RETURN_IF_ERROR(CheckId(id));
  if ((flags_[id] & kPresent) == 0) return std::string();
  std::string token = id_to_token_[id];
  if (decoder_ == nullptr) return first ? token : absl::StrCat(" ", token);
  decoder_->StreamToken(&token, first);
  return token;
}

int32_t HfTokenizer::TokenToId(const std::string& token) const {
  auto it = added_ids_.find(token);
  if (it != added_ids_.end()) return it->second;
  auto v = model_->vocab().find(token);
  return v == model_->vocab().end() ? -1 : v->second;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseTokenizerJson(const std::string& json_text) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<HfTokenizer> t, HfTokenizer::Parse(json_text));
  return std::unique_ptr<Tokenizer>(std::move(t));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = ParseTokenizerJson(buf.str());
  if (!t.ok()) return Annotate(t.status(), path);
  return t;
}

StreamingDecoder::StreamingDecoder(const Tokenizer* tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

namespace {

// Flushes a held run of byte-fallback bytes the way the ByteFallback decoder does.
void FlushByteRun(std::string* run, std::string* out) {
  if (internal::IsValidUtf8(*run)) {
    *out += *run;
  } else {
    for (size_t i = 0; i < run->size(); ++i) *out += "\xEF\xBF\xBD";
  }
  run->clear();
}

}  // namespace

absl::StatusOr<std::string> StreamingDecoder::Push(int32_t id) {
  if (skip_special_ && tokenizer_->IsSpecial(id)) return std::string();
  std::string bytes;
  std::string out;
  const auto* ours = dynamic_cast<const StreamSupport*>(tokenizer_);
  if (ours != nullptr) {
    STRATA_ASSIGN_OR_RETURN(bytes, ours->StreamBytes(id, first_));
    first_ = false;
    if (ours->HasByteFallback()) {
      // pending_ only ever holds a run of fallback bytes here.
      if (ours->IsFallbackByte(id)) {
        pending_ += bytes;
        return out;
      }
      FlushByteRun(&pending_, &out);
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(bytes, tokenizer_->TokenBytes(id));
    first_ = false;
  }
  pending_ += bytes;
  const size_t used = internal::Utf8LossyPrefix(pending_, &out);
  pending_.erase(0, used);
  return out;
}

std::string StreamingDecoder::Finish() {
  std::string out;
  const auto* ours = dynamic_cast<const StreamSupport*>(tokenizer_);
  if (ours != nullptr && ours->HasByteFallback()) {
    FlushByteRun(&pending_, &out);
  } else {
    out = internal::Utf8Lossy(pending_);
    pending_.clear();
  }
  return out;
}

}  // namespace strata::model
