// `simulate(desc, programs, profile)`: one training step of every rank's
// lowered program replayed event by event on a device profile. With a
// one-stream profile each rank runs its operations in program order (the CPU
// runtime's way: a collective blocks its rank); with `streams 2` collectives
// run in order on a communication stream and compute waits only for the
// operations it depends on (a GPU with NCCL). A collective starts when every
// rank of its group has reached it and lasts α + bytes/β; a message arrives
// α + bytes/β after its send, and a receive waits for it. Compute takes its
// GEMM FLOPs at the profile's rate for that size (a backward pass's at its
// backward factor; attention's per-head products at the attention rate where
// the profile has one), elementwise work its bytes at the profile's
// bandwidth. A GPU profile (a `kernels` line) prices each layer from what the
// GPU step's ledger counts for it instead (plan/probe.hpp, describe_kernels):
// its GEMMs, its attention, its other kernels' bytes and its launches, a
// repeat's blocks as a whole block runs them. Gives the step time, and per
// rank its compute, communication and idle time, and the spans for a trace.
// Pure.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "whale/comm/trace.hpp"
#include "whale/plan/describe.hpp"
#include "whale/plan/device.hpp"
#include "whale/plan/placement.hpp"
#include "whale/plan/price.hpp"
#include "whale/plan/sharing.hpp"
#include "whale/plan/program.hpp"

namespace whale {

/// One rank's simulated step.
struct rank_time {
  double end_s = 0;      ///< when its last operation ends
  double compute_s = 0;  ///< forward, backward, recompute, weight passes and the optimizer
  double comm_s = 0;     ///< in collectives and messages (transfer time; with two streams, partly hidden under compute)
  /// Waiting for a group or a message (bubbles, stragglers); with two streams,
  /// the compute stream's stalls for what it depends on (exposed communication too).
  double wait_s = 0;
  /// Communication by why ("gradient bucket ...", "ZeRO-3 gather ...", ...): first words.
  std::map<std::string, double> comm_by_what;
};

/// A simulated step of every rank.
struct step_simulation {
  double step_s = 0;  ///< the slowest rank's end
  std::vector<rank_time> ranks;
  std::vector<trace_event> spans;  ///< Chrome trace spans (write_trace), one per operation
  /// Bytes that cross between nodes in the step, over every link and both
  /// directions (the ranks left out by symmetry counted too). The traffic model
  /// is comm_stats' ring: a collective runs as a ring over its group in rank
  /// order, each member sending its bytes to the next, so a member's bytes
  /// cross when the next member sits on another node; a message crosses when
  /// its two ranks do. 0 on one node.
  double inter_node_bytes = 0;
  /// The busiest rank's idle fraction (waits over its end time).
  double bubble() const {
    double b = 0;
    for (const auto& r : ranks) b = std::max(b, r.end_s > 0 ? r.wait_s / r.end_s : 0.0);
    return b;
  }
};

namespace detail {
inline std::string what_key(const std::string& what) {
  // "gradient bucket 3 [..)" -> "gradient bucket"; "ZeRO-3 gather of linear<..>" -> "ZeRO-3 gather"
  std::size_t cut = what.find_first_of("[(<0123456789");
  std::string k = what.substr(0, cut);
  while (!k.empty() && (k.back() == ' ' || k.back() == 'o' || k.back() == 'f')) {
    if (k.size() >= 3 && k.compare(k.size() - 3, 3, " of") == 0) k.resize(k.size() - 3);
    else if (k.back() == ' ') k.pop_back();
    else break;
  }
  return k.empty() ? what : k;
}
}  // namespace detail

namespace detail {
/// Every rank's program (`progs[r]` for rank r, from lower(d, mesh, r, ...)) replayed
/// on `dev`; ranks in nodes of `ranks_per_node` (0: the profile's `node` entry,
/// and without one every rank on one node); mesh rank r on device `devices[r]`
/// (empty: device r), whose node is devices[r] / ranks_per_node.
/// By symmetry: the programs may be those of the ranks with coordinate 0 on the
/// data axis, the model axis or both (e.g. one rank per pipeline stage); every
/// rank left out is taken to run its group's program at the same times (true
/// when replicas are equal, no speeds or balanced rows, and the ranks of a
/// tensor-parallel group hold equal shards), so a collective starts when its
/// simulated members arrive and is priced for its whole group and placement.
/// Then sim.ranks[i] is progs[i]'s rank. `scale` (optional) multiplies each compute
/// operation's time; `computed` (optional) receives where each one ran.
inline step_simulation simulate_pass(const model_desc& d, const std::vector<program>& progs, const device_profile& dev,
                                     int ranks_per_node, const std::vector<int>& devices, const per_op* scale,
                                     op_spans* computed) {
  const int n = static_cast<int>(progs.size());
  if (n == 0) throw std::invalid_argument("whale::simulate: no programs");
  const auto& mesh = progs.front().mesh;
  const int full = mesh.size();
  std::vector<int> index(static_cast<std::size_t>(full), -1);  // mesh rank -> its program in progs (-1: by symmetry)
  int represented = n;
  unsigned by_symmetry = 0;  // the axes along which the programs given stand for the rest
  {
    bool zero[axis_count] = {true, true, true};
    for (int i = 0; i < n; ++i) {
      const int r = progs[static_cast<std::size_t>(i)].rank;
      if (r < 0 || r >= full || index[static_cast<std::size_t>(r)] >= 0)
        throw std::invalid_argument("whale::simulate: the programs' ranks are not distinct ranks of the mesh (rank " + std::to_string(r) + ")");
      index[static_cast<std::size_t>(r)] = i;
      for (int a = 0; a < axis_count; ++a) zero[a] = zero[a] && mesh.coords(r)[static_cast<std::size_t>(a)] == 0;
    }
    for (axis a : {axis::data, axis::model})
      if (zero[static_cast<int>(a)] && mesh.size(a) > 1) represented *= mesh.size(a), by_symmetry |= 1u << static_cast<int>(a);
    if (represented != full)
      throw std::invalid_argument("whale::simulate: " + std::to_string(n) + " programs for a mesh of " + std::to_string(full) +
                                  " ranks (give every rank's, or those of coordinate 0 on the data or model axis)");
  }
  const int per_node = ranks_per_node > 0 ? ranks_per_node : dev.ranks_per_node > 0 ? dev.ranks_per_node : full;
  const bool two_streams = dev.streams > 1;
  if (!devices.empty() && static_cast<int>(devices.size()) != full)
    throw std::invalid_argument("whale::simulate: " + std::to_string(devices.size()) + " devices for " + std::to_string(full) + " ranks");
  if (n < full && !replicas_alike(mesh, axes::from_bits(by_symmetry), per_node, devices))
    throw std::invalid_argument("whale::simulate: replay by symmetry needs every replica placed on the nodes as the first is "
                                "(" + std::to_string(per_node) + " ranks per node cut them otherwise); give every rank's program");
  auto node_of = [&](int r) { return (devices.empty() ? r : devices[static_cast<std::size_t>(r)]) / per_node; };
  step_simulation sim;
  sim.ranks.assign(static_cast<std::size_t>(n), {});
  std::vector<std::size_t> next(static_cast<std::size_t>(n), 0);
  std::vector<double> clock(static_cast<std::size_t>(n), 0.0);  // the rank's (compute) stream
  // a compute operation's seconds by (unit, kind, rows): ranks and micro-batches repeat them
  // (one plan, mesh and sequence length for every rank; the optimizer by its elements)
  std::map<std::tuple<int, int, index_t, std::int64_t>, double> priced;
  const auto seconds_of = [&](const program& p, const op& o) {
    const auto key = std::make_tuple(o.unit, static_cast<int>(o.kind), o.rows, o.kind == op_kind::optimizer ? o.elements : std::int64_t{0});
    if (const auto it = priced.find(key); it != priced.end()) return it->second;
    return priced[key] = detail::compute_seconds(d, p, o, dev);
  };
  std::vector<double> comm_clock(static_cast<std::size_t>(n), 0.0);  // its communication stream (two streams)
  std::vector<double> arrival(static_cast<std::size_t>(n), 0.0);  // when it can start the collective it is at
  std::vector<std::vector<double>> done(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) done[static_cast<std::size_t>(r)].assign(progs[static_cast<std::size_t>(r)].ops.size(), -1.0);
  // collectives match by group (its axes and the members' other coordinates) and order within it
  auto group_key = [&](int r, const op& o) {
    const auto c = mesh.coords(r);
    std::int64_t k = o.group.bits();
    for (int a = 0; a < axis_count; ++a)
      k = k * 4096 + ((o.group.bits() >> a) & 1u ? 0 : c[static_cast<std::size_t>(a)]);
    return k;
  };
  auto members = [&](int r, const op& o) {  // of the whole mesh
    std::vector<int> m;
    const auto c = mesh.coords(r);
    for (int q = 0; q < full; ++q) {
      const auto cq = mesh.coords(q);
      bool same = true;
      for (int a = 0; a < axis_count; ++a)
        if (!((o.group.bits() >> a) & 1u) && cq[static_cast<std::size_t>(a)] != c[static_cast<std::size_t>(a)]) same = false;
      if (same) m.push_back(q);
    }
    return m;
  };
  auto level_of = [&](const std::vector<int>& m) {
    for (int q : m)
      if (node_of(q) != node_of(m.front())) return link_level::net;
    return link_level::node;
  };
  auto local_of = [&](const std::vector<int>& m) {  // members on the first member's node
    int k = 0;
    for (int q : m) k += node_of(q) == node_of(m.front());
    return k;
  };
  std::map<std::pair<std::int64_t, int>, int> seen;      // (group, index) -> arrived ranks
  struct group_info {
    std::vector<int> simulated;  // its members among the programs (their indices)
    link_level level = link_level::node;
    int local = 1;               // its members on one node
    std::vector<int> crossing;   // its members whose next in the ring is on another node (mesh ranks)
    int leaving = 1;             // the most of them on one node: the ring's steps out of its busiest node
    double copies = 1;           // the groups it stands for (those of ranks left out by symmetry)
  };
  std::map<std::int64_t, group_info> member_cache;  // group -> its ranks and where they are
  std::vector<std::map<std::int64_t, int>> coll_index(static_cast<std::size_t>(n));  // per rank: collectives entered per group
  std::map<std::pair<int, int>, std::vector<double>> mailbox;  // (from, to) -> arrival times, in order
  std::map<std::pair<int, int>, std::size_t> taken;
  auto span = [&](int r, span_kind k, int micro, double t0, double t1) {  // r: a program's index
    trace_event e;
    e.kind = static_cast<std::int32_t>(k);
    e.rank = progs[static_cast<std::size_t>(r)].rank;
    e.stage = progs[static_cast<std::size_t>(r)].coords[1];
    e.replica = progs[static_cast<std::size_t>(r)].coords[0];
    e.micro = micro;
    e.ts_us = t0 * 1e6;
    e.dur_us = (t1 - t0) * 1e6;
    sim.spans.push_back(e);
  };
  // when operation o of rank r may start: after what it depends on (earlier operations, all done)
  auto deps_done = [&](int r, const op& o) {
    double at = 0;
    for (int k : o.deps) at = std::max(at, done[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)]);
    return at;
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < n; ++r) {
      const auto& p = progs[static_cast<std::size_t>(r)];
      const int me = p.rank;  // r: its index in progs
      auto& rt = sim.ranks[static_cast<std::size_t>(r)];
      auto& t = clock[static_cast<std::size_t>(r)];
      while (next[static_cast<std::size_t>(r)] < p.ops.size()) {
        const std::size_t i = next[static_cast<std::size_t>(r)];
        const auto& o = p.ops[i];
        if (o.kind == op_kind::collective) {
          if (o.group_size <= 1) {
            done[static_cast<std::size_t>(r)][i] = two_streams ? deps_done(r, o) : t;
            ++next[static_cast<std::size_t>(r)], progress = true;
            continue;
          }
          const auto key = group_key(me, o);
          const int idx = coll_index[static_cast<std::size_t>(r)][key];
          auto& arrived = seen[{key, idx}];
          // each rank counts itself once: mark arrival by a negative done
          if (done[static_cast<std::size_t>(r)][i] > -1.5) {
            ++arrived;
            done[static_cast<std::size_t>(r)][i] = -2.0;
            arrival[static_cast<std::size_t>(r)] = two_streams ? std::max(comm_clock[static_cast<std::size_t>(r)], deps_done(r, o)) : t;
          }
          auto cached = member_cache.find(key);
          if (cached == member_cache.end()) {
            group_info g;
            const auto all = members(me, o);
            for (int q : all)
              if (index[static_cast<std::size_t>(q)] >= 0) g.simulated.push_back(index[static_cast<std::size_t>(q)]);
            g.level = level_of(all);
            g.local = local_of(all);
            std::map<int, int> out_of;  // node -> ring steps leaving it
            for (std::size_t k = 0; k < all.size(); ++k)
              if (node_of(all[k]) != node_of(all[(k + 1) % all.size()])) {
                g.crossing.push_back(all[k]);
                g.leaving = std::max(g.leaving, ++out_of[node_of(all[k])]);
              }
            for (int a = 0; a < axis_count; ++a)  // a group without an axis replayed by symmetry stands for one per coordinate
              if (((by_symmetry >> a) & 1u) && !((o.group.bits() >> a) & 1u)) g.copies *= mesh.size(static_cast<axis>(a));
            cached = member_cache.emplace(key, std::move(g)).first;
          }
          const auto& m = cached->second.simulated;
          if (arrived < static_cast<int>(m.size())) break;  // wait for the group
          // every member has arrived: its start is the latest arrival
          double start = 0;
          for (int q : m) start = std::max(start, arrival[static_cast<std::size_t>(q)]);
          // the ring runs at the pace of its busiest member (uneven ZeRO pieces, uneven rows);
          // measured points are read at the even split of the same buffer (link_time)
          const double bytes = static_cast<double>(std::max({o.slowest_bytes, o.bytes_sent, o.bytes_received}));
          const double even = o.even_bytes > 0 ? std::min(bytes, static_cast<double>(o.even_bytes)) : bytes;
          const double dur = dev.link_time(cached->second.level, link_of(o), o.group_size, bytes, cached->second.local, even,
                                            cached->second.leaving);
          for (int q : cached->second.crossing) {  // a member left out by symmetry sends as this rank does
            const int iq = index[static_cast<std::size_t>(q)];
            const auto& oq = iq >= 0 ? progs[static_cast<std::size_t>(iq)].ops[next[static_cast<std::size_t>(iq)]] : o;
            sim.inter_node_bytes += static_cast<double>(oq.bytes_sent) * cached->second.copies;
          }
          for (int q : m) {
            const auto& pq = progs[static_cast<std::size_t>(q)];
            const std::size_t iq = next[static_cast<std::size_t>(q)];
            auto& rq = sim.ranks[static_cast<std::size_t>(q)];
            rq.comm_s += dur;
            rq.comm_by_what[detail::what_key(pq.ops[iq].what)] += dur;
            span(q, span_kind::grad_all_reduce, pq.ops[iq].micro, start, start + dur);
            if (two_streams) {
              comm_clock[static_cast<std::size_t>(q)] = start + dur;  // compute goes on; what depends on it waits
            } else {
              rq.wait_s += start - clock[static_cast<std::size_t>(q)];
              clock[static_cast<std::size_t>(q)] = start + dur;
            }
            done[static_cast<std::size_t>(q)][iq] = start + dur;
            ++coll_index[static_cast<std::size_t>(q)][key];
            ++next[static_cast<std::size_t>(q)];
          }
          progress = true;
          continue;
        }
        if (o.kind == op_kind::send) {
          if (two_streams) {  // what it sends may come from a conversion on the communication stream
            const double ready = deps_done(r, o);
            if (ready > t) rt.wait_s += ready - t, t = ready;
          }
          const double dur = dev.link_time(level_of({me, o.peer}), link_kind::p2p, 2, static_cast<double>(o.bytes_sent));
          if (node_of(me) != node_of(o.peer))  // one message for each rank this program stands for
            sim.inter_node_bytes += static_cast<double>(o.bytes_sent) * static_cast<double>(full / n);
          mailbox[{me, o.peer}].push_back(t + dur);
          span(r, span_kind::send_act, o.micro, t, t);
          done[static_cast<std::size_t>(r)][i] = t;
          ++next[static_cast<std::size_t>(r)];
          progress = true;
          continue;
        }
        if (o.kind == op_kind::recv) {
          auto& box = mailbox[{o.peer, me}];
          auto& k = taken[{o.peer, me}];
          if (k >= box.size()) break;  // its send is not simulated yet
          const double at = box[k++];
          if (at > t) rt.wait_s += at - t, span(r, span_kind::recv_act, o.micro, t, at), t = at;
          done[static_cast<std::size_t>(r)][i] = t;
          ++next[static_cast<std::size_t>(r)];
          progress = true;
          continue;
        }
        if (two_streams) {  // compute waits for the collectives (and receives) it depends on
          const double ready = deps_done(r, o);
          if (ready > t) rt.wait_s += ready - t, t = ready;
        }
        const double dur = seconds_of(p, o) *
                           (scale ? (*scale)[static_cast<std::size_t>(r)][i] : 1.0);
        if (computed) (*computed)[static_cast<std::size_t>(r)][i] = {t, t + dur};
        span(r, o.kind == op_kind::weight ? span_kind::weight : o.kind == op_kind::backward ? span_kind::backward
                : o.kind == op_kind::optimizer ? span_kind::optimizer : span_kind::forward,
             o.micro, t, t + dur);
        t += dur;
        rt.compute_s += dur;
        done[static_cast<std::size_t>(r)][i] = t;
        ++next[static_cast<std::size_t>(r)];
        progress = true;
      }
    }
  }
  for (int r = 0; r < n; ++r)
    if (next[static_cast<std::size_t>(r)] < progs[static_cast<std::size_t>(r)].ops.size())
      throw std::logic_error("whale::simulate: rank " + std::to_string(progs[static_cast<std::size_t>(r)].rank) + " cannot go on at operation " +
                             std::to_string(next[static_cast<std::size_t>(r)]) + " (" +
                             progs[static_cast<std::size_t>(r)].ops[next[static_cast<std::size_t>(r)]].what +
                             "): the programs do not match");
  for (int r = 0; r < n; ++r) {
    const double end = std::max(clock[static_cast<std::size_t>(r)], comm_clock[static_cast<std::size_t>(r)]);
    sim.ranks[static_cast<std::size_t>(r)].end_s = end;
    sim.step_s = std::max(sim.step_s, end);
  }
  return sim;
}

}  // namespace detail

/// Every rank's program (`progs[r]` for rank r, from lower(d, mesh, r, ...)) replayed
/// on `dev`; see simulate_pass above for placement and replay by symmetry.
/// Ranks sharing cores (a profile with a `cores` entry, every rank on one node):
/// compute runs slower while more ranks than cores compute at once, and faster
/// than the figures (measured with every rank busy) while fewer do, e.g. in a
/// pipeline's bubble (a waiting rank still takes the profile's waiting share).
/// Which ranks compute when depends on how fast they do, so the replay is
/// repeated, each compute operation slowed by the ranks found computing beside
/// it in the replay before (averaged with its previous factor), until the step
/// moves by under 0.1% (at most 8 replays).
inline step_simulation simulate(const model_desc& d, const std::vector<program>& progs, const device_profile& dev,
                                int ranks_per_node = 0, const std::vector<int>& devices = {}) {
  const int full = progs.empty() ? 0 : progs.front().mesh.size();
  const int per_node = ranks_per_node > 0 ? ranks_per_node : dev.ranks_per_node > 0 ? dev.ranks_per_node : full;
  if (dev.cores <= 0 || per_node < full) return detail::simulate_pass(d, progs, dev, ranks_per_node, devices, nullptr, nullptr);
  const std::size_t n = progs.size();
  detail::per_op scale(n);
  detail::op_spans spans(n);
  for (std::size_t r = 0; r < n; ++r) {
    scale[r].assign(progs[r].ops.size(), dev.sharing_slowdown(static_cast<double>(full), static_cast<double>(full)));
    spans[r].assign(progs[r].ops.size(), {0.0, 0.0});
  }
  auto sim = detail::simulate_pass(d, progs, dev, ranks_per_node, devices, &scale, &spans);
  for (int pass = 1; pass < 8; ++pass) {
    const detail::busy_profile busy(spans, static_cast<double>(full) / static_cast<double>(n));
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t i = 0; i < spans[r].size(); ++i)
        if (spans[r][i][1] > spans[r][i][0])
          scale[r][i] = 0.5 * (scale[r][i] + dev.sharing_slowdown(busy.mean(spans[r][i][0], spans[r][i][1]),
                                                                  static_cast<double>(full)));
    const double before = sim.step_s;
    sim = detail::simulate_pass(d, progs, dev, ranks_per_node, devices, &scale, &spans);
    if (std::abs(sim.step_s - before) <= 1e-3 * before) break;
  }
  return sim;
}

}  // namespace whale
