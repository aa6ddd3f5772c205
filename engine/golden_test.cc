// Golden tests: every case under tests/fixtures/golden/ (Hugging Face transformers in float32,
// made by scripts/make_golden_fixtures.py) must be reproduced by the dense CPU path:
// - logits at every recorded prompt position within max|diff| <= 1e-3 * max(1, max|logit|)
//   (the case's largest reference logit), for the default chunk size, chunk 7 and the case's
//   chunk_hint;
// - the 32 greedy tokens (EOS ignored) exactly.
// The test fails when no case is found. Run from the repository root (ctest sets it).
//
// Built twice: golden_test on the CPU backend, and golden_gpu_test (STRATA_GOLDEN_CUDA, ctest
// label gpu) on the CUDA backend loaded as the plugin (kernels::MakeBackend), which must reproduce the
// same logits within the same tolerance and the greedy tokens exactly; it is skipped, saying so,
// where no GPU is present.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "engine/attention_policy.h"
#include "engine/generator.h"
#include "engine/kv_cache.h"
#include "engine/transformer.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/testing/cuda_plugin_backend.h"
#include "model/model.h"
#include "nlohmann/json.hpp"

namespace strata::engine {
namespace {

constexpr const char* kGoldenDir = "tests/fixtures/golden";

struct Expected {
  std::vector<int32_t> prompt_ids;
  std::vector<int64_t> logit_positions;
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> greedy_ids;
  int64_t chunk_hint = 0;
};

// Reads expected.json; adds a failure and returns false when it is malformed.
bool ReadExpected(const std::string& path, Expected* e) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    ADD_FAILURE() << path << ": not a JSON object";
    return false;
  }
  auto ints = [&](const char* key, auto* out) {
    if (!j.contains(key) || !j[key].is_array()) return false;
    for (const auto& v : j[key]) {
      if (!v.is_number_integer()) return false;
      out->push_back(v.template get<typename std::decay_t<decltype(*out)>::value_type>());
    }
    return true;
  };
  if (!ints("prompt_ids", &e->prompt_ids) || !ints("greedy_ids", &e->greedy_ids)) {
    ADD_FAILURE() << path << ": prompt_ids / greedy_ids missing or malformed";
    return false;
  }
  if (j.contains("logit_positions")) {
    if (!ints("logit_positions", &e->logit_positions)) {
      ADD_FAILURE() << path << ": malformed logit_positions";
      return false;
    }
  } else {
    for (size_t i = 0; i < e->prompt_ids.size(); ++i) e->logit_positions.push_back(i);
  }
  if (!j.contains("logits") || !j["logits"].is_array()) {
    ADD_FAILURE() << path << ": logits missing";
    return false;
  }
  for (const auto& row : j["logits"]) {
    if (!row.is_array()) return false;
    std::vector<float> r;
    for (const auto& v : row) {
      if (!v.is_number()) {
        ADD_FAILURE() << path << ": non-numeric logit";
        return false;
      }
      r.push_back(v.get<float>());
    }
    e->logits.push_back(std::move(r));
  }
  if (j.contains("chunk_hint") && j["chunk_hint"].is_number_integer()) {
    e->chunk_hint = j["chunk_hint"].get<int64_t>();
  }
  if (e->logits.size() != e->logit_positions.size()) {
    ADD_FAILURE() << path << ": logits and logit_positions differ in length";
    return false;
  }
  return true;
}

std::vector<std::string> CaseDirs() {
  std::vector<std::string> dirs;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldenDir, ec)) {
    if (entry.is_directory() && std::filesystem::exists(entry.path() / "expected.json")) {
      dirs.push_back(entry.path().string());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

void RunGoldenCases(kernels::Backend* backend) {
  const std::vector<std::string> dirs = CaseDirs();
  ASSERT_FALSE(dirs.empty()) << "no golden cases under " << kGoldenDir
                             << " (run from the repository root)";
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    Expected e;
    if (!ReadExpected(dir + "/expected.json", &e)) continue;
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Model> m, model::LoadModel(dir));
    const int64_t vocab = m->config.vocab_size;
    const int64_t n = static_cast<int64_t>(e.prompt_ids.size());
    float max_ref = 1.0f;
    for (const auto& row : e.logits) {
      ASSERT_EQ(static_cast<int64_t>(row.size()), vocab);
      for (float v : row) max_ref = std::max(max_ref, std::fabs(v));
    }
    const double tol = 1e-3 * max_ref;

    std::vector<int64_t> chunks = {512, 7};
    if (e.chunk_hint > 0) chunks.push_back(e.chunk_hint);
    for (int64_t chunk : chunks) {
      TransformerOptions opt;
      opt.prefill_chunk_size = chunk;
      STRATA_ASSERT_OK_AND_ASSIGN(auto tf,
                                  Transformer::Create(m->config, m->weights, backend, opt));
      STRATA_ASSERT_OK_AND_ASSIGN(auto cache,
                                  KvCache::Create(tf->MakeCacheOptions(n, 16), backend));
      auto policy = MakeDensePolicy();
      std::vector<float> logits(n * vocab, NAN);
      STRATA_ASSERT_OK(tf->Forward(e.prompt_ids.data(), n, 0, cache.get(), policy.get(),
                                   logits.data(), true));
      double worst = 0;
      for (size_t r = 0; r < e.logit_positions.size(); ++r) {
        const int64_t pos = e.logit_positions[r];
        ASSERT_LT(pos, n);
        for (int64_t v = 0; v < vocab; ++v) {
          const double d = std::fabs(double(logits[pos * vocab + v]) - e.logits[r][v]);
          worst = std::isnan(d) ? INFINITY : std::max(worst, d);
        }
      }
      EXPECT_LE(worst, tol) << "chunk " << chunk;
      std::printf("golden[%s] %s chunk=%lld: max|diff|=%.3g (tolerance %.3g, max|logit| %.3g)\n",
                  backend->Name().c_str(), dir.c_str(), static_cast<long long>(chunk), worst, tol,
                  max_ref);

      GenerateOptions gen;
      gen.max_tokens = static_cast<int64_t>(e.greedy_ids.size());
      gen.ignore_eos = true;
      gen.page_size = 16;
      STRATA_ASSERT_OK_AND_ASSIGN(
          GenerateResult res, Generate(tf.get(), nullptr, e.prompt_ids, gen,
                                       MakeDensePolicy().get(), nullptr));
      EXPECT_EQ(res.tokens, e.greedy_ids) << "chunk " << chunk;
    }
  }
}

#ifndef STRATA_GOLDEN_CUDA
TEST(GoldenTest, DenseCpuPathReproducesTransformers) {
  // One thread: the models are tiny, and on a shared build machine an OpenMP team mostly waits
  // for descheduled members (the multi-threaded kernels are covered by cpu_backend_test).
  auto backend = kernels::MakeCpuBackend(1);
  RunGoldenCases(backend.get());
}
#else
TEST(GoldenTest, DenseCudaPathReproducesTransformers) {
  std::string why;
  std::unique_ptr<kernels::Backend> backend =
      kernels::testing::CudaPluginBackendOrNull(STRATA_CUDA_PLUGIN_PATH, &why);
  if (backend == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why << ")";
  RunGoldenCases(backend.get());
}
#endif

}  // namespace
}  // namespace strata::engine
