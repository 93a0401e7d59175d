// Pipeline schedules: small classes that list, for one stage, the order of its
// forward and backward passes over the micro-batches (`gpipe`, `one_f_one_b`,
// and `zb_h1`, whose backward is split into input- and weight-gradient
// passes), and the check that a schedule is well formed and cannot deadlock.
// No runtime.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace whale {

/// One entry of a stage's schedule: the forward, the backward, or (schedules
/// that split the backward) the weight-gradient pass of micro-batch `micro`.
/// In a split schedule `backward` computes only the gradient of the stage's
/// input (what the previous stage waits for) and `weight` the parameters'.
struct pipe_action {
  enum kind_t : int { forward = 0, backward = 1, weight = 2 };
  kind_t kind = forward;
  int micro = 0;
  friend bool operator==(const pipe_action&, const pipe_action&) = default;
  /// "F3", "B0", "W1"
  std::string str() const {
    std::string s(1, kind == forward ? 'F' : kind == backward ? 'B' : 'W');
    s += std::to_string(micro);
    return s;
  }
};

/// A pipeline schedule: `actions(stage, stages, micro)` is stage `stage`'s
/// ordered list of actions for `stages` stages and `micro` micro-batches.
/// Each micro-batch's forward and backward appear once, the forward first.
/// Whether the stages' lists fit together (no deadlock) is checked by
/// `check_schedule`, before any communication.
/// A schedule that lists weight passes declares `static constexpr bool
/// splits_backward = true`; then every micro-batch has one W, after its B.
template <class S>
concept Schedule = requires(int s, int p, int m) {
  { S::name() } -> std::convertible_to<std::string>;
  { S::actions(s, p, m) } -> std::same_as<std::vector<pipe_action>>;
};
/// Whether schedule S splits the backward into B (input gradient) and W (weight gradient).
template <class S> inline constexpr bool splits_backward_v = [] {
  if constexpr (requires { S::splits_backward; }) return static_cast<bool>(S::splits_backward);
  else return false;
}();

/// GPipe: every forward, then every backward (both in micro-batch order).
/// Stage s keeps all m micro-batches' activations alive.
struct gpipe {
  static std::string name() { return "gpipe"; }
  static std::vector<pipe_action> actions(int /*stage*/, int /*stages*/, int m) {
    std::vector<pipe_action> a;
    for (int j = 0; j < m; ++j) a.push_back({pipe_action::forward, j});
    for (int j = 0; j < m; ++j) a.push_back({pipe_action::backward, j});
    return a;
  }
};

/// 1F1B (PipeDream-flush / Megatron): stage s runs min(p-s-1, m) warm-up
/// forwards, then alternates one forward and one backward, then the remaining
/// backwards (cool-down). Stage s keeps at most p-s micro-batches alive.
struct one_f_one_b {
  static std::string name() { return "1f1b"; }
  static std::vector<pipe_action> actions(int s, int p, int m) {
    const int warm = std::min(p - s - 1, m);
    std::vector<pipe_action> a;
    for (int j = 0; j < warm; ++j) a.push_back({pipe_action::forward, j});
    for (int i = 0; i < m - warm; ++i) {
      a.push_back({pipe_action::forward, warm + i});
      a.push_back({pipe_action::backward, i});
    }
    for (int j = m - warm; j < m; ++j) a.push_back({pipe_action::backward, j});
    return a;
  }
};

namespace detail {
/// The zb_h1 lists of all `p` stages, from a replay with unit-time passes (below).
inline std::vector<std::vector<pipe_action>> zb_h1_lists(int p, int m);
}  // namespace detail

/// Zero-bubble pipeline schedule in the manner of ZB-H1 (Qi et al., "Zero
/// Bubble Pipeline Parallelism", 2023): each backward is split into B, the
/// gradient of the stage's input, which the previous stage waits for, and W,
/// the weight gradients, which nothing waits for and which fill the bubbles.
/// The lists come from a list-scheduling replay of all stages with equal
/// times for F, B and W: a stage runs B when its gradient has arrived, else F
/// while at most p−s micro-batches are between their F and B (1F1B's bound)
/// and at most p+1 between F and W, else its oldest W. A micro-batch keeps
/// its activation slot until its W, so every stage holds at most p+1 (1F1B's
/// first stage: p). With F = B = W the bubble of 1F1B is 3(p−1) pass times
/// and this schedule's is about p−1 (check_schedule's `bubble` gives it for
/// any p, m).
struct zb_h1 {
  static constexpr bool splits_backward = true;
  static std::string name() { return "zb-h1"; }
  static std::vector<pipe_action> actions(int s, int p, int m) {
    auto all = detail::zb_h1_lists(p, m);
    return s >= 0 && s < p ? std::move(all[static_cast<std::size_t>(s)]) : std::vector<pipe_action>{};
  }
};

/// What check_schedule learned by replaying a schedule.
struct schedule_report {
  /// Per stage: the most micro-batches whose activations are alive at once.
  std::vector<int> peak_live;
  /// Per stage, per micro-batch: its activation slot (lowest free one at its forward).
  std::vector<std::vector<int>> slot;
  /// Per stage, per micro-batch: the index of the action after which its slot is
  /// free for it (0: free from the start), i.e. when its receives may be posted.
  std::vector<std::vector<int>> free_at;
  /// Rounds of the replay with unit-time actions and free communication.
  int rounds = 0;
  /// Idle fraction of the busiest stage in that replay: the bubble when every
  /// pass (F, B and, if split, W) takes the same time. 1F1B and GPipe:
  /// (p−1)/(m+p−1).
  double bubble = 0;
  /// Whether the lists have weight passes (the backward is split).
  bool split = false;
};

namespace detail {
/// check_schedule for lists already made (`who` starts every message).
inline schedule_report check_lists(const std::vector<std::vector<pipe_action>>& lists, int p, int m, bool declared_split,
                                   const std::string& who) {
  schedule_report r;
  r.peak_live.assign(static_cast<std::size_t>(p), 0);
  r.slot.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(m), -1));
  r.free_at.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(m), 0));
  r.split = declared_split;
  const auto su = [](int i) { return static_cast<std::size_t>(i); };
  std::size_t most = 0;
  for (int s = 0; s < p; ++s) {
    const auto& l = lists[su(s)];
    most = std::max(most, l.size());
    std::vector<int> at[3];
    for (auto& v : at) v.assign(su(m), -1);
    for (std::size_t k = 0; k < l.size(); ++k) {
      const auto a = l[k];
      if (a.micro < 0 || a.micro >= m)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + ", but there are " +
                                    std::to_string(m) + " micro-batches (0.." + std::to_string(m - 1) + ")");
      if (a.kind == pipe_action::weight && !declared_split)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() +
                                    ", but the schedule does not declare splits_backward = true (its backward passes "
                                    "would compute the weight gradients already)");
      auto& v = at[static_cast<int>(a.kind)];
      if (v[su(a.micro)] >= 0)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + " twice");
      v[su(a.micro)] = static_cast<int>(k);
    }
    for (int j = 0; j < m; ++j) {
      const auto f = at[0][su(j)], b = at[1][su(j)], w = at[2][su(j)];
      if (f < 0 || b < 0 || (declared_split && w < 0))
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " never runs " +
                                    (f < 0 ? "F" : b < 0 ? "B" : "W") + std::to_string(j) + "; every micro-batch needs " +
                                    (declared_split ? "one forward, one backward and one weight pass" : "one forward and one backward"));
      if (b < f)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " runs B" + std::to_string(j) +
                                    " before F" + std::to_string(j) + "; a backward needs its forward's activations");
      if (declared_split && w < b)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " runs W" + std::to_string(j) + " before B" +
                                    std::to_string(j) + "; the weight pass needs the gradient its backward received");
    }
    // Slots: lowest free slot at each forward; a slot frees at its last pass (B, or W if split).
    const auto frees = declared_split ? pipe_action::weight : pipe_action::backward;
    std::vector<int> owner;  // owner[slot] = micro or -1
    std::vector<int> freed;  // action index after which the slot is free
    int live = 0;
    for (std::size_t k = 0; k < l.size(); ++k) {
      const auto a = l[k];
      const auto j = su(a.micro);
      if (a.kind == pipe_action::forward) {
        std::size_t sl = 0;
        while (sl < owner.size() && owner[sl] >= 0) ++sl;
        if (sl == owner.size()) owner.push_back(-1), freed.push_back(0);
        owner[sl] = a.micro;
        r.slot[su(s)][j] = static_cast<int>(sl);
        r.free_at[su(s)][j] = freed[sl];
        r.peak_live[su(s)] = std::max(r.peak_live[su(s)], ++live);
      } else if (a.kind == frees) {
        const auto sl = su(r.slot[su(s)][j]);
        owner[sl] = -1;
        freed[sl] = static_cast<int>(k) + 1;
        --live;
      }
    }
  }
  // Replay in rounds: each stage runs its next action if what it needs is done
  // (W needs only its own B, which its list runs first).
  std::vector<std::vector<char>> fdone(su(p), std::vector<char>(su(m))), bdone = fdone;
  std::vector<std::size_t> next(su(p), 0);
  std::size_t left = 0;
  for (auto& l : lists) left += l.size();
  while (left > 0) {
    std::vector<std::pair<int, pipe_action>> ran;
    for (int s = 0; s < p; ++s) {
      const auto& l = lists[su(s)];
      const auto k = next[su(s)];
      if (k == l.size()) continue;
      const auto a = l[k];
      const auto j = su(a.micro);
      const bool ready = a.kind == pipe_action::forward    ? (s == 0 || fdone[su(s - 1)][j])
                         : a.kind == pipe_action::backward ? (s == p - 1 || bdone[su(s + 1)][j])
                                                           : true;
      if (ready) ran.push_back({s, a});
    }
    if (ran.empty()) {
      std::string where;
      for (int s = 0; s < p; ++s) {
        const auto& l = lists[su(s)];
        const auto k = next[su(s)];
        if (k == l.size()) continue;
        const auto a = l[k];
        where += (where.empty() ? "" : ", ") + std::string("stage ") + std::to_string(s) + " waits at " + a.str() +
                 (a.kind == pipe_action::forward ? " for F" + std::to_string(a.micro) + " of stage " + std::to_string(s - 1)
                                                 : " for B" + std::to_string(a.micro) + " of stage " + std::to_string(s + 1));
      }
      throw std::invalid_argument(who + "the schedule deadlocks with " + std::to_string(p) + " stages and " +
                                  std::to_string(m) + " micro-batches: " + where +
                                  "; forward j of stage s needs forward j of stage s-1, and backward j needs "
                                  "backward j of stage s+1, so order each stage's list accordingly");
    }
    for (auto [s, a] : ran) {
      if (a.kind == pipe_action::forward) fdone[su(s)][su(a.micro)] = 1;
      if (a.kind == pipe_action::backward) bdone[su(s)][su(a.micro)] = 1;
      ++next[su(s)];
      --left;
    }
    ++r.rounds;
  }
  r.bubble = r.rounds > 0 ? 1.0 - static_cast<double>(most) / static_cast<double>(r.rounds) : 0.0;
  return r;
}

inline std::vector<std::vector<pipe_action>> zb_h1_lists(int p, int m) {
  std::vector<std::vector<pipe_action>> lists(static_cast<std::size_t>(p > 0 ? p : 0));
  if (p < 1 || m < 1) return lists;
  const auto su = [](int i) { return static_cast<std::size_t>(i); };
  // round at which stage s finished F j / B j (-1: not yet)
  std::vector<std::vector<int>> fat(su(p), std::vector<int>(su(m), -1)), bat = fat;
  std::vector<int> nf(su(p), 0), nb(su(p), 0), nw(su(p), 0);
  int done = 0;
  for (int t = 0; done < p; ++t) {
    if (t > 8 * (m + p) + 16) throw std::logic_error("whale::zb_h1: the list-scheduling replay did not finish");
    std::vector<pipe_action> pick(su(p));
    std::vector<char> any(su(p), 0);
    for (int s = 0; s < p; ++s) {
      const auto i = su(s);
      const int jb = nb[i], jf = nf[i];
      if (jb < nf[i] && (s == p - 1 || (bat[i + 1][su(jb)] >= 0 && bat[i + 1][su(jb)] < t))) {
        pick[i] = {pipe_action::backward, jb};
      } else if (jf < m && (s == 0 || (fat[i - 1][su(jf)] >= 0 && fat[i - 1][su(jf)] < t)) && nf[i] - nb[i] < p - s &&
                 nf[i] - nw[i] < p + 1) {
        pick[i] = {pipe_action::forward, jf};
      } else if (nw[i] < nb[i]) {
        pick[i] = {pipe_action::weight, nw[i]};
      } else {
        continue;
      }
      any[i] = 1;
    }
    for (int s = 0; s < p; ++s) {
      const auto i = su(s);
      if (!any[i]) continue;
      const auto a = pick[i];
      lists[i].push_back(a);
      if (a.kind == pipe_action::forward) fat[i][su(a.micro)] = t, ++nf[i];
      else if (a.kind == pipe_action::backward) bat[i][su(a.micro)] = t, ++nb[i];
      else if (++nw[i] == m) ++done;
    }
  }
  return lists;
}
}  // namespace detail

/// Replay schedule S on `p` stages and `m` micro-batches, as the pipeline
/// runtime executes it: forward j on stage s needs stage s-1's forward j done,
/// backward j on stage s needs stage s+1's backward j done (and its own forward
/// j), a weight pass its own backward; sends never block. Throws
/// std::invalid_argument, with the stages' positions, when a list is malformed
/// or the stages would wait on each other forever. Pure: the same answer on every rank.
template <Schedule S> schedule_report check_schedule(int p, int m) {
  const std::string who = "whale::pipeline<" + std::string(S::name()) + ", ...>: ";
  if (p < 1) throw std::invalid_argument(who + "a pipeline needs at least one stage");
  if (m < 1)
    throw std::invalid_argument(who + "the micro-batch count must be at least 1 (got " + std::to_string(m) + ")");
  std::vector<std::vector<pipe_action>> lists(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s) lists[static_cast<std::size_t>(s)] = S::actions(s, p, m);
  return detail::check_lists(lists, p, m, splits_backward_v<S>, who);
}

/// The idle fraction of a balanced pipeline (equal stages, free communication):
/// (p-1)/(m+p-1), the same for GPipe and 1F1B (for any schedule, and split
/// ones, see check_schedule's `bubble`).
inline double bubble_theory(int p, int m) {
  return p <= 1 ? 0.0 : static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

}  // namespace whale
