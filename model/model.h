// A loaded model: config, weights, tokenizer and fingerprint of a Hugging Face model directory.
//
// LoadModel reads DIR/config.json, the safetensors weights (memory-mapped, read-only),
// DIR/tokenizer.json when present, and computes the fingerprint (model/fingerprint.h).
// A Model is immutable after LoadModel and safe to read from many threads.
#ifndef STRATA_MODEL_MODEL_H_
#define STRATA_MODEL_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace strata::model {

struct Model {
  ModelConfig config;
  ModelWeights weights;                  // views stay valid while this Model lives
  std::unique_ptr<Tokenizer> tokenizer;  // null when DIR has no tokenizer.json
  std::string fingerprint;               // 32 hex chars
};

// Loads the model in `dir`. NotFound: no config.json or no weights. InvalidArgument / DataLoss:
// unsupported or malformed config, weights or tokenizer (also a tokenizer with more ids than
// the model's vocab_size). The message names the file.
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& dir);

}  // namespace strata::model

#endif  // STRATA_MODEL_MODEL_H_
