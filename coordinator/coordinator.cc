#include "coordinator/coordinator.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "coordinator/metrics.h"
#include "model/tokenizer.h"
#include "xxhash.h"

namespace strata::coordinator {
namespace {

// Where leaders reach a shard's holder: its Worker services and its selection link.
void SetHolderAddresses(const v1::WorkerInfo& holder, v1::ShardAssignment* a) {
  a->set_worker_address(holder.address());
  a->set_selection_link_address(holder.selection_link_address());
}

constexpr size_t kScanBatch = 256;
// ReconcileShards runs at least this often, and this soon again while something waits.
constexpr int64_t kReconcileIntervalNanos = 5'000'000'000;
constexpr int64_t kReconcileRetryNanos = 1'000'000'000;
// A failed MountShard is not asked again before this.
constexpr int64_t kMountRetryNanos = 1'000'000'000;

v1::JobEvent Snapshot(const v1::JobInfo& info) {
  v1::JobEvent e;
  e.set_job_id(info.job_id());
  *e.mutable_snapshot() = info;
  return e;
}

bool IsRunning(JobState s) { return s == v1::JobInfo::PREFILLING || s == v1::JobInfo::DECODING; }

int64_t ContextTokens(const v1::JobRecord& r) {
  return static_cast<int64_t>(r.info().prompt_tokens()) + r.info().params().max_tokens();
}

}  // namespace

absl::Status CoordinatorOptions::Validate() const {
  STRATA_RETURN_IF_ERROR(Annotate(limits.Validate(), "limits"));
  STRATA_RETURN_IF_ERROR(Annotate(admission.Validate(), "admission"));
  STRATA_RETURN_IF_ERROR(Annotate(placement.Validate(), "placement"));
  STRATA_RETURN_IF_ERROR(Annotate(registry.Validate(), "registry"));
  if (model_namespace.empty()) return absl::InvalidArgumentError("model_namespace is empty");
  if (collect_interval_nanos <= 0) return absl::InvalidArgumentError("collect_interval_nanos must be > 0");
  if (default_prefill_mode != v1::DocumentInfo::ANCHOR && default_prefill_mode != v1::DocumentInfo::EXACT) {
    return absl::InvalidArgumentError("default_prefill_mode must be ANCHOR or EXACT");
  }
  if (anchor_tokens < 1) return absl::InvalidArgumentError(absl::StrCat("anchor_tokens must be >= 1, got ", anchor_tokens));
  if (placement.page_size != limits.page_size) {
    return absl::InvalidArgumentError(absl::StrCat("placement.page_size ", placement.page_size,
                                                   " differs from limits.page_size ", limits.page_size));
  }
  return absl::OkStatus();
}

Coordinator::Coordinator(const CoordinatorOptions& options, std::unique_ptr<Catalog> catalog,
                         WorkerClient* workers, CoordinatorMetrics* metrics, NowFn now,
                         std::function<int64_t()> wall_micros)
    : options_(options),
      catalog_(std::move(catalog)),
      workers_(workers),
      metrics_(metrics),
      now_(now),
      wall_micros_(std::move(wall_micros)),
      admission_(options.admission),
      registry_(options.registry, std::move(now)) {
  uint64_t seed = options.random_seed;
  if (seed == 0) {
    std::random_device rd;
    seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  rng_.seed(seed);
}

Coordinator::~Coordinator() = default;

absl::Status Coordinator::Start() {
  absl::MutexLock lock(&mu_);
  start_nanos_ = now_();
  reconcile_needed_ = true;
  std::string cursor;
  int64_t requeued = 0;
  while (true) {
    STRATA_ASSIGN_OR_RETURN(std::vector<v1::JobRecord> jobs, catalog_->ListJobs(cursor, kScanBatch));
    for (v1::JobRecord& r : jobs) {
      cursor = r.info().job_id();
      if (IsTerminal(r.info().state())) continue;
      LiveJob job;
      job.record = std::move(r);
      if (IsRunning(job.record.info().state())) {
        v1::JobInfo* info = job.record.mutable_info();
        info->set_state(v1::JobInfo::QUEUED);
        info->clear_leader_worker_id();
        info->clear_output_text();
        info->clear_output_token_ids();
        info->clear_progress();
        info->set_start_time_micros(0);
        STRATA_RETURN_IF_ERROR(catalog_->UpdateJob(&job.record));
        ++requeued;
      }
      live_jobs_[job.record.info().job_id()] = std::move(job);
    }
    if (jobs.size() < kScanBatch) break;
  }
  cursor.clear();
  while (true) {
    STRATA_ASSIGN_OR_RETURN(std::vector<v1::DocumentRecord> docs, catalog_->ListDocuments(cursor, kScanBatch));
    for (v1::DocumentRecord& r : docs) {
      cursor = r.info().document_id();
      const auto state = r.info().state();
      if (state != v1::DocumentInfo::PENDING && state != v1::DocumentInfo::PREFILLING) continue;
      LiveDocument doc;
      doc.record = std::move(r);
      if (state == v1::DocumentInfo::PREFILLING) {
        doc.record.mutable_info()->set_state(v1::DocumentInfo::PENDING);
        doc.record.mutable_info()->mutable_progress()->set_tokens_prefilled(0);
        doc.record.mutable_info()->mutable_progress()->set_pages_persisted(0);
        doc.record.mutable_info()->mutable_progress()->set_shards_ready(0);
        STRATA_RETURN_IF_ERROR(catalog_->UpdateDocument(&doc.record));
      }
      live_documents_[doc.record.info().document_id()] = std::move(doc);
    }
    if (docs.size() < kScanBatch) break;
  }
  STRATA_LOG(INFO) << "coordinator catalog loaded: " << live_jobs_.size() << " unfinished jobs ("
                   << requeued << " requeued), " << live_documents_.size() << " documents not ready";
  UpdateGauges();
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------------------
// Documents
// ------------------------------------------------------------------------------------------------

absl::StatusOr<std::vector<int32_t>> Coordinator::Tokenize(const DocumentContent& content, bool add_special,
                                                           absl::string_view what) const {
  if (!content.is_text) return content.tokens;
  if (static_cast<int64_t>(content.text.size()) > options_.limits.max_upload_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " text has ", content.text.size(),
                                                     " bytes; the limit is ", options_.limits.max_upload_bytes));
  }
  if (options_.tokenizer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " is text but this server has no tokenizer; send token ids"));
  }
  auto ids = options_.tokenizer->Encode(content.text, add_special);
  if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", ids.status().message()));
  return *std::move(ids);
}

std::string Coordinator::DocumentIdFor(const std::vector<int32_t>& tokens) const {
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  static constexpr char kDomain[] = "strata.coordinator.document.v1";
  XXH3_128bits_update(state, kDomain, sizeof(kDomain));
  const uint64_t ns_len = options_.model_namespace.size();
  XXH3_128bits_update(state, &ns_len, sizeof(ns_len));
  XXH3_128bits_update(state, options_.model_namespace.data(), ns_len);
  std::vector<uint8_t> bytes(tokens.size() * 4);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint32_t v = static_cast<uint32_t>(tokens[i]);
    for (int b = 0; b < 4; ++b) bytes[i * 4 + b] = static_cast<uint8_t>(v >> (8 * b));
  }
  XXH3_128bits_update(state, bytes.data(), bytes.size());
  const XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

absl::StatusOr<v1::DocumentUploadResponse> Coordinator::UploadDocument(
    const v1::DocumentUploadOptions& upload, const DocumentContent& content) {
  if (draining()) return absl::UnavailableError("server is draining; retry on another replica");
  STRATA_RETURN_IF_ERROR(ValidateTtlSeconds(upload.ttl_seconds()));
  if (!v1::DocumentInfo::PrefillMode_IsValid(upload.prefill_mode())) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_mode = ", static_cast<int>(upload.prefill_mode()), " is unknown"));
  }
  STRATA_ASSIGN_OR_RETURN(std::vector<int32_t> tokens,
                          Tokenize(content, upload.add_special_tokens(), "document"));
  if (tokens.empty()) return absl::InvalidArgumentError("document is empty");
  if (static_cast<int64_t>(tokens.size()) > options_.limits.max_document_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("document has ", tokens.size(), " tokens; the limit is ",
                                                     options_.limits.max_document_tokens));
  }
  STRATA_RETURN_IF_ERROR(ValidateTokenIds(tokens, options_.limits.vocab_size, "tokens"));
  const std::string id = DocumentIdFor(tokens);
  const int64_t now = wall_micros_();

  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("server is draining; retry on another replica");
  v1::DocumentUploadResponse response;
  auto existing = catalog_->GetDocument(id);
  if (existing.ok()) {
    const bool change = upload.pin() || upload.ttl_seconds() > 0;
    auto live = live_documents_.find(id);
    if (live != live_documents_.end()) {
      if (change) {
        if (upload.pin()) live->second.record.mutable_info()->set_pinned(true);
        if (upload.ttl_seconds() > 0) {
          live->second.record.mutable_info()->set_expire_time_micros(now + upload.ttl_seconds() * 1'000'000);
        }
        STRATA_RETURN_IF_ERROR(SaveDocument(live->second));
      }
      *response.mutable_document() = live->second.record.info();
    } else {
      v1::DocumentRecord record = *std::move(existing);
      if (change) {
        if (upload.pin()) record.mutable_info()->set_pinned(true);
        if (upload.ttl_seconds() > 0) {
          record.mutable_info()->set_expire_time_micros(now + upload.ttl_seconds() * 1'000'000);
        }
        STRATA_RETURN_IF_ERROR(catalog_->UpdateDocument(&record));
      }
      *response.mutable_document() = record.info();
    }
    response.set_created(false);
    return response;
  }
  if (existing.status().code() != absl::StatusCode::kNotFound) return existing.status();

  LiveDocument doc;
  v1::DocumentInfo* info = doc.record.mutable_info();
  info->set_document_id(id);
  info->set_state(v1::DocumentInfo::PENDING);
  info->set_num_tokens(tokens.size());
  info->set_display_name(upload.display_name());
  info->set_pinned(upload.pin());
  info->set_create_time_micros(now);
  info->set_prefill_mode(upload.prefill_mode() == v1::DocumentInfo::PREFILL_MODE_UNSPECIFIED
                             ? options_.default_prefill_mode
                             : upload.prefill_mode());
  if (upload.ttl_seconds() > 0) info->set_expire_time_micros(now + upload.ttl_seconds() * 1'000'000);
  info->mutable_progress()->set_tokens_total(tokens.size());
  STRATA_RETURN_IF_ERROR(catalog_->CreateDocument(&doc.record, tokens));
  *response.mutable_document() = doc.record.info();
  response.set_created(true);
  live_documents_[id] = std::move(doc);
  if (metrics_ != nullptr) {
    metrics_->documents_created.Increment();
    metrics_->document_tokens.Increment(static_cast<double>(tokens.size()));
  }
  UpdateGauges();
  STRATA_LOG(INFO) << "document created id=" << id << " tokens=" << tokens.size();
  return response;
}

absl::StatusOr<v1::DocumentInfo> Coordinator::GetDocument(const std::string& document_id) {
  STRATA_RETURN_IF_ERROR(ValidateDocumentId(document_id));
  absl::MutexLock lock(&mu_);
  auto live = live_documents_.find(document_id);
  if (live != live_documents_.end()) return live->second.record.info();
  STRATA_ASSIGN_OR_RETURN(v1::DocumentRecord record, catalog_->GetDocument(document_id));
  return record.info();
}

absl::StatusOr<v1::DocumentListResponse> Coordinator::ListDocuments(const v1::DocumentListRequest& request) {
  if (request.page_size() > 1000) {
    return absl::InvalidArgumentError(absl::StrCat("page_size = ", request.page_size(), " exceeds 1000"));
  }
  if (!request.page_token().empty() && !ValidateDocumentId(request.page_token()).ok()) {
    return absl::InvalidArgumentError("page_token is malformed");
  }
  if (!v1::DocumentInfo::State_IsValid(request.state())) {
    return absl::InvalidArgumentError(absl::StrCat("state = ", static_cast<int>(request.state()), " is unknown"));
  }
  const size_t page_size = request.page_size() == 0 ? 100 : request.page_size();
  absl::MutexLock lock(&mu_);
  v1::DocumentListResponse response;
  std::string cursor = request.page_token();
  bool exhausted = false;
  while (static_cast<size_t>(response.documents_size()) < page_size) {
    STRATA_ASSIGN_OR_RETURN(std::vector<v1::DocumentRecord> batch, catalog_->ListDocuments(cursor, kScanBatch));
    for (const v1::DocumentRecord& r : batch) {
      cursor = r.info().document_id();
      auto live = live_documents_.find(cursor);
      const v1::DocumentInfo& info = live != live_documents_.end() ? live->second.record.info() : r.info();
      if (request.state() != v1::DocumentInfo::STATE_UNSPECIFIED && info.state() != request.state()) continue;
      *response.add_documents() = info;
      if (static_cast<size_t>(response.documents_size()) == page_size) break;
    }
    if (batch.size() < kScanBatch && (batch.empty() || cursor == batch.back().info().document_id())) {
      exhausted = true;
      break;
    }
  }
  if (!exhausted) response.set_next_page_token(cursor);
  return response;
}

absl::Status Coordinator::DeleteDocument(const std::string& document_id) {
  STRATA_RETURN_IF_ERROR(ValidateDocumentId(document_id));
  absl::ReleasableMutexLock lock(&mu_);
  STRATA_RETURN_IF_ERROR(catalog_->GetDocument(document_id).status());
  for (const auto& [id, job] : live_jobs_) {
    if (job.record.info().document_id() == document_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("document ", document_id, " is used by unfinished job ", id, "; cancel it first"));
    }
  }
  std::vector<Action> actions;
  STRATA_RETURN_IF_ERROR(EraseDocument(document_id, &actions));
  UpdateGauges();
  lock.Release();
  for (Action& a : actions) a();
  STRATA_LOG(INFO) << "document deleted id=" << document_id;
  return absl::OkStatus();
}

absl::Status Coordinator::EraseDocument(const std::string& document_id, std::vector<Action>* actions) {
  UnmountDocument(document_id, actions);  // reads the shard map, which the delete removes
  if (absl::Status s = catalog_->DeleteDocument(document_id); !s.ok()) {
    reconcile_needed_ = true;  // still there: mounted again
    return s;
  }
  live_documents_.erase(document_id);
  auto watchers = document_watchers_.find(document_id);
  if (watchers != document_watchers_.end()) {
    v1::DocumentInfo gone;
    gone.set_document_id(document_id);
    for (DocumentObserver* o : watchers->second) {
      o->OnDocument(absl::NotFoundError(absl::StrCat("document ", document_id, " was deleted")), gone);
    }
    document_watchers_.erase(watchers);
  }
  return absl::OkStatus();
}

void Coordinator::CollectExpiredDocuments(std::vector<Action>* actions) {
  const int64_t now = wall_micros_();
  std::set<std::string> in_use;
  for (const auto& [id, job] : live_jobs_) in_use.insert(job.record.info().document_id());
  std::vector<std::string> expired;
  std::string cursor;
  while (true) {
    auto batch = catalog_->ListDocuments(cursor, kScanBatch);
    if (!batch.ok()) {
      STRATA_LOG(ERROR) << "document collection: " << batch.status();
      return;
    }
    for (const v1::DocumentRecord& r : *batch) {
      cursor = r.info().document_id();
      const v1::DocumentInfo& info = r.info();
      if (!info.pinned() && info.expire_time_micros() > 0 && info.expire_time_micros() <= now &&
          in_use.count(cursor) == 0) {
        expired.push_back(cursor);
      }
    }
    if (batch->size() < kScanBatch) break;
  }
  for (const std::string& id : expired) {
    if (absl::Status s = EraseDocument(id, actions); !s.ok()) {
      STRATA_LOG(ERROR) << "document " << id << ": collection failed: " << s;
      continue;
    }
    if (metrics_ != nullptr) metrics_->documents_expired.Increment();
    STRATA_LOG(INFO) << "document expired and deleted id=" << id;
  }
}

absl::StatusOr<v1::DocumentInfo> Coordinator::PinDocument(const v1::DocumentPinRequest& request) {
  STRATA_RETURN_IF_ERROR(ValidateDocumentId(request.document_id()));
  STRATA_RETURN_IF_ERROR(ValidateTtlSeconds(request.ttl_seconds()));
  const int64_t now = wall_micros_();
  absl::MutexLock lock(&mu_);
  auto apply = [&](v1::DocumentInfo* info) {
    info->set_pinned(request.pinned());
    if (request.ttl_seconds() > 0) info->set_expire_time_micros(now + request.ttl_seconds() * 1'000'000);
  };
  auto live = live_documents_.find(request.document_id());
  if (live != live_documents_.end()) {
    apply(live->second.record.mutable_info());
    STRATA_RETURN_IF_ERROR(SaveDocument(live->second));
    return live->second.record.info();
  }
  STRATA_ASSIGN_OR_RETURN(v1::DocumentRecord record, catalog_->GetDocument(request.document_id()));
  apply(record.mutable_info());
  STRATA_RETURN_IF_ERROR(catalog_->UpdateDocument(&record));
  NotifyDocument(record.info());
  return record.info();
}

absl::Status Coordinator::WatchDocument(const std::string& document_id, DocumentObserver* observer) {
  STRATA_RETURN_IF_ERROR(ValidateDocumentId(document_id));
  absl::MutexLock lock(&mu_);
  v1::DocumentInfo info;
  auto live = live_documents_.find(document_id);
  if (live != live_documents_.end()) {
    info = live->second.record.info();
  } else {
    STRATA_ASSIGN_OR_RETURN(v1::DocumentRecord record, catalog_->GetDocument(document_id));
    info = record.info();
  }
  observer->OnDocument(absl::OkStatus(), info);
  if (info.state() != v1::DocumentInfo::READY && info.state() != v1::DocumentInfo::FAILED) {
    document_watchers_[document_id].insert(observer);
  }
  return absl::OkStatus();
}

void Coordinator::UnwatchDocument(const std::string& document_id, DocumentObserver* observer) {
  absl::MutexLock lock(&mu_);
  auto it = document_watchers_.find(document_id);
  if (it == document_watchers_.end()) return;
  it->second.erase(observer);
  if (it->second.empty()) document_watchers_.erase(it);
}

absl::Status Coordinator::SaveDocument(LiveDocument& doc) {
  STRATA_RETURN_IF_ERROR(catalog_->UpdateDocument(&doc.record));
  NotifyDocument(doc.record.info());
  return absl::OkStatus();
}

void Coordinator::NotifyDocument(const v1::DocumentInfo& info) {
  auto it = document_watchers_.find(info.document_id());
  if (it == document_watchers_.end()) return;
  for (DocumentObserver* o : it->second) o->OnDocument(absl::OkStatus(), info);
  if (info.state() == v1::DocumentInfo::READY || info.state() == v1::DocumentInfo::FAILED) {
    document_watchers_.erase(it);
  }
}

// ------------------------------------------------------------------------------------------------
// Jobs
// ------------------------------------------------------------------------------------------------

std::string Coordinator::NewJobId() {
  // 44 bits of wall-clock milliseconds, then 20 random bits: ids sort by creation time.
  const uint64_t ms = static_cast<uint64_t>(std::max<int64_t>(0, wall_micros_() / 1000)) & ((uint64_t{1} << 44) - 1);
  return absl::StrFormat("job-%016x", (ms << 20) | (rng_() & 0xfffff));
}

absl::StatusOr<v1::JobInfo> Coordinator::SubmitJob(const v1::JobSubmitRequest& request) {
  const std::string& request_id = request.request_id();
  if (request_id.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat("request_id has ", request_id.size(), " bytes; at most 128"));
  }
  for (char c : request_id) {
    if (c < 0x21 || c > 0x7e) return absl::InvalidArgumentError("request_id must be printable ASCII");
  }
  if (!request_id.empty()) {
    // A retry: the job the first call created.
    auto existing = catalog_->FindJobByRequestId(request_id);
    if (existing.ok()) return GetJob(*existing);
    if (existing.status().code() != absl::StatusCode::kNotFound) return existing.status();
  }
  // Everything that needs no lock is checked first: a rejected request changes nothing.
  std::vector<int32_t> inline_tokens;
  std::string document_id;
  switch (request.document_case()) {
    case v1::JobSubmitRequest::kDocumentId:
      document_id = request.document_id();
      STRATA_RETURN_IF_ERROR(ValidateDocumentId(document_id));
      break;
    case v1::JobSubmitRequest::kInlineDocument: {
      const v1::InlineDocument& d = request.inline_document();
      if (!v1::DocumentInfo::PrefillMode_IsValid(d.prefill_mode())) {
        return absl::InvalidArgumentError(
            absl::StrCat("inline_document.prefill_mode = ", static_cast<int>(d.prefill_mode()), " is unknown"));
      }
      DocumentContent content;
      content.is_text = d.content_case() == v1::InlineDocument::kText;
      if (content.is_text) {
        content.text = d.text();
      } else {
        content.tokens.assign(d.tokens().ids().begin(), d.tokens().ids().end());
      }
      STRATA_ASSIGN_OR_RETURN(inline_tokens, Tokenize(content, d.add_special_tokens(), "inline_document"));
      if (inline_tokens.empty()) return absl::InvalidArgumentError("inline_document is empty");
      if (static_cast<int64_t>(inline_tokens.size()) > options_.limits.max_document_tokens) {
        return absl::ResourceExhaustedError(absl::StrCat("inline_document has ", inline_tokens.size(),
                                                         " tokens; the limit is ",
                                                         options_.limits.max_document_tokens));
      }
      STRATA_RETURN_IF_ERROR(ValidateTokenIds(inline_tokens, options_.limits.vocab_size, "inline_document.tokens"));
      document_id = DocumentIdFor(inline_tokens);
      break;
    }
    case v1::JobSubmitRequest::DOCUMENT_NOT_SET:
      break;
  }
  DocumentContent prompt;
  switch (request.prompt_case()) {
    case v1::JobSubmitRequest::kPromptText:
      prompt.is_text = true;
      prompt.text = request.prompt_text();
      break;
    case v1::JobSubmitRequest::kPromptTokens:
      prompt.tokens.assign(request.prompt_tokens().ids().begin(), request.prompt_tokens().ids().end());
      break;
    case v1::JobSubmitRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt is empty");
  }
  if (prompt.is_text && prompt.text.empty()) return absl::InvalidArgumentError("prompt is empty");
  STRATA_ASSIGN_OR_RETURN(std::vector<int32_t> prompt_tokens, Tokenize(prompt, false, "prompt"));
  if (prompt_tokens.empty()) return absl::InvalidArgumentError("prompt is empty");
  if (static_cast<int64_t>(prompt_tokens.size()) > options_.limits.max_prompt_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("prompt has ", prompt_tokens.size(), " tokens; the limit is ",
                                                   options_.limits.max_prompt_tokens));
  }
  STRATA_RETURN_IF_ERROR(ValidateTokenIds(prompt_tokens, options_.limits.vocab_size, "prompt_tokens"));
  uint64_t default_seed;
  {
    absl::MutexLock lock(&mu_);
    default_seed = rng_();
  }
  STRATA_ASSIGN_OR_RETURN(v1::GenerationParams params,
                          EffectiveGenerationParams(request.params(), options_.limits, default_seed));
  STRATA_ASSIGN_OR_RETURN(v1::SelectionPolicy policy, EffectiveSelectionPolicy(request.policy(), options_.limits));
  const int64_t now = wall_micros_();

  absl::MutexLock lock(&mu_);
  int64_t document_tokens = 0;
  bool create_inline = false;
  if (!document_id.empty()) {
    auto record = catalog_->GetDocument(document_id);
    if (record.ok()) {
      document_tokens = static_cast<int64_t>(record->info().num_tokens());
    } else if (record.status().code() == absl::StatusCode::kNotFound &&
               request.document_case() == v1::JobSubmitRequest::kInlineDocument) {
      document_tokens = static_cast<int64_t>(inline_tokens.size());
      create_inline = true;
    } else if (record.status().code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(absl::StrCat("document ", document_id, " not found"));
    } else {
      return record.status();
    }
  }

  QueueSnapshot queue;
  for (const auto& [id, job] : live_jobs_) {
    ++queue.pending_jobs;
    queue.pending_tokens += ContextTokens(job.record);
  }
  CapacitySnapshot capacity;
  capacity.draining = draining_;
  for (const WorkerEntry& w : registry_.Snapshot()) {
    ++capacity.live_workers;
    capacity.total_capacity_tokens += static_cast<int64_t>(w.info.capacity_tokens());
  }
  JobDemand demand;
  demand.context_tokens = document_tokens + static_cast<int64_t>(prompt_tokens.size()) + params.max_tokens();
  if (absl::Status s = admission_(queue, capacity, demand); !s.ok()) {
    if (metrics_ != nullptr) {
      metrics_->admission_rejections
          .Add({{"code", s.code() == absl::StatusCode::kUnavailable ? "unavailable" : "resource_exhausted"}})
          .Increment();
    }
    return s;
  }

  if (create_inline) {
    LiveDocument doc;
    v1::DocumentInfo* info = doc.record.mutable_info();
    info->set_document_id(document_id);
    info->set_state(v1::DocumentInfo::PENDING);
    info->set_num_tokens(inline_tokens.size());
    info->set_display_name(request.inline_document().display_name());
    info->set_create_time_micros(now);
    info->set_prefill_mode(request.inline_document().prefill_mode() == v1::DocumentInfo::PREFILL_MODE_UNSPECIFIED
                               ? options_.default_prefill_mode
                               : request.inline_document().prefill_mode());
    info->mutable_progress()->set_tokens_total(inline_tokens.size());
    STRATA_RETURN_IF_ERROR(catalog_->CreateDocument(&doc.record, inline_tokens));
    live_documents_[document_id] = std::move(doc);
    if (metrics_ != nullptr) {
      metrics_->documents_created.Increment();
      metrics_->document_tokens.Increment(static_cast<double>(inline_tokens.size()));
    }
  } else if (!document_id.empty() && live_documents_.count(document_id) == 0) {
    // A FAILED document gets another chance when a job needs it.
    STRATA_ASSIGN_OR_RETURN(v1::DocumentRecord record, catalog_->GetDocument(document_id));
    if (record.info().state() == v1::DocumentInfo::FAILED) {
      LiveDocument doc;
      doc.record = std::move(record);
      doc.record.mutable_info()->set_state(v1::DocumentInfo::PENDING);
      doc.record.mutable_info()->clear_error_message();
      STRATA_RETURN_IF_ERROR(SaveDocument(doc));
      live_documents_[document_id] = std::move(doc);
    }
  }

  LiveJob job;
  v1::JobInfo* info = job.record.mutable_info();
  info->set_job_id(NewJobId());
  info->set_state(v1::JobInfo::QUEUED);
  info->set_document_id(document_id);
  info->set_display_name(request.display_name());
  info->set_request_id(request_id);
  *info->mutable_params() = params;
  *info->mutable_policy() = policy;
  info->set_prompt_tokens(static_cast<uint64_t>(document_tokens) + prompt_tokens.size());
  info->mutable_usage()->set_prompt_tokens(info->prompt_tokens());
  info->set_create_time_micros(now);
  job.record.mutable_prompt_token_ids()->Assign(prompt_tokens.begin(), prompt_tokens.end());
  STRATA_ASSIGN_OR_RETURN(uint64_t sequence, catalog_->NextSequence("admission"));
  job.record.set_admission_sequence(sequence);
  if (!request_id.empty()) {
    // A concurrent call with the same request_id may have won the race.
    auto existing = catalog_->FindJobByRequestId(request_id);
    if (existing.ok()) {
      auto live = live_jobs_.find(*existing);
      if (live != live_jobs_.end()) return live->second.record.info();
      STRATA_ASSIGN_OR_RETURN(v1::JobRecord record, catalog_->GetJob(*existing));
      return record.info();
    }
  }
  absl::Status created = catalog_->CreateJob(&job.record);
  for (int attempt = 0; attempt < 4 && created.code() == absl::StatusCode::kAlreadyExists; ++attempt) {
    info->set_job_id(NewJobId());  // two jobs in the same millisecond drew the same random bits
    created = catalog_->CreateJob(&job.record);
  }
  STRATA_RETURN_IF_ERROR(created);
  const v1::JobInfo result = job.record.info();
  live_jobs_[result.job_id()] = std::move(job);
  if (metrics_ != nullptr) metrics_->jobs_submitted.Increment();
  UpdateGauges();
  STRATA_LOG(INFO) << "job admitted id=" << result.job_id() << " document=" << document_id
                   << " prompt_tokens=" << result.prompt_tokens() << " policy=" << policy.name();
  return result;
}

absl::StatusOr<v1::JobInfo> Coordinator::GetJob(const std::string& job_id) {
  STRATA_RETURN_IF_ERROR(ValidateJobId(job_id));
  absl::MutexLock lock(&mu_);
  auto live = live_jobs_.find(job_id);
  if (live != live_jobs_.end()) return live->second.record.info();
  STRATA_ASSIGN_OR_RETURN(v1::JobRecord record, catalog_->GetJob(job_id));
  return record.info();
}

absl::StatusOr<v1::JobListResponse> Coordinator::ListJobs(const v1::JobListRequest& request) {
  if (request.page_size() > 1000) {
    return absl::InvalidArgumentError(absl::StrCat("page_size = ", request.page_size(), " exceeds 1000"));
  }
  if (!request.page_token().empty() && !ValidateJobId(request.page_token()).ok()) {
    return absl::InvalidArgumentError("page_token is malformed");
  }
  if (!request.document_id().empty()) STRATA_RETURN_IF_ERROR(ValidateDocumentId(request.document_id()));
  if (!v1::JobInfo::State_IsValid(request.state())) {
    return absl::InvalidArgumentError(absl::StrCat("state = ", static_cast<int>(request.state()), " is unknown"));
  }
  const size_t page_size = request.page_size() == 0 ? 100 : request.page_size();
  absl::MutexLock lock(&mu_);
  v1::JobListResponse response;
  std::string cursor = request.page_token();
  bool exhausted = false;
  while (static_cast<size_t>(response.jobs_size()) < page_size) {
    STRATA_ASSIGN_OR_RETURN(std::vector<v1::JobRecord> batch, catalog_->ListJobs(cursor, kScanBatch));
    for (const v1::JobRecord& r : batch) {
      cursor = r.info().job_id();
      auto live = live_jobs_.find(cursor);
      const v1::JobInfo& info = live != live_jobs_.end() ? live->second.record.info() : r.info();
      if (request.state() != v1::JobInfo::STATE_UNSPECIFIED && info.state() != request.state()) continue;
      if (!request.document_id().empty() && info.document_id() != request.document_id()) continue;
      *response.add_jobs() = info;
      if (static_cast<size_t>(response.jobs_size()) == page_size) break;
    }
    if (batch.size() < kScanBatch && (batch.empty() || cursor == batch.back().info().job_id())) {
      exhausted = true;
      break;
    }
  }
  if (!exhausted) response.set_next_page_token(cursor);
  return response;
}

absl::StatusOr<v1::JobInfo> Coordinator::CancelJob(const std::string& job_id) {
  STRATA_RETURN_IF_ERROR(ValidateJobId(job_id));
  std::vector<Action> actions;
  v1::JobInfo result;
  {
    absl::MutexLock lock(&mu_);
    auto live = live_jobs_.find(job_id);
    if (live == live_jobs_.end()) {
      STRATA_ASSIGN_OR_RETURN(v1::JobRecord record, catalog_->GetJob(job_id));
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " already finished (", v1::JobInfo::State_Name(record.info().state()), ")"));
    }
    live->second.record.mutable_info()->set_finish_reason(v1::JobInfo::CANCELLED_BY_CLIENT);
    const v1::JobInfo before = live->second.record.info();
    STRATA_RETURN_IF_ERROR(TransitionJob(job_id, JobTransition::kCancel, &actions));
    auto record = catalog_->GetJob(job_id);
    result = record.ok() ? record->info() : before;
    if (!before.leader_worker_id().empty() && workers_ != nullptr) {
      auto worker = registry_.Get(before.leader_worker_id());
      if (worker.ok()) {
        v1::WorkerInfo info = worker->info;
        actions.push_back([this, info, job_id] { workers_->CancelJob(info, job_id); });
      }
    }
  }
  for (Action& a : actions) a();
  STRATA_LOG(INFO) << "job cancelled id=" << job_id;
  return result;
}

absl::Status Coordinator::WatchJob(const std::string& job_id, JobObserver* observer) {
  STRATA_RETURN_IF_ERROR(ValidateJobId(job_id));
  absl::MutexLock lock(&mu_);
  auto live = live_jobs_.find(job_id);
  if (live != live_jobs_.end()) {
    observer->OnJobEvent(Snapshot(live->second.record.info()));
    job_watchers_[job_id].insert(observer);
    return absl::OkStatus();
  }
  STRATA_ASSIGN_OR_RETURN(v1::JobRecord record, catalog_->GetJob(job_id));
  observer->OnJobEvent(Snapshot(record.info()));
  return absl::OkStatus();
}

void Coordinator::UnwatchJob(const std::string& job_id, JobObserver* observer) {
  absl::MutexLock lock(&mu_);
  auto it = job_watchers_.find(job_id);
  if (it == job_watchers_.end()) return;
  it->second.erase(observer);
  if (it->second.empty()) job_watchers_.erase(it);
}

void Coordinator::NotifyJob(const v1::JobEvent& event) {
  auto it = job_watchers_.find(event.job_id());
  if (it == job_watchers_.end()) return;
  for (JobObserver* o : it->second) o->OnJobEvent(event);
  if (event.has_snapshot() && IsTerminal(event.snapshot().state())) job_watchers_.erase(it);
}

absl::Status Coordinator::SaveJob(LiveJob& job, JobState old_state) {
  absl::Status s = catalog_->UpdateJob(&job.record);
  if (!s.ok()) {
    STRATA_LOG(ERROR) << "job " << job.record.info().job_id() << ": catalog write failed: " << s;
  }
  if (metrics_ != nullptr && job.record.info().state() != old_state && IsTerminal(job.record.info().state())) {
    std::string state = v1::JobInfo::State_Name(job.record.info().state());
    for (char& c : state) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    metrics_->jobs_finished.Add({{"state", state}}).Increment();
  }
  NotifyJob(Snapshot(job.record.info()));
  return s;
}

absl::Status Coordinator::TransitionJob(const std::string& job_id, JobTransition t, std::vector<Action>* actions) {
  auto it = live_jobs_.find(job_id);
  if (it == live_jobs_.end()) return absl::NotFoundError(absl::StrCat("job ", job_id, " is not live"));
  LiveJob& job = it->second;
  v1::JobInfo* info = job.record.mutable_info();
  const JobState old_state = info->state();
  STRATA_ASSIGN_OR_RETURN(JobState next, NextJobState(old_state, t));
  info->set_state(next);
  if (t == JobTransition::kStartPrefill) info->set_start_time_micros(wall_micros_());
  if (t == JobTransition::kRequeue) {
    if (!info->leader_worker_id().empty()) jobs_by_worker_[info->leader_worker_id()].erase(job_id);
    info->clear_leader_worker_id();
    info->clear_output_text();
    info->clear_output_token_ids();
    info->clear_progress();
    info->set_start_time_micros(0);
    info->mutable_usage()->set_completion_tokens(0);
    ++job.dispatch_epoch;
  }
  if (IsTerminal(next)) {
    info->set_end_time_micros(wall_micros_());
    if (next == v1::JobInfo::DONE && info->finish_reason() == v1::JobInfo::FINISH_REASON_UNSPECIFIED) {
      info->set_finish_reason(v1::JobInfo::LENGTH);
    }
    if (next == v1::JobInfo::FAILED) info->set_finish_reason(v1::JobInfo::ERROR);
  }
  absl::Status s = SaveJob(job, old_state);
  if (IsTerminal(next)) {
    if (!info->leader_worker_id().empty()) jobs_by_worker_[info->leader_worker_id()].erase(job_id);
    live_jobs_.erase(it);
  }
  UpdateGauges();
  return s;
}

// ------------------------------------------------------------------------------------------------
// Workers
// ------------------------------------------------------------------------------------------------

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(const v1::RegisterWorkerRequest& request) {
  if (draining()) return absl::UnavailableError("coordinator is draining");
  const v1::WorkerInfo& worker = request.worker();
  if (!options_.model_fingerprint.empty() && worker.model_fingerprint() != options_.model_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker.worker_id(), " serves model '",
                                                      worker.model_fingerprint(), "'; this coordinator serves '",
                                                      options_.model_fingerprint, "'"));
  }
  if (worker.layout().page_size() != 0 && worker.layout().page_size() != options_.limits.page_size) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker.worker_id(), " uses pages of ",
                                                      worker.layout().page_size(), " tokens; the deployment uses ",
                                                      options_.limits.page_size));
  }
  if (options_.limits.vocab_size > 0 && worker.vocab_size() != 0 &&
      worker.vocab_size() != options_.limits.vocab_size) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker.worker_id(), " has a vocabulary of ",
                                                      worker.vocab_size(), " tokens; expected ",
                                                      options_.limits.vocab_size));
  }
  std::vector<Action> actions;
  {
    absl::MutexLock lock(&mu_);
    // A re-registration means the worker restarted: what it ran and mounted is gone.
    RequeueJobsOfWorker(request.worker().worker_id(), &actions);
    ResetDocumentsOnWorker(request.worker().worker_id());
    ForgetMountsOfWorker(request.worker().worker_id());
  }
  STRATA_ASSIGN_OR_RETURN(v1::RegisterWorkerResponse response, registry_.Register(request.worker()));
  STRATA_LOG(INFO) << "worker registered id=" << request.worker().worker_id()
                   << " address=" << request.worker().address()
                   << " capacity_tokens=" << request.worker().capacity_tokens();
  {
    absl::MutexLock lock(&mu_);
    UpdateGauges();
  }
  Tick();
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  STRATA_RETURN_IF_ERROR(registry_.Heartbeat(request));
  // Reconcile the shards the worker says it has mounted with what it was asked to mount: a shard
  // mounted well before this heartbeat was built (two heartbeat intervals) but missing from it was
  // dropped by the worker, and is mounted again.
  std::set<std::tuple<std::string, uint64_t, uint64_t>> reported;
  for (const v1::ShardRange& r : request.mounted_shards()) reported.emplace(r.document_id(), r.first_page(), r.end_page());
  absl::MutexLock lock(&mu_);
  const int64_t settled_before = now_() - 2 * options_.registry.heartbeat_interval_nanos;
  for (auto it = mounts_.begin(); it != mounts_.end();) {
    const ShardMount& m = it->second;
    if (m.worker_id == request.worker_id() && m.state == ShardMount::kMounted && m.reported &&
        m.mounted_nanos < settled_before &&
        reported.count({m.range.document_id(), m.range.first_page(), m.range.end_page()}) == 0) {
      STRATA_LOG(WARNING) << "document " << it->first.first << " shard " << it->first.second << ": worker "
                          << m.worker_id << " no longer reports it mounted; mounting it again";
      it = mounts_.erase(it);
      reconcile_needed_ = true;
    } else {
      ++it;
    }
  }
  v1::HeartbeatResponse response;
  return response;
}

absl::Status Coordinator::DeregisterWorker(const v1::DeregisterWorkerRequest& request) {
  STRATA_RETURN_IF_ERROR(registry_.Deregister(request.worker_id(), request.lease_id()));
  std::vector<Action> actions;
  {
    absl::MutexLock lock(&mu_);
    RequeueJobsOfWorker(request.worker_id(), &actions);
    ResetDocumentsOnWorker(request.worker_id());
    ForgetMountsOfWorker(request.worker_id());
    UpdateGauges();
  }
  for (Action& a : actions) a();
  STRATA_LOG(INFO) << "worker deregistered id=" << request.worker_id();
  Tick();  // its shards move now
  return absl::OkStatus();
}

void Coordinator::RequeueJobsOfWorker(const std::string& worker_id, std::vector<Action>* actions) {
  auto it = jobs_by_worker_.find(worker_id);
  if (it == jobs_by_worker_.end()) return;
  const std::set<std::string> jobs = it->second;
  for (const std::string& job_id : jobs) {
    absl::Status s = TransitionJob(job_id, JobTransition::kRequeue, actions);
    STRATA_LOG(WARNING) << "job " << job_id << " handed back to the queue (worker " << worker_id << " is gone)"
                        << (s.ok() ? "" : absl::StrCat("; not requeued: ", s.ToString()));
  }
  jobs_by_worker_.erase(worker_id);
}

void Coordinator::ResetDocumentsOnWorker(const std::string& worker_id) {
  for (auto& [id, doc] : live_documents_) {
    if (doc.record.info().state() != v1::DocumentInfo::PREFILLING) continue;
    bool uses = false;
    for (const v1::ShardAssignment& a : doc.map.shards()) uses |= a.worker_id() == worker_id;
    if (!uses) continue;
    ++doc.dispatch_epoch;
    v1::DocumentInfo* info = doc.record.mutable_info();
    info->set_state(v1::DocumentInfo::PENDING);
    info->mutable_progress()->set_tokens_prefilled(0);
    info->mutable_progress()->set_pages_persisted(0);
    info->mutable_progress()->set_shards_ready(0);
    absl::Status s = SaveDocument(doc);
    STRATA_LOG(WARNING) << "document " << id << " prefill restarts (worker " << worker_id << " is gone)"
                        << (s.ok() ? "" : absl::StrCat("; its record was not saved: ", s.ToString()));
  }
}

// ------------------------------------------------------------------------------------------------
// Scheduling
// ------------------------------------------------------------------------------------------------

void Coordinator::Tick() {
  std::vector<Action> actions;
  const std::vector<std::string> expired = registry_.ExpireStale();
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& w : expired) {
      STRATA_LOG(WARNING) << "worker " << w << " missed its heartbeats; dropped";
      if (metrics_ != nullptr) metrics_->worker_timeouts.Increment();
      RequeueJobsOfWorker(w, &actions);
      ResetDocumentsOnWorker(w);
      ForgetMountsOfWorker(w);
    }
    const int64_t now = now_();
    if (now - last_collect_nanos_ >= options_.collect_interval_nanos) {
      last_collect_nanos_ = now;
      CollectExpiredDocuments(&actions);
    }
    if (!draining_ && workers_ != nullptr) {
      DispatchDocuments(&actions);
      if (reconcile_needed_ || now >= next_reconcile_nanos_) ReconcileShards(&actions);
      DispatchJobs(&actions);
    }
    UpdateGauges();
  }
  for (Action& a : actions) a();
}

void Coordinator::DispatchDocuments(std::vector<Action>* actions) {
  std::vector<WorkerEntry> live;
  for (WorkerEntry& w : registry_.Snapshot()) {
    if (!w.draining) live.push_back(std::move(w));
  }
  if (live.empty()) return;
  std::map<std::string, v1::WorkerInfo> infos;
  for (const WorkerEntry& w : live) infos[w.info.worker_id()] = w.info;
  for (auto& [id, doc] : live_documents_) {
    if (doc.record.info().state() != v1::DocumentInfo::PENDING) continue;
    std::vector<WorkerCapacity> capacities;
    for (const WorkerEntry& w : live) {
      capacities.push_back({w.info.worker_id(), static_cast<int64_t>(w.info.capacity_tokens()) -
                                                    static_cast<int64_t>(w.load.mounted_tokens())});
    }
    const int64_t num_tokens = static_cast<int64_t>(doc.record.info().num_tokens());
    auto map = PlaceDocument(id, num_tokens, options_.placement, capacities);
    if (!map.ok()) continue;  // stays PENDING until capacity appears
    auto tokens = catalog_->GetDocumentTokens(id);
    if (!tokens.ok()) {
      STRATA_LOG(ERROR) << "document " << id << ": tokens unreadable: " << tokens.status();
      continue;
    }
    v1::ShardMapRecord shard_record;
    auto previous = catalog_->GetShardMap(id);
    if (previous.ok()) {
      shard_record = *std::move(previous);
      map->set_version(shard_record.map().version() + 1);
    }
    *shard_record.mutable_map() = *map;
    for (v1::ShardAssignment& a : *shard_record.mutable_map()->mutable_shards()) {
      SetHolderAddresses(infos[a.worker_id()], &a);
    }
    if (absl::Status s = catalog_->PutShardMap(&shard_record); !s.ok()) {
      STRATA_LOG(ERROR) << "document " << id << ": shard map write failed: " << s;
      continue;
    }
    doc.map = shard_record.map();
    ++doc.dispatch_epoch;
    doc.shard_done.assign(doc.map.shards_size(), false);
    doc.shard_progress.assign(doc.map.shards_size(), v1::PrefillShardProgress());
    v1::DocumentInfo* info = doc.record.mutable_info();
    info->set_state(v1::DocumentInfo::PREFILLING);
    info->set_num_shards(static_cast<uint32_t>(doc.map.shards_size()));
    info->mutable_progress()->set_shards_total(static_cast<uint32_t>(doc.map.shards_size()));
    info->mutable_progress()->set_shards_ready(0);
    if (absl::Status s = SaveDocument(doc); !s.ok()) {
      STRATA_LOG(ERROR) << "document " << id << ": catalog write failed: " << s;
    }
    const bool exact = PrefillModeOf(*info) == v1::DocumentInfo::EXACT;
    for (int i = 0; i < doc.map.shards_size(); ++i) {
      // EXACT: shard i starts once shard i-1 is durable (OnPrefillDone sends the next one).
      if (exact && i > 0) break;
      SendPrefill(id, doc, i, *tokens, infos[doc.map.shards(i).worker_id()], actions);
    }
    STRATA_LOG(INFO) << "document " << id << " placed in " << doc.map.shards_size() << " shards ("
                     << (exact ? "exact" : "anchor") << " prefill)";
  }
}

v1::DocumentInfo::PrefillMode Coordinator::PrefillModeOf(const v1::DocumentInfo& info) const {
  return info.prefill_mode() == v1::DocumentInfo::PREFILL_MODE_UNSPECIFIED ? options_.default_prefill_mode
                                                                           : info.prefill_mode();
}

void Coordinator::SendPrefill(const std::string& document_id, const LiveDocument& doc, int shard,
                              const std::vector<int32_t>& tokens, const v1::WorkerInfo& worker,
                              std::vector<Action>* actions) {
  const int64_t P = options_.placement.page_size;
  const int64_t num_tokens = static_cast<int64_t>(tokens.size());
  const v1::ShardAssignment& a = doc.map.shards(shard);
  v1::PrefillShardRequest request;
  *request.mutable_shard() = a.range();
  *request.mutable_shard_map() = doc.map;
  const int64_t begin = std::min<int64_t>(static_cast<int64_t>(a.range().first_page()) * P, num_tokens);
  const int64_t end = std::min<int64_t>(static_cast<int64_t>(a.range().end_page()) * P, num_tokens);
  request.mutable_token_ids()->Assign(tokens.begin() + begin, tokens.begin() + end);
  if (PrefillModeOf(doc.record.info()) == v1::DocumentInfo::EXACT) {
    request.set_mode(v1::PREFILL_MODE_EXACT);
  } else {
    request.set_mode(v1::PREFILL_MODE_ANCHOR);
    if (shard > 0) {
      const int64_t anchor_end = std::min<int64_t>(
          options_.anchor_tokens, ShardTokens(doc.map.shards(0).range(), P, num_tokens));
      request.mutable_anchor_token_ids()->Assign(tokens.begin(), tokens.begin() + anchor_end);
    }
  }
  const uint64_t epoch = doc.dispatch_epoch;
  actions->push_back([this, worker, request = std::move(request), document_id, epoch, shard] {
    workers_->PrefillShard(
        worker, request,
        [this, document_id, epoch, shard](const v1::PrefillShardProgress& p) {
          OnPrefillProgress(document_id, epoch, shard, p);
        },
        [this, document_id, epoch, shard](const absl::Status& s) { OnPrefillDone(document_id, epoch, shard, s); });
  });
}

absl::StatusOr<v1::ShardMap> Coordinator::ServingShardMap(const std::string& document_id) {
  STRATA_ASSIGN_OR_RETURN(v1::ShardMapRecord record, catalog_->GetShardMap(document_id));
  bool gone = false;
  for (const v1::ShardAssignment& a : record.map().shards()) gone |= !registry_.Get(a.worker_id()).ok();
  if (gone) {
    if (now_() - start_nanos_ < options_.registry.heartbeat_timeout_nanos) {
      return absl::UnavailableError("shard holders of the previous coordinator may still register");
    }
    std::vector<WorkerCapacity> capacities;
    for (const WorkerEntry& w : registry_.Snapshot()) {
      if (w.draining) continue;
      capacities.push_back({w.info.worker_id(), static_cast<int64_t>(w.info.capacity_tokens()) -
                                                    static_cast<int64_t>(w.load.mounted_tokens())});
    }
    auto moved = ReassignShards(record.map(), capacities);
    if (!moved.ok()) return absl::UnavailableError(moved.status().message());
    const uint64_t old_version = record.map().version();
    *record.mutable_map() = *std::move(moved);
    for (v1::ShardAssignment& a : *record.mutable_map()->mutable_shards()) {
      auto w = registry_.Get(a.worker_id());
      if (w.ok()) SetHolderAddresses(w->info, &a);
    }
    STRATA_RETURN_IF_ERROR(catalog_->PutShardMap(&record));
    if (metrics_ != nullptr) metrics_->shard_moves.Increment();
    STRATA_LOG(WARNING) << "document " << document_id << ": shards of dropped workers moved (map version "
                        << old_version << " -> " << record.map().version() << ")";
  }
  v1::ShardMap map = record.map();
  for (v1::ShardAssignment& a : *map.mutable_shards()) {
    auto w = registry_.Get(a.worker_id());
    if (!w.ok()) return absl::UnavailableError(absl::StrCat("worker ", a.worker_id(), " is not registered"));
    SetHolderAddresses(w->info, &a);
  }
  return map;
}

bool Coordinator::EnsureMounted(const v1::ShardMap& map, std::vector<Action>* actions) {
  bool all = true;
  const int64_t now = now_();
  for (int i = 0; i < map.shards_size(); ++i) {
    const v1::ShardAssignment& a = map.shards(i);
    const MountKey key{map.document_id(), i};
    auto it = mounts_.find(key);
    if (it != mounts_.end() && it->second.worker_id == a.worker_id()) {
      if (it->second.state == ShardMount::kMounted) continue;
      all = false;
      if (it->second.state == ShardMount::kInFlight || now < it->second.retry_after_nanos) continue;
    }
    all = false;
    auto worker = registry_.Get(a.worker_id());
    if (!worker.ok()) continue;
    ShardMount& m = mounts_[key];
    m.worker_id = a.worker_id();
    m.range = a.range();
    m.state = ShardMount::kInFlight;
    m.call = ++next_mount_call_;
    m.retry_after_nanos = 0;
    v1::MountShardRequest request;
    *request.mutable_shard() = a.range();
    request.set_whole_document(std::all_of(map.shards().begin(), map.shards().end(),
                                           [&](const v1::ShardAssignment& s) { return s.worker_id() == a.worker_id(); }));
    const v1::WorkerInfo info = worker->info;
    const std::string document_id = map.document_id();
    const uint64_t call = m.call;
    actions->push_back([this, info, request, document_id, i, call] {
      workers_->MountShard(info, request,
                           [this, document_id, i, call](const absl::Status& s) { OnMountDone(document_id, i, call, s); });
    });
  }
  return all;
}

void Coordinator::ReconcileShards(std::vector<Action>* actions) {
  const int64_t now = now_();
  reconcile_needed_ = false;
  bool waiting = false;
  std::string cursor;
  while (true) {
    auto batch = catalog_->ListDocuments(cursor, kScanBatch);
    if (!batch.ok()) {
      STRATA_LOG(ERROR) << "shard reconciliation: " << batch.status();
      waiting = true;
      break;
    }
    for (const v1::DocumentRecord& r : *batch) {
      cursor = r.info().document_id();
      if (r.info().state() != v1::DocumentInfo::READY || live_documents_.count(cursor) > 0) continue;
      auto map = ServingShardMap(cursor);
      if (!map.ok()) {
        if (map.status().code() == absl::StatusCode::kNotFound) continue;
        waiting = true;
        // Some holder is not registered (yet): the registered ones mount their shards meanwhile.
        auto stored = catalog_->GetShardMap(cursor);
        if (stored.ok()) EnsureMounted(stored->map(), actions);
        continue;
      }
      waiting |= !EnsureMounted(*map, actions);
    }
    if (batch->size() < kScanBatch) break;
  }
  next_reconcile_nanos_ = now + (waiting ? kReconcileRetryNanos : kReconcileIntervalNanos);
}

void Coordinator::ForgetMountsOfWorker(const std::string& worker_id) {
  for (auto it = mounts_.begin(); it != mounts_.end();) {
    it = it->second.worker_id == worker_id ? mounts_.erase(it) : std::next(it);
  }
  reconcile_needed_ = true;
}

void Coordinator::UnmountDocument(const std::string& document_id, std::vector<Action>* actions) {
  for (auto it = mounts_.lower_bound({document_id, 0}); it != mounts_.end() && it->first.first == document_id;) {
    auto worker = registry_.Get(it->second.worker_id);
    if (worker.ok() && workers_ != nullptr) {
      v1::UnmountShardRequest request;
      request.mutable_shard()->set_document_id(document_id);
      auto map = catalog_->GetShardMap(document_id);
      const int shard = it->first.second;
      if (map.ok() && shard < map->map().shards_size()) *request.mutable_shard() = map->map().shards(shard).range();
      const v1::WorkerInfo info = worker->info;
      actions->push_back([this, info, request] {
        workers_->UnmountShard(info, request, [](const absl::Status&) {});  // best effort
      });
    }
    it = mounts_.erase(it);
  }
}

void Coordinator::DispatchJobs(std::vector<Action>* actions) {
  std::vector<WorkerEntry> live;
  for (WorkerEntry& w : registry_.Snapshot()) {
    if (!w.draining) live.push_back(std::move(w));
  }
  if (live.empty()) return;
  std::vector<std::pair<uint64_t, std::string>> queued;
  for (const auto& [id, job] : live_jobs_) {
    if (job.record.info().state() == v1::JobInfo::QUEUED) queued.emplace_back(job.record.admission_sequence(), id);
  }
  std::sort(queued.begin(), queued.end());
  for (const auto& [sequence, job_id] : queued) {
    LiveJob& job = live_jobs_[job_id];
    const std::string document_id = job.record.info().document_id();
    v1::ShardMap map;
    if (!document_id.empty()) {
      if (live_documents_.count(document_id) > 0) continue;  // not READY yet
      auto doc = catalog_->GetDocument(document_id);
      if (!doc.ok() || doc->info().state() != v1::DocumentInfo::READY) {
        job.record.mutable_info()->set_error_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
        job.record.mutable_info()->set_error_message(
            doc.ok() ? absl::StrCat("document ", document_id, " failed: ", doc->info().error_message())
                     : absl::StrCat("document ", document_id, ": ", doc.status().message()));
        TransitionJob(job_id, JobTransition::kFail, actions).IgnoreError();  // logged by SaveJob
        continue;
      }
      auto shards = ServingShardMap(document_id);
      if (shards.status().code() == absl::StatusCode::kNotFound) {
        // READY without a shard map (a catalog from before maps were kept): place it again.
        LiveDocument again;
        again.record = *std::move(doc);
        again.record.mutable_info()->set_state(v1::DocumentInfo::PENDING);
        if (SaveDocument(again).ok()) live_documents_[document_id] = std::move(again);
        continue;
      }
      if (!shards.ok()) continue;  // waits: holders registering again, or no room to move shards
      if (!EnsureMounted(*shards, actions)) continue;  // waits for the mounts
      map = *std::move(shards);
    }
    std::vector<WorkerLoadView> loads;
    for (const WorkerEntry& w : live) {
      auto it = jobs_by_worker_.find(w.info.worker_id());
      loads.push_back({w.info.worker_id(), it == jobs_by_worker_.end() ? 0 : static_cast<int64_t>(it->second.size()),
                       static_cast<int64_t>(w.info.max_jobs())});
    }
    auto leader = ChooseLeader(map, loads);
    if (!leader.ok()) break;  // every worker is busy
    v1::WorkerInfo worker;
    for (const WorkerEntry& w : live) {
      if (w.info.worker_id() == *leader) worker = w.info;
    }
    job.record.mutable_info()->set_leader_worker_id(*leader);
    ++job.dispatch_epoch;
    const uint64_t epoch = job.dispatch_epoch;
    jobs_by_worker_[*leader].insert(job_id);
    if (!TransitionJob(job_id, JobTransition::kStartPrefill, actions).ok()) continue;
    v1::RunJobRequest request;
    request.set_job_id(job_id);
    *request.mutable_shard_map() = map;
    const LiveJob& started = live_jobs_[job_id];
    *request.mutable_prompt_token_ids() = started.record.prompt_token_ids();
    *request.mutable_params() = started.record.info().params();
    *request.mutable_policy() = started.record.info().policy();
    actions->push_back([this, worker, request, job_id, epoch] {
      workers_->RunJob(
          worker, request,
          [this, job_id, epoch](const v1::JobEvent& e) { OnJobEventFromWorker(job_id, epoch, e); },
          [this, job_id, epoch](const absl::Status& s) { OnJobDone(job_id, epoch, s); });
    });
    STRATA_LOG(INFO) << "job " << job_id << " dispatched to leader " << *leader;
  }
}

void Coordinator::FailJobsOnDocument(const std::string& document_id, const std::string& message) {
  std::vector<std::string> ids;
  for (const auto& [id, job] : live_jobs_) {
    if (job.record.info().document_id() == document_id && job.record.info().state() == v1::JobInfo::QUEUED) {
      ids.push_back(id);
    }
  }
  std::vector<Action> unused;
  for (const std::string& id : ids) {
    v1::JobInfo* info = live_jobs_[id].record.mutable_info();
    info->set_error_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
    info->set_error_message(absl::StrCat("document ", document_id, " failed: ", message));
    TransitionJob(id, JobTransition::kFail, &unused).IgnoreError();  // logged by SaveJob
  }
}

void Coordinator::OnPrefillProgress(const std::string& document_id, uint64_t epoch, int shard,
                                    const v1::PrefillShardProgress& progress) {
  absl::MutexLock lock(&mu_);
  auto it = live_documents_.find(document_id);
  if (it == live_documents_.end() || it->second.dispatch_epoch != epoch) return;
  LiveDocument& doc = it->second;
  if (shard < 0 || shard >= static_cast<int>(doc.shard_progress.size())) return;
  doc.shard_progress[shard] = progress;
  uint64_t tokens = 0, pages = 0;
  for (const auto& p : doc.shard_progress) {
    tokens += p.tokens_prefilled();
    pages += p.pages_persisted();
  }
  doc.record.mutable_info()->mutable_progress()->set_tokens_prefilled(tokens);
  doc.record.mutable_info()->mutable_progress()->set_pages_persisted(pages);
  NotifyDocument(doc.record.info());
}

void Coordinator::OnPrefillDone(const std::string& document_id, uint64_t epoch, int shard, const absl::Status& status) {
  bool ready = false;
  std::vector<Action> actions;
  {
    absl::MutexLock lock(&mu_);
    auto it = live_documents_.find(document_id);
    if (it == live_documents_.end() || it->second.dispatch_epoch != epoch) return;
    LiveDocument& doc = it->second;
    if (shard < 0 || shard >= static_cast<int>(doc.shard_done.size())) return;
    v1::DocumentInfo* info = doc.record.mutable_info();
    if (!status.ok()) {
      ++doc.dispatch_epoch;  // the other shards' callbacks no longer count
      if (status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kCancelled) {
        info->set_state(v1::DocumentInfo::PENDING);  // the worker went away: place again
        STRATA_LOG(WARNING) << "document " << document_id << " shard " << shard << " prefill interrupted: " << status;
        SaveDocument(doc).IgnoreError();  // best effort; the document is retried either way
      } else {
        info->set_state(v1::DocumentInfo::FAILED);
        info->set_error_message(std::string(status.message()));
        STRATA_LOG(ERROR) << "document " << document_id << " prefill failed: " << status;
        SaveDocument(doc).IgnoreError();  // logged; the in-memory state is what matters now
        live_documents_.erase(it);
        FailJobsOnDocument(document_id, std::string(status.message()));
      }
      UpdateGauges();
      return;
    }
    doc.shard_done[shard] = true;
    const auto ready_count = std::count(doc.shard_done.begin(), doc.shard_done.end(), true);
    info->mutable_progress()->set_shards_ready(static_cast<uint32_t>(ready_count));
    if (ready_count == static_cast<long>(doc.shard_done.size())) {
      info->set_state(v1::DocumentInfo::READY);
      info->mutable_progress()->set_tokens_prefilled(info->num_tokens());
      info->mutable_progress()->set_eta_seconds(0);
      if (absl::Status s = SaveDocument(doc); !s.ok()) {
        STRATA_LOG(ERROR) << "document " << document_id << ": catalog write failed: " << s;
      }
      live_documents_.erase(it);
      ready = true;
      reconcile_needed_ = true;  // the holders mount the shards in the next Tick
      STRATA_LOG(INFO) << "document " << document_id << " is READY";
    } else {
      NotifyDocument(*info);
      const int next = shard + 1;
      if (PrefillModeOf(*info) == v1::DocumentInfo::EXACT && next < doc.map.shards_size() && !doc.shard_done[next]) {
        auto tokens = catalog_->GetDocumentTokens(document_id);
        auto worker = registry_.Get(doc.map.shards(next).worker_id());
        if (tokens.ok() && worker.ok()) {
          SendPrefill(document_id, doc, next, *tokens, worker->info, &actions);
        } else {
          // The next holder is gone (or the tokens unreadable): place the document again.
          ++doc.dispatch_epoch;
          info->set_state(v1::DocumentInfo::PENDING);
          STRATA_LOG(WARNING) << "document " << document_id << ": shard " << next << " cannot start ("
                              << (tokens.ok() ? worker.status() : tokens.status()) << "); placed again";
          SaveDocument(doc).IgnoreError();  // best effort; the document is retried either way
        }
      }
    }
    UpdateGauges();
  }
  for (Action& a : actions) a();
  if (ready) Tick();
}

void Coordinator::OnMountDone(const std::string& document_id, int shard, uint64_t call, const absl::Status& status) {
  bool mounted = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = mounts_.find({document_id, shard});
    if (it == mounts_.end() || it->second.call != call) return;
    if (status.ok() || status.code() == absl::StatusCode::kUnimplemented) {
      // UNIMPLEMENTED: the worker loads the document itself when it runs a job.
      it->second.state = ShardMount::kMounted;
      it->second.mounted_nanos = now_();
      it->second.reported = status.ok();
      mounted = true;
      STRATA_LOG(INFO) << "document " << document_id << " shard " << shard << " mounted on " << it->second.worker_id;
    } else {
      it->second.state = ShardMount::kFailed;
      it->second.retry_after_nanos = now_() + kMountRetryNanos;
      STRATA_LOG(WARNING) << "document " << document_id << " shard " << shard << ": mount on "
                          << it->second.worker_id << " failed: " << status << " (retried)";
    }
  }
  if (mounted) Tick();  // jobs waiting for the mount
}

void Coordinator::OnJobEventFromWorker(const std::string& job_id, uint64_t epoch, const v1::JobEvent& event) {
  absl::MutexLock lock(&mu_);
  auto it = live_jobs_.find(job_id);
  if (it == live_jobs_.end() || it->second.dispatch_epoch != epoch) return;
  v1::JobInfo* info = it->second.record.mutable_info();
  std::vector<Action> unused;
  v1::JobEvent relayed = event;  // watchers number events themselves
  relayed.set_job_id(job_id);
  relayed.clear_sequence();
  switch (event.event_case()) {
    case v1::JobEvent::kProgress:
      *info->mutable_progress() = event.progress();
      NotifyJob(relayed);
      break;
    case v1::JobEvent::kTokens:
      if (info->state() == v1::JobInfo::PREFILLING) {
        TransitionJob(job_id, JobTransition::kStartDecode, &unused).IgnoreError();  // logged by SaveJob
      }
      for (int32_t t : event.tokens().token_ids()) info->add_output_token_ids(t);
      info->mutable_output_text()->append(event.tokens().text());
      info->mutable_usage()->set_completion_tokens(info->output_token_ids_size());
      NotifyJob(relayed);
      break;
    case v1::JobEvent::kSnapshot: {
      const v1::JobInfo& s = event.snapshot();
      if (s.has_usage()) {
        const uint64_t prompt = info->usage().prompt_tokens();
        *info->mutable_usage() = s.usage();
        if (info->usage().prompt_tokens() == 0) info->mutable_usage()->set_prompt_tokens(prompt);
      }
      switch (s.state()) {
        case v1::JobInfo::DECODING:
          if (info->state() == v1::JobInfo::PREFILLING) {
            TransitionJob(job_id, JobTransition::kStartDecode, &unused).IgnoreError();  // logged by SaveJob
          }
          break;
        case v1::JobInfo::DONE:
          if (info->state() == v1::JobInfo::PREFILLING) {
            TransitionJob(job_id, JobTransition::kStartDecode, &unused).IgnoreError();  // logged by SaveJob
          }
          info->set_finish_reason(s.finish_reason());
          if (s.output_token_ids_size() > 0) {
            *info->mutable_output_token_ids() = s.output_token_ids();
            info->set_output_text(s.output_text());
          }
          TransitionJob(job_id, JobTransition::kComplete, &unused).IgnoreError();  // logged by SaveJob
          break;
        case v1::JobInfo::FAILED:
          info->set_error_code(s.error_code() != 0 ? s.error_code() : static_cast<int>(absl::StatusCode::kInternal));
          info->set_error_message(s.error_message());
          TransitionJob(job_id, JobTransition::kFail, &unused).IgnoreError();  // logged by SaveJob
          break;
        case v1::JobInfo::CANCELLED:
          info->set_finish_reason(v1::JobInfo::CANCELLED_BY_CLIENT);
          TransitionJob(job_id, JobTransition::kCancel, &unused).IgnoreError();  // logged by SaveJob
          break;
        default:
          break;
      }
      break;
    }
    case v1::JobEvent::EVENT_NOT_SET:
      break;
  }
}

void Coordinator::OnJobDone(const std::string& job_id, uint64_t epoch, const absl::Status& status) {
  std::vector<Action> unused;
  absl::MutexLock lock(&mu_);
  auto it = live_jobs_.find(job_id);
  if (it == live_jobs_.end() || it->second.dispatch_epoch != epoch) return;
  if (status.code() == absl::StatusCode::kUnavailable || status.code() == absl::StatusCode::kCancelled) {
    STRATA_LOG(WARNING) << "job " << job_id << ": leader stream ended (" << status << "); requeued";
    TransitionJob(job_id, JobTransition::kRequeue, &unused).IgnoreError();  // logged by SaveJob
    return;
  }
  v1::JobInfo* info = it->second.record.mutable_info();
  if (status.ok()) {
    info->set_error_code(static_cast<int>(absl::StatusCode::kInternal));
    info->set_error_message("the leader ended the job stream without a final state");
  } else {
    info->set_error_code(static_cast<int>(status.code()));
    info->set_error_message(std::string(status.message()));
  }
  TransitionJob(job_id, JobTransition::kFail, &unused).IgnoreError();  // logged by SaveJob
}

// ------------------------------------------------------------------------------------------------
// Drain
// ------------------------------------------------------------------------------------------------

void Coordinator::StartDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  if (metrics_ != nullptr) metrics_->draining.Set(1);
}

bool Coordinator::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

int64_t Coordinator::RunningJobs() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [id, job] : live_jobs_) n += IsRunning(job.record.info().state()) ? 1 : 0;
  return n;
}

void Coordinator::HandBackRunningJobs() {
  std::vector<Action> actions;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<std::string, std::string>> running;
    for (const auto& [id, job] : live_jobs_) {
      if (IsRunning(job.record.info().state())) running.emplace_back(id, job.record.info().leader_worker_id());
    }
    for (const auto& [id, leader] : running) {
      auto worker = registry_.Get(leader);
      if (worker.ok() && workers_ != nullptr) {
        v1::WorkerInfo info = worker->info;
        const std::string job_id = id;
        actions.push_back([this, info, job_id] { workers_->CancelJob(info, job_id); });
      }
      TransitionJob(id, JobTransition::kRequeue, &actions).IgnoreError();  // logged by SaveJob
      STRATA_LOG(WARNING) << "job " << id << " handed back to the queue at shutdown";
    }
  }
  for (Action& a : actions) a();
}

void Coordinator::UpdateGauges() {
  if (metrics_ == nullptr) return;
  int64_t queued = 0, prefilling = 0, decoding = 0;
  for (const auto& [id, job] : live_jobs_) {
    switch (job.record.info().state()) {
      case v1::JobInfo::QUEUED: ++queued; break;
      case v1::JobInfo::PREFILLING: ++prefilling; break;
      case v1::JobInfo::DECODING: ++decoding; break;
      default: break;
    }
  }
  metrics_->jobs_queued.Set(static_cast<double>(queued));
  metrics_->jobs_prefilling.Set(static_cast<double>(prefilling));
  metrics_->jobs_decoding.Set(static_cast<double>(decoding));
  metrics_->job_queue_length.Set(static_cast<double>(queued));
  int64_t pending = 0, doc_prefilling = 0;
  for (const auto& [id, doc] : live_documents_) {
    if (doc.record.info().state() == v1::DocumentInfo::PENDING) ++pending;
    if (doc.record.info().state() == v1::DocumentInfo::PREFILLING) ++doc_prefilling;
  }
  metrics_->documents_pending.Set(static_cast<double>(pending));
  metrics_->documents_prefilling.Set(static_cast<double>(doc_prefilling));
  metrics_->workers.Set(static_cast<double>(registry_.size()));
}

}  // namespace strata::coordinator
