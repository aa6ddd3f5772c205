#include "kvstore/remote_store.h"

#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "grpcpp/grpcpp.h"
#include "kvstore/page_format.h"
#include "proto/status_conversion.h"

namespace strata::kvstore {
namespace {

using proto::FromGrpcStatus;

// Groups key positions by document, keeping first-seen order of documents.
template <typename Key>
std::vector<std::pair<DocumentId, std::vector<size_t>>> GroupByDocument(absl::Span<const Key> keys) {
  std::vector<std::pair<DocumentId, std::vector<size_t>>> groups;
  std::map<DocumentId, size_t> index;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto [it, inserted] = index.emplace(keys[i].document, groups.size());
    if (inserted) groups.emplace_back(keys[i].document, std::vector<size_t>());
    groups[it->second].second.push_back(i);
  }
  return groups;
}

}  // namespace

absl::Status RemoteStoreOptions::Validate() const {
  if (target.empty()) return absl::InvalidArgumentError("remote store: target required");
  if (timeout_ms <= 0) return absl::InvalidArgumentError("remote store: timeout_ms must be > 0");
  if (max_message_bytes < 1024 || max_receive_bytes < 1024) {
    return absl::InvalidArgumentError("remote store: message limits must be >= 1 KiB");
  }
  if (data_channels < 1 || data_channels > 64) {
    return absl::InvalidArgumentError("remote store: data_channels must be in [1, 64]");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RemoteStore>> RemoteStore::Create(
    const RemoteStoreOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::unique_ptr<RemoteStore>(new RemoteStore(options));
}

RemoteStore::RemoteStore(const RemoteStoreOptions& options) : options_(options) {
  KvMetrics* metrics = options_.metrics;
  if (metrics == nullptr) {
    own_registry_ = std::make_unique<prometheus::Registry>();
    own_metrics_ = std::make_unique<KvMetrics>(own_registry_.get());
    metrics = own_metrics_.get();
  }
  m_ = metrics->ForTier("remote");
  bytes_in_ = metrics->FetchBytes("remote", "host");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_receive_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options_.max_receive_bytes));
  channel_ = grpc::CreateCustomChannel(options_.target, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::KvStore::NewStub(channel_);
  data_stubs_.push_back(v1::KvStore::NewStub(channel_));
  // The others on connections of their own: channels with the same target and arguments would
  // share one connection through gRPC's global subchannel pool.
  grpc::ChannelArguments own = args;
  own.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (int i = 1; i < options_.data_channels; ++i) {
    data_channels_.push_back(grpc::CreateCustomChannel(options_.target, grpc::InsecureChannelCredentials(), own));
    data_stubs_.push_back(v1::KvStore::NewStub(data_channels_.back()));
  }
}

v1::KvStore::Stub* RemoteStore::DataStub() {
  return data_stubs_[next_data_.fetch_add(1, std::memory_order_relaxed) % data_stubs_.size()].get();
}

RemoteStore::~RemoteStore() = default;

void RemoteStore::SetDeadline(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(options_.timeout_ms));
}

absl::Status RemoteStore::WaitForReady(int64_t timeout_ms) {
  if (channel_->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::milliseconds(timeout_ms))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("kvstore at ", options_.target, " not reachable in ",
                                             timeout_ms, " ms"));
}

absl::Status RemoteStore::GetPagesOfDocument(const DocumentId& doc, absl::Span<const PageKey> keys,
                                             absl::Span<const size_t> positions,
                                             std::vector<PageRef>* out) {
  v1::GetPagesRequest request;
  request.set_document_id(doc.ToHex());
  for (size_t pos : positions) {
    v1::PageKey* k = request.add_keys();
    k->set_layer(keys[pos].layer);
    k->set_kv_head(keys[pos].kv_head);
    k->set_page_index(keys[pos].page_index);
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  std::unique_ptr<grpc::ClientReader<v1::GetPagesResponse>> reader =
      DataStub()->GetPages(&ctx, request);
  v1::GetPagesResponse response;
  size_t next = 0;
  int64_t hits = 0, bytes = 0;
  absl::Status error;
  while (reader->Read(&response)) {
    for (v1::Page& p : *response.mutable_pages()) {
      if (next >= positions.size()) {
        error = absl::InternalError("kvstore sent more pages than requested");
        break;
      }
      const PageKey& want = keys[positions[next]];
      if (p.key().layer() != want.layer || p.key().kv_head() != want.kv_head ||
          p.key().page_index() != want.page_index) {
        error = absl::InternalError("kvstore sent pages out of order");
        break;
      }
      if (!p.absent()) {
        if (absl::StatusOr<PageHeader> h = VerifyPage(p.data()); !h.ok()) {
          error = absl::DataLossError(absl::StrCat("page received from kvstore is corrupt: ",
                                                   h.status().message()));
          break;
        }
        bytes += static_cast<int64_t>(p.data().size());
        ++hits;
        (*out)[positions[next]] = PageBuffer::Adopt(std::move(*p.mutable_data()));
      }
      ++next;
    }
    if (!error.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status status = reader->Finish();
  m_.hits->Increment(static_cast<double>(hits));
  bytes_in_->Increment(static_cast<double>(bytes));
  if (!error.ok()) return error;
  if (!status.ok()) return FromGrpcStatus(status);
  if (next != positions.size()) {
    return absl::InternalError(absl::StrCat("kvstore sent ", next, " of ", positions.size(),
                                            " pages"));
  }
  return absl::OkStatus();
}

absl::Status RemoteStore::GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) {
  Stopwatch watch;
  out->assign(keys.size(), nullptr);
  m_.lookups->Increment(static_cast<double>(keys.size()));
  for (const auto& [doc, positions] : GroupByDocument(keys)) {
    absl::Status s = GetPagesOfDocument(doc, keys, positions, out);
    if (!s.ok()) {
      out->assign(keys.size(), nullptr);
      return s;
    }
  }
  m_.fetch_duration->Observe(watch.ElapsedSeconds());
  return absl::OkStatus();
}

absl::Status RemoteStore::Put(absl::Span<const PageWrite> pages,
                              absl::Span<const SummaryWrite> summaries) {
  return Write(pages, summaries, /*deferred=*/false);
}

absl::Status RemoteStore::PutDeferred(absl::Span<const PageWrite> pages,
                                      absl::Span<const SummaryWrite> summaries) {
  return Write(pages, summaries, /*deferred=*/true);
}

absl::Status RemoteStore::Write(absl::Span<const PageWrite> pages,
                                absl::Span<const SummaryWrite> summaries, bool deferred) {
  std::map<DocumentId, std::pair<std::vector<size_t>, std::vector<size_t>>> by_doc;
  for (size_t i = 0; i < pages.size(); ++i) by_doc[pages[i].key.document].first.push_back(i);
  for (size_t i = 0; i < summaries.size(); ++i) {
    by_doc[summaries[i].key.document].second.push_back(i);
  }
  for (const auto& [doc, idx] : by_doc) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    v1::PutPagesResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PutPagesRequest>> writer =
        DataStub()->PutPages(&ctx, &response);
    v1::PutPagesRequest message;
    int64_t bytes = 0;
    bool write_failed = false;
    auto flush = [&]() {
      if (message.pages_size() == 0 && message.summaries_size() == 0) return;
      message.set_document_id(doc.ToHex());
      message.set_deferred(deferred);
      if (!writer->Write(message)) write_failed = true;
      message.Clear();
      bytes = 0;
    };
    for (size_t i : idx.first) {
      if (write_failed) break;
      const PageWrite& w = pages[i];
      if (w.data == nullptr) return absl::InvalidArgumentError("null page data");
      if (bytes > 0 && bytes + static_cast<int64_t>(w.data->size()) > options_.max_message_bytes) {
        flush();
      }
      v1::Page* p = message.add_pages();
      p->mutable_key()->set_layer(w.key.layer);
      p->mutable_key()->set_kv_head(w.key.kv_head);
      p->mutable_key()->set_page_index(w.key.page_index);
      p->set_data(w.data->data(), w.data->size());
      bytes += static_cast<int64_t>(w.data->size()) + 16;
    }
    for (size_t i : idx.second) {
      if (write_failed) break;
      const SummaryWrite& w = summaries[i];
      if (w.data == nullptr) return absl::InvalidArgumentError("null summary data");
      if (bytes > 0 && bytes + static_cast<int64_t>(w.data->size()) > options_.max_message_bytes) {
        flush();
      }
      v1::Summary* s = message.add_summaries();
      s->mutable_key()->set_layer(w.key.layer);
      s->mutable_key()->set_kv_head(w.key.kv_head);
      s->mutable_key()->set_kind(w.key.kind);
      s->mutable_key()->set_index(w.key.index);
      s->set_data(w.data->data(), w.data->size());
      bytes += static_cast<int64_t>(w.data->size()) + 20;
    }
    if (!write_failed) flush();
    if (!write_failed) writer->WritesDone();
    grpc::Status status = writer->Finish();
    if (!status.ok()) return FromGrpcStatus(status);
    if (write_failed) return absl::UnavailableError("kvstore stream closed during PutPages");
  }
  return absl::OkStatus();
}

absl::Status RemoteStore::GetSummaries(absl::Span<const SummaryKey> keys,
                                       std::vector<PageRef>* out) {
  out->assign(keys.size(), nullptr);
  for (const auto& [doc, positions] : GroupByDocument(keys)) {
    v1::GetSummariesRequest request;
    request.set_document_id(doc.ToHex());
    for (size_t pos : positions) {
      v1::SummaryKey* k = request.add_keys();
      k->set_layer(keys[pos].layer);
      k->set_kv_head(keys[pos].kv_head);
      k->set_kind(keys[pos].kind);
      k->set_index(keys[pos].index);
    }
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    auto reader = DataStub()->GetSummaries(&ctx, request);
    v1::GetSummariesResponse response;
    size_t next = 0;
    while (reader->Read(&response)) {
      for (const v1::Summary& s : response.summaries()) {
        if (next >= positions.size()) break;
        if (!s.absent()) {
          absl::StatusOr<PageRef> ref = PageBuffer::Copy(s.data());
          if (!ref.ok()) return ref.status();
          (*out)[positions[next]] = *std::move(ref);
        }
        ++next;
      }
    }
    grpc::Status status = reader->Finish();
    if (!status.ok()) {
      out->assign(keys.size(), nullptr);
      return FromGrpcStatus(status);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Document> RemoteStore::CreateDocument(const v1::CreateDocumentRequest& request,
                                                         bool* created) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::CreateDocumentResponse response;
  grpc::Status s = stub_->CreateDocument(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  *created = response.created();
  return response.document();
}

absl::StatusOr<v1::Document> RemoteStore::FinalizeDocument(const DocumentId& id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::FinalizeDocumentRequest request;
  request.set_document_id(id.ToHex());
  v1::Document response;
  grpc::Status s = stub_->FinalizeDocument(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<v1::Document> RemoteStore::GetDocument(const DocumentId& id) { return Get(id, false); }

absl::StatusOr<v1::Document> RemoteStore::GetDocumentInfo(const DocumentId& id) { return Get(id, true); }

absl::StatusOr<v1::Document> RemoteStore::Get(const DocumentId& id, bool skip_counts) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::GetDocumentRequest request;
  request.set_document_id(id.ToHex());
  request.set_skip_counts(skip_counts);
  v1::Document response;
  grpc::Status s = stub_->GetDocument(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<std::vector<v1::Document>> RemoteStore::ListDocuments(
    const v1::ListDocumentsRequest& request) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::ListDocumentsResponse response;
  grpc::Status s = stub_->ListDocuments(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return std::vector<v1::Document>(response.documents().begin(), response.documents().end());
}

absl::StatusOr<v1::Document> RemoteStore::PinDocument(const DocumentId& id, bool pinned,
                                                      int64_t ttl_seconds) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::PinDocumentRequest request;
  request.set_document_id(id.ToHex());
  request.set_pinned(pinned);
  request.set_ttl_seconds(ttl_seconds);
  v1::Document response;
  grpc::Status s = stub_->PinDocument(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::Status RemoteStore::DeleteDocument(const DocumentId& id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  v1::DeleteDocumentRequest request;
  request.set_document_id(id.ToHex());
  v1::DeleteDocumentResponse response;
  return FromGrpcStatus(stub_->DeleteDocument(&ctx, request, &response));
}

}  // namespace strata::kvstore
