// Emulated heterogeneity: layer hooks that make this rank behave as a device
// `f` times slower, by sleeping (f - 1) times each leaf's forward and backward
// after it ran (the time its thread ran, not the time it waited for a core).
// Compiled once (no model types); it does not touch the results.
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "whale/nn/layer.hpp"

namespace whale::detail {

/// Wraps the pass's hooks: times each leaf's forward and backward and then
/// sleeps (factor - 1) times as long. Sleeping, not spinning, leaves the core
/// to the other ranks, as a slower device beside the others would.
class slowdown_hooks final : public layer_hooks {
 public:
  void set_factor(double f) noexcept { factor_ = f; }
  double factor() const noexcept { return factor_; }
  bool active() const noexcept { return factor_ > 1.0; }
  /// Seconds slept so far (emulated extra compute time).
  double waited_s() const noexcept { return waited_; }
  /// Put these hooks around `hooks` (e.g. the ZeRO engine's) for one pass.
  layer_hooks* wrap(layer_hooks* hooks) noexcept {
    next_ = hooks;
    return this;
  }

  void before_forward(const leaf_ref& r) override {
    if (next_) next_->before_forward(r);
    t0_ = ran_s();
  }
  void after_forward(const leaf_ref& r) override {
    stall();
    if (next_) next_->after_forward(r);
  }
  void before_backward(const leaf_ref& r) override {
    if (next_) next_->before_backward(r);
    t0_ = ran_s();
  }
  void after_backward(const leaf_ref& r) override {
    stall();
    if (next_) next_->after_backward(r);
  }

 private:
  /// Seconds this thread has run (its CPU time): where ranks share cores, the
  /// time a leaf waited for one is not stretched too, so the emulated slowness
  /// does not grow with what the other ranks do meanwhile.
  static double ran_s() noexcept {
    timespec t{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }
  void stall() {
    const double extra = std::max(0.0, ran_s() - t0_) * (factor_ - 1.0);
    std::this_thread::sleep_for(std::chrono::duration<double>(extra));
    waited_ += extra;
  }
  double factor_ = 1.0, waited_ = 0.0, t0_ = 0.0;
  layer_hooks* next_ = nullptr;
};

}  // namespace whale::detail
