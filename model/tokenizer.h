// Tokenizer: Hugging Face tokenizer.json, the two BPE families Strata supports.
//
// - Byte-level BPE (Llama 3, Qwen2, GPT-2 style): a "ByteLevel" pre-tokenizer/decoder, usually
//   behind a "Split" pre-tokenizer with the Llama 3 or Qwen2 regex; tokens are byte-to-unicode
//   mapped strings.
// - SentencePiece-style BPE with byte fallback (Llama 2, Mistral): "▁" replaces spaces
//   (normalizer Prepend/Replace or Metaspace pre-tokenizer), unknown characters become <0xNN>
//   byte tokens, decoder ByteFallback + Fuse + Strip.
// Added tokens (special or not) are matched in the raw text before pre-tokenization.
//
// Encode is deterministic and matches Hugging Face `tokenizers` ids exactly for these forms.
// Immutable after construction; Encode/Decode are safe to call from many threads.
#ifndef STRATA_MODEL_TOKENIZER_H_
#define STRATA_MODEL_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace strata::model {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Text to ids. `add_special_tokens` adds what the post-processor adds (e.g. BOS). Invalid UTF-8
  // in `text` is repaired first: each maximal ill-formed subsequence becomes U+FFFD.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(const std::string& text,
                                                      bool add_special_tokens) const = 0;
  // Ids to text. InvalidArgument for ids outside the vocabulary. Special tokens are skipped when
  // `skip_special_tokens`. Invalid UTF-8 (a byte sequence cut short) is replaced by U+FFFD.
  virtual absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                                             bool skip_special_tokens) const = 0;
  virtual int32_t vocab_size() const = 0;  // largest id + 1
  // Id of a token string (added or regular), or -1.
  virtual int32_t TokenToId(const std::string& token) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  // The raw bytes a single token stands for (after byte-level / byte-fallback / "▁" decoding),
  // for streaming decode. Empty for special tokens when skipped.
  virtual absl::StatusOr<std::string> TokenBytes(int32_t id) const = 0;
};

// Parses tokenizer.json text. InvalidArgument for malformed JSON or unsupported models,
// normalizers, pre-tokenizers or decoders (the message names what is unsupported).
absl::StatusOr<std::unique_ptr<Tokenizer>> ParseTokenizerJson(const std::string& json_text);
// Reads DIR/tokenizer.json.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir);

// Streams decoded text token by token without ever splitting a UTF-8 character across chunks:
// bytes of an incomplete character are held back until the character completes. For tokenizers
// with a ByteFallback decoder a run of <0xNN> tokens is held until the run ends, because such a
// run decodes as a whole (valid UTF-8, or one U+FFFD per byte). The concatenated chunks plus
// Finish() equal Decode() of the same ids (a Strip decoder's trailing strip, unused by the
// supported models, is not applied to streams). Not thread-safe; one per stream.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer* tokenizer, bool skip_special_tokens = true);
  // Returns the text that became complete with this token (possibly empty).
  absl::StatusOr<std::string> Push(int32_t id);
  // Returns any held-back bytes at end of stream (invalid ones replaced by U+FFFD).
  std::string Finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
  bool first_ = true;
};

// Trains a byte-level BPE (GPT-2 byte-to-unicode alphabet, Llama 3 split regex) on `corpus` until
// the vocabulary has `vocab_size` entries including `special_tokens` (appended last, e.g.
// "<|begin_of_text|>", "<|end_of_text|>"), and returns it as tokenizer.json text that
// ParseTokenizerJson and Hugging Face `tokenizers` both load. Deterministic.
// InvalidArgument when vocab_size < 256 + special_tokens.size().
absl::StatusOr<std::string> TrainByteLevelBpeJson(const std::string& corpus, int32_t vocab_size,
                                                  const std::vector<std::string>& special_tokens,
                                                  bool add_bos);

}  // namespace strata::model

#endif  // STRATA_MODEL_TOKENIZER_H_
