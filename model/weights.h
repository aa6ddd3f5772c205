// Model weights: host views of every tensor of a Llama-family checkpoint, backed by read-only
// memory maps of its safetensors files.
//
// LoadModelWeights checks every tensor the config requires is present with the right shape and a
// float dtype (f32, bf16, f16), and that no tensor the architecture does not use is left over
// except ignorable ones (e.g. rotary inv_freq buffers). The views stay valid while the
// ModelWeights object lives. Immutable after load; safe to read from many threads.
#ifndef STRATA_MODEL_WEIGHTS_H_
#define STRATA_MODEL_WEIGHTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "model/config.h"

namespace strata::model {

struct LayerWeights {
  kernels::TensorView input_norm;           // [hidden]
  kernels::TensorView q_proj;               // [num_heads * head_dim, hidden]
  kernels::TensorView k_proj;               // [num_kv_heads * head_dim, hidden]
  kernels::TensorView v_proj;               // [num_kv_heads * head_dim, hidden]
  kernels::TensorView q_bias, k_bias, v_bias;  // [out] when config.attention_bias, else data null
  kernels::TensorView o_proj;               // [hidden, num_heads * head_dim]
  kernels::TensorView post_attention_norm;  // [hidden]
  kernels::TensorView gate_proj;            // [intermediate, hidden]
  kernels::TensorView up_proj;              // [intermediate, hidden]
  kernels::TensorView down_proj;            // [hidden, intermediate]
};

class SafetensorsFile;  // model/safetensors.h

struct ModelWeights {
  kernels::TensorView embed_tokens;  // [vocab, hidden]
  std::vector<LayerWeights> layers;  // num_layers
  kernels::TensorView final_norm;    // [hidden]
  kernels::TensorView lm_head;       // [vocab, hidden]; aliases embed_tokens when tied
  std::vector<std::shared_ptr<const SafetensorsFile>> files;  // keep the maps alive
};

// Loads DIR/model.safetensors or the shards listed in DIR/model.safetensors.index.json.
// NotFound: no weights file; InvalidArgument / DataLoss: malformed files, missing or extra
// tensors, wrong shapes or dtypes (the message names the tensor and file).
absl::StatusOr<ModelWeights> LoadModelWeights(const std::string& model_dir,
                                              const ModelConfig& config);

}  // namespace strata::model

#endif  // STRATA_MODEL_WEIGHTS_H_
