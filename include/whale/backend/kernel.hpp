// The vocabulary of kernel bodies: one body, two execution spaces. A kernel is
// a function object over an index space, `body(i)` for i in [0, n), written
// once with WHALE_HD so that nvcc compiles it for the GPU (launched by a CUDA
// grid, backend/cuda/launch.cuh) and g++ for the CPU (launched by a loop,
// backend/cpu/launch.hpp). No launching here and no memory: only the macros
// and the bit-level helpers both compilers accept.
#pragma once

#include <bit>
#include <cstdint>

#include "whale/tensor/tensor.hpp"

#if defined(__CUDACC__)
#define WHALE_HD __host__ __device__
#else
#define WHALE_HD
#endif

/// Force inlining on both compilers: a body's arithmetic must vanish into the
/// launching loop so that g++ vectorizes it (and nvcc keeps it in registers).
#define WHALE_INLINE __attribute__((always_inline)) inline

namespace whale::kernels {

/// The float whose bits are `i`, on either side.
WHALE_HD WHALE_INLINE float as_float(std::int32_t i) noexcept {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  return std::bit_cast<float>(i);
#endif
}
/// The bits of float `x`, on either side.
WHALE_HD WHALE_INLINE std::int32_t as_int(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_int(x);
#else
  return std::bit_cast<std::int32_t>(x);
#endif
}

/// A type is a kernel body over an index space when it can be called with an index.
template <class K>
concept KernelBody = std::is_trivially_copyable_v<K> && requires(const K& k, index_t i) { k(i); };

}  // namespace whale::kernels
