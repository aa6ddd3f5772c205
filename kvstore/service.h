// The KV store gRPC service (strata.v1.KvStore) over a LocalStore, and KvStoreServer, which runs
// it: gRPC server with health checking and reflection, and garbage collection of expired
// documents.
//
// Handlers are thin adapters (proto -> LocalStore -> proto) built on the callback API; blocking
// storage work runs on an internal executor, never inside a reaction. Page streams are split into
// messages of at most max_response_bytes. Request limits give RESOURCE_EXHAUSTED; the other codes
// are those of LocalStore (page_store.h). Thread-safe.
#ifndef STRATA_KVSTORE_SERVICE_H_
#define STRATA_KVSTORE_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include <condition_variable>
#include <mutex>
#include "kvstore/local_store.h"
#include "kvstore/metrics.h"
#include "strata/v1/kvstore.grpc.pb.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace strata::kvstore {

namespace internal {
class Executor;
}  // namespace internal

struct KvStoreServiceOptions {
  // Most keys in one GetPages / GetSummaries request or pages + summaries in one PutPages
  // message; more is RESOURCE_EXHAUSTED. Default: 65536.
  int64_t max_keys_per_request = 65536;
  // Target size of one streamed response message. Default: 4 MiB.
  int64_t max_response_bytes = int64_t{4} << 20;
  // Threads doing storage work. Default: 8.
  int num_threads = 8;
  // Bytes of deferred PutPages messages one stream gathers before it stores them as one
  // PutDeferred batch (a worker's prefill sends batches of ~128 MiB, one stream each), and the
  // most all streams hold at once (a stream past it stores what it gathered). Defaults: 256 MiB,
  // 1 GiB.
  int64_t max_deferred_bytes = int64_t{256} << 20;
  int64_t max_deferred_total_bytes = int64_t{1} << 30;

  absl::Status Validate() const;
};

class KvStoreService final : public v1::KvStore::CallbackService {
 public:
  // `store` and `metrics` are not owned and must outlive the service.
  KvStoreService(LocalStore* store, KvMetrics* metrics, const KvStoreServiceOptions& options);
  ~KvStoreService() override;

  grpc::ServerWriteReactor<v1::GetPagesResponse>* GetPages(
      grpc::CallbackServerContext* ctx, const v1::GetPagesRequest* request) override;
  grpc::ServerReadReactor<v1::PutPagesRequest>* PutPages(grpc::CallbackServerContext* ctx,
                                                         v1::PutPagesResponse* response) override;
  grpc::ServerWriteReactor<v1::GetSummariesResponse>* GetSummaries(
      grpc::CallbackServerContext* ctx, const v1::GetSummariesRequest* request) override;
  grpc::ServerUnaryReactor* CreateDocument(grpc::CallbackServerContext* ctx,
                                           const v1::CreateDocumentRequest* request,
                                           v1::CreateDocumentResponse* response) override;
  grpc::ServerUnaryReactor* FinalizeDocument(grpc::CallbackServerContext* ctx,
                                             const v1::FinalizeDocumentRequest* request,
                                             v1::Document* response) override;
  grpc::ServerUnaryReactor* GetDocument(grpc::CallbackServerContext* ctx,
                                        const v1::GetDocumentRequest* request,
                                        v1::Document* response) override;
  grpc::ServerUnaryReactor* ListDocuments(grpc::CallbackServerContext* ctx,
                                          const v1::ListDocumentsRequest* request,
                                          v1::ListDocumentsResponse* response) override;
  grpc::ServerUnaryReactor* PinDocument(grpc::CallbackServerContext* ctx,
                                        const v1::PinDocumentRequest* request,
                                        v1::Document* response) override;
  grpc::ServerUnaryReactor* DeleteDocument(grpc::CallbackServerContext* ctx,
                                           const v1::DeleteDocumentRequest* request,
                                           v1::DeleteDocumentResponse* response) override;

  // Shared with the reactors (service.cc).
  struct Shared {
    LocalStore* store;
    KvMetrics* metrics;
    KvStoreServiceOptions options;
    TierMetrics remote;                      // tier "remote": what clients looked up here
    prometheus::Counter* sent_bytes;         // fetch bytes src=disk dst=remote
    std::unique_ptr<internal::Executor> executor;
    std::atomic<int64_t> deferred_bytes{0};  // gathered by every PutPages stream, not yet stored
  };

 private:
  Shared shared_;
};

struct KvStoreServerOptions {
  // gRPC listen address, e.g. "127.0.0.1:0" (port 0: any free port). Required.
  std::string listen_address;
  LocalStoreOptions store;  // store.path is required
  KvStoreServiceOptions service;
  // Largest accepted request message (gRPC max receive size); larger ones fail with
  // RESOURCE_EXHAUSTED. Default: 64 MiB.
  int64_t max_message_bytes = int64_t{64} << 20;
  // Garbage-collection period; 0 disables the collector. Default: 60 s.
  int64_t gc_interval_ms = 60000;

  absl::Status Validate() const;
};

// Owns the store, the service and the gRPC server. Thread-safe.
class KvStoreServer {
 public:
  // Opens the store and starts serving. `metrics` (not owned) receives every kv metric.
  static absl::StatusOr<std::unique_ptr<KvStoreServer>> Start(const KvStoreServerOptions& options,
                                                              KvMetrics* metrics);
  ~KvStoreServer();  // Shutdown()

  int port() const { return port_; }
  LocalStore* store() { return store_.get(); }
  // Stops accepting calls, waits (up to `deadline_ms`) for calls in flight, stops the collector.
  void Shutdown(int64_t deadline_ms = 2000);

 private:
  KvStoreServer() = default;
  void GcLoop(int64_t interval_ms);

  std::unique_ptr<LocalStore> store_;
  std::unique_ptr<KvStoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  // std locks (not absl): visible to TSan, Debian's Abseil is not instrumented.
  std::mutex gc_mu_;
  std::condition_variable gc_cv_;
  bool stop_gc_ = false;  // guarded by gc_mu_
  std::thread gc_thread_;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_SERVICE_H_
