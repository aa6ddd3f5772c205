#include "coordinator/catalog.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace strata::coordinator {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) return absl::UnavailableError(msg);
  if (s.IsInvalidArgument()) return absl::InvalidArgumentError(msg);
  return absl::InternalError(msg);
}

template <typename Record>
absl::StatusOr<Record> Parse(const std::string& bytes, absl::string_view key) {
  Record r;
  if (!r.ParseFromString(bytes)) return absl::DataLossError(absl::StrCat("unreadable record '", key, "'"));
  if (r.schema_version() != kCatalogSchemaVersion) {
    return absl::DataLossError(absl::StrCat("record '", key, "' has schema version ", r.schema_version(),
                                            "; this build reads ", kCatalogSchemaVersion));
  }
  return r;
}

template <typename Record>
absl::StatusOr<Record> GetRecord(rocksdb::DB* db, rocksdb::ColumnFamilyHandle* cf, const std::string& key,
                                 absl::string_view kind) {
  std::string bytes;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), cf, key, &bytes);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat(kind, " '", key, "' not found"));
  if (!s.ok()) return FromRocks(s, absl::StrCat("read ", kind, " '", key, "'"));
  return Parse<Record>(bytes, key);
}

template <typename Record>
absl::StatusOr<std::vector<Record>> ListRecords(rocksdb::DB* db, rocksdb::ColumnFamilyHandle* cf,
                                                const std::string& start_after, size_t limit) {
  std::vector<Record> out;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), cf));
  it->Seek(start_after);
  for (; it->Valid() && out.size() < limit; it->Next()) {
    if (it->key().ToString() <= start_after && !start_after.empty()) continue;
    auto r = Parse<Record>(it->value().ToString(), it->key().ToString());
    if (!r.ok()) return r.status();
    out.push_back(*std::move(r));
  }
  if (!it->status().ok()) return FromRocks(it->status(), "list");
  return out;
}

}  // namespace

absl::Status CatalogOptions::Validate() const {
  if (path.empty()) return absl::InvalidArgumentError("catalog path is empty");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Catalog>> Catalog::Open(const CatalogOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_open_files = 256;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const char* name : {rocksdb::kDefaultColumnFamilyName.c_str(), "documents", "tokens", "jobs", "shards"}) {
    cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
  }
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.path, cfs, &handles, &db);
  if (!s.ok()) return FromRocks(s, absl::StrCat("open catalog at ", options.path));
  std::unique_ptr<Catalog> catalog(new Catalog());
  catalog->db_ = db;
  catalog->default_cf_ = handles[0];
  catalog->documents_cf_ = handles[1];
  catalog->tokens_cf_ = handles[2];
  catalog->jobs_cf_ = handles[3];
  catalog->shards_cf_ = handles[4];
  catalog->sync_writes_ = options.sync_writes;
  return catalog;
}

Catalog::~Catalog() {
  if (db_ == nullptr) return;
  for (rocksdb::ColumnFamilyHandle* h : {default_cf_, documents_cf_, tokens_cf_, jobs_cf_, shards_cf_}) {
    // Destroying a handle only fails for the default family's handle held by the DB itself.
    db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  }
  db_->Close().PermitUncheckedError();  // nothing to do about a failed close at shutdown
  delete db_;
}

namespace {

rocksdb::WriteOptions Write(bool sync) {
  rocksdb::WriteOptions w;
  w.sync = sync;
  return w;
}

// Checks the stored generation of `key` against `expected` (0: must not exist).
absl::Status CheckGeneration(rocksdb::DB* db, rocksdb::ColumnFamilyHandle* cf, const std::string& key,
                             uint64_t expected, absl::string_view kind, bool create) {
  std::string bytes;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), cf, key, &bytes);
  if (s.IsNotFound()) {
    if (expected == 0) return absl::OkStatus();
    return absl::NotFoundError(absl::StrCat(kind, " '", key, "' not found"));
  }
  if (!s.ok()) return FromRocks(s, absl::StrCat("read ", kind, " '", key, "'"));
  if (create) return absl::AlreadyExistsError(absl::StrCat(kind, " '", key, "' already exists"));
  v1::CatalogRecordHeader header;
  if (!header.ParseFromString(bytes)) return absl::DataLossError(absl::StrCat("unreadable ", kind, " '", key, "'"));
  if (header.generation() != expected) {
    return absl::AbortedError(absl::StrCat(kind, " '", key, "' changed (generation ", header.generation(),
                                           ", expected ", expected, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Catalog::CreateDocument(v1::DocumentRecord* record, absl::Span<const int32_t> tokens) {
  const std::string& id = record->info().document_id();
  absl::MutexLock lock(&write_mu_);
  if (absl::Status s = CheckGeneration(db_, documents_cf_, id, 0, "document", true); !s.ok()) return s;
  record->set_schema_version(kCatalogSchemaVersion);
  record->set_generation(1);
  std::string token_bytes(tokens.size() * sizeof(int32_t), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint32_t v = static_cast<uint32_t>(tokens[i]);
    for (int b = 0; b < 4; ++b) token_bytes[i * 4 + b] = static_cast<char>((v >> (8 * b)) & 0xff);
  }
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Put(documents_cf_, id, record->SerializeAsString());
  if (s.ok()) s = batch.Put(tokens_cf_, id, token_bytes);
  if (s.ok()) s = db_->Write(Write(sync_writes_), &batch);
  return FromRocks(s, absl::StrCat("create document '", id, "'"));
}

absl::Status Catalog::UpdateDocument(v1::DocumentRecord* record) {
  const std::string& id = record->info().document_id();
  absl::MutexLock lock(&write_mu_);
  if (absl::Status s = CheckGeneration(db_, documents_cf_, id, record->generation(), "document", false);
      !s.ok()) {
    return s;
  }
  if (record->generation() == 0) return absl::NotFoundError(absl::StrCat("document '", id, "' not found"));
  record->set_schema_version(kCatalogSchemaVersion);
  record->set_generation(record->generation() + 1);
  return FromRocks(db_->Put(Write(sync_writes_), documents_cf_, id, record->SerializeAsString()),
                   absl::StrCat("update document '", id, "'"));
}

absl::StatusOr<v1::DocumentRecord> Catalog::GetDocument(const std::string& id) const {
  return GetRecord<v1::DocumentRecord>(db_, documents_cf_, id, "document");
}

absl::StatusOr<std::vector<int32_t>> Catalog::GetDocumentTokens(const std::string& id) const {
  std::string bytes;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), tokens_cf_, id, &bytes);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("tokens of document '", id, "' not found"));
  if (!s.ok()) return FromRocks(s, "read tokens");
  if (bytes.size() % 4 != 0) return absl::DataLossError(absl::StrCat("tokens of '", id, "' are truncated"));
  std::vector<int32_t> tokens(bytes.size() / 4);
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint32_t v = 0;
    for (int b = 0; b < 4; ++b) v |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i * 4 + b])) << (8 * b);
    tokens[i] = static_cast<int32_t>(v);
  }
  return tokens;
}

absl::StatusOr<std::vector<v1::DocumentRecord>> Catalog::ListDocuments(const std::string& start_after,
                                                                       size_t limit) const {
  return ListRecords<v1::DocumentRecord>(db_, documents_cf_, start_after, limit);
}

absl::Status Catalog::DeleteDocument(const std::string& id) {
  absl::MutexLock lock(&write_mu_);
  std::string bytes;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), documents_cf_, id, &bytes);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("document '", id, "' not found"));
  if (!s.ok()) return FromRocks(s, "read document");
  rocksdb::WriteBatch batch;
  s = batch.Delete(documents_cf_, id);
  if (s.ok()) s = batch.Delete(tokens_cf_, id);
  if (s.ok()) s = batch.Delete(shards_cf_, id);
  if (s.ok()) s = db_->Write(Write(sync_writes_), &batch);
  return FromRocks(s, absl::StrCat("delete document '", id, "'"));
}

absl::Status Catalog::CreateJob(v1::JobRecord* record) {
  const std::string& id = record->info().job_id();
  const std::string& request_id = record->info().request_id();
  absl::MutexLock lock(&write_mu_);
  if (absl::Status s = CheckGeneration(db_, jobs_cf_, id, 0, "job", true); !s.ok()) return s;
  const std::string request_key = absl::StrCat("request/", request_id);
  if (!request_id.empty()) {
    std::string holder;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), default_cf_, request_key, &holder);
    if (s.ok()) {
      return absl::AlreadyExistsError(absl::StrCat("request_id '", request_id, "' belongs to job ", holder));
    }
    if (!s.IsNotFound()) return FromRocks(s, "read request id");
  }
  record->set_schema_version(kCatalogSchemaVersion);
  record->set_generation(1);
  rocksdb::WriteBatch batch;
  rocksdb::Status s = batch.Put(jobs_cf_, id, record->SerializeAsString());
  if (s.ok() && !request_id.empty()) s = batch.Put(default_cf_, request_key, id);
  if (s.ok()) s = db_->Write(Write(sync_writes_), &batch);
  return FromRocks(s, absl::StrCat("create job '", id, "'"));
}

absl::StatusOr<std::string> Catalog::FindJobByRequestId(const std::string& request_id) const {
  std::string job_id;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), default_cf_, absl::StrCat("request/", request_id), &job_id);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("no job with request_id '", request_id, "'"));
  if (!s.ok()) return FromRocks(s, "read request id");
  return job_id;
}

absl::Status Catalog::UpdateJob(v1::JobRecord* record) {
  const std::string& id = record->info().job_id();
  absl::MutexLock lock(&write_mu_);
  if (record->generation() == 0) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  if (absl::Status s = CheckGeneration(db_, jobs_cf_, id, record->generation(), "job", false); !s.ok()) {
    return s;
  }
  record->set_schema_version(kCatalogSchemaVersion);
  record->set_generation(record->generation() + 1);
  return FromRocks(db_->Put(Write(sync_writes_), jobs_cf_, id, record->SerializeAsString()),
                   absl::StrCat("update job '", id, "'"));
}

absl::StatusOr<v1::JobRecord> Catalog::GetJob(const std::string& id) const {
  return GetRecord<v1::JobRecord>(db_, jobs_cf_, id, "job");
}

absl::StatusOr<std::vector<v1::JobRecord>> Catalog::ListJobs(const std::string& start_after, size_t limit) const {
  return ListRecords<v1::JobRecord>(db_, jobs_cf_, start_after, limit);
}

absl::Status Catalog::PutShardMap(v1::ShardMapRecord* record) {
  const std::string& id = record->map().document_id();
  absl::MutexLock lock(&write_mu_);
  if (absl::Status s = CheckGeneration(db_, shards_cf_, id, record->generation(), "shard map",
                                       /*create=*/record->generation() == 0);
      !s.ok()) {
    return s;
  }
  record->set_schema_version(kCatalogSchemaVersion);
  record->set_generation(record->generation() + 1);
  return FromRocks(db_->Put(Write(sync_writes_), shards_cf_, id, record->SerializeAsString()),
                   absl::StrCat("put shard map '", id, "'"));
}

absl::StatusOr<v1::ShardMapRecord> Catalog::GetShardMap(const std::string& document_id) const {
  return GetRecord<v1::ShardMapRecord>(db_, shards_cf_, document_id, "shard map");
}

absl::StatusOr<uint64_t> Catalog::NextSequence(const std::string& counter) {
  absl::MutexLock lock(&write_mu_);
  const std::string key = absl::StrCat("seq/", counter);
  std::string bytes;
  uint64_t value = 0;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), default_cf_, key, &bytes);
  if (s.ok()) {
    if (bytes.size() != 8) return absl::DataLossError(absl::StrCat("counter '", counter, "' is malformed"));
    std::memcpy(&value, bytes.data(), 8);
  } else if (!s.IsNotFound()) {
    return FromRocks(s, "read counter");
  }
  ++value;
  bytes.assign(reinterpret_cast<const char*>(&value), 8);
  if (absl::Status st = FromRocks(db_->Put(Write(sync_writes_), default_cf_, key, bytes), "write counter");
      !st.ok()) {
    return st;
  }
  return value;
}

}  // namespace strata::coordinator
