// The flight recorder: each process keeps its last 16 communication calls
// (operation, communicator, number, size, start and end), which the watchdog
// prints when it fires. Recording only; no communication.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "whale/comm/detail/watchdog.hpp"

namespace whale::detail {

class flight_recorder {
 public:
  static constexpr std::size_t depth = 16;
  static flight_recorder& instance() {
    static flight_recorder* f = new flight_recorder;  // never destroyed: the watchdog may read it at exit
    return *f;
  }
  /// Record the start of a call; returns its ticket (for done()).
  std::uint64_t begin(const char* op, const std::string& comm, std::int64_t seq, std::int64_t count, const char* type) {
    std::lock_guard<std::mutex> l(m_);
    const std::uint64_t t = ++next_;
    auto& e = ring_[t % depth];
    e.ticket = t, e.op = op, e.seq = seq, e.count = count, e.type = type;
    std::snprintf(e.comm, sizeof e.comm, "%s", comm.c_str());
    e.start_us = now_us(), e.end_us = 0;
    return t;
  }
  void done(std::uint64_t ticket) noexcept {
    std::lock_guard<std::mutex> l(m_);
    auto& e = ring_[ticket % depth];
    if (e.ticket == ticket) e.end_us = now_us();
  }
  /// "#7 barrier on 'world' (0.021 ms), ..., #9 all_reduce 4 × f32 on 'world' (in flight for 2.00 s)", oldest first.
  std::string dump() const {
    std::lock_guard<std::mutex> l(m_);
    std::string s;
    const auto now = now_us();
    for (std::uint64_t t = next_ >= depth ? next_ - depth + 1 : 1; t <= next_; ++t) {
      const auto& e = ring_[t % depth];
      if (e.ticket != t) continue;
      char b[160];
      const double ms = static_cast<double>((e.end_us ? e.end_us : now) - e.start_us) / 1000.0;
      char num[24] = "";
      if (e.seq > 0) std::snprintf(num, sizeof num, "#%lld ", static_cast<long long>(e.seq));
      char size[48] = "";
      if (e.count > 0) std::snprintf(size, sizeof size, " of %lld x %s", static_cast<long long>(e.count), e.type);
      std::snprintf(b, sizeof b, "%s%s%s on '%s' (%s %.3f ms)", num, e.op, size, e.comm, e.end_us ? "took" : "in flight for", ms);
      if (!s.empty()) s += ", ";
      s += b;
    }
    return s;
  }

 private:
  struct entry {
    std::uint64_t ticket = 0;
    const char* op = "";
    const char* type = "";
    char comm[32] = {};
    std::int64_t seq = 0, count = 0, start_us = 0, end_us = 0;
  };
  static std::int64_t now_us() noexcept {
    timespec t{};
    ::clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<std::int64_t>(t.tv_sec) * 1000000 + t.tv_nsec / 1000;
  }
  flight_recorder() = default;
  mutable std::mutex m_;
  std::array<entry, depth> ring_{};
  std::uint64_t next_ = 0;
};

}  // namespace whale::detail
