// nccl_comm's larger member functions, defined out of line (included at the end of
// comm/nccl_comm.hpp): creation, device selection, the operations and split.
// Not the class, its requests and groups (nccl_comm.hpp) nor its state (detail/nccl_state.hpp).
#pragma once

#if !defined(WHALE_HAS_CUDA) || !defined(WHALE_HAS_MPI)
#error "whale/comm/detail/nccl_ops.hpp needs CUDA, NCCL and MPI: link whale::cuda and whale::mpi"
#endif

#include <cuda_runtime.h>
#include <nccl.h>

#include <climits>
#include <cstdlib>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/detail/cost.hpp"
#include "whale/comm/detail/nccl_state.hpp"
#include "whale/comm/detail/watchdog.hpp"
#include "whale/comm/launcher.hpp"
#include "whale/comm/failure.hpp"
#include "whale/comm/mpi_comm.hpp"
#include "whale/comm/nccl_comm.hpp"
#include "whale/detail/parse.hpp"

namespace whale {

inline nccl_comm::nccl_comm(mpi_comm& over, std::string name) : s_(std::make_unique<detail::nccl_state>()) {
  s_->name = name.empty() ? over.name() : std::move(name);
  s_->rank = over.rank();
  s_->size = over.size();
  s_->not_in_group("creating a communicator (ncclCommInitRank)");
  require_devices(over);
  ncclUniqueId id{};
  if (over.rank() == 0) s_->check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  over.broadcast(&id, static_cast<index_t>(sizeof id), dtype::u8, 0);
  ncclComm_t c = nullptr;
  {
    const detail::nccl_joining j{s_.get(), "ncclCommInitRank"};
    detail::watchdog::scope w({&j, &detail::nccl_joining::describe}, watchdog_timeout());
    s_->check(ncclCommInitRank(&c, over.size(), id, over.rank()), "ncclCommInitRank");
  }
  s_->adopt(c);
}

inline int nccl_comm::select_device_by_local_rank() {
  const char* where = "whale::nccl_comm::select_device_by_local_rank: ";
  local_place p;
  try {
    p = local_place_of_process();
  } catch (const detail::parse_error& e) {
    throw detail::parse_error(where + std::string(e.what()) + " (this process's rank on its node)");
  }
  int n = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string(where) + "no CUDA device (cudaGetDeviceCount: " +
                             (e == cudaSuccess ? std::string("0 devices") : std::string(cudaGetErrorString(e))) +
                             "); NCCL needs one GPU per rank");
  }
  int device = 0;
  try {
    device = device_for(p, n, env::text("CUDA_VISIBLE_DEVICES"));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(where + std::string(e.what()));
  }
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    throw std::runtime_error(std::string(where) + "cudaSetDevice(" + std::to_string(device) + ") for " + p.source +
                             " failed: " + cudaGetErrorString(e));
  return device;
}

inline void nccl_comm::require_devices(mpi_comm& over) const {
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

inline nccl_comm::request nccl_comm::iall_reduce(void* buf, index_t n, dtype t, reduce_op op) {
  auto& s = state();
  detail::add(s.stats, detail::all_reduce_traffic(n * bytes(t), s.size));
  s.after_producer();
  s.check(ncclAllReduce(buf, buf, static_cast<std::size_t>(n), detail::nccl_type(t), detail::nccl_op(op),
                        s.comm, s.stream),
          "ncclAllReduce");
  return record("all_reduce", n, t);
}

inline nccl_comm::request nccl_comm::iall_gather(const void* in, void* out, index_t n, dtype t) {
  auto& s = state();
  detail::add(s.stats, detail::all_gather_traffic(n * bytes(t), s.size));
  s.after_producer();
  s.check(ncclAllGather(in, out, static_cast<std::size_t>(n), detail::nccl_type(t), s.comm, s.stream),
          "ncclAllGather");
  return record("all_gather", n, t);
}

inline nccl_comm::request nccl_comm::iall_gather_v(const void* in, void* out, std::span<const index_t> counts, dtype t) {
  auto& s = state();
  check_counts(counts, "all_gather_v");
  detail::add(s.stats, detail::all_gather_traffic(counts, s.rank, s.size, bytes(t)));
  s.after_producer();
  auto* o = static_cast<char*>(out);
  {
    auto g = group();  // ended on every path, also when a broadcast fails
    index_t at = 0;
    for (int r = 0; r < s.size; ++r) {
      const auto c = counts[static_cast<std::size_t>(r)];
      s.check(ncclBroadcast(r == s.rank ? in : o + at * bytes(t), o + at * bytes(t),
                            static_cast<std::size_t>(c), detail::nccl_type(t), r, s.comm, s.stream),
              "ncclBroadcast");
      at += c;
    }
    g.end();
  }
  return record("all_gather_v", counts[static_cast<std::size_t>(s.rank)], t);
}

inline nccl_comm::request nccl_comm::ireduce_scatter(const void* in, void* out, index_t n, dtype t, reduce_op op) {
  auto& s = state();
  detail::add(s.stats, detail::reduce_scatter_traffic(n * bytes(t), s.size));
  // whale's in place (out == in: result in the first block) is NCCL's in
  // place (out == in + rank·n) followed by a move to the front.
  const bool in_place = in == out;
  void* dst = in_place ? static_cast<char*>(out) + s.rank * n * bytes(t) : out;
  s.after_producer();
  s.check(ncclReduceScatter(in, dst, static_cast<std::size_t>(n), detail::nccl_type(t), detail::nccl_op(op),
                            s.comm, s.stream),
          "ncclReduceScatter");
  if (in_place && dst != out) s.then_copy(out, dst, static_cast<std::size_t>(n * bytes(t)));
  return record("reduce_scatter", n, t);
}

inline nccl_comm::request nccl_comm::ireduce_scatter_v(const void* in, void* out, std::span<const index_t> counts, dtype t, reduce_op op) {
  auto& s = state();
  check_counts(counts, "reduce_scatter_v");
  detail::add(s.stats, detail::reduce_scatter_traffic(counts, s.rank, s.size, bytes(t)));
  const bool in_place = in == out;
  const auto* i = static_cast<const char*>(in);
  void* mine = out;
  s.after_producer();
  {
    auto g = group();  // ended on every path, also when a reduce fails
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
    g.end();
  }
  const auto mine_n = counts[static_cast<std::size_t>(s.rank)];
  if (mine != out) s.then_copy(out, mine, static_cast<std::size_t>(mine_n * bytes(t)));
  return record("reduce_scatter_v", mine_n, t);
}

inline nccl_comm::request nccl_comm::ibroadcast(void* buf, index_t n, dtype t, int root) {
  auto& s = state();
  check_rank(root, "broadcast");
  detail::add(s.stats, detail::broadcast_traffic(n * bytes(t), s.rank, root, s.size));
  s.after_producer();
  s.check(ncclBroadcast(buf, buf, static_cast<std::size_t>(n), detail::nccl_type(t), root, s.comm, s.stream),
          "ncclBroadcast");
  return record("broadcast", n, t);
}

inline nccl_comm::request nccl_comm::ibarrier() {
  auto& s = state();
  detail::add(s.stats, {});
  s.after_producer();
  s.check(ncclAllReduce(s.scratch, s.scratch, 1, ncclInt32, ncclSum, s.comm, s.stream), "ncclAllReduce");
  return record("barrier", 0, dtype::i32);
}

inline nccl_comm::request nccl_comm::isend(const void* buf, index_t n, dtype t, int dst, int /*tag*/) {
  auto& s = state();
  check_rank(dst, "send");
  detail::add(s.stats, {n * bytes(t), 0});
  s.after_producer();
  s.check(ncclSend(buf, static_cast<std::size_t>(n), detail::nccl_type(t), dst, s.comm, s.stream), "ncclSend");
  return record("send", n, t);
}

inline nccl_comm::request nccl_comm::irecv(void* buf, index_t n, dtype t, int src, int /*tag*/) {
  auto& s = state();
  check_rank(src, "recv");
  detail::add(s.stats, {0, n * bytes(t)});
  s.after_producer();
  s.check(ncclRecv(buf, static_cast<std::size_t>(n), detail::nccl_type(t), src, s.comm, s.stream), "ncclRecv");
  return record("recv", n, t);
}

inline nccl_comm::request nccl_comm::isendrecv(const void* sbuf, index_t sn, int dst, void* rbuf, index_t rn, int src, dtype t) {
  auto& s = state();
  check_rank(dst, "sendrecv");
  check_rank(src, "sendrecv");
  detail::add(s.stats, {sn * bytes(t), rn * bytes(t)});
  s.after_producer();
  {
    auto g = group();
    s.check(ncclSend(sbuf, static_cast<std::size_t>(sn), detail::nccl_type(t), dst, s.comm, s.stream), "ncclSend");
    s.check(ncclRecv(rbuf, static_cast<std::size_t>(rn), detail::nccl_type(t), src, s.comm, s.stream), "ncclRecv");
    g.end();
  }
  return record("sendrecv", sn + rn, t);
}

inline nccl_comm nccl_comm::split(int color, int key, std::string name) {
  auto& s = state();
#if defined(NCCL_VERSION_CODE) && defined(NCCL_VERSION) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  s.not_in_group("split (ncclCommSplit)");
  // Built against a new enough nccl.h, but the library loaded may be older.
  int loaded = 0;
  s.check(ncclGetVersion(&loaded), "ncclGetVersion");
  if (loaded < NCCL_VERSION(2, 18, 0))
    throw std::runtime_error("whale::nccl_comm '" + s.name + "': split needs ncclCommSplit, in NCCL 2.18.0 and later, "
                             "but the NCCL library loaded is " + detail::nccl_version_string(loaded) +
                             " (built against " + detail::nccl_version_string(NCCL_VERSION_CODE) +
                             "): load NCCL 2.18 or newer (LD_LIBRARY_PATH), or split the mpi_comm and create "
                             "an nccl_comm from each part");
  ncclComm_t c = nullptr;
  {
    const detail::nccl_joining j{&s, "ncclCommSplit"};
    detail::watchdog::scope w({&j, &detail::nccl_joining::describe}, watchdog_timeout());
    s.check(ncclCommSplit(s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &c, nullptr), "ncclCommSplit");
  }
  nccl_comm out;
  if (!c) return out;
  out.s_ = std::make_unique<detail::nccl_state>();
  out.s_->name = std::move(name);
  out.s_->producer = s.producer;
  out.s_->adopt(c);
  return out;
#else
  (void)color, (void)key, (void)name;
#if defined(NCCL_VERSION_CODE)
  const std::string built = detail::nccl_version_string(NCCL_VERSION_CODE);
#else
  const std::string built = "older than 2.3.4";
#endif
  throw std::runtime_error("whale::nccl_comm '" + s.name + "': split needs ncclCommSplit, in NCCL 2.18.0 and later, "
                           "but whale was built against NCCL " + built +
                           " (nccl.h): build against NCCL 2.18 or newer, or split the mpi_comm and create an "
                           "nccl_comm from each part");
#endif
}

}  // namespace whale
