// The generation loop of one sequence: prefill the prompt, then decode token by token until
// max_tokens, an end-of-sequence token (unless ignore_eos) or a stop sequence, streaming the
// decoded text through a callback.
//
// Stop sequences are matched on the decoded text; the stop text itself (and anything after it)
// is never emitted. Text that could still turn out to be the start of a stop sequence is held
// back until it can be decided. EOS tokens end generation and are not decoded into text.
//
// Thread-compatible: Generate uses the Transformer exclusively while it runs.
#ifndef STRATA_ENGINE_GENERATOR_H_
#define STRATA_ENGINE_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_policy.h"
#include "engine/sampler.h"
#include "engine/transformer.h"
#include "kernels/tensor.h"
#include "model/tokenizer.h"

namespace strata::engine {

struct GenerateOptions {
  // Tokens to generate at most (the EOS token, when it ends generation, counts). Must be >= 1.
  // Default: 128.
  int64_t max_tokens = 128;
  SamplingOptions sampling;
  // Stop sequences matched on the decoded text; empty strings are not allowed. Need a tokenizer.
  std::vector<std::string> stop;
  // Keep going past EOS tokens (config eos ids). Default: false.
  bool ignore_eos = false;
  // KV cache page size (tokens) and storage dtype (f32 exact, bf16, or fp8_e4m3 with the cache's
  // default scales of 1: engine/kv_cache.h). Defaults: 64, f32.
  int page_size = 64;
  kernels::DType kv_dtype = kernels::DType::kF32;
  // When set, decode steps attend through this backend-side selection (ForwardOptions::
  // device_policy); it must be made for MakeCacheOptions(prompt + max_tokens, page_size,
  // kv_dtype) and be fresh for this sequence. Default: null.
  sparse::DevicePolicy* device_policy = nullptr;
  // Sample on the backend (Backend::Sample) when it supports it: the logits stay in backend
  // memory (ForwardOptions::logits_on_device) and only the token comes back. The tokens are
  // engine::Sampler's with the same seed (the CPU backend's Sample is bit-exact with it; the CUDA
  // one may differ only where a draw falls within double rounding of a cumulative probability,
  // kernels/backend.h). Backends without Sample use the host sampler. Default: true.
  bool device_sampling = true;

  // InvalidArgument for out-of-range values.
  absl::Status Validate() const;
};

enum class FinishReason { kLength, kEos, kStop };
const char* FinishReasonName(FinishReason r);  // "length", "eos", "stop"

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (an ending EOS included; stop text's ids too)
  std::string text;             // the emitted text (what the callback received, concatenated)
  FinishReason finish_reason = FinishReason::kLength;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // tokens.size()
  double prefill_seconds = 0;    // prompt forward + first token
  double decode_seconds = 0;     // the remaining single-token forwards and sampling
  int64_t decode_steps = 0;      // single-token forwards run
  bool sampled_on_device = false;  // Backend::Sample picked the tokens (device_sampling)
};

// Receives text as it becomes final. A non-OK return aborts generation with that status.
using TextCallback = std::function<absl::Status(const std::string& text)>;

// Runs the loop on `transformer` with a fresh KV cache sized prompt + max_tokens and the policy
// from `policy` (ownership stays with the caller; it must be fresh for this sequence).
// `tokenizer` may be null (then no text is produced and `stop` must be empty); `on_text` may be
// null. InvalidArgument for an empty prompt, ids outside the vocabulary, invalid options;
// errors of the forward, the tokenizer and the callback are passed through.
absl::StatusOr<GenerateResult> Generate(Transformer* transformer,
                                        const model::Tokenizer* tokenizer,
                                        const std::vector<int32_t>& prompt,
                                        const GenerateOptions& options, AttentionPolicy* policy,
                                        const TextCallback& on_text);

}  // namespace strata::engine

#endif  // STRATA_ENGINE_GENERATOR_H_
