// Prometheus metrics of the coordinator (DESIGN.md section 6; names strata_<what>_<unit>, counters
// end in _total, no job or document ids as labels). One instance per process, registered on the
// registry served by the Exposer on --metrics-listen. Thread-safe (prometheus-cpp metrics are).
#ifndef STRATA_COORDINATOR_METRICS_H_
#define STRATA_COORDINATOR_METRICS_H_

#include <string>

#include "absl/status/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace strata::coordinator {

struct CoordinatorMetrics {
  explicit CoordinatorMetrics(prometheus::Registry& registry);

  // strata_jobs{state="queued|prefilling|decoding"}: unfinished jobs by state.
  prometheus::Family<prometheus::Gauge>& jobs;
  prometheus::Gauge& jobs_queued;
  prometheus::Gauge& jobs_prefilling;
  prometheus::Gauge& jobs_decoding;
  // strata_job_queue_length: jobs waiting for a worker (= queued).
  prometheus::Gauge& job_queue_length;
  // strata_coordinator_jobs_submitted_total: jobs admitted.
  prometheus::Counter& jobs_submitted;
  // strata_coordinator_jobs_finished_total{state="done|failed|cancelled"}.
  prometheus::Family<prometheus::Counter>& jobs_finished;
  // strata_coordinator_admission_rejections_total{code="resource_exhausted|unavailable"}.
  prometheus::Family<prometheus::Counter>& admission_rejections;
  // strata_coordinator_documents_created_total / strata_coordinator_document_tokens_total.
  prometheus::Counter& documents_created;
  prometheus::Counter& document_tokens;
  // strata_coordinator_documents_expired_total: unpinned documents deleted after their TTL.
  prometheus::Counter& documents_expired;
  // strata_coordinator_documents{state="pending|prefilling"}: documents not READY yet.
  prometheus::Family<prometheus::Gauge>& documents;
  prometheus::Gauge& documents_pending;
  prometheus::Gauge& documents_prefilling;
  // strata_coordinator_workers: live workers; strata_coordinator_worker_timeouts_total.
  prometheus::Gauge& workers;
  prometheus::Counter& worker_timeouts;
  // strata_coordinator_shard_moves_total: shard maps changed because a holder was dropped.
  prometheus::Counter& shard_moves;
  // strata_coordinator_requests_total{method, code}: public and internal RPCs by final status.
  prometheus::Family<prometheus::Counter>& requests;
  // strata_coordinator_draining: 1 while draining.
  prometheus::Gauge& draining;

  // Counts one finished RPC. `method` is a fixed RPC name (bounded cardinality).
  void CountRequest(const std::string& method, const absl::Status& status);
};

}  // namespace strata::coordinator

#endif  // STRATA_COORDINATOR_METRICS_H_
