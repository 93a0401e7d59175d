// mpi_comm's reports, from the watchdog thread: what a stuck call is and who
// it waits for (the watchdog's timeout), and which peer on the node has died or
// frozen (the heartbeat). Text only; included at the end of comm/mpi_comm.hpp.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include "whale/comm/mpi_comm.hpp"

namespace whale {

/// The watchdog's report. For a collective numbered #k on a communicator, it
/// reads every peer's count of collectives entered there (from node-shared
/// memory: no help from the peer needed) and names the ranks with a count
/// below k: those have not arrived. Ranks on other nodes cannot be read and are
/// listed as "progress could not be read".
/// For send/recv it names the peer whose matching operation has not come.
inline std::string mpi_comm::request::message(double limit) const {
  using detail::to_string;
  const auto& s = *c_;
  auto wr = [&](int r) { return std::to_string(s.world_ranks[static_cast<std::size_t>(r)]); };
  std::string m = "watchdog: " + operation();
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", limit);
  m += " has not completed after " + std::string(secs) + " s";

  if (op_ == detail::coll::send || op_ == detail::coll::recv) {
    m += op_ == detail::coll::send ? "; rank " + wr(peer_) + " has not received it (no matching recv)"
                                   : "; the matching send from rank " + wr(peer_) + " has not arrived";
    m += "; ranks that did not arrive: " + wr(peer_);
  } else {
    std::vector<std::int64_t> v(2 * static_cast<std::size_t>(s.size), -1);
    std::vector<int> got(static_cast<std::size_t>(s.size), 0);
    for (int i = 0; i < s.size; ++i) {
      auto k = static_cast<std::size_t>(i);
      if (std::int64_t* p = s.peer_slot[k]) {
        v[2 * k] = std::atomic_ref<std::int64_t>(p[0]).load(std::memory_order_acquire);
        v[2 * k + 1] = std::atomic_ref<std::int64_t>(p[1]).load(std::memory_order_relaxed);
        got[k] = 1;
      }
    }
    std::string missing, other, unknown;
    auto item = [](std::string& list, const std::string& x) {
      if (!list.empty()) list += ", ";
      list += x;
    };
    for (int i = 0; i < s.size; ++i) {
      auto k = static_cast<std::size_t>(i);
      if (i == s.rank) continue;
      if (got[k] != 1) {
        item(unknown, wr(i));
        continue;
      }
      const auto seq = v[2 * k];
      const auto last = static_cast<detail::coll>(v[2 * k + 1]);
      if (seq < seq_)
        item(missing, wr(i) + (seq ? " (its last collective there is #" + std::to_string(seq) + ", a " +
                                         to_string(last) + ")"
                                   : std::string(" (no collective there yet)")));
      else if (seq == seq_ && last != op_)
        item(other, wr(i) + " (its collective #" + std::to_string(seq) + " there is a " +
                        to_string(last) + ")");
    }
    m += " (it is collective #" + std::to_string(seq_) + " on that communicator)";
    m += "; ranks that did not arrive: " + (missing.empty() ? std::string("none known") : missing);
    if (!other.empty()) m += "; ranks that entered a different collective: " + other;
    if (!unknown.empty()) m += "; ranks whose progress could not be read: " + unknown;
    if (missing.empty() && other.empty() && unknown.empty())
      m += " (every rank entered it; the transport is stuck or the ranks disagree on sizes)";
  }
  m += "; this rank's last communication calls, oldest first: " + detail::flight_recorder::instance().dump();
  m += "; aborting the job";
  return m;
}

/// "all_reduce (sum, 4 × f32) on communicator 'world' (world ranks 0,1)".
inline std::string mpi_comm::request::operation() const {
  using detail::to_string;
  const auto& s = *c_;
  std::string m = std::string(to_string(op_)) + " (";
  if (op_ == detail::coll::all_reduce || op_ == detail::coll::reduce_scatter || op_ == detail::coll::reduce_scatter_v)
    m += std::string(whale::to_string(rop_)) + ", ";
  if (op_ != detail::coll::barrier) m += std::to_string(count_) + " × " + whale::to_string(type_);
  if (op_ == detail::coll::broadcast) m += ", root rank " + std::to_string(s.world_ranks[static_cast<std::size_t>(peer_)]);
  if (op_ == detail::coll::send || op_ == detail::coll::recv) m += ", tag " + std::to_string(tag_);
  return m + ") on communicator '" + s.name + "' " + s.members();
}

/// The heartbeat check, from the watchdog thread while this rank waits: the
/// first member of this communicator on this node whose process is gone, or
/// whose heartbeat is older than heartbeat_silence_limit(); else the members on
/// other nodes whose processes are gone (their nodes refused a heartbeat), or
/// else those not heard from for that long (remote_heartbeat), all of them,
/// with their hosts; empty if none.
inline std::string mpi_comm::request::peer_problem() const {
  const double bound = heartbeat_timeout();
  if (bound <= 0) return {};
  const double limit = heartbeat_silence_limit(bound);
  char bound_text[32];
  std::snprintf(bound_text, sizeof bound_text, "%g", bound);
  auto tail = [&] {  // what every report ends with
    return "; this rank waits in " + operation() + " (collective #" + std::to_string(seq_) +
           "); this rank's last communication calls, oldest first: " + detail::flight_recorder::instance().dump() +
           "; aborting the job (WHALE_HEARTBEAT_S=" + std::string(bound_text) + ")";
  };
  const auto& s = *c_;
  const auto now = detail::monotonic_ms();
  for (int i = 0; i < s.size; ++i) {
    std::int64_t* p = s.peer_slot[static_cast<std::size_t>(i)];
    if (i == s.rank || !p) continue;
    const auto pid = std::atomic_ref<std::int64_t>(p[3]).load(std::memory_order_relaxed);
    const auto beat = std::atomic_ref<std::int64_t>(p[2]).load(std::memory_order_relaxed);
    std::string what;
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      what = "has died";
    } else if (beat > 0 && static_cast<double>(now - beat) > 1000 * limit) {
      char b[64];
      std::snprintf(b, sizeof b, "%.1f", static_cast<double>(now - beat) / 1000);
      what = "has sent no heartbeat for " + std::string(b) + " s (stopped, or frozen where its threads cannot run)";
    }
    if (what.empty()) continue;
    const auto seq = std::atomic_ref<std::int64_t>(p[0]).load(std::memory_order_acquire);
    const auto last = static_cast<detail::coll>(std::atomic_ref<std::int64_t>(p[1]).load(std::memory_order_relaxed));
    char host[256] = "this node";
    ::gethostname(host, sizeof host - 1);
    return "heartbeat: rank " + std::to_string(s.world_ranks[static_cast<std::size_t>(i)]) + " (pid " + std::to_string(pid) +
           " on " + host + ") " + what + "; its last collective on '" + s.name + "' is " +
           (seq ? "#" + std::to_string(seq) + ", a " + detail::to_string(last) : std::string("none yet")) +
           tail();
  }
  // members on other nodes: when one has been silent for longer than the limit, every
  // one silent for nearly as long (the same outage: beats come every 0.5 s), with its host
  const auto& remote = detail::remote_heartbeat::instance();
  auto quiet_of = [&](int i) -> std::int64_t {
    if (i == s.rank || s.peer_slot[static_cast<std::size_t>(i)]) return -1;
    return remote.silence_ms(s.world_ranks[static_cast<std::size_t>(i)]);
  };
  std::vector<int> others;  // the members on other nodes
  for (int i = 0; i < s.size; ++i)
    if (i != s.rank && !s.peer_slot[static_cast<std::size_t>(i)]) others.push_back(s.world_ranks[static_cast<std::size_t>(i)]);
  if (const auto m = remote.gone_report(others); !m.empty()) return "heartbeat: " + m + tail();
  bool over = false;
  for (int i = 0; i < s.size && !over; ++i) over = static_cast<double>(quiet_of(i)) > 1000 * limit;
  if (!over) return {};
  const double near = std::max(500 * limit, 1000 * limit - 2000);
  std::string silent;
  int count = 0;
  std::int64_t longest = 0;
  for (int i = 0; i < s.size; ++i) {
    const int w = s.world_ranks[static_cast<std::size_t>(i)];
    const auto quiet = quiet_of(i);
    if (quiet < 0 || static_cast<double>(quiet) <= near) continue;
    silent += std::string(count++ ? ", " : "") + "rank " + std::to_string(w) + " (pid " + std::to_string(remote.pid(w)) + " on " +
              remote.host(w) + ")";
    longest = std::max(longest, quiet);
  }
  if (count == 0) return {};
  char b[64];
  std::snprintf(b, sizeof b, "%.1f", static_cast<double>(longest) / 1000);
  char host[256] = "this node";
  ::gethostname(host, sizeof host - 1);
  return "heartbeat: " + silent + (count > 1 ? " have" : " has") + " not been heard from " + host + " for up to " + b +
         " s (stopped, frozen, or " + (count > 1 ? "their nodes" : "its node") + " cannot be reached)" + tail();
}

}  // namespace whale
