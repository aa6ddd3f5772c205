#include "coordinator/metrics.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace strata::coordinator {

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry)
    : jobs(prometheus::BuildGauge().Name("strata_jobs").Help("Unfinished jobs by state").Register(registry)),
      jobs_queued(jobs.Add({{"state", "queued"}})),
      jobs_prefilling(jobs.Add({{"state", "prefilling"}})),
      jobs_decoding(jobs.Add({{"state", "decoding"}})),
      job_queue_length(prometheus::BuildGauge()
                           .Name("strata_job_queue_length")
                           .Help("Jobs waiting for a worker")
                           .Register(registry)
                           .Add({})),
      jobs_submitted(prometheus::BuildCounter()
                         .Name("strata_coordinator_jobs_submitted_total")
                         .Help("Jobs admitted")
                         .Register(registry)
                         .Add({})),
      jobs_finished(prometheus::BuildCounter()
                        .Name("strata_coordinator_jobs_finished_total")
                        .Help("Jobs that reached a terminal state, by state")
                        .Register(registry)),
      admission_rejections(prometheus::BuildCounter()
                               .Name("strata_coordinator_admission_rejections_total")
                               .Help("Job submissions refused by admission control, by status code")
                               .Register(registry)),
      documents_created(prometheus::BuildCounter()
                            .Name("strata_coordinator_documents_created_total")
                            .Help("Documents created (uploads of new content)")
                            .Register(registry)
                            .Add({})),
      document_tokens(prometheus::BuildCounter()
                          .Name("strata_coordinator_document_tokens_total")
                          .Help("Tokens of created documents")
                          .Register(registry)
                          .Add({})),
      documents_expired(prometheus::BuildCounter()
                            .Name("strata_coordinator_documents_expired_total")
                            .Help("Unpinned documents deleted after their TTL")
                            .Register(registry)
                            .Add({})),
      documents(prometheus::BuildGauge()
                    .Name("strata_coordinator_documents")
                    .Help("Documents not READY yet, by state")
                    .Register(registry)),
      documents_pending(documents.Add({{"state", "pending"}})),
      documents_prefilling(documents.Add({{"state", "prefilling"}})),
      workers(prometheus::BuildGauge()
                  .Name("strata_coordinator_workers")
                  .Help("Live registered workers")
                  .Register(registry)
                  .Add({})),
      worker_timeouts(prometheus::BuildCounter()
                          .Name("strata_coordinator_worker_timeouts_total")
                          .Help("Workers dropped after missing heartbeats")
                          .Register(registry)
                          .Add({})),
      shard_moves(prometheus::BuildCounter()
                      .Name("strata_coordinator_shard_moves_total")
                      .Help("Shard maps changed because a holder was dropped (its shards moved to live workers)")
                      .Register(registry)
                      .Add({})),
      requests(prometheus::BuildCounter()
                   .Name("strata_coordinator_requests_total")
                   .Help("RPCs served, by method and status code")
                   .Register(registry)),
      draining(prometheus::BuildGauge()
                   .Name("strata_coordinator_draining")
                   .Help("1 while the coordinator drains (SIGTERM)")
                   .Register(registry)
                   .Add({})) {}

void CoordinatorMetrics::CountRequest(const std::string& method, const absl::Status& status) {
  requests.Add({{"method", method}, {"code", absl::AsciiStrToLower(absl::StatusCodeToString(status.code()))}})
      .Increment();
}

}  // namespace strata::coordinator
