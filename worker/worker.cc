#include "worker/worker.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/attention_policy.h"
#include "engine/gpu_cache_attention.h"
#include "engine/kv_cache.h"
#include "engine/sampler.h"
#include "engine/sparse/device_policy.h"
#include "engine/sparse/policy.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvstore/document_id.h"
#include "kvstore/page_format.h"
#include "kvstore/tiered_store.h"
#include "model/tokenizer.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/internal/host_parallel.h"
#include "worker/lazy_attention.h"

namespace strata::worker {
namespace {

constexpr uint32_t kMinMaxSummaryKind = 1;  // v1::SUMMARY_KIND_MINMAX

// The integer in environment variable `name` when set and within [lo, hi], else `fallback`.
int64_t EnvCount(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* e = std::getenv(name);
  const int64_t v = e == nullptr ? fallback : std::atoll(e);
  return v >= lo && v <= hi ? v : fallback;
}

// Concurrent PutDeferred batches of a prefill chunk's pages: 8, or STRATA_PERSIST_WRITERS (1 to 16,
// read once; for A/B timing). H100 machine (16 cores), 512K on the 8B shape, ingested batches:
// persisted in 27.2 / 28.6 s with 8, 28.3-31.7 s with 4, 29.2 s with 12 (bench/RESULTS.md).
int64_t PersistWriters() {
  static const int64_t writers = EnvCount("STRATA_PERSIST_WRITERS", 8, 1, 16);
  return writers;
}

// Batches of a LoadPages read from the store at once, ahead of the one being copied into the
// cache: 4, or STRATA_LOAD_READERS (1 to 16, read once; for A/B timing). Two H200s, 8B shape, a
// 68K-token shard from the KV store service (bench/RESULTS.md, session 36): with 2 a mount took
// 9.8 s, 7.3 of them waiting for the store.
size_t LoadReaders() {
  static const size_t readers = static_cast<size_t>(EnvCount("STRATA_LOAD_READERS", 4, 1, 16));
  return readers;
}

prometheus::Family<prometheus::Counter>& NewCounterFamily(prometheus::Registry* r, const std::string& name,
                                                          const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(*r);
}

prometheus::Counter* NewCounter(prometheus::Registry* r, const std::string& name, const std::string& help) {
  return &NewCounterFamily(r, name, help).Add({});
}

void Inc(prometheus::Counter* c, double v) {
  if (c != nullptr && v > 0) c->Increment(v);
}

// Copies `bytes` at `src` (backend memory) to `dst` (host).
absl::Status ToHost(kernels::Backend* backend, void* dst, const void* src, size_t bytes) {
  STRATA_RETURN_IF_ERROR(backend->CopyToHost(dst, src, bytes, nullptr));
  return backend->Synchronize(nullptr);
}

absl::Status FromHost(kernels::Backend* backend, void* dst, const void* src, size_t bytes) {
  STRATA_RETURN_IF_ERROR(backend->CopyToDevice(dst, src, bytes, nullptr));
  return backend->Synchronize(nullptr);
}

kvstore::KvLayout LayoutOf(const model::ModelConfig& c, int page_size, const std::string& page_dtype) {
  kvstore::KvLayout layout;
  layout.num_layers = static_cast<int>(c.num_layers);
  layout.num_kv_heads = static_cast<int>(c.num_kv_heads);
  layout.page.dtype = ParseKvDType(page_dtype).value_or(kernels::DType::kBF16);
  layout.page.page_size = page_size;
  layout.page.head_dim = static_cast<int>(c.head_dim);
  return layout;
}

// FailedPrecondition naming both layouts when a document's KV layout is not this worker's (its
// model, --page-size and --kv-page-dtype).
absl::Status CheckLayout(const v1::KvLayout& document, const kvstore::KvLayout& mine) {
  const v1::KvLayout want = kvstore::LayoutToProto(mine);
  if (want.SerializeAsString() == document.SerializeAsString()) return absl::OkStatus();
  auto text = [](const v1::KvLayout& l) {
    return absl::StrCat(l.num_layers(), " layers x ", l.num_kv_heads(), " KV heads, head_dim ", l.head_dim(),
                        ", page_size ", l.page_size(), ", ", v1::PageDType_Name(l.dtype()));
  };
  return absl::FailedPreconditionError(absl::StrCat("the document's KV layout (", text(document),
                                                    ") does not match this worker's (", text(want), ")"));
}

// FailedPrecondition when a document was prefilled under another served model fingerprint than
// `mine` (another checkpoint, or the same one in another weight format: its KV differs). Documents
// that name none (written by other tools) are accepted.
absl::Status CheckFingerprint(const v1::Document& document, const std::string& mine) {
  if (document.model_fingerprint().empty() || document.model_fingerprint() == mine) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("document ", document.document_id(), " was prefilled by model '",
                                                    document.model_fingerprint(), "'; this worker serves '", mine,
                                                    "' (--weight-format must match too)"));
}

void AddCounters(WorkerMetrics* m, const engine::SelectionCounters& now, const engine::SelectionCounters& before) {
  if (m == nullptr) return;
  Inc(m->candidate_tokens, static_cast<double>(now.candidate_tokens - before.candidate_tokens));
  Inc(m->selected_tokens, static_cast<double>(now.selected_tokens - before.selected_tokens));
  Inc(m->selection_cache_lookups, static_cast<double>(now.cache_lookups - before.cache_lookups));
  Inc(m->selection_cache_hits, static_cast<double>(now.cache_hits - before.cache_hits));
}

// Policies DevicePolicy runs: quest and tokenselect with minmax summaries.
// One persisted page of a prefill shard: k and v ([valid, d] bf16, host) encoded in `shape`
// into pw->data, and the page's minmax summary (f32 min[d] then max[d]) into sw->data. The summary
// bounds the keys as stored: an fp8 page's decoded keys, which are what every later job attends.
absl::Status EncodePersistedPage(const kvstore::PageShape& shape, const uint16_t* k, const uint16_t* v, int valid,
                                 int d, kvstore::PageWrite* pw, kvstore::SummaryWrite* sw) {
  const kernels::TensorView kv(const_cast<uint16_t*>(k), kernels::DType::kBF16, {valid, d});
  const kernels::TensorView vv(const_cast<uint16_t*>(v), kernels::DType::kBF16, {valid, d});
  // Encoded straight into the page's buffer (no intermediate string).
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<kvstore::PageBuffer> page, kvstore::PageBuffer::Allocate(shape.EncodedBytes()));
  STRATA_RETURN_IF_ERROR(kvstore::EncodePageTo(shape, kv, vv, page->mutable_data()));
  // Scratch kept per thread (the encoding runs on a team, page after page).
  // The keys as stored, f32: for fp8 what DecodePage gives (codes times the page's K scale), for
  // bf16 the keys themselves. Only K is decoded; the page was just encoded, so its checksum is
  // not verified again.
  thread_local std::vector<float> stored;
  thread_local std::vector<float> summary;
  stored.resize(static_cast<size_t>(valid) * d);
  if (shape.dtype != kernels::DType::kBF16) {
    STRATA_ASSIGN_OR_RETURN(const kvstore::PageHeader header, kvstore::ParsePageHeader(page->view()));
    kernels::ConvertToF32(kvstore::PageKBytes(page->view()).data(), shape.dtype, stored.data(), static_cast<int64_t>(valid) * d);
    for (float& x : stored) x *= header.k_scale;
  } else {
    kernels::ConvertToF32(k, kernels::DType::kBF16, stored.data(), static_cast<int64_t>(valid) * d);
  }
  pw->data = std::move(page);
  summary.resize(2 * static_cast<size_t>(d));
  for (int j = 0; j < d; ++j) {
    summary[j] = std::numeric_limits<float>::infinity();
    summary[d + j] = -std::numeric_limits<float>::infinity();
  }
  for (int t = 0; t < valid; ++t) {
    for (int j = 0; j < d; ++j) {
      const size_t at = static_cast<size_t>(t) * d + j;
      const float x = stored[at];
      summary[j] = std::min(summary[j], x);
      summary[d + j] = std::max(summary[d + j], x);
    }
  }
  STRATA_ASSIGN_OR_RETURN(sw->data, kvstore::PageBuffer::Copy(absl::string_view(
                                        reinterpret_cast<const char*>(summary.data()), summary.size() * sizeof(float))));
  return absl::OkStatus();
}

// One persisted fp8 page of a prefill shard encoded on the backend (Backend::EncodeFp8Pages): its
// K then V codes ([P, d] each), scales (K, V) and key summary (min[d] then max[d]) framed into
// pw->data and sw->data.
absl::Status FramePersistedPage(const kvstore::PageShape& shape, const uint8_t* codes, const float* scales,
                                const float* summary, int valid, int d, kvstore::PageWrite* pw,
                                kvstore::SummaryWrite* sw) {
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<kvstore::PageBuffer> page, kvstore::PageBuffer::Allocate(shape.EncodedBytes()));
  const size_t half = static_cast<size_t>(shape.page_size) * d;
  STRATA_RETURN_IF_ERROR(
      kvstore::AssemblePage(shape, valid, scales[0], scales[1], codes, codes + half, page->mutable_data()));
  pw->data = std::move(page);
  STRATA_ASSIGN_OR_RETURN(sw->data, kvstore::PageBuffer::Copy(absl::string_view(
                                        reinterpret_cast<const char*>(summary), 2 * static_cast<size_t>(d) * sizeof(float))));
  return absl::OkStatus();
}

bool DeviceKind(const engine::sparse::PolicyOptions& o) {
  return (o.kind == engine::sparse::PolicyKind::kQuest || o.kind == engine::sparse::PolicyKind::kTokenSelect) &&
         o.EffectiveSummary() == engine::sparse::SummaryKind::kMinMax;
}

// Whether a decode step over a cache of up to `max_len` tokens can attend less than everything:
// some step's middle (between the sinks and the window) exceeds the budget on a layer that is
// not dense. Prompt chunks select no more than the last decode step (their window starts W
// tokens before their first query), so when this is false every policy is exact.
bool CanSelect(const engine::sparse::PolicyOptions& o, int64_t max_len, int num_layers) {
  if (static_cast<int>(o.dense_layers.size()) >= num_layers) {
    std::vector<bool> dense(num_layers, false);
    for (int l : o.dense_layers) {
      if (l < num_layers) dense[l] = true;
    }
    if (std::all_of(dense.begin(), dense.end(), [](bool b) { return b; })) return false;
  }
  const int64_t sink_end = std::min<int64_t>(o.sink_tokens, max_len);
  const int64_t window_begin = std::clamp<int64_t>(max_len - 1 - o.window_tokens, sink_end, max_len);
  return window_begin - sink_end > o.token_budget;
}

// Runs one decode step of device tokenselect and of device quest (two-level, so every selection op
// runs: UpdateSummaries, ScoreSummaries over segments and pages, ScoreKeys, VoteTopK,
// SelectedAttention) with the model's shape over a 3-page bf16 cache on `backend`, and checks
// that the lse came back finite. OK when the backend runs them; the first error otherwise (e.g.
// UNIMPLEMENTED for a head_dim the CUDA SelectedAttention lacks).
absl::Status ProbeDeviceSelection(const engine::Transformer& tf, int page_size, kernels::Backend* be) {
  const model::ModelConfig& c = tf.config();
  const int hq = static_cast<int>(c.num_heads), hkv = static_cast<int>(c.num_kv_heads);
  const int d = static_cast<int>(c.head_dim), P = page_size;
  const int64_t n = 3 * static_cast<int64_t>(P);
  const engine::KvCacheOptions co = tf.MakeCacheOptions(n, P, kernels::DType::kBF16);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::KvCache> cache, engine::KvCache::Create(co, be));
  std::vector<float> rows(static_cast<size_t>(n) * hkv * d);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.25f * std::sin(0.37f * static_cast<float>(i));
  std::vector<float> q(static_cast<size_t>(hq) * d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.5f * std::cos(0.11f * static_cast<float>(i));
  const size_t row_bytes = rows.size() * sizeof(float), q_bytes = q.size() * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> kv, be->Allocate(row_bytes));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> qb, be->Allocate(q_bytes));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> out, be->Allocate(q_bytes));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Buffer> lse, be->Allocate(sizeof(float) * hq));
  STRATA_RETURN_IF_ERROR(FromHost(be, kv->data(), rows.data(), row_bytes));
  STRATA_RETURN_IF_ERROR(FromHost(be, qb->data(), q.data(), q_bytes));
  const kernels::TensorView rv(kv->data(), kernels::DType::kF32, {n, hkv, d});
  for (int l = 0; l < c.num_layers; ++l) STRATA_RETURN_IF_ERROR(cache->Append(l, rv, rv));
  for (engine::sparse::PolicyKind kind : {engine::sparse::PolicyKind::kTokenSelect, engine::sparse::PolicyKind::kQuest}) {
    engine::sparse::PolicyOptions o;
    o.kind = kind;
    o.page_size = P;
    o.token_budget = 1;
    o.sink_tokens = 1;
    o.window_tokens = 1;
    o.segment_pages = 2;
    o.two_level_min_pages = 1;
    o.min_segments = 1;
    o.segment_factor = 1;
    o.tokenselect_candidate_factor = 1;
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::sparse::DevicePolicy> dp,
                            engine::sparse::DevicePolicy::Create(o, co, hq, be));
    for (int l = 0; l < c.num_layers; ++l) STRATA_RETURN_IF_ERROR(dp->OnAppend(l, *cache, 0, n, nullptr));
    STRATA_RETURN_IF_ERROR(dp->Attend(0, kernels::TensorView(qb->data(), kernels::DType::kF32, {1, hq, d}), *cache,
                                      kernels::TensorView(out->data(), kernels::DType::kF32, {1, hq, d}),
                                      kernels::TensorView(lse->data(), kernels::DType::kF32, {1, hq}), nullptr));
    std::vector<float> got(static_cast<size_t>(hq));
    STRATA_RETURN_IF_ERROR(ToHost(be, got.data(), lse->data(), got.size() * sizeof(float)));
    for (float x : got) {
      if (!std::isfinite(x)) {
        return absl::InternalError(absl::StrCat("device ", engine::sparse::PolicyName(kind),
                                                " probe: non-finite attention lse"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<kernels::DType> ParseKvDType(absl::string_view name) {
  if (name == "bf16") return kernels::DType::kBF16;
  if (name == "fp8") return kernels::DType::kFP8E4M3;
  return absl::InvalidArgumentError(absl::StrCat("KV element type: bf16|fp8, got '", name, "'"));
}

absl::Status WorkerOptions::Validate() const {
  if (worker_id.empty() || worker_id.size() > 128) return absl::InvalidArgumentError("worker_id: 1..128 chars");
  for (char ch : worker_id) {
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-')) {
      return absl::InvalidArgumentError("worker_id: [A-Za-z0-9._-] only");
    }
  }
  if (page_size < 1 || page_size > 4096) return absl::InvalidArgumentError("page_size in [1, 4096]");
  if (prefill_chunk_size < 0) {
    return absl::InvalidArgumentError("prefill_chunk_size >= 0 (0: 512 on the CPU backend, 4096 on others)");
  }
  if (max_jobs < 1) return absl::InvalidArgumentError("max_jobs >= 1");
  if (mount_batch_pages < 1) return absl::InvalidArgumentError("mount_batch_pages >= 1");
  if (max_decode_batch < 1) return absl::InvalidArgumentError("max_decode_batch >= 1");
  if (decode_batch_wait_us < 0 || decode_batch_wait_us > 10'000'000) {
    return absl::InvalidArgumentError("decode_batch_wait_us in [0, 10000000]");
  }
  if (peer_timeout_ms < 1) return absl::InvalidArgumentError("peer_timeout_ms >= 1");
  if (lazy_cache_pages < 0) return absl::InvalidArgumentError("lazy_cache_pages >= 0 (0: four decode steps' pages)");
  if (lazy_shared_documents < 0) return absl::InvalidArgumentError("lazy_shared_documents >= 0");
  if (decode_graph != "auto" && decode_graph != "on" && decode_graph != "off") {
    return absl::InvalidArgumentError(absl::StrCat("decode_graph: auto|on|off, got '", decode_graph, "'"));
  }
  if (shard_placement != "auto" && shard_placement != "host" && shard_placement != "device") {
    return absl::InvalidArgumentError(absl::StrCat("shard_placement: auto|host|device, got '", shard_placement, "'"));
  }
  if (device_selection != "auto" && device_selection != "on" && device_selection != "off") {
    return absl::InvalidArgumentError(absl::StrCat("device_selection: auto|on|off, got '", device_selection, "'"));
  }
  if (!engine::ParseWeightFormat(weight_format).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("weight_format: checkpoint|fp8, got '", weight_format, "'"));
  }
  if (!engine::ParseMatMulPrecision(matmul_precision).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("matmul_precision: split|bf16, got '", matmul_precision, "'"));
  }
  if (prefill_policy != "dense" && prefill_policy != "quest" && prefill_policy != "tokenselect") {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_policy: dense|quest|tokenselect, got '", prefill_policy, "'"));
  }
  if (prefill_budget_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prefill_budget_tokens >= 1, got ", prefill_budget_tokens));
  }
  if (!ParseKvDType(kv_page_dtype).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("kv_page_dtype: bf16|fp8, got '", kv_page_dtype, "'"));
  }
  if (!ParseKvDType(kv_cache_dtype).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("kv_cache_dtype: bf16|fp8, got '", kv_cache_dtype, "'"));
  }
  return absl::OkStatus();
}

WorkerMetrics::WorkerMetrics(prometheus::Registry* r) {
  prefill_tokens = NewCounter(r, "strata_prefill_tokens_total", "Tokens run through prefill (documents and prompts).");
  decode_tokens = NewCounter(r, "strata_decode_tokens_total", "Tokens generated by jobs this worker led.");
  decode_graph_steps = NewCounter(r, "strata_decode_graph_steps_total",
                                  "Decode steps replayed as one CUDA graph (--decode-graph).");
  candidate_tokens = NewCounter(r, "strata_attention_candidate_tokens_total",
                                "Context tokens that could have been attended, summed over (step, layer, KV head).");
  selected_tokens = NewCounter(r, "strata_attention_selected_tokens_total",
                               "Context tokens attended, summed over (step, layer, KV head).");
  selection_cache_lookups = NewCounter(r, "strata_selection_cache_lookups_total", "Selection-cache lookups.");
  selection_cache_hits = NewCounter(r, "strata_selection_cache_hits_total", "Selection-cache hits.");
  auto& lazy_jobs = NewCounterFamily(r, "strata_lazy_jobs_total",
                                     "Lazy-mount jobs by page cache: host_managed, or resident (device-managed, "
                                     "the document whole in the host tier).");
  lazy_jobs_host_managed = &lazy_jobs.Add({{"cache", "host_managed"}});
  lazy_jobs_resident = &lazy_jobs.Add({{"cache", "resident"}});
  time_to_first_token = &prometheus::BuildHistogram()
                             .Name("strata_time_to_first_token_seconds")
                             .Help("Time to the first generated token of a job.")
                             .Register(*r)
                             .Add({}, prometheus::Histogram::BucketBoundaries{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                                                              60, 120, 300, 600, 1800, 3600});
  auto& page_load = prometheus::BuildHistogram()
                        .Name("strata_page_load_seconds")
                        .Help("Loading a document's stored pages into a KV cache: a shard's mount (mount), the "
                              "earlier shards of an exact prefill (prefill), a full-mount job's document (job).")
                        .Register(*r);
  const prometheus::Histogram::BucketBoundaries load_buckets{0.01, 0.05, 0.1, 0.25, 0.5, 1,  2.5,
                                                             5,    10,   30,  60,   120, 300, 600};
  page_load_mount = &page_load.Add({{"use", "mount"}}, load_buckets);
  page_load_prefill = &page_load.Add({{"use", "prefill"}}, load_buckets);
  page_load_job = &page_load.Add({{"use", "job"}}, load_buckets);
  shard_attention_layers =
      NewCounter(r, "strata_shard_attention_layers_total",
                 "Layer calls of a sharded job's attention over the document's shards, on its leader.");
  auto& shard_seconds = NewCounterFamily(r, "strata_shard_attention_seconds_total",
                                         "Seconds of those calls in the leader's own shards (local), then waiting "
                                         "for the peers' answers (peers).");
  shard_attention_local_seconds = &shard_seconds.Add({{"part", "local"}});
  shard_attention_peer_seconds = &shard_seconds.Add({{"part", "peers"}});
  shard_answers = NewCounter(r, "strata_shard_answers_total",
                             "Layer queries of other workers' sharded jobs answered over selection streams.");
  auto& answer_seconds = NewCounterFamily(r, "strata_shard_answer_seconds_total",
                                          "Seconds of those answers: queueing the shard's selection and attention "
                                          "(queue), waiting for their results (wait), writing the answers (send).");
  shard_answer_queue_seconds = &answer_seconds.Add({{"part", "queue"}});
  shard_answer_wait_seconds = &answer_seconds.Add({{"part", "wait"}});
  shard_answer_send_seconds = &answer_seconds.Add({{"part", "send"}});
  auto& streams = NewCounterFamily(r, "strata_shard_selection_streams_total",
                                   "Selection streams of other workers' sharded jobs served, by transport: the "
                                   "selection link (link) or the gRPC ShardSelection stream (grpc).");
  selection_streams_link = &streams.Add({{"transport", "link"}});
  selection_streams_grpc = &streams.Add({{"transport", "grpc"}});
  inter_token_latency = &prometheus::BuildHistogram()
                             .Name("strata_inter_token_latency_seconds")
                             .Help("Time between consecutive generated tokens of a job.")
                             .Register(*r)
                             .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.0025, 0.005, 0.01, 0.02, 0.04,
                                                                              0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5});
}

struct Worker::JobResult {
  v1::JobInfo info;
};

std::string ServedFingerprint(const std::string& model_fingerprint, const std::string& weight_format) {
  const absl::StatusOr<engine::WeightFormat> format = engine::ParseWeightFormat(weight_format);
  return format.ok() && *format != engine::WeightFormat::kCheckpoint
             ? absl::StrCat(model_fingerprint, "+", engine::WeightFormatName(*format))
             : model_fingerprint;
}

std::string Worker::served_fingerprint() const {
  return ServedFingerprint(model_->fingerprint, options_.weight_format);
}

Worker::Worker(const WorkerOptions& options, const model::Model* model, kernels::Backend* backend,
               kvstore::PageStore* store, kvstore::DocumentCatalog* catalog, WorkerMetrics* metrics)
    : options_(options), model_(model), backend_(backend), store_(store), catalog_(catalog), metrics_(metrics) {}

Worker::~Worker() = default;

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options, const model::Model* model,
                                                       kernels::Backend* backend, kvstore::PageStore* store,
                                                       kvstore::DocumentCatalog* catalog, WorkerMetrics* metrics,
                                                       kernels::Backend* shard_backend) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (model == nullptr || backend == nullptr || store == nullptr || catalog == nullptr) {
    return absl::InvalidArgumentError("Worker::Create: model, backend, store and catalog are required");
  }
  if (shard_backend != nullptr && (shard_backend == backend || shard_backend->Name() == "cpu")) {
    return absl::InvalidArgumentError("Worker::Create: the shard backend must be a second GPU backend instance");
  }
  if (options.shard_placement == "device" && shard_backend == nullptr && backend->Name() != "cpu") {
    return absl::InvalidArgumentError(
        "shard_placement=device on a GPU worker needs a shard backend (a second instance of its backend)");
  }
  WorkerOptions resolved = options;
  if (resolved.prefill_chunk_size == 0) resolved.prefill_chunk_size = backend->Name() == "cpu" ? 512 : 4096;
  std::unique_ptr<Worker> w(new Worker(resolved, model, backend, store, catalog, metrics));
  engine::TransformerOptions topt;
  topt.prefill_chunk_size = w->options_.prefill_chunk_size;
  STRATA_ASSIGN_OR_RETURN(topt.matmul_precision, engine::ParseMatMulPrecision(options.matmul_precision));
  STRATA_ASSIGN_OR_RETURN(topt.weight_format, engine::ParseWeightFormat(options.weight_format));
  topt.decode_graph = options.decode_graph == "on" || (options.decode_graph == "auto" && backend->Name() != "cpu");
  STRATA_ASSIGN_OR_RETURN(w->transformer_, engine::Transformer::Create(model->config, model->weights, backend, topt));
  if (backend->Name() != "cpu") w->host_backend_ = kernels::MakeCpuBackend(0);
  if (options.shard_placement != "host") w->shard_device_ = shard_backend;
  w->shards_on_device_ = options.shard_placement == "device" || w->shard_device_ != nullptr;
  const bool selection_wanted =
      !(options.device_selection == "off" || (options.device_selection == "auto" && backend->Name() == "cpu"));
  // One probe serves both: decode steps (device_selection) and sparse prefill on a device backend.
  absl::Status probe = absl::FailedPreconditionError("not probed");
  const bool prefill_wanted = options.prefill_policy != "dense" && backend->Name() != "cpu";
  if (selection_wanted || prefill_wanted) probe = ProbeDeviceSelection(*w->transformer_, options.page_size, backend);
  if (prefill_wanted) w->device_prefill_ = probe;
  if (!selection_wanted) {
    w->device_selection_ = absl::FailedPreconditionError(
        absl::StrCat("device selection is ", options.device_selection, " on backend ", backend->Name()));
  } else {
    w->device_selection_ = probe;
    if (w->device_selection_.ok()) {
      STRATA_LOG(INFO) << "worker: quest/tokenselect decode steps select on backend " << backend->Name();
    } else {
      STRATA_LOG(WARNING) << "worker: backend " << backend->Name()
                          << " cannot run device selection for this model (" << w->device_selection_
                          << "); quest/tokenselect jobs use the "
                          << (backend->Name() == "cpu" ? "host policy" : "dense policy");
    }
  }
  return w;
}

void Worker::LogFallbackOnce(const std::string& what, std::atomic<bool>* flag) {
  if (flag == nullptr) flag = &fallback_logged_;
  if (!flag->exchange(true)) STRATA_LOG(WARNING) << "worker: " << what << " (logged once)";
}

void Worker::MakePrefillAttention(const engine::KvCacheOptions& cache_options,
                                  std::unique_ptr<engine::AttentionPolicy>* policy,
                                  std::unique_ptr<engine::sparse::DevicePolicy>* device) {
  *policy = engine::MakeDensePolicy();
  device->reset();
  if (options_.prefill_policy == "dense") return;
  const model::ModelConfig& c = model_->config;
  engine::sparse::PolicyOptions popt;
  popt.kind = options_.prefill_policy == "quest" ? engine::sparse::PolicyKind::kQuest
                                                 : engine::sparse::PolicyKind::kTokenSelect;
  popt.token_budget = options_.prefill_budget_tokens;
  popt.page_size = options_.page_size;
  popt.cache_theta = 2.0;  // no selection cache: every chunk selects (as the DevicePolicy does)
  auto fall_back = [&](const std::string& why) {
    LogFallbackOnce(absl::StrCat("prefill_policy ", options_.prefill_policy, " on backend ", backend_->Name(),
                                 " cannot be used (", why, "); documents are prefilled densely"),
                    &prefill_fallback_logged_);
  };
  if (backend_->Name() == "cpu") {
    absl::StatusOr<std::unique_ptr<engine::AttentionPolicy>> host = engine::sparse::MakeAttentionPolicy(
        popt, static_cast<int>(c.num_layers), static_cast<int>(c.num_heads), static_cast<int>(c.num_kv_heads),
        static_cast<int>(c.head_dim));
    if (host.ok()) {
      *policy = *std::move(host);
    } else {
      fall_back(host.status().ToString());
    }
    return;
  }
  if (!device_prefill_.ok()) {
    fall_back(device_prefill_.ToString());
    return;
  }
  absl::StatusOr<std::unique_ptr<engine::sparse::DevicePolicy>> created =
      engine::sparse::DevicePolicy::Create(popt, cache_options, static_cast<int>(c.num_heads), backend_);
  if (created.ok()) {
    *device = *std::move(created);
  } else {
    fall_back(created.status().ToString());
  }
}

v1::WorkerInfo Worker::Info() const {
  v1::WorkerInfo info;
  info.set_worker_id(options_.worker_id);
  {
    absl::MutexLock lock(&mu_);
    info.set_address(address_.empty() ? options_.address : address_);
    const size_t colon = info.address().rfind(':');
    if (selection_link_port_ > 0 && colon != std::string::npos) {
      info.set_selection_link_address(absl::StrCat(info.address().substr(0, colon), ":", selection_link_port_));
    }
  }
  info.set_model_fingerprint(served_fingerprint());
  *info.mutable_layout() = kvstore::LayoutToProto(LayoutOf(model_->config, options_.page_size, options_.kv_page_dtype));
  info.set_capacity_tokens(options_.capacity_tokens);
  info.set_max_jobs(options_.max_jobs);
  info.set_backend(backend_->Name());
  info.set_version("0.1");
  info.set_vocab_size(static_cast<uint32_t>(model_->config.vocab_size));
  return info;
}

void Worker::SetAddress(const std::string& address) {
  absl::MutexLock lock(&mu_);
  address_ = address;
}

void Worker::SetSelectionLinkPort(int port) {
  absl::MutexLock lock(&mu_);
  selection_link_port_ = port;
}

v1::WorkerLoad Worker::Load() const {
  absl::MutexLock lock(&mu_);
  v1::WorkerLoad load;
  load.set_running_jobs(static_cast<uint32_t>(jobs_.size()));
  load.set_prefilling_shards(static_cast<uint32_t>(prefilling_));
  load.set_mounted_tokens(MountedTokens());
  return load;
}

namespace {

// Attention to every token of an anchor cache (positions [0, a)), for ANCHOR prefill.
class AnchorAttention : public engine::ExternalAttention {
 public:
  AnchorAttention(kernels::Backend* backend, const engine::KvCache* anchor) : backend_(backend), anchor_(anchor) {}
  absl::Status Attend(int layer, const float* q, int n, int hq, int64_t q_begin,
                      std::vector<engine::AttentionPartial>* parts) override {
    parts->resize(1);
    selection_.Clear();
    selection_.offsets.push_back(0);
    for (int g = 0; g < anchor_->options().num_kv_heads; ++g) {
      anchor_->AppendSpans(layer, g, 0, anchor_->length(layer), &selection_.spans);
      selection_.offsets.push_back(static_cast<int32_t>(selection_.spans.size()));
    }
    return AttendSelection(backend_, *anchor_, layer, selection_, q, n, hq, q_begin, &scratch_, &(*parts)[0]);
  }

 private:
  kernels::Backend* const backend_;
  const engine::KvCache* const anchor_;
  engine::Selection selection_;
  AttendScratch scratch_;
};

// Policies a lazy mount serves: quest and tokenselect with minmax summaries (their default).
bool LazyEligible(const v1::SelectionPolicy& p) {
  if (p.name() != "quest" && p.name() != "tokenselect") return false;
  return p.summary() == v1::SUMMARY_KIND_MINMAX || p.summary() == v1::SUMMARY_KIND_UNSPECIFIED;
}

void AddTiers(kvstore::TierCounts* to, const kvstore::TierCounts& from) {
  to->host += from.host;
  to->local += from.local;
  to->remote += from.remote;
}

}  // namespace

absl::Status Worker::LoadPages(const kvstore::DocumentId& doc_id, int64_t doc_tokens, int64_t first_page,
                               int64_t end_page, kernels::Backend* backend, engine::KvCache* cache,
                               engine::AttentionPolicy* policy, engine::sparse::DevicePolicy* device,
                               const std::atomic<bool>* cancelled, absl::StatusCode missing_code,
                               bool fill_host, kvstore::TierCounts* pages_read, LoadTimes* times) {
  const model::ModelConfig& c = model_->config;
  const int L = static_cast<int>(c.num_layers), H = static_cast<int>(c.num_kv_heads), d = static_cast<int>(c.head_dim);
  const int P = options_.page_size;
  end_page = std::min<int64_t>(end_page, (doc_tokens + P - 1) / P);
  if (first_page >= end_page) return absl::OkStatus();
  const Stopwatch total;
  const int64_t batch_pages = options_.mount_batch_pages;
  // With a tiered store (host cache in front of the durable tier) the counts say which tier
  // served each page; otherwise every page came from the store's own tier.
  auto* tiered = dynamic_cast<kvstore::TieredStore*>(store_);
  const bool remote_tier = std::string(store_->tier()) == "remote";

  // The batches, layer by layer: pages [p0, p1) of every KV head of a layer, keys page-major. The
  // store is read LoadReaders() batches ahead on other threads while this one copies a batch into
  // the cache (a read from the KV store service is the slow part; the tiers are thread-safe).
  struct Batch {
    std::vector<kvstore::PageKey> keys;
    std::vector<kvstore::PageRef> pages;
    kvstore::TierCounts read;
    absl::Status status;
  };
  auto fetch = [this, tiered, remote_tier, fill_host, &doc_id, H](int l, int64_t p0, int64_t p1) {
    Batch b;
    for (int64_t p = p0; p < p1; ++p) {
      for (int g = 0; g < H; ++g) {
        b.keys.push_back({doc_id, static_cast<uint32_t>(l), static_cast<uint32_t>(g), static_cast<uint32_t>(p)});
      }
    }
    if (tiered != nullptr) {
      b.status = tiered->GetPages(b.keys, &b.pages, &b.read, fill_host);
    } else {
      b.status = store_->GetPages(b.keys, &b.pages);
      (remote_tier ? b.read.remote : b.read.local) += static_cast<int64_t>(b.keys.size());
    }
    return b;
  };
  std::vector<std::pair<int, int64_t>> order;  // (layer, p0) of each batch
  for (int l = 0; l < L; ++l) {
    for (int64_t p0 = first_page; p0 < end_page; p0 += batch_pages) order.emplace_back(l, p0);
  }
  const size_t fetch_ahead_batches = LoadReaders();
  std::deque<std::future<Batch>> ahead;  // an early return waits for these (future destructors)
  size_t next = 0;
  auto fetch_ahead = [&]() {
    while (ahead.size() < fetch_ahead_batches && next < order.size()) {
      const auto [l, p0] = order[next++];
      ahead.push_back(std::async(std::launch::async, fetch, l, p0, std::min(end_page, p0 + batch_pages)));
    }
  };

  // A bf16 cache takes the pages' K and V as they are stored (bf16 pages; fp8 ones dequantised to
  // bf16), each page verified and written into PageCopy staging in AllocateHost memory by the
  // host team, then one KvCache::AppendPages per batch (a single copy kernel on a GPU). Other
  // caches (fp8), or no AllocateHost memory: the pages decoded to f32 rows and appended.
  const size_t page_elems = static_cast<size_t>(P) * d;
  const size_t page_bytes = kernels::PageCopyBytes(P, d, kernels::DType::kBF16);
  const size_t batch_items = static_cast<size_t>(std::min<int64_t>(batch_pages, end_page - first_page)) * H;
  std::unique_ptr<kernels::Buffer> staging, slots;
  if (cache->options().dtype == kernels::DType::kBF16) {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> st = backend->AllocateHost(batch_items * page_bytes);
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> sl = backend->AllocateHost(batch_items * sizeof(int32_t));
    if (st.ok() && sl.ok()) {
      staging = *std::move(st);
      slots = *std::move(sl);
    }
  }
  std::vector<float> k_rows, v_rows;  // [tokens, H, d], the decoding path
  std::unique_ptr<kernels::Buffer> kdev, vdev;
  const bool host = backend->Name() == "cpu";
  double wait_s = 0;

  fetch_ahead();
  for (size_t bi = 0; bi < order.size(); ++bi) {
    if (cancelled != nullptr && cancelled->load()) return absl::CancelledError("cancelled while loading pages");
    const Stopwatch waited;
    Batch b = ahead.front().get();
    ahead.pop_front();
    wait_s += waited.ElapsedSeconds();
    fetch_ahead();
    STRATA_RETURN_IF_ERROR(b.status);
    AddTiers(pages_read, b.read);
    const int l = order[bi].first;
    const int64_t p0 = order[bi].second, p1 = std::min(end_page, p0 + batch_pages);
    for (size_t i = 0; i < b.keys.size(); ++i) {
      if (b.pages[i] == nullptr) {
        const kvstore::PageKey& k = b.keys[i];
        return absl::Status(missing_code, absl::StrCat("document ", doc_id.ToHex(), " page (layer ", k.layer,
                                                       ", head ", k.kv_head, ", page ", k.page_index,
                                                       ") is missing from the store"));
      }
    }
    const int64_t t0 = p0 * P, t1 = std::min(doc_tokens, p1 * P);
    const int64_t rows = t1 - t0;
    const int64_t items = static_cast<int64_t>(b.keys.size());
    std::vector<absl::Status> item_status(static_cast<size_t>(items));
    const int64_t first = cache->length(l);
    if (staging != nullptr) {
      char* const base = static_cast<char*>(staging->data());
#pragma omp parallel for schedule(static) num_threads(internal::HostTeam(items))
      for (int64_t i = 0; i < items; ++i) {
        const absl::string_view bytes = b.pages[i]->view();
        absl::StatusOr<kvstore::PageHeader> h = kvstore::VerifyPage(bytes);
        absl::Status& st = item_status[static_cast<size_t>(i)];
        if (!h.ok()) {
          st = h.status();
        } else if (h->shape.page_size != P || h->shape.head_dim != d) {
          st = absl::DataLossError(absl::StrCat("a stored page of shape ", h->shape.page_size, " x ",
                                                h->shape.head_dim, " where ", P, " x ", d, " was expected"));
        } else {
          uint16_t* k = reinterpret_cast<uint16_t*>(base + static_cast<size_t>(i) * page_bytes);
          st = kvstore::PageToBf16(bytes, k, k + page_elems);
        }
      }
    } else {
      k_rows.assign(static_cast<size_t>(rows) * H * d, 0.0f);
      v_rows.assign(static_cast<size_t>(rows) * H * d, 0.0f);
#pragma omp parallel num_threads(internal::HostTeam(items))
      {
        std::vector<float> kdec(page_elems), vdec(page_elems);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; ++i) {
          absl::Status& st = item_status[static_cast<size_t>(i)];
          st = kvstore::DecodePage(b.pages[i]->view(), kdec.data(), vdec.data());
          if (!st.ok()) continue;
          const int64_t p = b.keys[i].page_index;
          const int g = static_cast<int>(b.keys[i].kv_head);
          const int64_t valid = std::min<int64_t>(P, doc_tokens - p * P);
          for (int64_t t = 0; t < valid; ++t) {
            const size_t row = static_cast<size_t>(p * P + t - t0);
            std::memcpy(&k_rows[(row * H + g) * d], &kdec[static_cast<size_t>(t) * d], sizeof(float) * d);
            std::memcpy(&v_rows[(row * H + g) * d], &vdec[static_cast<size_t>(t) * d], sizeof(float) * d);
          }
        }
      }
    }
    for (absl::Status& st : item_status) STRATA_RETURN_IF_ERROR(st);
    if (staging != nullptr) {
      STRATA_RETURN_IF_ERROR(cache->AppendPages(l, rows, staging->data(), batch_items * page_bytes,
                                                static_cast<int32_t*>(slots->data())));
      // The staging is refilled by the next batch.
      STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    } else {
      kernels::TensorView kv(k_rows.data(), kernels::DType::kF32, {rows, H, d});
      kernels::TensorView vv(v_rows.data(), kernels::DType::kF32, {rows, H, d});
      if (!host) {
        const size_t bytes = k_rows.size() * sizeof(float);
        STRATA_ASSIGN_OR_RETURN(kdev, backend->Allocate(bytes));
        STRATA_ASSIGN_OR_RETURN(vdev, backend->Allocate(bytes));
        STRATA_RETURN_IF_ERROR(FromHost(backend, kdev->data(), k_rows.data(), bytes));
        STRATA_RETURN_IF_ERROR(FromHost(backend, vdev->data(), v_rows.data(), bytes));
        kv.data = kdev->data();
        vv.data = vdev->data();
      }
      STRATA_RETURN_IF_ERROR(cache->Append(l, kv, vv));
    }
    if (policy != nullptr) STRATA_RETURN_IF_ERROR(policy->OnAppend(l, *cache, first, first + rows));
    if (device != nullptr) STRATA_RETURN_IF_ERROR(device->OnAppend(l, *cache, first, first + rows, nullptr));
  }
  if (times != nullptr) {
    times->seconds += total.ElapsedSeconds();
    times->fetch_wait_seconds += wait_s;
  }
  return absl::OkStatus();
}

absl::Status Worker::PrefillShard(const v1::PrefillShardRequest& request, const ProgressFn& on_progress,
                                  const std::atomic<bool>* cancelled) {
  const model::ModelConfig& c = model_->config;
  const int P = options_.page_size;
  STRATA_ASSIGN_OR_RETURN(kvstore::DocumentId id, kvstore::DocumentId::FromHex(request.shard().document_id()));
  const int64_t n = request.token_ids_size();
  if (n == 0) return absl::InvalidArgumentError("PrefillShard: no token ids");
  if (request.shard_map().page_size() != 0 && static_cast<int>(request.shard_map().page_size()) != P) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefillShard: page size ", request.shard_map().page_size(), " but this worker uses ", P));
  }
  const uint64_t first_page = request.shard().first_page();
  if (request.shard_map().num_tokens() == 0 && first_page != 0) {
    return absl::InvalidArgumentError("PrefillShard: shard_map.num_tokens is required for a shard after page 0");
  }
  if (first_page > (uint64_t{1} << 31)) return absl::InvalidArgumentError("PrefillShard: first_page out of range");
  const int64_t num_tokens =
      request.shard_map().num_tokens() != 0 ? static_cast<int64_t>(request.shard_map().num_tokens()) : n;
  if (num_tokens > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("PrefillShard: num_tokens beyond int32");
  }
  const int64_t s0 = static_cast<int64_t>(first_page) * P;
  const int64_t end_page = request.shard().end_page() != 0 ? static_cast<int64_t>(request.shard().end_page())
                                                           : (s0 + n + P - 1) / P;
  if (end_page < 0 || end_page > (num_tokens + P - 1) / P) {
    return absl::InvalidArgumentError(absl::StrCat("PrefillShard: shard pages [", first_page, ", ",
                                                   request.shard().end_page(), ") end past the ",
                                                   (num_tokens + P - 1) / P, " pages of a ", num_tokens,
                                                   "-token document"));
  }
  const int64_t s1 = std::min<int64_t>(end_page * P, num_tokens);
  if (static_cast<int64_t>(first_page) >= end_page || s0 >= num_tokens || s1 - s0 != n) {
    return absl::InvalidArgumentError(absl::StrCat("PrefillShard: shard pages [", first_page, ", ", end_page,
                                                   ") of a ", num_tokens, "-token document hold ", s1 - s0,
                                                   " tokens, got ", n, " token ids"));
  }
  for (int32_t t : request.token_ids()) {
    if (t < 0 || t >= c.vocab_size) return absl::InvalidArgumentError(absl::StrCat("token id ", t, " out of range"));
  }
  const bool exact = request.mode() == v1::PREFILL_MODE_EXACT;
  std::vector<int32_t> anchor;
  if (!exact && s0 > 0) {
    anchor.assign(request.anchor_token_ids().begin(), request.anchor_token_ids().end());
    if (static_cast<int64_t>(anchor.size()) > s0) {
      return absl::InvalidArgumentError(absl::StrCat("PrefillShard: anchor of ", anchor.size(),
                                                     " tokens overlaps the shard starting at token ", s0));
    }
    for (int32_t t : anchor) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("anchor token id ", t, " out of range"));
      }
    }
  }
  const int64_t total_pages = (num_tokens + P - 1) / P;
  const int64_t shard_pages = end_page - static_cast<int64_t>(first_page);
  const kvstore::KvLayout layout = LayoutOf(c, P, options_.kv_page_dtype);

  v1::CreateDocumentRequest create;
  create.set_document_id(id.ToHex());
  create.set_model_fingerprint(served_fingerprint());
  *create.mutable_layout() = kvstore::LayoutToProto(layout);
  create.set_num_tokens(static_cast<uint64_t>(num_tokens));
  v1::SummarySpec* spec = create.add_summaries();
  spec->set_kind(kMinMaxSummaryKind);
  spec->set_count(static_cast<uint32_t>(total_pages));
  bool created = false;
  STRATA_ASSIGN_OR_RETURN(v1::Document doc, catalog_->CreateDocument(create, &created));
  v1::PrefillShardProgress progress;
  if (doc.state() == v1::DOCUMENT_STATE_READY) {
    progress.set_tokens_prefilled(static_cast<uint64_t>(n));
    progress.set_pages_persisted(static_cast<uint64_t>(shard_pages));
    progress.set_complete(true);
    if (on_progress) on_progress(progress);
    STRATA_LOG(INFO) << "worker: document " << id.ToHex() << " already READY in the store; no prefill";
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    ++prefilling_;
  }
  struct Done {
    Worker* w;
    ~Done() {
      absl::MutexLock lock(&w->mu_);
      --w->prefilling_;
    }
  } done{this};

  const int L = static_cast<int>(c.num_layers), H = static_cast<int>(c.num_kv_heads), d = static_cast<int>(c.head_dim);
  Stopwatch watch;
  std::vector<float> logits(static_cast<size_t>(c.vocab_size));
  // The cache: EXACT holds tokens [0, s1) (earlier shards loaded from the store); otherwise it
  // holds the shard's tokens only (cache index i = position s0 + i).
  const int64_t cache_first = exact ? 0 : s0;
  const engine::KvCacheOptions cache_options =
      transformer_->MakeCacheOptions(s1 - cache_first, P, kernels::DType::kBF16);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::KvCache> cache, engine::KvCache::Create(cache_options, backend_));
  // The shard's attention (WorkerOptions::prefill_policy): dense, a host policy's chunk path, or
  // device chunk selection (policy then dense and only told of appends).
  std::unique_ptr<engine::AttentionPolicy> policy;
  std::unique_ptr<engine::sparse::DevicePolicy> device;
  MakePrefillAttention(cache_options, &policy, &device);
  engine::ForwardOptions fo;
  fo.cache_first_position = cache_first;
  fo.device_policy = device.get();
  fo.device_prefill = device != nullptr;
  auto counters = [&]() {
    engine::SelectionCounters sc = policy->counters();
    if (device != nullptr) {
      sc.candidate_tokens += device->counters().candidate_tokens;
      sc.selected_tokens += device->counters().selected_tokens;
    }
    return sc;
  };
  std::unique_ptr<engine::KvCache> anchor_cache;
  std::unique_ptr<AnchorAttention> anchor_attention;
  LoadTimes earlier;  // EXACT: the earlier shards' pages loaded
  if (exact && s0 > 0) {
    kvstore::TierCounts pages;
    STRATA_RETURN_IF_ERROR(LoadPages(id, num_tokens, 0, static_cast<int64_t>(first_page), backend_, cache.get(),
                                     policy.get(), device.get(), cancelled, absl::StatusCode::kFailedPrecondition,
                                     /*fill_host=*/false, &pages, &earlier));
    if (metrics_ != nullptr) metrics_->page_load_prefill->Observe(earlier.seconds);
  } else if (!anchor.empty()) {
    const int64_t a = static_cast<int64_t>(anchor.size());
    STRATA_ASSIGN_OR_RETURN(
        anchor_cache, engine::KvCache::Create(transformer_->MakeCacheOptions(a, P, kernels::DType::kBF16), backend_));
    auto anchor_policy = engine::MakeDensePolicy();
    for (int64_t pos = 0; pos < a;) {
      if (cancelled != nullptr && cancelled->load()) return absl::CancelledError("prefill cancelled");
      const int64_t chunk = std::min<int64_t>(options_.prefill_chunk_size, a - pos);
      {
        absl::MutexLock lock(&engine_mu_);
        STRATA_RETURN_IF_ERROR(transformer_->Forward(anchor.data() + pos, chunk, pos, anchor_cache.get(),
                                                     anchor_policy.get(), logits.data(), /*all_logits=*/false));
      }
      pos += chunk;
      if (metrics_ != nullptr) metrics_->prefill_tokens->Increment(static_cast<double>(chunk));
    }
    anchor_attention = std::make_unique<AnchorAttention>(backend_, anchor_cache.get());
    fo.external = anchor_attention.get();
  }

  std::vector<int32_t> ids(request.token_ids().begin(), request.token_ids().end());
  // Persistence runs as a pipeline beside the forward of the next chunk: chunk c's new pages are
  // copied to the host right after its forward, encoded and summarized on another thread while
  // chunk c + 1 is computed, and written to the store while chunk c + 2 is (each stage at most one
  // chunk in flight, so at most three chunks' pages are held).
  //
  // Host copies of a chunk's newly complete pages, [L][H][pages][P][d] bf16 for K and for V (a
  // head's pages are consecutive cache slots): two sets, alternating chunks, so that a chunk is
  // copied while the previous one is encoded. Backend host memory (pinned on CUDA: the copies run
  // at the link's speed), plain memory where that is not available.
  const size_t page_elems = static_cast<size_t>(P) * d, page_bytes = page_elems * sizeof(uint16_t);
  const int64_t max_chunk_pages =
      std::min<int64_t>((options_.prefill_chunk_size + P - 1) / P + 1, end_page - static_cast<int64_t>(first_page));
  const int64_t max_items = static_cast<int64_t>(L) * H * std::max<int64_t>(max_chunk_pages, 1);
  const size_t set_elems = static_cast<size_t>(max_items) * page_elems;
  // fp8 pages are encoded on the backend when it can (Backend::EncodeFp8Pages: the fp8 codes,
  // scales and key summaries of every new page of a layer in one op, into `encoded_*` in backend
  // memory, items [l][g][page]); only those are copied to the host (half a bf16 page's bytes),
  // where the encoder thread frames each page (header, checksum). Otherwise the bf16 pages are
  // copied and encoded on the host.
  const size_t codes_bytes = static_cast<size_t>(max_items) * 2 * page_elems;
  const size_t scales_bytes = static_cast<size_t>(max_items) * 2 * sizeof(float);
  const size_t sums_bytes = static_cast<size_t>(max_items) * 2 * d * sizeof(float);
  std::unique_ptr<kernels::Buffer> encoded_codes, encoded_scales, encoded_sums;
  if (layout.page.dtype == kernels::DType::kFP8E4M3) {
    // Whether the backend has the op: a call over no pages.
    kernels::EncodeFp8PagesParams probe;
    probe.k_pool = cache->k_pool(0);
    probe.v_pool = cache->v_pool(0);
    probe.num_heads = H;
    probe.codes = kernels::TensorView(nullptr, kernels::DType::kFP8E4M3, {0, 2, P, d});
    probe.scales = kernels::TensorView(nullptr, kernels::DType::kF32, {0, 2});
    probe.summaries = kernels::TensorView(nullptr, kernels::DType::kF32, {0, 2 * d});
    if (backend_->EncodeFp8Pages(probe, nullptr).ok()) {
      auto codes = backend_->Allocate(codes_bytes);
      auto scales = backend_->Allocate(scales_bytes);
      auto sums = backend_->Allocate(sums_bytes);
      if (codes.ok() && scales.ok() && sums.ok()) {
        encoded_codes = *std::move(codes), encoded_scales = *std::move(scales), encoded_sums = *std::move(sums);
      }
    }
  }
  const bool device_encode = encoded_codes != nullptr;
  const size_t set_bytes = std::max(2 * set_elems * sizeof(uint16_t), codes_bytes + scales_bytes + sums_bytes);
  struct HostPages {
    std::unique_ptr<kernels::Buffer> pinned;
    std::vector<char> plain;
    char* base = nullptr;
    // bf16 pages: K and V [L][H][pages][P][d]; device-encoded fp8 pages: codes [L][H][pages][2][P][d],
    // then scales [..][2] f32, then summaries [..][2d] f32.
    uint16_t* k = nullptr;
    uint16_t* v = nullptr;
  };
  HostPages host_pages[2];
  for (HostPages& h : host_pages) {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> b = backend_->AllocateHost(set_bytes);
    if (b.ok()) {
      h.pinned = *std::move(b);
      h.base = static_cast<char*>(h.pinned->data());
    } else {
      h.plain.resize(set_bytes);
      h.base = h.plain.data();
    }
    h.k = reinterpret_cast<uint16_t*>(h.base);
    h.v = h.k + set_elems;
  }
  // Where the shard's time goes (logged at the end), on this thread: the forward, the copies of
  // new pages to the host, and the waits for the encoder and the store; the encoder's own time
  // (in parallel over pages) is encode_s.
  double forward_s = 0, copy_s = 0, encode_s = 0, encode_wait_s = 0, store_wait_s = 0;
  int encode_threads = 0;  // the largest team the encoding ran on
  // One chunk's pages encoded for the store: item i = (l * H + g) * count + page - first.
  struct EncodedChunk {
    absl::Status status;
    std::vector<kvstore::PageWrite> pages;
    std::vector<kvstore::SummaryWrite> summaries;
    int64_t first = 0, end = 0;  // its pages [first, end); pages before `first` are in earlier chunks
    double seconds = 0;
    int threads = 0;
  };
  // Encodes and summarizes pages [first, first + count) of every layer and KV head from a host
  // set, item i from its slot i: bf16 pages encoded here, or (device_set) the backend's fp8 codes,
  // scales and summaries framed. One parallel region over every layer's pages (one team wake-up
  // per chunk: per-layer regions of 64 pages did not speed up with the team on the GPU machine;
  // bench/RESULTS.md).
  auto encode = [&layout, id, num_tokens, L, H, P, d, page_elems, codes_bytes, scales_bytes](
                    const HostPages* set, bool device_set, int64_t first, int64_t count) {
    const Stopwatch enc;
    EncodedChunk out;
    out.first = first;
    out.end = first + count;
    const int64_t items = static_cast<int64_t>(L) * H * count;
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(set->base);
    const float* scales = reinterpret_cast<const float*>(set->base + codes_bytes);
    const float* sums = reinterpret_cast<const float*>(set->base + codes_bytes + scales_bytes);
    out.pages.resize(static_cast<size_t>(items));
    out.summaries.resize(static_cast<size_t>(items));
    std::vector<absl::Status> item_status(static_cast<size_t>(items));
    int threads = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(internal::HostTeam(items))
    for (int64_t i = 0; i < items; ++i) {
      const int64_t lg = i / count, p = first + i % count;
      const int l = static_cast<int>(lg / H), g = static_cast<int>(lg % H);
      const int valid = static_cast<int>(std::min<int64_t>(P, num_tokens - p * P));
      out.pages[i].key = {id, static_cast<uint32_t>(l), static_cast<uint32_t>(g), static_cast<uint32_t>(p)};
      out.summaries[i].key = {id, static_cast<uint32_t>(l), static_cast<uint32_t>(g), kMinMaxSummaryKind,
                              static_cast<uint32_t>(p)};
      const size_t at = static_cast<size_t>(i) * page_elems;
      item_status[static_cast<size_t>(i)] =
          device_set ? FramePersistedPage(layout.page, codes + 2 * at, scales + 2 * i, sums + 2 * d * i, valid, d,
                                          &out.pages[i], &out.summaries[i])
                     : EncodePersistedPage(layout.page, set->k + at, set->v + at, valid, d, &out.pages[i],
                                           &out.summaries[i]);
      if (i == 0) threads = omp_get_num_threads();
    }
    for (absl::Status& st : item_status) {
      if (!st.ok()) {
        out.status = std::move(st);
        break;
      }
    }
    out.seconds = enc.ElapsedSeconds();
    out.threads = threads;
    return out;
  };
  // The chunk being encoded (reads host set `encoding_set`), and the store's writes of the chunk
  // before it, split into up to PersistWriters() batches written at once (PutDeferred: the
  // document is WRITING, and FinalizeDocument makes the batches durable before it is READY; a
  // local store skips its write-ahead log). Each is waited for before the next of its kind starts
  // and before the document is finalized; the futures are declared after the host sets, so an
  // early return waits for them (the destructor of a std::async future does) before the sets go.
  const int64_t persist_writers = PersistWriters();
  constexpr int64_t kPagesPerWriter = 256;
  std::future<EncodedChunk> encoding;
  std::vector<std::future<absl::Status>> put_in_flight;
  int64_t in_flight_end = static_cast<int64_t>(first_page);  // pages before it are written or writing
  int64_t persisted = static_cast<int64_t>(first_page);       // next document page to copy
  int64_t durable = persisted;  // pages [first_page, durable) are in the store
  auto wait_put = [&]() -> absl::Status {
    const Stopwatch wait;
    absl::Status s;
    for (std::future<absl::Status>& f : put_in_flight) {
      absl::Status one = f.get();
      if (s.ok()) s = std::move(one);
    }
    put_in_flight.clear();
    store_wait_s += wait.ElapsedSeconds();
    if (s.ok()) durable = in_flight_end;
    return s;
  };
  // Waits for the chunk being encoded and starts its writes (after the previous writes returned).
  auto write_encoded = [&]() -> absl::Status {
    if (!encoding.valid()) return absl::OkStatus();
    const Stopwatch wait;
    EncodedChunk done = encoding.get();
    encode_wait_s += wait.ElapsedSeconds();
    encode_s += done.seconds;
    encode_threads = std::max(encode_threads, done.threads);
    STRATA_RETURN_IF_ERROR(done.status);
    STRATA_RETURN_IF_ERROR(wait_put());
    // Item i's page and summary go to the same batch. Batch w takes a contiguous range of the
    // chunk's page indices (every layer and KV head of them): in the store's page-first key
    // order the batches and the chunks cover disjoint key ranges, so a local store ingests each
    // batch's page file below the others without overlap (LocalStoreOptions::ingest_deferred).
    const int64_t total = static_cast<int64_t>(done.pages.size());
    const int64_t lo = done.first, span = std::max<int64_t>(done.end - done.first, 1);
    const int64_t writers = std::clamp<int64_t>(std::min(total / kPagesPerWriter, span), 1, persist_writers);
    std::vector<std::vector<kvstore::PageWrite>> pws(static_cast<size_t>(writers));
    std::vector<std::vector<kvstore::SummaryWrite>> sws(static_cast<size_t>(writers));
    for (int64_t i = 0; i < total; ++i) {
      const int64_t w = (static_cast<int64_t>(done.pages[i].key.page_index) - lo) * writers / span;
      pws[w].push_back(std::move(done.pages[i]));
      sws[w].push_back(std::move(done.summaries[i]));
    }
    for (int64_t w = 0; w < writers && total > 0; ++w) {
      std::vector<kvstore::PageWrite> pw = std::move(pws[w]);
      std::vector<kvstore::SummaryWrite> sw = std::move(sws[w]);
      kvstore::PageStore* store = store_;
      put_in_flight.push_back(std::async(std::launch::async, [store, pw = std::move(pw), sw = std::move(sw)]() {
        return store->PutDeferred(pw, sw);
      }));
    }
    in_flight_end = done.end;
    return absl::OkStatus();
  };
  int64_t done_tokens = 0;
  int chunk_index = 0;
  while (done_tokens < n) {
    if (cancelled != nullptr && cancelled->load()) return absl::CancelledError("prefill cancelled");
    const int64_t chunk = std::min<int64_t>(options_.prefill_chunk_size, n - done_tokens);
    const engine::SelectionCounters before = counters();
    {
      const Stopwatch fw;
      absl::MutexLock lock(&engine_mu_);
      STRATA_RETURN_IF_ERROR(transformer_->Forward(ids.data() + done_tokens, chunk, s0 + done_tokens, cache.get(),
                                                   policy.get(), logits.data(), /*all_logits=*/false, fo));
      forward_s += fw.ElapsedSeconds();
    }
    AddCounters(metrics_, counters(), before);
    done_tokens += chunk;
    if (metrics_ != nullptr) metrics_->prefill_tokens->Increment(static_cast<double>(chunk));
    // The shard's pages that are now complete (all of them at the end) are copied into this
    // chunk's host set (its last reader, the encoding of two chunks ago, has finished: the
    // previous iteration waited for it).
    const int64_t complete = done_tokens == n ? end_page : (s0 + done_tokens) / P;
    const int64_t count = complete - persisted;
    HostPages& set = host_pages[chunk_index++ % 2];
    if (count > 0 && device_encode) {
      // Every layer's new pages encoded on the backend (items [l][g][page]), then one copy each of
      // the codes, scales and summaries of this chunk's items.
      const Stopwatch cp;
      const int64_t items = static_cast<int64_t>(L) * H * count;
      const int64_t rel = persisted - cache_first / P;  // the chunk's first page in the cache
      for (int l = 0; l < L; ++l) {
        kernels::EncodeFp8PagesParams ep;
        ep.k_pool = cache->k_pool(l);
        ep.v_pool = cache->v_pool(l);
        ep.first_slot = cache->SlotOf(l, 0, rel);
        ep.head_slot_stride = cache->pages_per_head();  // KvCache's layout: head g's pages from g * pages_per_head
        ep.num_heads = H;
        ep.count = count;
        ep.last_valid = static_cast<int>(std::min<int64_t>(P, num_tokens - (persisted + count - 1) * P));
        const int64_t at = static_cast<int64_t>(l) * H * count;
        ep.codes = kernels::TensorView(static_cast<uint8_t*>(encoded_codes->data()) + at * 2 * page_elems,
                                       kernels::DType::kFP8E4M3, {H * count, 2, P, d});
        ep.scales = kernels::TensorView(static_cast<float*>(encoded_scales->data()) + at * 2, kernels::DType::kF32,
                                        {H * count, 2});
        ep.summaries = kernels::TensorView(static_cast<float*>(encoded_sums->data()) + at * 2 * d,
                                           kernels::DType::kF32, {H * count, 2 * d});
        STRATA_RETURN_IF_ERROR(backend_->EncodeFp8Pages(ep, nullptr));
      }
      STRATA_RETURN_IF_ERROR(backend_->CopyToHost(set.base, encoded_codes->data(),
                                                  static_cast<size_t>(items) * 2 * page_elems, nullptr));
      STRATA_RETURN_IF_ERROR(backend_->CopyToHost(set.base + codes_bytes, encoded_scales->data(),
                                                  static_cast<size_t>(items) * 2 * sizeof(float), nullptr));
      STRATA_RETURN_IF_ERROR(backend_->CopyToHost(set.base + codes_bytes + scales_bytes, encoded_sums->data(),
                                                  static_cast<size_t>(items) * 2 * d * sizeof(float), nullptr));
      STRATA_RETURN_IF_ERROR(backend_->Synchronize(nullptr));
      copy_s += cp.ElapsedSeconds();
    }
    if (count > 0 && !device_encode) {
      const size_t layer_elems = static_cast<size_t>(H) * static_cast<size_t>(count) * page_elems;
      const Stopwatch cp;
      for (int l = 0; l < L; ++l) {
        const kernels::TensorView kp = cache->k_pool(l), vp = cache->v_pool(l);
        for (int g = 0; g < H; ++g) {
          const int32_t slot = cache->SlotOf(l, g, persisted - cache_first / P);
          const size_t off = static_cast<size_t>(slot) * page_bytes, n_bytes = static_cast<size_t>(count) * page_bytes;
          const size_t at = static_cast<size_t>(l) * layer_elems + static_cast<size_t>(g) * count * page_elems;
          STRATA_RETURN_IF_ERROR(
              backend_->CopyToHost(set.k + at, static_cast<const char*>(kp.data) + off, n_bytes, nullptr));
          STRATA_RETURN_IF_ERROR(
              backend_->CopyToHost(set.v + at, static_cast<const char*>(vp.data) + off, n_bytes, nullptr));
        }
      }
      STRATA_RETURN_IF_ERROR(backend_->Synchronize(nullptr));
      copy_s += cp.ElapsedSeconds();
    }
    // The previous chunk's encoding is done: its writes start; this chunk's encoding starts.
    STRATA_RETURN_IF_ERROR(write_encoded());
    if (count > 0) {
      encoding = std::async(std::launch::async, encode, &set, device_encode, persisted, count);
    }
    persisted = std::max(persisted, complete);
    progress.set_tokens_prefilled(static_cast<uint64_t>(done_tokens));
    // Pages whose writes have returned (the chunks being encoded and written count once they have).
    progress.set_pages_persisted(static_cast<uint64_t>(durable - static_cast<int64_t>(first_page)));
    if (on_progress && done_tokens < n) on_progress(progress);
  }
  STRATA_RETURN_IF_ERROR(write_encoded());
  STRATA_RETURN_IF_ERROR(wait_put());
  if (durable != persisted) {
    return absl::InternalError(absl::StrCat("prefill: pages [", durable, ", ", persisted, ") not written"));
  }
  progress.set_pages_persisted(static_cast<uint64_t>(persisted - static_cast<int64_t>(first_page)));
  // READY once every shard is durable: the last shard to get here finalizes the document.
  absl::StatusOr<v1::Document> ready = catalog_->FinalizeDocument(id);
  if (ready.ok()) {
    if (ready->state() != v1::DOCUMENT_STATE_READY) {
      return absl::InternalError(absl::StrCat("document ", id.ToHex(), " not READY after finalize"));
    }
  } else if (ready.status().code() == absl::StatusCode::kFailedPrecondition) {
    STRATA_LOG(INFO) << "worker: document " << id.ToHex() << " shard pages [" << first_page << ", " << end_page
                     << ") durable; other shards still missing (" << ready.status().message() << ")";
  } else {
    return ready.status();
  }
  progress.set_complete(true);
  if (on_progress) on_progress(progress);
  STRATA_LOG(INFO) << "worker: document " << id.ToHex() << " shard [" << first_page << ", " << end_page
                   << ") prefilled (" << (exact ? "exact" : "anchor") << ", attention "
                   << (device != nullptr ? absl::StrCat(options_.prefill_policy, " on the device") : policy->Name())
                   << "): tokens=" << n
                   << " pages=" << shard_pages << " seconds=" << watch.ElapsedSeconds()
                   << (exact && s0 > 0 ? absl::StrCat(" (earlier shards' pages loaded in ", earlier.seconds,
                                                      ", waiting for the store ", earlier.fetch_wait_seconds, ")")
                                       : std::string())
                   << " (forward " << forward_s
                   << ", copy " << copy_s << (device_encode ? ", fp8 pages encoded on the backend, framed " : ", encode ")
                   << encode_s << " on " << encode_threads << " threads of " << omp_get_num_procs()
                   << " processors beside the forward, encode wait " << encode_wait_s << ", store wait " << store_wait_s
                   << ")";
  return absl::OkStatus();
}

absl::StatusOr<LazyAttentionOptions> Worker::LazyOptions(const kvstore::DocumentId& doc_id, int64_t doc_tokens,
                                                          const v1::SelectionPolicy& policy) {
  const model::ModelConfig& c = model_->config;
  const int P = options_.page_size;
  const int64_t pages_per_head = (doc_tokens + P - 1) / P;
  // The job's budget, window and selection-cache theta, defaults applied as for a full mount.
  STRATA_ASSIGN_OR_RETURN(const engine::sparse::PolicyOptions popt, JobPolicyOptions(policy, P));
  const int64_t budget = popt.token_budget, window = popt.window_tokens;
  LazyAttentionOptions lo;
  lo.store = store_;
  lo.document = doc_id;
  lo.document_tokens = doc_tokens;
  lo.page_size = P;
  lo.num_layers = static_cast<int>(c.num_layers);
  lo.num_kv_heads = static_cast<int>(c.num_kv_heads);
  lo.head_dim = static_cast<int>(c.head_dim);
  lo.summary_kind = kMinMaxSummaryKind;
  lo.budget_pages = static_cast<int>(std::min<int64_t>((budget + P - 1) / P, pages_per_head));
  lo.window_pages = static_cast<int>(std::min<int64_t>((window + P - 1) / P, pages_per_head));
  lo.capacity_pages = options_.lazy_cache_pages;
  lo.cache_theta = popt.cache_theta;
  lo.share = AcquireLazyShare(LazyShareKey(doc_id, doc_tokens));
  lo.metrics = metrics_ != nullptr ? metrics_->kv : nullptr;
  // device_selection "on" takes the device path on the CPU backend too (its twins); otherwise
  // the device path on a device backend. There, a document whole in a pinned host tier runs the
  // device-managed cache (resident mode, worker/lazy_attention.h).
  lo.device_path = options_.device_selection == "on" ? 1 : -1;
  return lo;
}

std::string Worker::LazyShareKey(const kvstore::DocumentId& doc_id, int64_t doc_tokens) {
  return absl::StrCat(doc_id.ToHex(), ":", doc_tokens);
}

absl::StatusOr<int64_t> Worker::PrepareLazyDocument(const kvstore::DocumentId& doc_id, int64_t doc_tokens) {
  // What a job of the default sparse policy (quest, default budget and window) makes on its first
  // question: the share keeps it (lazy_shared_documents) when the attention object goes.
  v1::SelectionPolicy policy;
  policy.set_name("quest");
  STRATA_ASSIGN_OR_RETURN(const LazyAttentionOptions lo, LazyOptions(doc_id, doc_tokens, policy));
  if (lo.share == nullptr) return 0;  // sharing is off: every job builds its own
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<LazyDocumentAttention> lazy, LazyDocumentAttention::Create(lo, backend_));
  STRATA_LOG(INFO) << "worker: document " << doc_id.ToHex() << " prepared for lazy jobs in " << lazy->setup_seconds()
                   << " s (" << (lazy->device_managed() ? "device-managed page cache of " : "no resident cache; ")
                   << (lazy->device_managed() ? absl::StrCat(lazy->slots(), " slots, ") : std::string())
                   << lo.share->summary_bytes() << " bytes of summaries on the backend)";
  return lo.share->summary_bytes();
}

std::shared_ptr<LazyDocumentShare> Worker::AcquireLazyShare(const std::string& key) {
  if (options_.lazy_shared_documents <= 0) return nullptr;
  absl::MutexLock lock(&mu_);
  std::shared_ptr<LazyDocumentShare> share;
  for (auto it = lazy_shares_.begin(); it != lazy_shares_.end(); ++it) {
    if (it->first == key) {
      share = it->second;
      lazy_shares_.erase(it);
      break;
    }
  }
  if (share == nullptr) share = std::make_shared<LazyDocumentShare>();
  lazy_shares_.emplace_front(key, share);
  TrimLazyShares();
  return share;
}

void Worker::TrimLazyShares() {
  // Keep every share a job holds, and the `lazy_shared_documents` most recently used idle ones.
  int64_t idle = 0;
  for (auto it = lazy_shares_.begin(); it != lazy_shares_.end();) {
    if (it->second.use_count() > 1 || ++idle <= options_.lazy_shared_documents) {
      ++it;
    } else {
      it = lazy_shares_.erase(it);
    }
  }
}

int64_t Worker::lazy_shared_documents() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(lazy_shares_.size());
}

uint64_t Worker::MountedTokens() const {
  uint64_t tokens = 0;
  for (const auto& [k, m] : mounted_) tokens += static_cast<uint64_t>(m->num_tokens());
  for (const auto& [k, m] : host_copies_) tokens += static_cast<uint64_t>(m->num_tokens());
  for (const auto& [k, h] : held_) {
    if (mounted_.count(k) == 0 && host_copies_.count(k) == 0) tokens += static_cast<uint64_t>(h.tokens);
  }
  return tokens;
}

absl::StatusOr<Worker::ShardSpan> Worker::CheckShard(const v1::ShardRange& range, bool check_capacity) {
  const model::ModelConfig& c = model_->config;
  const int P = options_.page_size;
  ShardSpan span;
  STRATA_ASSIGN_OR_RETURN(span.id, kvstore::DocumentId::FromHex(range.document_id()));
  STRATA_ASSIGN_OR_RETURN(v1::Document doc, catalog_->GetDocumentInfo(span.id));
  if (absl::Status s = CheckLayout(doc.layout(), LayoutOf(c, P, options_.kv_page_dtype)); !s.ok()) {
    return s;
  }
  STRATA_RETURN_IF_ERROR(CheckFingerprint(doc, served_fingerprint()));
  span.doc_tokens = static_cast<int64_t>(doc.num_tokens());
  const int64_t total_pages = (span.doc_tokens + P - 1) / P;
  if (range.first_page() >= range.end_page() || range.end_page() > static_cast<uint64_t>(total_pages)) {
    return absl::InvalidArgumentError(absl::StrCat("shard pages [", range.first_page(), ", ", range.end_page(),
                                                   ") outside the document's ", total_pages, " pages"));
  }
  span.t0 = static_cast<int64_t>(range.first_page()) * P;
  span.t1 = std::min<int64_t>(static_cast<int64_t>(range.end_page()) * P, span.doc_tokens);
  if (check_capacity) {
    int64_t mounted_tokens = 0;
    {
      absl::MutexLock lock(&mu_);
      mounted_tokens = static_cast<int64_t>(MountedTokens());
    }
    if (static_cast<uint64_t>(mounted_tokens + (span.t1 - span.t0)) > options_.capacity_tokens) {
      return absl::ResourceExhaustedError(absl::StrCat("mounting ", span.t1 - span.t0, " tokens beyond capacity_tokens ",
                                                       options_.capacity_tokens, " (", mounted_tokens, " mounted)"));
    }
  }
  return span;
}

bool Worker::DevicePlaced(const v1::SelectionPolicy* policy) const {
  return shards_on_device_ && (policy == nullptr || DeviceShardPolicy(*policy, options_.page_size));
}

absl::StatusOr<std::shared_ptr<const MountedShard>> Worker::GetOrMount(const v1::ShardRange& range,
                                                                       kvstore::TierCounts* pages,
                                                                       bool check_capacity, bool device) {
  const std::string key = ShardKey(range);
  // Mounts of the worker's placement are in mounted_; host copies of a worker that places shards
  // on the device in host_copies_.
  const bool primary = device == shards_on_device_;
  {
    absl::MutexLock lock(&mu_);
    auto it = mounted_.find(key);
    // (A device mount that fell back to host memory serves host sessions too.)
    if (it != mounted_.end() && (primary || !it->second->device_selection())) return it->second;
    if (!primary && (it = host_copies_.find(key)) != host_copies_.end()) return it->second;
  }
  STRATA_ASSIGN_OR_RETURN(const ShardSpan span, CheckShard(range, check_capacity));
  const kvstore::DocumentId id = span.id;
  const int64_t doc_tokens = span.doc_tokens, t0 = span.t0, t1 = span.t1;
  const int P = options_.page_size;
  // On the device: the shard backend instance (its calls serialised), or a CPU worker's own
  // backend; in host memory: a CPU backend.
  auto load = [&](bool on_device) -> absl::StatusOr<std::shared_ptr<const MountedShard>> {
    kernels::Backend* const be =
        !on_device ? shard_backend() : shard_device_ != nullptr ? shard_device_ : backend_;
    absl::Mutex* const be_mu = on_device && shard_device_ != nullptr ? &shard_device_mu_ : nullptr;
    kvstore::TierCounts read;
    LoadTimes times;
    absl::MutexLockMaybe lock(be_mu);
    std::unique_ptr<engine::KvCache> cache;  // on failure freed under the lock, as every call on be
    STRATA_ASSIGN_OR_RETURN(
        cache, engine::KvCache::Create(transformer_->MakeCacheOptions(t1 - t0, P, CacheDType()), be));
    STRATA_RETURN_IF_ERROR(LoadPages(id, doc_tokens, static_cast<int64_t>(range.first_page()),
                                     static_cast<int64_t>(range.end_page()), be, cache.get(), nullptr, nullptr,
                                     nullptr, absl::StatusCode::kDataLoss, /*fill_host=*/false, &read, &times));
    STRATA_RETURN_IF_ERROR(be->Synchronize(nullptr));
    AddTiers(pages, read);
    if (metrics_ != nullptr) metrics_->page_load_mount->Observe(times.seconds);
    STRATA_LOG(INFO) << "worker: shard " << ShardKey(range) << " loaded " << (on_device ? "on the device" : "in host memory")
                     << ": " << (read.host + read.local + read.remote) << " pages in " << times.seconds
                     << " s (waiting for the store " << times.fetch_wait_seconds << " s; pages from host "
                     << read.host << ", disk " << read.local << ", remote " << read.remote << ")";
    return std::make_shared<const MountedShard>(range, id, t0, std::move(cache), read, be, be_mu, on_device);
  };
  absl::StatusOr<std::shared_ptr<const MountedShard>> loaded = load(device);
  if (device && loaded.status().code() == absl::StatusCode::kResourceExhausted) {
    // The device is full: the shard lives in host memory instead (its sessions select there).
    LogFallbackOnce(absl::StrCat("a shard does not fit on the shard backend (", loaded.status().message(),
                                 "); such shards are mounted in host memory"),
                    &shard_fallback_logged_);
    loaded = load(false);
  }
  STRATA_RETURN_IF_ERROR(loaded.status());
  std::shared_ptr<const MountedShard> shard = *std::move(loaded);
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = (primary ? mounted_ : host_copies_).emplace(key, shard);
  return it->second;
}

absl::StatusOr<v1::MountShardResponse> Worker::MountShard(const v1::MountShardRequest& request) {
  if (request.whole_document()) return HoldWholeDocument(request.shard());
  kvstore::TierCounts pages;
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const MountedShard> m,
                          GetOrMount(request.shard(), &pages, true, DevicePlaced(nullptr)));
  STRATA_LOG(INFO) << "worker: mounted shard " << ShardKey(request.shard()) << " tokens=" << m->num_tokens();
  return v1::MountShardResponse();  // summary_bytes = 0: no summaries are held at mount
}

absl::StatusOr<v1::MountShardResponse> Worker::HoldWholeDocument(const v1::ShardRange& range) {
  const std::string key = ShardKey(range);
  {
    absl::MutexLock lock(&mu_);
    if (held_.count(key) > 0) return v1::MountShardResponse();  // idempotent
  }
  STRATA_ASSIGN_OR_RETURN(const ShardSpan span, CheckShard(range, /*check_capacity=*/true));
  v1::MountShardResponse response;
  if (options_.lazy_mount) {
    // Best effort: a job that finds no prepared state builds it itself, as before.
    absl::StatusOr<int64_t> summary_bytes = PrepareLazyDocument(span.id, span.doc_tokens);
    if (summary_bytes.ok()) {
      response.set_summary_bytes(static_cast<uint64_t>(*summary_bytes));
    } else {
      STRATA_LOG(WARNING) << "worker: document " << span.id.ToHex()
                          << ": lazy state not prepared at mount (the first job makes it): " << summary_bytes.status();
    }
  }
  absl::MutexLock lock(&mu_);
  held_.emplace(key, HeldShard{range, span.t1 - span.t0, LazyShareKey(span.id, span.doc_tokens)});
  STRATA_LOG(INFO) << "worker: holds shard " << key << " of a document whole on this worker, tokens="
                   << span.t1 - span.t0 << " (no pages loaded for the mount)";
  return response;
}

absl::Status Worker::UnmountShard(const v1::UnmountShardRequest& request) {
  absl::MutexLock lock(&mu_);
  const std::string key = ShardKey(request.shard());
  mounted_.erase(key);
  host_copies_.erase(key);
  auto it = held_.find(key);
  if (it != held_.end()) {
    // The document's lazy state goes when no job uses it and no other shard of it is held here.
    const std::string share_key = it->second.share_key;
    held_.erase(it);
    bool other = false;
    for (const auto& [k, h] : held_) other |= h.share_key == share_key;
    if (!other) {
      lazy_shares_.remove_if([&](const auto& e) { return e.second.use_count() == 1 && e.first == share_key; });
    }
  }
  return absl::OkStatus();
}

std::vector<v1::ShardRange> Worker::MountedShards() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::ShardRange> out;
  for (const auto& [k, m] : mounted_) out.push_back(m->range());
  for (const auto& [k, m] : host_copies_) {
    if (mounted_.count(k) == 0) out.push_back(m->range());
  }
  for (const auto& [k, h] : held_) {
    if (mounted_.count(k) == 0 && host_copies_.count(k) == 0) out.push_back(h.range);
  }
  return out;
}

absl::Status Worker::GetPeerPages(const v1::GetPagesRequest& request,
                                  const std::function<bool(const v1::GetPagesResponse&)>& write) {
  constexpr int kMaxKeys = 65536, kPerMessage = 64;
  STRATA_ASSIGN_OR_RETURN(kvstore::DocumentId id, kvstore::DocumentId::FromHex(request.document_id()));
  if (request.keys_size() > kMaxKeys) {
    return absl::InvalidArgumentError(absl::StrCat(request.keys_size(), " page keys; at most ", kMaxKeys));
  }
  const model::ModelConfig& c = model_->config;
  std::vector<kvstore::PageKey> keys;
  keys.reserve(static_cast<size_t>(request.keys_size()));
  for (const v1::PageKey& k : request.keys()) {
    if (k.layer() >= static_cast<uint32_t>(c.num_layers) || k.kv_head() >= static_cast<uint32_t>(c.num_kv_heads)) {
      return absl::InvalidArgumentError(absl::StrCat("page (", k.layer(), ", ", k.kv_head(), ", ", k.page_index(),
                                                     ") outside the model's layers or KV heads"));
    }
    keys.push_back({id, k.layer(), k.kv_head(), k.page_index()});
  }
  for (size_t i = 0; i < keys.size(); i += kPerMessage) {
    const size_t end = std::min(keys.size(), i + kPerMessage);
    std::vector<kvstore::PageRef> pages;
    STRATA_RETURN_IF_ERROR(store_->GetPages(absl::MakeConstSpan(keys.data() + i, end - i), &pages));
    v1::GetPagesResponse resp;
    for (size_t j = i; j < end; ++j) {
      v1::Page* p = resp.add_pages();
      *p->mutable_key() = request.keys(static_cast<int>(j));
      if (pages[j - i] == nullptr) {
        p->set_absent(true);
      } else {
        p->set_data(pages[j - i]->data(), pages[j - i]->size());
      }
    }
    if (!write(resp)) return absl::CancelledError("the caller went away");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShardSession>> Worker::OpenSelection(const v1::SelectionOpen& open) {
  const model::ModelConfig& c = model_->config;
  if (open.num_q_heads() != static_cast<uint32_t>(c.num_heads) || open.head_dim() != static_cast<uint32_t>(c.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("SelectionOpen: ", open.num_q_heads(), " heads x ", open.head_dim(),
                                                   " but the model has ", c.num_heads, " x ", c.head_dim));
  }
  if (open.policy().page_size() != 0 && static_cast<int>(open.policy().page_size()) != options_.page_size) {
    return absl::InvalidArgumentError(absl::StrCat("policy.page_size must be ", options_.page_size));
  }
  kvstore::TierCounts pages;
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const MountedShard> m,
                          GetOrMount(open.shard(), &pages, false, DevicePlaced(&open.policy())));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ShardSession> session,
                          ShardSession::Create(std::move(m), open.policy(), open.budget_tokens(), c));
  if (pages.host + pages.local + pages.remote > 0) session->set_report_pages(pages);
  if (metrics_ != nullptr) {
    // Selection-cache lookups are counted where the selection runs; the leader counts the
    // candidate and selected tokens of the answers.
    WorkerMetrics* m = metrics_;
    session->set_on_answer([m](const engine::SelectionCounters& c) {
      Inc(m->selection_cache_lookups, static_cast<double>(c.cache_lookups));
      Inc(m->selection_cache_hits, static_cast<double>(c.cache_hits));
    });
  }
  return session;
}

void Worker::RecordShardAnswers(const std::string& job_id, const ShardAnswerTiming& t, const std::string& transport) {
  if (metrics_ != nullptr) {
    Inc(transport == "link" ? metrics_->selection_streams_link : metrics_->selection_streams_grpc, 1);
  }
  if (t.answers <= 0) return;
  if (metrics_ != nullptr) {
    Inc(metrics_->shard_answers, static_cast<double>(t.answers));
    Inc(metrics_->shard_answer_queue_seconds, t.queue_seconds);
    Inc(metrics_->shard_answer_wait_seconds, t.wait_seconds);
    Inc(metrics_->shard_answer_send_seconds, t.send_seconds);
  }
  const double us = 1e6 / static_cast<double>(t.answers);
  STRATA_LOG(INFO) << "job " << job_id << ": selection stream (" << transport << ") answered " << t.answers
                   << " layer queries, on average " << t.queue_seconds * us << " us queueing each, "
                   << t.wait_seconds * us << " us waiting for its results, " << t.send_seconds * us
                   << " us writing it";
}

struct Worker::DecodeRequest {
  engine::Transformer::BatchItem item;
  bool sampled = false;  // the token drawn on the backend with `row`
  kernels::SampleRow row;
  int32_t device_token = -1;
  absl::Status status;
  bool done = false;
};

absl::Status Worker::DecodeStep(const engine::Transformer::BatchItem& item, const kernels::SampleRow* row,
                                int32_t* device_token) {
  *device_token = -1;
  DecodeRequest me;
  me.item = item;
  me.sampled = row != nullptr;
  if (row != nullptr) me.row = *row;
  const size_t limit = static_cast<size_t>(
      std::max<int64_t>(1, std::min<int64_t>(options_.max_decode_batch, options_.prefill_chunk_size)));
  absl::MutexLock lock(&batch_mu_);
  pending_.push_back(&me);
  while (!me.done) {
    if (batch_running_) {
      auto ready = [this, &me]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_) { return me.done || !batch_running_; };
      batch_mu_.Await(absl::Condition(&ready));
      continue;
    }
    // Gather the other steps first: those of every job in its decode loop, up to the batch limit,
    // for at most WorkerOptions::decode_batch_wait_us; or a test's fixed count
    // (SetDecodeBatchGateForTesting), for at most 2 s.
    const int gate = batch_gate_for_testing_.load();
    const bool gated = gate > 1;
    auto want = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_) {
      return gated ? static_cast<size_t>(gate) : std::min(limit, static_cast<size_t>(decoding_jobs_));
    };
    const absl::Duration wait = gated ? absl::Seconds(2) : absl::Microseconds(options_.decode_batch_wait_us);
    if (wait > absl::ZeroDuration() && pending_.size() < want()) {
      auto full = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_) {
        return batch_running_ || pending_.size() >= want();
      };
      batch_mu_.AwaitWithTimeout(absl::Condition(&full), wait);
      if (batch_running_ || me.done) continue;
    }
    batch_running_ = true;
    const size_t take = std::min(limit, pending_.size());
    std::vector<DecodeRequest*> batch(pending_.begin(), pending_.begin() + take);
    pending_.erase(pending_.begin(), pending_.begin() + take);
    batch_mu_.Unlock();
    std::vector<engine::Transformer::BatchItem> items;
    for (DecodeRequest* r : batch) items.push_back(r->item);
    absl::Status s;
    {
      absl::MutexLock engine(&engine_mu_);
      // Their tokens drawn on the backend (WorkerOptions::device_sampling); one replayed graph for
      // the batch's steps, or a lone step's, when they can be captured (WorkerOptions::decode_graph).
      for (size_t i = 0; i < batch.size(); ++i) {
        if (!batch[i]->sampled) continue;
        items[i].sample = &batch[i]->row;
        items[i].token = &batch[i]->device_token;
      }
      const int64_t replayed = transformer_->graph_steps();
      s = transformer_->ForwardBatch(items);
      if (metrics_ != nullptr) {
        Inc(metrics_->decode_graph_steps, static_cast<double>(transformer_->graph_steps() - replayed));
      }
      if (s.ok()) {
        for (DecodeRequest* r : batch) {
          // As engine::Sampler: no token when every logit is NaN or -inf.
          r->status = r->sampled && r->device_token < 0
                          ? absl::InvalidArgumentError("Sample: every logit is NaN or -inf")
                          : absl::OkStatus();
          if (r->sampled && r->device_token >= 0) device_picks_ += 1;
        }
      } else {
        // Run alone every step whose cache did not take the token, so only bad steps fail.
        for (DecodeRequest* r : batch) {
          const engine::Transformer::BatchItem& it = r->item;
          if (batch.size() > 1 && it.cache->length(0) == it.pos - it.options.cache_first_position) {
            r->sampled = false;  // alone, its logits to the host (sampled there with the same row)
            r->status = transformer_->Forward(&it.id, 1, it.pos, it.cache, it.policy, it.logits_out,
                                              /*all_logits=*/false, it.options);
          } else {
            r->status = s;
          }
        }
      }
    }
    decode_batches_ += 1;
    decode_steps_ += static_cast<int64_t>(batch.size());
    batch_mu_.Lock();
    for (DecodeRequest* r : batch) r->done = true;
    batch_running_ = false;
  }
  *device_token = me.sampled ? me.device_token : -1;
  return me.status;
}

int64_t Worker::decode_graph_steps() {
  absl::MutexLock lock(&engine_mu_);
  return transformer_->graph_steps();
}

int64_t Worker::decode_graph_captures() {
  absl::MutexLock lock(&engine_mu_);
  return transformer_->graph_captures();
}

bool Worker::CancelJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return false;
  it->second->store(true);
  return true;
}

absl::Status Worker::RunJob(const v1::RunJobRequest& request, const EventFn& on_event) {
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  {
    absl::MutexLock lock(&mu_);
    if (jobs_.count(request.job_id()) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("job ", request.job_id(), " is already running here"));
    }
    jobs_[request.job_id()] = cancelled;
  }
  JobResult result;
  result.info.set_job_id(request.job_id());
  uint64_t sequence = 0;
  bool receiver_gone = false;
  EventFn send = [&](const v1::JobEvent& e) {
    v1::JobEvent copy = e;
    copy.set_job_id(request.job_id());
    copy.set_sequence(++sequence);
    if (!on_event(copy)) {
      receiver_gone = true;
      cancelled->store(true);
      return false;
    }
    return true;
  };
  absl::Status s = RunJobInner(request, send, *cancelled, &result);
  {
    absl::MutexLock lock(&mu_);
    jobs_.erase(request.job_id());
  }
  v1::JobInfo& info = result.info;
  if (!s.ok()) {
    if (s.code() == absl::StatusCode::kCancelled || cancelled->load()) {
      info.set_state(v1::JobInfo::CANCELLED);
      info.set_finish_reason(v1::JobInfo::CANCELLED_BY_CLIENT);
    } else {
      info.set_state(v1::JobInfo::FAILED);
      info.set_finish_reason(v1::JobInfo::ERROR);
      info.set_error_code(static_cast<int>(s.code()));
      info.set_error_message(std::string(s.message()));
      STRATA_LOG(WARNING) << "worker: job " << request.job_id() << " failed: " << s;
    }
  }
  if (receiver_gone) return absl::CancelledError("the job's receiver went away");
  v1::JobEvent last;
  *last.mutable_snapshot() = info;
  if (!send(last)) return absl::CancelledError("the job's receiver went away");
  return absl::OkStatus();
}

absl::Status Worker::RunJobInner(const v1::RunJobRequest& request, const EventFn& send,
                                 const std::atomic<bool>& cancelled, JobResult* result) {
  const int64_t job_start = MonotonicNanos();
  int64_t last_token = 0;
  const model::ModelConfig& c = model_->config;
  const int L = static_cast<int>(c.num_layers), H = static_cast<int>(c.num_kv_heads);
  v1::JobInfo& info = result->info;
  const v1::GenerationParams& params = request.params();
  const int64_t max_tokens = params.max_tokens() == 0 ? 256 : params.max_tokens();
  // A job's generated tokens live in its KV cache beside its context: more than the worker can hold
  // of a document (capacity_tokens) is refused before anything is allocated for it (the
  // coordinator caps max_tokens far lower; this guards the worker's own API).
  if (static_cast<uint64_t>(max_tokens) > options_.capacity_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("params.max_tokens = ", max_tokens,
                                                   " is above this worker's capacity_tokens ",
                                                   options_.capacity_tokens));
  }
  std::vector<int32_t> prompt(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  for (int32_t t : prompt) {
    if (t < 0 || t >= c.vocab_size) return absl::InvalidArgumentError(absl::StrCat("token id ", t, " out of range"));
  }
  int P = options_.page_size;
  if (request.shard_map().page_size() != 0) P = static_cast<int>(request.shard_map().page_size());
  if (P != options_.page_size) {
    return absl::InvalidArgumentError(absl::StrCat("page size ", P, " but this worker uses ", options_.page_size));
  }
  if (request.policy().page_size() != 0 && static_cast<int>(request.policy().page_size()) != P) {
    return absl::InvalidArgumentError(absl::StrCat("policy.page_size must be ", P));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::AttentionPolicy> policy, MakeJobPolicy(request.policy(), c, P));

  const bool has_doc = request.shard_map().shards_size() > 0;
  int64_t doc_tokens = 0;
  kvstore::DocumentId doc_id;
  if (has_doc) {
    STRATA_ASSIGN_OR_RETURN(doc_id, kvstore::DocumentId::FromHex(request.shard_map().document_id()));
    // Metadata only: the stored counts would scan the document's index, a cost growing with it.
    STRATA_ASSIGN_OR_RETURN(v1::Document doc, catalog_->GetDocumentInfo(doc_id));
    if (doc.state() != v1::DOCUMENT_STATE_READY) {
      return absl::FailedPreconditionError(absl::StrCat("document ", doc_id.ToHex(), " is not READY in the store"));
    }
    if (absl::Status s = CheckLayout(doc.layout(), LayoutOf(c, P, options_.kv_page_dtype)); !s.ok()) {
      return s;
    }
    STRATA_RETURN_IF_ERROR(CheckFingerprint(doc, served_fingerprint()));
    doc_tokens = static_cast<int64_t>(doc.num_tokens());
  }
  const int64_t context = doc_tokens + static_cast<int64_t>(prompt.size());
  info.set_prompt_tokens(static_cast<uint64_t>(context));
  v1::Usage* usage = info.mutable_usage();
  usage->set_prompt_tokens(static_cast<uint64_t>(context));
  usage->set_cached_tokens(static_cast<uint64_t>(doc_tokens));

  // Sharded over other workers: LeaderAttention over the shards, the cache holds the prompt and
  // the generated tokens only (worker.h).
  bool sharded = false;
  for (const v1::ShardAssignment& a : request.shard_map().shards()) {
    if (!a.worker_id().empty() && a.worker_id() != options_.worker_id) sharded = true;
  }
  std::unique_ptr<LeaderAttention> leader;
  struct CountFailovers {  // peers failed over during this job, whatever its outcome
    std::unique_ptr<LeaderAttention>* leader;
    std::atomic<int64_t>* total;
    ~CountFailovers() {
      if (*leader != nullptr) *total += (*leader)->failovers();
    }
  } count_failovers{&leader, &failovers_};
  engine::ForwardOptions fo;
  if (sharded) {
    const int64_t total_pages = (doc_tokens + P - 1) / P;
    uint64_t next = 0;
    for (const v1::ShardAssignment& a : request.shard_map().shards()) {
      if (a.range().first_page() != next || a.range().end_page() <= a.range().first_page() ||
          (!a.range().document_id().empty() && a.range().document_id() != request.shard_map().document_id())) {
        return absl::InvalidArgumentError("shard map: shards must cover the document's pages in order");
      }
      next = a.range().end_page();
    }
    if (next != static_cast<uint64_t>(total_pages)) {
      return absl::InvalidArgumentError(absl::StrCat("shard map covers ", next, " of ", total_pages, " pages"));
    }
    v1::ShardMap map = request.shard_map();
    map.set_num_tokens(static_cast<uint64_t>(doc_tokens));
    map.set_page_size(static_cast<uint32_t>(P));
    LeaderAttention::Options lo;
    lo.job_id = request.job_id();
    lo.self_worker_id = options_.worker_id;
    lo.policy = request.policy();
    lo.config = &c;
    lo.peer_timeout_ms = options_.peer_timeout_ms;
    const bool device = DevicePlaced(&lo.policy);
    lo.mount = [this, device](const v1::ShardRange& r, kvstore::TierCounts* pages) {
      return GetOrMount(r, pages, false, device);
    };
    STRATA_ASSIGN_OR_RETURN(leader, LeaderAttention::Create(lo, map));
    policy = engine::MakeDensePolicy();  // over the prompt and generated tokens
    fo.cache_first_position = doc_tokens;
    fo.external = leader.get();
  }
  // Lazy mount (WorkerOptions::lazy_mount): only the summaries load; pages come in as chosen.
  // Declared before `lazy` (so run after it is gone): the idle shares beyond the limit go.
  struct TrimShares {
    Worker* w;
    ~TrimShares() {
      absl::MutexLock lock(&w->mu_);
      w->TrimLazyShares();
    }
  } trim_shares{this};
  std::unique_ptr<LazyDocumentAttention> lazy;
  if (has_doc && !sharded && options_.lazy_mount && LazyEligible(request.policy())) {
    STRATA_ASSIGN_OR_RETURN(const LazyAttentionOptions lo, LazyOptions(doc_id, doc_tokens, request.policy()));
    // The page cache lives on the job's own backend (CPU or CUDA), like the job's KvCache.
    STRATA_ASSIGN_OR_RETURN(lazy, LazyDocumentAttention::Create(lo, backend_));
    if (metrics_ != nullptr) {
      Inc(lazy->device_managed() ? metrics_->lazy_jobs_resident : metrics_->lazy_jobs_host_managed, 1);
    }
    if (lazy->device_managed()) {
      ++resident_lazy_jobs_;
      STRATA_LOG(INFO) << "worker: job " << request.job_id() << ": document " << doc_id.ToHex()
                       << " whole in the host tier: device-managed page cache (" << lazy->slots()
                       << " slots, set up in " << lazy->setup_seconds() << " s)";
    }
    policy = engine::MakeDensePolicy();  // over the prompt and generated tokens
    fo.cache_first_position = doc_tokens;
    fo.external = lazy.get();
  }
  // The job's cache holds the whole document (or there is none): device selection, or the
  // policy's restrictions on a device backend (WorkerOptions::device_selection, worker.h).
  const engine::KvCacheOptions cache_options =
      transformer_->MakeCacheOptions(context - fo.cache_first_position + max_tokens, P, CacheDType());
  std::unique_ptr<engine::sparse::DevicePolicy> device;
  if (!sharded && lazy == nullptr) {
    STRATA_ASSIGN_OR_RETURN(engine::sparse::PolicyOptions popt, JobPolicyOptions(request.policy(), P));
    const bool host_pools = backend_->Name() == "cpu";
    const bool reads_pools =
        popt.kind != engine::sparse::PolicyKind::kDense && popt.kind != engine::sparse::PolicyKind::kStreaming;
    if (reads_pools && !DeviceKind(popt) && !host_pools) {
      return absl::FailedPreconditionError(absl::StrCat(
          "policy ", policy->Name(), " reads keys on the host, which backend ", backend_->Name(),
          " cannot serve: use quest or tokenselect with minmax summaries, or a worker on the CPU backend"));
    }
    if (reads_pools && DeviceKind(popt)) {
      if (!CanSelect(popt, cache_options.max_tokens, L)) {
        // Every step attends everything: exact either way.
        if (!host_pools) policy = engine::MakeDensePolicy();
      } else {
        if (device_selection_.ok()) {
          absl::StatusOr<std::unique_ptr<engine::sparse::DevicePolicy>> created = engine::sparse::DevicePolicy::Create(
              popt, cache_options, static_cast<int>(c.num_heads), backend_);
          if (created.ok()) {
            device = *std::move(created);
            policy = engine::MakeDensePolicy();  // prompt chunks attend densely; decode steps select on the device
            ++device_selection_jobs_;
          } else {
            LogFallbackOnce(absl::StrCat("device selection for a ", policy->Name(), " job failed (", created.status().ToString(),
                                         "); using the ", host_pools ? "host policy" : "dense policy"));
          }
        } else if (!host_pools) {
          LogFallbackOnce(absl::StrCat(policy->Name(), " jobs attend densely on backend ", backend_->Name(), ": ",
                                       device_selection_.ToString()));
        }
        if (device == nullptr && !host_pools) policy = engine::MakeDensePolicy();
      }
    }
  }
  fo.device_policy = device.get();
  auto counters = [&]() {
    engine::SelectionCounters sc = policy->counters();
    if (device != nullptr) {
      sc.candidate_tokens += device->counters().candidate_tokens;
      sc.selected_tokens += device->counters().selected_tokens;
    }
    if (lazy != nullptr) {
      sc.candidate_tokens += lazy->counters().candidate_tokens;
      sc.selected_tokens += lazy->counters().selected_tokens;
    }
    if (leader != nullptr) {
      sc.candidate_tokens += leader->counters().candidate_tokens;
      sc.selected_tokens += leader->counters().selected_tokens;
      sc.cache_lookups += leader->counters().cache_lookups;
      sc.cache_hits += leader->counters().cache_hits;
    }
    return sc;
  };
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::KvCache> cache, engine::KvCache::Create(cache_options, backend_));

  const int64_t setup_end = MonotonicNanos();
  // Mount: load every page of the document from the store into the cache, layer by layer.
  if (has_doc && !sharded && lazy == nullptr) {
    kvstore::TierCounts served;
    LoadTimes times;
    STRATA_RETURN_IF_ERROR(LoadPages(doc_id, doc_tokens, 0, (doc_tokens + P - 1) / P, backend_, cache.get(), policy.get(),
                                     device.get(), &cancelled, absl::StatusCode::kDataLoss, /*fill_host=*/true, &served,
                                     &times));
    if (metrics_ != nullptr) metrics_->page_load_job->Observe(times.seconds);
    v1::PagesByTier* tiers = usage->mutable_pages_fetched();
    tiers->set_host(static_cast<uint64_t>(served.host));
    tiers->set_disk(static_cast<uint64_t>(served.local));
    tiers->set_remote(static_cast<uint64_t>(served.remote));
  }

  // Prompt.
  const int64_t prompt_start = MonotonicNanos();
  const engine::SelectionCounters start = counters();
  std::vector<float> logits(static_cast<size_t>(c.vocab_size));
  {
    v1::JobEvent e;
    v1::PrefillProgress* pr = e.mutable_progress();
    pr->set_tokens_total(static_cast<uint64_t>(context));
    pr->set_tokens_prefilled(static_cast<uint64_t>(doc_tokens));
    if (!send(e)) return absl::CancelledError("receiver gone");
  }
  int64_t pos = doc_tokens;
  for (size_t off = 0; off < prompt.size();) {
    if (cancelled.load()) return absl::CancelledError("cancelled during the prompt");
    const int64_t chunk = std::min<int64_t>(options_.prefill_chunk_size, static_cast<int64_t>(prompt.size() - off));
    {
      absl::MutexLock lock(&engine_mu_);
      STRATA_RETURN_IF_ERROR(transformer_->Forward(prompt.data() + off, chunk, pos, cache.get(), policy.get(),
                                                   logits.data(), /*all_logits=*/false, fo));
    }
    off += static_cast<size_t>(chunk);
    pos += chunk;
    if (metrics_ != nullptr) metrics_->prefill_tokens->Increment(static_cast<double>(chunk));
  }
  AddCounters(metrics_, counters(), start);
  const int64_t prompt_end = MonotonicNanos();

  // Decode.
  engine::SamplingOptions so;
  so.temperature = params.temperature();
  so.top_k = params.top_k();
  so.top_p = params.top_p() == 0 ? 1.0 : params.top_p();
  so.seed = params.has_seed() ? params.seed() : 0;
  STRATA_RETURN_IF_ERROR(so.Validate());
  engine::Sampler sampler(so);  // without device_sampling
  // With device_sampling every token is drawn with a SampleRow: the job's options and the next
  // uniform of the stream engine::Sampler would use (one per token at temperature > 0), on the
  // backend or, for host logits, by the CPU twin (kernels::CpuSample: engine::Sampler's tokens).
  engine::SampleRowStream row_stream(so);
  kernels::SampleRow row = row_stream.Next();  // the first token's, from the prompt's host logits
  // Counted among the decoding jobs while in the loop below (a batch leader waits for their steps).
  struct Decoding {
    Worker* w;
    explicit Decoding(Worker* worker) : w(worker) {
      absl::MutexLock lock(&w->batch_mu_);
      ++w->decoding_jobs_;
    }
    ~Decoding() {
      absl::MutexLock lock(&w->batch_mu_);
      --w->decoding_jobs_;
    }
  } decoding(this);
  const model::Tokenizer* tok = model_->tokenizer.get();
  std::unique_ptr<model::StreamingDecoder> decoder;
  if (tok != nullptr) decoder = std::make_unique<model::StreamingDecoder>(tok);
  std::vector<std::string> stops(params.stop().begin(), params.stop().end());
  size_t max_stop = 0;
  for (const std::string& s : stops) max_stop = std::max(max_stop, s.size());
  std::string text;     // decoded so far
  size_t emitted = 0;   // bytes of `text` sent
  std::vector<int32_t> pending_ids;
  v1::JobInfo::FinishReason finish = v1::JobInfo::LENGTH;
  int64_t steps = 0;
  engine::SelectionCounters decode_start = counters();
  bool done = false;
  int32_t device_next = -1;
  while (!done) {
    if (cancelled.load()) return absl::CancelledError("cancelled");
    // A step that drew its token on the backend (WorkerOptions::device_sampling) left it in
    // device_next; otherwise the logits are on the host.
    int32_t next = device_next;
    if (next < 0 && options_.device_sampling) {
      kernels::SampleParams p;
      p.logits = kernels::TensorView(logits.data(), kernels::DType::kF32, {1, c.vocab_size});
      p.rows = &row;
      p.tokens = kernels::TensorView(&next, kernels::DType::kI32, {1});
      STRATA_RETURN_IF_ERROR(kernels::CpuSample(p));
      if (next < 0) return absl::InvalidArgumentError("Sample: every logit is NaN or -inf");
    } else if (next < 0) {
      STRATA_ASSIGN_OR_RETURN(next, sampler.Sample(logits.data(), c.vocab_size));
    }
    info.add_output_token_ids(next);
    pending_ids.push_back(next);
    {
      const int64_t now = MonotonicNanos();
      if (last_token == 0) {
        STRATA_LOG(INFO) << "worker: job " << request.job_id() << ": first token after " << (now - job_start) * 1e-9
                         << " s (setup " << (setup_end - job_start) * 1e-9 << ", mount "
                         << (prompt_start - setup_end) * 1e-9 << ", prompt of " << prompt.size() << " tokens "
                         << (prompt_end - prompt_start) * 1e-9 << ")";
      }
      if (metrics_ != nullptr) {
        metrics_->decode_tokens->Increment();
        if (last_token == 0) {
          metrics_->time_to_first_token->Observe((now - job_start) * 1e-9);
        } else {
          metrics_->inter_token_latency->Observe((now - last_token) * 1e-9);
        }
      }
      last_token = now;
    }
    const bool is_eos = std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), next) != c.eos_token_ids.end();
    bool stop_token = std::find(params.stop_token_ids().begin(), params.stop_token_ids().end(), next) !=
                      params.stop_token_ids().end();
    if ((is_eos && !params.ignore_eos()) || stop_token) {
      finish = v1::JobInfo::STOP;
      done = true;
    } else if (decoder != nullptr) {
      STRATA_ASSIGN_OR_RETURN(std::string piece, decoder->Push(next));
      text += piece;
      for (const std::string& s : stops) {
        const size_t at = text.find(s, emitted > s.size() ? emitted - s.size() : 0);
        if (at != std::string::npos) {
          text.resize(at);
          finish = v1::JobInfo::STOP;
          done = true;
          break;
        }
      }
    }
    if (!done && info.output_token_ids_size() >= max_tokens) done = true;
    if (done && decoder != nullptr && finish == v1::JobInfo::LENGTH) text += decoder->Finish();
    // Send what is final: everything when done, else all but a possible stop-string prefix.
    size_t safe = text.size();
    if (!done && max_stop > 0) safe = text.size() > max_stop - 1 ? text.size() - (max_stop - 1) : 0;
    safe = std::max(safe, emitted);
    while (safe > emitted && safe < text.size() && (static_cast<unsigned char>(text[safe]) & 0xC0) == 0x80) --safe;
    v1::JobEvent e;
    v1::TokenDelta* delta = e.mutable_tokens();
    for (int32_t id : pending_ids) delta->add_token_ids(id);
    pending_ids.clear();
    delta->set_text(text.substr(emitted, safe - emitted));
    emitted = safe;
    if (!send(e)) return absl::CancelledError("receiver gone");
    if (done) break;
    const engine::SelectionCounters before = counters();
    engine::Transformer::BatchItem step;
    step.id = next;
    step.pos = pos;
    step.cache = cache.get();
    step.policy = policy.get();
    step.options = fo;
    step.logits_out = logits.data();
    row = row_stream.Next();
    STRATA_RETURN_IF_ERROR(DecodeStep(step, options_.device_sampling ? &row : nullptr, &device_next));
    AddCounters(metrics_, counters(), before);
    ++pos;
    ++steps;
  }
  const engine::SelectionCounters end = counters();
  int64_t device_cache_lookups = 0, device_cache_hits = 0;
  if (device != nullptr || lazy != nullptr) {
    // The selection cache's counts of this job: hits are counted on the device, read once here
    // (the counters() above leave them out, so each is added once).
    {
      absl::MutexLock lock(&engine_mu_);  // the backend is shared with the forwards of other jobs
      if (device != nullptr) STRATA_RETURN_IF_ERROR(device->ReadCacheHits(nullptr));
      // The lazy hook's device counters; in resident mode also the page cache's.
      if (lazy != nullptr) STRATA_RETURN_IF_ERROR(lazy->SyncStats());
    }
    const engine::SelectionCounters& sc = device != nullptr ? device->counters() : lazy->counters();
    if (metrics_ != nullptr) {
      Inc(metrics_->selection_cache_lookups, static_cast<double>(sc.cache_lookups));
      Inc(metrics_->selection_cache_hits, static_cast<double>(sc.cache_hits));
    }
    device_cache_lookups = sc.cache_lookups;
    device_cache_hits = sc.cache_hits;
  }
  usage->set_selection_cache_lookups(static_cast<uint64_t>(end.cache_lookups + device_cache_lookups));
  usage->set_selection_cache_hits(static_cast<uint64_t>(end.cache_hits + device_cache_hits));
  if (lazy != nullptr) {  // every page-cache miss of this job, by the tier that served it
    v1::PagesByTier* tiers = usage->mutable_pages_fetched();
    tiers->set_host(static_cast<uint64_t>(lazy->pages().host));
    tiers->set_disk(static_cast<uint64_t>(lazy->pages().local));
    tiers->set_remote(static_cast<uint64_t>(lazy->pages().remote));
  }
  if (leader != nullptr) {
    v1::PagesByTier* tiers = usage->mutable_pages_fetched();
    tiers->set_host(static_cast<uint64_t>(leader->pages().host));
    tiers->set_disk(static_cast<uint64_t>(leader->pages().local));
    tiers->set_remote(static_cast<uint64_t>(leader->pages().remote));
    const LeaderAttention::Timing& t = leader->timing();
    if (metrics_ != nullptr) {
      Inc(metrics_->shard_attention_layers, static_cast<double>(t.calls));
      Inc(metrics_->shard_attention_local_seconds, t.local_seconds);
      Inc(metrics_->shard_attention_peer_seconds, t.wait_seconds);
    }
    if (t.calls > 0) {
      const double us = 1e6 / static_cast<double>(t.calls);
      STRATA_LOG(INFO) << "job " << request.job_id() << ": shard attention, " << t.calls << " layer calls of "
                       << t.attend_seconds * us << " us on average (local shards " << t.local_seconds * us
                       << " us, then waiting for the peers " << t.wait_seconds * us << " us)";
    }
  }
  const double denom = static_cast<double>(std::max<int64_t>(steps, 1)) * L * H;
  usage->set_mean_attended_tokens(steps > 0 ? (end.selected_tokens - decode_start.selected_tokens) / denom
                                            : static_cast<double>(context));
  usage->set_completion_tokens(static_cast<uint64_t>(info.output_token_ids_size()));
  info.set_output_text(text);
  info.set_state(v1::JobInfo::DONE);
  info.set_finish_reason(finish);
  return absl::OkStatus();
}

}  // namespace strata::worker
