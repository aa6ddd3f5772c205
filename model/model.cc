#include "model/model.h"

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/fingerprint.h"

namespace strata::model {

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& dir) {
  auto m = std::make_unique<Model>();
  STRATA_ASSIGN_OR_RETURN(m->config, LoadModelConfig(dir));
  STRATA_ASSIGN_OR_RETURN(m->weights, LoadModelWeights(dir, m->config));
  const std::string tok_path = dir + "/tokenizer.json";
  struct stat st;
  if (::stat(tok_path.c_str(), &st) == 0) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = LoadTokenizer(dir);
    if (!tok.ok()) return Annotate(tok.status(), tok_path);
    if ((*tok)->vocab_size() > m->config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(tok_path, ": tokenizer has ",
                                                     (*tok)->vocab_size(), " ids, the model only ",
                                                     m->config.vocab_size));
    }
    m->tokenizer = std::move(*tok);
  }
  m->fingerprint = ModelFingerprint(m->config, m->weights);
  return m;
}

}  // namespace strata::model
