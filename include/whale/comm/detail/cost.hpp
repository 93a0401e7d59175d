// The traffic cost model behind comm_stats (see communicator.hpp for the
// definition): bytes this rank sends and receives per operation under ring /
// chain algorithms. Pure arithmetic; no communication.
#pragma once

#include <cstdint>
#include <span>

#include "whale/comm/communicator.hpp"

namespace whale::detail {

struct traffic {
  std::int64_t sent = 0;
  std::int64_t received = 0;
  /// The most any rank of the group sends or receives: what the ring waits for
  /// (uneven pieces make it more than this rank's share).
  std::int64_t slowest = 0;
  /// What each rank would send with the same buffer split evenly (the x of a
  /// measured link curve, whose buffers were split so); 0: as `slowest`.
  std::int64_t even = 0;
};

inline traffic all_reduce_traffic(std::int64_t bytes, int p) noexcept {
  if (p <= 1) return {};
  const std::int64_t t = 2 * (p - 1) * bytes / p;
  return {t, t, t, t};
}

/// counts in elements, `elem` bytes each; rank r of p.
inline traffic all_gather_traffic(std::span<const index_t> counts, int r, int p,
                                  std::int64_t elem) noexcept {
  if (p <= 1) return {};
  std::int64_t total = 0, least = counts[0];
  for (auto c : counts) total += c, least = c < least ? c : least;
  return {(total - counts[(r + 1) % p]) * elem, (total - counts[r]) * elem, (total - least) * elem, total * elem * (p - 1) / p};
}
inline traffic all_gather_traffic(std::int64_t block_bytes, int p) noexcept {
  if (p <= 1) return {};
  return {(p - 1) * block_bytes, (p - 1) * block_bytes, (p - 1) * block_bytes, (p - 1) * block_bytes};
}

inline traffic reduce_scatter_traffic(std::span<const index_t> counts, int r, int p,
                                      std::int64_t elem) noexcept {
  if (p <= 1) return {};
  std::int64_t total = 0, least = counts[0];
  for (auto c : counts) total += c, least = c < least ? c : least;
  return {(total - counts[r]) * elem, (total - counts[(r + p - 1) % p]) * elem, (total - least) * elem, total * elem * (p - 1) / p};
}
inline traffic reduce_scatter_traffic(std::int64_t block_bytes, int p) noexcept {
  return all_gather_traffic(block_bytes, p);
}

inline traffic broadcast_traffic(std::int64_t bytes, int r, int root, int p) noexcept {
  if (p <= 1) return {};
  if (r == root) return {bytes, 0, bytes};
  if (r == (root + p - 1) % p) return {0, bytes, bytes};
  return {bytes, bytes, bytes};
}

inline void add(comm_stats& s, traffic t) noexcept {
  s.bytes_sent += t.sent;
  s.bytes_received += t.received;
  ++s.operations;
}

}  // namespace whale::detail
