// The `Communicator` concept, reduction operators and the traffic counters that
// every communicator (local_comm, mpi_comm, nccl_comm) shares. No transport
// lives here; the typed collectives (whale::all_reduce, ...) are in collectives.hpp.
#pragma once

#include <concepts>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>

#include "whale/tensor/tensor.hpp"

namespace whale {

/// How a reduction combines the ranks' values. `avg` is `sum` divided by the
/// communicator's size (integer types: truncated toward zero).
enum class reduce_op : int { sum, avg, max, min };

inline const char* to_string(reduce_op op) noexcept {
  constexpr const char* names[] = {"sum", "avg", "max", "min"};
  return names[static_cast<int>(op)];
}
inline const char* to_string(dtype d) noexcept {
  constexpr const char* names[] = {"f32", "f64", "i32", "i64", "u8", "bf16"};
  return names[static_cast<int>(d)];
}

/// Traffic of one communicator as seen by this rank.
///
/// Definition (the same for every communicator): the bytes this rank sends and
/// receives under the standard bandwidth-optimal algorithms on `p` ranks, for
/// an operation whose full buffer holds `n` bytes:
///   all_reduce      ring reduce-scatter + ring all-gather: 2·(p−1)·n/p each way
///   all_gather(v)   ring: sent = n − block(r+1), received = n − block(r)
///   reduce_scatter(v) ring: sent = n − block(r), received = n − block(r−1)
///   broadcast       chain from the root: root sends n; others receive n and
///                   forward n, except the last rank of the chain (root−1)
///   send / recv     the message: n sent / n received
///   barrier         0
/// where `n` is the gathered (all_gather) or the input (reduce_scatter) size and
/// block(i) the bytes of rank i's block. A world of one rank moves nothing:
/// every count is 0. This is a cost model, not a measurement of what the MPI
/// library chose; it is what benchmarks report as comm bytes.
struct comm_stats {
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;
  std::int64_t operations = 0;  ///< operations issued (collectives, sends, receives)

  comm_stats& operator+=(const comm_stats& o) noexcept {
    bytes_sent += o.bytes_sent;
    bytes_received += o.bytes_received;
    operations += o.operations;
    return *this;
  }
  friend comm_stats operator+(comm_stats a, const comm_stats& b) noexcept { return a += b; }
  friend bool operator==(const comm_stats&, const comm_stats&) = default;
  friend std::ostream& operator<<(std::ostream& os, const comm_stats& s) {
    return os << "sent " << s.bytes_sent << " B, received " << s.bytes_received << " B, "
              << s.operations << " ops";
  }
};

/// A pending non-blocking operation: `test()` says whether it completed (and
/// finishes it if so), `wait()` blocks until it completes.
template <class R>
concept Request = std::movable<R> && requires(R& r) {
  { r.test() } -> std::same_as<bool>;
  r.wait();
};

/// A group of ranks that runs collectives. Members beyond this list are helpers.
/// The core is type-erased: element counts and a `dtype`; the typed layer in
/// collectives.hpp computes them from views. Every operation is non-blocking
/// and returns a `request`; blocking calls are `i...(...).wait()`.
///   space                    where buffers must live (whale::host, whale::cuda)
///   rank(), size(), name()   this rank's index, the group's size, a label for messages
///   stats(), reset_stats()   traffic counters (comm_stats)
///   iall_reduce(buf, n, t, op)                      in place
///   iall_gather(in, out, n, t)                      out holds size·n; in may be out + rank·n
///   iall_gather_v(in, out, counts, t)               counts[r] from rank r, in rank order
///   ireduce_scatter(in, out, n, t, op)              in holds size·n; out may be in
///   ireduce_scatter_v(in, out, counts, t, op)       rank r gets block r of counts[r]
///   ibroadcast(buf, n, t, root)
///   isend(buf, n, t, dst, tag), irecv(buf, n, t, src, tag)
///   ibarrier()
///   split(color, key)        collective; the ranks of equal color, ordered by key
template <class C>
concept Communicator =
    std::movable<C> &&
    requires(C& c, const C& cc, void* p, const void* cp, index_t n, std::span<const index_t> counts,
             dtype t, reduce_op op, int peer) {
      typename C::space;
      typename C::request;
      requires Request<typename C::request>;
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      { cc.name() } -> std::convertible_to<std::string>;
      { cc.stats() } -> std::same_as<comm_stats>;
      c.reset_stats();
      { c.iall_reduce(p, n, t, op) } -> std::same_as<typename C::request>;
      { c.iall_gather(cp, p, n, t) } -> std::same_as<typename C::request>;
      { c.iall_gather_v(cp, p, counts, t) } -> std::same_as<typename C::request>;
      { c.ireduce_scatter(cp, p, n, t, op) } -> std::same_as<typename C::request>;
      { c.ireduce_scatter_v(cp, p, counts, t, op) } -> std::same_as<typename C::request>;
      { c.ibroadcast(p, n, t, peer) } -> std::same_as<typename C::request>;
      { c.isend(cp, n, t, peer, peer) } -> std::same_as<typename C::request>;
      { c.irecv(p, n, t, peer, peer) } -> std::same_as<typename C::request>;
      { c.ibarrier() } -> std::same_as<typename C::request>;
      { c.split(peer, peer) } -> std::same_as<C>;
    };

}  // namespace whale
