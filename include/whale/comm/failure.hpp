// Failure handling shared by every communicator: the watchdog timeout, the
// "whale: rank R: <message>" report and the job abort (MPI_Abort under MPI,
// _Exit otherwise), and the std::terminate handler. No communication here.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <thread>

#include "whale/detail/environment.hpp"

#ifdef WHALE_HAS_MPI
#include <mpi.h>
#endif

namespace whale {

namespace detail {
/// The first value before context::init checks it (which reports a bad one on every rank).
inline double watchdog_from_env() noexcept {
  try {
    return env::watchdog_seconds();
  } catch (...) {
    return 300.0;
  }
}
inline std::atomic<double>& watchdog_seconds() noexcept {
  static std::atomic<double> s{watchdog_from_env()};
  return s;
}
inline std::atomic<double>& heartbeat_seconds() noexcept {
  static std::atomic<double> s{[] {
    try {
      return env::heartbeat_seconds();
    } catch (...) {
      return 10.0;
    }
  }()};
  return s;
}
}  // namespace detail

/// The bound, in seconds, within which a job whose rank froze (stopped, or
/// hung where its heartbeat thread cannot run; on another node also: its
/// node cut off) ends: a rank blocked in a communication call checks the peers
/// of that communicator four times a second and ends the job naming a dead or
/// frozen one. Default 10, or WHALE_HEARTBEAT_S (seconds in [0, 3600];
/// anything else is an error of context::init); 0 turns the check off. A slow
/// rank keeps beating, so only the watchdog's timeout ends a job waiting for it.
inline double heartbeat_timeout() noexcept { return detail::heartbeat_seconds().load(); }
inline void set_heartbeat_timeout(double seconds) noexcept { detail::heartbeat_seconds().store(seconds); }

namespace detail {
/// What the heartbeat learnt of peers that died on other nodes, for the line a
/// signal's handler prints when mpirun ends this rank before the heartbeat
/// check does (train/interrupt.hpp): two fixed buffers, read without locks.
struct peer_note_state {
  std::atomic<int> current{0};
  std::atomic<int> lengths[2] = {0, 0};
  std::atomic<std::int64_t> at[2] = {0, 0};  ///< when it was learnt (CLOCK_MONOTONIC, ms)
  char text[2][1024] = {};
};
inline peer_note_state& peer_notes() noexcept {
  static peer_note_state s;
  return s;
}
/// Writes `note`, learnt at `at_ms`, into the buffer not being read (the heartbeat thread only).
inline void set_peer_note(const std::string& note, std::int64_t at_ms) noexcept {
  auto& s = peer_notes();
  const int next = 1 - s.current.load();
  const auto n = std::min(note.size(), sizeof s.text[0]);
  std::memcpy(s.text[next], note.data(), n);
  s.lengths[next].store(static_cast<int>(n));
  s.at[next].store(at_ms);
  s.current.store(next);
}
}  // namespace detail

/// How long a peer may be silent before the check takes it for frozen: the
/// bound less the time to notice and end (a beat every 0.5 s, heard at the
/// next beat on another node; a check every 0.25 s; the abort): `bound` − 2 s,
/// but never under 1.5 s (a live peer's beat may be a second old), or the
/// bound itself if that is less. Bounds under 3.5 s cannot be kept exactly.
constexpr double heartbeat_silence_limit(double bound) noexcept {
  const double floor = bound < 1.5 ? bound : 1.5;
  return bound - 2 > floor ? bound - 2 : floor;
}

/// Seconds a blocking operation (or request::wait) may take before the
/// watchdog reports it and aborts the job. Default 300, or WHALE_WATCHDOG_S
/// (a number of seconds in [0, 604800]; anything else is an error of
/// context::init). 0 disables the watchdog; mpi_comm's blocking operations then call
/// the blocking MPI functions directly.
inline double watchdog_timeout() noexcept { return detail::watchdog_seconds().load(); }
inline void set_watchdog_timeout(double seconds) noexcept { detail::watchdog_seconds().store(seconds); }

namespace detail {

inline bool mpi_active() noexcept {
#ifdef WHALE_HAS_MPI
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
#else
  return false;
#endif
}

/// This process's rank in the world (0 without MPI or before MPI_Init). Cached
/// once known, so that the watchdog thread never calls MPI.
inline int world_rank() noexcept {
  static std::atomic<int> cached{-1};
  if (int r = cached.load(); r >= 0) return r;
#ifdef WHALE_HAS_MPI
  if (mpi_active()) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    cached.store(r);
    return r;
  }
#endif
  return 0;
}

/// Print "whale: rank R: <message>" to stderr as one write.
inline void report(std::string_view message) noexcept {
  std::string line = "whale: rank " + std::to_string(world_rank()) + ": ";
  line.append(message);
  if (line.empty() || line.back() != '\n') line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

/// End the whole job now: MPI_Abort on the world (so no rank hangs), else _Exit.
[[noreturn]] inline void abort_job(int code = 1) noexcept {
  std::fflush(stdout);
#ifdef WHALE_HAS_MPI
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::_Exit(code);
}

/// Report `message` and abort the job.
[[noreturn]] inline void fatal(std::string_view message, int code = 1) noexcept {
  report(message);
  abort_job(code);
}

/// While an exception unwinds through a context: report that the job will
/// end, and end it `seconds` later from a thread of its own (which never calls
/// MPI: the process exits with status 1 and mpirun ends the job), so that
/// whoever catches the exception still prints its message first. The caller
/// must not finalize MPI (peers may wait in a collective).
inline void exit_soon(double seconds, std::string_view why) noexcept {
  report(why);
  try {
    std::thread([seconds] {
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      report("ending the job (an exception unwound through the whale::context; its message is above, where it was caught)");
      std::fflush(stdout);
      std::_Exit(1);
    }).detach();
  } catch (...) {
    abort_job(1);
  }
}

/// The message of the exception in flight, for reports.
inline std::string current_exception_message() {
  auto e = std::current_exception();
  if (!e) return "std::terminate called without an active exception";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

inline void terminate_handler() noexcept {
  std::string m;
  try {
    m = current_exception_message();
  } catch (...) {
    m = "unknown exception";
  }
  fatal(m);
}

/// Installed by context::init: an exception escaping main (or a noexcept
/// function) reports on stderr and aborts the job instead of leaving peers hanging.
inline void install_terminate_handler() noexcept { std::set_terminate(&terminate_handler); }

}  // namespace detail
}  // namespace whale
