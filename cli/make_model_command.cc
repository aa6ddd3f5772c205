// `strata make-model`: writes a random Llama-family model in Hugging Face layout (config.json,
// safetensors weights, tokenizer.json), then loads it back and prints its fingerprint.
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "model/model.h"
#include "model/random_model.h"

namespace strata::cli {
namespace {

absl::Status ParseArch(const std::string& s, model::Architecture* out) {
  if (s == "llama") {
    *out = model::Architecture::kLlama;
  } else if (s == "qwen2") {
    *out = model::Architecture::kQwen2;
  } else if (s == "mistral") {
    *out = model::Architecture::kMistral;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--arch: unknown architecture '", s, "' (llama, qwen2, mistral)"));
  }
  return absl::OkStatus();
}

absl::Status ParseDType(const std::string& s, kernels::DType* out) {
  if (s == "f32") {
    *out = kernels::DType::kF32;
  } else if (s == "bf16") {
    *out = kernels::DType::kBF16;
  } else if (s == "f16") {
    *out = kernels::DType::kF16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--dtype: '", s, "' is not f32, bf16 or f16"));
  }
  return absl::OkStatus();
}

}  // namespace

int RunMakeModel(int argc, char** argv) {
  std::string arch = "llama", preset = "tiny", out, dtype = "f32";
  int64_t seed = 0, vocab = 0, max_shard_bytes = int64_t{2} << 30;
  bool tokenizer = true, verify = true;
  FlagSet flags("make-model", "--out DIR [--arch llama|qwen2|mistral] [--preset P] [flags]");
  flags.String("arch", &arch,
               "architecture: llama (llama3 rope scaling), qwen2 (QKV bias), mistral");
  flags.String("preset", &preset, "shape: tiny, small (~90M), llama-3.2-1b, llama-3.1-8b");
  flags.String("out", &out, "output directory (created when missing)");
  flags.String("dtype", &dtype, "weight dtype: f32, bf16, f16");
  flags.Int("seed", &seed, "seed of the random weights");
  flags.Int("vocab", &vocab, "vocabulary size of model and tokenizer (0: the preset's)");
  flags.Int("max-shard-bytes", &max_shard_bytes, "shard the weights above this many bytes");
  flags.Bool("tokenizer", &tokenizer, "train and write tokenizer.json");
  flags.Bool("verify", &verify, "load the written model back and print its fingerprint");
  absl::Status st = flags.Parse(argc, argv);
  if (!st.ok() || flags.help_requested()) return ReportAndExit(flags, st);

  model::RandomModelOptions opts;
  opts.preset = preset;
  opts.seed = static_cast<uint64_t>(seed);
  opts.vocab_size = vocab;
  opts.write_tokenizer = tokenizer;
  opts.max_shard_bytes = max_shard_bytes;
  opts.progress = preset != "tiny";
  st = ParseArch(arch, &opts.arch);
  if (st.ok()) st = ParseDType(dtype, &opts.dtype);
  if (st.ok() && out.empty()) st = absl::InvalidArgumentError("--out is required");
  if (st.ok()) st = opts.Validate();
  if (!st.ok()) return ReportAndExit(flags, st);

  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<model::ModelConfig> config = model::WriteRandomModel(out, opts);
  if (!config.ok()) {
    std::fprintf(stderr, "strata make-model: %s\n", config.status().ToString().c_str());
    return 1;
  }
  const double write_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "wrote %s (%s, seed %lld) in %.1f s\n", out.c_str(),
               config->DebugString().c_str(), static_cast<long long>(seed), write_s);
  if (!verify) return 0;
  absl::StatusOr<std::unique_ptr<model::Model>> m = model::LoadModel(out);
  if (!m.ok()) {
    std::fprintf(stderr, "strata make-model: written model does not load: %s\n",
                 m.status().ToString().c_str());
    return 1;
  }
  std::printf("%s fingerprint %s\n", out.c_str(), (*m)->fingerprint.c_str());
  return 0;
}

}  // namespace strata::cli
