// The shard holder's side of one sharded decode layer, alone: ShardSession::Answer on a mounted
// shard, with no gRPC and no other worker in the process. Separates what an answer costs on the
// host (the query staged, the selection and attention queued) from the device's part, the two
// figures a ShardSelection stream reports as queue and wait (strata_shard_answer_seconds_total).
//
//   shard_answer_bench [--backend cuda|cpu] [--tokens 65536] [--layers 4] [--heads 32]
//                      [--kv-heads 8] [--dim 128] [--policy tokenselect] [--budget 1024]
//                      [--theta 1] [--rounds 2000] [--sessions 1] [--gap-us 0]
//
// The shard: --tokens random bf16 tokens (N(0, 1) keys and values) in every one of --layers
// layers, 64-token pages, mounted for device selection (a GPU worker's --shard-placement device).
// Each of --sessions sessions (one thread each, at once) answers --rounds one-token LayerQuery
// messages with fresh random queries, layer after layer; --theta 1 turns the selection cache off
// (every step selects). Prints per session the answers' mean queue and wait time and the median
// and 90th percentile of Answer's wall time, in microseconds; STRATA_SHARD_STEP_GRAPHS=0 gives
// the answers without the per-layer graphs. --gap-us N sleeps N microseconds between answers (the
// thread blocks, as a stream's thread does between a leader's queries): what an answer costs when
// it does not follow the previous one at once.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/kv_cache.h"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "model/config.h"
#include "strata/v1/internal.pb.h"
#include "worker/shard_attention.h"

namespace {

using strata::kernels::DType;
using strata::kernels::TensorView;

struct Flags {
  std::string backend = "cuda", policy = "tokenselect";
  int64_t tokens = 65536;
  int layers = 4, heads = 32, kv_heads = 8, dim = 128, budget = 1024, rounds = 2000, sessions = 1, gap_us = 0;
  double theta = 1.0;
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], v = argv[i + 1];
    if (flag == "--backend") f->backend = v;
    else if (flag == "--policy") f->policy = v;
    else if (flag == "--tokens") f->tokens = std::atoll(v.c_str());
    else if (flag == "--layers") f->layers = std::atoi(v.c_str());
    else if (flag == "--heads") f->heads = std::atoi(v.c_str());
    else if (flag == "--kv-heads") f->kv_heads = std::atoi(v.c_str());
    else if (flag == "--dim") f->dim = std::atoi(v.c_str());
    else if (flag == "--budget") f->budget = std::atoi(v.c_str());
    else if (flag == "--rounds") f->rounds = std::atoi(v.c_str());
    else if (flag == "--sessions") f->sessions = std::atoi(v.c_str());
    else if (flag == "--theta") f->theta = std::atof(v.c_str());
    else if (flag == "--gap-us") f->gap_us = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return false;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "flags come in pairs: --name value\n");
    return false;
  }
  if (f->tokens < 1024 || f->layers < 1 || f->heads < 1 || f->kv_heads < 1 || f->heads % f->kv_heads != 0 ||
      f->dim < 16 || f->rounds < 1 || f->sessions < 1) {
    std::fprintf(stderr, "bad sizes\n");
    return false;
  }
  return true;
}

// The shard's cache: random keys and values appended in chunks through backend memory.
absl::StatusOr<std::unique_ptr<strata::engine::KvCache>> MakeCache(const Flags& f, strata::kernels::Backend* be) {
  strata::engine::KvCacheOptions co;
  co.num_layers = f.layers;
  co.num_kv_heads = f.kv_heads;
  co.head_dim = f.dim;
  co.dtype = DType::kBF16;
  co.max_tokens = f.tokens;
  auto cache = strata::engine::KvCache::Create(co, be);
  if (!cache.ok()) return cache.status();
  const int64_t chunk = 4096, row = static_cast<int64_t>(f.kv_heads) * f.dim;
  std::vector<float> host(static_cast<size_t>(2 * chunk * row));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  auto k = be->Allocate(host.size() / 2 * sizeof(float));
  if (!k.ok()) return k.status();
  auto v = be->Allocate(host.size() / 2 * sizeof(float));
  if (!v.ok()) return v.status();
  for (int l = 0; l < f.layers; ++l) {
    for (int64_t t = 0; t < f.tokens; t += chunk) {
      const int64_t n = std::min(chunk, f.tokens - t);
      for (float& x : host) x = nd(rng);
      const size_t bytes = static_cast<size_t>(n * row) * sizeof(float);
      if (absl::Status s = be->CopyToDevice((*k)->data(), host.data(), bytes, nullptr); !s.ok()) return s;
      if (absl::Status s = be->CopyToDevice((*v)->data(), host.data() + chunk * row, bytes, nullptr); !s.ok()) {
        return s;
      }
      if (absl::Status s = (*cache)->Append(l, TensorView((*k)->data(), DType::kF32, {n, f.kv_heads, f.dim}),
                                            TensorView((*v)->data(), DType::kF32, {n, f.kv_heads, f.dim}));
          !s.ok()) {
        return s;
      }
    }
  }
  if (absl::Status s = be->Synchronize(nullptr); !s.ok()) return s;
  return cache;
}

struct SessionResult {
  absl::Status status;
  strata::worker::ShardAnswerTiming timing;
  std::vector<double> wall_us;
};

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (!ParseFlags(argc, argv, &f)) return 2;
  strata::kernels::BackendOptions bo;
  auto kind = strata::kernels::ParseBackendKind(f.backend);
  if (!kind.ok()) {
    std::fprintf(stderr, "%s\n", kind.status().ToString().c_str());
    return 2;
  }
  bo.kind = *kind;
  auto made = strata::kernels::MakeBackend(bo);
  if (!made.ok()) {
    std::fprintf(stderr, "backend %s: %s\n", f.backend.c_str(), made.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<strata::kernels::Backend> backend = *std::move(made);
  auto cache = MakeCache(f, backend.get());
  if (!cache.ok()) {
    std::fprintf(stderr, "cache: %s\n", cache.status().ToString().c_str());
    return 1;
  }
  strata::model::ModelConfig config;
  config.num_layers = f.layers;
  config.num_heads = f.heads;
  config.num_kv_heads = f.kv_heads;
  config.head_dim = f.dim;
  config.hidden_size = static_cast<int64_t>(f.heads) * f.dim;
  strata::v1::ShardRange range;
  range.set_first_page(0);
  range.set_end_page(static_cast<uint64_t>((f.tokens + 63) / 64));
  absl::Mutex backend_mu;
  auto shard = std::make_shared<const strata::worker::MountedShard>(
      range, strata::kvstore::DocumentId(), 0, *std::move(cache), strata::kvstore::TierCounts(), backend.get(),
      &backend_mu, /*device_selection=*/true);
  strata::v1::SelectionPolicy policy;
  policy.set_name(f.policy);
  policy.set_budget_tokens(static_cast<uint32_t>(f.budget));
  policy.set_theta(static_cast<float>(f.theta));
  std::vector<std::unique_ptr<strata::worker::ShardSession>> sessions;
  for (int i = 0; i < f.sessions; ++i) {
    auto s = strata::worker::ShardSession::Create(shard, policy, 0, config);
    if (!s.ok()) {
      std::fprintf(stderr, "session: %s\n", s.status().ToString().c_str());
      return 1;
    }
    sessions.push_back(*std::move(s));
  }
  std::printf("backend %s, shard of %lld tokens x %d layers, %d/%d heads x %d, %s budget %d theta %g, "
              "%d session(s) x %d answers, %d us apart\n",
              backend->Name().c_str(), static_cast<long long>(f.tokens), f.layers, f.heads, f.kv_heads, f.dim,
              f.policy.c_str(), f.budget, f.theta, f.sessions, f.rounds, f.gap_us);
  std::vector<SessionResult> results(static_cast<size_t>(f.sessions));
  std::vector<std::thread> threads;
  for (int i = 0; i < f.sessions; ++i) {
    threads.emplace_back([&, i] {
      SessionResult& r = results[static_cast<size_t>(i)];
      std::mt19937 rng(100 + i);
      std::normal_distribution<float> nd;
      std::vector<float> q(static_cast<size_t>(f.heads) * f.dim);
      strata::v1::LayerQuery query;
      query.set_num_tokens(1);
      query.set_q_begin(static_cast<uint64_t>(f.tokens));
      strata::v1::SelectionResponse response;
      const int warmup = 2 * f.layers;  // the graphs recorded, the caches warm
      for (int round = 0; round < warmup + f.rounds; ++round) {
        if (round == warmup) r.timing = sessions[static_cast<size_t>(i)]->answer_timing();
        for (float& x : q) x = nd(rng);
        if (f.gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(f.gap_us));
        query.set_step(static_cast<uint64_t>(round / f.layers));
        query.set_layer(static_cast<uint32_t>(round % f.layers));
        query.set_q(q.data(), q.size() * sizeof(float));
        const auto t0 = std::chrono::steady_clock::now();
        r.status = sessions[static_cast<size_t>(i)]->Answer(query, &response);
        if (!r.status.ok()) return;
        if (round >= warmup) {
          r.wall_us.push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        }
      }
      const strata::worker::ShardAnswerTiming& end = sessions[static_cast<size_t>(i)]->answer_timing();
      r.timing.answers = end.answers - r.timing.answers;
      r.timing.queue_seconds = end.queue_seconds - r.timing.queue_seconds;
      r.timing.wait_seconds = end.wait_seconds - r.timing.wait_seconds;
    });
  }
  for (std::thread& t : threads) t.join();
  int rc = 0;
  for (int i = 0; i < f.sessions; ++i) {
    SessionResult& r = results[static_cast<size_t>(i)];
    if (!r.status.ok()) {
      std::fprintf(stderr, "session %d: %s\n", i, r.status.ToString().c_str());
      rc = 1;
      continue;
    }
    std::sort(r.wall_us.begin(), r.wall_us.end());
    const double n = static_cast<double>(std::max<int64_t>(1, r.timing.answers));
    std::printf("ANSWER session %d: queue %.1f us, wait %.1f us (means); answer p50 %.1f us, p90 %.1f us\n", i,
                1e6 * r.timing.queue_seconds / n, 1e6 * r.timing.wait_seconds / n, r.wall_us[r.wall_us.size() / 2],
                r.wall_us[r.wall_us.size() * 9 / 10]);
  }
  return rc;
}
