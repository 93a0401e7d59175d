// mpi_comm's larger members (comm/mpi_comm.hpp): the world communicator,
// splitting, the checks of v-collectives' counts, and the start of every
// operation (its sequence number, the flight recorder, the traffic counters).
// Compiled once in whale::core under the compiled core (detail/compiled.hpp);
// inline, as the rest of the library, without it.
#pragma once

#include <algorithm>
#include <climits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/mpi_comm.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/comm/mpi_comm_impl.hpp holds the compiled core's definitions: include whale/comm/mpi_comm.hpp, not this file"
#endif

namespace whale {

WHALE_CORE_INLINE mpi_comm mpi_comm::world() {
  if (!detail::mpi_active())
    throw std::logic_error("whale::mpi_comm::world: MPI is not initialized; create a whale::context first");
  MPI_Comm c;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  mpi_comm w(c, "world");
  detail::remote_heartbeat::instance().start();  // collective over MPI_COMM_WORLD; the first time only
  return w;
}

WHALE_CORE_INLINE mpi_comm mpi_comm::split(int color, int key, std::string name) {
  auto& s = state();
  const auto seq = s.enter(detail::coll::split);
  const auto ticket = detail::flight_recorder::instance().begin("split", s.name, seq, 0, "");
  MPI_Comm c = MPI_COMM_NULL;
  s.check(MPI_Comm_split(s.comm, color < 0 ? MPI_UNDEFINED : color, key, &c), "MPI_Comm_split");
  detail::flight_recorder::instance().done(ticket);
  if (c == MPI_COMM_NULL) return {};
  return mpi_comm(c, std::move(name));
}

WHALE_CORE_INLINE mpi_comm::request mpi_comm::start(detail::coll op, index_t n, dtype t) {
  request r;
  r.c_ = s_.get();
  r.active_ = true;
  r.op_ = op;
  r.count_ = n;
  r.type_ = t;
  r.seq_ = s_->enter(op);
  r.flight_ = detail::flight_recorder::instance().begin(detail::to_string(op), s_->name, r.seq_, n, whale::to_string(t));
  if (s_->recording) s_->calls.push_back({op, n, 0, -1, detail::mpi_comm_state::next_recorded()});
  return r;
}

WHALE_CORE_INLINE mpi_comm::request mpi_comm::p2p(detail::coll op, index_t n, dtype t, int peer, int tag) {
  request r;
  r.c_ = s_.get();
  r.active_ = true;
  r.op_ = op;
  r.count_ = n;
  r.type_ = t;
  r.peer_ = peer;
  r.tag_ = tag;
  r.flight_ = detail::flight_recorder::instance().begin(detail::to_string(op), s_->name, 0, n, whale::to_string(t));
  if (s_->recording)  // the peer in world numbering, as the program names it
    s_->calls.push_back({op, n, 0, peer >= 0 && peer < s_->size ? s_->world_ranks[static_cast<std::size_t>(peer)] : peer,
                         detail::mpi_comm_state::next_recorded()});
  return r;
}

WHALE_CORE_INLINE void mpi_comm::fill_v(request& r, std::span<const index_t> counts, const char* op) const {
  r.counts_.resize(counts.size());
  r.displs_.resize(counts.size());
  index_t at = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    r.counts_[i] = s_->to_int(counts[i], op);
    r.displs_[i] = s_->to_int(at, op);
    at += counts[i];
  }
  s_->to_int(at, op);
}

WHALE_CORE_INLINE void mpi_comm::check_counts(std::span<const index_t> counts, const char* op) const {
  if (static_cast<int>(counts.size()) != s_->size)
    throw std::invalid_argument(std::string("whale::") + op + ": " + std::to_string(counts.size()) +
                                " counts for communicator '" + s_->name + "' of " +
                                std::to_string(s_->size) + " ranks; give one count per rank");
}

}  // namespace whale
