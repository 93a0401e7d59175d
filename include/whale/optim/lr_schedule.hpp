// Learning-rate schedules: callables of the data step (counted from 0) that
// the trainer applies before each update (trainer_options::lr_schedule). Any
// `double(std::int64_t)` callable works; these are the usual ones.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <stdexcept>
#include <string>

namespace whale {

namespace detail {
/// Linear warm-up to `peak` over `warmup` steps, `floor` from `total` on, and
/// `decay(t)` of the fraction t in [0, 1) of the steps between.
template <class F> double warmup_then(std::int64_t step, double peak, std::int64_t warmup, std::int64_t total, double floor, F decay) {
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (step >= total) return floor;
  return decay(static_cast<double>(step - warmup) / static_cast<double>(std::max<std::int64_t>(1, total - warmup)));
}
inline void check_lr_args(const char* who, double peak, std::int64_t warmup, std::int64_t total, double floor) {
  auto bad = [&](const std::string& why) { throw std::invalid_argument(std::string("whale::") + who + ": " + why); };
  if (!(peak > 0) || !std::isfinite(peak)) bad("the peak rate must be finite and positive (got " + std::to_string(peak) + ")");
  if (!(floor >= 0) || floor > peak) bad("the final rate must be in [0, peak] (got " + std::to_string(floor) + ")");
  if (warmup < 0) bad("warm-up steps must be >= 0 (got " + std::to_string(warmup) + ")");
  if (total < 1 || warmup > total) bad("total steps must be >= 1 and >= the warm-up (got " + std::to_string(total) + ")");
}
}  // namespace detail

/// The same rate every step.
struct constant_lr {
  double lr = 1e-3;
  double operator()(std::int64_t) const { return lr; }
};

/// Linear warm-up from peak/warmup to `peak` over `warmup` steps, then a
/// cosine from `peak` to `floor` at step `total` (and `floor` after it).
struct warmup_cosine {
  double peak = 1e-3;
  std::int64_t warmup = 0, total = 1;
  double floor = 0;
  warmup_cosine(double peak_, std::int64_t warmup_, std::int64_t total_, double floor_ = 0)
      : peak(peak_), warmup(warmup_), total(total_), floor(floor_) {
    detail::check_lr_args("warmup_cosine", peak, warmup, total, floor);
  }
  double operator()(std::int64_t step) const {
    return detail::warmup_then(step, peak, warmup, total, floor,
                               [&](double t) { return floor + 0.5 * (peak - floor) * (1 + std::cos(std::numbers::pi * t)); });
  }
};

/// Linear warm-up as warmup_cosine, then a straight line from `peak` to `floor` at step `total`.
struct linear_decay {
  double peak = 1e-3;
  std::int64_t warmup = 0, total = 1;
  double floor = 0;
  linear_decay(double peak_, std::int64_t total_, std::int64_t warmup_ = 0, double floor_ = 0)
      : peak(peak_), warmup(warmup_), total(total_), floor(floor_) {
    detail::check_lr_args("linear_decay", peak, warmup, total, floor);
  }
  double operator()(std::int64_t step) const {
    return detail::warmup_then(step, peak, warmup, total, floor, [&](double t) { return peak + (floor - peak) * t; });
  }
};

}  // namespace whale
