// Model configuration: the architecture hyper-parameters read from a Hugging Face config.json.
//
// Supported families: Llama 2 / 3 / 3.1 / 3.2 ("LlamaForCausalLM"), Mistral
// ("MistralForCausalLM"), Qwen2 / 2.5 ("Qwen2ForCausalLM", QKV bias). Fields that would change
// the math and are not supported (another rope type, sliding-window attention in use, other
// activations, ...) make ParseModelConfig fail with InvalidArgument rather than be ignored.
// Plain value type; thread-compatible.
#ifndef STRATA_MODEL_CONFIG_H_
#define STRATA_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace strata::model {

enum class Architecture { kLlama, kMistral, kQwen2 };
const char* ArchitectureName(Architecture a);  // "llama", "mistral", "qwen2"

struct RopeScaling {
  enum class Type { kNone, kLlama3 };
  Type type = Type::kNone;
  // llama3 parameters (transformers' _compute_llama3_parameters).
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // explicit "head_dim" or hidden_size / num_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry a bias (Qwen2: always true)
  bool mlp_bias = false;        // must be false (unsupported otherwise)
  std::vector<int32_t> bos_token_ids;  // may be empty
  std::vector<int32_t> eos_token_ids;  // may be empty
  kernels::DType torch_dtype = kernels::DType::kF32;  // dtype the weights were saved in

  // Checks internal consistency (positive sizes, heads divide, head_dim even, ...).
  absl::Status Validate() const;
  // Inverse frequencies of the rotary embedding, [head_dim / 2], llama3 scaling applied.
  std::vector<float> RopeInvFreq() const;
  // One line for logs: "llama L=2 H=64 heads=4/2 d=16 ffn=128 vocab=300 rope=10000(llama3 x8)".
  std::string DebugString() const;
};

// Parses the text of a config.json. Reads both spellings of the rope settings: "rope_theta" +
// "rope_scaling" (published models) and "rope_parameters" (transformers 5).
// InvalidArgument on malformed JSON, missing required fields, or unsupported settings.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text);
// Reads and parses DIR/config.json. NotFound when the file is missing.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);
// Serialises a config in Hugging Face form (used by make-model); ParseModelConfig round-trips it.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace strata::model

#endif  // STRATA_MODEL_CONFIG_H_
