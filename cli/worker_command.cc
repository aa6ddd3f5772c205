// `strata worker`: one worker process (DESIGN.md section 1, strata-worker).
//
//   strata worker --listen ADDR --metrics-listen ADDR --coordinator ADDR --kvstore ADDR --model DIR
//       [--worker-id ID] [--advertise HOST:PORT] [--selection-link-listen ADDR|off] [--port-file FILE]
//
// Loads the model on the CUDA backend when a GPU is present and the binary was built with
// -DSTRATA_WORKER_CUDA=ON (CPU otherwise; see cli/CMakeLists.txt), serves the internal
// Worker service (with health and reflection) on --listen and the selection link (sharded decode
// layers' queries over plain TCP; worker/selection_link.h) on --selection-link-listen, advertised
// at the --advertise host, stores KV pages in the KV store
// service at --kvstore (`strata kvstore`), registers with the coordinator and heartbeats.
// SIGTERM drains: heartbeats say draining (no new work), running jobs get
// --drain-timeout-seconds, then the worker deregisters and stops.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/clock.h"
#include "base/logging.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/server_runtime.h"
#include "kvstore/metrics.h"
#include "kvstore/remote_store.h"
#include "model/model.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "worker/service.h"
#include "worker/worker.h"

namespace strata::cli {
namespace {

struct WorkerFlags {
  std::string listen = "127.0.0.1:7800";
  std::string metrics_listen;
  std::string coordinator;
  std::string kvstore;
  std::string model;
  std::string worker_id;
  std::string advertise;
  std::string selection_link_listen;
  std::string port_file;
  WorkerEngineFlags engine;
  int64_t capacity_tokens = int64_t{1} << 22;
  int64_t drain_timeout_seconds = 30;
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "strata worker: %s\n", s.ToString().c_str());
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

int Run(const WorkerFlags& f) {
  if (f.model.empty() || f.coordinator.empty() || f.kvstore.empty()) {
    std::fprintf(stderr, "strata worker: --model, --coordinator and --kvstore are required\n");
    return 2;
  }
  sigset_t stop_signals = BlockStopSignals();
  auto loaded = model::LoadModel(f.model);
  if (!loaded.ok()) return Fail(loaded.status());
  std::unique_ptr<model::Model> m = *std::move(loaded);

  auto registry = std::make_shared<prometheus::Registry>();
  kvstore::KvMetrics kv_metrics(registry.get());
  worker::WorkerMetrics worker_metrics(registry.get());
  worker_metrics.kv = &kv_metrics;  // lazy-mount jobs count their GPU page caches (tier "gpu")
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = 0;
  if (absl::Status s = StartMetrics(f.metrics_listen, registry, &exposer, &metrics_port); !s.ok()) {
    std::fprintf(stderr, "strata worker: %s\n", s.ToString().c_str());
    return 1;
  }

  kvstore::RemoteStoreOptions so;
  so.target = f.kvstore;
  so.metrics = &kv_metrics;
  auto store = kvstore::RemoteStore::Create(so);
  if (!store.ok()) return Fail(store.status());
  // The backend first: tier H's pages live in its host memory (pinned on CUDA) and go before it.
  std::unique_ptr<kernels::Backend> backend = MakeWorkerBackend(static_cast<int>(f.engine.threads));
  // Tier H (host memory) in front of tier R (the KV store service).
  auto host_tier = HostTier::Create(f.engine.host_cache_bytes, &kv_metrics, nullptr, store->get(), backend.get(),
                                    WorkerPageBytes(m->config, f.engine.page_size, f.engine.kv_page_dtype));
  if (!host_tier.ok()) return Fail(host_tier.status());
  kvstore::PageStore* pages = (*host_tier)->store();
  worker::WorkerOptions wo;
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  wo.worker_id = f.worker_id.empty() ? std::string(hostname) : f.worker_id;
  f.engine.ApplyTo(&wo);
  wo.capacity_tokens = static_cast<uint64_t>(f.capacity_tokens);
  // Mounted shards on the GPU through a second backend instance (before the worker: it outlives it).
  std::unique_ptr<kernels::Backend> shard_backend = MakeShardBackend(*backend, wo.shard_placement);
  auto w = worker::Worker::Create(wo, m.get(), backend.get(), pages, store->get(), &worker_metrics,
                                  shard_backend.get());
  if (!w.ok()) return Fail(w.status());
  worker::WorkerServerOptions wso;
  wso.listen_address = f.listen;
  wso.selection_link_address = f.selection_link_listen;
  auto server = worker::WorkerServer::Start(wso, w->get());
  if (!server.ok()) return Fail(server.status());
  std::string address = f.advertise;
  if (address.empty()) {
    std::string host = f.listen.substr(0, f.listen.rfind(':'));
    if (host == "0.0.0.0" || host == "[::]" || host.empty()) host = hostname;
    address = absl::StrCat(host, ":", (*server)->port());
  }
  (*w)->SetAddress(address);
  worker::RegistrationOptions ro;
  ro.coordinator = f.coordinator;
  worker::RegistrationAgent agent(ro, w->get());
  agent.Start();
  STRATA_LOG(INFO) << "worker " << wo.worker_id << ": grpc=" << address << " selection_link="
                   << ((*w)->Info().selection_link_address().empty() ? "off" : (*w)->Info().selection_link_address())
                   << " metrics_port=" << metrics_port
                   << " backend=" << backend->Name() << " coordinator=" << f.coordinator << " kvstore=" << f.kvstore
                   << " model=" << f.model << " fingerprint=" << (*w)->served_fingerprint();
  if (!f.port_file.empty()) {
    if (absl::Status s = WritePortFile(f.port_file, (*server)->port(), metrics_port); !s.ok()) {
      return Fail(s);
    }
  }
  const int sig = WaitForStopSignal(stop_signals);
  STRATA_LOG(INFO) << "worker: signal " << sig << ", draining (timeout " << f.drain_timeout_seconds << " s)";
  agent.SetDraining();
  (*server)->SetServing(false);
  Stopwatch drain;
  while ((*w)->Load().running_jobs() + (*w)->Load().prefilling_shards() > 0 &&
         drain.ElapsedSeconds() < static_cast<double>(f.drain_timeout_seconds)) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  agent.Stop();
  (*server)->Shutdown(absl::Seconds(2));
  STRATA_LOG(INFO) << "worker: stopped after " << drain.ElapsedSeconds() << " s of drain";
  return 0;
}

}  // namespace

int RunWorker(int argc, char** argv) {
  WorkerFlags f;
  FlagSet flags("worker",
                "strata worker --listen ADDR --coordinator ADDR --kvstore ADDR --model DIR [--metrics-listen ADDR]");
  flags.String("listen", &f.listen, "gRPC listen address of the Worker service (port 0: any free port)");
  flags.String("metrics-listen", &f.metrics_listen, "Prometheus /metrics listen address (empty: none)");
  flags.String("coordinator", &f.coordinator, "coordinator address (host:port)");
  flags.String("kvstore", &f.kvstore, "KV store service address (host:port)");
  flags.String("model", &f.model, "Hugging Face model directory");
  flags.String("worker-id", &f.worker_id, "stable worker id (default: the host name)");
  flags.String("advertise", &f.advertise, "address the coordinator dials (default: listen host and bound port)");
  flags.String("selection-link-listen", &f.selection_link_listen,
               "listen address of the selection link, sharded decode's per-layer exchange over TCP (default: the "
               "--listen host and a free port; 'off': none, peers use gRPC)");
  flags.String("port-file", &f.port_file, "write '<grpc_port> <metrics_port>' here once serving");
  f.engine.Register(&flags, "the KV store");
  flags.Int("capacity-tokens", &f.capacity_tokens, "document tokens this worker can hold");
  flags.Int("drain-timeout-seconds", &f.drain_timeout_seconds, "on SIGTERM, how long running jobs may finish");
  const absl::Status parse = flags.Parse(argc, argv);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  return Run(f);
}

}  // namespace strata::cli
