#include "model/config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using Json = nlohmann::json;

absl::Status FieldError(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: \"", field, "\" ", what));
}

// Reads an optional integer field. Integral floats (e.g. 8192.0) are accepted.
absl::Status GetInt(const Json& obj, const std::string& key, const std::string& path, bool required,
                    int64_t* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    return required ? FieldError(path, "is required") : absl::OkStatus();
  }
  if (it->is_number_integer()) {
    *out = it->get<int64_t>();
    return absl::OkStatus();
  }
  if (it->is_number_float()) {
    double v = it->get<double>();
    if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 9.0e15) {
      *out = static_cast<int64_t>(v);
      return absl::OkStatus();
    }
  }
  return FieldError(path, "must be an integer");
}

absl::Status GetDouble(const Json& obj, const std::string& key, const std::string& path,
                       bool required, double* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    return required ? FieldError(path, "is required") : absl::OkStatus();
  }
  if (!it->is_number()) return FieldError(path, "must be a number");
  *out = it->get<double>();
  if (!std::isfinite(*out)) return FieldError(path, "must be finite");
  return absl::OkStatus();
}

absl::Status GetBool(const Json& obj, const std::string& key, bool* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return FieldError(key, "must be true or false");
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status GetString(const Json& obj, const std::string& key, std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string()) return FieldError(key, "must be a string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

// bos_token_id / eos_token_id: null, an int, or a list of ints.
absl::Status GetTokenIds(const Json& obj, const std::string& key, std::vector<int32_t>* out) {
  out->clear();
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  auto one = [&](const Json& v) -> absl::Status {
    if (!v.is_number_integer()) return FieldError(key, "must be an integer or a list of integers");
    int64_t id = v.get<int64_t>();
    if (id < 0 || id > INT32_MAX) return FieldError(key, "is out of range");
    out->push_back(static_cast<int32_t>(id));
    return absl::OkStatus();
  };
  if (it->is_array()) {
    for (const Json& v : *it) STRATA_RETURN_IF_ERROR(one(v));
    return absl::OkStatus();
  }
  return one(*it);
}

// Parses a rope settings object ("rope_scaling" or "rope_parameters"). `prefix` names the field in
// messages. The object may also carry "rope_theta" (rope_parameters does).
absl::Status ParseRopeObject(const Json& rope, const std::string& prefix, ModelConfig* c) {
  if (!rope.is_object()) return FieldError(prefix, "must be an object or null");
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    auto it = rope.find(key);
    if (it != rope.end() && !it->is_null()) {
      if (!it->is_string()) return FieldError(absl::StrCat(prefix, ".", key), "must be a string");
      type = it->get<std::string>();
      break;
    }
  }
  STRATA_RETURN_IF_ERROR(
      GetDouble(rope, "rope_theta", prefix + ".rope_theta", false, &c->rope_theta));
  double partial = 1.0;
  STRATA_RETURN_IF_ERROR(
      GetDouble(rope, "partial_rotary_factor", prefix + ".partial_rotary_factor", false, &partial));
  if (partial != 1.0) {
    return FieldError(prefix + ".partial_rotary_factor", "other than 1.0 is not supported");
  }
  if (type.empty() || type == "default") {
    c->rope_scaling = RopeScaling{};
    return absl::OkStatus();
  }
  if (type != "llama3") {
    return FieldError(prefix + ".rope_type",
                      absl::StrCat("\"", type, "\" is not supported (only default and llama3)"));
  }
  RopeScaling s;
  s.type = RopeScaling::Type::kLlama3;
  STRATA_RETURN_IF_ERROR(GetDouble(rope, "factor", prefix + ".factor", true, &s.factor));
  STRATA_RETURN_IF_ERROR(
      GetDouble(rope, "low_freq_factor", prefix + ".low_freq_factor", true, &s.low_freq_factor));
  STRATA_RETURN_IF_ERROR(
      GetDouble(rope, "high_freq_factor", prefix + ".high_freq_factor", true, &s.high_freq_factor));
  STRATA_RETURN_IF_ERROR(GetInt(rope, "original_max_position_embeddings",
                                prefix + ".original_max_position_embeddings", true,
                                &s.original_max_position_embeddings));
  c->rope_scaling = s;
  return absl::OkStatus();
}

absl::StatusOr<kernels::DType> ParseDType(const std::string& field, const std::string& name) {
  if (name == "float32" || name == "float") return kernels::DType::kF32;
  if (name == "bfloat16") return kernels::DType::kBF16;
  if (name == "float16" || name == "half") return kernels::DType::kF16;
  return FieldError(field,
                    absl::StrCat("\"", name, "\" is not supported (float32, bfloat16, float16)"));
}

const char* HfDTypeName(kernels::DType t) {
  switch (t) {
    case kernels::DType::kBF16:
      return "bfloat16";
    case kernels::DType::kF16:
      return "float16";
    default:
      return "float32";
  }
}

Json TokenIdsJson(const std::vector<int32_t>& ids) {
  if (ids.empty()) return Json(nullptr);
  if (ids.size() == 1) return Json(ids[0]);
  Json arr = Json::array();
  for (int32_t id : ids) arr.push_back(id);
  return arr;
}

}  // namespace

const char* ArchitectureName(Architecture a) {
  switch (a) {
    case Architecture::kLlama:
      return "llama";
    case Architecture::kMistral:
      return "mistral";
    case Architecture::kQwen2:
      return "qwen2";
  }
  return "?";
}

absl::Status ModelConfig::Validate() const {
  auto positive = [](int64_t v, const char* name) -> absl::Status {
    if (v <= 0) return FieldError(name, absl::StrCat("must be positive (got ", v, ")"));
    return absl::OkStatus();
  };
  STRATA_RETURN_IF_ERROR(positive(vocab_size, "vocab_size"));
  STRATA_RETURN_IF_ERROR(positive(hidden_size, "hidden_size"));
  STRATA_RETURN_IF_ERROR(positive(intermediate_size, "intermediate_size"));
  STRATA_RETURN_IF_ERROR(positive(num_layers, "num_hidden_layers"));
  STRATA_RETURN_IF_ERROR(positive(num_heads, "num_attention_heads"));
  STRATA_RETURN_IF_ERROR(positive(num_kv_heads, "num_key_value_heads"));
  STRATA_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  if (vocab_size > INT32_MAX) return FieldError("vocab_size", "is too large");
  if (num_heads % num_kv_heads != 0) {
    return FieldError(
        "num_key_value_heads",
        absl::StrCat("(", num_kv_heads, ") must divide num_attention_heads (", num_heads, ")"));
  }
  if (head_dim % 2 != 0)
    return FieldError("head_dim", absl::StrCat("must be even (got ", head_dim, ")"));
  // Guard against absurd sizes that would overflow byte counts.
  constexpr int64_t kMaxDim = int64_t{1} << 24;
  for (int64_t v : {vocab_size, hidden_size, intermediate_size, num_layers, num_heads * head_dim}) {
    if (v > kMaxDim)
      return absl::InvalidArgumentError("config.json: a dimension is implausibly large");
  }
  if (!(rms_norm_eps > 0.0)) return FieldError("rms_norm_eps", "must be positive");
  if (!(rope_theta > 0.0)) return FieldError("rope_theta", "must be positive");
  if (max_position_embeddings < 0)
    return FieldError("max_position_embeddings", "must not be negative");
  if (mlp_bias) return FieldError("mlp_bias", "true is not supported");
  if (torch_dtype != kernels::DType::kF32 && torch_dtype != kernels::DType::kBF16 &&
      torch_dtype != kernels::DType::kF16) {
    return FieldError("torch_dtype", "must be float32, bfloat16 or float16");
  }
  if (arch == Architecture::kQwen2 && !attention_bias) {
    return FieldError("attention_bias", "must be true for qwen2");
  }
  if (rope_scaling.type == RopeScaling::Type::kLlama3) {
    const RopeScaling& s = rope_scaling;
    if (!(s.factor > 0.0)) return FieldError("rope_scaling.factor", "must be positive");
    if (!(s.low_freq_factor > 0.0))
      return FieldError("rope_scaling.low_freq_factor", "must be positive");
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      return FieldError("rope_scaling.high_freq_factor", "must be greater than low_freq_factor");
    }
    if (s.original_max_position_embeddings <= 0) {
      return FieldError("rope_scaling.original_max_position_embeddings", "must be positive");
    }
  }
  for (int32_t id : bos_token_ids) {
    if (id >= vocab_size) return FieldError("bos_token_id", "is not below vocab_size");
  }
  for (int32_t id : eos_token_ids) {
    if (id >= vocab_size) return FieldError("eos_token_id", "is not below vocab_size");
  }
  return absl::OkStatus();
}

// Mirrors transformers' _compute_default_rope_parameters and _compute_llama3_parameters op by op.
// Those run in float32 torch tensors (python scalars are rounded to float32 when they meet a
// float32 tensor; `s / t` is `t.reciprocal() * s`), so each step here is one correctly rounded
// float32 operation; pow is evaluated in double and rounded once.
std::vector<float> ModelConfig::RopeInvFreq() const {
  const int64_t dim = head_dim;
  std::vector<float> inv(static_cast<size_t>(dim / 2));
  const float base = static_cast<float>(rope_theta);
  for (int64_t i = 0; i < dim / 2; ++i) {
    volatile float e = static_cast<float>(2 * i) / static_cast<float>(dim);
    float p = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(e)));
    inv[i] = 1.0f / p;
  }
  if (rope_scaling.type != RopeScaling::Type::kLlama3) return inv;

  const RopeScaling& s = rope_scaling;
  const float factor = static_cast<float>(s.factor);
  const float low = static_cast<float>(s.low_freq_factor);
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const float old_len_f = static_cast<float>(old_len);
  const float low_freq_wavelen = static_cast<float>(old_len / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_len / s.high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * M_PI);
  const float high_minus_low = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  for (float& f : inv) {
    volatile float recip = 1.0f / f;
    volatile float wavelen = recip * two_pi;
    float llama = wavelen > low_freq_wavelen ? f / factor : f;
    volatile float recip_w = 1.0f / wavelen;
    volatile float ratio = recip_w * old_len_f;
    volatile float smooth = (ratio - low) / high_minus_low;
    volatile float a = (1.0f - smooth) * llama;
    volatile float a2 = a / factor;
    volatile float b = smooth * llama;
    float smoothed = a2 + b;
    bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    f = medium ? smoothed : llama;
  }
  return inv;
}

std::string ModelConfig::DebugString() const {
  std::string rope = absl::StrFormat("%g", rope_theta);
  if (rope_scaling.type == RopeScaling::Type::kLlama3) {
    absl::StrAppend(&rope, absl::StrFormat("(llama3 x%g)", rope_scaling.factor));
  }
  return absl::StrCat(ArchitectureName(arch), " L=", num_layers, " H=", hidden_size,
                      " heads=", num_heads, "/", num_kv_heads, " d=", head_dim,
                      " ffn=", intermediate_size, " vocab=", vocab_size, " rope=", rope,
                      attention_bias ? " qkv_bias" : "", tie_word_embeddings ? " tied" : "",
                      " dtype=", kernels::DTypeName(torch_dtype));
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text) {
  Json j = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("config.json: not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("config.json: top level is not an object");

  ModelConfig c;
  // Architecture: "architectures" (a list with one supported name), else "model_type".
  auto arch_it = j.find("architectures");
  if (arch_it != j.end() && !arch_it->is_null()) {
    if (!arch_it->is_array() || arch_it->empty()) {
      return FieldError("architectures", "must be a non-empty list of strings");
    }
    bool found = false;
    for (const Json& a : *arch_it) {
      if (!a.is_string()) return FieldError("architectures", "must be a list of strings");
      const std::string name = a.get<std::string>();
      if (name == "LlamaForCausalLM") {
        c.arch = Architecture::kLlama;
      } else if (name == "MistralForCausalLM") {
        c.arch = Architecture::kMistral;
      } else if (name == "Qwen2ForCausalLM") {
        c.arch = Architecture::kQwen2;
      } else {
        return FieldError("architectures",
                          absl::StrCat("\"", name,
                                       "\" is not supported (LlamaForCausalLM, MistralForCausalLM, "
                                       "Qwen2ForCausalLM)"));
      }
      found = true;
    }
    if (!found) return FieldError("architectures", "is empty");
  } else {
    std::string model_type;
    STRATA_RETURN_IF_ERROR(GetString(j, "model_type", &model_type));
    if (model_type == "llama") {
      c.arch = Architecture::kLlama;
    } else if (model_type == "mistral") {
      c.arch = Architecture::kMistral;
    } else if (model_type == "qwen2") {
      c.arch = Architecture::kQwen2;
    } else {
      return FieldError("architectures",
                        "is missing and model_type is not llama, mistral or qwen2");
    }
  }

  STRATA_RETURN_IF_ERROR(GetInt(j, "vocab_size", "vocab_size", true, &c.vocab_size));
  STRATA_RETURN_IF_ERROR(GetInt(j, "hidden_size", "hidden_size", true, &c.hidden_size));
  STRATA_RETURN_IF_ERROR(
      GetInt(j, "intermediate_size", "intermediate_size", true, &c.intermediate_size));
  STRATA_RETURN_IF_ERROR(GetInt(j, "num_hidden_layers", "num_hidden_layers", true, &c.num_layers));
  STRATA_RETURN_IF_ERROR(
      GetInt(j, "num_attention_heads", "num_attention_heads", true, &c.num_heads));
  c.num_kv_heads = c.num_heads;
  STRATA_RETURN_IF_ERROR(
      GetInt(j, "num_key_value_heads", "num_key_value_heads", false, &c.num_kv_heads));
  c.head_dim = 0;
  STRATA_RETURN_IF_ERROR(GetInt(j, "head_dim", "head_dim", false, &c.head_dim));
  if (c.head_dim == 0 && c.num_heads > 0) {
    if (c.hidden_size % c.num_heads != 0) {
      return FieldError("num_attention_heads", "must divide hidden_size when head_dim is absent");
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  STRATA_RETURN_IF_ERROR(GetDouble(j, "rms_norm_eps", "rms_norm_eps", false, &c.rms_norm_eps));
  switch (c.arch) {
    case Architecture::kLlama:
      c.max_position_embeddings = 2048;
      break;
    case Architecture::kMistral:
      c.max_position_embeddings = 4096 * 32;
      break;
    case Architecture::kQwen2:
      c.max_position_embeddings = 32768;
      break;
  }
  STRATA_RETURN_IF_ERROR(GetInt(j, "max_position_embeddings", "max_position_embeddings", false,
                                &c.max_position_embeddings));
  STRATA_RETURN_IF_ERROR(GetBool(j, "tie_word_embeddings", &c.tie_word_embeddings));

  // Activation.
  std::string act = "silu";
  STRATA_RETURN_IF_ERROR(GetString(j, "hidden_act", &act));
  if (act != "silu")
    return FieldError("hidden_act", absl::StrCat("\"", act, "\" is not supported (silu)"));

  // Biases. Llama reads attention_bias and mlp_bias; Qwen2 always has q/k/v bias; Mistral none.
  bool attention_bias = false, mlp_bias = false;
  STRATA_RETURN_IF_ERROR(GetBool(j, "attention_bias", &attention_bias));
  STRATA_RETURN_IF_ERROR(GetBool(j, "mlp_bias", &mlp_bias));
  if (mlp_bias) return FieldError("mlp_bias", "true is not supported");
  switch (c.arch) {
    case Architecture::kLlama:
      c.attention_bias = attention_bias;
      break;
    case Architecture::kMistral:
      c.attention_bias = false;
      break;
    case Architecture::kQwen2:
      c.attention_bias = true;
      break;
  }

  // Sliding-window attention changes the math beyond the window: reject it when it is in use.
  if (c.arch == Architecture::kQwen2) {
    bool use_sliding_window = false;
    STRATA_RETURN_IF_ERROR(GetBool(j, "use_sliding_window", &use_sliding_window));
    if (use_sliding_window) return FieldError("use_sliding_window", "true is not supported");
  } else if (c.arch == Architecture::kMistral) {
    int64_t window = 0;
    STRATA_RETURN_IF_ERROR(GetInt(j, "sliding_window", "sliding_window", false, &window));
    auto it = j.find("sliding_window");
    if (it != j.end() && !it->is_null() && window < c.max_position_embeddings) {
      return FieldError(
          "sliding_window",
          absl::StrCat("(", window, ") below max_position_embeddings (", c.max_position_embeddings,
                       ") is not supported (sliding-window attention)"));
    }
  }

  // transformers 5 lists the attention kind of every layer; only full attention is supported.
  auto layer_types = j.find("layer_types");
  if (layer_types != j.end() && !layer_types->is_null()) {
    if (!layer_types->is_array()) return FieldError("layer_types", "must be a list of strings");
    for (const Json& t : *layer_types) {
      if (!t.is_string()) return FieldError("layer_types", "must be a list of strings");
      if (t.get<std::string>() != "full_attention") {
        return FieldError("layer_types", absl::StrCat("contains \"", t.get<std::string>(),
                                                      "\" (only full_attention is supported)"));
      }
    }
  }

  // RoPE: transformers 5 "rope_parameters", else "rope_theta" + "rope_scaling".
  STRATA_RETURN_IF_ERROR(GetDouble(j, "rope_theta", "rope_theta", false, &c.rope_theta));
  double partial = 1.0;
  STRATA_RETURN_IF_ERROR(
      GetDouble(j, "partial_rotary_factor", "partial_rotary_factor", false, &partial));
  if (partial != 1.0) return FieldError("partial_rotary_factor", "other than 1.0 is not supported");
  auto params_it = j.find("rope_parameters");
  if (params_it != j.end() && !params_it->is_null()) {
    STRATA_RETURN_IF_ERROR(ParseRopeObject(*params_it, "rope_parameters", &c));
  } else {
    auto scaling_it = j.find("rope_scaling");
    if (scaling_it != j.end() && !scaling_it->is_null()) {
      STRATA_RETURN_IF_ERROR(ParseRopeObject(*scaling_it, "rope_scaling", &c));
    }
  }

  STRATA_RETURN_IF_ERROR(GetTokenIds(j, "bos_token_id", &c.bos_token_ids));
  STRATA_RETURN_IF_ERROR(GetTokenIds(j, "eos_token_id", &c.eos_token_ids));

  // transformers 5 writes "dtype", earlier versions "torch_dtype".
  c.torch_dtype = kernels::DType::kF32;
  for (const char* key : {"dtype", "torch_dtype"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string()) return FieldError(key, "must be a string");
    STRATA_ASSIGN_OR_RETURN(c.torch_dtype, ParseDType(key, it->get<std::string>()));
    break;
  }

  STRATA_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  absl::StatusOr<ModelConfig> c = ParseModelConfig(ss.str());
  if (!c.ok()) return Annotate(c.status(), path);
  return c;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  Json j = Json::object();
  switch (c.arch) {
    case Architecture::kLlama:
      j["architectures"] = {"LlamaForCausalLM"};
      j["model_type"] = "llama";
      break;
    case Architecture::kMistral:
      j["architectures"] = {"MistralForCausalLM"};
      j["model_type"] = "mistral";
      break;
    case Architecture::kQwen2:
      j["architectures"] = {"Qwen2ForCausalLM"};
      j["model_type"] = "qwen2";
      break;
  }
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type == RopeScaling::Type::kLlama3) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling.factor},
        {"low_freq_factor", c.rope_scaling.low_freq_factor},
        {"high_freq_factor", c.rope_scaling.high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.arch == Architecture::kLlama) {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = false;
  }
  if (c.arch == Architecture::kQwen2) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
  }
  if (c.arch == Architecture::kMistral) j["sliding_window"] = nullptr;
  j["bos_token_id"] = TokenIdsJson(c.bos_token_ids);
  j["eos_token_id"] = TokenIdsJson(c.eos_token_ids);
  j["torch_dtype"] = HfDTypeName(c.torch_dtype);
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

}  // namespace strata::model
