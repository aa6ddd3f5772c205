// A small per-command flag parser for the `strata` CLI.
//
// Each subcommand declares its flags on a FlagSet bound to local variables (which hold the
// defaults), then calls Parse(). Accepts "--name value", "--name=value", and "--flag" /
// "--no-flag" for booleans; "--" ends flags. Unknown flags, missing values and malformed numbers
// are InvalidArgument with a message naming the flag. "--help" makes Parse return
// help_requested() == true. Thread-compatible.
#ifndef STRATA_CLI_FLAGS_H_
#define STRATA_CLI_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace strata::cli {

class FlagSet {
 public:
  FlagSet(std::string command, std::string synopsis);

  void String(const std::string& name, std::string* target, const std::string& help);
  void Int(const std::string& name, int64_t* target, const std::string& help);
  void Double(const std::string& name, double* target, const std::string& help);
  void Bool(const std::string& name, bool* target, const std::string& help);

  // Parses argv[0..argc) (argv[0] is the first argument after the subcommand name).
  // Positional arguments are appended to `positional` (an error if it is null).
  absl::Status Parse(int argc, char** argv, std::vector<std::string>* positional = nullptr);

  bool help_requested() const { return help_requested_; }
  // True when the flag appeared on the command line.
  bool WasSet(const std::string& name) const;
  // The usage text: synopsis, then one line per flag with its default.
  std::string Usage() const;

 private:
  enum class Kind { kString, kInt, kDouble, kBool };
  struct Flag {
    std::string name;
    Kind kind;
    void* target;
    std::string help;
    std::string default_text;
    bool set = false;
  };
  Flag* Find(const std::string& name);
  absl::Status Assign(Flag& f, const std::string& value);

  std::string command_;
  std::string synopsis_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
};

// Runs a subcommand body with the usual conventions: prints usage on --help (exit 0), prints
// "strata <command>: <status>" to stderr and returns 1 on error (2 for bad flags).
int ReportAndExit(const FlagSet& flags, const absl::Status& parse_status);

}  // namespace strata::cli

#endif  // STRATA_CLI_FLAGS_H_
