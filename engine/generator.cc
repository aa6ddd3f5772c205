// The generation loop; see engine/generator.h.
#include "engine/generator.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/status_macros.h"
#include "kernels/backend.h"

namespace strata::engine {

absl::Status GenerateOptions::Validate() const {
  if (max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", max_tokens));
  }
  STRATA_RETURN_IF_ERROR(sampling.Validate());
  for (const std::string& s : stop) {
    if (s.empty()) return absl::InvalidArgumentError("stop sequences must not be empty");
  }
  if (page_size < 1) return absl::InvalidArgumentError("page_size must be >= 1");
  if (kv_dtype != kernels::DType::kF32 && kv_dtype != kernels::DType::kBF16 &&
      kv_dtype != kernels::DType::kFP8E4M3) {
    return absl::InvalidArgumentError("kv_dtype must be f32, bf16 or fp8_e4m3");
  }
  return absl::OkStatus();
}

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStop:
      return "stop";
  }
  return "?";
}

namespace {

// Holds back decoded text that might be the beginning of a stop sequence.
class StopMatcher {
 public:
  explicit StopMatcher(const std::vector<std::string>& stop) : stop_(stop) {}

  // Adds text; returns the text that is now final. Sets *stopped when a stop sequence completed
  // (the returned text then ends right before it).
  std::string Push(const std::string& text, bool* stopped) {
    pending_ += text;
    *stopped = false;
    size_t best = std::string::npos;
    for (const std::string& s : stop_) best = std::min(best, pending_.find(s));
    if (best != std::string::npos) {
      *stopped = true;
      std::string out = pending_.substr(0, best);
      pending_.clear();
      return out;
    }
    // Longest suffix of pending_ that is a proper prefix of a stop sequence stays held.
    size_t hold = 0;
    for (const std::string& s : stop_) {
      const size_t max_len = std::min(s.size() - 1, pending_.size());
      for (size_t len = max_len; len > hold; --len) {
        if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
          hold = len;
          break;
        }
      }
    }
    std::string out = pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    return out;
  }

  // End of stream: whatever is held is final (it did not complete a stop sequence).
  std::string Flush() { return std::exchange(pending_, std::string()); }

 private:
  const std::vector<std::string>& stop_;
  std::string pending_;
};

// Token sampling on the backend (Transformer::PickToken over the step's device logits), each
// token's row from the stream engine::Sampler would draw from (SampleRowStream).
class DeviceSampler {
 public:
  // Null (and OK) when the backend has no Sample for these logits.
  static absl::StatusOr<std::unique_ptr<DeviceSampler>> Create(kernels::Backend* backend,
                                                               int64_t vocab,
                                                               const SamplingOptions& o) {
    STRATA_ASSIGN_OR_RETURN(auto row, backend->Allocate(sizeof(kernels::SampleRow)));
    STRATA_ASSIGN_OR_RETURN(auto token, backend->Allocate(sizeof(int32_t)));
    STRATA_ASSIGN_OR_RETURN(auto probe, backend->Allocate(static_cast<size_t>(vocab) * 4));
    kernels::SampleParams p;
    p.logits = probe->View(kernels::DType::kF32, {1, vocab});
    p.rows = static_cast<const kernels::SampleRow*>(row->data());
    p.tokens = token->View(kernels::DType::kI32, {1});
    if (!backend->Supports(p).ok()) return std::unique_ptr<DeviceSampler>();
    return std::unique_ptr<DeviceSampler>(new DeviceSampler(o));
  }

  // The token of the transformer's device logits; InvalidArgument as engine::Sampler.
  absl::StatusOr<int32_t> Sample(Transformer* transformer) {
    STRATA_ASSIGN_OR_RETURN(const int32_t token, transformer->PickToken(rows_.Next()));
    if (token < 0) return absl::InvalidArgumentError("Sample: every logit is NaN or -inf");
    return token;
  }

 private:
  explicit DeviceSampler(const SamplingOptions& o) : rows_(o) {}
  SampleRowStream rows_;
};

}  // namespace

absl::StatusOr<GenerateResult> Generate(Transformer* transformer,
                                        const model::Tokenizer* tokenizer,
                                        const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options, AttentionPolicy* policy,
                                        const TextCallback& on_text) {
  if (transformer == nullptr || policy == nullptr) {
    return absl::InvalidArgumentError("Generate: null transformer or policy");
  }
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (prompt.empty()) return absl::InvalidArgumentError("Generate: the prompt is empty");
  if (tokenizer == nullptr && !options.stop.empty()) {
    return absl::InvalidArgumentError("Generate: stop sequences need a tokenizer");
  }
  const model::ModelConfig& config = transformer->config();
  const int64_t vocab = config.vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("Generate: prompt id ", prompt[i], " at ", i,
                                                     " is outside [0, ", vocab, ")"));
    }
  }

  const int64_t n = static_cast<int64_t>(prompt.size());
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<KvCache> cache,
      KvCache::Create(transformer->MakeCacheOptions(n + options.max_tokens, options.page_size,
                                                    options.kv_dtype),
                      transformer->backend()));
  Sampler sampler(options.sampling);
  std::unique_ptr<DeviceSampler> device_sampler;
  if (options.device_sampling) {
    STRATA_ASSIGN_OR_RETURN(device_sampler,
                            DeviceSampler::Create(transformer->backend(), vocab, options.sampling));
  }
  std::unique_ptr<model::StreamingDecoder> decoder;
  if (tokenizer != nullptr) decoder = std::make_unique<model::StreamingDecoder>(tokenizer);
  StopMatcher matcher(options.stop);
  std::vector<float> logits(vocab);

  GenerateResult result;
  result.prompt_tokens = n;
  auto emit = [&](const std::string& text) -> absl::Status {
    if (text.empty()) return absl::OkStatus();
    result.text += text;
    return on_text ? on_text(text) : absl::OkStatus();
  };

  ForwardOptions fo;
  fo.device_policy = options.device_policy;
  fo.logits_on_device = device_sampler != nullptr;
  result.sampled_on_device = device_sampler != nullptr;
  auto sample = [&]() -> absl::StatusOr<int32_t> {
    if (device_sampler != nullptr) return device_sampler->Sample(transformer);
    return sampler.Sample(logits.data(), vocab);
  };
  Stopwatch watch;
  STRATA_RETURN_IF_ERROR(
      transformer->Forward(prompt.data(), n, 0, cache.get(), policy, logits.data(), false, fo));
  int64_t pos = n;
  bool done = false;
  while (!done) {
    STRATA_ASSIGN_OR_RETURN(int32_t token, sample());
    result.tokens.push_back(token);
    if (result.tokens.size() == 1) {
      result.prefill_seconds = watch.ElapsedSeconds();
      watch.Reset();
    }
    const bool is_eos = std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(),
                                  token) != config.eos_token_ids.end();
    if (is_eos && !options.ignore_eos) {
      result.finish_reason = FinishReason::kEos;
      break;
    }
    if (decoder != nullptr) {
      STRATA_ASSIGN_OR_RETURN(std::string piece, decoder->Push(token));
      bool stopped = false;
      STRATA_RETURN_IF_ERROR(emit(matcher.Push(piece, &stopped)));
      if (stopped) {
        result.finish_reason = FinishReason::kStop;
        break;
      }
    }
    if (static_cast<int64_t>(result.tokens.size()) >= options.max_tokens) {
      result.finish_reason = FinishReason::kLength;
      break;
    }
    STRATA_RETURN_IF_ERROR(
        transformer->Forward(&token, 1, pos, cache.get(), policy, logits.data(), false, fo));
    ++pos;
    ++result.decode_steps;
  }
  if (decoder != nullptr && result.finish_reason != FinishReason::kStop) {
    bool stopped = false;
    std::string tail = matcher.Push(decoder->Finish(), &stopped);
    if (stopped) result.finish_reason = FinishReason::kStop;
    STRATA_RETURN_IF_ERROR(emit(tail));
    if (!stopped) STRATA_RETURN_IF_ERROR(emit(matcher.Flush()));
  }
  if (result.tokens.size() > 1) result.decode_seconds = watch.ElapsedSeconds();
  result.generated_tokens = static_cast<int64_t>(result.tokens.size());
  return result;
}

}  // namespace strata::engine
