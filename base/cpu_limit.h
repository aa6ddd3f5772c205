// The CPU cores a process may use: its CPU affinity, capped by its cgroup's CPU quota where one is
// set (as a Kubernetes CPU limit sets it, while the affinity still lists every core of the node).
// What sizes the CPU backend's default thread team and the selection link's spinning readers.
// Thread-safe (stateless functions; UsableCores reads once).
#ifndef STRATA_BASE_CPU_LIMIT_H_
#define STRATA_BASE_CPU_LIMIT_H_

#include <string>

namespace strata {

// The cores of the cgroup's CPU quota under `cgroup_root`: cgroup v2 `cpu.max` ("QUOTA PERIOD" or
// "max PERIOD"), else cgroup v1 `cpu/cpu.cfs_quota_us` and `cpu/cpu.cfs_period_us`; the quota
// divided by the period, rounded up. 0 when no quota is set ("max", -1) or none can be read.
int CgroupQuotaCores(const std::string& cgroup_root = "/sys/fs/cgroup");

// The cores in this process's CPU affinity (std::thread::hardware_concurrency where it cannot be
// read), capped by CgroupQuotaCores() when that is set; at least 1. Read at the first call.
int UsableCores();

}  // namespace strata

#endif  // STRATA_BASE_CPU_LIMIT_H_
