// nccl_comm: the Communicator over NCCL for cuda buffers, created from an
// mpi_comm (the NCCL unique id is broadcast over MPI). Operations are enqueued
// on the communicator's stream; requests are CUDA events. Needs WHALE_HAS_CUDA and WHALE_HAS_MPI.
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
#include <vector>

#include "whale/comm/communicator.hpp"
#include "whale/comm/detail/cost.hpp"
#include "whale/comm/detail/watchdog.hpp"
#include "whale/comm/mpi_comm.hpp"

namespace whale {

namespace detail {
inline ncclDataType_t nccl_type(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
  }
  return ncclFloat32;
}
inline ncclRedOp_t nccl_op(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::max: return ncclMax;
    case reduce_op::min: return ncclMin;
  }
  return ncclSum;
}

struct nccl_state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int* scratch = nullptr;  // one int on the device, for barrier
  int rank = 0, size = 0;
  std::string name;
  comm_stats stats{};

  void check(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess)
      throw std::runtime_error("whale::nccl_comm '" + name + "': " + call + " failed: " +
                               ncclGetErrorString(r));
  }
  void check(cudaError_t e, const char* call) const {
    if (e != cudaSuccess)
      throw std::runtime_error("whale::nccl_comm '" + name + "': " + call + " failed: " +
                               cudaGetErrorString(e));
  }
  /// Takes ownership of `c`; creates the stream and scratch on the current device.
  void adopt(ncclComm_t c) {
    comm = c;
    check(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    check(ncclCommCount(comm, &size), "ncclCommCount");
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(int)), "cudaMalloc");
  }
  ~nccl_state() {
    if (comm) {
      // Unwinding (a failing rank): peers may never match pending work; abort it.
      if (std::uncaught_exceptions() > 0) ncclCommAbort(comm);
      else ncclCommDestroy(comm);
    }
    if (scratch) cudaFree(scratch);
    if (stream) cudaStreamDestroy(stream);
  }
};
}  // namespace detail

/// A communicator over NCCL. One rank per GPU: select the device (cudaSetDevice)
/// before creating it. Buffers are device pointers (view<T, whale::cuda>).
/// Tags of send/recv are ignored: NCCL matches messages between two ranks in
/// the order they are issued. Move-only.
class nccl_comm {
 public:
  using space = whale::cuda;

  /// A CUDA event recorded after the operation on the communicator's stream.
  /// wait() polls it under the watchdog; NCCL cannot say which peers are late,
  /// so the watchdog reports the operation and that the peers' progress is unknown.
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
      const auto e = cudaEventQuery(ev_);
      if (e == cudaErrorNotReady) return false;
      c_->check(e, "cudaEventQuery");
      done();
      return true;
    }
    void wait() {
      if (!ev_) return;
      detail::watchdog::scope w({this, &describe}, watchdog_timeout());
      for (unsigned spins = 0; !test(); ++spins) {
        if ((spins & 1023) == 1023) {
          ncclResult_t async = ncclSuccess;
          c_->check(ncclCommGetAsyncError(c_->comm, &async), "ncclCommGetAsyncError");
          c_->check(async, "an asynchronous NCCL operation");
        }
        if (spins > 256) std::this_thread::yield();
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
  };

  nccl_comm() = default;
  /// Collective over `over`: NCCL rank i is `over`'s rank i, on each rank's
  /// current CUDA device. Rank 0 makes the unique id; MPI broadcasts it.
  /// Without a CUDA device on some rank, every rank throws std::runtime_error
  /// naming those ranks (not NCCL's "unhandled cuda error").
  explicit nccl_comm(mpi_comm& over, std::string name = {}) : s_(std::make_unique<detail::nccl_state>()) {
    s_->name = name.empty() ? over.name() : std::move(name);
    require_devices(over);
    ncclUniqueId id{};
    if (over.rank() == 0) s_->check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    over.broadcast(&id, static_cast<index_t>(sizeof id), dtype::u8, 0);
    ncclComm_t c = nullptr;
    s_->check(ncclCommInitRank(&c, over.size(), id, over.rank()), "ncclCommInitRank");
    s_->adopt(c);
  }

  /// Collective over `over`: whether every rank sees a CUDA device; if not, the same error on every rank.
  void require_devices(mpi_comm& over) const {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    int have = e == cudaSuccess && n > 0 ? 1 : 0;
    std::vector<int> all(static_cast<std::size_t>(over.size()));
    over.all_gather(&have, all.data(), 1, dtype::i32);
    std::string missing;
    for (int r = 0; r < over.size(); ++r)
      if (!all[static_cast<std::size_t>(r)]) {
        if (!missing.empty()) missing += ',';
        missing += std::to_string(r);
      }
    if (missing.empty()) return;
    throw std::runtime_error("whale::nccl_comm '" + s_->name + "': no CUDA device was found on rank(s) " + missing + " of '" +
                             over.name() + "'" + (have ? std::string() : std::string(" (here cudaGetDeviceCount says: ") +
                             (e == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorString(e))) + ")") +
                             "; NCCL needs one GPU per rank: run where every rank has one, or communicate with mpi_comm");
  }

  bool valid() const noexcept { return s_ != nullptr; }
  int rank() const noexcept { return s_ ? s_->rank : -1; }
  int size() const noexcept { return s_ ? s_->size : 0; }
  const std::string& name() const noexcept {
    static const std::string null_name = "null";
    return s_ ? s_->name : null_name;
  }
  cudaStream_t stream() const noexcept { return s_ ? s_->stream : nullptr; }
  ncclComm_t native() const noexcept { return s_ ? s_->comm : nullptr; }
  comm_stats stats() const noexcept { return s_ ? s_->stats : comm_stats{}; }
  void reset_stats() noexcept {
    if (s_) s_->stats = {};
  }

  request iall_reduce(void* buf, index_t n, dtype t, reduce_op op) {
    auto& s = state();
    detail::add(s.stats, detail::all_reduce_traffic(n * bytes(t), s.size));
    s.check(ncclAllReduce(buf, buf, static_cast<std::size_t>(n), detail::nccl_type(t), detail::nccl_op(op),
                          s.comm, s.stream),
            "ncclAllReduce");
    return record("all_reduce", n, t);
  }
  request iall_gather(const void* in, void* out, index_t n, dtype t) {
    auto& s = state();
    detail::add(s.stats, detail::all_gather_traffic(n * bytes(t), s.size));
    s.check(ncclAllGather(in, out, static_cast<std::size_t>(n), detail::nccl_type(t), s.comm, s.stream),
            "ncclAllGather");
    return record("all_gather", n, t);
  }
  request iall_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
    auto& s = state();
    check_counts(counts, "all_gather_v");
    detail::add(s.stats, detail::all_gather_traffic(counts, s.rank, s.size, bytes(t)));
    auto* o = static_cast<char*>(out);
    s.check(ncclGroupStart(), "ncclGroupStart");
    index_t at = 0;
    for (int r = 0; r < s.size; ++r) {
      const auto c = counts[static_cast<std::size_t>(r)];
      s.check(ncclBroadcast(r == s.rank ? in : o + at * bytes(t), o + at * bytes(t),
                            static_cast<std::size_t>(c), detail::nccl_type(t), r, s.comm, s.stream),
              "ncclBroadcast");
      at += c;
    }
    s.check(ncclGroupEnd(), "ncclGroupEnd");
    return record("all_gather_v", counts[static_cast<std::size_t>(s.rank)], t);
  }
  request ireduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
    auto& s = state();
    detail::add(s.stats, detail::reduce_scatter_traffic(n * bytes(t), s.size));
    // whale's in place (out == in: result in the first block) is NCCL's in
    // place (out == in + rank·n) followed by a move to the front.
    const bool in_place = in == out;
    void* dst = in_place ? static_cast<char*>(out) + s.rank * n * bytes(t) : out;
    s.check(ncclReduceScatter(in, dst, static_cast<std::size_t>(n), detail::nccl_type(t), detail::nccl_op(op),
                              s.comm, s.stream),
            "ncclReduceScatter");
    if (in_place && dst != out)
      s.check(cudaMemcpyAsync(out, dst, static_cast<std::size_t>(n * bytes(t)), cudaMemcpyDeviceToDevice, s.stream),
              "cudaMemcpyAsync");
    return record("reduce_scatter", n, t);
  }
  request ireduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op) {
    auto& s = state();
    check_counts(counts, "reduce_scatter_v");
    detail::add(s.stats, detail::reduce_scatter_traffic(counts, s.rank, s.size, bytes(t)));
    const bool in_place = in == out;
    const auto* i = static_cast<const char*>(in);
    void* mine = out;
    s.check(ncclGroupStart(), "ncclGroupStart");
    index_t at = 0;
    for (int r = 0; r < s.size; ++r) {
      const auto c = counts[static_cast<std::size_t>(r)];
      void* dst = out;
      if (r == s.rank && in_place) mine = dst = const_cast<char*>(i + at * bytes(t));
      s.check(ncclReduce(i + at * bytes(t), dst, static_cast<std::size_t>(c), detail::nccl_type(t),
                         detail::nccl_op(op), r, s.comm, s.stream),
              "ncclReduce");
      at += c;
    }
    s.check(ncclGroupEnd(), "ncclGroupEnd");
    const auto mine_n = counts[static_cast<std::size_t>(s.rank)];
    if (mine != out)
      s.check(cudaMemcpyAsync(out, mine, static_cast<std::size_t>(mine_n * bytes(t)), cudaMemcpyDeviceToDevice,
                              s.stream),
              "cudaMemcpyAsync");
    return record("reduce_scatter_v", mine_n, t);
  }
  request ibroadcast(void* buf, index_t n, dtype t, int root) {
    auto& s = state();
    check_rank(root, "broadcast");
    detail::add(s.stats, detail::broadcast_traffic(n * bytes(t), s.rank, root, s.size));
    s.check(ncclBroadcast(buf, buf, static_cast<std::size_t>(n), detail::nccl_type(t), root, s.comm, s.stream),
            "ncclBroadcast");
    return record("broadcast", n, t);
  }
  request ibarrier() {
    auto& s = state();
    detail::add(s.stats, {});
    s.check(ncclAllReduce(s.scratch, s.scratch, 1, ncclInt32, ncclSum, s.comm, s.stream), "ncclAllReduce");
    return record("barrier", 0, dtype::i32);
  }
  request isend(const void* buf, index_t n, dtype t, int dst, int /*tag*/) {
    auto& s = state();
    check_rank(dst, "send");
    detail::add(s.stats, {n * bytes(t), 0});
    s.check(ncclSend(buf, static_cast<std::size_t>(n), detail::nccl_type(t), dst, s.comm, s.stream), "ncclSend");
    return record("send", n, t);
  }
  request irecv(void* buf, index_t n, dtype t, int src, int /*tag*/) {
    auto& s = state();
    check_rank(src, "recv");
    detail::add(s.stats, {0, n * bytes(t)});
    s.check(ncclRecv(buf, static_cast<std::size_t>(n), detail::nccl_type(t), src, s.comm, s.stream), "ncclRecv");
    return record("recv", n, t);
  }

  /// Collective (ncclCommSplit): equal colors form a communicator ordered by
  /// key; a negative color gives a null communicator.
  nccl_comm split(int color, int key = 0) { return split(color, key, name() + "/" + std::to_string(color)); }
  nccl_comm split(int color, int key, std::string name) {
    auto& s = state();
    ncclComm_t c = nullptr;
    s.check(ncclCommSplit(s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &c, nullptr), "ncclCommSplit");
    nccl_comm out;
    if (!c) return out;
    out.s_ = std::make_unique<detail::nccl_state>();
    out.s_->name = std::move(name);
    out.s_->adopt(c);
    return out;
  }

 private:
  static index_t bytes(dtype t) noexcept { return static_cast<index_t>(size_of(t)); }
  detail::nccl_state& state() const {
    if (!s_) throw std::logic_error("whale::nccl_comm: operation on a null communicator");
    return *s_;
  }
  request record(const char* op, index_t n, dtype t) {
    request r;
    r.c_ = s_.get();
    r.op_ = op;
    r.count_ = n;
    r.type_ = t;
    s_->check(cudaEventCreateWithFlags(&r.ev_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s_->check(cudaEventRecord(r.ev_, s_->stream), "cudaEventRecord");
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
