#include "cli/flags.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace strata::cli {

FlagSet::FlagSet(std::string command, std::string synopsis)
    : command_(std::move(command)), synopsis_(std::move(synopsis)) {}

void FlagSet::String(const std::string& name, std::string* target, const std::string& help) {
  flags_.push_back({name, Kind::kString, target, help, target->empty() ? "" : "\"" + *target + "\""});
}
void FlagSet::Int(const std::string& name, int64_t* target, const std::string& help) {
  flags_.push_back({name, Kind::kInt, target, help, std::to_string(*target)});
}
void FlagSet::Double(const std::string& name, double* target, const std::string& help) {
  flags_.push_back({name, Kind::kDouble, target, help, absl::StrCat(*target)});
}
void FlagSet::Bool(const std::string& name, bool* target, const std::string& help) {
  flags_.push_back({name, Kind::kBool, target, help, *target ? "true" : "false"});
}

FlagSet::Flag* FlagSet::Find(const std::string& name) {
  for (Flag& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

bool FlagSet::WasSet(const std::string& name) const {
  for (const Flag& f : flags_) {
    if (f.name == name) return f.set;
  }
  return false;
}

absl::Status FlagSet::Assign(Flag& f, const std::string& value) {
  switch (f.kind) {
    case Kind::kString:
      *static_cast<std::string*>(f.target) = value;
      break;
    case Kind::kInt: {
      int64_t v;
      if (!absl::SimpleAtoi(value, &v)) {
        return absl::InvalidArgumentError(absl::StrCat("--", f.name, ": not an integer: '", value, "'"));
      }
      *static_cast<int64_t*>(f.target) = v;
      break;
    }
    case Kind::kDouble: {
      double v;
      if (!absl::SimpleAtod(value, &v)) {
        return absl::InvalidArgumentError(absl::StrCat("--", f.name, ": not a number: '", value, "'"));
      }
      *static_cast<double*>(f.target) = v;
      break;
    }
    case Kind::kBool: {
      bool v;
      if (!absl::SimpleAtob(value, &v)) {
        return absl::InvalidArgumentError(absl::StrCat("--", f.name, ": not a boolean: '", value, "'"));
      }
      *static_cast<bool*>(f.target) = v;
      break;
    }
  }
  f.set = true;
  return absl::OkStatus();
}

absl::Status FlagSet::Parse(int argc, char** argv, std::vector<std::string>* positional) {
  bool flags_done = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (flags_done || arg.size() < 2 || arg.compare(0, 2, "--") != 0) {
      if (positional == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
      }
      positional->push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return absl::OkStatus();
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Flag* f = Find(name);
    if (f == nullptr && !has_value && name.compare(0, 3, "no-") == 0) {
      Flag* neg = Find(name.substr(3));
      if (neg != nullptr && neg->kind == Kind::kBool) {
        *static_cast<bool*>(neg->target) = false;
        neg->set = true;
        continue;
      }
    }
    if (f == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (!has_value) {
      if (f->kind == Kind::kBool) {
        value = "true";
      } else {
        if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        value = argv[++i];
      }
    }
    if (absl::Status s = Assign(*f, value); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("usage: strata ", command_, " ", synopsis_, "\n");
  if (!flags_.empty()) out += "\nflags:\n";
  for (const Flag& f : flags_) {
    std::string left = absl::StrCat("  --", f.name);
    if (f.kind != Kind::kBool) left += f.kind == Kind::kString ? " STR" : " N";
    if (left.size() < 26) left.resize(26, ' ');
    absl::StrAppend(&out, left, " ", f.help);
    if (!f.default_text.empty()) absl::StrAppend(&out, " (default ", f.default_text, ")");
    out += "\n";
  }
  return out;
}

int ReportAndExit(const FlagSet& flags, const absl::Status& parse_status) {
  if (!parse_status.ok()) {
    std::fprintf(stderr, "strata: %s\n%s", std::string(parse_status.message()).c_str(),
                 flags.Usage().c_str());
    return 2;
  }
  std::fputs(flags.Usage().c_str(), stdout);
  return 0;
}

}  // namespace strata::cli
