// The CPU execution space: a kernel body run by a plain loop over its index
// space, on the calling thread. The body is inlined into the loop, so that it
// vectorizes as a hand-written loop would; on x86-64 built for the baseline
// ISA, the loop is compiled three times (baseline, AVX2+FMA, AVX-512) and the
// widest the processor has is chosen once at run time, as PyTorch's CPU
// kernels do. Not threaded: one rank per core.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "whale/backend/kernel.hpp"

// Dispatch only where it can help: GCC or Clang, x86-64, and not already
// compiled for AVX-512 (-march=native on such a machine makes it moot).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX512F__) && !defined(__CUDA_ARCH__) && \
    !defined(WHALE_NO_ISA_DISPATCH)
#define WHALE_ISA_DISPATCH 1
#else
#define WHALE_ISA_DISPATCH 0
#endif

namespace whale::cpu {

/// The instruction sets the CPU kernels' loops are compiled for.
enum class isa : int { baseline = 0, avx2 = 1, avx512 = 2 };

inline const char* isa_name(isa i) noexcept {
  switch (i) {
    case isa::avx2: return "avx2";
    case isa::avx512: return "avx512";
    default: return "baseline";
  }
}

namespace detail {
/// What this processor runs, capped by WHALE_CPU_ISA (baseline, avx2, avx512)
/// when set: a way to compare the paths, or to pin one across unequal hosts.
inline isa detect_isa() {
  isa best = isa::baseline;
#if WHALE_ISA_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = isa::avx2;
  if (best == isa::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    best = isa::avx512;
#endif
  if (const char* e = std::getenv("WHALE_CPU_ISA")) {
    const std::string v = e;
    isa want;
    if (v == "baseline") want = isa::baseline;
    else if (v == "avx2") want = isa::avx2;
    else if (v == "avx512") want = isa::avx512;
    else
      throw std::invalid_argument("WHALE_CPU_ISA='" + v + "': expected baseline, avx2 or avx512");
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

#if WHALE_ISA_DISPATCH
template <class K> [[gnu::target("avx2,fma")]] void launch_avx2(index_t n, const K body) {
  for (index_t i = 0; i < n; ++i) body(i);
}
template <class K>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]] void launch_avx512(index_t n, const K body) {
  for (index_t i = 0; i < n; ++i) body(i);
}
#endif
}  // namespace detail

/// The instruction set the kernels run with in this process (detected once).
inline isa active_isa() {
  static const isa i = detail::detect_isa();
  return i;
}

/// body(i) for i in [0, n), in order, with the widest vectors this CPU has.
template <kernels::KernelBody K>
inline void launch(index_t n, const K& body) {
#if WHALE_ISA_DISPATCH
  switch (active_isa()) {
    case isa::avx512: return detail::launch_avx512(n, body);
    case isa::avx2: return detail::launch_avx2(n, body);
    default: break;
  }
#endif
  const K k = body;  // a local copy: its pointers are known not to change inside the loop
  for (index_t i = 0; i < n; ++i) k(i);
}

}  // namespace whale::cpu
