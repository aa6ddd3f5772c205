// A scriptable WorkerClient for tests: records every call and lets the test complete them.
// Thread-safe.
#ifndef STRATA_COORDINATOR_TESTING_FAKE_WORKER_CLIENT_H_
#define STRATA_COORDINATOR_TESTING_FAKE_WORKER_CLIENT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "coordinator/worker_client.h"

namespace strata::coordinator::testing {

class FakeWorkerClient : public WorkerClient {
 public:
  struct PrefillCall {
    std::string worker_id;
    v1::PrefillShardRequest request;
    ProgressFn on_progress;
    DoneFn on_done;
  };
  struct MountCall {
    std::string worker_id;
    v1::ShardRange shard;
    bool mount = true;  // false: UnmountShard
    DoneFn on_done;
    bool whole_document = false;  // MountShardRequest::whole_document
  };
  struct RunCall {
    std::string worker_id;
    v1::RunJobRequest request;
    JobEventFn on_event;
    DoneFn on_done;
  };

  void PrefillShard(const v1::WorkerInfo& worker, const v1::PrefillShardRequest& request,
                    ProgressFn on_progress, DoneFn on_done) override {
    absl::MutexLock lock(&mu_);
    prefills_.push_back({worker.worker_id(), request, std::move(on_progress), std::move(on_done)});
  }
  void MountShard(const v1::WorkerInfo& worker, const v1::MountShardRequest& request, DoneFn on_done) override {
    absl::MutexLock lock(&mu_);
    mounts_.push_back({worker.worker_id(), request.shard(), true, std::move(on_done), request.whole_document()});
  }
  void UnmountShard(const v1::WorkerInfo& worker, const v1::UnmountShardRequest& request,
                    DoneFn on_done) override {
    absl::MutexLock lock(&mu_);
    mounts_.push_back({worker.worker_id(), request.shard(), false, std::move(on_done)});
  }
  void RunJob(const v1::WorkerInfo& worker, const v1::RunJobRequest& request, JobEventFn on_event,
              DoneFn on_done) override {
    absl::MutexLock lock(&mu_);
    runs_.push_back({worker.worker_id(), request, std::move(on_event), std::move(on_done)});
  }
  void CancelJob(const v1::WorkerInfo& worker, const std::string& job_id) override {
    absl::MutexLock lock(&mu_);
    cancels_.emplace_back(worker.worker_id(), job_id);
  }

  std::vector<PrefillCall> prefills() const {
    absl::MutexLock lock(&mu_);
    return prefills_;
  }
  // MountShard and UnmountShard calls, in call order.
  std::vector<MountCall> mounts() const {
    absl::MutexLock lock(&mu_);
    return mounts_;
  }
  std::vector<RunCall> runs() const {
    absl::MutexLock lock(&mu_);
    return runs_;
  }
  std::vector<std::pair<std::string, std::string>> cancels() const {
    absl::MutexLock lock(&mu_);
    return cancels_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<PrefillCall> prefills_ ABSL_GUARDED_BY(mu_);
  std::vector<MountCall> mounts_ ABSL_GUARDED_BY(mu_);
  std::vector<RunCall> runs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, std::string>> cancels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace strata::coordinator::testing

#endif  // STRATA_COORDINATOR_TESTING_FAKE_WORKER_CLIENT_H_
