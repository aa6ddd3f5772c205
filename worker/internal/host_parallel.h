// The OpenMP team for the worker's own host loops (page encoding at persistence, the pages a
// mount or an exact prefill loads, the resident mount's summary reads).
#ifndef STRATA_WORKER_INTERNAL_HOST_PARALLEL_H_
#define STRATA_WORKER_INTERNAL_HOST_PARALLEL_H_

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "base/cpu_limit.h"

namespace strata::worker::internal {

// One thread per usable core (base/cpu_limit.h: the CPU affinity capped by a cgroup CPU quota),
// at most one per item. Pass it as the loop's num_threads: the CPU
// backend sets its calling thread's default team to one thread for its small ops
// (kernels/cpu/cpu_backend.cc), and the worker's thread may have run one.
inline int HostTeam(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(UsableCores(), items)));
}

}  // namespace strata::worker::internal

#endif  // STRATA_WORKER_INTERNAL_HOST_PARALLEL_H_
