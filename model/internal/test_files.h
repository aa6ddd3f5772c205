// Test-only helpers for model/ tests: temporary directories and whole-file reads/writes.
// Header-only; thread-compatible.
#ifndef STRATA_MODEL_INTERNAL_TEST_FILES_H_
#define STRATA_MODEL_INTERNAL_TEST_FILES_H_

#include <fstream>
#include <sstream>
#include <string>

#include "base/testing/temp_dir.h"

namespace strata::model::testing {

// A fresh directory, removed with its contents on destruction (base/testing/temp_dir.h).
class TempDir : public ::strata::testing::TempDir {
 public:
  TempDir() : ::strata::testing::TempDir("strata_model") {}
};

inline bool WriteFileBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return static_cast<bool>(out);
}

inline std::string ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace strata::model::testing

#endif  // STRATA_MODEL_INTERNAL_TEST_FILES_H_
