// TrainByteLevelBpeJson: a deterministic byte-level BPE trainer that writes tokenizer.json in
// the Llama 3 layout (Split with the Llama 3 regex + ByteLevel, ByteLevel decoder).
//
// Training: the corpus (special tokens cut out) is split with the Llama 3 regex; each distinct
// word starts as its bytes; the most frequent adjacent pair (ties: smallest left id, then
// smallest right id) is merged until the vocabulary is full or no pair is left.
#include <algorithm>
#include <cstdint>
#include <queue>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/internal/tokenizer_pipeline.h"
#include "model/internal/tokenizer_regex.h"
#include "model/internal/tokenizer_unicode.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using ojson = nlohmann::ordered_json;

inline uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct HeapEntry {
  int64_t count;
  int32_t a, b;
};
struct HeapOrder {  // top = highest count, then smallest (a, b)
  bool operator()(const HeapEntry& x, const HeapEntry& y) const {
    if (x.count != y.count) return x.count < y.count;
    return std::tie(x.a, x.b) > std::tie(y.a, y.b);
  }
};

// Cuts every occurrence of the special tokens out of `text`, returning the pieces between.
std::vector<std::string> CutSpecials(const std::string& text,
                                     const std::vector<std::string>& specials) {
  std::vector<std::string> pieces{text};
  for (const std::string& s : specials) {
    std::vector<std::string> next;
    for (const std::string& p : pieces) {
      size_t prev = 0, pos;
      while ((pos = p.find(s, prev)) != std::string::npos) {
        next.push_back(p.substr(prev, pos - prev));
        prev = pos + s.size();
      }
      next.push_back(p.substr(prev));
    }
    pieces = std::move(next);
  }
  return pieces;
}

}  // namespace

absl::StatusOr<std::string> TrainByteLevelBpeJson(const std::string& corpus, int32_t vocab_size,
                                                  const std::vector<std::string>& special_tokens,
                                                  bool add_bos) {
  const int64_t num_special = static_cast<int64_t>(special_tokens.size());
  if (vocab_size < 256 + num_special) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size ", vocab_size, " < 256 + ", num_special, " special tokens"));
  }
  if (add_bos && special_tokens.empty()) {
    return absl::InvalidArgumentError("add_bos needs at least one special token (the BOS)");
  }
  absl::flat_hash_set<std::string> seen;
  for (const std::string& s : special_tokens) {
    if (s.empty() || !internal::IsValidUtf8(s) || !seen.insert(s).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("special token \"", s, "\" is empty, not UTF-8 or repeated"));
    }
  }

  // 1. Distinct words and their counts, in a deterministic (sorted) order.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<internal::Regex> regex,
                          internal::Regex::Compile(internal::kLlama3Regex));
  absl::flat_hash_map<std::string, int64_t> word_counts;
  std::vector<std::pair<size_t, size_t>> spans;
  for (const std::string& piece : CutSpecials(internal::Utf8Lossy(corpus), special_tokens)) {
    spans.clear();
    STRATA_RETURN_IF_ERROR(regex->FindAll(piece, &spans));
    size_t prev = 0;
    for (const auto& [b, e] : spans) {
      if (b > prev) ++word_counts[piece.substr(prev, b - prev)];
      ++word_counts[piece.substr(b, e - b)];
      prev = e;
    }
    if (prev < piece.size()) ++word_counts[piece.substr(prev)];
  }
  std::vector<std::pair<std::string, int64_t>> sorted(word_counts.begin(), word_counts.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::vector<int32_t>> words(sorted.size());
  std::vector<int64_t> counts(sorted.size());
  for (size_t w = 0; w < sorted.size(); ++w) {
    counts[w] = sorted[w].second;
    for (char c : sorted[w].first) words[w].push_back(static_cast<uint8_t>(c));
  }

  // 2. The byte alphabet: id b is the byte-level character of byte b.
  std::vector<std::string> tokens;
  absl::flat_hash_map<std::string, int32_t> vocab;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(internal::ByteLevelChar(static_cast<uint8_t>(b)));
    vocab[tokens.back()] = b;
  }
  const int64_t target = vocab_size - num_special;

  // 3. Pair statistics.
  absl::flat_hash_map<uint64_t, int64_t> pair_counts;
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> pair_words;
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, HeapOrder> heap;
  for (size_t w = 0; w < words.size(); ++w) {
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t key = PairKey(words[w][i], words[w][i + 1]);
      pair_counts[key] += counts[w];
      auto& list = pair_words[key];
      if (list.empty() || list.back() != static_cast<int32_t>(w)) list.push_back(w);
    }
  }
  {
    std::vector<std::pair<uint64_t, int64_t>> initial(pair_counts.begin(), pair_counts.end());
    std::sort(initial.begin(), initial.end());
    for (const auto& [key, count] : initial) {
      heap.push(HeapEntry{count, static_cast<int32_t>(key >> 32), static_cast<int32_t>(key)});
    }
  }

  std::vector<std::pair<std::string, std::string>> merges;
  absl::flat_hash_set<uint64_t> merged;
  std::vector<uint64_t> changed;
  std::vector<int32_t> rewritten;
  while (static_cast<int64_t>(vocab.size()) < target && !heap.empty()) {
    const HeapEntry top = heap.top();
    heap.pop();
    const uint64_t key = PairKey(top.a, top.b);
    auto pc = pair_counts.find(key);
    if (pc == pair_counts.end() || pc->second != top.count || top.count <= 0) continue;  // stale
    if (!merged.insert(key).second) continue;
    const std::string joined = tokens[top.a] + tokens[top.b];
    int32_t new_id;
    auto v = vocab.find(joined);
    if (v != vocab.end()) {
      new_id = v->second;
    } else {
      new_id = static_cast<int32_t>(tokens.size());
      tokens.push_back(joined);
      vocab[joined] = new_id;
    }
    merges.emplace_back(tokens[top.a], tokens[top.b]);

    changed.clear();
    std::vector<int32_t> affected = std::move(pair_words[key]);
    pair_words.erase(key);
    int32_t last = -1;
    for (int32_t w : affected) {
      if (w == last) continue;
      last = w;
      std::vector<int32_t>& word = words[w];
      bool has = false;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        if (word[i] == top.a && word[i + 1] == top.b) {
          has = true;
          break;
        }
      }
      if (!has) continue;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const uint64_t k = PairKey(word[i], word[i + 1]);
        pair_counts[k] -= counts[w];
        changed.push_back(k);
      }
      rewritten.clear();
      for (size_t i = 0; i < word.size(); ++i) {
        if (i + 1 < word.size() && word[i] == top.a && word[i + 1] == top.b) {
          rewritten.push_back(new_id);
          ++i;
        } else {
          rewritten.push_back(word[i]);
        }
      }
      word = rewritten;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const uint64_t k = PairKey(word[i], word[i + 1]);
        pair_counts[k] += counts[w];
        changed.push_back(k);
        auto& list = pair_words[k];
        if (list.empty() || list.back() != w) list.push_back(w);
      }
    }
    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    for (uint64_t k : changed) {
      const int64_t c = pair_counts[k];
      if (c > 0 && !merged.contains(k)) {
        heap.push(HeapEntry{c, static_cast<int32_t>(k >> 32), static_cast<int32_t>(k)});
      }
    }
  }

  // 4. tokenizer.json in the schema of Hugging Face `tokenizers`.
  const int32_t first_special = static_cast<int32_t>(tokens.size());
  for (const std::string& s : special_tokens) {
    if (vocab.contains(s)) {
      return absl::InvalidArgumentError(
          absl::StrCat("special token \"", s, "\" is also a byte-level vocabulary entry"));
    }
  }
  ojson added = ojson::array();
  for (size_t i = 0; i < special_tokens.size(); ++i) {
    added.push_back(ojson{{"id", first_special + static_cast<int32_t>(i)},
                          {"content", special_tokens[i]},
                          {"single_word", false},
                          {"lstrip", false},
                          {"rstrip", false},
                          {"normalized", false},
                          {"special", true}});
  }
  const ojson byte_level_post = {{"type", "ByteLevel"},
                                 {"add_prefix_space", true},
                                 {"trim_offsets", false},
                                 {"use_regex", true}};
  ojson post_processor = byte_level_post;
  if (add_bos) {
    const std::string& bos = special_tokens[0];
    ojson special_map = ojson::object();
    special_map[bos] =
        ojson{{"id", bos}, {"ids", ojson::array({first_special})}, {"tokens", ojson::array({bos})}};
    auto special_item = [&bos](int type_id) {
      return ojson{{"SpecialToken", ojson{{"id", bos}, {"type_id", type_id}}}};
    };
    auto sequence_item = [](const char* id, int type_id) {
      return ojson{{"Sequence", ojson{{"id", id}, {"type_id", type_id}}}};
    };
    ojson templ = {{"type", "TemplateProcessing"},
                   {"single", ojson::array({special_item(0), sequence_item("A", 0)})},
                   {"pair", ojson::array({special_item(0), sequence_item("A", 0), special_item(1),
                                          sequence_item("B", 1)})},
                   {"special_tokens", special_map}};
    post_processor =
        ojson{{"type", "Sequence"}, {"processors", ojson::array({byte_level_post, templ})}};
  }
  ojson vocab_json = ojson::object();
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (vocab[tokens[id]] == static_cast<int32_t>(id)) vocab_json[tokens[id]] = id;
  }
  ojson merges_json = ojson::array();
  for (const auto& [a, b] : merges) merges_json.push_back(absl::StrCat(a, " ", b));

  ojson root;
  root["version"] = "1.0";
  root["truncation"] = nullptr;
  root["padding"] = nullptr;
  root["added_tokens"] = added;
  root["normalizer"] = nullptr;
  root["pre_tokenizer"] =
      ojson{{"type", "Sequence"},
            {"pretokenizers",
             ojson::array({ojson{{"type", "Split"},
                                 {"pattern", ojson{{"Regex", std::string(internal::kLlama3Regex)}}},
                                 {"behavior", "Isolated"},
                                 {"invert", false}},
                           ojson{{"type", "ByteLevel"},
                                 {"add_prefix_space", false},
                                 {"trim_offsets", true},
                                 {"use_regex", false}}})}};
  root["post_processor"] = post_processor;
  root["decoder"] = ojson{{"type", "ByteLevel"},
                          {"add_prefix_space", true},
                          {"trim_offsets", true},
                          {"use_regex", true}};
  root["model"] = ojson{{"type", "BPE"},
                        {"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"continuing_subword_prefix", nullptr},
                        {"end_of_word_suffix", nullptr},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"ignore_merges", false},
                        {"vocab", vocab_json},
                        {"merges", merges_json}};
  return root.dump(2, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace strata::model
