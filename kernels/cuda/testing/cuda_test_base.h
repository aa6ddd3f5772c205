// The fixture base of the CUDA backend's tests (label gpu): one CUDA backend per test suite, made
// in SetUpTestSuite and deleted after it, and every test of the suite skipped, saying why, when
// no usable GPU is present (so CI without a GPU reports them as skipped). `Base` is the gtest
// fixture to derive from (::testing::Test or ::testing::TestWithParam<...>).
#ifndef STRATA_KERNELS_CUDA_TESTING_CUDA_TEST_BASE_H_
#define STRATA_KERNELS_CUDA_TESTING_CUDA_TEST_BASE_H_

#include <string>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend.h"

namespace strata::kernels {

template <typename Base>
class CudaTestBase : public Base {
 protected:
  static void SetUpTestSuite() {
    auto b = MakeCudaBackend(0);
    if (b.ok()) {
      gpu_ = b->release();
    } else {
      why_ = b.status().ToString();
    }
  }
  static void TearDownTestSuite() {
    delete gpu_;
    gpu_ = nullptr;
  }
  void SetUp() override {
    if (gpu_ == nullptr) GTEST_SKIP() << "no CUDA GPU: skipped (" << why_ << ")";
  }

  static inline Backend* gpu_ = nullptr;
  static inline std::string why_;
};

}  // namespace strata::kernels

#endif  // STRATA_KERNELS_CUDA_TESTING_CUDA_TEST_BASE_H_
