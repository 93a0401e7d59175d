// mpi_comm: the Communicator over Open MPI (host buffers). Typed calls come
// from collectives.hpp; this is the type-erased core (void*, count, dtype),
// traffic counters and the watchdog. Include only when WHALE_HAS_MPI is defined.
#pragma once

#ifndef WHALE_HAS_MPI
#error "whale/comm/mpi_comm.hpp needs MPI: link whale::mpi (it defines WHALE_HAS_MPI), or use whale::local_comm"
#endif

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "whale/comm/communicator.hpp"
#include "whale/comm/detail/cost.hpp"
#include "whale/comm/detail/flight.hpp"
#include "whale/comm/detail/mpi_state.hpp"
#include "whale/comm/detail/watchdog.hpp"
#include "whale/comm/failure.hpp"
#include "whale/detail/compiled.hpp"

namespace whale {

/// A communicator over Open MPI: owns an MPI communicator (a duplicate, so
/// whale's traffic never matches the user's), counts traffic (comm_stats) and
/// runs every blocking call under the watchdog. Blocking operations call the
/// blocking MPI functions (Open MPI's tuned algorithms, several times faster
/// than its non-blocking ones for big buffers); i-operations return a request.
/// Move-only; destroying it is collective (MPI_Comm_free, MPI_Win_free), so
/// every rank destroys the same communicators in the same order, as SPMD code does.
class mpi_comm {
 public:
  using space = host;

  /// A pending operation. test() polls; wait() blocks in MPI_Wait under the
  /// watchdog. Destroying an unfinished request waits for it, except while an
  /// exception unwinds (the job is about to be aborted then).
  class request {
   public:
    request() = default;
    request(request&& o) noexcept { swap(o); }
    request& operator=(request&& o) noexcept {
      if (this != &o) {
        request t(std::move(o));
        swap(t);
      }
      return *this;
    }
    ~request() {
      if (active_ && std::uncaught_exceptions() == 0) wait();
    }

    bool test() {
      if (!active_) return true;
      int flag = 0;
      c_->check(MPI_Test(&r_, &flag, MPI_STATUS_IGNORE), "MPI_Test");
      if (flag) finish();
      return flag != 0;
    }
    void wait() {
      if (!active_) return;
      guarded([&] { return MPI_Wait(&r_, MPI_STATUS_IGNORE); }, "MPI_Wait");
    }

   private:
    friend class mpi_comm;
    void swap(request& o) noexcept {
      std::swap(r_, o.r_);
      std::swap(c_, o.c_);
      std::swap(active_, o.active_);
      std::swap(op_, o.op_);
      std::swap(seq_, o.seq_);
      std::swap(flight_, o.flight_);
      std::swap(count_, o.count_);
      std::swap(type_, o.type_);
      std::swap(rop_, o.rop_);
      std::swap(peer_, o.peer_);
      std::swap(tag_, o.tag_);
      std::swap(avg_buf_, o.avg_buf_);
      std::swap(avg_n_, o.avg_n_);
      std::swap(counts_, o.counts_);
      std::swap(displs_, o.displs_);
    }
    /// Run one blocking MPI call under the watchdog, then finish.
    template <class F> void guarded(F&& call, const char* name) {
      int rc;
      {
        detail::watchdog::scope w({this, &describe, &dead_peer}, watchdog_timeout());
        rc = call();
      }
      c_->check(rc, name);
      finish();
    }
    void finish() {
      active_ = false;
      detail::flight_recorder::instance().done(flight_);
      if (avg_buf_) detail::divide(avg_buf_, avg_n_, type_, c_->size);
      avg_buf_ = nullptr;
    }
    static std::string dead_peer(const void* self) { return static_cast<const request*>(self)->peer_problem(); }
    std::string operation() const;
    std::string peer_problem() const;
    static std::string describe(const void* self, double seconds) {
      return static_cast<const request*>(self)->message(seconds);
    }
    std::string message(double seconds) const;

    MPI_Request r_ = MPI_REQUEST_NULL;
    detail::mpi_comm_state* c_ = nullptr;
    bool active_ = false;
    detail::coll op_ = detail::coll::none;
    std::int64_t seq_ = 0;
    std::uint64_t flight_ = 0;  // its ticket in the flight recorder
    index_t count_ = 0;
    dtype type_ = dtype::f32;
    reduce_op rop_ = reduce_op::sum;
    int peer_ = -1, tag_ = 0;
    void* avg_buf_ = nullptr;  // avg: divide after completion
    index_t avg_n_ = 0;
    std::vector<int> counts_, displs_;  // v-collectives: MPI reads them until completion
  };

  mpi_comm() = default;  ///< a null communicator (valid() is false)
  /// Adopt `c` (whale frees it). Collective over `c`.
  mpi_comm(MPI_Comm c, std::string name)
      : s_(std::make_unique<detail::mpi_comm_state>(c, std::move(name))) {}

  /// A duplicate of MPI_COMM_WORLD named "world". Collective; MPI must be initialized.
  static mpi_comm world();

  bool valid() const noexcept { return s_ != nullptr; }
  int rank() const noexcept { return s_ ? s_->rank : -1; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  const std::string& name() const noexcept {
    static const std::string null_name = "null";
    return s_ ? s_->name : null_name;
  }
  /// World rank of member `r`.
  int world_rank(int r) const { return state().world_ranks.at(static_cast<std::size_t>(r)); }
  const std::vector<int>& world_ranks() const { return state().world_ranks; }
  MPI_Comm native() const noexcept { return s_ ? s_->comm : MPI_COMM_NULL; }
  comm_stats stats() const noexcept { return s_ ? s_->stats : comm_stats{}; }
  /// From now on, keep every operation this communicator issues, in order
  /// (`on`; the earlier record is dropped), or stop keeping them. Tests compare
  /// the record with the lowered program's operations (tests/mpi_plan.cpp).
  void record_calls(bool on) {
    auto& s = state();
    s.recording = on;
    if (on) s.calls.clear();
  }
  /// The operations kept since record_calls(true), in the order they were issued.
  const std::vector<detail::mpi_comm_state::call>& recorded_calls() const { return state().calls; }
  void reset_stats() noexcept {
    if (s_) s_->stats = {};
  }

  // ---- the type-erased core: non-blocking (Communicator) and blocking ----
  request iall_reduce(void* buf, index_t n, dtype t, reduce_op op) { return do_all_reduce<false>(buf, n, t, op); }
  void all_reduce(void* buf, index_t n, dtype t, reduce_op op) { do_all_reduce<true>(buf, n, t, op); }
  request iall_gather(const void* in, void* out, index_t n, dtype t) { return do_all_gather<false>(in, out, n, t); }
  void all_gather(const void* in, void* out, index_t n, dtype t) { do_all_gather<true>(in, out, n, t); }
  request iall_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    return do_all_gather_v<false>(in, out, counts, t);
  }
  void all_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    do_all_gather_v<true>(in, out, counts, t);
  }
  request ireduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
    return do_reduce_scatter<false>(in, out, n, t, op);
  }
  void reduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
    do_reduce_scatter<true>(in, out, n, t, op);
  }
  request ireduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op) {
    return do_reduce_scatter_v<false>(in, out, counts, t, op);
  }
  void reduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op) {
    do_reduce_scatter_v<true>(in, out, counts, t, op);
  }
  request ibroadcast(void* buf, index_t n, dtype t, int root) { return do_broadcast<false>(buf, n, t, root); }
  void broadcast(void* buf, index_t n, dtype t, int root) { do_broadcast<true>(buf, n, t, root); }
  request ibarrier() { return do_barrier<false>(); }
  void barrier() { do_barrier<true>(); }
  request isend(const void* buf, index_t n, dtype t, int dst, int tag) { return do_send<false>(buf, n, t, dst, tag); }
  void send(const void* buf, index_t n, dtype t, int dst, int tag) { do_send<true>(buf, n, t, dst, tag); }
  request irecv(void* buf, index_t n, dtype t, int src, int tag) { return do_recv<false>(buf, n, t, src, tag); }
  void recv(void* buf, index_t n, dtype t, int src, int tag) { do_recv<true>(buf, n, t, src, tag); }

  /// Collective: the ranks of equal `color` form a new communicator, ordered by
  /// `key` (then by rank). A negative color gives a null communicator.
  mpi_comm split(int color, int key = 0) { return split(color, key, name() + "/" + std::to_string(color)); }
  mpi_comm split(int color, int key, std::string name);

 private:
  // Each operation once: Blocking picks the blocking MPI call under the watchdog,
  // else the non-blocking one, returning its request.
  template <bool Blocking, class B, class NB>
  request run(request r, B&& blocking, NB&& nonblocking, const char* bname, const char* nbname) {
    if constexpr (Blocking) {
      r.guarded(std::forward<B>(blocking), bname);
    } else {
      r.c_->check(nonblocking(&r.r_), nbname);
    }
    return r;
  }

  template <bool Blocking> request do_all_reduce(void* buf, index_t n, dtype t, reduce_op op) {
    auto& s = state();
    const auto O = detail::mpi_op(op, t);  // before start: a refused op enters no collective
    auto r = start(detail::coll::all_reduce, n, t);
    r.rop_ = op;
    const int cn = s.to_int(n, "all_reduce");
    detail::add(s.stats, detail::all_reduce_traffic(n * static_cast<index_t>(size_of(t)), s.size));
    if (op == reduce_op::avg) r.avg_buf_ = buf, r.avg_n_ = n;
    const auto T = detail::mpi_type(t);
    return run<Blocking>(
        std::move(r), [&] { return MPI_Allreduce(MPI_IN_PLACE, buf, cn, T, O, s.comm); },
        [&](MPI_Request* q) { return MPI_Iallreduce(MPI_IN_PLACE, buf, cn, T, O, s.comm, q); },
        "MPI_Allreduce", "MPI_Iallreduce");
  }

  template <bool Blocking> request do_all_gather(const void* in, void* out, index_t n, dtype t) {
    auto& s = state();
    auto r = start(detail::coll::all_gather, n, t);
    const auto eb = static_cast<index_t>(size_of(t));
    s.to_int(n * s.size, "all_gather");
    const int cn = s.to_int(n, "all_gather");
    detail::add(s.stats, detail::all_gather_traffic(n * eb, s.size));
    const void* src = in == static_cast<const char*>(out) + s.rank * n * eb ? MPI_IN_PLACE : in;
    const auto T = detail::mpi_type(t);
    return run<Blocking>(
        std::move(r), [&] { return MPI_Allgather(src, cn, T, out, cn, T, s.comm); },
        [&](MPI_Request* q) { return MPI_Iallgather(src, cn, T, out, cn, T, s.comm, q); },
        "MPI_Allgather", "MPI_Iallgather");
  }

  template <bool Blocking>
  request do_all_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    auto& s = state();
    check_counts(counts, "all_gather_v");
    const auto me = static_cast<std::size_t>(s.rank);
    auto r = start(detail::coll::all_gather_v, counts[me], t);
    if (s.recording) {  // the whole buffer too
      s.calls.back().total = 0;
      for (auto c : counts) s.calls.back().total += c;
    }
    const auto eb = static_cast<index_t>(size_of(t));
    fill_v(r, counts, "all_gather_v");
    detail::add(s.stats, detail::all_gather_traffic(counts, s.rank, s.size, eb));
    const void* src = in == static_cast<const char*>(out) + index_t{r.displs_[me]} * eb ? MPI_IN_PLACE : in;
    const auto T = detail::mpi_type(t);
    const int* rc = r.counts_.data();
    const int* rd = r.displs_.data();
    const int mine = r.counts_[me];
    return run<Blocking>(
        std::move(r), [&] { return MPI_Allgatherv(src, mine, T, out, rc, rd, T, s.comm); },
        [&](MPI_Request* q) { return MPI_Iallgatherv(src, mine, T, out, rc, rd, T, s.comm, q); },
        "MPI_Allgatherv", "MPI_Iallgatherv");
  }

  template <bool Blocking>
  request do_reduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
    auto& s = state();
    const auto O = detail::mpi_op(op, t);
    auto r = start(detail::coll::reduce_scatter, n, t);
    r.rop_ = op;
    s.to_int(n * s.size, "reduce_scatter");
    const int cn = s.to_int(n, "reduce_scatter");
    detail::add(s.stats, detail::reduce_scatter_traffic(n * static_cast<index_t>(size_of(t)), s.size));
    if (op == reduce_op::avg) r.avg_buf_ = out, r.avg_n_ = n;
    const void* src = in == out ? MPI_IN_PLACE : in;
    const auto T = detail::mpi_type(t);
    return run<Blocking>(
        std::move(r), [&] { return MPI_Reduce_scatter_block(src, out, cn, T, O, s.comm); },
        [&](MPI_Request* q) { return MPI_Ireduce_scatter_block(src, out, cn, T, O, s.comm, q); },
        "MPI_Reduce_scatter_block", "MPI_Ireduce_scatter_block");
  }

  template <bool Blocking>
  request do_reduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t,
                              reduce_op op) {
    auto& s = state();
    const auto O = detail::mpi_op(op, t);
    check_counts(counts, "reduce_scatter_v");
    const auto me = static_cast<std::size_t>(s.rank);
    auto r = start(detail::coll::reduce_scatter_v, counts[me], t);
    if (s.recording) {  // the whole buffer too
      s.calls.back().total = 0;
      for (auto c : counts) s.calls.back().total += c;
    }
    r.rop_ = op;
    fill_v(r, counts, "reduce_scatter_v");
    detail::add(s.stats, detail::reduce_scatter_traffic(counts, s.rank, s.size, static_cast<index_t>(size_of(t))));
    if (op == reduce_op::avg) r.avg_buf_ = out, r.avg_n_ = counts[me];
    const void* src = in == out ? MPI_IN_PLACE : in;
    const auto T = detail::mpi_type(t);
    const int* rc = r.counts_.data();
    return run<Blocking>(
        std::move(r), [&] { return MPI_Reduce_scatter(src, out, rc, T, O, s.comm); },
        [&](MPI_Request* q) { return MPI_Ireduce_scatter(src, out, rc, T, O, s.comm, q); },
        "MPI_Reduce_scatter", "MPI_Ireduce_scatter");
  }

  template <bool Blocking> request do_broadcast(void* buf, index_t n, dtype t, int root) {
    auto& s = state();
    check_rank(root, "broadcast");
    auto r = start(detail::coll::broadcast, n, t);
    r.peer_ = root;
    const int cn = s.to_int(n, "broadcast");
    detail::add(s.stats, detail::broadcast_traffic(n * static_cast<index_t>(size_of(t)), s.rank, root, s.size));
    const auto T = detail::mpi_type(t);
    return run<Blocking>(
        std::move(r), [&] { return MPI_Bcast(buf, cn, T, root, s.comm); },
        [&](MPI_Request* q) { return MPI_Ibcast(buf, cn, T, root, s.comm, q); }, "MPI_Bcast", "MPI_Ibcast");
  }

  template <bool Blocking> request do_barrier() {
    auto& s = state();
    auto r = start(detail::coll::barrier, 0, dtype::u8);
    detail::add(s.stats, {});
    return run<Blocking>(
        std::move(r), [&] { return MPI_Barrier(s.comm); },
        [&](MPI_Request* q) { return MPI_Ibarrier(s.comm, q); }, "MPI_Barrier", "MPI_Ibarrier");
  }

  template <bool Blocking> request do_send(const void* buf, index_t n, dtype t, int dst, int tag) {
    auto& s = state();
    check_rank(dst, "send");
    auto r = p2p(detail::coll::send, n, t, dst, tag);
    const int cn = s.to_int(n, "send");
    detail::add(s.stats, {n * static_cast<index_t>(size_of(t)), 0});
    const auto T = detail::mpi_type(t);
    return run<Blocking>(
        std::move(r), [&] { return MPI_Send(buf, cn, T, dst, tag, s.comm); },
        [&](MPI_Request* q) { return MPI_Isend(buf, cn, T, dst, tag, s.comm, q); }, "MPI_Send", "MPI_Isend");
  }

  template <bool Blocking> request do_recv(void* buf, index_t n, dtype t, int src, int tag) {
    auto& s = state();
    check_rank(src, "recv");
    auto r = p2p(detail::coll::recv, n, t, src, tag);
    const int cn = s.to_int(n, "recv");
    detail::add(s.stats, {0, n * static_cast<index_t>(size_of(t))});
    const auto T = detail::mpi_type(t);
    return run<Blocking>(
        std::move(r), [&] { return MPI_Recv(buf, cn, T, src, tag, s.comm, MPI_STATUS_IGNORE); },
        [&](MPI_Request* q) { return MPI_Irecv(buf, cn, T, src, tag, s.comm, q); }, "MPI_Recv", "MPI_Irecv");
  }

  detail::mpi_comm_state& state() const {
    if (!s_) throw std::logic_error("whale::mpi_comm: operation on a null communicator");
    return *s_;
  }
  request start(detail::coll op, index_t n, dtype t);
  request p2p(detail::coll op, index_t n, dtype t, int peer, int tag);
  void check_rank(int r, const char* op) const {
    if (r < 0 || r >= s_->size)
      throw std::invalid_argument(std::string("whale::") + op + ": rank " + std::to_string(r) +
                                  " is not in communicator '" + s_->name + "' of " +
                                  std::to_string(s_->size) + " ranks");
  }
  void check_counts(std::span<const index_t> counts, const char* op) const;
  void fill_v(request& r, std::span<const index_t> counts, const char* op) const;

  std::unique_ptr<detail::mpi_comm_state> s_;
};

static_assert(Communicator<mpi_comm>);

}  // namespace whale

#include "whale/comm/detail/mpi_reports.hpp"

#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/comm/mpi_comm_impl.hpp"
#endif
