#include "model/fingerprint.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/internal/test_files.h"
#include "model/model.h"
#include "model/random_model.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

using ::strata::model::testing::TempDir;
using ::strata::model::testing::WriteFileBytes;

ModelConfig Tiny(Architecture arch = Architecture::kLlama) {
  RandomModelOptions o;
  o.arch = arch;
  absl::StatusOr<ModelConfig> c = RandomModelConfig(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

void WriteTiny(const std::string& dir, const ModelConfig& c, uint64_t seed) {
  RandomModelOptions o;
  o.seed = seed;
  STRATA_ASSERT_OK(WriteRandomCheckpoint(dir, c, o));
}

std::string LoadFingerprint(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Model>> m = LoadModel(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? (*m)->fingerprint : "";
}

TEST(FingerprintTest, FormatAndStableAcrossLoads) {
  TempDir dir;
  WriteTiny(dir.path(), Tiny(), 1);
  const std::string a = LoadFingerprint(dir.path());
  const std::string b = LoadFingerprint(dir.path());
  ASSERT_EQ(a.size(), 32u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_EQ(a, b);
}

TEST(FingerprintTest, ChangesWithOneFlippedWeightByte) {
  TempDir dir;
  WriteTiny(dir.path(), Tiny(), 1);
  const std::string before = LoadFingerprint(dir.path());
  const std::string path = dir.Join("model.safetensors");
  const uint64_t size = std::filesystem::file_size(path);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 3));
    char c;
    f.read(&c, 1);
    c ^= 0x01;  // the lowest bit of a byte of lm_head (the last tensor)
    f.seekp(static_cast<std::streamoff>(size - 3));
    f.write(&c, 1);
  }
  const std::string after = LoadFingerprint(dir.path());
  EXPECT_EQ(after.size(), 32u);
  EXPECT_NE(before, after);
}

TEST(FingerprintTest, ShardingDoesNotChangeIt) {
  TempDir single, sharded;
  ModelConfig c = Tiny();
  WriteTiny(single.path(), c, 3);
  RandomModelOptions o;
  o.seed = 3;
  o.max_shard_bytes = 100000;
  STRATA_ASSERT_OK(WriteRandomCheckpoint(sharded.path(), c, o));
  EXPECT_EQ(LoadFingerprint(single.path()), LoadFingerprint(sharded.path()));
}

TEST(FingerprintTest, ConfigMathFieldsChangeIt) {
  TempDir dir;
  ModelConfig c = Tiny();
  WriteTiny(dir.path(), c, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w, LoadModelWeights(dir.path(), c));
  const std::string base = ModelFingerprint(c, w);
  ModelConfig eps = c;
  eps.rms_norm_eps = 1e-6;
  EXPECT_NE(ModelFingerprint(eps, w), base);
  ModelConfig theta = c;
  theta.rope_theta = 10000.0;
  EXPECT_NE(ModelFingerprint(theta, w), base);
  ModelConfig scaling = c;
  scaling.rope_scaling.factor = 16.0;
  EXPECT_NE(ModelFingerprint(scaling, w), base);
  // Fields that do not change the computation leave it alone.
  ModelConfig eos = c;
  eos.eos_token_ids = {3};
  eos.max_position_embeddings = 4096;
  EXPECT_EQ(ModelFingerprint(eos, w), base);
}

// A hand-made model with fixed bytes has a fixed fingerprint: the hash is deterministic across
// processes, builds and machines. (Update the constant only when changing the fingerprint format
// on purpose: every stored document of every model changes identity with it.)
TEST(FingerprintTest, GoldenValue) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.vocab_size = 4;
  c.hidden_size = 2;
  c.intermediate_size = 2;
  c.num_layers = 1;
  c.num_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = true;
  STRATA_ASSERT_OK(c.Validate());
  TempDir dir;
  std::vector<SafetensorsEntry> entries = CheckpointTensors(c, kernels::DType::kF32);
  std::vector<std::vector<float>> data;
  std::vector<SafetensorsTensor> tensors;
  float v = 0.0f;
  for (const SafetensorsEntry& e : entries) {
    std::vector<float> d(e.Bytes() / 4);
    for (float& x : d) x = (v += 0.125f);
    data.push_back(std::move(d));
    tensors.push_back({e.name, e.dtype, e.shape, data.back().data()});
  }
  STRATA_ASSERT_OK(WriteSafetensors(dir.Join("model.safetensors"), tensors));
  ASSERT_TRUE(WriteFileBytes(dir.Join("config.json"), ModelConfigToJson(c)));
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w, LoadModelWeights(dir.path(), c));
  EXPECT_EQ(ModelFingerprint(c, w), "16b8f393a7d5b8f6937350a6ea8ded7f");
}

}  // namespace
}  // namespace strata::model
