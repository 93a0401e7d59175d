// Ending a run on SIGINT (Ctrl-C) or SIGTERM (mpirun passes Ctrl-C on as
// SIGTERM to every rank; schedulers send it before a job's time runs out):
// the process ends at once with one line on rank 0, "whale: interrupted
// (SIGINT) at step N; last checkpoint 'ckpt/step-…'", and exit status
// 128 + the signal, as a shell reports a killed job; a checkpoint being saved
// is finished first, and the process ends right after it. The trainer
// installs the handlers when it is made, unless the program has its own.
#pragma once

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "whale/comm/failure.hpp"

namespace whale::detail {

/// What the handlers read: async-signal-safe state only (lock-free atomics, fixed buffers).
struct interrupt_state {
  std::atomic<int> seen{0};        ///< the signal received while a save ran (0: none)
  std::atomic<int> saving{0};      ///< saves in progress in this process
  std::atomic<int> current{0};     ///< which of the two lines is whole
  std::atomic<bool> speaks{true};  ///< whether this process prints the line (rank 0)
  std::atomic<std::int64_t> signalled_ms{0};  ///< when the signal came (CLOCK_MONOTONIC), for a deferred one too
  char lines[2][512] = {};
  std::atomic<int> lengths[2] = {0, 0};
};
inline interrupt_state& interrupts() {
  static interrupt_state s;
  return s;
}

/// The rest of the line printed on interruption (after "whale: interrupted
/// (SIGINT)"), written into the buffer not being read; allocates nothing.
inline void set_interrupt_text(const char* text, std::size_t size) {
  auto& s = interrupts();
  const int next = 1 - s.current.load();
  const auto n = std::min<std::size_t>(size, sizeof s.lines[0] - 1);
  std::memcpy(s.lines[next], text, n);
  s.lengths[next].store(static_cast<int>(n));
  s.current.store(next);
}

/// End the process for signal `sig`: the line (if this process speaks), then _exit(128 + sig).
inline void end_interrupted(int sig) noexcept {
  auto& s = interrupts();
  if (s.speaks.load()) {
    // a peer on another node found dead before this signal: say which (mpirun ends a
    // job whose node died, perhaps before the heartbeat's check names the ranks);
    // not those refused within 0.1 s of it, which may end on the same signal
    const auto& peers = peer_notes();
    const int p = peers.current.load();
    const char* found = peers.text[p];
    std::size_t m = static_cast<std::size_t>(peers.lengths[p].load());
    if (m > 0 && peers.at[p].load() > s.signalled_ms.load() - 100) m = 0;
    // then the line, in one write (other ranks may be writing theirs)
    char line[2048];
    std::size_t at = 0;
    auto put = [&](const char* t, std::size_t k) {
      k = std::min(k, sizeof line - at);
      std::memcpy(line + at, t, k);
      at += k;
    };
    const char* name = sig == SIGINT ? "whale: interrupted (SIGINT)" : sig == SIGTERM ? "whale: interrupted (SIGTERM)" : "whale: interrupted";
    put(name, std::strlen(name));
    const int k = s.current.load();
    put(s.lines[k], static_cast<std::size_t>(std::max(0, s.lengths[k].load())));
    if (m > 0) put("; ", 2), put(found, m);
    put("\n", 1);
    ssize_t ignored = ::write(STDERR_FILENO, line, at);
    (void)ignored;
  }
  ::_exit(128 + sig);
}

extern "C" inline void whale_on_interrupt(int sig) {
  auto& s = interrupts();
  if (s.signalled_ms.load() == 0) {  // the first signal's time
    timespec now{};
    ::clock_gettime(CLOCK_MONOTONIC, &now);
    s.signalled_ms.store(static_cast<std::int64_t>(now.tv_sec) * 1000 + now.tv_nsec / 1000000);
  }
  if (s.saving.load() > 0) {  // a checkpoint is being written: end right after it
    s.seen.store(sig);
    return;
  }
  end_interrupted(sig);
}

/// Install the handlers for SIGINT and SIGTERM, where the program has none of
/// its own (the default disposition); `speaks`: this process prints the line.
inline void install_interrupt_handlers(bool speaks) {
  interrupts().speaks.store(speaks);
  for (int sig : {SIGINT, SIGTERM}) {
    struct sigaction now {};
    if (::sigaction(sig, nullptr, &now) != 0) continue;
    if ((now.sa_flags & SA_SIGINFO) || now.sa_handler != SIG_DFL) continue;  // the program's own, ignored, or ours already
    struct sigaction act {};
    act.sa_handler = whale_on_interrupt;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;
    ::sigaction(sig, &act, nullptr);
  }
}

/// Held while a checkpoint is written: an interruption then ends the process
/// when the save is done (on every path out of it), never in the middle.
class interrupt_deferral {
 public:
  interrupt_deferral() { interrupts().saving.fetch_add(1); }
  interrupt_deferral(const interrupt_deferral&) = delete;
  interrupt_deferral& operator=(const interrupt_deferral&) = delete;
  ~interrupt_deferral() {
    auto& s = interrupts();
    if (s.saving.fetch_sub(1) == 1)
      if (const int sig = s.seen.exchange(0); sig != 0) end_interrupted(sig);
  }
};

}  // namespace whale::detail
