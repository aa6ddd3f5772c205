#include "model/fingerprint.h"

#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "xxhash.h"

namespace strata::model {
namespace {

// Appends a length-prefixed field so that no two descriptions concatenate to the same bytes.
void AddField(XXH3_state_t* st, const std::string& s) {
  const uint64_t n = s.size();
  XXH3_128bits_update(st, &n, sizeof(n));
  XXH3_128bits_update(st, s.data(), s.size());
}

std::vector<std::pair<std::string, const kernels::TensorView*>> CanonicalTensors(
    const ModelConfig& config, const ModelWeights& w) {
  std::vector<std::pair<std::string, const kernels::TensorView*>> t;
  t.emplace_back("model.embed_tokens.weight", &w.embed_tokens);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    t.emplace_back(p + "input_layernorm.weight", &l.input_norm);
    t.emplace_back(p + "self_attn.q_proj.weight", &l.q_proj);
    t.emplace_back(p + "self_attn.k_proj.weight", &l.k_proj);
    t.emplace_back(p + "self_attn.v_proj.weight", &l.v_proj);
    if (config.attention_bias) {
      t.emplace_back(p + "self_attn.q_proj.bias", &l.q_bias);
      t.emplace_back(p + "self_attn.k_proj.bias", &l.k_bias);
      t.emplace_back(p + "self_attn.v_proj.bias", &l.v_bias);
    }
    t.emplace_back(p + "self_attn.o_proj.weight", &l.o_proj);
    t.emplace_back(p + "post_attention_layernorm.weight", &l.post_attention_norm);
    t.emplace_back(p + "mlp.gate_proj.weight", &l.gate_proj);
    t.emplace_back(p + "mlp.up_proj.weight", &l.up_proj);
    t.emplace_back(p + "mlp.down_proj.weight", &l.down_proj);
  }
  t.emplace_back("model.norm.weight", &w.final_norm);
  if (!config.tie_word_embeddings) t.emplace_back("lm_head.weight", &w.lm_head);
  return t;
}

}  // namespace

std::string CanonicalConfigString(const ModelConfig& c) {
  std::string s = absl::StrFormat(
      "strata-model-fingerprint-v1\narch=%s\nvocab=%d\nhidden=%d\nffn=%d\nlayers=%d\nheads=%d\n"
      "kv_heads=%d\nhead_dim=%d\nrms_norm_eps=%.17g\nrope_theta=%.17g\ntied=%d\nattention_bias=%"
      "d\n",
      ArchitectureName(c.arch), c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers,
      c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.rope_theta,
      c.tie_word_embeddings ? 1 : 0, c.attention_bias ? 1 : 0);
  if (c.rope_scaling.type == RopeScaling::Type::kLlama3) {
    absl::StrAppendFormat(&s, "rope_scaling=llama3 factor=%.17g low=%.17g high=%.17g orig=%d\n",
                          c.rope_scaling.factor, c.rope_scaling.low_freq_factor,
                          c.rope_scaling.high_freq_factor,
                          c.rope_scaling.original_max_position_embeddings);
  } else {
    s += "rope_scaling=none\n";
  }
  return s;
}

std::string ModelFingerprint(const ModelConfig& config, const ModelWeights& weights) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset(st);
  AddField(st, CanonicalConfigString(config));
  const auto tensors = CanonicalTensors(config, weights);
  for (const auto& [name, view] : tensors)
    AddField(st, absl::StrCat(name, " ", view->DebugString()));
  for (const auto& [name, view] : tensors) {
    const uint64_t n = view->data == nullptr ? 0 : view->Bytes();
    XXH3_128bits_update(st, &n, sizeof(n));
    if (n > 0) XXH3_128bits_update(st, view->data, n);
  }
  XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  XXH128_canonical_t canon;
  XXH128_canonicalFromHash(&canon, h);
  std::string hex;
  hex.reserve(32);
  for (unsigned char b : canon.digest) absl::StrAppendFormat(&hex, "%02x", b);
  return hex;
}

}  // namespace strata::model
