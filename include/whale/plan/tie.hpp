// `prefer_simpler`: the near-tie rule both planners share (auto_plan<M> and the
// reference workloads' plan search). Predictions closer than the cost model's
// error (docs/records-planning.md) do not say which plan is faster; the
// simpler one then runs, since fewer mechanisms leave less the model does not
// see -- unless it would leave less memory free than the memory model's own
// error, when a plan of the band that does leave it runs instead.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace whale {

/// A ranked candidate as the tie rule reads it: runnable, within memory, its
/// predicted step and peak memory per rank, its simplicity (lower: simpler)
/// and where the rule marks it.
template <class C>
concept tie_candidate = requires(C c) {
  { c.valid } -> std::convertible_to<bool>;
  { c.fits } -> std::convertible_to<bool>;
  { c.step_s } -> std::convertible_to<double>;
  { c.memory_mib } -> std::convertible_to<double>;
  { c.order } -> std::convertible_to<int>;
  c.tie = true;
};

/// A tie band must be a fraction in [0, 1); `what` names the setting in the error.
inline void check_plan_tie(double tie, const std::string& what) {
  if (!(tie >= 0 && tie < 1)) throw std::invalid_argument(what + " must be in [0, 1) (got " + std::to_string(tie) + ")");
}

/// The memory a near-tie choice must leave free, as a fraction of the limit:
/// the memory model's stated error (within ±10% of the measured peak,
/// docs/records-planning.md), so that a plan chosen for simplicity is not
/// one the model's error could put over the limit.
inline constexpr double tie_headroom = 0.10;

/// Among the runnable, fitting candidates at the front of `cs` (ranked by
/// predicted step time), those predicted within `tie` of the fastest are a
/// tie. With a memory limit (`memory_limit_mib` > 0), those that leave
/// `tie_headroom` of it free come first; among them (or among all, when none
/// does) the one of lowest `order` moves to the front (the others keep their
/// order) and is marked `tie`.
template <tie_candidate C> void prefer_simpler(std::vector<C>& cs, double tie, double memory_limit_mib = 0) {
  if (cs.empty() || !cs.front().valid || !cs.front().fits) return;
  auto roomy = [&](const C& c) {
    return memory_limit_mib <= 0 || static_cast<double>(c.memory_mib) <= (1.0 - tie_headroom) * memory_limit_mib;
  };
  std::size_t pick = 0;
  for (std::size_t i = 1; i < cs.size() && cs[i].valid && cs[i].fits; ++i) {
    if (cs[i].step_s > cs.front().step_s * (1.0 + tie)) continue;
    const bool better = roomy(cs[i]) != roomy(cs[pick]) ? roomy(cs[i]) : cs[i].order < cs[pick].order;
    if (better) pick = i;
  }
  if (pick == 0) return;
  const auto at = cs.begin() + static_cast<std::ptrdiff_t>(pick);
  std::rotate(cs.begin(), at, at + 1);
  cs.front().tie = true;
}

}  // namespace whale
