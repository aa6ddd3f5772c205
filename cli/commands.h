// The subcommands of the `strata` binary. Each takes the arguments after its name and returns
// the process exit code (0 success, 1 runtime error, 2 usage error). Defined in
// cli/<name>_command.cc.
#ifndef STRATA_CLI_COMMANDS_H_
#define STRATA_CLI_COMMANDS_H_

namespace strata::cli {

int RunGenerate(int argc, char** argv);   // generate_command.cc
int RunMakeModel(int argc, char** argv);  // make_model_command.cc
int RunKvstore(int argc, char** argv);    // kvstore_command.cc
int RunCoordinator(int argc, char** argv);  // coordinator_command.cc
int RunBench(int argc, char** argv);       // bench_command.cc
int RunWorker(int argc, char** argv);      // worker_command.cc
int RunServe(int argc, char** argv);       // serve_command.cc
int RunDoc(int argc, char** argv);         // client_commands.cc
int RunJob(int argc, char** argv);         // client_commands.cc
int RunAsk(int argc, char** argv);         // client_commands.cc

}  // namespace strata::cli

#endif  // STRATA_CLI_COMMANDS_H_
