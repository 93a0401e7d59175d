// Float math for kernel bodies (GELU, softmax, LayerNorm, cross-entropy): exp,
// tanh and lane-split reductions written as plain float arithmetic and bit
// casts, which g++ turns into SIMD without -ffast-math and nvcc compiles for
// the GPU unchanged (the same arithmetic on both sides). Not a libm.
#pragma once

#include <cstdint>

#include "whale/backend/kernel.hpp"

namespace whale::kernels {

/// a * b + c rounded once (a fused multiply-add), on every backend: an
/// instruction in the CPU loops built for FMA (cpu/launch.hpp) and on a GPU.
/// Where two code paths must give the same bits (a CPU loop and a device's
/// shape of the same sums), each multiply-add is written as one, so that an
/// optimizing compiler has no product left to fuse one way in one loop and
/// another way in the other.
WHALE_HD WHALE_INLINE float madd(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}

/// e^x for float x; relative error < 3e-7 where the result is a normal float.
/// Saturates instead of overflowing: about 1e-38 for x < -87, at most 2.4e38 for
/// x > 88 (so exp(-inf) is ~1e-38, not 0). Branch-free and built only from
/// operations GCC vectorizes without -ffast-math (float selects here would
/// stop it, so the clamps are done on integers); inlined into a loop, it vectorizes.
WHALE_HD WHALE_INLINE float vexp(float x) noexcept {
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693359375f;       // exact in 9 bits: n * ln2_hi is exact
  constexpr float ln2_lo = -2.12194440e-4f;    // ln 2 - ln2_hi
  constexpr float round_magic = 12582912.f;    // 1.5 * 2^23: adding it rounds to an integer
  // |x| <= 100 (on the bit pattern), so that n below is a small integer
  const auto xb = as_int(x);
  constexpr std::int32_t lim = 0x42c80000;  // the bits of 100.f
  constexpr auto sign = static_cast<std::int32_t>(0x80000000u);
  x = as_float((xb & 0x7fffffff) > lim ? ((xb & sign) | lim) : xb);
  const float n = (x * log2e + round_magic) - round_magic;  // round(x / ln 2)
  const float r = (x - n * ln2_hi) - n * ln2_lo;            // |r| <= ln2 / 2
  // e^r by its Taylor series to degree 7 (truncation < 3e-9 on |r| <= 0.347).
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  auto ni = static_cast<std::int32_t>(n);
  ni = ni < -126 ? -126 : ni;  // keep 2^n a normal float
  ni = ni > 127 ? 127 : ni;
  return p * as_float((ni + 127) << 23);  // p * 2^n
}

/// tanh(x) = 1 - 2 / (1 + e^{2x}); absolute error < 1e-6, exactly +-1 when |x| > 9.
WHALE_HD WHALE_INLINE float vtanh(float x) noexcept {
  return 1.f - 2.f / (1.f + vexp(2.f * x));
}

/// Sum of x[0..n), in 8 lanes so that it vectorizes.
WHALE_HD WHALE_INLINE float vsum(const float* __restrict x, index_t n) noexcept {
  float acc[8] = {};
  const index_t n8 = n / 8 * 8;
  for (index_t i = 0; i < n8; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += x[i + k];
  float s = 0.f;
  for (index_t i = n8; i < n; ++i) s += x[i];
  for (int k = 0; k < 8; ++k) s += acc[k];
  return s;
}

/// Dot product of a[0..n) and b[0..n), in 8 lanes.
WHALE_HD WHALE_INLINE float vdot(const float* __restrict a, const float* __restrict b, index_t n) noexcept {
  float acc[8] = {};
  const index_t n8 = n / 8 * 8;
  for (index_t i = 0; i < n8; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  float s = 0.f;
  for (index_t i = n8; i < n; ++i) s += a[i] * b[i];
  for (int k = 0; k < 8; ++k) s += acc[k];
  return s;
}

/// Maximum of x[0..n), n >= 1, in 8 lanes.
WHALE_HD WHALE_INLINE float vmax(const float* __restrict x, index_t n) noexcept {
  float m = x[0];
  const index_t n8 = n / 8 * 8;
  if (n8 > 0) {
    float acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = x[k];
    for (index_t i = 8; i < n8; i += 8)
      for (int k = 0; k < 8; ++k) acc[k] = x[i + k] > acc[k] ? x[i + k] : acc[k];
    for (int k = 0; k < 8; ++k) m = acc[k] > m ? acc[k] : m;
  }
  for (index_t i = n8; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

}  // namespace whale::kernels
