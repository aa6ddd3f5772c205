#include "kvstore/metrics.h"

namespace strata::kvstore {

KvMetrics::KvMetrics(prometheus::Registry* registry)
    : lookups_(prometheus::BuildCounter()
                   .Name("strata_kv_lookups_total")
                   .Help("KV pages and summaries looked up, by tier")
                   .Register(*registry)),
      hits_(prometheus::BuildCounter()
                .Name("strata_kv_hits_total")
                .Help("KV lookups that found the page in the tier")
                .Register(*registry)),
      fetch_bytes_(prometheus::BuildCounter()
                       .Name("strata_kv_fetch_bytes_total")
                       .Help("Bytes of KV moved from tier src to tier dst")
                       .Register(*registry)),
      fetch_duration_(prometheus::BuildHistogram()
                          .Name("strata_kv_fetch_duration_seconds")
                          .Help("Duration of one batched KV fetch from a tier")
                          .Register(*registry)),
      resident_(prometheus::BuildGauge()
                    .Name("strata_kv_resident_bytes")
                    .Help("Bytes of KV resident in the tier")
                    .Register(*registry)),
      capacity_(prometheus::BuildGauge()
                    .Name("strata_kv_capacity_bytes")
                    .Help("Capacity of the tier in bytes (0: unbounded)")
                    .Register(*registry)),
      evictions_(prometheus::BuildCounter()
                     .Name("strata_kv_evictions_total")
                     .Help("KV pages evicted from the tier")
                     .Register(*registry)) {}

TierMetrics KvMetrics::ForTier(const std::string& tier) {
  // Exponential buckets from 10 us to ~5 s.
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
      0.5,  1.0,    2.5,  5.0};
  TierMetrics m;
  m.lookups = &lookups_.Add({{"tier", tier}});
  m.hits = &hits_.Add({{"tier", tier}});
  m.evictions = &evictions_.Add({{"tier", tier}});
  m.resident_bytes = &resident_.Add({{"tier", tier}});
  m.capacity_bytes = &capacity_.Add({{"tier", tier}});
  m.fetch_duration = &fetch_duration_.Add({{"tier", tier}}, kBuckets);
  return m;
}

prometheus::Counter* KvMetrics::FetchBytes(const std::string& src, const std::string& dst) {
  return &fetch_bytes_.Add({{"src", src}, {"dst", dst}});
}

}  // namespace strata::kvstore
