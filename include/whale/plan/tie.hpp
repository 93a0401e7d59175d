// `prefer_simpler`: the near-tie rule both planners share (auto_plan<M> and the
// reference workloads' plan search). Predictions closer than the cost model's
// error (docs/planning.md, section 6) do not say which plan is faster; the
// simpler one then runs, since fewer mechanisms leave less the model does not see.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace whale {

/// A ranked candidate as the tie rule reads it: runnable, within memory, its
/// predicted step, its simplicity (lower: simpler) and where the rule marks it.
template <class C>
concept tie_candidate = requires(C c) {
  { c.valid } -> std::convertible_to<bool>;
  { c.fits } -> std::convertible_to<bool>;
  { c.step_s } -> std::convertible_to<double>;
  { c.order } -> std::convertible_to<int>;
  c.tie = true;
};

/// A tie band must be a fraction in [0, 1); `what` names the setting in the error.
inline void check_plan_tie(double tie, const std::string& what) {
  if (!(tie >= 0 && tie < 1)) throw std::invalid_argument(what + " must be in [0, 1) (got " + std::to_string(tie) + ")");
}

/// Among the runnable, fitting candidates at the front of `cs` (ranked by
/// predicted step time), the one of lowest `order` predicted within `tie` of the
/// fastest moves to the front (the others keep their order) and is marked `tie`.
template <tie_candidate C> void prefer_simpler(std::vector<C>& cs, double tie) {
  if (cs.empty() || !cs.front().valid || !cs.front().fits) return;
  std::size_t pick = 0;
  for (std::size_t i = 1; i < cs.size() && cs[i].valid && cs[i].fits; ++i)
    if (cs[i].step_s <= cs.front().step_s * (1.0 + tie) && cs[i].order < cs[pick].order) pick = i;
  if (pick == 0) return;
  const auto at = cs.begin() + static_cast<std::ptrdiff_t>(pick);
  std::rotate(cs.begin(), at, at + 1);
  cs.front().tie = true;
}

}  // namespace whale
