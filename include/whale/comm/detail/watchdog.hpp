// The watchdog thread: while this rank is blocked in a communication call it
// holds a deadline; past it, the thread prints the operation's description and
// ends the process. It never calls MPI (MPI stays single-threaded, FUNNELED).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "whale/comm/failure.hpp"

namespace whale::detail {

/// What the watchdog prints for a stuck operation: `describe(what, seconds)`.
struct watched {
  const void* what = nullptr;
  std::string (*describe)(const void* what, double seconds) = nullptr;
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
      cv_.wait_until(l, d);
      if (stop_ || e != epoch_ || !cur_.what || clock::now() < d) continue;
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
