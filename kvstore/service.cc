#include "kvstore/service.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kvstore/internal/executor.h"
#include "proto/status_conversion.h"

namespace strata::kvstore {
namespace {

using proto::ToGrpcStatus;
using Shared = KvStoreService::Shared;

grpc::Status Error(const absl::Status& s) { return ToGrpcStatus(s); }

absl::StatusOr<DocumentId> ParseId(const std::string& hex) { return DocumentId::FromHex(hex); }

absl::Status TooMany(int64_t n, int64_t max, const char* what) {
  return absl::ResourceExhaustedError(
      absl::StrCat(n, " ", what, " in one request; the limit is ", max));
}

// Streams the requested pages of one document in request order.
class GetPagesReactor final : public grpc::ServerWriteReactor<v1::GetPagesResponse> {
 public:
  GetPagesReactor(Shared* shared, const v1::GetPagesRequest* request)
      : shared_(shared), request_(request) {
    shared_->executor->Post([this] { Prepare(); });
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    shared_->executor->Post([this] { LoadNext(); });
  }
  void OnDone() override { delete this; }

 private:
  void Prepare() {
    const int64_t n = request_->keys_size();
    if (n > shared_->options.max_keys_per_request) {
      Finish(Error(TooMany(n, shared_->options.max_keys_per_request, "page keys")));
      return;
    }
    absl::StatusOr<DocumentId> id = ParseId(request_->document_id());
    if (!id.ok()) {
      Finish(Error(id.status()));
      return;
    }
    absl::StatusOr<v1::Document> doc = shared_->store->GetDocumentMetadata(*id);
    if (!doc.ok()) {
      Finish(Error(doc.status()));
      return;
    }
    absl::StatusOr<KvLayout> layout = LayoutFromProto(doc->layout());
    if (!layout.ok()) {
      Finish(Error(layout.status()));
      return;
    }
    keys_.reserve(n);
    for (const v1::PageKey& k : request_->keys()) {
      if (k.layer() >= doc->layout().num_layers() || k.kv_head() >= doc->layout().num_kv_heads() ||
          k.page_index() >= doc->num_pages()) {
        Finish(Error(absl::InvalidArgumentError(
            absl::StrCat("page (", k.layer(), ", ", k.kv_head(), ", ", k.page_index(),
                         ") outside document ", doc->document_id()))));
        return;
      }
      keys_.push_back(PageKey{*id, k.layer(), k.kv_head(), k.page_index()});
    }
    const int64_t page_bytes = static_cast<int64_t>(layout->page.EncodedBytes());
    per_message_ = static_cast<size_t>(
        std::max<int64_t>(1, shared_->options.max_response_bytes / page_bytes));
    LoadNext();
  }

  void LoadNext() {
    if (next_ >= keys_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    Stopwatch watch;
    const size_t end = std::min(keys_.size(), next_ + per_message_);
    absl::Span<const PageKey> chunk(keys_.data() + next_, end - next_);
    // The pages go from the store's read straight into the response (whose cleared pages and
    // their strings are reused from message to message): one copy, no buffer of their own.
    response_.Clear();
    for (size_t i = 0; i < chunk.size(); ++i) {
      v1::Page* p = response_.add_pages();
      p->mutable_key()->set_layer(chunk[i].layer);
      p->mutable_key()->set_kv_head(chunk[i].kv_head);
      p->mutable_key()->set_page_index(chunk[i].page_index);
      p->set_absent(true);
    }
    int64_t hits = 0, bytes = 0;
    absl::Status s = shared_->store->VisitPages(chunk, [&](size_t i, absl::string_view data) {
      v1::Page* p = response_.mutable_pages(static_cast<int>(i));
      p->set_absent(false);
      p->set_data(data.data(), data.size());
      ++hits;
      bytes += static_cast<int64_t>(data.size());
    });
    if (!s.ok()) {
      Finish(Error(s));
      return;
    }
    shared_->remote.lookups->Increment(static_cast<double>(chunk.size()));
    shared_->remote.hits->Increment(static_cast<double>(hits));
    shared_->sent_bytes->Increment(static_cast<double>(bytes));
    shared_->remote.fetch_duration->Observe(watch.ElapsedSeconds());
    next_ = end;
    if (next_ >= keys_.size()) {
      // Last message: write and finish in one step (saves a round through the executor).
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    StartWrite(&response_);
  }

  Shared* shared_;
  const v1::GetPagesRequest* request_;
  std::vector<PageKey> keys_;
  size_t per_message_ = 1;
  size_t next_ = 0;
  v1::GetPagesResponse response_;
};

// Each message is validated and written as one synced batch before the next is read, so the
// final response means the whole stream is durable. Deferred messages (a WRITING document's bulk
// writes) are gathered, up to max_deferred_bytes, and stored as one PutDeferred batch (ingested
// as SST files by the local store) before a non-deferred message, at the cap, or at the stream's
// end, before the final response.
class PutPagesReactor final : public grpc::ServerReadReactor<v1::PutPagesRequest> {
 public:
  PutPagesReactor(Shared* shared, v1::PutPagesResponse* response)
      : shared_(shared), response_(response) {
    StartRead(&request_);
  }
  // A stream that failed with writes still gathered gives their bytes back.
  ~PutPagesReactor() override { shared_->deferred_bytes.fetch_sub(gathered_bytes_); }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed (or went away): store what is gathered, then answer
      if (gathered_pages_.empty() && gathered_summaries_.empty()) {
        Finish(grpc::Status::OK);
        return;
      }
      shared_->executor->Post([this] {
        const absl::Status s = StoreGathered();
        Finish(s.ok() ? grpc::Status::OK : Error(s));
      });
      return;
    }
    shared_->executor->Post([this] { Apply(); });
  }
  void OnDone() override { delete this; }

 private:
  // Stores the gathered deferred writes as one PutDeferred batch.
  absl::Status StoreGathered() {
    if (gathered_pages_.empty() && gathered_summaries_.empty()) return absl::OkStatus();
    const absl::Status s = shared_->store->PutDeferred(gathered_pages_, gathered_summaries_);
    if (s.ok()) {
      response_->set_pages_written(response_->pages_written() + gathered_pages_.size());
      response_->set_summaries_written(response_->summaries_written() + gathered_summaries_.size());
    }
    gathered_pages_.clear();
    gathered_summaries_.clear();
    shared_->deferred_bytes.fetch_sub(gathered_bytes_);
    gathered_bytes_ = 0;
    return s;
  }

  void Apply() {
    const int64_t n = request_.pages_size() + request_.summaries_size();
    if (n > shared_->options.max_keys_per_request) {
      Finish(Error(TooMany(n, shared_->options.max_keys_per_request, "pages and summaries")));
      return;
    }
    absl::StatusOr<DocumentId> id = ParseId(request_.document_id());
    if (!id.ok()) {
      Finish(Error(id.status()));
      return;
    }
    std::vector<PageWrite> pages;
    std::vector<SummaryWrite> summaries;
    pages.reserve(request_.pages_size());
    summaries.reserve(request_.summaries_size());
    for (const v1::Page& p : request_.pages()) {
      absl::StatusOr<PageRef> data = PageBuffer::Copy(p.data());
      if (!data.ok()) {
        Finish(Error(data.status()));
        return;
      }
      pages.push_back(PageWrite{PageKey{*id, p.key().layer(), p.key().kv_head(),
                                        p.key().page_index()},
                                *std::move(data)});
    }
    for (const v1::Summary& s : request_.summaries()) {
      absl::StatusOr<PageRef> data = PageBuffer::Copy(s.data());
      if (!data.ok()) {
        Finish(Error(data.status()));
        return;
      }
      summaries.push_back(SummaryWrite{
          SummaryKey{*id, s.key().layer(), s.key().kv_head(), s.key().kind(), s.key().index()},
          *std::move(data)});
    }
    if (request_.deferred()) {
      int64_t added = 0;
      for (PageWrite& w : pages) {
        added += static_cast<int64_t>(w.data->size());
        gathered_pages_.push_back(std::move(w));
      }
      for (SummaryWrite& w : summaries) {
        added += static_cast<int64_t>(w.data->size());
        gathered_summaries_.push_back(std::move(w));
      }
      gathered_bytes_ += added;
      const int64_t total = shared_->deferred_bytes.fetch_add(added) + added;
      if (gathered_bytes_ >= shared_->options.max_deferred_bytes ||
          total >= shared_->options.max_deferred_total_bytes) {
        if (absl::Status s = StoreGathered(); !s.ok()) {
          Finish(Error(s));
          return;
        }
      }
      StartRead(&request_);
      return;
    }
    absl::Status s = StoreGathered();  // deferred writes before this one
    if (s.ok()) s = shared_->store->Put(pages, summaries);
    if (!s.ok()) {
      Finish(Error(s));
      return;
    }
    response_->set_pages_written(response_->pages_written() + pages.size());
    response_->set_summaries_written(response_->summaries_written() + summaries.size());
    StartRead(&request_);
  }

  Shared* shared_;
  v1::PutPagesResponse* response_;
  v1::PutPagesRequest request_;
  std::vector<PageWrite> gathered_pages_;  // deferred messages not yet stored
  std::vector<SummaryWrite> gathered_summaries_;
  int64_t gathered_bytes_ = 0;
};

class GetSummariesReactor final : public grpc::ServerWriteReactor<v1::GetSummariesResponse> {
 public:
  GetSummariesReactor(Shared* shared, const v1::GetSummariesRequest* request)
      : shared_(shared), request_(request) {
    shared_->executor->Post([this] { Load(); });
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void Load() {
    if (request_->keys_size() > shared_->options.max_keys_per_request) {
      Finish(Error(TooMany(request_->keys_size(), shared_->options.max_keys_per_request,
                           "summary keys")));
      return;
    }
    absl::StatusOr<DocumentId> id = ParseId(request_->document_id());
    if (!id.ok()) {
      Finish(Error(id.status()));
      return;
    }
    if (absl::StatusOr<v1::Document> doc = shared_->store->GetDocumentMetadata(*id); !doc.ok()) {
      Finish(Error(doc.status()));
      return;
    }
    std::vector<SummaryKey> keys;
    std::vector<PageRef> values;
    absl::Status s;
    if (request_->keys_size() > 0) {
      for (const v1::SummaryKey& k : request_->keys()) {
        keys.push_back(SummaryKey{*id, k.layer(), k.kv_head(), k.kind(), k.index()});
      }
      s = shared_->store->GetSummaries(keys, &values);
    } else {
      std::vector<uint32_t> kinds(request_->kinds().begin(), request_->kinds().end());
      s = shared_->store->ScanSummaries(*id, kinds, &keys, &values);
    }
    if (!s.ok()) {
      Finish(Error(s));
      return;
    }
    int64_t bytes = 0;
    messages_.emplace_back();
    for (size_t i = 0; i < keys.size(); ++i) {
      const int64_t size = values[i] == nullptr ? 0 : static_cast<int64_t>(values[i]->size());
      if (bytes > 0 && bytes + size > shared_->options.max_response_bytes) {
        messages_.emplace_back();
        bytes = 0;
      }
      v1::Summary* out = messages_.back().add_summaries();
      out->mutable_key()->set_layer(keys[i].layer);
      out->mutable_key()->set_kv_head(keys[i].kv_head);
      out->mutable_key()->set_kind(keys[i].kind);
      out->mutable_key()->set_index(keys[i].index);
      if (values[i] == nullptr) {
        out->set_absent(true);
      } else {
        out->set_data(values[i]->data(), values[i]->size());
      }
      bytes += size + 16;
    }
    if (messages_.back().summaries_size() == 0) messages_.pop_back();
    WriteNext();
  }

  void WriteNext() {
    if (next_ >= messages_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    if (next_ + 1 == messages_.size()) {
      StartWriteAndFinish(&messages_[next_++], grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    StartWrite(&messages_[next_++]);
  }

  Shared* shared_;
  const v1::GetSummariesRequest* request_;
  std::vector<v1::GetSummariesResponse> messages_;
  size_t next_ = 0;
};

// Runs `fn` (returning absl::Status) on the executor and finishes the unary call with it.
template <typename Fn>
grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* ctx, internal::Executor* executor,
                                   Fn fn) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  executor->Post([reactor, fn = std::move(fn)]() mutable { reactor->Finish(Error(fn())); });
  return reactor;
}

}  // namespace

absl::Status KvStoreServiceOptions::Validate() const {
  if (max_keys_per_request < 1 || max_response_bytes < 1 || num_threads < 1 || max_deferred_bytes < 1 ||
      max_deferred_total_bytes < 1) {
    return absl::InvalidArgumentError(
        "kvstore service: max_keys_per_request, max_response_bytes, num_threads, max_deferred_bytes and "
        "max_deferred_total_bytes must be >= 1");
  }
  return absl::OkStatus();
}

KvStoreService::KvStoreService(LocalStore* store, KvMetrics* metrics,
                               const KvStoreServiceOptions& options) {
  shared_.store = store;
  shared_.metrics = metrics;
  shared_.options = options;
  shared_.remote = metrics->ForTier("remote");
  shared_.sent_bytes = metrics->FetchBytes("disk", "remote");
  shared_.executor = std::make_unique<internal::Executor>(options.num_threads);
}

KvStoreService::~KvStoreService() = default;

grpc::ServerWriteReactor<v1::GetPagesResponse>* KvStoreService::GetPages(
    grpc::CallbackServerContext* ctx, const v1::GetPagesRequest* request) {
  return new GetPagesReactor(&shared_, request);
}

grpc::ServerReadReactor<v1::PutPagesRequest>* KvStoreService::PutPages(
    grpc::CallbackServerContext* ctx, v1::PutPagesResponse* response) {
  return new PutPagesReactor(&shared_, response);
}

grpc::ServerWriteReactor<v1::GetSummariesResponse>* KvStoreService::GetSummaries(
    grpc::CallbackServerContext* ctx, const v1::GetSummariesRequest* request) {
  return new GetSummariesReactor(&shared_, request);
}

grpc::ServerUnaryReactor* KvStoreService::CreateDocument(grpc::CallbackServerContext* ctx,
                                                         const v1::CreateDocumentRequest* request,
                                                         v1::CreateDocumentResponse* response) {
  LocalStore* store = shared_.store;
  return RunUnary(ctx, shared_.executor.get(), [store, request, response]() -> absl::Status {
    bool created = false;
    absl::StatusOr<v1::Document> doc = store->CreateDocument(*request, &created);
    if (!doc.ok()) return doc.status();
    *response->mutable_document() = *std::move(doc);
    response->set_created(created);
    if (created) {
      STRATA_LOG(INFO) << "kvstore: created document=" << request->document_id()
                       << " tokens=" << request->num_tokens();
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvStoreService::FinalizeDocument(
    grpc::CallbackServerContext* ctx, const v1::FinalizeDocumentRequest* request,
    v1::Document* response) {
  LocalStore* store = shared_.store;
  return RunUnary(ctx, shared_.executor.get(), [store, request, response]() -> absl::Status {
    absl::StatusOr<DocumentId> id = ParseId(request->document_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<v1::Document> doc = store->FinalizeDocument(*id);
    if (!doc.ok()) return doc.status();
    *response = *std::move(doc);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvStoreService::GetDocument(grpc::CallbackServerContext* ctx,
                                                      const v1::GetDocumentRequest* request,
                                                      v1::Document* response) {
  LocalStore* store = shared_.store;
  return RunUnary(ctx, shared_.executor.get(), [store, request, response]() -> absl::Status {
    absl::StatusOr<DocumentId> id = ParseId(request->document_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<v1::Document> doc = request->skip_counts() ? store->GetDocumentInfo(*id) : store->GetDocument(*id);
    if (!doc.ok()) return doc.status();
    *response = *std::move(doc);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvStoreService::ListDocuments(grpc::CallbackServerContext* ctx,
                                                        const v1::ListDocumentsRequest* request,
                                                        v1::ListDocumentsResponse* response) {
  LocalStore* store = shared_.store;
  return RunUnary(ctx, shared_.executor.get(), [store, request, response]() -> absl::Status {
    absl::StatusOr<std::vector<v1::Document>> docs = store->ListDocuments(*request);
    if (!docs.ok()) return docs.status();
    for (v1::Document& d : *docs) *response->add_documents() = std::move(d);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvStoreService::PinDocument(grpc::CallbackServerContext* ctx,
                                                      const v1::PinDocumentRequest* request,
                                                      v1::Document* response) {
  LocalStore* store = shared_.store;
  return RunUnary(ctx, shared_.executor.get(), [store, request, response]() -> absl::Status {
    absl::StatusOr<DocumentId> id = ParseId(request->document_id());
    if (!id.ok()) return id.status();
    absl::StatusOr<v1::Document> doc =
        store->PinDocument(*id, request->pinned(), request->ttl_seconds());
    if (!doc.ok()) return doc.status();
    *response = *std::move(doc);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* KvStoreService::DeleteDocument(grpc::CallbackServerContext* ctx,
                                                         const v1::DeleteDocumentRequest* request,
                                                         v1::DeleteDocumentResponse* response) {
  LocalStore* store = shared_.store;
  return RunUnary(ctx, shared_.executor.get(), [store, request]() -> absl::Status {
    absl::StatusOr<DocumentId> id = ParseId(request->document_id());
    if (!id.ok()) return id.status();
    absl::Status s = store->DeleteDocument(*id);
    if (s.ok()) STRATA_LOG(INFO) << "kvstore: deleted document=" << request->document_id();
    return s;
  });
}

absl::Status KvStoreServerOptions::Validate() const {
  if (listen_address.empty()) return absl::InvalidArgumentError("kvstore: listen address required");
  if (max_message_bytes < (1 << 20)) {
    return absl::InvalidArgumentError("kvstore: max_message_bytes must be >= 1 MiB");
  }
  if (gc_interval_ms < 0) return absl::InvalidArgumentError("kvstore: gc_interval_ms < 0");
  if (absl::Status s = store.Validate(); !s.ok()) return s;
  return service.Validate();
}

absl::StatusOr<std::unique_ptr<KvStoreServer>> KvStoreServer::Start(
    const KvStoreServerOptions& options, KvMetrics* metrics) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<KvStoreServer> server(new KvStoreServer());
  LocalStoreOptions store_options = options.store;
  store_options.metrics = metrics;
  absl::StatusOr<std::unique_ptr<LocalStore>> store = LocalStore::Open(store_options);
  if (!store.ok()) return store.status();
  server->store_ = *std::move(store);
  server->service_ =
      std::make_unique<KvStoreService>(server->store_.get(), metrics, options.service);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("kvstore: cannot listen on ", options.listen_address));
  }
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus(v1::KvStore::service_full_name(), true);
  }
  if (options.gc_interval_ms > 0) {
    KvStoreServer* raw = server.get();
    const int64_t interval = options.gc_interval_ms;
    server->gc_thread_ = std::thread([raw, interval] { raw->GcLoop(interval); });
  }
  return server;
}

void KvStoreServer::GcLoop(int64_t interval_ms) {
  // Ticks every 5 s (or the GC interval when shorter) to refresh the resident-bytes gauge;
  // collects garbage every interval_ms.
  const int64_t tick_ms = std::min<int64_t>(interval_ms, 5000);
  int64_t since_gc_ms = 0;
  store_->UpdateResidentBytes();
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(gc_mu_);
      if (gc_cv_.wait_for(lock, std::chrono::milliseconds(tick_ms), [this] { return stop_gc_; })) {
        return;
      }
    }
    store_->UpdateResidentBytes();
    since_gc_ms += tick_ms;
    if (since_gc_ms < interval_ms) continue;
    since_gc_ms = 0;
    absl::StatusOr<int> n = store_->CollectGarbage(WallMicros());
    if (!n.ok()) STRATA_LOG(WARNING) << "kvstore gc failed: " << n.status();
  }
}

void KvStoreServer::Shutdown(int64_t deadline_ms) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ != nullptr) {
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    if (health != nullptr) health->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  }
  {
    std::lock_guard<std::mutex> gc_lock(gc_mu_);
    stop_gc_ = true;
  }
  gc_cv_.notify_all();
  if (gc_thread_.joinable()) gc_thread_.join();
}

KvStoreServer::~KvStoreServer() { Shutdown(); }

}  // namespace strata::kvstore
