// Validation of public API requests, and the effective values (server defaults filled in) of
// generation parameters and selection policies. Every failure is INVALID_ARGUMENT with a message
// naming the field, except sizes over the upload limit (RESOURCE_EXHAUSTED). Pure functions;
// thread-safe.
#ifndef STRATA_COORDINATOR_VALIDATION_H_
#define STRATA_COORDINATOR_VALIDATION_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "strata/v1/api.pb.h"

namespace strata::coordinator {

struct ValidationLimits {
  // Tokens of one document, at most (uploads and inline documents). Default: 1M.
  int64_t max_document_tokens = int64_t{1} << 20;
  // Bytes of one uploaded text, at most. Default: 64 MiB.
  int64_t max_upload_bytes = int64_t{64} << 20;
  // Tokens of one job prompt, at most. Default: 65536.
  int64_t max_prompt_tokens = 65536;
  // Used when GenerationParams.max_tokens is 0. Default: 256.
  uint32_t default_max_tokens = 256;
  // GenerationParams.max_tokens, at most. Default: 4096.
  uint32_t max_max_tokens = 4096;
  // Token ids must be in [0, vocab_size); 0: unknown (only negative ids are refused).
  int64_t vocab_size = 0;
  // Layer count for dense_layers checks; 0: unknown (not checked).
  int64_t num_layers = 0;
  // The deployment's tokens per page. Default: 64.
  uint32_t page_size = 64;
  // Used when SelectionPolicy.budget_tokens is 0. Default: 2048.
  uint32_t default_budget_tokens = 2048;

  // InvalidArgument for non-positive sizes or default_max_tokens > max_max_tokens.
  absl::Status Validate() const;
};

// The policies Strata knows.
bool IsKnownPolicy(absl::string_view name);

// INVALID_ARGUMENT unless `id` is 32 lowercase hex characters.
absl::Status ValidateDocumentId(absl::string_view id);
// INVALID_ARGUMENT unless `id` is "job-" followed by 16 lowercase hex characters.
absl::Status ValidateJobId(absl::string_view id);

// INVALID_ARGUMENT when an id is negative or (vocab_size > 0) >= vocab_size; `what` names the
// field in the message.
absl::Status ValidateTokenIds(absl::Span<const int32_t> ids, int64_t vocab_size, absl::string_view what);

// Checks `p` and returns it with defaults filled in: max_tokens (0 -> default), top_p (0 -> 1),
// seed (unset -> `default_seed`). INVALID_ARGUMENT: max_tokens above the limit, temperature
// outside [0, 2] or not finite, top_p outside [0, 1], top_k above the vocabulary, more than 8
// stop strings or one empty or longer than 256 bytes, more than 32 stop token ids or an invalid
// one.
absl::StatusOr<v1::GenerationParams> EffectiveGenerationParams(const v1::GenerationParams& p,
                                                               const ValidationLimits& limits,
                                                               uint64_t default_seed);

// Checks `p` and returns it with defaults filled in (name "dense", budget, sinks 4, window 256,
// theta 0.9, page size). INVALID_ARGUMENT: unknown name, budget outside [16, 1048576], sinks
// above 1024, window above 65536, page_size other than 0 or the deployment's, theta outside
// [0, 1], dense layer out of range, unknown summary or miss mode.
absl::StatusOr<v1::SelectionPolicy> EffectiveSelectionPolicy(const v1::SelectionPolicy& p,
                                                             const ValidationLimits& limits);

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_VALIDATION_H_
