#include "kvstore/local_store.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "kvstore/internal/keys.h"
#include "kvstore/internal/rocksdb_status.h"
#include "kvstore/internal/write_tally.h"
#include "kvstore/page_format.h"
#include "rocksdb/cache.h"
#include "rocksdb/db.h"
#include "rocksdb/filter_policy.h"
#include "rocksdb/options.h"
#include "rocksdb/sst_file_writer.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"

namespace strata::kvstore {
namespace {

using internal::FromRocksDb;

constexpr uint32_t kDefaultListLimit = 1000;

rocksdb::Slice ToSlice(absl::string_view s) { return rocksdb::Slice(s.data(), s.size()); }

// Tokens held by page `index` of a document of `num_tokens` tokens.
int ExpectedTokens(const v1::Document& doc, uint32_t index) {
  const uint64_t p = doc.layout().page_size();
  const uint64_t begin = static_cast<uint64_t>(index) * p;
  return static_cast<int>(std::min<uint64_t>(p, doc.num_tokens() - begin));
}

// Checks one page write against its document (state checked by the caller).
absl::Status CheckPage(const v1::Document& doc, const KvLayout& layout, const PageWrite& w) {
  const PageKey& k = w.key;
  if (k.layer >= doc.layout().num_layers() || k.kv_head >= doc.layout().num_kv_heads() ||
      k.page_index >= doc.num_pages()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page (layer ", k.layer, ", kv_head ", k.kv_head, ", page ", k.page_index,
        ") outside document ", doc.document_id(), " (", doc.layout().num_layers(), " layers, ",
        doc.layout().num_kv_heads(), " kv heads, ", doc.num_pages(), " pages)"));
  }
  if (w.data == nullptr) return absl::InvalidArgumentError("null page data");
  absl::StatusOr<PageHeader> h = VerifyPage(w.data->view());
  if (!h.ok()) {
    return Annotate(h.status(), absl::StrCat("page (", k.layer, ", ", k.kv_head, ", ",
                                             k.page_index, ")"));
  }
  if (!(h->shape == layout.page)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page (", k.layer, ", ", k.kv_head, ", ", k.page_index, ") has shape ",
        kernels::DTypeName(h->shape.dtype), " P=", h->shape.page_size, " d=", h->shape.head_dim,
        ", document layout is ", kernels::DTypeName(layout.page.dtype),
        " P=", layout.page.page_size, " d=", layout.page.head_dim));
  }
  const int expected = ExpectedTokens(doc, k.page_index);
  if (h->num_tokens != expected) {
    return absl::InvalidArgumentError(absl::StrCat("page ", k.page_index, " holds ", h->num_tokens,
                                                   " tokens, expected ", expected));
  }
  return absl::OkStatus();
}

absl::Status CheckSummary(const v1::Document& doc, const SummaryWrite& w) {
  const SummaryKey& k = w.key;
  if (k.layer >= doc.layout().num_layers() || k.kv_head >= doc.layout().num_kv_heads()) {
    return absl::InvalidArgumentError(absl::StrCat("summary (layer ", k.layer, ", kv_head ",
                                                   k.kv_head, ") outside document"));
  }
  if (w.data == nullptr) return absl::InvalidArgumentError("null summary data");
  for (const v1::SummarySpec& spec : doc.summaries()) {
    if (spec.kind() != k.kind) continue;
    if (k.index >= spec.count()) {
      return absl::InvalidArgumentError(absl::StrCat("summary kind ", k.kind, " index ", k.index,
                                                     " >= declared count ", spec.count()));
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("summary kind ", k.kind, " not declared by document ", doc.document_id()));
}

uint64_t ExpectedSummaries(const v1::Document& doc) {
  uint64_t per_head = 0;
  for (const v1::SummarySpec& s : doc.summaries()) per_head += s.count();
  return per_head * doc.layout().num_layers() * doc.layout().num_kv_heads();
}

uint64_t ExpectedPages(const v1::Document& doc) {
  return doc.num_pages() * doc.layout().num_layers() * doc.layout().num_kv_heads();
}

}  // namespace

absl::Status LocalStoreOptions::Validate() const {
  if (path.empty()) return absl::InvalidArgumentError("local store: path is required");
  if (write_buffer_bytes < (1 << 20)) {
    return absl::InvalidArgumentError("local store: write_buffer_bytes must be >= 1 MiB");
  }
  if (block_cache_bytes < 0) return absl::InvalidArgumentError("local store: block_cache_bytes < 0");
  if (tier.empty()) return absl::InvalidArgumentError("local store: empty tier label");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LocalStore>> LocalStore::Open(const LocalStoreOptions& options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<LocalStore> store(new LocalStore(options));
  if (absl::Status s = store->OpenDb(); !s.ok()) return s;
  return store;
}

LocalStore::LocalStore(const LocalStoreOptions& options) : options_(options) {
  KvMetrics* metrics = options_.metrics;
  if (metrics == nullptr) {
    own_registry_ = std::make_unique<prometheus::Registry>();
    own_metrics_ = std::make_unique<KvMetrics>(own_registry_.get());
    metrics = own_metrics_.get();
  }
  m_ = metrics->ForTier(options_.tier);
  bytes_read_ = metrics->FetchBytes(options_.tier, "host");
}

LocalStore::~LocalStore() {
  if (db_ != nullptr) {
    for (rocksdb::ColumnFamilyHandle* h : handles_) db_->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    db_->Close().PermitUncheckedError();  // best effort; the WAL is synced anyway
  }
}

absl::Status LocalStore::OpenDb() {
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.max_background_jobs = 4;
  db_options.bytes_per_sync = 1 << 20;
  // PutDeferred's batches have no WAL: flushing every column family together keeps a batch's
  // pages and index entries in or out of the files together.
  db_options.atomic_flush = true;

  std::shared_ptr<rocksdb::Cache> cache =
      rocksdb::NewLRUCache(static_cast<size_t>(options_.block_cache_bytes));
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = cache;
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  table.whole_key_filtering = true;
  table.cache_index_and_filter_blocks = true;
  table.pin_l0_filter_and_index_blocks_in_cache = true;
  // XXH3 block checksums: RocksDB's crc32c is a table-driven loop in builds without SSE4.2 code
  // (Debian's portable package), where it took a fifth of a page load's CPU.
  table.checksum = rocksdb::kXXH3;

  rocksdb::ColumnFamilyOptions small;  // documents, index: small values
  small.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  small.compression = rocksdb::kLZ4Compression;
  small.write_buffer_size = 16 << 20;

  rocksdb::ColumnFamilyOptions large = small;  // pages, summaries: large incompressible values
  large.write_buffer_size = static_cast<size_t>(options_.write_buffer_bytes);
  large.max_write_buffer_number = 4;
  large.compression = options_.compression ? rocksdb::kLZ4Compression : rocksdb::kNoCompression;
  if (options_.blob_files) {
    large.enable_blob_files = true;
    large.min_blob_size = 4096;
    large.blob_file_size = 256 << 20;
    large.blob_compression_type = large.compression;
    large.enable_blob_garbage_collection = true;
    large.blob_cache = cache;  // blobs share the block cache budget
  }

  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, small},
      {"pages", large},
      {"summaries", large},
      {"documents", small},
      {"index", small}};
  large_options_ = std::make_unique<rocksdb::Options>(db_options, large);
  small_options_ = std::make_unique<rocksdb::Options>(db_options, small);
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options_.path, cfs, &handles_, &db);
  if (!s.ok()) return FromRocksDb(s, absl::StrCat("open ", options_.path));
  db_.reset(db);
  // Files a PutDeferred was building when the process stopped were never ingested: gone.
  ingest_dir_ = options_.path + "/ingest";
  std::error_code ec;
  std::filesystem::remove_all(ingest_dir_, ec);
  std::filesystem::create_directories(ingest_dir_, ec);
  if (ec) return absl::InternalError(absl::StrCat("local store: cannot make ", ingest_dir_, ": ", ec.message()));
  pages_ = handles_[1];
  summaries_ = handles_[2];
  documents_ = handles_[3];
  index_ = handles_[4];
  m_.capacity_bytes->Set(0);
  return CheckFormat();
}

namespace {
constexpr char kFormatKey[] = "strata.store_format";
constexpr char kFormat[] = "3";
}  // namespace

// The key encodings' version (kvstore/internal/keys.h), in the default column family. A store
// without it is new (it gets the current one) or of format 1 (it has documents; its page keys
// would not be found): refused.
absl::Status LocalStore::CheckFormat() {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), handles_[0], kFormatKey, &value);
  if (s.ok()) {
    if (value == kFormat) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("local store ", options_.path, " has store format ", value,
                                                      "; this build reads format ", kFormat,
                                                      ": prefill its documents into a new data directory"));
  }
  if (!s.IsNotFound()) return FromRocksDb(s, "read the store format");
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), documents_));
  it->SeekToFirst();
  if (it->Valid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "local store ", options_.path, " was written by an older Strata (store format 1: page keys ordered by "
        "layer first); this build reads format ", kFormat, ": prefill its documents into a new data directory"));
  }
  if (!it->status().ok()) return FromRocksDb(it->status(), "read the store format");
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return FromRocksDb(db_->Put(wo, handles_[0], kFormatKey, kFormat), "write the store format");
}

std::shared_mutex& LocalStore::StripeFor(const DocumentId& id) {
  return stripes_[id.bytes[0] % kStripes];
}

absl::Status LocalStore::GetPages(absl::Span<const PageKey> keys, std::vector<PageRef>* out) {
  out->assign(keys.size(), nullptr);
  absl::Status copied;
  absl::Status s = VisitPages(keys, [&](size_t i, absl::string_view bytes) {
    if (!copied.ok()) return;
    absl::StatusOr<PageRef> ref = PageBuffer::Copy(bytes);
    if (ref.ok()) {
      (*out)[i] = *std::move(ref);
    } else {
      copied = ref.status();
    }
  });
  if (s.ok()) s = copied;
  if (!s.ok()) out->assign(keys.size(), nullptr);
  return s;
}

absl::Status LocalStore::VisitPages(absl::Span<const PageKey> keys,
                                    const std::function<void(size_t, absl::string_view)>& emit) {
  Stopwatch watch;
  if (keys.empty()) return absl::OkStatus();
  std::vector<std::string> key_bytes;
  key_bytes.reserve(keys.size());
  for (const PageKey& k : keys) key_bytes.push_back(internal::PageKeyBytes(k));
  std::vector<rocksdb::Slice> slices(key_bytes.begin(), key_bytes.end());
  std::vector<rocksdb::PinnableSlice> values(keys.size());
  std::vector<rocksdb::Status> statuses(keys.size());
  db_->MultiGet(rocksdb::ReadOptions(), pages_, keys.size(), slices.data(), values.data(),
                statuses.data());
  int64_t hits = 0, bytes = 0;
  absl::Status result;
  for (size_t i = 0; i < keys.size() && result.ok(); ++i) {
    if (statuses[i].IsNotFound()) continue;
    if (!statuses[i].ok()) {
      result = FromRocksDb(statuses[i], "get page");
      break;
    }
    absl::string_view v(values[i].data(), values[i].size());
    absl::StatusOr<PageHeader> h = VerifyPage(v);
    if (!h.ok()) {
      result = absl::DataLossError(absl::StrCat(
          "stored page (document ", keys[i].document.ToHex(), ", layer ", keys[i].layer,
          ", kv_head ", keys[i].kv_head, ", page ", keys[i].page_index,
          ") is corrupt: ", h.status().message()));
      break;
    }
    emit(i, v);
    ++hits;
    bytes += static_cast<int64_t>(v.size());
  }
  m_.lookups->Increment(static_cast<double>(keys.size()));
  m_.hits->Increment(static_cast<double>(hits));
  bytes_read_->Increment(static_cast<double>(bytes));
  m_.fetch_duration->Observe(watch.ElapsedSeconds());
  return result;
}

absl::Status LocalStore::GetSummaries(absl::Span<const SummaryKey> keys,
                                      std::vector<PageRef>* out) {
  out->assign(keys.size(), nullptr);
  if (keys.empty()) return absl::OkStatus();
  std::vector<std::string> key_bytes;
  key_bytes.reserve(keys.size());
  for (const SummaryKey& k : keys) key_bytes.push_back(internal::SummaryKeyBytes(k));
  std::vector<rocksdb::Slice> slices(key_bytes.begin(), key_bytes.end());
  std::vector<rocksdb::PinnableSlice> values(keys.size());
  std::vector<rocksdb::Status> statuses(keys.size());
  db_->MultiGet(rocksdb::ReadOptions(), summaries_, keys.size(), slices.data(), values.data(),
                statuses.data());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (statuses[i].IsNotFound()) continue;
    if (!statuses[i].ok()) {
      out->assign(keys.size(), nullptr);
      return FromRocksDb(statuses[i], "get summary");
    }
    absl::StatusOr<absl::string_view> payload =
        DecodeSummary(absl::string_view(values[i].data(), values[i].size()));
    absl::StatusOr<PageRef> ref =
        payload.ok() ? PageBuffer::Copy(*payload) : absl::StatusOr<PageRef>(payload.status());
    if (!ref.ok()) {
      out->assign(keys.size(), nullptr);
      return ref.status();
    }
    (*out)[i] = *std::move(ref);
  }
  return absl::OkStatus();
}

absl::Status LocalStore::Put(absl::Span<const PageWrite> pages,
                             absl::Span<const SummaryWrite> summaries) {
  return Write(pages, summaries, /*deferred=*/false);
}

absl::Status LocalStore::PutDeferred(absl::Span<const PageWrite> pages,
                                     absl::Span<const SummaryWrite> summaries) {
  return Write(pages, summaries, /*deferred=*/true);
}

absl::Status LocalStore::Write(absl::Span<const PageWrite> pages,
                               absl::Span<const SummaryWrite> summaries, bool deferred) {
  if (pages.empty() && summaries.empty()) return absl::OkStatus();
  // Lock the stripes of every document in the batch, shared, in stripe order (no deadlock with
  // the exclusive single-stripe holders).
  std::set<int> stripe_ids;
  std::set<DocumentId> docs;
  for (const PageWrite& w : pages) docs.insert(w.key.document);
  for (const SummaryWrite& w : summaries) docs.insert(w.key.document);
  for (const DocumentId& d : docs) stripe_ids.insert(d.bytes[0] % kStripes);
  std::vector<std::shared_mutex*> held;
  for (int i : stripe_ids) {
    stripes_[i].lock_shared();
    held.push_back(&stripes_[i]);
  }
  auto unlock = [&held] {
    for (auto it = held.rbegin(); it != held.rend(); ++it) (*it)->unlock_shared();
  };

  absl::flat_hash_map<std::string, std::pair<v1::Document, KvLayout>> meta;
  for (const DocumentId& d : docs) {
    absl::StatusOr<v1::Document> doc = GetDocumentMetadata(d);
    if (!doc.ok()) {
      unlock();
      return doc.status();
    }
    if (doc->state() != v1::DOCUMENT_STATE_WRITING) {
      unlock();
      return absl::FailedPreconditionError(
          absl::StrCat("document ", d.ToHex(), " is READY; its pages cannot change"));
    }
    absl::StatusOr<KvLayout> layout = LayoutFromProto(doc->layout());
    if (!layout.ok()) {
      unlock();
      return absl::DataLossError(absl::StrCat("stored document ", d.ToHex(),
                                              " has an invalid layout: ", layout.status().message()));
    }
    meta.emplace(std::string(d.AsBytes()), std::make_pair(*std::move(doc), *layout));
  }

  for (const PageWrite& w : pages) {
    const auto& [doc, layout] = meta.at(std::string(w.key.document.AsBytes()));
    if (absl::Status s = CheckPage(doc, layout, w); !s.ok()) {
      unlock();
      return s;
    }
  }
  for (const SummaryWrite& w : summaries) {
    const auto& entry = meta.at(std::string(w.key.document.AsBytes()));
    if (absl::Status s = CheckSummary(entry.first, w); !s.ok()) {
      unlock();
      return s;
    }
  }
  // Counts the batch's entries in their documents' tallies once it is stored (before the stripes
  // are released, so a FinalizeDocument that follows sees them).
  auto tally = [&] {
    absl::flat_hash_map<std::string, std::shared_ptr<internal::WriteTally>> tallies;
    auto of = [&](const DocumentId& d) -> internal::WriteTally* {
      auto [it, inserted] = tallies.try_emplace(std::string(d.AsBytes()));
      if (inserted) it->second = TallyFor(d);
      return it->second.get();
    };
    for (const PageWrite& w : pages) {
      if (internal::WriteTally* t = of(w.key.document)) t->AddPage(w.key);
    }
    for (const SummaryWrite& w : summaries) {
      if (internal::WriteTally* t = of(w.key.document)) t->AddSummary(w.key);
    }
  };
  if (deferred && options_.ingest_deferred) {
    absl::Status s = Ingest(pages, summaries);
    if (s.ok()) tally();
    unlock();
    return s;
  }
  rocksdb::WriteBatch batch;
  for (const PageWrite& w : pages) {
    batch.Put(pages_, internal::PageKeyBytes(w.key), ToSlice(w.data->view()));
    batch.Put(index_, internal::PageIndexKey(w.key), rocksdb::Slice());
  }
  for (const SummaryWrite& w : summaries) {
    batch.Put(summaries_, internal::SummaryKeyBytes(w.key), EncodeSummary(w.data->view()));
    batch.Put(index_, internal::SummaryIndexKey(w.key), rocksdb::Slice());
  }
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes && !deferred;
  wo.disableWAL = deferred;
  if (deferred) deferred_writes_.fetch_add(1);  // before the write: a Finalize after it flushes
  rocksdb::Status s = db_->Write(wo, &batch);
  if (s.ok()) tally();
  unlock();
  return FromRocksDb(s, "write pages");
}

absl::Status LocalStore::Ingest(absl::Span<const PageWrite> pages, absl::Span<const SummaryWrite> summaries) {
  struct Entry {
    std::string key;
    rocksdb::Slice value;
  };
  // Index entries as two files, the pages' and the summaries': each covers the batch's page range
  // of its kind of entry, so neither overlaps another batch's.
  std::vector<Entry> page_entries, summary_entries, page_index_entries, summary_index_entries;
  std::vector<std::string> summary_values;
  summary_values.reserve(summaries.size());  // no reallocation: the entries point into it
  page_entries.reserve(pages.size());
  summary_entries.reserve(summaries.size());
  page_index_entries.reserve(pages.size());
  summary_index_entries.reserve(summaries.size());
  for (const PageWrite& w : pages) {
    page_entries.push_back({internal::PageKeyBytes(w.key), ToSlice(w.data->view())});
    page_index_entries.push_back({internal::PageIndexKey(w.key), rocksdb::Slice()});
  }
  for (const SummaryWrite& w : summaries) {
    summary_values.push_back(EncodeSummary(w.data->view()));
    summary_entries.push_back({internal::SummaryKeyBytes(w.key), rocksdb::Slice(summary_values.back())});
    summary_index_entries.push_back({internal::SummaryIndexKey(w.key), rocksdb::Slice()});
  }
  const uint64_t n = ingest_files_.fetch_add(1);
  std::vector<std::string> made;
  auto remove_made = [&made] {
    std::error_code ec;  // ingested files were moved (their names here are gone); others are dropped
    for (const std::string& f : made) std::filesystem::remove(f, ec);
  };
  std::vector<rocksdb::IngestExternalFileArg> args;
  // Sorted files, one per column family (two for the index: they do not overlap, 'p' < 's'); of
  // equal keys the batch's last wins, as in a WriteBatch.
  auto build = [&](std::vector<Entry>* entries, rocksdb::ColumnFamilyHandle* cf, const rocksdb::Options& cf_options,
                   const char* name) -> absl::Status {
    if (entries->empty()) return absl::OkStatus();
    std::stable_sort(entries->begin(), entries->end(), [](const Entry& a, const Entry& b) { return a.key < b.key; });
    const std::string path = absl::StrCat(ingest_dir_, "/", n, "-", name, ".sst");
    rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), cf_options, cf, /*invalidate_page_cache=*/false);
    STRATA_RETURN_IF_ERROR(FromRocksDb(writer.Open(path), "ingest: open a file"));
    made.push_back(path);
    for (size_t i = 0; i < entries->size(); ++i) {
      if (i + 1 < entries->size() && (*entries)[i + 1].key == (*entries)[i].key) continue;
      STRATA_RETURN_IF_ERROR(FromRocksDb(writer.Put((*entries)[i].key, (*entries)[i].value), "ingest: write"));
    }
    STRATA_RETURN_IF_ERROR(FromRocksDb(writer.Finish(), "ingest: finish a file"));
    if (!args.empty() && args.back().column_family == cf) {  // one argument per column family
      args.back().external_files.push_back(path);
      return absl::OkStatus();
    }
    rocksdb::IngestExternalFileArg arg;
    arg.column_family = cf;
    arg.external_files = {path};
    arg.options.move_files = true;
    arg.options.write_global_seqno = false;
    args.push_back(std::move(arg));
    return absl::OkStatus();
  };
  absl::Status s = build(&page_entries, pages_, *large_options_, "pages");
  if (s.ok()) s = build(&summary_entries, summaries_, *large_options_, "summaries");
  if (s.ok()) s = build(&page_index_entries, index_, *small_options_, "page-index");
  if (s.ok()) s = build(&summary_index_entries, index_, *small_options_, "summary-index");
  if (s.ok() && !args.empty()) s = FromRocksDb(db_->IngestExternalFiles(args), "ingest pages");
  remove_made();
  return s;
}

absl::StatusOr<v1::Document> LocalStore::GetDocumentMetadata(const DocumentId& id) {
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), documents_, ToSlice(id.AsBytes()), &value);
  if (s.IsNotFound()) return absl::NotFoundError(absl::StrCat("unknown document ", id.ToHex()));
  if (!s.ok()) return FromRocksDb(s, "get document");
  v1::Document doc;
  if (!doc.ParseFromString(value)) {
    return absl::DataLossError(absl::StrCat("document ", id.ToHex(), ": unparsable metadata"));
  }
  return doc;
}

absl::Status LocalStore::WriteDocument(const v1::Document& doc) {
  absl::StatusOr<DocumentId> id = DocumentId::FromHex(doc.document_id());
  if (!id.ok()) return id.status();
  v1::Document stored = doc;
  stored.clear_stored_pages();
  stored.clear_stored_summaries();
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  return FromRocksDb(
      db_->Put(wo, documents_, ToSlice(id->AsBytes()), stored.SerializeAsString()),
      "write document");
}

absl::StatusOr<uint64_t> LocalStore::CountIndex(const DocumentId& doc, char type) {
  const std::string prefix = internal::IndexPrefix(doc, type);
  std::string upper = prefix;
  upper.back() = static_cast<char>(type + 1);
  rocksdb::Slice upper_slice(upper);
  rocksdb::ReadOptions ro;
  ro.iterate_upper_bound = &upper_slice;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro, index_));
  uint64_t n = 0;
  for (it->Seek(prefix); it->Valid(); it->Next()) ++n;
  if (!it->status().ok()) return FromRocksDb(it->status(), "count index");
  return n;
}

absl::Status LocalStore::FillCounts(v1::Document* doc) {
  absl::StatusOr<DocumentId> id = DocumentId::FromHex(doc->document_id());
  if (!id.ok()) return id.status();
  // The tally of this instance's acknowledged writes, when it created the document, stands for
  // the count (every index entry the document has went through it); otherwise count the index.
  if (doc->state() == v1::DOCUMENT_STATE_WRITING) {
    if (const std::shared_ptr<internal::WriteTally> tally = TallyFor(*id)) {
      doc->set_stored_pages(tally->pages());
      doc->set_stored_summaries(tally->summaries());
      return absl::OkStatus();
    }
  }
  absl::StatusOr<uint64_t> pages = CountIndex(*id, 'p');
  if (!pages.ok()) return pages.status();
  absl::StatusOr<uint64_t> summaries = CountIndex(*id, 's');
  if (!summaries.ok()) return summaries.status();
  doc->set_stored_pages(*pages);
  doc->set_stored_summaries(*summaries);
  return absl::OkStatus();
}

absl::StatusOr<v1::Document> LocalStore::CreateDocument(const v1::CreateDocumentRequest& request,
                                                        bool* created) {
  *created = false;
  absl::StatusOr<DocumentId> id = DocumentId::FromHex(request.document_id());
  if (!id.ok()) return id.status();
  if (request.model_fingerprint().empty()) {
    return absl::InvalidArgumentError("create document: empty model_fingerprint");
  }
  absl::StatusOr<KvLayout> layout = LayoutFromProto(request.layout());
  if (!layout.ok()) return layout.status();
  if (request.num_tokens() == 0) return absl::InvalidArgumentError("create document: no tokens");
  const uint64_t num_pages =
      (request.num_tokens() + layout->page.page_size - 1) / layout->page.page_size;
  if (num_pages > (uint64_t{1} << 31)) {
    return absl::InvalidArgumentError("create document: too many pages");
  }
  std::set<uint32_t> kinds;
  for (const v1::SummarySpec& s : request.summaries()) {
    if (!kinds.insert(s.kind()).second) {
      return absl::InvalidArgumentError(absl::StrCat("summary kind ", s.kind(), " declared twice"));
    }
    if (s.count() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("summary kind ", s.kind(), " has count 0"));
    }
  }
  STRATA_RETURN_IF_ERROR(ValidateTtlSeconds(request.ttl_seconds()));

  std::unique_lock<std::shared_mutex> lock(StripeFor(*id));
  absl::StatusOr<v1::Document> existing = GetDocumentMetadata(*id);
  if (existing.ok()) {
    if (existing->model_fingerprint() != request.model_fingerprint() ||
        existing->num_tokens() != request.num_tokens() ||
        existing->layout().SerializeAsString() != LayoutToProto(*layout).SerializeAsString()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "document ", id->ToHex(), " exists with a different model, layout or length"));
    }
    return *existing;
  }
  if (existing.status().code() != absl::StatusCode::kNotFound) return existing.status();

  v1::Document doc;
  doc.set_document_id(id->ToHex());
  doc.set_model_fingerprint(request.model_fingerprint());
  *doc.mutable_layout() = LayoutToProto(*layout);
  doc.set_num_tokens(request.num_tokens());
  doc.set_num_pages(num_pages);
  *doc.mutable_summaries() = request.summaries();
  doc.set_state(v1::DOCUMENT_STATE_WRITING);
  const int64_t now = WallMicros();
  doc.set_create_time_micros(now);
  if (request.ttl_seconds() > 0) doc.set_expire_time_micros(now + request.ttl_seconds() * 1000000);
  if (absl::Status s = WriteDocument(doc); !s.ok()) return s;
  *created = true;
  if (std::unique_ptr<internal::WriteTally> t = internal::WriteTally::Make(doc)) {
    std::lock_guard<std::mutex> l(tallies_mu_);
    tallies_[std::string(id->AsBytes())] = std::move(t);
  }
  return doc;
}

absl::StatusOr<v1::Document> LocalStore::FinalizeDocument(const DocumentId& id) {
  std::unique_lock<std::shared_mutex> lock(StripeFor(id));
  absl::StatusOr<v1::Document> doc = GetDocumentMetadata(id);
  if (!doc.ok()) return doc.status();
  if (absl::Status s = FillCounts(&*doc); !s.ok()) return s;
  if (doc->state() == v1::DOCUMENT_STATE_READY) return doc;
  const uint64_t want_pages = ExpectedPages(*doc), want_summaries = ExpectedSummaries(*doc);
  if (doc->stored_pages() != want_pages || doc->stored_summaries() != want_summaries) {
    return absl::FailedPreconditionError(absl::StrCat(
        "document ", id.ToHex(), " is incomplete: ", doc->stored_pages(), "/", want_pages,
        " pages, ", doc->stored_summaries(), "/", want_summaries, " summaries stored"));
  }
  // Deferred batches (no WAL) reach the files before any document is READY.
  if (deferred_writes_.load() > 0) {
    if (absl::Status s = Flush(); !s.ok()) return s;
  }
  doc->set_state(v1::DOCUMENT_STATE_READY);
  if (absl::Status s = WriteDocument(*doc); !s.ok()) return s;
  DropTally(id);  // READY: no more writes
  return doc;
}

std::shared_ptr<internal::WriteTally> LocalStore::TallyFor(const DocumentId& id) {
  std::lock_guard<std::mutex> l(tallies_mu_);
  auto it = tallies_.find(id.AsBytes());
  return it == tallies_.end() ? nullptr : it->second;
}

void LocalStore::DropTally(const DocumentId& id) {
  std::lock_guard<std::mutex> l(tallies_mu_);
  tallies_.erase(id.AsBytes());
}

absl::StatusOr<v1::Document> LocalStore::GetDocumentInfo(const DocumentId& id) { return GetDocumentMetadata(id); }

absl::StatusOr<v1::Document> LocalStore::GetDocument(const DocumentId& id) {
  absl::StatusOr<v1::Document> doc = GetDocumentMetadata(id);
  if (!doc.ok()) return doc.status();
  if (absl::Status s = FillCounts(&*doc); !s.ok()) return s;
  return doc;
}

absl::StatusOr<std::vector<v1::Document>> LocalStore::ListDocuments(
    const v1::ListDocumentsRequest& request) {
  const uint32_t limit = request.limit() == 0 ? kDefaultListLimit
                                              : std::min(request.limit(), kDefaultListLimit);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), documents_));
  std::string start;
  if (!request.start_after().empty()) {
    absl::StatusOr<DocumentId> after = DocumentId::FromHex(request.start_after());
    if (!after.ok()) return after.status();
    start = std::string(after->AsBytes());
    start.push_back('\0');  // strictly after
  }
  std::vector<v1::Document> out;
  for (it->Seek(start); it->Valid() && out.size() < limit; it->Next()) {
    v1::Document doc;
    if (!doc.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
      return absl::DataLossError("list documents: unparsable metadata");
    }
    if (request.state() != v1::DOCUMENT_STATE_UNSPECIFIED && doc.state() != request.state()) {
      continue;
    }
    out.push_back(std::move(doc));
  }
  if (!it->status().ok()) return FromRocksDb(it->status(), "list documents");
  return out;
}

absl::StatusOr<v1::Document> LocalStore::PinDocument(const DocumentId& id, bool pinned,
                                                     int64_t ttl_seconds) {
  STRATA_RETURN_IF_ERROR(ValidateTtlSeconds(ttl_seconds));
  std::unique_lock<std::shared_mutex> lock(StripeFor(id));
  absl::StatusOr<v1::Document> doc = GetDocumentMetadata(id);
  if (!doc.ok()) return doc.status();
  doc->set_pinned(pinned);
  if (ttl_seconds > 0) doc->set_expire_time_micros(WallMicros() + ttl_seconds * 1000000);
  if (absl::Status s = WriteDocument(*doc); !s.ok()) return s;
  return doc;
}

absl::Status LocalStore::DeleteDocument(const DocumentId& id) {
  std::unique_lock<std::shared_mutex> lock(StripeFor(id));
  absl::StatusOr<v1::Document> doc = GetDocumentMetadata(id);
  if (!doc.ok()) return doc.status();
  return DeleteDocumentLocked(id);
}

absl::Status LocalStore::DeleteDocumentLocked(const DocumentId& id) {
  const std::string begin = internal::DocumentRangeBegin(id), end = internal::DocumentRangeEnd(id);
  rocksdb::WriteBatch batch;
  batch.Delete(documents_, ToSlice(id.AsBytes()));
  batch.DeleteRange(pages_, begin, end);
  batch.DeleteRange(summaries_, begin, end);
  batch.DeleteRange(index_, begin, end);
  rocksdb::WriteOptions wo;
  wo.sync = options_.sync_writes;
  // Dropped even when the delete fails: a later finalize then counts what is there.
  DropTally(id);
  return FromRocksDb(db_->Write(wo, &batch), "delete document");
}

absl::Status LocalStore::ScanSummaries(const DocumentId& doc, absl::Span<const uint32_t> kinds,
                                       std::vector<SummaryKey>* keys,
                                       std::vector<PageRef>* values) {
  keys->clear();
  values->clear();
  const std::string begin = internal::DocumentRangeBegin(doc), end = internal::DocumentRangeEnd(doc);
  rocksdb::Slice upper(end);
  rocksdb::ReadOptions ro;
  ro.iterate_upper_bound = &upper;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro, summaries_));
  for (it->Seek(begin); it->Valid(); it->Next()) {
    SummaryKey key;
    if (!internal::ReadSummaryKey(doc, reinterpret_cast<const uint8_t*>(it->key().data()), it->key().size(), &key)) {
      return absl::DataLossError("summary key of unexpected length");
    }
    if (!kinds.empty() && std::find(kinds.begin(), kinds.end(), key.kind) == kinds.end()) continue;
    absl::StatusOr<absl::string_view> payload =
        DecodeSummary(absl::string_view(it->value().data(), it->value().size()));
    if (!payload.ok()) return payload.status();
    absl::StatusOr<PageRef> ref = PageBuffer::Copy(*payload);
    if (!ref.ok()) return ref.status();
    keys->push_back(key);
    values->push_back(*std::move(ref));
  }
  return FromRocksDb(it->status(), "scan summaries");
}

absl::StatusOr<int> LocalStore::CollectGarbage(int64_t now_micros) {
  std::vector<DocumentId> expired;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), documents_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      v1::Document doc;
      if (!doc.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) continue;
      if (doc.pinned() || doc.expire_time_micros() == 0 || doc.expire_time_micros() > now_micros) {
        continue;
      }
      absl::StatusOr<DocumentId> id = DocumentId::FromHex(doc.document_id());
      if (id.ok()) expired.push_back(*id);
    }
    if (!it->status().ok()) return FromRocksDb(it->status(), "garbage collection scan");
  }
  int deleted = 0;
  for (const DocumentId& id : expired) {
    // Re-check under the lock: it may have been pinned, extended or deleted since the scan.
    std::unique_lock<std::shared_mutex> lock(StripeFor(id));
    absl::StatusOr<v1::Document> doc = GetDocumentMetadata(id);
    if (!doc.ok() || doc->pinned() || doc->expire_time_micros() == 0 ||
        doc->expire_time_micros() > now_micros) {
      continue;
    }
    if (absl::Status s = DeleteDocumentLocked(id); !s.ok()) return s;
    ++deleted;
    STRATA_LOG(INFO) << "kvstore gc: deleted expired document document=" << id.ToHex()
                     << " state=" << v1::DocumentState_Name(doc->state());
  }
  return deleted;
}

int64_t LocalStore::UpdateResidentBytes() {
  uint64_t total = 0;
  for (rocksdb::ColumnFamilyHandle* cf : {pages_, summaries_}) {
    for (const char* prop : {"rocksdb.live-sst-files-size", "rocksdb.live-blob-file-size",
                             "rocksdb.cur-size-all-mem-tables"}) {
      uint64_t v = 0;
      if (db_->GetIntProperty(cf, prop, &v)) total += v;
    }
  }
  m_.resident_bytes->Set(static_cast<double>(total));
  return static_cast<int64_t>(total);
}

absl::Status LocalStore::Flush() {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  std::vector<rocksdb::ColumnFamilyHandle*> cfs(handles_.begin(), handles_.end());
  return FromRocksDb(db_->Flush(fo, cfs), "flush");
}

absl::StatusOr<std::string> LocalStore::RawPageForTesting(const PageKey& key) {
  std::string value;
  rocksdb::Status s =
      db_->Get(rocksdb::ReadOptions(), pages_, internal::PageKeyBytes(key), &value);
  if (!s.ok()) return FromRocksDb(s, "raw page");
  return value;
}

int LocalStore::FilesAtLevelForTesting(const std::string& cf, int level) {
  rocksdb::ColumnFamilyHandle* h = cf == "pages"       ? pages_
                                   : cf == "summaries" ? summaries_
                                   : cf == "index"     ? index_
                                   : cf == "documents" ? documents_
                                                       : nullptr;
  std::string value;
  if (h == nullptr ||
      !db_->GetProperty(h, absl::StrCat("rocksdb.num-files-at-level", level), &value)) {
    return -1;
  }
  return std::atoi(value.c_str());
}

absl::Status LocalStore::WriteFormatForTesting(const std::string& value) {
  rocksdb::WriteOptions wo;
  wo.sync = true;
  if (value.empty()) return FromRocksDb(db_->Delete(wo, handles_[0], kFormatKey), "delete the store format");
  return FromRocksDb(db_->Put(wo, handles_[0], kFormatKey, value), "write the store format");
}

absl::Status LocalStore::OverwriteRawPageForTesting(const PageKey& key, const std::string& bytes) {
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return FromRocksDb(db_->Put(wo, pages_, internal::PageKeyBytes(key), bytes), "raw page write");
}

}  // namespace strata::kvstore
