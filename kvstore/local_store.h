// Tier D: the local store, RocksDB in a data directory; also the storage engine of the KV store
// service (tier R is this store behind gRPC).
//
// Column families: "pages" (encoded pages), "summaries" (checksummed summary payloads),
// "documents" (strata.v1.Document metadata), "index" (one empty entry per stored page and summary,
// so completeness is checked without reading page bytes). Key encodings: kvstore/internal/keys.h.
// Writes are WriteBatches with the WAL synced before Put returns (WriteOptions::sync), so an
// acknowledged batch survives SIGKILL and power loss; a batch is atomic. PutDeferred (a document's
// bulk writes while it is prefilled) builds each batch as sorted SST files and ingests them, every
// column family in one atomic ingestion, so a batch is durable and whole when PutDeferred returns
// and its page bytes are written once (LocalStoreOptions::ingest_deferred). Otherwise it skips
// the WAL: its batches reach the SST files when the memtables are flushed, and FinalizeDocument
// flushes them before it marks any document READY; the column families are flushed together
// (atomic flush), so after a crash such a batch is either wholly present (pages and index
// entries) or wholly absent. A document becomes READY
// only in FinalizeDocument, after its pages and summaries are counted complete (from the tally of
// the writes this instance acknowledged when it created the document, else by counting the index
// column family); deletes are range deletes over the document's key range in every column family.
//
// RocksDB settings for large incompressible values (see LocalStoreOptions and bench/RESULTS.md):
// no compression, pages in SST files with XXH3 block checksums (the page-first key order of
// kvstore/internal/keys.h lets compactions move a prefill's files down without rewriting them,
// so blob files no longer save writes), whole-key bloom filters for point lookups, a large write
// buffer.
//
// Thread-safe. Put, Finalize and Delete on one document are serialized against each other by a
// striped reader/writer lock (Put takes it shared), so no page lands in a READY or deleted
// document.
#ifndef STRATA_KVSTORE_LOCAL_STORE_H_
#define STRATA_KVSTORE_LOCAL_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mutex>
#include <shared_mutex>

#include "absl/container/flat_hash_map.h"
#include "kvstore/metrics.h"
#include "kvstore/page_store.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
struct Options;
}  // namespace rocksdb

namespace strata::kvstore {
namespace internal {
class WriteTally;
}  // namespace internal

struct LocalStoreOptions {
  // Data directory; created when missing. Required. Not reloadable.
  std::string path;
  // Sync the WAL on every write batch. Turning it off loses acknowledged writes on power loss or
  // SIGKILL. Default: true.
  bool sync_writes = true;
  // Store values >= 4 KiB in blob files (RocksDB integrated BlobDB). Default: false: with the
  // page-first keys a prefill-order load writes each page once either way (write amplification
  // 2.0 with the WAL, both), and SST files loaded faster (10.0 s against 12.1 s for 1 GiB on the
  // build machine), took a prefill's writes at 0.9-1.0 GB/s against 0.46-0.54 on the H100
  // machine's 16 cores, and served batched cold reads about 3x faster (bench/RESULTS.md).
  bool blob_files = false;
  // PutDeferred builds each batch's pages, summaries and index entries as SST files beside the
  // database (SstFileWriter, keys sorted) and ingests them together (IngestExternalFiles: atomic
  // across the column families, durable when it returns), instead of writing them through the
  // memtables. A batch of one contiguous page range lands below every other file without
  // overlapping any, so its page bytes are written once and never compacted. False: WAL-less
  // WriteBatches, made durable by the memtable flush at FinalizeDocument. Default: true.
  bool ingest_deferred = true;
  // Compress SST and blob files with LZ4. KV pages are nearly incompressible (see
  // bench/RESULTS.md), so this costs CPU for no space. Default: false.
  bool compression = false;
  // Memtable size per column family. Default: 128 MiB.
  int64_t write_buffer_bytes = int64_t{128} << 20;
  // RocksDB block cache (keys, index, filters, summary values). Pages are cached by the host tier.
  // Default: 64 MiB.
  int64_t block_cache_bytes = int64_t{64} << 20;
  // Metrics sink (tier "disk"). Default (null): a private registry. Not owned.
  KvMetrics* metrics = nullptr;
  // Tier label for metrics: "disk" for a worker's local store; the service uses it too.
  std::string tier = "disk";

  absl::Status Validate() const;
};

class LocalStore final : public PageStore, public DocumentCatalog {
 public:
  // Opens (or creates) the store. Internal / DataLoss / InvalidArgument from RocksDB.
  static absl::StatusOr<std::unique_ptr<LocalStore>> Open(const LocalStoreOptions& options);
  ~LocalStore() override;

  const char* tier() const override { return options_.tier.c_str(); }
  absl::Status GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) override;
  // GetPages for a caller that keeps the bytes elsewhere (the KV store service writes them into
  // its response): emit(i, bytes) for each stored key i, verified, in key order; the bytes are
  // RocksDB's and valid during the call only. Missing keys are not emitted. The same errors and
  // metrics as GetPages (a corrupt page: DataLoss, after the pages before it were emitted).
  absl::Status VisitPages(absl::Span<const PageKey> keys,
                          const std::function<void(size_t, absl::string_view)>& emit);
  absl::Status Put(absl::Span<const PageWrite> pages,
                   absl::Span<const SummaryWrite> summaries) override;
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

  // The document metadata as stored (stored_* counts not filled). NotFound.
  absl::StatusOr<v1::Document> GetDocumentMetadata(const DocumentId& id);
  // Every stored summary of `doc` (optionally only `kinds`), in key order.
  absl::Status ScanSummaries(const DocumentId& doc, absl::Span<const uint32_t> kinds,
                             std::vector<SummaryKey>* keys, std::vector<PageRef>* values);
  // Deletes unpinned documents whose expire time is set and <= now_micros. Returns how many.
  absl::StatusOr<int> CollectGarbage(int64_t now_micros);

  // Sets strata_kv_resident_bytes{tier} from RocksDB's live SST and blob file sizes of the pages
  // and summaries column families. Returns the value.
  int64_t UpdateResidentBytes();

  // Flushes the memtables to SST and blob files (the WAL already makes Put's writes durable; this
  // makes PutDeferred's durable, shortens recovery and puts the bytes in their final files).
  absl::Status Flush();

  // Test hooks: raw access to stored page bytes (e.g. to corrupt one).
  absl::StatusOr<std::string> RawPageForTesting(const PageKey& key);
  absl::Status OverwriteRawPageForTesting(const PageKey& key, const std::string& bytes);
  // The number of SST files at `level` of column family `cf` ("pages", "summaries", "index",
  // "documents"); -1 for an unknown family or level.
  int FilesAtLevelForTesting(const std::string& cf, int level);
  // Sets the stored format marker to `value` ("" removes it), as another build would have left it.
  absl::Status WriteFormatForTesting(const std::string& value);

 private:
  explicit LocalStore(const LocalStoreOptions& options);
  absl::Status OpenDb();
  absl::Status CheckFormat();
  absl::Status Write(absl::Span<const PageWrite> pages, absl::Span<const SummaryWrite> summaries,
                     bool deferred);
  // PutDeferred's batch as ingested SST files (LocalStoreOptions::ingest_deferred); the pages and
  // summaries are checked, and the caller holds their documents' stripes.
  absl::Status Ingest(absl::Span<const PageWrite> pages, absl::Span<const SummaryWrite> summaries);
  absl::Status WriteDocument(const v1::Document& doc);
  absl::Status DeleteDocumentLocked(const DocumentId& id);  // caller holds the stripe
  absl::StatusOr<uint64_t> CountIndex(const DocumentId& doc, char type);
  // stored_pages / stored_summaries of `doc`: from its write tally while it is WRITING and has
  // one, else counted in the index column family.
  absl::Status FillCounts(v1::Document* doc);
  // The write tally of a document this instance created and has not finalized or deleted; null
  // when there is none.
  std::shared_ptr<internal::WriteTally> TallyFor(const DocumentId& id);
  void DropTally(const DocumentId& id);
  std::shared_mutex& StripeFor(const DocumentId& id);

  LocalStoreOptions options_;
  std::unique_ptr<prometheus::Registry> own_registry_;
  std::unique_ptr<KvMetrics> own_metrics_;
  TierMetrics m_;
  prometheus::Counter* bytes_read_ = nullptr;  // fetch bytes src=tier dst=host

  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // default, pages, summaries, documents, index
  rocksdb::ColumnFamilyHandle* pages_ = nullptr;
  rocksdb::ColumnFamilyHandle* summaries_ = nullptr;
  rocksdb::ColumnFamilyHandle* documents_ = nullptr;
  rocksdb::ColumnFamilyHandle* index_ = nullptr;
  // The options the column families were opened with (SstFileWriter builds files of the same
  // format): large values (pages, summaries) and small ones (index).
  std::unique_ptr<rocksdb::Options> large_options_, small_options_;
  std::string ingest_dir_;  // where Ingest builds its files (emptied at open)
  std::atomic<uint64_t> ingest_files_{0};

  static constexpr int kStripes = 64;
  std::shared_mutex stripes_[kStripes];  // std locks: visible to TSan
  // PutDeferred batches written so far (FinalizeDocument flushes once there are any).
  std::atomic<uint64_t> deferred_writes_{0};
  // Write tallies of the WRITING documents this instance created (internal/write_tally.h), by
  // document id bytes: FinalizeDocument takes a complete one instead of counting the index.
  std::mutex tallies_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<internal::WriteTally>> tallies_;
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_LOCAL_STORE_H_
