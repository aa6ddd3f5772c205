#include "kvstore/local_store.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kvstore/testing/test_pages.h"

namespace strata::kvstore {
namespace {

using ::strata::testing::StatusIs;
using testing::MakeDocumentRequest;
using testing::MakeDocumentWrites;
using testing::MakePage;
using testing::SmallLayout;

constexpr uint64_t kSeed = 42;

class LocalStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_local_store_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    Open();
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  void Open() {
    store_.reset();
    LocalStoreOptions o;
    o.path = dir_;
    o.write_buffer_bytes = 4 << 20;
    absl::StatusOr<std::unique_ptr<LocalStore>> s = LocalStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  DocumentId Create(const v1::CreateDocumentRequest& r) {
    bool created = false;
    absl::StatusOr<v1::Document> d = store_->CreateDocument(r, &created);
    EXPECT_TRUE(d.ok()) << d.status();
    EXPECT_TRUE(created);
    return *DocumentId::FromHex(r.document_id());
  }

  std::string dir_;
  std::unique_ptr<LocalStore> store_;
};

TEST_F(LocalStoreTest, WriteFinalizeReadBackBitExactAcrossReopen) {
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 40, kSeed);  // 3 pages, last 8
  const DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  ASSERT_EQ(pages.size(), 12u);
  // Incomplete: finalize refuses.
  STRATA_ASSERT_OK(store_->Put(absl::MakeSpan(pages).subspan(0, 6), {}));
  EXPECT_THAT(store_->FinalizeDocument(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("6/12 pages")));
  STRATA_ASSERT_OK(store_->Put(absl::MakeSpan(pages).subspan(6), summaries));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->FinalizeDocument(id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(doc.stored_pages(), 12u);
  EXPECT_EQ(doc.stored_summaries(), 12u);

  STRATA_ASSERT_OK(store_->Flush());
  EXPECT_GE(store_->UpdateResidentBytes(), static_cast<int64_t>(pages[0].data->size() * 12));
  Open();  // survives a reopen
  std::vector<PageKey> keys;
  for (const PageWrite& w : pages) keys.push_back(w.key);
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(store_->GetPages(keys, &out));
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_NE(out[i], nullptr);
    EXPECT_EQ(out[i]->view(), pages[i].data->view()) << i;
  }
  std::vector<SummaryKey> skeys;
  for (const SummaryWrite& w : summaries) skeys.push_back(w.key);
  STRATA_ASSERT_OK(store_->GetSummaries(skeys, &out));
  for (size_t i = 0; i < skeys.size(); ++i) {
    ASSERT_NE(out[i], nullptr);
    EXPECT_EQ(out[i]->view(), summaries[i].data->view());
  }
  std::vector<SummaryKey> scanned_keys;
  STRATA_ASSERT_OK(store_->ScanSummaries(id, {}, &scanned_keys, &out));
  EXPECT_EQ(scanned_keys.size(), 12u);
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document again, store_->GetDocument(id));
  EXPECT_EQ(again.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_GT(again.stored_pages(), 0u);
  // The metadata alone: the same document without the counts (no index scan).
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document info, store_->GetDocumentInfo(id));
  EXPECT_EQ(info.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(info.num_tokens(), again.num_tokens());
  EXPECT_EQ(info.layout().SerializeAsString(), again.layout().SerializeAsString());
  EXPECT_EQ(info.stored_pages(), 0u);
  EXPECT_EQ(info.stored_summaries(), 0u);
  EXPECT_THAT(store_->GetDocumentInfo(*DocumentId::FromHex("00000000000000000000000000000abc")),
              StatusIs(absl::StatusCode::kNotFound));

  // READY documents are immutable.
  EXPECT_THAT(store_->Put(absl::MakeSpan(pages).subspan(0, 1), {}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store_->PutDeferred(absl::MakeSpan(pages).subspan(0, 1), {}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // Missing pages are misses, not errors.
  const std::vector<PageKey> missing = {PageKey{id, 0, 0, 99}};
  STRATA_ASSERT_OK(store_->GetPages(missing, &out));
  EXPECT_EQ(out[0], nullptr);
}

TEST_F(LocalStoreTest, IngestedDeferredBatchesReadBackAndTheLastWriteOfAKeyWins) {
  // PutDeferred ingests each batch as SST files (LocalStoreOptions::ingest_deferred, the default):
  // readable and counted as soon as it returns, with no flush; of two writes of one key the later
  // wins, within a batch, over a memtable write and over an earlier ingested file.
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 40, kSeed);  // 3 pages, last 8
  const DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  auto other = [&](const PageKey& k, uint64_t seed) {
    return PageWrite{k, *PageBuffer::Copy(MakePage(layout, 40, k.layer, k.kv_head, k.page_index, seed))};
  };
  const PageKey first = pages[0].key;
  STRATA_ASSERT_OK(store_->Put({other(first, 1)}, {}));  // through the WAL and the memtable
  // The first batch: every page, page 0's key twice (its own bytes last); the second: the
  // summaries and page 1 again with other bytes, then its own.
  std::vector<PageWrite> batch = {other(first, 2)};
  batch.insert(batch.end(), pages.begin(), pages.end());
  STRATA_ASSERT_OK(store_->PutDeferred(batch, {}));
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(store_->GetPages({first}, &out));
  ASSERT_NE(out[0], nullptr);
  EXPECT_EQ(out[0]->view(), pages[0].data->view());
  STRATA_ASSERT_OK(store_->PutDeferred({other(pages[1].key, 3)}, summaries));
  STRATA_ASSERT_OK(store_->GetPages({pages[1].key}, &out));
  EXPECT_NE(out[0]->view(), pages[1].data->view());
  STRATA_ASSERT_OK(store_->PutDeferred({pages[1]}, {}));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->GetDocument(id));
  EXPECT_EQ(doc.stored_pages(), pages.size());
  EXPECT_EQ(doc.stored_summaries(), summaries.size());
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document ready, store_->FinalizeDocument(id));
  EXPECT_EQ(ready.state(), v1::DOCUMENT_STATE_READY);
  // Nothing of the ingestion stays beside the database; a file left there by an interrupted
  // batch is removed at open.
  EXPECT_TRUE(std::filesystem::is_empty(dir_ + "/ingest"));
  { std::ofstream(dir_ + "/ingest/7-pages.sst") << "partial"; }
  Open();
  ASSERT_NE(store_, nullptr);
  EXPECT_TRUE(std::filesystem::is_empty(dir_ + "/ingest"));
  std::vector<PageKey> keys;
  for (const PageWrite& w : pages) keys.push_back(w.key);
  STRATA_ASSERT_OK(store_->GetPages(keys, &out));
  for (size_t i = 0; i < pages.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << i;
    EXPECT_EQ(out[i]->view(), pages[i].data->view()) << i;
  }
  // Deleting the document removes the ingested pages too (range deletes).
  STRATA_ASSERT_OK(store_->DeleteDocument(id));
  STRATA_ASSERT_OK(store_->GetPages(keys, &out));
  for (const PageRef& p : out) EXPECT_EQ(p, nullptr);

  // One batch over two documents (their index entries in one file): both complete.
  const v1::CreateDocumentRequest r1 = MakeDocumentRequest(layout, 40, kSeed + 1);
  const v1::CreateDocumentRequest r2 = MakeDocumentRequest(layout, 20, kSeed + 2);
  const DocumentId id1 = Create(r1), id2 = Create(r2);
  std::vector<PageWrite> p1, p2;
  std::vector<SummaryWrite> s1, s2;
  MakeDocumentWrites(r1, kSeed + 1, &p1, &s1);
  MakeDocumentWrites(r2, kSeed + 2, &p2, &s2);
  p1.insert(p1.end(), p2.begin(), p2.end());
  s1.insert(s1.end(), s2.begin(), s2.end());
  STRATA_ASSERT_OK(store_->PutDeferred(p1, s1));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document d1, store_->FinalizeDocument(id1));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document d2, store_->FinalizeDocument(id2));
  EXPECT_EQ(d1.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(d2.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(d1.stored_pages() + d2.stored_pages(), p1.size());
  EXPECT_EQ(d1.stored_summaries() + d2.stored_summaries(), s1.size());
}

TEST_F(LocalStoreTest, IngestedPageRangeBatchesOverlapNoOtherBatchAndLandBelowLevelZero) {
  // A prefill's batches, each one contiguous page range with its page summaries (as the worker
  // writes them), written out of order: with the page-first keys of store format 3 no batch's
  // files overlap another's in any column family, so none stays in level 0 (where overlapping
  // files pile up, are merged by compactions and stall writes).
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 16 * 12, kSeed);  // 12 pages
  const DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  for (uint32_t first : {4u, 0u, 8u}) {
    std::vector<PageWrite> pw;
    std::vector<SummaryWrite> sw;
    for (const PageWrite& w : pages) {
      if (w.key.page_index >= first && w.key.page_index < first + 4) pw.push_back(w);
    }
    for (const SummaryWrite& w : summaries) {
      if (w.key.index >= first && w.key.index < first + 4) sw.push_back(w);
    }
    ASSERT_FALSE(pw.empty());
    ASSERT_FALSE(sw.empty());
    STRATA_ASSERT_OK(store_->PutDeferred(pw, sw));
  }
  for (const char* cf : {"pages", "summaries", "index"}) {
    EXPECT_EQ(store_->FilesAtLevelForTesting(cf, 0), 0) << cf;
  }
  EXPECT_EQ(store_->FilesAtLevelForTesting("pages", 6), 3);
  EXPECT_EQ(store_->FilesAtLevelForTesting("summaries", 6), 3);
  EXPECT_EQ(store_->FilesAtLevelForTesting("index", 6), 6);  // pages' and summaries' entries
  EXPECT_EQ(store_->FilesAtLevelForTesting("nothing", 0), -1);
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->FinalizeDocument(id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  // The summaries scan back under their own keys (every one once), and the index counts them.
  std::vector<SummaryKey> scanned;
  std::vector<PageRef> values;
  STRATA_ASSERT_OK(store_->ScanSummaries(id, {}, &scanned, &values));
  ASSERT_EQ(scanned.size(), summaries.size());
  for (const SummaryWrite& w : summaries) {
    const auto it = std::find(scanned.begin(), scanned.end(), w.key);
    ASSERT_NE(it, scanned.end()) << w.key.layer << " " << w.key.kv_head << " " << w.key.index;
    EXPECT_EQ(values[static_cast<size_t>(it - scanned.begin())]->view(), w.data->view());
  }
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document counted, store_->GetDocument(id));
  EXPECT_EQ(counted.stored_pages(), pages.size());
  EXPECT_EQ(counted.stored_summaries(), summaries.size());
}

TEST_F(LocalStoreTest, FinalizeCountsEveryAcknowledgedEntryOnceAndNothingElse) {
  // FinalizeDocument takes the store's tally of acknowledged writes when it created the document
  // (internal/write_tally.h). Each step below would complete a tally that counted wrongly (a key
  // twice, a refused batch, a failed ingestion, a deleted document's writes), so finalize must
  // still refuse until the last page is really stored.
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 40, kSeed);  // 3 pages, last 8
  DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  ASSERT_EQ(pages.size(), 12u);
  const auto span = [&pages](size_t from, size_t n) { return absl::MakeSpan(pages).subspan(from, n); };

  // A deleted document's writes do not count for the document created again under its id.
  STRATA_ASSERT_OK(store_->PutDeferred(pages, summaries));
  STRATA_ASSERT_OK(store_->DeleteDocument(id));
  id = Create(r);
  // Six pages, each written three times (ingested twice, once through the WAL).
  STRATA_ASSERT_OK(store_->PutDeferred(span(0, 6), summaries));
  STRATA_ASSERT_OK(store_->PutDeferred(span(0, 6), {}));
  STRATA_ASSERT_OK(store_->Put(span(0, 6), {}));
  EXPECT_THAT(store_->FinalizeDocument(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("6/12 pages")));
  // A refused batch stores and counts none of its pages.
  std::vector<PageWrite> refused(pages.begin() + 6, pages.end());
  refused.push_back(PageWrite{PageKey{id, 1, 1, 0},
                              *PageBuffer::Copy(MakePage(SmallLayout(2, 2, 16, 64), 40, 1, 1, 0, 1))});
  EXPECT_THAT(store_->PutDeferred(refused, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK(store_->PutDeferred(span(6, 5), {}));
  EXPECT_THAT(store_->FinalizeDocument(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("11/12 pages")));
  // An ingestion that fails (its files cannot be built: the build directory is a file now)
  // returns the error, stores nothing and counts nothing; the store writes again once it can.
  const std::string ingest = dir_ + "/ingest";
  std::filesystem::remove_all(ingest);
  { std::ofstream(ingest) << "not a directory"; }
  EXPECT_FALSE(store_->PutDeferred(span(11, 1), {}).ok());
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(store_->GetPages({pages[11].key}, &out));
  EXPECT_EQ(out[0], nullptr);
  EXPECT_THAT(store_->FinalizeDocument(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("11/12 pages")));
  std::filesystem::remove(ingest);
  std::filesystem::create_directories(ingest);
  STRATA_ASSERT_OK(store_->PutDeferred(span(11, 1), {}));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->FinalizeDocument(id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(doc.stored_pages(), 12u);
  EXPECT_EQ(doc.stored_summaries(), 12u);
  STRATA_ASSERT_OK(store_->GetPages({pages[11].key}, &out));
  ASSERT_NE(out[0], nullptr);
  EXPECT_EQ(out[0]->view(), pages[11].data->view());

  // A document written before a reopen has no tally: finalize counts the index.
  const v1::CreateDocumentRequest r2 = MakeDocumentRequest(layout, 20, kSeed + 1);
  const DocumentId id2 = Create(r2);
  std::vector<PageWrite> p2;
  std::vector<SummaryWrite> s2;
  MakeDocumentWrites(r2, kSeed + 1, &p2, &s2);
  STRATA_ASSERT_OK(store_->PutDeferred(absl::MakeSpan(p2).subspan(1), s2));
  Open();
  EXPECT_THAT(store_->FinalizeDocument(id2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::HasSubstr(absl::StrCat(p2.size() - 1, "/", p2.size(), " pages"))));
  STRATA_ASSERT_OK(store_->PutDeferred(absl::MakeSpan(p2).subspan(0, 1), {}));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document d2, store_->FinalizeDocument(id2));
  EXPECT_EQ(d2.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(d2.stored_pages(), p2.size());
}

TEST_F(LocalStoreTest, ConcurrentBatchesOfOneDocumentCountEachEntryOnce) {
  // Four writers at once, their batches overlapping (each page written by two of them), every
  // page but the last: the tally counts 11 distinct pages; the last page makes it complete.
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 40, kSeed);
  const DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  ASSERT_EQ(pages.size(), 12u);
  std::vector<std::thread> writers;
  std::vector<absl::Status> status(4);
  for (int t = 0; t < 4; ++t) {
    writers.emplace_back([&, t] {
      std::vector<PageWrite> pw;
      for (int i = 0; i < 6; ++i) {
        const size_t p = static_cast<size_t>((t * 3 + i) % 12);
        if (p != 11) pw.push_back(pages[p]);
      }
      for (int rep = 0; rep < 5 && status[t].ok(); ++rep) {
        status[t] = t % 2 == 0 ? store_->PutDeferred(pw, summaries) : store_->Put(pw, summaries);
      }
    });
  }
  for (std::thread& w : writers) w.join();
  for (const absl::Status& s : status) STRATA_ASSERT_OK(s);
  EXPECT_THAT(store_->FinalizeDocument(id),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("11/12 pages, 12/12 summaries")));
  STRATA_ASSERT_OK(store_->PutDeferred(absl::MakeSpan(pages).subspan(11, 1), {}));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->FinalizeDocument(id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(doc.stored_pages(), 12u);
  EXPECT_EQ(doc.stored_summaries(), 12u);
}

TEST_F(LocalStoreTest, StoresOfAnotherKeyFormatAreRefused) {
  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(), 40, kSeed);
  Create(r);
  Open();  // a store of this build reopens
  ASSERT_NE(store_, nullptr);
  // Documents but no format marker: written by a build of format 1.
  STRATA_ASSERT_OK(store_->WriteFormatForTesting(""));
  store_.reset();
  LocalStoreOptions o;
  o.path = dir_;
  EXPECT_THAT(LocalStore::Open(o), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            ::testing::HasSubstr("store format 1")));
  // A marker of another format, on an empty store.
  o.path = dir_ + "/other";
  {
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<LocalStore> other, LocalStore::Open(o));
    STRATA_ASSERT_OK(other->WriteFormatForTesting("2"));  // summary keys ordered layer first
  }
  EXPECT_THAT(LocalStore::Open(o), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            ::testing::HasSubstr("has store format 2; this build reads format 3")));
}

TEST_F(LocalStoreTest, BadWritesStoreNothing) {
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 40, kSeed);
  const DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);

  // Unknown document.
  std::vector<PageWrite> unknown = {pages[0]};
  unknown[0].key.document.bytes[5] ^= 1;
  EXPECT_THAT(store_->Put(unknown, {}), StatusIs(absl::StatusCode::kNotFound));

  // One page of the wrong layout (different head dim) poisons the whole batch.
  std::vector<PageWrite> batch(pages.begin(), pages.begin() + 3);
  batch.push_back(PageWrite{PageKey{id, 1, 1, 0},
                            *PageBuffer::Copy(MakePage(SmallLayout(2, 2, 16, 64), 40, 1, 1, 0, 1))});
  EXPECT_THAT(store_->Put(batch, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  // Out-of-range page index, layer, wrong token count, corrupted bytes, undeclared summary kind.
  std::vector<PageWrite> bad = {pages[0]};
  bad[0].key.page_index = 3;
  EXPECT_THAT(store_->Put(bad, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  bad[0] = pages[0];
  bad[0].key.layer = 2;
  EXPECT_THAT(store_->Put(bad, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  bad[0] = pages[0];
  bad[0].key.page_index = 2;  // page 2 holds 8 tokens; page 0's bytes hold 16
  EXPECT_THAT(store_->Put(bad, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  std::string corrupt(pages[0].data->view());
  corrupt[100] ^= 4;
  bad[0] = PageWrite{pages[0].key, *PageBuffer::Copy(corrupt)};
  EXPECT_THAT(store_->Put(bad, {}), StatusIs(absl::StatusCode::kDataLoss));
  std::vector<SummaryWrite> bad_summary = {summaries[0]};
  bad_summary[0].key.kind = 9;
  EXPECT_THAT(store_->Put({}, bad_summary), StatusIs(absl::StatusCode::kInvalidArgument));

  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->GetDocument(id));
  EXPECT_EQ(doc.stored_pages(), 0u);
  EXPECT_EQ(doc.stored_summaries(), 0u);
  EXPECT_THAT(store_->FinalizeDocument(PageKey{}.document),
              StatusIs(absl::StatusCode::kNotFound));
}

TEST_F(LocalStoreTest, CorruptedStoredPageIsDataLossNeverReturned) {
  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(), 32, kSeed);
  const DocumentId id = Create(r);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  STRATA_ASSERT_OK(store_->Put(pages, summaries));
  STRATA_ASSERT_OK(store_->FinalizeDocument(id).status());
  STRATA_ASSERT_OK_AND_ASSIGN(std::string raw, store_->RawPageForTesting(pages[3].key));
  raw[raw.size() / 2] ^= 0x01;
  STRATA_ASSERT_OK(store_->OverwriteRawPageForTesting(pages[3].key, raw));
  std::vector<PageRef> out;
  const std::vector<PageKey> keys = {pages[2].key, pages[3].key};
  EXPECT_THAT(store_->GetPages(keys, &out), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(out[0], nullptr);
  EXPECT_EQ(out[1], nullptr);
  const std::vector<PageKey> good = {pages[2].key};
  STRATA_ASSERT_OK(store_->GetPages(good, &out));
  EXPECT_NE(out[0], nullptr);
}

TEST_F(LocalStoreTest, DeleteRemovesEverythingAndGcHonoursPinsAndTtl) {
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest a = MakeDocumentRequest(layout, 32, 1, /*ttl_seconds=*/10);
  const v1::CreateDocumentRequest b = MakeDocumentRequest(layout, 32, 2, /*ttl_seconds=*/10);
  const v1::CreateDocumentRequest c = MakeDocumentRequest(layout, 32, 3);
  const DocumentId ida = Create(a), idb = Create(b), idc = Create(c);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(a, 1, &pages, &summaries);
  MakeDocumentWrites(b, 2, &pages, &summaries);
  MakeDocumentWrites(c, 3, &pages, &summaries);
  STRATA_ASSERT_OK(store_->Put(pages, summaries));
  STRATA_ASSERT_OK(store_->PinDocument(idb, true, 0).status());
  // Times to live past 100 years are refused (now + ttl in microseconds would overflow int64),
  // at creation and by a pin; 100 years is taken.
  EXPECT_THAT(store_->PinDocument(idb, true, kMaxTtlSeconds + 1), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store_->PinDocument(idb, true, std::numeric_limits<int64_t>::max()),
              StatusIs(absl::StatusCode::kInvalidArgument));
  bool created = false;
  EXPECT_THAT(store_->CreateDocument(MakeDocumentRequest(layout, 32, 4, std::numeric_limits<int64_t>::max()), &created),
              StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(const v1::Document far, store_->PinDocument(idb, true, kMaxTtlSeconds));
  EXPECT_GT(far.expire_time_micros(), WallMicros() + (kMaxTtlSeconds - 60) * 1000000);

  // Not yet expired.
  STRATA_ASSERT_OK_AND_ASSIGN(int n, store_->CollectGarbage(WallMicros()));
  EXPECT_EQ(n, 0);
  STRATA_ASSERT_OK_AND_ASSIGN(n, store_->CollectGarbage(WallMicros() + 11 * 1000000));
  EXPECT_EQ(n, 1);  // a: expired, unpinned. b: pinned. c: no TTL.
  EXPECT_THAT(store_->GetDocument(ida), StatusIs(absl::StatusCode::kNotFound));
  STRATA_ASSERT_OK(store_->GetDocument(idb).status());

  STRATA_ASSERT_OK(store_->DeleteDocument(idc));
  EXPECT_THAT(store_->DeleteDocument(idc), StatusIs(absl::StatusCode::kNotFound));
  std::vector<PageKey> keys;
  for (const PageWrite& w : pages) keys.push_back(w.key);
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(store_->GetPages(keys, &out));
  size_t present = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const bool is_b = keys[i].document == idb;
    EXPECT_EQ(out[i] != nullptr, is_b) << i;
    present += out[i] != nullptr;
  }
  EXPECT_EQ(present, pages.size() / 3);
  std::vector<SummaryKey> sk;
  STRATA_ASSERT_OK(store_->ScanSummaries(idc, {}, &sk, &out));
  EXPECT_TRUE(sk.empty());

  // A re-created document starts empty.
  Create(c);
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, store_->GetDocument(idc));
  EXPECT_EQ(doc.stored_pages(), 0u);
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<v1::Document> docs,
                              store_->ListDocuments(v1::ListDocumentsRequest()));
  EXPECT_EQ(docs.size(), 2u);
}

}  // namespace
}  // namespace strata::kvstore
