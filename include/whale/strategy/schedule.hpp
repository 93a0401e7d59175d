// Pipeline schedules: small classes that list, for one stage, the order of its
// forward and backward passes over the micro-batches (`gpipe`, `one_f_one_b`),
// and the check that a schedule is well formed and cannot deadlock. No runtime.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace whale {

/// One entry of a stage's schedule: the forward or the backward of micro-batch `micro`.
struct pipe_action {
  enum kind_t : int { forward = 0, backward = 1 };
  kind_t kind = forward;
  int micro = 0;
  friend bool operator==(const pipe_action&, const pipe_action&) = default;
  /// "F3", "B0"
  std::string str() const {
    std::string s(1, kind == forward ? 'F' : 'B');
    s += std::to_string(micro);
    return s;
  }
};

/// A pipeline schedule: `actions(stage, stages, micro)` is stage `stage`'s
/// ordered list of actions for `stages` stages and `micro` micro-batches.
/// Each micro-batch's forward and backward appear once, the forward first.
/// Whether the stages' lists fit together (no deadlock) is checked by
/// `check_schedule`, before any communication.
template <class S>
concept Schedule = requires(int s, int p, int m) {
  { S::name() } -> std::convertible_to<std::string>;
  { S::actions(s, p, m) } -> std::same_as<std::vector<pipe_action>>;
};

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
};

/// Replay schedule S on `p` stages and `m` micro-batches, as the pipeline
/// runtime executes it: forward j on stage s needs stage s-1's forward j done,
/// backward j on stage s needs stage s+1's backward j done (and its own forward
/// j); sends never block. Throws std::invalid_argument, with the stages'
/// positions, when a list is malformed or the stages would wait on each other
/// forever. Pure: the same answer on every rank.
template <Schedule S> schedule_report check_schedule(int p, int m) {
  const std::string who = "whale::pipeline<" + std::string(S::name()) + ", ...>: ";
  if (p < 1) throw std::invalid_argument(who + "a pipeline needs at least one stage");
  if (m < 1)
    throw std::invalid_argument(who + "the micro-batch count must be at least 1 (got " + std::to_string(m) + ")");
  std::vector<std::vector<pipe_action>> lists(static_cast<std::size_t>(p));
  schedule_report r;
  r.peak_live.assign(static_cast<std::size_t>(p), 0);
  r.slot.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(m), -1));
  r.free_at.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(m), 0));
  for (int s = 0; s < p; ++s) {
    auto& l = lists[static_cast<std::size_t>(s)];
    l = S::actions(s, p, m);
    std::vector<int> fwd_at(static_cast<std::size_t>(m), -1), bwd_at(static_cast<std::size_t>(m), -1);
    for (std::size_t k = 0; k < l.size(); ++k) {
      const auto a = l[k];
      if (a.micro < 0 || a.micro >= m)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + ", but there are " +
                                    std::to_string(m) + " micro-batches (0.." + std::to_string(m - 1) + ")");
      auto& at = a.kind == pipe_action::forward ? fwd_at : bwd_at;
      if (at[static_cast<std::size_t>(a.micro)] >= 0)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + " twice");
      at[static_cast<std::size_t>(a.micro)] = static_cast<int>(k);
    }
    for (int j = 0; j < m; ++j) {
      const auto f = fwd_at[static_cast<std::size_t>(j)], b = bwd_at[static_cast<std::size_t>(j)];
      if (f < 0 || b < 0)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " never runs " + (f < 0 ? "F" : "B") +
                                    std::to_string(j) + "; every micro-batch needs one forward and one backward");
      if (b < f)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " runs B" + std::to_string(j) +
                                    " before F" + std::to_string(j) + "; a backward needs its forward's activations");
    }
    // Slots: lowest free slot at each forward; a slot frees at its backward.
    std::vector<int> owner;  // owner[slot] = micro or -1
    std::vector<int> freed;  // action index after which the slot is free
    int live = 0;
    for (std::size_t k = 0; k < l.size(); ++k) {
      const auto a = l[k];
      const auto j = static_cast<std::size_t>(a.micro);
      if (a.kind == pipe_action::forward) {
        std::size_t sl = 0;
        while (sl < owner.size() && owner[sl] >= 0) ++sl;
        if (sl == owner.size()) owner.push_back(-1), freed.push_back(0);
        owner[sl] = a.micro;
        r.slot[static_cast<std::size_t>(s)][j] = static_cast<int>(sl);
        r.free_at[static_cast<std::size_t>(s)][j] = freed[sl];
        r.peak_live[static_cast<std::size_t>(s)] = std::max(r.peak_live[static_cast<std::size_t>(s)], ++live);
      } else {
        const auto sl = static_cast<std::size_t>(r.slot[static_cast<std::size_t>(s)][j]);
        owner[sl] = -1;
        freed[sl] = static_cast<int>(k) + 1;
        --live;
      }
    }
  }
  // Replay in rounds: each stage runs its next action if what it needs is done.
  std::vector<std::vector<char>> fdone(static_cast<std::size_t>(p), std::vector<char>(static_cast<std::size_t>(m))),
      bdone = fdone;
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::size_t left = 0;
  for (auto& l : lists) left += l.size();
  while (left > 0) {
    std::vector<std::pair<int, pipe_action>> ran;
    for (int s = 0; s < p; ++s) {
      const auto& l = lists[static_cast<std::size_t>(s)];
      const auto k = next[static_cast<std::size_t>(s)];
      if (k == l.size()) continue;
      const auto a = l[k];
      const auto j = static_cast<std::size_t>(a.micro);
      const bool ready = a.kind == pipe_action::forward
                             ? (s == 0 || fdone[static_cast<std::size_t>(s - 1)][j])
                             : (s == p - 1 || bdone[static_cast<std::size_t>(s + 1)][j]);
      if (ready) ran.push_back({s, a});
    }
    if (ran.empty()) {
      std::string where;
      for (int s = 0; s < p; ++s) {
        const auto& l = lists[static_cast<std::size_t>(s)];
        const auto k = next[static_cast<std::size_t>(s)];
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
      (a.kind == pipe_action::forward ? fdone : bdone)[static_cast<std::size_t>(s)][static_cast<std::size_t>(a.micro)] = 1;
      ++next[static_cast<std::size_t>(s)];
      --left;
    }
    ++r.rounds;
  }
  return r;
}

/// The idle fraction of a balanced pipeline (equal stages, free communication):
/// (p-1)/(m+p-1), the same for GPipe and 1F1B.
inline double bubble_theory(int p, int m) {
  return p <= 1 ? 0.0 : static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

}  // namespace whale
