#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "base/status_macros.h"
#include "base/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/internal/matmul.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

constexpr uint32_t kSeed = 20261122;
const int64_t kSizes[] = {1, 3, 17, 129};
const DType kWeightTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// A float tensor stored in `dtype`, plus the f32 values it actually holds (after rounding).
struct HostTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;
  std::vector<uint8_t> bytes;
  std::vector<float> values;

  TensorView View() {
    TensorView v;
    v.data = bytes.data();
    v.dtype = dtype;
    v.rank = static_cast<int>(dims.size());
    for (int i = 0; i < v.rank; ++i) v.shape[i] = dims[i];
    return v;
  }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
};

class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  float Uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(gen_() >> 8) / 16777216.0f;
  }
  uint32_t Next() { return gen_(); }

 private:
  std::mt19937 gen_;
};

HostTensor Random(Rng& rng, DType dtype, std::vector<int64_t> dims, float lo = -1.0f,
                  float hi = 1.0f) {
  HostTensor t;
  t.dtype = dtype;
  t.dims = dims;
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  std::vector<float> raw(n);
  for (float& x : raw) x = rng.Uniform(lo, hi);
  t.bytes.resize(n * DTypeSize(dtype) + 1);
  ConvertFromF32(raw.data(), t.bytes.data(), dtype, n);
  t.values.resize(n);
  ConvertToF32(t.bytes.data(), dtype, t.values.data(), n);
  return t;
}

HostTensor Zeros(std::vector<int64_t> dims) {
  HostTensor t;
  t.dims = dims;
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  t.bytes.assign(n * 4 + 1, 0);
  // Poison: NaN everywhere, so an element the op forgets to write fails the comparison.
  for (int64_t i = 0; i < n; ++i) t.f32()[i] = NAN;
  t.values.assign(n, 0.0f);
  return t;
}

// Every element must satisfy |got - want| <= atol + rtol * |want|; NaN never passes.
void ExpectClose(const float* got, const std::vector<double>& want, double atol, double rtol,
                 const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(d <= atol + rtol * std::fabs(want[i]))) {
      if (++bad <= 3) {
        ADD_FAILURE() << what << " seed " << kSeed << " element " << i << ": got " << got[i]
                      << " want " << want[i];
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << " seed " << kSeed;
}

TEST(CpuBackendTest, Memory) {
  auto backend = MakeCpuBackend(2);
  EXPECT_EQ(backend->Name(), "cpu");
  STRATA_ASSERT_OK_AND_ASSIGN(auto buf, backend->Allocate(1000));
  ASSERT_NE(buf->data(), nullptr);
  EXPECT_EQ(buf->bytes(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 64, 0u);
  std::vector<uint8_t> src(1000), dst(1000);
  for (int i = 0; i < 1000; ++i) src[i] = static_cast<uint8_t>(i * 7);
  STRATA_ASSERT_OK(backend->CopyToDevice(buf->data(), src.data(), 1000, nullptr));
  STRATA_ASSERT_OK(backend->CopyToHost(dst.data(), buf->data(), 1000, nullptr));
  STRATA_ASSERT_OK(backend->Synchronize(nullptr));
  EXPECT_EQ(src, dst);
  EXPECT_THAT(backend->CopyToDevice(nullptr, src.data(), 4, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The defaults of the stream helpers: copies that do not wait are the waiting ones (and refuse
// null the same way), a mark is 0 and done at once (any other id is refused), a fork is the
// stream itself and its join does nothing.
TEST(CpuBackendTest, StreamHelperDefaults) {
  auto backend = MakeCpuBackend(1);
  std::vector<uint8_t> src(100, 3), dst(100, 0);
  STRATA_ASSERT_OK_AND_ASSIGN(auto buf, backend->Allocate(100));
  STRATA_ASSERT_OK(backend->CopyToDeviceAsync(buf->data(), src.data(), 100, nullptr));
  STRATA_ASSERT_OK(backend->CopyToHostAsync(dst.data(), buf->data(), 100, nullptr));
  EXPECT_EQ(src, dst);
  EXPECT_THAT(backend->CopyToHostAsync(nullptr, buf->data(), 4, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(const int64_t mark, backend->RecordMark(nullptr));
  EXPECT_EQ(mark, 0);
  STRATA_ASSERT_OK(backend->WaitMark(mark));
  EXPECT_THAT(backend->WaitMark(5), StatusIs(absl::StatusCode::kInvalidArgument));
  STRATA_ASSERT_OK_AND_ASSIGN(Stream side, backend->ForkStream(nullptr));
  EXPECT_EQ(side, nullptr);
  STRATA_ASSERT_OK(backend->JoinStream(side, nullptr));
}

TEST(CpuBackendTest, Embedding) {
  Rng rng(kSeed);
  auto backend = MakeCpuBackend();
  for (DType dt : kWeightTypes) {
    for (int64_t hidden : kSizes) {
      for (int64_t n : kSizes) {
        const int64_t vocab = 19;
        HostTensor table = Random(rng, dt, {vocab, hidden});
        std::vector<int32_t> ids(n);
        for (auto& id : ids) id = static_cast<int32_t>(rng.Next() % vocab);
        HostTensor out = Zeros({n, hidden});
        EmbeddingParams p{ids.data(), table.View(), out.View()};
        STRATA_ASSERT_OK(backend->Supports(p));
        STRATA_ASSERT_OK(backend->Embedding(p, nullptr));
        std::vector<double> want(n * hidden);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t j = 0; j < hidden; ++j) want[i * hidden + j] = table.values[ids[i] * hidden + j];
        }
        ExpectClose(out.f32(), want, 0, 0, std::string("embedding ") + DTypeName(dt));
      }
    }
  }
}

TEST(CpuBackendTest, EmbeddingRejectsBadIds) {
  Rng rng(kSeed);
  auto backend = MakeCpuBackend();
  HostTensor table = Random(rng, DType::kF32, {5, 3});
  HostTensor out = Zeros({2, 3});
  std::vector<int32_t> ids = {1, 5};
  EmbeddingParams p{ids.data(), table.View(), out.View()};
  EXPECT_THAT(backend->Embedding(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  ids = {-1, 0};
  EXPECT_THAT(backend->Embedding(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p.ids = nullptr;
  EXPECT_THAT(backend->Supports(p), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CpuBackendTest, RmsNorm) {
  Rng rng(kSeed + 1);
  auto backend = MakeCpuBackend();
  for (DType dt : kWeightTypes) {
    for (int64_t hidden : kSizes) {
      for (int64_t n : kSizes) {
        HostTensor in = Random(rng, DType::kF32, {n, hidden}, -3, 3);
        HostTensor w = Random(rng, dt, {hidden}, 0.5, 1.5);
        HostTensor out = Zeros({n, hidden});
        RmsNormParams p{in.View(), w.View(), out.View(), 1e-5f};
        STRATA_ASSERT_OK(backend->Supports(p));
        STRATA_ASSERT_OK(backend->RmsNorm(p, nullptr));
        std::vector<double> want(n * hidden);
        for (int64_t t = 0; t < n; ++t) {
          double ss = 0;
          for (int64_t i = 0; i < hidden; ++i) ss += double(in.values[t * hidden + i]) * in.values[t * hidden + i];
          const double inv = 1.0 / std::sqrt(ss / hidden + 1e-5);
          for (int64_t i = 0; i < hidden; ++i) want[t * hidden + i] = in.values[t * hidden + i] * inv * w.values[i];
        }
        ExpectClose(out.f32(), want, 1e-6, 2e-5, std::string("rmsnorm ") + DTypeName(dt));
        // In place (out aliases in).
        p.out = in.View();
        STRATA_ASSERT_OK(backend->RmsNorm(p, nullptr));
        ExpectClose(in.f32(), want, 1e-6, 2e-5, "rmsnorm in place");
        // With a residual: the same bits as Add then RmsNorm, and in holds the sum.
        HostTensor a = Random(rng, DType::kF32, {n, hidden}, -3, 3);
        HostTensor r = Random(rng, DType::kF32, {n, hidden}, -1, 1);
        HostTensor a2 = a, sep = Zeros({n, hidden}), fused = Zeros({n, hidden});
        STRATA_ASSERT_OK(backend->Add({a2.View(), r.View(), a2.View()}, nullptr));
        STRATA_ASSERT_OK(backend->RmsNorm({a2.View(), w.View(), sep.View(), 1e-5f}, nullptr));
        RmsNormParams pr{a.View(), w.View(), fused.View(), 1e-5f, r.View()};
        STRATA_ASSERT_OK(backend->RmsNorm(pr, nullptr));
        ASSERT_EQ(a.bytes, a2.bytes);  // in holds the sum, bit for bit
        ASSERT_EQ(fused.bytes, sep.bytes);
        pr.residual = fused.View();  // aliasing out
        EXPECT_THAT(backend->Supports(pr), StatusIs(absl::StatusCode::kInvalidArgument));
      }
    }
  }
}

std::vector<double> NaiveMatMul(const HostTensor& in, const HostTensor& w, const HostTensor* bias,
                                std::vector<double>* abs_sum) {
  const int64_t n = in.dims[0], k = in.dims[1], m = w.dims[0];
  std::vector<double> out(n * m);
  abs_sum->assign(n * m, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < m; ++o) {
      double s = bias ? bias->values[o] : 0.0, a = bias ? std::fabs(bias->values[o]) : 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const double prod = double(in.values[t * k + i]) * w.values[o * k + i];
        s += prod;
        a += std::fabs(prod);
      }
      out[t * m + o] = s;
      (*abs_sum)[t * m + o] = a;
    }
  }
  return out;
}

TEST(CpuBackendTest, MatMulAllPathsDtypesAndSizes) {
  Rng rng(kSeed + 2);
  auto backend = MakeCpuBackend();  // sets the thread counts used by MatMulWithPath below
  using cpu_internal::MatMulPath;
  for (DType dt : kWeightTypes) {
    for (int64_t n : kSizes) {
      for (int64_t k : kSizes) {
        for (int64_t m : kSizes) {
          const bool with_bias = ((n + k + m) % 2) == 1;
          HostTensor in = Random(rng, DType::kF32, {n, k});
          HostTensor w = Random(rng, dt, {m, k});
          HostTensor bias = Random(rng, dt, {m});
          std::vector<double> abs_sum;
          std::vector<double> want = NaiveMatMul(in, w, with_bias ? &bias : nullptr, &abs_sum);
          for (MatMulPath path : {MatMulPath::kAuto, MatMulPath::kRowDot, MatMulPath::kBlockedBlas}) {
            HostTensor out = Zeros({n, m});
            MatMulParams p{in.View(), w.View(), with_bias ? bias.View() : TensorView(), out.View()};
            if (path == MatMulPath::kAuto) {
              STRATA_ASSERT_OK(backend->Supports(p));
              STRATA_ASSERT_OK(backend->MatMul(p, nullptr));
            } else {
              STRATA_ASSERT_OK(cpu_internal::MatMulWithPath(p, path));
            }
            // f32 accumulation error bound: a few ulps of the sum of |products|.
            const std::string what = std::string("matmul ") + DTypeName(dt) + " n=" +
                                     std::to_string(n) + " k=" + std::to_string(k) + " m=" +
                                     std::to_string(m) + " path=" +
                                     std::to_string(static_cast<int>(path));
            int bad = 0;
            for (size_t i = 0; i < want.size(); ++i) {
              const double d = std::fabs(double(out.f32()[i]) - want[i]);
              if (!(d <= 1e-6 + 4e-6 * abs_sum[i])) ++bad;
            }
            EXPECT_EQ(bad, 0) << what << " seed " << kSeed + 2;
          }
        }
      }
    }
  }
}

TEST(CpuBackendTest, MatMulIsBitwiseIndependentOfThreadCount) {
  // Large enough to run multi-threaded (above kParallelMinWork) on both paths.
  Rng rng(kSeed + 6);
  for (DType dt : kWeightTypes) {
    for (int64_t n : {1, 3, 129}) {
      HostTensor in = Random(rng, DType::kF32, {n, 300});
      HostTensor w = Random(rng, dt, {517, 300});
      HostTensor out1 = Zeros({n, 517}), out2 = Zeros({n, 517});
      auto one = MakeCpuBackend(1), two = MakeCpuBackend(2);
      STRATA_ASSERT_OK(one->MatMul({in.View(), w.View(), TensorView(), out1.View()}, nullptr));
      STRATA_ASSERT_OK(two->MatMul({in.View(), w.View(), TensorView(), out2.View()}, nullptr));
      EXPECT_EQ(std::memcmp(out1.f32(), out2.f32(), n * 517 * 4), 0)
          << DTypeName(dt) << " n=" << n << " seed " << kSeed + 6;
    }
  }
}

// `values` stored in `dtype` (rounded by ConvertFromF32); .values holds what was stored.
HostTensor FromValues(DType dtype, std::vector<int64_t> dims, const std::vector<float>& raw) {
  HostTensor t;
  t.dtype = dtype;
  t.dims = dims;
  const int64_t n = static_cast<int64_t>(raw.size());
  t.bytes.resize(n * DTypeSize(dtype) + 1);
  ConvertFromF32(raw.data(), t.bytes.data(), dtype, n);
  t.values.resize(n);
  ConvertToF32(t.bytes.data(), dtype, t.values.data(), n);
  return t;
}

// MatMulPrecision::kRoundActivations by hand. Weights {1, 2, 4} (exact in bf16 and f16), two
// tokens (the same row twice, so the BLAS path runs a GEMM), bias 2^-20 (f32, added unrounded).
// bf16 (8 significant bits): 1 + 2^-9 -> 1; 1 + 3 * 2^-8 is a tie -> 1 + 2^-6 (even);
// -(2 + 2^-7) is a tie -> -2 (even). f16 (11 bits): 1 + 2^-12 -> 1; 1 + 3 * 2^-11 -> 1 + 2^-9;
// -(2 + 2^-10) -> -2. Every partial sum below is exact in f32, so the results are exact.
TEST(CpuBackendTest, MatMulRoundActivationsByHand) {
  auto backend = MakeCpuBackend(1);
  using cpu_internal::MatMulPath;
  struct Case {
    DType dt;
    std::vector<float> x;
    float round_want, split_want;
  };
  const float b = std::ldexp(1.0f, -20);
  const std::vector<Case> cases = {
      {DType::kBF16,
       {1 + std::ldexp(1.0f, -9), 1 + 3 * std::ldexp(1.0f, -8), -(2 + std::ldexp(1.0f, -7))},
       1 * 1.0f + 2 * (1 + std::ldexp(1.0f, -6)) + 4 * -2.0f + b,  // -4.96875 + 2^-20
       -5.0f + std::ldexp(1.0f, -9) + 3 * std::ldexp(1.0f, -7) - std::ldexp(1.0f, -5) + b},
      {DType::kF16,
       {1 + std::ldexp(1.0f, -12), 1 + 3 * std::ldexp(1.0f, -11), -(2 + std::ldexp(1.0f, -10))},
       1 * 1.0f + 2 * (1 + std::ldexp(1.0f, -9)) + 4 * -2.0f + b,  // -4.99609375 + 2^-20
       -5.0f + std::ldexp(1.0f, -12) + 3 * std::ldexp(1.0f, -10) - std::ldexp(1.0f, -8) + b},
  };
  EXPECT_EQ(cases[0].round_want, -4.96875f + b);
  EXPECT_EQ(cases[1].round_want, -4.99609375f + b);
  for (const Case& c : cases) {
    std::vector<float> x2 = c.x;
    x2.insert(x2.end(), c.x.begin(), c.x.end());
    HostTensor in = FromValues(DType::kF32, {2, 3}, x2);
    HostTensor w = FromValues(c.dt, {1, 3}, {1, 2, 4});
    HostTensor bias = FromValues(DType::kF32, {1}, {b});
    for (MatMulPath path : {MatMulPath::kAuto, MatMulPath::kRowDot, MatMulPath::kBlockedBlas}) {
      for (MatMulPrecision prec : {MatMulPrecision::kSplit, MatMulPrecision::kRoundActivations}) {
        HostTensor out = Zeros({2, 1});
        MatMulParams p{in.View(), w.View(), bias.View(), out.View(), prec};
        if (path == MatMulPath::kAuto) {
          STRATA_ASSERT_OK(backend->MatMul(p, nullptr));
        } else {
          STRATA_ASSERT_OK(cpu_internal::MatMulWithPath(p, path));
        }
        const float want =
            prec == MatMulPrecision::kRoundActivations ? c.round_want : c.split_want;
        for (int t = 0; t < 2; ++t) {
          EXPECT_EQ(out.f32()[t], want) << DTypeName(c.dt) << " path "
                                        << static_cast<int>(path) << " precision "
                                        << static_cast<int>(prec) << " token " << t;
        }
      }
      // The input is not modified by the rounding.
      EXPECT_EQ(std::memcmp(in.f32(), x2.data(), x2.size() * 4), 0);
    }
  }
}

// Row-wise fp8 quantisation: each row's largest finite |x| becomes +-448 (codes 0x7e / 0xfe) with
// scale amax / 448; every code is F32ToFP8E4M3(x / scale); an all-zero row has scale 1; inf
// saturates, NaN stays NaN and neither sets the scale; rows are independent (quantising a stack
// of parts equals stacking quantised parts), and dequantised values are within e4m3's half ulp.
TEST(CpuBackendTest, QuantizeRowsToFP8E4M3) {
  Rng rng(kSeed + 50);
  const int64_t rows = 37, cols = 300;
  for (DType dt : kWeightTypes) {
    HostTensor w = Random(rng, dt, {rows, cols});
    for (int64_t c = 0; c < cols; ++c) w.values[5 * cols + c] = 0.0f;  // an all-zero row
    w.values[7 * cols + 3] = std::numeric_limits<float>::infinity();
    w.values[7 * cols + 4] = std::numeric_limits<float>::quiet_NaN();
    w.values[9 * cols + 11] = -3.0f;  // the row's largest |x|: code 0xfe
    ConvertFromF32(w.values.data(), w.bytes.data(), dt, rows * cols);
    ConvertToF32(w.bytes.data(), dt, w.values.data(), rows * cols);
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> scale(rows);
    QuantizeRowsToFP8E4M3(w.bytes.data(), dt, rows, cols, q.data(), scale.data());
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = w.values[r * cols + c];
        if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
      }
      ASSERT_EQ(scale[r], r == 5 ? 1.0f : amax / 448.0f) << DTypeName(dt) << " row " << r;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = w.values[r * cols + c];
        const uint8_t code = q[r * cols + c];
        ASSERT_EQ(code, F32ToFP8E4M3(x / scale[r])) << DTypeName(dt) << " " << r << "," << c;
        const float back = FP8E4M3ToF32(code) * scale[r];
        if (std::isfinite(x) && std::fabs(x) >= amax / 64) {  // normal e4m3 range
          EXPECT_LE(std::fabs(back - x), std::fabs(x) / 16 + 1e-7f) << r << "," << c;
        }
      }
    }
    EXPECT_EQ(q[9 * cols + 11], 0xfe);
    EXPECT_EQ(q[7 * cols + 3], 0x7e);  // +inf saturates to +448
    EXPECT_EQ(q[7 * cols + 4] & 0x7f, 0x7f);
    std::vector<uint8_t> q2(rows * cols);
    std::vector<float> scale2(rows);
    const int64_t split = 20;
    QuantizeRowsToFP8E4M3(w.bytes.data(), dt, split, cols, q2.data(), scale2.data());
    QuantizeRowsToFP8E4M3(w.bytes.data() + split * cols * DTypeSize(dt), dt, rows - split, cols,
                          q2.data() + split * cols, scale2.data() + split);
    EXPECT_EQ(q, q2);
    EXPECT_EQ(scale, scale2);
  }
}

// fp8 weights: out = scale[o] * sum f16(x) * w + bias on every path, against a naive f64 sum of
// the same exact products; the scale is required with fp8 and refused with other weights.
TEST(CpuBackendTest, MatMulFp8Weights) {
  Rng rng(kSeed + 51);
  auto backend = MakeCpuBackend();
  using cpu_internal::MatMulPath;
  for (int64_t n : {1, 3, 17, 129}) {
    for (int64_t k : {1, 16, 129}) {
      for (int64_t m : {1, 3, 129}) {
        const bool with_bias = ((n + k + m) % 2) == 1;
        HostTensor in = Random(rng, DType::kF32, {n, k}, -3, 3);
        in.values[0] = 1 + std::ldexp(1.0f, -12);  // rounds to 1 in f16
        std::memcpy(in.bytes.data(), in.values.data(), 4);
        HostTensor wf = Random(rng, DType::kF32, {m, k});
        HostTensor w;
        w.dtype = DType::kFP8E4M3;
        w.dims = {m, k};
        w.bytes.resize(m * k);
        HostTensor sc = Zeros({m});
        QuantizeRowsToFP8E4M3(wf.bytes.data(), DType::kF32, m, k, w.bytes.data(), sc.f32());
        w.values.resize(m * k);
        ConvertToF32(w.bytes.data(), DType::kFP8E4M3, w.values.data(), m * k);
        HostTensor bias = Random(rng, DType::kBF16, {m});
        HostTensor x16 = in;
        for (float& v : x16.values) v = F16ToF32(F32ToF16(v));
        std::vector<double> abs_sum;
        std::vector<double> dot = NaiveMatMul(x16, w, nullptr, &abs_sum);
        for (MatMulPath path : {MatMulPath::kAuto, MatMulPath::kRowDot, MatMulPath::kBlockedBlas}) {
          HostTensor out = Zeros({n, m});
          MatMulParams p{in.View(), w.View(), with_bias ? bias.View() : TensorView(), out.View()};
          p.weight_scale = sc.View();
          if (path == MatMulPath::kAuto) {
            STRATA_ASSERT_OK(backend->Supports(p));
            STRATA_ASSERT_OK(backend->MatMul(p, nullptr));
          } else {
            STRATA_ASSERT_OK(cpu_internal::MatMulWithPath(p, path));
          }
          int bad = 0;
          for (int64_t t = 0; t < n; ++t) {
            for (int64_t o = 0; o < m; ++o) {
              const double want = dot[t * m + o] * sc.f32()[o] + (with_bias ? bias.values[o] : 0);
              const double d = std::fabs(double(out.f32()[t * m + o]) - want);
              if (!(d <= 1e-6 + 4e-6 * abs_sum[t * m + o] * sc.f32()[o])) ++bad;
            }
          }
          EXPECT_EQ(bad, 0) << "fp8 n=" << n << " k=" << k << " m=" << m << " path "
                            << static_cast<int>(path);
        }
      }
    }
  }
  HostTensor in = Random(rng, DType::kF32, {2, 4});
  HostTensor w8 = Zeros({3, 4});
  w8.dtype = DType::kFP8E4M3;
  w8.dims = {3, 4};
  HostTensor wb = Random(rng, DType::kBF16, {3, 4});
  HostTensor sc = Zeros({3}), sc2 = Zeros({2}), out = Zeros({2, 3});
  MatMulParams p{in.View(), w8.View(), TensorView(), out.View()};
  EXPECT_THAT(backend->MatMul(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p.weight_scale = sc2.View();
  EXPECT_THAT(backend->MatMul(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  p.weight_scale = sc.View();
  STRATA_EXPECT_OK(backend->MatMul(p, nullptr));
  MatMulParams pb{in.View(), wb.View(), TensorView(), out.View()};
  pb.weight_scale = sc.View();
  EXPECT_THAT(backend->MatMul(pb, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

// f16 rounding overflows beyond 65504 (to inf); f32 weights ignore the precision (bit for bit).
TEST(CpuBackendTest, MatMulRoundActivationsOverflowAndF32Weights) {
  auto backend = MakeCpuBackend(1);
  HostTensor in = FromValues(DType::kF32, {1, 2}, {70000.0f, 1.0f});
  HostTensor w16 = FromValues(DType::kF16, {1, 2}, {1.0f, 1.0f});
  HostTensor out = Zeros({1, 1});
  STRATA_ASSERT_OK(backend->MatMul(
      {in.View(), w16.View(), TensorView(), out.View(), MatMulPrecision::kRoundActivations},
      nullptr));
  EXPECT_TRUE(std::isinf(out.f32()[0]) && out.f32()[0] > 0) << out.f32()[0];
  STRATA_ASSERT_OK(backend->MatMul({in.View(), w16.View(), TensorView(), out.View()}, nullptr));
  EXPECT_EQ(out.f32()[0], 70001.0f);

  Rng rng(kSeed + 40);
  for (int64_t n : {1, 3, 129}) {
    HostTensor x = Random(rng, DType::kF32, {n, 300});
    HostTensor w = Random(rng, DType::kF32, {517, 300});
    HostTensor a = Zeros({n, 517}), r = Zeros({n, 517});
    STRATA_ASSERT_OK(backend->MatMul({x.View(), w.View(), TensorView(), a.View()}, nullptr));
    STRATA_ASSERT_OK(backend->MatMul(
        {x.View(), w.View(), TensorView(), r.View(), MatMulPrecision::kRoundActivations},
        nullptr));
    EXPECT_EQ(std::memcmp(a.f32(), r.f32(), n * 517 * 4), 0) << "n=" << n;
  }
}

// kRoundActivations on random data, every path, dtype and awkward size: bit for bit the split
// (f32-activation) product of the pre-rounded activations, and different from the product of the
// raw activations somewhere once k >= 17.
TEST(CpuBackendTest, MatMulRoundActivationsIsTheProductOfRoundedInputs) {
  Rng rng(kSeed + 41);
  auto backend = MakeCpuBackend();
  using cpu_internal::MatMulPath;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int64_t n : kSizes) {
      for (int64_t k : kSizes) {
        for (int64_t m : {1, 3, 129}) {
          HostTensor in = Random(rng, DType::kF32, {n, k}, -2, 2);
          HostTensor w = Random(rng, dt, {m, k});
          HostTensor bias = Random(rng, dt, {m});
          HostTensor rounded = in;
          cpu_internal::RoundActivations(in.f32(), dt, n * k, rounded.f32());
          std::vector<float> hand(n * k);
          for (int64_t i = 0; i < n * k; ++i) {
            hand[i] = dt == DType::kBF16 ? BF16ToF32(F32ToBF16(in.f32()[i]))
                                         : F16ToF32(F32ToF16(in.f32()[i]));
          }
          ASSERT_EQ(std::memcmp(rounded.f32(), hand.data(), n * k * 4), 0);
          for (MatMulPath path :
               {MatMulPath::kAuto, MatMulPath::kRowDot, MatMulPath::kBlockedBlas}) {
            HostTensor got = Zeros({n, m}), want = Zeros({n, m}), raw = Zeros({n, m});
            STRATA_ASSERT_OK(cpu_internal::MatMulWithPath(
                {in.View(), w.View(), bias.View(), got.View(),
                 MatMulPrecision::kRoundActivations},
                path));
            STRATA_ASSERT_OK(cpu_internal::MatMulWithPath(
                {rounded.View(), w.View(), bias.View(), want.View()}, path));
            STRATA_ASSERT_OK(cpu_internal::MatMulWithPath(
                {in.View(), w.View(), bias.View(), raw.View()}, path));
            const std::string what = std::string(DTypeName(dt)) + " n=" + std::to_string(n) +
                                     " k=" + std::to_string(k) + " m=" + std::to_string(m) +
                                     " path=" + std::to_string(static_cast<int>(path));
            EXPECT_EQ(std::memcmp(got.f32(), want.f32(), n * m * 4), 0) << what;
            if (k >= 17) {
              EXPECT_NE(std::memcmp(got.f32(), raw.f32(), n * m * 4), 0) << what;
            }
          }
        }
      }
    }
  }
}

TEST(CpuBackendTest, MatMulRejectsUnknownPrecision) {
  auto backend = MakeCpuBackend(1);
  HostTensor in = FromValues(DType::kF32, {1, 2}, {1.0f, 1.0f});
  HostTensor w = FromValues(DType::kBF16, {1, 2}, {1.0f, 1.0f});
  HostTensor out = Zeros({1, 1});
  MatMulParams p{in.View(), w.View(), TensorView(), out.View(), static_cast<MatMulPrecision>(7)};
  EXPECT_THAT(backend->Supports(p), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(backend->MatMul(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CpuBackendTest, Rope) {
  Rng rng(kSeed + 3);
  auto backend = MakeCpuBackend();
  for (int64_t d : {2, 6, 34, 128}) {
    for (int64_t n : kSizes) {
      for (float factor : {1.0f, 1.25f}) {
        const int64_t heads = 3, half = d / 2;
        HostTensor x = Random(rng, DType::kF32, {n, heads, d});
        std::vector<float> inv(half);
        for (int64_t i = 0; i < half; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / d);
        std::vector<int32_t> pos(n);
        for (auto& p : pos) p = static_cast<int32_t>(rng.Next() % 5000);
        RopeParams p{x.View(), pos.data(), TensorView(inv.data(), DType::kF32, {half}), factor};
        STRATA_ASSERT_OK(backend->Supports(p));
        STRATA_ASSERT_OK(backend->Rope(p, nullptr));
        std::vector<double> want(n * heads * d);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t h = 0; h < heads; ++h) {
            for (int64_t i = 0; i < half; ++i) {
              const float a = static_cast<float>(pos[t]) * inv[i];  // the angle as transformers has it
              const double c = std::cos(double(a)) * factor, s = std::sin(double(a)) * factor;
              const double x1 = x.values[(t * heads + h) * d + i];
              const double x2 = x.values[(t * heads + h) * d + i + half];
              want[(t * heads + h) * d + i] = x1 * c - x2 * s;
              want[(t * heads + h) * d + i + half] = x2 * c + x1 * s;
            }
          }
        }
        ExpectClose(x.f32(), want, 1e-5, 1e-5, "rope d=" + std::to_string(d));
      }
    }
  }
}

TEST(CpuBackendTest, SwiGluAndAdd) {
  Rng rng(kSeed + 4);
  auto backend = MakeCpuBackend();
  for (int64_t n : kSizes) {
    for (int64_t m : kSizes) {
      HostTensor g = Random(rng, DType::kF32, {n, m}, -8, 8);
      HostTensor u = Random(rng, DType::kF32, {n, m}, -2, 2);
      HostTensor out = Zeros({n, m});
      std::vector<double> want(n * m), sum(n * m);
      for (int64_t i = 0; i < n * m; ++i) {
        const double x = g.values[i];
        want[i] = x / (1.0 + std::exp(-x)) * u.values[i];
        sum[i] = double(g.values[i]) + u.values[i];
      }
      SwiGluParams sp{g.View(), u.View(), out.View()};
      STRATA_ASSERT_OK(backend->Supports(sp));
      STRATA_ASSERT_OK(backend->SwiGlu(sp, nullptr));
      ExpectClose(out.f32(), want, 1e-6, 1e-5, "swiglu");
      AddParams ap{g.View(), u.View(), out.View()};
      STRATA_ASSERT_OK(backend->Supports(ap));
      STRATA_ASSERT_OK(backend->Add(ap, nullptr));
      ExpectClose(out.f32(), sum, 0, 1e-7, "add");
      // Scaled: out = 0.75 a - 1.5 b.
      std::vector<double> scaled(n * m);
      for (int64_t i = 0; i < n * m; ++i) scaled[i] = 0.75 * g.values[i] - 1.5 * double(u.values[i]);
      ap.a_scale = 0.75f;
      ap.b_scale = -1.5f;
      STRATA_ASSERT_OK(backend->Add(ap, nullptr));
      ExpectClose(out.f32(), scaled, 1e-6, 1e-6, "scaled add");
      ap.b_scale = NAN;
      EXPECT_EQ(backend->Supports(ap).code(), absl::StatusCode::kInvalidArgument);
      // In place: out aliases gate / a.
      sp.out = g.View();
      STRATA_ASSERT_OK(backend->SwiGlu(sp, nullptr));
      ExpectClose(g.f32(), want, 1e-6, 1e-5, "swiglu in place");
    }
  }
}

// The e4m3 conversions (bit arithmetic) against a definition written out: decode by ldexp, encode
// by searching the nearest of the 127 non-negative finite codes (ties to the even code), saturated
// at 448, NaN -> 0x7f.
TEST(CpuBackendTest, Fp8ConversionsMatchTheNearestCodeDefinition) {
  auto decode = [](int code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) return NAN;
    const float a = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    return code & 0x80 ? -a : a;
  };
  auto encode = [&](float v) -> uint8_t {
    if (std::isnan(v)) return 0x7f;
    const uint8_t sign = std::signbit(v) ? 0x80 : 0;
    const float a = std::fabs(v);
    if (a >= 448.0f) return sign | 0x7e;
    int best = 0;
    for (int c = 1; c <= 0x7e; ++c) {
      const double dc = std::fabs(double(decode(c)) - a), db = std::fabs(double(decode(best)) - a);
      if (dc < db || (dc == db && c % 2 == 0)) best = c;
    }
    return sign | static_cast<uint8_t>(best);
  };
  for (int c = 0; c < 256; ++c) {
    const float want = decode(c), got = FP8E4M3ToF32(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << c << ": " << want << " vs " << got;
    }
  }
  std::vector<float> inputs = {0.0f, -0.0f, NAN, INFINITY, -INFINITY, 448.0f, 447.9f, 464.0f, 1e30f,
                               1e-45f, 1e-30f, 0.015625f, 0.0146484375f};
  for (int c = 0; c < 0x7e; ++c) {  // every code, the midpoints and their neighbours
    const float lo = decode(c), hi = decode(c + 1), mid = 0.5f * (lo + hi);
    for (float x : {lo, hi, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      inputs.push_back(x);
      inputs.push_back(-x);
    }
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-14, 10);
  for (int i = 0; i < 20000; ++i) inputs.push_back((i % 2 ? -1.0f : 1.0f) * std::ldexp(mant(rng), ex(rng)));
  for (float x : inputs) {
    EXPECT_EQ(F32ToFP8E4M3(x), encode(x)) << x;
  }
  // The array conversions (a table for decoding, the branch-free encoder inline) give the same.
  std::vector<uint8_t> codes(256), coded(inputs.size());
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  std::vector<float> decoded(256);
  ConvertToF32(codes.data(), DType::kFP8E4M3, decoded.data(), 256);
  for (int c = 0; c < 256; ++c) {
    const float want = FP8E4M3ToF32(static_cast<uint8_t>(c));
    EXPECT_EQ(std::memcmp(&want, &decoded[c], 4), 0) << c;
  }
  ConvertFromF32(inputs.data(), coded.data(), DType::kFP8E4M3, static_cast<int64_t>(inputs.size()));
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_EQ(coded[i], encode(inputs[i])) << inputs[i];
}

TEST(CpuBackendTest, SupportsRejectsBadShapesAndDtypes) {
  Rng rng(kSeed + 5);
  auto backend = MakeCpuBackend();
  HostTensor in = Random(rng, DType::kF32, {3, 17});
  HostTensor in_bf16 = Random(rng, DType::kBF16, {3, 17});
  HostTensor w = Random(rng, DType::kBF16, {5, 17});
  HostTensor w_fp8 = Random(rng, DType::kFP8E4M3, {5, 17});
  HostTensor w_bad = Random(rng, DType::kF32, {5, 16});
  HostTensor out = Zeros({3, 5});
  HostTensor out_bad = Zeros({3, 4});
  HostTensor bias_bad = Random(rng, DType::kF32, {4});
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  MatMulParams mm{in.View(), w.View(), TensorView(), out.View()};
  STRATA_EXPECT_OK(backend->Supports(mm));
  mm.weight = w_bad.View();
  EXPECT_THAT(backend->Supports(mm), StatusIs(kInvalid));
  EXPECT_THAT(backend->MatMul(mm, nullptr), StatusIs(kInvalid));
  mm.weight = w_fp8.View();  // fp8 weights without their row scales
  EXPECT_THAT(backend->Supports(mm), StatusIs(kInvalid));
  mm.weight = w.View();
  mm.out = out_bad.View();
  EXPECT_THAT(backend->Supports(mm), StatusIs(kInvalid));
  mm.out = out.View();
  mm.in = in_bf16.View();
  EXPECT_THAT(backend->Supports(mm), StatusIs(kInvalid));
  mm.in = in.View();
  mm.bias = bias_bad.View();
  EXPECT_THAT(backend->Supports(mm), StatusIs(kInvalid));
  mm.bias = TensorView();
  mm.in = TensorView(in.bytes.data(), DType::kF32, {51});
  EXPECT_THAT(backend->Supports(mm), StatusIs(kInvalid));

  HostTensor norm_w = Random(rng, DType::kF32, {16});
  HostTensor norm_out = Zeros({3, 17});
  RmsNormParams rn{in.View(), norm_w.View(), norm_out.View()};
  EXPECT_THAT(backend->Supports(rn), StatusIs(kInvalid));
  EXPECT_THAT(backend->RmsNorm(rn, nullptr), StatusIs(kInvalid));
  rn.weight = Random(rng, DType::kF32, {17}).View();  // dangling after the statement: not run
  rn.weight.data = nullptr;
  EXPECT_THAT(backend->Supports(rn), StatusIs(kInvalid));

  HostTensor x = Random(rng, DType::kF32, {2, 3, 5});  // odd head_dim
  std::vector<float> inv(2, 1.0f);
  std::vector<int32_t> pos = {0, 1};
  RopeParams rp{x.View(), pos.data(), TensorView(inv.data(), DType::kF32, {2})};
  EXPECT_THAT(backend->Supports(rp), StatusIs(kInvalid));
  HostTensor x2 = Random(rng, DType::kF32, {2, 3, 6});
  rp.x = x2.View();
  EXPECT_THAT(backend->Supports(rp), StatusIs(kInvalid));  // inv_freq has 2, needs 3
  rp.inv_freq = TensorView(inv.data(), DType::kF32, {3});
  rp.positions = nullptr;
  EXPECT_THAT(backend->Supports(rp), StatusIs(kInvalid));

  HostTensor a = Random(rng, DType::kF32, {3, 17});
  HostTensor b = Random(rng, DType::kF32, {17, 3});
  AddParams ap{a.View(), b.View(), a.View()};
  EXPECT_THAT(backend->Supports(ap), StatusIs(kInvalid));
  SwiGluParams sp{a.View(), b.View(), a.View()};
  EXPECT_THAT(backend->Supports(sp), StatusIs(kInvalid));
  sp.up = in_bf16.View();
  EXPECT_THAT(backend->Supports(sp), StatusIs(kInvalid));

  HostTensor table = Random(rng, DType::kF32, {7, 16});
  std::vector<int32_t> ids = {0, 1, 2};
  EmbeddingParams ep{ids.data(), table.View(), norm_out.View()};
  EXPECT_THAT(backend->Supports(ep), StatusIs(kInvalid));
  HostTensor table_i32 = Random(rng, DType::kF32, {7, 17});
  table_i32.dtype = DType::kI32;
  ep.table = table_i32.View();
  EXPECT_THAT(backend->Supports(ep), StatusIs(absl::StatusCode::kUnimplemented));
}

}  // namespace
}  // namespace strata::kernels
