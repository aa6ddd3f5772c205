// `strata kvstore`: runs the KV store service (kvstore/service.h) until SIGINT or SIGTERM.
//
//   strata kvstore --listen 127.0.0.1:7070 --data /var/lib/strata/kv [--metrics-listen 127.0.0.1:9100]
//
// Logs the bound ports (port 0 picks a free one); --port-file also writes them, as
// "<grpc_port> <metrics_port>\n", once the service accepts calls.
#include <csignal>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/server_runtime.h"
#include "kvstore/metrics.h"
#include "kvstore/service.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace strata::cli {
namespace {

struct KvstoreFlags {
  std::string listen = "127.0.0.1:7070";
  std::string data;
  std::string metrics_listen;
  std::string port_file;
  int64_t gc_interval_seconds = 60;
  int64_t max_message_mib = 64;
  int64_t threads = 8;
  int64_t deferred_mib = 1024;
  bool sync = true;
};

int Serve(const KvstoreFlags& f) {
  if (f.data.empty()) {
    std::fprintf(stderr, "strata kvstore: --data is required\n");
    return 2;
  }
  // Block the stop signals in every thread; the main thread waits for them with sigwait.
  sigset_t stop_signals = BlockStopSignals();

  auto registry = std::make_shared<prometheus::Registry>();
  kvstore::KvMetrics metrics(registry.get());
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = 0;
  if (absl::Status s = StartMetrics(f.metrics_listen, registry, &exposer, &metrics_port); !s.ok()) {
    std::fprintf(stderr, "strata kvstore: %s\n", s.ToString().c_str());
    return 1;
  }

  kvstore::KvStoreServerOptions options;
  options.listen_address = f.listen;
  options.store.path = f.data;
  options.store.sync_writes = f.sync;
  options.max_message_bytes = f.max_message_mib << 20;
  options.gc_interval_ms = f.gc_interval_seconds * 1000;
  options.service.num_threads = static_cast<int>(f.threads);
  options.service.max_deferred_total_bytes = f.deferred_mib << 20;
  absl::StatusOr<std::unique_ptr<kvstore::KvStoreServer>> server =
      kvstore::KvStoreServer::Start(options, &metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "strata kvstore: %s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string host = f.listen.substr(0, f.listen.rfind(':'));
  STRATA_LOG(INFO) << "kvstore serving grpc=" << host << ":" << (*server)->port()
                   << " metrics_port=" << metrics_port << " data=" << f.data
                   << " sync=" << f.sync << " gc_interval_s=" << f.gc_interval_seconds
                   << " max_message_mib=" << f.max_message_mib << " threads=" << f.threads
                   << " deferred_mib=" << f.deferred_mib;
  if (!f.port_file.empty()) {
    if (absl::Status s = WritePortFile(f.port_file, (*server)->port(), metrics_port); !s.ok()) {
      std::fprintf(stderr, "strata kvstore: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  const int sig = WaitForStopSignal(stop_signals);
  STRATA_LOG(INFO) << "kvstore: signal " << sig << ", shutting down";
  (*server)->Shutdown();
  server->reset();
  return 0;
}

}  // namespace

int RunKvstore(int argc, char** argv) {
  KvstoreFlags f;
  FlagSet flags("kvstore", "--listen ADDR --data DIR [--metrics-listen ADDR]");
  flags.String("listen", &f.listen, "gRPC listen address (port 0: any free port)");
  flags.String("data", &f.data, "data directory (RocksDB); created when missing");
  flags.String("metrics-listen", &f.metrics_listen,
               "Prometheus /metrics listen address (empty: no metrics endpoint)");
  flags.String("port-file", &f.port_file,
               "write '<grpc_port> <metrics_port>' here once serving (for scripts and tests)");
  flags.Int("gc-interval-seconds", &f.gc_interval_seconds,
            "period of the collector of expired unpinned documents (0: off)");
  flags.Int("max-message-mib", &f.max_message_mib, "largest accepted request message, MiB");
  flags.Int("threads", &f.threads, "storage worker threads");
  flags.Int("deferred-mib", &f.deferred_mib,
            "most MiB of a prefill's page writes held in memory at once, over all streams, before "
            "they are stored as ingested batches");
  flags.Bool("sync", &f.sync, "sync the write-ahead log before acknowledging writes");
  const absl::Status parse = flags.Parse(argc, argv);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  if (f.gc_interval_seconds < 0 || f.max_message_mib < 1 || f.threads < 1 || f.deferred_mib < 1) {
    std::fprintf(stderr, "strata kvstore: --gc-interval-seconds >= 0, --max-message-mib >= 1, "
                         "--threads >= 1 and --deferred-mib >= 1 required\n");
    return 2;
  }
  return Serve(f);
}

}  // namespace strata::cli
