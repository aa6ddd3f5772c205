// The tensor-core flash prefill kernel (kernels/cuda/flash_prefill.cu) against the CPU reference
// PagedAttention on fresh random inputs: awkward token counts (1, 3, 17, 129, 600), spans that
// start mid-page, one-token pages, dense causal prefill (all earlier pages + the chunk) and
// block-sparse layouts (selected pages in shuffled order, gaps in positions, queries that attend
// nothing), causal and non-causal, GQA ratios 1/4/8, head_dim 64 and 128. Outputs are poisoned
// with NaN first, so an element the kernel does not write fails. The backend is forced onto the
// flash path (CudaBackend::PrefillPath::kFlash) so that one-token calls take it too; shapes the
// flash kernel does not cover (f32 pool, head_dim 96) check that the general fallback still
// serves them. fp8 e4m3 pools (with per-tensor k_scale / v_scale) take the flash path too. Every case runs with 32- and 64-key tiles (cuda_internal::SetFlashPrefillBlockN). Tolerances: bf16 rounding of q and of the softmax weights (f32 accumulation) on
// the flash path; the general kernel's f32 tolerance otherwise. Without a GPU every test reports
// "no CUDA GPU: skipped".
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/flash_prefill.h"
#include "kernels/tensor.h"

namespace strata::kernels {
namespace {

constexpr uint32_t kSeed = 6061;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

enum class Layout { kDense, kSparse };

struct FlashCase {
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int page_size;
  int keys;  // dense: keys before the chunk; sparse: about this many selected keys per KV head
  bool causal;
  Layout layout;
  DType pool;
};

std::string CaseName(const ::testing::TestParamInfo<FlashCase>& info) {
  const FlashCase& c = info.param;
  return absl::StrCat(c.layout == Layout::kDense ? "dense" : "sparse", "_t", c.num_tokens, "_q",
                      c.num_q_heads, "_kv", c.num_kv_heads, "_d", c.head_dim, "_p", c.page_size,
                      "_k", c.keys, c.causal ? "_causal" : "_full", "_", DTypeName(c.pool));
}

// True when the case is served by the flash kernel (see CudaBackend::SetPrefillPath).
bool OnFlashPath(const FlashCase& c) {
  return (c.pool == DType::kBF16 || c.pool == DType::kFP8E4M3) &&
         (c.head_dim == 64 || c.head_dim == 128);
}

struct Host {
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
  std::vector<float> Values() const {
    std::vector<float> v(NumElements());
    ConvertToF32(bytes.data(), dtype, v.data(), NumElements());
    return v;
  }
};

Host Make(DType dtype, std::vector<int64_t> dims, std::mt19937* rng, float lo, float hi,
          float fill = 0.0f) {
  Host t;
  t.dtype = dtype;
  t.dims = std::move(dims);
  std::vector<float> raw(t.NumElements(), fill);
  if (rng != nullptr) {
    std::uniform_real_distribution<float> dist(lo, hi);
    for (float& x : raw) x = dist(*rng);
  }
  t.bytes.resize(raw.size() * DTypeSize(dtype) + 16);
  ConvertFromF32(raw.data(), t.bytes.data(), dtype, static_cast<int64_t>(raw.size()));
  return t;
}

class FlashPrefillTest : public ::testing::TestWithParam<FlashCase> {
 protected:
  static void SetUpTestSuite() {
    auto b = CudaBackend::Create(0);
    if (b.ok()) {
      gpu_ = std::move(b).value().release();
      gpu_->SetPrefillPath(CudaBackend::PrefillPath::kFlash);
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
  }

  std::unique_ptr<Buffer> Upload(const Host& t) {
    auto buf = gpu_->Allocate(t.bytes.size());
    EXPECT_TRUE(buf.ok()) << buf.status();
    EXPECT_TRUE(gpu_->CopyToDevice(buf.value()->data(), t.bytes.data(), t.bytes.size(), nullptr).ok());
    return std::move(buf).value();
  }
  std::vector<float> Download(Buffer& b, int64_t n) {
    std::vector<float> v(n);
    EXPECT_TRUE(gpu_->CopyToHost(v.data(), b.data(), n * 4, nullptr).ok());
    return v;
  }

  static CudaBackend* gpu_;
  static Backend* cpu_;
  static std::string why_;
};

CudaBackend* FlashPrefillTest::gpu_ = nullptr;
Backend* FlashPrefillTest::cpu_ = nullptr;
std::string FlashPrefillTest::why_;

// |got - want| <= atol + rtol * |want| everywhere (equal infinities pass; NaN never does).
int CountBad(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol,
             const std::string& what, uint32_t seed) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(d <= atol + rtol * std::fabs(static_cast<double>(want[i])))) {
      if (++bad <= 3) {
        ADD_FAILURE() << what << " (seed " << seed << "): element " << i << " got " << got[i]
                      << " want " << want[i];
      }
    }
  }
  return bad;
}

TEST_P(FlashPrefillTest, MatchesCpu) {
  const FlashCase c = GetParam();
  const uint32_t seed = kSeed ^ static_cast<uint32_t>(std::hash<std::string>()(
                                    ::testing::UnitTest::GetInstance()->current_test_info()->name()));
  std::mt19937 rng(seed);
  const int64_t d = c.head_dim, page = c.page_size;
  const int keys_per_head = c.layout == Layout::kDense ? c.keys + c.num_tokens : c.keys;
  const int64_t pages_per_head = keys_per_head / page + 3;
  const int64_t num_slots = pages_per_head * c.num_kv_heads + 2;
  Host k_pool = Make(c.pool, {num_slots, page, d}, &rng, -1, 1);
  Host v_pool = Make(c.pool, {num_slots, page, d}, &rng, -1, 1);
  Host q = Make(DType::kF32, {c.num_tokens, c.num_q_heads, d}, &rng, -2, 2);

  std::vector<int32_t> slots(num_slots);
  for (int64_t i = 0; i < num_slots; ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  size_t next_slot = 0;
  std::vector<KvSpan> spans;
  std::vector<int32_t> offsets(c.num_kv_heads + 1, 0);
  std::vector<int32_t> q_pos(c.num_tokens);
  int32_t max_pos = 0;
  const int32_t base = static_cast<int32_t>(rng() % 50);
  for (int g = 0; g < c.num_kv_heads; ++g) {
    offsets[g] = static_cast<int32_t>(spans.size());
    if (c.layout == Layout::kDense) {
      // All earlier keys plus the chunk, in order; the first span starts mid-page.
      int32_t pos = base, left = keys_per_head;
      int32_t off = static_cast<int32_t>(rng() % page);
      while (left > 0) {
        KvSpan s;
        s.slot = slots[next_slot++];
        s.offset = off;
        s.length = std::min<int32_t>(left, static_cast<int32_t>(page) - off);
        s.position = pos;
        spans.push_back(s);
        pos += s.length;
        left -= s.length;
        off = 0;
      }
    } else {
      // Selected pages and sub-runs with gaps, then shuffled (positions not monotone).
      const size_t first = spans.size();
      int32_t pos = static_cast<int32_t>(rng() % 7), tokens = 0;
      while (tokens < keys_per_head && next_slot < slots.size()) {
        KvSpan s;
        s.slot = slots[next_slot++];
        if (rng() % 3 == 0) {
          s.offset = static_cast<int32_t>(rng() % page);
          s.length = static_cast<int32_t>(rng() % (page - s.offset + 1));  // may be 0
        } else {
          s.offset = 0;
          s.length = static_cast<int32_t>(page);
        }
        s.length = std::min(s.length, keys_per_head - tokens);
        s.position = pos;
        pos += s.length + static_cast<int32_t>(rng() % (3 * page));
        tokens += s.length;
        spans.push_back(s);
      }
      std::shuffle(spans.begin() + first, spans.end(), rng);
      max_pos = std::max(max_pos, pos);
    }
  }
  offsets[c.num_kv_heads] = static_cast<int32_t>(spans.size());
  for (int t = 0; t < c.num_tokens; ++t) {
    // Dense: the chunk is the last num_tokens keys. Sparse: anywhere, some before every key.
    q_pos[t] = c.layout == Layout::kDense ? base + c.keys + t
                                          : static_cast<int32_t>(rng() % (max_pos + 2)) - 3;
  }

  Host want_out = Make(DType::kF32, {c.num_tokens, c.num_q_heads, d}, nullptr, 0, 0, kNaN);
  Host want_lse = Make(DType::kF32, {c.num_tokens, c.num_q_heads}, nullptr, 0, 0, kNaN);
  PagedAttentionParams cp;
  cp.q = q.View(q.bytes.data());
  cp.k_pool = k_pool.View(k_pool.bytes.data());
  cp.v_pool = v_pool.View(v_pool.bytes.data());
  cp.spans = spans.data();
  cp.span_offsets = offsets.data();
  cp.num_kv_heads = c.num_kv_heads;
  cp.q_positions = q_pos.data();
  cp.causal = c.causal;
  cp.scale = 1.0f / std::sqrt(static_cast<float>(d));
  if (c.pool == DType::kFP8E4M3) {  // per-tensor scales: keys and values of the codes x scale
    cp.k_scale = 0.375f;
    cp.v_scale = 2.5f;
  }
  cp.out = want_out.View(want_out.bytes.data());
  cp.lse = want_lse.View(want_lse.bytes.data());
  STRATA_ASSERT_OK(cpu_->PagedAttention(cp, nullptr));
  const std::vector<float> ref_out = want_out.Values(), ref_lse = want_lse.Values();
  // The cases are built so that some rows attend keys (otherwise the test proves little).
  int attended = 0;
  for (float x : ref_lse) attended += std::isfinite(x) ? 1 : 0;
  if (c.keys > 0) {
    EXPECT_GT(attended, 0);
  }

  auto d_k = Upload(k_pool);
  auto d_v = Upload(v_pool);
  auto d_q = Upload(q);
  auto d_out = Upload(want_out);  // NaN-poisoned
  auto d_lse = Upload(want_lse);
  Host poison_out = Make(DType::kF32, {c.num_tokens, c.num_q_heads, d}, nullptr, 0, 0, kNaN);
  Host poison_lse = Make(DType::kF32, {c.num_tokens, c.num_q_heads}, nullptr, 0, 0, kNaN);
  STRATA_ASSERT_OK(gpu_->CopyToDevice(d_out->data(), poison_out.bytes.data(),
                                      poison_out.bytes.size(), nullptr));
  STRATA_ASSERT_OK(gpu_->CopyToDevice(d_lse->data(), poison_lse.bytes.data(),
                                      poison_lse.bytes.size(), nullptr));
  PagedAttentionParams p = cp;
  p.q = q.View(d_q->data());
  p.k_pool = k_pool.View(d_k->data());
  p.v_pool = v_pool.View(d_v->data());
  p.out = want_out.View(d_out->data());
  p.lse = want_lse.View(d_lse->data());
  STRATA_ASSERT_OK(gpu_->Supports(p));
  const bool flash = OnFlashPath(c);
  const double atol = flash ? 1e-2 : 2e-5, rtol = flash ? 1e-2 : 2e-4;
  // Both tile sizes of the flash kernel, each on freshly poisoned outputs.
  for (const int block_n : {32, 64}) {
    cuda_internal::SetFlashPrefillBlockN(block_n);
    STRATA_ASSERT_OK(gpu_->CopyToDevice(d_out->data(), poison_out.bytes.data(),
                                        poison_out.bytes.size(), nullptr));
    STRATA_ASSERT_OK(gpu_->CopyToDevice(d_lse->data(), poison_lse.bytes.data(),
                                        poison_lse.bytes.size(), nullptr));
    STRATA_ASSERT_OK(gpu_->PagedAttention(p, nullptr));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    const std::string what =
        absl::StrCat(CaseName(::testing::TestParamInfo<FlashCase>(c, 0)), " block_n ", block_n);
    EXPECT_EQ(CountBad(Download(*d_out, c.num_tokens * c.num_q_heads * d), ref_out, atol, rtol,
                       what + " out", seed),
              0);
    EXPECT_EQ(CountBad(Download(*d_lse, c.num_tokens * c.num_q_heads), ref_lse, atol,
                       flash ? 1e-3 : 2e-5, what + " lse", seed),
              0);
  }
  cuda_internal::SetFlashPrefillBlockN(0);
}

INSTANTIATE_TEST_SUITE_P(
    Flash, FlashPrefillTest,
    ::testing::Values(
        // Dense causal prefill: earlier keys + the chunk, first span mid-page.
        FlashCase{1, 8, 2, 128, 16, 300, true, Layout::kDense, DType::kBF16},
        FlashCase{3, 8, 1, 128, 16, 81, true, Layout::kDense, DType::kBF16},
        FlashCase{17, 8, 2, 64, 64, 0, true, Layout::kDense, DType::kBF16},
        FlashCase{129, 4, 4, 128, 16, 700, true, Layout::kDense, DType::kBF16},
        FlashCase{600, 8, 1, 128, 64, 1500, true, Layout::kDense, DType::kBF16},
        FlashCase{600, 8, 2, 64, 32, 77, true, Layout::kDense, DType::kBF16},
        FlashCase{130, 8, 2, 128, 16, 4000, false, Layout::kDense, DType::kBF16},
        FlashCase{64, 8, 2, 128, 1, 200, true, Layout::kDense, DType::kBF16},
        // Block-sparse: selected pages, shuffled, gaps; queries before every key attend nothing.
        FlashCase{17, 8, 2, 64, 64, 500, true, Layout::kSparse, DType::kBF16},
        FlashCase{129, 8, 1, 64, 16, 1000, true, Layout::kSparse, DType::kBF16},
        FlashCase{600, 8, 2, 64, 32, 900, false, Layout::kSparse, DType::kBF16},
        FlashCase{3, 4, 1, 128, 16, 3000, true, Layout::kSparse, DType::kBF16},
        FlashCase{64, 8, 2, 128, 1, 300, true, Layout::kSparse, DType::kBF16},
        FlashCase{17, 4, 1, 128, 16, 0, true, Layout::kSparse, DType::kBF16},
        // Off the flash path: the general kernel serves them.
        // fp8 e4m3 pools with k_scale / v_scale: converted to bf16 as they land in the tiles.
        FlashCase{129, 4, 4, 128, 16, 700, true, Layout::kDense, DType::kFP8E4M3},
        FlashCase{600, 8, 2, 64, 32, 77, true, Layout::kDense, DType::kFP8E4M3},
        FlashCase{3, 8, 1, 128, 16, 81, true, Layout::kDense, DType::kFP8E4M3},
        FlashCase{130, 8, 2, 128, 16, 4000, false, Layout::kDense, DType::kFP8E4M3},
        FlashCase{129, 8, 1, 64, 16, 1000, true, Layout::kSparse, DType::kFP8E4M3},
        FlashCase{64, 8, 2, 128, 1, 300, true, Layout::kSparse, DType::kFP8E4M3},
        FlashCase{17, 8, 2, 128, 16, 300, true, Layout::kDense, DType::kF32},
        FlashCase{5, 4, 2, 96, 16, 100, true, Layout::kDense, DType::kBF16}),
    CaseName);

}  // namespace
}  // namespace strata::kernels
