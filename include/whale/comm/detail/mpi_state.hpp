// mpi_comm's internals (comm/mpi_comm.hpp): the collective numbering, the MPI
// datatype and op of whale's dtype and reduce_op, and `mpi_comm_state`, one
// communicator's state and node-shared window. Not the mpi_comm class: mpi_comm.hpp.
#pragma once

#ifndef WHALE_HAS_MPI
#error "whale/comm/detail/mpi_state.hpp needs MPI: link whale::mpi (it defines WHALE_HAS_MPI), or use whale::local_comm"
#endif

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/comm/detail/remote_heartbeat.hpp"
#include "whale/comm/detail/watchdog.hpp"
#include "whale/comm/failure.hpp"

namespace whale {

namespace detail {

/// Collectives are numbered per communicator; the watchdog compares numbers.
enum class coll : std::int64_t { none, all_reduce, all_gather, all_gather_v, reduce_scatter,
                                 reduce_scatter_v, broadcast, barrier, split, send, recv };
inline const char* to_string(coll c) noexcept {
  constexpr const char* names[] = {"none", "all_reduce", "all_gather", "all_gather_v",
                                   "reduce_scatter", "reduce_scatter_v", "broadcast", "barrier",
                                   "split", "send", "recv"};
  auto i = static_cast<std::size_t>(c);
  return i < std::size(names) ? names[i] : "?";
}

inline MPI_Datatype mpi_type(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::bf16: return MPI_UINT16_T;  // summed by bf16_sum_op
  }
  return MPI_DATATYPE_NULL;
}
/// MPI's reduction for bf16 sums: each pair added in fp32 and rounded back to
/// bf16 (to nearest, ties to even), as NCCL's bf16 sum does.
inline void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = kernels::bf16_bits(kernels::from_bf16_bits(a[i]) + kernels::from_bf16_bits(b[i]));
}
inline MPI_Op bf16_sum_op() {
  static const MPI_Op op = [] {
    MPI_Op o = MPI_OP_NULL;
    if (MPI_Op_create(&bf16_sum, 1, &o) != MPI_SUCCESS || o == MPI_OP_NULL)
      throw std::runtime_error("whale::mpi_comm: MPI_Op_create failed for the bf16 sum");
    return o;
  }();
  return op;
}
/// The MPI op of `op` on elements of type `t`; bf16 has sum only (an error names the op).
inline MPI_Op mpi_op(reduce_op op, dtype t) {
  if (t == dtype::bf16) {
    if (op != reduce_op::sum)
      throw std::invalid_argument(std::string("whale::mpi_comm: bf16 buffers are reduced by sum only (asked: ") +
                                  to_string(op) + ")");
    return bf16_sum_op();
  }
  switch (op) {
    case reduce_op::sum: case reduce_op::avg: return MPI_SUM;
    case reduce_op::max: return MPI_MAX;
    case reduce_op::min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

/// Divide n elements of type t by p in place (avg = sum / p).
inline void divide(void* buf, index_t n, dtype t, int p) noexcept {
  if (p <= 1) return;
  auto run = [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    if constexpr (std::is_floating_point_v<T>) {
      const T s = T(1) / static_cast<T>(p);
      for (index_t i = 0; i < n; ++i) x[i] *= s;
    } else {
      for (index_t i = 0; i < n; ++i) x[i] = static_cast<T>(x[i] / p);
    }
  };
  switch (t) {
    case dtype::f32: run(static_cast<float*>(buf)); break;
    case dtype::f64: run(static_cast<double*>(buf)); break;
    case dtype::i32: run(static_cast<std::int32_t*>(buf)); break;
    case dtype::i64: run(static_cast<std::int64_t*>(buf)); break;
    case dtype::u8: run(static_cast<std::uint8_t*>(buf)); break;
    case dtype::bf16: break;  // never: bf16 reduces by sum only (mpi_op)
  }
}

inline std::string mpi_error_text(int rc) {
  char s[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, s, &len);
  return std::string(s, static_cast<std::size_t>(len));
}

/// Stops the heartbeat when MPI finalizes, whoever finalizes it: MPI_Finalize
/// deletes MPI_COMM_SELF's attributes first, and this one's deleter stops it.
/// Set once, before the first heartbeat word is registered.
inline void stop_heartbeat_at_finalize() {
  static const bool set = [] {
    int key = MPI_KEYVAL_INVALID;
    auto stop = [](MPI_Comm, int, void*, void*) -> int {
      heartbeat::instance().stop();
      return MPI_SUCCESS;
    };
    return MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, stop, &key, nullptr) == MPI_SUCCESS &&
           MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr) == MPI_SUCCESS;
  }();
  (void)set;
}

/// One communicator's state; its address is stable (requests point to it).
struct mpi_comm_state {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  std::string name;
  std::vector<int> world_ranks;  // world rank of each member, for messages
  MPI_Comm node = MPI_COMM_NULL;  // the members on this node, for the shared window
  MPI_Win win = MPI_WIN_NULL;     // node-shared: every local member's `slot`
  // [0]: number of collectives entered, [1]: the last one (coll), [2]: heartbeat (monotonic_ms), [3]: pid
  std::int64_t* slot = nullptr;
  std::vector<std::int64_t*> peer_slot;  // by rank in comm; nullptr: on another node
  std::int64_t seq = 0;
  comm_stats stats{};
  /// An operation as issued: what, how many elements (as the call was given
  /// them: an all-gather's per rank, a reduce-scatter's kept), the whole buffer's
  /// of an uneven gather or scatter, a message's peer in world numbering (-1
  /// for collectives), and its place among every recorded call of this process
  /// (the order across communicators). Kept only while `recording` (mpi_comm::record_calls).
  struct call {
    coll op = coll::none;
    std::int64_t count = 0;
    std::int64_t total = 0;
    int peer = -1;
    std::uint64_t order = 0;
  };
  /// The next place among this process's recorded calls (every communicator's).
  static std::uint64_t next_recorded() noexcept {
    static std::uint64_t n = 0;  // the main thread's alone: only it issues communication
    return ++n;
  }
  bool recording = false;
  std::vector<call> calls;

  mpi_comm_state(MPI_Comm c, std::string n) : comm(c), name(std::move(n)) {
    (void)world_rank();  // cache it for the watchdog thread
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Group g, wg;
    MPI_Comm_group(comm, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    std::vector<int> local(static_cast<std::size_t>(size));
    for (int i = 0; i < size; ++i) local[static_cast<std::size_t>(i)] = i;
    world_ranks.resize(static_cast<std::size_t>(size));
    MPI_Group_translate_ranks(g, size, local.data(), wg, world_ranks.data());
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    // Two words per rank in node-shared memory (MPI_Win_allocate_shared on the
    // ranks of this communicator that share a node), so that a timed-out rank can
    // read how far its peers got without their help. Ranks on other nodes: unknown.
    peer_slot.assign(static_cast<std::size_t>(size), nullptr);
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) != MPI_SUCCESS)
      node = MPI_COMM_NULL;
    void* base = nullptr;
    if (node != MPI_COMM_NULL &&
        MPI_Win_allocate_shared(4 * sizeof(std::int64_t), sizeof(std::int64_t), MPI_INFO_NULL, node,
                                &base, &win) == MPI_SUCCESS) {
      slot = static_cast<std::int64_t*>(base);
      slot[0] = slot[1] = 0;
      slot[3] = static_cast<std::int64_t>(::getpid());
      stop_heartbeat_at_finalize();
      heartbeat::instance().add(&slot[2]);
      int nsize = 0;
      MPI_Comm_size(node, &nsize);
      MPI_Group ng, cg;
      MPI_Comm_group(node, &ng);
      MPI_Comm_group(comm, &cg);
      std::vector<int> nl(static_cast<std::size_t>(nsize)), cl(static_cast<std::size_t>(nsize));
      for (int i = 0; i < nsize; ++i) nl[static_cast<std::size_t>(i)] = i;
      MPI_Group_translate_ranks(ng, nsize, nl.data(), cg, cl.data());
      MPI_Group_free(&ng);
      MPI_Group_free(&cg);
      for (int i = 0; i < nsize; ++i) {
        MPI_Aint sz = 0;
        int unit = 0;
        void* p = nullptr;
        if (MPI_Win_shared_query(win, i, &sz, &unit, &p) == MPI_SUCCESS && p)
          peer_slot[static_cast<std::size_t>(cl[static_cast<std::size_t>(i)])] = static_cast<std::int64_t*>(p);
      }
    } else {
      win = MPI_WIN_NULL;
    }
  }
  mpi_comm_state(const mpi_comm_state&) = delete;
  mpi_comm_state& operator=(const mpi_comm_state&) = delete;
  ~mpi_comm_state() {
    if (slot) heartbeat::instance().remove(&slot[2]);
    // Freeing is collective; during unwinding (a failing rank) leave it to the abort.
    if (comm == MPI_COMM_NULL || !mpi_active() || std::uncaught_exceptions() > 0) return;
    if (win != MPI_WIN_NULL) MPI_Win_free(&win);
    if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
    MPI_Comm_free(&comm);
  }

  /// Number the next collective and publish it to the window.
  std::int64_t enter(coll c) noexcept {
    ++seq;
    if (slot) {
      std::atomic_ref<std::int64_t>(slot[1]).store(static_cast<std::int64_t>(c), std::memory_order_relaxed);
      std::atomic_ref<std::int64_t>(slot[0]).store(seq, std::memory_order_release);
    }
    return seq;
  }
  void check(int rc, const char* call) const {
    if (rc != MPI_SUCCESS)
      throw std::runtime_error("whale::mpi_comm '" + name + "': " + call + " failed: " +
                               mpi_error_text(rc));
  }
  int to_int(index_t n, const char* op) const {
    if (n < 0 || n > INT_MAX)
      throw std::length_error(std::string("whale::") + op + " on '" + name + "': " +
                              std::to_string(n) +
                              " elements exceed MPI's int count; split the operation into chunks");
    return static_cast<int>(n);
  }
  std::string members() const {
    std::string s = "(world ranks ";
    for (std::size_t i = 0; i < world_ranks.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(world_ranks[i]);
    }
    return s + ")";
  }
};

}  // namespace detail

}  // namespace whale
