// The stages of a Hugging Face tokenizer around its model: normalizers, pre-tokenizers,
// post-processors and decoders, each parsed from its tokenizer.json object, with the semantics
// of Hugging Face `tokenizers` for the forms Strata supports.
//
// Every stage is immutable after parsing and safe to use from many threads.
#ifndef STRATA_MODEL_INTERNAL_TOKENIZER_PIPELINE_H_
#define STRATA_MODEL_INTERNAL_TOKENIZER_PIPELINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace strata::model::internal {

// A piece of text between pipeline stages. `at_origin`: the piece starts at byte 0 of the
// original input (Metaspace's prepend_scheme "first" needs it).
struct Piece {
  std::string text;
  bool at_origin = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual absl::Status Normalize(std::string* text) const = 0;
};

// Receives the pieces a pre-tokenizer produces, in order; an error stops the pre-tokenizer.
using PieceSink = absl::FunctionRef<absl::Status(Piece)>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits (and may rewrite) `piece`, passing each non-empty result to `emit` in order. Pieces
  // are independent, so a Sequence runs its steps depth-first (piece by piece) with the same
  // result as Hugging Face's stage-by-stage order, without holding every piece of a document.
  virtual absl::Status PreTokenize(Piece piece, PieceSink emit) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds what the processor adds around a single sequence when `add_special_tokens`.
  virtual void Process(std::vector<int32_t>* ids, bool add_special_tokens) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Hugging Face `decode_chain`: token strings in, strings out (concatenated by the caller).
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
  // The bytes one token contributes to a stream of output, without any UTF-8 repair. `first`:
  // the token is the first of the output (Strip and Metaspace treat it specially).
  virtual void StreamToken(std::string* token, bool first) const = 0;
  // True when the chain contains a ByteFallback decoder (<0xNN> tokens are raw bytes).
  virtual bool HasByteFallback() const { return false; }
};

// The byte a ByteFallback token "<0xNN>" stands for, or -1 for any other token.
int ByteFallbackValue(const std::string& token);

// Each parser takes one JSON object (never null) and returns InvalidArgument for malformed or
// unsupported input, naming the offending type.
absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const nlohmann::json& j);
absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const nlohmann::json& j);
absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(const nlohmann::json& j);
absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const nlohmann::json& j);

// JSON field helpers. Absent and null fields take the default; a field of the wrong type is
// InvalidArgument naming `what` and the key.
absl::StatusOr<std::string> JsonString(const nlohmann::json& obj, const char* key,
                                       absl::string_view what);
absl::StatusOr<std::string> JsonStringOr(const nlohmann::json& obj, const char* key,
                                         const std::string& dflt, absl::string_view what);
absl::StatusOr<bool> JsonBoolOr(const nlohmann::json& obj, const char* key, bool dflt,
                                absl::string_view what);
absl::StatusOr<int64_t> JsonIntOr(const nlohmann::json& obj, const char* key, int64_t dflt,
                                  absl::string_view what);

// The GPT-2 pre-tokenization regex used by the ByteLevel pre-tokenizer (use_regex).
extern const char kGpt2Regex[];
// The Llama 3 Split pre-tokenizer regex (digits in groups of up to three).
extern const char kLlama3Regex[];

}  // namespace strata::model::internal

#endif  // STRATA_MODEL_INTERNAL_TOKENIZER_PIPELINE_H_
