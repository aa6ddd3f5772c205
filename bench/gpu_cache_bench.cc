// gpu_cache_bench: the GPU page cache (kvstore/gpu_cache.h) replaying a decode selection trace,
// and the throughput of its fill op (Backend::PageCopy) from pinned host memory.
//
// Trace: a document of --context tokens in pages of --page_size tokens for --layers x --kv_heads
// (default: Llama-3.1-8B, 32 x 8, d = 128, bf16, 512K tokens: 2M pages, 64 GiB of KV). Each decode
// step, every layer acquires the pages of its 8 KV heads (one Acquire per layer, as a decode
// would; the step's pins are released at its end): the sink page, the last --window_pages pages
// and --budget_tokens / page_size selected pages per KV head. Selections drift: each step every
// selected page is replaced with probability --drift; a replacement is, with probability
// --revisit, a page this head dropped recently (attention returning to a passage), else a
// uniformly random page. The cache has --resident (fraction of all KV) slots. Warm-up runs until
// --warmup_fills x num_slots pages were filled (the cache has turned over, so evictions are in
// steady state); then --steps steps are measured: hit ratio, misses and fill time per step (host
// gather and waits).
//
// The host tier is a synthetic PageStore: every page key maps onto one of --distinct_pages encoded
// bf16 pages held in host memory (default 16384 = 512 MiB, beyond the CPU caches), so that 64 GiB
// of KV need not exist in host memory; the cache's gather and copy do the same work as with real
// pages. With --in_place=1 (default) those pages live in Backend::AllocateHost memory
// (BackendPageAllocator) and the fills read them in place; --in_place=0: plain memory, gathered
// into the cache's staging buffer by memcpy. After the run, --verify_pages resident slots are read back and compared byte for byte.
//
// --policy=device: the cache in device-managed mode (GpuCacheOptions::device_managed, pages held
// in place, so --in_place=1): per layer one GpuPageCache::EnqueueResolve of the same selection
// (sink page, selected pages as a device parents array uploaded once per step for all layers,
// window pages) and, with --attend, SelectedAttention over the cache's device table; the step
// ends with one synchronise. Hits and fills come from the device counters (SyncDeviceStats at the
// measurement boundaries), the verify reads the device table.
//
// --selection_log=PATH replays a decode's recorded selections instead of the drifting trace: a
// file written by decode_e2e_bench --selection_log (its header gives the layers, KV heads, budget,
// window, pages and cache slots, overriding those flags and --resident; the warm-up is the
// decode's warm-up steps and every later step is measured; head_dim stays the flag's, which does
// not change which pages hit). --compare_policies=1 also replays the pages the steps named through
// other replacement policies offline (host code, no fills): the clock as the cache runs it (a
// check: its hit ratio must equal the cache's), the clock with new pages inserted unreferenced,
// LRU, LFU over the whole history, and Belady's optimum (the page named furthest in the future
// goes first: no policy can beat it); with the share of lookups that the `slots` most often named
// pages carry (the best a fixed set of resident pages could do).
//
// Fill throughput: PageCopy of N staged pages into random slots (one op), against one contiguous
// CopyToDevice of the same bytes from pinned memory; medians of --copy_reps.
//
// Usage: gpu_cache_bench [--backend=auto|cpu|cuda] [--flag=value ...]; prints a table.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kvstore/backend_page_allocator.h"
#include "kvstore/gpu_cache.h"
#include "kvstore/page_format.h"
#include "kvstore/page_store.h"

namespace strata {
namespace {

struct Flags {
  std::string backend = "auto";
  int layers = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page_size = 64;
  int64_t context = 524288;
  double resident = 0.05;
  int budget_tokens = 2048;
  int window_pages = 2;
  double drift = 0.05;
  double revisit = 0.5;
  int steps = 500;             // measured steps, after the warm-up
  double warmup_fills = 2.0;   // warm-up until this many times num_slots pages were filled
  int max_warmup_steps = 20000;
  int distinct_pages = 16384;
  int in_place = 1;  // host-tier pages in AllocateHost memory, read in place by the fills
  int attend = 1;    // after each layer's Acquire, PagedAttention over the acquired slots
  int q_per_kv = 4;  // query heads per KV head (Llama-3.1-8B: 32 / 8)
  int verify_pages = 256;
  std::string policy = "wait";
  std::string selection_log;  // replay these selections (see the file comment)
  int compare_policies = 0;
  std::string copy_pages = "64,410,1024,4096";
  int copy_reps = 20;
  uint64_t seed = 1;
};

bool ParseFlag(const std::string& arg, Flags* f) {
  const size_t eq = arg.find('=');
  if (arg.rfind("--", 0) != 0 || eq == std::string::npos) return false;
  const std::string name = arg.substr(2, eq - 2), v = arg.substr(eq + 1);
  if (name == "backend") f->backend = v;
  else if (name == "layers") f->layers = std::atoi(v.c_str());
  else if (name == "kv_heads") f->kv_heads = std::atoi(v.c_str());
  else if (name == "head_dim") f->head_dim = std::atoi(v.c_str());
  else if (name == "page_size") f->page_size = std::atoi(v.c_str());
  else if (name == "context") f->context = std::atoll(v.c_str());
  else if (name == "resident") f->resident = std::atof(v.c_str());
  else if (name == "budget_tokens") f->budget_tokens = std::atoi(v.c_str());
  else if (name == "window_pages") f->window_pages = std::atoi(v.c_str());
  else if (name == "drift") f->drift = std::atof(v.c_str());
  else if (name == "revisit") f->revisit = std::atof(v.c_str());
  else if (name == "steps") f->steps = std::atoi(v.c_str());
  else if (name == "warmup_fills") f->warmup_fills = std::atof(v.c_str());
  else if (name == "max_warmup_steps") f->max_warmup_steps = std::atoi(v.c_str());
  else if (name == "distinct_pages") f->distinct_pages = std::atoi(v.c_str());
  else if (name == "in_place") f->in_place = std::atoi(v.c_str());
  else if (name == "attend") f->attend = std::atoi(v.c_str());
  else if (name == "q_per_kv") f->q_per_kv = std::atoi(v.c_str());
  else if (name == "verify_pages") f->verify_pages = std::atoi(v.c_str());
  else if (name == "policy") f->policy = v;
  else if (name == "copy_pages") f->copy_pages = v;
  else if (name == "selection_log") f->selection_log = v;
  else if (name == "compare_policies") f->compare_policies = std::atoi(v.c_str());
  else if (name == "copy_reps") f->copy_reps = std::atoi(v.c_str());
  else if (name == "seed") f->seed = std::strtoull(v.c_str(), nullptr, 10);
  else return false;
  return true;
}

// Every key maps onto one of a fixed set of encoded pages (see the file comment).
class SyntheticHostTier : public kvstore::PageStore {
 public:
  // Page buffers come from `allocator` (null: plain memory).
  static absl::StatusOr<std::unique_ptr<SyntheticHostTier>> Create(
      int distinct, int page_size, int head_dim, kvstore::PageAllocator* allocator) {
    auto t = std::unique_ptr<SyntheticHostTier>(new SyntheticHostTier());
    kvstore::PageShape shape;
    shape.dtype = kernels::DType::kBF16;
    shape.page_size = page_size;
    shape.head_dim = head_dim;
    std::mt19937_64 rng(42);
    std::vector<uint16_t> k(static_cast<size_t>(page_size) * head_dim), v(k.size());
    for (int i = 0; i < distinct; ++i) {
      for (size_t j = 0; j < k.size(); ++j) {
        k[j] = static_cast<uint16_t>(rng() & 0xbfff);
        v[j] = static_cast<uint16_t>(rng() & 0xbfff);
      }
      absl::StatusOr<std::string> page = kvstore::EncodePage(
          shape, kernels::TensorView(k.data(), kernels::DType::kBF16, {page_size, head_dim}),
          kernels::TensorView(v.data(), kernels::DType::kBF16, {page_size, head_dim}));
      if (!page.ok()) return page.status();
      absl::StatusOr<kvstore::PageRef> ref = kvstore::PageBuffer::Copy(*page, allocator);
      if (!ref.ok()) return ref.status();
      t->pages_.push_back(*std::move(ref));
    }
    return t;
  }
  const char* tier() const override { return "host"; }
  size_t size() const { return pages_.size(); }
  const kvstore::PageRef& page(size_t i) const { return pages_[i]; }
  size_t Which(const kvstore::PageKey& k) const {
    uint64_t h = (uint64_t{k.layer} * 1000003u + k.kv_head) * 1000033u + k.page_index;
    h ^= h >> 29;
    h *= 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>((h >> 17) % pages_.size());
  }
  absl::Status GetPages(absl::Span<const kvstore::PageKey> keys,
                        std::vector<kvstore::PageRef>* out) override {
    out->resize(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) (*out)[i] = pages_[Which(keys[i])];
    return absl::OkStatus();
  }
  absl::Status Put(absl::Span<const kvstore::PageWrite>,
                   absl::Span<const kvstore::SummaryWrite>) override {
    return absl::UnimplementedError("synthetic tier is read-only");
  }
  absl::Status GetSummaries(absl::Span<const kvstore::SummaryKey> keys,
                            std::vector<kvstore::PageRef>* out) override {
    out->assign(keys.size(), nullptr);
    return absl::OkStatus();
  }

 private:
  std::vector<kvstore::PageRef> pages_;
};

// The drifting selection of one (layer, KV head).
struct HeadTrace {
  std::vector<int32_t> selected;  // middle pages, distinct
  std::vector<int32_t> dropped;   // ring of recently dropped pages
  size_t dropped_next = 0;
};

// A recorded decode's selections (decode_e2e_bench --selection_log): a header of int64s (magic,
// layers, KV heads, k, pages per head, first window page, cache slots, page size, warm-up steps),
// then per layer call its layer (int32) and selection [kv_heads, k] (int32 page ids, -1 none).
struct SelectionLog {
  int64_t layers = 0, kv_heads = 0, k = 0, pages = 0, window_first = 0, slots = 0, page_size = 0,
          warmup = 0;
  std::vector<int32_t> selections;  // [steps][layers][kv_heads][k]
  int64_t steps() const { return static_cast<int64_t>(selections.size()) / (layers * kv_heads * k); }
  const int32_t* at(int64_t step, int64_t layer, int64_t head) const {
    return selections.data() + ((step * layers + layer) * kv_heads + head) * k;
  }
};

absl::StatusOr<SelectionLog> ReadSelectionLog(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (file == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  int64_t h[9];
  if (std::fread(h, sizeof(h), 1, file.get()) != 1 || h[0] != 0x53454c4c4f473031) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a selection log"));
  }
  SelectionLog log;
  log.layers = h[1];
  log.kv_heads = h[2];
  log.k = h[3];
  log.pages = h[4];
  log.window_first = h[5];
  log.slots = h[6];
  log.page_size = h[7];
  log.warmup = h[8];
  if (log.layers < 1 || log.layers > 1024 || log.kv_heads < 1 || log.kv_heads > 1024 ||
      log.k < 1 || log.k > (1 << 20) || log.pages < 2 || log.pages > (int64_t{1} << 31) ||
      log.window_first < 1 || log.window_first > log.pages || log.slots < 1 ||
      log.page_size < 1 || log.warmup < 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad header"));
  }
  std::vector<int32_t> record(static_cast<size_t>(1 + log.kv_heads * log.k));
  for (int64_t call = 0;; ++call) {
    const size_t got = std::fread(record.data(), sizeof(int32_t), record.size(), file.get());
    if (got == 0) break;
    if (got != record.size() || record[0] != call % log.layers) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": record ", call, " is cut or out of order"));
    }
    for (size_t i = 1; i < record.size(); ++i) {
      if (record[i] < -1 || record[i] >= log.pages) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": page ", record[i], " out of range"));
      }
    }
    log.selections.insert(log.selections.end(), record.begin() + 1, record.end());
  }
  if (log.steps() <= log.warmup || log.selections.size() % (log.layers * log.kv_heads * log.k) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no measured steps"));
  }
  return log;
}

// Offline replacement policies over the pages each call named (flat ids, in naming order; the
// cache's order: head by head, the sink page, the selected pages, the window pages). Hit ratio
// over the calls from `first_measured` on, a page counting once per call.
struct NamedCalls {
  std::vector<std::vector<int64_t>> calls;
  int64_t num_pages = 0;
};

// The clock of kernels::ResolvePagesParams (hits set the bit; a miss takes the next unpinned slot
// whose bit is clear, clearing the bits it passes), new pages inserted with the bit `insert_ref`.
double ClockHitRatio(const NamedCalls& nc, int64_t slots, int64_t first_measured, bool insert_ref) {
  std::vector<int32_t> table(static_cast<size_t>(nc.num_pages), -1);
  std::vector<int64_t> slot_page(static_cast<size_t>(slots), -1);
  std::vector<int64_t> stamp(static_cast<size_t>(slots), -1);
  std::vector<uint8_t> ref(static_cast<size_t>(slots), 0);
  int64_t hand = 0, hits = 0, lookups = 0;
  std::vector<int64_t> misses;
  for (size_t c = 0; c < nc.calls.size(); ++c) {
    const bool measured = static_cast<int64_t>(c) >= first_measured;
    const int64_t epoch = static_cast<int64_t>(c);
    misses.clear();
    for (int64_t page : nc.calls[c]) {
      const int32_t s = table[page];
      if (s >= 0) {
        if (stamp[s] != epoch) {
          stamp[s] = epoch;
          if (measured) ++hits, ++lookups;
        }
        ref[s] = 1;
      } else if (std::find(misses.begin(), misses.end(), page) == misses.end()) {
        misses.push_back(page);
        if (measured) ++lookups;
      }
    }
    for (int64_t page : misses) {
      int64_t victim = -1;
      for (int64_t passed = 0; passed < 2 * slots && victim < 0; ++passed) {
        const int64_t s = hand;
        hand = hand + 1 == slots ? 0 : hand + 1;
        if (stamp[s] == epoch) continue;
        if (ref[s] != 0) {
          ref[s] = 0;
          continue;
        }
        victim = s;
      }
      if (victim < 0) break;
      if (slot_page[victim] >= 0) table[slot_page[victim]] = -1;
      slot_page[victim] = page;
      table[page] = static_cast<int32_t>(victim);
      stamp[victim] = epoch;
      ref[victim] = insert_ref ? 1 : 0;
    }
  }
  return lookups > 0 ? static_cast<double>(hits) / lookups : 0.0;
}

// LRU (least recently named goes first) and LFU (fewest names so far, counted over the whole
// history including while evicted; ties: least recently named), both by an ordered set.
double RankedHitRatio(const NamedCalls& nc, int64_t slots, int64_t first_measured, bool lfu) {
  std::vector<int64_t> count(static_cast<size_t>(nc.num_pages), 0), last(count.size(), -1);
  std::vector<uint8_t> resident(count.size(), 0);
  std::set<std::pair<std::pair<int64_t, int64_t>, int64_t>> order;  // ((count|0, last), page)
  auto key = [&](int64_t page) {
    return std::make_pair(std::make_pair(lfu ? count[page] : 0, last[page]), page);
  };
  int64_t t = 0, hits = 0, lookups = 0, held = 0;
  for (size_t c = 0; c < nc.calls.size(); ++c) {
    const bool measured = static_cast<int64_t>(c) >= first_measured;
    for (int64_t page : nc.calls[c]) {
      if (resident[page]) {
        order.erase(key(page));
        if (measured) ++hits;
      } else if (held >= slots) {
        const int64_t victim = order.begin()->second;
        order.erase(order.begin());
        resident[victim] = 0;
        --held;
      }
      if (measured) ++lookups;
      ++count[page];
      last[page] = ++t;
      resident[page] = 1;
      ++held;
      order.insert(key(page));
    }
  }
  return lookups > 0 ? static_cast<double>(hits) / lookups : 0.0;
}

// Belady's optimum: on a miss with the cache full, the resident page named next furthest in the
// future goes (pages named in the same call are needed together, so they are never the victim).
double OptimalHitRatio(const NamedCalls& nc, int64_t slots, int64_t first_measured) {
  std::vector<std::pair<int64_t, int64_t>> seq;  // (call, page)
  for (size_t c = 0; c < nc.calls.size(); ++c) {
    for (int64_t page : nc.calls[c]) seq.push_back({static_cast<int64_t>(c), page});
  }
  const int64_t kNever = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> next(seq.size()), seen(static_cast<size_t>(nc.num_pages), kNever);
  for (int64_t i = static_cast<int64_t>(seq.size()) - 1; i >= 0; --i) {
    next[i] = seen[seq[i].second];
    seen[seq[i].second] = i;
  }
  std::vector<int64_t> resident_next(static_cast<size_t>(nc.num_pages), -1);  // -1: not resident
  std::set<std::pair<int64_t, int64_t>> by_next;  // (next use, page)
  int64_t hits = 0, lookups = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    const auto [call, page] = seq[i];
    const bool measured = call >= first_measured;
    if (measured) ++lookups;
    if (resident_next[page] >= 0) {
      if (measured) ++hits;
      by_next.erase({resident_next[page], page});
    } else if (static_cast<int64_t>(by_next.size()) >= slots) {
      const auto victim = std::prev(by_next.end());
      resident_next[victim->second] = -1;
      by_next.erase(victim);
    }
    resident_next[page] = next[i];
    by_next.insert({next[i], page});
  }
  return lookups > 0 ? static_cast<double>(hits) / lookups : 0.0;
}

void ComparePolicies(const NamedCalls& nc, int64_t slots, int64_t first_measured,
                     double measured_hit_ratio) {
  std::vector<int64_t> named(static_cast<size_t>(nc.num_pages), 0);
  int64_t total = 0;
  for (const auto& call : nc.calls) {
    for (int64_t page : call) ++named[page], ++total;
  }
  std::sort(named.begin(), named.end(), std::greater<int64_t>());
  int64_t top = 0;
  for (int64_t i = 0; i < slots && i < nc.num_pages; ++i) top += named[i];
  const int64_t distinct = nc.num_pages - std::count(named.begin(), named.end(), int64_t{0});
  std::printf("\nreplacement policies offline, the same pages (hit ratio over the measured steps):\n");
  std::printf("  clock (the cache's)              %.4f  (the cache measured %.4f)\n",
              ClockHitRatio(nc, slots, first_measured, true), measured_hit_ratio);
  std::printf("  clock, new pages unreferenced    %.4f\n", ClockHitRatio(nc, slots, first_measured, false));
  std::printf("  LRU                              %.4f\n", RankedHitRatio(nc, slots, first_measured, false));
  std::printf("  LFU (whole history)              %.4f\n", RankedHitRatio(nc, slots, first_measured, true));
  std::printf("  Belady's optimum                 %.4f\n", OptimalHitRatio(nc, slots, first_measured));
  std::printf("  lookups carried by the %" PRId64 " most named pages (all steps): %.4f; "
              "%" PRId64 " distinct pages named of %" PRId64 "\n",
              slots, total > 0 ? static_cast<double>(top) / total : 0.0, distinct, nc.num_pages);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run(const Flags& flags) {
  Flags f = flags;
  std::unique_ptr<SelectionLog> log;
  if (!f.selection_log.empty()) {
    absl::StatusOr<SelectionLog> read = ReadSelectionLog(f.selection_log);
    if (!read.ok()) {
      std::fprintf(stderr, "%s\n", read.status().ToString().c_str());
      return 2;
    }
    log = std::make_unique<SelectionLog>(*std::move(read));
    f.layers = static_cast<int>(log->layers);
    f.kv_heads = static_cast<int>(log->kv_heads);
    f.page_size = static_cast<int>(log->page_size);
    f.context = log->pages * log->page_size;
    f.budget_tokens = static_cast<int>(log->k * log->page_size);
    f.window_pages = static_cast<int>(log->pages - log->window_first);
    f.steps = static_cast<int>(log->steps() - log->warmup);
    std::printf("selection log %s: %" PRId64 " steps (%" PRId64 " warm-up), %" PRId64
                " cache slots\n",
                f.selection_log.c_str(), log->steps(), log->warmup, log->slots);
  }
  absl::StatusOr<kernels::BackendKind> kind = kernels::ParseBackendKind(f.backend);
  if (!kind.ok()) {
    std::fprintf(stderr, "%s\n", kind.status().ToString().c_str());
    return 2;
  }
  kernels::BackendOptions bo;
  bo.kind = *kind;
  std::string why_not_cuda;
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend_or =
      kernels::MakeBackend(bo, &why_not_cuda);
  if (!backend_or.ok()) {
    std::fprintf(stderr, "backend: %s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  kernels::Backend* backend = backend_or->get();
  std::printf("backend: %s\n", backend->Name().c_str());
  if (!why_not_cuda.empty()) std::printf("  (CUDA not used: %s)\n", why_not_cuda.c_str());

  const int64_t pages_per_head = (f.context + f.page_size - 1) / f.page_size;
  const int64_t total_pages = pages_per_head * f.layers * f.kv_heads;
  const size_t page_bytes = kernels::PageCopyBytes(f.page_size, f.head_dim, kernels::DType::kBF16);
  const int64_t num_slots = log != nullptr ? log->slots
                                           : std::max<int64_t>(1, static_cast<int64_t>(f.resident * total_pages));
  const int middle = f.budget_tokens / f.page_size;
  std::printf("shape: %d layers x %d kv heads, d=%d, P=%d, %" PRId64 " tokens: %" PRId64
              " pages, %.1f GiB of bf16 KV\n",
              f.layers, f.kv_heads, f.head_dim, f.page_size, f.context, total_pages,
              static_cast<double>(total_pages) * page_bytes / (1u << 30));
  std::printf("cache: %" PRId64 " slots (%.2f%% of KV, %.2f GiB); per head and step: 1 sink + %d "
              "selected + %d window pages; drift %.3f, revisit %.2f, policy %s\n",
              num_slots, 100.0 * num_slots / total_pages,
              static_cast<double>(num_slots) * page_bytes / (1u << 30), middle, f.window_pages,
              f.drift, f.revisit, f.policy.c_str());
  if (pages_per_head < middle + f.window_pages + 2) {
    std::fprintf(stderr, "context too short for the budget\n");
    return 2;
  }

  kvstore::PageShape shape;
  shape.page_size = f.page_size;
  shape.head_dim = f.head_dim;
  kvstore::BackendPageAllocator pinned(backend, shape.EncodedBytes());
  absl::StatusOr<std::unique_ptr<SyntheticHostTier>> tier = SyntheticHostTier::Create(
      f.distinct_pages, f.page_size, f.head_dim, f.in_place ? &pinned : nullptr);
  if (!tier.ok()) {
    std::fprintf(stderr, "host tier: %s\n", tier.status().ToString().c_str());
    return 1;
  }

  // ---- Fill throughput ----------------------------------------------------------------------
  if (!f.copy_pages.empty() && f.copy_reps > 0) {
    std::vector<int> sizes;
    for (size_t pos = 0; pos < f.copy_pages.size();) {
      size_t comma = f.copy_pages.find(',', pos);
      if (comma == std::string::npos) comma = f.copy_pages.size();
      sizes.push_back(std::atoi(f.copy_pages.substr(pos, comma - pos).c_str()));
      pos = comma + 1;
    }
    const int max_n = *std::max_element(sizes.begin(), sizes.end());
    const int64_t pool_slots = std::max<int64_t>(2 * max_n, 8192);
    auto k = backend->Allocate(pool_slots * page_bytes / 2);
    auto v = backend->Allocate(pool_slots * page_bytes / 2);
    auto staging = backend->AllocateHost(static_cast<size_t>(max_n) * page_bytes);
    auto slots = backend->AllocateHost(sizeof(int32_t) * max_n);
    auto dst = backend->Allocate(static_cast<size_t>(max_n) * page_bytes);
    auto sources = backend->AllocateHost(sizeof(void*) * max_n);
    if (!k.ok() || !v.ok() || !staging.ok() || !slots.ok() || !dst.ok() || !sources.ok()) {
      std::fprintf(stderr, "fill benchmark: allocation failed\n");
      return 1;
    }
    std::memset((*staging)->data(), 0x3c, (*staging)->bytes());
    std::vector<int32_t> perm(pool_slots);
    std::iota(perm.begin(), perm.end(), 0);
    std::mt19937_64 rng(f.seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::memcpy((*slots)->data(), perm.data(), sizeof(int32_t) * max_n);
    // In place: random pages of the host tier (scattered over its pinned chunks).
    auto* src = static_cast<const void**>((*sources)->data());
    for (int i = 0; i < max_n; ++i) {
      src[i] = kvstore::PageKBytes((*tier)->page(rng() % (*tier)->size())->view()).data();
    }
    std::printf("\nfill op: PageCopy from pinned staging into random slots, PageCopy reading "
                "random host-tier pages in place%s, and one contiguous copy (median of %d)\n",
                f.in_place ? "" : " (skipped: --in_place=0)", f.copy_reps);
    std::printf("%8s %10s %12s %8s %14s %8s %12s %8s\n", "pages", "MiB", "staging us", "GB/s",
                "in place us", "GB/s", "contig. us", "GB/s");
    for (int n : sizes) {
      kernels::PageCopyParams p;
      p.staging = (*staging)->data();
      p.staging_bytes = (*staging)->bytes();
      p.slots = static_cast<const int32_t*>((*slots)->data());
      p.num_pages = n;
      p.k_pool = (*k)->View(kernels::DType::kBF16, {pool_slots, f.page_size, f.head_dim});
      p.v_pool = (*v)->View(kernels::DType::kBF16, {pool_slots, f.page_size, f.head_dim});
      std::vector<double> t_copy, t_contig, t_place;
      for (int r = 0; r < f.copy_reps + 2; ++r) {
        Stopwatch w;
        absl::Status s = backend->PageCopy(p, nullptr);
        if (s.ok()) s = backend->Synchronize(nullptr);
        if (!s.ok()) {
          std::fprintf(stderr, "PageCopy: %s\n", s.ToString().c_str());
          return 1;
        }
        if (r >= 2) t_copy.push_back(w.ElapsedSeconds());
        w.Reset();
        s = backend->CopyToDevice((*dst)->data(), (*staging)->data(), n * page_bytes, nullptr);
        if (!s.ok()) {
          std::fprintf(stderr, "CopyToDevice: %s\n", s.ToString().c_str());
          return 1;
        }
        if (r >= 2) t_contig.push_back(w.ElapsedSeconds());
        if (f.in_place) {
          kernels::PageCopyParams q = p;
          q.sources = src;
          w.Reset();
          s = backend->PageCopy(q, nullptr);
          if (s.ok()) s = backend->Synchronize(nullptr);
          if (!s.ok()) {
            std::fprintf(stderr, "PageCopy in place: %s\n", s.ToString().c_str());
            return 1;
          }
          if (r >= 2) t_place.push_back(w.ElapsedSeconds());
        }
      }
      const double bytes = static_cast<double>(n) * page_bytes;
      const double a = Median(t_copy), b = Median(t_contig), c = Median(t_place);
      std::printf("%8d %10.2f %12.1f %8.1f %14.1f %8.1f %12.1f %8.1f\n", n, bytes / (1 << 20),
                  a * 1e6, bytes / a / 1e9, c * 1e6, c > 0 ? bytes / c / 1e9 : 0.0, b * 1e6,
                  bytes / b / 1e9);
    }
  }

  // ---- Trace replay ---------------------------------------------------------------------------
  kvstore::GpuCacheOptions o;
  o.document.bytes.fill('b');
  o.num_layers = f.layers;
  o.num_kv_heads = f.kv_heads;
  o.pages_per_head = pages_per_head;
  o.page_size = f.page_size;
  o.head_dim = f.head_dim;
  o.num_slots = num_slots;
  o.max_batch_pages = 4096;
  o.source = tier->get();
  if (f.in_place) o.in_place_allocator = &pinned;
  const bool device = f.policy == "device";
  if (device && !f.in_place) {
    std::fprintf(stderr, "--policy=device needs --in_place=1\n");
    return 2;
  }
  o.device_managed = device;
  o.hold_source_pages = device;
  absl::StatusOr<std::unique_ptr<kvstore::GpuPageCache>> cache_or =
      kvstore::GpuPageCache::Create(o, backend);
  if (!cache_or.ok()) {
    std::fprintf(stderr, "cache: %s\n", cache_or.status().ToString().c_str());
    return 1;
  }
  kvstore::GpuPageCache& cache = **cache_or;
  const kvstore::MissPolicy policy =
      f.policy == "defer" ? kvstore::MissPolicy::kDefer : kvstore::MissPolicy::kWait;

  std::mt19937_64 rng(f.seed);
  const int64_t first_middle = 1, end_middle = pages_per_head - f.window_pages;
  std::uniform_int_distribution<int64_t> any_page(first_middle, end_middle - 1);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<HeadTrace> heads(static_cast<size_t>(f.layers) * f.kv_heads);
  for (HeadTrace& h : heads) {
    while (static_cast<int>(h.selected.size()) < middle) {
      const int32_t p = static_cast<int32_t>(any_page(rng));
      if (std::find(h.selected.begin(), h.selected.end(), p) == h.selected.end()) {
        h.selected.push_back(p);
      }
    }
  }
  constexpr size_t kDroppedRing = 64;
  std::vector<kvstore::GpuPageId> want;
  std::vector<std::vector<int32_t>> step_slots(f.layers);
  // Attention of one decode token per layer over the acquired slots (same stream as the fills).
  const int q_heads = f.kv_heads * f.q_per_kv;
  auto q_buf = backend->Allocate(sizeof(float) * q_heads * f.head_dim);
  auto out_buf = backend->Allocate(sizeof(float) * q_heads * f.head_dim);
  auto lse_buf = backend->Allocate(sizeof(float) * q_heads);
  if (!q_buf.ok() || !out_buf.ok() || !lse_buf.ok()) return 1;
  {
    std::vector<float> q(static_cast<size_t>(q_heads) * f.head_dim);
    std::mt19937 qr(3);
    std::uniform_real_distribution<float> u(-1, 1);
    for (float& x : q) x = u(qr);
    if (!backend->CopyToDevice((*q_buf)->data(), q.data(), q.size() * sizeof(float), nullptr)
             .ok()) {
      return 1;
    }
  }
  // --policy=device: every layer's selected pages of the step, uploaded once per step.
  std::unique_ptr<kernels::Buffer> parents_buf;
  std::vector<int32_t> parents_host;
  if (device) {
    auto b = backend->Allocate(sizeof(int32_t) * f.layers * f.kv_heads * middle);
    if (!b.ok()) return 1;
    parents_buf = *std::move(b);
    parents_host.resize(static_cast<size_t>(f.layers) * f.kv_heads * middle);
  }
  auto stats_now = [&]() -> kvstore::GpuCacheStats {
    if (device && !cache.SyncDeviceStats().ok()) std::fprintf(stderr, "SyncDeviceStats failed\n");
    return cache.stats();
  };
  std::vector<kernels::KvSpan> spans;
  std::vector<int32_t> span_offsets(f.kv_heads + 1);
  const int32_t q_position = static_cast<int32_t>(f.context);
  double attend_total = 0;
  int64_t lookups = 0, hits = 0, measured_steps = 0;
  kvstore::GpuCacheStats before{};
  std::vector<double> step_acquire;
  double acquire_total = 0;
  bool measuring = false;
  int warmup_steps = 0;
  NamedCalls named;  // --compare_policies: the pages each layer call names
  named.num_pages = total_pages;
  int64_t first_measured_call = 0;
  for (int step = 0; measured_steps < f.steps; ++step) {
    if (!measuring && (log != nullptr ? step >= log->warmup
                                      : stats_now().fills >= f.warmup_fills * num_slots ||
                                            step >= f.max_warmup_steps)) {
      if (!cache.WaitForFills().ok()) return 1;
      before = stats_now();
      measuring = true;
      warmup_steps = step;
      first_measured_call = static_cast<int64_t>(named.calls.size());
    }
    if (log != nullptr) {  // the recorded selections (-1: none)
      for (int l = 0; l < f.layers; ++l) {
        for (int g = 0; g < f.kv_heads; ++g) {
          const int32_t* row = log->at(step, l, g);
          heads[static_cast<size_t>(l) * f.kv_heads + g].selected.assign(row, row + middle);
        }
      }
    }
    if (f.compare_policies) {
      for (int l = 0; l < f.layers; ++l) {
        std::vector<int64_t>& call = named.calls.emplace_back();
        for (int g = 0; g < f.kv_heads; ++g) {
          const int64_t base = (static_cast<int64_t>(l) * f.kv_heads + g) * pages_per_head;
          const size_t head_first = call.size();
          auto name = [&](int64_t page) {
            if (page < 0 || page >= pages_per_head) return;
            if (std::find(call.begin() + head_first, call.end(), base + page) == call.end()) {
              call.push_back(base + page);
            }
          };
          name(0);
          for (int32_t p : heads[static_cast<size_t>(l) * f.kv_heads + g].selected) name(p);
          for (int64_t p = end_middle; p < pages_per_head; ++p) name(p);
        }
      }
    }
    // Drift the selections.
    for (HeadTrace& h : heads) {
      if (log != nullptr) break;
      for (int32_t& page : h.selected) {
        if (unit(rng) >= f.drift) continue;
        int32_t next = -1;
        for (int tries = 0; tries < 8 && next < 0; ++tries) {
          int32_t c;
          if (!h.dropped.empty() && unit(rng) < f.revisit) {
            c = h.dropped[rng() % h.dropped.size()];
          } else {
            c = static_cast<int32_t>(any_page(rng));
          }
          if (std::find(h.selected.begin(), h.selected.end(), c) == h.selected.end()) next = c;
        }
        if (next < 0) continue;
        if (h.dropped.size() < kDroppedRing) {
          h.dropped.push_back(page);
        } else {
          h.dropped[h.dropped_next] = page;
          h.dropped_next = (h.dropped_next + 1) % kDroppedRing;
        }
        page = next;
      }
    }
    double step_seconds = 0;
    if (device) {
      for (int l = 0; l < f.layers; ++l) {
        for (int g = 0; g < f.kv_heads; ++g) {
          const HeadTrace& h = heads[static_cast<size_t>(l) * f.kv_heads + g];
          std::copy(h.selected.begin(), h.selected.end(),
                    parents_host.begin() + (static_cast<size_t>(l) * f.kv_heads + g) * middle);
        }
      }
      if (!backend->CopyToDevice(parents_buf->data(), parents_host.data(),
                                 parents_host.size() * sizeof(int32_t), nullptr)
               .ok() ||
          !backend->Synchronize(nullptr).ok()) {
        return 1;
      }
      const kvstore::GpuCacheStats s0 = measuring ? stats_now() : kvstore::GpuCacheStats{};
      Stopwatch watch;
      const int64_t P = f.page_size;
      for (int l = 0; l < f.layers; ++l) {
        kernels::CandidateList mid;
        mid.parents = kernels::TensorView(
            static_cast<int32_t*>(parents_buf->data()) + static_cast<int64_t>(l) * f.kv_heads * middle,
            kernels::DType::kI32, {f.kv_heads, middle});
        mid.fanout = f.page_size;
        mid.begin = P;
        mid.end = end_middle * P;
        const int64_t suffix_begin = end_middle * P, suffix_end = pages_per_head * P;
        absl::Status s = cache.EnqueueResolve(l, P, mid, suffix_begin, suffix_end);
        if (s.ok() && f.attend) {
          kernels::SelectedAttentionParams a;
          a.q = (*q_buf)->View(kernels::DType::kF32, {1, q_heads, f.head_dim});
          a.k_pool = cache.k_pool();
          a.v_pool = cache.v_pool();
          a.page_table = kernels::TensorView(
              const_cast<int32_t*>(cache.device_table()) +
                  static_cast<int64_t>(l) * f.kv_heads * pages_per_head,
              kernels::DType::kI32, {f.kv_heads, pages_per_head});
          a.prefix_end = P;
          a.middle = mid;
          a.suffix_begin = suffix_begin;
          a.suffix_end = suffix_end;
          a.scale = 1.0f / std::sqrt(static_cast<float>(f.head_dim));
          a.out = (*out_buf)->View(kernels::DType::kF32, {1, q_heads, f.head_dim});
          a.lse = (*lse_buf)->View(kernels::DType::kF32, {1, q_heads});
          s = backend->SelectedAttention(a, nullptr);
        }
        if (!s.ok()) {
          std::fprintf(stderr, "step %d layer %d: %s\n", step, l, s.ToString().c_str());
          return 1;
        }
      }
      if (!backend->Synchronize(nullptr).ok()) return 1;
      step_seconds = watch.ElapsedSeconds();
      if (measuring) {
        const kvstore::GpuCacheStats s1 = stats_now();
        lookups += s1.lookups - s0.lookups;
        hits += s1.hits - s0.hits;
        ++measured_steps;
        acquire_total += step_seconds;
        step_acquire.push_back(step_seconds);
      }
      continue;
    }
    for (int l = 0; l < f.layers; ++l) {
      want.clear();
      for (int g = 0; g < f.kv_heads; ++g) {
        const HeadTrace& h = heads[static_cast<size_t>(l) * f.kv_heads + g];
        want.push_back({l, g, 0});
        for (int32_t p : h.selected) {
          if (p >= 0) want.push_back({l, g, p});
        }
        for (int w = 0; w < f.window_pages; ++w) {
          want.push_back({l, g, static_cast<int32_t>(pages_per_head - f.window_pages + w)});
        }
      }
      const kvstore::GpuCacheStats s0 = cache.stats();
      Stopwatch watch;
      absl::Status s = cache.Acquire(want, policy, &step_slots[l]);
      step_seconds += watch.ElapsedSeconds();
      if (!s.ok()) {
        std::fprintf(stderr, "step %d layer %d: %s\n", step, l, s.ToString().c_str());
        return 1;
      }
      if (f.attend) {
        Stopwatch attend_watch;
        spans.clear();
        const std::vector<int32_t>& got = step_slots[l];
        for (int g = 0; g < f.kv_heads; ++g) {
          span_offsets[g] = static_cast<int32_t>(spans.size());
          // A head's entries: after the previous head's (a logged selection may name fewer).
          for (size_t j = 0; j < want.size(); ++j) {
            if (want[j].kv_head != g) continue;
            if (got[j] < 0) continue;  // deferred miss: not attended this step
            spans.push_back(kernels::KvSpan{got[j], 0, f.page_size, want[j].page * f.page_size});
          }
        }
        span_offsets[f.kv_heads] = static_cast<int32_t>(spans.size());
        kernels::PagedAttentionParams a;
        a.q = (*q_buf)->View(kernels::DType::kF32, {1, q_heads, f.head_dim});
        a.k_pool = cache.k_pool();
        a.v_pool = cache.v_pool();
        a.spans = spans.data();
        a.span_offsets = span_offsets.data();
        a.num_kv_heads = f.kv_heads;
        a.q_positions = &q_position;
        a.causal = true;
        a.scale = 1.0f / std::sqrt(static_cast<float>(f.head_dim));
        a.out = (*out_buf)->View(kernels::DType::kF32, {1, q_heads, f.head_dim});
        a.lse = (*lse_buf)->View(kernels::DType::kF32, {1, q_heads});
        if (absl::Status as = backend->PagedAttention(a, nullptr); !as.ok()) {
          std::fprintf(stderr, "attention: %s\n", as.ToString().c_str());
          return 1;
        }
        step_seconds += attend_watch.ElapsedSeconds();
        if (measuring) attend_total += attend_watch.ElapsedSeconds();
      }
      if (measuring) {
        const kvstore::GpuCacheStats s1 = cache.stats();
        lookups += s1.lookups - s0.lookups;
        hits += s1.hits - s0.hits;
      }
    }
    if (f.attend) {
      // The step ends when its attention has run (the pins cover the reads until here).
      Stopwatch sync_watch;
      if (!backend->Synchronize(nullptr).ok()) return 1;
      step_seconds += sync_watch.ElapsedSeconds();
      if (measuring) attend_total += sync_watch.ElapsedSeconds();
    }
    for (int l = 0; l < f.layers; ++l) {
      if (absl::Status s = cache.Release(step_slots[l]); !s.ok()) {
        std::fprintf(stderr, "release: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    if (measuring) {
      ++measured_steps;
      acquire_total += step_seconds;
      step_acquire.push_back(step_seconds);
    }
  }
  if (!cache.WaitForFills().ok()) return 1;
  const kvstore::GpuCacheStats after = stats_now();
  const double n = std::max<int64_t>(1, measured_steps);
  std::printf("\ntrace: %d warm-up steps (%s), then %" PRId64
              " measured; %d Acquire calls per step (one per layer)\n",
              warmup_steps,
              log != nullptr ? "the recorded decode's"
                             : absl::StrCat("until ", f.warmup_fills, " x the slots were filled").c_str(),
              measured_steps, f.layers);
  std::printf("  hit ratio (steady)       %.4f  (%" PRId64 " hits / %" PRId64 " lookups)\n",
              lookups > 0 ? static_cast<double>(hits) / lookups : 0.0, hits, lookups);
  std::printf("  lookups per step         %.0f\n", lookups / n);
  std::printf("  fills per step           %.1f pages, %.2f MiB\n",
              (after.fills - before.fills) / n,
              (after.fill_bytes - before.fill_bytes) / n / (1 << 20));
  std::printf("  evictions per step       %.1f\n", (after.evictions - before.evictions) / n);
  std::printf("  step time                mean %.1f us, median %.1f us (all %d layers: %s%s)\n",
              acquire_total / n * 1e6, Median(step_acquire) * 1e6, f.layers,
              device ? "EnqueueResolve" : "Acquire",
              !f.attend ? ""
              : device  ? " + SelectedAttention over the device table + one final synchronise"
                        : " + PagedAttention over the slots + one final synchronise");
  if (f.attend) {
    std::printf("    of which attention     %.1f us (enqueue per layer, then the wait at the end)\n",
                attend_total / n * 1e6);
  }
  std::printf("    of which PageCopy call %.1f us (host: checks, launch)\n",
              (after.copy_seconds - before.copy_seconds) / n * 1e6);
  std::printf("    of which host gather   %.1f us (source lookup, checks, memcpy into staging)\n",
              (after.gather_seconds - before.gather_seconds) / n * 1e6);
  std::printf("    of which waiting       %.1f us (Synchronize on the fill stream)\n",
              (after.wait_seconds - before.wait_seconds) / n * 1e6);
  std::printf("  fill batches per step    %.1f; pages read in place per step %.1f\n",
              (after.fill_batches - before.fill_batches) / n,
              (after.in_place - before.in_place) / n);
  std::printf("  resident pages           %" PRId64 " of %" PRId64 " slots\n",
              cache.resident_pages(), num_slots);

  // ---- Verify: resident slots hold their pages' bytes ------------------------------------------
  int checked = 0, bad = 0;
  std::vector<char> host(page_bytes / 2);
  std::mt19937_64 vr(f.seed + 1);
  for (int tries = 0; tries < 50 * f.verify_pages && checked < f.verify_pages; ++tries) {
    kvstore::GpuPageId id{static_cast<int32_t>(vr() % f.layers),
                          static_cast<int32_t>(vr() % f.kv_heads),
                          static_cast<int32_t>(vr() % pages_per_head)};
    absl::StatusOr<int32_t> slot = -1;
    if (device) {
      int32_t v = -1;
      const int64_t flat = (static_cast<int64_t>(id.layer) * f.kv_heads + id.kv_head) *
                               pages_per_head + id.page;
      if (!backend->CopyToHost(&v, cache.device_table() + flat, sizeof(v), nullptr).ok()) return 1;
      slot = v;
    } else {
      slot = cache.SlotOf(id);
    }
    if (!slot.ok() || *slot < 0) continue;
    kvstore::PageKey key{o.document, static_cast<uint32_t>(id.layer),
                         static_cast<uint32_t>(id.kv_head), static_cast<uint32_t>(id.page)};
    std::vector<kvstore::PageRef> source;
    if (!(*tier)->GetPages({key}, &source).ok()) return 1;
    const kvstore::PageRef& ref = source[0];
    for (int half = 0; half < 2; ++half) {
      const char* base = static_cast<const char*>(half == 0 ? cache.k_pool().data
                                                            : cache.v_pool().data);
      if (!backend->CopyToHost(host.data(), base + static_cast<size_t>(*slot) * host.size(),
                               host.size(), nullptr)
               .ok()) {
        return 1;
      }
      const absl::string_view want_bytes =
          half == 0 ? kvstore::PageKBytes(ref->view()) : kvstore::PageVBytes(ref->view());
      if (std::memcmp(host.data(), want_bytes.data(), host.size()) != 0) ++bad;
    }
    ++checked;
  }
  std::printf("  verify                   %d resident pages read back, %d halves differ\n",
              checked, bad);
  if (f.compare_policies) {
    ComparePolicies(named, num_slots, first_measured_call,
                    lookups > 0 ? static_cast<double>(hits) / lookups : 0.0);
  }
  std::printf("RESULT backend=%s in_place=%d drift=%.3f revisit=%.2f policy=%s resident=%.3f "
              "hit_ratio=%.4f "
              "fills_per_step=%.1f fill_mib_per_step=%.2f step_us=%.1f attend_us=%.1f "
              "copy_call_us=%.1f gather_us=%.1f wait_us=%.1f verify_bad=%d\n",
              backend->Name().c_str(), f.in_place, f.drift, f.revisit, f.policy.c_str(),
              f.resident,
              lookups > 0 ? static_cast<double>(hits) / lookups : 0.0,
              (after.fills - before.fills) / n,
              (after.fill_bytes - before.fill_bytes) / n / (1 << 20), acquire_total / n * 1e6,
              attend_total / n * 1e6, (after.copy_seconds - before.copy_seconds) / n * 1e6,
              (after.gather_seconds - before.gather_seconds) / n * 1e6,
              (after.wait_seconds - before.wait_seconds) / n * 1e6, bad);
  return bad == 0 ? 0 : 3;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  strata::Flags f;
  for (int i = 1; i < argc; ++i) {
    if (!strata::ParseFlag(argv[i], &f)) {
      std::fprintf(stderr, "unknown flag %s (see the comment at the top of gpu_cache_bench.cc)\n",
                   argv[i]);
      return 2;
    }
  }
  return strata::Run(f);
}
