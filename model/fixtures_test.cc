// Loads every golden model of tests/fixtures/golden (written by Hugging Face transformers with
// scripts/make_golden_fixtures.py) through LoadModel: config spellings of transformers 5, tied
// and bf16 weights, QKV bias, tokenizers. The logits themselves are checked by engine/ tests.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

const char kGoldenDir[] = "tests/fixtures/golden";  // tests run from the repository root

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str(), nullptr, false);
}

TEST(FixturesTest, EveryGoldenModelLoads) {
  ASSERT_TRUE(std::filesystem::is_directory(kGoldenDir))
      << kGoldenDir << " missing: run from the repository root";
  int cases = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldenDir)) {
    if (!entry.is_directory()) continue;
    const std::string dir = entry.path().string();
    SCOPED_TRACE(dir);
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Model> m, LoadModel(dir));
    nlohmann::json expected = ReadJson(dir + "/expected.json");
    ASSERT_FALSE(expected.is_discarded());
    const std::string arch = expected.value("arch", "");
    EXPECT_EQ(arch, ArchitectureName(m->config.arch));
    ASSERT_TRUE(expected["logits"].is_array() && !expected["logits"].empty());
    EXPECT_EQ(static_cast<int64_t>(expected["logits"][0].size()), m->config.vocab_size);
    EXPECT_EQ(m->fingerprint.size(), 32u);
    EXPECT_EQ(m->weights.layers.size(), static_cast<size_t>(m->config.num_layers));
    EXPECT_EQ(m->config.attention_bias, arch == "qwen2");
    const std::string name = entry.path().filename().string();
    if (name == "llama_tied") {
      EXPECT_TRUE(m->config.tie_word_embeddings);
      EXPECT_EQ(m->weights.lm_head.data, m->weights.embed_tokens.data);
    }
    if (name == "llama_bf16") {
      EXPECT_EQ(m->weights.embed_tokens.dtype, kernels::DType::kBF16);
    }
    if (name == "llama3_scaled") {
      EXPECT_EQ(m->config.rope_scaling.type, RopeScaling::Type::kLlama3);
    }
    if (m->tokenizer != nullptr) {
      EXPECT_LE(m->tokenizer->vocab_size(), m->config.vocab_size);
    }
    ++cases;
  }
  EXPECT_GE(cases, 7);
}

}  // namespace
}  // namespace strata::model
