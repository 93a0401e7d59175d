// Memory for whale: aligned host allocation (2 MiB + MADV_HUGEPAGE for big
// buffers), a tracker of live and peak bytes per category, an allocation
// counter, the activation pool that recompute scopes allocate from, and
// `memory_place`: a backend's memory (a GPU's) that tensors allocate in while
// a `place_scope` is open. It does not hold tensors or shapes (see tensor.hpp).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

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
  /// Model state: parameters + gradients + optimizer state (live bytes).
  std::int64_t model_state() const noexcept {
    return live_of(mem_kind::params) + live_of(mem_kind::grads) + live_of(mem_kind::optimizer);
  }
};

namespace detail {
inline memory_stats& global_memory_stats() noexcept {
  static memory_stats s;
  return s;
}
inline constexpr std::size_t huge_page = std::size_t{2} << 20;
inline constexpr std::size_t huge_threshold = std::size_t{1} << 20;

/// Count `bytes` of kind `k` as allocated: live and peak bytes, and the allocation counter.
inline void count_allocation(std::size_t bytes, mem_kind k) noexcept {
  auto& s = global_memory_stats();
  auto i = static_cast<int>(k);
  s.live[i] += static_cast<std::int64_t>(bytes);
  if (s.live[i] > s.peak[i]) s.peak[i] = s.live[i];
  ++s.allocations;
}

/// Allocate `bytes` (64-byte aligned; 2 MiB aligned and huge-page advised when
/// at least 1 MiB, since page faults are costly here), always from the heap.
inline void* allocate_raw(std::size_t bytes, mem_kind k) {
  if (bytes == 0) return nullptr;
  const bool big = bytes >= huge_threshold;
  const std::size_t align = big ? huge_page : 64;
  const std::size_t rounded = (bytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (!p)
    throw std::runtime_error("whale: out of host memory allocating " + std::to_string(bytes) +
                             " bytes for " + to_string(k));
  if (big) ::madvise(p, rounded, MADV_HUGEPAGE);
  count_allocation(bytes, k);
  return p;
}
inline void free_raw(void* p, std::size_t bytes, mem_kind k) noexcept {
  if (!p) return;
  std::free(p);
  global_memory_stats().live[static_cast<int>(k)] -= static_cast<std::int64_t>(bytes);
}

/// The pool that `recompute` scopes take activation buffers from (nn/recompute.hpp).
/// While a scope is open (`depth() > 0`), every `activations` allocation of this
/// process is served from the pool: the smallest free block that fits, else a
/// new heap block. A block freed by its tensor returns to the pool (inside a
/// scope or not) and is handed out again, so recomputing the same blocks every
/// step allocates nothing from the heap after the first. Blocks the pool holds
/// stay live `activations` bytes in the tracker (they are real memory), until
/// `trim()` returns the free ones to the heap. One process-wide pool, used from
/// the thread that runs the layers.
class activation_pool {
 public:
  static activation_pool& instance() noexcept {
    static activation_pool* p = new activation_pool;  // never destroyed: tensors may outlive statics
    return *p;
  }
  int depth() const noexcept { return depth_; }
  void enter() noexcept { ++depth_; }
  void leave() noexcept { --depth_; }

  void* take(std::size_t bytes) {
    block* best = nullptr;
    for (auto& b : blocks_)
      if (!b.used && b.bytes >= bytes && (!best || b.bytes < best->bytes)) best = &b;
    if (best) {
      best->used = true;
      return best->p;
    }
    void* p = allocate_raw(bytes, mem_kind::activations);
    blocks_.push_back({p, bytes, true});
    return p;
  }
  /// Returns true when `p` is one of the pool's blocks (now free again).
  bool give_back(void* p) noexcept {
    for (auto& b : blocks_)
      if (b.p == p) {
        b.used = false;
        return true;
      }
    return false;
  }
  bool owns_any() const noexcept { return !blocks_.empty(); }
  /// Bytes the pool holds (free and in use).
  std::int64_t held_bytes() const noexcept {
    std::int64_t n = 0;
    for (const auto& b : blocks_) n += static_cast<std::int64_t>(b.bytes);
    return n;
  }
  /// Return every free block to the heap.
  void trim() noexcept {
    std::size_t out = 0;
    for (auto& b : blocks_) {
      if (b.used) blocks_[out++] = b;
      else free_raw(b.p, b.bytes, mem_kind::activations);
    }
    blocks_.resize(out);
  }

 private:
  struct block {
    void* p;
    std::size_t bytes;
    bool used;
  };
  std::vector<block> blocks_;
  int depth_ = 0;
};

/// Allocate `bytes` for a tensor of kind `k`: from the activation pool while a
/// recompute scope is open (activations only), else from the heap (allocate_raw).
inline void* allocate_bytes(std::size_t bytes, mem_kind k) {
  if (bytes == 0) return nullptr;
  auto& pool = activation_pool::instance();
  if (k == mem_kind::activations && pool.depth() > 0) return pool.take(bytes);
  return allocate_raw(bytes, k);
}

inline void free_bytes(void* p, std::size_t bytes, mem_kind k) noexcept {
  if (!p) return;
  auto& pool = activation_pool::instance();
  if (k == mem_kind::activations && pool.owns_any() && pool.give_back(p)) return;
  free_raw(p, bytes, k);
}
}  // namespace detail

/// Memory that is not the host's: a backend's (a GPU's device memory, or the
/// guarded CPU emulation of it, backend/guarded.hpp), as allocate, free and
/// zero on it. Host code must not read or write it; only the backend's calls
/// (GEMMs, kernel bodies, copies, fills) touch it. The backend owns the place.
struct memory_place {
  void* owner = nullptr;
  void* (*allocate)(void* owner, std::size_t bytes) = nullptr;
  void (*deallocate)(void* owner, void* p, std::size_t bytes) = nullptr;
  void (*zero)(void* owner, void* p, std::size_t bytes) = nullptr;
  const char* name = "";
};

namespace detail {
/// The place tensors of this thread allocate in; null: host memory.
inline const memory_place*& current_place() noexcept {
  thread_local const memory_place* p = nullptr;
  return p;
}
/// Allocate in `place` (null: the host, through allocate_bytes), counted by kind
/// in the same tracker: with a device place the tracker counts device bytes.
inline void* allocate_in(const memory_place* place, std::size_t bytes, mem_kind k) {
  if (!place) return allocate_bytes(bytes, k);
  if (bytes == 0) return nullptr;
  void* p = place->allocate(place->owner, bytes);
  count_allocation(bytes, k);
  return p;
}
inline void free_in(const memory_place* place, void* p, std::size_t bytes, mem_kind k) noexcept {
  if (!place) return free_bytes(p, bytes, k);
  if (!p) return;
  place->deallocate(place->owner, p, bytes);
  global_memory_stats().live[static_cast<int>(k)] -= static_cast<std::int64_t>(bytes);
}
inline void zero_in(const memory_place* place, void* p, std::size_t bytes) {
  if (!p || bytes == 0) return;
  if (place) place->zero(place->owner, p, bytes);
  else std::memset(p, 0, bytes);
}
}  // namespace detail

/// While alive, tensors this thread allocates (new storage, or storage that
/// grows) go to `place` (null: the host); the previous place comes back at
/// the end. A tensor remembers where its storage is, so it is freed there
/// whatever scope is open then. Recompute's activation pool is host memory
/// only: under a device place, blocks come from the place (a GPU backend's
/// caching allocator reuses them the same way).
class place_scope {
 public:
  explicit place_scope(const memory_place* place) noexcept : saved_(detail::current_place()) {
    detail::current_place() = place;
  }
  place_scope(const place_scope&) = delete;
  place_scope& operator=(const place_scope&) = delete;
  ~place_scope() { detail::current_place() = saved_; }

 private:
  const memory_place* saved_;
};

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
