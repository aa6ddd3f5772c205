#include "worker/worker.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/attention_policy.h"
#include "engine/kv_cache.h"
#include "engine/sampler.h"
#include "engine/sparse/policy.h"
#include "kvstore/document_id.h"
#include "kvstore/page_format.h"
#include "kvstore/tiered_store.h"
#include "model/tokenizer.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace strata::worker {
namespace {

constexpr uint32_t kMinMaxSummaryKind = 1;  // v1::SUMMARY_KIND_MINMAX

prometheus::Counter* NewCounter(prometheus::Registry* r, const std::string& name, const std::string& help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(*r).Add({});
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

// Builds the policy of a job (empty name: dense).
absl::StatusOr<std::unique_ptr<engine::AttentionPolicy>> MakePolicy(const v1::SelectionPolicy& p,
                                                                    const model::ModelConfig& c,
                                                                    int page_size) {
  const std::string name = p.name().empty() ? "dense" : p.name();
  if (name == "dense") return engine::MakeDensePolicy();
  STRATA_ASSIGN_OR_RETURN(engine::sparse::PolicyKind kind, engine::sparse::ParsePolicyName(name));
  engine::sparse::PolicyOptions o;
  o.kind = kind;
  o.page_size = page_size;
  if (p.budget_tokens() > 0) o.token_budget = static_cast<int>(p.budget_tokens());
  if (p.has_sink_tokens()) o.sink_tokens = static_cast<int>(p.sink_tokens());
  if (p.has_window_tokens()) o.window_tokens = static_cast<int>(p.window_tokens());
  if (p.has_theta()) o.cache_theta = p.theta();
  for (uint32_t l : p.dense_layers()) o.dense_layers.push_back(static_cast<int>(l));
  switch (p.summary()) {
    case v1::SUMMARY_KIND_MINMAX: o.summary = engine::sparse::SummaryKind::kMinMax; break;
    case v1::SUMMARY_KIND_MEAN: o.summary = engine::sparse::SummaryKind::kMean; break;
    case v1::SUMMARY_KIND_RF: o.summary = engine::sparse::SummaryKind::kRf; break;
    default: break;
  }
  STRATA_RETURN_IF_ERROR(o.Validate());
  return engine::sparse::MakeAttentionPolicy(o, static_cast<int>(c.num_layers), static_cast<int>(c.num_heads),
                                             static_cast<int>(c.num_kv_heads), static_cast<int>(c.head_dim));
}

kvstore::KvLayout LayoutOf(const model::ModelConfig& c, int page_size) {
  kvstore::KvLayout layout;
  layout.num_layers = static_cast<int>(c.num_layers);
  layout.num_kv_heads = static_cast<int>(c.num_kv_heads);
  layout.page.dtype = kernels::DType::kBF16;
  layout.page.page_size = page_size;
  layout.page.head_dim = static_cast<int>(c.head_dim);
  return layout;
}

void AddCounters(WorkerMetrics* m, const engine::SelectionCounters& now, const engine::SelectionCounters& before) {
  if (m == nullptr) return;
  Inc(m->candidate_tokens, static_cast<double>(now.candidate_tokens - before.candidate_tokens));
  Inc(m->selected_tokens, static_cast<double>(now.selected_tokens - before.selected_tokens));
  Inc(m->selection_cache_lookups, static_cast<double>(now.cache_lookups - before.cache_lookups));
  Inc(m->selection_cache_hits, static_cast<double>(now.cache_hits - before.cache_hits));
}

}  // namespace

absl::Status WorkerOptions::Validate() const {
  if (worker_id.empty() || worker_id.size() > 128) return absl::InvalidArgumentError("worker_id: 1..128 chars");
  for (char ch : worker_id) {
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-')) {
      return absl::InvalidArgumentError("worker_id: [A-Za-z0-9._-] only");
    }
  }
  if (page_size < 1 || page_size > 4096) return absl::InvalidArgumentError("page_size in [1, 4096]");
  if (prefill_chunk_size < 1) return absl::InvalidArgumentError("prefill_chunk_size >= 1");
  if (max_jobs < 1) return absl::InvalidArgumentError("max_jobs >= 1");
  if (mount_batch_pages < 1) return absl::InvalidArgumentError("mount_batch_pages >= 1");
  return absl::OkStatus();
}

WorkerMetrics::WorkerMetrics(prometheus::Registry* r) {
  prefill_tokens = NewCounter(r, "strata_prefill_tokens_total", "Tokens run through prefill (documents and prompts).");
  decode_tokens = NewCounter(r, "strata_decode_tokens_total", "Tokens generated by jobs this worker led.");
  candidate_tokens = NewCounter(r, "strata_attention_candidate_tokens_total",
                                "Context tokens that could have been attended, summed over (step, layer, KV head).");
  selected_tokens = NewCounter(r, "strata_attention_selected_tokens_total",
                               "Context tokens attended, summed over (step, layer, KV head).");
  selection_cache_lookups = NewCounter(r, "strata_selection_cache_lookups_total", "Selection-cache lookups.");
  selection_cache_hits = NewCounter(r, "strata_selection_cache_hits_total", "Selection-cache hits.");
  time_to_first_token = &prometheus::BuildHistogram()
                             .Name("strata_time_to_first_token_seconds")
                             .Help("Time to the first generated token of a job.")
                             .Register(*r)
                             .Add({}, prometheus::Histogram::BucketBoundaries{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                                                              60, 120, 300, 600, 1800, 3600});
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

Worker::Worker(const WorkerOptions& options, const model::Model* model, kernels::Backend* backend,
               kvstore::PageStore* store, kvstore::DocumentCatalog* catalog, WorkerMetrics* metrics)
    : options_(options), model_(model), backend_(backend), store_(store), catalog_(catalog), metrics_(metrics) {}

Worker::~Worker() = default;

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options, const model::Model* model,
                                                       kernels::Backend* backend, kvstore::PageStore* store,
                                                       kvstore::DocumentCatalog* catalog, WorkerMetrics* metrics) {
  STRATA_RETURN_IF_ERROR(options.Validate());
  if (model == nullptr || backend == nullptr || store == nullptr || catalog == nullptr) {
    return absl::InvalidArgumentError("Worker::Create: model, backend, store and catalog are required");
  }
  std::unique_ptr<Worker> w(new Worker(options, model, backend, store, catalog, metrics));
  engine::TransformerOptions topt;
  topt.prefill_chunk_size = options.prefill_chunk_size;
  STRATA_ASSIGN_OR_RETURN(w->transformer_, engine::Transformer::Create(model->config, model->weights, backend, topt));
  return w;
}

v1::WorkerInfo Worker::Info() const {
  v1::WorkerInfo info;
  info.set_worker_id(options_.worker_id);
  {
    absl::MutexLock lock(&mu_);
    info.set_address(address_.empty() ? options_.address : address_);
  }
  info.set_model_fingerprint(model_->fingerprint);
  *info.mutable_layout() = kvstore::LayoutToProto(LayoutOf(model_->config, options_.page_size));
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

v1::WorkerLoad Worker::Load() const {
  absl::MutexLock lock(&mu_);
  v1::WorkerLoad load;
  load.set_running_jobs(static_cast<uint32_t>(jobs_.size()));
  load.set_prefilling_shards(static_cast<uint32_t>(prefilling_));
  return load;
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
  const int64_t num_tokens =
      request.shard_map().num_tokens() != 0 ? static_cast<int64_t>(request.shard_map().num_tokens()) : n;
  if (request.shard().first_page() != 0 || n != num_tokens) {
    return absl::UnimplementedError(
        "PrefillShard: only single-shard documents (the shard starts at page 0 and covers the document)");
  }
  for (int32_t t : request.token_ids()) {
    if (t < 0 || t >= c.vocab_size) return absl::InvalidArgumentError(absl::StrCat("token id ", t, " out of range"));
  }
  const int64_t num_pages = (n + P - 1) / P;
  const kvstore::KvLayout layout = LayoutOf(c, P);

  v1::CreateDocumentRequest create;
  create.set_document_id(id.ToHex());
  create.set_model_fingerprint(model_->fingerprint);
  *create.mutable_layout() = kvstore::LayoutToProto(layout);
  create.set_num_tokens(static_cast<uint64_t>(n));
  v1::SummarySpec* spec = create.add_summaries();
  spec->set_kind(kMinMaxSummaryKind);
  spec->set_count(static_cast<uint32_t>(num_pages));
  bool created = false;
  STRATA_ASSIGN_OR_RETURN(v1::Document doc, catalog_->CreateDocument(create, &created));
  v1::PrefillShardProgress progress;
  if (doc.state() == v1::DOCUMENT_STATE_READY) {
    progress.set_tokens_prefilled(static_cast<uint64_t>(n));
    progress.set_pages_persisted(static_cast<uint64_t>(num_pages));
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
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::KvCache> cache,
                          engine::KvCache::Create(transformer_->MakeCacheOptions(n, P, kernels::DType::kBF16),
                                                  backend_));
  auto policy = engine::MakeDensePolicy();
  std::vector<float> logits(static_cast<size_t>(c.vocab_size));
  std::vector<int32_t> ids(request.token_ids().begin(), request.token_ids().end());
  std::vector<uint16_t> kbuf(static_cast<size_t>(P) * d), vbuf(static_cast<size_t>(P) * d);
  std::vector<float> summary(2 * static_cast<size_t>(d));
  int64_t persisted_pages = 0;
  int64_t pos = 0;
  Stopwatch watch;
  while (pos < n) {
    if (cancelled != nullptr && cancelled->load()) return absl::CancelledError("prefill cancelled");
    const int64_t chunk = std::min<int64_t>(options_.prefill_chunk_size, n - pos);
    const engine::SelectionCounters before = policy->counters();
    {
      absl::MutexLock lock(&engine_mu_);
      STRATA_RETURN_IF_ERROR(transformer_->Forward(ids.data() + pos, chunk, pos, cache.get(), policy.get(),
                                                   logits.data(), /*all_logits=*/false));
    }
    AddCounters(metrics_, policy->counters(), before);
    pos += chunk;
    if (metrics_ != nullptr) metrics_->prefill_tokens->Increment(static_cast<double>(chunk));
    // Persist the pages that are now complete (all of them at the end).
    const int64_t complete_pages = pos == n ? num_pages : pos / P;
    std::vector<kvstore::PageWrite> pages;
    std::vector<kvstore::SummaryWrite> summaries;
    for (int64_t p = persisted_pages; p < complete_pages; ++p) {
      const int valid = static_cast<int>(std::min<int64_t>(P, n - p * P));
      for (int l = 0; l < L; ++l) {
        const kernels::TensorView kp = cache->k_pool(l), vp = cache->v_pool(l);
        for (int g = 0; g < H; ++g) {
          const int32_t slot = cache->SlotOf(l, g, p);
          const size_t page_bytes = static_cast<size_t>(P) * d * sizeof(uint16_t);
          const char* ksrc = static_cast<const char*>(kp.data) + static_cast<size_t>(slot) * page_bytes;
          const char* vsrc = static_cast<const char*>(vp.data) + static_cast<size_t>(slot) * page_bytes;
          STRATA_RETURN_IF_ERROR(ToHost(backend_, kbuf.data(), ksrc, page_bytes));
          STRATA_RETURN_IF_ERROR(ToHost(backend_, vbuf.data(), vsrc, page_bytes));
          kernels::TensorView kv(kbuf.data(), kernels::DType::kBF16, {valid, d});
          kernels::TensorView vv(vbuf.data(), kernels::DType::kBF16, {valid, d});
          STRATA_ASSIGN_OR_RETURN(std::string encoded, kvstore::EncodePage(layout.page, kv, vv));
          kvstore::PageWrite pw;
          pw.key = {id, static_cast<uint32_t>(l), static_cast<uint32_t>(g), static_cast<uint32_t>(p)};
          STRATA_ASSIGN_OR_RETURN(pw.data, kvstore::PageBuffer::Copy(encoded));
          pages.push_back(std::move(pw));
          // minmax summary: f32 min[d] then max[d] over the page's valid keys.
          for (int j = 0; j < d; ++j) {
            summary[j] = std::numeric_limits<float>::infinity();
            summary[d + j] = -std::numeric_limits<float>::infinity();
          }
          for (int t = 0; t < valid; ++t) {
            for (int j = 0; j < d; ++j) {
              const float x = kernels::BF16ToF32(kbuf[static_cast<size_t>(t) * d + j]);
              summary[j] = std::min(summary[j], x);
              summary[d + j] = std::max(summary[d + j], x);
            }
          }
          kvstore::SummaryWrite sw;
          sw.key = {id, static_cast<uint32_t>(l), static_cast<uint32_t>(g), kMinMaxSummaryKind,
                    static_cast<uint32_t>(p)};
          STRATA_ASSIGN_OR_RETURN(
              sw.data, kvstore::PageBuffer::Copy(absl::string_view(reinterpret_cast<const char*>(summary.data()),
                                                                   summary.size() * sizeof(float))));
          summaries.push_back(std::move(sw));
        }
      }
    }
    if (!pages.empty()) STRATA_RETURN_IF_ERROR(store_->Put(pages, summaries));
    persisted_pages = complete_pages;
    progress.set_tokens_prefilled(static_cast<uint64_t>(pos));
    progress.set_pages_persisted(static_cast<uint64_t>(persisted_pages));
    if (on_progress && pos < n) on_progress(progress);
  }
  STRATA_ASSIGN_OR_RETURN(v1::Document ready, catalog_->FinalizeDocument(id));
  if (ready.state() != v1::DOCUMENT_STATE_READY) {
    return absl::InternalError(absl::StrCat("document ", id.ToHex(), " not READY after finalize"));
  }
  progress.set_complete(true);
  if (on_progress) on_progress(progress);
  STRATA_LOG(INFO) << "worker: document " << id.ToHex() << " prefilled: tokens=" << n << " pages=" << num_pages
                   << " seconds=" << watch.ElapsedSeconds();
  return absl::OkStatus();
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
  const int L = static_cast<int>(c.num_layers), H = static_cast<int>(c.num_kv_heads), d = static_cast<int>(c.head_dim);
  v1::JobInfo& info = result->info;
  const v1::GenerationParams& params = request.params();
  const int64_t max_tokens = params.max_tokens() == 0 ? 256 : params.max_tokens();
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
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::AttentionPolicy> policy, MakePolicy(request.policy(), c, P));

  const bool has_doc = request.shard_map().shards_size() > 0;
  int64_t doc_tokens = 0;
  kvstore::DocumentId doc_id;
  if (has_doc) {
    STRATA_ASSIGN_OR_RETURN(doc_id, kvstore::DocumentId::FromHex(request.shard_map().document_id()));
    STRATA_ASSIGN_OR_RETURN(v1::Document doc, catalog_->GetDocument(doc_id));
    if (doc.state() != v1::DOCUMENT_STATE_READY) {
      return absl::FailedPreconditionError(absl::StrCat("document ", doc_id.ToHex(), " is not READY in the store"));
    }
    if (!(kvstore::LayoutToProto(LayoutOf(c, P)).SerializeAsString() == doc.layout().SerializeAsString())) {
      return absl::FailedPreconditionError("the document's KV layout does not match this worker's model");
    }
    doc_tokens = static_cast<int64_t>(doc.num_tokens());
  }
  const int64_t context = doc_tokens + static_cast<int64_t>(prompt.size());
  info.set_prompt_tokens(static_cast<uint64_t>(context));
  v1::Usage* usage = info.mutable_usage();
  usage->set_prompt_tokens(static_cast<uint64_t>(context));
  usage->set_cached_tokens(static_cast<uint64_t>(doc_tokens));
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<engine::KvCache> cache,
      engine::KvCache::Create(transformer_->MakeCacheOptions(context + max_tokens, P, kernels::DType::kBF16),
                              backend_));

  // Mount: load every page of the document from the store into the cache, layer by layer.
  if (has_doc) {
    const int64_t num_pages = (doc_tokens + P - 1) / P;
    std::vector<float> kdec(static_cast<size_t>(P) * d), vdec(static_cast<size_t>(P) * d);
    const int64_t batch_pages = options_.mount_batch_pages;
    std::vector<float> k_rows, v_rows;  // [tokens, H, d]
    std::unique_ptr<kernels::Buffer> kdev, vdev;
    const bool host = backend_->Name() == "cpu";
    uint64_t fetched = 0;
    // With a tiered store (host cache in front of the durable tier) usage says which tier served
    // each page; otherwise every page came from the store's own tier.
    auto* tiered = dynamic_cast<kvstore::TieredStore*>(store_);
    kvstore::TierCounts served;
    for (int l = 0; l < L; ++l) {
      for (int64_t p0 = 0; p0 < num_pages; p0 += batch_pages) {
        if (cancelled.load()) return absl::CancelledError("cancelled while mounting");
        const int64_t p1 = std::min(num_pages, p0 + batch_pages);
        std::vector<kvstore::PageKey> keys;
        for (int64_t p = p0; p < p1; ++p) {
          for (int g = 0; g < H; ++g) {
            keys.push_back({doc_id, static_cast<uint32_t>(l), static_cast<uint32_t>(g), static_cast<uint32_t>(p)});
          }
        }
        std::vector<kvstore::PageRef> pages;
        if (tiered != nullptr) {
          STRATA_RETURN_IF_ERROR(tiered->GetPages(keys, &pages, &served));
        } else {
          STRATA_RETURN_IF_ERROR(store_->GetPages(keys, &pages));
        }
        fetched += keys.size();
        const int64_t t0 = p0 * P, t1 = std::min(doc_tokens, p1 * P);
        const int64_t rows = t1 - t0;
        k_rows.assign(static_cast<size_t>(rows) * H * d, 0.0f);
        v_rows.assign(static_cast<size_t>(rows) * H * d, 0.0f);
        for (size_t i = 0; i < keys.size(); ++i) {
          if (pages[i] == nullptr) {
            return absl::DataLossError(absl::StrCat("document ", doc_id.ToHex(), " page (layer ", keys[i].layer,
                                                    ", head ", keys[i].kv_head, ", page ", keys[i].page_index,
                                                    ") is missing from the store"));
          }
          STRATA_RETURN_IF_ERROR(kvstore::DecodePage(pages[i]->view(), kdec.data(), vdec.data()));
          const int64_t p = keys[i].page_index;
          const int g = static_cast<int>(keys[i].kv_head);
          const int64_t valid = std::min<int64_t>(P, doc_tokens - p * P);
          for (int64_t t = 0; t < valid; ++t) {
            const size_t row = static_cast<size_t>(p * P + t - t0);
            std::memcpy(&k_rows[(row * H + g) * d], &kdec[static_cast<size_t>(t) * d], sizeof(float) * d);
            std::memcpy(&v_rows[(row * H + g) * d], &vdec[static_cast<size_t>(t) * d], sizeof(float) * d);
          }
        }
        kernels::TensorView kv(k_rows.data(), kernels::DType::kF32, {rows, H, d});
        kernels::TensorView vv(v_rows.data(), kernels::DType::kF32, {rows, H, d});
        if (!host) {
          const size_t bytes = k_rows.size() * sizeof(float);
          STRATA_ASSIGN_OR_RETURN(kdev, backend_->Allocate(bytes));
          STRATA_ASSIGN_OR_RETURN(vdev, backend_->Allocate(bytes));
          STRATA_RETURN_IF_ERROR(FromHost(backend_, kdev->data(), k_rows.data(), bytes));
          STRATA_RETURN_IF_ERROR(FromHost(backend_, vdev->data(), v_rows.data(), bytes));
          kv.data = kdev->data();
          vv.data = vdev->data();
        }
        const int64_t first = cache->length(l);
        STRATA_RETURN_IF_ERROR(cache->Append(l, kv, vv));
        STRATA_RETURN_IF_ERROR(policy->OnAppend(l, *cache, first, first + rows));
      }
    }
    v1::PagesByTier* tiers = usage->mutable_pages_fetched();
    if (tiered != nullptr) {
      tiers->set_host(served.host);
      tiers->set_disk(served.local);
      tiers->set_remote(served.remote);
    } else if (std::string(store_->tier()) == "remote") {
      tiers->set_remote(fetched);
    } else {
      tiers->set_disk(fetched);
    }
  }

  // Prompt.
  const engine::SelectionCounters start = policy->counters();
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
                                                   logits.data(), /*all_logits=*/false));
    }
    off += static_cast<size_t>(chunk);
    pos += chunk;
    if (metrics_ != nullptr) metrics_->prefill_tokens->Increment(static_cast<double>(chunk));
  }
  AddCounters(metrics_, policy->counters(), start);

  // Decode.
  engine::SamplingOptions so;
  so.temperature = params.temperature();
  so.top_k = params.top_k();
  so.top_p = params.top_p() == 0 ? 1.0 : params.top_p();
  so.seed = params.has_seed() ? params.seed() : 0;
  STRATA_RETURN_IF_ERROR(so.Validate());
  engine::Sampler sampler(so);
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
  engine::SelectionCounters decode_start = policy->counters();
  bool done = false;
  while (!done) {
    if (cancelled.load()) return absl::CancelledError("cancelled");
    STRATA_ASSIGN_OR_RETURN(int32_t next, sampler.Sample(logits.data(), c.vocab_size));
    info.add_output_token_ids(next);
    pending_ids.push_back(next);
    if (metrics_ != nullptr) {
      metrics_->decode_tokens->Increment();
      const int64_t now = MonotonicNanos();
      if (last_token == 0) {
        metrics_->time_to_first_token->Observe((now - job_start) * 1e-9);
      } else {
        metrics_->inter_token_latency->Observe((now - last_token) * 1e-9);
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
    const engine::SelectionCounters before = policy->counters();
    {
      absl::MutexLock lock(&engine_mu_);
      STRATA_RETURN_IF_ERROR(transformer_->Forward(&next, 1, pos, cache.get(), policy.get(), logits.data(),
                                                   /*all_logits=*/false));
    }
    AddCounters(metrics_, policy->counters(), before);
    ++pos;
    ++steps;
  }
  const engine::SelectionCounters end = policy->counters();
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
