// Counter-based random numbers: every value is a pure function of
// (seed, stream, index), so any rank can produce any slice of a tensor or a
// batch without producing the rest. Not a cryptographic generator.
#pragma once

#include <cmath>
#include <cstdint>

namespace whale {

/// A seed, as users write it: `seed{42}`.
struct seed {
  std::uint64_t value = 0;
};

namespace detail {
inline constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace detail

/// A stream of random numbers addressed by index.
class counter_rng {
 public:
  constexpr counter_rng() = default;
  constexpr explicit counter_rng(seed s, std::uint64_t stream = 0) noexcept
      : key_(detail::mix64(s.value ^ detail::mix64(stream + 0x51ed2701ULL))) {}

  /// A derived, independent stream (e.g. the i-th layer of a model).
  constexpr counter_rng child(std::uint64_t i) const noexcept {
    counter_rng r;
    r.key_ = detail::mix64(key_ ^ detail::mix64(i * 0x2545f4914f6cdd1dULL + 1));
    return r;
  }
  constexpr std::uint64_t bits(std::uint64_t i) const noexcept {
    return detail::mix64(key_ + detail::mix64(i));
  }
  /// Uniform in [0, 1).
  double uniform(std::uint64_t i) const noexcept {
    return static_cast<double>(bits(i) >> 11) * 0x1.0p-53;
  }
  /// Standard normal (Box-Muller on two uniforms derived from i).
  double normal(std::uint64_t i) const noexcept {
    const double u1 = (static_cast<double>(bits(2 * i) >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = static_cast<double>(bits(2 * i + 1) >> 11) * 0x1.0p-53;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  /// Uniform integer in [0, n).
  std::uint64_t below(std::uint64_t i, std::uint64_t n) const noexcept {
    return static_cast<std::uint64_t>(uniform(i) * static_cast<double>(n)) % n;
  }

 private:
  std::uint64_t key_ = 0;
};

}  // namespace whale
