// Random Llama-family models in Hugging Face layout, for tests, benchmarks and `strata make-model`.
//
// WriteRandomModel writes DIR/config.json, DIR/model.safetensors (or shards of at most
// max_shard_bytes plus model.safetensors.index.json) and DIR/tokenizer.json (a byte-level BPE
// trained on a built-in English corpus, with <|begin_of_text|> / <|end_of_text|> as BOS / EOS).
// Weights are seeded normal(0, 0.02) (norm weights 1 + normal(0, 0.02)); each tensor's values
// depend only on the seed and the tensor name, never on thread count or sharding. Tensors are
// generated and written block by block, so memory stays small even for 8B-parameter shapes.
// Functions are thread-compatible (they use worker threads internally).
#ifndef STRATA_MODEL_RANDOM_MODEL_H_
#define STRATA_MODEL_RANDOM_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace strata::model {

struct RandomModelOptions {
  // Architecture: llama gets Llama 3.1 style llama3 rope scaling, qwen2 QKV bias, mistral neither.
  // Default: kLlama.
  Architecture arch = Architecture::kLlama;
  // "tiny" (hidden 64, 2 layers, 4/2 heads, d 16, ffn 128, vocab 512), "small" (~90M parameters:
  // hidden 768, 12 layers, 12/4 heads, ffn 2048, vocab 8192), "llama-3.2-1b", "llama-3.1-8b"
  // (the real shapes, vocab 128256). Default: "tiny".
  std::string preset = "tiny";
  // Weight dtype: kF32, kBF16 or kF16. Default: kF32.
  kernels::DType dtype = kernels::DType::kF32;
  // Seed of every weight. Default: 0.
  uint64_t seed = 0;
  // Vocabulary size (model and tokenizer); 0 keeps the preset's. At least 258 (256 byte tokens and
  // the two specials). Default: 0.
  int64_t vocab_size = 0;
  // Write tokenizer.json. Default: true.
  bool write_tokenizer = true;
  // Largest safetensors file; a checkpoint larger than this is sharded. Default: 2 GiB.
  int64_t max_shard_bytes = int64_t{2} << 30;
  // Print progress lines to stderr. Default: false.
  bool progress = false;

  absl::Status Validate() const;
};

// The config a preset stands for (bos/eos set to the last two ids, the tokenizer's specials).
// InvalidArgument for an unknown preset or invalid options.
absl::StatusOr<ModelConfig> RandomModelConfig(const RandomModelOptions& options);

// Every tensor a checkpoint of `config` holds, in canonical order (HF names, shapes), all `dtype`.
std::vector<SafetensorsEntry> CheckpointTensors(const ModelConfig& config, kernels::DType dtype);

// Writes `entries` to the safetensors file `path` with seeded random values (see file comment).
// Errors as SafetensorsWriter.
absl::Status WriteRandomSafetensors(const std::string& path,
                                    const std::vector<SafetensorsEntry>& entries, uint64_t seed,
                                    bool progress = false);

// Writes config.json and the weights (sharded above options.max_shard_bytes, with
// model.safetensors.index.json) of `config` into `dir` (created when missing), using
// options.dtype / seed / max_shard_bytes / progress. No tokenizer. InvalidArgument / Internal.
absl::Status WriteRandomCheckpoint(const std::string& dir, const ModelConfig& config,
                                   const RandomModelOptions& options);

// RandomModelConfig, then (when options.write_tokenizer) trains and writes tokenizer.json with
// model::TrainByteLevelBpeJson and takes bos/eos from its special tokens, then
// WriteRandomCheckpoint. Returns the config written.
absl::StatusOr<ModelConfig> WriteRandomModel(const std::string& dir,
                                             const RandomModelOptions& options);

// The built-in English text the tokenizer is trained on (a few KB).
const std::string& RandomModelCorpus();

}  // namespace strata::model

#endif  // STRATA_MODEL_RANDOM_MODEL_H_
