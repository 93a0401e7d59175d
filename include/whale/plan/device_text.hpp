// A device profile's text format (plan/device.hpp lists its lines): writing
// and reading it, and one profile from several runs of the same measurement.
#pragma once

#include <algorithm>
#include <cmath>
#include <fstream>
#include <istream>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/detail/parse.hpp"
#include "whale/plan/device.hpp"

namespace whale {

/// Write `p` in the text format (what parse() reads back).
inline std::ostream& operator<<(std::ostream& os, const device_profile& p) {
  os << "# whale device profile\ndevice " << p.name << "\n";
  for (const auto& g : p.gemm)
    os << "gemm " << g.m << ' ' << g.n << ' ' << g.k << ' ' << g.ta << ' ' << g.tb << ' ' << g.gflops << "\n";
  for (const auto& t : p.thin) {
    os << "thin " << static_cast<long long>(t.rows) << ' ' << t.factor;
    if (t.width != thin_point::default_width) os << ' ' << static_cast<long long>(t.width);
    os << "\n";
  }
  for (const auto& a : p.attention)
    os << "attention " << static_cast<long long>(a.seq) << ' ' << static_cast<long long>(a.head_dim) << ' ' << a.gflops << "\n";
  for (const auto& b : p.backward) os << "backward " << static_cast<long long>(b.narrow) << ' ' << b.factor << "\n";
  os << "bandwidth " << p.bandwidth_bps / 1e9 << "\n";
  if (p.ranks_per_node) os << "node " << p.ranks_per_node << "\n";
  if (p.streams != 1) os << "streams " << p.streams << "\n";
  if (p.cores > 0) os << "cores " << p.cores << ' ' << p.cores_measured_ranks << ' ' << p.waiting_share << "\n";
  if (!p.kernel_precision.empty()) os << "kernels " << p.kernel_precision << ' ' << p.launch_s * 1e6 << "\n";
  if (p.peak_flops > 0) os << "peak " << p.peak_flops / 1e12 << "\n";
  for (int l = 0; l < 2; ++l)
    for (int k = 0; k < link_kinds; ++k) {
      const auto& f = p.links[static_cast<std::size_t>(l)][static_cast<std::size_t>(k)];
      if (f.ranks)
        os << "link " << link_level_name(static_cast<link_level>(l)) << ' ' << link_kind_name(static_cast<link_kind>(k)) << ' '
           << f.ranks << ' ' << f.alpha_s * 1e6 << ' ' << f.beta_bps / 1e9 << "\n";
      for (const auto& [b, t] : f.points)
        os << "point " << link_level_name(static_cast<link_level>(l)) << ' ' << link_kind_name(static_cast<link_kind>(k)) << ' '
           << static_cast<long long>(b) << ' ' << t * 1e6 << "\n";
    }
  return os;
}

/// Read the text format; every error names the file, the line and what is wrong.
inline device_profile device_profile::parse(std::istream& in, const std::string& origin) {
  device_profile p;
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    if (const auto h = line.find('#'); h != std::string::npos) line.resize(h);
    std::istringstream ss(line);
    std::vector<std::string> w;
    for (std::string t; ss >> t;) w.push_back(t);
    if (w.empty()) continue;
    const std::string at = origin + ":" + std::to_string(no);
    auto need = [&](std::size_t n, const char* form) {
      if (w.size() != n) throw std::invalid_argument(at + ": '" + w[0] + "' takes " + form);
    };
    auto num = [&](std::size_t i, const char* what, double lo, double hi, bool open) {
      return detail::parse_double(w[i], at + ": " + what, lo, hi, open);
    };
    if (w[0] == "device") {
      need(2, "a name");
      p.name = w[1];
    } else if (w[0] == "gemm") {
      need(7, "M N K TA TB GFLOPS");
      gemm_point g;
      g.m = detail::parse_int(w[1], at + ": M", 1, 1 << 30);
      g.n = detail::parse_int(w[2], at + ": N", 1, 1 << 30);
      g.k = detail::parse_int(w[3], at + ": K", 1, 1 << 30);
      g.ta = detail::parse_int(w[4], at + ": TA", 0, 1) != 0;
      g.tb = detail::parse_int(w[5], at + ": TB", 0, 1) != 0;
      g.gflops = num(6, "GFLOPS", 0, 1e9, true);
      p.gemm.push_back(g);
    } else if (w[0] == "thin") {
      if (w.size() != 3 && w.size() != 4)
        throw std::invalid_argument(at + ": 'thin' takes ROWS FACTOR [WIDTH] (products of ROWS rows through a layer of "
                                         "WIDTH = in x out features run at FACTOR of the size curve's rate)");
      thin_point t;
      t.rows = static_cast<double>(detail::parse_int(w[1], at + ": ROWS", 1, 1 << 30));
      t.factor = num(2, "FACTOR", 0, 2, true);
      if (w.size() == 4) t.width = static_cast<double>(detail::parse_int(w[3], at + ": WIDTH", 1, std::int64_t{1} << 50));
      if (std::any_of(p.thin.begin(), p.thin.end(), [&](const auto& o) { return o.rows == t.rows && o.width == t.width; }))
        throw std::invalid_argument(at + ": a second 'thin' line for " + w[1] + " rows through a layer of width " +
                                    std::to_string(static_cast<long long>(t.width)));
      p.thin.push_back(t);
    } else if (w[0] == "attention") {
      need(4, "SEQ HEAD_DIM GFLOPS (the rate of attention's per-head products at sequence SEQ and head width HEAD_DIM)");
      attention_point a;
      a.seq = static_cast<double>(detail::parse_int(w[1], at + ": SEQ", 1, 1 << 30));
      a.head_dim = static_cast<double>(detail::parse_int(w[2], at + ": HEAD_DIM", 1, 1 << 30));
      a.gflops = num(3, "GFLOPS", 0, 1e9, true);
      if (std::any_of(p.attention.begin(), p.attention.end(), [&](const auto& o) { return o.seq == a.seq && o.head_dim == a.head_dim; }))
        throw std::invalid_argument(at + ": a second 'attention' line for sequence " + w[1] + " and head width " + w[2]);
      p.attention.push_back(a);
    } else if (w[0] == "backward") {
      need(3, "NARROW FACTOR (a layer whose narrower side is NARROW features runs its backward products at FACTOR "
              "of its forward product's rate)");
      backward_point b;
      b.narrow = static_cast<double>(detail::parse_int(w[1], at + ": NARROW", 1, 1 << 30));
      b.factor = num(2, "FACTOR", 0, 2, true);
      if (std::any_of(p.backward.begin(), p.backward.end(), [&](const auto& o) { return o.narrow == b.narrow; }))
        throw std::invalid_argument(at + ": a second 'backward' line for layers " + w[1] + " features wide");
      p.backward.push_back(b);
    } else if (w[0] == "bandwidth") {
      need(2, "GBPS");
      p.bandwidth_bps = num(1, "bandwidth", 0, 1e6, true) * 1e9;
    } else if (w[0] == "node") {
      need(2, "RANKS (ranks per node)");
      p.ranks_per_node = static_cast<int>(detail::parse_int(w[1], at + ": RANKS", 1, 1 << 20));
    } else if (w[0] == "streams") {
      need(2, "1 or 2 (2: collectives on a stream of their own, beside compute)");
      p.streams = static_cast<int>(detail::parse_int(w[1], at + ": streams", 1, 2));
    } else if (w[0] == "cores") {
      need(4, "CORES RANKS WAITING (the cores a node's ranks share, how many ranks measured the rates at once, "
              "and the share of a core a waiting rank takes, 0 to 1)");
      p.cores = static_cast<int>(detail::parse_int(w[1], at + ": CORES", 1, 1 << 20));
      p.cores_measured_ranks = static_cast<int>(detail::parse_int(w[2], at + ": RANKS", 1, 1 << 20));
      p.waiting_share = num(3, "WAITING", 0, 1, false);
    } else if (w[0] == "kernels") {
      need(3, "bf16|fp32 LAUNCH_US (compute priced from the layers' GPU kernels in that precision, LAUNCH_US a launch)");
      if (w[1] != "bf16" && w[1] != "fp32") throw std::invalid_argument(at + ": kernels precision '" + w[1] + "' (have bf16, fp32)");
      p.kernel_precision = w[1];
      p.launch_s = num(2, "LAUNCH_US", 0, 1e6, false) * 1e-6;
    } else if (w[0] == "peak") {
      need(2, "TFLOPS (the device's dense peak)");
      p.peak_flops = num(1, "TFLOPS", 0, 1e9, true) * 1e12;
    } else if (w[0] == "link" || w[0] == "point") {
      if (w[0] == "link") need(6, "LEVEL KIND RANKS ALPHA_US BETA_GBPS");
      else need(5, "LEVEL KIND BYTES MICROSECONDS");
      int level = w[1] == "node" ? 0 : w[1] == "net" ? 1 : -1;
      if (level < 0) throw std::invalid_argument(at + ": link level '" + w[1] + "' (have node, net)");
      int kind = -1;
      for (int k = 0; k < link_kinds; ++k)
        if (w[2] == link_kind_name(static_cast<link_kind>(k))) kind = k;
      if (kind < 0) throw std::invalid_argument(at + ": link kind '" + w[2] + "' (have all_reduce, all_gather, reduce_scatter, broadcast, p2p)");
      auto& f = p.links[static_cast<std::size_t>(level)][static_cast<std::size_t>(kind)];
      if (w[0] == "point") {
        if (f.ranks == 0)
          throw std::invalid_argument(at + ": a point of " + w[1] + " " + w[2] + " before its 'link' line (the link gives the group size)");
        const double b = num(3, "BYTES", 0, 1e18, true), t = num(4, "MICROSECONDS", 0, 1e12, true) * 1e-6;
        if (!f.points.empty() && !(b > f.points.back().first && t >= f.points.back().second))
          throw std::invalid_argument(at + ": the points of " + w[1] + " " + w[2] + " must grow in bytes, and not shrink in time");
        f.points.push_back({b, t});
        continue;
      }
      f.ranks = static_cast<int>(detail::parse_int(w[3], at + ": RANKS", 2, 1 << 20));
      f.alpha_s = num(4, "ALPHA_US", 0, 1e9, false) * 1e-6;
      f.beta_bps = num(5, "BETA_GBPS", 0, 1e6, true) * 1e9;
    } else {
      throw std::invalid_argument(at + ": unknown entry '" + w[0] + "' (have device, gemm, thin, attention, backward, bandwidth, node, streams, cores, link, point, kernels, peak)");
    }
  }
  if (p.gemm.empty()) throw std::invalid_argument(origin + ": no 'gemm' line: a profile needs at least one GEMM rate");
  if (!(p.bandwidth_bps > 0)) throw std::invalid_argument(origin + ": no 'bandwidth' line");
  // stable: the transposes of one shape keep their order, so that writing a parsed profile and reading it back is the same
  std::stable_sort(p.gemm.begin(), p.gemm.end(), [](const gemm_point& a, const gemm_point& b) { return a.flops() < b.flops(); });
  p.settle_gemm();
  return p;
}
inline device_profile device_profile::load(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::invalid_argument("whale::device_profile: cannot read '" + path + "'");
  return parse(f, path);
}

/// One profile from several runs of the same measurement on one machine (`scripts/profile
/// --runs N`): every figure the median of the runs' (each GEMM shape's, thin factor,
/// attention rate, backward factor, the bandwidth, the cores' waiting share, each link's
/// alpha, beta and measured points). A run's figures move together with the machine's
/// slow and fast spells (one run here read GEMM rates 12-17% above the next two's): the
/// median of runs minutes apart is what a training job minutes later meets. The runs must
/// list the same entries in the same order (the same program on the same ranks);
/// otherwise std::invalid_argument, naming the first that differs.
inline device_profile median_profile(const std::vector<device_profile>& runs) {
  if (runs.empty()) throw std::invalid_argument("whale::median_profile: no runs");
  const auto& first = runs.front();
  auto differ = [&](const std::string& what) {
    return std::invalid_argument("whale::median_profile: the runs differ in " + what + " (not runs of one measurement)");
  };
  // the median over the runs of field(run, i) for entry i of a list whose entries match by key
  auto each = [&](auto list, const char* what, auto key, auto field) {
    for (const auto& r : runs)
      if ((r.*list).size() != (first.*list).size()) throw differ(std::string("how many '") + what + "' lines they have");
    auto out = first.*list;
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::vector<double> v;
      for (const auto& r : runs) {
        if (key((r.*list)[i]) != key((first.*list)[i])) throw differ(std::string("'") + what + "' line " + std::to_string(i + 1));
        v.push_back(field((r.*list)[i]));
      }
      field(out[i]) = detail::median_of(std::move(v));
    }
    return out;
  };
  device_profile m = first;
  m.gemm = each(&device_profile::gemm, "gemm", [](const gemm_point& g) { return std::make_tuple(g.m, g.n, g.k, g.ta, g.tb); },
                [](auto& g) -> auto& { return g.gflops; });
  m.thin = each(&device_profile::thin, "thin", [](const thin_point& t) { return std::make_pair(t.rows, t.width); },
                [](auto& t) -> auto& { return t.factor; });
  m.attention = each(&device_profile::attention, "attention", [](const attention_point& a) { return std::make_pair(a.seq, a.head_dim); },
                     [](auto& a) -> auto& { return a.gflops; });
  m.backward = each(&device_profile::backward, "backward", [](const backward_point& b) { return b.narrow; },
                    [](auto& b) -> auto& { return b.factor; });
  std::vector<double> bw, share;
  for (const auto& r : runs) {
    if (r.ranks_per_node != first.ranks_per_node || r.streams != first.streams || r.cores != first.cores ||
        r.cores_measured_ranks != first.cores_measured_ranks)
      throw differ("their 'node', 'streams' or 'cores' lines");
    if (r.kernel_precision != first.kernel_precision || r.launch_s != first.launch_s || r.peak_flops != first.peak_flops)
      throw differ("their 'kernels' or 'peak' lines");
    bw.push_back(r.bandwidth_bps);
    share.push_back(r.waiting_share);
  }
  m.bandwidth_bps = detail::median_of(bw);
  m.waiting_share = detail::median_of(share);
  for (std::size_t l = 0; l < m.links.size(); ++l)
    for (std::size_t k = 0; k < m.links[l].size(); ++k) {
      auto& f = m.links[l][k];
      std::vector<double> alpha, beta;
      for (const auto& r : runs) {
        const auto& g = r.links[l][k];
        if (g.ranks != f.ranks || g.points.size() != f.points.size()) throw differ("their 'link' lines");
        alpha.push_back(g.alpha_s);
        beta.push_back(g.beta_bps);
      }
      f.alpha_s = detail::median_of(alpha);
      f.beta_bps = detail::median_of(beta);
      // each run's times rise with the bytes, and so does their median at each size
      for (std::size_t i = 0; i < f.points.size(); ++i) {
        std::vector<double> t;
        for (const auto& r : runs) {
          if (r.links[l][k].points[i].first != f.points[i].first) throw differ("their 'point' lines' sizes");
          t.push_back(r.links[l][k].points[i].second);
        }
        f.points[i].second = detail::median_of(std::move(t));
      }
    }
  m.settle_gemm();
  return m;
}

}  // namespace whale
