// The host tier of the server commands (cli/server_runtime.h): on a device backend its whole
// capacity is pinned from the start by a thread of its own, which the tier stops and joins when it
// goes; on the CPU backend nothing is reserved up front.
#include "cli/server_runtime.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "base/testing/temp_dir.h"
#include "cli/flags.h"
#include "gtest/gtest.h"
#include "kernels/testing/forwarding_backend.h"
#include "kvstore/local_store.h"
#include "worker/worker.h"

namespace strata::cli {
namespace {

// The CPU backend under a device's name, counting AllocateHost calls and taking `delay` for each
// (pinning is slow on a GPU machine). The CPU backend's host memory is allocated, not touched, so
// large capacities cost address space only.
class SlowHostBackend : public kernels::testing::ForwardingBackend {
 public:
  explicit SlowHostBackend(std::chrono::milliseconds delay)
      : ForwardingBackend("fake-device", kernels::MakeCpuBackend(1)), delay_(delay) {}
  absl::StatusOr<std::unique_ptr<kernels::Buffer>> AllocateHost(size_t bytes) override {
    calls_.fetch_add(1);
    std::this_thread::sleep_for(delay_);
    return ForwardingBackend::AllocateHost(bytes);
  }
  int calls() const { return calls_.load(); }

 private:
  std::chrono::milliseconds delay_;
  std::atomic<int> calls_{0};
};

class HostTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    kvstore::LocalStoreOptions o;
    o.path = dir_.path();
    STRATA_ASSERT_OK_AND_ASSIGN(local_, kvstore::LocalStore::Open(o));
  }

  strata::testing::TempDir dir_{"strata_server_runtime_test"};
  std::unique_ptr<kvstore::LocalStore> local_;  // closed before dir_ goes
};

constexpr int64_t kChunk = int64_t{256} << 20;  // the tier pins chunks of at most 256 MiB

TEST_F(HostTierTest, DeviceBackendPinsTheWholeCapacityFromTheStart) {
  SlowHostBackend backend(std::chrono::milliseconds(1));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostTier> tier,
                              HostTier::Create(3 * kChunk, nullptr, local_.get(), nullptr, &backend, 4096));
  ASSERT_NE(tier->allocator(), nullptr);
  EXPECT_NE(tier->store(), local_.get());  // the tiered store in front of the local one
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (tier->allocator()->reserved_bytes() < static_cast<size_t>(3 * kChunk) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(tier->allocator()->reserved_bytes(), static_cast<size_t>(3 * kChunk));
  EXPECT_EQ(backend.calls(), 3);  // three chunks, nothing else
  tier.reset();
}

TEST_F(HostTierTest, GoingAwayStopsAndJoinsThePinningThread) {
  // 16 chunks at 100 ms each would take 1.6 s; the tier goes after the first.
  SlowHostBackend backend(std::chrono::milliseconds(100));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostTier> tier,
                              HostTier::Create(16 * kChunk, nullptr, local_.get(), nullptr, &backend, 4096));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const auto t0 = std::chrono::steady_clock::now();
  tier.reset();  // joins the thread: no access to the backend after this
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int calls = backend.calls();
  EXPECT_LT(seconds, 1.0);
  EXPECT_GE(calls, 1);
  EXPECT_LT(calls, 16);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(backend.calls(), calls);
}

TEST_F(HostTierTest, CpuBackendReservesNothingUpFront) {
  std::unique_ptr<kernels::Backend> cpu = kernels::MakeCpuBackend(1);
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostTier> tier,
                              HostTier::Create(3 * kChunk, nullptr, local_.get(), nullptr, cpu.get(), 4096));
  ASSERT_NE(tier->allocator(), nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(tier->allocator()->reserved_bytes(), 0u);
  // No tier at all: the local store serves directly.
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostTier> none,
                              HostTier::Create(0, nullptr, local_.get(), nullptr, cpu.get(), 4096));
  EXPECT_EQ(none->store(), local_.get());
  EXPECT_EQ(none->allocator(), nullptr);
}

// Parses `args` as the worker engine flags and applies them to *o (when they parse).
absl::Status ParseEngineFlags(std::vector<std::string> args, worker::WorkerOptions* o) {
  FlagSet flags("worker", "");
  WorkerEngineFlags engine;
  engine.Register(&flags, "the store");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  absl::Status s = flags.Parse(static_cast<int>(argv.size()), argv.data());
  if (s.ok()) engine.ApplyTo(o);
  return s;
}

// The worker engine flags reach WorkerOptions; bad batch values fail WorkerOptions::Validate.
TEST(WorkerEngineFlagsTest, DecodeBatchFlagsReachTheWorkerOptions) {
  worker::WorkerOptions o;
  o.worker_id = "w";
  STRATA_ASSERT_OK(ParseEngineFlags({}, &o));
  EXPECT_EQ(o.max_decode_batch, 16);
  EXPECT_EQ(o.decode_batch_wait_us, 1000);
  STRATA_ASSERT_OK(ParseEngineFlags({"--max-decode-batch", "4", "--decode-batch-wait-us", "250"}, &o));
  EXPECT_EQ(o.max_decode_batch, 4);
  EXPECT_EQ(o.decode_batch_wait_us, 250);
  STRATA_EXPECT_OK(o.Validate());
  STRATA_ASSERT_OK(ParseEngineFlags({"--decode-batch-wait-us", "-1"}, &o));
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK(ParseEngineFlags({"--decode-batch-wait-us", "0", "--max-decode-batch", "0"}, &o));
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// --weight-format reaches WorkerOptions::weight_format; a format that does not exist fails
// WorkerOptions::Validate.
TEST(WorkerEngineFlagsTest, WeightFormatReachesTheWorkerOptions) {
  worker::WorkerOptions o;
  o.worker_id = "w";
  STRATA_ASSERT_OK(ParseEngineFlags({}, &o));
  EXPECT_EQ(o.weight_format, "checkpoint");
  STRATA_ASSERT_OK(ParseEngineFlags({"--weight-format", "fp8"}, &o));
  EXPECT_EQ(o.weight_format, "fp8");
  STRATA_EXPECT_OK(o.Validate());
  STRATA_ASSERT_OK(ParseEngineFlags({"--weight-format", "int4"}, &o));
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
}

// --kv-page-dtype and --kv-cache-dtype reach WorkerOptions; other values fail
// WorkerOptions::Validate naming the field.
TEST(WorkerEngineFlagsTest, KvDtypesReachTheWorkerOptions) {
  worker::WorkerOptions o;
  o.worker_id = "w";
  STRATA_ASSERT_OK(ParseEngineFlags({}, &o));
  EXPECT_EQ(o.kv_page_dtype, "bf16");
  EXPECT_EQ(o.kv_cache_dtype, "bf16");
  STRATA_ASSERT_OK(ParseEngineFlags({"--kv-page-dtype", "fp8", "--kv-cache-dtype", "fp8"}, &o));
  EXPECT_EQ(o.kv_page_dtype, "fp8");
  EXPECT_EQ(o.kv_cache_dtype, "fp8");
  STRATA_EXPECT_OK(o.Validate());
  STRATA_ASSERT_OK(ParseEngineFlags({"--kv-cache-dtype", "f32"}, &o));
  const absl::Status s = o.Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("kv_cache_dtype"), std::string::npos) << s;
}

}  // namespace
}  // namespace strata::cli
