// The `strata` command: dispatches to subcommands (cli/commands.h).
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

const Command kCommands[] = {
    {"generate", strata::cli::RunGenerate, "run a model locally on a prompt and stream the text"},
    {"make-model", strata::cli::RunMakeModel, "write a random Llama-family model in Hugging Face format"},
    {"kvstore", strata::cli::RunKvstore, "run the KV store service (pages, summaries, documents)"},
    {"coordinator", strata::cli::RunCoordinator, "run the coordinator (public API, catalog, worker registry)"},
    {"bench", strata::cli::RunBench, "run a benchmark (fidelity: sparse attention vs dense)"},
    {"worker", strata::cli::RunWorker, "run a worker (model, prefill, jobs) for a coordinator"},
    {"serve", strata::cli::RunServe, "run coordinator + worker + KV store in one process"},
    {"doc", strata::cli::RunDoc, "documents on a server: upload, get, ls, rm"},
    {"job", strata::cli::RunJob, "jobs on a server: submit, watch, cancel, ls"},
    {"ask", strata::cli::RunAsk, "upload a document (if new) and stream the answer to a question"},
};

void PrintUsage(FILE* out) {
  std::fprintf(out, "usage: strata <command> [flags]   (strata <command> --help for its flags)\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    PrintUsage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) == 0) return c.run(argc - 2, argv + 2);
  }
  std::fprintf(stderr, "strata: unknown command '%s'\n", argv[1]);
  PrintUsage(stderr);
  return 2;
}
