#include "base/cpu_limit.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>

namespace strata {

int CgroupQuotaCores(const std::string& cgroup_root) {
  int64_t quota = -1, period = 0;
  std::ifstream v2(cgroup_root + "/cpu.max");
  if (v2) {
    std::string q;
    if (!(v2 >> q >> period) || q == "max") return 0;
    try {
      quota = std::stoll(q);
    } catch (...) {
      return 0;
    }
  } else {
    std::ifstream fq(cgroup_root + "/cpu/cpu.cfs_quota_us"), fp(cgroup_root + "/cpu/cpu.cfs_period_us");
    if (!(fq >> quota) || !(fp >> period)) return 0;
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}

int UsableCores() {
  static const int cores = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    int n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                          : static_cast<int>(std::thread::hardware_concurrency());
    const int quota = CgroupQuotaCores();
    if (quota > 0) n = std::min(n, quota);
    return std::max(1, n);
  }();
  return cores;
}

}  // namespace strata
