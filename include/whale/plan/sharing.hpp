// Ranks that share cores, for the simulator (plan/simulate.hpp): a factor per
// operation on its compute time, where the replay put each operation, and how
// many ranks computed at once over a stretch of time.
#pragma once

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace whale::detail {

/// Per rank (an index in progs), per operation: a factor on its compute time, and
/// where the replay put it ({start, end}; {0, 0} for operations that do not compute).
using per_op = std::vector<std::vector<double>>;
using op_spans = std::vector<std::vector<std::array<double, 2>>>;

/// Ranks computing at once over [a, b), on average: from every simulated compute
/// span, each standing for `weight` ranks (the ranks its program stands for).
class busy_profile {
 public:
  busy_profile(const op_spans& spans, double weight) {
    std::vector<std::pair<double, double>> ev;  // (time, +-weight)
    for (const auto& r : spans)
      for (const auto& s : r)
        if (s[1] > s[0]) ev.push_back({s[0], weight}), ev.push_back({s[1], -weight});
    std::sort(ev.begin(), ev.end());
    double level = 0, area = 0, last = 0;
    for (const auto& [t, dw] : ev) {
      area += level * (t - last);
      last = t;
      level += dw;
      t_.push_back(t), area_.push_back(area), level_.push_back(level);
    }
  }
  double mean(double a, double b) const { return b > a ? (integral(b) - integral(a)) / (b - a) : 0.0; }

 private:
  double integral(double x) const {  // of the busy count from 0 to x
    const auto it = std::upper_bound(t_.begin(), t_.end(), x);
    if (it == t_.begin()) return 0.0;
    const auto k = static_cast<std::size_t>(it - t_.begin()) - 1;
    return area_[k] + level_[k] * (x - t_[k]);
  }
  std::vector<double> t_, area_, level_;
};

}  // namespace whale::detail
