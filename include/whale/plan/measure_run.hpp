// The rest of measuring this machine (plan/measure.hpp holds the compute
// parts): the collectives' latency and bandwidth, the share of a core a
// waiting rank takes, and measure_profile, which runs a whole measurement and
// gives every rank the same profile. No files: whale_profile writes one,
// auto_plan caches one (runtime/profile_cache.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/comm/detail/cost.hpp"
#include "whale/plan/device.hpp"
#include "whale/plan/measure.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// What measure_profile measures.
struct measure_options {
  /// false: the full measurement (whale_profile, scripts/profile; about a minute);
  /// true: the quick one (a few seconds), every entry the planner reads, each
  /// coarser (detail::measure_plan::quick says how).
  bool quick = false;
  /// The profile's name; "-<ranks>-ranks" is appended.
  std::string name = "this-machine";
  /// The whole measurement this many times in turns, each figure the median of
  /// the runs' (median_profile): one run's figures move with the machine's spells
  /// (here one run's GEMM rates read 12-17% above the next two's). 1 to 9.
  int runs = 1;
};

/// `p` in the text format (what device_profile::parse reads back).
inline std::string profile_text(const device_profile& p) {
  std::ostringstream s;
  s << p;
  return s.str();
}

namespace detail {

/// Least squares t = alpha + bytes / beta over (bytes, seconds) points, each
/// weighted by 1/t^2 (relative error), so that small messages fix alpha; the
/// points are kept too (times made non-decreasing), and the simulator follows them.
inline link_fit fit_link(const std::vector<std::pair<double, double>>& pts, int ranks) {
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (auto [x, y] : pts) {
    const double w = 1.0 / (y * y);
    sw += w, sx += w * x, sy += w * y, sxx += w * x * x, sxy += w * x * y;
  }
  const double slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx);
  link_fit f;
  f.ranks = ranks;
  f.beta_bps = slope > 0 ? 1.0 / slope : 1e12;
  f.alpha_s = std::max(0.0, (sy - slope * sx) / sw);
  for (auto [x, y] : pts) f.points.push_back({x, f.points.empty() ? y : std::max(y, f.points.back().second)});
  return f;
}

/// More ranks than cores: how much of a core a rank waiting in a receive still takes (MPI
/// polls while it waits). Rank 0 multiplies while the others wait for its message; against
/// every rank multiplying at once, sharing_slowdown (plan/device.hpp) gives the share.
template <Communicator C> void measure_sharing(C& w, const measure_plan& mp, device_profile& prof) {
  const int p = w.size();
  if (prof.cores <= 0 || p <= prof.cores) return;
  const index_t m = mp.share_side;
  tensor<float> a({m * m}), b({m * m}), c({m * m});
  for (auto& x : a) x = 0.5f;
  for (auto& x : b) x = 0.25f;
  const int times = std::max(1, static_cast<int>(mp.share_s * 30e9 / (2.0 * m * m * m)));
  auto product = [&] { gemm_n(false, false, m, m, m, a.data(), b.data(), c.data(), times); };
  const double all = timed(w, mp, mp.share_reps, product);
  int token = 0;
  const double alone = timed(w, mp, mp.share_reps, [&] {
    if (w.rank() == 0) {
      product();
      for (int q = 1; q < p; ++q) send(w, cview<int>(&token, {1}), q, 9);
    } else {
      recv(w, view<int>(&token, {1}), 0, 9);
    }
  });
  const double cores = prof.cores, ranks = p;
  const double load = alone / all * std::max(1.0, ranks / cores) * cores;  // 1 + share x (R - 1), where it is above C
  prof.waiting_share = std::clamp((load - 1.0) / (ranks - 1.0), 0.0, 1.0);
}

/// Links inside this node (on 2 or more ranks): all-reduce, all-gather and
/// reduce-scatter over every rank, and messages from rank 0 to rank 1 and back
/// (half the round trip), at the plan's sizes (the times are kept as points, and
/// they jump where the buffers leave the caches; the smallest always, the others
/// where their buffers fit the plan's cap), each fitted (fit_link). A
/// broadcast is not measured: it is taken as an all-gather.
template <Communicator C> void measure_links(C& w, const measure_plan& mp, device_profile& prof) {
  const int p = w.size();
  if (p < 2) return;
  std::vector<index_t> sizes;
  for (index_t n : mp.link_floats)
    if (sizes.empty() || mp.link_buffer_floats == 0 || n * p <= mp.link_buffer_floats) sizes.push_back(n);
  tensor<float> buf({sizes.back() * p}), out_buf({sizes.back() * p});
  for (auto& v : buf) v = 1.f;
  std::vector<std::pair<double, double>> ar, ag, rs, pp;
  const int reps = mp.link_reps;
  for (index_t n : sizes) {
    const std::int64_t bytes = 4 * n;
    ar.push_back({static_cast<double>(all_reduce_traffic(bytes, p).sent),
                  timed(w, mp, reps, [&] { all_reduce(w, view<float>(buf.data(), {n})); })});
    ag.push_back({static_cast<double>(all_gather_traffic(bytes, p).sent),
                  timed(w, mp, reps, [&] { all_gather(w, cview<float>(buf.data(), {n}), view<float>(out_buf.data(), {n * p})); })});
    rs.push_back({static_cast<double>(reduce_scatter_traffic(bytes, p).sent),
                  timed(w, mp, reps, [&] { reduce_scatter(w, cview<float>(buf.data(), {n * p}), view<float>(out_buf.data(), {n})); })});
    const double rt = timed(w, mp, reps, [&] {
      if (w.rank() == 0) {
        send(w, cview<float>(buf.data(), {n}), 1, 7);
        recv(w, view<float>(out_buf.data(), {n}), 1, 8);
      } else if (w.rank() == 1) {
        recv(w, view<float>(out_buf.data(), {n}), 0, 7);
        send(w, cview<float>(buf.data(), {n}), 0, 8);
      }
    });
    pp.push_back({static_cast<double>(bytes), rt / 2});
  }
  auto& node = prof.links[static_cast<std::size_t>(link_level::node)];
  node[static_cast<std::size_t>(link_kind::all_reduce)] = fit_link(ar, p);
  node[static_cast<std::size_t>(link_kind::all_gather)] = fit_link(ag, p);
  node[static_cast<std::size_t>(link_kind::reduce_scatter)] = fit_link(rs, p);
  node[static_cast<std::size_t>(link_kind::broadcast)] = fit_link(ag, p);  // (not measured: taken as an all-gather)
  node[static_cast<std::size_t>(link_kind::p2p)] = fit_link(pp, 2);
}

/// One whole measurement on every rank of `w` at once.
template <Communicator C> device_profile measure_once(C& w, const measure_plan& mp, const std::string& name) {
  device_profile prof;
  prof.name = name + "-" + std::to_string(w.size()) + "-ranks";
  // the ranks measure at once on this node's cores: the simulator then knows that
  // a rank computing while others wait runs faster than these figures
  if (const unsigned c = std::thread::hardware_concurrency(); c > 0)
    prof.cores = static_cast<int>(c), prof.cores_measured_ranks = w.size();
  measure_gemm(w, mp, prof);
  measure_thin(w, mp, prof);
  {
    cache_flush flush(w.size(), mp.flush_cap);
    measure_attention(w, mp, flush, prof);
    measure_backward(w, mp, flush, prof);
  }
  measure_sharing(w, mp, prof);
  measure_bandwidth(w, mp, prof);
  measure_links(w, mp, prof);
  return prof;
}

/// Rank 0's profile on every rank: its text broadcast and parsed (collective). The
/// figures are already the slowest rank's (each phase ends at a barrier on every rank,
/// and the medians are agreed with max and min); the text makes them the same to the
/// bit, and the same as a file written from it reads back.
template <Communicator C> device_profile agree_profile(C& w, const device_profile& mine) {
  std::string text = w.rank() == 0 ? profile_text(mine) : std::string();
  index_t n = static_cast<index_t>(text.size());
  broadcast(w, view<index_t>(&n, {1}), 0);
  text.resize(static_cast<std::size_t>(n));
  broadcast(w, view<std::uint8_t>(reinterpret_cast<std::uint8_t*>(text.data()), {n}), 0);
  std::istringstream in(text);
  return device_profile::parse(in, "the profile rank 0 measured");
}

}  // namespace detail

/// Measures this machine on every rank of `w` at once (collective) and returns the
/// same profile on every rank: GEMM rates by size and transpose, thin products'
/// factors, attention's per-head products, a layer's backward against its forward,
/// elementwise bandwidth, the cores the ranks share (and, with more ranks than
/// cores, the share of a core a waiting rank takes), and on 2 or more ranks the
/// collectives and messages inside the node. `o.quick`: in seconds, coarser
/// (detail::measure_plan::quick). Throws std::invalid_argument for `o.runs`
/// outside 1 to 9, on every rank, before anything is measured.
template <Communicator C> device_profile measure_profile(C& w, const measure_options& o = {}) {
  if (o.runs < 1 || o.runs > 9)
    throw std::invalid_argument("whale::measure_profile: runs " + std::to_string(o.runs) + " is out of range; allowed 1 to 9");
  const auto mp = o.quick ? detail::measure_plan::quick() : detail::measure_plan::full();
  std::vector<device_profile> all;
  for (int r = 0; r < o.runs; ++r) all.push_back(detail::measure_once(w, mp, o.name));
  return detail::agree_profile(w, median_profile(all));
}

}  // namespace whale
