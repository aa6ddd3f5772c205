// Page get/put throughput and latency per tier: host cache, local RocksDB store, and the KV store
// service over loopback gRPC (in-process server), for 64-token bf16 pages of head dim 128
// (32 KiB + 32-byte header), single pages and batches of 64. Also RocksDB settings variants
// (blob files, LZ4) for the local store. Results: bench/RESULTS.md.
//
//   build/bin/kvstore_benchmark --benchmark_min_time=1
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "benchmark/benchmark.h"
#include "kvstore/host_cache.h"
#include "kvstore/local_store.h"
#include "kvstore/page_format.h"
#include "kvstore/remote_store.h"
#include "kvstore/service.h"
#ifdef STRATA_BENCH_TEST_PAGES
#include "kvstore/testing/test_pages.h"
#endif
#include "prometheus/registry.h"
#include "rocksdb/db.h"

namespace strata::kvstore {
namespace {

constexpr int kPageTokens = 64;
constexpr int kHeadDim = 128;
constexpr uint32_t kPages = 2048;  // 64 MiB of pages per store

KvLayout Layout() {
  KvLayout l;
  l.num_layers = 1;
  l.num_kv_heads = 1;
  l.page = PageShape{kernels::DType::kBF16, kPageTokens, kHeadDim};
  return l;
}

// K and V drawn from N(0, 1) and rounded to bf16: the value distribution of real KV (not
// uniformly random bits), so compressibility is measured on plausible data.
std::vector<PageRef> MakePages(uint32_t n) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> k(kPageTokens * kHeadDim), v(k.size());
  std::vector<PageRef> pages;
  for (uint32_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < k.size(); ++j) {
      k[j] = dist(rng);
      v[j] = dist(rng);
    }
    absl::StatusOr<std::string> p = EncodePage(
        Layout().page, kernels::TensorView(k.data(), kernels::DType::kF32, {kPageTokens, kHeadDim}),
        kernels::TensorView(v.data(), kernels::DType::kF32, {kPageTokens, kHeadDim}));
    STRATA_CHECK(p.ok());
    pages.push_back(*PageBuffer::Copy(*p));
  }
  return pages;
}

const std::vector<PageRef>& Pages() {
  static const std::vector<PageRef>* pages = new std::vector<PageRef>(MakePages(kPages));
  return *pages;
}

v1::CreateDocumentRequest DocRequest(uint32_t doc_index) {
  std::vector<int32_t> tokens(static_cast<size_t>(kPages) * kPageTokens, 0);
  tokens[0] = static_cast<int32_t>(doc_index);
  absl::StatusOr<DocumentIdentity> id = ComputeDocumentIdentity("bench-model", Layout(), tokens);
  STRATA_CHECK(id.ok());
  v1::CreateDocumentRequest r;
  r.set_document_id(id->id.ToHex());
  r.set_model_fingerprint("bench-model");
  *r.mutable_layout() = LayoutToProto(Layout());
  r.set_num_tokens(tokens.size());
  return r;
}

std::vector<PageWrite> Writes(const DocumentId& doc, uint32_t first, uint32_t n) {
  std::vector<PageWrite> w;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t idx = (first + i) % kPages;
    w.push_back(PageWrite{PageKey{doc, 0, 0, idx}, Pages()[idx]});
  }
  return w;
}

std::vector<PageKey> RandomKeys(const DocumentId& doc, uint32_t n, std::mt19937* rng) {
  std::vector<PageKey> keys;
  for (uint32_t i = 0; i < n; ++i) keys.push_back(PageKey{doc, 0, 0, (*rng)() % kPages});
  return keys;
}

void SetCounters(benchmark::State& state, int64_t pages_per_iter) {
  const int64_t n = state.iterations() * pages_per_iter;
  state.SetItemsProcessed(n);
  state.SetBytesProcessed(n * static_cast<int64_t>(Pages()[0]->size()));
}

std::string TempDir() {
  char tmpl[] = "/tmp/strata_kvstore_bench.XXXXXX";
  STRATA_CHECK(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

// ---- host cache ----

void BM_HostGet(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  HostCacheOptions o;
  o.capacity_bytes = int64_t{1} << 30;
  auto cache = *HostCache::Create(o);
  DocumentId doc;
  STRATA_CHECK(cache->Put(Writes(doc, 0, kPages), {}).ok());
  std::mt19937 rng(1);
  std::vector<PageRef> out;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<PageKey> keys = RandomKeys(doc, batch, &rng);
    state.ResumeTiming();
    STRATA_CHECK(cache->GetPages(keys, &out).ok());
    benchmark::DoNotOptimize(out.data());
  }
  SetCounters(state, batch);
}
BENCHMARK(BM_HostGet)->Arg(1)->Arg(64)->UseRealTime();

void BM_HostPut(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  HostCacheOptions o;
  o.capacity_bytes = int64_t{32} << 20;  // half the pages: puts evict
  auto cache = *HostCache::Create(o);
  DocumentId doc;
  uint32_t next = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<PageWrite> w = Writes(doc, next, batch);
    next += batch;
    state.ResumeTiming();
    STRATA_CHECK(cache->Put(w, {}).ok());
  }
  SetCounters(state, batch);
}
BENCHMARK(BM_HostPut)->Arg(1)->Arg(64)->UseRealTime();

// HostCache::PeekPages over every page of a document of state.range(0) pages (32 layers x 8 KV
// heads x pages / 256 each; 2^21 = an 8B model's 512K-token document at P = 64), one call per
// (layer, KV head) as the worker's resident-mode check makes them. Tiny page bodies: the cost is
// the keys and the map, not the bytes.
void BM_HostPeekWholeDocument(benchmark::State& state) {
  const uint32_t total = static_cast<uint32_t>(state.range(0));
  const uint32_t per_head = total / 256;
  HostCacheOptions o;
  o.capacity_bytes = int64_t{1} << 40;
  auto cache = *HostCache::Create(o);
  DocumentId doc;
  std::vector<PageWrite> writes;
  const PageRef body = *PageBuffer::Copy(std::string(16, 'p'));
  for (uint32_t i = 0; i < total; ++i) {
    writes.push_back(PageWrite{PageKey{doc, i / per_head / 8, i / per_head % 8, i % per_head}, body});
  }
  STRATA_CHECK(cache->Put(writes, {}).ok());
  writes.clear();
  std::vector<PageKey> keys(per_head);
  std::vector<PageRef> out;
  for (auto _ : state) {
    int64_t found = 0;
    for (uint32_t lh = 0; lh < 256; ++lh) {
      for (uint32_t p = 0; p < per_head; ++p) keys[p] = PageKey{doc, lh / 8, lh % 8, p};
      cache->PeekPages(keys, &out);
      for (const PageRef& r : out) found += r != nullptr;
    }
    STRATA_CHECK(found == total);
  }
  // Pages peeked per second of the whole-document check.
  state.counters["pages_per_s"] = benchmark::Counter(static_cast<double>(total),
                                                     benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_HostPeekWholeDocument)
    ->Arg(1 << 18)
    ->Arg(1 << 21)
    ->Iterations(3)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// ---- local RocksDB store ----

struct LocalEnv {
  std::string dir;
  std::unique_ptr<LocalStore> store;
  DocumentId doc;
};

// args: blob files (0/1), LZ4 (0/1)
std::unique_ptr<LocalEnv> OpenLocal(bool blob, bool lz4, bool populate) {
  auto env = std::make_unique<LocalEnv>();
  env->dir = TempDir();
  LocalStoreOptions o;
  o.path = env->dir;
  o.blob_files = blob;
  o.compression = lz4;
  o.block_cache_bytes = int64_t{8} << 20;  // 1/8 of the pages: most reads miss the cache
  env->store = *LocalStore::Open(o);
  const v1::CreateDocumentRequest r = DocRequest(0);
  bool created = false;
  STRATA_CHECK(env->store->CreateDocument(r, &created).ok());
  env->doc = *DocumentId::FromHex(r.document_id());
  if (populate) {
    for (uint32_t i = 0; i < kPages; i += 256) {
      STRATA_CHECK(env->store->Put(Writes(env->doc, i, 256), {}).ok());
    }
    STRATA_CHECK(env->store->Flush().ok());
  }
  return env;
}

void CloseLocal(std::unique_ptr<LocalEnv> env) {
  const std::string dir = env->dir;
  env.reset();
  std::filesystem::remove_all(dir);
}

void BM_LocalGet(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  auto env = OpenLocal(state.range(1) != 0, state.range(2) != 0, /*populate=*/true);
  std::mt19937 rng(2);
  std::vector<PageRef> out;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<PageKey> keys = RandomKeys(env->doc, batch, &rng);
    state.ResumeTiming();
    STRATA_CHECK(env->store->GetPages(keys, &out).ok());
  }
  SetCounters(state, batch);
  CloseLocal(std::move(env));
}
BENCHMARK(BM_LocalGet)
    ->ArgNames({"batch", "blob", "lz4"})
    ->Args({1, 1, 0})->Args({64, 1, 0})->Args({1, 0, 0})->Args({64, 0, 0})->Args({64, 1, 1})
    ->UseRealTime();

void BM_LocalPut(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  auto env = OpenLocal(state.range(1) != 0, state.range(2) != 0, /*populate=*/false);
  uint32_t next = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<PageWrite> w = Writes(env->doc, next, batch);
    next += batch;
    state.ResumeTiming();
    STRATA_CHECK(env->store->Put(w, {}).ok());  // WAL synced before it returns
  }
  SetCounters(state, batch);
  // Bytes on disk after a flush, per page byte written (compression ratio of the settings).
  STRATA_CHECK(env->store->Flush().ok());
  uint64_t on_disk = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(env->dir)) {
    const std::string ext = e.path().extension().string();
    if (e.is_regular_file() && (ext == ".sst" || ext == ".blob")) on_disk += e.file_size();
  }
  const uint64_t distinct = std::min<uint64_t>(next, kPages);
  state.counters["disk_bytes_per_page_byte"] =
      static_cast<double>(on_disk) / static_cast<double>(distinct * Pages()[0]->size());
  CloseLocal(std::move(env));
}
BENCHMARK(BM_LocalPut)
    ->ArgNames({"batch", "blob", "lz4"})
    ->Args({1, 1, 0})->Args({64, 1, 0})->Args({1, 0, 0})->Args({64, 0, 0})->Args({64, 1, 1})
    ->Args({64, 0, 1})
    ->UseRealTime();

// Bytes the process wrote to storage (/proc/self/io write_bytes).
int64_t ProcessWriteBytes() {
  FILE* f = std::fopen("/proc/self/io", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t v = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "write_bytes: %lld", reinterpret_cast<long long*>(&v)) == 1) break;
  }
  std::fclose(f);
  return v;
}

// Write amplification of loading 1 GiB of pages the way prefill writes them: 8 layers x 8 KV
// heads, one page per (layer, head) per 64-token chunk, one batch of 64 pages per chunk, so
// successive batches interleave in key order. Reported: storage bytes written by the process
// (/proc/self/io write_bytes: WAL + flushes + compactions, after compactions settle) per page
// byte. A small write buffer makes the LSM tree grow levels as a large store does.
// Creates (WRITING) a document of `layers` x `heads` and pages_per_head pages of Layout()'s shape.
DocumentId CreateBenchDocument(LocalStore* store, uint32_t layers, uint32_t heads, uint32_t pages_per_head) {
  std::vector<int32_t> tokens(static_cast<size_t>(pages_per_head) * kPageTokens, 7);
  KvLayout layout = Layout();
  layout.num_layers = layers;
  layout.num_kv_heads = heads;
  const DocumentId doc = ComputeDocumentIdentity("bench-model", layout, tokens)->id;
  v1::CreateDocumentRequest r;
  r.set_document_id(doc.ToHex());
  r.set_model_fingerprint("bench-model");
  *r.mutable_layout() = LayoutToProto(layout);
  r.set_num_tokens(tokens.size());
  bool created = false;
  STRATA_CHECK(store->CreateDocument(r, &created).ok());
  return doc;
}

void BM_LocalWriteAmplification(benchmark::State& state) {
  const bool blob = state.range(0) != 0;
  const uint32_t layers = 8, heads = 8, pages_per_head = 512;  // 32768 pages, 1 GiB
  for (auto _ : state) {
    const std::string dir = TempDir();
    LocalStoreOptions o;
    o.path = dir;
    o.blob_files = blob;
    o.write_buffer_bytes = 4 << 20;
    auto store = *LocalStore::Open(o);
    const DocumentId doc = CreateBenchDocument(store.get(), layers, heads, pages_per_head);
    const uint32_t total = layers * heads * pages_per_head;
    const int64_t before = ProcessWriteBytes();
    for (uint32_t p = 0; p < pages_per_head; ++p) {
      std::vector<PageWrite> w;
      for (uint32_t l = 0; l < layers; ++l) {
        for (uint32_t h = 0; h < heads; ++h) {
          w.push_back(PageWrite{PageKey{doc, l, h, p}, Pages()[(p * 64 + l * heads + h) % kPages]});
        }
      }
      STRATA_CHECK(store->Put(w, {}).ok());
    }
    STRATA_CHECK(store->Flush().ok());
    int64_t last = ProcessWriteBytes(), stable_for_ms = 0;
    for (int waited = 0; waited < 120000 && stable_for_ms < 3000; waited += 500) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      const int64_t now = ProcessWriteBytes();
      stable_for_ms = now == last ? stable_for_ms + 500 : 0;
      last = now;
    }
    const double user = static_cast<double>(total) * static_cast<double>(Pages()[0]->size());
    state.counters["write_amplification"] = static_cast<double>(last - before) / user;
    store.reset();
    std::filesystem::remove_all(dir);
  }
}
BENCHMARK(BM_LocalWriteAmplification)->ArgName("blob")->Arg(0)->Arg(1)->Iterations(1)
    ->UseRealTime()->Unit(benchmark::kSecond);

// A document persisted the way the worker's PrefillShard writes it: per prefill chunk one batch of
// the chunk's new pages of every (layer, KV head) (32 layers x 8 KV heads, 8 pages each: 2048
// pages, 64 MiB), 8 chunks (512 MiB), split over several writer threads, with PutDeferred (as
// the worker) or Put, then a flush. Args: writer threads, values in blob files (0/1), deferred
// (0/1). Counter: MB/s of page bytes. STRATA_BENCH_DIR picks the parent folder (default /tmp;
// /dev/shm takes the disk out).
void BM_LocalPrefillLoad(benchmark::State& state) {
  const int writers = static_cast<int>(state.range(0));
  // deferred: 0 Put (WAL synced), 1 PutDeferred through the memtables (no WAL), 2 PutDeferred
  // ingested as SST files (LocalStoreOptions::ingest_deferred, the default).
  const bool blob = state.range(1) != 0, deferred = state.range(2) != 0;
  const bool ingest = state.range(2) == 2;
  const uint32_t layers = 32, heads = 8, chunk_pages = 16, chunks = 4;
  const char* parent = std::getenv("STRATA_BENCH_DIR");
  (void)Pages();  // made before the clock starts
  for (auto _ : state) {
    std::string tmpl = std::string(parent != nullptr ? parent : "/tmp") + "/strata_prefill_load.XXXXXX";
    STRATA_CHECK(mkdtemp(tmpl.data()) != nullptr);
    const std::string dir = tmpl;
    LocalStoreOptions o;
    o.path = dir;
    o.blob_files = blob;
    o.ingest_deferred = ingest;
    auto store = *LocalStore::Open(o);
    auto put = [&](const std::vector<PageWrite>& w) {
      STRATA_CHECK((deferred ? store->PutDeferred(w, {}) : store->Put(w, {})).ok());
    };
    const DocumentId doc = CreateBenchDocument(store.get(), layers, heads, chunk_pages * chunks);
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t c = 0; c < chunks; ++c) {
      // As the worker's prefill splits a chunk: writer w takes a contiguous range of its pages
      // (every layer and KV head of them).
      std::vector<std::vector<PageWrite>> parts(static_cast<size_t>(writers));
      uint32_t i = 0;
      for (uint32_t l = 0; l < layers; ++l) {
        for (uint32_t h = 0; h < heads; ++h) {
          for (uint32_t p = c * chunk_pages; p < (c + 1) * chunk_pages; ++p, ++i) {
            const uint32_t w = (p - c * chunk_pages) * static_cast<uint32_t>(writers) / chunk_pages;
            parts[w].push_back(PageWrite{PageKey{doc, l, h, p}, Pages()[i % kPages]});
          }
        }
      }
      std::vector<std::thread> threads;
      for (int w = 1; w < writers; ++w) {
        threads.emplace_back([&, w]() { put(parts[w]); });
      }
      put(parts[0]);
      for (std::thread& t : threads) t.join();
    }
    STRATA_CHECK(store->Flush().ok());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double bytes = static_cast<double>(layers) * heads * chunk_pages * chunks * Pages()[0]->size();
    state.counters["MB_per_s"] = bytes / s / 1e6;
    store.reset();
    std::filesystem::remove_all(dir);
  }
}
BENCHMARK(BM_LocalPrefillLoad)->ArgNames({"writers", "blob", "deferred"})
    ->Args({1, 1, 0})->Args({1, 1, 1})->Args({4, 1, 1})->Args({8, 1, 1})
    ->Args({1, 0, 1})->Args({4, 0, 1})->Args({8, 0, 1})
    ->Args({1, 0, 2})->Args({4, 0, 2})->Args({8, 0, 2})->Iterations(1)->UseRealTime()
    ->Unit(benchmark::kSecond);

#ifdef STRATA_BENCH_TEST_PAGES
// A prefill's writes and its FinalizeDocument at the scale of a 256K-token shard's index: 32
// layers x 8 KV heads x 8192 pages of 16 tokens, head dim 16 (small pages: 2.1M pages and 2.1M
// summaries in ~3 GB), written as the worker writes them (chunks of 64 pages, each as four (by default)
// concurrent PutDeferred batches of contiguous page ranges with their summaries), then
// FinalizeDocument timed alone (its completeness check: the store's write tally since session 11,
// a count of the document's index entries before), then a count of the index entries
// (GetDocument of the READY document: what FinalizeDocument did before; count_s).
// Arg: 1 batches ingested as SST files (the default), 0 through the memtables. Env
// STRATA_BENCH_WRITERS: batches per chunk (default 4; the worker writes up to 8 since session 11).
void BM_LocalPrefillFinalize(benchmark::State& state) {
  const bool ingest = state.range(0) != 0;
  const uint32_t pages_per_head = 8192, chunk_pages = 64;
  const uint32_t writers = std::getenv("STRATA_BENCH_WRITERS") != nullptr ? std::atoi(std::getenv("STRATA_BENCH_WRITERS")) : 4;
  const KvLayout layout = testing::SmallLayout(32, 8, 16, 16);
  const v1::CreateDocumentRequest r = testing::MakeDocumentRequest(layout, uint64_t{pages_per_head} * 16, 5);
  std::vector<PageWrite> pages;
  std::vector<SummaryWrite> summaries;
  testing::MakeDocumentWrites(r, 5, &pages, &summaries);  // (layer, head, page) order
  const char* parent = std::getenv("STRATA_BENCH_DIR");
  for (auto _ : state) {
    std::string tmpl = std::string(parent != nullptr ? parent : "/tmp") + "/strata_prefill_finalize.XXXXXX";
    STRATA_CHECK(mkdtemp(tmpl.data()) != nullptr);
    const std::string dir = tmpl;
    LocalStoreOptions o;
    o.path = dir;
    o.ingest_deferred = ingest;
    auto store = *LocalStore::Open(o);
    bool created = false;
    STRATA_CHECK(store->CreateDocument(r, &created).ok());
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t c = 0; c < pages_per_head / chunk_pages; ++c) {
      std::vector<std::vector<PageWrite>> pw(writers);
      std::vector<std::vector<SummaryWrite>> sw(writers);
      for (uint32_t lh = 0; lh < 32 * 8; ++lh) {
        for (uint32_t p = c * chunk_pages; p < (c + 1) * chunk_pages; ++p) {
          const size_t i = size_t{lh} * pages_per_head + p;
          const uint32_t w = (p - c * chunk_pages) * writers / chunk_pages;
          pw[w].push_back(pages[i]);
          sw[w].push_back(summaries[i]);
        }
      }
      std::vector<std::thread> threads;
      for (uint32_t w = 0; w < writers; ++w) {
        threads.emplace_back([&, w] { STRATA_CHECK(store->PutDeferred(pw[w], sw[w]).ok()); });
      }
      for (std::thread& t : threads) t.join();
    }
    const auto t1 = std::chrono::steady_clock::now();
    auto ready = store->FinalizeDocument(*DocumentId::FromHex(r.document_id()));
    const auto t2 = std::chrono::steady_clock::now();
    STRATA_CHECK(ready.ok()) << ready.status();
    auto again = store->GetDocument(*DocumentId::FromHex(r.document_id()));  // READY: counted
    const auto t3 = std::chrono::steady_clock::now();
    STRATA_CHECK(again.ok()) << again.status();
    STRATA_CHECK(again->stored_pages() == ready->stored_pages() &&
                 again->stored_summaries() == ready->stored_summaries());
    state.counters["write_s"] = std::chrono::duration<double>(t1 - t0).count();
    state.counters["finalize_s"] = std::chrono::duration<double>(t2 - t1).count();
    state.counters["count_s"] = std::chrono::duration<double>(t3 - t2).count();
    store.reset();
    std::filesystem::remove_all(dir);
  }
}
BENCHMARK(BM_LocalPrefillFinalize)->ArgNames({"ingest"})->Arg(1)->Arg(0)->Iterations(1)->UseRealTime()
    ->Unit(benchmark::kSecond);
#endif  // STRATA_BENCH_TEST_PAGES

// ---- remote: KV store service over loopback ----

struct RemoteEnv {
  std::string dir;
  prometheus::Registry registry;
  std::unique_ptr<KvMetrics> metrics;
  std::unique_ptr<KvStoreServer> server;
  std::unique_ptr<RemoteStore> client;
  DocumentId doc;
};

std::unique_ptr<RemoteEnv> StartRemote(bool populate, int data_channels = RemoteStoreOptions().data_channels) {
  auto env = std::make_unique<RemoteEnv>();
  env->dir = TempDir();
  env->metrics = std::make_unique<KvMetrics>(&env->registry);
  KvStoreServerOptions o;
  o.listen_address = "127.0.0.1:0";
  o.store.path = env->dir;
  o.gc_interval_ms = 0;
  env->server = *KvStoreServer::Start(o, env->metrics.get());
  RemoteStoreOptions ro;
  ro.target = absl::StrCat("127.0.0.1:", env->server->port());
  ro.data_channels = data_channels;
  env->client = *RemoteStore::Create(ro);
  STRATA_CHECK(env->client->WaitForReady(5000).ok());
  const v1::CreateDocumentRequest r = DocRequest(1);
  bool created = false;
  STRATA_CHECK(env->client->CreateDocument(r, &created).ok());
  env->doc = *DocumentId::FromHex(r.document_id());
  if (populate) {
    for (uint32_t i = 0; i < kPages; i += 256) {
      STRATA_CHECK(env->client->Put(Writes(env->doc, i, 256), {}).ok());
    }
    STRATA_CHECK(env->server->store()->Flush().ok());
  }
  return env;
}

void StopRemote(std::unique_ptr<RemoteEnv> env) {
  const std::string dir = env->dir;
  env->client.reset();
  env->server.reset();
  env.reset();
  std::filesystem::remove_all(dir);
}

void BM_RemoteGet(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  auto env = StartRemote(/*populate=*/true);
  std::mt19937 rng(3);
  std::vector<PageRef> out;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<PageKey> keys = RandomKeys(env->doc, batch, &rng);
    state.ResumeTiming();
    STRATA_CHECK(env->client->GetPages(keys, &out).ok());
  }
  SetCounters(state, batch);
  StopRemote(std::move(env));
}
BENCHMARK(BM_RemoteGet)->Arg(1)->Arg(64)->UseRealTime();

// A bulk read as a worker's mount makes it (worker/worker.cc LoadPages): `readers` threads at once,
// each reading 512 consecutive pages (16 MiB) per request over the one client with `channels`
// data connections (RemoteStoreOptions::data_channels), the whole store (64 MiB) per iteration.
void BM_RemoteBulkRead(benchmark::State& state) {
  const int readers = static_cast<int>(state.range(0));
  constexpr uint32_t kBatch = 512;
  auto env = StartRemote(/*populate=*/true, static_cast<int>(state.range(1)));
  for (auto _ : state) {
    std::vector<std::thread> threads;
    std::vector<absl::Status> status(kPages / kBatch);
    std::atomic<uint32_t> next{0};
    for (int r = 0; r < readers; ++r) {
      threads.emplace_back([&]() {
        for (uint32_t b; (b = next.fetch_add(1)) < kPages / kBatch;) {
          std::vector<PageKey> keys;
          for (uint32_t i = 0; i < kBatch; ++i) keys.push_back(PageKey{env->doc, 0, 0, b * kBatch + i});
          std::vector<PageRef> out;
          status[b] = env->client->GetPages(keys, &out);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& st : status) STRATA_CHECK(st.ok());
  }
  SetCounters(state, kPages);
  StopRemote(std::move(env));
}
BENCHMARK(BM_RemoteBulkRead)
    ->ArgNames({"readers", "channels"})
    ->Args({1, 1})
    ->Args({4, 1})
    ->Args({4, 4})
    ->UseRealTime();

void BM_RemotePut(benchmark::State& state) {
  const uint32_t batch = static_cast<uint32_t>(state.range(0));
  auto env = StartRemote(/*populate=*/false);
  uint32_t next = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<PageWrite> w = Writes(env->doc, next, batch);
    next += batch;
    state.ResumeTiming();
    STRATA_CHECK(env->client->Put(w, {}).ok());
  }
  SetCounters(state, batch);
  StopRemote(std::move(env));
}
BENCHMARK(BM_RemotePut)->Arg(1)->Arg(64)->UseRealTime();

}  // namespace
}  // namespace strata::kvstore

BENCHMARK_MAIN();
