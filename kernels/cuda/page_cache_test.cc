// ResolvePages on the CUDA backend against the CPU twin: the same random sequence of calls (page
// and token selections, prefixes and suffixes) on both, for f32 / bf16 pools with 16-byte and odd
// page halves, caches smaller and larger than the kernel's 1024-slot window. After every call the
// whole state must be equal bit for bit (counters, hand, table, slot owners, stamps, reference
// bits, the call's miss and victim lists) and every used slot of the GPU pools must hold its
// page's bytes. Also: a pinned-out call (more pages than slots) and the op captured in a CUDA
// graph and replayed with new selections. Without a GPU every test reports "no CUDA GPU:
// skipped".
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/testing/cuda_test_base.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {
namespace {

class CudaPageCacheTest
    : public CudaTestBase<::testing::TestWithParam<std::tuple<DType, int, int, int>>> {};

constexpr int kLayers = 3, kHeads = 2, kPages = 700;

// One cache state on `backend` (arrays in its memory), sources shared.
struct State {
  absl::Status Init(Backend* be, DType dtype, int P, int d, int slots, const void* const* src) {
    backend = be;
    num_slots = slots;
    half = static_cast<size_t>(P) * d * DTypeSize(dtype);
    const int64_t n = static_cast<int64_t>(kLayers) * kHeads * kPages;
    STRATA_ASSIGN_OR_RETURN(table, be->Allocate(n * 4));
    STRATA_ASSIGN_OR_RETURN(slot_page, be->Allocate(slots * 4));
    STRATA_ASSIGN_OR_RETURN(stamp, be->Allocate(slots * 4));
    STRATA_ASSIGN_OR_RETURN(ref, be->Allocate(slots));
    STRATA_ASSIGN_OR_RETURN(counters, be->Allocate(kPageCacheCounterCount * 8));
    STRATA_ASSIGN_OR_RETURN(scratch, be->Allocate((1 + 2 * slots) * 4));
    STRATA_ASSIGN_OR_RETURN(sources, be->Allocate(n * sizeof(void*)));
    STRATA_ASSIGN_OR_RETURN(page_scales, be->Allocate(n * 2 * sizeof(float)));
    STRATA_ASSIGN_OR_RETURN(slot_scales, be->Allocate(slots * 2 * sizeof(float)));
    {
      std::vector<float> ps(2 * n), ss(2 * slots, -1.0f);
      for (int64_t f = 0; f < 2 * n; ++f) ps[f] = 0.25f + static_cast<float>(f % 977);
      STRATA_RETURN_IF_ERROR(
          be->CopyToDevice(page_scales->data(), ps.data(), ps.size() * 4, nullptr));
      STRATA_RETURN_IF_ERROR(
          be->CopyToDevice(slot_scales->data(), ss.data(), ss.size() * 4, nullptr));
    }
    STRATA_ASSIGN_OR_RETURN(k, be->Allocate(slots * half));
    STRATA_ASSIGN_OR_RETURN(v, be->Allocate(slots * half));
    const std::vector<int32_t> minus(static_cast<size_t>(std::max<int64_t>(n, slots)), -1);
    const std::vector<uint8_t> zeros(static_cast<size_t>(std::max<int64_t>(n, slots) * 8), 0);
    STRATA_RETURN_IF_ERROR(be->CopyToDevice(table->data(), minus.data(), n * 4, nullptr));
    STRATA_RETURN_IF_ERROR(be->CopyToDevice(slot_page->data(), minus.data(), slots * 4, nullptr));
    STRATA_RETURN_IF_ERROR(be->CopyToDevice(stamp->data(), zeros.data(), slots * 4, nullptr));
    STRATA_RETURN_IF_ERROR(be->CopyToDevice(ref->data(), zeros.data(), slots, nullptr));
    STRATA_RETURN_IF_ERROR(
        be->CopyToDevice(counters->data(), zeros.data(), kPageCacheCounterCount * 8, nullptr));
    STRATA_RETURN_IF_ERROR(be->CopyToDevice(sources->data(), src, n * sizeof(void*), nullptr));
    st.table = static_cast<int32_t*>(table->data());
    st.table_size = n;
    st.slot_page = static_cast<int32_t*>(slot_page->data());
    st.slot_stamp = static_cast<uint32_t*>(stamp->data());
    st.slot_ref = static_cast<uint8_t*>(ref->data());
    st.num_slots = slots;
    st.counters = static_cast<int64_t*>(counters->data());
    st.scratch = static_cast<int32_t*>(scratch->data());
    st.scratch_pages = slots;
    st.sources = static_cast<const void* const*>(sources->data());
    st.page_scales = static_cast<const float*>(page_scales->data());
    st.slot_scales = static_cast<float*>(slot_scales->data());
    st.k_pool = TensorView(k->data(), dtype, {slots, P, d});
    st.v_pool = TensorView(v->data(), dtype, {slots, P, d});
    return be->Synchronize(nullptr);
  }
  template <typename T>
  std::vector<T> Read(Buffer* b, size_t count) {
    std::vector<T> out(count);
    EXPECT_TRUE(backend->CopyToHost(out.data(), b->data(), count * sizeof(T), nullptr).ok());
    return out;
  }
  Backend* backend = nullptr;
  int num_slots = 0;
  size_t half = 0;
  std::unique_ptr<Buffer> table, slot_page, stamp, ref, counters, scratch, sources, k, v,
      page_scales, slot_scales;
  PageCacheState st;
};

// A CPU and a GPU cache state over the same random source pages (AllocateHost memory of the GPU
// backend, which the CPU reads too).
struct Pair {
  absl::Status Init(Backend* gpu, DType dtype, int P, int d, int slots, std::mt19937& rng) {
    cpu = MakeCpuBackend(1);
    const int64_t n = static_cast<int64_t>(kLayers) * kHeads * kPages;
    const size_t half = static_cast<size_t>(P) * d * DTypeSize(dtype);
    STRATA_ASSIGN_OR_RETURN(host, gpu->AllocateHost(n * 2 * half));
    uint8_t* base = static_cast<uint8_t*>(host->data());
    bytes.resize(n * 2 * half);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    std::memcpy(base, bytes.data(), bytes.size());
    std::vector<const void*> src(n);
    for (int64_t f = 0; f < n; ++f) src[f] = base + f * 2 * half;
    STRATA_RETURN_IF_ERROR(c.Init(cpu.get(), dtype, P, d, slots, src.data()));
    return g.Init(gpu, dtype, P, d, slots, src.data());
  }
  std::unique_ptr<Backend> cpu;
  std::unique_ptr<Buffer> host;
  std::vector<uint8_t> bytes;
  State c, g;
};

// One call's selection, in host vectors; Params() points into `dev_parents` (backend memory).
struct Call {
  int layer = 0;
  int64_t prefix_end = 0, suffix_begin = 0, suffix_end = 0;
  std::vector<int32_t> parents;  // [kHeads, width]
  int width = 0, fanout = 1;
  int64_t begin = 0, end = 0;
};

// Calls name at most `slots` pages (every miss finds a victim);
// PinnedOutCallLeavesTheRestUnresolved covers calls that name more.
Call RandomCall(std::mt19937& rng, int P, int slots) {
  Call c;
  const int cap = std::max(1, std::min(300, slots / kHeads - 10));
  c.layer = static_cast<int>(rng() % kLayers);
  const int kind = static_cast<int>(rng() % 4);
  if (kind == 0) {  // token ids
    c.width = 1 + static_cast<int>(rng() % cap);
    c.fanout = 1;
    c.begin = P;
    c.end = static_cast<int64_t>(kPages - 4) * P;
    for (int i = 0; i < kHeads * c.width; ++i) {
      c.parents.push_back(static_cast<int32_t>(rng() % (kPages * P)) -
                          (rng() % 9 == 0 ? 99999 : 0));
    }
  } else {  // pages (fanout P), a few -1; the biggest calls exceed small caches
    c.width = 1 + static_cast<int>(rng() % (kind == 3 ? cap : std::min(cap, 40)));
    c.fanout = P;
    c.begin = P;
    c.end = static_cast<int64_t>(kPages - 4) * P;
    // A hot set (hits) and cold pages.
    for (int i = 0; i < kHeads * c.width; ++i) {
      const bool hot = rng() % 3 != 0;
      c.parents.push_back(
          rng() % 17 == 0 ? -1 : static_cast<int32_t>(hot ? rng() % 60 : rng() % kPages));
    }
  }
  c.prefix_end = static_cast<int64_t>(rng() % (2 * P + 1));
  if (rng() % 2) {
    c.suffix_begin = static_cast<int64_t>(kPages - 4) * P + rng() % P;
    c.suffix_end = static_cast<int64_t>(kPages) * P + rng() % (3 * P);  // past the table too
  }
  return c;
}

ResolvePagesParams MakeParams(const PageCacheState& st, const Call& c, int P,
                              const int32_t* parents) {
  ResolvePagesParams p;
  p.state = st;
  p.table_base = static_cast<int64_t>(c.layer) * kHeads * kPages;
  p.num_kv_heads = kHeads;
  p.pages_per_head = kPages;
  p.page_size = P;
  p.prefix_end = c.prefix_end;
  p.middle.parents = TensorView(const_cast<int32_t*>(parents), DType::kI32, {kHeads, c.width});
  p.middle.fanout = c.fanout;
  p.middle.begin = c.begin;
  p.middle.end = c.end;
  p.suffix_begin = c.suffix_begin;
  p.suffix_end = c.suffix_end;
  return p;
}

void Compare(State& cpu, State& gpu, const std::vector<uint8_t>& bytes, int call) {
  const int n = cpu.num_slots;
  const int64_t t = static_cast<int64_t>(kLayers) * kHeads * kPages;
  const auto cc = cpu.Read<int64_t>(cpu.counters.get(), kPageCacheCounterCount);
  const auto gc = gpu.Read<int64_t>(gpu.counters.get(), kPageCacheCounterCount);
  ASSERT_EQ(cc, gc) << "counters, call " << call;
  ASSERT_EQ(cpu.Read<uint32_t>(cpu.stamp.get(), n), gpu.Read<uint32_t>(gpu.stamp.get(), n))
      << "stamps, call " << call;
  ASSERT_EQ(cpu.Read<uint8_t>(cpu.ref.get(), n), gpu.Read<uint8_t>(gpu.ref.get(), n))
      << "reference bits, call " << call;
  const auto ctab = cpu.Read<int32_t>(cpu.table.get(), t),
             gtab = gpu.Read<int32_t>(gpu.table.get(), t);
  ASSERT_EQ(ctab, gtab) << "table, call " << call;
  for (int64_t f = 0; f < t; ++f) {
    ASSERT_EQ(ctab[f] >= 0, gtab[f] >= 0) << "page " << f << " resident, call " << call;
    ASSERT_GE(gtab[f], -1);
  }
  const auto csp = cpu.Read<int32_t>(cpu.slot_page.get(), n);
  const auto gsp = gpu.Read<int32_t>(gpu.slot_page.get(), n);
  const auto cscr = cpu.Read<int32_t>(cpu.scratch.get(), 1 + 2 * n);
  const auto gscr = gpu.Read<int32_t>(gpu.scratch.get(), 1 + 2 * n);
  ASSERT_EQ(cscr[0], gscr[0]) << "fills of call " << call;
  ASSERT_EQ(csp, gsp) << "slot owners, call " << call;
  ASSERT_EQ(cpu.Read<float>(cpu.slot_scales.get(), 2 * n),
            gpu.Read<float>(gpu.slot_scales.get(), 2 * n))
      << "slot scales, call " << call;
  for (int i = 0; i < cscr[0]; ++i) {
    ASSERT_EQ(cscr[1 + i], gscr[1 + i]) << "miss " << i << ", call " << call;
    ASSERT_EQ(cscr[1 + n + i], gscr[1 + n + i]) << "victim " << i << ", call " << call;
  }
  std::vector<bool> victim(n, false);
  std::vector<int32_t> cv, gv;
  for (int i = 0; i < cscr[0]; ++i) {
    victim[cscr[1 + n + i]] = true;
    cv.push_back(csp[cscr[1 + n + i]]);
    gv.push_back(gsp[gscr[1 + n + i]]);
    ASSERT_TRUE(victim[gscr[1 + n + i]]) << "victim slots differ, call " << call;
  }
  std::sort(cv.begin(), cv.end());
  std::sort(gv.begin(), gv.end());
  ASSERT_EQ(cv, gv) << "pages filled, call " << call;
  const auto gk = gpu.Read<uint8_t>(gpu.k.get(), n * gpu.half);
  const auto gvv = gpu.Read<uint8_t>(gpu.v.get(), n * gpu.half);
  for (int s = 0; s < n; ++s) {
    if (!victim[s]) {
      ASSERT_EQ(csp[s], gsp[s]) << "slot " << s << ", call " << call;
    }
    if (gsp[s] < 0) continue;
    ASSERT_EQ(gtab[gsp[s]], s);
    const uint8_t* src = bytes.data() + static_cast<size_t>(gsp[s]) * 2 * gpu.half;
    ASSERT_EQ(std::memcmp(gk.data() + s * gpu.half, src, gpu.half), 0) << "K of slot " << s;
    ASSERT_EQ(std::memcmp(gvv.data() + s * gpu.half, src + gpu.half, gpu.half), 0)
        << "V of slot " << s;
  }
}

TEST_P(CudaPageCacheTest, MatchesCpuOverRandomCalls) {
  const auto [dtype, P, d, slots] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(P * 31 + d * 7 + slots));
  Pair t;
  STRATA_ASSERT_OK(t.Init(gpu_, dtype, P, d, slots, rng));
  Backend* cpu = t.cpu.get();
  State& c = t.c;
  State& g = t.g;
  const std::vector<uint8_t>& bytes = t.bytes;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev_parents, gpu_->Allocate(kHeads * 300 * 4));
  for (int call = 0; call < 60; ++call) {
    const Call k = RandomCall(rng, P, slots);
    STRATA_ASSERT_OK(cpu->ResolvePages(MakeParams(c.st, k, P, k.parents.data()), nullptr));
    STRATA_ASSERT_OK(
        gpu_->CopyToDevice(dev_parents->data(), k.parents.data(), k.parents.size() * 4, nullptr));
    STRATA_ASSERT_OK(gpu_->ResolvePages(
        MakeParams(g.st, k, P, static_cast<int32_t*>(dev_parents->data())), nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    Compare(c, g, bytes, call);
    if (::testing::Test::HasFatalFailure()) return;
  }
  const auto counters = c.Read<int64_t>(c.counters.get(), kPageCacheCounterCount);
  EXPECT_GT(counters[kPageCacheHits], 0);
  EXPECT_GT(counters[kPageCacheFills], 0);
  if (slots < 100) {
    EXPECT_GT(counters[kPageCacheEvictions], 0);
  }
  EXPECT_EQ(counters[kPageCacheUnresolved], 0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaPageCacheTest,
    ::testing::Values(std::make_tuple(DType::kBF16, 64, 128, 1500),  // window wraps, 16-byte
                      std::make_tuple(DType::kBF16, 64, 128, 40),    // evictions
                      std::make_tuple(DType::kF32, 4, 3, 300),       // 48-byte halves
                      std::make_tuple(DType::kBF16, 3, 5, 26)));     // odd halves, small cache

TEST_F(CudaPageCacheTest, CapturedInAGraphReplaysNewSelections) {
  const int P = 16, d = 8, slots = 64;
  std::mt19937 rng(5);
  Pair t;
  STRATA_ASSERT_OK(t.Init(gpu_, DType::kF32, P, d, slots, rng));
  Backend* cpu = t.cpu.get();
  State& c = t.c;
  State& g = t.g;
  const std::vector<uint8_t>& bytes = t.bytes;
  const int width = 12;
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev_parents, gpu_->Allocate(kHeads * width * 4));
  Call k;
  k.layer = 1;
  k.width = width;
  k.fanout = P;
  k.begin = P;
  k.end = static_cast<int64_t>(kPages) * P;
  k.prefix_end = P;
  k.parents.assign(kHeads * width, -1);
  STRATA_ASSERT_OK(
      gpu_->CopyToDevice(dev_parents->data(), k.parents.data(), k.parents.size() * 4, nullptr));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
  STRATA_ASSERT_OK(gpu_->BeginCapture(nullptr));
  const absl::Status recorded = gpu_->ResolvePages(
      MakeParams(g.st, k, P, static_cast<int32_t*>(dev_parents->data())), nullptr);
  auto graph = gpu_->EndCapture(nullptr);
  STRATA_ASSERT_OK(recorded);
  STRATA_ASSERT_OK(graph.status());
  for (int step = 0; step < 20; ++step) {
    for (int32_t& p : k.parents) p = static_cast<int32_t>(1 + rng() % 40);
    STRATA_ASSERT_OK(cpu->ResolvePages(MakeParams(c.st, k, P, k.parents.data()), nullptr));
    STRATA_ASSERT_OK(
        gpu_->CopyToDevice(dev_parents->data(), k.parents.data(), k.parents.size() * 4, nullptr));
    STRATA_ASSERT_OK((*graph)->Replay(nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    Compare(c, g, bytes, step);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_F(CudaPageCacheTest, PinnedOutCallLeavesTheRestUnresolved) {
  const int P = 8, d = 4, slots = 8;
  std::mt19937 rng(3);
  Pair t;
  STRATA_ASSERT_OK(t.Init(gpu_, DType::kF32, P, d, slots, rng));
  Backend* cpu = t.cpu.get();
  State& c = t.c;
  State& g = t.g;
  const std::vector<uint8_t>& bytes = t.bytes;
  const int64_t n = static_cast<int64_t>(kLayers) * kHeads * kPages;
  const size_t half = g.half;
  Call k;
  k.layer = 2;
  k.width = 10;  // 20 distinct pages for 8 slots
  k.fanout = P;
  k.begin = 0;
  k.end = static_cast<int64_t>(kPages) * P;
  for (int i = 0; i < kHeads * k.width; ++i) k.parents.push_back(100 + i % k.width);
  STRATA_ASSERT_OK_AND_ASSIGN(auto dev_parents, gpu_->Allocate(k.parents.size() * 4));
  STRATA_ASSERT_OK(
      gpu_->CopyToDevice(dev_parents->data(), k.parents.data(), k.parents.size() * 4, nullptr));
  for (int call = 0; call < 2; ++call) {
    STRATA_ASSERT_OK(cpu->ResolvePages(MakeParams(c.st, k, P, k.parents.data()), nullptr));
    STRATA_ASSERT_OK(gpu_->ResolvePages(
        MakeParams(g.st, k, P, static_cast<int32_t*>(dev_parents->data())), nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    Compare(c, g, bytes, call);  // the same pages left unresolved as the CPU twin
    if (::testing::Test::HasFatalFailure()) return;
    const auto gc = g.Read<int64_t>(g.counters.get(), kPageCacheCounterCount);
    // The first call fills every slot; in the second the 8 resident pages are hits, pinned, and
    // the other 12 find no victim.
    EXPECT_EQ(gc[kPageCacheFills], 8);
    EXPECT_EQ(gc[kPageCacheUnresolved], 12 * (call + 1));
    EXPECT_EQ(gc[kPageCacheHits], call == 0 ? 0 : 8);
    const auto gtab = g.Read<int32_t>(g.table.get(), n);
    const auto gsp = g.Read<int32_t>(g.slot_page.get(), slots);
    int resident = 0;
    for (int64_t f = 0; f < n; ++f) {
      ASSERT_GE(gtab[f], -1);
      if (gtab[f] >= 0) {
        ++resident;
        EXPECT_EQ(gsp[gtab[f]], f);
      }
    }
    EXPECT_EQ(resident, slots);
    const auto gk = g.Read<uint8_t>(g.k.get(), slots * half);
    for (int s = 0; s < slots; ++s) {
      ASSERT_GE(gsp[s], 0);
      EXPECT_EQ(std::memcmp(gk.data() + s * half, bytes.data() + gsp[s] * 2 * half, half), 0);
    }
  }
}

}  // namespace
}  // namespace strata::kernels
