#include "model/weights.h"

#include <sys/stat.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace strata::model {
namespace {

using Json = nlohmann::json;

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Tensors a checkpoint may carry that Strata recomputes or never uses.
bool IsIgnorable(const std::string& name) { return absl::EndsWith(name, "rotary_emb.inv_freq"); }

// Where each tensor lives.
struct Location {
  const SafetensorsFile* file;
  bool used = false;
};

class Collector {
 public:
  Collector(std::string dir, std::map<std::string, Location> tensors)
      : dir_(std::move(dir)), tensors_(std::move(tensors)) {}

  // The view of `name`, checked against `shape`. InvalidArgument when missing or mismatched.
  absl::StatusOr<kernels::TensorView> Take(const std::string& name,
                                           std::initializer_list<int64_t> shape) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name, " in ", dir_));
    }
    it->second.used = true;
    const SafetensorsFile& f = *it->second.file;
    absl::StatusOr<kernels::TensorView> v = f.Get(name);
    if (!v.ok()) return v.status();
    bool match = v->rank == static_cast<int>(shape.size());
    int i = 0;
    for (int64_t d : shape) {
      if (match && v->shape[i] != d) match = false;
      ++i;
    }
    if (!match) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tensor ", name, " has shape ",
                                                     v->DebugString(), ", expected [",
                                                     absl::StrJoin(shape, ","), "]"));
    }
    return v;
  }

  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }
  void MarkUsed(const std::string& name) {
    auto it = tensors_.find(name);
    if (it != tensors_.end()) it->second.used = true;
  }

  absl::Status CheckNoneLeft() const {
    for (const auto& [name, loc] : tensors_) {
      if (!loc.used && !IsIgnorable(name)) {
        return absl::InvalidArgumentError(absl::StrCat(loc.file->path(), ": unexpected tensor ",
                                                       name, " (not used by this architecture)"));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::string dir_;
  std::map<std::string, Location> tensors_;
};

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Opens every file of the checkpoint and maps tensor names to files.
absl::Status OpenFiles(const std::string& dir, ModelWeights* w,
                       std::map<std::string, Location>* tensors) {
  const std::string single = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (FileExists(index_path)) {
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(index_path));
    Json index = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object"));
    }
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": no \"weight_map\" object"));
    }
    std::map<std::string, const SafetensorsFile*> opened;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map entry ", it.key(), " is not a file name"));
      }
      const std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": shard name '", shard, "' is not a plain file name"));
      }
      if (opened.count(shard) == 0) {
        absl::StatusOr<std::unique_ptr<SafetensorsFile>> f =
            SafetensorsFile::Open(dir + "/" + shard);
        if (!f.ok()) {
          return Annotate(f.status(), absl::StrCat("shard ", shard, " listed in ", index_path));
        }
        opened[shard] = f->get();
        w->files.push_back(std::shared_ptr<const SafetensorsFile>(std::move(*f)));
      }
      const SafetensorsFile* file = opened[shard];
      if (file->Find(it.key()) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, " maps ", it.key(), " to ",
                                                       shard, ", which does not contain it"));
      }
      (*tensors)[it.key()] = Location{file};
    }
    // Every tensor of every shard must be in the index (a stray one is as suspect as an extra one).
    for (const auto& f : w->files) {
      for (const std::string& name : f->TensorNames()) {
        auto t = tensors->find(name);
        if (t == tensors->end()) {
          if (IsIgnorable(name)) continue;
          return absl::InvalidArgumentError(
              absl::StrCat(f->path(), ": tensor ", name, " is not listed in ", index_path));
        }
      }
    }
    if (w->files.empty()) return absl::InvalidArgumentError(absl::StrCat(index_path, ": empty"));
    return absl::OkStatus();
  }
  if (!FileExists(single)) {
    return absl::NotFoundError(
        absl::StrCat("no model.safetensors or model.safetensors.index.json in ", dir));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(single));
  const SafetensorsFile* file = f.get();
  w->files.push_back(std::shared_ptr<const SafetensorsFile>(std::move(f)));
  for (const std::string& name : file->TensorNames()) (*tensors)[name] = Location{file};
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelWeights> LoadModelWeights(const std::string& model_dir,
                                              const ModelConfig& config) {
  STRATA_RETURN_IF_ERROR(config.Validate());
  ModelWeights w;
  std::map<std::string, Location> tensors;
  STRATA_RETURN_IF_ERROR(OpenFiles(model_dir, &w, &tensors));
  Collector c(model_dir, std::move(tensors));

  const int64_t hidden = config.hidden_size;
  const int64_t vocab = config.vocab_size;
  const int64_t q_out = config.num_heads * config.head_dim;
  const int64_t kv_out = config.num_kv_heads * config.head_dim;
  const int64_t ffn = config.intermediate_size;

  STRATA_ASSIGN_OR_RETURN(w.embed_tokens, c.Take("model.embed_tokens.weight", {vocab, hidden}));
  w.layers.resize(static_cast<size_t>(config.num_layers));
  for (int64_t i = 0; i < config.num_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    STRATA_ASSIGN_OR_RETURN(l.input_norm, c.Take(p + "input_layernorm.weight", {hidden}));
    STRATA_ASSIGN_OR_RETURN(l.q_proj, c.Take(p + "self_attn.q_proj.weight", {q_out, hidden}));
    STRATA_ASSIGN_OR_RETURN(l.k_proj, c.Take(p + "self_attn.k_proj.weight", {kv_out, hidden}));
    STRATA_ASSIGN_OR_RETURN(l.v_proj, c.Take(p + "self_attn.v_proj.weight", {kv_out, hidden}));
    if (config.attention_bias) {
      STRATA_ASSIGN_OR_RETURN(l.q_bias, c.Take(p + "self_attn.q_proj.bias", {q_out}));
      STRATA_ASSIGN_OR_RETURN(l.k_bias, c.Take(p + "self_attn.k_proj.bias", {kv_out}));
      STRATA_ASSIGN_OR_RETURN(l.v_bias, c.Take(p + "self_attn.v_proj.bias", {kv_out}));
    }
    STRATA_ASSIGN_OR_RETURN(l.o_proj, c.Take(p + "self_attn.o_proj.weight", {hidden, q_out}));
    STRATA_ASSIGN_OR_RETURN(l.post_attention_norm,
                            c.Take(p + "post_attention_layernorm.weight", {hidden}));
    STRATA_ASSIGN_OR_RETURN(l.gate_proj, c.Take(p + "mlp.gate_proj.weight", {ffn, hidden}));
    STRATA_ASSIGN_OR_RETURN(l.up_proj, c.Take(p + "mlp.up_proj.weight", {ffn, hidden}));
    STRATA_ASSIGN_OR_RETURN(l.down_proj, c.Take(p + "mlp.down_proj.weight", {hidden, ffn}));
  }
  STRATA_ASSIGN_OR_RETURN(w.final_norm, c.Take("model.norm.weight", {hidden}));
  if (config.tie_word_embeddings) {
    // Tied checkpoints usually omit lm_head; when one is saved anyway it must still fit, and the
    // embedding is what the model uses (as transformers ties them).
    if (c.Has("lm_head.weight")) {
      STRATA_RETURN_IF_ERROR(c.Take("lm_head.weight", {vocab, hidden}).status());
    }
    w.lm_head = w.embed_tokens;
  } else {
    if (!c.Has("lm_head.weight")) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor lm_head.weight in ", model_dir,
                                                     " (tie_word_embeddings is false)"));
    }
    STRATA_ASSIGN_OR_RETURN(w.lm_head, c.Take("lm_head.weight", {vocab, hidden}));
  }
  STRATA_RETURN_IF_ERROR(c.CheckNoneLeft());
  return w;
}

}  // namespace strata::model
