// What a pipeline schedule's lists do when run: the replay of every stage's
// list against the others (rounds, activation slots, when each slot is free),
// the check that lists are well formed and cannot deadlock
// (`check_schedule`), the order of the pipeline's messages on every link, the
// bubble of theory, and zb_h1's lists. Part of schedule.hpp.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/strategy/schedule.hpp"

namespace whale {

namespace detail {
/// The lists with their forwards only, in their order: what a forward-only pass runs.
inline std::vector<std::vector<pipe_action>> forwards_of(const std::vector<std::vector<pipe_action>>& lists) {
  std::vector<std::vector<pipe_action>> fwd(lists.size());
  for (std::size_t s = 0; s < lists.size(); ++s)
    for (const auto& a : lists[s])
      if (a.kind == pipe_action::forward) fwd[s].push_back(a);
  return fwd;
}
/// A replay of every stage's list in rounds: in each round every stage runs its
/// next action if what it needs is done (forward j of virtual stage v needs
/// forward j of v-1, backward j needs backward j of v+1; W needs only its own
/// B, which its list runs first). Forward-only lists replay the same way.
struct replay_result {
  std::vector<std::vector<int>> round;  ///< per stage, per action of its list: the round it ran in
  std::vector<std::size_t> next;        ///< per stage: its first action not run (where it is stuck, if stuck)
  int rounds = 0;
  bool stuck = false;  ///< some stage waits forever
};
inline replay_result replay(const std::vector<std::vector<pipe_action>>& lists, int p, int m, int V) {
  const auto su = [](int i) { return static_cast<std::size_t>(i); };
  const int pv = p * V;
  replay_result r;
  std::vector<std::vector<char>> fdone(su(pv), std::vector<char>(su(m))), bdone = fdone;
  r.next.assign(su(p), 0);
  r.round.resize(su(p));
  std::size_t left = 0;
  for (int s = 0; s < p; ++s) {
    left += lists[su(s)].size();
    r.round[su(s)].assign(lists[su(s)].size(), -1);
  }
  while (left > 0) {
    std::vector<std::pair<int, pipe_action>> ran;
    for (int s = 0; s < p; ++s) {
      const auto& l = lists[su(s)];
      const auto k = r.next[su(s)];
      if (k == l.size()) continue;
      const auto a = l[k];
      const int vs = a.chunk * p + s;
      const auto j = su(a.micro);
      const bool ready = a.kind == pipe_action::forward    ? (vs == 0 || fdone[su(vs - 1)][j])
                         : a.kind == pipe_action::backward ? (vs == pv - 1 || bdone[su(vs + 1)][j])
                                                           : true;
      if (ready) ran.push_back({s, a});
    }
    if (ran.empty()) {
      r.stuck = true;
      return r;
    }
    for (auto [s, a] : ran) {
      const int vs = a.chunk * p + s;
      if (a.kind == pipe_action::forward) fdone[su(vs)][su(a.micro)] = 1;
      if (a.kind == pipe_action::backward) bdone[su(vs)][su(a.micro)] = 1;
      r.round[su(s)][r.next[su(s)]++] = r.rounds;
      --left;
    }
    ++r.rounds;
  }
  return r;
}

/// check_schedule for lists already made (`who` starts every message): `p`
/// pipe ranks with `V` chunks each, `m` micro-batches. Arrays per rank are
/// indexed by chunk·m + micro (micro alone when V = 1).
inline schedule_report check_lists(const std::vector<std::vector<pipe_action>>& lists, int p, int m, bool declared_split,
                                   const std::string& who, int V = 1) {
  schedule_report r;
  const int keys = m * V;
  r.peak_live.assign(static_cast<std::size_t>(p), 0);
  r.slot.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(keys), -1));
  r.free_at.assign(static_cast<std::size_t>(p), std::vector<int>(static_cast<std::size_t>(keys), 0));
  r.split = declared_split;
  r.chunks = V;
  const auto su = [](int i) { return static_cast<std::size_t>(i); };
  const auto key = [m](const pipe_action& a) { return a.chunk * m + a.micro; };
  const auto at_stage = [p](int vs) { return " of stage " + std::to_string(vs % p) + (vs >= p ? " (chunk " + std::to_string(vs / p) + ")" : ""); };
  std::size_t most = 0;
  for (int s = 0; s < p; ++s) {
    const auto& l = lists[su(s)];
    most = std::max(most, l.size());
    std::vector<int> at[3];
    for (auto& v : at) v.assign(su(keys), -1);
    for (std::size_t k = 0; k < l.size(); ++k) {
      const auto a = l[k];
      if (a.micro < 0 || a.micro >= m)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + ", but there are " +
                                    std::to_string(m) + " micro-batches (0.." + std::to_string(m - 1) + ")");
      if (a.chunk < 0 || a.chunk >= V)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + ", but the schedule has " +
                                    std::to_string(V) + " chunk(s) per pipe rank");
      if (a.kind == pipe_action::weight && !declared_split)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() +
                                    ", but the schedule does not declare splits_backward = true (its backward passes "
                                    "would compute the weight gradients already)");
      auto& v = at[static_cast<int>(a.kind)];
      if (v[su(key(a))] >= 0)
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " lists " + a.str() + " twice");
      v[su(key(a))] = static_cast<int>(k);
    }
    for (int c = 0; c < V; ++c)
      for (int j = 0; j < m; ++j) {
        const pipe_action x{pipe_action::forward, j, c};
        const auto f = at[0][su(key(x))], b = at[1][su(key(x))], w = at[2][su(key(x))];
        auto name = [&](pipe_action::kind_t k) { return pipe_action{k, j, c}.str(); };
        if (f < 0 || b < 0 || (declared_split && w < 0))
          throw std::invalid_argument(who + "stage " + std::to_string(s) + " never runs " +
                                      name(f < 0 ? pipe_action::forward : b < 0 ? pipe_action::backward : pipe_action::weight) +
                                      "; every micro-batch needs " +
                                      (declared_split ? "one forward, one backward and one weight pass" : "one forward and one backward") +
                                      (V > 1 ? " on each chunk" : ""));
        if (b < f)
          throw std::invalid_argument(who + "stage " + std::to_string(s) + " runs " + name(pipe_action::backward) +
                                      " before " + name(pipe_action::forward) + "; a backward needs its forward's activations");
        if (declared_split && w < b)
          throw std::invalid_argument(who + "stage " + std::to_string(s) + " runs " + name(pipe_action::weight) + " before " +
                                      name(pipe_action::backward) + "; the weight pass needs the gradient its backward received");
      }
    // Slots: lowest free slot at each forward; a slot frees at its last pass (B, or W if split).
    const auto frees = declared_split ? pipe_action::weight : pipe_action::backward;
    std::vector<int> owner;  // owner[slot] = key or -1
    std::vector<int> freed;  // action index after which the slot is free
    int live = 0;
    for (std::size_t k = 0; k < l.size(); ++k) {
      const auto a = l[k];
      const auto j = su(key(a));
      if (a.kind == pipe_action::forward) {
        std::size_t sl = 0;
        while (sl < owner.size() && owner[sl] >= 0) ++sl;
        if (sl == owner.size()) owner.push_back(-1), freed.push_back(0);
        owner[sl] = key(a);
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
  const auto rp = replay(lists, p, m, V);
  if (rp.stuck) {
    std::string where;
    for (int s = 0; s < p; ++s) {
      const auto& l = lists[su(s)];
      const auto k = rp.next[su(s)];
      if (k == l.size()) continue;
      const auto a = l[k];
      const int vs = a.chunk * p + s;
      where += (where.empty() ? "" : ", ") + std::string("stage ") + std::to_string(s) + " waits at " + a.str() +
               (a.kind == pipe_action::forward ? " for F" + std::to_string(a.micro) + at_stage(vs - 1)
                                               : " for B" + std::to_string(a.micro) + at_stage(vs + 1));
    }
    throw std::invalid_argument(who + "the schedule deadlocks with " + std::to_string(p) + " stages and " +
                                std::to_string(m) + " micro-batches: " + where +
                                "; forward j of stage s needs forward j of stage s-1, and backward j needs "
                                "backward j of stage s+1, so order each stage's list accordingly");
  }
  r.rounds = rp.rounds;
  r.round = rp.round;
  const int pv = p * V;
  r.bubble = r.rounds > 0 ? 1.0 - static_cast<double>(most) / static_cast<double>(r.rounds) : 0.0;
  // each link's messages (micro-batch, virtual stage read at), in the order sent and in the order read
  for (int s = 0; s < p && r.in_order; ++s)
    for (int dir : {1, -1}) {  // activations to s + 1, gradients to s - 1 (around the ring)
      const int to = (s + dir + p) % p;
      std::vector<std::pair<int, int>> sent, read;
      for (const auto& a : lists[su(s)]) {
        const int vs = a.chunk * p + s;
        if (dir == 1 && a.kind == pipe_action::forward && vs < pv - 1) sent.push_back({a.micro, vs + 1});
        if (dir == -1 && a.kind == pipe_action::backward && vs > 0) sent.push_back({a.micro, vs - 1});
      }
      for (const auto& a : lists[su(to)]) {
        const int vs = a.chunk * p + to;
        if (dir == 1 && a.kind == pipe_action::forward && vs > 0 && (vs - 1) % p == s) read.push_back({a.micro, vs});
        if (dir == -1 && a.kind == pipe_action::backward && vs < pv - 1 && (vs + 1) % p == s) read.push_back({a.micro, vs});
      }
      if (sent != read) r.in_order = false;
    }
  return r;
}

/// One pipeline message as one pipe rank issues it (message_order).
struct pipe_op {
  bool send = false;  ///< this rank sends it (else receives it)
  int kind = 0;       ///< 0: an activation (to the next virtual stage), 1: a gradient (to the previous one)
  int key = 0;        ///< the pass (chunk·m + micro) that reads it, on the receiving rank
  int peer = 0;       ///< the pipe rank at the other end
  int round = 0;      ///< the round of the replay in which the receiver reads it
  friend bool operator==(const pipe_op&, const pipe_op&) = default;
};

/// The messages of one pass over `lists` (every pipe rank's actions; a
/// forward-only pass lists its forwards only) that pipe rank `stage` sends
/// and receives, in the one order every rank agrees on: by the round of the
/// replay in which the receiver reads the message, then by the receiving
/// rank. A rank issues a message (on the pipe group's one communicator)
/// before its first action of that round or later, or at the pass's end, so
/// each send follows the action that made it and each receive comes just
/// before the action that reads it. Each rank's operations then run one at a
/// time, in this order, and none waits for a later one: the first message
/// not yet done has both its ends at the head of their queues. So the
/// pipeline needs one operation in flight a rank, never two NCCL kernels
/// resident at once, and a host that does not wait cannot hold it up.
inline std::vector<pipe_op> message_order(const std::vector<std::vector<pipe_action>>& lists, const std::vector<std::vector<int>>& rounds,
                                          int p, int m, int V, int stage) {
  const auto su = [](int i) { return static_cast<std::size_t>(i); };
  const int pv = p * V;
  struct msg {
    int round, reader, sender, kind, key;
  };
  std::vector<msg> all;
  for (int s = 0; s < p; ++s)
    for (std::size_t k = 0; k < lists[su(s)].size(); ++k) {
      const auto a = lists[su(s)][k];
      const int vs = a.chunk * p + s, key = a.chunk * m + a.micro, at = rounds[su(s)][k];
      if (a.kind == pipe_action::forward && vs > 0) all.push_back({at, s, (vs - 1) % p, 0, key});
      if (a.kind == pipe_action::backward && vs < pv - 1) all.push_back({at, s, (vs + 1) % p, 1, key});
    }
  std::sort(all.begin(), all.end(), [](const msg& a, const msg& b) { return a.round != b.round ? a.round < b.round : a.reader < b.reader; });
  std::vector<pipe_op> mine;
  for (const auto& x : all) {
    if (x.reader == stage) mine.push_back({false, x.kind, x.key, x.sender, x.round});
    if (x.sender == stage) mine.push_back({true, x.kind, x.key, x.reader, x.round});
  }
  return mine;
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
  return detail::check_lists(schedule_lists<S>(p, m), p, m, splits_backward_v<S>, who, chunks_v<S>);
}

/// The idle fraction of a balanced pipeline (equal stages, free communication):
/// (p-1)/(m+p-1), the same for GPipe and 1F1B (for any schedule, and split
/// ones, see check_schedule's `bubble`).
inline double bubble_theory(int p, int m) {
  return p <= 1 ? 0.0 : static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

}  // namespace whale
