#include "coordinator/worker_registry.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace strata::coordinator {
namespace {

bool ValidWorkerId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status WorkerRegistryOptions::Validate() const {
  if (heartbeat_interval_nanos <= 0 || heartbeat_timeout_nanos <= heartbeat_interval_nanos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need 0 < heartbeat interval (", heartbeat_interval_nanos, " ns) < timeout (",
        heartbeat_timeout_nanos, " ns)"));
  }
  return absl::OkStatus();
}

WorkerRegistry::WorkerRegistry(const WorkerRegistryOptions& options, NowFn now)
    : options_(options), now_(std::move(now)) {}

absl::StatusOr<v1::RegisterWorkerResponse> WorkerRegistry::Register(const v1::WorkerInfo& info) {
  if (!ValidWorkerId(info.worker_id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id must match [A-Za-z0-9._-]{1,128}, got '", info.worker_id(), "'"));
  }
  if (info.address().empty()) return absl::InvalidArgumentError("worker address is empty");
  if (!info.selection_link_address().empty() && info.selection_link_address().rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker selection_link_address '", info.selection_link_address(), "' has no port"));
  }
  if (info.capacity_tokens() == 0) return absl::InvalidArgumentError("worker capacity_tokens is 0");
  if (info.max_jobs() == 0) return absl::InvalidArgumentError("worker max_jobs is 0");
  absl::MutexLock lock(&mu_);
  WorkerEntry entry;
  entry.info = info;
  entry.lease_id = next_lease_++;
  entry.last_heartbeat_nanos = now_();
  workers_[info.worker_id()] = entry;
  v1::RegisterWorkerResponse response;
  response.set_lease_id(entry.lease_id);
  response.set_heartbeat_interval_ms(static_cast<uint32_t>(options_.heartbeat_interval_nanos / 1'000'000));
  response.set_heartbeat_timeout_ms(static_cast<uint32_t>(options_.heartbeat_timeout_nanos / 1'000'000));
  return response;
}

absl::Status WorkerRegistry::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end() || it->second.lease_id != request.lease_id()) {
    return absl::NotFoundError(absl::StrCat("worker '", request.worker_id(), "' lease ",
                                            request.lease_id(), " is not registered; register again"));
  }
  it->second.last_heartbeat_nanos = now_();
  it->second.load = request.load();
  it->second.draining = request.draining();
  return absl::OkStatus();
}

absl::Status WorkerRegistry::Deregister(const std::string& worker_id, uint64_t lease_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.lease_id != lease_id) {
    return absl::NotFoundError(absl::StrCat("worker '", worker_id, "' lease ", lease_id, " is not registered"));
  }
  workers_.erase(it);
  return absl::OkStatus();
}

std::vector<std::string> WorkerRegistry::ExpireStale() {
  const int64_t now = now_();
  std::vector<std::string> expired;
  absl::MutexLock lock(&mu_);
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (now - it->second.last_heartbeat_nanos > options_.heartbeat_timeout_nanos) {
      expired.push_back(it->first);
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  return expired;
}

std::vector<WorkerEntry> WorkerRegistry::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerEntry> out;
  out.reserve(workers_.size());
  for (const auto& [id, entry] : workers_) out.push_back(entry);
  return out;
}

absl::StatusOr<WorkerEntry> WorkerRegistry::Get(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return absl::NotFoundError(absl::StrCat("unknown worker '", worker_id, "'"));
  return it->second;
}

size_t WorkerRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return workers_.size();
}

}  // namespace strata::coordinator
