// `strata generate`: runs a model locally on a prompt with an attention policy (dense by default;
// any sparse policy of engine/sparse/policy.h) and streams the generated text to stdout;
// statistics and the effective configuration go to stderr. The backend is the CPU one unless
// --backend says otherwise; on the CUDA backend quest and tokenselect select on the device
// (engine/sparse/device_policy.h: decode steps; prompt chunks attend densely), the other sparse
// policies need the CPU backend. --device-selection runs the device selection on the CPU backend
// too.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "engine/attention_policy.h"
#include "engine/generator.h"
#include "engine/sparse/device_policy.h"
#include "engine/sparse/policy.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "model/model.h"

namespace strata::cli {
namespace {

struct GenerateFlags {
  std::string model;
  std::string prompt;
  std::string prompt_file;
  std::string token_ids;
  int64_t max_tokens = 128;
  double temperature = 0.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  int64_t seed = 0;
  std::string stop;  // for --help; the values are collected by CollectStops
  bool ignore_eos = false;
  int64_t chunk_size = 512;
  int64_t threads = 0;
  // Attention policy (engine/sparse/policy.h).
  std::string policy = "dense";
  std::string summary;
  int64_t budget = 2048;
  int64_t sinks = 64;
  int64_t window = 256;
  int64_t page_size = 64;
  std::string kv_dtype = "f32";
  double theta = 0.9;
  int64_t candidate_factor = 4;
  int64_t partitions = 0;  // by the budget (PolicyOptions::EffectivePartitions)
  std::string dense_layers;
  std::string backend = "cpu";
  bool device_selection = false;
  std::string matmul_precision = "split";
  std::string weight_format = "checkpoint";
};

absl::StatusOr<std::vector<int>> ParseLayerList(const std::string& text) {
  std::vector<int> layers;
  for (absl::string_view piece : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    piece = absl::StripAsciiWhitespace(piece);
    int layer;
    if (!absl::SimpleAtoi(piece, &layer) || layer < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--dense-layers: '", std::string(piece), "' is not a layer index"));
    }
    layers.push_back(layer);
  }
  return layers;
}

absl::StatusOr<engine::sparse::PolicyOptions> MakePolicyOptions(const GenerateFlags& f) {
  engine::sparse::PolicyOptions o;
  STRATA_ASSIGN_OR_RETURN(o.kind, engine::sparse::ParsePolicyName(f.policy));
  if (!f.summary.empty()) {
    STRATA_ASSIGN_OR_RETURN(o.summary, engine::sparse::ParseSummaryKind(f.summary));
  }
  if (f.budget <= 0 || f.budget > (1 << 24)) {
    return absl::InvalidArgumentError("--budget must be in [1, 16777216] tokens");
  }
  if (f.sinks < 0 || f.window < 0 || f.page_size <= 0 || f.page_size > 4096) {
    return absl::InvalidArgumentError("--sinks/--window must be >= 0 and --page-size in [1, 4096]");
  }
  o.token_budget = static_cast<int>(f.budget);
  o.sink_tokens = static_cast<int>(f.sinks);
  o.window_tokens = static_cast<int>(f.window);
  o.page_size = static_cast<int>(f.page_size);
  o.cache_theta = f.theta;
  // Out of [1, 16]: o.Validate() below refuses it (a value past int's range as well).
  o.tokenselect_candidate_factor =
      static_cast<int>(std::clamp<int64_t>(f.candidate_factor, -1, 1 << 20));
  // Likewise a part count that is not a power of two in [1, 64].
  o.tokenselect_partitions = static_cast<int>(std::clamp<int64_t>(f.partitions, -1, 1 << 20));
  STRATA_ASSIGN_OR_RETURN(o.dense_layers, ParseLayerList(f.dense_layers));
  STRATA_RETURN_IF_ERROR(o.Validate());
  return o;
}

// "\n", "\t", "\\" and "\," in stop sequences stand for newline, tab, backslash and a comma.
std::vector<std::string> SplitStops(const std::string& value) {
  std::vector<std::string> out;
  std::string cur;
  for (size_t i = 0; i < value.size(); ++i) {
    const char c = value[i];
    if (c == '\\' && i + 1 < value.size()) {
      const char e = value[++i];
      cur += e == 'n' ? '\n' : e == 't' ? '\t' : e;
    } else if (c == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// Every --stop value (the flag may repeat; FlagSet keeps only the last one).
std::vector<std::string> CollectStops(int argc, char** argv) {
  std::vector<std::string> stops;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    std::string value;
    if (arg == "--stop" && i + 1 < argc) {
      value = argv[++i];
    } else if (arg.rfind("--stop=", 0) == 0) {
      value = arg.substr(7);
    } else {
      continue;
    }
    for (std::string& s : SplitStops(value)) stops.push_back(std::move(s));
  }
  return stops;
}

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view piece : absl::StrSplit(text, ',')) {
    piece = absl::StripAsciiWhitespace(piece);
    int32_t id;
    if (!absl::SimpleAtoi(piece, &id) || id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--token-ids: '", std::string(piece), "' is not a token id"));
    }
    ids.push_back(id);
  }
  return ids;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --prompt-file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status Run(const GenerateFlags& f, const std::vector<std::string>& stops) {
  const int sources = !f.prompt.empty() + !f.prompt_file.empty() + !f.token_ids.empty();
  if (f.model.empty()) return absl::InvalidArgumentError("--model DIR is required");
  if (sources != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --prompt, --prompt-file and --token-ids (non-empty)");
  }
  if (f.threads < 0) return absl::InvalidArgumentError("--threads must be >= 0");
  if (f.seed < 0) return absl::InvalidArgumentError("--seed must be >= 0");

  engine::GenerateOptions gen;
  gen.max_tokens = f.max_tokens;
  gen.sampling.temperature = f.temperature;
  gen.sampling.top_k = f.top_k;
  gen.sampling.top_p = f.top_p;
  gen.sampling.seed = static_cast<uint64_t>(f.seed);
  gen.stop = stops;
  gen.ignore_eos = f.ignore_eos;
  gen.page_size = static_cast<int>(f.page_size);
  if (f.kv_dtype == "f32") {
    gen.kv_dtype = kernels::DType::kF32;
  } else if (f.kv_dtype == "bf16") {
    gen.kv_dtype = kernels::DType::kBF16;
  } else if (f.kv_dtype == "fp8") {
    gen.kv_dtype = kernels::DType::kFP8E4M3;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-dtype: '", f.kv_dtype, "' is not one of f32, bf16, fp8"));
  }
  STRATA_RETURN_IF_ERROR(gen.Validate());
  STRATA_ASSIGN_OR_RETURN(const engine::sparse::PolicyOptions popt, MakePolicyOptions(f));
  engine::TransformerOptions topt;
  topt.prefill_chunk_size = f.chunk_size;
  STRATA_ASSIGN_OR_RETURN(topt.matmul_precision, engine::ParseMatMulPrecision(f.matmul_precision));
  STRATA_ASSIGN_OR_RETURN(topt.weight_format, engine::ParseWeightFormat(f.weight_format));
  STRATA_RETURN_IF_ERROR(topt.Validate());

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<model::Model> m, model::LoadModel(f.model));
  std::vector<int32_t> prompt;
  if (!f.token_ids.empty()) {
    STRATA_ASSIGN_OR_RETURN(prompt, ParseTokenIds(f.token_ids));
  } else {
    std::string text = f.prompt;
    if (!f.prompt_file.empty()) {
      STRATA_ASSIGN_OR_RETURN(text, ReadFile(f.prompt_file));
    }
    if (text.empty()) return absl::InvalidArgumentError("the prompt is empty");
    if (m->tokenizer == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(f.model, " has no tokenizer.json: use --token-ids"));
    }
    STRATA_ASSIGN_OR_RETURN(prompt, m->tokenizer->Encode(text, /*add_special_tokens=*/true));
  }
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  if (!stops.empty() && m->tokenizer == nullptr) {
    return absl::FailedPreconditionError("--stop needs a model with tokenizer.json");
  }

  kernels::BackendOptions bo;
  STRATA_ASSIGN_OR_RETURN(bo.kind, kernels::ParseBackendKind(f.backend));
  bo.cpu_threads = static_cast<int>(f.threads);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::MakeBackend(bo));
  const bool on_cpu = backend->Name() == "cpu";
  const bool device_kind = popt.kind == engine::sparse::PolicyKind::kQuest ||
                           popt.kind == engine::sparse::PolicyKind::kTokenSelect;
  const bool device_selection = device_kind && (f.device_selection || !on_cpu);
  if (!on_cpu && popt.kind != engine::sparse::PolicyKind::kDense && !device_kind) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--policy ", f.policy, " reads keys on the host: use --backend cpu (quest and "
        "tokenselect also run on ", backend->Name(), ")"));
  }
  if (f.device_selection && !device_kind) {
    return absl::InvalidArgumentError("--device-selection needs --policy quest|tokenselect");
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::Transformer> tf,
                          engine::Transformer::Create(m->config, m->weights, backend.get(), topt));
  std::unique_ptr<engine::AttentionPolicy> policy;
  // The host policy attends the prompt chunks on the CPU backend (any cache dtype).
  if (on_cpu || !device_selection) {
    STRATA_ASSIGN_OR_RETURN(
        policy, engine::sparse::MakeAttentionPolicy(popt, static_cast<int>(m->config.num_layers),
                                                    static_cast<int>(m->config.num_heads),
                                                    static_cast<int>(m->config.num_kv_heads),
                                                    static_cast<int>(m->config.head_dim)));
  } else {
    policy = engine::MakeDensePolicy();  // prompt chunks; decode steps select on the device
  }
  std::unique_ptr<engine::sparse::DevicePolicy> device_policy;
  if (device_selection) {
    STRATA_ASSIGN_OR_RETURN(
        device_policy,
        engine::sparse::DevicePolicy::Create(
            popt,
            tf->MakeCacheOptions(static_cast<int64_t>(prompt.size()) + gen.max_tokens,
                                 gen.page_size, gen.kv_dtype),
            static_cast<int>(m->config.num_heads), backend.get()));
    gen.device_policy = device_policy.get();
  }
  // tokenselect's parts as the policy runs them (0 asks for them by the budget).
  const int group =
      static_cast<int>(m->config.num_heads / std::max<int64_t>(1, m->config.num_kv_heads));
  const std::string parts = popt.kind == engine::sparse::PolicyKind::kTokenSelect
                                ? absl::StrCat(" parts=", popt.EffectivePartitions(group))
                                : std::string();
  std::fprintf(stderr,
               "strata generate: model=%s [%s] backend=%s selection=%s threads=%s policy=%s "
               "budget=%lld%s "
               "sinks=%lld window=%lld page=%lld kv=%s chunk=%lld "
               "max_tokens=%lld temperature=%g top_k=%lld top_p=%g seed=%lld stop=%zu "
               "ignore_eos=%s matmul=%s weights=%s\n",
               f.model.c_str(), m->config.DebugString().c_str(), backend->Name().c_str(),
               device_selection ? "device" : "host",
               f.threads > 0 ? std::to_string(f.threads).c_str() : "all",
               device_selection ? f.policy.c_str() : policy->Name().c_str(), static_cast<long long>(f.budget),
               parts.c_str(), static_cast<long long>(f.sinks), static_cast<long long>(f.window),
               static_cast<long long>(f.page_size), f.kv_dtype.c_str(),
               static_cast<long long>(f.chunk_size),
               static_cast<long long>(f.max_tokens), f.temperature,
               static_cast<long long>(f.top_k), f.top_p, static_cast<long long>(f.seed),
               stops.size(), f.ignore_eos ? "true" : "false",
               engine::MatMulPrecisionName(topt.matmul_precision),
               engine::WeightFormatName(topt.weight_format));

  auto on_text = [](const std::string& text) -> absl::Status {
    if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout) != 0) {
      return absl::UnavailableError("cannot write to stdout");
    }
    return absl::OkStatus();
  };
  STRATA_ASSIGN_OR_RETURN(
      engine::GenerateResult r,
      engine::Generate(tf.get(), m->tokenizer.get(), prompt, gen, policy.get(), on_text));
  if (m->tokenizer == nullptr) {
    // No tokenizer: print the generated ids instead of text.
    std::string ids = absl::StrJoin(r.tokens, ",");
    on_text(ids + "\n").IgnoreError();  // best effort; the statistics follow regardless
  } else if (!r.text.empty() && r.text.back() != '\n') {
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  const double prefill_tps = r.prefill_seconds > 0 ? r.prompt_tokens / r.prefill_seconds : 0;
  const double decode_tps = r.decode_seconds > 0 ? r.decode_steps / r.decode_seconds : 0;
  std::fprintf(stderr,
               "strata generate: prompt_tokens=%lld generated_tokens=%lld finish=%s "
               "prefill=%.3fs (%.1f tok/s) decode=%.3fs for %lld steps (%.1f tok/s)\n",
               static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.generated_tokens),
               engine::FinishReasonName(r.finish_reason), r.prefill_seconds, prefill_tps,
               r.decode_seconds, static_cast<long long>(r.decode_steps), decode_tps);
  // The prompt chunks' policy and, with device selection, the decode steps' (its cache hits read
  // back now).
  engine::SelectionCounters c = policy->counters();
  if (device_policy != nullptr) {
    STRATA_RETURN_IF_ERROR(device_policy->ReadCacheHits(nullptr));
    const engine::SelectionCounters& d = device_policy->counters();
    c.candidate_tokens += d.candidate_tokens;
    c.selected_tokens += d.selected_tokens;
    c.cache_lookups += d.cache_lookups;
    c.cache_hits += d.cache_hits;
  }
  std::fprintf(stderr,
               "strata generate: attention candidate_tokens=%lld selected_tokens=%lld (%.3f) "
               "selection_cache hits=%lld/%lld\n",
               static_cast<long long>(c.candidate_tokens), static_cast<long long>(c.selected_tokens),
               c.candidate_tokens > 0 ? static_cast<double>(c.selected_tokens) / c.candidate_tokens : 0.0,
               static_cast<long long>(c.cache_hits), static_cast<long long>(c.cache_lookups));
  return absl::OkStatus();
}

}  // namespace

int RunGenerate(int argc, char** argv) {
  GenerateFlags f;
  FlagSet flags("generate",
                "--model DIR (--prompt TEXT | --prompt-file F | --token-ids 1,2,3) [flags]");
  flags.String("model", &f.model, "Hugging Face model directory (config.json, *.safetensors)");
  flags.String("prompt", &f.prompt, "prompt text (encoded with the model's tokenizer, BOS added)");
  flags.String("prompt-file", &f.prompt_file, "read the prompt text from this file");
  flags.String("token-ids", &f.token_ids, "prompt as comma-separated token ids");
  flags.Int("max-tokens", &f.max_tokens, "tokens to generate at most");
  flags.Double("temperature", &f.temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &f.top_k, "keep the k most likely tokens; 0 = all");
  flags.Double("top-p", &f.top_p, "nucleus sampling mass in (0, 1]");
  flags.Int("seed", &f.seed, "random seed (PCG32)");
  flags.String("stop", &f.stop,
               "stop sequence; repeatable or comma-separated (\\n, \\t, \\, and \\\\ escapes)");
  flags.Bool("ignore-eos", &f.ignore_eos, "keep generating past end-of-sequence tokens");
  flags.Int("chunk-size", &f.chunk_size, "prefill chunk size (tokens)");
  flags.Int("threads", &f.threads, "CPU threads; 0 = every usable core (the CPU limit where one is set)");
  flags.String("policy", &f.policy,
               "attention policy: dense|streaming|quest|radar|tokenselect|hip|subgen");
  flags.String("summary", &f.summary, "page summary: none|minmax|mean|rf (default: the policy's)");
  flags.Int("budget", &f.budget, "token budget of a sparse policy (sinks and window on top)");
  flags.Int("sinks", &f.sinks, "first tokens always attended");
  flags.Int("window", &f.window, "recent tokens always attended");
  flags.Int("page-size", &f.page_size, "KV page size (tokens)");
  flags.String("kv-dtype", &f.kv_dtype,
               "KV cache storage: f32 (exact) | bf16 | fp8 (e4m3, scale 1: half bf16's memory)");
  flags.Double("theta", &f.theta, "selection-cache cosine threshold (> 1 disables the cache)");
  flags.Int("candidate-factor", &f.candidate_factor,
            "tokenselect: candidate tokens per budget token (1-16; fewer: faster, less exact)");
  flags.Int("partitions", &f.partitions,
            "tokenselect: independent parts of the selection (a power of two 1-64; a budget they "
            "do not divide is rounded up; more: faster on a GPU, a little less exact; 0: by the "
            "budget, 16 at 2048, 1 below 256)");
  flags.String("dense-layers", &f.dense_layers, "comma-separated layers that always attend densely");
  flags.String("backend", &f.backend, "compute backend: cpu|cuda|auto");
  flags.Bool("device-selection", &f.device_selection,
             "quest|tokenselect: select on the backend (always so on CUDA)");
  flags.String("matmul-precision", &f.matmul_precision,
               "split|bf16: split keeps f32 activations (two GEMMs per projection on the GPU); bf16 "
               "rounds them to the weight type for one GEMM (faster prefill, logits move slightly)");
  flags.String("weight-format", &f.weight_format,
               "checkpoint|fp8: projection matrices as loaded, or fp8 e4m3 rows with per-row scales quantised "
               "at load (half the weight bytes per decode step; logits move by the rounding)");
  const absl::Status parse = flags.Parse(argc, argv);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  if ((flags.WasSet("prompt") && f.prompt.empty()) || (flags.WasSet("token-ids") && f.token_ids.empty())) {
    std::fprintf(stderr, "strata generate: the prompt is empty\n");
    return 2;
  }
  const absl::Status s = Run(f, CollectStops(argc, argv));
  if (!s.ok()) {
    std::fprintf(stderr, "strata generate: %s\n", s.ToString().c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace strata::cli
