// CPU-vs-CUDA equivalence tests: one parameterised suite per op. Each case draws fresh random
// inputs (seed printed on failure), runs the CPU reference backend and the CUDA backend on the
// same values, poisons every CUDA output with NaN first, and checks every element against a
// per-op, per-dtype tolerance |d| <= atol + rtol * |ref| (NaN never passes). Without a GPU the
// CUDA tests report "no CUDA GPU: skipped" (ctest counts them as skipped, not passed).
#include "kernels/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

constexpr uint32_t kSeed = 20261122;
uint32_t g_seed = kSeed;  // the current test's seed (kSeed mixed with the test name), printed
const float kNaN = std::numeric_limits<float>::quiet_NaN();

const float kNegInf = -std::numeric_limits<float>::infinity();

// A host tensor in `dtype` plus the f32 values it holds (after rounding to dtype).
struct HostTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;
  std::vector<uint8_t> bytes;

  int64_t NumElements() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
  TensorView View(void* data) const {
    TensorView v;
    v.data = data;
    v.dtype = dtype;
    v.rank = static_cast<int>(dims.size());
    for (int i = 0; i < v.rank; ++i) v.shape[i] = dims[i];
    return v;
  }
  TensorView HostView() { return View(bytes.data()); }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
  std::vector<float> Values() const {
    std::vector<float> v(NumElements());
    ConvertToF32(bytes.data(), dtype, v.data(), NumElements());
    return v;
  }
};

HostTensor Random(std::mt19937& rng, DType dtype, std::vector<int64_t> dims, float lo = -1.0f,
                  float hi = 1.0f) {
  HostTensor t;
  t.dtype = dtype;
  t.dims = std::move(dims);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> raw(t.NumElements());
  for (float& x : raw) x = dist(rng);
  t.bytes.resize(raw.size() * DTypeSize(dtype) + 4);
  ConvertFromF32(raw.data(), t.bytes.data(), dtype, static_cast<int64_t>(raw.size()));
  return t;
}

HostTensor Filled(std::vector<int64_t> dims, float value) {
  HostTensor t;
  t.dims = std::move(dims);
  t.bytes.resize(t.NumElements() * 4 + 4);
  for (int64_t i = 0; i < t.NumElements(); ++i) t.f32()[i] = value;
  return t;
}

// Every element: |got - want| <= atol + rtol * scale[i] (scale defaults to |want|); NaN fails
// unless both are the same infinity.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double atol,
                 double rtol, const std::string& what, const std::vector<double>* scale = nullptr) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double ref = scale ? (*scale)[i] : std::fabs(static_cast<double>(want[i]));
    if (!(d <= atol + rtol * ref)) {
      if (++bad <= 3) {
        ADD_FAILURE() << what << " (seed " << g_seed << "): element " << i << " got " << got[i]
                      << " want " << want[i] << " |d| " << d << " > " << atol + rtol * ref;
      }
    }
    if (d > worst && std::isfinite(d)) worst = d;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " elements out of tolerance";
}

struct SelCase;  // a SelectedAttention test case (below)

class CudaBackendTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto b = MakeCudaBackend(0);
    if (b.ok()) {
      gpu_ = std::move(b).value().release();
    } else {
      why_ = b.status().ToString();
    }
    cpu_ = MakeCpuBackend().release();
  }
  static void TearDownTestSuite() {
    delete gpu_;
    gpu_ = nullptr;
    delete cpu_;
    cpu_ = nullptr;
  }
  void SetUp() override {
    if (gpu_ == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why_ << ")";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    g_seed = kSeed ^ static_cast<uint32_t>(std::hash<std::string>()(
                         std::string(info->test_suite_name()) + "." + info->name()));
    rng_.seed(g_seed);
    RecordProperty("seed", static_cast<int>(g_seed & 0x7fffffff));
  }

  // Device copy of a host tensor, or (poison) a NaN-filled device buffer of the same size.
  std::unique_ptr<Buffer> Upload(const HostTensor& t) {
    auto buf = gpu_->Allocate(std::max<size_t>(t.bytes.size(), 4));
    EXPECT_TRUE(buf.ok()) << buf.status();
    EXPECT_TRUE(gpu_->CopyToDevice(buf.value()->data(), t.bytes.data(), t.bytes.size(), nullptr).ok());
    return std::move(buf).value();
  }
  std::unique_ptr<Buffer> UploadRaw(const void* p, size_t bytes) {
    auto buf = gpu_->Allocate(std::max<size_t>(bytes, 4));
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (bytes > 0) {
      EXPECT_TRUE(gpu_->CopyToDevice(buf.value()->data(), p, bytes, nullptr).ok());
    }
    return std::move(buf).value();
  }
  std::vector<float> Download(Buffer& b, int64_t n) {
    std::vector<float> v(n);
    EXPECT_TRUE(gpu_->CopyToHost(v.data(), b.data(), n * 4, nullptr).ok());
    return v;
  }

  // One SelectedAttention case on both backends (defined with SelCase below).
  void RunSelectedCase(const SelCase& c);

  static Backend* gpu_;
  static Backend* cpu_;
  static std::string why_;
  std::mt19937 rng_;
};

Backend* CudaBackendTest::gpu_ = nullptr;
Backend* CudaBackendTest::cpu_ = nullptr;
std::string CudaBackendTest::why_;

// ---- Factory and memory ----------------------------------------------------------------------

TEST(CudaBackendFactoryTest, BadDeviceIsUnavailable) {
  EXPECT_THAT(MakeCudaBackend(-1).status(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(MakeCudaBackend(1 << 20).status(), StatusIs(absl::StatusCode::kUnavailable));
  auto b = MakeCudaBackend(0);
  if (b.ok()) {
    EXPECT_EQ(b.value()->Name(), "cuda:0");
  } else {
    EXPECT_THAT(b.status(), StatusIs(absl::StatusCode::kUnavailable));
  }
}

TEST_F(CudaBackendTest, MemoryRoundTripAndErrors) {
  std::vector<uint8_t> src(12345), dst(12345, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(rng_());
  STRATA_ASSERT_OK_AND_ASSIGN(auto buf, gpu_->Allocate(src.size()));
  EXPECT_EQ(buf->bytes(), src.size());
  STRATA_ASSERT_OK(gpu_->CopyToDevice(buf->data(), src.data(), src.size(), nullptr));
  STRATA_ASSERT_OK(gpu_->CopyToHost(dst.data(), buf->data(), dst.size(), nullptr));
  EXPECT_EQ(src, dst);
  EXPECT_THAT(gpu_->CopyToDevice(nullptr, src.data(), 4, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // 1 PiB cannot be allocated: ResourceExhausted, and the backend keeps working afterwards.
  EXPECT_THAT(gpu_->Allocate(size_t{1} << 50).status(),
              StatusIs(absl::StatusCode::kResourceExhausted));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
  // A stream of our own.
  auto* cuda = static_cast<CudaBackend*>(gpu_);
  STRATA_ASSERT_OK_AND_ASSIGN(Stream s, cuda->CreateStream());
  std::fill(dst.begin(), dst.end(), 0);
  STRATA_ASSERT_OK(gpu_->CopyToHost(dst.data(), buf->data(), dst.size(), s));
  EXPECT_EQ(src, dst);
  STRATA_ASSERT_OK(cuda->DestroyStream(s));
}

// ---- Forked streams --------------------------------------------------------------------------

// A fork's branch sees the work queued before the fork, the work after the join sees the
// branch's, eagerly and in a captured graph replayed on new inputs; a stream that is not a live
// fork cannot be joined. The CPU backend's fork is the stream itself.
TEST_F(CudaBackendTest, ForkJoinOrdersBranches) {
  const int64_t n = 1 << 20;  // long enough for the branches to overlap
  HostTensor a = Random(rng_, DType::kF32, {n}, -5, 5);
  HostTensor b = Random(rng_, DType::kF32, {n}, -5, 5);
  auto d_a = Upload(a), d_b = Upload(b);
  auto d_t = Upload(Filled({n}, kNaN)), d_x = Upload(Filled({n}, kNaN));
  auto d_y = Upload(Filled({n}, kNaN)), d_z = Upload(Filled({n}, kNaN));
  const TensorView va = a.View(d_a->data()), vb = a.View(d_b->data()), vt = a.View(d_t->data());
  const TensorView vx = a.View(d_x->data()), vy = a.View(d_y->data()), vz = a.View(d_z->data());
  // t = a + a; fork: x = t + b on the branch, y = t - b here; join; z = x + y.
  auto run = [&](Backend* be, const TensorView& ta, const TensorView& tb, const TensorView& tt,
                 const TensorView& tx, const TensorView& ty, const TensorView& tz) -> absl::Status {
    STRATA_RETURN_IF_ERROR(be->Add({ta, ta, tt}, nullptr));
    STRATA_ASSIGN_OR_RETURN(Stream side, be->ForkStream(nullptr));
    absl::Status s = be->Add({tt, tb, tx}, side);
    if (s.ok()) s = be->Add({tt, tb, ty, 1.0f, -1.0f}, nullptr);
    const absl::Status joined = be->JoinStream(side, nullptr);
    STRATA_RETURN_IF_ERROR(s);
    STRATA_RETURN_IF_ERROR(joined);
    return be->Add({tx, ty, tz}, nullptr);
  };
  auto want_of = [&](HostTensor& ha, HostTensor& hb) {
    HostTensor t = Filled({n}, kNaN), x = Filled({n}, kNaN), y = Filled({n}, kNaN);
    HostTensor z = Filled({n}, kNaN);
    EXPECT_TRUE(run(cpu_, ha.HostView(), hb.HostView(), t.HostView(), x.HostView(), y.HostView(),
                    z.HostView())
                    .ok());
    return z.Values();
  };
  STRATA_ASSERT_OK(run(gpu_, va, vb, vt, vx, vy, vz));
  ExpectClose(Download(*d_z, n), want_of(a, b), 0, 0, "eager");

  auto d_z2 = Upload(Filled({n}, kNaN));
  const TensorView vz2 = a.View(d_z2->data());
  STRATA_ASSERT_OK(gpu_->BeginCapture(nullptr));
  const absl::Status recorded = run(gpu_, va, vb, vt, vx, vy, vz2);
  auto graph = gpu_->EndCapture(nullptr);
  STRATA_ASSERT_OK(recorded);
  STRATA_ASSERT_OK(graph.status());
  HostTensor a2 = Random(rng_, DType::kF32, {n}, -5, 5);
  STRATA_ASSERT_OK(gpu_->CopyToDevice(d_a->data(), a2.bytes.data(), a2.bytes.size(), nullptr));
  STRATA_ASSERT_OK(graph.value()->Replay(nullptr));
  ExpectClose(Download(*d_z2, n), want_of(a2, b), 0, 0, "graph replay");

  // Joining a stream that is not a live fork.
  auto* cuda = static_cast<CudaBackend*>(gpu_);
  STRATA_ASSERT_OK_AND_ASSIGN(Stream own, cuda->CreateStream());
  EXPECT_THAT(gpu_->JoinStream(own, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK(cuda->DestroyStream(own));
  STRATA_ASSERT_OK_AND_ASSIGN(Stream side, gpu_->ForkStream(nullptr));
  STRATA_ASSERT_OK(gpu_->JoinStream(side, nullptr));
  EXPECT_THAT(gpu_->JoinStream(side, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
  // The CPU backend runs a fork's ops in order.
  STRATA_ASSERT_OK_AND_ASSIGN(Stream cpu_side, cpu_->ForkStream(nullptr));
  EXPECT_EQ(cpu_side, nullptr);
  STRATA_ASSERT_OK(cpu_->JoinStream(cpu_side, nullptr));
}

// A capture of the default stream records this thread's ops only: another thread's synchronous
// copies on the default stream meanwhile run (they neither fail nor join the graph), and the
// graph replays the recorded op alone.
TEST_F(CudaBackendTest, CaptureOfTheDefaultStreamLeavesOtherThreadsAlone) {
  const int64_t n = 1 << 16;
  HostTensor a = Random(rng_, DType::kF32, {n}, -5, 5);
  HostTensor b = Random(rng_, DType::kF32, {n}, -5, 5);
  auto d_a = Upload(a), d_b = Upload(b), d_z = Upload(Filled({n}, kNaN));
  auto d_other = Upload(Filled({n}, kNaN));
  const TensorView va = a.View(d_a->data()), vb = a.View(d_b->data()), vz = a.View(d_z->data());
  absl::Notification capturing, recorded;
  std::vector<float> back(n, kNaN);
  absl::Status other_status;
  std::thread other([&] {
    capturing.WaitForNotification();
    // Synchronous copies on the default stream while the other thread's capture is open.
    absl::Status s = gpu_->CopyToDevice(d_other->data(), b.bytes.data(), b.bytes.size(), nullptr);
    if (s.ok()) s = gpu_->CopyToHost(back.data(), d_other->data(), n * 4, nullptr);
    if (s.ok()) s = gpu_->Synchronize(nullptr);
    other_status = s;
    recorded.Notify();
  });
  STRATA_ASSERT_OK(gpu_->BeginCapture(nullptr));
  capturing.Notify();
  recorded.WaitForNotification();  // the other thread's copies ran during the capture
  const absl::Status added = gpu_->Add({va, vb, vz}, nullptr);
  auto graph = gpu_->EndCapture(nullptr);
  other.join();
  STRATA_ASSERT_OK(other_status);
  STRATA_ASSERT_OK(added);
  STRATA_ASSERT_OK(graph.status());
  EXPECT_EQ(std::memcmp(back.data(), b.bytes.data(), n * 4), 0);
  // Nothing ran at capture: z is still NaN; the replay computes a + b on the default stream.
  EXPECT_TRUE(std::isnan(Download(*d_z, n)[0]));
  STRATA_ASSERT_OK(graph.value()->Replay(nullptr));
  HostTensor z = Filled({n}, kNaN);
  STRATA_ASSERT_OK(cpu_->Add({a.HostView(), b.HostView(), z.HostView()}, nullptr));
  ExpectClose(Download(*d_z, n), z.Values(), 0, 0, "replay");
}

// Copies that do not wait, read back behind marks: a device buffer filled from pinned host memory
// and copied out again arrives once the mark after the copies is waited for, with another op
// queued in between; each mark is waited for once. The CPU backend's copies are done at once.
TEST_F(CudaBackendTest, AsyncCopiesAndMarks) {
  const size_t n = 1 << 20;
  STRATA_ASSERT_OK_AND_ASSIGN(auto src, gpu_->AllocateHost(n * 4));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dst, gpu_->AllocateHost(n * 4));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, gpu_->Allocate(n * 4));
  float* s = static_cast<float*>(src->data());
  float* d = static_cast<float*>(dst->data());
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<float>(rng_() % 1000) - 500.0f, d[i] = kNaN;
  const TensorView v(dev->data(), DType::kF32, {static_cast<int64_t>(n)});
  STRATA_ASSERT_OK(gpu_->CopyToDeviceAsync(dev->data(), s, n * 4, nullptr));
  STRATA_ASSERT_OK(gpu_->Add({v, v, v}, nullptr));  // doubled on the device
  STRATA_ASSERT_OK(gpu_->CopyToHostAsync(d, dev->data(), n * 4, nullptr));
  STRATA_ASSERT_OK_AND_ASSIGN(int64_t mark, gpu_->RecordMark(nullptr));
  STRATA_ASSERT_OK(gpu_->WaitMark(mark));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(d[i], 2.0f * s[i]) << i;
  EXPECT_THAT(gpu_->WaitMark(mark), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(gpu_->WaitMark(-3), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(gpu_->CopyToDeviceAsync(nullptr, s, 4, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Marks recorded and waited for out of order.
  STRATA_ASSERT_OK_AND_ASSIGN(int64_t m1, gpu_->RecordMark(nullptr));
  STRATA_ASSERT_OK_AND_ASSIGN(int64_t m2, gpu_->RecordMark(nullptr));
  EXPECT_NE(m1, m2);
  STRATA_ASSERT_OK(gpu_->WaitMark(m2));
  STRATA_ASSERT_OK(gpu_->WaitMark(m1));
  // The CPU backend.
  float x[3] = {1, 2, 3}, y[3] = {0, 0, 0};
  STRATA_ASSERT_OK(cpu_->CopyToHostAsync(y, x, sizeof(x), nullptr));
  STRATA_ASSERT_OK_AND_ASSIGN(int64_t cm, cpu_->RecordMark(nullptr));
  STRATA_ASSERT_OK(cpu_->WaitMark(cm));
  EXPECT_EQ(y[2], 3.0f);
}

// Small copies that do not wait between AllocateHost memory and device memory run as a kernel
// (LaunchCopyBytes): every size (1, 3, 17, ... up to the largest kernel copy and one past it, on
// the copy engine) and every misalignment of either side arrives byte for byte, the bytes around
// the destination stay as they were, and the copies record into a graph and replay there.
TEST_F(CudaBackendTest, SmallAsyncCopiesAtAwkwardSizesAndOffsets) {
  const size_t cap = 256 * 1024 + 64;
  STRATA_ASSERT_OK_AND_ASSIGN(auto host_in, gpu_->AllocateHost(cap));
  STRATA_ASSERT_OK_AND_ASSIGN(auto host_out, gpu_->AllocateHost(cap));
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev, gpu_->Allocate(cap));
  uint8_t* in = static_cast<uint8_t*>(host_in->data());
  uint8_t* out = static_cast<uint8_t*>(host_out->data());
  for (const size_t bytes : {size_t{1}, size_t{3}, size_t{4}, size_t{16}, size_t{17}, size_t{129},
                             size_t{4096 + 3}, size_t{16384}, size_t{256 * 1024}, size_t{256 * 1024 + 16}}) {
    for (const size_t src_off : {size_t{0}, size_t{1}, size_t{4}}) {
      for (const size_t dst_off : {size_t{0}, size_t{3}, size_t{16}}) {
        if (bytes + std::max(src_off, dst_off) + 16 > cap) continue;
        SCOPED_TRACE(::testing::Message() << bytes << " bytes, offsets " << src_off << " / " << dst_off);
        for (size_t i = 0; i < cap; ++i) in[i] = static_cast<uint8_t>(rng_()), out[i] = 0xA5;
        STRATA_ASSERT_OK(gpu_->CopyToDevice(dev->data(), out, cap, nullptr));  // 0xA5 around it
        uint8_t* d = static_cast<uint8_t*>(dev->data());
        STRATA_ASSERT_OK(gpu_->CopyToDeviceAsync(d + dst_off, in + src_off, bytes, nullptr));
        STRATA_ASSERT_OK(gpu_->CopyToHostAsync(out + src_off, d + dst_off, bytes, nullptr));
        STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
        ASSERT_EQ(std::memcmp(out + src_off, in + src_off, bytes), 0);
        std::vector<uint8_t> back(cap);
        STRATA_ASSERT_OK(gpu_->CopyToHost(back.data(), d, cap, nullptr));
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(back[i], 0xA5) << i;
        for (size_t i = dst_off + bytes; i < cap; ++i) ASSERT_EQ(back[i], 0xA5) << i;
      }
    }
  }
  // Recorded in a graph: each replay copies what the host buffer holds then.
  const size_t n = 4096;
  float* fin = static_cast<float*>(host_in->data());
  float* fout = static_cast<float*>(host_out->data());
  const TensorView v(dev->data(), DType::kF32, {static_cast<int64_t>(n)});
  STRATA_ASSERT_OK_AND_ASSIGN(Stream st, gpu_->CreateStream());
  STRATA_ASSERT_OK(gpu_->BeginCapture(st));
  STRATA_ASSERT_OK(gpu_->CopyToDeviceAsync(dev->data(), fin, n * 4, st));
  STRATA_ASSERT_OK(gpu_->Add({v, v, v}, st));
  STRATA_ASSERT_OK(gpu_->CopyToHostAsync(fout, dev->data(), n * 4, st));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Graph> graph, gpu_->EndCapture(st));
  for (int round = 0; round < 3; ++round) {
    for (size_t i = 0; i < n; ++i) fin[i] = static_cast<float>(rng_() % 1000) - 500.0f, fout[i] = kNaN;
    STRATA_ASSERT_OK(graph->Replay(st));
    STRATA_ASSERT_OK(gpu_->Synchronize(st));
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(fout[i], 2.0f * fin[i]) << "round " << round << ", " << i;
  }
  graph.reset();
  STRATA_ASSERT_OK(gpu_->DestroyStream(st));
}

// ---- Embedding -------------------------------------------------------------------------------

class CudaEmbeddingTest : public CudaBackendTest,
                          public ::testing::WithParamInterface<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(CudaEmbeddingTest, MatchesCpu) {
  const auto [dt, hidden, n] = GetParam();
  const int64_t vocab = 37;
  HostTensor table = Random(rng_, dt, {vocab, hidden});
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng_() % vocab);
  HostTensor want = Filled({n, hidden}, kNaN);
  STRATA_ASSERT_OK(cpu_->Embedding({ids.data(), table.HostView(), want.HostView()}, nullptr));
  auto d_table = Upload(table);
  auto d_ids = UploadRaw(ids.data(), ids.size() * 4);
  auto d_out = Upload(Filled({n, hidden}, kNaN));
  EmbeddingParams p{static_cast<const int32_t*>(d_ids->data()), table.View(d_table->data()),
                    want.View(d_out->data())};
  STRATA_ASSERT_OK(gpu_->Supports(p));
  STRATA_ASSERT_OK(gpu_->Embedding(p, nullptr));
  ExpectClose(Download(*d_out, n * hidden), want.Values(), 0, 0,
              absl::StrCat("embedding ", DTypeName(dt)));
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaEmbeddingTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(1, 3, 17, 129, 4096, 4098,
                                                              8192),
                                            ::testing::Values(1, 3, 129)));

TEST_F(CudaBackendTest, EmbeddingBadIdGivesNaNRow) {
  HostTensor table = Random(rng_, DType::kF32, {5, 7});
  std::vector<int32_t> ids = {1, 5, -1};
  auto d_table = Upload(table);
  auto d_ids = UploadRaw(ids.data(), 12);
  auto d_out = Upload(Filled({3, 7}, 0.0f));
  HostTensor out_shape = Filled({3, 7}, 0.0f);
  STRATA_ASSERT_OK(gpu_->Embedding({static_cast<const int32_t*>(d_ids->data()),
                                    table.View(d_table->data()), out_shape.View(d_out->data())},
                                   nullptr));
  std::vector<float> got = Download(*d_out, 21);
  std::vector<float> tv = table.Values();
  for (int j = 0; j < 7; ++j) {
    EXPECT_EQ(got[j], tv[7 + j]);
    EXPECT_TRUE(std::isnan(got[7 + j]));
    EXPECT_TRUE(std::isnan(got[14 + j]));
  }
}

// ---- RmsNorm ---------------------------------------------------------------------------------

class CudaRmsNormTest : public CudaBackendTest,
                        public ::testing::WithParamInterface<std::tuple<DType, int64_t, int64_t>> {};

TEST_P(CudaRmsNormTest, MatchesCpu) {
  const auto [dt, hidden, n] = GetParam();
  HostTensor in = Random(rng_, DType::kF32, {n, hidden}, -3, 3);
  HostTensor w = Random(rng_, dt, {hidden}, 0.5, 1.5);
  HostTensor want = Filled({n, hidden}, kNaN);
  STRATA_ASSERT_OK(cpu_->RmsNorm({in.HostView(), w.HostView(), want.HostView(), 1e-5f}, nullptr));
  auto d_in = Upload(in);
  auto d_w = Upload(w);
  auto d_out = Upload(Filled({n, hidden}, kNaN));
  RmsNormParams p{in.View(d_in->data()), w.View(d_w->data()), want.View(d_out->data()), 1e-5f};
  STRATA_ASSERT_OK(gpu_->RmsNorm(p, nullptr));
  ExpectClose(Download(*d_out, n * hidden), want.Values(), 1e-6, 2e-5,
              absl::StrCat("rmsnorm ", DTypeName(dt)));
  // In place.
  p.out = p.in;
  STRATA_ASSERT_OK(gpu_->RmsNorm(p, nullptr));
  ExpectClose(Download(*d_in, n * hidden), want.Values(), 1e-6, 2e-5, "rmsnorm in place");
}

// With a residual: in += residual (bit for bit the CPU twin's sum), then the norm of the sum (as
// the CPU twin, to tolerance), out separate and in place.
TEST_P(CudaRmsNormTest, ResidualMatchesCpu) {
  const auto [dt, hidden, n] = GetParam();
  HostTensor in = Random(rng_, DType::kF32, {n, hidden}, -3, 3);
  HostTensor res = Random(rng_, DType::kF32, {n, hidden}, -1, 1);
  HostTensor w = Random(rng_, dt, {hidden}, 0.5, 1.5);
  HostTensor sum = in, want = Filled({n, hidden}, kNaN);
  STRATA_ASSERT_OK(cpu_->RmsNorm(
      {sum.HostView(), w.HostView(), want.HostView(), 1e-5f, res.HostView()}, nullptr));
  for (bool in_place : {false, true}) {
    auto d_in = Upload(in);
    auto d_res = Upload(res);
    auto d_w = Upload(w);
    auto d_out = Upload(Filled({n, hidden}, kNaN));
    RmsNormParams p{in.View(d_in->data()), w.View(d_w->data()), want.View(d_out->data()), 1e-5f,
                    res.View(d_res->data())};
    if (in_place) p.out = p.in;
    STRATA_ASSERT_OK(gpu_->RmsNorm(p, nullptr));
    ExpectClose(Download(in_place ? *d_in : *d_out, n * hidden), want.Values(), 1e-6, 2e-5,
                absl::StrCat("rmsnorm residual ", DTypeName(dt), in_place ? " in place" : ""));
    if (!in_place) ExpectClose(Download(*d_in, n * hidden), sum.Values(), 0, 0, "in + residual");
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaRmsNormTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(1, 3, 17, 129, 4096, 4098,
                                                              8192),
                                            ::testing::Values(1, 3, 129)));

// ---- MatMul ----------------------------------------------------------------------------------

// (weight dtype, tokens, in_features, out_features, with bias)
class CudaMatMulTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<std::tuple<DType, int64_t, int64_t, int64_t, bool>> {};

TEST_P(CudaMatMulTest, MatchesCpu) {
  const auto [dt, n, k, m, with_bias] = GetParam();
  HostTensor in = Random(rng_, DType::kF32, {n, k}, -2, 2);
  HostTensor w = Random(rng_, dt, {m, k});
  HostTensor bias = Random(rng_, dt, {m});
  HostTensor want = Filled({n, m}, kNaN);
  MatMulParams cp{in.HostView(), w.HostView(), with_bias ? bias.HostView() : TensorView(),
                  want.HostView()};
  STRATA_ASSERT_OK(cpu_->MatMul(cp, nullptr));
  auto d_in = Upload(in);
  auto d_w = Upload(w);
  auto d_b = Upload(bias);
  auto d_out = Upload(Filled({n, m}, kNaN));
  MatMulParams p{in.View(d_in->data()), w.View(d_w->data()),
                 with_bias ? bias.View(d_b->data()) : TensorView(), want.View(d_out->data())};
  STRATA_ASSERT_OK(gpu_->Supports(p));
  STRATA_ASSERT_OK(gpu_->MatMul(p, nullptr));
  // Tolerance relative to sum_i |in * w| (+ |bias|): the dot products cancel, so |ref| alone is
  // no measure of the rounding. bf16/f16 with 2+ tokens (and 16-byte rows, or > 8 tokens) keeps
  // ~16 bits of each activation (hi/lo).
  const std::vector<float> iv = in.Values(), wv = w.Values(), bv = bias.Values();
  std::vector<double> scale(n * m);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < m; ++o) {
      double a = with_bias ? std::fabs(bv[o]) : 0.0;
      for (int64_t i = 0; i < k; ++i) a += std::fabs(double(iv[t * k + i]) * wv[o * k + i]);
      scale[t * m + o] = a;
    }
  }
  ExpectClose(Download(*d_out, n * m), want.Values(), 1e-6, 3e-5,
              absl::StrCat("matmul ", DTypeName(dt), " n=", n, " k=", k, " m=", m), &scale);
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, CudaMatMulTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(1, 3, 8, 9, 16, 129), ::testing::Values(0, 1, 17, 256, 1000),
                       ::testing::Values(1, 3, 129), ::testing::Bool()));

// Decode-sized GEMVs with model-sized rows: for several tokens with 16-byte rows, 16 rows per
// block on tensor cores (16 tokens: two n8 tiles), the row's 32-column steps split over 8 warps
// (4096: 16 steps each; 14336: 56) and their sums added across the block; 4100 (not a multiple of
// 8: scalar loads) one block of up to 256 threads per row (16 tokens: the split GEMMs); one token with
// 16-byte rows of a weight up to 64 MiB takes a warp per row (4096: 16 loads per lane in two
// rounds; 14336: 56 in seven).
INSTANTIATE_TEST_SUITE_P(
    LongRows, CudaMatMulTest,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16), ::testing::Values(1, 3, 8, 16),
                       ::testing::Values(4096, 4100, 14336), ::testing::Values(3, 129),
                       ::testing::Bool()));

// One token over a weight above the warp-per-row kernel's size limit (64 MiB; 8200 x 4096 x 2
// bytes is 64.06 MiB): a block per row, as for several tokens.
INSTANTIATE_TEST_SUITE_P(
    LargeWeight, CudaMatMulTest,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16), ::testing::Values(1),
                       ::testing::Values(4096), ::testing::Values(8200), ::testing::Bool()));

// One token over more rows than the warp-per-row grid has warps (at most SMs x resident blocks x
// 8): each warp takes several rows in turn. k = 8: one 16-byte chunk per row (lane 0 only).
INSTANTIATE_TEST_SUITE_P(
    ManyRows, CudaMatMulTest,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16), ::testing::Values(1),
                       ::testing::Values(8, 264), ::testing::Values(20011), ::testing::Bool()));

// MatMulPrecision::kRoundActivations against the CPU's: both round every activation to the
// weight's type (RNE), so each product is exact and only the f32 accumulation order differs
// (GEMV for <= kGemvMaxTokens tokens, rounding pass + one cuBLAS GEMM beyond; k % 4 picks the
// rounding pass's vector or scalar loop, k % 8 the GEMV's). Also checks that the rounding really
// happened: the worst GPU error against the CPU's kRoundActivations is smaller than the distance
// between the CPU's kRoundActivations and kSplit results.
// (weight dtype, tokens, in_features, out_features, with bias)
class CudaMatMulRoundTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<std::tuple<DType, int64_t, int64_t, int64_t, bool>> {};

TEST_P(CudaMatMulRoundTest, MatchesCpuRoundActivations) {
  const auto [dt, n, k, m, with_bias] = GetParam();
  HostTensor in = Random(rng_, DType::kF32, {n, k}, -2, 2);
  HostTensor w = Random(rng_, dt, {m, k});
  HostTensor bias = Random(rng_, dt, {m});
  const TensorView no_bias;
  HostTensor want = Filled({n, m}, kNaN), split = Filled({n, m}, kNaN);
  STRATA_ASSERT_OK(cpu_->MatMul({in.HostView(), w.HostView(),
                                 with_bias ? bias.HostView() : no_bias, want.HostView(),
                                 MatMulPrecision::kRoundActivations},
                                nullptr));
  STRATA_ASSERT_OK(cpu_->MatMul(
      {in.HostView(), w.HostView(), with_bias ? bias.HostView() : no_bias, split.HostView()},
      nullptr));
  auto d_in = Upload(in);
  auto d_w = Upload(w);
  auto d_b = Upload(bias);
  auto d_out = Upload(Filled({n, m}, kNaN));
  MatMulParams p{in.View(d_in->data()), w.View(d_w->data()),
                 with_bias ? bias.View(d_b->data()) : no_bias, want.View(d_out->data()),
                 MatMulPrecision::kRoundActivations};
  STRATA_ASSERT_OK(gpu_->Supports(p));
  STRATA_ASSERT_OK(gpu_->MatMul(p, nullptr));
  const std::vector<float> got = Download(*d_out, n * m);
  // The input must be left as it was (the rounding goes to scratch or registers).
  EXPECT_EQ(Download(*d_in, n * k), in.Values());
  const std::vector<float> wv = w.Values(), bv = bias.Values(), ref = want.Values(),
                           sp = split.Values();
  std::vector<double> scale(n * m);
  const std::vector<float> iv = in.Values();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < m; ++o) {
      double a = with_bias ? std::fabs(bv[o]) : 0.0;
      for (int64_t i = 0; i < k; ++i) a += std::fabs(double(iv[t * k + i]) * wv[o * k + i]);
      scale[t * m + o] = a;
    }
  }
  const std::string what = absl::StrCat("matmul round ", DTypeName(dt), " n=", n, " k=", k,
                                        " m=", m, " bias=", with_bias);
  ExpectClose(got, ref, 1e-6, 2e-5, what, &scale);
  double worst_gpu = 0, worst_split = 0;
  for (int64_t i = 0; i < n * m; ++i) {
    worst_gpu = std::max(worst_gpu, std::fabs(double(got[i]) - ref[i]) / (scale[i] + 1e-30));
    worst_split = std::max(worst_split, std::fabs(double(sp[i]) - ref[i]) / (scale[i] + 1e-30));
  }
  EXPECT_LT(worst_gpu, worst_split) << what << " (seed " << g_seed << ")";
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, CudaMatMulRoundTest,
    ::testing::Combine(::testing::Values(DType::kBF16, DType::kF16),
                       ::testing::Values(1, 3, 8, 9, 17, 129),
                       ::testing::Values(1, 17, 256, 1001, 4096), ::testing::Values(3, 129),
                       ::testing::Bool()));

TEST_F(CudaBackendTest, MatMulRoundActivationsF32WeightsEqualSplit) {
  // f32 weights ignore the precision: the same cuBLAS f32 GEMM, bit for bit.
  for (int64_t n : {1, 17, 129}) {
    HostTensor in = Random(rng_, DType::kF32, {n, 257}, -2, 2);
    HostTensor w = Random(rng_, DType::kF32, {131, 257});
    auto d_in = Upload(in);
    auto d_w = Upload(w);
    auto d_a = Upload(Filled({n, 131}, kNaN));
    auto d_r = Upload(Filled({n, 131}, kNaN));
    STRATA_ASSERT_OK(gpu_->MatMul({in.View(d_in->data()), w.View(d_w->data()), TensorView(),
                                   Filled({n, 131}, 0).View(d_a->data())},
                                  nullptr));
    STRATA_ASSERT_OK(gpu_->MatMul({in.View(d_in->data()), w.View(d_w->data()), TensorView(),
                                   Filled({n, 131}, 0).View(d_r->data()),
                                   MatMulPrecision::kRoundActivations},
                                  nullptr));
    EXPECT_EQ(Download(*d_a, n * 131), Download(*d_r, n * 131)) << "n=" << n;
  }
}

TEST_F(CudaBackendTest, MatMulRejectsUnknownPrecision) {
  HostTensor in = Random(rng_, DType::kF32, {2, 8});
  HostTensor w = Random(rng_, DType::kBF16, {4, 8});
  auto d_in = Upload(in);
  auto d_w = Upload(w);
  auto d_out = Upload(Filled({2, 4}, kNaN));
  MatMulParams p{in.View(d_in->data()), w.View(d_w->data()), TensorView(),
                 Filled({2, 4}, 0).View(d_out->data()), static_cast<MatMulPrecision>(5)};
  EXPECT_THAT(gpu_->Supports(p), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(gpu_->MatMul(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// fp8 e4m3 weights with row scales (QuantizeRowsToFP8E4M3) against the CPU: both round the
// activations to f16, so every product is exact and only the f32 accumulation order differs.
// 1..16 tokens with k % 16 == 0 take the tensor-core GEMV (two n8 tiles above 8 tokens; 4096:
// 64 columns per step, 8 steps per warp; 14336: 28), the rest the f16 cuBLAS path over blocks of
// at most 32 MiB of converted rows (8200 rows of 4096: three blocks).
// (tokens, in_features, out_features, with bias)
class CudaMatMulFp8Test
    : public CudaBackendTest,
      public ::testing::WithParamInterface<std::tuple<int64_t, int64_t, int64_t, bool>> {};

TEST_P(CudaMatMulFp8Test, MatchesCpu) {
  const auto [n, k, m, with_bias] = GetParam();
  HostTensor in = Random(rng_, DType::kF32, {n, k}, -2, 2);
  HostTensor wf = Random(rng_, DType::kF32, {m, k}, -0.3f, 0.3f);
  HostTensor w;
  w.dtype = DType::kFP8E4M3;
  w.dims = {m, k};
  w.bytes.resize(m * k + 16);
  HostTensor scales = Filled({m}, kNaN);
  QuantizeRowsToFP8E4M3(wf.bytes.data(), DType::kF32, m, k, w.bytes.data(), scales.f32());
  HostTensor bias = Random(rng_, DType::kBF16, {m});
  HostTensor want = Filled({n, m}, kNaN);
  const TensorView no_bias;
  MatMulParams cp{in.HostView(), w.HostView(), with_bias ? bias.HostView() : no_bias,
                  want.HostView()};
  cp.weight_scale = scales.HostView();
  STRATA_ASSERT_OK(cpu_->MatMul(cp, nullptr));
  auto d_in = Upload(in);
  auto d_w = Upload(w);
  auto d_s = Upload(scales);
  auto d_b = Upload(bias);
  auto d_out = Upload(Filled({n, m}, kNaN));
  MatMulParams p{in.View(d_in->data()), w.View(d_w->data()),
                 with_bias ? bias.View(d_b->data()) : no_bias, want.View(d_out->data())};
  p.weight_scale = scales.View(d_s->data());
  STRATA_ASSERT_OK(gpu_->Supports(p));
  STRATA_ASSERT_OK(gpu_->MatMul(p, nullptr));
  EXPECT_EQ(Download(*d_in, n * k), in.Values());  // the rounding goes to scratch or registers
  const std::vector<float> iv = in.Values(), wv = w.Values(), bv = bias.Values(),
                           sv = scales.Values();
  std::vector<double> scale(n * m);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < m; ++o) {
      double a = 0.0;
      for (int64_t i = 0; i < k; ++i) a += std::fabs(double(iv[t * k + i]) * wv[o * k + i]);
      scale[t * m + o] = a * sv[o] + (with_bias ? std::fabs(bv[o]) : 0.0);
    }
  }
  ExpectClose(Download(*d_out, n * m), want.Values(), 1e-6, 2e-5,
              absl::StrCat("matmul fp8 n=", n, " k=", k, " m=", m, " bias=", with_bias), &scale);
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, CudaMatMulFp8Test,
    ::testing::Combine(::testing::Values(1, 3, 8, 9, 16, 17, 129),
                       ::testing::Values(0, 16, 17, 256, 1008, 4096), ::testing::Values(1, 3, 129),
                       ::testing::Bool()));
INSTANTIATE_TEST_SUITE_P(
    LongRows, CudaMatMulFp8Test,
    ::testing::Combine(::testing::Values(1, 5, 16), ::testing::Values(14336),
                       ::testing::Values(17, 1000), ::testing::Bool()));
INSTANTIATE_TEST_SUITE_P(
    ManyRows, CudaMatMulFp8Test,
    ::testing::Combine(::testing::Values(1, 17), ::testing::Values(4096), ::testing::Values(8200),
                       ::testing::Values(false)));

TEST_F(CudaBackendTest, MatMulFp8NeedsItsScale) {
  HostTensor in = Random(rng_, DType::kF32, {2, 16});
  HostTensor w8;
  w8.dtype = DType::kFP8E4M3;
  w8.dims = {4, 16};
  w8.bytes.assign(64, 0x38);  // 1.0
  HostTensor wb = Random(rng_, DType::kBF16, {4, 16});
  HostTensor sc = Filled({4}, 1.0f), sc3 = Filled({3}, 1.0f);
  auto d_in = Upload(in);
  auto d_w8 = Upload(w8);
  auto d_wb = Upload(wb);
  auto d_s = Upload(sc);
  auto d_out = Upload(Filled({2, 4}, kNaN));
  const TensorView out = Filled({2, 4}, 0).View(d_out->data());
  MatMulParams p{in.View(d_in->data()), w8.View(d_w8->data()), TensorView(), out};
  EXPECT_THAT(gpu_->MatMul(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p.weight_scale = sc3.View(d_s->data());
  EXPECT_THAT(gpu_->MatMul(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p.weight_scale = sc.View(d_s->data());
  STRATA_EXPECT_OK(gpu_->MatMul(p, nullptr));
  // 1.0 weights, unit scales: each output is the sum of the token's f16-rounded activations.
  const std::vector<float> iv = in.Values(), got = Download(*d_out, 8);
  for (int t = 0; t < 2; ++t) {
    double sum = 0;
    for (int i = 0; i < 16; ++i) sum += F16ToF32(F32ToF16(iv[t * 16 + i]));
    for (int o = 0; o < 4; ++o) EXPECT_NEAR(got[t * 4 + o], sum, 1e-5) << t << " " << o;
  }
  MatMulParams pb{in.View(d_in->data()), wb.View(d_wb->data()), TensorView(), out};
  pb.weight_scale = sc.View(d_s->data());  // a scale with bf16 weights
  EXPECT_THAT(gpu_->MatMul(pb, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- Rope ------------------------------------------------------------------------------------

class CudaRopeTest : public CudaBackendTest,
                     public ::testing::WithParamInterface<std::tuple<int64_t, int64_t, int64_t>> {};

TEST_P(CudaRopeTest, MatchesCpu) {
  const auto [n, heads, head_dim] = GetParam();
  HostTensor x = Random(rng_, DType::kF32, {n, heads, head_dim}, -2, 2);
  HostTensor inv_freq = Filled({head_dim / 2}, 0.0f);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq.f32()[i] = std::pow(500000.0f, -2.0f * i / head_dim);
  }
  std::vector<int32_t> pos(n);
  for (auto& p : pos) p = static_cast<int32_t>(rng_() % 200000);
  HostTensor want = x;
  STRATA_ASSERT_OK(cpu_->Rope({want.HostView(), pos.data(), inv_freq.HostView(), 1.25f}, nullptr));
  auto d_x = Upload(x);
  auto d_f = Upload(inv_freq);
  auto d_pos = UploadRaw(pos.data(), pos.size() * 4);
  RopeParams p{x.View(d_x->data()), static_cast<const int32_t*>(d_pos->data()),
               inv_freq.View(d_f->data()), 1.25f};
  STRATA_ASSERT_OK(gpu_->Supports(p));
  STRATA_ASSERT_OK(gpu_->Rope(p, nullptr));
  ExpectClose(Download(*d_x, n * heads * head_dim), want.Values(), 2e-5, 2e-5, "rope");
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaRopeTest,
                         ::testing::Combine(::testing::Values(1, 3, 17, 129),
                                            ::testing::Values(1, 3, 32),
                                            ::testing::Values(2, 16, 64, 128)));

// ---- SwiGlu and Add --------------------------------------------------------------------------

class CudaElementwiseTest : public CudaBackendTest,
                            public ::testing::WithParamInterface<std::tuple<int64_t, int64_t>> {};

TEST_P(CudaElementwiseTest, SwiGluMatchesCpu) {
  const auto [n, width] = GetParam();
  HostTensor gate = Random(rng_, DType::kF32, {n, width}, -8, 8);
  HostTensor up = Random(rng_, DType::kF32, {n, width}, -2, 2);
  HostTensor want = Filled({n, width}, kNaN);
  STRATA_ASSERT_OK(cpu_->SwiGlu({gate.HostView(), up.HostView(), want.HostView()}, nullptr));
  auto d_g = Upload(gate);
  auto d_u = Upload(up);
  auto d_o = Upload(Filled({n, width}, kNaN));
  STRATA_ASSERT_OK(gpu_->SwiGlu(
      {gate.View(d_g->data()), up.View(d_u->data()), want.View(d_o->data())}, nullptr));
  ExpectClose(Download(*d_o, n * width), want.Values(), 1e-6, 1e-5, "swiglu");
  // In place over gate.
  STRATA_ASSERT_OK(gpu_->SwiGlu(
      {gate.View(d_g->data()), up.View(d_u->data()), gate.View(d_g->data())}, nullptr));
  ExpectClose(Download(*d_g, n * width), want.Values(), 1e-6, 1e-5, "swiglu in place");
}

TEST_P(CudaElementwiseTest, AddMatchesCpu) {
  const auto [n, width] = GetParam();
  HostTensor a = Random(rng_, DType::kF32, {n, width}, -5, 5);
  HostTensor b = Random(rng_, DType::kF32, {n, width}, -5, 5);
  HostTensor want = Filled({n, width}, kNaN);
  STRATA_ASSERT_OK(cpu_->Add({a.HostView(), b.HostView(), want.HostView()}, nullptr));
  auto d_a = Upload(a);
  auto d_b = Upload(b);
  auto d_o = Upload(Filled({n, width}, kNaN));
  STRATA_ASSERT_OK(
      gpu_->Add({a.View(d_a->data()), b.View(d_b->data()), want.View(d_o->data())}, nullptr));
  ExpectClose(Download(*d_o, n * width), want.Values(), 0, 0, "add");
  STRATA_ASSERT_OK(
      gpu_->Add({a.View(d_a->data()), b.View(d_b->data()), a.View(d_a->data())}, nullptr));
  ExpectClose(Download(*d_a, n * width), want.Values(), 0, 0, "add in place");
}

// out = a_scale * a + b_scale * b: the same bits as the CPU twin (one fma, then rounding).
TEST_P(CudaElementwiseTest, ScaledAddMatchesCpu) {
  const auto [n, width] = GetParam();
  HostTensor a = Random(rng_, DType::kF32, {n, width}, -5, 5);
  HostTensor b = Random(rng_, DType::kF32, {n, width}, -5, 5);
  HostTensor want = Filled({n, width}, kNaN);
  AddParams cp{a.HostView(), b.HostView(), want.HostView(), 0.9f, 0.43588989f};
  STRATA_ASSERT_OK(cpu_->Add(cp, nullptr));
  auto d_a = Upload(a);
  auto d_b = Upload(b);
  auto d_o = Upload(Filled({n, width}, kNaN));
  STRATA_ASSERT_OK(gpu_->Add(
      {a.View(d_a->data()), b.View(d_b->data()), want.View(d_o->data()), 0.9f, 0.43588989f},
      nullptr));
  ExpectClose(Download(*d_o, n * width), want.Values(), 0, 0, "scaled add");
  STRATA_ASSERT_OK(gpu_->Add(
      {a.View(d_a->data()), b.View(d_b->data()), a.View(d_a->data()), 0.9f, 0.43588989f},
      nullptr));
  ExpectClose(Download(*d_a, n * width), want.Values(), 0, 0, "scaled add in place");
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaElementwiseTest,
                         ::testing::Combine(::testing::Values(1, 3, 17, 129),
                                            ::testing::Values(1, 3, 129, 14336)));

// ---- PagedAttention --------------------------------------------------------------------------

struct AttnCase {
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int page_size;
  int tokens_per_head;  // about this many keys per KV head (0: none at all)
  bool causal;
  DType pool;
};

std::string CaseName(const AttnCase& c) {
  return absl::StrCat("t", c.num_tokens, "_q", c.num_q_heads, "_kv", c.num_kv_heads, "_d",
                      c.head_dim, "_p", c.page_size, "_n", c.tokens_per_head,
                      c.causal ? "_causal" : "_full", "_", DTypeName(c.pool));
}
std::string AttnName(const ::testing::TestParamInfo<AttnCase>& info) { return CaseName(info.param); }

class CudaPagedAttentionTest : public CudaBackendTest,
                               public ::testing::WithParamInterface<AttnCase> {};

TEST_P(CudaPagedAttentionTest, MatchesCpu) {
  const AttnCase c = GetParam();
  const int64_t d = c.head_dim;
  // Pool large enough for every head's pages, plus unused slots.
  const int64_t pages_per_head = c.tokens_per_head / c.page_size + 2;
  const int64_t num_slots = pages_per_head * c.num_kv_heads + 3;
  HostTensor k_pool = Random(rng_, c.pool, {num_slots, c.page_size, d});
  HostTensor v_pool = Random(rng_, c.pool, {num_slots, c.page_size, d});
  HostTensor q = Random(rng_, DType::kF32, {c.num_tokens, c.num_q_heads, d}, -3, 3);
  // Spans: every head gets shuffled distinct slots; spans cover whole pages or random sub-runs,
  // positions increase along the head with random gaps.
  std::vector<int32_t> slots(num_slots);
  for (int64_t i = 0; i < num_slots; ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng_);
  std::vector<KvSpan> spans;
  std::vector<int32_t> offsets(c.num_kv_heads + 1, 0);
  int32_t max_pos = 0;
  size_t next_slot = 0;
  for (int g = 0; g < c.num_kv_heads; ++g) {
    offsets[g] = static_cast<int32_t>(spans.size());
    int32_t pos = static_cast<int32_t>(rng_() % 7), tokens = 0;
    while (tokens < c.tokens_per_head && next_slot < slots.size()) {
      KvSpan s;
      s.slot = slots[next_slot++];
      if (rng_() % 4 == 0) {
        s.offset = static_cast<int32_t>(rng_() % c.page_size);
        s.length = static_cast<int32_t>(rng_() % (c.page_size - s.offset + 1));  // may be 0
      } else {
        s.offset = 0;
        s.length = c.page_size;
      }
      s.length = std::min(s.length, c.tokens_per_head - tokens);
      s.position = pos;
      pos += s.length + static_cast<int32_t>(rng_() % 3);
      tokens += s.length;
      spans.push_back(s);
    }
    max_pos = std::max(max_pos, pos);
  }
  offsets[c.num_kv_heads] = static_cast<int32_t>(spans.size());
  // Query positions: spread so that causal masking cuts some heads' spans mid-way.
  std::vector<int32_t> q_pos(c.num_tokens);
  for (int t = 0; t < c.num_tokens; ++t) {
    q_pos[t] = c.num_tokens == 1 ? static_cast<int32_t>(max_pos * 3 / 4)
                                 : static_cast<int32_t>(rng_() % (max_pos + 2));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

  HostTensor want_out = Filled({c.num_tokens, c.num_q_heads, d}, kNaN);
  HostTensor want_lse = Filled({c.num_tokens, c.num_q_heads}, kNaN);
  PagedAttentionParams cp;
  cp.q = q.HostView();
  cp.k_pool = k_pool.HostView();
  cp.v_pool = v_pool.HostView();
  cp.spans = spans.data();
  cp.span_offsets = offsets.data();
  cp.num_kv_heads = c.num_kv_heads;
  cp.q_positions = q_pos.data();
  cp.causal = c.causal;
  cp.scale = scale;
  if (c.pool == DType::kFP8E4M3) {  // per-tensor scales (folded into the GPU kernels' math)
    cp.k_scale = 0.37f;
    cp.v_scale = 2.5f;
  }
  cp.out = want_out.HostView();
  cp.lse = want_lse.HostView();
  STRATA_ASSERT_OK(cpu_->PagedAttention(cp, nullptr));

  auto d_k = Upload(k_pool);
  auto d_v = Upload(v_pool);
  auto d_q = Upload(q);
  auto d_out = Upload(Filled({c.num_tokens, c.num_q_heads, d}, kNaN));
  auto d_lse = Upload(Filled({c.num_tokens, c.num_q_heads}, kNaN));
  PagedAttentionParams p = cp;
  p.q = q.View(d_q->data());
  p.k_pool = k_pool.View(d_k->data());
  p.v_pool = v_pool.View(d_v->data());
  p.out = want_out.View(d_out->data());
  p.lse = want_lse.View(d_lse->data());
  STRATA_ASSERT_OK(gpu_->Supports(p));
  // Several tokens over a bf16 or fp8 pool with head_dim 64/128 take the tensor-core flash kernel
  // (bf16 q and softmax weights: bf16 tolerance; kernels/cuda/flash_prefill_test.cc covers it).
  const bool flash = c.num_tokens > 1 && (c.pool == DType::kBF16 || c.pool == DType::kFP8E4M3) &&
                     (c.head_dim == 64 || c.head_dim == 128);
  const double out_atol = flash ? 1e-2 : 2e-5, out_rtol = flash ? 1e-2 : 2e-4;
  const double lse_atol = flash ? 1e-3 : 2e-5, lse_rtol = flash ? 1e-3 : 2e-5;
  // Run twice: the second run reuses the pinned staging buffer and pooled scratch.
  for (int rep = 0; rep < 2; ++rep) {
    STRATA_ASSERT_OK(gpu_->PagedAttention(p, nullptr));
    // The host arrays may change as soon as the call returns (the kernels read a device copy).
    const std::vector<KvSpan> saved = spans;
    for (KvSpan& s : spans) s.slot = -1;
    ExpectClose(Download(*d_out, c.num_tokens * c.num_q_heads * d), want_out.Values(), out_atol,
                out_rtol, absl::StrCat(CaseName(c), " out rep ", rep));
    ExpectClose(Download(*d_lse, c.num_tokens * c.num_q_heads), want_lse.Values(), lse_atol,
                lse_rtol, absl::StrCat(CaseName(c), " lse rep ", rep));
    std::copy(saved.begin(), saved.end(), spans.begin());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Decode, CudaPagedAttentionTest,
    ::testing::Values(
        // Split-K fast path (one token, d 64/128/256, GQA groups 1..8).
        AttnCase{1, 32, 8, 128, 64, 2048, true, DType::kBF16},
        AttnCase{1, 32, 8, 128, 16, 4099, false, DType::kBF16},
        AttnCase{1, 32, 8, 128, 32, 40000, true, DType::kBF16},
        AttnCase{1, 8, 8, 64, 16, 129, true, DType::kF32},
        AttnCase{1, 16, 2, 256, 64, 1000, false, DType::kF32},
        AttnCase{1, 4, 1, 128, 17, 3, true, DType::kBF16},
        AttnCase{1, 4, 1, 128, 16, 1, false, DType::kF32},
        AttnCase{1, 8, 2, 128, 16, 0, true, DType::kBF16},
        // Work items of several 128-key tiles; one-token pages (a tile touches 128 spans).
        AttnCase{1, 8, 1, 128, 64, 100000, false, DType::kBF16},
        AttnCase{1, 4, 2, 64, 16, 70000, true, DType::kF32},
        AttnCase{1, 2, 1, 128, 1, 40000, false, DType::kBF16},
        AttnCase{1, 2, 1, 64, 2, 200000, true, DType::kBF16},
        // General kernel with one token: head_dim off the fast path, or groups > 8.
        AttnCase{1, 4, 2, 16, 16, 300, true, DType::kF32},
        AttnCase{1, 32, 2, 128, 16, 257, true, DType::kBF16},
        // fp8 e4m3 pools with k_scale / v_scale (decode fast path; general kernel for d 16).
        AttnCase{1, 32, 8, 128, 16, 129, true, DType::kFP8E4M3},
        AttnCase{1, 4, 1, 64, 16, 17, false, DType::kFP8E4M3},
        AttnCase{1, 6, 2, 128, 64, 3, true, DType::kFP8E4M3},
        AttnCase{1, 8, 1, 64, 16, 1, true, DType::kFP8E4M3},
        AttnCase{1, 16, 2, 256, 64, 5000, false, DType::kFP8E4M3},
        AttnCase{1, 4, 2, 16, 16, 300, true, DType::kFP8E4M3}),
    AttnName);

INSTANTIATE_TEST_SUITE_P(
    Prefill, CudaPagedAttentionTest,
    ::testing::Values(AttnCase{3, 4, 2, 16, 16, 81, true, DType::kF32},
                      AttnCase{17, 8, 2, 128, 64, 500, true, DType::kBF16},
                      AttnCase{129, 4, 1, 64, 16, 129, true, DType::kBF16},
                      AttnCase{9, 6, 3, 3, 5, 27, false, DType::kF32},
                      AttnCase{5, 2, 1, 512, 8, 40, true, DType::kF32},
                      AttnCase{4, 4, 2, 128, 16, 0, true, DType::kF32},
                      // fp8 prefill takes the flash kernel (fp8 tiles converted to bf16).
                      AttnCase{3, 4, 2, 64, 16, 81, true, DType::kFP8E4M3},
                      AttnCase{17, 8, 2, 128, 64, 129, true, DType::kFP8E4M3}),
    AttnName);

TEST_F(CudaBackendTest, PagedAttentionRejectsBadSpans) {
  HostTensor q = Random(rng_, DType::kF32, {1, 2, 16});
  HostTensor pool = Random(rng_, DType::kF32, {2, 4, 16});
  HostTensor out = Filled({1, 2, 16}, 0), lse = Filled({1, 2}, 0);
  auto d_q = Upload(q), d_pool = Upload(pool), d_out = Upload(out), d_lse = Upload(lse);
  std::vector<KvSpan> spans = {{2, 0, 4, 0}};  // slot 2 of 2
  std::vector<int32_t> offsets = {0, 1};
  int32_t qpos = 10;
  PagedAttentionParams p;
  p.q = q.View(d_q->data());
  p.k_pool = pool.View(d_pool->data());
  p.v_pool = pool.View(d_pool->data());
  p.spans = spans.data();
  p.span_offsets = offsets.data();
  p.num_kv_heads = 1;
  p.q_positions = &qpos;
  p.scale = 0.25f;
  p.out = out.View(d_out->data());
  p.lse = lse.View(d_lse->data());
  EXPECT_THAT(gpu_->PagedAttention(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  spans[0] = {1, 2, 3, 0};  // offset + length > page_size
  EXPECT_THAT(gpu_->PagedAttention(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  spans[0] = {1, 0, 4, 0};
  STRATA_ASSERT_OK(gpu_->PagedAttention(p, nullptr));
  p.num_kv_heads = 3;
  EXPECT_THAT(gpu_->Supports(p), StatusIs(absl::StatusCode::kInvalidArgument));
  HostTensor f16 = pool;
  f16.dtype = DType::kF16;
  p.num_kv_heads = 1;
  p.k_pool = f16.View(d_pool->data());
  p.v_pool = f16.View(d_pool->data());
  EXPECT_THAT(gpu_->Supports(p), StatusIs(absl::StatusCode::kUnimplemented));
  // fp8 pools need finite scales > 0; other pools scales of exactly 1.
  HostTensor fp8 = pool;
  fp8.dtype = DType::kFP8E4M3;
  p.k_pool = fp8.View(d_pool->data());
  p.v_pool = fp8.View(d_pool->data());
  STRATA_EXPECT_OK(gpu_->Supports(p));
  p.v_scale = 0.0f;
  EXPECT_THAT(gpu_->Supports(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.v_scale = 1.0f;
  p.k_pool = pool.View(d_pool->data());
  p.v_pool = pool.View(d_pool->data());
  p.k_scale = 0.5f;
  EXPECT_THAT(gpu_->Supports(p), StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- MergeAttention --------------------------------------------------------------------------

class CudaMergeAttentionTest
    : public CudaBackendTest,
      public ::testing::WithParamInterface<std::tuple<int, int64_t, int64_t>> {};

TEST_P(CudaMergeAttentionTest, MatchesCpu) {
  const auto [parts, rows, d] = GetParam();
  std::vector<HostTensor> outs, lses;
  std::uniform_real_distribution<float> lse_dist(-20.0f, 20.0f);
  for (int s = 0; s < parts; ++s) {
    outs.push_back(Random(rng_, DType::kF32, {rows, 1, d}));
    HostTensor l = Filled({rows, 1}, 0);
    for (int64_t r = 0; r < rows; ++r) {
      // Some parts attended nothing for some rows; row 0 attended nothing anywhere.
      l.f32()[r] = (r == 0 || rng_() % 5 == 0) ? kNegInf : lse_dist(rng_);
    }
    lses.push_back(l);
  }
  std::vector<TensorView> h_outs, h_lses, g_outs, g_lses;
  std::vector<std::unique_ptr<Buffer>> bufs;
  for (int s = 0; s < parts; ++s) {
    h_outs.push_back(outs[s].HostView());
    h_lses.push_back(lses[s].HostView());
    bufs.push_back(Upload(outs[s]));
    g_outs.push_back(outs[s].View(bufs.back()->data()));
    bufs.push_back(Upload(lses[s]));
    g_lses.push_back(lses[s].View(bufs.back()->data()));
  }
  HostTensor want_out = Filled({rows, 1, d}, kNaN), want_lse = Filled({rows, 1}, kNaN);
  STRATA_ASSERT_OK(cpu_->MergeAttention(
      {h_outs.data(), h_lses.data(), parts, want_out.HostView(), want_lse.HostView()}, nullptr));
  auto d_out = Upload(Filled({rows, 1, d}, kNaN));
  auto d_lse = Upload(Filled({rows, 1}, kNaN));
  MergeAttentionParams p{g_outs.data(), g_lses.data(), parts, want_out.View(d_out->data()),
                         want_lse.View(d_lse->data())};
  STRATA_ASSERT_OK(gpu_->Supports(p));
  STRATA_ASSERT_OK(gpu_->MergeAttention(p, nullptr));
  ExpectClose(Download(*d_out, rows * d), want_out.Values(), 1e-6, 1e-5, "merge out");
  ExpectClose(Download(*d_lse, rows), want_lse.Values(), 1e-6, 1e-6, "merge lse");
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaMergeAttentionTest,
                         ::testing::Combine(::testing::Values(1, 2, 5, 64),
                                            ::testing::Values(1, 3, 129),
                                            ::testing::Values(1, 16, 128, 129)));

TEST_F(CudaBackendTest, MergeAttentionTooManyParts) {
  std::vector<TensorView> outs(65), lses(65);
  HostTensor o = Filled({1, 1, 4}, 0), l = Filled({1, 1}, 0);
  auto d_o = Upload(o), d_l = Upload(l);
  for (int i = 0; i < 65; ++i) {
    outs[i] = o.View(d_o->data());
    lses[i] = l.View(d_l->data());
  }
  MergeAttentionParams p{outs.data(), lses.data(), 65, o.View(d_o->data()), l.View(d_l->data())};
  EXPECT_THAT(gpu_->Supports(p), StatusIs(absl::StatusCode::kUnimplemented));
}

// ---- AppendKv ----------------------------------------------------------------------------------

// Rows land in the KvCache layout, converted exactly as ConvertFromF32; the rest of the pools is
// untouched; out-of-range positions are refused.
TEST_F(CudaBackendTest, AppendKvMatchesHostConversion) {
  constexpr int64_t kHeads = 2, kDim = 5, kPage = 4, kPerHead = 3, kSlots = kHeads * kPerHead;
  for (DType dt : {DType::kBF16, DType::kF32}) {
    const size_t es = DTypeSize(dt);
    const size_t pool_bytes = static_cast<size_t>(kSlots * kPage * kDim) * es;
    std::vector<uint8_t> kpool(pool_bytes), vpool(pool_bytes);
    for (size_t i = 0; i < pool_bytes; ++i) {
      kpool[i] = static_cast<uint8_t>(rng_());
      vpool[i] = static_cast<uint8_t>(rng_());
    }
    auto d_kp = UploadRaw(kpool.data(), pool_bytes);
    auto d_vp = UploadRaw(vpool.data(), pool_bytes);
    const int64_t first = 6, n = 5;  // positions 6..10: pages 1 and 2
    HostTensor k = Random(rng_, DType::kF32, {n, kHeads, kDim}, -3, 3);
    HostTensor v = Random(rng_, DType::kF32, {n, kHeads, kDim}, -3, 3);
    auto d_k = Upload(k);
    auto d_v = Upload(v);
    AppendKvParams p;
    p.k = k.View(d_k->data());
    p.v = v.View(d_v->data());
    p.k_pool = TensorView(d_kp->data(), dt, {kSlots, kPage, kDim});
    p.v_pool = TensorView(d_vp->data(), dt, {kSlots, kPage, kDim});
    p.first = first;
    p.slots_per_head = kPerHead;
    STRATA_ASSERT_OK(gpu_->AppendKv(p, nullptr));
    const std::vector<float> kv = k.Values(), vv = v.Values();
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < kHeads; ++g) {
        const int64_t pos = first + i;
        const size_t dst = static_cast<size_t>(((g * kPerHead + pos / kPage) * kPage + pos % kPage) * kDim) * es;
        const size_t src = static_cast<size_t>((i * kHeads + g) * kDim);
        ConvertFromF32(kv.data() + src, kpool.data() + dst, dt, kDim);
        ConvertFromF32(vv.data() + src, vpool.data() + dst, dt, kDim);
      }
    }
    std::vector<uint8_t> got_k(pool_bytes), got_v(pool_bytes);
    STRATA_ASSERT_OK(gpu_->CopyToHost(got_k.data(), d_kp->data(), pool_bytes, nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToHost(got_v.data(), d_vp->data(), pool_bytes, nullptr));
    EXPECT_EQ(got_k, kpool) << DTypeName(dt);
    EXPECT_EQ(got_v, vpool) << DTypeName(dt);
    // Position 12 is page 3: past a head's 3 slots.
    p.first = 8;
    EXPECT_THAT(gpu_->AppendKv(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
    p.first = 6;
    p.slots_per_head = kPerHead + 1;  // head 1's pages would pass the last slot
    EXPECT_THAT(gpu_->AppendKv(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

// AppendKv with rope (the decode step's fused Rope and append): against the CPU twin (f32 pool,
// Rope's tolerance) and against the GPU's own Rope followed by a plain AppendKv (every pool type,
// the same sincosf: equal), at awkward sizes; the queries rotated in place, k untouched, and the
// queries rotated also when the device position refuses the append.
TEST_F(CudaBackendTest, AppendKvWithRopeMatchesRopeThenAppend) {
  constexpr int64_t kHeads = 3, kPage = 4, kPerHead = 5, kSlots = kHeads * kPerHead;
  for (int64_t d : {2, 16, 128}) {
    for (int64_t n : {1, 3}) {
      for (DType dt : {DType::kF32, DType::kBF16, DType::kFP8E4M3}) {
        const int64_t q_heads = 7, first = 5;
        const size_t pool_bytes = static_cast<size_t>(kSlots * kPage * d) * DTypeSize(dt);
        std::vector<uint8_t> pool0(pool_bytes);
        for (auto& b : pool0) b = static_cast<uint8_t>(rng_() & 0x3f);  // no NaN patterns
        HostTensor k = Random(rng_, DType::kF32, {n, kHeads, d}, -2, 2);
        HostTensor v = Random(rng_, DType::kF32, {n, kHeads, d}, -2, 2);
        HostTensor q = Random(rng_, DType::kF32, {n, q_heads, d}, -2, 2);
        HostTensor inv_freq = Filled({d / 2}, 0.0f);
        for (int64_t i = 0; i < d / 2; ++i) inv_freq.f32()[i] = std::pow(500000.0f, -2.0f * i / d);
        std::vector<int32_t> pos(n);
        for (auto& x : pos) x = static_cast<int32_t>(rng_() % 600000);
        auto d_f = Upload(inv_freq);
        auto d_pos = UploadRaw(pos.data(), pos.size() * 4);
        const auto* pos_dev = static_cast<const int32_t*>(d_pos->data());
        auto run = [&](bool fused, std::vector<uint8_t>* kp, std::vector<uint8_t>* vp,
                       std::vector<float>* q_out, std::vector<float>* k_out) {
          auto d_kp = UploadRaw(pool0.data(), pool_bytes);
          auto d_vp = UploadRaw(pool0.data(), pool_bytes);
          auto d_k = Upload(k);
          auto d_v = Upload(v);
          auto d_q = Upload(q);
          AppendKvParams p;
          p.k = k.View(d_k->data());
          p.v = v.View(d_v->data());
          p.k_pool = TensorView(d_kp->data(), dt, {kSlots, kPage, d});
          p.v_pool = TensorView(d_vp->data(), dt, {kSlots, kPage, d});
          p.first = first;
          p.slots_per_head = kPerHead;
          if (dt == DType::kFP8E4M3) p.k_scale = 0.25f, p.v_scale = 0.5f;
          if (fused) {
            p.rope = {q.View(d_q->data()), pos_dev, inv_freq.View(d_f->data()), 1.0f};
          } else {
            const TensorView f = inv_freq.View(d_f->data());
            STRATA_ASSERT_OK(gpu_->Rope({q.View(d_q->data()), pos_dev, f, 1.0f}, nullptr));
            STRATA_ASSERT_OK(gpu_->Rope({k.View(d_k->data()), pos_dev, f, 1.0f}, nullptr));
          }
          STRATA_ASSERT_OK(gpu_->AppendKv(p, nullptr));
          kp->resize(pool_bytes);
          vp->resize(pool_bytes);
          STRATA_ASSERT_OK(gpu_->CopyToHost(kp->data(), d_kp->data(), pool_bytes, nullptr));
          STRATA_ASSERT_OK(gpu_->CopyToHost(vp->data(), d_vp->data(), pool_bytes, nullptr));
          *q_out = Download(*d_q, n * q_heads * d);
          *k_out = Download(*d_k, n * kHeads * d);
        };
        std::vector<uint8_t> fk, fv, sk, sv;
        std::vector<float> fq, sq, fkr, skr;
        run(true, &fk, &fv, &fq, &fkr);
        run(false, &sk, &sv, &sq, &skr);
        const std::string what = absl::StrCat(DTypeName(dt), " d=", d, " n=", n);
        EXPECT_EQ(fk, sk) << what;
        EXPECT_EQ(fv, sv) << what;
        EXPECT_EQ(fq, sq) << what;
        EXPECT_EQ(fkr, k.Values()) << "k is left as it is: " << what;
        if (dt == DType::kF32) {  // the CPU twin
          std::vector<uint8_t> ck(pool0), cv(pool0);
          HostTensor cq = q;
          AppendKvParams c;
          c.k = k.HostView();
          c.v = v.HostView();
          c.k_pool = TensorView(ck.data(), dt, {kSlots, kPage, d});
          c.v_pool = TensorView(cv.data(), dt, {kSlots, kPage, d});
          c.first = first;
          c.slots_per_head = kPerHead;
          c.rope = {cq.HostView(), pos.data(), inv_freq.HostView(), 1.0f};
          STRATA_ASSERT_OK(cpu_->AppendKv(c, nullptr));
          std::vector<float> gk(pool_bytes / 4), ck_f(pool_bytes / 4);
          std::memcpy(gk.data(), fk.data(), pool_bytes);
          std::memcpy(ck_f.data(), ck.data(), pool_bytes);
          ExpectClose(gk, ck_f, 2e-5, 2e-5, "rope append k pool");
          ExpectClose(fq, cq.Values(), 2e-5, 2e-5, "rope append q");
          EXPECT_EQ(fv, cv) << what;
        }
      }
    }
  }
  // A refused device position: nothing written, the queries rotated all the same.
  const int64_t d = 8;
  std::vector<float> pool(kSlots * kPage * d, 1.5f);
  auto d_kp = UploadRaw(pool.data(), pool.size() * 4);
  HostTensor k = Random(rng_, DType::kF32, {1, kHeads, d}, -2, 2);
  HostTensor q = Random(rng_, DType::kF32, {1, 2, d}, -2, 2);
  HostTensor inv_freq = Filled({d / 2}, 0.5f);
  const int32_t host_vals[2] = {1000, -1};  // position, refused index
  auto d_vals = UploadRaw(host_vals, sizeof(host_vals));
  auto d_k = Upload(k);
  auto d_q = Upload(q);
  auto d_f = Upload(inv_freq);
  const auto* vals = static_cast<const int32_t*>(d_vals->data());
  AppendKvParams p;
  p.k = k.View(d_k->data());
  p.v = k.View(d_k->data());
  p.k_pool = TensorView(d_kp->data(), DType::kF32, {kSlots, kPage, d});
  p.v_pool = p.k_pool;
  p.first = 3;
  p.slots_per_head = kPerHead;
  p.first_device = vals + 1;
  p.rope = {q.View(d_q->data()), vals, inv_freq.View(d_f->data()), 1.0f};
  STRATA_ASSERT_OK(gpu_->AppendKv(p, nullptr));
  EXPECT_EQ(Download(*d_kp, pool.size()), pool);
  HostTensor want = q;
  STRATA_ASSERT_OK(cpu_->Rope({want.HostView(), host_vals, inv_freq.HostView(), 1.0f}, nullptr));
  ExpectClose(Download(*d_q, 2 * d), want.Values(), 2e-5, 2e-5, "refused append's q");
}


// EncodeFp8Pages against the CPU twin, bit for bit (codes, scales, summaries): random bf16 bits
// (NaN, inf, subnormals, both zeros among them) scaled per slot, an all-zero page, head dims 17,
// 64 and 128 (block sizes 255, 256 and 256 threads), interleaved head slots, a partial last page.
TEST_F(CudaBackendTest, EncodeFp8PagesMatchesCpu) {
  struct Case {
    int64_t page, dim, slots, first, stride;
    int heads;
    int64_t count;
    int last_valid;
  };
  for (const Case c : {Case{4, 17, 9, 1, 4, 2, 3, 1}, Case{64, 128, 12, 0, 6, 2, 5, 37}, Case{16, 64, 20, 19, -6, 3, 1, 16}}) {
    SCOPED_TRACE(::testing::Message() << "page " << c.page << " dim " << c.dim);
    const size_t pe = static_cast<size_t>(c.page * c.dim);
    std::vector<uint16_t> kpool(c.slots * pe), vpool(c.slots * pe);
    for (std::vector<uint16_t>* pool : {&kpool, &vpool}) {
      for (size_t i = 0; i < pool->size(); ++i) {
        const int64_t slot = static_cast<int64_t>(i / pe);
        uint16_t b = static_cast<uint16_t>(rng_());
        // Mostly moderate values (exponent 110..140), some raw bits (NaN, inf, subnormals).
        if (rng_() % 8 != 0) b = static_cast<uint16_t>((b & 0x807f) | ((110 + rng_() % 31) << 7));
        if (slot == 2) b = 0;  // an all-zero page (scale 1)
        (*pool)[i] = b;
      }
    }
    const size_t pool_bytes = kpool.size() * 2;
    auto d_kp = UploadRaw(kpool.data(), pool_bytes);
    auto d_vp = UploadRaw(vpool.data(), pool_bytes);
    const int64_t items = c.heads * c.count;
    std::vector<uint8_t> codes(items * 2 * pe, 0xab), got_codes(codes.size());
    std::vector<float> scales(items * 2, -1.0f), got_scales(scales.size());
    std::vector<float> sums(items * 2 * c.dim, -1.0f), got_sums(sums.size());
    auto d_codes = UploadRaw(codes.data(), codes.size());
    auto d_scales = UploadRaw(scales.data(), scales.size() * 4);
    auto d_sums = UploadRaw(sums.data(), sums.size() * 4);
    EncodeFp8PagesParams p;
    p.first_slot = c.first;
    p.head_slot_stride = c.stride;
    p.num_heads = c.heads;
    p.count = c.count;
    p.last_valid = c.last_valid;
    p.k_pool = TensorView(kpool.data(), DType::kBF16, {c.slots, c.page, c.dim});
    p.v_pool = TensorView(vpool.data(), DType::kBF16, {c.slots, c.page, c.dim});
    p.codes = TensorView(codes.data(), DType::kFP8E4M3, {items, 2, c.page, c.dim});
    p.scales = TensorView(scales.data(), DType::kF32, {items, 2});
    p.summaries = TensorView(sums.data(), DType::kF32, {items, 2 * c.dim});
    STRATA_ASSERT_OK(cpu_->EncodeFp8Pages(p, nullptr));
    p.k_pool.data = d_kp->data();
    p.v_pool.data = d_vp->data();
    p.codes.data = d_codes->data();
    p.scales.data = d_scales->data();
    p.summaries.data = d_sums->data();
    STRATA_ASSERT_OK(gpu_->EncodeFp8Pages(p, nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToHost(got_codes.data(), d_codes->data(), codes.size(), nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToHost(got_scales.data(), d_scales->data(), scales.size() * 4, nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToHost(got_sums.data(), d_sums->data(), sums.size() * 4, nullptr));
    EXPECT_EQ(got_codes, codes);
    EXPECT_EQ(std::memcmp(got_scales.data(), scales.data(), scales.size() * 4), 0);
    for (size_t i = 0; i < sums.size(); ++i) {
      ASSERT_EQ(std::memcmp(&got_sums[i], &sums[i], 4), 0) << "summary value " << i << ": " << got_sums[i]
                                                             << " vs " << sums[i];
    }
    // A slot outside the pools is refused before any launch.
    p.head_slot_stride = c.slots;
    EXPECT_THAT(gpu_->EncodeFp8Pages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

// fp8 pools: x / scale rounded as F32ToFP8E4M3 (saturated to +-448, NaN -> 0x7f), bit for bit,
// including out-of-range values, infinities, NaN, subnormals and ties.
TEST_F(CudaBackendTest, AppendKvFp8MatchesHostConversion) {
  constexpr int64_t kHeads = 3, kDim = 17, kPage = 5, kPerHead = 2, kSlots = kHeads * kPerHead;
  const float k_scale = 0.3f, v_scale = 4.0f;
  const size_t pool_bytes = static_cast<size_t>(kSlots * kPage * kDim);
  std::vector<uint8_t> kpool(pool_bytes), vpool(pool_bytes);
  for (size_t i = 0; i < pool_bytes; ++i) {
    kpool[i] = static_cast<uint8_t>(rng_());
    vpool[i] = static_cast<uint8_t>(rng_());
  }
  auto d_kp = UploadRaw(kpool.data(), pool_bytes);
  auto d_vp = UploadRaw(vpool.data(), pool_bytes);
  const int64_t first = 3, n = 7;  // positions 3..9: pages 0 and 1
  HostTensor k = Random(rng_, DType::kF32, {n, kHeads, kDim}, -200, 200);
  HostTensor v = Random(rng_, DType::kF32, {n, kHeads, kDim}, -3000, 3000);
  const float specials[] = {kNaN, std::numeric_limits<float>::infinity(), -1e30f, 448.0f * 0.3f,
                            464.0f * 0.3f, -0.0f, 1e-9f, 0.0019531f * 0.3f, 0.0029297f * 0.3f,
                            1.0625f * 0.3f, 1.1875f * 0.3f};
  for (size_t i = 0; i < std::size(specials); ++i) {
    k.f32()[i * 5] = specials[i];
    v.f32()[i * 5 + 1] = specials[i] * (v_scale / k_scale);
  }
  auto d_k = Upload(k);
  auto d_v = Upload(v);
  AppendKvParams p;
  p.k = k.View(d_k->data());
  p.v = v.View(d_v->data());
  p.k_pool = TensorView(d_kp->data(), DType::kFP8E4M3, {kSlots, kPage, kDim});
  p.v_pool = TensorView(d_vp->data(), DType::kFP8E4M3, {kSlots, kPage, kDim});
  p.first = first;
  p.slots_per_head = kPerHead;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  STRATA_ASSERT_OK(gpu_->AppendKv(p, nullptr));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < kHeads; ++g) {
      const int64_t pos = first + i;
      const size_t dst =
          static_cast<size_t>(((g * kPerHead + pos / kPage) * kPage + pos % kPage) * kDim);
      const size_t src = static_cast<size_t>((i * kHeads + g) * kDim);
      for (int64_t c = 0; c < kDim; ++c) {
        kpool[dst + c] = F32ToFP8E4M3(k.f32()[src + c] / k_scale);
        vpool[dst + c] = F32ToFP8E4M3(v.f32()[src + c] / v_scale);
      }
    }
  }
  std::vector<uint8_t> got_k(pool_bytes), got_v(pool_bytes);
  STRATA_ASSERT_OK(gpu_->CopyToHost(got_k.data(), d_kp->data(), pool_bytes, nullptr));
  STRATA_ASSERT_OK(gpu_->CopyToHost(got_v.data(), d_vp->data(), pool_bytes, nullptr));
  int bad = 0;
  for (size_t i = 0; i < pool_bytes; ++i) {
    if (got_k[i] != kpool[i] && ++bad <= 5) {
      ADD_FAILURE() << "k byte " << i << " got " << int{got_k[i]} << " want " << int{kpool[i]};
    }
    if (got_v[i] != vpool[i] && ++bad <= 5) {
      ADD_FAILURE() << "v byte " << i << " got " << int{got_v[i]} << " want " << int{vpool[i]};
    }
  }
  EXPECT_EQ(bad, 0);
  p.k_scale = -1.0f;
  EXPECT_THAT(gpu_->AppendKv(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- SelectedAttention (kernels/cuda/attention.cu) against the CPU twin ----------------------

struct SelCase {
  DType pool;
  int num_q_heads, num_kv_heads, head_dim, page_size;
  int64_t prefix, mid_count, suffix;  // tokens of each part (middle: candidate count)
  bool pages_middle;                  // middle = token ids of parent pages (else a plain range)
  bool device_prefix;                 // prefix_len in device memory, below prefix_end
  bool slot_scales = false;           // fp8: random per-slot (K, V) scales in [0.01, 2]
};

// Random pools and query; a page table with missing pages (-1) and a slot outside the pool; a
// middle with negative parents and ids outside its range; outputs poisoned with NaN.
TEST_F(CudaBackendTest, SelectedAttentionMatchesCpu) {
  const SelCase cases[] = {
      {DType::kBF16, 32, 8, 128, 64, 4, 2048, 64, true, false},
      {DType::kBF16, 32, 8, 128, 16, 1, 0, 0, false, false},
      {DType::kBF16, 24, 8, 128, 16, 3, 17, 0, false, false},
      {DType::kBF16, 8, 1, 64, 16, 0, 129, 3, true, false},
      {DType::kBF16, 16, 2, 256, 32, 16, 300, 17, true, false},
      {DType::kBF16, 8, 2, 128, 64, 40000, 0, 0, false, true},
      {DType::kF32, 20, 4, 64, 16, 3, 129, 1, false, false},
      {DType::kF32, 4, 2, 128, 16, 17, 0, 0, false, true},
      {DType::kF32, 14, 2, 256, 64, 0, 1000, 0, true, false},
      {DType::kFP8E4M3, 32, 8, 128, 64, 4, 2048, 64, true, false},
      {DType::kFP8E4M3, 12, 4, 128, 16, 1, 0, 0, false, false},
      {DType::kFP8E4M3, 8, 1, 64, 16, 3, 17, 0, false, false},
      {DType::kFP8E4M3, 16, 2, 128, 32, 129, 0, 0, false, true},
      {DType::kFP8E4M3, 40, 5, 64, 16, 16, 4099, 129, true, false},
      {DType::kFP8E4M3, 4, 1, 256, 64, 0, 129, 17, false, false},
      {DType::kFP8E4M3, 8, 2, 128, 16, 0, 0, 0, false, false},  // nothing attended
      // Long lists: the split-K kernel by default (the cluster kernel runs up to 3072 positions
      // per KV head); with STRATA_SELECTED_ATTENTION=cluster8|cluster16 the cluster kernel, whose
      // ring of stages then wraps many times.
      {DType::kBF16, 32, 8, 128, 64, 0, 16384, 0, false, false},
      {DType::kFP8E4M3, 16, 2, 128, 32, 12000, 0, 0, false, true},
      {DType::kF32, 16, 2, 256, 16, 5, 16380, 7, true, false},
      // Group 4 runs builds of its own (head_dim 64 and 128, every pool type).
      {DType::kFP8E4M3, 32, 8, 128, 64, 0, 9000, 5, false, false},
      {DType::kBF16, 16, 4, 64, 16, 7, 5000, 3, true, false},
      {DType::kF32, 8, 2, 64, 64, 6000, 0, 0, false, true},
  };
  for (const SelCase& c : cases) RunSelectedCase(c);
}

void CudaBackendTest::RunSelectedCase(const SelCase& c) {
  const std::string name =
      absl::StrCat(DTypeName(c.pool), " q", c.num_q_heads, " kv", c.num_kv_heads, " d",
                   c.head_dim, " p", c.page_size, " ", c.prefix, "+", c.mid_count, "+",
                   c.suffix, c.pages_middle ? " pages" : "", c.device_prefix ? " dev" : "",
                   c.slot_scales ? " slot_scales" : "");
  SCOPED_TRACE(name);
  const int64_t hkv = c.num_kv_heads, hq = c.num_q_heads, d = c.head_dim, P = c.page_size;
  // Token space: prefix, then the middle's range, then the suffix.
  const int64_t mid_begin = c.prefix + 5, mid_end = mid_begin + c.mid_count;
  const int64_t suffix_begin = mid_end + 3, suffix_end = suffix_begin + c.suffix;
  const int64_t table_pages = (suffix_end + P - 1) / P + 1;
  const int64_t slots = hkv * table_pages + 2;
  const float k_scale = c.pool == DType::kFP8E4M3 ? 0.25f : 1.0f;
  const float v_scale = c.pool == DType::kFP8E4M3 ? 3.0f : 1.0f;
  HostTensor k_pool = Random(rng_, c.pool, {slots, P, d}, -4, 4);
  HostTensor v_pool = Random(rng_, c.pool, {slots, P, d}, -1, 1);
  HostTensor q = Random(rng_, DType::kF32, {1, hq, d}, -1, 1);
  // Per-slot (K, V) scales: [slots, 2] in [0.01, 2] (drawn only when used: the other cases keep
  // their random streams).
  HostTensor slot_scales = c.slot_scales ? Random(rng_, DType::kF32, {slots, 2}, 0.01f, 2.0f)
                                         : Filled({slots, 2}, 1.0f);
  HostTensor table;
  table.dtype = DType::kI32;
  table.dims = {hkv, table_pages};
  table.bytes.resize(hkv * table_pages * 4);
  std::vector<int32_t> perm(slots);
  for (int64_t i = 0; i < slots; ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng_);
  auto* tab = reinterpret_cast<int32_t*>(table.bytes.data());
  for (int64_t i = 0; i < hkv * table_pages; ++i) {
    const uint32_t r = rng_() % 16;
    tab[i] = r == 0 ? -1 : r == 1 ? static_cast<int32_t>(slots + 7) : perm[i];
  }
  CandidateList mid;
  HostTensor parents;
  mid.begin = mid_begin;
  mid.end = mid_end;
  if (c.pages_middle) {  // parents = pages, some negative, some outside the range
    mid.fanout = static_cast<int>(P);
    const int64_t np = (c.mid_count + P - 1) / P + 1;
    parents.dtype = DType::kI32;
    parents.dims = {hkv, np};
    parents.bytes.resize(hkv * np * 4);
    auto* par = reinterpret_cast<int32_t*>(parents.bytes.data());
    for (int64_t g = 0; g < hkv; ++g) {
      for (int64_t i = 0; i < np; ++i) {
        const int64_t page = mid_begin / P + i;
        par[g * np + i] = rng_() % 7 == 0 ? -1 : static_cast<int32_t>(page);
      }
    }
  } else {
    mid.begin = mid_begin;
    mid.end = mid_end;
  }
  HostTensor want_out = Filled({1, hq, d}, kNaN), want_lse = Filled({1, hq}, kNaN);
  int32_t prefix_len = static_cast<int32_t>(c.prefix * 2 / 3);
  SelectedAttentionParams cp;
  cp.q = q.HostView();
  cp.k_pool = k_pool.HostView();
  cp.v_pool = v_pool.HostView();
  cp.page_table = table.HostView();
  cp.prefix_end = c.prefix;
  cp.middle = mid;
  if (c.pages_middle) cp.middle.parents = parents.HostView();
  cp.suffix_begin = suffix_begin;
  cp.suffix_end = suffix_end;
  cp.scale = 1.0f / std::sqrt(static_cast<float>(d));
  cp.k_scale = k_scale;
  cp.v_scale = v_scale;
  cp.out = want_out.HostView();
  cp.lse = want_lse.HostView();
  if (c.device_prefix) cp.prefix_len = &prefix_len;
  if (c.slot_scales) cp.slot_scales = slot_scales.f32();
  STRATA_ASSERT_OK(cpu_->SelectedAttention(cp, nullptr));

  auto d_k = Upload(k_pool), d_v = Upload(v_pool), d_q = Upload(q), d_t = Upload(table);
  auto d_par = Upload(c.pages_middle ? parents : Filled({1}, 0));
  auto d_plen = UploadRaw(&prefix_len, 4);
  auto d_scales = Upload(slot_scales);
  auto d_out = Upload(Filled({1, hq, d}, kNaN));
  auto d_lse = Upload(Filled({1, hq}, kNaN));
  SelectedAttentionParams p = cp;
  p.q = q.View(d_q->data());
  p.k_pool = k_pool.View(d_k->data());
  p.v_pool = v_pool.View(d_v->data());
  p.page_table = table.View(d_t->data());
  if (c.pages_middle) p.middle.parents = parents.View(d_par->data());
  p.out = want_out.View(d_out->data());
  p.lse = want_lse.View(d_lse->data());
  if (c.device_prefix) p.prefix_len = static_cast<const int32_t*>(d_plen->data());
  if (c.slot_scales) p.slot_scales = static_cast<const float*>(d_scales->data());
  for (int rep = 0; rep < 2; ++rep) {  // the second run reuses pooled scratch (counters)
    STRATA_ASSERT_OK(gpu_->SelectedAttention(p, nullptr));
    ExpectClose(Download(*d_out, hq * d), want_out.Values(), 2e-5, 2e-4,
                absl::StrCat(name, " out rep ", rep));
    ExpectClose(Download(*d_lse, hq), want_lse.Values(), 2e-5, 2e-5,
                absl::StrCat(name, " lse rep ", rep));
  }
}

// Per-slot scales (SelectedAttentionParams::slot_scales) on fp8 pools: 1, 3, 17, 129, 2368 and
// 4099 positions per KV head, head_dim 64/128/256, groups 1 to 8, random page tables (missing
// pages, a slot outside the pool), random scales in [0.01, 2]. By default 2368 positions run the
// cluster kernel and 4099 the split-K one; STRATA_SELECTED_ATTENTION=split|cluster (read once per
// process) runs every case through one of them.
TEST_F(CudaBackendTest, SelectedAttentionSlotScalesMatchCpu) {
  const SelCase cases[] = {
      {DType::kFP8E4M3, 8, 8, 64, 16, 1, 0, 0, false, false, true},        // 1 token, group 1
      {DType::kFP8E4M3, 12, 4, 128, 16, 0, 3, 0, true, false, true},       // 3, group 3
      {DType::kFP8E4M3, 16, 2, 64, 16, 0, 17, 0, false, false, true},      // 17, group 8
      {DType::kFP8E4M3, 24, 8, 128, 32, 129, 0, 0, false, true, true},     // 129 (86 on device)
      {DType::kFP8E4M3, 8, 4, 64, 64, 0, 0, 129, false, false, true},      // 129, group 2
      {DType::kFP8E4M3, 32, 8, 128, 64, 64, 2240, 64, true, false, true},  // 2368, group 4
      {DType::kFP8E4M3, 40, 5, 64, 16, 16, 4067, 16, false, false, true},  // 4099, group 8
      {DType::kFP8E4M3, 32, 8, 128, 64, 0, 4099, 0, false, false, true},   // 4099, group 4
      {DType::kFP8E4M3, 7, 7, 128, 16, 4000, 99, 0, true, false, true},    // 4099, group 1
      {DType::kFP8E4M3, 12, 2, 256, 64, 0, 2368, 0, false, false, true},   // d 256, group 6
      {DType::kFP8E4M3, 8, 2, 128, 16, 0, 0, 0, false, false, true},       // nothing attended
  };
  for (const SelCase& c : cases) RunSelectedCase(c);
}

// slot_scales need fp8 pools: InvalidArgument with f32|bf16 ones, on both backends, and nothing
// written.
TEST_F(CudaBackendTest, SelectedAttentionSlotScalesNeedFp8Pools) {
  for (DType pool : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(DTypeName(pool));
    const int64_t hq = 4, hkv = 2, d = 64, P = 16, slots = 4;
    HostTensor k_pool = Random(rng_, pool, {slots, P, d});
    HostTensor v_pool = Random(rng_, pool, {slots, P, d});
    HostTensor q = Random(rng_, DType::kF32, {1, hq, d});
    HostTensor table = Filled({hkv, 2}, 0.0f);  // 0.0f bytes: i32 zeros
    table.dtype = DType::kI32;
    HostTensor scales = Filled({slots, 2}, 1.0f);
    HostTensor out = Filled({1, hq, d}, kNaN), lse = Filled({1, hq}, kNaN);
    SelectedAttentionParams cp;
    cp.q = q.HostView();
    cp.k_pool = k_pool.HostView();
    cp.v_pool = v_pool.HostView();
    cp.page_table = table.HostView();
    cp.prefix_end = 20;
    cp.scale = 0.125f;
    cp.out = out.HostView();
    cp.lse = lse.HostView();
    cp.slot_scales = scales.f32();
    EXPECT_THAT(cpu_->SelectedAttention(cp, nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument));
    auto d_k = Upload(k_pool), d_v = Upload(v_pool), d_q = Upload(q), d_t = Upload(table);
    auto d_s = Upload(scales), d_out = Upload(out), d_lse = Upload(lse);
    SelectedAttentionParams p = cp;
    p.q = q.View(d_q->data());
    p.k_pool = k_pool.View(d_k->data());
    p.v_pool = v_pool.View(d_v->data());
    p.page_table = table.View(d_t->data());
    p.out = out.View(d_out->data());
    p.lse = lse.View(d_lse->data());
    p.slot_scales = static_cast<const float*>(d_s->data());
    EXPECT_THAT(gpu_->SelectedAttention(p, nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument));
    for (float x : Download(*d_out, hq * d)) ASSERT_TRUE(std::isnan(x));
    p.slot_scales = nullptr;  // the same call without them runs
    STRATA_EXPECT_OK(gpu_->SelectedAttention(p, nullptr));
    STRATA_EXPECT_OK(gpu_->Synchronize(nullptr));
  }
}

}  // namespace
}  // namespace strata::kernels
