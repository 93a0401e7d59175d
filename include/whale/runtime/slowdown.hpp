// Emulated heterogeneity: layer hooks that make this rank behave as a device
// `f` times slower, by sleeping (f - 1) times each leaf's forward and backward
// after it ran. Compiled once (no model types); it does not touch the results.
#pragma once

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
    t0_ = clock::now();
  }
  void after_forward(const leaf_ref& r) override {
    stall();
    if (next_) next_->after_forward(r);
  }
  void before_backward(const leaf_ref& r) override {
    if (next_) next_->before_backward(r);
    t0_ = clock::now();
  }
  void after_backward(const leaf_ref& r) override {
    stall();
    if (next_) next_->after_backward(r);
  }

 private:
  using clock = std::chrono::steady_clock;
  void stall() {
    const auto ran = clock::now() - t0_;
    const auto extra = std::chrono::duration_cast<clock::duration>(ran * (factor_ - 1.0));
    std::this_thread::sleep_for(extra);
    waited_ += std::chrono::duration<double>(extra).count();
  }
  double factor_ = 1.0, waited_ = 0.0;
  layer_hooks* next_ = nullptr;
  clock::time_point t0_{};
};

}  // namespace whale::detail
