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
/// In an interleaved schedule `chunk` says which of the rank's model chunks
/// (virtual stages) runs: chunk c of pipe rank s is virtual stage c·p + s.
struct pipe_action {
  enum kind_t : int { forward = 0, backward = 1, weight = 2 };
  kind_t kind = forward;
  int micro = 0;
  int chunk = 0;
  friend bool operator==(const pipe_action&, const pipe_action&) = default;
  /// "F3", "B0", "W1"; with a chunk above 0, "F3/c1"
  std::string str() const {
    std::string s(1, kind == forward ? 'F' : kind == backward ? 'B' : 'W');
    s += std::to_string(micro);
    if (chunk > 0) s += "/c" + std::to_string(chunk);
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
/// Model chunks (virtual stages) per pipe rank of schedule S: S::chunks, or 1.
template <class S> inline constexpr int chunks_v = [] {
  if constexpr (requires { S::chunks; }) return static_cast<int>(S::chunks);
  else return 1;
}();
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

/// Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's virtual pipeline):
/// each pipe rank holds V model chunks — virtual stage c·p + s on rank s — so
/// a micro-batch passes each rank V times and the bubble shrinks V-fold,
/// (p−1)/(V·m+p−1), for V times the point-to-point messages. Rank s runs
/// (p−s−1)·2 + (V−1)·p warm-up forwards (at most V·m), then one forward / one
/// backward, then the remaining backwards; forwards take chunks in groups of
/// p micro-batches (chunk 0 of micro-batches 0..p−1, chunk 1 of the same,
/// ..., then the next p), backwards the chunks in reverse. Needs m a multiple
/// of p, as Megatron does.
template <int V>
struct interleaved_1f1b {
  static_assert(V >= 2, "whale::interleaved_1f1b<V>: V is the model chunks per pipe rank, at least 2 (V = 1 is one_f_one_b)");
  static constexpr int chunks = V;
  static std::string name() { return "interleaved-1f1b<" + std::to_string(V) + ">"; }
  static std::vector<pipe_action> actions(int s, int p, int m) {
    if (p < 1 || m % p != 0)
      throw std::invalid_argument("whale::interleaved_1f1b<" + std::to_string(V) + ">: the micro-batch count (" +
                                  std::to_string(m) + ") must be a multiple of the pipe ranks (" + std::to_string(p) +
                                  "); set plan_options::micro_batches (--micro-batches) to one");
    const int total = m * V;
    auto key = [&](int k, bool fwd) {
      const int c = (k / p) % V;
      return std::pair<int, int>{fwd ? c : V - 1 - c, (k / (p * V)) * p + k % p};
    };
    const int warm = std::min((p - s - 1) * 2 + (V - 1) * p, total);
    std::vector<pipe_action> a;
    int f = 0, b = 0;
    auto fwd = [&] {
      const auto [c, j] = key(f++, true);
      a.push_back({pipe_action::forward, j, c});
    };
    auto bwd = [&] {
      const auto [c, j] = key(b++, false);
      a.push_back({pipe_action::backward, j, c});
    };
    while (f < warm) fwd();
    while (f < total) fwd(), bwd();
    while (b < total) bwd();
    return a;
  }
};

namespace detail {
/// The zb_h1 lists of all `p` stages, from a replay with unit-time passes (schedule_check.hpp).
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
  /// Per stage: the most micro-batches (chunk passes, if interleaved) whose activations are alive at once.
  std::vector<int> peak_live;
  /// Per stage, per micro-batch (index chunk·m + micro if interleaved): its activation slot (lowest free one at its forward).
  std::vector<std::vector<int>> slot;
  /// Per stage, per micro-batch: the index of the action after which its slot is
  /// free for it (0: free from the start), i.e. when its receives may be posted.
  std::vector<std::vector<int>> free_at;
  /// Rounds of the replay with unit-time actions and free communication.
  int rounds = 0;
  /// Per stage, per action of its list: the round of that replay it ran in.
  std::vector<std::vector<int>> round;
  /// Idle fraction of the busiest stage in that replay: the bubble when every
  /// pass (F, B and, if split, W) takes the same time. 1F1B and GPipe:
  /// (p−1)/(m+p−1).
  double bubble = 0;
  /// Whether the lists have weight passes (the backward is split).
  bool split = false;
  /// Model chunks per pipe rank (interleaved schedules; 1 otherwise).
  int chunks = 1;
  /// Whether every link between neighbouring pipe ranks carries its messages
  /// in the order the receiver reads them: the activations a rank sends to the
  /// next in the order that rank runs the forwards that read them, and the
  /// gradients likewise backwards. A transport that matches messages by issue
  /// order, not by tag (NCCL), needs it.
  bool in_order = true;
};

/// Every stage's list of S for p stages and m micro-batches.
template <Schedule S> std::vector<std::vector<pipe_action>> schedule_lists(int p, int m) {
  std::vector<std::vector<pipe_action>> lists(static_cast<std::size_t>(p > 0 ? p : 0));
  for (int s = 0; s < p; ++s) lists[static_cast<std::size_t>(s)] = S::actions(s, p, m);
  return lists;
}

}  // namespace whale

#include "whale/strategy/schedule_check.hpp"  // the checks and replays, and zb_h1's lists
