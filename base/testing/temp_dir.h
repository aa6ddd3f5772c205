// A temporary directory for tests (test-only target strata::base_testing): a fresh directory
// under $TMPDIR (or /tmp), removed with its contents on destruction. Header-only;
// thread-compatible. path() is empty when the directory could not be made.
#ifndef STRATA_BASE_TESTING_TEMP_DIR_H_
#define STRATA_BASE_TESTING_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>

namespace strata::testing {

class TempDir {
 public:
  // The directory's name starts with `prefix`.
  explicit TempDir(const std::string& prefix = "strata") {
    const char* base = getenv("TMPDIR");
    std::string tmpl = std::string(base != nullptr && *base ? base : "/tmp") + "/" + prefix + "_XXXXXX";
    char* made = mkdtemp(tmpl.data());
    path_ = made != nullptr ? made : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace strata::testing

#endif  // STRATA_BASE_TESTING_TEMP_DIR_H_
