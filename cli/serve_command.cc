// `strata serve`: the coordinator, one worker and the KV store in one process (the embedded
// default of DESIGN.md section 1; no GPU needed).
//
//   strata serve --model DIR --data DIR [--listen 127.0.0.1:7070] [--metrics-listen ADDR]
//
// Layout: the KV store is a LocalStore (RocksDB in DIR/kv) used directly by the worker, with no
// gRPC server of its own. The coordinator's gRPC server (public DocumentService / JobService,
// internal WorkerRegistry, health, reflection) listens on --listen; the worker's internal Worker
// service listens on a second gRPC server on 127.0.0.1 with a free port, registers with the
// coordinator over loopback like a remote worker would, and is called by the coordinator through
// GrpcWorkerClient. The coordinator's catalog is in DIR/catalog. Documents are placed as one shard
// (target shard size = max document size), the only layout one worker supports yet.
// One /metrics endpoint (--metrics-listen) exports the coordinator's, the worker's and the KV
// tiers' metrics.
//
// --no-worker runs the coordinator alone (with the gRPC worker transport), for `strata worker`
// processes that register with it.
//
// SIGTERM / SIGINT drain: the worker reports draining, the coordinator stops admitting work and
// gives running jobs --drain-timeout-seconds to finish (the rest are handed back, QUEUED in the
// catalog), then both servers stop.
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <system_error>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/clock.h"
#include "base/logging.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/server_runtime.h"
#include "coordinator/catalog.h"
#include "coordinator/coordinator.h"
#include "coordinator/grpc_worker_client.h"
#include "coordinator/metrics.h"
#include "coordinator/service.h"
#include "kvstore/local_store.h"
#include "kvstore/metrics.h"
#include "model/model.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "worker/service.h"
#include "worker/worker.h"

namespace strata::cli {
namespace {

struct ServeFlags {
  std::string model;
  std::string data;
  std::string listen = "127.0.0.1:7070";
  std::string metrics_listen;
  std::string port_file;
  WorkerEngineFlags engine;
  int64_t max_document_tokens = int64_t{1} << 20;
  int64_t max_tokens_limit = 4096;
  int64_t drain_timeout_seconds = 30;
  bool sync = true;
  bool worker = true;
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "strata serve: %s\n", s.ToString().c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

int Serve(const ServeFlags& f) {
  if (f.model.empty() || f.data.empty()) {
    std::fprintf(stderr, "strata serve: --model and --data are required\n");
    return 2;
  }
  sigset_t stop_signals = BlockStopSignals();
  auto loaded = model::LoadModel(f.model);
  if (!loaded.ok()) return Fail(loaded.status());
  std::unique_ptr<model::Model> m = *std::move(loaded);

  auto registry = std::make_shared<prometheus::Registry>();
  coordinator::CoordinatorMetrics coordinator_metrics(*registry);
  kvstore::KvMetrics kv_metrics(registry.get());
  worker::WorkerMetrics worker_metrics(registry.get());
  worker_metrics.kv = &kv_metrics;  // lazy-mount jobs count their GPU page caches (tier "gpu")
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = 0;
  if (absl::Status s = StartMetrics(f.metrics_listen, registry, &exposer, &metrics_port); !s.ok()) {
    std::fprintf(stderr, "strata serve: %s\n", s.ToString().c_str());
    return 1;
  }

  // KV store (embedded) and worker, unless --no-worker.
  std::error_code mkdir_error;
  std::filesystem::create_directories(f.data, mkdir_error);
  if (mkdir_error) return Fail(absl::InternalError(absl::StrCat("cannot create ", f.data, ": ", mkdir_error.message())));
  std::unique_ptr<kvstore::LocalStore> store;
  std::unique_ptr<kernels::Backend> backend;  // declared before (destroyed after) tier H, whose pages it holds
  std::unique_ptr<kernels::Backend> shard_backend;  // WorkerOptions::shard_placement "device"
  std::unique_ptr<HostTier> host_tier;
  std::unique_ptr<worker::Worker> w;
  std::unique_ptr<worker::WorkerServer> worker_server;
  std::string worker_address = "none";
  if (f.worker) {
    kvstore::LocalStoreOptions store_options;
    store_options.path = f.data + "/kv";
    store_options.sync_writes = f.sync;
    store_options.metrics = &kv_metrics;
    auto opened = kvstore::LocalStore::Open(store_options);
    if (!opened.ok()) return Fail(opened.status());
    store = *std::move(opened);
    // Tier H (host memory) in front of tier D (RocksDB): pages persisted or read once stay in
    // memory for the next job, within --host-cache-bytes.
    backend = MakeWorkerBackend(static_cast<int>(f.engine.threads));
    auto ht = HostTier::Create(f.engine.host_cache_bytes, &kv_metrics, store.get(), nullptr, backend.get(),
                               WorkerPageBytes(m->config, f.engine.page_size, f.engine.kv_page_dtype));
    if (!ht.ok()) return Fail(ht.status());
    host_tier = *std::move(ht);
    kvstore::PageStore* pages = host_tier->store();
    worker::WorkerOptions wo;
    wo.worker_id = "serve-worker-0";
    f.engine.ApplyTo(&wo);
    wo.capacity_tokens = static_cast<uint64_t>(f.max_document_tokens) * 4;
    // One worker holds every shard of its documents (whole-document mounts load nothing), so a
    // shard backend is made only when asked for.
    if (wo.shard_placement == "device") shard_backend = MakeShardBackend(*backend, wo.shard_placement);
    auto created = worker::Worker::Create(wo, m.get(), backend.get(), pages, store.get(), &worker_metrics,
                                          shard_backend.get());
    if (!created.ok()) return Fail(created.status());
    w = *std::move(created);
    worker::WorkerServerOptions wso;
    wso.listen_address = "127.0.0.1:0";
    wso.selection_link_address = "off";  // the one worker leads every job: no peers
    auto started = worker::WorkerServer::Start(wso, w.get());
    if (!started.ok()) return Fail(started.status());
    worker_server = *std::move(started);
    worker_address = absl::StrCat("127.0.0.1:", worker_server->port());
    w->SetAddress(worker_address);
  }

  // Coordinator.
  coordinator::CoordinatorOptions options;
  // The embedded worker's served fingerprint (the weight format's, worker::ServedFingerprint).
  options.model_namespace = worker::ServedFingerprint(m->fingerprint, f.engine.weight_format);
  options.model_fingerprint = options.model_namespace;
  options.tokenizer = m->tokenizer.get();
  options.limits.vocab_size = m->config.vocab_size;
  options.limits.num_layers = m->config.num_layers;
  options.limits.page_size = static_cast<uint32_t>(f.engine.page_size);
  options.limits.max_document_tokens = f.max_document_tokens;
  options.limits.max_max_tokens = static_cast<uint32_t>(f.max_tokens_limit);
  options.limits.default_max_tokens = std::min<uint32_t>(options.limits.default_max_tokens,
                                                         options.limits.max_max_tokens);
  options.placement.page_size = f.engine.page_size;
  options.placement.target_shard_tokens = f.max_document_tokens;
  if (absl::Status s = options.Validate(); !s.ok()) return Fail(s);
  coordinator::CatalogOptions catalog_options;
  catalog_options.path = f.data + "/catalog";
  catalog_options.sync_writes = f.sync;
  auto catalog = coordinator::Catalog::Open(catalog_options);
  if (!catalog.ok()) return Fail(catalog.status());
  coordinator::GrpcWorkerClient worker_client;
  coordinator::Coordinator coordinator(options, *std::move(catalog), &worker_client, &coordinator_metrics,
                                       &MonotonicNanos, &WallMicros);
  if (absl::Status s = coordinator.Start(); !s.ok()) return Fail(s);
  coordinator::CoordinatorServerOptions server_options;
  server_options.listen_address = f.listen;
  auto server = coordinator::CoordinatorServer::Start(server_options, &coordinator, &coordinator_metrics);
  if (!server.ok()) return Fail(server.status());

  worker::RegistrationOptions ro;
  ro.coordinator = absl::StrCat("127.0.0.1:", (*server)->port());
  std::unique_ptr<worker::RegistrationAgent> agent;
  if (w != nullptr) {
    agent = std::make_unique<worker::RegistrationAgent>(ro, w.get());
    agent->Start();
    if (!agent->WaitRegistered(absl::Seconds(30))) {
      std::fprintf(stderr, "strata serve: the worker could not register with the coordinator\n");
      return 1;
    }
  }
  const std::string host = f.listen.substr(0, f.listen.rfind(':'));
  STRATA_LOG(INFO) << "serve: grpc=" << host << ":" << (*server)->port() << " metrics_port=" << metrics_port
                   << " worker=" << worker_address << " backend=" << (backend != nullptr ? backend->Name() : "none") << " model=" << f.model
                   << " fingerprint=" << options.model_fingerprint << " data=" << f.data << " page_size=" << f.engine.page_size;
  if (!f.port_file.empty()) {
    if (absl::Status s = WritePortFile(f.port_file, (*server)->port(), metrics_port); !s.ok()) {
      return Fail(s);
    }
  }

  const int sig = WaitForStopSignal(stop_signals);
  STRATA_LOG(INFO) << "serve: signal " << sig << ", draining (timeout " << f.drain_timeout_seconds << " s)";
  if (agent != nullptr) agent->SetDraining();
  const int64_t handed_back = coordinator::DrainAndShutdown(
      &coordinator, server->get(), absl::Seconds(f.drain_timeout_seconds), absl::Seconds(2));
  if (agent != nullptr) agent->Stop();
  if (worker_server != nullptr) worker_server->Shutdown(absl::Seconds(2));
  worker_client.Shutdown();  // its callbacks reach the coordinator: before the coordinator goes
  server->reset();
  STRATA_LOG(INFO) << "serve: stopped; " << handed_back << " running jobs handed back";
  return 0;
}

}  // namespace

int RunServe(int argc, char** argv) {
  ServeFlags f;
  FlagSet flags("serve", "strata serve --model DIR --data DIR [--listen ADDR] [--metrics-listen ADDR]");
  flags.String("model", &f.model, "Hugging Face model directory");
  flags.String("data", &f.data, "data directory (catalog/ and kv/ RocksDB stores); created when missing");
  flags.String("listen", &f.listen, "public gRPC listen address (port 0: any free port)");
  flags.String("metrics-listen", &f.metrics_listen, "Prometheus /metrics listen address (empty: none)");
  flags.String("port-file", &f.port_file, "write '<grpc_port> <metrics_port>' here once serving");
  f.engine.Register(&flags, "RocksDB");
  flags.Int("max-document-tokens", &f.max_document_tokens, "largest document, tokens");
  flags.Int("max-tokens-limit", &f.max_tokens_limit, "largest accepted params.max_tokens");
  flags.Int("drain-timeout-seconds", &f.drain_timeout_seconds, "on SIGTERM, how long running jobs may finish");
  flags.Bool("worker", &f.worker,
             "run the embedded worker and KV store (--no-worker: coordinator only, for `strata worker` processes)");
  flags.Bool("sync", &f.sync, "sync the RocksDB write-ahead logs on every write");
  const absl::Status parse = flags.Parse(argc, argv);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  return Serve(f);
}

}  // namespace strata::cli
