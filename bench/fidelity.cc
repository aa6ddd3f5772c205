// Attention-fidelity benchmark. See bench/fidelity.h.
#include "bench/fidelity.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <ctime>

#include <omp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "engine/kv_cache.h"
#include "engine/sparse/policy.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "kvstore/page_format.h"
#include "nlohmann/json.hpp"

namespace strata::bench {
namespace {

using engine::KvCache;
using engine::KvCacheOptions;
using engine::Selection;
using engine::sparse::PolicyKind;
using engine::sparse::PolicyOptions;
using engine::sparse::SparsePolicy;
using engine::sparse::SummaryKind;
using kernels::DType;
using kernels::TensorView;

constexpr int kD = 128;
constexpr int kHalf = kD / 2;
constexpr int kGroup = 4;            // query heads per KV head (GQA 32/8)
constexpr int kModelKvHeads = 8;     // bytes and time are reported for 8 KV heads per layer
constexpr int kTopics = 64;
constexpr int kSinkTokens = 4;       // tokens that carry the sink key
constexpr int kNeedles = 16;
constexpr int kNeedlesPerQuery = 4;
constexpr int kSemLo = 48;           // semantic rotary pairs [kSemLo, kBiasPair)
constexpr int kBiasPair = kHalf - 1; // the lowest-frequency pair carries a shared key bias
constexpr double kTopicMeanRun = 512.0;
constexpr float kHeadScale[kGroup] = {0.7f, 1.0f, 1.4f, 2.0f};
constexpr int64_t kChunk = 8192;
constexpr int64_t kCalibrationContext = 131072;  // where the background logit is calibrated
constexpr float kQueryBias = 15.0f;  // query anti-alignment with the shared key bias direction

// Keys as an fp8 e4m3 page holds them: rows [0, n) of k and v (f32, kD per row; row 0 starts a
// page) rounded to bf16 as the cache stores them, page by page (`page` rows) encoded by kvstore's
// page format (per-page scale amax / 448) and decoded back to bf16 as its bf16 consumers read it
// (kvstore::PageToBf16); the keys into out as f32.
absl::Status Fp8PageKeys(const float* k, const float* v, int64_t n, int page, float* out) {
  kvstore::PageShape shape;
  shape.dtype = DType::kFP8E4M3;
  shape.page_size = page;
  shape.head_dim = kD;
  std::string bytes(shape.EncodedBytes(), '\0');
  const size_t elems = static_cast<size_t>(page) * kD;
  std::vector<uint16_t> k16(elems), v16(elems), kq(elems), vq(elems);
  for (int64_t p0 = 0; p0 < n; p0 += page) {
    const int64_t rows = std::min<int64_t>(n - p0, page);
    for (int64_t i = 0; i < rows * kD; ++i) {
      k16[i] = kernels::F32ToBF16(k[p0 * kD + i]);
      v16[i] = kernels::F32ToBF16(v[p0 * kD + i]);
    }
    STRATA_RETURN_IF_ERROR(kvstore::EncodePageTo(shape,
                                                 TensorView(k16.data(), DType::kBF16, {rows, kD}),
                                                 TensorView(v16.data(), DType::kBF16, {rows, kD}),
                                                 bytes.data()));
    STRATA_RETURN_IF_ERROR(kvstore::PageToBf16(bytes, kq.data(), vq.data()));
    for (int64_t i = 0; i < rows * kD; ++i) out[p0 * kD + i] = kernels::BF16ToF32(kq[i]);
  }
  return absl::OkStatus();
}

// Rotary inverse frequencies for a workload of `context` tokens (see RopeRule).
std::vector<double> Llama3InvFreq();
std::vector<double> InvFreqFor(RopeRule rule, int64_t context) {
  const double theta = RopeThetaFor(rule, context);
  if (theta <= 0) return Llama3InvFreq();
  std::vector<double> inv(kHalf);
  for (int i = 0; i < kHalf; ++i) inv[i] = std::pow(theta, -2.0 * i / kD);
  return inv;
}

// Llama 3.1 rotary inverse frequencies (theta 500000, llama3 scaling: factor 8, low 1, high 4,
// original context 8192), as in transformers' _compute_llama3_parameters.
std::vector<double> Llama3InvFreq() {
  const double theta = 500000.0, factor = 8.0, low = 1.0, high = 4.0, orig = 8192.0;
  const double low_wavelen = orig / low, high_wavelen = orig / high;
  std::vector<double> inv(kHalf);
  for (int i = 0; i < kHalf; ++i) {
    const double f = std::pow(theta, -2.0 * i / kD);
    const double wavelen = 2 * M_PI / f;
    if (wavelen < high_wavelen) {
      inv[i] = f;
    } else if (wavelen > low_wavelen) {
      inv[i] = f / factor;
    } else {
      const double smooth = (orig / wavelen - low) / (high - low);
      inv[i] = (1 - smooth) * f / factor + smooth * f;
    }
  }
  return inv;
}

void Rope(float* x, int64_t pos, const std::vector<double>& inv) {
  for (int i = 0; i < kHalf; ++i) {
    const double a = static_cast<double>(pos) * inv[i];
    const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
    const float x1 = x[i], x2 = x[i + kHalf];
    x[i] = x1 * c - x2 * s;
    x[i + kHalf] = x2 * c + x1 * s;
  }
}

bool IsSemanticDim(int i) { return (i % kHalf) >= kSemLo && (i % kHalf) < kBiasPair; }

// A random unit vector in the semantic dims.
std::vector<float> SemanticUnit(std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> v(kD, 0.0f);
  double n2 = 0;
  for (int i = 0; i < kD; ++i) {
    if (IsSemanticDim(i)) {
      v[i] = nd(rng);
      n2 += v[i] * v[i];
    }
  }
  for (float& x : v) x = static_cast<float>(x / std::sqrt(n2));
  return v;
}

// The synthetic sequence of one KV head: keys/values are produced in order by Next().
class HeadWorkload {
 public:
  HeadWorkload(const WorkloadParams& params, int64_t length, int64_t middle_begin,
               int64_t middle_end, uint64_t seed)
      : length_(length),
        rng_(seed),
        inv_(InvFreqFor(params.rope, length)),
        // Background logit at scale 1 = -key_bias * kQueryBias / sqrt(d).
        key_bias_(static_cast<float>(-params.background_logit * std::sqrt(static_cast<double>(kD)) /
                                     kQueryBias)) {
    // Relative to the calibration point (128K), so every profile has the same logits there.
    const float temperature =
        static_cast<float>(QueryTemperature(params.length_rule, length) /
                           QueryTemperature(params.length_rule, kCalibrationContext));
    std::normal_distribution<float> nd;
    for (int c = 0; c < kTopics; ++c) {
      topic_key_.push_back(SemanticUnit(rng_));
      std::vector<float> v(kD);
      for (float& x : v) x = nd(rng_);
      topic_value_.push_back(v);
    }
    sink_dir_ = SemanticUnit(rng_);
    bias_dir_.assign(kD, 0.0f);
    bias_dir_[kBiasPair] = 1.0f;
    for (int j = 0; j < kNeedles; ++j) {
      needle_dir_.push_back(SemanticUnit(rng_));
      std::vector<float> v(kD);
      for (float& x : v) x = nd(rng_);
      needle_value_.push_back(v);
      const int64_t run = std::uniform_int_distribution<int>(1, 4)(rng_);
      const int64_t lo = middle_begin, hi = std::max(lo + 1, middle_end - run);
      const int64_t pos = std::uniform_int_distribution<int64_t>(lo, hi - 1)(rng_);
      needle_runs_.push_back({pos, pos + run});
    }
    // Queries: pre-RoPE, per head of the group.
    std::vector<int> perm(kNeedles);
    std::iota(perm.begin(), perm.end(), 0);
    for (int h = 0; h < kGroup; ++h) {
      std::shuffle(perm.begin(), perm.end(), rng_);
      std::vector<float> q(kD, 0.0f);
      auto add = [&](const std::vector<float>& dir, float w) {
        for (int i = 0; i < kD; ++i) q[i] += w * dir[i];
      };
      add(sink_dir_, 5.7f);
      add(bias_dir_, -kQueryBias);  // with the key bias: background_logit
      for (int j = 0; j < kNeedlesPerQuery; ++j) add(needle_dir_[perm[j]], 9.0f);
      for (int r = 0; r < 2; ++r) {
        add(topic_key_[std::uniform_int_distribution<int>(0, kTopics - 1)(rng_)], 4.0f);
      }
      for (int i = 0; i < kD; ++i) q[i] = kHeadScale[h] * (q[i] + 0.3f * nd(rng_));
      if (temperature != 1.0f) {
        for (float& x : q) x *= temperature;
      }
      Rope(q.data(), length - 1, inv_);
      queries_.insert(queries_.end(), q.begin(), q.end());
    }
  }

  // Writes key and value (post-RoPE key) of the next token.
  void Next(float* k, float* v) {
    const int64_t t = next_++;
    std::normal_distribution<float> nd;
    int needle = -1;
    for (int j = 0; j < kNeedles; ++j) {
      if (t >= needle_runs_[j].first && t < needle_runs_[j].second) needle = j;
    }
    if (remaining_ == 0) {
      topic_ = std::uniform_int_distribution<int>(0, kTopics - 1)(rng_);
      remaining_ = 1 + static_cast<int64_t>(
                           std::exponential_distribution<double>(1.0 / kTopicMeanRun)(rng_));
    }
    --remaining_;
    if (t < kSinkTokens) {
      for (int i = 0; i < kD; ++i) {
        k[i] = 12.0f * sink_dir_[i] + 0.3f * nd(rng_);
        v[i] = 0.1f * nd(rng_);
      }
    } else if (needle >= 0) {
      for (int i = 0; i < kD; ++i) {
        k[i] = 10.0f * needle_dir_[needle][i] + 0.3f * nd(rng_);
        v[i] = needle_value_[needle][i] + 0.3f * nd(rng_);
      }
    } else {
      for (int i = 0; i < kD; ++i) {
        k[i] = 6.0f * topic_key_[topic_][i] + key_bias_ * bias_dir_[i] + 0.5f * nd(rng_);
        v[i] = topic_value_[topic_][i] + nd(rng_);
      }
    }
    Rope(k, t, inv_);
  }

  const float* queries() const { return queries_.data(); }  // [kGroup, kD], post-RoPE

 private:
  int64_t length_;
  std::mt19937_64 rng_;
  std::vector<double> inv_;
  float key_bias_;
  std::vector<std::vector<float>> topic_key_, topic_value_, needle_dir_, needle_value_;
  std::vector<float> sink_dir_, bias_dir_;
  std::vector<std::pair<int64_t, int64_t>> needle_runs_;
  std::vector<float> queries_;
  int64_t next_ = 0;
  int topic_ = 0;
  int64_t remaining_ = 0;
};

struct PolicySpec {
  std::string label;
  PolicyOptions options;
  bool oracle = false;  // per-query-head true top-B (see fidelity.h)
};

absl::StatusOr<PolicySpec> ParseSpec(const std::string& text) {
  PolicySpec spec;
  spec.label = text;
  if (text == "oracle") {
    spec.oracle = true;
    return spec;
  }
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.empty() || parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("bad policy '", text, "'"));
  }
  absl::StatusOr<PolicyKind> kind = engine::sparse::ParsePolicyName(parts[0]);
  if (!kind.ok()) return kind.status();
  spec.options.kind = *kind;
  if (parts.size() == 2) {
    absl::StatusOr<SummaryKind> s = engine::sparse::ParseSummaryKind(parts[1]);
    if (!s.ok()) return s.status();
    spec.options.summary = *s;
  }
  return spec;
}

float Bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Accum {
  double mass = 0, topk = 0, err = 0, bytes = 0, ms = 0, attended = 0;
  int heads = 0;   // query heads accumulated (metrics)
  int kv = 0;      // KV heads accumulated (bytes, time)
};

}  // namespace

absl::StatusOr<WorkloadParams> WorkloadProfile(const std::string& name) {
  WorkloadParams p;
  p.profile = name;
  if (name == "calibrated") return p;
  if (name == "calibrated-logtemp") {
    p.length_rule = LengthRule::kLlama4;
    return p;
  }
  if (name == "diffuse") {
    p.background_logit = -3.0 * kQueryBias / std::sqrt(static_cast<double>(kD));
    p.rope = RopeRule::kLlama31;
    return p;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "fidelity: unknown workload profile '", name, "' (want calibrated|calibrated-logtemp|diffuse)"));
}

double RopeThetaFor(RopeRule rule, int64_t context) {
  if (rule != RopeRule::kContextMatched || context <= kCalibrationContext) return 0.0;
  // gradientai/Llama-3-8B-Instruct-Gradient-1048k / -4194k progressive training (model card):
  // plain RoPE theta 207.1M at 262K, 1.06B at 524K, 2.80B at 1048K, 45.2B at 4191K.
  if (context <= 262144) return 207.1e6;
  if (context <= 524288) return 1.06e9;
  if (context <= 1048576) return 2.80e9;
  return 45.2e9;
}

double QueryTemperature(LengthRule rule, int64_t context) {
  if (rule != LengthRule::kLlama4 || context <= 0) return 1.0;
  // transformers Llama4TextAttention: log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1,
  // for the query at position context - 1.
  return 1.0 + 0.1 * std::log(std::floor(static_cast<double>(context) / 8192.0) + 1.0);
}

absl::Status FidelityOptions::Validate() const {
  if (contexts.empty() || budgets.empty() || page_sizes.empty() || policies.empty()) {
    return absl::InvalidArgumentError("fidelity: empty contexts, budgets, page sizes or policies");
  }
  for (int64_t c : contexts) {
    if (c < 1024) return absl::InvalidArgumentError("fidelity: contexts must be >= 1024");
  }
  for (int b : budgets) {
    if (b <= 0) return absl::InvalidArgumentError("fidelity: budgets must be positive");
  }
  for (int p : page_sizes) {
    if (p <= 0) return absl::InvalidArgumentError("fidelity: page sizes must be positive");
  }
  if (kv_heads < 1 || kv_heads > kModelKvHeads) {
    return absl::InvalidArgumentError("fidelity: kv_heads must be in [1, 8]");
  }
  if (!(workload.background_logit <= 0.0) || workload.background_logit < -40.0) {
    return absl::InvalidArgumentError("fidelity: background_logit must be in [-40, 0]");
  }
  if (sink_tokens < 0 || window_tokens < 0 || topk < 1 || rf_features < 1) {
    return absl::InvalidArgumentError("fidelity: bad sinks, window, topk or rf_features");
  }
  if (tokenselect_partitions > 0 && !kernels::ValidPartitions(tokenselect_partitions)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fidelity: partitions ", tokenselect_partitions, " is not a power of two in [1, 64]"));
  }
  for (const std::string& p : policies) {
    absl::StatusOr<PolicySpec> spec = ParseSpec(p);
    if (!spec.ok()) return spec.status();
  }
  if (fp8_selection_keys) {
    for (int p : page_sizes) {
      if (kChunk % p != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("fidelity: fp8 selection keys need page sizes dividing ", kChunk,
                         "; got ", p));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ParseSelectionKeys(absl::string_view name) {
  if (name == "bf16") return false;
  if (name == "fp8") return true;
  return absl::InvalidArgumentError(
      absl::StrCat("fidelity: selection keys are bf16 or fp8, got \"", name, "\""));
}

absl::StatusOr<std::vector<FidelityRow>> RunFidelity(const FidelityOptions& options,
                                                     std::ostream* log) {
  absl::Status st = options.Validate();
  if (!st.ok()) return st;
  std::unique_ptr<kernels::Backend> backend = kernels::MakeCpuBackend();
  const int max_budget = *std::max_element(options.budgets.begin(), options.budgets.end());
  std::vector<PolicySpec> specs;
  for (const std::string& p : options.policies) specs.push_back(*ParseSpec(p));
  std::vector<FidelityRow> rows;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  using Clock = std::chrono::steady_clock;

  for (int64_t L : options.contexts) {
    for (int page : options.page_sizes) {
      // accum[spec][budget]
      std::vector<std::vector<Accum>> acc(specs.size(), std::vector<Accum>(options.budgets.size()));
      for (int g = 0; g < options.kv_heads; ++g) {
        const Clock::time_point t0 = Clock::now();
        KvCacheOptions co;
        co.num_layers = 1;
        co.num_kv_heads = 1;
        co.head_dim = kD;
        co.page_size = page;
        co.dtype = DType::kBF16;
        co.max_tokens = L;
        absl::StatusOr<std::unique_ptr<KvCache>> cache_or = KvCache::Create(co, backend.get());
        if (!cache_or.ok()) return cache_or.status();
        KvCache& cache = **cache_or;
        // With fp8 selection keys the policies read a second cache holding each page's keys as
        // an fp8 page stores them (and the same values).
        std::unique_ptr<KvCache> fp8_cache;
        if (options.fp8_selection_keys) {
          absl::StatusOr<std::unique_ptr<KvCache>> c = KvCache::Create(co, backend.get());
          if (!c.ok()) return c.status();
          fp8_cache = std::move(c).value();
        }
        KvCache& sel_cache = fp8_cache != nullptr ? *fp8_cache : cache;
        // Policy instances: one per spec (budget changed with SetTokenBudget), except subgen,
        // whose streaming state depends on the budget: one per budget.
        struct Instance {
          size_t spec;
          int budget_index;  // -1: all budgets
          std::unique_ptr<SparsePolicy> policy;
        };
        std::vector<Instance> instances;
        for (size_t s = 0; s < specs.size(); ++s) {
          if (specs[s].oracle) continue;
          PolicyOptions po = specs[s].options;
          po.page_size = page;
          po.sink_tokens = options.sink_tokens;
          po.window_tokens = options.window_tokens;
          po.rf_features = options.rf_features;
          if (options.segment_pages >= 0) po.segment_pages = options.segment_pages;
          if (options.two_level_min_pages >= 0) po.two_level_min_pages = options.two_level_min_pages;
          if (options.min_segments >= 0) po.min_segments = options.min_segments;
          if (options.segment_factor >= 0) po.segment_factor = options.segment_factor;
          if (options.tokenselect_candidate_factor >= 0) {
            po.tokenselect_candidate_factor = options.tokenselect_candidate_factor;
          }
          if (options.tokenselect_partitions >= 0) {
            po.tokenselect_partitions = options.tokenselect_partitions;
          }
          po.rf_seed = options.seed * 7 + 3;
          po.subgen_seed = options.seed * 11 + g;
          if (po.kind == PolicyKind::kSubGen) {
            if (L > options.subgen_max_context) continue;
            for (size_t b = 0; b < options.budgets.size(); ++b) {
              po.token_budget = options.budgets[b];
              absl::StatusOr<std::unique_ptr<SparsePolicy>> p =
                  engine::sparse::MakeSparsePolicy(po, 1, kGroup, 1, kD);
              if (!p.ok()) return p.status();
              instances.push_back({s, static_cast<int>(b), std::move(p).value()});
            }
          } else {
            po.token_budget = max_budget;
            absl::StatusOr<std::unique_ptr<SparsePolicy>> p =
                engine::sparse::MakeSparsePolicy(po, 1, kGroup, 1, kD);
            if (!p.ok()) return p.status();
            instances.push_back({s, -1, std::move(p).value()});
          }
        }
        // Stream the sequence into the cache; policies build summaries as pages fill.
        const int64_t middle_begin = options.sink_tokens;
        const int64_t middle_end = std::max<int64_t>(middle_begin + 1, L - 1 - options.window_tokens);
        HeadWorkload work(options.workload, L, middle_begin, middle_end,
                          options.seed * 1000003u + static_cast<uint64_t>(g) * 7919u +
                              static_cast<uint64_t>(L));
        std::vector<float> kbuf(kChunk * kD), vbuf(kChunk * kD);
        std::vector<float> qbuf(fp8_cache != nullptr ? kChunk * kD : 0);
        std::vector<double> append_seconds(instances.size(), 0.0);
        for (int64_t t = 0; t < L; t += kChunk) {
          const int64_t n = std::min(kChunk, L - t);
          for (int64_t i = 0; i < n; ++i) work.Next(&kbuf[i * kD], &vbuf[i * kD]);
          st = cache.Append(0, TensorView(kbuf.data(), DType::kF32, {n, 1, kD}),
                            TensorView(vbuf.data(), DType::kF32, {n, 1, kD}));
          if (!st.ok()) return st;
          if (fp8_cache != nullptr) {  // pages start at multiples of `page`, which divides kChunk
            st = Fp8PageKeys(kbuf.data(), vbuf.data(), n, page, qbuf.data());
            if (!st.ok()) return st;
            st = fp8_cache->Append(0, TensorView(qbuf.data(), DType::kF32, {n, 1, kD}),
                                   TensorView(vbuf.data(), DType::kF32, {n, 1, kD}));
            if (!st.ok()) return st;
          }
          for (size_t i = 0; i < instances.size(); ++i) {
            const Clock::time_point a = Clock::now();
            st = instances[i].policy->OnAppend(0, sel_cache, t, t + n);
            if (!st.ok()) return st;
            append_seconds[i] += std::chrono::duration<double>(Clock::now() - a).count();
          }
        }
        // Dense truth for each query head.
        const uint16_t* keys = cache.k_pool(0).As<const uint16_t>();
        const uint16_t* values = cache.v_pool(0).As<const uint16_t>();
        std::vector<std::vector<float>> prob(kGroup, std::vector<float>(L));
        std::vector<std::vector<double>> dense_out(kGroup, std::vector<double>(kD, 0.0));
        std::vector<std::vector<int64_t>> topk(kGroup);
        const int k_top = static_cast<int>(std::min<int64_t>(options.topk, L));
        for (int h = 0; h < kGroup; ++h) {
          const float* q = work.queries() + h * kD;
          std::vector<float>& p = prob[h];
#pragma omp parallel for schedule(static)
          for (int64_t j = 0; j < L; ++j) {
            float acc_dot = 0.0f;
            const uint16_t* kr = keys + j * kD;
            for (int i = 0; i < kD; ++i) acc_dot += q[i] * Bf16(kr[i]);
            p[j] = acc_dot * scale;
          }
          std::vector<int64_t> idx(L);
          std::iota(idx.begin(), idx.end(), 0);
          std::nth_element(idx.begin(), idx.begin() + k_top - 1, idx.end(),
                           [&](int64_t a, int64_t b) { return p[a] > p[b]; });
          topk[h].assign(idx.begin(), idx.begin() + k_top);
          const float m = *std::max_element(p.begin(), p.end());
          double sum = 0;
          for (int64_t j = 0; j < L; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
          }
          const float inv = static_cast<float>(1.0 / sum);
          for (int64_t j = 0; j < L; ++j) p[j] *= inv;
          std::vector<double>& o = dense_out[h];
          for (int64_t j = 0; j < L; ++j) {
            const uint16_t* vr = values + j * kD;
            for (int i = 0; i < kD; ++i) o[i] += static_cast<double>(p[j]) * Bf16(vr[i]);
          }
        }
        if (log != nullptr) {
          *log << absl::StrFormat("context %d page %d kv head %d: generated + summarised + truth in %.1f s\n",
                                  L, page, g,
                                  std::chrono::duration<double>(Clock::now() - t0).count());
          log->flush();
        }
        // Adds the metrics of query head h attending `ranges` to `a`.
        std::vector<uint8_t> in_set(L, 0);
        auto add_metrics = [&](int h, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                               Accum& a) {
          double mass = 0;
          std::vector<double> o(kD, 0.0);
          for (const auto& [b, e] : ranges) {
            std::fill(in_set.begin() + b, in_set.begin() + e, 1);
            for (int64_t j = b; j < e; ++j) {
              const double pj = prob[h][j];
              mass += pj;
              const uint16_t* vr = values + j * kD;
              for (int c = 0; c < kD; ++c) o[c] += pj * Bf16(vr[c]);
            }
          }
          double diff2 = 0, ref2 = 0;
          for (int c = 0; c < kD; ++c) {
            const double oc = mass > 0 ? o[c] / mass : 0.0;
            diff2 += (oc - dense_out[h][c]) * (oc - dense_out[h][c]);
            ref2 += dense_out[h][c] * dense_out[h][c];
          }
          int hits = 0;
          for (int64_t j : topk[h]) hits += in_set[j];
          for (const auto& [b, e] : ranges) std::fill(in_set.begin() + b, in_set.begin() + e, 0);
          a.mass += mass;
          a.topk += static_cast<double>(hits) / k_top;
          a.err += std::sqrt(diff2 / std::max(ref2, 1e-30));
          ++a.heads;
        };
        // The oracle: sinks + window + each head's true top-B middle tokens.
        for (size_t s = 0; s < specs.size(); ++s) {
          if (!specs[s].oracle) continue;
          const int64_t sink_end = std::min<int64_t>(options.sink_tokens, L);
          const int64_t wb = std::clamp<int64_t>(L - 1 - options.window_tokens, sink_end, L);
          for (size_t b = 0; b < options.budgets.size(); ++b) {
            Accum& a = acc[s][b];
            int64_t attended = 0;
            for (int h = 0; h < kGroup; ++h) {
              std::vector<int64_t> mid(wb - sink_end);
              std::iota(mid.begin(), mid.end(), sink_end);
              const int64_t take = std::min<int64_t>(options.budgets[b], mid.size());
              if (take > 0 && take < static_cast<int64_t>(mid.size())) {
                std::nth_element(mid.begin(), mid.begin() + take - 1, mid.end(),
                                 [&](int64_t x, int64_t y) { return prob[h][x] > prob[h][y]; });
              }
              mid.resize(take);
              std::vector<std::pair<int64_t, int64_t>> ranges = {{0, sink_end}, {wb, L}};
              for (int64_t j : mid) ranges.push_back({j, j + 1});
              add_metrics(h, ranges, a);
              attended = sink_end + take + (L - wb);
            }
            a.bytes += static_cast<double>(attended) * kD * 2 * 2;
            a.attended += static_cast<double>(attended);
            ++a.kv;
          }
        }
        // Selections.
        for (Instance& inst : instances) {
          for (size_t b = 0; b < options.budgets.size(); ++b) {
            if (inst.budget_index >= 0 && inst.budget_index != static_cast<int>(b)) continue;
            SparsePolicy& pol = *inst.policy;
            if (inst.budget_index < 0) pol.SetTokenBudget(options.budgets[b]);
            pol.ResetStats();
            Selection sel;
            // Selection is timed on one thread: the figure is per core and does not depend on
            // what else the (shared) machine runs.
            // CPU time of this thread, not wall time: the build machine is shared and loaded.
            const int threads = omp_get_max_threads();
            omp_set_num_threads(1);
            const double cpu0 = ThreadCpuSeconds();
            st = pol.Select(0, work.queries(), 1, kGroup, L - 1, sel_cache, &sel);
            const double cpu_seconds = ThreadCpuSeconds() - cpu0;
            omp_set_num_threads(threads);
            if (!st.ok()) return st;
            int64_t attended = 0;
            for (int i = sel.offsets[0]; i < sel.offsets[1]; ++i) attended += sel.spans[i].length;
            Accum& a = acc[inst.spec][b];
            std::vector<std::pair<int64_t, int64_t>> ranges;
            for (int i = sel.offsets[0]; i < sel.offsets[1]; ++i) {
              ranges.push_back({sel.spans[i].position, sel.spans[i].position + sel.spans[i].length});
            }
            const double mass0 = a.mass, err0 = a.err;
            for (int h = 0; h < kGroup; ++h) add_metrics(h, ranges, a);
            if (log != nullptr) {
              *log << absl::StrFormat("    kv head %d %-18s B=%-6d mass %.4f err %.4f\n", g,
                                      specs[inst.spec].label, options.budgets[b],
                                      (a.mass - mass0) / kGroup, (a.err - err0) / kGroup);
            }
            const engine::sparse::SelectionStats& ss = pol.stats();
            a.bytes += static_cast<double>(ss.summary_bytes + ss.key_bytes) +
                       static_cast<double>(attended) * kD * 2 /*K,V*/ * 2 /*bf16*/;
            a.ms += cpu_seconds * 1e3;
            a.attended += static_cast<double>(attended);
            ++a.kv;
          }
        }
      }
      for (size_t s = 0; s < specs.size(); ++s) {
        for (size_t b = 0; b < options.budgets.size(); ++b) {
          const Accum& a = acc[s][b];
          if (a.heads == 0) continue;  // skipped (subgen above its context limit)
          FidelityRow r;
          r.profile = options.workload.profile;
          r.policy = specs[s].label;
          r.selection_keys = options.fp8_selection_keys && !specs[s].oracle ? "fp8" : "bf16";
          r.context = L;
          r.budget = options.budgets[b];
          r.page_size = page;
          r.mass_recall = a.mass / a.heads;
          r.topk_recall = a.topk / a.heads;
          r.rel_error = a.err / a.heads;
          r.bytes_per_step = a.bytes / a.kv * kModelKvHeads;
          r.select_ms = a.ms / a.kv * kModelKvHeads;
          r.attended_tokens = a.attended / a.kv;
          rows.push_back(r);
          if (log != nullptr) {
            *log << absl::StrFormat("  %-20s B=%-5d P=%-3d mass %.4f topk %.4f err %.4f\n", r.policy,
                                    r.budget, r.page_size, r.mass_recall, r.topk_recall,
                                    r.rel_error);
          }
        }
      }
    }
  }
  return rows;
}

std::string FormatFidelityTable(const std::vector<FidelityRow>& rows) {
  std::string out = absl::StrFormat("%-20s %8s %6s %5s %11s %11s %9s %12s %10s %9s\n", "policy",
                                    "context", "budget", "page", "mass_recall", "topk_recall",
                                    "rel_error", "MB/step", "select_ms", "attended");
  for (const FidelityRow& r : rows) {
    absl::StrAppendFormat(&out, "%-20s %8d %6d %5d %11.4f %11.4f %9.4f %12.3f %10.3f %9.0f\n",
                          r.policy, r.context, r.budget, r.page_size, r.mass_recall, r.topk_recall,
                          r.rel_error, r.bytes_per_step / 1e6, r.select_ms, r.attended_tokens);
  }
  return out;
}

std::string FidelityRowJson(const FidelityRow& r) {
  nlohmann::json j;
  j["profile"] = r.profile;
  j["policy"] = r.policy;
  j["selection_keys"] = r.selection_keys;
  j["context"] = r.context;
  j["budget"] = r.budget;
  j["page_size"] = r.page_size;
  j["mass_recall"] = r.mass_recall;
  j["topk_recall"] = r.topk_recall;
  j["rel_error"] = r.rel_error;
  j["bytes_per_step"] = r.bytes_per_step;
  j["select_ms"] = r.select_ms;
  j["attended_tokens"] = r.attended_tokens;
  return j.dump();
}

}  // namespace strata::bench
