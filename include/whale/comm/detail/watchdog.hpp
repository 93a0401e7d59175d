// The watchdog thread: while this rank is blocked in a communication call it
// holds a deadline; past it, the thread prints the operation's description and
// ends the process. Until then it asks, four times a second, whether a peer has died
// or frozen (the heartbeat thread below keeps each rank's heartbeat in memory
// its peers on the node read). Neither thread calls MPI (MPI stays FUNNELED).
#pragma once

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "whale/comm/failure.hpp"

namespace whale::detail {

/// What the watchdog prints for a stuck operation: `describe(what, seconds)`;
/// `peers(what)`: a dead or frozen peer described, or empty (null: not checked).
struct watched {
  const void* what = nullptr;
  std::string (*describe)(const void* what, double seconds) = nullptr;
  std::string (*peers)(const void* what) = nullptr;
};

/// Milliseconds of CLOCK_MONOTONIC: one clock for every process of a node.
inline std::int64_t monotonic_ms() noexcept {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

/// The heartbeat thread: every 0.5 s it writes monotonic_ms() into each
/// registered word (a communicator's node-shared slot). A stopped process
/// stops beating; a busy one does not. Never destroyed (it may outlive main).
class heartbeat {
 public:
  static heartbeat& instance() {
    static heartbeat* h = new heartbeat;
    return *h;
  }
  void add(std::int64_t* word) {
    std::lock_guard<std::mutex> l(m_);
    std::atomic_ref<std::int64_t>(*word).store(monotonic_ms(), std::memory_order_relaxed);
    if (stopped_) return;
    words_.push_back(word);
    start_thread();
  }
  /// `tick` runs on the heartbeat thread at each beat, after the words are
  /// written (the beats to other nodes: remote_heartbeat.hpp); nullptr: none.
  void set_tick(void (*tick)()) {
    std::lock_guard<std::mutex> l(m_);
    if (stopped_) return;
    tick_ = tick;
    start_thread();
  }
  void remove(std::int64_t* word) {
    std::lock_guard<std::mutex> l(m_);
    words_.erase(std::remove(words_.begin(), words_.end(), word), words_.end());
  }
  /// Writes no word again: MPI is finalizing, and the node-shared windows the
  /// words live in are about to be unmapped (a communicator still alive then, or
  /// one left to the job's end, would otherwise be written after it). Each word
  /// is left at a beat from the far future, so that a peer still waiting on this
  /// rank does not take a rank in MPI_Finalize for a frozen one (a dead one it
  /// still sees by its pid). The tick (UDP, no MPI) goes on.
  void stop() {
    std::lock_guard<std::mutex> l(m_);
    stopped_ = true;
    for (auto* w : words_) std::atomic_ref<std::int64_t>(*w).store(std::numeric_limits<std::int64_t>::max() / 2, std::memory_order_relaxed);
    words_.clear();
  }

 private:
  heartbeat() = default;
  void start_thread() {  // under m_
    if (started_) return;
    started_ = true;
    std::thread([this] { loop(); }).detach();
  }
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
      const auto now = monotonic_ms();
      for (auto* w : words_) std::atomic_ref<std::int64_t>(*w).store(now, std::memory_order_relaxed);
      if (auto* tick = tick_) {  // without the lock: a tick waits a moment for refusals
        l.unlock();
        tick();
        l.lock();
      }
      cv_.wait_for(l, std::chrono::milliseconds(500));
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::int64_t*> words_;
  void (*tick_)() = nullptr;
  bool started_ = false, stopped_ = false;
};

class watchdog {
 public:
  static watchdog& instance() {
    static watchdog w;
    return w;
  }
  /// Arms the watchdog for the duration of one blocking call.
  class scope {
   public:
    scope(watched w, double seconds) : on_(seconds > 0) {
      if (on_) instance().arm(w, seconds);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() {
      if (on_) instance().disarm();
    }

   private:
    bool on_;
  };

  ~watchdog() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    if (t_.joinable()) t_.join();
  }

 private:
  using clock = std::chrono::steady_clock;
  watchdog() = default;

  void arm(watched w, double seconds) {
    std::lock_guard<std::mutex> l(m_);
    if (!t_.joinable()) t_ = std::thread([this] { loop(); });
    cur_ = w;
    seconds_ = seconds;
    deadline_ = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(seconds));
    ++epoch_;
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> l(m_);
    cur_ = {};
    ++epoch_;
  }
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    while (!stop_) {
      if (!cur_.what) {
        cv_.wait(l);
        continue;
      }
      const auto e = epoch_;
      const auto d = deadline_;
      const bool check = cur_.peers && heartbeat_timeout() > 0;
      cv_.wait_until(l, check ? std::min(d, clock::now() + std::chrono::milliseconds(250)) : d);
      if (stop_ || e != epoch_ || !cur_.what) continue;
      if (clock::now() < d) {  // not yet the deadline: is a peer dead or frozen?
        if (check)
          if (std::string m = cur_.peers(cur_.what); !m.empty()) {
            report(m);
            std::_Exit(1);
          }
        continue;
      }
      // Still the same call, past its deadline. Ends the process: exiting without
      // MPI_Finalize makes mpirun terminate every other rank.
      std::string m = cur_.describe(cur_.what, seconds_);
      report(m);
      std::_Exit(1);
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::thread t_;
  watched cur_{};
  double seconds_ = 0;
  clock::time_point deadline_{};
  unsigned long epoch_ = 0;
  bool stop_ = false;
};

}  // namespace whale::detail
