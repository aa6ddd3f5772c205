// The coordinator's catalog: documents, jobs and shard maps in RocksDB, so that they survive a
// restart (DESIGN.md section 1).
//
// Column families: "documents" (document id -> DocumentRecord), "tokens" (document id -> the
// document's token ids, little-endian int32), "jobs" (job id -> JobRecord), "shards" (document
// id -> ShardMapRecord); "default" holds counters ("seq/<name>") and request ids of jobs
// ("request/<request_id>" -> job id). Records are versioned: `schema_version` says
// how to read them (unknown versions are DATA_LOSS) and `generation` increments on every write,
// so updates are compare-and-set (ABORTED when the caller's generation is stale). Writes are
// synced to the WAL before they return (unless sync_writes is off).
//
// Thread-safe: writes of one key are serialized by an internal mutex; reads take no lock.
#ifndef STRATA_COORDINATOR_CATALOG_H_
#define STRATA_COORDINATOR_CATALOG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "strata/v1/internal.pb.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
}  // namespace rocksdb

namespace strata::coordinator {

struct CatalogOptions {
  // RocksDB directory; created if missing. Required.
  std::string path;
  // Sync the WAL on every write (durable across power loss). Off only in tests. Default: true.
  bool sync_writes = true;

  // InvalidArgument when path is empty.
  absl::Status Validate() const;
};

// The record layout this code writes and reads.
inline constexpr uint32_t kCatalogSchemaVersion = 1;

class Catalog {
 public:
  // Opens (creating if missing) the catalog at options.path. INVALID_ARGUMENT for bad options;
  // INTERNAL / UNAVAILABLE (e.g. the directory is locked by another process) from RocksDB.
  static absl::StatusOr<std::unique_ptr<Catalog>> Open(const CatalogOptions& options);
  ~Catalog();
  Catalog(const Catalog&) = delete;
  Catalog& operator=(const Catalog&) = delete;

  // Stores a new document and its tokens atomically; sets record->schema_version and generation
  // (1). ALREADY_EXISTS when the id is taken.
  absl::Status CreateDocument(v1::DocumentRecord* record, absl::Span<const int32_t> tokens);
  // Replaces a document record. record->generation must be the stored one (ABORTED otherwise);
  // it is incremented on success. NOT_FOUND when the document does not exist.
  absl::Status UpdateDocument(v1::DocumentRecord* record);
  // NOT_FOUND when absent; DATA_LOSS for an unreadable record.
  absl::StatusOr<v1::DocumentRecord> GetDocument(const std::string& id) const;
  absl::StatusOr<std::vector<int32_t>> GetDocumentTokens(const std::string& id) const;
  // Up to `limit` documents with id > start_after, in id order.
  absl::StatusOr<std::vector<v1::DocumentRecord>> ListDocuments(const std::string& start_after,
                                                                size_t limit) const;
  // Deletes the document, its tokens and its shard map atomically. NOT_FOUND when absent.
  absl::Status DeleteDocument(const std::string& id);

  // Jobs: the same contract as documents. A non-empty record->info().request_id() is recorded
  // with the job in the same write (ALREADY_EXISTS when another job holds it).
  absl::Status CreateJob(v1::JobRecord* record);
  // The id of the job created with `request_id`; NOT_FOUND when none was.
  absl::StatusOr<std::string> FindJobByRequestId(const std::string& request_id) const;
  absl::Status UpdateJob(v1::JobRecord* record);
  absl::StatusOr<v1::JobRecord> GetJob(const std::string& id) const;
  absl::StatusOr<std::vector<v1::JobRecord>> ListJobs(const std::string& start_after, size_t limit) const;

  // Creates or replaces a shard map (compare-and-set on generation; 0 means "must not exist").
  absl::Status PutShardMap(v1::ShardMapRecord* record);
  absl::StatusOr<v1::ShardMapRecord> GetShardMap(const std::string& document_id) const;

  // Returns the next value of a persistent counter (1, 2, 3, ...).
  absl::StatusOr<uint64_t> NextSequence(const std::string& counter);

 private:
  Catalog() = default;

  rocksdb::DB* db_ = nullptr;
  rocksdb::ColumnFamilyHandle* default_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* documents_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* tokens_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* jobs_cf_ = nullptr;
  rocksdb::ColumnFamilyHandle* shards_cf_ = nullptr;
  bool sync_writes_ = true;
  // Serializes read-check-write sequences.
  absl::Mutex write_mu_;
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_CATALOG_H_
