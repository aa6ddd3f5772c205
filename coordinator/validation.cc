#include "coordinator/validation.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace strata::coordinator {
namespace {

constexpr const char* kPolicies[] = {"dense", "streaming", "quest", "radar", "tokenselect", "hip", "subgen"};

bool IsLowerHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

absl::Status ValidationLimits::Validate() const {
  if (max_document_tokens <= 0 || max_upload_bytes <= 0 || max_prompt_tokens <= 0 ||
      max_max_tokens == 0 || page_size == 0 || default_budget_tokens == 0) {
    return absl::InvalidArgumentError("validation limits must be positive");
  }
  if (default_max_tokens == 0 || default_max_tokens > max_max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("default_max_tokens ", default_max_tokens,
                                                   " must be in [1, ", max_max_tokens, "]"));
  }
  if (vocab_size < 0 || num_layers < 0) {
    return absl::InvalidArgumentError("vocab_size and num_layers must be >= 0");
  }
  return absl::OkStatus();
}

bool IsKnownPolicy(absl::string_view name) {
  for (const char* p : kPolicies) {
    if (name == p) return true;
  }
  return false;
}

absl::Status ValidateDocumentId(absl::string_view id) {
  if (id.size() != 32 || !IsLowerHex(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("document_id must be 32 lowercase hex characters, got '",
                     id.substr(0, 64), "'"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJobId(absl::string_view id) {
  if (id.size() != 20 || !absl::StartsWith(id, "job-") || !IsLowerHex(id.substr(4))) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id must be 'job-' and 16 lowercase hex characters, got '", id.substr(0, 64), "'"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTokenIds(absl::Span<const int32_t> ids, int64_t vocab_size, absl::string_view what) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || (vocab_size > 0 && ids[i] >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "[", i, "] = ", ids[i], " is not a valid token id",
          vocab_size > 0 ? absl::StrCat(" (vocabulary size ", vocab_size, ")") : std::string(" (negative)")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::GenerationParams> EffectiveGenerationParams(const v1::GenerationParams& p,
                                                               const ValidationLimits& limits,
                                                               uint64_t default_seed) {
  v1::GenerationParams out = p;
  if (p.max_tokens() > limits.max_max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("params.max_tokens = ", p.max_tokens(),
                                                   " is out of range [1, ", limits.max_max_tokens, "]"));
  }
  if (p.max_tokens() == 0) out.set_max_tokens(limits.default_max_tokens);
  if (!std::isfinite(p.temperature()) || p.temperature() < 0 || p.temperature() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("params.temperature = ", p.temperature(), " is out of range [0, 2]"));
  }
  if (!std::isfinite(p.top_p()) || p.top_p() < 0 || p.top_p() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("params.top_p = ", p.top_p(), " is out of range [0, 1]"));
  }
  if (p.top_p() == 0) out.set_top_p(1.0f);
  if (limits.vocab_size > 0 && p.top_k() > limits.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("params.top_k = ", p.top_k(),
                                                   " exceeds the vocabulary size ", limits.vocab_size));
  }
  if (p.stop_size() > 8) {
    return absl::InvalidArgumentError(absl::StrCat("params.stop has ", p.stop_size(), " strings; at most 8"));
  }
  for (int i = 0; i < p.stop_size(); ++i) {
    if (p.stop(i).empty() || p.stop(i).size() > 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("params.stop[", i, "] must be 1..256 bytes, got ", p.stop(i).size()));
    }
  }
  if (p.stop_token_ids_size() > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("params.stop_token_ids has ", p.stop_token_ids_size(), " ids; at most 32"));
  }
  if (absl::Status s = ValidateTokenIds(p.stop_token_ids(), limits.vocab_size, "params.stop_token_ids");
      !s.ok()) {
    return s;
  }
  if (!p.has_seed()) out.set_seed(default_seed);
  return out;
}

absl::StatusOr<v1::SelectionPolicy> EffectiveSelectionPolicy(const v1::SelectionPolicy& p,
                                                             const ValidationLimits& limits) {
  v1::SelectionPolicy out = p;
  if (p.name().empty()) {
    out.set_name("dense");
  } else if (!IsKnownPolicy(p.name())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.name '", p.name().substr(0, 64),
        "' is unknown (dense, streaming, quest, radar, tokenselect, hip, subgen)"));
  }
  if (p.budget_tokens() == 0) {
    out.set_budget_tokens(limits.default_budget_tokens);
  } else if (p.budget_tokens() < 16 || p.budget_tokens() > (1u << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.budget_tokens = ", p.budget_tokens(), " is out of range [16, 1048576]"));
  }
  if (!p.has_sink_tokens()) out.set_sink_tokens(4);
  if (out.sink_tokens() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.sink_tokens = ", out.sink_tokens(), " is out of range [0, 1024]"));
  }
  if (!p.has_window_tokens()) out.set_window_tokens(256);
  if (out.window_tokens() > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.window_tokens = ", out.window_tokens(), " is out of range [0, 65536]"));
  }
  if (p.page_size() != 0 && p.page_size() != limits.page_size) {
    return absl::InvalidArgumentError(absl::StrCat("policy.page_size = ", p.page_size(),
                                                   " differs from the deployment's ", limits.page_size));
  }
  out.set_page_size(limits.page_size);
  if (!p.has_theta()) out.set_theta(0.9f);
  if (!std::isfinite(out.theta()) || out.theta() < 0 || out.theta() > 1) {
    return absl::InvalidArgumentError(absl::StrCat("policy.theta = ", out.theta(), " is out of range [0, 1]"));
  }
  for (int i = 0; i < p.dense_layers_size(); ++i) {
    if (limits.num_layers > 0 && p.dense_layers(i) >= limits.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("policy.dense_layers[", i, "] = ", p.dense_layers(i),
                                                     " is not a layer (model has ", limits.num_layers, ")"));
    }
  }
  if (!v1::SummaryKind_IsValid(p.summary())) {
    return absl::InvalidArgumentError(absl::StrCat("policy.summary = ", static_cast<int>(p.summary()), " is unknown"));
  }
  if (!v1::MissMode_IsValid(p.miss_mode())) {
    return absl::InvalidArgumentError(absl::StrCat("policy.miss_mode = ", static_cast<int>(p.miss_mode()), " is unknown"));
  }
  if (p.miss_mode() == v1::MISS_MODE_UNSPECIFIED) out.set_miss_mode(v1::MISS_MODE_WAIT);
  if (!p.has_candidate_factor()) out.set_candidate_factor(4);
  if (out.candidate_factor() < 1 || out.candidate_factor() > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.candidate_factor = ", out.candidate_factor(), " is out of range [1, 16]"));
  }
  // Unset or 0: the worker's policy chooses by the budget it gets (a shard: its share), as
  // PolicyOptions::EffectivePartitions (engine/sparse/policy.h: 16 at B = 2048).
  if (!p.has_partitions() || p.partitions() == 0) {
    out.clear_partitions();
    return out;
  }
  const uint32_t parts = out.partitions();
  if (parts > 64 || (parts & (parts - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.partitions = ", parts, " is not a power of two in [1, 64]"));
  }
  return out;
}

}  // namespace strata::coordinator
