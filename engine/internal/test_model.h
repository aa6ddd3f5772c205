// Test-only: a small random Llama/Qwen2-shaped model held in memory (weights in f32, bf16 or
// f16) with the f32 values of every tensor for reference computations. Used by the engine tests.
#ifndef STRATA_ENGINE_INTERNAL_TEST_MODEL_H_
#define STRATA_ENGINE_INTERNAL_TEST_MODEL_H_

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kernels/tensor.h"
#include "model/config.h"
#include "model/weights.h"

namespace strata::engine::test_model {

using kernels::DType;
using kernels::TensorView;

inline constexpr uint32_t kTestModelSeed = 7321;

// A random model held in memory: tensors stored in `dtype`, plus their f32 values for the
// reference.
struct TestModel {
  model::ModelConfig config;
  model::ModelWeights weights;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<std::vector<float>> values;

  // Returns the index of a new tensor of `n` random values in [-scale, scale] (or around 1 for
  // norms when `around_one`).
  TensorView Make(std::mt19937& rng, DType dtype, std::initializer_list<int64_t> dims,
                  float scale, bool around_one, const std::vector<float>** vals) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    std::vector<float> raw(n);
    for (float& x : raw) {
      const float u = static_cast<float>(rng() >> 8) / 16777216.0f * 2.0f - 1.0f;
      x = around_one ? 1.0f + 0.2f * u : scale * u;
    }
    storage.emplace_back(n * kernels::DTypeSize(dtype));
    kernels::ConvertFromF32(raw.data(), storage.back().data(), dtype, n);
    values.emplace_back(n);
    kernels::ConvertToF32(storage.back().data(), dtype, values.back().data(), n);
    if (vals) *vals = &values.back();
    return TensorView(storage.back().data(), dtype, dims);
  }
};

struct RefLayer {
  const std::vector<float>*in_norm, *q, *k, *v, *qb, *kb, *vb, *o, *post_norm, *gate, *up, *down;
};
struct RefModel {
  const std::vector<float>*embed, *final_norm, *lm_head;
  std::vector<RefLayer> layers;
};

inline std::unique_ptr<TestModel> MakeModel(DType dtype, bool bias, bool tied, RefModel* ref) {
  auto m = std::make_unique<TestModel>();
  model::ModelConfig& c = m->config;
  c.arch = bias ? model::Architecture::kQwen2 : model::Architecture::kLlama;
  c.vocab_size = 67;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 1024;
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  c.eos_token_ids = {1};
  c.torch_dtype = dtype;
  // Reserve so the vectors never reallocate (views point into them).
  m->storage.reserve(64);
  m->values.reserve(64);
  std::mt19937 rng(kTestModelSeed);
  const int64_t h = c.hidden_size, qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  const int64_t f = c.intermediate_size;
  model::ModelWeights& w = m->weights;
  w.embed_tokens = m->Make(rng, dtype, {c.vocab_size, h}, 1.0f, false, &ref->embed);
  for (int l = 0; l < c.num_layers; ++l) {
    model::LayerWeights lw;
    RefLayer rl{};
    lw.input_norm = m->Make(rng, dtype, {h}, 0, true, &rl.in_norm);
    lw.q_proj = m->Make(rng, dtype, {qd, h}, 0.3f, false, &rl.q);
    lw.k_proj = m->Make(rng, dtype, {kvd, h}, 0.3f, false, &rl.k);
    lw.v_proj = m->Make(rng, dtype, {kvd, h}, 0.3f, false, &rl.v);
    if (bias) {
      lw.q_bias = m->Make(rng, dtype, {qd}, 0.2f, false, &rl.qb);
      lw.k_bias = m->Make(rng, dtype, {kvd}, 0.2f, false, &rl.kb);
      lw.v_bias = m->Make(rng, dtype, {kvd}, 0.2f, false, &rl.vb);
    }
    lw.o_proj = m->Make(rng, dtype, {h, qd}, 0.3f, false, &rl.o);
    lw.post_attention_norm = m->Make(rng, dtype, {h}, 0, true, &rl.post_norm);
    lw.gate_proj = m->Make(rng, dtype, {f, h}, 0.3f, false, &rl.gate);
    lw.up_proj = m->Make(rng, dtype, {f, h}, 0.3f, false, &rl.up);
    lw.down_proj = m->Make(rng, dtype, {h, f}, 0.3f, false, &rl.down);
    w.layers.push_back(lw);
    ref->layers.push_back(rl);
  }
  w.final_norm = m->Make(rng, dtype, {h}, 0, true, &ref->final_norm);
  if (tied) {
    w.lm_head = w.embed_tokens;
    ref->lm_head = ref->embed;
  } else {
    w.lm_head = m->Make(rng, dtype, {c.vocab_size, h}, 1.0f, false, &ref->lm_head);
  }
  return m;
}

}  // namespace strata::engine::test_model

#endif  // STRATA_ENGINE_INTERNAL_TEST_MODEL_H_
