// A fixed pool of threads running posted closures in FIFO order. Used by the KV store service so
// that blocking storage work never runs inside a gRPC reaction. Thread-safe. The destructor runs
// every task already posted, then joins.
#ifndef STRATA_KVSTORE_INTERNAL_EXECUTOR_H_
#define STRATA_KVSTORE_INTERNAL_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include <condition_variable>
#include <mutex>

namespace strata::kvstore::internal {

class Executor {
 public:
  explicit Executor(int num_threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Post(std::function<void()> task);

 private:
  void Loop();

  std::mutex mu_;  // std locks: visible to TSan (Debian's Abseil is not instrumented)
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace strata::kvstore::internal

#endif  // STRATA_KVSTORE_INTERNAL_EXECUTOR_H_
