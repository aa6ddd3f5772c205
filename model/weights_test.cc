#include "model/weights.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/internal/test_files.h"
#include "model/random_model.h"
#include "model/safetensors.h"

namespace strata::model {
namespace {

using ::strata::model::testing::TempDir;
using ::strata::model::testing::WriteFileBytes;
using ::strata::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kSeed = 7;

ModelConfig TinyConfig(Architecture arch = Architecture::kLlama, bool tied = false) {
  RandomModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  absl::StatusOr<ModelConfig> c = RandomModelConfig(o);
  EXPECT_TRUE(c.ok()) << c.status();
  c->tie_word_embeddings = tied;
  return *c;
}

// Writes config.json and model.safetensors holding exactly `entries`.
void WriteCustom(const TempDir& dir, const ModelConfig& config,
                 const std::vector<SafetensorsEntry>& entries) {
  ASSERT_TRUE(WriteFileBytes(dir.Join("config.json"), ModelConfigToJson(config)));
  STRATA_ASSERT_OK(WriteRandomSafetensors(dir.Join("model.safetensors"), entries, kSeed));
}

std::vector<SafetensorsEntry> Without(std::vector<SafetensorsEntry> v, const std::string& name) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i].name == name) {
      v.erase(v.begin() + i);
      break;
    }
  }
  return v;
}

TEST(WeightsTest, LoadsCompleteCheckpoint) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  WriteCustom(dir, c, CheckpointTensors(c, kernels::DType::kF32));
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w, LoadModelWeights(dir.path(), c));
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.embed_tokens.DebugString(), "f32[512,64]");
  EXPECT_EQ(w.layers[1].q_proj.DebugString(), "f32[64,64]");
  EXPECT_EQ(w.layers[1].k_proj.DebugString(), "f32[32,64]");
  EXPECT_EQ(w.layers[1].v_proj.DebugString(), "f32[32,64]");
  EXPECT_EQ(w.layers[0].o_proj.DebugString(), "f32[64,64]");
  EXPECT_EQ(w.layers[0].gate_proj.DebugString(), "f32[128,64]");
  EXPECT_EQ(w.layers[0].down_proj.DebugString(), "f32[64,128]");
  EXPECT_EQ(w.final_norm.DebugString(), "f32[64]");
  EXPECT_EQ(w.layers[0].q_bias.data, nullptr);
  EXPECT_NE(w.lm_head.data, w.embed_tokens.data);
  EXPECT_EQ(w.files.size(), 1u);
  // Norm weights are near 1, projections near 0.
  EXPECT_NEAR(w.final_norm.As<float>()[0], 1.0f, 0.2f);
  EXPECT_NEAR(w.layers[0].q_proj.As<float>()[0], 0.0f, 0.2f);
}

TEST(WeightsTest, NoWeightsFileIsNotFound) {
  TempDir dir;
  EXPECT_THAT(LoadModelWeights(dir.path(), TinyConfig()), StatusIs(absl::StatusCode::kNotFound));
}

TEST(WeightsTest, MissingTensor) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  WriteCustom(
      dir, c,
      Without(CheckpointTensors(c, kernels::DType::kF32), "model.layers.1.mlp.up_proj.weight"));
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("missing tensor model.layers.1.mlp.up_proj.weight")));
}

TEST(WeightsTest, WrongShape) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  for (auto& e : entries) {
    if (e.name == "model.layers.0.self_attn.k_proj.weight") e.shape = {64, 64};
  }
  WriteCustom(dir, c, entries);
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.layers.0.self_attn.k_proj.weight has shape f32[64,64], "
                                 "expected [32,64]")));
}

TEST(WeightsTest, WrongRank) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  for (auto& e : entries) {
    if (e.name == "model.norm.weight") e.shape = {1, 64};
  }
  WriteCustom(dir, c, entries);
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.norm.weight")));
}

TEST(WeightsTest, ExtraTensorIsAnError) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  entries.push_back({"model.layers.0.self_attn.extra.weight", kernels::DType::kF32, {4}});
  WriteCustom(dir, c, entries);
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unexpected tensor model.layers.0.self_attn.extra.weight")));
}

TEST(WeightsTest, RotaryInvFreqIsIgnored) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  entries.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", kernels::DType::kF32, {8}});
  WriteCustom(dir, c, entries);
  STRATA_EXPECT_OK(LoadModelWeights(dir.path(), c));
}

TEST(WeightsTest, BiasOnLlamaWithoutAttentionBiasIsExtra) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  entries.push_back({"model.layers.0.self_attn.q_proj.bias", kernels::DType::kF32, {64}});
  WriteCustom(dir, c, entries);
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("q_proj.bias")));
}

TEST(WeightsTest, Qwen2NeedsBiases) {
  TempDir dir;
  ModelConfig c = TinyConfig(Architecture::kQwen2);
  WriteCustom(dir, c, CheckpointTensors(c, kernels::DType::kBF16));
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w, LoadModelWeights(dir.path(), c));
  EXPECT_EQ(w.layers[1].q_bias.DebugString(), "bf16[64]");
  EXPECT_EQ(w.layers[1].k_bias.DebugString(), "bf16[32]");
  EXPECT_EQ(w.layers[1].v_bias.DebugString(), "bf16[32]");

  TempDir dir2;
  WriteCustom(
      dir2, c,
      Without(CheckpointTensors(c, kernels::DType::kBF16), "model.layers.1.self_attn.v_proj.bias"));
  EXPECT_THAT(LoadModelWeights(dir2.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("v_proj.bias")));
}

TEST(WeightsTest, TiedEmbeddings) {
  TempDir dir;
  ModelConfig c = TinyConfig(Architecture::kLlama, /*tied=*/true);
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  for (const auto& e : entries) ASSERT_NE(e.name, "lm_head.weight");
  WriteCustom(dir, c, entries);
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w, LoadModelWeights(dir.path(), c));
  EXPECT_EQ(w.lm_head.data, w.embed_tokens.data);
  EXPECT_EQ(w.lm_head.DebugString(), "f32[512,64]");

  // A tied checkpoint that still stores lm_head loads (the embedding is used).
  TempDir dir2;
  entries.push_back({"lm_head.weight", kernels::DType::kF32, {512, 64}});
  WriteCustom(dir2, c, entries);
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w2, LoadModelWeights(dir2.path(), c));
  EXPECT_EQ(w2.lm_head.data, w2.embed_tokens.data);
}

TEST(WeightsTest, UntiedWithoutLmHead) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  WriteCustom(dir, c, Without(CheckpointTensors(c, kernels::DType::kF32), "lm_head.weight"));
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lm_head.weight")));
}

TEST(WeightsTest, NonFloatDtypeInRequiredSlot) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  entries = Without(entries, "model.norm.weight");
  ASSERT_TRUE(WriteFileBytes(dir.Join("config.json"), ModelConfigToJson(c)));
  STRATA_ASSERT_OK(WriteRandomSafetensors(dir.Join("part.safetensors"), entries, kSeed));
  // Append an I32 "model.norm.weight" by writing the header by hand.
  std::string raw =
      "{\"model.norm.weight\":{\"dtype\":\"I32\",\"shape\":[64],\"data_offsets\":[0,256]}}";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((raw.size() >> (8 * i)) & 0xff);
  file += raw + std::string(256, '\0');
  ASSERT_TRUE(WriteFileBytes(dir.Join("norm.safetensors"), file));
  std::string index = "{\"weight_map\": {\"model.norm.weight\": \"norm.safetensors\"";
  for (const auto& e : entries) index += ",\"" + e.name + "\": \"part.safetensors\"";
  index += "}}";
  ASSERT_TRUE(WriteFileBytes(dir.Join("model.safetensors.index.json"), index));
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("I32")));
}

TEST(WeightsTest, ShardedCheckpoint) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  RandomModelOptions o;
  o.seed = kSeed;
  o.max_shard_bytes = 100000;  // the tiny model is ~0.4 MB in f32: several shards
  STRATA_ASSERT_OK(WriteRandomCheckpoint(dir.path(), c, o));
  EXPECT_FALSE(std::filesystem::exists(dir.Join("model.safetensors")));
  ASSERT_TRUE(std::filesystem::exists(dir.Join("model.safetensors.index.json")));
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w, LoadModelWeights(dir.path(), c));
  EXPECT_GE(w.files.size(), 3u);
  for (const auto& f : w.files) EXPECT_LE(f->file_size(), 100000u + 262144u);

  // The same seed unsharded gives the same values.
  TempDir single;
  RandomModelOptions o1;
  o1.seed = kSeed;
  STRATA_ASSERT_OK(WriteRandomCheckpoint(single.path(), c, o1));
  STRATA_ASSERT_OK_AND_ASSIGN(ModelWeights w1, LoadModelWeights(single.path(), c));
  EXPECT_EQ(w1.files.size(), 1u);
  EXPECT_EQ(std::memcmp(w.layers[1].down_proj.data, w1.layers[1].down_proj.data,
                        w1.layers[1].down_proj.Bytes()),
            0);
}

TEST(WeightsTest, ShardedIndexWithMissingShard) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  RandomModelOptions o;
  o.max_shard_bytes = 100000;
  STRATA_ASSERT_OK(WriteRandomCheckpoint(dir.path(), c, o));
  const std::string victim = "model-00002-of-" + [&] {
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      std::string n = e.path().filename().string();
      if (n.rfind("model-00001-of-", 0) == 0) return n.substr(15);
    }
    return std::string("?");
  }();
  ASSERT_TRUE(std::filesystem::remove(dir.Join(victim))) << victim;
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(victim)));
}

TEST(WeightsTest, IndexPointingAtWrongShard) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  auto entries = CheckpointTensors(c, kernels::DType::kF32);
  WriteCustom(dir, c, entries);
  std::filesystem::rename(dir.Join("model.safetensors"), dir.Join("a.safetensors"));
  STRATA_ASSERT_OK(WriteRandomSafetensors(dir.Join("b.safetensors"),
                                          {{"unrelated", kernels::DType::kF32, {2}}}, kSeed));
  std::string index = "{\"weight_map\": {\"model.norm.weight\": \"b.safetensors\"";
  for (const auto& e : entries) {
    if (e.name != "model.norm.weight") index += ",\"" + e.name + "\": \"a.safetensors\"";
  }
  index += "}}";
  ASSERT_TRUE(WriteFileBytes(dir.Join("model.safetensors.index.json"), index));
  EXPECT_THAT(LoadModelWeights(dir.path(), c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.norm.weight")));

  // Shard names must be plain file names.
  ASSERT_TRUE(WriteFileBytes(dir.Join("model.safetensors.index.json"),
                             "{\"weight_map\": {\"model.norm.weight\": \"../a.safetensors\"}}"));
  EXPECT_THAT(LoadModelWeights(dir.path(), c), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_TRUE(WriteFileBytes(dir.Join("model.safetensors.index.json"), "{\"weight_map\": 3}"));
  EXPECT_THAT(LoadModelWeights(dir.path(), c), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(WeightsTest, CorruptFileIsReported) {
  TempDir dir;
  ModelConfig c = TinyConfig();
  WriteCustom(dir, c, CheckpointTensors(c, kernels::DType::kF32));
  std::filesystem::resize_file(dir.Join("model.safetensors"), 1000);
  EXPECT_THAT(LoadModelWeights(dir.path(), c), StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace strata::model
