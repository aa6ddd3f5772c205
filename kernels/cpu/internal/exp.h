// A vectorisable e^x for the CPU attention's softmax weights (private to kernels/cpu). Stateless.
#ifndef STRATA_KERNELS_CPU_INTERNAL_EXP_H_
#define STRATA_KERNELS_CPU_INTERNAL_EXP_H_

#include <cstdint>
#include <cstring>

namespace strata::kernels::cpu_internal {

// e^x for x <= 0 (a score minus the running max), branch-free so that the weights' loop
// vectorises (with -fno-trapping-math for its selects: kernels/CMakeLists.txt): Cody-Waite
// reduction to x = n ln2 + f, |f| <= ln2 / 2, and Cephes' degree-6 polynomial for e^f, within
// 1 ulp of std::exp on [-87.3, 0] (kernels/cpu/attention_test.cc checks every 64th float); 0
// below -87.3 (near where expf turns subnormal), NaN for NaN.
inline float ExpNonPositive(float x) {
  const float xc = x < -87.3f ? -87.3f : x;  // keeps 2^n normal (n >= -126); the result is 0 there
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const float r = xc * 1.44269504088896341f + magic;
  const float fn = r - magic;
  int32_t n;
  std::memcpy(&n, &r, sizeof(n));
  n -= 0x4b400000;  // the bits of `magic`
  const float f = (xc - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * (f * f) + f + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  const float y = p * two_n;  // NaN for NaN (through xc)
  return x < -87.3f ? 0.0f : y;
}

}  // namespace strata::kernels::cpu_internal

#endif  // STRATA_KERNELS_CPU_INTERNAL_EXP_H_
