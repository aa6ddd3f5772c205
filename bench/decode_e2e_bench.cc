// decode_e2e_bench: end-to-end sparse decode of a long document whose KV lives in the host tier,
// read through the GPU page cache (issue #6, DESIGN.md section 9: tokens/s at 32K-512K for the
// Llama-3.2-1B and Llama-3.1-8B shapes).
//
// Per (shape, context):
//   Model: the preset's config (model::RandomModelConfig) with random bf16 weights made in memory:
//     every matrix is a view into one shared pool of normal(0, 0.02) bf16 values (at different
//     offsets; the pool is as large as the largest matrix) and every norm weight a view into a
//     pool of 1 + normal(0, 0.02) values, so nothing is written to disk. The Transformer uploads
//     them to the CUDA backend (the full parameter count is resident on the GPU).
//   Document: `context` tokens of KV per layer and KV head, generated directly as encoded bf16
//     pages (page_size 64) into a kvstore::HostCache whose buffers come from a
//     BackendPageAllocator (pinned memory the cache's fills read in place). Keys of page p of a
//     (layer, head): a per-page centre c_p (per channel, uniform in [-1.5, 1.5]) plus per-token
//     triangular noise in [-1, 1]; values: triangular noise in [-1, 1]. Minmax summaries (per
//     channel min then max of the page's keys) are computed on the host and uploaded to device
//     memory ([layers][kv_heads, pages, 2 * head_dim] f32). Nothing is prefilled.
//   Decode: a GpuPageCache with --cache_fraction of the document's pages as slots and
//     GpuCacheAttention (MissPolicy::kWait) with a device chooser: per layer, the layer's query
//     (host, as the hook receives it) is copied to the device, Backend::ScoreSummaries scores the
//     middle pages [1, pages - window_pages) of every KV head, Backend::VoteTopK keeps
//     budget_tokens / page_size of them per head, and the selection [kv_heads, k] is copied back
//     to the host for the cache's Acquire; page 0 (sink) and the last window_pages pages are
//     always attended. The local KvCache (bf16, dense policy) holds the prompt and generated
//     tokens. The prompt (--prompt tokens) is fed one token at a time like a decode step; then
//     tokens are generated greedily (argmax of the host logits). The first --warmup steps
//     (prompt included) are not measured; the next --tokens are.
//   Reported: tokens/s and ms per token split into: selection (the device chooser: q upload,
//     ScoreSummaries, VoteTopK, selection copy back), cache fills (GpuCacheStats gather + copy +
//     wait: host-side time of the fill path inside Acquire), attention hook rest (the rest of
//     GpuCacheAttention::Attend: Acquire bookkeeping, PagedAttention, copies of the partials back
//     to the host, Release), and the rest of the forward (projections, MLP, local attention,
//     merge, LM head, logits copy). GPU memory used (cudaMemGetInfo total - free) before the
//     backend, after the weights, after the summaries and cache, and after decode; the GPU page
//     cache hit ratio over the measured steps.
//   With --hooks=host,device,device-selected (default: device) each document is decoded once per
//   listed path ("device-selected" = "device" with --selected_attention=1) of
//     GpuCacheAttention: "host" (Attend: q copied to the host, the device chooser's q copied
//     back up, fills waited for on the host, partials copied to the host and up again for the
//     merge) and "device" (AttendOnDevice: q, selection scores and partials stay in backend
//     memory; the selection [kv_heads, k] is the one copy to the host per layer, which also waits
//     for the step's work queued so far; fills with MissPolicy::kOrdered, no host wait). In the
//     device path the host-time split moves GPU time into "select" (its copy waits for the queued
//     layers), so compare paths by ms/token. Fills are further split into source lookups (host
//     tier), other gather work, PageCopy calls (pointer checks + launch) and host waits.
//   Hooks "managed" and "managed-graph": the GPU page cache in device-managed mode
//     (GpuCacheOptions::device_managed, hold_source_pages implied): per layer the device chooser's
//     selection stays on the device (no copy to the host), GpuPageCache::EnqueueResolve makes its
//     pages resident (Backend::ResolvePages: the clock on the device, misses read by the GPU from
//     the pinned host tier in place) and SelectedAttention reads them: no host wait per layer.
//     "managed-graph" also runs each one-token step as one replayed CUDA graph
//     (TransformerOptions::decode_graph with the hook recorded in it). Hit ratio and fill bytes
//     come from the device counters (GpuPageCache::SyncDeviceStats, outside the timed steps).
//   --page_dtype=fp8: the document's pages are encoded fp8 e4m3 (page_format.h: per-page K and
//     V scales, amax / 448; half the bytes of bf16): the device-managed cache's pools are fp8
//     and SelectedAttention reads each slot's scales; a host-managed cache (the other hooks)
//     dequantises the pages into bf16 staging on the host (bf16 bytes over PCIe).
//   --query_correlation=rho[,rho...] (0 <= rho < 1; default 0): the document's attention sees a correlated
//     query stream q'_t = rho q'_{t-1} + sqrt(1 - rho^2) q_t per layer instead of the random
//     model's queries, which are unrelated from one token to the next where a real model's are
//     similar (TokenSelect Fig. 3a; papers/DIGEST.md's query-similarity study): the workload model
//     for page-cache locality and selection reuse (CorrelatedQueries below). Use a warm-up of
//     several 1 / (1 - rho^2) steps (q'_{-1} = 0).
//   --cache_theta=theta[,theta...] (default 2: off): the device chooser keeps TokenSelect's selection cache
//     (engine::DeviceSelectionCache, as the worker's lazy jobs do): a KV head whose group query has
//     cosine >= theta with the one it last selected for reuses that selection. Reported as
//     selection_reuse (hits per (layer, KV head) choice over the measured steps). Each document
//     pass runs once per listed (hook, rho, theta), in that order.
//   --selection_log=PATH (hooks device / managed, no graphs): each document pass writes every
//     layer's selection to PATH.<shape>.<context>.<pass>.bin (header and records: Decode), the
//     input of bench/page_cache_sim.cc (the page cache's replacement policies offline).
//   --summary_dtype=bf16 (default f32): the device chooser's summaries in bf16, rounded outward
//     (kernels::MinMaxRowsToBF16, as the worker's lazy jobs keep them): half the device memory and
//     half the bytes each selection reads.
//   --hold_source_pages=1: GpuCacheOptions::hold_source_pages (every page looked up once when the
//     cache is made, reported as cache_create_s; misses then need no host-tier lookup).
//   --selected_attention=1 (device hook): the device chooser also returns its selection on the
//     device, and GpuCacheAttention attends with Backend::SelectedAttention over the GPU cache's
//     device page table instead of PagedAttention over a host-planned span list.
//   --device_sample=1 (default): greedy tokens are picked on the device (logits stay there);
//     0: the logits are copied to the host for the argmax (the behaviour before).
//   --pipeline=1 (with device_sample; default 0): a generated step's token id is read on the
//     device by the next step (ForwardOptions::device_token) and reaches the host one step later,
//     so the host queues (launches) step t + 1 while step t runs; the same tokens. A comma list
//     (0,1) runs each document pass and the no-document-graph pass once per value.
//   With --no_document_pass=1, each shape first decodes the same way with no attention to the
//     document (ForwardOptions::external null): the model's own cost per token. With 2, only
//     that pass runs (no document is made).
//   With --decode_graph=1 (and --no_document_pass), the no-document pass is repeated with a
//     second Transformer made with TransformerOptions::decode_graph (each one-token step a
//     replayed CUDA graph), reported as chooser "no-document-graph".
//   With --host_chooser_max_context >= context, the same decode is repeated with the host
//     MinMaxChooser (summaries read from the host tier) for --host_tokens measured tokens.
//   With --prefill_contexts=N1,N2,... each shape first prefills N random token ids into a fresh
//     bf16 KvCache on the backend through Transformer::Forward (dense attention: chunks of
//     --prefill_chunk tokens, each attending causally to itself and every earlier chunk with the
//     backend's PagedAttention, i.e. the tensor-core flash kernel on CUDA), last-token logits only;
//     reported: seconds (one timed pass after the weights are resident, backend synchronized),
//     tokens/s, the attention FLOPs of causal dense attention 4 * layers * q_heads * head_dim *
//     N^2 / 2 divided by the seconds (an effective rate for scale, not a kernel measurement), and
//     GPU memory at the end. Runs before the decode passes' Transformer is made (one copy of the
//     weights on the device) and before any document decode (--contexts still applies after).
//     --prefill_policy=dense|quest|tokenselect (a comma list runs each in turn, per context):
//     quest / tokenselect prefill through engine::sparse::DevicePolicy::AttendChunk (default
//     PolicyOptions: B = 2048, 64 sinks, 256-token window; selection on the device with each
//     chunk's mean query, one host wait per layer and chunk for the selection, then the same
//     PagedAttention over the selected spans); the line then also gives the fraction of
//     (layer, KV head, chunk) candidate tokens attended. The attention FLOPs stay those of dense
//     causal attention (so effective_attention_tflops is "dense-equivalent"). Sparse warm-ups use
//     two chunks so that the selection kernels load before the timed pass.
//     --dense_decode_tokens=T (> 0): after each dense prefill, --warmup + T greedy tokens decoded
//     through the same Transformer and cache, every step attending densely to the whole context
//     (SelectedAttention over [0, length) of the cache: the tensor-core split-K kernel on CUDA;
//     one replayed graph per step with --decode_graph=1; picks as --device_sample): the dense
//     reference for the document passes, reported as a dense_decode line (tok/s over the T
//     measured steps, GPU memory).
//     --prefill_check=N (> 0): a correctness check on the backend: N tokens prefilled dense and
//     through the DevicePolicy with tokenselect and a budget covering everything (must agree: the
//     same spans), and with the default budget (differs: reported for scale); prints the largest
//     absolute difference of the last-token logits to the dense ones.
//   --matmul_precision=split|bf16 (default split; a comma list runs each prefill once per listed
//     precision, per policy and context): engine::TransformerOptions::matmul_precision of the
//     prefill Transformer ("bf16": kernels::MatMulPrecision::kRoundActivations, activations
//     rounded to bf16 and one cuBLAS GEMM per projection instead of the hi/lo split's two). The
//     prefill line also gives linear_tflops: 2 * (projection + MLP weights) FLOPs per token (LM
//     head once) times tokens over the seconds, an effective rate that includes attention time.
//     The decode passes and --prefill_check use the first listed precision.
//   --gpu_memory_cap_gib=X (> 0; CUDA): before the backend is made, the device memory beyond X GiB
//     of the device's total is taken by one cudaMalloc that is held to the end (a ballast), so
//     the run has the memory of an X GiB device (e.g. 79.6 for an 80 GB H100 on an H200); the
//     GPU memory figures then exclude the ballast. Fails if the device has less than X GiB free
//     beyond what is in use.
//   --weight_format=checkpoint|fp8 (default checkpoint: the random bf16 weights as made):
//     engine::TransformerOptions::weight_format of every Transformer of the run; fp8 quantises
//     the projections and the LM head row-wise to e4m3 at load (half the weight bytes per token).
//
// Usage: decode_e2e_bench [--shapes=llama-3.2-1b,llama-3.1-8b] [--contexts=32768,131072,524288]
//   [--flag=value ...]. CUDA backend (--backend=cpu runs the same code on the CPU backend, for a
//   smoke test with --shapes=tiny). Prints one line per run and a table at the end.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/clock.h"
#include "base/status_macros.h"
#include "engine/attention_policy.h"
#include "engine/gpu_cache_attention.h"
#include "engine/kv_cache.h"
#include "engine/selection_cache.h"
#include "engine/sparse/device_policy.h"
#include "engine/sparse/policy.h"
#include "engine/transformer.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kvstore/backend_page_allocator.h"
#include "kvstore/gpu_cache.h"
#include "kvstore/host_cache.h"
#include "kvstore/page_format.h"
#include "model/config.h"
#include "model/random_model.h"
#include "model/weights.h"

namespace strata {
namespace {

using kernels::DType;
using kernels::TensorView;

struct Flags {
  std::string shapes = "llama-3.2-1b,llama-3.1-8b";
  std::string contexts = "32768,131072,524288";
  std::string backend = "cuda";  // "cpu" runs the same code on the CPU backend (a smoke test)
  int page_size = 64;
  int budget_tokens = 2048;
  int window_pages = 2;
  double cache_fraction = 0.05;
  int prompt = 16;
  int warmup = 16;  // steps not measured (the prompt steps count)
  int tokens = 64;  // measured steps
  int64_t host_chooser_max_context = 32768;
  int host_tokens = 16;
  int threads = 0;  // KV generation threads; 0: hardware concurrency
  int no_document_pass = 0;  // 1: also decode with no document attention (the model's floor);
                             // 2: only that
  int decode_graph = 0;      // 1: repeat the no-document pass with decode_graph
  // Which GpuCacheAttention paths decode each document, in order: "host" (Attend: q and the
  // partials through host memory, fills waited for) and/or "device" (AttendOnDevice: q and
  // partials in backend memory, MissPolicy::kOrdered fills, one host sync per layer).
  std::string hooks = "device";
  std::string page_dtype = "bf16";  // bf16 | fp8
  // The device chooser's summaries: f32 as computed, or bf16 rounded outward
  // (kernels::MinMaxRowsToBF16; what the worker's lazy jobs use).
  std::string summary_dtype = "f32";
  // 1: GpuCacheOptions::hold_source_pages (every page looked up once at Create; misses need no
  // host-tier lookup).
  int hold_source_pages = 0;
  // 1: greedy tokens picked on the device (ForwardOptions::logits_on_device + Backend::Sample);
  // 0: logits copied to the host and argmax there.
  int device_sample = 1;
  // 1 (with device_sample): each step's pick stays on the device for the next step
  // (ForwardOptions::device_token) and reaches the host one step later, so the host queues step
  // t + 1 before step t ends; 0: the host waits for each pick before the next step.
  int pipeline = 0;                  // of the current pass
  std::string pipelines = "0";       // comma list
  // 1 (device hook only): the device chooser also hands its selection to GpuCacheAttention, which
  // attends with Backend::SelectedAttention over the cache's device page table.
  int selected_attention = 0;
  // Prefill pass (see the file comment): contexts, empty for none, and the chunk size.
  std::string prefill_contexts;
  int prefill_chunk = 8192;
  int dense_decode_tokens = 0;  // > 0: decode after each dense prefill (the dense reference)
  // > 0: the run behaves as on a GPU of this many GiB (see the file comment).
  double gpu_memory_cap_gib = 0;
  std::string prefill_policy = "dense";
  int64_t prefill_check = 0;
  std::string matmul_precision = "split";  // comma list of split|bf16
  std::string weight_format = "checkpoint";  // checkpoint|fp8
  // Document passes: rho of the correlated query stream (0: the model's queries as they are) and
  // the device chooser's selection cache threshold (> 1: off). See the file comment.
  // Comma lists: each document pass runs once per (hook, rho, theta).
  std::string query_correlations = "0";
  std::string cache_thetas = "2";
  double query_correlation = 0.0;  // of the current pass
  double cache_theta = 2.0;        // of the current pass
  uint64_t seed = 1;
  // Non-empty: every document pass appends each layer's selection to
  // "<selection_log>.<shape>.<context>.<pass>.bin" (see SelectionLog) for offline cache studies
  // (bench/page_cache_sim.cc); each layer's selection is copied to the host (not for graphs).
  std::string selection_log;
  int pass_index = 0;  // of the current pass (the log's name)
};

bool ParseFlag(const std::string& arg, Flags* f) {
  const size_t eq = arg.find('=');
  if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return false;
  const std::string k = arg.substr(2, eq - 2), v = arg.substr(eq + 1);
  int64_t i = 0;
  double x = 0;
  if (k == "shapes") { f->shapes = v; return true; }
  if (k == "contexts") { f->contexts = v; return true; }
  if (k == "hooks") { f->hooks = v; return true; }
  if (k == "page_dtype") {
    f->page_dtype = v;
    return v == "bf16" || v == "fp8";
  }
  if (k == "summary_dtype") {
    f->summary_dtype = v;
    return v == "f32" || v == "bf16";
  }
  if (k == "prefill_contexts") { f->prefill_contexts = v; return true; }
  if (k == "prefill_policy") { f->prefill_policy = v; return true; }
  if (k == "matmul_precision") { f->matmul_precision = v; return true; }
  if (k == "weight_format") { f->weight_format = v; return true; }
  if (k == "selection_log") { f->selection_log = v; return !v.empty(); }
  if (k == "backend") { f->backend = v; return v == "cuda" || v == "cpu"; }
  if (k == "gpu_memory_cap_gib") {
    return absl::SimpleAtod(v, &x) && (f->gpu_memory_cap_gib = x) > 0;
  }
  if (k == "cache_fraction") { return absl::SimpleAtod(v, &x) && (f->cache_fraction = x) > 0; }
  if (k == "query_correlation" || k == "cache_theta") {
    for (absl::string_view e : absl::StrSplit(v, ',', absl::SkipEmpty())) {
      if (!absl::SimpleAtod(e, &x)) return false;
      if (k == "query_correlation" ? !(x >= 0 && x < 1) : !(x > 0)) return false;
    }
    (k == "query_correlation" ? f->query_correlations : f->cache_thetas) = v;
    return !v.empty();
  }
  if (k == "pipeline") {
    for (absl::string_view e : absl::StrSplit(v, ',', absl::SkipEmpty())) {
      if (!absl::SimpleAtoi(e, &i) || i < 0 || i > 1) return false;
    }
    f->pipelines = v;
    return !v.empty();
  }
  if (!absl::SimpleAtoi(v, &i) || i < 0) return false;
  if (k == "page_size") { f->page_size = static_cast<int>(i); return i > 0; }
  if (k == "budget_tokens") { f->budget_tokens = static_cast<int>(i); return true; }
  if (k == "window_pages") { f->window_pages = static_cast<int>(i); return true; }
  if (k == "prompt") { f->prompt = static_cast<int>(i); return i > 0; }
  if (k == "warmup") { f->warmup = static_cast<int>(i); return true; }
  if (k == "tokens") { f->tokens = static_cast<int>(i); return i > 0; }
  if (k == "host_chooser_max_context") { f->host_chooser_max_context = i; return true; }
  if (k == "host_tokens") { f->host_tokens = static_cast<int>(i); return i > 0; }
  if (k == "threads") { f->threads = static_cast<int>(i); return true; }
  if (k == "no_document_pass") { f->no_document_pass = static_cast<int>(i); return true; }
  if (k == "selected_attention") { f->selected_attention = static_cast<int>(i); return true; }
  if (k == "device_sample") { f->device_sample = static_cast<int>(i); return true; }
  if (k == "hold_source_pages") { f->hold_source_pages = static_cast<int>(i); return true; }
  if (k == "decode_graph") { f->decode_graph = static_cast<int>(i); return true; }
  if (k == "prefill_chunk") { f->prefill_chunk = static_cast<int>(i); return i > 0; }
  if (k == "prefill_check") { f->prefill_check = i; return true; }
  if (k == "dense_decode_tokens") { f->dense_decode_tokens = static_cast<int>(i); return i >= 0; }
  if (k == "seed") { f->seed = static_cast<uint64_t>(i); return true; }
  return false;
}

size_t g_ballast_bytes = 0;  // --gpu_memory_cap_gib's allocation, excluded from GpuUsedGiB

double GpuUsedGiB() {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return NAN;
  return static_cast<double>(total_b - free_b - g_ballast_bytes) / (1 << 30);
}

// --gpu_memory_cap_gib: holds the device memory beyond cap_gib of the total (until exit).
bool TakeBallast(double cap_gib) {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return false;
  const double cap = cap_gib * (1 << 30);
  if (cap >= static_cast<double>(total_b)) {
    std::printf("gpu memory cap %.2f GiB: the device has %.2f GiB, no ballast\n", cap_gib,
                static_cast<double>(total_b) / (1 << 30));
    return true;
  }
  const size_t bytes = total_b - static_cast<size_t>(cap);
  void* p = nullptr;
  if (bytes > free_b || cudaMalloc(&p, bytes) != cudaSuccess) {
    std::fprintf(stderr, "gpu memory cap %.2f GiB: cannot hold %.2f GiB (free %.2f)\n", cap_gib,
                 static_cast<double>(bytes) / (1 << 30), static_cast<double>(free_b) / (1 << 30));
    return false;
  }
  g_ballast_bytes = bytes;
  std::printf("gpu memory cap %.2f GiB: %.2f GiB of the device's %.2f GiB held as ballast\n",
              cap_gib, static_cast<double>(bytes) / (1 << 30),
              static_cast<double>(total_b) / (1 << 30));
  return true;
}

// splitmix64: a fast, seedable stream for bulk random data.
struct Rng {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float Uniform() { return static_cast<float>(Next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }
};

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even (inputs are finite)
  return static_cast<uint16_t>(u >> 16);
}
inline float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

int NumThreads(const Flags& f) {
  if (f.threads > 0) return f.threads;
  return std::max(1u, std::thread::hardware_concurrency());
}

template <typename Fn>
void ParallelFor(int64_t n, int threads, Fn fn) {
  std::atomic<int64_t> next{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (int64_t i = next++; i < n; i = next++) fn(i);
    });
  }
  for (auto& t : ts) t.join();
}

// Fills `n` bf16 values: mean + std * (sum of 3 uniforms) * 1 (approximately normal).
void FillNormalBf16(uint16_t* out, int64_t n, float mean, float std, uint64_t seed, int threads) {
  const int64_t block = int64_t{1} << 20;
  ParallelFor((n + block - 1) / block, threads, [&](int64_t b) {
    Rng r{seed * 0x1234567ULL + static_cast<uint64_t>(b)};
    const int64_t end = std::min(n, (b + 1) * block);
    for (int64_t i = b * block; i < end; ++i) {
      const float z = r.Uniform() + r.Uniform() + r.Uniform();  // variance 1
      out[i] = ToBf16(mean + std * z);
    }
  });
}

// Random in-memory bf16 weights for `config` (see the file comment).
struct RandomWeights {
  std::vector<uint16_t> matrix_pool;
  std::vector<uint16_t> norm_pool;
  model::ModelWeights weights;
};

std::unique_ptr<RandomWeights> MakeWeights(const model::ModelConfig& c, uint64_t seed,
                                           int threads) {
  auto w = std::make_unique<RandomWeights>();
  const int64_t H = c.hidden_size, I = c.intermediate_size, d = c.head_dim;
  const int64_t qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t largest = std::max({c.vocab_size * H, I * H, qd * H});
  const int64_t pool = largest + 4096 * 16;
  w->matrix_pool.resize(static_cast<size_t>(pool));
  FillNormalBf16(w->matrix_pool.data(), pool, 0.0f, 0.02f, seed, threads);
  w->norm_pool.resize(static_cast<size_t>(H) + 4096);
  FillNormalBf16(w->norm_pool.data(), H + 4096, 1.0f, 0.02f, seed + 1, threads);
  int64_t salt = 0;
  auto mat = [&](int64_t rows, int64_t cols) {
    const int64_t span = pool - rows * cols;
    const int64_t off = ((salt++ * 7919) % 16) * 4096 % (span + 1);
    return TensorView(w->matrix_pool.data() + off, DType::kBF16, {rows, cols});
  };
  auto norm = [&](int64_t n) {
    const int64_t off = (salt++ * 131) % 4096;
    return TensorView(w->norm_pool.data() + off, DType::kBF16, {n});
  };
  model::ModelWeights& mw = w->weights;
  mw.embed_tokens = mat(c.vocab_size, H);
  mw.layers.resize(static_cast<size_t>(c.num_layers));
  for (model::LayerWeights& l : mw.layers) {
    l.input_norm = norm(H);
    l.q_proj = mat(qd, H);
    l.k_proj = mat(kvd, H);
    l.v_proj = mat(kvd, H);
    l.o_proj = mat(H, qd);
    l.post_attention_norm = norm(H);
    l.gate_proj = mat(I, H);
    l.up_proj = mat(I, H);
    l.down_proj = mat(H, I);
  }
  mw.final_norm = norm(H);
  mw.lm_head = c.tie_word_embeddings ? mw.embed_tokens : mat(c.vocab_size, H);
  return w;
}

// The document's KV in the host tier plus its summaries (host copy, layout per layer
// [kv_heads, pages, 2 * d] f32).
struct Document {
  kvstore::DocumentId id;
  int64_t tokens = 0;
  int64_t pages = 0;
  std::unique_ptr<kvstore::BackendPageAllocator> allocator;
  std::unique_ptr<kvstore::HostCache> host;  // the pages (pinned, read in place by the fills)
  // The summaries for the host MinMaxChooser (plain memory), when asked for.
  std::unique_ptr<kvstore::HostCache> summary_host;
  std::vector<float> summaries;  // [layers][kv_heads][pages][2 d]
  double seconds = 0;
};

absl::StatusOr<std::unique_ptr<Document>> MakeDocument(const model::ModelConfig& c,
                                                       kernels::Backend* backend, int64_t tokens,
                                                       bool host_summaries, const Flags& f) {
  Stopwatch sw;
  auto doc = std::make_unique<Document>();
  doc->id.bytes.fill(0x5a);
  doc->tokens = tokens;
  const int P = f.page_size, d = static_cast<int>(c.head_dim);
  doc->pages = (tokens + P - 1) / P;
  kvstore::PageShape shape;
  shape.dtype = f.page_dtype == "fp8" ? DType::kFP8E4M3 : DType::kBF16;
  shape.page_size = P;
  shape.head_dim = d;
  const size_t page_bytes = shape.EncodedBytes();
  doc->allocator = std::make_unique<kvstore::BackendPageAllocator>(backend, page_bytes);
  const int64_t heads = c.num_layers * c.num_kv_heads;
  const int64_t total_pages = heads * doc->pages;
  kvstore::HostCacheOptions ho;
  ho.capacity_bytes = static_cast<int64_t>(total_pages * page_bytes + (int64_t{64} << 20));
  ho.allocator = doc->allocator.get();
  STRATA_ASSIGN_OR_RETURN(doc->host, kvstore::HostCache::Create(ho));
  if (host_summaries) {
    kvstore::HostCacheOptions so;
    so.capacity_bytes =
        static_cast<int64_t>(total_pages * 2 * d * sizeof(float) + (int64_t{64} << 20));
    STRATA_ASSIGN_OR_RETURN(doc->summary_host, kvstore::HostCache::Create(so));
  }
  doc->summaries.resize(static_cast<size_t>(total_pages) * 2 * d);
  std::atomic<bool> failed{false};
  absl::Status first_error;
  std::mutex error_mu;
  ParallelFor(heads, NumThreads(f), [&](int64_t lh) {
    if (failed) return;
    const uint32_t layer = static_cast<uint32_t>(lh / c.num_kv_heads);
    const uint32_t head = static_cast<uint32_t>(lh % c.num_kv_heads);
    Rng r{f.seed * 0x9e3779b1ULL + static_cast<uint64_t>(lh) * 0x100000001b3ULL};
    std::vector<uint16_t> k(static_cast<size_t>(P) * d), v(static_cast<size_t>(P) * d);
    std::vector<float> centre(d);
    std::vector<kvstore::PageWrite> writes;
    std::vector<kvstore::SummaryWrite> sums;
    auto flush = [&]() -> absl::Status {
      absl::Status s = doc->host->Put(writes, {});
      if (s.ok() && !sums.empty()) s = doc->summary_host->Put({}, sums);
      writes.clear();
      sums.clear();
      return s;
    };
    for (int64_t p = 0; p < doc->pages; ++p) {
      const int valid = static_cast<int>(std::min<int64_t>(P, tokens - p * P));
      float* sum = &doc->summaries[(static_cast<size_t>(lh) * doc->pages + p) * 2 * d];
      for (int j = 0; j < d; ++j) {
        centre[j] = 1.5f * r.Uniform();
        sum[j] = INFINITY;
        sum[d + j] = -INFINITY;
      }
      for (int t = 0; t < valid; ++t) {
        for (int j = 0; j < d; ++j) {
          const uint16_t kb = ToBf16(centre[j] + 0.5f * (r.Uniform() + r.Uniform()));
          k[static_cast<size_t>(t) * d + j] = kb;
          v[static_cast<size_t>(t) * d + j] = ToBf16(0.5f * (r.Uniform() + r.Uniform()));
          const float kf = FromBf16(kb);
          sum[j] = std::min(sum[j], kf);
          sum[d + j] = std::max(sum[d + j], kf);
        }
      }
      absl::StatusOr<std::string> enc =
          kvstore::EncodePage(shape, TensorView(k.data(), DType::kBF16, {valid, d}),
                              TensorView(v.data(), DType::kBF16, {valid, d}));
      absl::StatusOr<kvstore::PageRef> buf =
          enc.ok() ? kvstore::PageBuffer::Copy(*enc, doc->allocator.get())
                   : absl::StatusOr<kvstore::PageRef>(enc.status());
      absl::Status s = buf.status();
      if (s.ok()) {
        writes.push_back(kvstore::PageWrite{kvstore::PageKey{doc->id, layer, head,
                                                             static_cast<uint32_t>(p)},
                                            *std::move(buf)});
        if (host_summaries) {
          absl::StatusOr<kvstore::PageRef> sb = kvstore::PageBuffer::Copy(absl::string_view(
              reinterpret_cast<const char*>(sum), 2 * d * sizeof(float)));
          s = sb.status();
          if (s.ok()) {
            sums.push_back(kvstore::SummaryWrite{
                kvstore::SummaryKey{doc->id, layer, head, 1, static_cast<uint32_t>(p)},
                *std::move(sb)});
          }
        }
      }
      if (s.ok() && writes.size() >= 1024) s = flush();
      if (!s.ok()) {
        std::lock_guard<std::mutex> l(error_mu);
        if (!failed.exchange(true)) first_error = s;
        return;
      }
    }
    absl::Status s = flush();
    if (!s.ok()) {
      std::lock_guard<std::mutex> l(error_mu);
      if (!failed.exchange(true)) first_error = s;
    }
  });
  if (failed) return first_error;
  if (doc->host->num_entries() != total_pages ||
      (host_summaries && doc->summary_host->num_entries() != total_pages)) {
    return absl::InternalError(absl::StrCat("host tier holds ", doc->host->num_entries(),
                                            " entries, expected ", total_pages));
  }
  doc->seconds = sw.ElapsedSeconds();
  return doc;
}

// The device chooser (see the file comment). Called by GpuCacheAttention for KV heads 0..hkv-1 of
// a layer in turn with the same q: head 0 runs the selection of every head, the others read it.
class DeviceChooser {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceChooser>> Create(const model::ModelConfig& c,
                                                               kernels::Backend* backend,
                                                               const Document& doc,
                                                               const Flags& f) {
    auto ch = std::unique_ptr<DeviceChooser>(new DeviceChooser);
    ch->backend_ = backend;
    ch->hkv_ = static_cast<int>(c.num_kv_heads);
    ch->hq_ = static_cast<int>(c.num_heads);
    ch->d_ = static_cast<int>(c.head_dim);
    ch->pages_ = doc.pages;
    ch->doc_tokens_ = doc.tokens;
    ch->page_size_ = f.page_size;
    ch->window_first_ = std::max<int64_t>(1, doc.pages - f.window_pages);
    ch->k_ = std::max<int64_t>(1, f.budget_tokens / f.page_size);
    const int64_t n = ch->window_first_ - 1;  // middle candidates
    const size_t layer_floats = static_cast<size_t>(ch->hkv_) * doc.pages * 2 * ch->d_;
    ch->summary_dtype_ = f.summary_dtype == "bf16" ? DType::kBF16 : DType::kF32;
    std::vector<uint16_t> rounded;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const void* src = doc.summaries.data() + l * layer_floats;
      size_t bytes = layer_floats * sizeof(float);
      if (ch->summary_dtype_ == DType::kBF16) {
        rounded.resize(layer_floats);
        kernels::MinMaxRowsToBF16(doc.summaries.data() + l * layer_floats,
                                  static_cast<int64_t>(ch->hkv_) * doc.pages, ch->d_,
                                  rounded.data());
        src = rounded.data();
        bytes = layer_floats * sizeof(uint16_t);
      }
      STRATA_ASSIGN_OR_RETURN(auto buf, backend->Allocate(bytes));
      STRATA_RETURN_IF_ERROR(backend->CopyToDevice(buf->data(), src, bytes, nullptr));
      ch->summaries_.push_back(std::move(buf));
    }
    STRATA_ASSIGN_OR_RETURN(ch->q_, backend->Allocate(static_cast<size_t>(ch->hq_) * ch->d_ * 4));
    STRATA_ASSIGN_OR_RETURN(
        ch->scores_, backend->Allocate(static_cast<size_t>(ch->hq_) * std::max<int64_t>(1, n) * 4));
    STRATA_ASSIGN_OR_RETURN(ch->selected_,
                            backend->Allocate(static_cast<size_t>(ch->hkv_) * ch->k_ * 4));
    ch->host_selected_.resize(static_cast<size_t>(ch->hkv_) * ch->k_);
    if (f.cache_theta <= 1.0) {
      STRATA_ASSIGN_OR_RETURN(ch->cache_, engine::DeviceSelectionCache::Create(
                                              backend, static_cast<int>(c.num_layers), ch->hkv_,
                                              ch->hq_ / ch->hkv_, ch->d_, ch->k_, f.cache_theta));
    }
    STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    return ch;
  }

  absl::Status Choose(int layer, int kv_head, const float* q, int num_tokens, int num_q_heads,
                      std::vector<int32_t>* pages) {
    if (num_tokens != 1 || num_q_heads != hq_ || layer < 0 ||
        layer >= static_cast<int>(summaries_.size())) {
      return absl::InvalidArgumentError("DeviceChooser: one query token of the model's heads only");
    }
    if (kv_head == 0) {
      Stopwatch sw;
      const int64_t n = window_first_ - 1;
      const int group = hq_ / hkv_;
      if (n > 0) {
        STRATA_RETURN_IF_ERROR(
            backend_->CopyToDevice(q_->data(), q, static_cast<size_t>(hq_) * d_ * 4, nullptr));
        STRATA_ASSIGN_OR_RETURN(const TensorView chosen,
                                Enqueue(layer, q_->View(DType::kF32, {hq_, d_}), group, n));
        STRATA_RETURN_IF_ERROR(backend_->CopyToHost(host_selected_.data(), chosen.data,
                                                    host_selected_.size() * 4, nullptr));
      } else {
        std::fill(host_selected_.begin(), host_selected_.end(), -1);
      }
      seconds_ += sw.ElapsedSeconds();
    }
    if (kv_head < 0 || kv_head >= hkv_) return absl::InvalidArgumentError("DeviceChooser: head");
    engine::AppendChosenPages(&host_selected_[static_cast<size_t>(kv_head) * k_], k_, window_first_,
                              pages_, pages);
    return absl::OkStatus();
  }

  // The device path: q is already in backend memory ([num_tokens = 1, hq, d]); one copy of the
  // selection [hkv, k] to the host (which also waits for the step's queued work).
  // With `sel`, also the selection for SelectedAttention: page 0, the selected pages (token ids
  // through fanout page_size), the window pages.
  absl::Status ChooseDevice(int layer, const TensorView& q,
                            std::vector<std::vector<int32_t>>* pages,
                            engine::DeviceTokenSelection* sel) {
    if (q.rank != 3 || q.dim(0) != 1 || q.dim(1) != hq_ || q.dim(2) != d_ || layer < 0 ||
        layer >= static_cast<int>(summaries_.size()) ||
        (pages != nullptr && static_cast<int>(pages->size()) != hkv_)) {
      return absl::InvalidArgumentError("DeviceChooser: one query token of the model's heads only");
    }
    Stopwatch sw;
    const int64_t n = window_first_ - 1;
    const int group = hq_ / hkv_;
    TensorView chosen;
    if (n > 0) {
      STRATA_ASSIGN_OR_RETURN(chosen,
                              Enqueue(layer, TensorView(q.data, DType::kF32, {hq_, d_}), group, n));
      if (pages != nullptr || log_ != nullptr) {  // null: a device-managed cache
        Stopwatch copy;
        STRATA_RETURN_IF_ERROR(backend_->CopyToHost(host_selected_.data(), chosen.data,
                                                    host_selected_.size() * 4, nullptr));
        copy_seconds_ += copy.ElapsedSeconds();
      }
    } else {
      std::fill(host_selected_.begin(), host_selected_.end(), -1);
    }
    if (log_ != nullptr) {
      const int32_t l32 = layer;
      if (std::fwrite(&l32, 4, 1, log_) != 1 ||
          std::fwrite(host_selected_.data(), 4, host_selected_.size(), log_) !=
              host_selected_.size()) {
        return absl::InternalError("DeviceChooser: selection log write failed");
      }
    }
    for (int g = 0; pages != nullptr && g < hkv_; ++g) {
      engine::AppendChosenPages(&host_selected_[static_cast<size_t>(g) * k_], k_, window_first_,
                                pages_, &(*pages)[g]);
    }
    if (sel != nullptr) {
      sel->valid = true;
      sel->prefix_end = std::min<int64_t>(doc_tokens_, page_size_);
      sel->middle.parents = chosen;
      sel->middle.fanout = page_size_;
      sel->middle.begin = page_size_;
      sel->middle.end = window_first_ * page_size_;
      if (n <= 0) {  // no middle pages
        sel->middle.parents = TensorView();
        sel->middle.end = sel->middle.begin;
      }
      sel->suffix_begin = window_first_ * page_size_;
      sel->suffix_end = doc_tokens_;
    }
    seconds_ += sw.ElapsedSeconds();
    return absl::OkStatus();
  }

  // Selection-cache hits so far (the device's count; waits for the queued work); 0 without it.
  absl::StatusOr<int64_t> CacheHits() {
    if (cache_ == nullptr) return 0;
    return cache_->ReadHits(nullptr);
  }
  // Appends each layer's selection to `log` (not owned; null: off). See SelectionLog.
  void set_log(std::FILE* log) { log_ = log; }
  double seconds() const { return seconds_; }
  // Of seconds(): the selection copies to the host (in the device path, the wait for the step's
  // queued GPU work up to this layer's selection).
  double copy_seconds() const { return copy_seconds_; }
  int64_t device_bytes() const {
    return static_cast<int64_t>(summaries_.size()) * hkv_ * pages_ * 2 * d_ *
           static_cast<int64_t>(kernels::DTypeSize(summary_dtype_));
  }

 private:
  DeviceChooser() = default;
  kernels::Backend* backend_ = nullptr;
  int hkv_ = 0, hq_ = 0, d_ = 0;
  int64_t pages_ = 0, window_first_ = 0, k_ = 0, doc_tokens_ = 0, page_size_ = 0;
  std::vector<std::unique_ptr<kernels::Buffer>> summaries_;
  // The selection of `layer` for q [hq, d] (backend memory): through the selection cache when it
  // is on (its kept rows; heads whose query is similar keep last step's), else into selected_.
  absl::StatusOr<TensorView> Enqueue(int layer, const TensorView& q, int group, int64_t n) {
    const TensorView sums = summaries_[layer]->View(summary_dtype_, {hkv_, pages_, 2 * d_});
    const TensorView sc = scores_->View(DType::kF32, {hkv_, group, n});
    if (cache_ != nullptr) {
      // The check in the selection op (on CUDA inside its kernel), as the worker's lazy chooser.
      return engine::EnqueueCachedMinMaxPageTopK(backend_, q, sums, window_first_, k_, sc,
                                                 *cache_, layer);
    }
    const TensorView chosen = selected_->View(DType::kI32, {hkv_, k_});
    STRATA_RETURN_IF_ERROR(
        engine::EnqueueMinMaxPageTopK(backend_, q, sums, window_first_, k_, sc, chosen));
    return chosen;
  }

  std::unique_ptr<kernels::Buffer> q_, scores_, selected_;
  DType summary_dtype_ = DType::kF32;
  std::unique_ptr<engine::DeviceSelectionCache> cache_;
  std::vector<int32_t> host_selected_;
  double seconds_ = 0;
  double copy_seconds_ = 0;
  std::FILE* log_ = nullptr;
};

// Greedy next token: on the device (Backend::Sample at temperature 0 over Transformer::
// device_logits(), 4 bytes back) with --device_sample=1, else the host argmax of the copied
// logits (lowest id on ties, as engine::Sampler).
class NextToken {
 public:
  static absl::StatusOr<std::unique_ptr<NextToken>> Create(kernels::Backend* backend,
                                                           bool device, bool pipelined) {
    auto nt = std::unique_ptr<NextToken>(new NextToken);
    nt->backend_ = backend;
    nt->device_ = device;
    nt->pipelined_ = device && pipelined;
    if (device) {
      STRATA_ASSIGN_OR_RETURN(nt->row_, backend->Allocate(sizeof(kernels::SampleRow)));
      STRATA_ASSIGN_OR_RETURN(nt->token_, backend->Allocate(sizeof(int32_t)));
      if (nt->pipelined_) {
        STRATA_ASSIGN_OR_RETURN(nt->host_, backend->AllocateHost(2 * sizeof(int32_t)));
      }
      const kernels::SampleRow greedy;  // temperature 0
      STRATA_RETURN_IF_ERROR(backend->CopyToDevice(nt->row_->data(), &greedy, sizeof(greedy),
                                                   nullptr));
    }
    return nt;
  }
  bool device() const { return device_; }
  // With pipelining (--pipeline=1, device picks only) a pick stays on the device for the next
  // step, which reads it through ForwardOptions::device_token; it reaches the host one step later.
  bool pipelined() const { return pipelined_; }
  const int32_t* device_token() const {
    return token_ != nullptr ? static_cast<const int32_t*>(token_->data()) : nullptr;
  }
  // After a Forward with ForwardOptions::logits_on_device = device(): the greedy pick into
  // *token, or, pipelined, the pick is queued (into the device token and a host slot behind a
  // mark, without waiting) and *token becomes the pick before it, once two are queued.
  absl::Status Advance(engine::Transformer* tf, const std::vector<float>& host_logits,
                       int32_t* token) {
    if (!device_) {
      *token = static_cast<int32_t>(std::max_element(host_logits.begin(), host_logits.end()) -
                                    host_logits.begin());
      return absl::OkStatus();
    }
    kernels::SampleParams p;
    p.logits = tf->device_logits();
    p.rows = static_cast<const kernels::SampleRow*>(row_->data());
    p.tokens = token_->View(DType::kI32, {1});
    STRATA_RETURN_IF_ERROR(backend_->Sample(p, nullptr));
    if (!pipelined_) {
      STRATA_RETURN_IF_ERROR(backend_->CopyToHost(token, token_->data(), sizeof(int32_t), nullptr));
      return *token < 0 ? absl::InternalError("Sample: no finite logit") : absl::OkStatus();
    }
    const int slot = (first_ + pending_) % 2;
    int32_t* h = static_cast<int32_t*>(host_->data()) + slot;
    STRATA_RETURN_IF_ERROR(backend_->CopyToHostAsync(h, token_->data(), sizeof(int32_t), nullptr));
    STRATA_ASSIGN_OR_RETURN(marks_[slot], backend_->RecordMark(nullptr));
    ++pending_;
    return pending_ > 1 ? Take(token) : absl::OkStatus();
  }
  // The picks still queued, in order, the last into *token.
  absl::Status Drain(int32_t* token) {
    while (pending_ > 0) STRATA_RETURN_IF_ERROR(Take(token));
    return absl::OkStatus();
  }

 private:
  NextToken() = default;
  // The oldest queued pick into *token (waits for its mark).
  absl::Status Take(int32_t* token) {
    const int slot = first_;
    first_ = (first_ + 1) % 2;
    --pending_;
    STRATA_RETURN_IF_ERROR(backend_->WaitMark(marks_[slot]));
    *token = static_cast<const int32_t*>(host_->data())[slot];
    return *token < 0 ? absl::InternalError("Sample: no finite logit") : absl::OkStatus();
  }
  kernels::Backend* backend_ = nullptr;
  bool device_ = false, pipelined_ = false;
  std::unique_ptr<kernels::Buffer> row_, token_, host_;
  int64_t marks_[2] = {0, 0};
  int first_ = 0, pending_ = 0;
};

// f.warmup unmeasured then `measured` greedy one-token steps over `cache` with a dense policy,
// from *token at positions start, start + 1, ... (fo: the steps' ForwardOptions; picks as
// --device_sample, pipelined with `pipelined`); *token ends as the last pick. Returns the seconds
// of the measured steps.
absl::StatusOr<double> GreedySteps(engine::Transformer* tf, kernels::Backend* backend,
                                   engine::KvCache* cache, engine::ForwardOptions fo,
                                   int64_t start, int measured, int64_t vocab, const Flags& f,
                                   bool pipelined, int32_t* token) {
  auto dense = engine::MakeDensePolicy();
  STRATA_ASSIGN_OR_RETURN(auto next, NextToken::Create(backend, f.device_sample != 0, pipelined));
  fo.logits_on_device = next->device();
  std::vector<float> logits(static_cast<size_t>(vocab));
  const int steps = f.warmup + measured;
  Stopwatch sw;
  double t0 = 0;
  for (int step = 0; step < steps; ++step) {
    if (step == f.warmup) {
      STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
      t0 = sw.ElapsedSeconds();
    }
    engine::ForwardOptions fs = fo;
    if (next->pipelined() && step > 0) fs.device_token = next->device_token();
    STRATA_RETURN_IF_ERROR(
        tf->Forward(token, 1, start + step, cache, dense.get(), logits.data(), false, fs));
    STRATA_RETURN_IF_ERROR(next->Advance(tf, logits, token));
  }
  STRATA_RETURN_IF_ERROR(next->Drain(token));
  STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  return sw.ElapsedSeconds() - t0;
}

// Times the hook's Attend calls.
class TimedAttention : public engine::ExternalAttention {
 public:
  explicit TimedAttention(engine::ExternalAttention* inner) : inner_(inner) {}
  absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      std::vector<engine::AttentionPartial>* parts) override {
    Stopwatch sw;
    absl::Status s = inner_->Attend(layer, q, num_tokens, num_q_heads, q_begin, parts);
    seconds_ += sw.ElapsedSeconds();
    return s;
  }
  bool AttendsOnDevice() const override { return inner_->AttendsOnDevice(); }
  bool CapturableOnDevice() const override { return inner_->CapturableOnDevice(); }
  absl::Status AttendOnDevice(int layer, const TensorView& q, int64_t q_begin,
                              const TensorView& out, const TensorView& lse) override {
    Stopwatch sw;
    absl::Status s = inner_->AttendOnDevice(layer, q, q_begin, out, lse);
    seconds_ += sw.ElapsedSeconds();
    return s;
  }
  double seconds() const { return seconds_; }

 private:
  engine::ExternalAttention* inner_;
  double seconds_ = 0;
};

// The correlated query stream of the document passes (--query_correlation=rho > 0; papers/DIGEST.md,
// TokenSelect's query-similarity study): the hook sees, per layer, q'_t = rho q'_{t-1} +
// sqrt(1 - rho^2) q_t instead of the model's query q_t (q'_{-1} = 0), so consecutive queries
// have cosine ~rho, as a real model's do (TokenSelect Fig. 3a), where random weights give
// unrelated queries. One scaled Backend::Add per layer on the device path (capturable in the
// step's graph); the same arithmetic on the host for the host path. Only the document's
// attention sees q'; the local cache's attention keeps q_t.
class CorrelatedQueries : public engine::ExternalAttention {
 public:
  static absl::StatusOr<std::unique_ptr<CorrelatedQueries>> Create(engine::ExternalAttention* inner,
                                                                   kernels::Backend* backend,
                                                                   const model::ModelConfig& c,
                                                                   double rho) {
    auto cq = std::unique_ptr<CorrelatedQueries>(new CorrelatedQueries);
    cq->inner_ = inner;
    cq->backend_ = backend;
    cq->rho_ = static_cast<float>(rho);
    cq->fresh_ = static_cast<float>(std::sqrt(1.0 - rho * rho));
    cq->n_ = c.num_heads * c.head_dim;
    cq->hq_ = c.num_heads;
    cq->d_ = c.head_dim;
    const std::vector<float> zeros(static_cast<size_t>(cq->n_), 0.0f);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      STRATA_ASSIGN_OR_RETURN(auto buf, backend->Allocate(zeros.size() * sizeof(float)));
      STRATA_RETURN_IF_ERROR(
          backend->CopyToDevice(buf->data(), zeros.data(), zeros.size() * sizeof(float), nullptr));
      cq->device_.push_back(std::move(buf));
      cq->host_.push_back(zeros);
    }
    STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    return cq;
  }
  absl::Status Attend(int layer, const float* q, int num_tokens, int num_q_heads, int64_t q_begin,
                      std::vector<engine::AttentionPartial>* parts) override {
    if (num_tokens != 1 || layer < 0 || layer >= static_cast<int>(host_.size()) ||
        static_cast<int64_t>(num_q_heads) * d_ != n_) {
      return inner_->Attend(layer, q, num_tokens, num_q_heads, q_begin, parts);
    }
    std::vector<float>& s = host_[static_cast<size_t>(layer)];
    for (int64_t i = 0; i < n_; ++i) s[i] = std::fma(rho_, s[i], fresh_ * q[i]);
    return inner_->Attend(layer, s.data(), num_tokens, num_q_heads, q_begin, parts);
  }
  bool AttendsOnDevice() const override { return inner_->AttendsOnDevice(); }
  bool CapturableOnDevice() const override { return inner_->CapturableOnDevice(); }
  absl::Status AttendOnDevice(int layer, const TensorView& q, int64_t q_begin,
                              const TensorView& out, const TensorView& lse) override {
    if (layer < 0 || layer >= static_cast<int>(device_.size()) || q.NumElements() != n_) {
      return absl::InvalidArgumentError("CorrelatedQueries: one query token of the model's heads");
    }
    const TensorView s = device_[static_cast<size_t>(layer)]->View(DType::kF32, {1, hq_, d_});
    kernels::AddParams p;
    p.a = s;
    p.b = TensorView(q.data, DType::kF32, {1, hq_, d_});
    p.out = s;
    p.a_scale = rho_;
    p.b_scale = fresh_;
    STRATA_RETURN_IF_ERROR(backend_->Add(p, nullptr));
    return inner_->AttendOnDevice(layer, s, q_begin, out, lse);
  }
  absl::Status PrepareCapture(int num_q_heads) override {
    return inner_->PrepareCapture(num_q_heads);
  }
  void OnReplayedStep(int64_t q_begin) override { inner_->OnReplayedStep(q_begin); }

 private:
  CorrelatedQueries() = default;
  engine::ExternalAttention* inner_ = nullptr;
  kernels::Backend* backend_ = nullptr;
  float rho_ = 0, fresh_ = 1;
  int64_t n_ = 0, hq_ = 0, d_ = 0;
  std::vector<std::unique_ptr<kernels::Buffer>> device_;
  std::vector<std::vector<float>> host_;
};

struct RunResult {
  std::string shape;
  std::string chooser;
  int64_t context = 0;
  int tokens = 0;
  double tok_s = 0;
  double ms_total = 0, ms_select = 0, ms_fill = 0, ms_attend_rest = 0, ms_rest = 0;
  // Of ms_select: the selection copies to the host. Of ms_fill: source lookups, other gather
  // work, PageCopy calls (checks + launch), host waits.
  double ms_select_copy = 0, ms_fill_source = 0, ms_fill_gather = 0, ms_fill_copy = 0,
         ms_fill_wait = 0;
  std::string hook = "host";
  double cache_create_s = 0;
  int64_t graph_steps = 0;  // one-token steps replayed as a CUDA graph
  int64_t selected_calls = 0;  // hook calls attended through SelectedAttention  // GpuPageCache::Create (with hold_source_pages: every lookup)
  double hit_ratio = 0;
  double fill_mb_per_token = 0;
  int64_t cache_slots = 0;
  int64_t doc_pages_total = 0;
  double gpu_weights_gib = 0, gpu_ready_gib = 0, gpu_end_gib = 0;
  double host_kv_gib = 0;
  double doc_seconds = 0;
  int64_t pages_per_step = 0;
  int32_t last_token = 0;
  int64_t agree_same = 0, agree_total = 0;  // device vs host chooser, warm-up steps
  // Selection-cache hits over (layer, KV head) choices of the measured steps (NaN: no cache).
  double selection_reuse = NAN;
  double rho = 0, theta = 2;  // the pass's query correlation and cache threshold
  int pipeline = 0;  // the pass's --pipeline
};

// Prefill of `tokens` random token ids from position 0 into a fresh bf16 KvCache (see the file
// comment): dense attention when `policy` is "dense", else through a DevicePolicy of that kind
// (default PolicyOptions, token_budget `budget` when > 0). A warm-up Forward of one chunk (two for
// a sparse policy) into its own cache runs first (kernel loading, cuBLAS handles), untimed. The
// last token's logits go to *logits_out when it is set.
absl::Status Prefill(const std::string& name, const model::ModelConfig& c,
                     const model::ModelWeights& weights, kernels::Backend* backend, int64_t tokens,
                     const Flags& f, const std::string& policy, int budget = 0,
                     std::vector<float>* logits_out = nullptr,
                     kernels::MatMulPrecision precision = kernels::MatMulPrecision::kSplit) {
  engine::TransformerOptions to;
  to.prefill_chunk_size = f.prefill_chunk;
  to.matmul_precision = precision;
  STRATA_ASSIGN_OR_RETURN(to.weight_format, engine::ParseWeightFormat(f.weight_format));
  // The dense reference decode (--dense_decode_tokens) after a dense prefill: one-token steps
  // as graphs with --decode_graph (the prefill's chunks are not one-token steps).
  const int decode_steps = policy == "dense" && logits_out == nullptr && f.dense_decode_tokens > 0
                               ? f.warmup + f.dense_decode_tokens
                               : 0;
  to.decode_graph = decode_steps > 0 && f.decode_graph != 0;
  STRATA_ASSIGN_OR_RETURN(auto tf, engine::Transformer::Create(c, weights, backend, to));
  const double gpu_weights = GpuUsedGiB();
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  Rng r{f.seed * 31 + static_cast<uint64_t>(tokens)};
  for (int32_t& id : ids) id = static_cast<int32_t>(r.Next() % static_cast<uint64_t>(c.vocab_size));
  std::vector<float> logits(static_cast<size_t>(c.vocab_size));
  auto dense = engine::MakeDensePolicy();
  const bool sparse = policy != "dense";
  engine::sparse::PolicyOptions po;
  if (sparse) {
    STRATA_ASSIGN_OR_RETURN(po.kind, engine::sparse::ParsePolicyName(policy));
    po.page_size = f.page_size;
    if (budget > 0) po.token_budget = budget;
  }
  // The options of a Forward over `cache` (a DevicePolicy made for it when sparse).
  std::unique_ptr<engine::sparse::DevicePolicy> dp;
  auto options_for = [&](const engine::KvCache& cache) -> absl::StatusOr<engine::ForwardOptions> {
    engine::ForwardOptions fo;
    if (!sparse) return fo;
    dp.reset();
    STRATA_ASSIGN_OR_RETURN(dp, engine::sparse::DevicePolicy::Create(po, cache.options(),
                                                                     c.num_heads, backend));
    fo.device_policy = dp.get();
    fo.device_prefill = true;
    return fo;
  };
  {
    const int64_t w = std::min<int64_t>(tokens, (sparse ? 2 : 1) * int64_t{f.prefill_chunk});
    STRATA_ASSIGN_OR_RETURN(auto warm, engine::KvCache::Create(
                                           tf->MakeCacheOptions(w, f.page_size, DType::kBF16), backend));
    STRATA_ASSIGN_OR_RETURN(const engine::ForwardOptions fo, options_for(*warm));
    STRATA_RETURN_IF_ERROR(
        tf->Forward(ids.data(), w, 0, warm.get(), dense.get(), logits.data(), false, fo));
    STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  }
  const double gpu_warm = GpuUsedGiB();  // the warm-up's cache freed, its scratch kept
  STRATA_ASSIGN_OR_RETURN(
      auto cache, engine::KvCache::Create(
                      tf->MakeCacheOptions(tokens + decode_steps, f.page_size, DType::kBF16),
                      backend));
  const double gpu_cache = GpuUsedGiB();
  STRATA_ASSIGN_OR_RETURN(const engine::ForwardOptions fo, options_for(*cache));
  const double gpu_ready = GpuUsedGiB();
  Stopwatch sw;
  STRATA_RETURN_IF_ERROR(
      tf->Forward(ids.data(), tokens, 0, cache.get(), dense.get(), logits.data(), false, fo));
  STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  const double s = sw.ElapsedSeconds();
  double checksum = 0;
  for (float x : logits) checksum += std::isfinite(x) ? x : 1e30;
  const double n = static_cast<double>(tokens);
  const double attn_flop = 4.0 * c.num_layers * c.num_heads * c.head_dim * n * n / 2;
  const double q_dim = static_cast<double>(c.num_heads) * c.head_dim;
  const double kv_dim = static_cast<double>(c.num_kv_heads) * c.head_dim;
  const double h = static_cast<double>(c.hidden_size);
  const double linear_flop =
      2.0 * c.num_layers * (h * (q_dim + 2 * kv_dim) + q_dim * h + 3.0 * h * c.intermediate_size) *
          n +
      2.0 * h * c.vocab_size;  // LM head of the last token only
  const double attended =
      dp != nullptr && dp->counters().candidate_tokens > 0
          ? static_cast<double>(dp->counters().selected_tokens) / dp->counters().candidate_tokens
          : 1.0;
  std::printf("prefill shape=%s policy=%s matmul=%s budget=%d tokens=%" PRId64
              " chunk=%d seconds=%.2f "
              "tok_s=%.0f attention_tflop=%.1f effective_attention_tflops=%.1f "
              "linear_tflops=%.1f "
              "attended_fraction=%.4f gpu_used_GiB weights=%.2f after_warmup=%.2f "
              "cache=%.2f ready=%.2f end=%.2f logits_sum=%.4g\n",
              name.c_str(), policy.c_str(), engine::MatMulPrecisionName(precision),
              sparse ? po.token_budget : 0, tokens, f.prefill_chunk, s, n / s, attn_flop / 1e12,
              attn_flop / 1e12 / s, linear_flop / 1e12 / s, attended, gpu_weights, gpu_warm,
              gpu_cache, gpu_ready, GpuUsedGiB(),
              checksum);
  std::fflush(stdout);
  if (!std::isfinite(checksum) || checksum >= 1e30) {
    return absl::InternalError("prefill: non-finite logits");
  }
  if (logits_out != nullptr) *logits_out = logits;
  if (decode_steps == 0) return absl::OkStatus();
  // The dense reference: greedy steps from the prefill's last logits, each attending to every
  // token of the cache.
  int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                       logits.begin());
  STRATA_ASSIGN_OR_RETURN(const double dt,
                          GreedySteps(tf.get(), backend, cache.get(), engine::ForwardOptions(),
                                      tokens, f.dense_decode_tokens, c.vocab_size, f, false,
                                      &token));
  std::printf("dense_decode shape=%s context=%" PRId64 " tokens=%d decode_graph=%d tok_s=%.1f "
              "ms_per_token=%.3f last_token=%d gpu_used_GiB=%.2f\n",
              name.c_str(), tokens, f.dense_decode_tokens, to.decode_graph ? 1 : 0,
              f.dense_decode_tokens / dt, 1e3 * dt / f.dense_decode_tokens, token, GpuUsedGiB());
  std::fflush(stdout);
  return absl::OkStatus();
}

// --prefill_check: dense vs DevicePolicy prefill of the same tokens (see the file comment).
absl::Status PrefillCheck(const std::string& name, const model::ModelConfig& c,
                          const model::ModelWeights& weights, kernels::Backend* backend,
                          int64_t tokens, const Flags& f, kernels::MatMulPrecision precision) {
  std::vector<float> dense, all, sparse;
  STRATA_RETURN_IF_ERROR(
      Prefill(name, c, weights, backend, tokens, f, "dense", 0, &dense, precision));
  STRATA_RETURN_IF_ERROR(Prefill(name, c, weights, backend, tokens, f, "tokenselect",
                                 static_cast<int>(tokens), &all, precision));
  STRATA_RETURN_IF_ERROR(
      Prefill(name, c, weights, backend, tokens, f, "tokenselect", 0, &sparse, precision));
  double d_all = 0, d_sparse = 0, scale = 0;
  for (size_t i = 0; i < dense.size(); ++i) {
    d_all = std::max(d_all, std::fabs(static_cast<double>(all[i]) - dense[i]));
    d_sparse = std::max(d_sparse, std::fabs(static_cast<double>(sparse[i]) - dense[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(dense[i])));
  }
  std::printf("prefill_check shape=%s tokens=%" PRId64 " max_abs_dense_logit=%.4g "
              "covering_budget_max_abs_diff=%.4g default_budget_max_abs_diff=%.4g %s\n",
              name.c_str(), tokens, scale, d_all, d_sparse,
              d_all <= 1e-2 * std::max(1.0, scale) ? "OK" : "MISMATCH");
  std::fflush(stdout);
  if (!(d_all <= 1e-2 * std::max(1.0, scale))) {
    return absl::InternalError("prefill_check: covering budget differs from dense");
  }
  return absl::OkStatus();
}

// The same decode steps (positions after the document, local cache, greedy tokens) with no
// attention to the document at all: the model's own cost per token on this backend.
absl::Status DecodeNoDocument(const model::ModelConfig& c, engine::Transformer* tf,
                              kernels::Backend* backend, int64_t doc_tokens, int measured,
                              const Flags& f, RunResult* res) {
  const int steps = f.warmup + measured;
  STRATA_ASSIGN_OR_RETURN(
      auto local, engine::KvCache::Create(tf->MakeCacheOptions(steps + 8, f.page_size,
                                                               DType::kBF16),
                                          backend));
  engine::ForwardOptions fo;
  fo.cache_first_position = doc_tokens;
  int32_t token = static_cast<int32_t>(f.seed % 1000) + 100;
  STRATA_ASSIGN_OR_RETURN(const double total,
                          GreedySteps(tf, backend, local.get(), fo, doc_tokens, measured,
                                      c.vocab_size, f, f.pipeline != 0, &token));
  res->tokens = measured;
  res->tok_s = measured / total;
  res->ms_total = res->ms_rest = 1e3 * total / measured;
  res->hit_ratio = NAN;
  res->gpu_ready_gib = res->gpu_end_gib = GpuUsedGiB();
  return absl::OkStatus();
}

absl::Status Decode(const model::ModelConfig& c, engine::Transformer* tf,
                    kernels::Backend* backend, const Document& doc, bool device_chooser,
                    bool device_hook, int measured, const Flags& f, RunResult* res,
                    bool managed = false) {
  const int P = f.page_size;
  const int64_t heads = c.num_layers * c.num_kv_heads;
  kvstore::GpuCacheOptions go;
  go.document = doc.id;
  go.num_layers = static_cast<int>(c.num_layers);
  go.num_kv_heads = static_cast<int>(c.num_kv_heads);
  go.pages_per_head = doc.pages;
  go.page_size = P;
  go.head_dim = static_cast<int>(c.head_dim);
  go.num_slots = std::max<int64_t>(1, static_cast<int64_t>(f.cache_fraction * heads * doc.pages));
  go.source = doc.host.get();
  go.in_place_allocator = doc.allocator.get();
  go.hold_source_pages = f.hold_source_pages != 0 || managed;
  go.device_managed = managed;
  Stopwatch create_watch;
  STRATA_ASSIGN_OR_RETURN(auto cache, kvstore::GpuPageCache::Create(go, backend));
  res->cache_create_s = create_watch.ElapsedSeconds();
  res->cache_slots = go.num_slots;
  res->doc_pages_total = heads * doc.pages;

  std::unique_ptr<DeviceChooser> dev;
  engine::GpuCacheAttentionOptions ao;
  ao.document_tokens = doc.tokens;
  ao.device_path = device_hook;
  res->hook = !device_hook           ? "host"
              : managed               ? (tf->options().decode_graph ? "managed-graph" : "managed")
              : f.selected_attention ? "device-selected"
                                     : "device";
  double host_chooser_seconds = 0;
  engine::MinMaxChooserOptions mo;
  mo.store = doc.summary_host.get();
  mo.document = doc.id;
  mo.summary_kind = 1;
  mo.num_layers = static_cast<int>(c.num_layers);
  mo.num_kv_heads = static_cast<int>(c.num_kv_heads);
  mo.head_dim = static_cast<int>(c.head_dim);
  mo.num_pages = doc.pages;
  mo.budget_pages = std::max(1, f.budget_tokens / P);
  mo.window_pages = f.window_pages;
  // With host summaries, the device selections of the warm-up steps are compared with the host
  // MinMaxChooser's on the same queries (pages chosen by both / pages chosen).
  struct Agreement {
    bool on = false;
    int64_t same = 0, total = 0;
  };
  auto agree = std::make_shared<Agreement>();
  if (device_chooser) {
    STRATA_ASSIGN_OR_RETURN(dev, DeviceChooser::Create(c, backend, doc, f));
    DeviceChooser* d = dev.get();
    engine::PageChooser check;
    if (mo.store != nullptr) {
      check = engine::MakeMinMaxChooser(mo);
      agree->on = true;
    }
    ao.chooser = [d, check, agree](int layer, int g, const float* q, int nt, int nq,
                                   std::vector<int32_t>* pages) -> absl::Status {
      STRATA_RETURN_IF_ERROR(d->Choose(layer, g, q, nt, nq, pages));
      if (agree->on) {
        std::vector<int32_t> want;
        STRATA_RETURN_IF_ERROR(check(layer, g, q, nt, nq, &want));
        std::vector<int32_t> both;
        std::set_intersection(pages->begin(), pages->end(), want.begin(), want.end(),
                              std::back_inserter(both));
        agree->same += static_cast<int64_t>(both.size());
        agree->total += static_cast<int64_t>(want.size());
      }
      return absl::OkStatus();
    };
    if (device_hook) {
      // q stays on the device (the agreement check needs host q: host hook only).
      agree->on = false;
      ao.chooser = nullptr;
      const bool selected = f.selected_attention != 0 || managed;
      ao.device_chooser = [d, selected](int layer, const TensorView& q,
                                        std::vector<std::vector<int32_t>>* pages,
                                        engine::DeviceTokenSelection* sel) {
        return d->ChooseDevice(layer, q, pages, selected ? sel : nullptr);
      };
    }
  } else {
    if (mo.store == nullptr) return absl::FailedPreconditionError("no host summaries");
    engine::PageChooser inner = engine::MakeMinMaxChooser(mo);
    double* acc = &host_chooser_seconds;
    ao.chooser = [inner, acc](int layer, int g, const float* q, int nt, int nq,
                              std::vector<int32_t>* pages) {
      Stopwatch sw;
      absl::Status s = inner(layer, g, q, nt, nq, pages);
      *acc += sw.ElapsedSeconds();
      return s;
    };
  }
  // The selection log: a header of int64s (magic 0x53454c4c4f473031 "SELLOG01", layers, KV
  // heads, k, pages per head, first window page, cache slots, page size, warm-up steps), then per
  // layer call its layer (int32) and selection [kv_heads, k] (int32 page ids, -1 none).
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> log(nullptr, &std::fclose);
  if (!f.selection_log.empty()) {
    if (!device_chooser || !device_hook || tf->options().decode_graph) {
      return absl::InvalidArgumentError(
          "--selection_log needs the device chooser and a device hook without graphs");
    }
    const std::string path = absl::StrCat(f.selection_log, ".", res->shape, ".", doc.tokens, ".",
                                          f.pass_index, ".bin");
    log.reset(std::fopen(path.c_str(), "wb"));
    if (log == nullptr) return absl::InternalError(absl::StrCat("cannot write ", path));
    const int64_t header[9] = {0x53454c4c4f473031,
                               c.num_layers,
                               c.num_kv_heads,
                               std::max<int64_t>(1, f.budget_tokens / P),
                               doc.pages,
                               std::max<int64_t>(1, doc.pages - f.window_pages),
                               go.num_slots,
                               P,
                               f.warmup};
    if (std::fwrite(header, sizeof(header), 1, log.get()) != 1) {
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
    dev->set_log(log.get());
  }
  STRATA_ASSIGN_OR_RETURN(auto gca, engine::GpuCacheAttention::Create(ao, cache.get(), backend));
  TimedAttention timed(gca.get());
  std::unique_ptr<CorrelatedQueries> correlated;
  if (f.query_correlation > 0) {
    STRATA_ASSIGN_OR_RETURN(correlated,
                            CorrelatedQueries::Create(&timed, backend, c, f.query_correlation));
  }
  res->gpu_ready_gib = GpuUsedGiB();

  const int steps = f.warmup + measured;
  STRATA_ASSIGN_OR_RETURN(
      auto local, engine::KvCache::Create(tf->MakeCacheOptions(steps + 8, P, DType::kBF16),
                                          backend));
  auto dense = engine::MakeDensePolicy();
  engine::ForwardOptions fo;
  fo.cache_first_position = doc.tokens;
  fo.external = correlated != nullptr ? static_cast<engine::ExternalAttention*>(correlated.get())
                                      : &timed;
  STRATA_ASSIGN_OR_RETURN(auto next,
                          NextToken::Create(backend, f.device_sample != 0, f.pipeline != 0));
  fo.logits_on_device = next->device();
  const int64_t V = c.vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  int32_t token = static_cast<int32_t>(f.seed % 1000) + 100;
  Stopwatch sw;
  double t0 = 0, sel0 = 0, attend0 = 0, fill0 = 0, selcopy0 = 0;
  kvstore::GpuCacheStats s0;
  int64_t pages0 = 0, reuse0 = 0;
  for (int step = 0; step < steps; ++step) {
    if (step == f.warmup) {
      agree->on = false;  // the check is not part of the measured steps
      STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
      if (device_chooser) {
        STRATA_ASSIGN_OR_RETURN(reuse0, dev->CacheHits());
      }
      t0 = sw.ElapsedSeconds();
      sel0 = device_chooser ? dev->seconds() : host_chooser_seconds;
      selcopy0 = device_chooser ? dev->copy_seconds() : 0;
      attend0 = timed.seconds();
      if (managed) STRATA_RETURN_IF_ERROR(cache->SyncDeviceStats());
      s0 = cache->stats();
      fill0 = s0.gather_seconds + s0.copy_seconds + s0.wait_seconds;
      pages0 = gca->counters().pages_attended;
    }
    const int64_t pos = doc.tokens + step;
    engine::ForwardOptions fs = fo;
    if (next->pipelined() && step >= f.prompt) fs.device_token = next->device_token();
    STRATA_RETURN_IF_ERROR(
        tf->Forward(&token, 1, pos, local.get(), dense.get(), logits.data(), false, fs));
    if (step + 1 >= f.prompt) {  // generated: greedy
      STRATA_RETURN_IF_ERROR(next->Advance(tf, logits, &token));
    } else {  // prompt tokens: a fixed pseudo-random sequence
      token = static_cast<int32_t>((static_cast<int64_t>(token) * 7919 + 13) % V);
    }
  }
  STRATA_RETURN_IF_ERROR(next->Drain(&token));
  STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  const double total = sw.ElapsedSeconds() - t0;
  if (managed) STRATA_RETURN_IF_ERROR(cache->SyncDeviceStats());
  const kvstore::GpuCacheStats s1 = cache->stats();
  const double sel = (device_chooser ? dev->seconds() : host_chooser_seconds) - sel0;
  const double attend = timed.seconds() - attend0;
  const double fill = s1.gather_seconds + s1.copy_seconds + s1.wait_seconds - fill0;
  res->tokens = measured;
  res->tok_s = measured / total;
  res->ms_total = 1e3 * total / measured;
  res->ms_select = 1e3 * sel / measured;
  res->ms_fill = 1e3 * fill / measured;
  res->ms_attend_rest = 1e3 * (attend - sel - fill) / measured;
  res->ms_rest = 1e3 * (total - attend) / measured;
  res->ms_select_copy = 1e3 * ((device_chooser ? dev->copy_seconds() : 0) - selcopy0) / measured;
  res->ms_fill_source = 1e3 * (s1.source_seconds - s0.source_seconds) / measured;
  res->ms_fill_gather = 1e3 * (s1.gather_seconds - s0.gather_seconds -
                               (s1.source_seconds - s0.source_seconds)) / measured;
  res->ms_fill_copy = 1e3 * (s1.copy_seconds - s0.copy_seconds) / measured;
  res->ms_fill_wait = 1e3 * (s1.wait_seconds - s0.wait_seconds) / measured;
  const int64_t lookups = s1.lookups - s0.lookups;
  res->hit_ratio = lookups > 0 ? static_cast<double>(s1.hits - s0.hits) / lookups : NAN;
  res->fill_mb_per_token = static_cast<double>(s1.fill_bytes - s0.fill_bytes) / measured / 1e6;
  // Device-managed: the hook does not see the page lists; the cache counts one lookup per
  // distinct page a layer's selection names (the same pages here).
  res->pages_per_step = managed ? lookups / measured
                                : (gca->counters().pages_attended - pages0) / measured;
  res->gpu_end_gib = GpuUsedGiB();
  res->last_token = token;
  res->selected_calls = gca->counters().selected_attention;
  res->graph_steps = tf->graph_steps();
  if (device_chooser && f.cache_theta <= 1.0) {
    STRATA_ASSIGN_OR_RETURN(const int64_t reuse1, dev->CacheHits());
    res->selection_reuse = static_cast<double>(reuse1 - reuse0) /
                           (static_cast<double>(measured) * c.num_layers * c.num_kv_heads);
  }
  res->agree_same = agree->same;
  res->agree_total = agree->total;
  return absl::OkStatus();
}

void Print(const RunResult& r) {
  std::printf(
      "RESULT shape=%s chooser=%s hook=%s context=%" PRId64 " tokens=%d tok/s=%.1f ms/token=%.2f "
      "[select %.2f (copy to host %.2f), fills %.2f (source %.2f, gather %.2f, PageCopy %.2f, "
      "wait %.2f), attend-hook rest %.2f, rest of forward %.2f] hit=%.4f "
      "fill=%.1f MB/token pages/step=%" PRId64 " slots=%" PRId64 " of %" PRId64
      " pages gpu_used_GiB weights=%.2f ready=%.2f end=%.2f host_kv_GiB=%.2f doc_gen_s=%.1f "
      "last_token=%d cache_create_s=%.2f selected_attention_calls=%" PRId64
      " graph_steps=%" PRId64 " rho=%.3f theta=%.3f selection_reuse=%.4f pipeline=%d\n",
      r.shape.c_str(), r.chooser.c_str(), r.hook.c_str(), r.context, r.tokens, r.tok_s,
      r.ms_total, r.ms_select, r.ms_select_copy, r.ms_fill, r.ms_fill_source, r.ms_fill_gather,
      r.ms_fill_copy, r.ms_fill_wait, r.ms_attend_rest, r.ms_rest, r.hit_ratio,
      r.fill_mb_per_token, r.pages_per_step, r.cache_slots, r.doc_pages_total, r.gpu_weights_gib,
      r.gpu_ready_gib, r.gpu_end_gib, r.host_kv_gib, r.doc_seconds, r.last_token,
      r.cache_create_s, r.selected_calls, r.graph_steps, r.rho, r.theta, r.selection_reuse,
      r.pipeline);
  if (r.agree_total > 0) {
    std::printf("  device selection vs host MinMaxChooser (warm-up steps): %" PRId64 " of %" PRId64
                " pages agree (%.4f)\n",
                r.agree_same, r.agree_total, static_cast<double>(r.agree_same) / r.agree_total);
  }
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    if (!ParseFlag(argv[i], &f)) {
      std::fprintf(stderr, "bad flag %s (see the file comment)\n", argv[i]);
      return 2;
    }
  }
  std::vector<int> pipelines;  // checked by ParseFlag
  for (absl::string_view e : absl::StrSplit(f.pipelines, ',', absl::SkipEmpty())) {
    pipelines.push_back(0);
    (void)absl::SimpleAtoi(e, &pipelines.back());
  }
  f.pipeline = pipelines.front();  // of the passes without a list
  std::vector<int64_t> contexts;
  for (absl::string_view s : absl::StrSplit(f.contexts, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v < f.page_size * 4) {
      std::fprintf(stderr, "bad context %s\n", std::string(s).c_str());
      return 2;
    }
    contexts.push_back(v);
  }
  std::vector<kernels::MatMulPrecision> precisions;
  for (absl::string_view s : absl::StrSplit(f.matmul_precision, ',', absl::SkipEmpty())) {
    absl::StatusOr<kernels::MatMulPrecision> p = engine::ParseMatMulPrecision(s);
    if (!p.ok()) {
      std::fprintf(stderr, "bad --matmul_precision: %s\n", p.status().ToString().c_str());
      return 2;
    }
    precisions.push_back(*p);
  }
  if (precisions.empty()) {
    std::fprintf(stderr, "bad --matmul_precision: empty\n");
    return 2;
  }
  const absl::StatusOr<engine::WeightFormat> weight_format =
      engine::ParseWeightFormat(f.weight_format);
  if (!weight_format.ok()) {
    std::fprintf(stderr, "bad --weight_format: %s\n", weight_format.status().ToString().c_str());
    return 2;
  }
  if (f.gpu_memory_cap_gib > 0 && f.backend == "cuda" && !TakeBallast(f.gpu_memory_cap_gib)) {
    return 1;
  }
  const double gpu_before = GpuUsedGiB();
  kernels::BackendOptions bo;
  bo.kind = f.backend == "cpu" ? kernels::BackendKind::kCpu : kernels::BackendKind::kCuda;
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend_or = kernels::MakeBackend(bo);
  if (!backend_or.ok()) {
    std::fprintf(stderr, "decode_e2e_bench: no %s backend: %s\n", f.backend.c_str(),
                 backend_or.status().ToString().c_str());
    return 1;
  }
  kernels::Backend* backend = backend_or->get();
  std::printf("backend: %s; GPU memory used before the backend: %.2f GiB\n",
              backend->Name().c_str(), gpu_before);
  std::vector<RunResult> results;
  int failures = 0;
  for (absl::string_view shape : absl::StrSplit(f.shapes, ',', absl::SkipEmpty())) {
    model::RandomModelOptions mo;
    mo.preset = std::string(shape);
    mo.dtype = DType::kBF16;
    absl::StatusOr<model::ModelConfig> config = model::RandomModelConfig(mo);
    if (!config.ok()) {
      std::fprintf(stderr, "%s: %s\n", mo.preset.c_str(), config.status().ToString().c_str());
      return 1;
    }
    int64_t longest = contexts.back();
    for (absl::string_view pc : absl::StrSplit(f.prefill_contexts, ',', absl::SkipEmpty())) {
      int64_t n = 0;
      if (absl::SimpleAtoi(pc, &n)) longest = std::max(longest, n);
    }
    config->max_position_embeddings =
        std::max<int64_t>(config->max_position_embeddings, longest + 4096);
    Stopwatch wsw;
    auto weights = MakeWeights(*config, f.seed, NumThreads(f));
    std::printf("model %s: weights made in %.1f s\n", mo.preset.c_str(), wsw.ElapsedSeconds());
    // The prefill passes first, each with its own Transformer, before the decode passes' one is
    // made: only one copy of the weights is on the device while a prefill runs.
    for (absl::string_view pc : absl::StrSplit(f.prefill_contexts, ',', absl::SkipEmpty())) {
      int64_t n = 0;
      if (!absl::SimpleAtoi(pc, &n) || n < 1) {
        std::fprintf(stderr, "bad prefill context %s\n", std::string(pc).c_str());
        return 2;
      }
      for (kernels::MatMulPrecision prec : precisions) {
        for (absl::string_view pp : absl::StrSplit(f.prefill_policy, ',', absl::SkipEmpty())) {
          absl::Status s = Prefill(mo.preset, *config, weights->weights, backend, n, f,
                                   std::string(pp), 0, nullptr, prec);
          if (!s.ok()) {
            std::printf("FAILED shape=%s prefill=%" PRId64 " policy=%s matmul=%s: %s\n",
                        mo.preset.c_str(), n, std::string(pp).c_str(),
                        engine::MatMulPrecisionName(prec), s.ToString().c_str());
            std::fflush(stdout);
            ++failures;
          }
        }
      }
    }
    if (f.prefill_check > 0) {
      absl::Status s = PrefillCheck(mo.preset, *config, weights->weights, backend,
                                    f.prefill_check, f, precisions.front());
      if (!s.ok()) {
        std::printf("FAILED shape=%s prefill_check=%" PRId64 ": %s\n", mo.preset.c_str(),
                    f.prefill_check, s.ToString().c_str());
        std::fflush(stdout);
        ++failures;
      }
    }
    Stopwatch usw;
    engine::TransformerOptions to;
    to.prefill_chunk_size = 16;
    to.matmul_precision = precisions.front();  // decode passes: the first listed precision
    to.weight_format = *weight_format;
    absl::StatusOr<std::unique_ptr<engine::Transformer>> tf =
        engine::Transformer::Create(*config, weights->weights, backend, to);
    if (!tf.ok()) {
      std::fprintf(stderr, "%s: Transformer::Create: %s\n", mo.preset.c_str(),
                   tf.status().ToString().c_str());
      return 1;
    }
    const double gpu_weights = GpuUsedGiB();
    std::printf("model %s: %s; weights uploaded in %.1f s; GPU used %.2f GiB; "
                "decode matmul precision %s; weight format %s\n",
                mo.preset.c_str(), config->DebugString().c_str(), usw.ElapsedSeconds(),
                gpu_weights, engine::MatMulPrecisionName(to.matmul_precision),
                engine::WeightFormatName(to.weight_format));
    std::fflush(stdout);
    if (f.no_document_pass) {
      RunResult r;
      r.shape = mo.preset;
      r.chooser = "no-document";
      r.context = contexts.front();
      r.gpu_weights_gib = gpu_weights;
      absl::Status s = DecodeNoDocument(*config, tf->get(), backend, contexts.front(), f.tokens,
                                        f, &r);
      if (!s.ok()) {
        std::printf("FAILED shape=%s no-document: %s\n", mo.preset.c_str(),
                    s.ToString().c_str());
        ++failures;
      } else {
        Print(r);
        results.push_back(r);
      }
    }
    for (int pipeline : pipelines) {
      if (!(f.no_document_pass && f.decode_graph)) break;
      engine::TransformerOptions tgo = to;
      tgo.decode_graph = true;
      absl::StatusOr<std::unique_ptr<engine::Transformer>> tg =
          engine::Transformer::Create(*config, weights->weights, backend, tgo);
      RunResult r;
      r.shape = mo.preset;
      r.chooser = "no-document-graph";
      r.context = contexts.front();
      r.pipeline = pipeline;
      r.gpu_weights_gib = gpu_weights;
      Flags pass_flags = f;
      pass_flags.pipeline = pipeline;
      absl::Status s = tg.status();
      if (s.ok()) {
        s = DecodeNoDocument(*config, tg->get(), backend, contexts.front(), f.tokens, pass_flags,
                             &r);
      }
      if (!s.ok()) {
        std::printf("FAILED shape=%s no-document-graph: %s\n", mo.preset.c_str(),
                    s.ToString().c_str());
        ++failures;
      } else {
        std::printf("  decode_graph: %" PRId64 " steps replayed as a graph\n",
                    (*tg)->graph_steps());
        Print(r);
        results.push_back(r);
      }
    }
    for (int64_t ctx : contexts) {
      if (f.no_document_pass == 2) break;
      const bool host_cmp = ctx <= f.host_chooser_max_context;
      absl::StatusOr<std::unique_ptr<Document>> doc =
          MakeDocument(*config, backend, ctx, host_cmp, f);
      if (!doc.ok()) {
        std::printf("FAILED shape=%s context=%" PRId64 ": document: %s\n", mo.preset.c_str(), ctx,
                    doc.status().ToString().c_str());
        ++failures;
        continue;
      }
      struct Pass {
        bool device_chooser, device_hook, selected, managed, graph;
        double rho = 0, theta = 2;
        int pipeline = 0;
      };
      std::vector<Pass> passes;
      std::vector<double> rhos, thetas;
      for (absl::string_view e : absl::StrSplit(f.query_correlations, ',', absl::SkipEmpty())) {
        rhos.push_back(0);
        (void)absl::SimpleAtod(e, &rhos.back());  // checked by ParseFlag
      }
      for (absl::string_view e : absl::StrSplit(f.cache_thetas, ',', absl::SkipEmpty())) {
        thetas.push_back(2);
        (void)absl::SimpleAtod(e, &thetas.back());
      }
      for (absl::string_view h : absl::StrSplit(f.hooks, ',', absl::SkipEmpty())) {
        const bool selected = h == "device-selected" || (h == "device" && f.selected_attention);
        const bool managed = h == "managed" || h == "managed-graph";
        for (double rho : rhos) {
          for (double theta : thetas) {
            for (int pipeline : pipelines) {
              passes.push_back({true, h != "host", selected, managed, h == "managed-graph", rho,
                                theta, pipeline});
            }
          }
        }
      }
      if (host_cmp) passes.push_back({false, false, false, false, false});
      int pass_index = 0;
      for (const auto& [device_chooser, device_hook, selected, managed, graph, rho, theta,
                        pipeline] : passes) {
        Flags pass_flags = f;
        pass_flags.selected_attention = selected ? 1 : 0;
        pass_flags.query_correlation = rho;
        pass_flags.cache_theta = theta;
        pass_flags.pipeline = pipeline;
        pass_flags.pass_index = pass_index++;
        RunResult r;
        r.shape = mo.preset;
        r.chooser = device_chooser ? "device" : "host-minmax";
        r.context = ctx;
        r.rho = rho;
        r.theta = theta;
        r.pipeline = pipeline;
        r.gpu_weights_gib = gpu_weights;
        r.host_kv_gib = static_cast<double>((*doc)->allocator->reserved_bytes()) / (1 << 30);
        r.doc_seconds = (*doc)->seconds;
        engine::Transformer* run_tf = tf->get();
        std::unique_ptr<engine::Transformer> graph_tf;
        absl::Status s;
        if (graph) {  // a Transformer of its own: each managed-graph pass captures afresh
          engine::TransformerOptions tgo = to;
          tgo.decode_graph = true;
          absl::StatusOr<std::unique_ptr<engine::Transformer>> tg =
              engine::Transformer::Create(*config, weights->weights, backend, tgo);
          s = tg.status();
          if (s.ok()) {
            graph_tf = *std::move(tg);
            run_tf = graph_tf.get();
          }
        }
        if (s.ok()) {
          s = Decode(*config, run_tf, backend, **doc, device_chooser, device_hook,
                     device_chooser ? f.tokens : f.host_tokens, pass_flags, &r, managed);
        }
        if (!s.ok()) {
          std::printf("FAILED shape=%s chooser=%s context=%" PRId64 ": %s\n", mo.preset.c_str(),
                      r.chooser.c_str(), ctx, s.ToString().c_str());
          std::fflush(stdout);
          ++failures;
          continue;
        }
        Print(r);
        results.push_back(r);
      }
    }
  }
  std::printf("\n| shape | chooser | hook | rho | theta | reuse | pipeline | context | tok/s | "
              "ms/token | select | fills | attend rest | rest | hit ratio | fill MB/tok | GPU GiB "
              "(weights / ready / end) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const RunResult& r : results) {
    std::printf("| %s | %s | %s | %.2f | %.2f | %.3f | %d | %" PRId64 " | %.1f | %.2f | "
                "%.2f | %.2f | %.2f | %.2f | %.3f | %.1f | %.2f / %.2f / %.2f |\n",
                r.shape.c_str(), r.chooser.c_str(), r.hook.c_str(), r.rho, r.theta,
                r.selection_reuse, r.pipeline, r.context, r.tok_s,
                r.ms_total, r.ms_select,
                r.ms_fill, r.ms_attend_rest, r.ms_rest, r.hit_ratio, r.fill_mb_per_token,
                r.gpu_weights_gib, r.gpu_ready_gib, r.gpu_end_gib);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::Main(argc, argv); }
