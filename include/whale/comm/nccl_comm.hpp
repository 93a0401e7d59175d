// nccl_comm: the Communicator over NCCL for cuda buffers, created from an
// mpi_comm (the NCCL unique id is broadcast over MPI). Operations are enqueued
// on the communicator's stream, each after the work already on its producer
// stream; requests are CUDA events. Needs WHALE_HAS_CUDA and WHALE_HAS_MPI.
#pragma once

#if !defined(WHALE_HAS_CUDA) || !defined(WHALE_HAS_MPI)
#error "whale/comm/nccl_comm.hpp needs CUDA, NCCL and MPI: link whale::cuda and whale::mpi"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "whale/comm/communicator.hpp"
#include "whale/comm/detail/nccl_state.hpp"
#include "whale/comm/detail/watchdog.hpp"
#include "whale/comm/failure.hpp"
#include "whale/comm/mpi_comm.hpp"

namespace whale {

/// A communicator over NCCL. One rank per GPU: select the device (cudaSetDevice,
/// or select_device_by_local_rank()) before creating it. Buffers are device
/// pointers (view<T, whale::cuda>). Every operation runs on stream() after the
/// work already enqueued on the producer stream (set_producer_stream; default
/// the legacy default stream). Tags of send/recv are ignored: NCCL matches
/// messages between two ranks in the order they are issued. Move-only.
class nccl_comm {
 public:
  using space = whale::cuda;

  /// A CUDA event recorded after the operation on the communicator's stream.
  /// wait() polls it under the watchdog; NCCL cannot say which peers are late,
  /// so the watchdog reports the operation and that the peers' progress is unknown.
  /// A request made inside an open group can be waited only after the group
  /// ends (NCCL issues the group's operations then); destroyed before, it is
  /// dropped without waiting (later work on stream() still follows the operation).
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
      if (ev_ && deferred_ && detail::nccl_group().holds(ev_)) {
        detail::nccl_group().forget(ev_);  // not issued yet: waiting could only hang
        cudaEventDestroy(ev_);
        return;
      }
      if (ev_ && std::uncaught_exceptions() == 0) {
        try {
          wait();
        } catch (...) {
          detail::fatal(detail::current_exception_message());
        }
      }
      if (ev_) cudaEventDestroy(ev_);
    }
    bool test() {
      if (!ev_) return true;
      if (deferred_) {
        // A never-recorded event reads as complete: refuse instead of lying.
        if (detail::nccl_group().holds(ev_))
          throw std::logic_error("whale::nccl_comm '" + c_->name + "': waiting for a " + op_ +
                                 " issued inside a group that is still open; NCCL issues the group's "
                                 "operations when it ends: end the group (g.end() or leave its scope) first");
        deferred_ = false;
      }
      const auto e = cudaEventQuery(ev_);
      if (e == cudaErrorNotReady) return false;
      c_->check(e, "cudaEventQuery");
      done();
      return true;
    }
    void wait() {
      wait([] {});
    }
    /// Stream `s` (a cudaStream_t) waits for the operation; the host does not.
    /// The request is complete afterwards (its event is released once the device is done with it).
    void join_on(void* s) {
      if (!ev_) return;
      if (deferred_) {
        if (detail::nccl_group().holds(ev_))
          throw std::logic_error("whale::nccl_comm '" + c_->name + "': joining a " + op_ +
                                 " issued inside a group that is still open; end the group first");
        deferred_ = false;
      }
      c_->check(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), ev_, 0), "cudaStreamWaitEvent");
      done();
    }
    /// wait(), calling `poll()` between the checks: another library's progress
    /// (MPI moves its pending messages only inside its calls).
    template <class Poll> void wait(Poll&& poll) {
      if (!ev_) return;
      if (!test()) {
        detail::watchdog::scope w({this, &describe}, watchdog_timeout());
        for (unsigned spins = 0; !test(); ++spins) {
          poll();
          if ((spins & 1023) == 1023) {
            ncclResult_t async = ncclSuccess;
            c_->check(ncclCommGetAsyncError(c_->comm, &async), "ncclCommGetAsyncError");
            c_->check(async, "an asynchronous NCCL operation");
          }
          if (spins > 256) std::this_thread::yield();
        }
      }
    }

   private:
    friend class nccl_comm;
    void swap(request& o) noexcept {
      std::swap(ev_, o.ev_);
      std::swap(c_, o.c_);
      std::swap(op_, o.op_);
      std::swap(count_, o.count_);
      std::swap(type_, o.type_);
      std::swap(deferred_, o.deferred_);
    }
    void done() {
      cudaEventDestroy(ev_);
      ev_ = nullptr;
    }
    static std::string describe(const void* self, double seconds) {
      auto& r = *static_cast<const request*>(self);
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g", seconds);
      return "watchdog: nccl " + std::string(r.op_) + " (" + std::to_string(r.count_) + " × " +
             to_string(r.type_) + ") on communicator '" + r.c_->name + "' (" +
             std::to_string(r.c_->size) + " ranks) has not completed after " + secs +
             " s; NCCL does not expose which ranks did not arrive: the progress of the other " +
             std::to_string(r.c_->size - 1) + " ranks is unknown; aborting the job";
    }
    cudaEvent_t ev_ = nullptr;
    detail::nccl_state* c_ = nullptr;
    const char* op_ = "";
    index_t count_ = 0;
    dtype type_ = dtype::f32;
    bool deferred_ = false;  // made inside a group: its event is recorded when the group ends
  };

  /// An open NCCL group (ncclGroupStart) until it ends (ncclGroupEnd): end(), or
  /// leaving its scope. NCCL issues the operations of a group together, so sends
  /// and receives inside one progress concurrently and cannot block each other
  /// (a lone send blocks its stream until the peer posts the matching receive).
  /// As in NCCL, a group belongs to the calling thread and holds every NCCL call
  /// of that thread, on any communicator; groups nest (the outermost end issues).
  /// Creating or splitting a communicator inside one is an error. If an exception
  /// leaves its scope, the group is ended and the exception goes on.
  ///   { auto g = comm.group(); auto a = comm.isend(...); auto b = comm.irecv(...); }
  class [[nodiscard]] group_guard {
   public:
    group_guard(const group_guard&) = delete;
    group_guard& operator=(const group_guard&) = delete;
    ~group_guard() {
      if (!open_) return;
      if (std::uncaught_exceptions() > unwinding_) {  // ends it; the exception in flight is the one to report
        close();
        return;
      }
      try {
        end();
      } catch (...) {
        detail::fatal(detail::current_exception_message());
      }
    }
    /// Ends the group now: NCCL enqueues its operations (at the outermost end).
    /// Throws if ncclGroupEnd fails; the group's requests then complete at once.
    void end() {
      if (!open_) return;
      const ncclResult_t r = close();
      s_->check(r, "ncclGroupEnd");
      s_->check(pending_, "enqueuing the work that follows the group");
    }

   private:
    friend class nccl_comm;
    explicit group_guard(detail::nccl_state& s) : s_(&s), unwinding_(std::uncaught_exceptions()) {
      s.check(ncclGroupStart(), "ncclGroupStart");
      ++detail::nccl_group().depth;
      open_ = true;
    }
    // ncclGroupEnd, then at the outermost end the copies and events that follow the group.
    ncclResult_t close() noexcept {
      open_ = false;
      auto& g = detail::nccl_group();
      --g.depth;
      const ncclResult_t r = ncclGroupEnd();
      if (g.depth > 0) return r;
      for (const auto& st : g.after) {
        cudaError_t e = cudaSuccess;
        if (st.bytes > 0) e = cudaMemcpyAsync(st.dst, st.src, st.bytes, cudaMemcpyDeviceToDevice, st.stream);
        if (e == cudaSuccess && st.ev) e = cudaEventRecord(st.ev, st.stream);
        if (e != cudaSuccess && pending_ == cudaSuccess) pending_ = e;
      }
      g.after.clear();
      return r;
    }
    detail::nccl_state* s_;
    int unwinding_;
    bool open_ = false;
    cudaError_t pending_ = cudaSuccess;
  };

  nccl_comm() = default;
  /// Collective over `over`: NCCL rank i is `over`'s rank i, on each rank's
  /// current CUDA device. Rank 0 makes the unique id; MPI broadcasts it.
  /// Without a CUDA device on some rank, every rank throws std::runtime_error
  /// naming those ranks (not NCCL's "unhandled cuda error"). ncclCommInitRank
  /// blocks until every rank joins: it runs under the watchdog.
  explicit nccl_comm(mpi_comm& over, std::string name = {});

  /// Selects this process's GPU from its rank on the node, before a nccl_comm is
  /// created (comm/launcher.hpp: the local rank from Open MPI, MPICH / Intel
  /// MPI, a torchrun-style launcher or Slurm, among the devices
  /// CUDA_VISIBLE_DEVICES leaves visible), and returns it. Throws
  /// std::invalid_argument naming a launcher variable whose value is not a
  /// whole number in range; std::runtime_error if there is no device or the
  /// node has more ranks than visible devices (naming both numbers).
  static int select_device_by_local_rank();

  /// Collective over `over`: whether every rank sees a CUDA device; if not, the same error on every rank.
  void require_devices(mpi_comm& over) const;

  bool valid() const noexcept { return s_ != nullptr; }
  int rank() const noexcept { return s_ ? s_->rank : -1; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  const std::string& name() const noexcept {
    static const std::string null_name = "null";
    return s_ ? s_->name : null_name;
  }
  cudaStream_t stream() const noexcept { return s_ ? s_->stream : nullptr; }
  /// The stream whose work every operation waits for before it starts (an event
  /// recorded there at the call): where the buffers are written. Default
  /// cudaStreamLegacy (the legacy default stream, which also follows the other
  /// blocking streams). split() passes it on.
  cudaStream_t producer_stream() const noexcept { return s_ ? s_->producer : cudaStreamLegacy; }
  void set_producer_stream(cudaStream_t s) { state().producer = s; }
  ncclComm_t native() const noexcept { return s_ ? s_->comm : nullptr; }
  comm_stats stats() const noexcept { return s_ ? s_->stats : comm_stats{}; }
  void reset_stats() noexcept {
    if (s_) s_->stats = {};
  }

  /// Opens a group on this thread until the guard ends: `auto g = comm.group();` (see group_guard).
  group_guard group() { return group_guard(state()); }

  request iall_reduce(void* buf, index_t n, dtype t, reduce_op op);
  request iall_gather(const void* in, void* out, index_t n, dtype t);
  request iall_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t);
  request ireduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op);
  request ireduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op);
  request ibroadcast(void* buf, index_t n, dtype t, int root);
  request ibarrier();
  /// Alone (outside a group) a send blocks the stream until the peer posts the
  /// matching receive, and everything later on stream() waits behind it: two
  /// ranks that each send before they receive deadlock. Exchange with
  /// isendrecv, or issue several sends and receives inside one group().
  request isend(const void* buf, index_t n, dtype t, int dst, int /*tag*/);
  /// Alone it blocks the stream until the peer's send arrives (see isend).
  request irecv(void* buf, index_t n, dtype t, int src, int /*tag*/);
  /// Sends `sn` elements of `sbuf` to `dst` and receives `rn` into `rbuf` from
  /// `src`, as one NCCL group, so both progress together: a ring or pairwise
  /// exchange cannot deadlock. One request (its count: sn + rn) for both.
  request isendrecv(const void* sbuf, index_t sn, int dst, void* rbuf, index_t rn, int src, dtype t);

  /// Collective (ncclCommSplit, NCCL >= 2.18 both at build and at run time):
  /// equal colors form a communicator ordered by key; a negative color gives a
  /// null communicator. Blocks until every rank of this one calls it (under the
  /// watchdog). The new communicator keeps this one's producer stream.
  nccl_comm split(int color, int key = 0) { return split(color, key, name() + "/" + std::to_string(color)); }
  nccl_comm split(int color, int key, std::string name);

 private:
  static index_t bytes(dtype t) noexcept { return static_cast<index_t>(size_of(t)); }
  detail::nccl_state& state() const {
    if (!s_) throw std::logic_error("whale::nccl_comm: operation on a null communicator");
    return *s_;
  }
  // The request's event follows the operation on the stream; inside a group the
  // operation is not enqueued yet, so the event is recorded when the group ends.
  request record(const char* op, index_t n, dtype t) {
    request r;
    r.c_ = s_.get();
    r.op_ = op;
    r.count_ = n;
    r.type_ = t;
    s_->check(cudaEventCreateWithFlags(&r.ev_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    if (auto& g = detail::nccl_group(); g.depth > 0) {
      g.after.push_back({s_->stream, r.ev_, nullptr, nullptr, 0});
      r.deferred_ = true;
    } else {
      s_->check(cudaEventRecord(r.ev_, s_->stream), "cudaEventRecord");
    }
    return r;
  }
  void check_rank(int r, const char* op) const {
    if (r < 0 || r >= s_->size)
      throw std::invalid_argument(std::string("whale::") + op + ": rank " + std::to_string(r) +
                                  " is not in communicator '" + s_->name + "' of " + std::to_string(s_->size) +
                                  " ranks");
  }
  void check_counts(std::span<const index_t> counts, const char* op) const {
    if (static_cast<int>(counts.size()) != s_->size)
      throw std::invalid_argument(std::string("whale::") + op + ": " + std::to_string(counts.size()) +
                                  " counts for communicator '" + s_->name + "' of " +
                                  std::to_string(s_->size) + " ranks; give one count per rank");
  }

  std::unique_ptr<detail::nccl_state> s_;
};

static_assert(Communicator<nccl_comm>);

}  // namespace whale

#include "whale/comm/detail/nccl_ops.hpp"
