// Child of kvstore_crash_test's deferred-writes test: writes a document into a LocalStore with
// PutDeferred (no WAL), flushing once on the way, then waits to be killed.
//
//   strata_deferred_writer DIR TOKENS SEED BATCH FLUSHED_BATCHES|finalize ingest|memtable
//
// Opens the store at DIR/db, creates the document of kvstore::testing::MakeDocumentRequest(4 x 2
// layout of 64-token bf16 pages of head dim 128, TOKENS, SEED), writes its pages and summaries in
// batches of BATCH writes: batches [0, FLUSHED_BATCHES), a Flush, the rest (which stay in the
// memtables: far below the write buffer). With "finalize" instead of a count: every batch, then
// FinalizeDocument (no Flush of its own). "ingest" writes with LocalStoreOptions::ingest_deferred
// (each batch ingested as SST files), "memtable" without it (WAL-less memtable writes). Then
// writes "written" to DIR/progress and pauses.
// Exit codes: 1 usage, 2 open, 3 create, 4 flush, 5 write, 6 finalize.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvstore/local_store.h"
#include "kvstore/testing/test_pages.h"

int main(int argc, char** argv) {
  using namespace strata;  // NOLINT: a test program
  if (argc != 7) return 1;
  const std::string mode = argv[6];
  if (mode != "ingest" && mode != "memtable") return 1;
  const std::string dir = argv[1];
  const uint64_t tokens = std::strtoull(argv[2], nullptr, 10), seed = std::strtoull(argv[3], nullptr, 10);
  const bool finalize = std::string(argv[5]) == "finalize";
  const size_t batch = std::strtoull(argv[4], nullptr, 10);
  const size_t flushed = finalize ? SIZE_MAX : std::strtoull(argv[5], nullptr, 10);
  if (batch == 0) return 1;
  kvstore::LocalStoreOptions o;
  o.path = dir + "/db";
  o.ingest_deferred = mode == "ingest";
  absl::StatusOr<std::unique_ptr<kvstore::LocalStore>> store = kvstore::LocalStore::Open(o);
  if (!store.ok()) return 2;
  const v1::CreateDocumentRequest r =
      kvstore::testing::MakeDocumentRequest(kvstore::testing::SmallLayout(4, 2, 64, 128), tokens, seed);
  bool created = false;
  if (!(*store)->CreateDocument(r, &created).ok()) return 3;
  std::vector<kvstore::PageWrite> pages;
  std::vector<kvstore::SummaryWrite> summaries;
  kvstore::testing::MakeDocumentWrites(r, seed, &pages, &summaries);
  for (size_t b = 0; b * batch < pages.size(); ++b) {
    if (b == flushed && !(*store)->Flush().ok()) return 4;
    const size_t n = std::min(batch, pages.size() - b * batch);
    if (!(*store)->PutDeferred(absl::MakeSpan(pages).subspan(b * batch, n),
                               absl::MakeSpan(summaries).subspan(b * batch, n)).ok()) {
      return 5;
    }
  }
  if (finalize && !(*store)->FinalizeDocument(*kvstore::DocumentId::FromHex(r.document_id())).ok()) return 6;
  {
    std::ofstream progress(dir + "/progress");
    progress << "written\n";
  }
  for (;;) pause();
}
