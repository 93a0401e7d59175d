// Host memory for whale: aligned allocation (2 MiB + MADV_HUGEPAGE for big
// buffers), and a tracker of live and peak bytes per category, plus an
// allocation counter. It does not hold tensors or shapes (see tensor.hpp).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <ostream>
#include <stdexcept>
#include <string>

#include <sys/mman.h>

namespace whale {

/// What a block of memory holds; the tracker keeps live and peak bytes for each.
enum class mem_kind : int { params, grads, optimizer, activations, comm, workspace };
inline constexpr int mem_kind_count = 6;

inline const char* to_string(mem_kind k) noexcept {
  constexpr const char* names[] = {"params", "grads", "optimizer", "activations", "comm", "workspace"};
  return names[static_cast<int>(k)];
}

/// Process-wide memory statistics. Deterministic: they count requested bytes,
/// not what the OS maps, so tests may assert them.
struct memory_stats {
  std::array<std::int64_t, mem_kind_count> live{};
  std::array<std::int64_t, mem_kind_count> peak{};
  std::int64_t allocations = 0;  ///< number of allocations since start

  std::int64_t live_total() const noexcept {
    std::int64_t s = 0;
    for (auto v : live) s += v;
    return s;
  }
  std::int64_t live_of(mem_kind k) const noexcept { return live[static_cast<int>(k)]; }
  std::int64_t peak_of(mem_kind k) const noexcept { return peak[static_cast<int>(k)]; }
};

namespace detail {
inline memory_stats& global_memory_stats() noexcept {
  static memory_stats s;
  return s;
}
inline constexpr std::size_t huge_page = std::size_t{2} << 20;
inline constexpr std::size_t huge_threshold = std::size_t{1} << 20;

/// Allocate `bytes` (64-byte aligned; 2 MiB aligned and huge-page advised when
/// at least 1 MiB, since page faults are costly here). Never returns null.
inline void* allocate_bytes(std::size_t bytes, mem_kind k) {
  if (bytes == 0) return nullptr;
  const bool big = bytes >= huge_threshold;
  const std::size_t align = big ? huge_page : 64;
  const std::size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (!p)
    throw std::runtime_error("whale: out of host memory allocating " + std::to_string(bytes) +
                             " bytes for " + to_string(k));
  if (big) ::madvise(p, rounded, MADV_HUGEPAGE);
  auto& s = global_memory_stats();
  auto i = static_cast<int>(k);
  s.live[i] += static_cast<std::int64_t>(bytes);
  if (s.live[i] > s.peak[i]) s.peak[i] = s.live[i];
  ++s.allocations;
  return p;
}

inline void free_bytes(void* p, std::size_t bytes, mem_kind k) noexcept {
  if (!p) return;
  std::free(p);
  global_memory_stats().live[static_cast<int>(k)] -= static_cast<std::int64_t>(bytes);
}
}  // namespace detail

/// Snapshot of this process's memory statistics.
inline memory_stats memory_snapshot() noexcept { return detail::global_memory_stats(); }

/// Reset peaks to the current live bytes (e.g. at the start of a step).
inline void reset_memory_peaks() noexcept {
  auto& s = detail::global_memory_stats();
  s.peak = s.live;
}

inline std::ostream& operator<<(std::ostream& os, const memory_stats& s) {
  os << "memory (MiB live/peak):";
  for (int i = 0; i < mem_kind_count; ++i)
    os << ' ' << to_string(static_cast<mem_kind>(i)) << ' ' << s.live[i] / 1048576.0 << '/'
       << s.peak[i] / 1048576.0;
  return os;
}

}  // namespace whale
