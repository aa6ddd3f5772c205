// Multi-process durability tests of `strata kvstore`:
//  - crash: SIGKILL while documents are being written; after a restart every READY document is
//    complete and bit-exact, every acknowledged batch is there, unfinished documents are reported
//    WRITING, refuse to finalize, and can be deleted;
//  - corruption: a flipped byte in a stored page (through RocksDB, and on disk) is DATA_LOSS and
//    the page is never served;
//  - deferred writes: a LocalStore written with PutDeferred by a child process that is SIGKILLed
//    before FinalizeDocument keeps every batch when the batches are ingested as SST files (the
//    default), and, written through the memtables without WAL, keeps the batches flushed before
//    the kill, each whole, and loses the later ones whole (pages, summaries and index entries
//    together); written again, the document finalizes and survives a reopen.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kvstore/local_store.h"
#include "kvstore/remote_store.h"
#include "kvstore/testing/test_pages.h"
#include "tests/kvstore/kvstore_process.h"

namespace strata::tests {
namespace {

// The deferred-writes test: the document tests/kvstore/deferred_writer_main.cc writes.
constexpr uint64_t kDeferredTokens = 2560;  // 40 pages per (layer, head): 320 pages, 10 MiB
constexpr uint64_t kDeferredSeed = 77;
constexpr size_t kDeferredBatch = 8, kFlushedBatches = 20;

using kvstore::DocumentId;
using kvstore::PageKey;
using kvstore::PageRef;
using kvstore::PageWrite;
using kvstore::SummaryKey;
using kvstore::SummaryWrite;
using ::strata::testing::StatusIs;

// 4 layers x 2 KV heads, 64-token bf16 pages of head dim 128 (32 KiB + header per page); the
// deferred writer uses the same layout.
kvstore::KvLayout Layout() { return kvstore::testing::SmallLayout(4, 2, 64, 128); }
constexpr uint64_t kTokens = 640;  // 10 pages per (layer, head): 80 pages per document

std::unique_ptr<kvstore::RemoteStore> Connect(const KvstoreProcess& p) {
  kvstore::RemoteStoreOptions o;
  o.target = p.target();
  o.timeout_ms = 10000;
  absl::StatusOr<std::unique_ptr<kvstore::RemoteStore>> r = kvstore::RemoteStore::Create(o);
  if (!r.ok() || !(*r)->WaitForReady(10000).ok()) return nullptr;
  return *std::move(r);
}

// Reads every page and summary of the document and compares with what was written.
void ExpectDocumentBitExact(kvstore::RemoteStore* remote, const v1::CreateDocumentRequest& r,
                            uint64_t seed) {
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  kvstore::testing::MakeDocumentWrites(r, seed, &pages, &summaries);
  std::vector<PageKey> keys;
  for (const PageWrite& w : pages) keys.push_back(w.key);
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(remote->GetPages(keys, &out));
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << r.document_id() << " page " << i;
    ASSERT_EQ(out[i]->view(), pages[i].data->view()) << r.document_id() << " page " << i;
  }
  std::vector<SummaryKey> skeys;
  for (const SummaryWrite& w : summaries) skeys.push_back(w.key);
  STRATA_ASSERT_OK(remote->GetSummaries(skeys, &out));
  for (size_t i = 0; i < skeys.size(); ++i) {
    ASSERT_NE(out[i], nullptr);
    ASSERT_EQ(out[i]->view(), summaries[i].data->view());
  }
}

struct WrittenDoc {
  v1::CreateDocumentRequest request;
  uint64_t seed = 0;
  uint64_t acked_pages = 0;  // pages in batches the service acknowledged durable
  bool finalized = false;    // FinalizeDocument returned READY
};

TEST(KvstoreCrashTest, SigkillDuringWritesLosesNothingAcknowledged) {
  TempDir tmp;
  ASSERT_FALSE(tmp.path().empty());
  const std::string data = tmp.path() + "/data";
  KvstoreProcess server;
  STRATA_ASSERT_OK(server.Start(data));

  std::mutex mu;
  std::map<std::string, WrittenDoc> docs;  // by id
  std::atomic<int> finalized{0};
  std::atomic<bool> stop{false};
  const std::string target = server.target();
  std::vector<std::thread> writers;
  for (int t = 0; t < 3; ++t) {
    writers.emplace_back([&, t] {
      kvstore::RemoteStoreOptions o;
      o.target = target;
      o.timeout_ms = 5000;
      auto remote = kvstore::RemoteStore::Create(o);
      if (!remote.ok()) return;
      for (uint64_t i = 0; !stop.load(); ++i) {
        const uint64_t seed = 1000 * (t + 1) + i;
        const v1::CreateDocumentRequest r = kvstore::testing::MakeDocumentRequest(Layout(), kTokens, seed);
        {
          std::lock_guard<std::mutex> lock(mu);
          docs[r.document_id()] = WrittenDoc{r, seed, 0, false};
        }
        bool created = false;
        if (!(*remote)->CreateDocument(r, &created).ok()) return;
        std::vector<PageWrite> pages;
        std::vector<SummaryWrite> summaries;
        kvstore::testing::MakeDocumentWrites(r, seed, &pages, &summaries);
        for (size_t b = 0; b < pages.size(); b += 8) {
          const size_t n = std::min<size_t>(8, pages.size() - b);
          if (!(*remote)->Put(absl::MakeSpan(pages).subspan(b, n),
                              absl::MakeSpan(summaries).subspan(b, n)).ok()) {
            return;  // the server is gone
          }
          std::lock_guard<std::mutex> lock(mu);
          docs[r.document_id()].acked_pages += n;
        }
        const DocumentId id = *DocumentId::FromHex(r.document_id());
        if (!(*remote)->FinalizeDocument(id).ok()) return;
        {
          std::lock_guard<std::mutex> lock(mu);
          docs[r.document_id()].finalized = true;
        }
        finalized.fetch_add(1);
      }
    });
  }
  // Kill once several documents are READY and others are half written.
  const int64_t deadline = MonotonicNanos() + int64_t{30} * 1000000000;
  while (finalized.load() < 4 && MonotonicNanos() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(40));  // land inside a document's writes
  const int status = server.Stop(SIGKILL);
  stop.store(true);
  for (std::thread& w : writers) w.join();
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ASSERT_GE(finalized.load(), 4) << "writers too slow: no crash mid-stream was tested";

  STRATA_ASSERT_OK(server.Start(data));
  std::unique_ptr<kvstore::RemoteStore> remote = Connect(server);
  ASSERT_NE(remote, nullptr);
  v1::ListDocumentsRequest all;
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<v1::Document> listed, remote->ListDocuments(all));
  int ready = 0, unfinished = 0;
  std::vector<DocumentId> to_delete;
  for (const v1::Document& d : listed) {
    auto it = docs.find(d.document_id());
    ASSERT_NE(it, docs.end()) << "unexpected document " << d.document_id();
    const WrittenDoc& w = it->second;
    const DocumentId id = *DocumentId::FromHex(d.document_id());
    STRATA_ASSERT_OK_AND_ASSIGN(v1::Document full, remote->GetDocument(id));
    EXPECT_GE(full.stored_pages(), w.acked_pages) << "acknowledged pages lost in " << d.document_id();
    if (d.state() == v1::DOCUMENT_STATE_READY) {
      ++ready;
      EXPECT_EQ(full.stored_pages(), 80u);
      ExpectDocumentBitExact(remote.get(), w.request, w.seed);
    } else {
      ASSERT_EQ(d.state(), v1::DOCUMENT_STATE_WRITING);
      EXPECT_FALSE(w.finalized) << "a document acknowledged READY came back WRITING";
      ++unfinished;
      if (full.stored_pages() < 80u) {
        EXPECT_THAT(remote->FinalizeDocument(id), StatusIs(absl::StatusCode::kFailedPrecondition));
      }
      to_delete.push_back(id);
    }
  }
  // Every document acknowledged READY is READY.
  for (const auto& [id, w] : docs) {
    if (!w.finalized) continue;
    STRATA_ASSERT_OK_AND_ASSIGN(v1::Document d, remote->GetDocument(*DocumentId::FromHex(id)));
    EXPECT_EQ(d.state(), v1::DOCUMENT_STATE_READY);
  }
  std::printf("crash test: %zu documents started, %d finalized before SIGKILL; after restart %d "
              "READY (all bit-exact), %d unfinished\n",
              docs.size(), finalized.load(), ready, unfinished);
  EXPECT_GE(ready, finalized.load());
  EXPECT_GE(unfinished, 1) << "the kill did not land inside a document's writes";

  // Unfinished documents can be cleaned up completely.
  for (const DocumentId& id : to_delete) STRATA_ASSERT_OK(remote->DeleteDocument(id));
  v1::ListDocumentsRequest writing;
  writing.set_state(v1::DOCUMENT_STATE_WRITING);
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<v1::Document> left, remote->ListDocuments(writing));
  EXPECT_TRUE(left.empty());
  if (!to_delete.empty()) {
    std::vector<PageRef> out;
    const std::vector<PageKey> gone = {PageKey{to_delete[0], 0, 0, 0}};
    EXPECT_THAT(remote->GetPages(gone, &out), StatusIs(absl::StatusCode::kNotFound));
  }
  remote.reset();
  EXPECT_TRUE(ExitedCleanly(server.Stop(SIGTERM)));
}

// Finds `needle` in the files under `dir`; flips one byte in its middle. False when not found.
bool FlipByteOnDisk(const std::string& dir, const std::string& needle, std::string* file) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t pos = content.find(needle);
    if (pos == std::string::npos) continue;
    std::fstream out(entry.path(), std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(static_cast<std::streamoff>(pos + needle.size() / 2));
    const char flipped = static_cast<char>(content[pos + needle.size() / 2] ^ 0x40);
    out.write(&flipped, 1);
    *file = entry.path().filename().string();
    return static_cast<bool>(out);
  }
  return false;
}

TEST(KvstoreCrashTest, FlippedBytesAreDataLossNeverServed) {
  TempDir tmp;
  const std::string data = tmp.path() + "/data";
  KvstoreProcess server;
  STRATA_ASSERT_OK(server.Start(data));
  std::unique_ptr<kvstore::RemoteStore> remote = Connect(server);
  ASSERT_NE(remote, nullptr);
  const v1::CreateDocumentRequest r = kvstore::testing::MakeDocumentRequest(Layout(), kTokens, 5);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  kvstore::testing::MakeDocumentWrites(r, 5, &pages, &summaries);
  bool created = false;
  STRATA_ASSERT_OK(remote->CreateDocument(r, &created).status());
  STRATA_ASSERT_OK(remote->Put(pages, summaries));
  const DocumentId id = *DocumentId::FromHex(r.document_id());
  STRATA_ASSERT_OK(remote->FinalizeDocument(id).status());
  remote.reset();
  ASSERT_TRUE(ExitedCleanly(server.Stop(SIGTERM)));

  // (a) A flipped byte written through RocksDB: only our XXH3 checksum can catch it.
  // (b) A flipped byte in the blob file on disk: RocksDB's blob CRC or our checksum catches it.
  std::string file;
  {
    kvstore::LocalStoreOptions o;
    o.path = data;
    STRATA_ASSERT_OK_AND_ASSIGN(auto store, kvstore::LocalStore::Open(o));
    STRATA_ASSERT_OK(store->Flush());
    STRATA_ASSERT_OK_AND_ASSIGN(std::string raw, store->RawPageForTesting(pages[3].key));
    raw[raw.size() / 3] ^= 0x01;
    STRATA_ASSERT_OK(store->OverwriteRawPageForTesting(pages[3].key, raw));
    STRATA_ASSERT_OK(store->Flush());
  }
  ASSERT_TRUE(FlipByteOnDisk(data, std::string(pages[40].data->view()), &file))
      << "page bytes not found in any file";
  std::printf("corruption test: flipped a byte of page 40 in %s\n", file.c_str());

  STRATA_ASSERT_OK(server.Start(data));
  remote = Connect(server);
  ASSERT_NE(remote, nullptr);
  std::vector<PageRef> out;
  for (size_t bad : {size_t{3}, size_t{40}}) {
    const std::vector<PageKey> keys = {pages[2].key, pages[bad].key};
    const absl::Status s = remote->GetPages(keys, &out);
    EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss)) << bad;
    std::printf("corruption test: page %zu -> %s\n", bad, s.ToString().c_str());
    EXPECT_EQ(out[1], nullptr);
  }
  // The intact pages are still served, bit-exact.
  std::vector<PageKey> good;
  for (size_t i = 0; i < pages.size(); ++i) {
    if (i != 3 && i != 40) good.push_back(pages[i].key);
  }
  STRATA_ASSERT_OK(remote->GetPages(good, &out));
  for (size_t i = 0, j = 0; i < pages.size(); ++i) {
    if (i == 3 || i == 40) continue;
    ASSERT_EQ(out[j++]->view(), pages[i].data->view());
  }
  remote.reset();
  EXPECT_TRUE(ExitedCleanly(server.Stop(SIGTERM)));
}

// Runs the deferred writer (tests/kvstore/deferred_writer_main.cc) on `dir` with this file's
// document constants, `last` (a batch count, or "finalize") and `mode` ("ingest" or "memtable")
// and SIGKILLs it once it reports its writes done.
void RunDeferredWriterUntilKilled(const std::string& dir, const std::string& last, const std::string& mode) {
  std::vector<std::string> args = {STRATA_DEFERRED_WRITER,      dir,  std::to_string(kDeferredTokens),
                                   std::to_string(kDeferredSeed), std::to_string(kDeferredBatch), last,
                                   mode};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  const int64_t deadline = MonotonicNanos() + int64_t{60} * 1000000000;
  bool written = false;
  int status = 0;
  while (!written && MonotonicNanos() < deadline) {
    std::ifstream progress(dir + "/progress");
    std::string line;
    written = static_cast<bool>(std::getline(progress, line)) && line == "written";
    if (!written) {
      ASSERT_EQ(waitpid(pid, &status, WNOHANG), 0) << "the writer exited early, status " << status;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  kill(pid, SIGKILL);
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(written) << "the writer did not write its batches within 60 s";
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

// What a killed deferred writer left: its store reopened, and the document it was writing (every
// page and summary, in write order, with their keys).
struct AfterKill {
  kvstore::LocalStoreOptions options;
  std::unique_ptr<kvstore::LocalStore> store;
  DocumentId id;
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  std::vector<PageKey> keys;
  std::vector<SummaryKey> skeys;
};
void RunWriterAndReopen(const std::string& dir, const std::string& last, const std::string& mode, AfterKill* a) {
  ASSERT_NO_FATAL_FAILURE(RunDeferredWriterUntilKilled(dir, last, mode));
  a->options.path = dir + "/db";
  STRATA_ASSERT_OK_AND_ASSIGN(a->store, kvstore::LocalStore::Open(a->options));
  const v1::CreateDocumentRequest r =
      kvstore::testing::MakeDocumentRequest(Layout(), kDeferredTokens, kDeferredSeed);
  a->id = *DocumentId::FromHex(r.document_id());
  kvstore::testing::MakeDocumentWrites(r, kDeferredSeed, &a->pages, &a->summaries);
  for (const PageWrite& w : a->pages) a->keys.push_back(w.key);
  for (const SummaryWrite& w : a->summaries) a->skeys.push_back(w.key);
}

TEST(KvstoreCrashTest, SigkillBeforeFinalizeLosesUnflushedDeferredBatchesWhole) {
  TempDir tmp;
  ASSERT_FALSE(tmp.path().empty());
  AfterKill k;
  ASSERT_NO_FATAL_FAILURE(RunWriterAndReopen(tmp.path(), std::to_string(kFlushedBatches), "memtable", &k));
  const size_t kept = kFlushedBatches * kDeferredBatch;
  ASSERT_GT(k.pages.size(), kept);
  // The index agrees with the pages: exactly the flushed batches are counted.
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, k.store->GetDocument(k.id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_WRITING);
  EXPECT_EQ(doc.stored_pages(), kept);
  EXPECT_EQ(doc.stored_summaries(), kept);
  std::vector<PageRef> out, sout;
  STRATA_ASSERT_OK(k.store->GetPages(k.keys, &out));
  STRATA_ASSERT_OK(k.store->GetSummaries(k.skeys, &sout));
  for (size_t i = 0; i < k.pages.size(); ++i) {
    if (i < kept) {
      ASSERT_NE(out[i], nullptr) << "flushed page " << i;
      ASSERT_EQ(out[i]->view(), k.pages[i].data->view()) << i;
      ASSERT_NE(sout[i], nullptr) << "flushed summary " << i;
    } else {
      ASSERT_EQ(out[i], nullptr) << "unflushed page " << i << " survived without a WAL";
      ASSERT_EQ(sout[i], nullptr) << "unflushed summary " << i;
    }
  }
  EXPECT_THAT(k.store->FinalizeDocument(k.id), StatusIs(absl::StatusCode::kFailedPrecondition));
  // Written again, the document finalizes; READY means durable: it survives a reopen.
  STRATA_ASSERT_OK(k.store->PutDeferred(absl::MakeSpan(k.pages).subspan(kept),
                                        absl::MakeSpan(k.summaries).subspan(kept)));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document ready, k.store->FinalizeDocument(k.id));
  EXPECT_EQ(ready.state(), v1::DOCUMENT_STATE_READY);
  k.store.reset();
  STRATA_ASSERT_OK_AND_ASSIGN(k.store, kvstore::LocalStore::Open(k.options));
  STRATA_ASSERT_OK(k.store->GetPages(k.keys, &out));
  for (size_t i = 0; i < k.pages.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << i;
    ASSERT_EQ(out[i]->view(), k.pages[i].data->view()) << i;
  }
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document again, k.store->GetDocument(k.id));
  EXPECT_EQ(again.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(again.stored_pages(), k.pages.size());
}

TEST(KvstoreCrashTest, SigkillBeforeFinalizeKeepsEveryIngestedBatch) {
  TempDir tmp;
  ASSERT_FALSE(tmp.path().empty());
  AfterKill k;
  ASSERT_NO_FATAL_FAILURE(RunWriterAndReopen(tmp.path(), std::to_string(kFlushedBatches), "ingest", &k));
  // Every batch whose PutDeferred returned is durable, flushed or not, and the index counts it.
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, k.store->GetDocument(k.id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_WRITING);
  EXPECT_EQ(doc.stored_pages(), k.pages.size());
  EXPECT_EQ(doc.stored_summaries(), k.summaries.size());
  std::vector<PageRef> out, sout;
  STRATA_ASSERT_OK(k.store->GetPages(k.keys, &out));
  STRATA_ASSERT_OK(k.store->GetSummaries(k.skeys, &sout));
  for (size_t i = 0; i < k.pages.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << "ingested page " << i << " lost";
    ASSERT_EQ(out[i]->view(), k.pages[i].data->view()) << i;
    ASSERT_NE(sout[i], nullptr) << "ingested summary " << i << " lost";
  }
  // Nothing to write again: the document finalizes as it is, and survives a reopen.
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document ready, k.store->FinalizeDocument(k.id));
  EXPECT_EQ(ready.state(), v1::DOCUMENT_STATE_READY);
  k.store.reset();
  STRATA_ASSERT_OK_AND_ASSIGN(k.store, kvstore::LocalStore::Open(k.options));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document again, k.store->GetDocument(k.id));
  EXPECT_EQ(again.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(again.stored_pages(), k.pages.size());
}

class DeferredModeTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeferredModeTest, DeferredBatchesAreDurableOnceFinalized) {
  TempDir tmp;
  ASSERT_FALSE(tmp.path().empty());
  // Every batch deferred, then FinalizeDocument, then SIGKILL with no clean close.
  AfterKill k;
  ASSERT_NO_FATAL_FAILURE(RunWriterAndReopen(tmp.path(), "finalize", GetParam(), &k));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, k.store->GetDocument(k.id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(doc.stored_pages(), k.pages.size());
  EXPECT_EQ(doc.stored_summaries(), k.summaries.size());
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(k.store->GetPages(k.keys, &out));
  for (size_t i = 0; i < k.pages.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << "page " << i << " of a READY document lost";
    ASSERT_EQ(out[i]->view(), k.pages[i].data->view()) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(KvstoreCrashTest, DeferredModeTest, ::testing::Values("ingest", "memtable"));

}  // namespace
}  // namespace strata::tests
