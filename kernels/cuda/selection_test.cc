// The device-resident selection ops of the CUDA backend (ScoreSummaries, ScoreKeys, VoteTopK,
// SelectedAttention) against their CPU twins (kernels/cpu/selection.cc) on random inputs with
// awkward sizes, invalid candidates, bad page-table entries and poisoned (NaN / 0x7f) outputs,
// and a whole tokenselect pipeline captured in a CUDA graph. Top-k results are compared as sets,
// allowing a swap only between candidates whose votes tie within float rounding. Without a GPU
// every test reports "no CUDA GPU: skipped".
#include <cuda_runtime_api.h>
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/status_macros.h"  // STRATA_STATUS_CONCAT_, used by the matchers
#include "base/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/internal/launch.h"
#include "kernels/cuda_backend.h"
#include "kernels/vote_rank.h"

namespace strata::kernels {
namespace {

using ::strata::testing::StatusIs;

const float kNegInf = -std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

class SelectionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto b = MakeCudaBackend(0);
    if (b.ok()) {
      gpu_ = std::move(b).value().release();
    } else {
      why_ = b.status().ToString();
    }
    cpu_ = MakeCpuBackend(1).release();
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
    seed_ = 20261122u ^ static_cast<uint32_t>(std::hash<std::string>()(info->name()));
    rng_.seed(seed_);
  }

  // A device copy of `v` (at least 4 bytes).
  template <typename T>
  std::unique_ptr<Buffer> Dev(const std::vector<T>& v) {
    auto b = gpu_->Allocate(std::max<size_t>(v.size() * sizeof(T), 4));
    EXPECT_TRUE(b.ok());
    if (!v.empty()) {
      EXPECT_TRUE(gpu_->CopyToDevice(b.value()->data(), v.data(), v.size() * sizeof(T), nullptr).ok());
    }
    return std::move(b).value();
  }
  // A device buffer of n elements of T filled with the byte `poison`.
  template <typename T>
  std::unique_ptr<Buffer> Poisoned(int64_t n, uint8_t poison = 0xff) {
    std::vector<uint8_t> bytes(std::max<int64_t>(n * sizeof(T), 4), poison);
    return Dev(bytes);
  }
  template <typename T>
  std::vector<T> Get(Buffer& b, int64_t n) {
    std::vector<T> v(n);
    if (n > 0) {
      EXPECT_TRUE(gpu_->CopyToHost(v.data(), b.data(), n * sizeof(T), nullptr).ok());
    }
    return v;
  }

  std::vector<float> RandomF(int64_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  // Pool values rounded to `dtype`, as raw bytes.
  std::vector<uint8_t> PoolBytes(const std::vector<float>& v, DType dtype) {
    std::vector<uint8_t> b(v.size() * DTypeSize(dtype));
    ConvertFromF32(v.data(), b.data(), dtype, static_cast<int64_t>(v.size()));
    return b;
  }

  void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double atol,
                   double rtol, const std::string& what) {
    ASSERT_EQ(got.size(), want.size());
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (std::isinf(want[i]) && got[i] == want[i]) continue;
      const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
      if (!(d <= atol + rtol * std::fabs(want[i]))) {
        if (++bad <= 3) {
          ADD_FAILURE() << what << " (seed " << seed_ << "): element " << i << " got " << got[i]
                        << " want " << want[i];
        }
      }
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " out of tolerance";
  }

  // Bodies of the VoteTopK tests run once per kernel choice (below).
  // Sizes default to 1 .. 70000 (every kernel's range and boundaries).
  void ExactTiesAtEverySize(std::vector<int64_t> sizes = {1, 3, 17, 129, 255, 256, 257, 1000,
                                                           2047, 8191, 8192, 20000, 70000});
  void MatchesCpuThroughParents();

  static Backend* gpu_;
  static Backend* cpu_;
  static std::string why_;
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

Backend* SelectionTest::gpu_ = nullptr;
Backend* SelectionTest::cpu_ = nullptr;
std::string SelectionTest::why_;

// Random parents in [-1, max_parent) (some -1), ascending per head like a top-k output.
std::vector<int32_t> RandomParents(std::mt19937& rng, int hkv, int n, int max_parent) {
  std::vector<int32_t> p(static_cast<size_t>(hkv) * n);
  std::uniform_int_distribution<int> d(-1, max_parent - 1);
  for (int32_t& x : p) x = d(rng);
  return p;
}

struct ScoreCase {
  int hkv, group, d, items;
  bool use_parents;
  int fanout;
};

TEST_F(SelectionTest, ScoreSummariesMatchesCpu) {
  const ScoreCase cases[] = {{1, 1, 17, 1, false, 1},     {3, 4, 64, 129, false, 1},
                             {8, 4, 128, 1000, true, 16}, {2, 5, 33, 300, true, 3},
                             {1, 16, 128, 77, true, 1},   {8, 4, 128, 4099, false, 1}};
  for (const ScoreCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "hkv " << c.hkv << " group " << c.group << " d " << c.d
                                      << " items " << c.items << " fanout " << c.fanout);
    const int hq = c.hkv * c.group;
    std::vector<float> q = RandomF(static_cast<int64_t>(hq) * c.d);
    std::vector<float> sums = RandomF(static_cast<int64_t>(c.hkv) * c.items * 2 * c.d);
    // min <= max per channel, as real summaries.
    for (int64_t r = 0; r < static_cast<int64_t>(c.hkv) * c.items; ++r) {
      float* s = &sums[r * 2 * c.d];
      for (int e = 0; e < c.d; ++e) {
        if (s[e] > s[c.d + e]) std::swap(s[e], s[c.d + e]);
      }
    }
    CandidateList cl;
    std::vector<int32_t> parents;
    if (c.use_parents) {
      const int np = std::max(1, c.items / c.fanout / 2 + 1);
      parents = RandomParents(rng_, c.hkv, np, (c.items + c.fanout - 1) / c.fanout + 1);
      cl.fanout = c.fanout;
      cl.begin = 1;
      cl.end = c.items + c.fanout;  // ids >= items are invalid through num_items
    } else {
      cl.begin = c.items / 3;
      cl.end = c.items;
    }
    const int64_t n = c.use_parents ? static_cast<int64_t>(parents.size() / c.hkv) * c.fanout
                                    : cl.end - cl.begin;
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    std::vector<float> want(static_cast<size_t>(hq) * n, kNaN);
    ScoreSummariesParams p;
    p.q = TensorView(q.data(), DType::kF32, {hq, c.d});
    p.summaries = TensorView(sums.data(), DType::kF32, {c.hkv, c.items, 2 * c.d});
    p.candidates = cl;
    if (c.use_parents) p.candidates.parents = TensorView(parents.data(), DType::kI32, {c.hkv, n / c.fanout});
    p.scale = scale;
    p.scores = TensorView(want.data(), DType::kF32, {c.hkv, c.group, n});
    STRATA_ASSERT_OK(cpu_->ScoreSummaries(p, nullptr));

    auto dq = Dev(q), ds = Dev(sums), dp = Dev(parents);
    auto out = Poisoned<float>(static_cast<int64_t>(hq) * n);
    p.q.data = dq->data();
    p.summaries.data = ds->data();
    if (c.use_parents) p.candidates.parents.data = dp->data();
    p.scores.data = out->data();
    STRATA_ASSERT_OK(gpu_->ScoreSummaries(p, nullptr));
    ExpectClose(Get<float>(*out, static_cast<int64_t>(hq) * n), want, 1e-5, 1e-5, "scores");

    // bf16 summaries rounded outward (MinMaxRowsToBF16): the CPU twin over the same bf16 rows,
    // and every bound at least the f32 summaries' bound.
    std::vector<uint16_t> sums16(sums.size());
    MinMaxRowsToBF16(sums.data(), static_cast<int64_t>(c.hkv) * c.items, c.d, sums16.data());
    std::vector<float> want16(want.size(), kNaN);
    p.q.data = q.data();
    p.summaries = TensorView(sums16.data(), DType::kBF16, {c.hkv, c.items, 2 * c.d});
    if (c.use_parents) p.candidates.parents.data = parents.data();
    p.scores.data = want16.data();
    STRATA_ASSERT_OK(cpu_->ScoreSummaries(p, nullptr));
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i] != kNegInf) {
        ASSERT_GE(want16[i], want[i] - 1e-5f * (1 + std::fabs(want[i]))) << i;
      }
    }
    auto ds16 = Dev(sums16);
    p.q.data = dq->data();
    p.summaries.data = ds16->data();
    if (c.use_parents) p.candidates.parents.data = dp->data();
    auto out16 = Poisoned<float>(static_cast<int64_t>(hq) * n);
    p.scores.data = out16->data();
    STRATA_ASSERT_OK(gpu_->ScoreSummaries(p, nullptr));
    ExpectClose(Get<float>(*out16, static_cast<int64_t>(hq) * n), want16, 1e-5, 1e-5,
                "bf16 summaries");
  }
}

TEST_F(SelectionTest, ScoreKeysMatchesCpu) {
  struct Case {
    DType dtype;
    int hkv, group, d, page, table_pages, slots;
    bool parents;
  } cases[] = {{DType::kBF16, 8, 4, 128, 64, 40, 300, true},
               {DType::kF32, 3, 5, 17, 7, 13, 30, false},
               {DType::kBF16, 1, 1, 64, 16, 9, 12, true},
               {DType::kF32, 2, 16, 128, 64, 5, 11, true},
               // PagedKeyScoreKernel's shapes (bf16, d 128, group <= 4, power-of-two page and
               // fanout), also run through FastScoreKernel below.
               {DType::kBF16, 2, 3, 128, 16, 9, 20, false},
               {DType::kBF16, 3, 2, 128, 32, 6, 10, true},
               {DType::kBF16, 2, 1, 128, 8, 11, 40, true},
               {DType::kBF16, 2, 4, 128, 48, 7, 12, true},  // page 48: FastScoreKernel
               // fp8 pools (stored values scored; the generic kernel).
               {DType::kFP8E4M3, 2, 4, 128, 16, 9, 20, true},
               {DType::kFP8E4M3, 3, 3, 17, 7, 13, 30, false}};
  // The default kernels (PagedKeyScoreKernel with 8 rounds), PagedKeyScoreKernel with 2 and 4
  // rounds, then FastScoreKernel where PagedKeyScoreKernel would run.
  for (const char* keys : {"", "2", "4", "generic"}) {
    unsetenv("STRATA_SELECTION_KEYS");
    unsetenv("STRATA_SELECTION_KEY_ROUNDS");
    if (std::string_view(keys) == "generic") {
      setenv("STRATA_SELECTION_KEYS", keys, 1);
    } else if (*keys != 0) {
      setenv("STRATA_SELECTION_KEY_ROUNDS", keys, 1);
    }
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << DTypeName(c.dtype) << " d " << c.d << " page " << c.page
                                        << " group " << c.group << " keys " << keys);
      const int hq = c.hkv * c.group;
      std::vector<float> q = RandomF(static_cast<int64_t>(hq) * c.d);
      std::vector<uint8_t> pool =
          PoolBytes(RandomF(static_cast<int64_t>(c.slots) * c.page * c.d), c.dtype);
      // Page table: mostly valid slots, some -1 and some beyond the pool.
      std::vector<int32_t> table(static_cast<size_t>(c.hkv) * c.table_pages);
      std::uniform_int_distribution<int> slot(-1, c.slots + 2);
      for (int32_t& t : table) t = slot(rng_);
      const int64_t tokens = static_cast<int64_t>(c.table_pages + 2) * c.page;
      CandidateList cl;
      std::vector<int32_t> parents;
      int64_t n;
      if (c.parents) {
        parents = RandomParents(rng_, c.hkv, 7, c.table_pages + 2);
        cl.fanout = c.page;
        cl.begin = 3;
        cl.end = tokens - 5;
        n = 7 * c.page;
      } else {
        cl.begin = 1;
        cl.end = tokens;
        n = tokens - 1;
      }
      const float scale = 0.125f;
      std::vector<float> want(static_cast<size_t>(hq) * n, kNaN);
      ScoreKeysParams p;
      p.q = TensorView(q.data(), DType::kF32, {hq, c.d});
      p.k_pool = TensorView(pool.data(), c.dtype, {c.slots, c.page, c.d});
      p.page_table = TensorView(table.data(), DType::kI32, {c.hkv, c.table_pages});
      p.candidates = cl;
      if (c.parents) p.candidates.parents = TensorView(parents.data(), DType::kI32, {c.hkv, 7});
      p.scale = scale;
      p.scores = TensorView(want.data(), DType::kF32, {c.hkv, c.group, n});
      STRATA_ASSERT_OK(cpu_->ScoreKeys(p, nullptr));
      auto dq = Dev(q), dpool = Dev(pool), dt = Dev(table), dp = Dev(parents);
      auto out = Poisoned<float>(static_cast<int64_t>(hq) * n);
      p.q.data = dq->data();
      p.k_pool.data = dpool->data();
      p.page_table.data = dt->data();
      if (c.parents) p.candidates.parents.data = dp->data();
      p.scores.data = out->data();
      STRATA_ASSERT_OK(gpu_->ScoreKeys(p, nullptr));
      ExpectClose(Get<float>(*out, static_cast<int64_t>(hq) * n), want, 1e-5, 1e-5, "key scores");
    }
  }
  unsetenv("STRATA_SELECTION_KEYS");
  unsetenv("STRATA_SELECTION_KEY_ROUNDS");
}

// Compares GPU top-k ids with the CPU's: same -1 padding, and ids may differ only where the two
// candidates' CPU votes tie within `tol` (relative) of each other's rank boundary.
void ExpectSameTopK(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                    const std::vector<float>& vote, const std::vector<int64_t>& index_of_id,
                    int hkv, int64_t k, int64_t n, uint32_t seed) {
  for (int g = 0; g < hkv; ++g) {
    std::vector<int32_t> a(got.begin() + g * k, got.begin() + (g + 1) * k);
    std::vector<int32_t> b(want.begin() + g * k, want.begin() + (g + 1) * k);
    EXPECT_EQ(std::count(a.begin(), a.end(), -1), std::count(b.begin(), b.end(), -1))
        << "head " << g << " seed " << seed;
    // Valid ids come first, in ascending index order.
    for (int64_t i = 1; i < k; ++i) {
      if (a[i] >= 0) {
        EXPECT_GE(a[i - 1], 0) << "head " << g << ": -1 before a valid id at " << i;
      }
    }
    std::multiset<int32_t> sa(a.begin(), a.end()), sb(b.begin(), b.end());
    if (sa == sb) continue;
    // The smallest CPU-selected vote; anything swapped must tie with it under the rank key
    // (kernels/vote_rank.h), up to the backends' rounding: their votes differ in the last bits
    // (~1e-6 relative, a few of the key's 2^-19 bins).
    float kth = std::numeric_limits<float>::infinity();
    for (int32_t id : b) {
      if (id >= 0) kth = std::min(kth, vote[g * n + index_of_id[g * (n + 1) + id]]);
    }
    for (int32_t id : a) {
      if (id < 0 || sb.count(id)) continue;
      const float v = vote[g * n + index_of_id[g * (n + 1) + id]];
      const uint32_t kv = VoteRankKey(v), kk = VoteRankKey(kth);
      EXPECT_LE(kv > kk ? kv - kk : kk - kv, 8u)
          << "head " << g << " id " << id << " vote " << v << " k-th " << kth << " seed " << seed;
    }
  }
}

// VoteTopK's kernels by size: the register kernel (group <= 4, n <= 8192; `reg`) and its
// cluster form (n <= 32768; `regcluster`), the bitonic kernel (n <= 8192, one block of n / 8
// threads rounded up to a power of two), the cluster kernel with 4 (n <= 16384) or 16 candidates per thread and 1
// to 8 blocks per KV head, and the one-block kernel beyond 65536 candidates. Scores take
// few distinct values shared by every query head of a candidate, so votes fall in well-separated
// classes of exactly equal values: the GPU must return exactly the CPU's ids (ties to the lower
// index, ascending, -1 padded), with k below, at and above the number of valid candidates.
// Runs `body` once per VoteTopK kernel choice: the default, then each kernel forced through
// STRATA_SELECTION_TOPK (kernels/cuda/selection.cu; beyond 8192 candidates `bitonic` and
// `cluster1` (the cluster kernel as one block) run the default, beyond 65536 every choice runs
// the block kernel).
template <typename Body>
void ForEachTopKKernel(Body body) {
  for (const char* choice : {"", "bitonic", "cluster", "cluster1", "block", "reg", "regcluster"}) {
    SCOPED_TRACE(::testing::Message() << "STRATA_SELECTION_TOPK=" << choice);
    if (*choice == 0) {
      unsetenv("STRATA_SELECTION_TOPK");
    } else {
      setenv("STRATA_SELECTION_TOPK", choice, 1);
    }
    body();
  }
  unsetenv("STRATA_SELECTION_TOPK");
}

TEST_F(SelectionTest, VoteTopKMatchesCpu) {
  struct Case {
    int hkv, group;
    int64_t n, k;
    bool parents;
  } cases[] = {{1, 1, 1, 1, false},       {3, 4, 17, 5, false},
               {8, 4, 1000, 64, true},    {2, 5, 129, 200, false},
               {8, 4, 8192, 2048, false}, {2, 4, 40000, 300, false},
               {1, 16, 3000, 0, false},   {4, 1, 500, 499, true},
               {2, 4, 20000, 1000, false}};
  ForEachTopKKernel([&] {
    for (const Case &c : cases) {
      SCOPED_TRACE(::testing::Message()
                   << "hkv " << c.hkv << " group " << c.group << " n " << c.n
                   << " k " << c.k);
      std::vector<float> scores =
          RandomF(static_cast<int64_t>(c.hkv) * c.group * c.n, -8.0f, 8.0f);
      std::uniform_int_distribution<int> u(0, 99);
      for (float &x : scores) {
        const int r = u(rng_);
        if (r < 5)
          x = kNegInf;
        if (r == 5)
          x = kNaN;
      }
      // A whole candidate column of -inf (invalid) and one head fully -inf.
      if (c.n > 3) {
        for (int g = 0; g < c.hkv; ++g) {
          for (int h = 0; h < c.group; ++h)
            scores[(static_cast<int64_t>(g) * c.group + h) * c.n + 2] = kNegInf;
        }
      }
      if (c.group > 1) {
        for (int64_t i = 0; i < c.n; ++i)
          scores[i] = kNegInf; // head 0 of KV head 0
      }
      CandidateList cl;
      std::vector<int32_t> parents;
      if (c.parents) {
        // fanout 1 list of ids: parents[g, i] = id; some -1.
        parents.resize(static_cast<size_t>(c.hkv) * c.n);
        for (int g = 0; g < c.hkv; ++g) {
          for (int64_t i = 0; i < c.n; ++i)
            parents[g * c.n + i] =
                u(rng_) < 10 ? -1 : static_cast<int32_t>(3 * i + 1);
        }
        cl.begin = 0;
        cl.end = 3 * c.n;
      } else {
        cl.begin = 5;
        cl.end = 5 + c.n;
      }
      std::vector<int32_t> want(static_cast<size_t>(c.hkv) * c.k, 12345);
      std::vector<float> vote(static_cast<size_t>(c.hkv) * c.n, kNaN);
      VoteTopKParams p;
      p.scores = TensorView(scores.data(), DType::kF32, {c.hkv, c.group, c.n});
      p.candidates = cl;
      if (c.parents)
        p.candidates.parents =
            TensorView(parents.data(), DType::kI32, {c.hkv, c.n});
      p.k = c.k;
      p.selected = TensorView(want.data(), DType::kI32, {c.hkv, c.k});
      p.vote = TensorView(vote.data(), DType::kF32, {c.hkv, c.n});
      STRATA_ASSERT_OK(cpu_->VoteTopK(p, nullptr));

      auto ds = Dev(scores), dp = Dev(parents);
      auto dsel = Poisoned<int32_t>(static_cast<int64_t>(c.hkv) * c.k, 0x7f);
      auto dvote = Poisoned<float>(static_cast<int64_t>(c.hkv) * c.n);
      p.scores.data = ds->data();
      if (c.parents)
        p.candidates.parents.data = dp->data();
      p.selected.data = dsel->data();
      p.vote.data = dvote->data();
      STRATA_ASSERT_OK(gpu_->VoteTopK(p, nullptr));
      ExpectClose(Get<float>(*dvote, static_cast<int64_t>(c.hkv) * c.n), vote,
                  1e-6, 1e-5, "vote");
      // id -> candidate index, per head.
      std::vector<int64_t> index_of_id(
          static_cast<size_t>(c.hkv) * (cl.end + 1), 0);
      for (int g = 0; g < c.hkv; ++g) {
        for (int64_t i = 0; i < c.n; ++i) {
          const int64_t id = c.parents ? parents[g * c.n + i] : cl.begin + i;
          if (id >= 0)
            index_of_id[g * (cl.end + 1) + id] = i;
        }
      }
      // ExpectSameTopK indexes ids by g * (n + 1); pass the id range as n.
      std::vector<float> vote_by_range(static_cast<size_t>(c.hkv) * cl.end,
                                       0.0f);
      std::vector<int64_t> identity(static_cast<size_t>(c.hkv) * (cl.end + 1));
      for (int g = 0; g < c.hkv; ++g) {
        for (int64_t id = 0; id <= cl.end; ++id)
          identity[g * (cl.end + 1) + id] = id;
        for (int64_t id = 0; id < cl.end; ++id) {
          vote_by_range[g * cl.end + id] =
              vote[g * c.n + index_of_id[g * (cl.end + 1) + id]];
        }
      }
      ExpectSameTopK(Get<int32_t>(*dsel, static_cast<int64_t>(c.hkv) * c.k),
                     want, vote_by_range, identity, c.hkv, c.k, cl.end, seed_);
    }
  });
}

TEST_F(SelectionTest, VoteTopKTiesGoToLowerIndices) {
  // Equal scores everywhere: both backends must pick exactly the first k valid
  // candidates.
  const int hkv = 2, group = 3;
  const int64_t n = 5000, k = 777;
  std::vector<float> scores(static_cast<size_t>(hkv) * group * n, 0.25f);
  for (int64_t i = 0; i < n; i += 7) {
    for (int h = 0; h < group; ++h) scores[h * n + i] = kNegInf;  // KV head 0: every 7th invalid
  }
  CandidateList cl;
  cl.begin = 0;
  cl.end = n;
  std::vector<int32_t> want(hkv * k);
  VoteTopKParams p;
  p.scores = TensorView(scores.data(), DType::kF32, {hkv, group, n});
  p.candidates = cl;
  p.k = k;
  p.selected = TensorView(want.data(), DType::kI32, {hkv, k});
  STRATA_ASSERT_OK(cpu_->VoteTopK(p, nullptr));
  auto ds = Dev(scores);
  auto dsel = Poisoned<int32_t>(hkv * k);
  p.scores.data = ds->data();
  p.selected.data = dsel->data();
  STRATA_ASSERT_OK(gpu_->VoteTopK(p, nullptr));
  EXPECT_EQ(Get<int32_t>(*dsel, hkv * k), want);
  std::vector<int32_t> expect;
  for (int64_t i = 0; static_cast<int64_t>(expect.size()) < k; ++i) {
    if (i % 7 != 0) expect.push_back(static_cast<int32_t>(i));
  }
  EXPECT_EQ(std::vector<int32_t>(want.begin(), want.begin() + k), expect);
}

TEST_F(SelectionTest, VoteTopKExactTiesAtEverySize) {
  ForEachTopKKernel([&] { ExactTiesAtEverySize(); });
}

// The bitonic kernel alone at its sizes, with each of its shapes (2, 4 or 8 candidates per
// thread, STRATA_SELECTION_BITONIC_PER; kernels/cuda/selection.cu): small enough for racecheck.
TEST_F(SelectionTest, VoteTopKBitonicExactTies) {
  setenv("STRATA_SELECTION_TOPK", "bitonic", 1);
  for (const char* per : {"2", "4", "8"}) {
    SCOPED_TRACE(::testing::Message() << "STRATA_SELECTION_BITONIC_PER=" << per);
    setenv("STRATA_SELECTION_BITONIC_PER", per, 1);
    ExactTiesAtEverySize({1, 63, 64, 65, 1000, 2048, 4097, 8192});
  }
  unsetenv("STRATA_SELECTION_BITONIC_PER");
  unsetenv("STRATA_SELECTION_TOPK");
}

// The register kernel (one block, scores and keys in registers, group <= 4) with each of its
// shapes (2, 4 or 8 candidates per thread, STRATA_SELECTION_REG_PER; more where the block would
// exceed 1024 threads): small enough for racecheck.
TEST_F(SelectionTest, VoteTopKRegisterExactTies) {
  setenv("STRATA_SELECTION_TOPK", "reg", 1);
  for (const char* per : {"2", "4", "8"}) {
    SCOPED_TRACE(::testing::Message() << "STRATA_SELECTION_REG_PER=" << per);
    setenv("STRATA_SELECTION_REG_PER", per, 1);
    ExactTiesAtEverySize({1, 31, 63, 64, 65, 1000, 2048, 2049, 4097, 8192});
  }
  // The other histogram adds (STRATA_SELECTION_REG_HIST; the default 2 ran above).
  setenv("STRATA_SELECTION_REG_PER", "4", 1);
  for (const char* hist : {"0", "1"}) {
    SCOPED_TRACE(::testing::Message() << "STRATA_SELECTION_REG_HIST=" << hist);
    setenv("STRATA_SELECTION_REG_HIST", hist, 1);
    ExactTiesAtEverySize({65, 2048, 8192});
  }
  unsetenv("STRATA_SELECTION_REG_HIST");
  unsetenv("STRATA_SELECTION_REG_PER");
  unsetenv("STRATA_SELECTION_TOPK");
}

// The register kernel over a cluster of 2, 4 and 8 blocks (STRATA_SELECTION_REG_CLUSTER), with
// each histogram add.
TEST_F(SelectionTest, VoteTopKRegisterClusterExactTies) {
  setenv("STRATA_SELECTION_TOPK", "regcluster", 1);
  for (const char* cs : {"2", "4", "8"}) {
    for (const char* hist : {"0", "1", "2"}) {
      SCOPED_TRACE(::testing::Message() << "STRATA_SELECTION_REG_CLUSTER=" << cs
                                        << " STRATA_SELECTION_REG_HIST=" << hist);
      setenv("STRATA_SELECTION_REG_CLUSTER", cs, 1);
      setenv("STRATA_SELECTION_REG_HIST", hist, 1);
      ExactTiesAtEverySize({31, 2048, 8192});
    }
  }
  unsetenv("STRATA_SELECTION_REG_HIST");
  unsetenv("STRATA_SELECTION_REG_CLUSTER");
  unsetenv("STRATA_SELECTION_TOPK");
}

// Mixed choices by size (STRATA_SELECTION_TOPK_MAP, as the A/B timing of the pipelines uses it),
// against the CPU on exact ties and on random scores through parents.
TEST_F(SelectionTest, VoteTopKSizeMapMatchesCpu) {
  setenv("STRATA_SELECTION_TOPK_MAP", "100:bitonic,1024:reg,2048:regcluster:4,8192:regcluster:8",
         1);
  ExactTiesAtEverySize({17, 1000, 2048, 8192, 20000});
  MatchesCpuThroughParents();
  unsetenv("STRATA_SELECTION_TOPK_MAP");
}

void SelectionTest::ExactTiesAtEverySize(std::vector<int64_t> sizes) {
  for (int64_t n : sizes) {
    for (int group : {4, 1}) {
      const int hkv = 3;
      std::uniform_int_distribution<int> cls(0, 5);
      std::vector<float> scores(static_cast<size_t>(hkv) * group * n);
      for (int g = 0; g < hkv; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const int c = cls(rng_);
          // Class 0: invalid (-inf in every head); classes 1-5: score c / 2 in every head.
          const float x = c == 0 ? kNegInf : 0.5f * c;
          for (int h = 0; h < group; ++h) scores[(static_cast<size_t>(g) * group + h) * n + i] = x;
        }
      }
      if (n >= 3) {
        for (int h = 0; h < group; ++h) scores[static_cast<size_t>(h) * n + 1] = kNaN;  // invalid
      }
      for (int64_t k : {int64_t{1}, (n + 1) / 2, n - n / 7, n, n + 5}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " group " << group << " k " << k);
        CandidateList cl;
        cl.begin = 7;
        cl.end = 7 + n;
        std::vector<int32_t> want(static_cast<size_t>(hkv) * k, 12345);
        std::vector<float> vote(static_cast<size_t>(hkv) * n);
        VoteTopKParams p;
        p.scores = TensorView(scores.data(), DType::kF32, {hkv, group, n});
        p.candidates = cl;
        p.k = k;
        p.selected = TensorView(want.data(), DType::kI32, {hkv, k});
        p.vote = TensorView(vote.data(), DType::kF32, {hkv, n});
        STRATA_ASSERT_OK(cpu_->VoteTopK(p, nullptr));
        auto ds = Dev(scores);
        auto dsel = Poisoned<int32_t>(static_cast<int64_t>(hkv) * k, 0x7f);
        auto dvote = Poisoned<float>(static_cast<int64_t>(hkv) * n);
        p.scores.data = ds->data();
        p.selected.data = dsel->data();
        p.vote.data = dvote->data();
        STRATA_ASSERT_OK(gpu_->VoteTopK(p, nullptr));
        EXPECT_EQ(Get<int32_t>(*dsel, static_cast<int64_t>(hkv) * k), want);
        ExpectClose(Get<float>(*dvote, static_cast<int64_t>(hkv) * n), vote, 1e-6, 1e-5, "vote");
      }
    }
  }
}

// Random scores at the sizes of the pipelines and awkward ones, through a parent list (fanout 16,
// some parents -1) as the page level uses, compared with the CPU modulo float near-ties.
TEST_F(SelectionTest, VoteTopKMatchesCpuThroughParents) {
  ForEachTopKKernel([&] { MatchesCpuThroughParents(); });
}

void SelectionTest::MatchesCpuThroughParents() {
  const int64_t sizes[] = {16, 48, 1024, 2048, 8192, 16384, 16400, 65536, 65552};
  for (int64_t n : sizes) {
    const int hkv = 2, group = 4, fanout = 16;
    const int64_t np = n / fanout, k = std::max<int64_t>(1, n / 4);
    SCOPED_TRACE(::testing::Message() << "n " << n << " k " << k);
    std::vector<float> scores = RandomF(static_cast<int64_t>(hkv) * group * n, -6.0f, 6.0f);
    std::vector<int32_t> parents(static_cast<size_t>(hkv) * np);
    std::uniform_int_distribution<int> u(0, 99);
    for (int g = 0; g < hkv; ++g) {
      for (int64_t i = 0; i < np; ++i) parents[g * np + i] = u(rng_) < 5 ? -1 : static_cast<int32_t>(2 * i + 1);
    }
    CandidateList cl;
    cl.fanout = fanout;
    cl.begin = 3;
    cl.end = 2 * np * fanout;
    std::vector<int32_t> want(static_cast<size_t>(hkv) * k);
    std::vector<float> vote(static_cast<size_t>(hkv) * n);
    VoteTopKParams p;
    p.scores = TensorView(scores.data(), DType::kF32, {hkv, group, n});
    p.candidates = cl;
    p.candidates.parents = TensorView(parents.data(), DType::kI32, {hkv, np});
    p.k = k;
    p.selected = TensorView(want.data(), DType::kI32, {hkv, k});
    p.vote = TensorView(vote.data(), DType::kF32, {hkv, n});
    STRATA_ASSERT_OK(cpu_->VoteTopK(p, nullptr));
    auto ds = Dev(scores), dp = Dev(parents);
    auto dsel = Poisoned<int32_t>(static_cast<int64_t>(hkv) * k, 0x7f);
    auto dvote = Poisoned<float>(static_cast<int64_t>(hkv) * n);
    p.scores.data = ds->data();
    p.candidates.parents.data = dp->data();
    p.selected.data = dsel->data();
    p.vote.data = dvote->data();
    STRATA_ASSERT_OK(gpu_->VoteTopK(p, nullptr));
    ExpectClose(Get<float>(*dvote, static_cast<int64_t>(hkv) * n), vote, 1e-6, 1e-5, "vote");
    // Votes by id (ids are unique per head here).
    std::vector<float> vote_by_id(static_cast<size_t>(hkv) * cl.end, 0.0f);
    std::vector<int64_t> identity(static_cast<size_t>(hkv) * (cl.end + 1));
    for (int g = 0; g < hkv; ++g) {
      for (int64_t i = 0; i < n; ++i) {
        const int32_t parent = parents[g * np + i / fanout];
        if (parent < 0) continue;
        const int64_t id = static_cast<int64_t>(parent) * fanout + i % fanout;
        if (id >= cl.begin && id < cl.end) vote_by_id[g * cl.end + id] = vote[g * n + i];
      }
      for (int64_t id = 0; id <= cl.end; ++id) identity[g * (cl.end + 1) + id] = id;
    }
    ExpectSameTopK(Get<int32_t>(*dsel, static_cast<int64_t>(hkv) * k), want, vote_by_id, identity,
                   hkv, k, cl.end, seed_);
  }
}

TEST_F(SelectionTest, SelectedAttentionMatchesCpu) {
  struct Case {
    DType dtype;
    int hkv, group, d, page, table_pages;
    int64_t prefix, suffix_begin, suffix_end;
    int fanout, parents;
  } cases[] = {{DType::kBF16, 8, 4, 128, 64, 40, 64, 2300, 2560, 64, 32},
               {DType::kF32, 3, 5, 64, 16, 30, 5, 400, 417, 1, 129},
               {DType::kBF16, 1, 8, 256, 64, 4, 0, 0, 0, 64, 3},
               {DType::kBF16, 2, 1, 128, 17, 50, 1, 800, 850, 1, 1000},
               {DType::kF32, 2, 4, 64, 8, 3, 0, 0, 0, 8, 0}};  // nothing attended
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << DTypeName(c.dtype) << " hkv " << c.hkv << " group "
                                      << c.group << " d " << c.d << " page " << c.page);
    const int hq = c.hkv * c.group;
    const int slots = c.hkv * c.table_pages + 3;
    std::vector<float> q = RandomF(static_cast<int64_t>(hq) * c.d, -2.0f, 2.0f);
    std::vector<uint8_t> kp = PoolBytes(RandomF(static_cast<int64_t>(slots) * c.page * c.d), c.dtype);
    std::vector<uint8_t> vp = PoolBytes(RandomF(static_cast<int64_t>(slots) * c.page * c.d), c.dtype);
    // A permutation of slots per head, with one bad entry per head.
    std::vector<int32_t> perm(slots);
    for (int i = 0; i < slots; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::vector<int32_t> table(static_cast<size_t>(c.hkv) * c.table_pages);
    for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i];
    if (c.table_pages > 2) table[1] = -1;
    const int64_t tokens = static_cast<int64_t>(c.table_pages) * c.page;
    CandidateList mid;
    mid.fanout = c.fanout;
    mid.begin = c.prefix;
    mid.end = c.suffix_begin > 0 ? c.suffix_begin : tokens;
    // Distinct parents per head inside the middle (sorted; a few -1).
    std::vector<int32_t> parents(static_cast<size_t>(c.hkv) * c.parents);
    const int64_t max_parent = (tokens + c.fanout - 1) / c.fanout;
    for (int g = 0; g < c.hkv; ++g) {
      std::vector<int32_t> all(max_parent);
      for (int64_t i = 0; i < max_parent; ++i) all[i] = static_cast<int32_t>(i);
      std::shuffle(all.begin(), all.end(), rng_);
      all.resize(std::min<int64_t>(c.parents, max_parent));
      std::sort(all.begin(), all.end());
      for (int i = 0; i < c.parents; ++i) {
        parents[g * c.parents + i] = i < static_cast<int>(all.size()) && i % 11 != 5 ? all[i] : -1;
      }
    }
    mid.parents = TensorView(parents.data(), DType::kI32, {c.hkv, c.parents});
    std::vector<float> out(static_cast<size_t>(hq) * c.d, kNaN), lse(hq, kNaN);
    SelectedAttentionParams p;
    p.q = TensorView(q.data(), DType::kF32, {1, hq, c.d});
    p.k_pool = TensorView(kp.data(), c.dtype, {slots, c.page, c.d});
    p.v_pool = TensorView(vp.data(), c.dtype, {slots, c.page, c.d});
    p.page_table = TensorView(table.data(), DType::kI32, {c.hkv, c.table_pages});
    p.prefix_end = c.prefix;
    p.middle = mid;
    p.suffix_begin = c.suffix_begin;
    p.suffix_end = c.suffix_end;
    p.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    p.out = TensorView(out.data(), DType::kF32, {1, hq, c.d});
    p.lse = TensorView(lse.data(), DType::kF32, {1, hq});
    STRATA_ASSERT_OK(cpu_->SelectedAttention(p, nullptr));
    auto dq = Dev(q), dk = Dev(kp), dv = Dev(vp), dt = Dev(table), dp = Dev(parents);
    auto dout = Poisoned<float>(static_cast<int64_t>(hq) * c.d);
    auto dlse = Poisoned<float>(hq);
    p.q.data = dq->data();
    p.k_pool.data = dk->data();
    p.v_pool.data = dv->data();
    p.page_table.data = dt->data();
    p.middle.parents.data = c.parents > 0 ? dp->data() : nullptr;
    if (c.parents == 0) {
      p.middle.begin = p.middle.end = 0;  // an empty middle
      p.middle.parents = TensorView();
    }
    p.out.data = dout->data();
    p.lse.data = dlse->data();
    if (c.parents == 0) {
      // Recompute the CPU reference with the same empty middle.
      SelectedAttentionParams h = p;
      h.q.data = q.data();
      h.k_pool.data = kp.data();
      h.v_pool.data = vp.data();
      h.page_table.data = table.data();
      h.out.data = out.data();
      h.lse.data = lse.data();
      STRATA_ASSERT_OK(cpu_->SelectedAttention(h, nullptr));
      for (float x : lse) EXPECT_EQ(x, kNegInf);
    }
    STRATA_ASSERT_OK(gpu_->SelectedAttention(p, nullptr));
    ExpectClose(Get<float>(*dout, static_cast<int64_t>(hq) * c.d), out, 2e-5, 1e-4, "out");
    ExpectClose(Get<float>(*dlse, hq), lse, 2e-5, 1e-5, "lse");
  }
}

TEST_F(SelectionTest, UpdateSummariesMatchesCpu) {
  for (DType dtype : {DType::kBF16, DType::kF32, DType::kFP8E4M3}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int hkv = 3, d = 128, page = 16, table_pages = 40, seg = 5, max_segs = 8;
    const int slots = hkv * table_pages + 1;
    std::vector<uint8_t> pool = PoolBytes(RandomF(static_cast<int64_t>(slots) * page * d), dtype);
    std::vector<int32_t> perm(slots);
    for (int i = 0; i < slots; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::vector<int32_t> table(perm.begin(), perm.begin() + hkv * table_pages);
    table[7] = slots + 5;  // a page whose slot is outside the pool: zeros
    std::vector<float> pages(static_cast<size_t>(hkv) * table_pages * 2 * d, 3.0f);
    std::vector<float> segs(static_cast<size_t>(hkv) * max_segs * 2 * d, 3.0f);
    auto dpool = Dev(pool), dt = Dev(table), dp = Dev(pages), ds = Dev(segs);
    UpdateSummariesParams h;
    h.k_pool = TensorView(pool.data(), dtype, {slots, page, d});
    h.page_table = TensorView(table.data(), DType::kI32, {hkv, table_pages});
    h.pages = TensorView(pages.data(), DType::kF32, {hkv, table_pages, 2 * d});
    h.segments = TensorView(segs.data(), DType::kF32, {hkv, max_segs, 2 * d});
    h.segment_pages = seg;
    UpdateSummariesParams dv = h;
    dv.k_pool.data = dpool->data();
    dv.page_table.data = dt->data();
    dv.pages.data = dp->data();
    dv.segments.data = ds->data();
    const int64_t len = 37 * page - 3;
    for (int64_t first = 0; first < len;) {
      const int64_t end = std::min<int64_t>(len, first + 1 + rng_() % 100);
      h.first = dv.first = first;
      h.end = dv.end = end;
      STRATA_ASSERT_OK(cpu_->UpdateSummaries(h, nullptr));
      STRATA_ASSERT_OK(gpu_->UpdateSummaries(dv, nullptr));
      first = end;
    }
    ExpectClose(Get<float>(*dp, static_cast<int64_t>(pages.size())), pages, 0, 0, "pages");
    ExpectClose(Get<float>(*ds, static_cast<int64_t>(segs.size())), segs, 0, 0, "segments");

    // bf16 rows (rounded outward; exact for the bf16 pool): the same bits as the CPU twin.
    std::vector<uint16_t> pages16(pages.size(), 0x4040), segs16(segs.size(), 0x4040);
    auto dp16 = Dev(pages16), ds16 = Dev(segs16);
    h.pages = TensorView(pages16.data(), DType::kBF16, {hkv, table_pages, 2 * d});
    h.segments = TensorView(segs16.data(), DType::kBF16, {hkv, max_segs, 2 * d});
    dv.pages = TensorView(dp16->data(), DType::kBF16, {hkv, table_pages, 2 * d});
    dv.segments = TensorView(ds16->data(), DType::kBF16, {hkv, max_segs, 2 * d});
    h.first = dv.first = 0;
    h.end = dv.end = len;
    STRATA_ASSERT_OK(cpu_->UpdateSummaries(h, nullptr));
    STRATA_ASSERT_OK(gpu_->UpdateSummaries(dv, nullptr));
    EXPECT_EQ(Get<uint16_t>(*dp16, static_cast<int64_t>(pages16.size())), pages16);
    EXPECT_EQ(Get<uint16_t>(*ds16, static_cast<int64_t>(segs16.size())), segs16);
  }
}

TEST_F(SelectionTest, BadParamsAreRejected) {
  std::vector<float> q(8 * 16), scores(8 * 16);
  auto dq = Dev(q), ds = Dev(scores);
  ScoreSummariesParams p;
  p.q = TensorView(dq->data(), DType::kF32, {8, 16});
  p.summaries = TensorView(ds->data(), DType::kF32, {3, 2, 32});  // 3 KV heads do not divide 8
  p.candidates.end = 2;
  p.scores = TensorView(ds->data(), DType::kF32, {3, 2, 2});
  EXPECT_THAT(gpu_->ScoreSummaries(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  VoteTopKParams v;
  v.scores = TensorView(ds->data(), DType::kF32, {2, 4, 16});
  v.candidates.end = 16;
  v.k = 4;
  v.selected = TensorView(dq->data(), DType::kF32, {2, 4});  // must be i32
  EXPECT_THAT(gpu_->VoteTopK(v, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  v.selected.dtype = DType::kI32;
  v.candidates.fanout = 0;
  EXPECT_THAT(gpu_->VoteTopK(v, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  // VoteTopK in parts: a count that is not a power of two (the CPU's check), more than 4 query
  // heads per KV head or more than 4096 candidates in a part (this backend's limits).
  v.candidates.fanout = 1;
  v.partitions = 3;
  EXPECT_THAT(gpu_->VoteTopK(v, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  v.partitions = 2;
  v.scores = TensorView(ds->data(), DType::kF32, {1, 8, 16});
  v.selected = TensorView(dq->data(), DType::kI32, {1, 4});
  EXPECT_THAT(gpu_->VoteTopK(v, nullptr), StatusIs(absl::StatusCode::kUnimplemented));
  auto big = Poisoned<float>(int64_t{4} * 8200);
  v.scores = TensorView(big->data(), DType::kF32, {1, 4, 8200});
  v.candidates.end = 8200;
  EXPECT_THAT(gpu_->VoteTopK(v, nullptr), StatusIs(absl::StatusCode::kUnimplemented));
}

// The default tokenselect pipeline (two-level minmax page ranking, token soft vote, attention
// over sinks + selection + window) on both backends, then the GPU pipeline captured in a CUDA
// graph and replayed: same selection (modulo vote ties) and same attention output.
TEST_F(SelectionTest, TokenSelectPipelineMatchesCpuAndReplaysInAGraph) {
  const int hkv = 2, group = 4, d = 64, page = 16, seg = 4;
  const int64_t len = 16 * 1024 + 37;  // partial last page
  const int pages = static_cast<int>((len + page - 1) / page), segs = (pages + seg - 1) / seg;
  const int64_t sink = 64, window_begin = len - 256, budget = 256;
  const int64_t keep_segs = 32, cand_pages = 4 * budget / page;
  const int hq = hkv * group;
  std::vector<float> q = RandomF(hq * d, -2.0f, 2.0f);
  std::vector<float> keys = RandomF(static_cast<int64_t>(hkv) * pages * page * d);
  std::vector<uint8_t> kp = PoolBytes(keys, DType::kBF16);
  std::vector<uint8_t> vp = PoolBytes(RandomF(static_cast<int64_t>(hkv) * pages * page * d), DType::kBF16);
  ConvertToF32(kp.data(), DType::kBF16, keys.data(), static_cast<int64_t>(keys.size()));
  std::vector<int32_t> table(hkv * pages);
  for (int i = 0; i < hkv * pages; ++i) table[i] = i;  // head g's pages at slots g * pages + p
  // Page and segment minmax summaries over the tokens < len.
  std::vector<float> ps(static_cast<size_t>(hkv) * pages * 2 * d), ss(static_cast<size_t>(hkv) * segs * 2 * d);
  for (int g = 0; g < hkv; ++g) {
    for (int pg = 0; pg < pages; ++pg) {
      float* s = &ps[(static_cast<size_t>(g) * pages + pg) * 2 * d];
      for (int e = 0; e < d; ++e) s[e] = 1e30f, s[d + e] = -1e30f;
      for (int t = pg * page; t < std::min<int64_t>(len, (pg + 1) * page); ++t) {
        const float* k = &keys[((static_cast<int64_t>(g) * pages) * page + t) * d];
        for (int e = 0; e < d; ++e) s[e] = std::min(s[e], k[e]), s[d + e] = std::max(s[d + e], k[e]);
      }
      float* sg = &ss[(static_cast<size_t>(g) * segs + pg / seg) * 2 * d];
      if (pg % seg == 0) std::copy(s, s + 2 * d, sg);
      for (int e = 0; e < d; ++e) sg[e] = std::min(sg[e], s[e]), sg[d + e] = std::max(sg[d + e], s[d + e]);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t p0 = sink / page, p1 = (window_begin + page - 1) / page;
  const int64_t s0 = p0 / seg, s1 = (p1 - 1) / seg + 1;

  // Runs the pipeline on `b` with buffers at the given addresses (host for the CPU).
  struct Bufs {
    void *q, *kp, *vp, *table, *ps, *ss, *seg_scores, *top_segs, *page_scores, *top_pages,
        *tok_scores, *top_tokens, *out, *lse;
  };
  auto run = [&](Backend* b, const Bufs& m, Stream s) -> absl::Status {
    ScoreSummariesParams a;
    a.q = TensorView(m.q, DType::kF32, {hq, d});
    a.summaries = TensorView(m.ss, DType::kF32, {hkv, segs, 2 * d});
    a.candidates.begin = s0;
    a.candidates.end = s1;
    a.scale = scale;
    a.scores = TensorView(m.seg_scores, DType::kF32, {hkv, group, s1 - s0});
    STRATA_RETURN_IF_ERROR(b->ScoreSummaries(a, s));
    VoteTopKParams t;
    t.scores = a.scores;
    t.candidates = a.candidates;
    t.k = keep_segs;
    t.selected = TensorView(m.top_segs, DType::kI32, {hkv, keep_segs});
    STRATA_RETURN_IF_ERROR(b->VoteTopK(t, s));
    a.summaries = TensorView(m.ps, DType::kF32, {hkv, pages, 2 * d});
    a.candidates = CandidateList();
    a.candidates.parents = t.selected;
    a.candidates.fanout = seg;
    a.candidates.begin = p0;
    a.candidates.end = p1;
    a.scores = TensorView(m.page_scores, DType::kF32, {hkv, group, keep_segs * seg});
    STRATA_RETURN_IF_ERROR(b->ScoreSummaries(a, s));
    t.scores = a.scores;
    t.candidates = a.candidates;
    t.k = cand_pages;
    t.selected = TensorView(m.top_pages, DType::kI32, {hkv, cand_pages});
    STRATA_RETURN_IF_ERROR(b->VoteTopK(t, s));
    ScoreKeysParams k;
    k.q = a.q;
    k.k_pool = TensorView(m.kp, DType::kBF16, {hkv * pages, page, d});
    k.page_table = TensorView(m.table, DType::kI32, {hkv, pages});
    k.candidates.parents = t.selected;
    k.candidates.fanout = page;
    k.candidates.begin = sink;
    k.candidates.end = window_begin;
    k.scale = scale;
    k.scores = TensorView(m.tok_scores, DType::kF32, {hkv, group, cand_pages * page});
    STRATA_RETURN_IF_ERROR(b->ScoreKeys(k, s));
    t.scores = k.scores;
    t.candidates = k.candidates;
    t.k = budget;
    t.selected = TensorView(m.top_tokens, DType::kI32, {hkv, budget});
    STRATA_RETURN_IF_ERROR(b->VoteTopK(t, s));
    SelectedAttentionParams at;
    at.q = TensorView(m.q, DType::kF32, {1, hq, d});
    at.k_pool = k.k_pool;
    at.v_pool = TensorView(m.vp, DType::kBF16, {hkv * pages, page, d});
    at.page_table = k.page_table;
    at.prefix_end = sink;
    at.middle.parents = t.selected;
    at.middle.begin = sink;
    at.middle.end = window_begin;
    at.suffix_begin = window_begin;
    at.suffix_end = len;
    at.scale = scale;
    at.out = TensorView(m.out, DType::kF32, {1, hq, d});
    at.lse = TensorView(m.lse, DType::kF32, {1, hq});
    return b->SelectedAttention(at, s);
  };
  std::vector<float> seg_scores(hkv * group * (s1 - s0)), page_scores(hkv * group * keep_segs * seg),
      tok_scores(hkv * group * cand_pages * page), out(hq * d), lse(hq);
  std::vector<int32_t> top_segs(hkv * keep_segs), top_pages(hkv * cand_pages), top_tokens(hkv * budget);
  Bufs h{q.data(), kp.data(), vp.data(), table.data(), ps.data(), ss.data(), seg_scores.data(),
         top_segs.data(), page_scores.data(), top_pages.data(), tok_scores.data(),
         top_tokens.data(), out.data(), lse.data()};
  STRATA_ASSERT_OK(run(cpu_, h, nullptr));

  auto dq = Dev(q), dk = Dev(kp), dv = Dev(vp), dt = Dev(table), dps = Dev(ps), dss = Dev(ss);
  auto d1 = Poisoned<float>(seg_scores.size()), d2 = Poisoned<int32_t>(top_segs.size());
  auto d3 = Poisoned<float>(page_scores.size()), d4 = Poisoned<int32_t>(top_pages.size());
  auto d5 = Poisoned<float>(tok_scores.size()), d6 = Poisoned<int32_t>(top_tokens.size());
  auto d7 = Poisoned<float>(out.size()), d8 = Poisoned<float>(lse.size());
  Bufs m{dq->data(), dk->data(), dv->data(), dt->data(), dps->data(), dss->data(), d1->data(),
         d2->data(), d3->data(), d4->data(), d5->data(), d6->data(), d7->data(), d8->data()};
  auto* cuda = static_cast<CudaBackend*>(gpu_);
  STRATA_ASSERT_OK_AND_ASSIGN(Stream s, cuda->CreateStream());
  STRATA_ASSERT_OK(run(gpu_, m, s));
  STRATA_ASSERT_OK(gpu_->Synchronize(s));
  // Every stage's selection is the same set as the CPU's (random data: no near-ties expected).
  auto same_sets = [&](Buffer& b, const std::vector<int32_t>& want, int64_t k, const char* what) {
    std::vector<int32_t> got = Get<int32_t>(b, static_cast<int64_t>(want.size()));
    int differ = 0;
    for (int g = 0; g < hkv; ++g) {
      std::set<int32_t> a(got.begin() + g * k, got.begin() + (g + 1) * k);
      std::set<int32_t> w(want.begin() + g * k, want.begin() + (g + 1) * k);
      for (int32_t x : a) differ += w.count(x) == 0;
    }
    EXPECT_LE(differ, 1) << what << ": " << differ << " ids differ from the CPU's (seed " << seed_ << ")";
    return differ;
  };
  const int diff = same_sets(*d2, top_segs, keep_segs, "segments") +
                   same_sets(*d4, top_pages, cand_pages, "pages") +
                   same_sets(*d6, top_tokens, budget, "tokens");
  if (diff == 0) {
    ExpectClose(Get<float>(*d7, out.size()), out, 2e-5, 1e-4, "pipeline out");
    ExpectClose(Get<float>(*d8, lse.size()), lse, 2e-5, 1e-5, "pipeline lse");
  }
  const std::vector<float> eager_out = Get<float>(*d7, out.size());

  // Capture and replay: the same output, bit for bit.
  cudaStream_t cs = static_cast<cudaStream_t>(s);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status captured = run(gpu_, m, s);
  ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess);
  STRATA_ASSERT_OK(captured);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  std::vector<uint8_t> poison(out.size() * 4, 0xff);
  STRATA_ASSERT_OK(gpu_->CopyToDevice(d7->data(), poison.data(), poison.size(), s));
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
  EXPECT_EQ(Get<float>(*d7, out.size()), eager_out);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  STRATA_ASSERT_OK(cuda->DestroyStream(s));
}

// The dense decode step over an engine::KvCache-style layout with the cache length read from
// device memory (SelectedAttentionParams::prefix_len): captured once in a CUDA graph with the
// bound prefix_end = capacity, then replayed with the length changed between replays; every
// replay must match the CPU twin at that length (which kernels/cpu/selection_test.cc checks
// against PagedAttention). Outputs are poisoned before each replay.
TEST_F(SelectionTest, DeviceLengthDecodeReplaysInAGraph) {
  struct Case {
    DType dtype;
    int hkv, group, d, page, slots_per_head;
  } cases[] = {{DType::kBF16, 8, 4, 128, 64, 40}, {DType::kF32, 4, 2, 64, 16, 33}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << DTypeName(c.dtype) << " d " << c.d);
    const int hq = c.hkv * c.group, slots = c.hkv * c.slots_per_head;
    const int capacity = c.slots_per_head * c.page;
    std::vector<float> q = RandomF(static_cast<int64_t>(hq) * c.d, -2.0f, 2.0f);
    std::vector<uint8_t> kp = PoolBytes(RandomF(static_cast<int64_t>(slots) * c.page * c.d), c.dtype);
    std::vector<uint8_t> vp = PoolBytes(RandomF(static_cast<int64_t>(slots) * c.page * c.d), c.dtype);
    std::vector<int32_t> table(slots);
    for (int i = 0; i < slots; ++i) table[i] = i;
    int32_t len_host = 0;
    std::vector<float> out(static_cast<size_t>(hq) * c.d), lse(hq);
    SelectedAttentionParams h;
    h.q = TensorView(q.data(), DType::kF32, {1, hq, c.d});
    h.k_pool = TensorView(kp.data(), c.dtype, {slots, c.page, c.d});
    h.v_pool = TensorView(vp.data(), c.dtype, {slots, c.page, c.d});
    h.page_table = TensorView(table.data(), DType::kI32, {c.hkv, c.slots_per_head});
    h.prefix_end = capacity;
    h.prefix_len = &len_host;
    h.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    h.out = TensorView(out.data(), DType::kF32, {1, hq, c.d});
    h.lse = TensorView(lse.data(), DType::kF32, {1, hq});
    auto dq = Dev(q), dk = Dev(kp), dv = Dev(vp), dt = Dev(table);
    auto dlen = Dev(std::vector<int32_t>{1});
    auto dout = Poisoned<float>(static_cast<int64_t>(hq) * c.d);
    auto dlse = Poisoned<float>(hq);
    SelectedAttentionParams p = h;
    p.q.data = dq->data();
    p.k_pool.data = dk->data();
    p.v_pool.data = dv->data();
    p.page_table.data = dt->data();
    p.prefix_len = static_cast<const int32_t*>(dlen->data());
    p.out.data = dout->data();
    p.lse.data = dlse->data();

    auto* cuda = static_cast<CudaBackend*>(gpu_);
    STRATA_ASSERT_OK_AND_ASSIGN(Stream s, cuda->CreateStream());
    cudaStream_t cs = static_cast<cudaStream_t>(s);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const absl::Status captured = gpu_->SelectedAttention(p, s);
    ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess);
    STRATA_ASSERT_OK(captured);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    std::vector<uint8_t> poison(out.size() * 4, 0xff);
    for (int32_t len : {1, c.page - 1, c.page, c.page + 1, 1000, capacity - 3, capacity, 0}) {
      SCOPED_TRACE(::testing::Message() << "len " << len);
      len_host = len;
      STRATA_ASSERT_OK(cpu_->SelectedAttention(h, nullptr));
      STRATA_ASSERT_OK(gpu_->CopyToDevice(dlen->data(), &len_host, 4, s));
      STRATA_ASSERT_OK(gpu_->CopyToDevice(dout->data(), poison.data(), poison.size(), s));
      STRATA_ASSERT_OK(gpu_->CopyToDevice(dlse->data(), poison.data(), hq * 4, s));
      ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
      ExpectClose(Get<float>(*dout, static_cast<int64_t>(hq) * c.d), out, 2e-5, 1e-4, "out");
      ExpectClose(Get<float>(*dlse, hq), lse, 2e-5, 1e-5, "lse");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    STRATA_ASSERT_OK(cuda->DestroyStream(s));
  }
}

// SelectionCacheCheck on the GPU equals the CPU twin (flags, valid, cached queries, hit count) on
// heads that hit by scaling, by a small drift, miss by turning away, and miss because not valid;
// and, where the GPU decides by squares (no square root or division), at thetas of 0 and below, on
// an opposite query (cosine -1), a zero query (cosine 0) and queries with an infinity or a NaN
// (never a hit).
TEST_F(SelectionTest, SelectionCacheCheckMatchesCpu) {
  const int hkv = 9, group = 4, d = 128, n = group * d;
  std::vector<float> q = RandomF(static_cast<int64_t>(hkv) * n);
  std::vector<float> cached = RandomF(static_cast<int64_t>(hkv) * n);
  for (int i = 0; i < n; ++i) {
    cached[1 * n + i] = 2.0f * q[1 * n + i];                       // cosine 1
    cached[2 * n + i] = q[2 * n + i] + 0.05f * ((i * 7) % 5 - 2);  // cosine ~0.98
    cached[4 * n + i] = q[4 * n + i];                              // but not valid
    cached[5 * n + i] = -q[5 * n + i];                             // cosine -1
    q[6 * n + i] = 0.0f;                                           // cosine 0
  }
  q[7 * n + 5] = std::numeric_limits<float>::infinity();
  cached[8 * n + 9] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<int32_t> valid0 = {0, 1, 1, 1, 0, 1, 1, 1, 1};
  for (float theta : {0.9f, 1.0f, 0.0f, -0.5f, -2.0f}) {
    SCOPED_TRACE(::testing::Message() << "theta " << theta);
    std::vector<float> want_cached = cached;
    std::vector<int32_t> want_valid = valid0, want_reuse(hkv, 7);
    int64_t want_hits = 3;
    SelectionCacheCheckParams p;
    p.q = TensorView(q.data(), DType::kF32, {hkv * group, d});
    p.cached_q = TensorView(want_cached.data(), DType::kF32, {hkv, n});
    p.valid = TensorView(want_valid.data(), DType::kI32, {hkv});
    p.reuse = TensorView(want_reuse.data(), DType::kI32, {hkv});
    p.theta = theta;
    p.hit_count = &want_hits;
    STRATA_ASSERT_OK(cpu_->SelectionCacheCheck(p, nullptr));
    auto dq = Dev(q), dc = Dev(cached), dv = Dev(valid0), dr = Poisoned<int32_t>(hkv);
    auto dh = Dev(std::vector<int64_t>{3});
    p.q.data = dq->data();
    p.cached_q.data = dc->data();
    p.valid.data = dv->data();
    p.reuse.data = dr->data();
    p.hit_count = static_cast<int64_t*>(dh->data());
    STRATA_ASSERT_OK(gpu_->SelectionCacheCheck(p, nullptr));
    EXPECT_EQ(Get<int32_t>(*dr, hkv), want_reuse);
    EXPECT_EQ(Get<int32_t>(*dv, hkv), want_valid);
    EXPECT_EQ(Get<float>(*dc, static_cast<int64_t>(hkv) * n), want_cached);
    EXPECT_EQ(Get<int64_t>(*dh, 1)[0], want_hits);
    if (theta == 0.9f) {
      EXPECT_EQ(want_reuse, std::vector<int32_t>({0, 1, 1, 0, 0, 0, 0, 0, 0}));
    }
    if (theta == -2.0f) {
      EXPECT_EQ(want_reuse, std::vector<int32_t>({0, 1, 1, 1, 0, 1, 1, 0, 0}));
    }
  }
}

// skip_heads on the GPU: the flagged heads' outputs keep their bytes (poison here), the other
// heads equal the same call without skip_heads, for the fast and general scoring kernels and
// every VoteTopK kernel (bitonic, cluster as one block, cluster, block).
TEST_F(SelectionTest, SkipHeadsLeaveFlaggedHeadsUntouched) {
  const int hkv = 4, group = 4, hq = hkv * group;
  const std::vector<int32_t> skip = {0, 1, 1, 0};
  auto dskip = Dev(skip);
  auto check = [&](Buffer& with, Buffer& without, int64_t per_head_bytes, const char* what) {
    const std::vector<uint8_t> a = Get<uint8_t>(with, hkv * per_head_bytes);
    const std::vector<uint8_t> b = Get<uint8_t>(without, hkv * per_head_bytes);
    for (int g = 0; g < hkv; ++g) {
      const auto ra = std::vector<uint8_t>(a.begin() + g * per_head_bytes,
                                           a.begin() + (g + 1) * per_head_bytes);
      if (skip[g]) {
        EXPECT_EQ(ra, std::vector<uint8_t>(per_head_bytes, 0xff)) << what << " head " << g;
      } else {
        EXPECT_EQ(ra, std::vector<uint8_t>(b.begin() + g * per_head_bytes,
                                           b.begin() + (g + 1) * per_head_bytes))
            << what << " head " << g;
      }
    }
  };
  for (int d : {128, 33}) {  // the fast minmax kernel, the general one
    SCOPED_TRACE(::testing::Message() << "d " << d);
    const int items = 300;
    auto dq = Dev(RandomF(static_cast<int64_t>(hq) * d));
    auto ds = Dev(RandomF(static_cast<int64_t>(hkv) * items * 2 * d));
    ScoreSummariesParams p;
    p.q = TensorView(dq->data(), DType::kF32, {hq, d});
    p.summaries = TensorView(ds->data(), DType::kF32, {hkv, items, 2 * d});
    p.candidates.end = items;
    p.scale = 0.1f;
    auto with = Poisoned<float>(static_cast<int64_t>(hq) * items);
    auto without = Poisoned<float>(static_cast<int64_t>(hq) * items);
    p.scores = TensorView(without->data(), DType::kF32, {hkv, group, items});
    STRATA_ASSERT_OK(gpu_->ScoreSummaries(p, nullptr));
    p.scores.data = with->data();
    p.skip_heads = static_cast<const int32_t*>(dskip->data());
    STRATA_ASSERT_OK(gpu_->ScoreSummaries(p, nullptr));
    check(*with, *without, int64_t{4} * group * items, "summary scores");
  }
  for (DType dtype : {DType::kBF16, DType::kF32}) {  // bf16 d 128: fast kernel; f32 d 17: general
    const int d = dtype == DType::kBF16 ? 128 : 17, page = 16, pages = 12;
    SCOPED_TRACE(::testing::Message() << DTypeName(dtype));
    auto dq = Dev(RandomF(static_cast<int64_t>(hq) * d));
    auto dpool = Dev(PoolBytes(RandomF(static_cast<int64_t>(hkv) * pages * page * d), dtype));
    std::vector<int32_t> table(static_cast<size_t>(hkv) * pages);
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
    auto dt = Dev(table);
    const int64_t n = static_cast<int64_t>(pages) * page;
    ScoreKeysParams p;
    p.q = TensorView(dq->data(), DType::kF32, {hq, d});
    p.k_pool = TensorView(dpool->data(), dtype, {hkv * pages, page, d});
    p.page_table = TensorView(dt->data(), DType::kI32, {hkv, pages});
    p.candidates.end = n;
    p.scale = 0.1f;
    auto with = Poisoned<float>(hq * n);
    auto without = Poisoned<float>(hq * n);
    p.scores = TensorView(without->data(), DType::kF32, {hkv, group, n});
    STRATA_ASSERT_OK(gpu_->ScoreKeys(p, nullptr));
    p.scores.data = with->data();
    p.skip_heads = static_cast<const int32_t*>(dskip->data());
    STRATA_ASSERT_OK(gpu_->ScoreKeys(p, nullptr));
    check(*with, *without, int64_t{4} * group * n, "key scores");
  }
  ForEachTopKKernel([&] {
    for (int64_t n : {int64_t{1000}, int64_t{2000}, int64_t{40000}, int64_t{70000}}) {
      SCOPED_TRACE(::testing::Message() << "n " << n);
      const int64_t k = 64;
      auto dsc = Dev(RandomF(hkv * group * n, -4.0f, 4.0f));
      VoteTopKParams p;
      p.scores = TensorView(dsc->data(), DType::kF32, {hkv, group, n});
      p.candidates.end = n;
      p.k = k;
      auto sel_with = Poisoned<int32_t>(hkv * k), sel_without = Poisoned<int32_t>(hkv * k);
      auto vote_with = Poisoned<float>(hkv * n), vote_without = Poisoned<float>(hkv * n);
      p.selected = TensorView(sel_without->data(), DType::kI32, {hkv, k});
      p.vote = TensorView(vote_without->data(), DType::kF32, {hkv, n});
      STRATA_ASSERT_OK(gpu_->VoteTopK(p, nullptr));
      p.selected.data = sel_with->data();
      p.vote.data = vote_with->data();
      p.skip_heads = static_cast<const int32_t*>(dskip->data());
      STRATA_ASSERT_OK(gpu_->VoteTopK(p, nullptr));
      check(*sel_with, *sel_without, 4 * k, "selected");
      check(*vote_with, *vote_without, 4 * n, "vote");
    }
  });
}

// SelectedAttention on the GPU clips stale middle ids (outside [middle.begin, middle.end), e.g.
// tokens the window now covers) exactly as the CPU twin.
TEST_F(SelectionTest, SelectedAttentionClipsStaleMiddleIdsAsCpu) {
  const int hkv = 2, group = 4, hq = hkv * group, d = 128, page = 16, pages = 16;
  const int slots = hkv * pages;
  std::vector<float> q = RandomF(static_cast<int64_t>(hq) * d, -2.0f, 2.0f);
  std::vector<uint8_t> kp = PoolBytes(RandomF(static_cast<int64_t>(slots) * page * d), DType::kBF16);
  std::vector<uint8_t> vp = PoolBytes(RandomF(static_cast<int64_t>(slots) * page * d), DType::kBF16);
  std::vector<int32_t> table(slots);
  for (int i = 0; i < slots; ++i) table[i] = i;
  const int64_t prefix = 8, mid_end = 200, len = 256;
  for (int fanout : {1, page}) {
    SCOPED_TRACE(::testing::Message() << "fanout " << fanout);
    // Ids below the prefix end and at or past the middle end (now in the suffix) among valid ones.
    std::vector<int32_t> parents =
        fanout == 1 ? std::vector<int32_t>{3, 20, 100, 199, 200, 230, 7, 8, 150, 201, 255, -1}
                    : std::vector<int32_t>{0, 5, 12, 15, 1, 13};
    const int64_t m = static_cast<int64_t>(parents.size()) / hkv;
    std::vector<float> want(hq * d), want_lse(hq);
    SelectedAttentionParams p;
    p.q = TensorView(q.data(), DType::kF32, {1, hq, d});
    p.k_pool = TensorView(kp.data(), DType::kBF16, {slots, page, d});
    p.v_pool = TensorView(vp.data(), DType::kBF16, {slots, page, d});
    p.page_table = TensorView(table.data(), DType::kI32, {hkv, pages});
    p.prefix_end = prefix;
    p.middle.parents = TensorView(parents.data(), DType::kI32, {hkv, m});
    p.middle.fanout = fanout;
    p.middle.begin = prefix;
    p.middle.end = mid_end;
    p.suffix_begin = mid_end;
    p.suffix_end = len;
    p.scale = 1.0f / std::sqrt(static_cast<float>(d));
    p.out = TensorView(want.data(), DType::kF32, {1, hq, d});
    p.lse = TensorView(want_lse.data(), DType::kF32, {1, hq});
    STRATA_ASSERT_OK(cpu_->SelectedAttention(p, nullptr));
    auto dq = Dev(q), dk = Dev(kp), dv = Dev(vp), dt = Dev(table), dp = Dev(parents);
    auto out = Poisoned<float>(hq * d), lse = Poisoned<float>(hq);
    p.q.data = dq->data();
    p.k_pool.data = dk->data();
    p.v_pool.data = dv->data();
    p.page_table.data = dt->data();
    p.middle.parents.data = dp->data();
    p.out.data = out->data();
    p.lse.data = lse->data();
    STRATA_ASSERT_OK(gpu_->SelectedAttention(p, nullptr));
    ExpectClose(Get<float>(*out, hq * d), want, 2e-5, 2e-4, "out");
    ExpectClose(Get<float>(*lse, hq), want_lse, 2e-5, 2e-5, "lse");
  }
}

// ---- SelectStages: the whole chain as one kernel -------------------------------------------

// One chain of selection stages: [segments ->] pages [-> keys], with its data on the host.
struct ChainCase {
  const char* name;
  int hkv, group;
  DType sum_dtype;           // page and segment summaries
  int page;                  // tokens per page
  int seg_pages;             // 0: no segment stage
  int64_t pages;             // summary rows (and page-table entries) per KV head
  int64_t keep_segs;         // k of the segment stage
  int64_t k_pages;
  bool keys;                 // a key stage after the pages
  int64_t k_tokens;
  int64_t p_begin, p_end;    // the page stage's [begin, end)
  int64_t t_begin, t_end;    // the key stage's [begin, end)
  bool identical_rows = false;  // every page summary the same (exact ties everywhere)
  bool fusable = true;          // a shape SelectStagesKernel runs (else the ops one by one)
};

// Host and device data of a ChainCase and the params of its SelectStages call.
struct Chain {
  static constexpr int kD = 128;
  ChainCase c;
  // The K (and the attention's V) pool: bf16, or fp8 codes of values in [-16, 16) with k_scale
  // and v_scale 1/16, 1/8 (the stages' scale then carries k_scale, as the policies pass it).
  DType pool_dtype = DType::kBF16;
  float k_scale = 1.0f, v_scale = 1.0f;
  int partitions = 1;  // SelectStagesParams::partitions
  int64_t segs = 0, slots = 0;
  std::vector<float> q;
  std::vector<uint8_t> page_sums, seg_sums, pool;
  std::vector<int32_t> table;
  // Per stage: candidate count and k, in order.
  std::vector<int64_t> counts, ks;

  // The params over the given buffers: q, summaries, pool, table, then per stage scores and
  // selected.
  SelectStagesParams Params(void* dq, void* dps, void* dss, void* dpool, void* dtable,
                            const std::vector<void*>& scores,
                            const std::vector<void*>& selected) const {
    SelectStagesParams p;
    p.q = TensorView(dq, DType::kF32, {c.hkv * c.group, kD});
    p.scale = 1.0f / std::sqrt(static_cast<float>(kD)) * k_scale;
    int i = 0;
    if (c.seg_pages > 0) {
      SelectStage& s = p.stages[i];
      s.summaries = TensorView(dss, c.sum_dtype, {c.hkv, segs, 2 * kD});
      s.candidates.begin = c.p_begin / c.seg_pages;
      s.candidates.end = (c.p_end - 1) / c.seg_pages + 1;
      ++i;
    }
    {
      SelectStage& s = p.stages[i];
      s.summaries = TensorView(dps, c.sum_dtype, {c.hkv, c.pages, 2 * kD});
      if (i > 0) s.candidates.fanout = c.seg_pages;
      s.candidates.begin = c.p_begin;
      s.candidates.end = c.p_end;
      ++i;
    }
    if (c.keys) {
      SelectStage& s = p.stages[i];
      s.k_pool = TensorView(dpool, pool_dtype, {slots, c.page, kD});
      s.page_table = TensorView(dtable, DType::kI32, {c.hkv, c.pages});
      s.candidates.fanout = c.page;
      s.candidates.begin = c.t_begin;
      s.candidates.end = c.t_end;
      ++i;
    }
    p.num_stages = i;
    p.partitions = partitions;
    for (int j = 0; j < i; ++j) {
      SelectStage& s = p.stages[j];
      s.k = ks[j];
      if (j > 0) s.candidates.parents = p.stages[j - 1].selected;
      s.scores = TensorView(scores[j], DType::kF32, {c.hkv, c.group, counts[j]});
      s.selected = TensorView(selected[j], DType::kI32, {c.hkv, ks[j]});
    }
    return p;
  }
};

// The chain's K pool (ch.pool_dtype) and page table (a key stage's, or an attention's): a pool
// smaller than the table, so pages share slots; a few entries are -1 or past the pool.
void AddChainPool(Chain& ch, std::mt19937& rng) {
  const ChainCase& c = ch.c;
  const bool fp8 = ch.pool_dtype == DType::kFP8E4M3;
  std::uniform_real_distribution<float> u(fp8 ? -16.0f : -1.0f, fp8 ? 16.0f : 1.0f);
  if (fp8) ch.k_scale = 1.0f / 16, ch.v_scale = 1.0f / 8;
  ch.slots = std::min<int64_t>(int64_t{c.hkv} * c.pages, 509);
  std::vector<float> k(static_cast<size_t>(ch.slots) * c.page * Chain::kD);
  for (float& x : k) x = u(rng);
  ch.pool.resize(k.size() * DTypeSize(ch.pool_dtype));
  ConvertFromF32(k.data(), ch.pool.data(), ch.pool_dtype, static_cast<int64_t>(k.size()));
  ch.table.resize(static_cast<size_t>(c.hkv) * c.pages);
  for (size_t i = 0; i < ch.table.size(); ++i) {
    ch.table[i] = i % 97 == 13 ? -1 : i % 101 == 7 ? static_cast<int32_t>(ch.slots)
                                                   : static_cast<int32_t>((i * 7) % ch.slots);
  }
}

Chain MakeChain(const ChainCase& c, std::mt19937& rng, DType pool_dtype = DType::kBF16) {
  Chain ch;
  ch.c = c;
  ch.pool_dtype = pool_dtype;
  constexpr int d = Chain::kD;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), uq(-2.0f, 2.0f);
  ch.q.resize(static_cast<size_t>(c.hkv) * c.group * d);
  for (float& x : ch.q) x = uq(rng);
  std::vector<float> ps(static_cast<size_t>(c.hkv) * c.pages * 2 * d);
  for (float& x : ps) x = u(rng);
  // Minmax rows hold min <= max per channel (what the sign-split bound of the fused kernel relies
  // on, and what summaries of keys are).
  for (size_t r = 0; r < ps.size() / (2 * d); ++r) {
    for (int e = 0; e < d; ++e) {
      float& lo = ps[r * 2 * d + e];
      float& hi = ps[r * 2 * d + d + e];
      if (lo > hi) std::swap(lo, hi);
    }
  }
  if (c.identical_rows) {
    for (size_t r = 1; r < ps.size() / (2 * d); ++r) {
      std::copy(ps.begin(), ps.begin() + 2 * d, ps.begin() + r * 2 * d);
    }
  }
  ch.page_sums.resize(ps.size() * DTypeSize(c.sum_dtype));
  ConvertFromF32(ps.data(), ch.page_sums.data(), c.sum_dtype, static_cast<int64_t>(ps.size()));
  if (c.seg_pages > 0) {
    ch.segs = (c.pages + c.seg_pages - 1) / c.seg_pages;
    std::vector<float> ss(static_cast<size_t>(c.hkv) * ch.segs * 2 * d);
    for (float& x : ss) x = u(rng);
    for (size_t r = 0; r < ss.size() / (2 * d); ++r) {
      for (int e = 0; e < d; ++e) {
        if (ss[r * 2 * d + e] > ss[r * 2 * d + d + e]) std::swap(ss[r * 2 * d + e], ss[r * 2 * d + d + e]);
      }
    }
    ch.seg_sums.resize(ss.size() * DTypeSize(c.sum_dtype));
    ConvertFromF32(ss.data(), ch.seg_sums.data(), c.sum_dtype, static_cast<int64_t>(ss.size()));
  }
  if (c.keys) AddChainPool(ch, rng);
  if (c.seg_pages > 0) {
    const int64_t s0 = c.p_begin / c.seg_pages, s1 = (c.p_end - 1) / c.seg_pages + 1;
    ch.counts.push_back(s1 - s0);
    ch.ks.push_back(c.keep_segs);
  }
  ch.counts.push_back(c.seg_pages > 0 ? c.keep_segs * c.seg_pages : c.p_end - c.p_begin);
  ch.ks.push_back(c.k_pages);
  if (c.keys) {
    ch.counts.push_back(c.k_pages * c.page);
    ch.ks.push_back(c.k_tokens);
  }
  return ch;
}

// The CPU op-by-op run of a chain: each stage's selection and its votes by candidate id (id space
// [0, end) of the stage), for the near-tie check.
struct ChainRef {
  std::vector<std::vector<int32_t>> selected;
  std::vector<std::vector<float>> vote_by_id;
  std::vector<int64_t> id_space;
};

ChainRef RunChainOnCpu(Backend* cpu, Chain& ch) {
  const ChainCase& c = ch.c;
  ChainRef r;
  std::vector<std::vector<float>> scores, votes;
  std::vector<void*> sp, sel;
  const int n = static_cast<int>(ch.counts.size());
  r.selected.resize(n);
  for (int i = 0; i < n; ++i) {
    scores.emplace_back(static_cast<size_t>(c.hkv) * c.group * std::max<int64_t>(1, ch.counts[i]));
    r.selected[i].assign(static_cast<size_t>(c.hkv) * std::max<int64_t>(1, ch.ks[i]), -7);
    sp.push_back(scores.back().data());
    sel.push_back(r.selected[i].data());
  }
  const SelectStagesParams p = ch.Params(ch.q.data(), ch.page_sums.data(), ch.seg_sums.data(),
                                         ch.pool.data(), ch.table.data(), sp, sel);
  // Stage by stage with vote outputs (SelectStagesOpByOp without them).
  for (int i = 0; i < n; ++i) {
    const SelectStage& st = p.stages[i];
    if (st.summaries.data != nullptr) {
      EXPECT_TRUE(cpu->ScoreSummaries(StageScoreSummariesParams(p, i), nullptr).ok());
    } else {
      EXPECT_TRUE(cpu->ScoreKeys(StageScoreKeysParams(p, i), nullptr).ok());
    }
    std::vector<float> vote(static_cast<size_t>(c.hkv) * std::max<int64_t>(1, ch.counts[i]));
    VoteTopKParams t = StageVoteTopKParams(p, i);
    t.vote = TensorView(vote.data(), DType::kF32, {c.hkv, ch.counts[i]});
    EXPECT_TRUE(cpu->VoteTopK(t, nullptr).ok());
    const int64_t end = st.candidates.end;
    r.id_space.push_back(end);
    std::vector<float> by_id(static_cast<size_t>(c.hkv) * (end + 1), 0.0f);
    for (int g = 0; g < c.hkv; ++g) {
      for (int64_t j = 0; j < ch.counts[i]; ++j) {
        int64_t id;
        if (st.candidates.parents.data == nullptr) {
          id = st.candidates.begin + j;
        } else {
          const int32_t parent = static_cast<const int32_t*>(
              st.candidates.parents.data)[g * st.candidates.parents.dim(1) + j / st.candidates.fanout];
          if (parent < 0) continue;
          id = static_cast<int64_t>(parent) * st.candidates.fanout + j % st.candidates.fanout;
        }
        if (id >= st.candidates.begin && id < end) by_id[g * (end + 1) + id] = vote[g * ch.counts[i] + j];
      }
    }
    r.vote_by_id.push_back(std::move(by_id));
  }
  // Trimmed to [hkv, k] once no later stage reads them (k may be 0).
  for (int i = 0; i < n; ++i) r.selected[i].resize(static_cast<size_t>(c.hkv) * ch.ks[i]);
  return r;
}

// The decode step's attention over a chain's last selection (`parents`): sinks [0, middle
// begin), the middle (the key stage's tokens, else the page stage's pages), and a window of
// `window` positions after it, over the chain's pool (k, v, table) with query q.
SelectedAttentionParams ChainAttention(const Chain& ch, int64_t window, void* q, void* k, void* v,
                                       void* table, const TensorView& parents, void* out,
                                       void* lse) {
  constexpr int kD = Chain::kD;
  const ChainCase& c = ch.c;
  const int hq = c.hkv * c.group;
  const int64_t mid_begin = c.keys ? c.t_begin : c.p_begin * c.page;
  const int64_t mid_end = c.keys ? c.t_end : c.p_end * c.page;
  SelectedAttentionParams at;
  at.q = TensorView(q, DType::kF32, {1, hq, kD});
  at.k_pool = TensorView(k, ch.pool_dtype, {ch.slots, c.page, kD});
  at.v_pool = TensorView(v, ch.pool_dtype, {ch.slots, c.page, kD});
  at.k_scale = ch.k_scale;
  at.v_scale = ch.v_scale;
  at.page_table = TensorView(table, DType::kI32, {c.hkv, c.pages});
  at.prefix_end = mid_begin;
  at.middle.parents = parents;
  at.middle.fanout = c.keys ? 1 : c.page;
  at.middle.begin = mid_begin;
  at.middle.end = mid_end;
  at.suffix_begin = mid_end;
  at.suffix_end = std::min<int64_t>(c.pages * c.page, mid_end + window);
  at.scale = 1.0f / std::sqrt(static_cast<float>(kD));
  at.out = TensorView(out, DType::kF32, {1, hq, kD});
  at.lse = TensorView(lse, DType::kF32, {1, hq});
  return at;
}

// STRATA_SELECT_STAGES_TEST_POOL=bf16|fp8_e4m3: the SelectStagesTest cases that loop over pool
// formats run that one only (unset or empty: every format), for a sanitizer run's time:
// scripts/gpu_check_select_stages.sh runs each format of them under racecheck in its own process.
// A value naming no pool format fails the test (it would otherwise run no case at all).
bool PoolWanted(DType pool) {
  const char* only = std::getenv("STRATA_SELECT_STAGES_TEST_POOL");
  if (only == nullptr || *only == '\0') return true;
  const std::string_view o(only);
  if (o != DTypeName(DType::kBF16) && o != DTypeName(DType::kFP8E4M3)) {
    ADD_FAILURE() << "STRATA_SELECT_STAGES_TEST_POOL=" << o << " names no pool format ("
                  << DTypeName(DType::kBF16) << " or " << DTypeName(DType::kFP8E4M3) << ")";
    return false;
  }
  return o == DTypeName(pool);
}

// STRATA_SELECT_STAGES_TEST_ONE_KV_HEAD=1: the PartitionedMatchesCpu and AttendMatchesCpu cases
// with one KV head (racecheck's time goes with the blocks it runs; every block runs the same code
// paths, which the per-head sizes choose, so one head covers them).
ChainCase SanitizerShape(ChainCase c) {
  const char* one = std::getenv("STRATA_SELECT_STAGES_TEST_ONE_KV_HEAD");
  if (one != nullptr && std::string_view(one) == "1") c.hkv = 1;
  return c;
}

// STRATA_SELECT_STAGES_TEST_CASE=NAME: the PartitionedMatchesCpu and AttendMatchesCpu cases
// named NAME only (unset or empty: every case), so that a sanitizer run can take the cases one
// process at a time. ExpectSomeCaseRan fails the test when the value named none of its cases.
bool CaseWanted(const char* name) {
  const char* only = std::getenv("STRATA_SELECT_STAGES_TEST_CASE");
  return only == nullptr || *only == '\0' || std::string_view(only) == name;
}
void ExpectSomeCaseRan(int ran) {
  if (ran == 0) {
    ADD_FAILURE() << "STRATA_SELECT_STAGES_TEST_CASE=" << std::getenv("STRATA_SELECT_STAGES_TEST_CASE")
                  << " names none of the test's cases";
  }
}

// STRATA_SELECT_STAGES_TEST_CHECK_ONLY=1: PartitionedMatchesCpu runs only its part with the
// selection cache's check in the kernel, with at most two KV heads (head 0 reuses, head 1
// selects), so that racecheck covers the cluster kernel's instances with the check in minutes.
bool CheckOnly() {
  const char* only = std::getenv("STRATA_SELECT_STAGES_TEST_CHECK_ONLY");
  return only != nullptr && std::string_view(only) == "1";
}

class SelectStagesTest : public SelectionTest {
 protected:
  // Per stage of `ch` a poisoned scores and selected buffer in *bufs (in that order), their
  // pointers in *sp and *sel.
  void StageBuffers(const Chain& ch, std::vector<std::unique_ptr<Buffer>>* bufs,
                    std::vector<void*>* sp, std::vector<void*>* sel) {
    for (size_t i = 0; i < ch.counts.size(); ++i) {
      bufs->push_back(Poisoned<float>(int64_t{ch.c.hkv} * ch.c.group * ch.counts[i]));
      sp->push_back(bufs->back()->data());
      bufs->push_back(Poisoned<int32_t>(int64_t{ch.c.hkv} * ch.ks[i], 0x7f));
      sel->push_back(bufs->back()->data());
    }
  }

  // Runs `ch` on the GPU (poisoned outputs, optionally skip flags) and returns each stage's
  // selection.
  std::vector<std::vector<int32_t>> RunOnGpu(const Chain& ch, const int32_t* skip = nullptr) {
    auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums), dpool = Dev(ch.pool);
    auto dt = Dev(ch.table);
    std::vector<std::unique_ptr<Buffer>> bufs;
    std::vector<void*> sp, sel;
    StageBuffers(ch, &bufs, &sp, &sel);
    SelectStagesParams p =
        ch.Params(dq->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
    p.skip_heads = skip;
    const absl::Status st = gpu_->SelectStages(p, nullptr);
    std::vector<std::vector<int32_t>> out;
    if (!st.ok()) {
      ADD_FAILURE() << st;
      return out;
    }
    for (size_t i = 0; i < ch.counts.size(); ++i) {
      out.push_back(Get<int32_t>(*bufs[2 * i + 1], int64_t{ch.c.hkv} * ch.ks[i]));
    }
    return out;
  }

  // Compares the GPU's selections with the CPU's stage by stage while the stages before agree
  // exactly (a near-tie swap changes the next stage's candidates); returns the stages compared.
  int Compare(const Chain& ch, const ChainRef& ref, const std::vector<std::vector<int32_t>>& got) {
    int compared = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "stage " << i);
      const int64_t end = ref.id_space[i];
      const auto bad = std::find_if(got[i].begin(), got[i].end(),
                                    [&](int32_t id) { return id < -1 || id >= end; });
      if (bad != got[i].end()) {
        ADD_FAILURE() << "id " << *bad << " outside [-1, " << end << ")";
        break;
      }
      std::vector<int64_t> identity(static_cast<size_t>(ch.c.hkv) * (end + 2));
      for (int g = 0; g < ch.c.hkv; ++g) {
        for (int64_t id = 0; id <= end; ++id) identity[g * (end + 2) + id] = id;
      }
      if (ch.partitions == 1) {
        ExpectSameTopK(got[i], ref.selected[i], ref.vote_by_id[i], identity, ch.c.hkv, ch.ks[i],
                       end + 1, seed_);
      } else {
        // Each part's slice on its own (its -1 padding ends the slice, not the row).
        const int64_t kp = ch.ks[i] / ch.partitions;
        for (int g = 0; g < ch.c.hkv; ++g) {
          const std::vector<float> vote(ref.vote_by_id[i].begin() + g * (end + 1),
                                        ref.vote_by_id[i].begin() + (g + 1) * (end + 1));
          const std::vector<int64_t> ident(identity.begin() + g * (end + 2),
                                           identity.begin() + (g + 1) * (end + 2));
          for (int part = 0; part < ch.partitions; ++part) {
            SCOPED_TRACE(::testing::Message() << "head " << g << " part " << part);
            const int64_t o = g * ch.ks[i] + part * kp;
            ExpectSameTopK(std::vector<int32_t>(got[i].begin() + o, got[i].begin() + o + kp),
                           std::vector<int32_t>(ref.selected[i].begin() + o,
                                                ref.selected[i].begin() + o + kp),
                           vote, ident, 1, kp, end + 1, seed_);
          }
        }
      }
      ++compared;
      if (got[i] != ref.selected[i]) break;
    }
    return compared;
  }
};

// The chain as one kernel (STRATA_SELECT_STAGES=require_fused: the backend fails rather than fall
// back to the ops) and op by op on the GPU, each against the CPU twin's ops, at the shapes of the
// decode step (quest one- and two-level, tokenselect) and awkward ones (group 1-3, three stages,
// k of 0, k above the candidates, 8192 candidates, exact ties everywhere, page-table entries -1
// or past the pool, pages sharing slots), and two shapes the kernel does not run (f32 summaries,
// too many candidates), which must fall back to the ops.
TEST_F(SelectStagesTest, MatchesCpuOps) {
  const ChainCase cases[] = {
      {"quest 128K", 8, 4, DType::kBF16, 64, 0, 2048, 0, 32, false, 0, 1, 2044, 0, 0},
      {"quest two-level", 4, 4, DType::kBF16, 64, 16, 16384, 128, 32, false, 0, 1, 16380, 0, 0},
      {"tokenselect 128K", 8, 4, DType::kBF16, 64, 0, 2048, 0, 128, true, 2048, 1, 2044, 64,
       2044 * 64 - 5},
      {"three stages", 3, 3, DType::kBF16, 16, 4, 3000, 100, 50, true, 300, 2, 2990, 40, 47000},
      {"group 1 tiny", 2, 1, DType::kBF16, 16, 0, 3, 0, 5, true, 7, 0, 3, 0, 48},
      {"group 2 k 0", 1, 2, DType::kBF16, 16, 0, 17, 0, 0, true, 4, 0, 17, 0, 272},
      {"8192 candidates", 2, 4, DType::kBF16, 16, 0, 8192, 0, 4000, false, 0, 0, 8192, 0, 0},
      {"k above n", 2, 4, DType::kBF16, 16, 0, 129, 0, 129, true, 2100, 0, 129, 0, 129 * 16},
      {"ties", 3, 4, DType::kBF16, 64, 0, 2048, 0, 32, false, 0, 3, 2048, 0, 0, true},
      // Key stages at page sizes other than 64: a block's share of the keys starting inside a
      // page (pages of 128), spanning many short pages (32), and pages of 8 tokens.
      {"keys page 128", 2, 4, DType::kBF16, 128, 0, 300, 0, 40, true, 1500, 3, 297, 100,
       297 * 128 - 7},
      {"keys page 32", 3, 2, DType::kBF16, 32, 0, 500, 0, 100, true, 700, 0, 500, 33,
       500 * 32 - 40},
      {"keys page 8", 2, 4, DType::kBF16, 8, 0, 400, 0, 60, true, 200, 0, 400, 0, 3200},
      // f32 summaries: not the fused kernel's (the ops one by one).
      {"f32 summaries", 2, 4, DType::kF32, 16, 4, 1000, 50, 40, true, 300, 1, 990, 20, 15800,
       false, false},
      // 2 * 16 * 1024 candidates: more than any cluster holds (the ops one by one).
      {"too many", 1, 4, DType::kBF16, 16, 0, 32768, 0, 100, false, 0, 0, 32768, 0, 0, false,
       false},
  };
  int stages = 0, compared = 0;
  for (const ChainCase& c : cases) {
    // Key stages over bf16 and over fp8 pools (the kernel's fp8 form).
    for (DType pool : {DType::kBF16, DType::kFP8E4M3}) {
      if ((pool == DType::kFP8E4M3 && !c.keys) || !PoolWanted(pool)) continue;
      SCOPED_TRACE(::testing::Message() << c.name << ", " << DTypeName(pool) << " keys");
      Chain ch = MakeChain(c, rng_, pool);
      const ChainRef ref = RunChainOnCpu(cpu_, ch);
      if (c.identical_rows) {
        // Every valid candidate ties: the lowest ids win, in order (the NaN-free rows).
        for (int g = 0; g < c.hkv; ++g) {
          for (int64_t j = 0; j < c.k_pages; ++j) {
            ASSERT_EQ(ref.selected[0][g * c.k_pages + j], c.p_begin + j);
          }
        }
      }
      if (c.fusable) {
        setenv("STRATA_SELECT_STAGES", "require_fused", 1);
      } else {
        unsetenv("STRATA_SELECT_STAGES");
      }
      const auto fused = RunOnGpu(ch);
      setenv("STRATA_SELECT_STAGES", "opbyop", 1);
      const auto ops = RunOnGpu(ch);
      unsetenv("STRATA_SELECT_STAGES");
      stages += 2 * static_cast<int>(ch.counts.size());
      {
        SCOPED_TRACE("fused");
        compared += Compare(ch, ref, fused);
      }
      {
        SCOPED_TRACE("op by op");
        compared += Compare(ch, ref, ops);
      }
      if (c.identical_rows) {
        EXPECT_EQ(fused, ref.selected) << "exact ties must match exactly";
      }
    }
  }
  // Near-ties that cut a comparison short are rare on random data.
  EXPECT_GE(compared, stages - 2);
}

// SelectStages in parts (SelectStagesParams::partitions): the partitioned kernel
// (STRATA_SELECT_STAGES=require_fused; small parts by one warp, again with the block's radix
// select for every stage, and again without the slot prefetch, STRATA_SELECT_PART_PREFETCH=0)
// and the ops one by one (VoteTopK in parts), each against
// the CPU's ops part by part, at tokenselect's shapes (one- and two-level, 8 and 16 parts) and
// awkward ones (group 1-3, k above the candidates, parts of unequal sizes, table entries -1 or
// past the pool); with the attention in the kernel (require_fused; its parts merged through
// global memory by the last block to arrive (SelectStagesParams::arrivals, left zero) or by a
// second kernel) and after it (separate), out / lse against the CPU's attention over the GPU's
// selection, then a second query with every other head flagged (those attend their kept
// selection), then the selection cache's check in the call (in the kernel and as its own op);
// over bf16 and fp8 pools. Two cases in one part run the same through the cluster kernel
// (SelectStagesKernel) for its check: quest's forms run it inside the kernel; tokenselect's only
// without the attention over bf16 pools, else (its attention takes the key stage's scores, or
// the key pool is fp8) as the check's kernel first.
TEST_F(SelectStagesTest, PartitionedMatchesCpu) {
  struct PartCase {
    ChainCase c;
    int parts;
    int64_t window;
  };
  const PartCase cases[] = {
      {{"tokenselect 128K", 8, 4, DType::kBF16, 64, 0, 2048, 0, 128, true, 2048, 1, 2044, 64,
        2044 * 64 - 5},
       16, 256},
      {{"tokenselect 128K", 8, 4, DType::kBF16, 64, 0, 2048, 0, 128, true, 2048, 1, 2044, 64,
        2044 * 64 - 5},
       8, 250},
      {{"tokenselect two-level", 4, 4, DType::kBF16, 64, 8, 4096, 128, 64, true, 1024, 1, 4090,
        64, 4090 * 64 - 9},
       16, 200},
      {{"three stages", 3, 3, DType::kBF16, 16, 4, 3000, 100, 48, true, 300, 2, 2990, 40, 47000},
       4, 37},
      {{"group 1", 2, 1, DType::kBF16, 16, 0, 203, 0, 24, true, 96, 0, 203, 0, 203 * 16 - 1}, 2,
       0},
      {{"k above n", 2, 2, DType::kBF16, 16, 0, 37, 0, 32, true, 1024, 3, 37, 48, 37 * 16}, 4,
       5},
      // Fewer parts than query heads per KV head (each block's partials hold every head's).
      {{"parts below the group", 2, 4, DType::kBF16, 16, 0, 300, 0, 32, true, 256, 1, 300, 16,
        300 * 16 - 3},
       2, 20},
      // One part: the cluster kernel (SelectStagesKernel), here for the selection cache's check
      // in it (AttendMatchesCpu covers the rest); page-level (quest) and token-level.
      {{"one part, quest", 8, 4, DType::kBF16, 64, 0, 2048, 0, 32, false, 0, 1, 2044, 0, 0}, 1,
       256},
      {{"one part, tokenselect", 8, 4, DType::kBF16, 64, 0, 2048, 0, 128, true, 2048, 1, 2044,
        64, 2044 * 64 - 5},
       1, 256},
  };
  constexpr int kD = Chain::kD;
  int compared = 0, stages = 0, ran = 0;
  for (const PartCase& pc : cases) {
    if (!CaseWanted(pc.c.name)) continue;
    ++ran;
    // bf16 and fp8 pools (the kernel's fp8 form: key stage and attention on fp8 rows).
    for (DType pool : {DType::kBF16, DType::kFP8E4M3}) {
      if (!PoolWanted(pool)) continue;
      ChainCase c = SanitizerShape(pc.c);
      const bool check_only = CheckOnly();
      if (check_only) c.hkv = std::min(c.hkv, 2);
      SCOPED_TRACE(::testing::Message() << c.name << ", " << pc.parts << " parts, "
                                        << DTypeName(pool) << " pools");
      Chain ch = MakeChain(c, rng_, pool);
      if (ch.pool.empty()) AddChainPool(ch, rng_);  // page-level: the attention's K pool
      ch.partitions = pc.parts;
      const ChainRef ref = RunChainOnCpu(cpu_, ch);
      for (const char* mode : {"require_fused", "opbyop"}) {
        if (check_only) break;
        SCOPED_TRACE(mode);
        setenv("STRATA_SELECT_STAGES", mode, 1);
        compared += Compare(ch, ref, RunOnGpu(ch));
        stages += static_cast<int>(ch.counts.size());
      }
      // The kernel with one of its paths switched off (var=0), against the CPU.
      auto fused_without = [&](const char* trace, const char* var) {
        if (check_only) return;
        SCOPED_TRACE(trace);
        setenv("STRATA_SELECT_STAGES", "require_fused", 1);
        setenv(var, "0", 1);
        compared += Compare(ch, ref, RunOnGpu(ch));
        unsetenv(var);
        stages += static_cast<int>(ch.counts.size());
      };
      // Every stage selected by the block's radix passes (small parts are otherwise one warp's:
      // PartWarpTopK).
      fused_without("require_fused, no warp top-k", "STRATA_SELECT_PART_WARP_TOPK");
      // Every key stage's table reads at its start (no slot prefetch during the stage before).
      fused_without("require_fused, no slot prefetch", "STRATA_SELECT_PART_PREFETCH");
      // The attention.
      const float vmax = pool == DType::kFP8E4M3 ? 16.0f : 1.0f;
      std::vector<float> vf = RandomF(static_cast<int64_t>(ch.slots) * c.page * kD, -vmax, vmax);
      const std::vector<uint8_t> vpool = PoolBytes(vf, pool);
      const int hq = c.hkv * c.group;
      const int last = static_cast<int>(ch.counts.size()) - 1;
      auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums), dpool = Dev(ch.pool);
      auto dv = Dev(vpool), dt = Dev(ch.table);
      std::vector<std::unique_ptr<Buffer>> bufs;
      std::vector<void*> sp, sel;
      StageBuffers(ch, &bufs, &sp, &sel);
      auto dout = Poisoned<float>(int64_t{hq} * kD), dlse = Poisoned<float>(hq);
      auto cpu_attention = [&](std::vector<float>& q, std::vector<int32_t>& final,
                               std::vector<float>* out, std::vector<float>* lse) {
        out->assign(static_cast<size_t>(hq) * kD, 0.0f);
        lse->assign(hq, 0.0f);
        const SelectedAttentionParams at = ChainAttention(
            ch, pc.window, q.data(), ch.pool.data(), const_cast<uint8_t*>(vpool.data()),
            ch.table.data(), TensorView(final.data(), DType::kI32, {c.hkv, ch.ks[last]}),
            out->data(), lse->data());
        ASSERT_TRUE(cpu_->SelectedAttention(at, nullptr).ok());
      };
      // The stages' selections against the CPU's and out / lse against the CPU's attention over
      // the GPU's last selection, after a call with the attention.
      auto check_fused = [&](const char* what) {
        std::vector<std::vector<int32_t>> got;
        for (size_t i = 0; i < ch.counts.size(); ++i) {
          got.push_back(Get<int32_t>(*bufs[2 * i + 1], int64_t{c.hkv} * ch.ks[i]));
        }
        compared += Compare(ch, ref, got);
        stages += static_cast<int>(ch.counts.size());
        std::vector<float> want_out, want_lse;
        cpu_attention(ch.q, got[last], &want_out, &want_lse);
        ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, what);
        ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, what);
        return got;
      };
      // SelectStagesParams::arrivals (zero; each call leaves them zero), passed while
      // `use_arrivals`.
      auto darrivals = Dev(std::vector<int32_t>(c.hkv, 0));
      bool use_arrivals = true;
      // The chain with the attention in the call, for query q and the heads flagged in skip
      // (device memory; null: none).
      auto select_and_attend = [&](void* q, const int32_t* skip,
                                   const SelectionCacheCheckParams* check = nullptr) {
        SelectStagesParams p =
            ch.Params(q, dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
        p.skip_heads = skip;
        p.cache_check = check;
        if (use_arrivals) p.arrivals = TensorView(darrivals->data(), DType::kI32, {c.hkv});
        const SelectedAttentionParams at =
            ChainAttention(ch, pc.window, q, dpool->data(), dv->data(), dt->data(),
                           p.stages[last].selected, dout->data(), dlse->data());
        p.attend = &at;
        return gpu_->SelectStages(p, nullptr);
      };
      // The attention in the kernel (with and without the slot prefetch: the last stage's
      // pool rows from the slots the stage before looked up, or from its own table reads; the
      // parts merged through global memory by the last block to arrive (arrivals given) or by
      // a second kernel) and after it.
      enum class Merge { kLastBlock, kSecondKernel };
      struct AttendMode {
        const char* attend;
        bool prefetch;
        Merge merge;
      };
      for (const AttendMode am : {AttendMode{"require_fused", true, Merge::kLastBlock},
                                  AttendMode{"require_fused", false, Merge::kLastBlock},
                                  AttendMode{"require_fused", true, Merge::kSecondKernel},
                                  AttendMode{"separate", true, Merge::kLastBlock}}) {
        if (check_only) break;
        SCOPED_TRACE(::testing::Message()
                     << am.attend << (am.prefetch ? "" : ", no prefetch")
                     << (am.merge == Merge::kSecondKernel ? ", merged by a second kernel" : ""));
        setenv("STRATA_SELECT_STAGES", "require_fused", 1);
        setenv("STRATA_SELECT_ATTEND", am.attend, 1);
        if (!am.prefetch) setenv("STRATA_SELECT_PART_PREFETCH", "0", 1);
        use_arrivals = am.merge != Merge::kSecondKernel;
        const absl::Status st = select_and_attend(dq->data(), nullptr);
        ASSERT_TRUE(st.ok()) << st;
        const std::vector<std::vector<int32_t>> got = check_fused("out / lse");

        std::vector<float> q2 = RandomF(static_cast<int64_t>(ch.q.size()), -2.0f, 2.0f);
        auto dq2 = Dev(q2);
        std::vector<int32_t> skip(c.hkv);
        for (int g = 0; g < c.hkv; ++g) skip[g] = g % 2;
        auto dskip = Dev(skip);
        const absl::Status st2 =
            select_and_attend(dq2->data(), static_cast<const int32_t*>(dskip->data()));
        ASSERT_TRUE(st2.ok()) << st2;
        std::vector<int32_t> final2 =
            Get<int32_t>(*bufs[2 * last + 1], int64_t{c.hkv} * ch.ks[last]);
        for (int g = 0; g < c.hkv; ++g) {
          if (!skip[g]) continue;
          for (int64_t j = 0; j < ch.ks[last]; ++j) {
            ASSERT_EQ(final2[g * ch.ks[last] + j], got[last][g * ch.ks[last] + j]) << "head " << g;
          }
        }
        std::vector<float> want_out, want_lse;
        cpu_attention(q2, final2, &want_out, &want_lse);
        ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, "out, skip");
        ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, "lse, skip");
        // Left zero for the next call.
        EXPECT_EQ(Get<int32_t>(*darrivals, c.hkv), std::vector<int32_t>(c.hkv, 0));
        unsetenv("STRATA_SELECT_PART_PREFETCH");
        use_arrivals = true;
      }
      // The selection cache's check in the call (SelectStagesParams::cache_check), in the kernel
      // and (STRATA_SELECT_CHECK_IN_KERNEL=0) as its own op first, with the attention in the
      // kernel and after it (one part: the cluster kernel's instances with the check, without an
      // attention and with quest's, or the check's kernel before the others; in parts the check
      // is then its own op): the cache's state as the CPU's check leaves
      // it; a head that reuses keeps its selection (here the one made for q2), the others select
      // for q (as the plain call for q did); out / lse as the CPU's attention over that selection.
      for (const bool in_kernel : {true, false})
      for (const char* attend_mode : {"require_fused", "separate"}) {
        if (check_only && !in_kernel) break;
        SCOPED_TRACE(::testing::Message()
                     << (in_kernel ? "cache check in the kernel" : "cache check as its own op")
                     << ", attention " << attend_mode);
        setenv("STRATA_SELECT_STAGES", "require_fused", 1);
        setenv("STRATA_SELECT_ATTEND", attend_mode, 1);
        if (!in_kernel) setenv("STRATA_SELECT_CHECK_IN_KERNEL", "0", 1);
        const int64_t n = int64_t{c.group} * kD, final_n = int64_t{c.hkv} * ch.ks[last];
        ASSERT_TRUE(select_and_attend(dq->data(), nullptr).ok());
        const std::vector<int32_t> for_q = Get<int32_t>(*bufs[2 * last + 1], final_n);
        std::vector<float> q2 = RandomF(static_cast<int64_t>(ch.q.size()), -2.0f, 2.0f);
        auto dq2 = Dev(q2);
        ASSERT_TRUE(select_and_attend(dq2->data(), nullptr).ok());
        const std::vector<int32_t> for_q2 = Get<int32_t>(*bufs[2 * last + 1], final_n);
        // Head g's cached query: q's own for even g (a hit), another for odd g (a miss); the
        // last head invalid (a miss).
        std::vector<float> cached(static_cast<size_t>(c.hkv * n));
        const std::vector<float> other = RandomF(c.hkv * n, -2.0f, 2.0f);
        for (int64_t i = 0; i < c.hkv * n; ++i) cached[i] = (i / n) % 2 == 0 ? ch.q[i] : other[i];
        std::vector<int32_t> valid(c.hkv, 1);
        valid[c.hkv - 1] = 0;
        std::vector<int32_t> reuse(c.hkv, -1);
        int64_t hits = 3;
        auto dcached = Dev(cached), dvalid = Dev(valid), dreuse = Dev(reuse);
        auto dhits = Dev(std::vector<int64_t>{hits});
        auto check_of = [&](void* q, void* cq, void* v, void* r, int64_t* h) {
          SelectionCacheCheckParams cc;
          cc.q = TensorView(q, DType::kF32, {hq, kD});
          cc.cached_q = TensorView(cq, DType::kF32, {c.hkv, n});
          cc.valid = TensorView(v, DType::kI32, {c.hkv});
          cc.theta = 0.9f;
          cc.reuse = TensorView(r, DType::kI32, {c.hkv});
          cc.hit_count = h;
          return cc;
        };
        const SelectionCacheCheckParams hc =
            check_of(ch.q.data(), cached.data(), valid.data(), reuse.data(), &hits);
        ASSERT_TRUE(cpu_->SelectionCacheCheck(hc, nullptr).ok());
        const SelectionCacheCheckParams gc =
            check_of(dq->data(), dcached->data(), dvalid->data(), dreuse->data(),
                     static_cast<int64_t*>(dhits->data()));
        const absl::Status st3 = select_and_attend(dq->data(), nullptr, &gc);
        ASSERT_TRUE(st3.ok()) << st3;
        EXPECT_EQ(Get<float>(*dcached, c.hkv * n), cached);
        EXPECT_EQ(Get<int32_t>(*dvalid, c.hkv), valid);
        EXPECT_EQ(Get<int32_t>(*dreuse, c.hkv), reuse);
        EXPECT_EQ(Get<int64_t>(*dhits, 1)[0], hits);
        std::vector<int32_t> final3 = Get<int32_t>(*bufs[2 * last + 1], final_n);
        for (int g = 0; g < c.hkv; ++g) {
          const std::vector<int32_t>& want = reuse[g] != 0 ? for_q2 : for_q;
          for (int64_t j = 0; j < ch.ks[last]; ++j) {
            ASSERT_EQ(final3[g * ch.ks[last] + j], want[g * ch.ks[last] + j])
                << "head " << g << (reuse[g] != 0 ? " (reused)" : "");
          }
        }
        std::vector<float> want_out, want_lse;
        cpu_attention(ch.q, final3, &want_out, &want_lse);
        ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, "out, cache check");
        ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, "lse, cache check");
        EXPECT_EQ(Get<int32_t>(*darrivals, c.hkv), std::vector<int32_t>(c.hkv, 0));
        unsetenv("STRATA_SELECT_CHECK_IN_KERNEL");
      }
      unsetenv("STRATA_SELECT_STAGES");
      unsetenv("STRATA_SELECT_ATTEND");
    }
  }
  ExpectSomeCaseRan(ran);
  EXPECT_GE(compared, stages - 2);
}

// Heads flagged in skip_heads keep their outputs (here the poison); the others are as without
// flags.
TEST_F(SelectStagesTest, SkipHeadsLeaveFlaggedHeadsUntouched) {
  const ChainCase c = {"tokenselect", 4, 4, DType::kBF16, 64, 0, 600, 0, 64, true, 512, 1, 590,
                       64, 590 * 64 - 3};
  Chain ch = MakeChain(c, rng_);
  const std::vector<int32_t> skip = {0, 1, 1, 0};
  auto dskip = Dev(skip);
  setenv("STRATA_SELECT_STAGES", "require_fused", 1);
  const auto without = RunOnGpu(ch);
  const auto with = RunOnGpu(ch, static_cast<const int32_t*>(dskip->data()));
  unsetenv("STRATA_SELECT_STAGES");
  for (size_t i = 0; i < with.size(); ++i) {
    const int64_t k = ch.ks[i];
    for (int g = 0; g < c.hkv; ++g) {
      for (int64_t j = 0; j < k; ++j) {
        if (skip[g]) {
          EXPECT_EQ(with[i][g * k + j], 0x7f7f7f7f) << "stage " << i << " head " << g;
        } else {
          EXPECT_EQ(with[i][g * k + j], without[i][g * k + j]) << "stage " << i << " head " << g;
        }
      }
    }
  }
}

// SelectStages with `attend` (the decode step's attention over the last stage's selection): the
// attention inside the selection kernel (STRATA_SELECT_ATTEND=require_fused; where the last stage
// scores the middle's tokens, with the middle's scores taken from it and, with
// STRATA_SELECT_ATTEND_SCORES=0, from its K rows: the same products, so the same bits) and as its
// own op after the kernel (=separate), against the CPU: every stage's selection as in
// MatchesCpuOps, and
// out / lse against the CPU's SelectedAttention over the GPU's final selection (so a near-tie at
// the k-th place does not change what is compared), with sinks, the window, page-table entries
// -1 or past the pool, -1 ids (k above the candidates) and groups 1-4. Then skip_heads on a
// second query: flagged heads keep their selection and attend it with the new query.
TEST_F(SelectStagesTest, AttendMatchesCpu) {
  struct AttendCase {
    ChainCase c;
    int64_t window;
  };
  const AttendCase cases[] = {
      {{"quest 128K", 8, 4, DType::kBF16, 64, 0, 2048, 0, 32, false, 0, 1, 2044, 0, 0}, 256},
      {{"tokenselect 128K", 8, 4, DType::kBF16, 64, 0, 2048, 0, 128, true, 2048, 1, 2044, 64,
        2044 * 64 - 5},
       250},
      {{"quest two-level", 4, 4, DType::kBF16, 64, 16, 16384, 128, 32, false, 0, 1, 16380, 0, 0},
       200},
      {{"three stages", 3, 3, DType::kBF16, 16, 4, 3000, 100, 50, true, 300, 2, 2990, 40, 47000},
       37},
      {{"group 1 tiny", 2, 1, DType::kBF16, 16, 0, 3, 0, 5, true, 7, 0, 3, 0, 48}, 0},
      {{"group 2 k 0", 1, 2, DType::kBF16, 16, 0, 17, 0, 0, true, 4, 0, 17, 0, 272}, 0},
  };
  constexpr int kD = Chain::kD;
  int ran = 0;
  for (const AttendCase& ac : cases) {
    if (!CaseWanted(ac.c.name)) continue;
    ++ran;
    // bf16 pools, and fp8 pools (the kernel's fp8 form: key stage and attention on fp8 rows).
    for (DType pool : {DType::kBF16, DType::kFP8E4M3}) {
      if (!PoolWanted(pool)) continue;
      const ChainCase c = SanitizerShape(ac.c);
      SCOPED_TRACE(::testing::Message() << c.name << ", " << DTypeName(pool) << " pools");
      Chain ch = MakeChain(c, rng_, pool);
      if (ch.pool.empty()) AddChainPool(ch, rng_);
      const ChainRef ref = RunChainOnCpu(cpu_, ch);
      const float vmax = pool == DType::kFP8E4M3 ? 16.0f : 1.0f;
      std::vector<float> vf = RandomF(static_cast<int64_t>(ch.slots) * c.page * kD, -vmax, vmax);
      const std::vector<uint8_t> vpool = PoolBytes(vf, pool);
      const int hq = c.hkv * c.group;
      auto attention = [&](void* q, void* k, void* v, void* table, const TensorView& parents,
                           void* out, void* lse) {
        return ChainAttention(ch, ac.window, q, k, v, table, parents, out, lse);
      };
      const int last = static_cast<int>(ch.counts.size()) - 1;
      auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums), dpool = Dev(ch.pool);
      auto dv = Dev(vpool), dt = Dev(ch.table);
      std::vector<std::unique_ptr<Buffer>> bufs;
      std::vector<void*> sp, sel;
      StageBuffers(ch, &bufs, &sp, &sel);
      auto dout = Poisoned<float>(int64_t{hq} * kD), dlse = Poisoned<float>(hq);
      // The CPU's attention over a selection `final` (host) with query `q` (host).
      auto cpu_attention = [&](std::vector<float>& q, std::vector<int32_t>& final,
                               std::vector<float>* out, std::vector<float>* lse) {
        out->assign(static_cast<size_t>(hq) * kD, 0.0f);
        lse->assign(hq, 0.0f);
        const SelectedAttentionParams at = attention(
            q.data(), ch.pool.data(), const_cast<uint8_t*>(vpool.data()), ch.table.data(),
            TensorView(final.data(), DType::kI32, {c.hkv, ch.ks[last]}), out->data(), lse->data());
        ASSERT_TRUE(cpu_->SelectedAttention(at, nullptr).ok());
      };
      // out and lse of the fused modes, for the bitwise comparison of the two ways to the scores.
      std::vector<std::vector<float>> fused_out, fused_lse;
      for (const char* mode : {"require_fused", "require_fused rows", "separate"}) {
        SCOPED_TRACE(mode);
        const std::string_view m(mode);
        setenv("STRATA_SELECT_STAGES", "require_fused", 1);
        setenv("STRATA_SELECT_ATTEND", m == "separate" ? "separate" : "require_fused", 1);
        setenv("STRATA_SELECT_ATTEND_SCORES", m == "require_fused rows" ? "0" : "1", 1);
        SelectStagesParams p =
            ch.Params(dq->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
        const SelectedAttentionParams at =
            attention(dq->data(), dpool->data(), dv->data(), dt->data(), p.stages[last].selected,
                      dout->data(), dlse->data());
        p.attend = &at;
        const absl::Status st = gpu_->SelectStages(p, nullptr);
        ASSERT_TRUE(st.ok()) << st;
        std::vector<std::vector<int32_t>> got;
        for (size_t i = 0; i < ch.counts.size(); ++i) {
          got.push_back(Get<int32_t>(*bufs[2 * i + 1], int64_t{c.hkv} * ch.ks[i]));
        }
        Compare(ch, ref, got);
        std::vector<float> want_out, want_lse;
        cpu_attention(ch.q, got[last], &want_out, &want_lse);
        ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, "out");
        ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, "lse");
        if (m != "separate") {
          fused_out.push_back(Get<float>(*dout, int64_t{hq} * kD));
          fused_lse.push_back(Get<float>(*dlse, hq));
        }

        // A second query with every other head flagged: those keep `got`'s selection and attend
        // it with the new query; the others select again.
        std::vector<float> q2 = RandomF(static_cast<int64_t>(ch.q.size()), -2.0f, 2.0f);
        auto dq2 = Dev(q2);
        std::vector<int32_t> skip(c.hkv);
        for (int g = 0; g < c.hkv; ++g) skip[g] = g % 2;
        auto dskip = Dev(skip);
        SelectStagesParams p2 =
            ch.Params(dq2->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
        p2.skip_heads = static_cast<const int32_t*>(dskip->data());
        const SelectedAttentionParams at2 =
            attention(dq2->data(), dpool->data(), dv->data(), dt->data(),
                      p2.stages[last].selected, dout->data(), dlse->data());
        p2.attend = &at2;
        const absl::Status st2 = gpu_->SelectStages(p2, nullptr);
        ASSERT_TRUE(st2.ok()) << st2;
        std::vector<int32_t> final2 = Get<int32_t>(*bufs[2 * last + 1], int64_t{c.hkv} * ch.ks[last]);
        for (int g = 0; g < c.hkv; ++g) {
          if (!skip[g]) continue;
          for (int64_t j = 0; j < ch.ks[last]; ++j) {
            ASSERT_EQ(final2[g * ch.ks[last] + j], got[last][g * ch.ks[last] + j]) << "head " << g;
          }
        }
        cpu_attention(q2, final2, &want_out, &want_lse);
        ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, "out, skip");
        ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, "lse, skip");
      }
      ASSERT_EQ(fused_out.size(), 2u);
      for (size_t i = 0; i < fused_out[0].size(); ++i) {
        ASSERT_EQ(std::memcmp(&fused_out[0][i], &fused_out[1][i], sizeof(float)), 0)
            << "out " << i << ": " << fused_out[0][i] << " scored, " << fused_out[1][i] << " rows";
      }
      for (size_t i = 0; i < fused_lse[0].size(); ++i) {
        ASSERT_EQ(std::memcmp(&fused_lse[0][i], &fused_lse[1][i], sizeof(float)), 0)
            << "lse " << i << ": " << fused_lse[0][i] << " scored, " << fused_lse[1][i] << " rows";
      }
      unsetenv("STRATA_SELECT_STAGES");
      unsetenv("STRATA_SELECT_ATTEND");
      unsetenv("STRATA_SELECT_ATTEND_SCORES");
    }
  }
  ExpectSomeCaseRan(ran);
}

// An attention the selection kernel cannot hold (more sink positions than its blocks stage) runs
// as its own op after the kernel, and matches the CPU, unless STRATA_SELECT_ATTEND=require_fused,
// which fails; an attention the backend refuses fails the call before anything runs (the stages'
// outputs keep their poison).
TEST_F(SelectStagesTest, AttendOutsideTheKernel) {
  constexpr int kD = Chain::kD;
  const ChainCase c = {"quest, 1120 sinks", 2, 4, DType::kBF16, 16, 0, 200, 0, 8, false, 0, 70,
                       190, 0, 0};
  Chain ch = MakeChain(c, rng_);
  if (ch.pool.empty()) AddChainPool(ch, rng_);
  const std::vector<uint8_t> vpool =
      PoolBytes(RandomF(static_cast<int64_t>(ch.slots) * c.page * kD), DType::kBF16);
  const int hq = c.hkv * c.group;
  auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums), dpool = Dev(ch.pool);
  auto dv = Dev(vpool), dt = Dev(ch.table);
  auto dout = Poisoned<float>(int64_t{hq} * kD), dlse = Poisoned<float>(hq);
  // 1120 sink positions and a window of 160: more than 16 blocks stage.
  auto attention = [&](void* q, void* k, void* v, void* table, const TensorView& parents,
                       void* out, void* lse) {
    return ChainAttention(ch, 160, q, k, v, table, parents, out, lse);
  };
  setenv("STRATA_SELECT_STAGES", "require_fused", 1);
  for (const char* mode : {"require_fused", ""}) {
    SCOPED_TRACE(mode);
    setenv("STRATA_SELECT_ATTEND", mode, 1);
    std::vector<std::unique_ptr<Buffer>> bufs;
    std::vector<void*> sp, sel;
    StageBuffers(ch, &bufs, &sp, &sel);
    SelectStagesParams p =
        ch.Params(dq->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
    const SelectedAttentionParams at = attention(dq->data(), dpool->data(), dv->data(),
                                                 dt->data(), p.stages[0].selected, dout->data(),
                                                 dlse->data());
    p.attend = &at;
    const absl::Status st = gpu_->SelectStages(p, nullptr);
    if (std::string_view(mode) == "require_fused") {
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
      continue;
    }
    ASSERT_TRUE(st.ok()) << st;
    std::vector<int32_t> got = Get<int32_t>(*bufs[1], int64_t{c.hkv} * c.k_pages);
    Compare(ch, RunChainOnCpu(cpu_, ch), {got});
    std::vector<float> want_out(static_cast<size_t>(hq) * kD), want_lse(hq);
    const SelectedAttentionParams ref = attention(
        ch.q.data(), ch.pool.data(), const_cast<uint8_t*>(vpool.data()), ch.table.data(),
        TensorView(got.data(), DType::kI32, {c.hkv, c.k_pages}), want_out.data(),
        want_lse.data());
    ASSERT_TRUE(cpu_->SelectedAttention(ref, nullptr).ok());
    ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, "out");
    ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, "lse");

    // A refused attention (lse one head short): nothing runs.
    std::vector<std::unique_ptr<Buffer>> bufs2;
    std::vector<void*> sp2, sel2;
    StageBuffers(ch, &bufs2, &sp2, &sel2);
    SelectStagesParams p2 =
        ch.Params(dq->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp2, sel2);
    SelectedAttentionParams bad = attention(dq->data(), dpool->data(), dv->data(), dt->data(),
                                            p2.stages[0].selected, dout->data(), dlse->data());
    bad.lse = TensorView(dlse->data(), DType::kF32, {1, hq - 1});
    p2.attend = &bad;
    EXPECT_THAT(gpu_->SelectStages(p2, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
    for (int32_t id : Get<int32_t>(*bufs2[1], int64_t{c.hkv} * c.k_pages)) {
      ASSERT_EQ(id, 0x7f7f7f7f) << "a refused call wrote a selection";
    }
  }
  unsetenv("STRATA_SELECT_STAGES");
  unsetenv("STRATA_SELECT_ATTEND");
}

// The fused op captured in a CUDA graph and replayed gives the eager result, bit for bit, with
// the outputs poisoned before the replays.
// A key stage over an fp8 pool and an attention over bf16 pools: the kernel reads one pool
// format, so the attention runs as its own op after it (STRATA_SELECT_ATTEND=require_fused
// fails instead), and matches the CPU over the GPU's selection. The attention's scale is the
// stages' so that the format is the only reason.
TEST_F(SelectStagesTest, AttendOverPoolsOfAnotherFormatRunsOutside) {
  constexpr int kD = Chain::kD;
  const ChainCase c = {"tokenselect", 2, 4, DType::kBF16, 64, 0, 200, 0, 16, true, 256, 1, 196,
                       64, 196 * 64 - 5};
  Chain ch = MakeChain(c, rng_, DType::kFP8E4M3);
  const int hq = c.hkv * c.group;
  const int64_t pool_elems = static_cast<int64_t>(ch.slots) * c.page * kD;
  const std::vector<uint8_t> kpool16 = PoolBytes(RandomF(pool_elems), DType::kBF16);
  const std::vector<uint8_t> vpool16 = PoolBytes(RandomF(pool_elems), DType::kBF16);
  auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums), dpool = Dev(ch.pool);
  auto dk16 = Dev(kpool16), dv16 = Dev(vpool16), dt = Dev(ch.table);
  auto dout = Poisoned<float>(int64_t{hq} * kD), dlse = Poisoned<float>(hq);
  const int last = static_cast<int>(ch.counts.size()) - 1;
  // The attention over the bf16 pools with the stages' scale (their k_scale folded in).
  auto attention = [&](const SelectStagesParams& p, void* q, void* k, void* v, void* table,
                       const TensorView& parents, void* out, void* lse) {
    SelectedAttentionParams at = ChainAttention(ch, 100, q, k, v, table, parents, out, lse);
    at.k_pool.dtype = DType::kBF16;
    at.v_pool.dtype = DType::kBF16;
    at.k_scale = at.v_scale = 1.0f;
    at.scale = p.scale;
    return at;
  };
  setenv("STRATA_SELECT_STAGES", "require_fused", 1);
  for (const char* mode : {"require_fused", ""}) {
    SCOPED_TRACE(mode);
    setenv("STRATA_SELECT_ATTEND", mode, 1);
    std::vector<std::unique_ptr<Buffer>> bufs;
    std::vector<void*> sp, sel;
    StageBuffers(ch, &bufs, &sp, &sel);
    SelectStagesParams p =
        ch.Params(dq->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
    const SelectedAttentionParams at =
        attention(p, dq->data(), dk16->data(), dv16->data(), dt->data(), p.stages[last].selected,
                  dout->data(), dlse->data());
    p.attend = &at;
    const absl::Status st = gpu_->SelectStages(p, nullptr);
    if (std::string_view(mode) == "require_fused") {
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
      continue;
    }
    ASSERT_TRUE(st.ok()) << st;
    std::vector<int32_t> got = Get<int32_t>(*bufs[2 * last + 1], int64_t{c.hkv} * ch.ks[last]);
    std::vector<float> want_out(static_cast<size_t>(hq) * kD), want_lse(hq);
    const SelectedAttentionParams ref = attention(
        p, ch.q.data(), const_cast<uint8_t*>(kpool16.data()),
        const_cast<uint8_t*>(vpool16.data()), ch.table.data(),
        TensorView(got.data(), DType::kI32, {c.hkv, ch.ks[last]}), want_out.data(),
        want_lse.data());
    ASSERT_TRUE(cpu_->SelectedAttention(ref, nullptr).ok());
    ExpectClose(Get<float>(*dout, int64_t{hq} * kD), want_out, 2e-5, 1e-4, "out");
    ExpectClose(Get<float>(*dlse, hq), want_lse, 2e-5, 1e-5, "lse");
  }
  unsetenv("STRATA_SELECT_STAGES");
  unsetenv("STRATA_SELECT_ATTEND");
}

TEST_F(SelectStagesTest, ReplaysInAGraph) {
  const ChainCase c = {"two-level tokenselect", 8, 4, DType::kBF16, 64, 16, 8192, 128, 128, true,
                       2048, 1, 8190, 64, 8190 * 64 - 300};
  Chain ch = MakeChain(c, rng_);
  setenv("STRATA_SELECT_STAGES", "require_fused", 1);
  const auto eager = RunOnGpu(ch);
  auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums), dpool = Dev(ch.pool);
  auto dt = Dev(ch.table);
  std::vector<std::unique_ptr<Buffer>> bufs;
  std::vector<void*> sp, sel;
  StageBuffers(ch, &bufs, &sp, &sel);
  const SelectStagesParams p =
      ch.Params(dq->data(), dps->data(), dss->data(), dpool->data(), dt->data(), sp, sel);
  auto* cuda = static_cast<CudaBackend*>(gpu_);
  STRATA_ASSERT_OK_AND_ASSIGN(Stream s, cuda->CreateStream());
  cudaStream_t cs = static_cast<cudaStream_t>(s);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status captured = gpu_->SelectStages(p, s);
  ASSERT_EQ(cudaStreamEndCapture(cs, &graph), cudaSuccess);
  STRATA_ASSERT_OK(captured);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, cs), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cs), cudaSuccess);
  for (size_t i = 0; i < ch.counts.size(); ++i) {
    EXPECT_EQ(Get<int32_t>(*bufs[2 * i + 1], int64_t{c.hkv} * ch.ks[i]), eager[i])
        << "stage " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  STRATA_ASSERT_OK(cuda->DestroyStream(s));
  unsetenv("STRATA_SELECT_STAGES");
}

// A chain whose stage does not take the previous stage's selection is refused, on both backends,
// and so is a chain of no stages or more than kMaxSelectStages.
TEST_F(SelectStagesTest, RefusesABrokenChain) {
  const ChainCase c = {"quest", 2, 4, DType::kBF16, 64, 16, 256, 8, 4, false, 0, 0, 256, 0, 0};
  Chain ch = MakeChain(c, rng_);
  std::vector<float> s1(2 * 4 * 16), s2(2 * 4 * 128);
  std::vector<int32_t> t1(2 * 8), t2(2 * 4), other(2 * 8);
  SelectStagesParams p = ch.Params(ch.q.data(), ch.page_sums.data(), ch.seg_sums.data(), nullptr,
                                   nullptr, {s1.data(), s2.data()}, {t1.data(), t2.data()});
  p.stages[1].candidates.parents.data = other.data();
  for (Backend* b : {cpu_, gpu_}) {
    EXPECT_THAT(b->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  p.stages[1].candidates.parents.data = t1.data();
  p.num_stages = 0;
  for (Backend* b : {cpu_, gpu_}) {
    EXPECT_THAT(b->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
  p.num_stages = kMaxSelectStages + 1;
  for (Backend* b : {cpu_, gpu_}) {
    EXPECT_THAT(b->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
  }
}

// A call with the selection cache's check that is refused writes nothing on the GPU either: not
// the cache's state (cached queries, valid and reuse flags, hit count), not a selection. One part
// (the cluster kernel, whose quest form runs the check inside it); the unedited call runs.
TEST_F(SelectStagesTest, RefusedCacheCheckWritesNothing) {
  const ChainCase c = {"quest", 2, 4, DType::kBF16, 64, 16, 256, 8, 4, false, 0, 0, 256, 0, 0};
  Chain ch = MakeChain(c, rng_);
  constexpr int kD = Chain::kD;
  const int hq = c.hkv * c.group;
  const int64_t n = int64_t{c.group} * kD;
  auto dq = Dev(ch.q), dps = Dev(ch.page_sums), dss = Dev(ch.seg_sums);
  auto dother = Dev(RandomF(int64_t{hq} * kD, -2.0f, 2.0f));
  std::vector<std::unique_ptr<Buffer>> bufs;
  std::vector<void*> sp, sel;
  StageBuffers(ch, &bufs, &sp, &sel);
  const std::vector<float> cached = RandomF(c.hkv * n, -2.0f, 2.0f);
  const std::vector<int32_t> valid(c.hkv, 1), reuse(c.hkv, -1), skip(c.hkv, 0);
  auto dcached = Dev(cached), dvalid = Dev(valid), dreuse = Dev(reuse), dskip = Dev(skip);
  auto dhits = Dev(std::vector<int64_t>{3});
  std::vector<std::vector<int32_t>> selected_before;
  for (size_t i = 0; i < ch.counts.size(); ++i) {
    selected_before.push_back(Get<int32_t>(*bufs[2 * i + 1], int64_t{c.hkv} * ch.ks[i]));
  }
  auto params = [&](SelectionCacheCheckParams* cc) {
    cc->q = TensorView(dq->data(), DType::kF32, {hq, kD});
    cc->cached_q = TensorView(dcached->data(), DType::kF32, {c.hkv, n});
    cc->valid = TensorView(dvalid->data(), DType::kI32, {c.hkv});
    cc->theta = 0.9f;
    cc->reuse = TensorView(dreuse->data(), DType::kI32, {c.hkv});
    cc->hit_count = static_cast<int64_t*>(dhits->data());
    SelectStagesParams p =
        ch.Params(dq->data(), dps->data(), dss->data(), nullptr, nullptr, sp, sel);
    p.cache_check = cc;
    return p;
  };
  auto refused = [&](const char* what, auto&& edit) {
    SCOPED_TRACE(what);
    SelectionCacheCheckParams cc;
    SelectStagesParams p = params(&cc);
    edit(p, cc);
    EXPECT_THAT(gpu_->SelectStages(p, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
    STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
    EXPECT_EQ(Get<float>(*dcached, c.hkv * n), cached);
    EXPECT_EQ(Get<int32_t>(*dvalid, c.hkv), valid);
    EXPECT_EQ(Get<int32_t>(*dreuse, c.hkv), reuse);
    EXPECT_EQ(Get<int64_t>(*dhits, 1)[0], 3);
    for (size_t i = 0; i < ch.counts.size(); ++i) {
      EXPECT_EQ(Get<int32_t>(*bufs[2 * i + 1], int64_t{c.hkv} * ch.ks[i]), selected_before[i])
          << "stage " << i;
    }
  };
  refused("skip_heads too", [&](SelectStagesParams& p, SelectionCacheCheckParams&) {
    p.skip_heads = static_cast<const int32_t*>(dskip->data());
  });
  refused("another query", [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
    cc.q.data = dother->data();
  });
  refused("a stage's scores too small", [&](SelectStagesParams& p, SelectionCacheCheckParams&) {
    p.stages[1].scores.shape[2] = 3;
  });
  refused("the check's cached queries one head short",
          [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
            cc.cached_q.shape[0] = c.hkv - 1;
          });
  refused("theta not finite", [&](SelectStagesParams&, SelectionCacheCheckParams& cc) {
    cc.theta = std::numeric_limits<float>::quiet_NaN();
  });
  // The same params unedited run: every head misses (cached queries unrelated to q).
  SelectionCacheCheckParams cc;
  STRATA_ASSERT_OK(gpu_->SelectStages(params(&cc), nullptr));
  STRATA_ASSERT_OK(gpu_->Synchronize(nullptr));
  EXPECT_EQ(Get<int32_t>(*dreuse, c.hkv), std::vector<int32_t>(c.hkv, 0));
  EXPECT_EQ(Get<float>(*dcached, c.hkv * n), ch.q);
}

// Which form of SelectStagesKernel attends (host logic: runs without a GPU too): the middle's
// scores from the key stage only where the last stage is a key stage over the attention's own
// pool and table and the middle its token ids; the K-row form for anything else and with
// STRATA_SELECT_ATTEND_SCORES=0. (AttendMatchesCpu checks that both forms give the same bits.)
TEST(SelectStagesAttendFormTest, ScoresFromTheKeyStageOnlyWhereTheyAreTheAttentionsOwn) {
  using cuda_internal::DeviceSelectAttend;
  using cuda_internal::DeviceSelectStages;
  using cuda_internal::SelectStageKind;
  using cuda_internal::SelectStagesAttendScored;
  // Never dereferenced: only compared.
  int32_t tables[2] = {0, 0};
  uint16_t pools[2] = {0, 0};
  DeviceSelectStages st;
  st.num_stages = 2;
  st.stage[0].kind = SelectStageKind::kSummariesBF16;
  st.stage[1].kind = SelectStageKind::kKeysBF16;
  st.stage[1].rows = &pools[0];
  st.stage[1].num_items = 100;
  st.stage[1].table = &tables[0];
  st.stage[1].table_pages = 50;
  st.stage[1].page_shift = 6;
  DeviceSelectAttend a;
  a.k_pool = &pools[0];
  a.table = &tables[0];
  a.table_pages = 50;
  a.page_size = 64;
  a.num_slots = 100;
  a.fanout_shift = 0;
  unsetenv("STRATA_SELECT_ATTEND_SCORES");
  EXPECT_TRUE(SelectStagesAttendScored(st, a));  // tokenselect's chain
  setenv("STRATA_SELECT_ATTEND_SCORES", "0", 1);
  EXPECT_FALSE(SelectStagesAttendScored(st, a));
  setenv("STRATA_SELECT_ATTEND_SCORES", "1", 1);
  EXPECT_TRUE(SelectStagesAttendScored(st, a));
  unsetenv("STRATA_SELECT_ATTEND_SCORES");
  // Each difference from the key stage's keys takes the K-row form.
  auto expect_rows = [&](const char* what, auto change) {
    DeviceSelectStages s2 = st;
    DeviceSelectAttend a2 = a;
    change(s2, a2);
    EXPECT_FALSE(SelectStagesAttendScored(s2, a2)) << what;
  };
  expect_rows("middle of page ids (quest)", [](auto&, auto& x) { x.fanout_shift = 6; });
  expect_rows("another pool", [&](auto&, auto& x) { x.k_pool = &pools[1]; });
  expect_rows("another table", [&](auto&, auto& x) { x.table = &tables[1]; });
  expect_rows("another table width", [](auto&, auto& x) { x.table_pages = 49; });
  expect_rows("another page size", [](auto&, auto& x) { x.page_size = 32; });
  expect_rows("another slot count", [](auto&, auto& x) { x.num_slots = 99; });
  expect_rows("last stage of summaries", [](auto& s, auto&) {
    s.stage[1].kind = SelectStageKind::kSummariesBF16;
  });
  expect_rows("no stage", [](auto& s, auto&) { s.num_stages = 0; });
  // A one-stage chain of keys over the attention's pool takes the scores too.
  DeviceSelectStages one;
  one.num_stages = 1;
  one.stage[0] = st.stage[1];
  EXPECT_TRUE(SelectStagesAttendScored(one, a));
}

// Whether the partitioned kernel holds a chain (host logic: runs without a GPU too) judges a
// range's parts by the largest: with 16 parts of the 32769 pages [1, 32770), part 0 holds 2048
// (PartCandidateCount) and part 1 holds 2049, past the kernel's 2048 per part and stage (its
// shared arrays would overflow); 32768 pages fit.
TEST(PartStagesFitsTest, JudgesARangeByItsLargestPart) {
  using cuda_internal::DeviceSelectStages;
  using cuda_internal::PartStagesFits;
  using cuda_internal::SelectStageKind;
  alignas(16) static uint16_t rows[8];  // never dereferenced: only its alignment is checked
  DeviceSelectStages st;
  st.num_stages = 1;
  st.stage[0].kind = SelectStageKind::kSummariesBF16;
  st.stage[0].rows = rows;
  st.stage[0].num_items = 40000;
  st.stage[0].k = 128;
  st.stage[0].c.begin = 1;
  for (const int32_t count : {16 * 2048, 16 * 2048 + 1}) {
    st.stage[0].c.count = count;
    st.stage[0].c.end = 1 + count;
    EXPECT_EQ(PartStagesFits(/*num_kv_heads=*/1, /*group=*/4, /*parts=*/16, st, nullptr),
              count <= 16 * 2048)
        << count << " pages";
  }
}

// Where SelectStagesKernel sends a stage's taken ids (host logic: runs without a GPU too): every
// id goes exactly to the blocks that read it as a parent (some element of theirs is its child),
// and each block waits for exactly as many ids as are pushed to it (a wrong count would hang the
// kernel on its mbarrier), over cluster sizes, fanouts and selection sizes.
TEST(SelectStagesParentPushTest, EveryReaderGetsItsParentsAndWaitsForExactlyThose) {
  using cuda_internal::OwnParentCount;
  using cuda_internal::ParentReaderBlocks;
  using cuda_internal::StageBlockShare;
  int checked = 0;
  for (int cs : {1, 2, 8, 16}) {
    for (int32_t fan : {1, 3, 16, 64}) {
      for (int32_t k : {0, 1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 63, 100, 128, 257, 2048}) {
        const int32_t n = k * fan;
        if (n > cs * 1024 && fan > 1) continue;  // beyond the kernel's candidates per stage
        const int32_t per = StageBlockShare(n, cs);
        for (int32_t taken : {0, k / 2, k > 0 ? k - 1 : 0, k}) {
          std::vector<int32_t> pushed(cs, 0);
          for (int32_t pos = 0; pos < taken; ++pos) {
            int b0 = -1, b1 = -1;
            ParentReaderBlocks(n, fan, per, cs, pos, &b0, &b1);
            for (int b = 0; b < cs; ++b) {
              const int64_t lo = int64_t{b} * per, hi = std::min<int64_t>(n, lo + per);
              const bool reads = lo < hi && lo < int64_t{pos + 1} * fan && int64_t{pos} * fan < hi;
              ASSERT_EQ(reads, b >= b0 && b <= b1) << "cs " << cs << " fan " << fan << " k " << k
                                                   << " pos " << pos << " block " << b;
              if (b >= b0 && b <= b1) ++pushed[b];
            }
          }
          for (int r = 0; r < cs; ++r) {
            ASSERT_EQ(OwnParentCount(n, fan, per, r, taken), pushed[r])
                << "cs " << cs << " fan " << fan << " k " << k << " taken " << taken
                << " block " << r;
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 200);
}

// The scored attention's position -> attending block in f32 (StageDivByShare, host and device
// alike: IEEE add, multiply and reciprocal) is integer division for every selection size up to
// kSelectStagesMaxParents and cluster size up to 16, as the kernel uses it.
TEST(SelectStagesParentPushTest, FloatDivisionByTheShareIsExact) {
  using cuda_internal::StageDivByShare;
  int64_t checked = 0;
  for (int cs = 1; cs <= 16; ++cs) {
    for (int32_t k = 1; k <= cuda_internal::kSelectStagesMaxParents; ++k) {
      const int32_t mc = (k + cs - 1) / cs;
      const float inv = 1.0f / static_cast<float>(mc);
      for (uint32_t pos = 0; pos < static_cast<uint32_t>(k); ++pos) {
        if (StageDivByShare(pos, inv) != static_cast<int>(pos / mc)) {
          FAIL() << "cs " << cs << " k " << k << " pos " << pos << ": "
                 << StageDivByShare(pos, inv) << " != " << pos / mc;
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, int64_t{16} * 2048 * 2049 / 2);
}

}  // namespace
}  // namespace strata::kernels
