// Many concurrent readers and writers against one `strata kvstore` process over loopback. Run
// under TSan (scripts/test_sanitize.sh thread) it checks both sides for races: the client side in
// this process, the service in the child (which exits non-zero when TSan reported anything).
#include <signal.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kvstore/remote_store.h"
#include "kvstore/testing/test_pages.h"
#include "tests/kvstore/kvstore_process.h"

namespace strata::tests {
namespace {

using kvstore::DocumentId;
using kvstore::PageKey;
using kvstore::PageRef;
using kvstore::PageWrite;
using kvstore::SummaryKey;
using kvstore::SummaryWrite;

constexpr uint32_t kSeed = 99;
constexpr uint64_t kTokens = 256;
constexpr int64_t kRunNanos = int64_t{4} * 1000000000;

#if defined(__SANITIZE_THREAD__)
// Under TSan, every copy of a page that passes through gRPC's uninstrumented threads is checked
// (and suppressed, scripts/tsan.supp) byte range by byte range: keep the pages small so the run
// measures races, not the cost of reporting them.
kvstore::KvLayout Layout() { return kvstore::testing::SmallLayout(2, 2, 16, 16); }
#else
kvstore::KvLayout Layout() { return kvstore::testing::SmallLayout(2, 2, 64, 128); }
#endif

struct Doc {
  v1::CreateDocumentRequest request;
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
};

Doc MakeDoc(uint64_t seed) {
  Doc d;
  d.request = kvstore::testing::MakeDocumentRequest(Layout(), kTokens, seed);
  kvstore::testing::MakeDocumentWrites(d.request, seed, &d.pages, &d.summaries);
  return d;
}

std::unique_ptr<kvstore::RemoteStore> Connect(const std::string& target) {
  kvstore::RemoteStoreOptions o;
  o.target = target;
  o.timeout_ms = 30000;
  o.max_message_bytes = 256 << 10;
  auto r = kvstore::RemoteStore::Create(o);
  return r.ok() ? *std::move(r) : nullptr;
}

absl::Status WriteAndFinalize(kvstore::RemoteStore* remote, const Doc& d, size_t batch) {
  bool created = false;
  STRATA_RETURN_IF_ERROR(remote->CreateDocument(d.request, &created).status());
  for (size_t b = 0; b < d.pages.size(); b += batch) {
    const size_t n = std::min(batch, d.pages.size() - b);
    STRATA_RETURN_IF_ERROR(remote->Put(absl::MakeConstSpan(d.pages).subspan(b, n),
                                       absl::MakeConstSpan(d.summaries).subspan(b, n)));
  }
  return remote->FinalizeDocument(*DocumentId::FromHex(d.request.document_id())).status();
}

TEST(KvstoreConcurrencyTest, ManyReadersAndWritersOverLoopback) {
  std::printf("seed %u\n", kSeed);
  TempDir tmp;
  KvstoreProcess server;
  STRATA_ASSERT_OK(server.Start(tmp.path() + "/data", "--threads 8"));
  const std::string target = server.target();
  std::unique_ptr<kvstore::RemoteStore> shared = Connect(target);
  ASSERT_NE(shared, nullptr);
  STRATA_ASSERT_OK(shared->WaitForReady(10000));

  // Stable READY documents the readers check.
  std::vector<Doc> stable;
  for (uint64_t s = 1; s <= 4; ++s) {
    stable.push_back(MakeDoc(s));
    STRATA_ASSERT_OK(WriteAndFinalize(shared.get(), stable.back(), 8));
  }

  const int64_t end = MonotonicNanos() + kRunNanos;
  std::atomic<int64_t> reads{0}, pages_read{0}, docs_written{0}, docs_deleted{0}, meta_ops{0},
      refused{0};
  std::atomic<int> failures{0};
  auto fail = [&failures](const std::string& what) {
    if (failures.fetch_add(1) < 10) ADD_FAILURE() << what;
  };
  std::vector<std::thread> threads;
  // Readers: half share one client (one channel), half have their own.
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<kvstore::RemoteStore> own = t % 2 ? Connect(target) : nullptr;
      kvstore::RemoteStore* remote = own ? own.get() : shared.get();
      std::mt19937 rng(kSeed + t);
      std::vector<PageRef> out;
      while (MonotonicNanos() < end) {
        const Doc& d = stable[rng() % stable.size()];
        const size_t n = 1 + rng() % 24;
        std::vector<PageKey> keys;
        std::vector<size_t> idx;
        for (size_t i = 0; i < n; ++i) {
          idx.push_back(rng() % d.pages.size());
          keys.push_back(d.pages[idx.back()].key);
        }
        absl::Status s = remote->GetPages(keys, &out);
        if (!s.ok()) return fail("GetPages: " + s.ToString());
        for (size_t i = 0; i < n; ++i) {
          if (out[i] == nullptr || out[i]->view() != d.pages[idx[i]].data->view()) {
            return fail("page differs");
          }
        }
        if (rng() % 4 == 0) {
          const std::vector<SummaryKey> sk = {d.summaries[idx[0]].key};
          s = remote->GetSummaries(sk, &out);
          if (!s.ok() || out[0] == nullptr || out[0]->view() != d.summaries[idx[0]].data->view()) {
            return fail("summary: " + s.ToString());
          }
        }
        reads.fetch_add(1);
        pages_read.fetch_add(static_cast<int64_t>(n));
      }
    });
  }
  // Writers: new documents, a third of them deleted again right away.
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<kvstore::RemoteStore> remote = Connect(target);
      for (uint64_t i = 0; MonotonicNanos() < end; ++i) {
        const Doc d = MakeDoc(100000 * (t + 1) + i);
        absl::Status s = WriteAndFinalize(remote.get(), d, 1 + (i % 8));
        if (!s.ok()) return fail("write: " + s.ToString());
        docs_written.fetch_add(1);
        if (i % 3 == 0) {
          s = remote->DeleteDocument(*DocumentId::FromHex(d.request.document_id()));
          if (!s.ok()) return fail("delete: " + s.ToString());
          docs_deleted.fetch_add(1);
        }
      }
    });
  }
  // Two writers racing on the same documents (identical content), both finalizing.
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      std::unique_ptr<kvstore::RemoteStore> remote = Connect(target);
      for (uint64_t i = 0; MonotonicNanos() < end; ++i) {
        absl::Status s = WriteAndFinalize(remote.get(), MakeDoc(900000 + i), 4);
        // The other writer may finalize first: then our remaining puts are refused.
        if (!s.ok() && s.code() != absl::StatusCode::kFailedPrecondition) {
          return fail("shared write: " + s.ToString());
        }
        if (!s.ok()) refused.fetch_add(1);
      }
    });
  }
  // Metadata traffic and writes to READY documents (always refused).
  threads.emplace_back([&] {
    std::unique_ptr<kvstore::RemoteStore> remote = Connect(target);
    while (MonotonicNanos() < end) {
      auto list = remote->ListDocuments(v1::ListDocumentsRequest());
      if (!list.ok()) return fail("list: " + list.status().ToString());
      const DocumentId id = *DocumentId::FromHex(stable[0].request.document_id());
      if (!remote->PinDocument(id, true, 3600).ok()) return fail("pin");
      auto doc = remote->GetDocument(id);
      if (!doc.ok() || doc->state() != v1::DOCUMENT_STATE_READY) return fail("get document");
      absl::Status s = remote->Put({stable[0].pages[0]}, {});
      if (s.code() != absl::StatusCode::kFailedPrecondition) return fail("write to READY: " + s.ToString());
      meta_ops.fetch_add(1);
    }
  });
  for (std::thread& t : threads) t.join();
  std::printf("concurrency: %lld read calls (%lld pages), %lld documents written, %lld deleted, "
              "%lld metadata rounds, %lld racing finalizes refused\n",
              static_cast<long long>(reads.load()), static_cast<long long>(pages_read.load()),
              static_cast<long long>(docs_written.load()), static_cast<long long>(docs_deleted.load()),
              static_cast<long long>(meta_ops.load()), static_cast<long long>(refused.load()));
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(reads.load(), 0);
  EXPECT_GT(docs_written.load(), 0);

  // Every surviving document is READY and consistent.
  auto list = shared->ListDocuments(v1::ListDocumentsRequest());
  STRATA_ASSERT_OK(list.status());
  for (const v1::Document& d : *list) {
    if (d.state() != v1::DOCUMENT_STATE_READY) {
      // Only a racing-writer document interrupted by the end of the run may be unfinished.
      continue;
    }
    auto full = shared->GetDocument(*DocumentId::FromHex(d.document_id()));
    STRATA_ASSERT_OK(full.status());
    const uint64_t expected = full->num_pages() * 2 * 2;  // pages per head x layers x heads
    EXPECT_EQ(full->stored_pages(), expected);
    EXPECT_EQ(full->stored_summaries(), expected);
  }
  shared.reset();
  const int status = server.Stop(SIGTERM);
  EXPECT_TRUE(ExitedCleanly(status)) << "kvstore exit status " << status
                                     << " (TSan reports make it non-zero); log tail:\n"
                                     << server.LogTail();
  if (failures.load() > 0) std::printf("kvstore log tail:\n%s\n", server.LogTail().c_str());
}

}  // namespace
}  // namespace strata::tests
