// Attention over document shards; see worker/shard_attention.h.
#include "worker/shard_attention.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "engine/query_mean.h"
#include "engine/sparse/policy.h"
#include "grpcpp/grpcpp.h"
#include "strata/v1/internal.grpc.pb.h"
#include "worker/selection_link.h"

namespace strata::worker {

absl::StatusOr<engine::sparse::PolicyOptions> JobPolicyOptions(const v1::SelectionPolicy& p, int page_size) {
  engine::sparse::PolicyOptions o;
  if (p.name().empty()) {
    o.kind = engine::sparse::PolicyKind::kDense;
  } else {
    STRATA_ASSIGN_OR_RETURN(o.kind, engine::sparse::ParsePolicyName(p.name()));
  }
  o.page_size = page_size;
  if (p.budget_tokens() > 0) o.token_budget = static_cast<int>(p.budget_tokens());
  if (p.has_sink_tokens()) o.sink_tokens = static_cast<int>(p.sink_tokens());
  if (p.has_window_tokens()) o.window_tokens = static_cast<int>(p.window_tokens());
  if (p.has_theta()) o.cache_theta = p.theta();
  if (p.has_candidate_factor()) o.tokenselect_candidate_factor = static_cast<int>(p.candidate_factor());
  // Clamped so that a huge value stays out of range (Validate names it) instead of wrapping.
  if (p.has_partitions()) o.tokenselect_partitions = static_cast<int>(std::min<uint32_t>(p.partitions(), 1u << 20));
  for (uint32_t l : p.dense_layers()) o.dense_layers.push_back(static_cast<int>(l));
  switch (p.summary()) {
    case v1::SUMMARY_KIND_MINMAX: o.summary = engine::sparse::SummaryKind::kMinMax; break;
    case v1::SUMMARY_KIND_MEAN: o.summary = engine::sparse::SummaryKind::kMean; break;
    case v1::SUMMARY_KIND_RF: o.summary = engine::sparse::SummaryKind::kRf; break;
    default: break;
  }
  STRATA_RETURN_IF_ERROR(o.Validate());
  return o;
}

absl::StatusOr<std::unique_ptr<engine::AttentionPolicy>> MakeJobPolicy(const v1::SelectionPolicy& p,
                                                                       const model::ModelConfig& c,
                                                                       int page_size) {
  if (IsDensePolicy(p)) return engine::MakeDensePolicy();
  STRATA_ASSIGN_OR_RETURN(engine::sparse::PolicyOptions o, JobPolicyOptions(p, page_size));
  return engine::sparse::MakeAttentionPolicy(o, static_cast<int>(c.num_layers), static_cast<int>(c.num_heads),
                                             static_cast<int>(c.num_kv_heads), static_cast<int>(c.head_dim));
}

bool IsDensePolicy(const v1::SelectionPolicy& p) { return p.name().empty() || p.name() == "dense"; }

std::string ShardKey(const v1::ShardRange& r) {
  return absl::StrCat(r.document_id(), ":", r.first_page(), ":", r.end_page());
}

namespace {

// A call's views (CallViews) and, off the CPU backend, its queries staged: *scratch grown to n
// tokens when smaller, q copied into its pinned staging and, with queue_copy, the staging's copy to
// the backend queued on `stream` (a recorded step copies it itself). out's vectors sized.
absl::StatusOr<CallViews> StageCall(kernels::Backend* backend, const float* q, int n, int hq, int d,
                                    AttendScratch* scratch, engine::AttentionPartial* out, kernels::Stream stream,
                                    bool queue_copy = true) {
  const size_t q_elems = static_cast<size_t>(n) * hq * d, l_elems = static_cast<size_t>(n) * hq;
  out->o.resize(q_elems);
  out->lse.resize(l_elems);
  CallViews v;
  v.host = backend->Name() == "cpu";
  v.q = const_cast<float*>(q);
  v.out = out->o.data();
  v.lse = out->lse.data();
  if (!v.host) {
    if (scratch->capacity_tokens < static_cast<size_t>(n)) {
      STRATA_ASSIGN_OR_RETURN(scratch->q, backend->Allocate(q_elems * 4));
      STRATA_ASSIGN_OR_RETURN(scratch->out, backend->Allocate(q_elems * 4));
      STRATA_ASSIGN_OR_RETURN(scratch->lse, backend->Allocate(l_elems * 4));
      STRATA_ASSIGN_OR_RETURN(scratch->q_host, backend->AllocateHost(q_elems * 4));
      STRATA_ASSIGN_OR_RETURN(scratch->out_host, backend->AllocateHost(q_elems * 4));
      STRATA_ASSIGN_OR_RETURN(scratch->lse_host, backend->AllocateHost(l_elems * 4));
      scratch->capacity_tokens = static_cast<size_t>(n);
    }
    std::memcpy(scratch->q_host->data(), q, q_elems * 4);
    if (queue_copy) {
      STRATA_RETURN_IF_ERROR(backend->CopyToDeviceAsync(scratch->q->data(), scratch->q_host->data(), q_elems * 4,
                                                        stream));
    }
    v.q = scratch->q->data();
    v.out = scratch->out->data();
    v.lse = scratch->lse->data();
  }
  return v;
}

// Queues the call's output and lse back to the host (when they are not there already) into the
// pinned staging, on `stream`.
absl::Status QueueResults(kernels::Backend* backend, const CallViews& v, const AttendScratch& scratch,
                          const engine::AttentionPartial& out, kernels::Stream stream) {
  if (v.host) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(
      backend->CopyToHostAsync(scratch.out_host->data(), v.out, out.o.size() * 4, stream));
  return backend->CopyToHostAsync(scratch.lse_host->data(), v.lse, out.lse.size() * 4, stream);
}

// Once the stream has been waited for: the results from the staging into *out.
void TakeResults(const CallViews& v, const AttendScratch& scratch, engine::AttentionPartial* out) {
  if (v.host) return;
  std::memcpy(out->o.data(), scratch.out_host->data(), out->o.size() * 4);
  std::memcpy(out->lse.data(), scratch.lse_host->data(), out->lse.size() * 4);
}

// Queues PagedAttention of q over `selection` (as AttendSelection) on `stream`, with its results'
// copies; the partial is in *out once the stream has been waited for and TakeResults ran.
absl::StatusOr<CallViews> QueueSelection(kernels::Backend* backend, const engine::KvCache& cache, int layer,
                                         const engine::Selection& selection, const float* q, int n, int hq,
                                         int64_t q_begin, AttendScratch* scratch, engine::AttentionPartial* out,
                                         kernels::Stream stream) {
  const int d = cache.options().head_dim;
  const int hkv = cache.options().num_kv_heads;
  scratch->positions.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) scratch->positions[i] = static_cast<int32_t>(q_begin + i);
  STRATA_ASSIGN_OR_RETURN(const CallViews v, StageCall(backend, q, n, hq, d, scratch, out, stream));
  kernels::PagedAttentionParams ap;
  ap.q = kernels::TensorView(v.q, kernels::DType::kF32, {n, hq, d});
  ap.k_pool = cache.k_pool(layer);
  ap.v_pool = cache.v_pool(layer);
  ap.spans = selection.spans.data();
  ap.span_offsets = selection.offsets.data();
  ap.num_kv_heads = hkv;
  ap.q_positions = scratch->positions.data();
  ap.causal = true;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(d));
  ap.k_scale = cache.options().k_scale;  // fp8 caches (1 otherwise)
  ap.v_scale = cache.options().v_scale;
  ap.out = kernels::TensorView(v.out, kernels::DType::kF32, {n, hq, d});
  ap.lse = kernels::TensorView(v.lse, kernels::DType::kF32, {n, hq});
  STRATA_RETURN_IF_ERROR(backend->PagedAttention(ap, stream));
  STRATA_RETURN_IF_ERROR(QueueResults(backend, v, *scratch, *out, stream));
  return v;
}

// What a selection did between two readings of its counters, added to *sum (when set).
void AddSince(const engine::SelectionCounters& before, const engine::SelectionCounters& after,
              engine::SelectionCounters* sum) {
  if (sum == nullptr) return;
  sum->candidate_tokens += after.candidate_tokens - before.candidate_tokens;
  sum->selected_tokens += after.selected_tokens - before.selected_tokens;
  sum->cache_lookups += after.cache_lookups - before.cache_lookups;
  sum->cache_hits += after.cache_hits - before.cache_hits;
}

}  // namespace

bool DeviceShardPolicy(const v1::SelectionPolicy& policy, int page_size) {
  if (IsDensePolicy(policy)) return true;
  absl::StatusOr<engine::sparse::PolicyOptions> o = JobPolicyOptions(policy, page_size);
  return o.ok() &&
         (o->kind == engine::sparse::PolicyKind::kQuest || o->kind == engine::sparse::PolicyKind::kTokenSelect) &&
         o->EffectiveSummary() == engine::sparse::SummaryKind::kMinMax;
}

absl::Status AttendSelection(kernels::Backend* backend, const engine::KvCache& cache, int layer,
                             const engine::Selection& selection, const float* q, int n, int hq, int64_t q_begin,
                             AttendScratch* scratch, engine::AttentionPartial* out) {
  STRATA_ASSIGN_OR_RETURN(const CallViews v,
                          QueueSelection(backend, cache, layer, selection, q, n, hq, q_begin, scratch, out, nullptr));
  STRATA_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  TakeResults(v, *scratch, out);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// ShardSession
// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<ShardSession>> ShardSession::Create(std::shared_ptr<const MountedShard> shard,
                                                                   const v1::SelectionPolicy& policy,
                                                                   uint32_t budget_tokens,
                                                                   const model::ModelConfig& config) {
  if (shard == nullptr || shard->backend() == nullptr) {
    return absl::InvalidArgumentError("ShardSession: null shard or backend");
  }
  std::unique_ptr<ShardSession> s(new ShardSession(std::move(shard), config));
  {
    absl::MutexLockMaybe lock(s->shard_->backend_mu());
    STRATA_ASSIGN_OR_RETURN(s->stream_, s->backend_->CreateStream());
  }
  if (IsDensePolicy(policy) && s->shard_->device_selection()) {
    // Dense decode steps attend the whole shard through its page table (SelectedAttention; on
    // CUDA the paged decode kernel) instead of spans built on the host per call.
    const engine::KvCache& cache = s->shard_->cache();
    const std::vector<int32_t> table = cache.PageTable(cache.pages_per_head());
    absl::MutexLockMaybe lock(s->shard_->backend_mu());
    STRATA_ASSIGN_OR_RETURN(s->dense_table_, s->backend_->Allocate(table.size() * sizeof(int32_t)));
    STRATA_RETURN_IF_ERROR(s->backend_->CopyToDevice(s->dense_table_->data(), table.data(),
                                                     table.size() * sizeof(int32_t), s->stream_));
  }
  if (!IsDensePolicy(policy)) {
    v1::SelectionPolicy p = policy;
    // Sinks belong to the shard holding tokens [0, S); the window belongs to the leader.
    if (s->shard_->first_token() != 0) p.set_sink_tokens(0);
    p.set_window_tokens(0);
    // tokenselect in parts rounds the share up to a multiple of the parts asked for itself (each
    // part keeps ceil(share / parts) tokens); by default the parts are chosen for the share
    // (PolicyOptions::EffectivePartitions) and divide it.
    if (budget_tokens > 0) p.set_budget_tokens(budget_tokens);
    const engine::KvCache& cache = s->shard_->cache();
    const int page_size = cache.options().page_size;
    absl::MutexLockMaybe lock(s->shard_->backend_mu());
    if (s->shard_->device_selection()) {
      if (!DeviceShardPolicy(p, page_size)) {
        return absl::InvalidArgumentError(absl::StrCat("policy '", p.name(),
                                                       "' cannot select on a device-placed shard (dense, "
                                                       "quest and tokenselect with minmax summaries can)"));
      }
      STRATA_ASSIGN_OR_RETURN(const engine::sparse::PolicyOptions o, JobPolicyOptions(p, page_size));
      STRATA_ASSIGN_OR_RETURN(s->device_, engine::sparse::DevicePolicy::Create(
                                              o, cache.options(), static_cast<int>(config.num_heads), s->backend_));
      for (int l = 0; l < static_cast<int>(config.num_layers); ++l) {
        STRATA_RETURN_IF_ERROR(s->device_->OnAppend(l, cache, 0, cache.length(l), s->stream_));
      }
      STRATA_RETURN_IF_ERROR(s->backend_->Synchronize(s->stream_));
    } else {
      STRATA_ASSIGN_OR_RETURN(s->policy_, MakeJobPolicy(p, config, page_size));
      for (int l = 0; l < static_cast<int>(config.num_layers); ++l) {
        STRATA_RETURN_IF_ERROR(s->policy_->OnAppend(l, cache, 0, cache.length(l)));
      }
    }
  }
  return s;
}

ShardSession::~ShardSession() {
  if (stream_ == nullptr) return;
  if (pending_.active) backend_->Synchronize(stream_).IgnoreError();  // its buffers are freed next
  absl::MutexLockMaybe lock(shard_->backend_mu());
  step_graphs_.clear();
  const absl::Status s = backend_->DestroyStream(stream_);
  if (!s.ok()) STRATA_LOG(WARNING) << "ShardSession: " << s;
}

absl::Status ShardSession::Attend(int layer, const float* q, int n, int hq, int64_t q_begin,
                                  engine::AttentionPartial* out, engine::SelectionCounters* counters) {
  STRATA_RETURN_IF_ERROR(Start(layer, q, n, hq, q_begin, out, counters));
  return Finish();
}

absl::Status ShardSession::Start(int layer, const float* q, int n, int hq, int64_t q_begin,
                                 engine::AttentionPartial* out, engine::SelectionCounters* counters) {
  if (pending_.active) STRATA_RETURN_IF_ERROR(Finish());
  const engine::KvCache& cache = shard_->cache();
  if (layer < 0 || layer >= cache.options().num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (n < 1 || q == nullptr || hq != static_cast<int>(config_.num_heads)) {
    return absl::InvalidArgumentError(absl::StrCat("queries: ", n, " tokens x ", hq, " heads (want >= 1 x ",
                                                   config_.num_heads, ")"));
  }
  // The work goes onto the session's stream under the shard backend's lock, which Finish does not
  // hold while it waits, so that other sessions on the backend queue theirs meanwhile.
  absl::MutexLockMaybe lock(shard_->backend_mu());
  pending_.scratch = &scratch_;
  STRATA_RETURN_IF_ERROR(Queue(layer, q, n, hq, q_begin, out, counters, &pending_.v, &pending_.before));
  pending_.active = true;
  pending_.out = out;
  pending_.counters = counters;
  return absl::OkStatus();
}

absl::Status ShardSession::Finish() {
  if (!pending_.active) return absl::FailedPreconditionError("ShardSession::Finish without Start");
  pending_.active = false;
  STRATA_RETURN_IF_ERROR(backend_->Synchronize(stream_));
  TakeResults(pending_.v, *pending_.scratch, pending_.out);
  if (device_ != nullptr) {
    device_->TakeCacheHits();  // read with the results (Queue); the session's own policy
    AddSince(pending_.before, device_->counters(), pending_.counters);
  }
  return absl::OkStatus();
}

absl::Status ShardSession::Queue(int layer, const float* q, int n, int hq, int64_t q_begin,
                                 engine::AttentionPartial* out, engine::SelectionCounters* counters, CallViews* v,
                                 engine::SelectionCounters* before) {
  const engine::KvCache& cache = shard_->cache();
  const int hkv = cache.options().num_kv_heads, d = cache.options().head_dim;
  const int64_t len = cache.length(layer);
  if (device_ != nullptr) *before = device_->counters();
  if (n == 1 && (device_ != nullptr || dense_table_ != nullptr)) {
    // A one-token query (a decode step) on a device-selection shard: the device policy's step, or
    // dense attention over the shard's page table.
    if (device_ == nullptr && counters != nullptr) {
      counters->candidate_tokens += len * hkv;
      counters->selected_tokens += len * hkv;
    }
    if (graphs_on_) {
      STRATA_ASSIGN_OR_RETURN(const bool replayed, QueueStepGraph(layer, q, hq, out, v));
      if (replayed) return absl::OkStatus();
    }
    STRATA_ASSIGN_OR_RETURN(*v, StageCall(backend_, q, 1, hq, d, &scratch_, out, stream_));
    STRATA_RETURN_IF_ERROR(QueueStep(layer, *v, hq));
    if (device_ != nullptr) STRATA_RETURN_IF_ERROR(device_->QueueCacheHitsRead(stream_));
    return QueueResults(backend_, *v, scratch_, *out, stream_);
  }
  if (device_ != nullptr) {
    STRATA_ASSIGN_OR_RETURN(*v, StageCall(backend_, q, n, hq, d, &scratch_, out, stream_));
    STRATA_RETURN_IF_ERROR(device_->AttendFollowing(
        layer, kernels::TensorView(v->q, kernels::DType::kF32, {n, hq, d}), cache,
        kernels::TensorView(v->out, kernels::DType::kF32, {n, hq, d}),
        kernels::TensorView(v->lse, kernels::DType::kF32, {n, hq}), stream_));
    // The selection cache's hit count comes back with the results (no wait of its own).
    STRATA_RETURN_IF_ERROR(device_->QueueCacheHitsRead(stream_));  // no-op without the cache
    return QueueResults(backend_, *v, scratch_, *out, stream_);
  }
  if (policy_ == nullptr) {
    selection_.Clear();
    selection_.offsets.push_back(0);
    for (int g = 0; g < hkv; ++g) {
      cache.AppendSpans(layer, g, 0, len, &selection_.spans);
      selection_.offsets.push_back(static_cast<int32_t>(selection_.spans.size()));
    }
    if (counters != nullptr) {
      counters->candidate_tokens += len * hkv;
      counters->selected_tokens += len * hkv;
    }
  } else {
    // The mean query of the call, placed on the shard's last token (see the header).
    engine::MeanQuery(q, n, static_cast<int64_t>(hq) * d, &qmean_);
    const engine::SelectionCounters selected_before = policy_->counters();
    STRATA_RETURN_IF_ERROR(policy_->Select(layer, qmean_.data(), 1, hq, len - 1, cache, &selection_));
    AddSince(selected_before, policy_->counters(), counters);
  }
  const int32_t base = static_cast<int32_t>(shard_->first_token());
  for (kernels::KvSpan& s : selection_.spans) s.position += base;
  STRATA_ASSIGN_OR_RETURN(*v, QueueSelection(backend_, cache, layer, selection_, q, n, hq, q_begin, &scratch_, out,
                                             stream_));
  return absl::OkStatus();
}

absl::StatusOr<bool> ShardSession::QueueStepGraph(int layer, const float* q, int hq, engine::AttentionPartial* out,
                                                  CallViews* v) {
  static const bool enabled = [] {
    const char* e = std::getenv("STRATA_SHARD_STEP_GRAPHS");
    return e == nullptr || std::string(e) != "0";
  }();
  if (!enabled) {
    graphs_on_ = false;
    return false;
  }
  const engine::KvCache& cache = shard_->cache();
  const int d = cache.options().head_dim;
  STRATA_ASSIGN_OR_RETURN(*v, StageCall(backend_, q, 1, hq, d, &step_scratch_, out, stream_, /*queue_copy=*/false));
  if (v->host) {  // a backend that runs ops as they are called: nothing to record
    graphs_on_ = false;
    return false;
  }
  if (step_graphs_.empty()) step_graphs_.resize(static_cast<size_t>(cache.options().num_layers));
  std::unique_ptr<kernels::Graph>& graph = step_graphs_[static_cast<size_t>(layer)];
  const size_t q_bytes = out->o.size() * 4;
  if (graph == nullptr) {
    const absl::Status begun = backend_->BeginCapture(stream_);
    if (!begun.ok()) {
      STRATA_LOG(WARNING) << "ShardSession: one-token steps not recorded (" << begun << "); queued call by call";
      graphs_on_ = false;
      return false;
    }
    // The device policy's host side (its counting) runs as it records: it counts this call.
    absl::Status recorded = backend_->CopyToDeviceAsync(v->q, step_scratch_.q_host->data(), q_bytes, stream_);
    if (recorded.ok()) recorded = QueueStep(layer, *v, hq);
    const bool counted = recorded.ok();  // the device policy counted the step
    if (recorded.ok()) recorded = QueueResults(backend_, *v, step_scratch_, *out, stream_);
    absl::StatusOr<std::unique_ptr<kernels::Graph>> made = backend_->EndCapture(stream_);
    if (!recorded.ok() || !made.ok()) {
      // Nothing ran: the recording's counts are taken back (the call is queued call by call next).
      STRATA_LOG(WARNING) << "ShardSession: a one-token step could not be recorded ("
                          << (recorded.ok() ? made.status() : recorded) << "); queued call by call from now on";
      graphs_on_ = false;
      if (counted && device_ != nullptr) STRATA_RETURN_IF_ERROR(device_->DiscardRecordedAttend(layer, cache));
      return false;
    }
    graph = *std::move(made);
  } else if (device_ != nullptr) {
    STRATA_RETURN_IF_ERROR(device_->NoteReplayedAttend(layer, cache));
  }
  STRATA_RETURN_IF_ERROR(graph->Replay(stream_));
  pending_.scratch = &step_scratch_;  // Finish takes the results from there
  // The selection cache's hit count comes back with the results (its host side runs per call).
  if (device_ != nullptr) STRATA_RETURN_IF_ERROR(device_->QueueCacheHitsRead(stream_));
  return true;
}

absl::Status ShardSession::QueueStep(int layer, const CallViews& v, int hq) {
  const engine::KvCache& cache = shard_->cache();
  const int d = cache.options().head_dim;
  const kernels::TensorView q(v.q, kernels::DType::kF32, {1, hq, d});
  const kernels::TensorView out(v.out, kernels::DType::kF32, {1, hq, d});
  const kernels::TensorView lse(v.lse, kernels::DType::kF32, {1, hq});
  if (device_ != nullptr) return device_->AttendFollowing(layer, q, cache, out, lse, stream_);
  kernels::SelectedAttentionParams at;
  at.q = q;
  at.k_pool = cache.k_pool(layer);
  at.v_pool = cache.v_pool(layer);
  at.page_table = dense_table_->View(kernels::DType::kI32, {cache.options().num_kv_heads, cache.pages_per_head()});
  at.prefix_end = cache.length(layer);  // every token of the shard precedes the query
  at.scale = 1.0f / std::sqrt(static_cast<float>(d));
  at.k_scale = cache.options().k_scale;
  at.v_scale = cache.options().v_scale;
  at.out = out;
  at.lse = lse;
  return backend_->SelectedAttention(at, stream_);
}

absl::Status ShardSession::Answer(const v1::LayerQuery& query, v1::SelectionResponse* response) {
  const int hq = static_cast<int>(config_.num_heads), d = static_cast<int>(config_.head_dim);
  const int64_t n = query.num_tokens();
  if (n < 1 || n > (int64_t{1} << 20)) return absl::InvalidArgumentError("LayerQuery: num_tokens out of range");
  if (query.q().size() != static_cast<size_t>(n) * hq * d * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("LayerQuery: q has ", query.q().size(), " bytes, expected ",
                                                   static_cast<size_t>(n) * hq * d * sizeof(float)));
  }
  if (query.q_begin() > static_cast<uint64_t>(INT32_MAX)) return absl::InvalidArgumentError("LayerQuery: q_begin");
  const auto t0 = std::chrono::steady_clock::now();
  // The queries are read in place when the message's bytes are float-aligned (Start reads them
  // before it returns), else from an aligned copy.
  const float* q = reinterpret_cast<const float*>(query.q().data());
  if (reinterpret_cast<uintptr_t>(q) % alignof(float) != 0) {
    q_copy_.resize(static_cast<size_t>(n) * hq * d);
    std::memcpy(q_copy_.data(), query.q().data(), query.q().size());
    q = q_copy_.data();
  }
  engine::SelectionCounters counters;
  STRATA_RETURN_IF_ERROR(Start(static_cast<int>(query.layer()), q, static_cast<int>(n), hq,
                               static_cast<int64_t>(query.q_begin()), &partial_, &counters));
  const auto t1 = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(Finish());
  ++answer_timing_.answers;
  answer_timing_.queue_seconds += std::chrono::duration<double>(t1 - t0).count();
  answer_timing_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  if (on_answer_) on_answer_(counters);
  response->set_step(query.step());
  response->set_layer(query.layer());
  response->set_o(reinterpret_cast<const char*>(partial_.o.data()), partial_.o.size() * sizeof(float));
  response->set_lse(reinterpret_cast<const char*>(partial_.lse.data()), partial_.lse.size() * sizeof(float));
  response->set_selected_tokens(static_cast<uint64_t>(counters.selected_tokens));
  response->set_candidate_tokens(static_cast<uint64_t>(counters.candidate_tokens));
  if (has_report_pages_) {
    response->mutable_pages_fetched()->set_host(static_cast<uint64_t>(report_pages_.host));
    response->mutable_pages_fetched()->set_disk(static_cast<uint64_t>(report_pages_.local));
    response->mutable_pages_fetched()->set_remote(static_cast<uint64_t>(report_pages_.remote));
    has_report_pages_ = false;
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// LeaderAttention
// ---------------------------------------------------------------------------------------------

struct LeaderAttention::Part {
  v1::ShardRange range;
  uint32_t budget_tokens = 0;
  // Local: the session, and the partial a Prepare started it on. Remote: the stream (until it
  // fails over).
  std::unique_ptr<ShardSession> local;
  engine::AttentionPartial local_out;
  std::string worker_id, address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::ShardSelection::Stub> stub;
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SelectionRequest, v1::SelectionResponse>> stream;
  // Or, when the shard map offers the holder's selection link and it connected, the link
  // instead of the stream (no watchdog: its reads poll with the deadline).
  std::unique_ptr<SelectionLink> link;
  bool sent = false;  // a query of the current layer is in flight
  // The deadline of the leader's Read in flight (absl::ToUnixNanos), 0 while it reads nothing,
  // -1 once the watchdog cancelled the stream for passing it. The leader reads answers on its own
  // thread (a reader thread handing them over cost ~40 us per round trip: bench/RESULTS.md,
  // shard_rtt_bench) and LeaderAttention's watchdog enforces the deadline.
  std::atomic<int64_t> read_deadline{0};

  // The next answer, or false (with *why) when the stream closed or nothing came by `deadline`
  // (then the stream is cancelled, even if an answer came as the watchdog fired).
  bool NextAnswer(absl::Time deadline, v1::SelectionResponse* out, std::string* why) {
    if (link != nullptr) return link->Read(deadline, out, why);
    read_deadline.store(std::max<int64_t>(1, absl::ToUnixNanos(deadline)));
    const bool ok = stream->Read(out);
    if (read_deadline.exchange(0) < 0) {
      *why = "no answer before the deadline";
      return false;
    }
    if (!ok) {
      *why = "stream closed";
      return false;
    }
    return true;
  }
  // Called by the watchdog: cancels the stream when the Read in flight is past its deadline.
  // `context` is set before the watchdog starts and lives until it has stopped, and TryCancel
  // may run beside the leader's calls on the stream.
  void CancelIfOverdue(int64_t now_ns) {
    int64_t d = read_deadline.load();
    if (d > 0 && now_ns >= d && read_deadline.compare_exchange_strong(d, -1)) context->TryCancel();
  }
  void CloseStream() {
    link.reset();
    if (stream == nullptr) return;
    context->TryCancel();
    stream->Finish();  // status ignored: the stream is being abandoned
    stream.reset();
  }
};

void LeaderAttention::StartWatchdog() {
  watchdog_ = std::thread([this] {
    absl::MutexLock lock(&watch_mu_);
    // Wakes every 10 ms (the deadline's precision) until the destructor stops it.
    while (!watch_mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Milliseconds(10))) {
      const int64_t now = absl::ToUnixNanos(absl::Now());
      for (auto& p : parts_) p->CancelIfOverdue(now);
    }
  });
}

absl::StatusOr<std::unique_ptr<LeaderAttention>> LeaderAttention::Create(const Options& options,
                                                                         const v1::ShardMap& map) {
  if (options.config == nullptr || !options.mount) {
    return absl::InvalidArgumentError("LeaderAttention: config and mount are required");
  }
  std::unique_ptr<LeaderAttention> la(new LeaderAttention(options));
  const int64_t P = map.page_size();
  const int64_t doc_tokens = static_cast<int64_t>(map.num_tokens());
  const bool dense = IsDensePolicy(options.policy);
  const int64_t total_budget = options.policy.budget_tokens() > 0 ? options.policy.budget_tokens() : 2048;
  for (const v1::ShardAssignment& a : map.shards()) {
    auto part = std::make_unique<Part>();
    part->range = a.range();
    if (part->range.document_id().empty()) part->range.set_document_id(map.document_id());
    part->worker_id = a.worker_id();
    part->address = a.worker_address();
    const int64_t t0 = static_cast<int64_t>(part->range.first_page()) * P;
    const int64_t t1 = std::min<int64_t>(static_cast<int64_t>(part->range.end_page()) * P, doc_tokens);
    if (!dense && doc_tokens > 0) {
      // This shard's share of the budget, proportional to its tokens (at least one token).
      part->budget_tokens =
          static_cast<uint32_t>(std::max<int64_t>(1, (total_budget * (t1 - t0) + doc_tokens - 1) / doc_tokens));
    }
    if (part->worker_id.empty() || part->worker_id == options.self_worker_id) {
      kvstore::TierCounts pages;
      STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const MountedShard> m, options.mount(part->range, &pages));
      la->pages_.host += pages.host;
      la->pages_.local += pages.local;
      la->pages_.remote += pages.remote;
      STRATA_ASSIGN_OR_RETURN(part->local,
                              ShardSession::Create(std::move(m), options.policy, part->budget_tokens, *options.config));
      la->parts_.push_back(std::move(part));
      continue;
    }
    Part* raw = part.get();
    la->parts_.push_back(std::move(part));
    v1::SelectionRequest open;
    v1::SelectionOpen* o = open.mutable_open();
    o->set_job_id(options.job_id);
    *o->mutable_shard() = raw->range;
    *o->mutable_policy() = options.policy;
    o->set_budget_tokens(raw->budget_tokens);
    o->set_num_q_heads(static_cast<uint32_t>(options.config->num_heads));
    o->set_head_dim(static_cast<uint32_t>(options.config->head_dim));
    // The holder's selection link when the map offers one and it connects; else (or when it
    // cannot be reached) the gRPC stream, which fails over at its first query if the holder is down.
    if (!a.selection_link_address().empty()) {
      absl::StatusOr<std::unique_ptr<SelectionLink>> link =
          SelectionLink::Connect(a.selection_link_address(), absl::Seconds(1));
      if (link.ok() && (*link)->Write(open.SerializeAsString())) {
        raw->link = *std::move(link);
        continue;
      }
      STRATA_LOG(WARNING) << "job " << options.job_id << ": selection link to " << raw->worker_id << " at "
                          << a.selection_link_address() << " unusable ("
                          << (link.ok() ? std::string("write failed") : link.status().ToString())
                          << "); using the ShardSelection stream";
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    raw->channel = grpc::CreateCustomChannel(raw->address, grpc::InsecureChannelCredentials(), args);
    raw->stub = v1::ShardSelection::NewStub(raw->channel);
    raw->context = std::make_unique<grpc::ClientContext>();
    raw->stream = raw->stub->Select(raw->context.get());
    if (!raw->stream->Write(open)) STRATA_RETURN_IF_ERROR(la->Failover(raw, "open failed"));
  }
  // Every part exists now (the watchdog reads parts_).
  for (const auto& p : la->parts_) {
    if (p->context != nullptr) {
      la->StartWatchdog();
      break;
    }
  }
  return la;
}

LeaderAttention::LeaderAttention(const Options& options) : options_(options) {}

LeaderAttention::~LeaderAttention() {
  if (watchdog_.joinable()) {
    {
      absl::MutexLock lock(&watch_mu_);
      stopping_ = true;
    }
    watchdog_.join();
  }
  for (auto& p : parts_) p->CloseStream();
}

absl::Status LeaderAttention::Failover(Part* part, const std::string& why) {
  STRATA_LOG(WARNING) << "job " << options_.job_id << ": selection stream to " << part->worker_id << " ("
                      << part->address << ") for shard " << ShardKey(part->range) << " failed (" << why
                      << "); mounting the shard here from the store";
  part->CloseStream();
  part->sent = false;
  kvstore::TierCounts pages;
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<const MountedShard> m, options_.mount(part->range, &pages));
  pages_.host += pages.host;
  pages_.local += pages.local;
  pages_.remote += pages.remote;
  STRATA_ASSIGN_OR_RETURN(part->local,
                          ShardSession::Create(std::move(m), options_.policy, part->budget_tokens, *options_.config));
  ++failovers_;
  return absl::OkStatus();
}

absl::Status LeaderAttention::Prepare(int layer, const float* q, int n, int hq, int64_t q_begin) {
  STRATA_RETURN_IF_ERROR(SendQueries(layer, q, n, hq, q_begin));
  // The local shards' work (every local part, those failed over just now included) starts too,
  // on their sessions' streams; Attend waits for it.
  for (auto& p : parts_) {
    if (p->local == nullptr) continue;
    STRATA_RETURN_IF_ERROR(p->local->Start(layer, q, n, hq, q_begin, &p->local_out, &counters_));
  }
  prepared_layer_ = layer;
  return absl::OkStatus();
}

absl::Status LeaderAttention::SendQueries(int layer, const float* q, int n, int hq, int64_t q_begin) {
  if (layer == 0) {
    if (!first_call_) ++step_;
    first_call_ = false;
  }
  const size_t q_bytes = static_cast<size_t>(n) * hq * options_.config->head_dim * sizeof(float);
  v1::SelectionRequest req;
  bool built = false;
  request_bytes_.clear();  // the request serialized once for every link
  for (auto& p : parts_) {
    if (p->local != nullptr) continue;
    if (!built) {
      v1::LayerQuery* lq = req.mutable_query();
      lq->set_step(step_);
      lq->set_layer(static_cast<uint32_t>(layer));
      lq->set_num_tokens(static_cast<uint32_t>(n));
      lq->set_q_begin(static_cast<uint64_t>(q_begin));
      lq->set_q(reinterpret_cast<const char*>(q), q_bytes);
      built = true;
    }
    if (p->link != nullptr && request_bytes_.empty()) req.SerializeToString(&request_bytes_);
    p->sent = p->link != nullptr ? p->link->Write(request_bytes_) : p->stream->Write(req);
    if (!p->sent) STRATA_RETURN_IF_ERROR(Failover(p.get(), "write failed"));
  }
  return absl::OkStatus();
}

absl::Status LeaderAttention::Attend(int layer, const float* q, int n, int hq, int64_t q_begin,
                                     std::vector<engine::AttentionPartial>* parts) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t_start = Clock::now();
  parts->resize(parts_.size());
  const size_t q_bytes = static_cast<size_t>(n) * hq * options_.config->head_dim * sizeof(float);
  // 1. Queries to every peer, unless Prepare sent them (and started the local shards).
  const bool prepared = prepared_layer_ == layer;
  if (!prepared) STRATA_RETURN_IF_ERROR(SendQueries(layer, q, n, hq, q_begin));
  prepared_layer_ = -1;
  // 2. Local shards (including shards failed over in step 1).
  const Clock::time_point t_local = Clock::now();
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part* p = parts_[i].get();
    if (p->local == nullptr) continue;
    if (prepared) {
      STRATA_RETURN_IF_ERROR(p->local->Finish());
      std::swap((*parts)[i], p->local_out);
    } else {
      STRATA_RETURN_IF_ERROR(p->local->Attend(layer, q, n, hq, q_begin, &(*parts)[i], &counters_));
    }
  }
  const Clock::time_point t_wait = Clock::now();
  // 3. The peers' answers, all within one deadline.
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.peer_timeout_ms);
  const size_t lse_bytes = static_cast<size_t>(n) * hq * sizeof(float);
  for (size_t i = 0; i < parts_.size(); ++i) {
    Part* p = parts_[i].get();
    if (p->local != nullptr || !p->sent) continue;
    p->sent = false;
    v1::SelectionResponse resp;
    std::string why;
    bool answered = p->NextAnswer(deadline, &resp, &why);
    // Answers to queries of an earlier forward that did not finish (a batched forward that failed
    // after Prepare sent every job's queries) are dropped.
    while (answered &&
           (resp.step() < step_ || (resp.step() == step_ && resp.layer() < static_cast<uint32_t>(layer)))) {
      answered = p->NextAnswer(deadline, &resp, &why);
    }
    if (answered && (resp.step() != step_ || resp.layer() != static_cast<uint32_t>(layer) ||
                     resp.o().size() != q_bytes || resp.lse().size() != lse_bytes)) {
      why = absl::StrCat("malformed answer (step ", resp.step(), ", layer ", resp.layer(), ")");
    }
    if (!why.empty()) {
      STRATA_RETURN_IF_ERROR(Failover(p, why));
      STRATA_RETURN_IF_ERROR(p->local->Attend(layer, q, n, hq, q_begin, &(*parts)[i], &counters_));
      continue;
    }
    engine::AttentionPartial& out = (*parts)[i];
    out.o.resize(q_bytes / sizeof(float));
    out.lse.resize(lse_bytes / sizeof(float));
    std::memcpy(out.o.data(), resp.o().data(), q_bytes);
    std::memcpy(out.lse.data(), resp.lse().data(), lse_bytes);
    counters_.selected_tokens += static_cast<int64_t>(resp.selected_tokens());
    counters_.candidate_tokens += static_cast<int64_t>(resp.candidate_tokens());
    pages_.host += static_cast<int64_t>(resp.pages_fetched().host());
    pages_.local += static_cast<int64_t>(resp.pages_fetched().disk());
    pages_.remote += static_cast<int64_t>(resp.pages_fetched().remote());
  }
  const Clock::time_point t_end = Clock::now();
  ++timing_.calls;
  timing_.attend_seconds += std::chrono::duration<double>(t_end - t_start).count();
  timing_.local_seconds += std::chrono::duration<double>(t_wait - t_local).count();
  timing_.wait_seconds += std::chrono::duration<double>(t_end - t_wait).count();
  return absl::OkStatus();
}

}  // namespace strata::worker
