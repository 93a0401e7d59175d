// A caching allocator over any upstream (cudaMalloc on the GPU, the heap in
// tests): blocks freed by their owner are kept by rounded size and handed out
// again, so that a training loop that asks for the same buffers every step
// reaches the upstream only in its first steps. One queue: blocks are reused
// in the order of that queue's work (the CUDA backend allocates for its
// compute stream only; a block used on another stream must be freed only
// after that stream's work on it is done). When the upstream fails, the
// cached blocks are returned and the request tried once more. Not
// thread-safe; one per backend object.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <new>
#include <stdexcept>
#include <utility>
#include <unordered_map>

namespace whale {

/// What an upstream needs: `void* allocate(std::size_t)` (throws on failure)
/// and `void deallocate(void*, std::size_t)`.
template <class U>
concept AllocatorUpstream = requires(U& u, void* p, std::size_t n) {
  { u.allocate(n) } -> std::same_as<void*>;
  u.deallocate(p, n);
};

/// Counters of a caching_allocator, for tests and the benchmark.
struct allocator_stats {
  std::int64_t upstream_allocations = 0;  ///< calls that reached the upstream (cudaMalloc)
  std::int64_t cache_hits = 0;            ///< requests served from cached blocks
  std::int64_t bytes_in_use = 0, peak_bytes_in_use = 0;
  std::int64_t bytes_cached = 0;  ///< held, free, waiting for reuse
};

template <AllocatorUpstream Upstream>
class caching_allocator {
 public:
  /// Requests up to 1 MiB round up to 512 bytes; larger ones to 2 MiB.
  static constexpr std::size_t small_round = 512, large_round = std::size_t{2} << 20,
                               small_limit = std::size_t{1} << 20;
  static constexpr std::size_t rounded(std::size_t bytes) noexcept {
    const std::size_t r = bytes <= small_limit ? small_round : large_round;
    return (bytes + r - 1) / r * r;
  }

  explicit caching_allocator(Upstream up = Upstream{}) : up_(std::move(up)) {}
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;
  ~caching_allocator() { release(); }

  /// A block of at least `bytes`: a cached block of the same rounded size, else
  /// the smallest cached block up to twice that, else a new upstream block.
  void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    const std::size_t n = rounded(bytes);
    auto it = free_.lower_bound(n);
    void* p = nullptr;
    std::size_t got = n;
    if (it != free_.end() && it->first <= 2 * n) {
      p = it->second;
      got = it->first;
      free_.erase(it);
      stats_.bytes_cached -= static_cast<std::int64_t>(got);
      ++stats_.cache_hits;
    } else {
      try {
        p = up_.allocate(n);
      } catch (...) {  // out of memory with blocks cached: give them back and try once more
        if (free_.empty()) throw;
        release();
        p = up_.allocate(n);
      }
      ++stats_.upstream_allocations;
    }
    live_[p] = got;
    stats_.bytes_in_use += static_cast<std::int64_t>(got);
    if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
    return p;
  }
  /// Keep the block for reuse (the size argument is for the Backend concept; the allocator knows it).
  void deallocate(void* p, std::size_t = 0) {
    if (!p) return;
    auto it = live_.find(p);
    if (it == live_.end()) throw std::invalid_argument("whale::caching_allocator: freeing a block it did not allocate");
    const std::size_t n = it->second;
    live_.erase(it);
    free_.emplace(n, p);
    stats_.bytes_in_use -= static_cast<std::int64_t>(n);
    stats_.bytes_cached += static_cast<std::int64_t>(n);
  }
  /// Return every cached (free) block to the upstream.
  void release() noexcept {
    for (auto& [n, p] : free_) up_.deallocate(p, n);
    free_.clear();
    stats_.bytes_cached = 0;
  }
  const allocator_stats& stats() const noexcept { return stats_; }
  Upstream& upstream() noexcept { return up_; }

 private:
  Upstream up_;
  std::multimap<std::size_t, void*> free_;
  std::unordered_map<void*, std::size_t> live_;
  allocator_stats stats_;
};

}  // namespace whale
