// nccl_comm's internals (comm/nccl_comm.hpp): the NCCL datatype and op of whale's
// dtype and reduce_op, this thread's open NCCL groups, `nccl_state` (one communicator's
// handles) and the watchdog's report on a joining rank. Not the nccl_comm class: nccl_comm.hpp.
#pragma once

#if !defined(WHALE_HAS_CUDA) || !defined(WHALE_HAS_MPI)
#error "whale/comm/detail/nccl_state.hpp needs CUDA, NCCL and MPI: link whale::cuda and whale::mpi"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/comm/communicator.hpp"

namespace whale {

namespace detail {
inline ncclDataType_t nccl_type(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
    case dtype::bf16: return ncclBfloat16;
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

/// "2.18.0" from an NCCL_VERSION_CODE (before 2.9: X·1000 + Y·100 + Z, since: X·10000 + Y·100 + Z).
inline std::string nccl_version_string(int v) {
  const int major = v >= 10000 ? v / 10000 : v / 1000, minor = v >= 10000 ? v % 10000 / 100 : v % 1000 / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
}

/// This thread's open NCCL groups (ncclGroupStart/End hold per thread, for every
/// communicator): their depth, and the stream work that must follow the grouped
/// operations, which NCCL enqueues only at the outermost ncclGroupEnd. Each step
/// is a device copy (bytes > 0) or a request's event to record (ev), in issue order.
struct nccl_group_state {
  struct step {
    cudaStream_t stream = nullptr;
    cudaEvent_t ev = nullptr;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
  };
  int depth = 0;
  std::vector<step> after;
  bool holds(cudaEvent_t e) const noexcept {
    return std::any_of(after.begin(), after.end(), [e](const step& s) { return s.ev == e; });
  }
  void forget(cudaEvent_t e) noexcept {
    for (auto& s : after)
      if (s.ev == e) s.ev = nullptr;
  }
};
inline nccl_group_state& nccl_group() noexcept {
  static thread_local nccl_group_state g;
  return g;
}

struct nccl_state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // Where the data comes from: every operation waits for the work on it first
  // (the communicator's own stream is non-blocking, so nothing else orders it).
  cudaStream_t producer = cudaStreamLegacy;
  cudaEvent_t ready = nullptr;  // recorded on `producer` by each operation; one, reused
  int* scratch = nullptr;       // one int on the device, for barrier
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
  /// Takes ownership of `c`; creates the stream, event and scratch on the current device.
  void adopt(ncclComm_t c) {
    comm = c;
    check(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    check(ncclCommCount(comm, &size), "ncclCommCount");
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(int)), "cudaMalloc");
  }
  /// Makes the stream wait for what is on the producer stream now. Issued at
  /// once even inside a group: it then precedes the grouped operations, which
  /// NCCL enqueues at the group's end. Re-recording `ready` later does not move
  /// a wait already enqueued (cudaStreamWaitEvent uses the latest record at the call).
  void after_producer() {
    check(cudaEventRecord(ready, producer), "cudaEventRecord (on the producer stream)");
    check(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
  }
  /// A device copy on the stream after the operations issued so far (deferred to the group's end inside one).
  void then_copy(void* dst, const void* src, std::size_t n) {
    auto& g = nccl_group();
    if (g.depth > 0) g.after.push_back({stream, nullptr, dst, src, n});
    else check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync");
  }
  void not_in_group(const char* call) const {
    if (nccl_group().depth > 0)
      throw std::logic_error("whale::nccl_comm '" + name + "': " + call +
                             " inside an open group (nccl_comm::group): it cannot be grouped with "
                             "communication; end the group first");
  }
  ~nccl_state() {
    if (comm) {
      // Unwinding (a failing rank): peers may never match pending work; abort it.
      if (std::uncaught_exceptions() > 0) ncclCommAbort(comm);
      else ncclCommDestroy(comm);
    }
    if (scratch) cudaFree(scratch);
    if (ready) cudaEventDestroy(ready);
    if (stream) cudaStreamDestroy(stream);
  }
};

/// What the watchdog says about a blocking call that creates a communicator.
struct nccl_joining {
  const nccl_state* s;
  const char* call;
  static std::string describe(const void* self, double seconds) {
    auto& j = *static_cast<const nccl_joining*>(self);
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", seconds);
    return "watchdog: " + std::string(j.call) + " for communicator '" + j.s->name + "' (" + std::to_string(j.s->size) +
           " ranks; this is rank " + std::to_string(j.s->rank) + ") has not returned after " + secs + " s; " + j.call +
           " waits for every rank to join, and NCCL does not say which have not: check that all " +
           std::to_string(j.s->size) + " ranks reach it (and each has its own GPU); aborting the job";
  }
};
}  // namespace detail

}  // namespace whale
