#include "model/random_model.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/internal/test_files.h"
#include "model/model.h"

namespace strata::model {
namespace {

using ::strata::model::testing::TempDir;
using ::strata::testing::StatusIs;

void MeanStd(const kernels::TensorView& v, double* mean, double* stddev) {
  std::vector<float> f(static_cast<size_t>(v.NumElements()));
  kernels::ConvertToF32(v.data, v.dtype, f.data(), v.NumElements());
  double s = 0, s2 = 0;
  for (float x : f) {
    s += x;
    s2 += static_cast<double>(x) * x;
  }
  *mean = s / f.size();
  *stddev = std::sqrt(std::max(0.0, s2 / f.size() - *mean * *mean));
}

TEST(RandomModelTest, PresetShapes) {
  RandomModelOptions o;
  o.preset = "llama-3.1-8b";
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c8, RandomModelConfig(o));
  EXPECT_EQ(c8.hidden_size, 4096);
  EXPECT_EQ(c8.num_layers, 32);
  EXPECT_EQ(c8.num_heads, 32);
  EXPECT_EQ(c8.num_kv_heads, 8);
  EXPECT_EQ(c8.head_dim, 128);
  EXPECT_EQ(c8.intermediate_size, 14336);
  EXPECT_EQ(c8.vocab_size, 128256);
  EXPECT_EQ(c8.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_FALSE(c8.tie_word_embeddings);
  o.preset = "llama-3.2-1b";
  o.vocab_size = 32000;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c1, RandomModelConfig(o));
  EXPECT_EQ(c1.hidden_size, 2048);
  EXPECT_EQ(c1.num_layers, 16);
  EXPECT_EQ(c1.head_dim, 64);
  EXPECT_EQ(c1.vocab_size, 32000);
  EXPECT_TRUE(c1.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c1.rope_scaling.factor, 32.0);
  o.preset = "small";
  o.vocab_size = 0;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig cs, RandomModelConfig(o));
  int64_t params = 0;
  for (const auto& e : CheckpointTensors(cs, kernels::DType::kF32)) params += e.Bytes() / 4;
  std::printf("small preset: %lld parameters\n", static_cast<long long>(params));
  EXPECT_GT(params, 80'000'000);
  EXPECT_LT(params, 120'000'000);

  o.arch = Architecture::kQwen2;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig q, RandomModelConfig(o));
  EXPECT_TRUE(q.attention_bias);
  EXPECT_EQ(q.rope_scaling.type, RopeScaling::Type::kNone);
  o.arch = Architecture::kMistral;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig m, RandomModelConfig(o));
  EXPECT_FALSE(m.attention_bias);
  EXPECT_EQ(m.rope_scaling.type, RopeScaling::Type::kNone);

  o.preset = "huge";
  EXPECT_THAT(RandomModelConfig(o), StatusIs(absl::StatusCode::kInvalidArgument));
  o.preset = "tiny";
  o.vocab_size = 100;
  EXPECT_THAT(RandomModelConfig(o), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(RandomModelTest, WeightsWithoutTokenizerLoadAndFollowTheDistribution) {
  const uint64_t seed = 11;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  TempDir dir;
  RandomModelOptions o;
  o.seed = seed;
  o.preset = "tiny";
  o.dtype = kernels::DType::kBF16;
  o.write_tokenizer = false;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, WriteRandomModel(dir.path(), o));
  EXPECT_FALSE(std::filesystem::exists(dir.Join("tokenizer.json")));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> m, LoadModel(dir.path()));
  EXPECT_EQ(m->tokenizer, nullptr);
  EXPECT_EQ(m->config.torch_dtype, kernels::DType::kBF16);
  EXPECT_EQ(m->weights.embed_tokens.dtype, kernels::DType::kBF16);
  double mean, sd;
  MeanStd(m->weights.embed_tokens, &mean, &sd);  // 32768 values
  EXPECT_NEAR(mean, 0.0, 0.001);
  EXPECT_NEAR(sd, 0.02, 0.001);
  MeanStd(m->weights.layers[0].input_norm, &mean, &sd);
  EXPECT_NEAR(mean, 1.0, 0.01);
  EXPECT_NEAR(sd, 0.02, 0.01);
  // Different tensors get different values.
  EXPECT_NE(std::memcmp(m->weights.layers[0].gate_proj.data, m->weights.layers[0].up_proj.data,
                        m->weights.layers[0].up_proj.Bytes()),
            0);
}

TEST(RandomModelTest, SameSeedSameFingerprintOtherSeedOther) {
  TempDir a, b, d;
  RandomModelOptions o;
  o.write_tokenizer = false;
  o.seed = 5;
  STRATA_ASSERT_OK(WriteRandomModel(a.path(), o).status());
  STRATA_ASSERT_OK(WriteRandomModel(b.path(), o).status());
  o.seed = 6;
  STRATA_ASSERT_OK(WriteRandomModel(d.path(), o).status());
  STRATA_ASSERT_OK_AND_ASSIGN(auto ma, LoadModel(a.path()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto mb, LoadModel(b.path()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto md, LoadModel(d.path()));
  EXPECT_EQ(ma->fingerprint, mb->fingerprint);
  EXPECT_NE(ma->fingerprint, md->fingerprint);
  // Byte-identical weight files.
  EXPECT_EQ(testing::ReadFileBytes(a.Join("model.safetensors")),
            testing::ReadFileBytes(b.Join("model.safetensors")));
}

TEST(RandomModelTest, EveryArchitectureLoads) {
  for (Architecture arch : {Architecture::kLlama, Architecture::kQwen2, Architecture::kMistral}) {
    TempDir dir;
    RandomModelOptions o;
    o.arch = arch;
    o.write_tokenizer = false;
    o.dtype = kernels::DType::kF16;
    STRATA_ASSERT_OK(WriteRandomModel(dir.path(), o).status());
    STRATA_ASSERT_OK_AND_ASSIGN(auto m, LoadModel(dir.path()));
    EXPECT_EQ(m->config.arch, arch);
    EXPECT_EQ(m->weights.layers[0].q_bias.data != nullptr, arch == Architecture::kQwen2);
  }
}

TEST(RandomModelTest, TinyModelWithTokenizer) {
  TempDir dir;
  RandomModelOptions o;
  o.seed = 1;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, WriteRandomModel(dir.path(), o));
  STRATA_ASSERT_OK_AND_ASSIGN(auto m, LoadModel(dir.path()));
  ASSERT_NE(m->tokenizer, nullptr);
  EXPECT_EQ(m->tokenizer->vocab_size(), 512);
  ASSERT_EQ(m->config.bos_token_ids.size(), 1u);
  ASSERT_EQ(m->config.eos_token_ids.size(), 1u);
  EXPECT_EQ(m->config.bos_token_ids[0], m->tokenizer->TokenToId("<|begin_of_text|>"));
  EXPECT_EQ(m->config.eos_token_ids[0], m->tokenizer->TokenToId("<|end_of_text|>"));
  EXPECT_TRUE(m->tokenizer->IsSpecial(m->config.bos_token_ids[0]));
  const std::string text = "The river ran past the old mill.";
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, m->tokenizer->Encode(text, true));
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], m->config.bos_token_ids[0]);
  EXPECT_LT(ids.size(), text.size());  // merges were learned
  STRATA_ASSERT_OK_AND_ASSIGN(std::string back, m->tokenizer->Decode(ids, true));
  EXPECT_EQ(back, text);
}

// The built-in corpus yields ~1000 merges; the rest of a larger vocabulary is filled with
// entries joining learned words, so every id the model can emit decodes to text.
TEST(RandomModelTest, TokenizerPaddedToModelVocab) {
  TempDir dir;
  RandomModelOptions o;
  o.vocab_size = 4096;
  STRATA_ASSERT_OK_AND_ASSIGN(ModelConfig c, WriteRandomModel(dir.path(), o));
  EXPECT_EQ(c.vocab_size, 4096);
  STRATA_ASSERT_OK_AND_ASSIGN(auto m, LoadModel(dir.path()));
  ASSERT_NE(m->tokenizer, nullptr);
  EXPECT_EQ(m->tokenizer->vocab_size(), 4096);
  for (int32_t id : {4095, 3000, 2000}) {
    STRATA_ASSERT_OK_AND_ASSIGN(std::string text, m->tokenizer->Decode({id}, true));
    EXPECT_GE(text.size(), 4u) << id;
    EXPECT_EQ(text[0], ' ') << id;
  }
  // Encoding text never produces the padding entries (they have no merges).
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids,
                              m->tokenizer->Encode(RandomModelCorpus(), false));
  int32_t max_id = 0;
  for (int32_t id : ids) max_id = std::max(max_id, id);
  EXPECT_LT(max_id, c.bos_token_ids[0]);
  STRATA_ASSERT_OK_AND_ASSIGN(std::string back, m->tokenizer->Decode(ids, false));
  EXPECT_EQ(back, RandomModelCorpus());
}

}  // namespace
}  // namespace strata::model
