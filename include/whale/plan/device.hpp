// A device profile: what one rank's device does per second, measured once
// per machine (scripts/profile) or written from a datasheet. GEMM rates at a
// few shapes (by size, and by how thin the product is), attention's per-head
// products, a layer's backward products against its forward, elementwise
// bandwidth, and the α–β parameters (latency, bandwidth) of each collective
// and of point-to-point messages per link level (inside a node, between
// nodes). Plain data, a text format, the median of several runs, and the time
// of an operation; no measurement here.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "whale/detail/parse.hpp"
#include "whale/plan/program.hpp"

namespace whale {

namespace detail {
/// The median of `v` (the mean of the middle two for an even count); `v` not empty.
inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}
}  // namespace detail

/// Where a group's ranks are: all on one node, or spread over nodes.
enum class link_level : std::uint8_t { node, net };
/// The communication a link entry describes (collectives of program.hpp, and messages).
enum class link_kind : std::uint8_t { all_reduce, all_gather, reduce_scatter, broadcast, p2p };
inline constexpr int link_kinds = 5;

inline const char* link_kind_name(link_kind k) {
  constexpr const char* n[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"};
  return n[static_cast<int>(k)];
}
inline const char* link_level_name(link_level l) { return l == link_level::node ? "node" : "net"; }

/// One measured GEMM: C(M, N) = op(A) op(B) with K the inner size, at `gflops`.
struct gemm_point {
  index_t m = 0, n = 0, k = 0;
  bool ta = false, tb = false;
  double gflops = 0;
  double flops() const noexcept { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
  index_t thinnest() const noexcept { return std::min({m, n, k}); }
  /// Thin: the longest side more than 8 times the shortest (a small batch's
  /// product, e.g. 64 rows through a 4096-wide layer); the rest are the size curve.
  bool thin() const noexcept { return std::max({m, n, k}) > 8 * thinnest(); }
};

/// A thin product's rate over a square one's of the same FLOPs (timed in
/// turns): `rows` through a layer of `width` = in × out features.
struct thin_point {
  /// The layer the first thin figures were measured on (1024 × 4096), and what
  /// a `thin` line without a width means.
  static constexpr double default_width = 1024.0 * 4096.0;
  double rows = 0, factor = 1, width = default_width;
};

/// Attention's per-head products (Q Kᵀ and P V forward, four more backward: T × T × hd
/// and T × hd × T, as causal_self_attention runs them, strided in its QKV buffer, on
/// operands a training step has left out of the caches) at sequence `seq` and head
/// width `head_dim`, at `gflops`.
struct attention_point {
  double seq = 0, head_dim = 0, gflops = 0;
};

/// A linear layer's backward products (d-input and d-weights, on operands a step has
/// left out of the caches) over its forward product's rate (timed in turns), for a
/// layer whose narrower side (min(in, out) features) is `narrow`.
struct backward_point {
  double narrow = 0, factor = 1;
};

/// t(bytes) = alpha + bytes / beta, `bytes` being what one rank sends (the
/// ring model of comm_stats), for groups of `ranks`. Where the measured times
/// are kept (`points`, sorted by bytes), t follows them instead: a CPU node's
/// collectives are no straight line (here an all-reduce of 4 ranks sent 25 MB
/// at 3.2 GB/s and 50 MB at 1 GB/s, once the buffers left the caches).
struct link_fit {
  double alpha_s = 0;       ///< latency, seconds
  double beta_bps = 0;      ///< bytes per second sent by one rank
  int ranks = 0;            ///< the group size it was measured on (0: not measured)
  std::vector<std::pair<double, double>> points;  ///< measured (bytes, seconds), if kept

  /// Seconds to send `bytes` per rank in a group of the measured size: between
  /// points linear, below the first from (0, alpha), beyond the last along the
  /// last two points' slope (never faster than beta); without points alpha + bytes/beta.
  double seconds(double bytes) const {
    if (points.empty()) return alpha_s + bytes / beta_bps;
    auto at = [](const std::pair<double, double>& a, const std::pair<double, double>& b, double x) {
      return b.first > a.first ? a.second + (b.second - a.second) * (x - a.first) / (b.first - a.first) : b.second;
    };
    if (bytes <= points.front().first) return at({0.0, std::min(alpha_s, points.front().second)}, points.front(), bytes);
    for (std::size_t i = 1; i < points.size(); ++i)
      if (bytes <= points[i].first) return at(points[i - 1], points[i], bytes);
    const auto& last = points.back();
    double per_byte = 1.0 / beta_bps;
    if (points.size() > 1) {
      const auto& prev = points[points.size() - 2];
      if (last.first > prev.first) per_byte = std::max(per_byte, (last.second - prev.second) / (last.first - prev.first));
    }
    return last.second + (bytes - last.first) * per_byte;
  }
};

/// What one rank's device and links do per second.
struct device_profile {
  std::string name = "unnamed";
  std::vector<gemm_point> gemm;  ///< as measured, sorted by size when read
  /// Thin factors measured as such (`thin ROWS FACTOR [WIDTH]` lines: a thin
  /// product's rate over a square one's of the same FLOPs, timed in turns), by
  /// rows and layer width. When present they are the factors; else they come
  /// from the thin `gemm` shapes.
  std::vector<thin_point> thin;
  /// Attention's per-head products measured as such (`attention SEQ HEAD_DIM GFLOPS`
  /// lines); none: they are priced with the layer's other GEMMs.
  std::vector<attention_point> attention;
  /// Backward factors measured as such (`backward NARROW FACTOR` lines); none: 1.
  std::vector<backward_point> backward;
  double bandwidth_bps = 0;      ///< elementwise: bytes read plus written per second
  int ranks_per_node = 0;        ///< devices (ranks) per node of the cluster it describes; 0: one node
  /// 1: a collective blocks its rank until it ends (the CPU runtime); 2: collectives
  /// run in order on a communication stream of their own and compute waits only
  /// for the operations it depends on (a GPU with NCCL, as DDP and Horovod run).
  int streams = 1;
  /// Ranks sharing cores (a CPU node running more ranks than it has cores): the
  /// node's ranks share `cores` cores, and the GEMM and bandwidth figures were
  /// measured with `cores_measured_ranks` ranks computing at once; a rank waiting
  /// in a collective or a receive still takes `waiting_share` of a core (MPI
  /// polls while it waits). 0 cores: every rank has a device of its own (GPUs,
  /// and CPU nodes with a core per rank).
  int cores = 0;
  int cores_measured_ranks = 0;
  double waiting_share = 0;
  /// How much slower compute runs while `computing` of the node's `ranks` ranks
  /// compute (the others wait) than the figures say; 1 without a `cores` entry.
  double sharing_slowdown(double computing, double ranks) const {
    if (cores <= 0) return 1.0;
    const double c = static_cast<double>(cores);
    const double load = computing + waiting_share * std::max(0.0, ranks - computing);
    return std::max(1.0, load / c) / std::max(1.0, static_cast<double>(cores_measured_ranks) / c);
  }
  std::array<std::array<link_fit, link_kinds>, 2> links{};  ///< [level][kind]
  /// `kernels PRECISION LAUNCH_US`: compute priced from each layer's GPU kernels
  /// (its ledger on the guarded backend, plan/probe.hpp) in "bf16" or "fp32",
  /// plus LAUNCH_US per launch; empty: from the layers' analytic costs.
  std::string kernel_precision;
  double launch_s = 0;
  /// Whether this profile prices bf16 mixed precision (`kernels bf16`): its
  /// kernels in bf16, and the fp32 master weights and bf16's refusals in the
  /// plans it prices. The one reader of `kernel_precision` for that question.
  bool prices_bf16() const noexcept { return kernel_precision == "bf16"; }
  /// `peak TFLOPS`: the device's dense peak for model FLOPs utilisation (0: none given).
  double peak_flops = 0;

  /// GEMM rate (FLOP/s) of a product of `flops` FLOPs whose rows (the batch
  /// side: M of the forward and input-gradient products, K of the weight
  /// gradient's) are `rows`; 0: not known, taken as not thin. `width`: the
  /// layer's weight matrix (in × out); 0: flops / (2 rows).
  /// - The size curve: the shapes that are not thin, each at the median of its
  ///   measured transposes, interpolated in log(FLOPs); beyond the ends, the end rates.
  /// - The thin factor: the `thin` lines where there are any, else a thin shape's
  ///   rate over the curve's at its size, the median per thinnest side; for
  ///   `rows`, interpolated in log(rows) between the sides measured, the
  ///   smallest's below them, and above the largest rising to 1 at 8 times it
  ///   (where a shape is no longer thin). 1 without either. Thin lines of
  ///   several widths: the factor at `rows` of each width, interpolated in
  ///   log(width) between the widths measured, the nearest end's beyond them.
  /// (An OpenBLAS core here ran 64-row products at 55-70% of its square-shape rate.)
  double gemm_rate(double flops, double rows = 0, double width = 0) const {
    if (gemm.empty()) throw std::logic_error("whale::device_profile '" + name + "': no GEMM rates");
    if (size_curve_.empty()) settle_gemm();
    return size_rate(flops) * thin_factor(rows, width > 0 ? width : rows > 0 ? flops / (2 * rows) : 0.0);
  }
  /// Derives the size curve and the thin factors from `gemm` (parse does; call it
  /// after changing `gemm` by hand).
  void settle_gemm() const {
    size_curve_.clear();
    thin_factors_.clear();
    // one point per shape not thin (only thin ones measured: all of them): (FLOPs, the
    // median rate of its transposes), by size
    const bool any_square = std::any_of(gemm.begin(), gemm.end(), [](const gemm_point& g) { return !g.thin(); });
    std::vector<gemm_point> shapes;
    for (const auto& g : gemm)
      if ((!g.thin() || !any_square) &&
          std::none_of(shapes.begin(), shapes.end(), [&](const gemm_point& s) { return s.m == g.m && s.n == g.n && s.k == g.k; }))
        shapes.push_back(g);
    for (const auto& s : shapes) {
      std::vector<double> r;
      for (const auto& g : gemm)
        if (g.m == s.m && g.n == s.n && g.k == s.k) r.push_back(g.gflops * 1e9);
      size_curve_.push_back({s.flops(), detail::median_of(r)});
    }
    std::sort(size_curve_.begin(), size_curve_.end());
    // A product's rate does not fall as it grows: a measured dip (noise, or one shape's
    // cache luck) is pooled with its neighbours (isotonic regression, pool adjacent
    // violators), so that no plan looks faster for cutting its products smaller.
    std::vector<std::pair<double, std::size_t>> pools;  // (mean rate, points)
    for (const auto& [f, r] : size_curve_) {
      pools.push_back({r, 1});
      while (pools.size() > 1 && pools[pools.size() - 2].first > pools.back().first) {
        const auto b = pools.back();
        pools.pop_back();
        auto& a = pools.back();
        a.first = (a.first * static_cast<double>(a.second) + b.first * static_cast<double>(b.second)) /
                  static_cast<double>(a.second + b.second);
        a.second += b.second;
      }
    }
    std::size_t at = 0;
    for (const auto& [rate, count] : pools)
      for (std::size_t k = 0; k < count; ++k) size_curve_[at++].second = rate;
    if (!thin.empty()) {
      for (const auto& t : thin) {
        auto c = std::find_if(thin_factors_.begin(), thin_factors_.end(), [&](const auto& w) { return w.first == t.width; });
        if (c == thin_factors_.end()) c = thin_factors_.insert(thin_factors_.end(), {t.width, {}});
        c->second.push_back({t.rows, t.factor});
      }
      std::sort(thin_factors_.begin(), thin_factors_.end());
      for (auto& c : thin_factors_) std::sort(c.second.begin(), c.second.end());
    } else if (any_square) {
      thin_factors_.push_back({thin_point::default_width, {}});
      std::vector<double> sides;
      for (const auto& g : gemm)
        if (g.thin() && std::find(sides.begin(), sides.end(), static_cast<double>(g.thinnest())) == sides.end())
          sides.push_back(static_cast<double>(g.thinnest()));
      std::sort(sides.begin(), sides.end());
      for (double t : sides) {
        std::vector<double> f;
        for (const auto& g : gemm)
          if (g.thin() && static_cast<double>(g.thinnest()) == t) f.push_back(g.gflops * 1e9 / size_rate(g.flops()));
        thin_factors_.back().second.push_back({t, detail::median_of(f)});
      }
      if (thin_factors_.back().second.empty()) thin_factors_.clear();  // no thin shapes: rows change nothing
    }
  }
  /// The size curve's rate at `flops` (FLOP/s), ignoring thinness.
  double size_rate(double flops) const {
    const auto& c = size_curve_;
    if (flops <= c.front().first) return c.front().second;
    for (std::size_t i = 1; i < c.size(); ++i)
      if (flops <= c[i].first) {
        const double a = std::log(c[i - 1].first), b = std::log(c[i].first);
        const double t = b > a ? (std::log(flops) - a) / (b - a) : 1.0;
        return c[i - 1].second + t * (c[i].second - c[i - 1].second);
      }
    return c.back().second;
  }
  /// The thin factor at `rows` through a layer of `width` = in × out (see
  /// gemm_rate; width 0: the default width); 1 for rows 0 or without thin shapes.
  double thin_factor(double rows, double width = 0) const {
    if (size_curve_.empty() && !gemm.empty()) settle_gemm();
    const auto& c = thin_factors_;
    if (c.empty() || !(rows > 0)) return 1.0;
    const double w = width > 0 ? width : thin_point::default_width;
    if (w <= c.front().first) return at_rows(c.front().second, rows);
    for (std::size_t i = 1; i < c.size(); ++i)
      if (w <= c[i].first) return lerp({c[i - 1].first, at_rows(c[i - 1].second, rows)}, {c[i].first, at_rows(c[i].second, rows)}, w);
    return at_rows(c.back().second, rows);
  }
  /// The rate (FLOP/s) of attention's per-head products at sequence `seq` and head
  /// width `head_dim`: the `attention` lines' rates, interpolated in log(seq) between
  /// the sequences measured (the nearest end's beyond them), and so across head
  /// widths in log(head_dim). 0 without `attention` lines (then the caller prices the
  /// products as the layer's other GEMMs). (One core here ran gpt's 128 × 128 × 64
  /// products, inside its step, at about half its rate on large square ones.)
  double attention_rate(double seq, double head_dim) const {
    if (attention.empty() || !(seq > 0) || !(head_dim > 0)) return 0.0;
    std::vector<std::pair<double, std::vector<std::pair<double, double>>>> by_width;  // head width -> (seq, FLOP/s)
    for (const auto& a : attention) {
      auto c = std::find_if(by_width.begin(), by_width.end(), [&](const auto& w) { return w.first == a.head_dim; });
      if (c == by_width.end()) c = by_width.insert(by_width.end(), {a.head_dim, {}});
      c->second.push_back({a.seq, a.gflops * 1e9});
    }
    std::sort(by_width.begin(), by_width.end());
    for (auto& c : by_width) std::sort(c.second.begin(), c.second.end());
    std::vector<std::pair<double, double>> at_seq;  // head width -> rate at seq
    for (const auto& c : by_width) at_seq.push_back({c.first, interpolate(c.second, seq)});
    return interpolate(at_seq, head_dim);
  }
  /// The factor on a layer's backward GEMM rate (d-input and d-weights against its
  /// forward) for a layer whose narrower side is `narrow` features: the `backward`
  /// lines' factors interpolated in log(narrow), the nearest end's beyond them; 1
  /// without lines or for `narrow` 0 (not known). (Profiles of 1, 2 and 4 ranks here,
  /// each the median of 3 runs: 0.83-0.89 at 256 features, 0.90-0.91 at 1024, 0.96-0.98 at 4096.)
  double backward_factor(double narrow) const {
    if (backward.empty() || !(narrow > 0)) return 1.0;
    std::vector<std::pair<double, double>> f;
    for (const auto& b : backward) f.push_back({b.narrow, b.factor});
    std::sort(f.begin(), f.end());
    return interpolate(f, narrow);
  }
  /// Seconds of a communication that sends `bytes` per rank in a group of `ranks` at `level`.
  /// A collective over nodes whose group has `local` ranks on each node runs `local`
  /// times the net figure (which is one rank's share when every rank of a node is in
  /// another group): its ring leaves each node once, over the node's shared links,
  /// so a group of 8 ranks per node gets the whole NIC. Never more than the node figure.
  /// `leaving` (1: the ring leaves each node once): the most of the ring's steps
  /// that leave one node; where ranks are dealt round robin, a ring of 4 over 2
  /// nodes leaves each twice, and each node's links carry two members' bytes.
  /// `even` (0: `bytes`): what each rank would send with the same buffer split evenly,
  /// as the measured points were; an uneven collective (ZeRO's pieces, one bucket
  /// owned by one rank) reads the points there, in the cache regime of its buffer,
  /// and scales their time past the latency by bytes / even.
  double link_time(link_level level, link_kind kind, int ranks, double bytes, int local = 1, double even = 0,
                   int leaving = 1) const {
    if (ranks <= 1 && kind != link_kind::p2p) return 0;
    const auto& f = links[static_cast<int>(level)][static_cast<int>(kind)];
    if (f.ranks == 0 || !(f.beta_bps > 0))
      throw std::logic_error("whale::device_profile '" + name + "': no " + link_kind_name(kind) + " figures for the " +
                             link_level_name(level) + " level; profile on as many ranks, or add a 'link' line");
    // a ring's latency grows with its steps: (p-1) of them, against (p0-1) measured
    const double steps = kind == link_kind::p2p || f.ranks <= 1 ? 1.0 : static_cast<double>(ranks - 1) / static_cast<double>(f.ranks - 1);
    double beta = f.beta_bps;
    if (level == link_level::net && kind != link_kind::p2p && (local > 1 || leaving > 1)) {
      beta *= static_cast<double>(local) / static_cast<double>(std::max(1, leaving));
      const auto& inside = links[static_cast<int>(link_level::node)][static_cast<int>(kind)];
      if (inside.ranks && inside.beta_bps > 0) beta = std::min(beta, inside.beta_bps);
      return f.alpha_s * steps + bytes / beta;
    }
    if (!f.points.empty()) {  // the measured curve, more or fewer ring steps
      if (even > 0 && even < bytes) {
        // the latency where the curve starts (seconds() rises from it below the first point)
        const double t = f.seconds(even), lat = std::min(f.alpha_s, f.points.front().second);
        return lat + (t - lat) * (bytes / even) + f.alpha_s * (steps - 1.0);
      }
      return f.seconds(bytes) + f.alpha_s * (steps - 1.0);
    }
    return f.alpha_s * steps + bytes / beta;
  }

  /// The text format (see docs/planning.md): one entry per line, '#' comments.
  ///   device NAME
  ///   gemm M N K TA TB GFLOPS          (TA, TB: 0 or 1)
  ///   thin ROWS FACTOR [WIDTH]          (products of ROWS rows through a layer of WIDTH = in × out
  ///                                      features run at FACTOR of the size curve's rate; WIDTH 4194304 if absent)
  ///   attention SEQ HEAD_DIM GFLOPS     (attention's per-head products at sequence SEQ and head width HEAD_DIM,
  ///                                      as the layer runs them on operands out of the caches)
  ///   backward NARROW FACTOR            (a layer NARROW = min(in, out) features wide runs its backward
  ///                                      products at FACTOR of its forward's rate)
  ///   bandwidth GBPS                    (elementwise, read + write)
  ///   node RANKS                        (ranks per node; absent: every rank on one node)
  ///   streams 1|2                       (2: collectives overlap compute; absent: 1)
  ///   cores CORES RANKS WAITING         (a node's ranks share CORES cores; the rates were measured with RANKS
  ///                                      ranks at once; a waiting rank takes WAITING of a core, 0..1)
  ///   link LEVEL KIND RANKS ALPHA_US BETA_GBPS   (LEVEL: node|net; KIND: all_reduce|all_gather|reduce_scatter|broadcast|p2p)
  ///   point LEVEL KIND BYTES MICROSECONDS        (a measured time, after its link line; the times then follow the points)
  ///   kernels bf16|fp32 LAUNCH_US       (compute priced from the layers' GPU kernels in that precision, LAUNCH_US a launch)
  ///   peak TFLOPS                       (the dense peak model FLOPs utilisation is reported against)
  friend std::ostream& operator<<(std::ostream& os, const device_profile& p);  // the text format (plan/device_text.hpp)

  /// Read the text format; every error names the file, the line and what is wrong.
  static device_profile parse(std::istream& in, const std::string& origin);
  /// parse() of the file at `path`.
  static device_profile load(const std::string& path);

 private:
  static double lerp(std::pair<double, double> a, std::pair<double, double> b, double x) {
    const double t = (std::log(x) - std::log(a.first)) / (std::log(b.first) - std::log(a.first));
    return a.second + t * (b.second - a.second);
  }
  // (x, y) points sorted by x: y at `x` interpolated in log(x), the nearest end's beyond them.
  static double interpolate(const std::vector<std::pair<double, double>>& f, double x) {
    if (x <= f.front().first) return f.front().second;
    for (std::size_t i = 1; i < f.size(); ++i)
      if (x <= f[i].first) return lerp(f[i - 1], f[i], x);
    return f.back().second;
  }
  // One width's factor at `rows`: interpolated in log(rows), the smallest's below, rising to 1 at 8 times the largest.
  static double at_rows(const std::vector<std::pair<double, double>>& f, double rows) {
    if (rows <= f.front().first) return f.front().second;
    for (std::size_t i = 1; i < f.size(); ++i)
      if (rows <= f[i].first) return lerp(f[i - 1], f[i], rows);
    const std::pair<double, double> square{8 * f.back().first, 1.0};
    return rows >= square.first ? 1.0 : lerp(f.back(), square, rows);
  }
  // derived from `gemm` by settle_gemm: (FLOPs, FLOP/s) by size; per layer width, (thinnest side, factor) by side
  mutable std::vector<std::pair<double, double>> size_curve_;
  mutable std::vector<std::pair<double, std::vector<std::pair<double, double>>>> thin_factors_;
};

}  // namespace whale

#include "whale/plan/device_text.hpp"  // the text format, and the median of runs
