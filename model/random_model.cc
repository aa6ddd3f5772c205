#include "model/random_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "xxhash.h"

namespace strata::model {
namespace {

constexpr int64_t kChunkElems = int64_t{1} << 16;  // one RNG stream per chunk
constexpr int64_t kBlockElems = int64_t{1} << 22;  // generated and written at a time

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills out[0..n) with normal(mean, stddev) for elements [first, first + n) of the stream
// `tensor_seed`. Chunk-aligned callers get values independent of how the work is split.
void FillNormalChunk(uint64_t tensor_seed, int64_t chunk_index, float mean, float stddev,
                     float* out, int64_t n) {
  uint64_t state = tensor_seed ^ (0xd1b54a32d192ed03ull * static_cast<uint64_t>(chunk_index + 1));
  SplitMix64(state);
  constexpr double kTwoPi = 6.283185307179586;
  for (int64_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(SplitMix64(state) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53;          // [0, 1)
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(mean + stddev * r * std::cos(kTwoPi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(mean + stddev * r * std::sin(kTwoPi * u2));
  }
}

bool IsNormWeight(const std::string& name) {
  return name.find("layernorm") != std::string::npos || name == "model.norm.weight";
}

int WorkerCount() {
  unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw == 0 ? 1u : hw, 1u, 16u));
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Streams one tensor's random values into `w`.
absl::Status WriteRandomTensor(SafetensorsWriter& w, const SafetensorsEntry& e, uint64_t seed) {
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  const uint64_t tensor_seed = XXH3_64bits_withSeed(e.name.data(), e.name.size(), seed);
  const float mean = IsNormWeight(e.name) ? 1.0f : 0.0f;
  const float stddev = 0.02f;
  const size_t esize = kernels::DTypeSize(e.dtype);
  const int64_t block = std::min<int64_t>(n, kBlockElems);
  std::vector<float> values(static_cast<size_t>(std::max<int64_t>(block, 1)));
  std::vector<uint8_t> bytes(static_cast<size_t>(std::max<int64_t>(block, 1)) * esize);
  const int workers = WorkerCount();
  for (int64_t start = 0; start < n; start += kBlockElems) {
    const int64_t count = std::min<int64_t>(kBlockElems, n - start);
    const int64_t chunks = (count + kChunkElems - 1) / kChunkElems;
    auto work = [&](int t) {
      for (int64_t c = t; c < chunks; c += workers) {
        const int64_t off = c * kChunkElems;
        const int64_t len = std::min<int64_t>(kChunkElems, count - off);
        FillNormalChunk(tensor_seed, (start + off) / kChunkElems, mean, stddev, values.data() + off,
                        len);
        kernels::ConvertFromF32(values.data() + off, bytes.data() + off * esize, e.dtype, len);
      }
    };
    if (chunks == 1 || workers == 1) {
      work(0);
      for (int t = 1; t < workers && chunks > 1; ++t) work(t);
    } else {
      std::vector<std::thread> threads;
      for (int t = 0; t < workers; ++t) threads.emplace_back(work, t);
      for (std::thread& th : threads) th.join();
    }
    STRATA_RETURN_IF_ERROR(w.Write(bytes.data(), static_cast<size_t>(count) * esize));
  }
  return absl::OkStatus();
}

// Fills a trained byte-level BPE tokenizer.json up to `vocab_size` ids. A few KB of corpus yield
// only ~1000 merges, but the model's vocabulary (and every id it can emit) should decode to text:
// the extra ids become regular vocabulary entries that join two (then three) learned word tokens,
// e.g. "Ġthe" + "Ġriver". They have no merges, so Encode never produces them (as in Hugging Face
// BPE); Decode turns them into English fragments.
absl::StatusOr<std::string> PadTokenizerJson(const std::string& json_text, int64_t vocab_size) {
  using OJson = nlohmann::json;  // std::map objects: ordered_json inserts are linear
  OJson j = OJson::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InternalError("trained tokenizer: bad JSON");
  auto model = j.find("model");
  if (model == j.end() || !model->is_object()) return absl::InternalError("tokenizer: no model");
  auto vocab = model->find("vocab");
  if (vocab == model->end() || !vocab->is_object())
    return absl::InternalError("tokenizer: no vocab");
  int64_t next_id = 0;
  std::vector<std::pair<int64_t, std::string>> words;  // learned word-initial tokens, by id
  absl::flat_hash_set<std::string> existing;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer()) return absl::InternalError("tokenizer: bad vocab id");
    const int64_t id = it.value().get<int64_t>();
    next_id = std::max(next_id, id + 1);
    existing.insert(it.key());
    // "Ġ" (U+0120, the byte-level space) followed by at least two more characters.
    if (id >= 256 && it.key().rfind("\xc4\xa0", 0) == 0 && it.key().size() >= 4) {
      words.emplace_back(id, it.key());
    }
  }
  auto added = j.find("added_tokens");
  if (added != j.end() && added->is_array()) {
    for (const auto& t : *added) {
      auto id = t.find("id");
      if (id != t.end() && id->is_number_integer())
        next_id = std::max(next_id, id->get<int64_t>() + 1);
    }
  }
  if (next_id >= vocab_size) return json_text;
  std::sort(words.begin(), words.end());
  if (words.size() < 8) return absl::InternalError("tokenizer: too few learned words to pad from");
  const size_t w = words.size();
  // Mixed-radix counter over pairs, then triples; skips strings already in the vocabulary.
  for (int len = 2; len <= 3 && next_id < vocab_size; ++len) {
    const uint64_t combos = len == 2 ? w * w : w * w * w;
    for (uint64_t k = 0; k < combos && next_id < vocab_size; ++k) {
      std::string tok;
      uint64_t r = k;
      for (int p = 0; p < len; ++p) {
        tok += words[r % w].second;
        r /= w;
      }
      if (!existing.insert(tok).second) continue;
      (*vocab)[tok] = next_id++;
    }
  }
  if (next_id < vocab_size) {
    return absl::InternalError(absl::StrCat("tokenizer: could only pad to ", next_id, " ids"));
  }
  return j.dump();
}

struct Preset {
  const char* name;
  int64_t hidden, layers, heads, kv_heads, head_dim, ffn, vocab;
  bool tied;
  double llama3_factor;  // rope scaling of the llama arch
};

constexpr Preset kPresets[] = {
    {"tiny", 64, 2, 4, 2, 16, 128, 512, false, 8.0},
    {"small", 768, 12, 12, 4, 64, 2048, 8192, false, 8.0},
    {"llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, true, 32.0},
    {"llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, false, 8.0},
};

const Preset* FindPreset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

}  // namespace

absl::Status RandomModelOptions::Validate() const {
  if (FindPreset(preset) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown preset '", preset, "' (tiny, small, llama-3.2-1b, llama-3.1-8b)"));
  }
  if (dtype != kernels::DType::kF32 && dtype != kernels::DType::kBF16 &&
      dtype != kernels::DType::kF16) {
    return absl::InvalidArgumentError("dtype must be f32, bf16 or f16");
  }
  if (vocab_size != 0 && (vocab_size < 258 || vocab_size > (int64_t{1} << 24))) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab size ", vocab_size, " must be between 258 and 16777216"));
  }
  if (max_shard_bytes <= 0) return absl::InvalidArgumentError("max_shard_bytes must be positive");
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> RandomModelConfig(const RandomModelOptions& options) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  const Preset& p = *FindPreset(options.preset);
  ModelConfig c;
  c.arch = options.arch;
  c.vocab_size = options.vocab_size != 0 ? options.vocab_size : p.vocab;
  c.hidden_size = p.hidden;
  c.intermediate_size = p.ffn;
  c.num_layers = p.layers;
  c.num_heads = p.heads;
  c.num_kv_heads = p.kv_heads;
  c.head_dim = p.head_dim;
  c.tie_word_embeddings = p.tied;
  c.torch_dtype = options.dtype;
  c.bos_token_ids = {static_cast<int32_t>(c.vocab_size - 2)};
  c.eos_token_ids = {static_cast<int32_t>(c.vocab_size - 1)};
  switch (options.arch) {
    case Architecture::kLlama:
      c.rms_norm_eps = 1e-5;
      c.rope_theta = 500000.0;
      c.max_position_embeddings = 131072;
      c.rope_scaling.type = RopeScaling::Type::kLlama3;
      c.rope_scaling.factor = p.llama3_factor;
      c.rope_scaling.low_freq_factor = 1.0;
      c.rope_scaling.high_freq_factor = 4.0;
      c.rope_scaling.original_max_position_embeddings = 8192;
      break;
    case Architecture::kQwen2:
      c.rms_norm_eps = 1e-6;
      c.rope_theta = 1000000.0;
      c.max_position_embeddings = 32768;
      c.attention_bias = true;
      break;
    case Architecture::kMistral:
      c.rms_norm_eps = 1e-5;
      c.rope_theta = 1000000.0;
      c.max_position_embeddings = 32768;
      break;
  }
  STRATA_RETURN_IF_ERROR(c.Validate());
  return c;
}

std::vector<SafetensorsEntry> CheckpointTensors(const ModelConfig& c, kernels::DType dtype) {
  const int64_t q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  std::vector<SafetensorsEntry> t;
  t.push_back({"model.embed_tokens.weight", dtype, {c.vocab_size, c.hidden_size}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    t.push_back({p + "input_layernorm.weight", dtype, {c.hidden_size}});
    t.push_back({p + "self_attn.q_proj.weight", dtype, {q_out, c.hidden_size}});
    t.push_back({p + "self_attn.k_proj.weight", dtype, {kv_out, c.hidden_size}});
    t.push_back({p + "self_attn.v_proj.weight", dtype, {kv_out, c.hidden_size}});
    if (c.attention_bias) {
      t.push_back({p + "self_attn.q_proj.bias", dtype, {q_out}});
      t.push_back({p + "self_attn.k_proj.bias", dtype, {kv_out}});
      t.push_back({p + "self_attn.v_proj.bias", dtype, {kv_out}});
    }
    t.push_back({p + "self_attn.o_proj.weight", dtype, {c.hidden_size, q_out}});
    t.push_back({p + "post_attention_layernorm.weight", dtype, {c.hidden_size}});
    t.push_back({p + "mlp.gate_proj.weight", dtype, {c.intermediate_size, c.hidden_size}});
    t.push_back({p + "mlp.up_proj.weight", dtype, {c.intermediate_size, c.hidden_size}});
    t.push_back({p + "mlp.down_proj.weight", dtype, {c.hidden_size, c.intermediate_size}});
  }
  t.push_back({"model.norm.weight", dtype, {c.hidden_size}});
  if (!c.tie_word_embeddings) {
    t.push_back({"lm_head.weight", dtype, {c.vocab_size, c.hidden_size}});
  }
  return t;
}

absl::Status WriteRandomSafetensors(const std::string& path,
                                    const std::vector<SafetensorsEntry>& entries, uint64_t seed,
                                    bool progress) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w,
                          SafetensorsWriter::Create(path, entries, {{"format", "pt"}}));
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t done = 0, total = 0;
  for (const SafetensorsEntry& e : entries) total += e.Bytes();
  for (size_t i = 0; i < entries.size(); ++i) {
    STRATA_RETURN_IF_ERROR(WriteRandomTensor(*w, entries[i], seed));
    done += entries[i].Bytes();
    if (progress) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "  %s: [%zu/%zu] %s  %.2f/%.2f GB  %.1f s\n", path.c_str(), i + 1,
                   entries.size(), entries[i].name.c_str(), done / 1e9, total / 1e9, s);
    }
  }
  return w->Close();
}

absl::Status WriteRandomCheckpoint(const std::string& dir, const ModelConfig& config,
                                   const RandomModelOptions& options) {
  STRATA_RETURN_IF_ERROR(config.Validate());
  STRATA_RETURN_IF_ERROR(options.Validate());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  STRATA_RETURN_IF_ERROR(WriteTextFile(dir + "/config.json", ModelConfigToJson(config)));

  std::vector<SafetensorsEntry> all = CheckpointTensors(config, options.dtype);
  // Greedy sharding in canonical order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<SafetensorsEntry>> shards(1);
  uint64_t shard_bytes = 0, total = 0;
  const uint64_t limit = static_cast<uint64_t>(options.max_shard_bytes);
  for (SafetensorsEntry& e : all) {
    const uint64_t b = e.Bytes();
    total += b;
    if (!shards.back().empty() && shard_bytes + b > limit) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += b;
    shards.back().push_back(std::move(e));
  }
  // A stale layout from an earlier run in the same directory must not linger.
  std::filesystem::remove(dir + "/model.safetensors", ec);
  std::filesystem::remove(dir + "/model.safetensors.index.json", ec);
  if (shards.size() == 1) {
    return WriteRandomSafetensors(dir + "/model.safetensors", shards[0], options.seed,
                                  options.progress);
  }
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file =
        absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    if (options.progress) std::fprintf(stderr, "writing shard %s\n", file.c_str());
    STRATA_RETURN_IF_ERROR(
        WriteRandomSafetensors(dir + "/" + file, shards[s], options.seed, options.progress));
    for (const SafetensorsEntry& e : shards[s]) weight_map[e.name] = file;
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return WriteTextFile(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
}

absl::StatusOr<ModelConfig> WriteRandomModel(const std::string& dir,
                                             const RandomModelOptions& options) {
  STRATA_ASSIGN_OR_RETURN(ModelConfig config, RandomModelConfig(options));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  if (options.write_tokenizer) {
    if (options.progress) {
      std::fprintf(stderr, "training a %lld-token byte-level BPE tokenizer\n",
                   static_cast<long long>(config.vocab_size));
    }
    STRATA_ASSIGN_OR_RETURN(
        std::string tok_json,
        TrainByteLevelBpeJson(RandomModelCorpus(), static_cast<int32_t>(config.vocab_size),
                              {"<|begin_of_text|>", "<|end_of_text|>"}, /*add_bos=*/true));
    STRATA_ASSIGN_OR_RETURN(tok_json, PadTokenizerJson(tok_json, config.vocab_size));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, ParseTokenizerJson(tok_json));
    const int32_t bos = tok->TokenToId("<|begin_of_text|>");
    const int32_t eos = tok->TokenToId("<|end_of_text|>");
    if (bos < 0 || eos < 0 || tok->vocab_size() != config.vocab_size) {
      return absl::InternalError(absl::StrCat("trained tokenizer does not fit the model: vocab ",
                                              tok->vocab_size(), " (model ", config.vocab_size,
                                              "), bos ", bos, ", eos ", eos));
    }
    config.bos_token_ids = {bos};
    config.eos_token_ids = {eos};
    STRATA_RETURN_IF_ERROR(WriteTextFile(dir + "/tokenizer.json", tok_json));
  } else {
    std::filesystem::remove(dir + "/tokenizer.json", ec);
  }
  STRATA_RETURN_IF_ERROR(WriteRandomCheckpoint(dir, config, options));
  return config;
}

const std::string& RandomModelCorpus() {
  static const std::string* corpus = new std::string(
      "The river ran past the old mill, and the children followed it down to the sea. Every "
      "morning the baker opened his shop at six, and the smell of fresh bread drifted along the "
      "street. People stopped to talk about the weather, the price of apples, and the news from "
      "the city.\n"
      "In the spring the fields turned green again. Farmers planted wheat and barley, and the "
      "birds came back from the south. The teacher told her students that a seed needs water, "
      "light and time. One boy asked why the sky is blue, and she explained that sunlight is "
      "scattered by the air, and blue light is scattered the most.\n"
      "A computer stores numbers as bits. A byte holds eight bits, so it can hold two hundred and "
      "fifty-six different values. Programs read data from memory, compute something new, and "
      "write the result back. When the data is larger than the memory, the program must read it "
      "in pieces, one page at a time, and keep only what it needs.\n"
      "The library was quiet in the afternoon. A woman read a long book about the history of the "
      "ocean, from the first ships to the great ports of today. She wrote notes in a small "
      "notebook: the names of captains, the dates of storms, the distance from one harbor to the "
      "next. Later she would write her own story.\n"
      "Questions and answers: What is the capital of France? The capital of France is Paris. How "
      "many days are in a week? There are seven days in a week. What do bees make? Bees make "
      "honey. Where does the sun rise? The sun rises in the east and sets in the west.\n"
      "The train left the station at nine o'clock. It crossed a bridge over a wide valley, passed "
      "through a long tunnel, and came out among the mountains. Snow covered the highest peaks. "
      "A family in the last car shared sandwiches and looked at the map, counting the towns they "
      "had passed and the towns that were still to come.\n"
      "Good software is written to be read. Each function should do one thing, its name should "
      "say what that thing is, and its tests should show that it works. When something fails, the "
      "error should explain what went wrong and where, so that the next person can fix it "
      "quickly.\n"
      "At night the city lights came on one by one. The market closed, the musicians packed their "
      "instruments, and the last bus carried tired workers home. Above the roofs the moon was "
      "bright and round, and a cold wind came down from the hills.\n"
      "Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, "
      "thirty, forty, fifty, one hundred, one thousand. Colors: red, orange, yellow, green, blue, "
      "purple, black, white, gray, brown. Animals: cat, dog, horse, cow, sheep, fox, wolf, bear, "
      "eagle, fish, whale, mouse.\n"
      "She said, \"We will meet again tomorrow, at the same place and the same time.\" He nodded, "
      "put on his coat, and walked out into the rain. It was a long way home, but he did not mind; "
      "he was thinking about the plan, the map, and the letter he still had to write.\n");
  return *corpus;
}

}  // namespace strata::model
