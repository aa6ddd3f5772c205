// In-process tests of the KV store service and the remote and tiered stores over loopback gRPC.
#include "kvstore/service.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvstore/host_cache.h"
#include "kvstore/remote_store.h"
#include "kvstore/testing/grpc_health.h"
#include "kvstore/testing/test_pages.h"
#include "kvstore/tiered_store.h"
#include "prometheus/registry.h"
#include "proto/testing/random_requests.h"

namespace strata::kvstore {
namespace {

using ::strata::testing::StatusIs;
using testing::MakeDocumentRequest;
using testing::MakeDocumentWrites;
using testing::MakePage;
using testing::SmallLayout;

constexpr uint64_t kSeed = 7;

// Reads every page of `pages` back from `store` (one GetPages call) and checks its bytes.
void ExpectStoredPages(PageStore* store, const std::vector<PageWrite>& pages) {
  std::vector<PageKey> keys;
  for (const PageWrite& w : pages) keys.push_back(w.key);
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(store->GetPages(keys, &out));
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << "page " << i;
    ASSERT_EQ(out[i]->view(), pages[i].data->view()) << "page " << i;
  }
}

double Sample(prometheus::Registry& r, const std::string& name, const std::string& label,
              const std::string& value) {
  for (const auto& fam : r.Collect()) {
    if (fam.name != name) continue;
    for (const auto& m : fam.metric) {
      for (const auto& l : m.label) {
        if (l.name == label && l.value == value) {
          if (fam.type == prometheus::MetricType::Histogram) {
            return static_cast<double>(m.histogram.sample_count);
          }
          return fam.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
        }
      }
    }
  }
  return -1;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/strata_kvstore_service_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    server_metrics_ = std::make_unique<KvMetrics>(&server_registry_);
    KvStoreServerOptions o;
    o.listen_address = "127.0.0.1:0";
    o.store.path = dir_;
    o.store.write_buffer_bytes = 4 << 20;
    o.max_message_bytes = 1 << 20;
    o.service.max_keys_per_request = 1000;
    o.service.max_response_bytes = 64 << 10;  // several pages per message, several messages
    o.service.max_deferred_bytes = 200 << 10;  // a deferred stream stores several batches
    o.gc_interval_ms = 0;
    STRATA_ASSERT_OK_AND_ASSIGN(server_, KvStoreServer::Start(o, server_metrics_.get()));
    client_metrics_ = std::make_unique<KvMetrics>(&client_registry_);
    RemoteStoreOptions ro;
    ro.target = "127.0.0.1:" + std::to_string(server_->port());
    ro.timeout_ms = 10000;
    ro.max_message_bytes = 100 << 10;
    ro.metrics = client_metrics_.get();
    STRATA_ASSERT_OK_AND_ASSIGN(remote_, RemoteStore::Create(ro));
    STRATA_ASSERT_OK(remote_->WaitForReady(5000));
  }
  void TearDown() override {
    remote_.reset();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  // Creates and fully writes a document through the service; returns its id and writes.
  DocumentId WriteDocument(const v1::CreateDocumentRequest& r, uint64_t seed,
                           std::vector<PageWrite>* pages, std::vector<SummaryWrite>* summaries) {
    bool created = false;
    absl::StatusOr<v1::Document> doc = remote_->CreateDocument(r, &created);
    EXPECT_TRUE(doc.ok()) << doc.status();
    EXPECT_TRUE(created);
    MakeDocumentWrites(r, seed, pages, summaries);
    absl::Status s = remote_->Put(*pages, *summaries);
    EXPECT_TRUE(s.ok()) << s;
    return *DocumentId::FromHex(r.document_id());
  }

  std::string dir_;
  prometheus::Registry server_registry_, client_registry_;
  std::unique_ptr<KvMetrics> server_metrics_, client_metrics_;
  std::unique_ptr<KvStoreServer> server_;
  std::unique_ptr<RemoteStore> remote_;
};

TEST_F(ServiceTest, DocumentLifecycleAndBitExactPages) {
  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(3, 2, 16, 64), 100, kSeed);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  const DocumentId id = WriteDocument(r, kSeed, &pages, &summaries);
  ASSERT_EQ(pages.size(), 3u * 2 * 7);
  // Create again: not created, same document.
  bool created = true;
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document again, remote_->CreateDocument(r, &created));
  EXPECT_FALSE(created);
  EXPECT_EQ(again.state(), v1::DOCUMENT_STATE_WRITING);

  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document ready, remote_->FinalizeDocument(id));
  EXPECT_EQ(ready.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(ready.stored_pages(), pages.size());

  std::vector<PageKey> keys;
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) keys.push_back(it->key);  // any order
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(remote_->GetPages(keys, &out));
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_NE(out[i], nullptr) << i;
    EXPECT_EQ(out[i]->view(), pages[pages.size() - 1 - i].data->view()) << i;
  }
  std::vector<SummaryKey> skeys;
  for (const SummaryWrite& w : summaries) skeys.push_back(w.key);
  skeys.push_back(SummaryKey{id, 0, 0, 1, 6});  // exists
  STRATA_ASSERT_OK(remote_->GetSummaries(skeys, &out));
  for (size_t i = 0; i < summaries.size(); ++i) {
    ASSERT_NE(out[i], nullptr);
    EXPECT_EQ(out[i]->view(), summaries[i].data->view());
  }

  // Pin with TTL, list, delete.
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document pinned, remote_->PinDocument(id, true, 60));
  EXPECT_TRUE(pinned.pinned());
  EXPECT_GT(pinned.expire_time_micros(), 0);
  v1::ListDocumentsRequest list;
  list.set_state(v1::DOCUMENT_STATE_READY);
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<v1::Document> docs, remote_->ListDocuments(list));
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(docs[0].document_id(), id.ToHex());
  STRATA_ASSERT_OK(remote_->DeleteDocument(id));
  EXPECT_THAT(remote_->GetDocument(id), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(remote_->GetPages(keys, &out), StatusIs(absl::StatusCode::kNotFound));

  // Server-side metrics count what clients fetched.
  EXPECT_EQ(Sample(server_registry_, "strata_kv_lookups_total", "tier", "remote"),
            static_cast<double>(keys.size()));
  EXPECT_EQ(Sample(server_registry_, "strata_kv_hits_total", "tier", "remote"),
            static_cast<double>(keys.size()));
  EXPECT_GT(Sample(server_registry_, "strata_kv_fetch_bytes_total", "src", "disk"), 0);
  EXPECT_EQ(Sample(client_registry_, "strata_kv_hits_total", "tier", "remote"),
            static_cast<double>(keys.size()));
}

// Server-side TCP connections on `port` that are established (/proc/net/tcp and tcp6: local
// port `port`, state 01).
int EstablishedOnPort(int port) {
  int n = 0;
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const size_t colon = local.rfind(':');
      if (colon == std::string::npos || state != "01") continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) ++n;
    }
  }
  return n;
}

// Page bytes travel over data_channels connections, in turn (the other calls over the first);
// reads and writes through each are bit-exact. Out-of-range counts are refused.
TEST_F(ServiceTest, DataCallsTakeTheirConnectionsInTurn) {
  RemoteStoreOptions bad;
  bad.target = "127.0.0.1:1";
  bad.data_channels = 0;
  EXPECT_THAT(RemoteStore::Create(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  bad.data_channels = 65;
  EXPECT_THAT(RemoteStore::Create(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument));

  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(2, 2, 16, 64), 70, kSeed);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  const DocumentId id = WriteDocument(r, kSeed, &pages, &summaries);
  for (const int channels : {1, 3}) {
    SCOPED_TRACE(channels);
    const int before = EstablishedOnPort(server_->port());
    RemoteStoreOptions ro;
    ro.target = "127.0.0.1:" + std::to_string(server_->port());
    ro.data_channels = channels;
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RemoteStore> client, RemoteStore::Create(ro));
    STRATA_ASSERT_OK(client->WaitForReady(5000));
    for (int call = 0; call < 2 * channels; ++call) {
      SCOPED_TRACE(::testing::Message() << "call " << call);
      ASSERT_NO_FATAL_FAILURE(ExpectStoredPages(client.get(), pages));
      STRATA_ASSERT_OK(client->Put(absl::MakeSpan(pages).subspan(0, 2), {}));  // rewrites, same bytes
    }
    // The first connection is the one the fixture's client already holds (channels with the same
    // target and arguments share it); each further data channel has its own. The server's side of
    // a connection shows up apart from the calls (failed once in a loaded ctest run): the count
    // is waited for, 5 s at most.
    int opened = 0;
    for (int i = 0; i < 500; ++i) {
      opened = EstablishedOnPort(server_->port()) - before;
      if (opened == channels - 1) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(opened, channels - 1);
  }
  (void)id;
}

// A deferred budget below 1 byte, per stream or over all streams, is refused at start.
TEST(KvStoreServerOptionsTest, DeferredBudgetsMustBePositive) {
  KvStoreServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.store.path = ::testing::TempDir() + "/strata_kv_deferred_budget";
  o.service.max_deferred_bytes = 0;
  EXPECT_THAT(KvStoreServer::Start(o, nullptr).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.service.max_deferred_bytes = 1;
  o.service.max_deferred_total_bytes = 0;
  EXPECT_THAT(KvStoreServer::Start(o, nullptr).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.service.max_deferred_total_bytes = 1;
  EXPECT_TRUE(o.Validate().ok());
}

// PutDeferred: the stream's messages (100 KiB each) are gathered and stored as deferred batches
// (200 KiB at most here); the pages read back bit-exact, the document finalizes complete, and a
// READY document refuses more deferred writes with FAILED_PRECONDITION.
TEST_F(ServiceTest, DeferredStreamsStoreGatheredBatches) {
  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(3, 2, 16, 64), 200, kSeed);
  bool created = false;
  STRATA_ASSERT_OK(remote_->CreateDocument(r, &created).status());
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);
  const DocumentId id = *DocumentId::FromHex(r.document_id());
  // The pages (78 of 4 KiB: 312 KiB, more than one gathered batch) in one call, the summaries in a
  // second.
  ASSERT_GT(pages.size() * pages[0].data->size(), size_t{200} << 10);
  STRATA_ASSERT_OK(remote_->PutDeferred(pages, {}));
  STRATA_ASSERT_OK(remote_->PutDeferred({}, summaries));
  ASSERT_NO_FATAL_FAILURE(ExpectStoredPages(remote_.get(), pages));
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document ready, remote_->FinalizeDocument(id));
  EXPECT_EQ(ready.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(ready.stored_pages(), pages.size());
  EXPECT_EQ(ready.stored_summaries(), summaries.size());
  EXPECT_THAT(remote_->PutDeferred(absl::MakeSpan(pages).subspan(0, 1), {}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(ServiceTest, BadInputGetsCanonicalCodesAndStoresNothing) {
  const KvLayout layout = SmallLayout();
  const v1::CreateDocumentRequest r = MakeDocumentRequest(layout, 32, kSeed);
  bool created = false;
  STRATA_ASSERT_OK(remote_->CreateDocument(r, &created).status());
  const DocumentId id = *DocumentId::FromHex(r.document_id());
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  MakeDocumentWrites(r, kSeed, &pages, &summaries);

  // Malformed id and layouts.
  v1::CreateDocumentRequest bad = r;
  bad.set_document_id("xyz");
  EXPECT_THAT(remote_->CreateDocument(bad, &created), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = r;
  bad.mutable_layout()->set_dtype(v1::PAGE_DTYPE_UNSPECIFIED);
  EXPECT_THAT(remote_->CreateDocument(bad, &created), StatusIs(absl::StatusCode::kInvalidArgument));
  bad = r;
  bad.set_num_tokens(33);  // same id, different length
  EXPECT_THAT(remote_->CreateDocument(bad, &created),
              StatusIs(absl::StatusCode::kFailedPrecondition));

  // Wrong page size: a page of another head dim.
  std::vector<PageWrite> wrong = {PageWrite{
      pages[0].key, *PageBuffer::Copy(MakePage(SmallLayout(2, 2, 16, 16), 32, 0, 0, 0, 1))}};
  EXPECT_THAT(remote_->Put(wrong, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  // Unknown document.
  std::vector<PageWrite> unknown = {pages[0]};
  unknown[0].key.document.bytes[3] ^= 0xff;
  EXPECT_THAT(remote_->Put(unknown, {}), StatusIs(absl::StatusCode::kNotFound));
  std::vector<PageRef> out;
  std::vector<PageKey> unknown_keys = {unknown[0].key};
  EXPECT_THAT(remote_->GetPages(unknown_keys, &out), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(remote_->FinalizeDocument(unknown[0].key.document),
              StatusIs(absl::StatusCode::kNotFound));
  // Out-of-range read.
  std::vector<PageKey> outside = {PageKey{id, 5, 0, 0}};
  EXPECT_THAT(remote_->GetPages(outside, &out), StatusIs(absl::StatusCode::kInvalidArgument));
  // Too many keys in one request.
  std::vector<PageKey> many(1001, pages[0].key);
  EXPECT_THAT(remote_->GetPages(many, &out), StatusIs(absl::StatusCode::kResourceExhausted));
  // An oversized message (> 1 MiB server limit) in one PutPages message.
  {
    v1::PutPagesRequest big;
    big.set_document_id(id.ToHex());
    for (int i = 0; i < 600; ++i) {
      v1::Page* p = big.add_pages();
      *p->mutable_key() = v1::PageKey();
      p->set_data(std::string(pages[0].data->view()));
    }
    ASSERT_GT(big.ByteSizeLong(), 1u << 20);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PutPagesResponse resp;
    auto writer = remote_->stub()->PutPages(&ctx, &resp);
    writer->Write(big);
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  // Nothing stored half.
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document doc, remote_->GetDocument(id));
  EXPECT_EQ(doc.stored_pages(), 0u);
  EXPECT_THAT(remote_->FinalizeDocument(id), StatusIs(absl::StatusCode::kFailedPrecondition));

  // Complete it; then writes to the READY document fail.
  STRATA_ASSERT_OK(remote_->Put(pages, summaries));
  STRATA_ASSERT_OK(remote_->FinalizeDocument(id).status());
  // GetDocument counts the stored pages on the server; GetDocumentInfo (skip_counts) does not.
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document counted, remote_->GetDocument(id));
  EXPECT_EQ(counted.stored_pages(), pages.size());
  STRATA_ASSERT_OK_AND_ASSIGN(v1::Document info, remote_->GetDocumentInfo(id));
  EXPECT_EQ(info.state(), v1::DOCUMENT_STATE_READY);
  EXPECT_EQ(info.num_tokens(), counted.num_tokens());
  EXPECT_EQ(info.stored_pages(), 0u);
  EXPECT_THAT(remote_->Put({pages[0]}, {}), StatusIs(absl::StatusCode::kFailedPrecondition));

  // A flipped byte in a stored page is DATA_LOSS, never served.
  STRATA_ASSERT_OK_AND_ASSIGN(std::string raw, server_->store()->RawPageForTesting(pages[1].key));
  raw[200] ^= 0x20;
  STRATA_ASSERT_OK(server_->store()->OverwriteRawPageForTesting(pages[1].key, raw));
  std::vector<PageKey> two = {pages[0].key, pages[1].key};
  EXPECT_THAT(remote_->GetPages(two, &out), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_EQ(out[0], nullptr);
  EXPECT_EQ(out[1], nullptr);
}

TEST_F(ServiceTest, TieredReadsFillTheHostCache) {
  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(), 64, kSeed);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  const DocumentId id = WriteDocument(r, kSeed, &pages, &summaries);
  STRATA_ASSERT_OK(remote_->FinalizeDocument(id).status());

  HostCacheOptions ho;
  ho.capacity_bytes = 1 << 20;
  ho.metrics = client_metrics_.get();
  STRATA_ASSERT_OK_AND_ASSIGN(auto host, HostCache::Create(ho));
  TieredStoreOptions to;
  to.host = host.get();
  to.remote = remote_.get();
  STRATA_ASSERT_OK_AND_ASSIGN(auto tiered, TieredStore::Create(to));
  std::vector<PageKey> keys;
  for (const PageWrite& w : pages) keys.push_back(w.key);
  keys.push_back(PageKey{id, 0, 0, 2});
  keys.push_back(PageKey{id, 0, 0, 2});
  std::vector<PageRef> out;
  STRATA_ASSERT_OK(tiered->GetPages(keys, &out));
  for (size_t i = 0; i < pages.size(); ++i) {
    ASSERT_NE(out[i], nullptr);
    EXPECT_EQ(out[i]->view(), pages[i].data->view());
  }
  EXPECT_EQ(Sample(client_registry_, "strata_kv_hits_total", "tier", "host"), 0);
  STRATA_ASSERT_OK(tiered->GetPages(keys, &out));
  EXPECT_EQ(Sample(client_registry_, "strata_kv_lookups_total", "tier", "host"),
            2.0 * keys.size());
  EXPECT_EQ(Sample(client_registry_, "strata_kv_hits_total", "tier", "host"),
            static_cast<double>(keys.size()));
  EXPECT_EQ(Sample(client_registry_, "strata_kv_lookups_total", "tier", "remote"),
            static_cast<double>(keys.size()));
  EXPECT_EQ(Sample(client_registry_, "strata_kv_fetch_duration_seconds", "tier", "remote"), 1);
  EXPECT_EQ(host->num_entries(), static_cast<int64_t>(pages.size()));
  EXPECT_GT(Sample(client_registry_, "strata_kv_fetch_bytes_total", "src", "remote"), 0);
}

TEST_F(ServiceTest, HealthAndSummaryScan) {
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                     grpc::InsecureChannelCredentials());
  STRATA_ASSERT_OK_AND_ASSIGN(int overall, testing::CheckHealth(channel, ""));
  EXPECT_EQ(overall, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(int kv, testing::CheckHealth(channel, "strata.v1.KvStore"));
  EXPECT_EQ(kv, 1);
  EXPECT_THAT(testing::CheckHealth(channel, "no.such.Service"),
              StatusIs(absl::StatusCode::kNotFound));
  STRATA_ASSERT_OK_AND_ASSIGN(std::string services, testing::ListServicesByReflection(channel));
  EXPECT_NE(services.find("strata.v1.KvStore"), std::string::npos) << services;
  EXPECT_NE(services.find("grpc.health.v1.Health"), std::string::npos);

  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(), 48, kSeed);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  const DocumentId id = WriteDocument(r, kSeed, &pages, &summaries);
  v1::GetSummariesRequest req;
  req.set_document_id(id.ToHex());
  req.add_kinds(1);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = remote_->stub()->GetSummaries(&ctx, req);
  v1::GetSummariesResponse resp;
  size_t n = 0;
  while (reader->Read(&resp)) n += resp.summaries_size();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(n, summaries.size());
}

// No request harms the service: random requests and valid ones with a few fields changed (a page's
// bytes, keys past the document, unknown states, a summary for a page) to every method get an
// answer or a canonical error, never UNKNOWN, INTERNAL or UNIMPLEMENTED; the server then still
// serves, and the document it held reads back as written.
TEST_F(ServiceTest, RandomRequestsGetCanonicalAnswers) {
  const v1::CreateDocumentRequest r = MakeDocumentRequest(SmallLayout(2, 2, 16, 64), 60, kSeed);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  const DocumentId id = WriteDocument(r, kSeed, &pages, &summaries);
  STRATA_ASSERT_OK(remote_->FinalizeDocument(id).status());
  // A second document left WRITING, for the writes to land on.
  const v1::CreateDocumentRequest w = MakeDocumentRequest(SmallLayout(2, 2, 16, 64), 40, kSeed + 1);
  bool created = false;
  STRATA_ASSERT_OK(remote_->CreateDocument(w, &created).status());
  std::vector<PageWrite> w_pages;
  std::vector<SummaryWrite> w_summaries;
  MakeDocumentWrites(w, kSeed + 1, &w_pages, &w_summaries);

  proto::testing::RandomRequestOptions o;
  // The READY document is named by the seeds of the methods that read it only (no request can
  // delete it: DeleteDocument's seed and known strings name the WRITING one).
  o.known_strings = {w.document_id()};
  auto seed = [&o](const std::string& method, const google::protobuf::Message& m) {
    o.seeds[method].push_back({m.SerializeAsString()});
  };
  v1::GetPagesRequest get;
  get.set_document_id(r.document_id());
  for (size_t i = 0; i < 6 && i < pages.size(); ++i) {
    v1::PageKey* k = get.add_keys();
    k->set_layer(pages[i].key.layer);
    k->set_kv_head(pages[i].key.kv_head);
    k->set_page_index(pages[i].key.page_index);
  }
  seed("GetPages", get);
  v1::GetSummariesRequest sums;
  sums.set_document_id(r.document_id());
  sums.add_kinds(1);
  seed("GetSummaries", sums);
  seed("CreateDocument", w);
  v1::PutPagesRequest put;
  put.set_document_id(w.document_id());
  for (size_t i = 0; i < 2 && i < w_pages.size(); ++i) {
    v1::Page* p = put.add_pages();
    p->mutable_key()->set_layer(w_pages[i].key.layer);
    p->mutable_key()->set_kv_head(w_pages[i].key.kv_head);
    p->mutable_key()->set_page_index(w_pages[i].key.page_index);
    p->set_data(std::string(w_pages[i].data->view()));
  }
  o.seeds["PutPages"].push_back({put.SerializeAsString()});
  put.set_deferred(true);
  o.seeds["PutPages"].push_back({put.SerializeAsString(), put.SerializeAsString()});
  v1::PinDocumentRequest ref;
  ref.set_document_id(r.document_id());
  ref.set_pinned(true);
  ref.set_ttl_seconds(60);
  for (const char* m : {"GetDocument", "PinDocument", "FinalizeDocument"}) seed(m, ref);  // document_id is field 1
  v1::DeleteDocumentRequest del;
  del.set_document_id(w.document_id());
  seed("DeleteDocument", del);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials());
  const std::vector<proto::testing::RandomCall> calls =
      proto::testing::CallWithRandomRequests(channel, "strata.v1.KvStore", 40, 20261130, o, 2.0);
  EXPECT_EQ(calls.size(), 40u * 9);
  const std::vector<proto::testing::RandomCall> bad = proto::testing::UnexpectedCodes(calls);
  EXPECT_TRUE(bad.empty()) << proto::testing::Describe(bad);
  EXPECT_GT(proto::testing::CountAnswered(calls), 20);
  // The READY document reads back as written: no write reached it (it is READY) and nothing
  // named it to delete it.
  STRATA_ASSERT_OK_AND_ASSIGN(const v1::Document doc, remote_->GetDocument(id));
  EXPECT_EQ(doc.state(), v1::DOCUMENT_STATE_READY);
  ExpectStoredPages(remote_.get(), pages);
  STRATA_ASSERT_OK_AND_ASSIGN(int health, testing::CheckHealth(channel, ""));
  EXPECT_EQ(health, 1);
}

}  // namespace
}  // namespace strata::kvstore
