// The trainer's progress line: step/total, loss, samples/s (tokens/s),
// achieved GFLOP/s and ETA, updated in place on a terminal and as plain lines
// otherwise. Only formatting and timing; no training logic.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace whale {

/// Prints training progress to a FILE* (stderr by default). `total` 0: the
/// number of steps is not known (stepping by hand): no ETA.
class progress_line {
 public:
  progress_line(std::int64_t total, bool tokens, std::FILE* out = stderr, int plain_every = 10)
      : total_(total), tokens_(tokens), out_(out), every_(plain_every < 1 ? 1 : plain_every),
        tty_(out && ::isatty(::fileno(out))) {}
  progress_line(const progress_line&) = delete;
  progress_line& operator=(const progress_line&) = delete;
  ~progress_line() {
    if (tty_ && open_) std::fputc('\n', out_);
  }

  /// A line of its own (e.g. an evaluation), above the progress line.
  void note(const char* text) {
    if (!out_) return;
    std::fprintf(out_, "%s%s\n", tty_ && open_ ? "\r\033[K" : "", text);
    open_ = false;
    std::fflush(out_);
  }

  /// Report step `step` (1-based) that took `seconds`, processed `units`
  /// samples (or tokens) and `flops` model FLOPs, with mean loss `loss`.
  void update(std::int64_t step, double loss, double seconds, double units, double flops) {
    if (!out_) return;
    sum_s_ += seconds;
    ++n_;
    // after the first step (warm-up), average the rest
    const bool warm = step > 1;
    if (warm) {
      warm_s_ += seconds;
      ++warm_n_;
    }
    const double per = warm_n_ ? warm_s_ / warm_n_ : sum_s_ / n_;
    const double rate = per > 0 ? units / per : 0;
    const double gflops = per > 0 ? flops / per / 1e9 : 0;
    const double eta = per * static_cast<double>(total_ - step);
    char buf[256];
    if (total_ > 0)
      std::snprintf(buf, sizeof buf, "step %lld/%lld  loss %.4f  %.4g %s/s  %.2f GFLOP/s  ETA %s",
                    static_cast<long long>(step), static_cast<long long>(total_), loss, rate,
                    tokens_ ? "tokens" : "samples", gflops, format_eta(eta).c_str());
    else
      std::snprintf(buf, sizeof buf, "step %lld  loss %.4f  %.4g %s/s  %.2f GFLOP/s", static_cast<long long>(step),
                    loss, rate, tokens_ ? "tokens" : "samples", gflops);
    if (tty_) {
      std::fprintf(out_, "\r\033[K%s", buf);
      open_ = step != total_;
      if (step == total_) std::fputc('\n', out_);
    } else if (step == 1 || step % every_ == 0 || step == total_) {
      std::fprintf(out_, "%s\n", buf);
    }
    std::fflush(out_);
  }

 private:
  static std::string format_eta(double s) {
    if (s < 0) s = 0;
    const long t = static_cast<long>(s + 0.5);
    char b[32];
    if (t >= 3600) std::snprintf(b, sizeof b, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else std::snprintf(b, sizeof b, "%ldm%02lds", t / 60, t % 60);
    return b;
  }
  std::int64_t total_;
  bool tokens_;
  std::FILE* out_;
  int every_;
  bool tty_;
  bool open_ = false;  // a terminal line without its newline yet
  double sum_s_ = 0, warm_s_ = 0;
  std::int64_t n_ = 0, warm_n_ = 0;
};

}  // namespace whale
