// Prometheus metrics of the KV tiers, named as in DESIGN.md section 6:
//   strata_kv_lookups_total{tier}, strata_kv_hits_total{tier}         pages (and summaries)
//   strata_kv_fetch_bytes_total{src,dst}                               bytes moved between tiers
//   strata_kv_fetch_duration_seconds{tier}                             histogram, one Get call
//   strata_kv_resident_bytes{tier}, strata_kv_capacity_bytes{tier}     gauges
//   strata_kv_evictions_total{tier}                                    pages
// tier = gpu|host|disk|remote. One KvMetrics per registry; tiers hold pointers to their children.
// Thread-safe (prometheus-cpp metrics are atomic).
#ifndef STRATA_KVSTORE_METRICS_H_
#define STRATA_KVSTORE_METRICS_H_

#include <memory>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace strata::kvstore {

// The metric children of one tier.
struct TierMetrics {
  prometheus::Counter* lookups = nullptr;
  prometheus::Counter* hits = nullptr;
  prometheus::Counter* evictions = nullptr;
  prometheus::Gauge* resident_bytes = nullptr;
  prometheus::Gauge* capacity_bytes = nullptr;
  prometheus::Histogram* fetch_duration = nullptr;
};

class KvMetrics {
 public:
  // Registers the families in `registry` (shared; must outlive this object).
  explicit KvMetrics(prometheus::Registry* registry);

  // The children for `tier`; created on first use, stable pointers afterwards.
  TierMetrics ForTier(const std::string& tier);
  // strata_kv_fetch_bytes_total{src, dst}.
  prometheus::Counter* FetchBytes(const std::string& src, const std::string& dst);

 private:
  prometheus::Family<prometheus::Counter>& lookups_;
  prometheus::Family<prometheus::Counter>& hits_;
  prometheus::Family<prometheus::Counter>& fetch_bytes_;
  prometheus::Family<prometheus::Histogram>& fetch_duration_;
  prometheus::Family<prometheus::Gauge>& resident_;
  prometheus::Family<prometheus::Gauge>& capacity_;
  prometheus::Family<prometheus::Counter>& evictions_;
};

}  // namespace strata::kvstore

#endif  // STRATA_KVSTORE_METRICS_H_
