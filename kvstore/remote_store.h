// Tier R client: a PageStore and DocumentCatalog backed by the KV store service over gRPC.
//
// Every call sets a deadline (RemoteStoreOptions::timeout_ms). Page reads verify each page's
// checksum on arrival (DataLoss). Put sends one PutPages stream per document, split into
// messages of at most max_message_bytes, and returns once the service has acknowledged the whole
// stream durable; PutDeferred the same with the messages marked deferred (one ingested batch on
// the service). gRPC errors map to absl codes 1:1. Thread-safe (the channels are shared).
#ifndef STRATA_KVSTORE_REMOTE_STORE_H_
#define STRATA_KVSTORE_REMOTE_STORE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvstore/metrics.h"
#include "kvstore/page_store.h"
#include "strata/v1/kvstore.grpc.pb.h"

namespace strata::kvstore {

struct RemoteStoreOptions {
  // gRPC target, e.g. "127.0.0.1:7070". Required.
  std::string target;
  // Deadline of every call. Default: 30 s.
  int64_t timeout_ms = 30000;
  // Largest PutPages message sent (pages are grouped up to this). Default: 4 MiB.
  int64_t max_message_bytes = int64_t{4} << 20;
  // Largest message accepted from the service. Default: 64 MiB.
  int64_t max_receive_bytes = int64_t{64} << 20;
  // Connections that carry page and summary bytes (GetPages, PutPages, GetSummaries), each call
  // on the next in turn; the other calls use the first. One HTTP/2 connection carries a bulk
  // read at about 1 GB/s however many calls share it (a worker's mount reads four batches at
  // once, a prefill writes eight). 1 to 64. Default: 4.
  int data_channels = 4;
  // Metrics sink (tier "remote"). Default (null): a private registry. Not owned.
  KvMetrics* metrics = nullptr;

  absl::Status Validate() const;
};

class RemoteStore final : public PageStore, public DocumentCatalog {
 public:
  // Creates the channel (lazily connected). InvalidArgument on bad options.
  static absl::StatusOr<std::unique_ptr<RemoteStore>> Create(const RemoteStoreOptions& options);
  ~RemoteStore() override;

  // Blocks until the channel is ready or `timeout_ms` passes (Unavailable).
  absl::Status WaitForReady(int64_t timeout_ms);

  const char* tier() const override { return "remote"; }
  absl::Status GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) override;
  absl::Status Put(absl::Span<const PageWrite> pages,
                   absl::Span<const SummaryWrite> summaries) override;
  // Put with every message marked deferred: the service stores each call's stream as one
  // PutDeferred batch of its local store (ingested as SST files) instead of a synced write per
  // message; stored (durable with ingestion, else at FinalizeDocument) when it returns.
  absl::Status PutDeferred(absl::Span<const PageWrite> pages,
                           absl::Span<const SummaryWrite> summaries) override;
  absl::Status GetSummaries(absl::Span<const SummaryKey> keys, std::vector<PageRef>* out) override;

  absl::StatusOr<v1::Document> CreateDocument(const v1::CreateDocumentRequest& request,
                                              bool* created) override;
  absl::StatusOr<v1::Document> FinalizeDocument(const DocumentId& id) override;
  absl::StatusOr<v1::Document> GetDocument(const DocumentId& id) override;
  absl::StatusOr<v1::Document> GetDocumentInfo(const DocumentId& id) override;
  absl::StatusOr<std::vector<v1::Document>> ListDocuments(
      const v1::ListDocumentsRequest& request) override;
  absl::StatusOr<v1::Document> PinDocument(const DocumentId& id, bool pinned,
                                           int64_t ttl_seconds) override;
  absl::Status DeleteDocument(const DocumentId& id) override;

  // The generated stub (for callers needing raw RPCs, e.g. tests). Owned by this object.
  v1::KvStore::Stub* stub() { return stub_.get(); }

 private:
  explicit RemoteStore(const RemoteStoreOptions& options);
  void SetDeadline(grpc::ClientContext* ctx) const;
  absl::StatusOr<v1::Document> Get(const DocumentId& id, bool skip_counts);  // the GetDocument RPC
  absl::Status GetPagesOfDocument(const DocumentId& doc, absl::Span<const PageKey> keys,
                                  absl::Span<const size_t> positions, std::vector<PageRef>* out);

  RemoteStoreOptions options_;
  std::unique_ptr<prometheus::Registry> own_registry_;
  std::unique_ptr<KvMetrics> own_metrics_;
  TierMetrics m_;
  prometheus::Counter* bytes_in_ = nullptr;  // fetch bytes src=remote dst=host
  // Put and PutDeferred: one PutPages stream per document.
  absl::Status Write(absl::Span<const PageWrite> pages, absl::Span<const SummaryWrite> summaries,
                     bool deferred);
  // The next data stub, in turn (data_channels of them; the first is stub_'s channel).
  v1::KvStore::Stub* DataStub();

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvStore::Stub> stub_;
  std::vector<std::shared_ptr<grpc::Channel>> data_channels_;
  std::vector<std::unique_ptr<v1::KvStore::Stub>> data_stubs_;
  std::atomic<uint64_t> next_data_{0};
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_REMOTE_STORE_H_
