// BPE model: merges applied lowest rank first (leftmost on ties), as Hugging Face `tokenizers`.
#include "model/internal/tokenizer_bpe.h"

#include <cstdio>
#include <queue>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/internal/tokenizer_unicode.h"

namespace strata::model::internal {
namespace {

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  int32_t len;  // bytes of the word this symbol covers; 0 once merged into its left neighbour
};

struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t new_id;
};

struct CandidateOrder {  // std::priority_queue pops the "largest": lowest rank, then leftmost
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.pos > b.pos;
  }
};

constexpr absl::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

inline uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::Create(
    absl::flat_hash_map<std::string, int32_t> vocab,
    const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->vocab_ = std::move(vocab);
  m->options_ = std::move(options);
  m->merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = m->vocab_.find(a);
    auto ib = m->vocab_.find(b);
    if (ia == m->vocab_.end() || ib == m->vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("BPE merge ", rank, " (\"", a, "\", \"", b,
                                                     "\") names a token not in vocab"));
    }
    auto ij = m->vocab_.find(absl::StrCat(a, b));
    if (ij == m->vocab_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("BPE merge ", rank, " result \"", a, b, "\" is not in vocab"));
    }
    // A repeated pair keeps its last rank, like the Hugging Face loader's map.
    m->merges_[PairKey(ia->second, ib->second)] = {static_cast<int32_t>(rank), ij->second};
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = m->vocab_.find(name);
    m->byte_ids_[b] = it == m->vocab_.end() ? -1 : it->second;
  }
  if (m->options_.split_long_words && m->vocab_.contains(kSpace)) {
    m->can_split_ = true;
    for (const auto& [token, id] : m->vocab_) {
      size_t pos = 0;
      while ((pos = absl::string_view(token).find(kSpace, pos + 1)) != absl::string_view::npos) {
        size_t start = pos - 1;
        while (start > 0 && (static_cast<unsigned char>(token[start]) & 0xC0) == 0x80) --start;
        m->joined_before_space_.insert(token.substr(start, pos - start));
      }
    }
  }
  if (!m->options_.unk_token.empty()) {
    auto it = m->vocab_.find(m->options_.unk_token);
    if (it != m->vocab_.end()) m->unk_id_ = it->second;
  }
  return m;
}

absl::Status BpeModel::Tokenize(absl::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return absl::OkStatus();
  if (options_.ignore_merges) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      ids->push_back(it->second);
      return absl::OkStatus();
    }
  }
  if (can_split_ && word.size() > kMaxCachedWordBytes) {
    size_t start = 0;
    size_t pos = 0;
    while ((pos = word.find(kSpace, pos + 1)) != absl::string_view::npos) {
      size_t prev = pos - 1;
      while (prev > 0 && (static_cast<unsigned char>(word[prev]) & 0xC0) == 0x80) --prev;
      if (joined_before_space_.contains(word.substr(prev, pos - prev))) continue;
      STRATA_RETURN_IF_ERROR(TokenizeCached(word.substr(start, pos - start), ids));
      start = pos;
    }
    return TokenizeCached(word.substr(start), ids);
  }
  return TokenizeCached(word, ids);
}

absl::Status BpeModel::TokenizeCached(absl::string_view word, std::vector<int32_t>* ids) const {
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    absl::ReaderMutexLock lock(&cache_mu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return absl::OkStatus();
    }
  }
  std::vector<int32_t> out;
  absl::Status s = TokenizeUncached(word, &out);
  if (!s.ok()) return s;
  ids->insert(ids->end(), out.begin(), out.end());
  if (cacheable) {
    absl::MutexLock lock(&cache_mu_);
    if (cache_.size() < kMaxCacheEntries) cache_.emplace(std::string(word), std::move(out));
  }
  return absl::OkStatus();
}

absl::Status BpeModel::TokenizeUncached(absl::string_view word, std::vector<int32_t>* ids) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id, int32_t len) {
    const int32_t n = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, n - 1, n + 1, len});
  };
  // Pending unknown token: (length in bytes), -1 when none.
  int32_t unk_len = -1;
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t start = pos;
    pos += Utf8CharLen(static_cast<unsigned char>(word[pos]));
    if (pos > word.size()) pos = word.size();
    const absl::string_view ch = word.substr(start, pos - start);
    const int32_t byte_len = static_cast<int32_t>(ch.size());
    auto it = vocab_.find(ch);
    if (it != vocab_.end()) {
      if (unk_len >= 0) {
        add(unk_id_, unk_len);
        unk_len = -1;
      }
      add(it->second, byte_len);
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (char c : ch) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        // Like Hugging Face, a pending unknown token is not flushed before byte tokens.
        for (char c : ch) add(byte_ids_[static_cast<uint8_t>(c)], 1);
        continue;
      }
    }
    if (options_.unk_token.empty()) continue;  // no unknown token: the character is dropped
    if (unk_id_ < 0) {
      return absl::InvalidArgumentError(absl::StrCat("BPE unk_token \"", options_.unk_token,
                                                     "\" is needed but not in the vocabulary"));
    }
    if (unk_len >= 0) {
      if (options_.fuse_unk) {
        unk_len += byte_len;
        continue;
      }
      add(unk_id_, unk_len);
    }
    unk_len = byte_len;
  }
  if (unk_len >= 0) add(unk_id_, unk_len);
  if (symbols.empty()) return absl::OkStatus();
  symbols.back().next = -1;

  std::priority_queue<Candidate, std::vector<Candidate>, CandidateOrder> queue;
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    auto it = merges_.find(PairKey(symbols[i].id, symbols[i + 1].id));
    if (it != merges_.end()) {
      queue.push(Candidate{it->second.first, static_cast<int32_t>(i), it->second.second});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next < 0) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = symbols[next_pos];
    auto it = merges_.find(PairKey(cur.id, right.id));
    if (it == merges_.end() || it->second.second != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      auto p = merges_.find(PairKey(symbols[cur.prev].id, cur.id));
      if (p != merges_.end()) queue.push(Candidate{p->second.first, cur.prev, p->second.second});
    }
    if (cur.next >= 0) {
      auto n = merges_.find(PairKey(cur.id, symbols[cur.next].id));
      if (n != merges_.end()) queue.push(Candidate{n->second.first, top.pos, n->second.second});
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) ids->push_back(s.id);
  }
  return absl::OkStatus();
}

}  // namespace strata::model::internal
