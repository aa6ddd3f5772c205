#include "model/config.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using ::strata::testing::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Published configs, trimmed to the fields that matter (values as in the Hugging Face hub files).
const char kLlama2Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
  "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "tie_word_embeddings": false, "torch_dtype": "float16", "vocab_size": 32000})";

const char kLlama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
  "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 128256})";

const char kLlama32Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
  "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "vocab_size": 128256})";

const char kMistralConfig[] = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "vocab_size": 32768})";

const char kQwen25Config[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
  "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
  "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

// transformers 5 spelling: rope settings in "rope_parameters", "dtype" instead of "torch_dtype".
const char kLlamaV5Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "dtype": "float32",
  "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
  "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 4,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
  "tie_word_embeddings": false, "vocab_size": 300})";

Json Parse(const char* text) { return Json::parse(text); }

absl::StatusOr<ModelConfig> ParseJson(const Json& j) { return ParseModelConfig(j.dump()); }

TEST(ConfigTest, Llama2) {
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlama2Config));
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.bos_token_ids, std::vector<int32_t>{1});
  EXPECT_EQ(c.eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c.torch_dtype, kernels::DType::kF16);
}

TEST(ConfigTest, Llama31) {
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlama31Config));
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{128001, 128008, 128009}));
  EXPECT_EQ(c.torch_dtype, kernels::DType::kBF16);
  EXPECT_THAT(c.DebugString(), HasSubstr("llama3 x8"));
}

TEST(ConfigTest, Llama32ExplicitHeadDimAndTied) {
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlama32Config));
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_layers, 16);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
}

TEST(ConfigTest, Mistral) {
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kMistralConfig));
  EXPECT_EQ(c.arch, Architecture::kMistral);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.vocab_size, 32768);
}

TEST(ConfigTest, FullAttentionLayerTypesAccepted) {
  Json j = Parse(kQwen25Config);
  j["layer_types"] = {"full_attention", "full_attention"};
  STRATA_EXPECT_OK(ParseJson(j));
}

TEST(ConfigTest, MistralSlidingWindowNotBelowMaxPositionsIsFine) {
  Json j = Parse(kMistralConfig);
  j["sliding_window"] = 32768;
  STRATA_EXPECT_OK(ParseJson(j));
}

TEST(ConfigTest, Qwen25ImpliesAttentionBias) {
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kQwen25Config));
  EXPECT_EQ(c.arch, Architecture::kQwen2);
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
}

TEST(ConfigTest, TransformersV5RopeParameters) {
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseModelConfig(kLlamaV5Config));
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);
  EXPECT_EQ(c.torch_dtype, kernels::DType::kF32);

  Json j = Parse(kLlamaV5Config);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 12345.0}};
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig d, ParseJson(j));
  EXPECT_DOUBLE_EQ(d.rope_theta, 12345.0);
  EXPECT_EQ(d.rope_scaling.type, RopeScaling::Type::kNone);
}

TEST(ConfigTest, LegacyTypeKeyForRopeScaling) {
  Json j = Parse(kLlama31Config);
  j["rope_scaling"].erase("rope_type");
  j["rope_scaling"]["type"] = "llama3";
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseJson(j));
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
}

TEST(ConfigTest, DefaultsWhenOptionalFieldsAbsent) {
  Json j = Parse(kLlama2Config);
  j.erase("num_key_value_heads");
  j.erase("bos_token_id");
  j.erase("eos_token_id");
  j.erase("torch_dtype");
  j.erase("rope_scaling");
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseJson(j));
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_TRUE(c.bos_token_ids.empty());
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.torch_dtype, kernels::DType::kF32);
}

struct BadCase {
  const char* name;
  const char* base;
  const char* patch;  // JSON object merged into the base config (null values erase)
  const char* field;  // must appear in the message
};

class ConfigRejectTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ConfigRejectTest, InvalidArgumentNamingField) {
  const BadCase& bc = GetParam();
  Json j = Parse(bc.base);
  j.merge_patch(Json::parse(bc.patch));
  EXPECT_THAT(ParseJson(j), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(bc.field)))
      << j.dump();
}

INSTANTIATE_TEST_SUITE_P(
    Unsupported, ConfigRejectTest,
    ::testing::Values(
        BadCase{"gelu", kLlama2Config, R"({"hidden_act": "gelu"})", "hidden_act"},
        BadCase{"linear", kLlama2Config, R"({"rope_scaling": {"type": "linear", "factor": 2.0}})",
                "rope_scaling.rope_type"},
        BadCase{"dynamic", kLlama2Config,
                R"({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})", "rope_type"},
        BadCase{"yarn", kLlama2Config,
                R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                    "original_max_position_embeddings": 32768}})",
                "rope_type"},
        BadCase{"longrope_v5", kLlamaV5Config,
                R"({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}})",
                "rope_parameters.rope_type"},
        BadCase{"mlp_bias", kLlama31Config, R"({"mlp_bias": true})", "mlp_bias"},
        BadCase{"qwen_sliding", kQwen25Config, R"({"use_sliding_window": true})",
                "use_sliding_window"},
        BadCase{"mistral_window", kMistralConfig, R"({"sliding_window": 4096})", "sliding_window"},
        BadCase{"arch", kLlama2Config, R"({"architectures": ["GemmaForCausalLM"]})",
                "architectures"},
        BadCase{"partial_rotary", kLlama2Config, R"({"partial_rotary_factor": 0.5})",
                "partial_rotary_factor"},
        BadCase{"dtype", kLlama2Config, R"({"torch_dtype": "float8_e4m3fn"})", "torch_dtype"},
        BadCase{"missing_vocab", kLlama2Config, R"({"vocab_size": null})", "vocab_size"},
        BadCase{"string_hidden", kLlama2Config, R"({"hidden_size": "4096"})", "hidden_size"},
        BadCase{"kv_divides", kLlama2Config, R"({"num_key_value_heads": 5})",
                "num_key_value_heads"},
        BadCase{"llama3_missing_key", kLlama31Config,
                R"({"rope_scaling": {"low_freq_factor": null}})", "low_freq_factor"},
        BadCase{"bos_type", kLlama2Config, R"({"bos_token_id": "x"})", "bos_token_id"},
        BadCase{"sliding_layers", kQwen25Config,
                R"({"layer_types": ["full_attention", "sliding_attention"]})", "layer_types"},
        BadCase{"odd_head_dim", kLlama2Config, R"({"head_dim": 15})", "head_dim"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(ConfigTest, MalformedJson) {
  EXPECT_THAT(ParseModelConfig("{\"vocab_size\": "), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseModelConfig("[1,2]"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseModelConfig(""), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ConfigTest, LoadMissingFileIsNotFound) {
  EXPECT_THAT(LoadModelConfig("/nonexistent/strata-model-dir"),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST(ConfigTest, JsonRoundTripEveryFamily) {
  for (const char* text : {kLlama2Config, kLlama31Config, kLlama32Config, kMistralConfig,
                           kQwen25Config, kLlamaV5Config}) {
    STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig a, ParseModelConfig(text));
    std::string out = ModelConfigToJson(a);
    STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig b, ParseModelConfig(out));
    EXPECT_EQ(a.arch, b.arch);
    EXPECT_EQ(a.vocab_size, b.vocab_size);
    EXPECT_EQ(a.hidden_size, b.hidden_size);
    EXPECT_EQ(a.intermediate_size, b.intermediate_size);
    EXPECT_EQ(a.num_layers, b.num_layers);
    EXPECT_EQ(a.num_heads, b.num_heads);
    EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
    EXPECT_EQ(a.head_dim, b.head_dim);
    EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
    EXPECT_EQ(a.rope_theta, b.rope_theta);
    EXPECT_EQ(a.rope_scaling.type, b.rope_scaling.type);
    EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
    EXPECT_EQ(a.rope_scaling.original_max_position_embeddings,
              b.rope_scaling.original_max_position_embeddings);
    EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
    EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
    EXPECT_EQ(a.attention_bias, b.attention_bias);
    EXPECT_EQ(a.bos_token_ids, b.bos_token_ids);
    EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
    EXPECT_EQ(a.torch_dtype, b.torch_dtype);
    EXPECT_EQ(a.RopeInvFreq(), b.RopeInvFreq());
  }
}

// Independent double-precision evaluation of the llama3 formula (Meta's reference / transformers
// _compute_llama3_parameters), written without looking at the float32 op order.
std::vector<double> ReferenceInvFreq(int64_t dim, double theta, double factor, double low,
                                     double high, double old_len) {
  std::vector<double> out;
  for (int64_t i = 0; i < dim; i += 2) {
    double f = 1.0 / std::pow(theta, static_cast<double>(i) / dim);
    if (factor > 0) {
      double wavelen = 2 * M_PI / f;
      if (wavelen < old_len / high) {
        // high frequency: unchanged
      } else if (wavelen > old_len / low) {
        f = f / factor;
      } else {
        double smooth = (old_len / wavelen - low) / (high - low);
        f = (1 - smooth) * f / factor + smooth * f;
      }
    }
    out.push_back(f);
  }
  return out;
}

ModelConfig RopeConfig(int64_t head_dim, double theta, double factor, int64_t old_len) {
  ModelConfig c;
  c.vocab_size = 16;
  c.hidden_size = head_dim * 4;
  c.intermediate_size = 8;
  c.num_layers = 1;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  if (factor > 0) {
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = factor;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position_embeddings = old_len;
  }
  return c;
}

struct GoldenRope {
  int64_t head_dim;
  double theta;
  double factor;  // 0: no scaling
  int64_t old_len;
  std::vector<uint32_t> bits;
};

// inv_freq buffers of transformers' LlamaRotaryEmbedding (transformers 5.x, torch 2.11, CPU),
// as float32 bit patterns; low/high_freq_factor 1 and 4.
const std::vector<GoldenRope>& GoldenRopes() {
  static const auto* v = new std::vector<GoldenRope>{
      {16,
       10000.0,
       0,
       0,
       {0x3f800000u, 0x3ea1e89bu, 0x3dcccccdu, 0x3d0186e3u, 0x3c23d70au, 0x3b4f3e38u, 0x3a83126fu,
        0x39a5cb60u}},
      {64, 500000.0, 32.0, 8192, {0x3f800000u, 0x3f29e1c6u, 0x3ee177bcu, 0x3e959ee3u, 0x3e4693b0u,
                                  0x3e03c6a0u, 0x3daee4adu, 0x3d681e67u, 0x3d1a08c8u, 0x3ccc6f49u,
                                  0x3c87a9c3u, 0x3c340d6du, 0x3beef74fu, 0x3b9e9402u, 0x3b527720u,
                                  0x3aa9279bu, 0x39e13620u, 0x38cb98f7u, 0x37a3418du, 0x3758ac81u,
                                  0x370fc8f8u, 0x36bed4f4u, 0x367d45c3u, 0x3628126bu, 0x35df10c4u,
                                  0x359406cbu, 0x35447610u, 0x35025f34u, 0x34ad07a7u, 0x3465a54du,
                                  0x341864a7u, 0x33ca41b0u}},
      {128, 500000.0, 8.0, 8192, {0x3f800000u, 0x3f508ac1u, 0x3f29e1c6u, 0x3f0a6384u, 0x3ee177bcu,
                                  0x3eb7ab7du, 0x3e959ee3u, 0x3e73c461u, 0x3e4693b0u, 0x3e21c3a0u,
                                  0x3e03c6a0u, 0x3dd6b19cu, 0x3daee4adu, 0x3d8e7898u, 0x3d681e67u,
                                  0x3d3d1684u, 0x3d1a08c8u, 0x3cfaf53fu, 0x3ccc6f49u, 0x3ca68939u,
                                  0x3c87a9c3u, 0x3c5d06ecu, 0x3c340d6du, 0x3c12ac7fu, 0x3beef74fu,
                                  0x3bc2aa76u, 0x3b9e9402u, 0x3b812e35u, 0x3b527720u, 0x3b0dfd06u,
                                  0x3ab3d11du, 0x3a60979eu, 0x3a0995d2u, 0x39a3f108u, 0x393b2dd2u,
                                  0x38c86886u, 0x38a3418du, 0x3884fdbfu, 0x3858ac81u, 0x38308199u,
                                  0x380fc8f8u, 0x37ea426fu, 0x37bed4f4u, 0x379b7475u, 0x377d45c3u,
                                  0x374e51f5u, 0x3728126bu, 0x3708ea0fu, 0x36df10c4u, 0x36b5b687u,
                                  0x369406cbu, 0x36712b80u, 0x36447610u, 0x36200a69u, 0x36025f34u,
                                  0x35d46808u, 0x35ad07a7u, 0x358cf400u, 0x3565a54du, 0x353b12c7u,
                                  0x351864a7u, 0x34f848c2u, 0x34ca41b0u, 0x34a4c2ffu}},
      {128, 1000000.0, 0, 0, {0x3f800000u, 0x3f4e4badu, 0x3f263de0u, 0x3f05f6efu, 0x3ed7e89bu,
                              0x3eadfcffu, 0x3e8c3504u, 0x3e61f835u, 0x3e361887u, 0x3e12bd91u,
                              0x3dec7fd6u, 0x3dbe94c6u, 0x3d99940du, 0x3d778513u, 0x3d47763fu,
                              0x3d20bc1du, 0x3d0186e3u, 0x3cd0c1a8u, 0x3ca8398bu, 0x3c879008u,
                              0x3c5a7bf2u, 0x3c301052u, 0x3c0de12du, 0x3be4aa46u, 0x3bb8449cu,
                              0x3b947daeu, 0x3b6f520eu, 0x3b40dac5u, 0x3b1b690du, 0x3afa78f0u,
                              0x3ac9d75cu, 0x3aa2a6f7u, 0x3a83126fu, 0x3a533f28u, 0x3a2a3b44u,
                              0x3a092e02u, 0x39dd1725u, 0x39b229fbu, 0x398f9272u, 0x39676492u,
                              0x393a7753u, 0x39164324u, 0x38f22ce2u, 0x38c327b5u, 0x389d43a4u,
                              0x387d75d4u, 0x384c3fbeu, 0x382497abu, 0x3804a2b2u, 0x37d5c441u,
                              0x37ac431du, 0x378ad0edu, 0x375fba4fu, 0x37344a0eu, 0x371148e3u,
                              0x36ea2732u, 0x36bcb0c1u, 0x36980e02u, 0x36751070u, 0x36457babu,
                              0x361f23e4u, 0x36003decu, 0x35ceaf79u, 0x35a68e4cu}},
      {16,
       10000.0,
       8.0,
       64,
       {0x3f800000u, 0x3e7a3ff4u, 0x3c55af30u, 0x3b8186e3u, 0x3aa3d70au, 0x39cf3e38u, 0x3903126fu,
        0x3825cb60u}},
      {64, 10000.0, 4.0, 256, {0x3f800000u, 0x3f3ff911u, 0x3f0ff59au, 0x3ed7e89bu, 0x3ea1e89bu,
                               0x3e72d423u, 0x3e361887u, 0x3e088d77u, 0x3dcccccdu, 0x3d6a9e04u,
                               0x3d03ef5bu, 0x3c94628fu, 0x3c26e2d6u, 0x3bc2434fu, 0x3b91ad39u,
                               0x3b5a7bf2u, 0x3b23d70au, 0x3af5b9b0u, 0x3ab8449cu, 0x3a8a2e77u,
                               0x3a4f3e38u, 0x3a1b690du, 0x39e91528u, 0x39aec98eu, 0x3983126fu,
                               0x3944948cu, 0x39136a16u, 0x38dd1725u, 0x38a5cb60u, 0x3878a815u,
                               0x383a7753u, 0x380bd472u}},
  };
  return *v;
}

// torch evaluates `theta ** x` with a vectorised powf (Sleef, 1-ULP accuracy) while RopeInvFreq
// rounds a double pow once, so a rare element may differ by one ULP (measured: 1 of the 208 values
// below); every llama3 scaling step matches exactly.
TEST(RopeTest, MatchesTransformersWithinOneUlp) {
  int total = 0, inexact = 0;
  for (const GoldenRope& g : GoldenRopes()) {
    ModelConfig c = RopeConfig(g.head_dim, g.theta, g.factor, g.old_len);
    std::vector<float> inv = c.RopeInvFreq();
    ASSERT_EQ(inv.size(), g.bits.size());
    for (size_t i = 0; i < inv.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &inv[i], 4);
      int64_t ulps = static_cast<int64_t>(bits) - static_cast<int64_t>(g.bits[i]);
      EXPECT_LE(std::abs(ulps), 1)
          << "head_dim " << g.head_dim << " theta " << g.theta << " factor " << g.factor
          << " old_len " << g.old_len << " i " << i;
      ++total;
      if (ulps != 0) ++inexact;
    }
  }
  EXPECT_EQ(total, 208);
  EXPECT_LE(inexact, 1);
}

TEST(RopeTest, MatchesIndependentDoubleFormula) {
  struct Case {
    int64_t dim;
    double theta, factor;
    int64_t old_len;
  };
  int medium_seen = 0;
  for (const Case& k :
       {Case{128, 500000.0, 8.0, 8192}, Case{64, 500000.0, 32.0, 8192}, Case{16, 10000.0, 8.0, 64},
        Case{64, 10000.0, 4.0, 256}, Case{128, 10000.0, 0.0, 0}}) {
    ModelConfig c = RopeConfig(k.dim, k.theta, k.factor, k.old_len);
    std::vector<float> inv = c.RopeInvFreq();
    std::vector<double> ref = ReferenceInvFreq(k.dim, k.theta, k.factor, 1.0, 4.0, k.old_len);
    ASSERT_EQ(inv.size(), ref.size());
    std::vector<double> unscaled = ReferenceInvFreq(k.dim, k.theta, 0.0, 1.0, 4.0, k.old_len);
    for (size_t i = 0; i < inv.size(); ++i) {
      EXPECT_NEAR(inv[i], ref[i], 4e-6 * ref[i]) << "dim " << k.dim << " i " << i;
      if (k.factor > 0 && ref[i] != unscaled[i] &&
          std::fabs(ref[i] * k.factor - unscaled[i]) > 1e-12)
        ++medium_seen;
    }
  }
  // The cases cover the interpolated (medium-frequency) band, not only the two plain branches.
  EXPECT_GT(medium_seen, 3);
}

TEST(RopeTest, NoScalingIsPlainInverseFrequency) {
  ModelConfig c = RopeConfig(8, 10000.0, 0, 0);
  std::vector<float> inv = c.RopeInvFreq();
  ASSERT_EQ(inv.size(), 4u);
  EXPECT_EQ(inv[0], 1.0f);
  EXPECT_FLOAT_EQ(inv[1], 0.1f);
  EXPECT_FLOAT_EQ(inv[2], 0.01f);
  EXPECT_FLOAT_EQ(inv[3], 0.001f);
}

}  // namespace
}  // namespace strata::model
