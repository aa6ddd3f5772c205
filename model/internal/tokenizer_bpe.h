// The BPE model of a Hugging Face tokenizer: vocabulary, ranked merges, byte fallback,
// ignore_merges and unknown-token handling, with a bounded per-word cache.
//
// Immutable after Create except for the word cache, which is guarded by a mutex: Tokenize is
// safe to call from many threads.
#ifndef STRATA_MODEL_INTERNAL_TOKENIZER_BPE_H_
#define STRATA_MODEL_INTERNAL_TOKENIZER_BPE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace strata::model::internal {

struct BpeOptions {
  // Characters missing from the vocabulary become their UTF-8 bytes as <0xNN> tokens.
  bool byte_fallback = false;
  // A word found whole in the vocabulary is one token, without applying merges.
  bool ignore_merges = false;
  // Consecutive unknown characters become one unknown token.
  bool fuse_unk = false;
  // The unknown token's string; empty: unknown characters are dropped (as Hugging Face does).
  std::string unk_token;
  // Long words (SentencePiece-style text without a pre-tokenizer is one word) are cut before
  // each "▁" that no vocabulary token joins to the character before it. No merge can cross such
  // a cut, so the result is unchanged; the pieces hit the word cache and keep the merge queue
  // small. Off only to test that equivalence.
  bool split_long_words = true;
};

class BpeModel {
 public:
  // `merges` in rank order (first = merged first). InvalidArgument when a merge names a token
  // that is not in `vocab`, or its concatenation is not in `vocab`.
  static absl::StatusOr<std::unique_ptr<BpeModel>> Create(
      absl::flat_hash_map<std::string, int32_t> vocab,
      const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);

  // Appends the ids of one pre-tokenized word (valid UTF-8). InvalidArgument when an unknown
  // character needs the unknown token and it is not in the vocabulary.
  absl::Status Tokenize(absl::string_view word, std::vector<int32_t>* ids) const;

  const absl::flat_hash_map<std::string, int32_t>& vocab() const { return vocab_; }
  // Id of the byte-fallback token <0xNN> for byte b, or -1.
  int32_t ByteTokenId(uint8_t b) const { return byte_ids_[b]; }

 private:
  BpeModel() = default;
  absl::Status TokenizeCached(absl::string_view word, std::vector<int32_t>* ids) const;
  absl::Status TokenizeUncached(absl::string_view word, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  // (left id << 32 | right id) -> (rank, merged id).
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::array<int32_t, 256> byte_ids_{};
  BpeOptions options_;
  int32_t unk_id_ = -1;  // -1: no unknown token configured or not in the vocabulary
  // Characters x such that some vocabulary token contains x immediately followed by "▁".
  absl::flat_hash_set<std::string> joined_before_space_;
  bool can_split_ = false;  // "▁" is in the vocabulary and split_long_words is set

  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 17;
  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_ ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace strata::model::internal

#endif  // STRATA_MODEL_INTERNAL_TOKENIZER_BPE_H_
