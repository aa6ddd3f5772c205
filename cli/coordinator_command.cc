// `strata coordinator`: runs the coordinator (public DocumentService and JobService, internal
// WorkerRegistry, health, reflection) until SIGINT or SIGTERM.
//
//   strata coordinator --listen 127.0.0.1:7700 --data /var/lib/strata/coordinator
//       [--metrics-listen 127.0.0.1:9700] [--vocab-size N] [--port-file FILE] [--model DIR]
//
// Work reaches the workers that register (`strata worker`) through the gRPC worker transport
// (coordinator::GrpcWorkerClient). --model DIR loads the served model's directory for its tokenizer
// (text uploads and text prompts), and takes the namespace, fingerprint, vocabulary size and layer
// count from it (as `strata serve` does) unless those flags are given; without --model, only
// token-id uploads and prompts are accepted.
//
// Documents are split into shards of about --target-shard-tokens, placed on the registered workers
// and prefilled there in the document's prefill mode (--default-prefill-mode when the upload names
// none); READY documents' shards are mounted by their holders, and moved to live workers when a
// holder is dropped (coordinator/coordinator.h).
//
// SIGTERM drains: health turns NOT_SERVING, uploads and submissions get UNAVAILABLE, running jobs
// get --drain-timeout-seconds to finish, and those still running are handed back (QUEUED in the
// catalog, for the next coordinator). Logs the bound ports (port 0 picks a free one); --port-file
// also writes them, as "<grpc_port> <metrics_port>\n", once the server accepts calls.
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <exception>
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
#include "engine/transformer.h"
#include "model/model.h"
#include "worker/worker.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace strata::cli {
namespace {

struct CoordinatorFlags {
  std::string listen = "127.0.0.1:7700";
  std::string metrics_listen;
  std::string data;
  std::string port_file;
  std::string model;
  std::string model_namespace = "default";
  bool model_namespace_set = false;  // --model-namespace given explicitly
  std::string model_fingerprint;
  std::string weight_format = "checkpoint";  // the workers' --weight-format, for the defaults
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t page_size = 64;
  int64_t target_shard_tokens = 65536;
  std::string default_prefill_mode = "anchor";
  int64_t anchor_tokens = 4096;
  int64_t max_document_tokens = int64_t{1} << 20;
  int64_t max_upload_mib = 64;
  int64_t max_prompt_tokens = 65536;
  int64_t max_tokens_limit = 4096;
  int64_t max_pending_jobs = 1024;
  int64_t max_pending_tokens = int64_t{64} << 20;
  int64_t heartbeat_interval_ms = 1000;
  int64_t heartbeat_timeout_ms = 5000;
  int64_t drain_timeout_seconds = 30;
  bool sync = true;
};

int Serve(const CoordinatorFlags& f) {
  if (f.data.empty()) {
    std::fprintf(stderr, "strata coordinator: --data is required\n");
    return 2;
  }
  // --model: the tokenizer, and the model's identity and shape where the flags leave them open.
  std::unique_ptr<model::Model> served_model;
  if (!f.model.empty()) {
    auto loaded = model::LoadModel(f.model);
    if (!loaded.ok()) {
      std::fprintf(stderr, "strata coordinator: %s\n", loaded.status().ToString().c_str());
      return loaded.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    served_model = *std::move(loaded);
  }
  coordinator::CoordinatorOptions options;
  options.model_namespace = f.model_namespace;
  options.model_fingerprint = f.model_fingerprint;
  options.limits.vocab_size = f.vocab_size;
  options.limits.num_layers = f.num_layers;
  if (served_model != nullptr) {
    options.tokenizer = served_model->tokenizer.get();
    // What the workers serve the model as (worker::ServedFingerprint: fp8 weights are another
    // model's KV and answers).
    const std::string served = worker::ServedFingerprint(served_model->fingerprint, f.weight_format);
    if (!f.model_namespace_set) options.model_namespace = served;
    if (f.model_fingerprint.empty()) options.model_fingerprint = served;
    if (f.vocab_size == 0) options.limits.vocab_size = served_model->config.vocab_size;
    if (f.num_layers == 0) options.limits.num_layers = served_model->config.num_layers;
  }
  options.limits.page_size = static_cast<uint32_t>(f.page_size);
  options.limits.max_document_tokens = f.max_document_tokens;
  options.limits.max_upload_bytes = f.max_upload_mib << 20;
  options.limits.max_prompt_tokens = f.max_prompt_tokens;
  options.limits.max_max_tokens = static_cast<uint32_t>(f.max_tokens_limit);
  options.limits.default_max_tokens =
      std::min<uint32_t>(options.limits.default_max_tokens, options.limits.max_max_tokens);
  options.placement.page_size = f.page_size;
  options.placement.target_shard_tokens = f.target_shard_tokens;
  if (f.default_prefill_mode == "anchor") {
    options.default_prefill_mode = v1::DocumentInfo::ANCHOR;
  } else if (f.default_prefill_mode == "exact") {
    options.default_prefill_mode = v1::DocumentInfo::EXACT;
  } else {
    std::fprintf(stderr, "strata coordinator: --default-prefill-mode must be anchor or exact, got '%s'\n",
                 f.default_prefill_mode.c_str());
    return 2;
  }
  options.anchor_tokens = f.anchor_tokens;
  options.admission.max_pending_jobs = f.max_pending_jobs;
  options.admission.max_pending_tokens = f.max_pending_tokens;
  options.registry.heartbeat_interval_nanos = f.heartbeat_interval_ms * 1'000'000;
  options.registry.heartbeat_timeout_nanos = f.heartbeat_timeout_ms * 1'000'000;
  if (f.page_size < 1 || f.page_size > 4096 || f.max_tokens_limit < 1 || f.max_tokens_limit > (1 << 24) ||
      f.drain_timeout_seconds < 0) {
    std::fprintf(stderr, "strata coordinator: --page-size in [1, 4096], --max-tokens-limit in [1, 2^24] and "
                         "--drain-timeout-seconds >= 0 required\n");
    return 2;
  }
  if (absl::Status s = options.Validate(); !s.ok()) {
    std::fprintf(stderr, "strata coordinator: %s\n", s.ToString().c_str());
    return 2;
  }

  // Block the stop signals in every thread; the main thread waits for them with sigwait.
  sigset_t stop_signals = BlockStopSignals();

  auto registry = std::make_shared<prometheus::Registry>();
  coordinator::CoordinatorMetrics metrics(*registry);
  std::unique_ptr<prometheus::Exposer> exposer;
  int metrics_port = 0;
  if (absl::Status s = StartMetrics(f.metrics_listen, registry, &exposer, &metrics_port); !s.ok()) {
    std::fprintf(stderr, "strata coordinator: %s\n", s.ToString().c_str());
    return 1;
  }

  coordinator::CatalogOptions catalog_options;
  catalog_options.path = f.data;
  catalog_options.sync_writes = f.sync;
  auto catalog = coordinator::Catalog::Open(catalog_options);
  if (!catalog.ok()) {
    std::fprintf(stderr, "strata coordinator: %s\n", catalog.status().ToString().c_str());
    return 1;
  }
  // Declared before the coordinator, so destroyed after it; Shutdown() below runs first (its
  // callbacks reach the coordinator).
  coordinator::GrpcWorkerClient worker_client;
  coordinator::Coordinator coordinator(options, *std::move(catalog), &worker_client, &metrics,
                                       &MonotonicNanos, &WallMicros);
  if (absl::Status s = coordinator.Start(); !s.ok()) {
    std::fprintf(stderr, "strata coordinator: %s\n", s.ToString().c_str());
    return 1;
  }
  coordinator::CoordinatorServerOptions server_options;
  server_options.listen_address = f.listen;
  auto server = coordinator::CoordinatorServer::Start(server_options, &coordinator, &metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "strata coordinator: %s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string host = f.listen.substr(0, f.listen.rfind(':'));
  STRATA_LOG(INFO) << "coordinator serving grpc=" << host << ":" << (*server)->port()
                   << " metrics_port=" << metrics_port << " data=" << f.data << " sync=" << f.sync
                   << " model=" << (f.model.empty() ? "none" : f.model)
                   << " namespace=" << options.model_namespace << " vocab_size=" << options.limits.vocab_size
                   << " page_size=" << f.page_size << " target_shard_tokens=" << f.target_shard_tokens
                   << " default_prefill_mode=" << f.default_prefill_mode << " anchor_tokens=" << f.anchor_tokens
                   << " max_document_tokens=" << f.max_document_tokens
                   << " max_prompt_tokens=" << f.max_prompt_tokens << " max_tokens_limit=" << f.max_tokens_limit
                   << " max_pending_jobs=" << f.max_pending_jobs << " max_pending_tokens=" << f.max_pending_tokens
                   << " heartbeat_ms=" << f.heartbeat_interval_ms << "/" << f.heartbeat_timeout_ms
                   << " drain_timeout_s=" << f.drain_timeout_seconds;
  if (!f.port_file.empty()) {
    if (absl::Status s = WritePortFile(f.port_file, (*server)->port(), metrics_port); !s.ok()) {
      std::fprintf(stderr, "strata coordinator: %s\n", s.ToString().c_str());
      return 1;
    }
  }

  const int sig = WaitForStopSignal(stop_signals);
  STRATA_LOG(INFO) << "coordinator: signal " << sig << ", draining (timeout " << f.drain_timeout_seconds << " s)";
  Stopwatch drain;
  const int64_t handed_back = coordinator::DrainAndShutdown(
      &coordinator, server->get(), absl::Seconds(f.drain_timeout_seconds), absl::Seconds(2));
  worker_client.Shutdown();  // its callbacks reach the coordinator: before the coordinator goes
  server->reset();
  STRATA_LOG(INFO) << "coordinator: stopped after " << drain.ElapsedSeconds() << " s of drain; "
                   << handed_back << " running jobs handed back";
  return 0;
}

}  // namespace

int RunCoordinator(int argc, char** argv) {
  CoordinatorFlags f;
  FlagSet flags("coordinator", "--listen ADDR --data DIR [--metrics-listen ADDR] [flags]");
  flags.String("listen", &f.listen, "gRPC listen address (port 0: any free port)");
  flags.String("metrics-listen", &f.metrics_listen, "Prometheus /metrics listen address (empty: none)");
  flags.String("data", &f.data, "catalog directory (RocksDB); created when missing");
  flags.String("port-file", &f.port_file,
               "write '<grpc_port> <metrics_port>' here once serving (for scripts and tests)");
  flags.String("model", &f.model,
               "model directory: its tokenizer for text uploads and prompts; its fingerprint is the default "
               "--model-namespace and --model-fingerprint, its config the default --vocab-size and --num-layers");
  flags.String("model-namespace", &f.model_namespace,
               "namespace of document ids (the model served): same tokens, other namespace, other document "
               "(default: the --model fingerprint, else 'default')");
  flags.String("model-fingerprint", &f.model_fingerprint,
               "refuse workers that serve another model (empty: the --model fingerprint, else accept any)");
  flags.String("weight-format", &f.weight_format,
               "checkpoint|fp8: the workers' --weight-format; fp8 workers serve the --model fingerprint + '+fp8', "
               "which then is the default --model-namespace and --model-fingerprint");
  flags.Int("vocab-size", &f.vocab_size,
            "token ids must be below this (0: the --model vocabulary, else only negative ids are refused)");
  flags.Int("num-layers", &f.num_layers,
            "model layers, for policy.dense_layers checks (0: the --model layer count, else unchecked)");
  flags.Int("page-size", &f.page_size, "tokens per KV page of the deployment");
  flags.Int("target-shard-tokens", &f.target_shard_tokens, "target tokens per document shard");
  flags.String("default-prefill-mode", &f.default_prefill_mode,
               "prefill of documents uploaded without a mode: anchor (shards in parallel, each attending to an "
               "anchor of the first tokens) or exact (shard by shard, the KV of a single-worker prefill)");
  flags.Int("anchor-tokens", &f.anchor_tokens,
            "anchor mode: the anchor is the document's first min(this, first shard's tokens) tokens");
  flags.Int("max-document-tokens", &f.max_document_tokens, "largest document, tokens");
  flags.Int("max-upload-mib", &f.max_upload_mib, "largest uploaded text, MiB");
  flags.Int("max-prompt-tokens", &f.max_prompt_tokens, "largest job prompt, tokens");
  flags.Int("max-tokens-limit", &f.max_tokens_limit, "largest accepted params.max_tokens");
  flags.Int("max-pending-jobs", &f.max_pending_jobs, "admission: unfinished jobs at most");
  flags.Int("max-pending-tokens", &f.max_pending_tokens, "admission: context tokens of unfinished jobs at most");
  flags.Int("heartbeat-interval-ms", &f.heartbeat_interval_ms, "worker heartbeat period");
  flags.Int("heartbeat-timeout-ms", &f.heartbeat_timeout_ms, "workers silent this long are dropped");
  flags.Int("drain-timeout-seconds", &f.drain_timeout_seconds,
            "on SIGTERM, how long running jobs may finish before they are handed back");
  flags.Bool("sync", &f.sync, "sync the catalog's write-ahead log on every write");
  const absl::Status parse = flags.Parse(argc, argv);
  if (!parse.ok() || flags.help_requested()) return ReportAndExit(flags, parse);
  f.model_namespace_set = flags.WasSet("model-namespace");
  if (absl::Status s = engine::ParseWeightFormat(f.weight_format).status(); !s.ok()) {
    std::fprintf(stderr, "strata coordinator: --weight-format: %s\n", s.ToString().c_str());
    return 2;
  }
  return Serve(f);
}

}  // namespace strata::cli
