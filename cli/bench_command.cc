// `strata bench <name>`: runs a benchmark and prints its results.
//   strata bench fidelity [--contexts 4096,32768,...] [--budgets ...] [--page-sizes 16,32,64]
//                         [--policies quest,radar,...] [--json-out FILE] [--seed N]
//                         [--profile calibrated|calibrated-logtemp|diffuse] [--background-logit X]
//                         [--selection-keys bf16|fp8] (see --help for the rest)
// The fidelity table goes to stdout, progress to stderr, one JSON object per row to --json-out.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/fidelity.h"
#include "cli/commands.h"
#include "cli/flags.h"

namespace strata::cli {
namespace {

template <typename T>
absl::Status ParseList(const std::string& flag, const std::string& text, std::vector<T>* out) {
  out->clear();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not an integer"));
    }
    out->push_back(static_cast<T>(v));
  }
  if (out->empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is empty"));
  return absl::OkStatus();
}

int RunFidelityCommand(int argc, char** argv) {
  bench::FidelityOptions o;
  std::string contexts = absl::StrJoin(o.contexts, ","), budgets = absl::StrJoin(o.budgets, ",");
  std::string pages = absl::StrJoin(o.page_sizes, ","), policies = absl::StrJoin(o.policies, ",");
  std::string json_out;
  int64_t seed = static_cast<int64_t>(o.seed), kv_heads = o.kv_heads, sinks = o.sink_tokens;
  int64_t window = o.window_tokens, topk = o.topk, subgen_max = o.subgen_max_context;
  int64_t rf_features = o.rf_features;
  int64_t segment_pages = -1, two_level_min_pages = -1, min_segments = -1, segment_factor = -1;
  int64_t candidate_factor = -1, partitions = -1;
  std::string selection_keys = "bf16";
  std::string profile = o.workload.profile;
  double background_logit = 1.0;  // > 0: the profile's value
  FlagSet flags("bench fidelity", "[flags]   attention fidelity of sparse policies vs dense");
  flags.String("contexts", &contexts, "context lengths (tokens), comma-separated");
  flags.String("budgets", &budgets, "token budgets B, comma-separated");
  flags.String("page-sizes", &pages, "page sizes P, comma-separated");
  flags.String("policies", &policies, "policies, name or name:summary, comma-separated");
  flags.String("json-out", &json_out, "write one JSON object per row to this file");
  flags.Int("seed", &seed, "workload seed");
  flags.Int("kv-heads", &kv_heads, "KV heads evaluated per context (1-8), 4 query heads each");
  flags.Int("sinks", &sinks, "sink tokens S");
  flags.Int("window", &window, "window tokens W");
  flags.Int("topk", &topk, "k of topk_recall");
  flags.Int("subgen-max-context", &subgen_max, "skip subgen above this context");
  flags.Int("rf-features", &rf_features, "random features n of rf summaries");
  flags.Int("segment-pages", &segment_pages, "pages per segment G (0 = 512 / P; -1 = default)");
  flags.Int("two-level-min-pages", &two_level_min_pages,
            "two-level ranking above this many pages (-1 = default)");
  flags.Int("min-segments", &min_segments, "segments kept at the first level, at least (-1 = default)");
  flags.Int("segment-factor", &segment_factor, "segments kept = factor * B / (P * G) (-1 = default)");
  flags.Int("candidate-factor", &candidate_factor,
            "tokenselect with a summary: candidate tokens = factor * B (-1 = default)");
  flags.Int("partitions", &partitions,
            "tokenselect with a summary: independent parts of the selection, a power of two "
            "1-64 (0 = by the budget, the default: 16 at 2048; -1 = default)");
  flags.String("selection-keys", &selection_keys,
               "the keys the policies score: bf16 (the cache's) or fp8 (each page's keys as an "
               "fp8 e4m3 page holds them; attention and the truth keep bf16)");
  flags.String("profile", &profile,
               "synthetic workload: calibrated (default), calibrated-logtemp or diffuse "
               "(see bench/fidelity.h)");
  flags.Double("background-logit", &background_logit,
               "override the profile's background logit (<= 0; default: the profile's)");
  absl::Status st = flags.Parse(argc, argv);
  if (st.ok()) st = ParseList("contexts", contexts, &o.contexts);
  if (st.ok()) st = ParseList("budgets", budgets, &o.budgets);
  if (st.ok()) st = ParseList("page-sizes", pages, &o.page_sizes);
  if (st.ok()) {
    absl::StatusOr<bool> fp8 = bench::ParseSelectionKeys(selection_keys);
    if (fp8.ok()) {
      o.fp8_selection_keys = *fp8;
    } else {
      st = fp8.status();
    }
  }
  if (st.ok()) {
    absl::StatusOr<bench::WorkloadParams> w = bench::WorkloadProfile(profile);
    if (w.ok()) {
      o.workload = *w;
      if (background_logit <= 0.0) o.workload.background_logit = background_logit;
    } else {
      st = w.status();
    }
  }
  if (!st.ok() || flags.help_requested()) return ReportAndExit(flags, st);
  o.policies = absl::StrSplit(policies, ',', absl::SkipEmpty());
  o.seed = static_cast<uint64_t>(seed);
  o.kv_heads = static_cast<int>(kv_heads);
  o.sink_tokens = static_cast<int>(sinks);
  o.window_tokens = static_cast<int>(window);
  o.topk = static_cast<int>(topk);
  o.subgen_max_context = subgen_max;
  o.rf_features = static_cast<int>(rf_features);
  o.segment_pages = static_cast<int>(segment_pages);
  o.two_level_min_pages = static_cast<int>(two_level_min_pages);
  o.min_segments = static_cast<int>(min_segments);
  o.segment_factor = static_cast<int>(segment_factor);
  o.tokenselect_candidate_factor = static_cast<int>(candidate_factor);
  o.tokenselect_partitions = static_cast<int>(partitions);
  st = o.Validate();
  if (!st.ok()) return ReportAndExit(flags, st);
  std::fprintf(stderr,
               "strata bench fidelity: contexts=%s budgets=%s page_sizes=%s policies=%s kv_heads=%d "
               "sinks=%d window=%d topk=%d rf_features=%d seed=%llu profile=%s "
               "background_logit=%.3f selection_keys=%s\n",
               contexts.c_str(), budgets.c_str(), pages.c_str(), policies.c_str(), o.kv_heads,
               o.sink_tokens, o.window_tokens, o.topk, o.rf_features,
               static_cast<unsigned long long>(o.seed), o.workload.profile.c_str(),
               o.workload.background_logit, selection_keys.c_str());
  absl::StatusOr<std::vector<bench::FidelityRow>> rows = bench::RunFidelity(o, &std::cerr);
  if (!rows.ok()) {
    std::fprintf(stderr, "strata bench fidelity: %s\n", rows.status().ToString().c_str());
    return 1;
  }
  std::fputs(bench::FormatFidelityTable(*rows).c_str(), stdout);
  if (!json_out.empty()) {
    std::ofstream f(json_out);
    for (const bench::FidelityRow& r : *rows) f << bench::FidelityRowJson(r) << "\n";
    if (!f) {
      std::fprintf(stderr, "strata bench fidelity: cannot write %s\n", json_out.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

int RunBench(int argc, char** argv) {
  if (argc >= 1 && std::string(argv[0]) == "fidelity") return RunFidelityCommand(argc - 1, argv + 1);
  std::fprintf(argc >= 1 && std::string(argv[0]) != "--help" ? stderr : stdout,
               "usage: strata bench fidelity [flags]   (strata bench fidelity --help)\n");
  return argc >= 1 && std::string(argv[0]) == "--help" ? 0 : 2;
}

}  // namespace strata::cli
