// PageCopy on the CUDA backend against the CPU twin: random pages copied into random distinct
// slots of poisoned pools (f32 and bf16, aligned and odd sizes, 1..1000 pages), plus table
// updates; the device pools and table must equal the CPU backend's byte for byte. Also checks
// that staging which is not AllocateHost memory is refused. Without a GPU every test reports
// "no CUDA GPU: skipped".
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
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

using ::strata::testing::StatusIs;

class CudaPageCopyTest
    : public CudaTestBase<::testing::TestWithParam<std::tuple<DType, int, int, int>>> {};

TEST_P(CudaPageCopyTest, MatchesCpuByteForByte) {
  const auto [dtype, page_size, head_dim, num_pages] = GetParam();
  const int num_slots = num_pages + 7;
  const int64_t table_size = 3 * num_pages + 5;
  std::mt19937 rng(static_cast<uint32_t>(page_size * 131 + head_dim * 7 + num_pages));
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);

  const size_t page_bytes = PageCopyBytes(page_size, head_dim, dtype);
  const size_t pool_bytes = static_cast<size_t>(num_slots) * page_bytes / 2;
  // Staging, slots and table updates in AllocateHost memory of the GPU backend (readable by both).
  STRATA_ASSERT_OK_AND_ASSIGN(auto staging, gpu_->AllocateHost(page_bytes * num_pages));
  STRATA_ASSERT_OK_AND_ASSIGN(auto slots, gpu_->AllocateHost(sizeof(int32_t) * num_pages));
  STRATA_ASSERT_OK_AND_ASSIGN(auto index, gpu_->AllocateHost(sizeof(int32_t) * num_pages));
  STRATA_ASSERT_OK_AND_ASSIGN(auto value, gpu_->AllocateHost(sizeof(int32_t) * num_pages));
  auto* bytes = static_cast<uint8_t*>(staging->data());
  for (size_t i = 0; i < page_bytes * num_pages; ++i) bytes[i] = static_cast<uint8_t>(rng());
  std::vector<int32_t> perm(num_slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tperm(table_size);
  std::iota(tperm.begin(), tperm.end(), 0);
  std::shuffle(tperm.begin(), tperm.end(), rng);
  auto* s = static_cast<int32_t*>(slots->data());
  auto* ti = static_cast<int32_t*>(index->data());
  auto* tv = static_cast<int32_t*>(value->data());
  for (int i = 0; i < num_pages; ++i) {
    s[i] = perm[i];
    ti[i] = tperm[i];
    tv[i] = (i % 3 == 0) ? -1 : perm[i];
  }

  // Poisoned pools and table, the same on both backends.
  std::vector<uint8_t> poison(pool_bytes, 0xA5);
  std::vector<int32_t> table_init(table_size, 12345);
  STRATA_ASSERT_OK_AND_ASSIGN(auto gk, gpu_->Allocate(pool_bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(auto gv, gpu_->Allocate(pool_bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(auto gt, gpu_->Allocate(sizeof(int32_t) * table_size));
  STRATA_ASSERT_OK(gpu_->CopyToDevice(gk->data(), poison.data(), pool_bytes, nullptr));
  STRATA_ASSERT_OK(gpu_->CopyToDevice(gv->data(), poison.data(), pool_bytes, nullptr));
  STRATA_ASSERT_OK(
      gpu_->CopyToDevice(gt->data(), table_init.data(), sizeof(int32_t) * table_size, nullptr));
  std::vector<uint8_t> ck(poison), cv(poison);
  std::vector<int32_t> ct(table_init);

  PageCopyParams p;
  p.staging = staging->data();
  p.staging_bytes = staging->bytes();
  p.slots = s;
  p.num_pages = num_pages;
  p.table_size = table_size;
  p.table_index = ti;
  p.table_value = tv;
  p.num_table_updates = num_pages;

  PageCopyParams pc = p;
  pc.k_pool = TensorView(ck.data(), dtype, {num_slots, page_size, head_dim});
  pc.v_pool = TensorView(cv.data(), dtype, {num_slots, page_size, head_dim});
  pc.table = ct.data();
  STRATA_ASSERT_OK(cpu->PageCopy(pc, nullptr));

  PageCopyParams pg = p;
  pg.k_pool = gk->View(dtype, {num_slots, page_size, head_dim});
  pg.v_pool = gv->View(dtype, {num_slots, page_size, head_dim});
  pg.table = static_cast<int32_t*>(gt->data());
  STRATA_ASSERT_OK(gpu_->Supports(pg));
  STRATA_ASSERT_OK(gpu_->PageCopy(pg, nullptr));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));

  std::vector<uint8_t> hk(pool_bytes), hv(pool_bytes);
  std::vector<int32_t> ht(table_size);
  STRATA_ASSERT_OK(gpu_->CopyToHost(hk.data(), gk->data(), pool_bytes, nullptr));
  STRATA_ASSERT_OK(gpu_->CopyToHost(hv.data(), gv->data(), pool_bytes, nullptr));
  STRATA_ASSERT_OK(gpu_->CopyToHost(ht.data(), gt->data(), sizeof(int32_t) * table_size, nullptr));
  EXPECT_TRUE(hk == ck) << "k_pool differs from the CPU twin";
  EXPECT_TRUE(hv == cv) << "v_pool differs from the CPU twin";
  EXPECT_TRUE(ht == ct) << "table differs from the CPU twin";
  // The copy really moved the pages (the CPU twin is not trivially equal to the poison).
  if (num_pages > 0) {
    EXPECT_FALSE(ck == poison);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaPageCopyTest,
    ::testing::Values(std::make_tuple(DType::kBF16, 64, 128, 1),
                      std::make_tuple(DType::kBF16, 64, 128, 1000),
                      std::make_tuple(DType::kF32, 64, 128, 17),
                      std::make_tuple(DType::kBF16, 3, 17, 129),    // odd: byte path
                      std::make_tuple(DType::kF32, 1, 1, 3),
                      std::make_tuple(DType::kBF16, 16, 64, 0)));

// Pages read in place through `sources` (shuffled, optionally misaligned by 2 bytes, which takes
// the byte path) equal the CPU twin's; a pageable source is refused.
TEST_F(CudaPageCopyTest, SourcesMatchCpu) {
  for (const int misalign : {0, 2}) {
    SCOPED_TRACE(misalign);
    constexpr int kPages = 300, kSlots = 400, kP = 64, kD = 128;
    const DType dtype = DType::kBF16;
    const size_t page_bytes = PageCopyBytes(kP, kD, dtype);
    const size_t pool_bytes = page_bytes / 2 * kSlots;
    std::mt19937 rng(99 + misalign);
    STRATA_ASSERT_OK_AND_ASSIGN(auto host, gpu_->AllocateHost(page_bytes * (kPages + 1)));
    STRATA_ASSERT_OK_AND_ASSIGN(auto sources, gpu_->AllocateHost(sizeof(void*) * kPages));
    STRATA_ASSERT_OK_AND_ASSIGN(auto slots, gpu_->AllocateHost(sizeof(int32_t) * kPages));
    auto* bytes = static_cast<uint8_t*>(host->data());
    for (size_t i = 0; i < host->bytes(); ++i) bytes[i] = static_cast<uint8_t>(rng());
    std::vector<int32_t> order(kPages), perm(kSlots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    auto* src = static_cast<const void**>(sources->data());
    auto* s = static_cast<int32_t*>(slots->data());
    for (int i = 0; i < kPages; ++i) {
      src[i] = bytes + page_bytes * order[i] + (i % 2 == 1 ? misalign : 0);
      s[i] = perm[i];
    }
    std::vector<uint8_t> ck(pool_bytes, 0x5A), cv(pool_bytes, 0x5A);
    STRATA_ASSERT_OK_AND_ASSIGN(auto gk, gpu_->Allocate(pool_bytes));
    STRATA_ASSERT_OK_AND_ASSIGN(auto gv, gpu_->Allocate(pool_bytes));
    STRATA_ASSERT_OK(gpu_->CopyToDevice(gk->data(), ck.data(), pool_bytes, nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToDevice(gv->data(), cv.data(), pool_bytes, nullptr));
    PageCopyParams p;
    p.sources = src;
    p.slots = s;
    p.num_pages = kPages;
    PageCopyParams pc = p;
    pc.k_pool = TensorView(ck.data(), dtype, {kSlots, kP, kD});
    pc.v_pool = TensorView(cv.data(), dtype, {kSlots, kP, kD});
    std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
    STRATA_ASSERT_OK(cpu->PageCopy(pc, nullptr));
    PageCopyParams pg = p;
    pg.k_pool = gk->View(dtype, {kSlots, kP, kD});
    pg.v_pool = gv->View(dtype, {kSlots, kP, kD});
    STRATA_ASSERT_OK(gpu_->PageCopy(pg, nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    std::vector<uint8_t> hk(pool_bytes), hv(pool_bytes);
    STRATA_ASSERT_OK(gpu_->CopyToHost(hk.data(), gk->data(), pool_bytes, nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToHost(hv.data(), gv->data(), pool_bytes, nullptr));
    EXPECT_TRUE(hk == ck);
    EXPECT_TRUE(hv == cv);
    // One source in pageable memory: refused before anything runs.
    std::vector<uint8_t> pageable(page_bytes);
    src[kPages / 2] = pageable.data();
    EXPECT_THAT(gpu_->PageCopy(pg, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

TEST_F(CudaPageCopyTest, RefusesPageableStagingAndBadSlots) {
  std::vector<uint8_t> pageable(PageCopyBytes(4, 8, DType::kF32));
  STRATA_ASSERT_OK_AND_ASSIGN(auto slots, gpu_->AllocateHost(sizeof(int32_t)));
  STRATA_ASSERT_OK_AND_ASSIGN(auto pool_k, gpu_->Allocate(2 * pageable.size()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto pool_v, gpu_->Allocate(2 * pageable.size()));
  static_cast<int32_t*>(slots->data())[0] = 0;
  PageCopyParams p;
  p.staging = pageable.data();
  p.staging_bytes = pageable.size();
  p.slots = static_cast<int32_t*>(slots->data());
  p.num_pages = 1;
  p.k_pool = pool_k->View(DType::kF32, {4, 4, 8});
  p.v_pool = pool_v->View(DType::kF32, {4, 4, 8});
  EXPECT_THAT(gpu_->PageCopy(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(auto staging, gpu_->AllocateHost(pageable.size()));
  p.staging = staging->data();
  STRATA_ASSERT_OK(gpu_->PageCopy(p, nullptr));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));  // the slots are read by the device until here
  static_cast<int32_t*>(slots->data())[0] = 4;   // == num_slots
  EXPECT_THAT(gpu_->PageCopy(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
}

}  // namespace
}  // namespace strata::kernels
