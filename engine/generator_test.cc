#include "engine/generator.h"

#include <memory>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/internal/test_model.h"
#include "engine/transformer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/tokenizer.h"

namespace strata::engine {
namespace {

using ::strata::testing::StatusIs;

// Token bytes: ids % 7 == 0 give the first byte of "é" and ids % 7 == 1 its second byte (so a
// character may be split across tokens); the rest are letters, some with a leading space.
class FakeTokenizer : public model::Tokenizer {
 public:
  explicit FakeTokenizer(int32_t vocab) : vocab_(vocab) {}
  absl::StatusOr<std::vector<int32_t>> Encode(const std::string&, bool) const override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<std::string> Decode(const std::vector<int32_t>& ids, bool) const override {
    std::string s;
    for (int32_t id : ids) {
      STRATA_ASSIGN_OR_RETURN(std::string b, TokenBytes(id));
      s += b;
    }
    return s;
  }
  int32_t vocab_size() const override { return vocab_; }
  int32_t TokenToId(const std::string&) const override { return -1; }
  bool IsSpecial(int32_t) const override { return false; }
  absl::StatusOr<std::string> TokenBytes(int32_t id) const override {
    if (id < 0 || id >= vocab_) return absl::InvalidArgumentError("id");
    if (id % 7 == 0) return std::string("\xC3");
    if (id % 7 == 1) return std::string("\xA9");
    std::string s(1, static_cast<char>('a' + id % 26));
    return id % 3 == 0 ? " " + s : s;
  }

 private:
  int32_t vocab_;
};

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = test_model::MakeModel(kernels::DType::kF32, false, false, &ref_);
    backend_ = kernels::MakeCpuBackend(1);
    tokenizer_ = std::make_unique<FakeTokenizer>(static_cast<int32_t>(model_->config.vocab_size));
  }
  absl::StatusOr<GenerateResult> Run(const GenerateOptions& o, std::string* streamed,
                                     int64_t chunk = 512) {
    TransformerOptions topt;
    topt.prefill_chunk_size = chunk;
    STRATA_ASSIGN_OR_RETURN(auto tf, Transformer::Create(model_->config, model_->weights,
                                                         backend_.get(), topt));
    auto policy = MakeDensePolicy();
    return Generate(tf.get(), tokenizer_.get(), prompt_, o, policy.get(),
                    [streamed](const std::string& t) {
                      EXPECT_FALSE(t.empty());
                      // Never a split character: a chunk never ends with the lead byte.
                      EXPECT_NE(t.back(), '\xC3');
                      *streamed += t;
                      return absl::OkStatus();
                    });
  }

  test_model::RefModel ref_;
  std::unique_ptr<test_model::TestModel> model_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<FakeTokenizer> tokenizer_;
  std::vector<int32_t> prompt_ = {5, 9, 22, 13, 40, 2, 61};
};

TEST_F(GeneratorTest, GreedyLengthStreamingAndChunkIndependence) {
  GenerateOptions o;
  o.max_tokens = 24;
  o.ignore_eos = true;
  std::string streamed;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult r, Run(o, &streamed));
  EXPECT_EQ(r.tokens.size(), 24u);
  EXPECT_EQ(r.generated_tokens, 24);
  EXPECT_EQ(r.prompt_tokens, 7);
  EXPECT_EQ(r.decode_steps, 23);
  EXPECT_EQ(r.finish_reason, FinishReason::kLength);
  EXPECT_EQ(streamed, r.text);
  STRATA_ASSERT_OK_AND_ASSIGN(std::string all, tokenizer_->Decode(r.tokens, false));
  // Same text except that invalid UTF-8 sequences became U+FFFD in the stream.
  EXPECT_EQ(r.text.empty(), all.empty());
  std::string streamed2;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult r2, Run(o, &streamed2, /*chunk=*/3));
  EXPECT_EQ(r2.tokens, r.tokens);
}

// KV caches in each storage dtype generate (fp8: e4m3 with the cache's default scales, attended
// through the CPU backend's fp8 PagedAttention); a dtype no cache stores is refused.
TEST_F(GeneratorTest, EveryKvDtypeGenerates) {
  for (kernels::DType dt : {kernels::DType::kF32, kernels::DType::kBF16, kernels::DType::kFP8E4M3}) {
    SCOPED_TRACE(kernels::DTypeName(dt));
    GenerateOptions o;
    o.max_tokens = 12;
    o.ignore_eos = true;
    o.kv_dtype = dt;
    std::string streamed;
    STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult r, Run(o, &streamed, /*chunk=*/4));
    EXPECT_EQ(r.tokens.size(), 12u);
    EXPECT_EQ(r.decode_steps, 11);
  }
  GenerateOptions bad;
  bad.kv_dtype = kernels::DType::kI32;
  std::string s;
  EXPECT_THAT(Run(bad, &s), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(GeneratorTest, DeviceSamplingGivesTheHostSamplersTokens) {
  // The CPU backend implements Backend::Sample (bit-exact with engine::Sampler): the same tokens
  // with the logits left in backend memory as with the host copy + Sampler, greedy and random.
  for (const double temperature : {0.0, 0.8, 1.5}) {
    for (const double top_p : {1.0, 0.7}) {
      GenerateOptions o;
      o.max_tokens = 20;
      o.ignore_eos = true;
      o.sampling.temperature = temperature;
      o.sampling.top_p = top_p;
      o.sampling.top_k = top_p < 1.0 ? 0 : 12;
      o.sampling.seed = 77;
      o.device_sampling = false;
      std::string s1, s2;
      STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult host, Run(o, &s1, /*chunk=*/4));
      EXPECT_FALSE(host.sampled_on_device);
      o.device_sampling = true;
      STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult device, Run(o, &s2, /*chunk=*/4));
      EXPECT_TRUE(device.sampled_on_device);
      EXPECT_EQ(device.tokens, host.tokens) << "temperature " << temperature << " top_p " << top_p;
      EXPECT_EQ(device.text, host.text);
    }
  }
}

TEST_F(GeneratorTest, EosEndsGenerationUnlessIgnored) {
  GenerateOptions o;
  o.max_tokens = 24;
  o.ignore_eos = true;
  std::string s;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult full, Run(o, &s));
  // Make the 6th generated token the EOS id: generation must end right there.
  const int32_t eos = full.tokens[5];
  size_t first = 0;
  while (full.tokens[first] != eos) ++first;
  model_->config.eos_token_ids = {eos};
  o.ignore_eos = false;
  std::string s2;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult r, Run(o, &s2));
  EXPECT_EQ(r.finish_reason, FinishReason::kEos);
  ASSERT_EQ(r.tokens.size(), first + 1);
  EXPECT_EQ(r.tokens.back(), eos);
  o.ignore_eos = true;
  std::string s3;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult r3, Run(o, &s3));
  EXPECT_EQ(r3.tokens, full.tokens);
}

TEST_F(GeneratorTest, StopSequenceIsNotEmitted) {
  GenerateOptions o;
  o.max_tokens = 24;
  o.ignore_eos = true;
  std::string s;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult full, Run(o, &s));
  ASSERT_GE(full.text.size(), 8u) << full.text;
  // A stop string from the middle of the text: output is everything before its first match.
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  const size_t at = full.text.find(stop);
  o.stop = {"never-present", stop};
  std::string streamed;
  STRATA_ASSERT_OK_AND_ASSIGN(GenerateResult r, Run(o, &streamed));
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(r.text, full.text.substr(0, at));
  EXPECT_EQ(streamed, r.text);
  EXPECT_LT(r.tokens.size(), full.tokens.size());
}

TEST_F(GeneratorTest, RejectsBadInput) {
  GenerateOptions o;
  std::string s;
  prompt_.clear();
  EXPECT_THAT(Run(o, &s), StatusIs(absl::StatusCode::kInvalidArgument));
  prompt_ = {1, 1000};
  EXPECT_THAT(Run(o, &s), StatusIs(absl::StatusCode::kInvalidArgument));
  prompt_ = {1, 2};
  o.max_tokens = 0;
  EXPECT_THAT(Run(o, &s), StatusIs(absl::StatusCode::kInvalidArgument));
  o.max_tokens = 3;
  o.stop = {""};
  EXPECT_THAT(Run(o, &s), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(GeneratorTest, CallbackErrorAborts) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto tf, Transformer::Create(model_->config, model_->weights,
                                                           backend_.get(), {}));
  GenerateOptions o;
  o.max_tokens = 30;
  o.ignore_eos = true;
  int calls = 0;
  auto policy = MakeDensePolicy();
  auto r = Generate(tf.get(), tokenizer_.get(), prompt_, o, policy.get(),
                    [&calls](const std::string&) {
                      ++calls;
                      return absl::CancelledError("client went away");
                    });
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace strata::engine
