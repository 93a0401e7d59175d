// Measuring this machine for the planner's cost model (plan/device.hpp): what
// the CPU's GEMMs, attention products, elementwise loops and (on 2 or more
// ranks) collectives do per second, with every rank measuring at once, as
// ranks run in training (they share cores and memory bandwidth). The full
// measurement is whale_profile's (scripts/profile, about a minute); the quick
// one is auto_plan's when no profile is given (seconds). Every rank gets the
// same profile. The collectives, the sharing of cores and the driver are in
// plan/measure_run.hpp; no files here.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/communicator.hpp"
#include "whale/plan/device.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale::detail {

/// The shapes, sizes and repeats of one measurement. full() is whale_profile's;
/// quick() (auto_plan's at start) fills every entry the planner reads, each
/// coarser, as its comments say.
struct measure_plan {
  struct layer {
    index_t in = 0, out = 0;
    std::vector<index_t> rows;
  };
  struct layer_shape {
    index_t in = 0, out = 0, rows = 0;
  };
  std::vector<std::tuple<index_t, index_t, index_t>> gemm_shapes;  // each NN, NT and TN
  double gemm_s = 0;      // seconds of each shape's run (at 30 GFLOP/s), repeated
  int gemm_reps = 0;      // runs per shape: their median
  std::vector<layer> thin;
  double thin_s = 0;      // seconds of each thin product's run (at 30 GFLOP/s)
  int thin_rounds = 0;    // rounds of the three forms and a cube (3 where a product is long)
  std::vector<std::pair<index_t, index_t>> attention;  // (sequence, head width)
  double attention_flops = 0;  // per-head products' FLOPs a run (4 heads, batched to it)
  int attention_runs = 0;      // after a warm-up: the median
  long flush_cap = 0;          // bytes a rank writes to push operands out of the caches
  std::vector<layer_shape> backward;
  int backward_pairs = 0;      // forward/backward pairs after a warm-up (3 and none where long)
  index_t share_side = 0;      // the square product of the sharing measurement
  double share_s = 0;
  int share_reps = 0;
  index_t bandwidth_floats = 0;  // each of the two arrays
  int bandwidth_reps = 0;
  std::vector<index_t> link_floats;  // message sizes of the collectives' points
  int link_reps = 0;
  index_t link_buffer_floats = 0;  // a size is left out where its buffers (ranks x size) would be larger; 0: none is
  // guarded (quick()): a run is its phase less the cheapest of 3 empty phases (the
  // barriers' own cost), and never less than half its phase; unguarded (full()), less
  // the median empty phase (one, where runs are timed in turns). Runs as short as
  // quick()'s less an empty phase that other work on the cores had stretched read up to
  // 10^8 GFLOP/s here, and a backward factor below 0.
  bool guarded = false;

  /// whale_profile's measurement (about 50 s on 4 ranks here, 30 s on 1).
  static measure_plan full() {
    measure_plan m;
    m.gemm_shapes = {{64, 64, 64},     {128, 128, 128},   {256, 256, 256},    {512, 512, 512},   {256, 1024, 256},
                     {1024, 1024, 1024}, {2048, 1024, 256}, {1024, 4096, 1024}, {2048, 2048, 2048}};
    m.gemm_s = 0.1, m.gemm_reps = 3;
    m.thin = {{1024, 4096, {16, 32, 64, 128, 256, 512}}, {1024, 32768, {16, 64, 256}}, {2048, 100000, {16, 64}}};
    m.thin_s = 0.05, m.thin_rounds = 5;
    m.attention = {{64, 64}, {128, 64}, {512, 64}, {512, 128}, {2048, 128}};
    m.attention_flops = 0.3e9, m.attention_runs = 3, m.flush_cap = 1L << 30;
    m.backward = {{256, 1024, 2048}, {1024, 4096, 2048}, {4096, 4096, 512}};
    m.backward_pairs = 5;
    m.share_side = 1024, m.share_s = 0.3, m.share_reps = 3;
    m.bandwidth_floats = index_t{16} << 20, m.bandwidth_reps = 5;
    for (index_t n = 1024; n <= 8388608; n *= 2) m.link_floats.push_back(n);  // 4 KiB .. 32 MiB, doubling
    m.link_reps = 5;
    return m;
  }
  /// auto_plan's measurement at start, in seconds (here, -Og: 0.8 s on 1 rank;
  /// on 2, 1.2-1.8 s with both cores free, 5-6 s while other work shared them).
  /// Coarser than full(), in every entry the planner reads: shorter runs of each
  /// GEMM shape, cubes of 64 to 1024 only (larger products are taken at 1024's
  /// rate); thin factors of one layer (1024 x 4096; wider layers get its factors)
  /// at 16 and 64 rows (above, the factor rises to 1 at 512 rows); attention at 2
  /// sequences of one head width, operands pushed out by writes of 16 MiB (out of
  /// the private caches, not always out of a large shared one); the backward
  /// factor of 2 layers (256 and 1024 features on the narrower side) at fewer
  /// rows; the sharing of cores from shorter runs; bandwidth over 32 MiB arrays;
  /// collectives at 4 sizes (4 KiB to 32 MiB, 32 times apart: the simulator
  /// interpolates between fewer points; on more than 4 ranks only the sizes whose
  /// buffers stay within 128 MiB), 3 runs each; every run `guarded`. (One rank
  /// here, right after full(): the GEMM rates within 6% of full()'s, the thin and
  /// backward factors within 9%, the bandwidth 6%, attention 18% faster: the
  /// smaller writes leave more in the shared cache.)
  static measure_plan quick() {
    measure_plan m;
    m.gemm_shapes = {{64, 64, 64}, {128, 128, 128}, {256, 256, 256}, {512, 512, 512}, {1024, 1024, 1024}};
    m.gemm_s = 0.01, m.gemm_reps = 3;
    m.thin = {{1024, 4096, {16, 64}}};
    m.thin_s = 0.01, m.thin_rounds = 3;
    m.attention = {{128, 64}, {512, 64}};
    m.attention_flops = 0.05e9, m.attention_runs = 3, m.flush_cap = 16L << 20;
    m.backward = {{256, 1024, 512}, {1024, 4096, 128}};
    m.backward_pairs = 3;
    m.share_side = 512, m.share_s = 0.01, m.share_reps = 3;
    m.bandwidth_floats = index_t{8} << 20, m.bandwidth_reps = 3;
    m.link_floats = {1024, 32768, 1048576, 8388608};
    m.link_reps = 3, m.link_buffer_floats = index_t{32} << 20;  // 2 x 128 MiB: 32 MiB messages up to 4 ranks
    m.guarded = true;
    return m;
  }
};

using measure_clock = std::chrono::steady_clock;

// A product over this many FLOPs (about 0.2 s here) is timed in fewer rounds and not
// warmed: such long products vary less, and take most of the profile's time.
inline constexpr double long_product_flops = 6e9;

/// Seconds of one phase of f on every rank at once: from a barrier to the end of
/// the last rank's run (a rank that waits for a core is counted waiting). A
/// phase ends at the same barrier on every rank, so every rank has the figure.
template <Communicator C, class F> double phase(C& w, F&& f) {
  barrier(w);
  const auto t0 = measure_clock::now();
  f();
  barrier(w);
  return std::chrono::duration<double>(measure_clock::now() - t0).count();
}

/// Seconds of an empty phase on this rank, for runs timed in turns: one phase, or
/// (guarded) the cheapest of 3.
template <Communicator C> double empty_phase(C& w, const measure_plan& mp) {
  double e = phase(w, [] {});
  for (int i = 1; i < (mp.guarded ? 3 : 1); ++i) e = std::min(e, phase(w, [] {}));
  return e;
}

/// A run's seconds: its phase `t` less an empty phase's `empty`; guarded, at least half the phase.
inline double less_empty(const measure_plan& mp, double t, double empty) {
  return mp.guarded ? std::max(t - empty, 0.5 * t) : std::max(1e-9, t - empty);
}

/// Median seconds of `reps` phases of f (the slowest rank's median), less the
/// time of an empty phase (the median of as many; guarded, the cheapest: less_empty);
/// `warm` runs first, untimed.
template <Communicator C, class F, class W> double timed(C& w, const measure_plan& mp, int reps, F&& f, W&& warm) {
  auto median = [&](auto&& g, bool cheapest) {
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) t.push_back(phase(w, g));
    double m = cheapest ? *std::min_element(t.begin(), t.end()) : median_of(t);
    all_reduce(w, view<double>(&m, {1}), reduce_op::max);
    return m;
  };
  warm();
  const double empty = median([] {}, mp.guarded);
  return less_empty(mp, median(f, false), empty);
}
template <Communicator C, class F> double timed(C& w, const measure_plan& mp, int reps, F&& f) { return timed(w, mp, reps, f, f); }

inline void gemm_n(bool ta, bool tb, index_t m, index_t n, index_t k, const float* a, const float* b, float* c, int count) {
  for (int r = 0; r < count; ++r)
    cpu::gemm(ta ? cpu::trans::yes : cpu::trans::no, tb ? cpu::trans::yes : cpu::trans::no, m, n, k, 1.f, a, b, 0.f, c);
}

/// GEMM: squares per size class, and the transposes of backward at each.
template <Communicator C> void measure_gemm(C& w, const measure_plan& mp, device_profile& prof) {
  for (auto [m, n, k] : mp.gemm_shapes)
    for (int t = 0; t < 3; ++t) {  // NN (forward), NT (d input), TN (d weights)
      const bool ta = t == 2, tb = t == 1;
      tensor<float> a({m * k}), b({k * n}), c({m * n});
      for (auto& x : a) x = 0.5f;
      for (auto& x : b) x = 0.25f;
      // repeated to at least gemm_s per run, so that the ranks' GEMMs overlap as in training
      gemm_point g{m, n, k, ta, tb, 0};
      const int times = std::max(1, static_cast<int>(mp.gemm_s * 30e9 / g.flops()));
      // warmed by one product (the repeats warm the rest)
      const double s = timed(w, mp, mp.gemm_reps, [&] { gemm_n(ta, tb, m, n, k, a.data(), b.data(), c.data(), times); },
                             [&] { gemm_n(ta, tb, m, n, k, a.data(), b.data(), c.data(), 1); });
      g.gflops = g.flops() * times / s / 1e9;
      prof.gemm.push_back(g);
    }
}

/// Thin products: a batch of t rows through a layer, as a linear layer runs it: forward
/// y = x W^T (t, out, in), d input dy W (t, in, out), d weights dy^T x (out, in, t).
/// After one untimed product of each, rounds of the three forms and a cube of the same
/// FLOPs, timed in turns: a form's factor is the median over the rounds of its rate over
/// the same round's cube's, the row count's the median of the three forms, so a slow
/// spell of the machine falls on both sides of a ratio (rates timed minutes apart were
/// not steady enough here, docs/records-planning.md). Where one product is over 6
/// GFLOP (about 0.2 s) three rounds and no untimed products: those long products vary
/// less, and take most of the time. The full measurement's three layers: 1024 x 4096
/// (16 to 512 rows), a wide one, 1024 x 32768, as a language model's head (16 to 256
/// rows), and xc's 2048 x 100,000 classifier (16 and 64 rows): the wider the layer, the
/// slower its thin products run here.
template <Communicator C> void measure_thin(C& w, const measure_plan& mp, device_profile& prof) {
  for (const auto& layer : mp.thin) {
    const index_t in = layer.in, out = layer.out;
    // a: x (t x in) or dy (t x out), as the form reads it; b: W; c: the product
    tensor<float> a({layer.rows.back() * std::max(in, out)}), b({out * in}), c({out * in});
    for (auto* x : {&a, &b})
      for (auto& v : *x) v = 0.5f;
    for (index_t t : layer.rows) {
      const double flops = 2.0 * static_cast<double>(t) * static_cast<double>(out) * static_cast<double>(in);
      const auto side = static_cast<index_t>(std::lround(std::cbrt(flops / 2.0)));
      const int times = std::max(1, static_cast<int>(mp.thin_s * 30e9 / flops));
      tensor<float> q({side * side}), r({side * side}), o({side * side});
      for (auto* x : {&q, &r})
        for (auto& v : *x) v = 0.5f;
      auto product = [&](index_t m, index_t n, index_t k, bool ta, bool tb, const float* x, const float* y, float* z) {
        return [=](int count) { gemm_n(ta, tb, m, n, k, x, y, z, count); };
      };
      const auto cube = product(side, side, side, false, false, q.data(), r.data(), o.data());
      const std::vector<std::function<void(int)>> forms = {product(t, out, in, false, true, a.data(), b.data(), c.data()),
                                                           product(t, in, out, false, false, a.data(), b.data(), c.data()),
                                                           product(out, in, t, true, false, a.data(), b.data(), c.data())};
      const bool long_products = flops > long_product_flops;  // (then times is 1)
      if (!long_products) {  // (the buffers' pages were touched when they were filled)
        for (const auto& f : forms) f(1);
        cube(1);
      }
      const double empty = empty_phase(w, mp);
      const int rounds = long_products ? 3 : mp.thin_rounds;
      const double cube_flops = 2.0 * static_cast<double>(side) * static_cast<double>(side) * static_cast<double>(side);
      std::vector<std::vector<double>> ratio(forms.size());
      for (int round = 0; round < rounds; ++round) {
        std::vector<double> form_s;
        for (const auto& f : forms) form_s.push_back(less_empty(mp, phase(w, [&] { f(times); }), empty));
        const double cube_s = less_empty(mp, phase(w, [&] { cube(times); }), empty);
        for (std::size_t i = 0; i < forms.size(); ++i) ratio[i].push_back((flops / form_s[i]) / (cube_flops / cube_s));  // thin over cube
      }
      std::vector<double> factor;
      for (auto& v : ratio) factor.push_back(median_of(v));
      // (at most 2, what the format takes)
      prof.thin.push_back({static_cast<double>(t), std::min(median_of(factor), 2.0), static_cast<double>(in) * static_cast<double>(out)});
    }
  }
}

/// Writes a buffer the last-level cache's size over the ranks (at least 16 MiB a rank,
/// at most the plan's cap), as the rest of a training step does between a layer's
/// forward and its backward.
class cache_flush {
 public:
  cache_flush(int ranks, long cap) {
    const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    const long bytes = std::min(cap, std::clamp((llc > 0 ? llc : 256L << 20) / std::max(1, ranks), 16L << 20, 1L << 30));
    buf_ = tensor<float>({static_cast<index_t>(bytes / 4)});
  }
  void operator()() {
    float* e = buf_.data();
    for (index_t i = 0; i < buf_.numel(); ++i) e[i] += 1.f;
    volatile float sink = e[buf_.numel() / 2];
    (void)sink;
  }

 private:
  tensor<float> buf_;
};

/// Attention's per-head products, as causal_self_attention runs them: its forward and
/// backward core on 4 heads (Q, K, V strided in one QKV buffer; the softmax between the
/// products, untimed), the products' time summed from the GEMM log, runs after a
/// warm-up: the median rate, the slowest rank's. Before the forward and again before
/// the backward the ranks, all at once, each write their share of a buffer the
/// last-level cache's size (cache_flush), as the rest of a training step does between
/// them: these small products ran about 30% slower here after such writes than on
/// operands left in the caches, and at that slower rate inside gpt's step. A rate, not a
/// factor over the size curve: the curve's smallest shapes (64 cubed) run from the
/// first-level caches, faster than these. The full measurement: sequences 64 to 2048,
/// head widths 64 and 128 (the gpt and BERT-Large workloads' 128 x 64, gpt-13b's 2048 x
/// 128); the writes take most of this part's time.
template <Communicator C> void measure_attention(C& w, const measure_plan& mp, cache_flush& flush, device_profile& prof) {
  for (const auto& [T, hd] : mp.attention) {
    const index_t H = 4, W = H * hd;
    const double product = 2.0 * static_cast<double>(T) * static_cast<double>(T) * static_cast<double>(hd);
    const index_t B = std::max<index_t>(1, static_cast<index_t>(std::ceil(mp.attention_flops / (6.0 * product * static_cast<double>(H)))));
    tensor<float> qkv({B * T * 3 * W}), lse({B * H * T}), att({B * T * W}), dqkv({B * T * 3 * W});
    for (auto* x : {&qkv, &att})
      for (auto& v : *x) v = 0.01f;
    const backend_ref be;  // the CPU
    std::vector<cpu::gemm_call> log;
    log.reserve(static_cast<std::size_t>(6 * B * H + 8));
    std::vector<double> rate;
    for (int run = 0; run <= mp.attention_runs; ++run) {  // the first a warm-up
      log.clear();
      if (run > 0) flush();
      barrier(w);  // the ranks compute at once, as in training
      cpu::set_gemm_log(&log);
      be.attention_forward(B, T, H, hd, qkv.data(), att.data(), lse.data());
      cpu::set_gemm_log(nullptr);
      if (run > 0) flush();
      cpu::set_gemm_log(&log);
      be.attention_backward(B, T, H, hd, qkv.data(), att.data(), lse.data(), att.data(), dqkv.data());
      cpu::set_gemm_log(nullptr);
      double secs = 0, flops = 0;
      for (const auto& g : log) secs += g.seconds, flops += g.flops();
      if (run > 0) rate.push_back(flops / secs / 1e9);
    }
    double r = median_of(rate);
    all_reduce(w, view<double>(&r, {1}), reduce_op::min);  // the slowest rank's
    prof.attention.push_back({static_cast<double>(T), static_cast<double>(hd), r});
  }
}

/// A linear layer's backward against its forward (the full measurement: 2,048 rows
/// through layers whose narrower side is 256 and 1024 features, 256 -> 1024 and 1024 ->
/// 4096, 512 through 4096 -> 4096). The forward y = x W^T on operands it has just
/// touched (a step's forward reads what the layer before wrote), then, after the cache
/// writes, d input dy W and d weights dy^T x (a step's backward reads what its forward
/// kept long before). Each side timed as a phase of all ranks at once, from a barrier to
/// the last rank's end, pairs after a warm-up (3 and none where the forward is over 6
/// GFLOP, about 0.2 s, as the thin products): the factor is the median of the pairs'
/// rate ratios.
template <Communicator C> void measure_backward(C& w, const measure_plan& mp, cache_flush& flush, device_profile& prof) {
  for (const auto shape : mp.backward) {
    const index_t in = shape.in, out = shape.out, rows = shape.rows;
    tensor<float> x({rows * in}), wt({out * in}), y({rows * out}), dy({rows * out}), dx({rows * in}), dw({out * in});
    for (auto* t : {&x, &wt, &dy})
      for (auto& v : *t) v = 0.01f;
    using cpu::trans;
    auto forward = [&] { cpu::gemm(trans::no, trans::yes, rows, out, in, 1.f, x.data(), wt.data(), 0.f, y.data()); };
    const double empty = empty_phase(w, mp);
    const bool long_products = 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out) > long_product_flops;
    const int warm = long_products ? 0 : 1, pairs = long_products ? 3 : mp.backward_pairs;
    std::vector<double> ratio;
    for (int pair = 0; pair < warm + pairs; ++pair) {
      forward();
      const double fwd = phase(w, forward);
      flush();
      const double bwd = phase(w, [&] {
        cpu::gemm(trans::no, trans::no, rows, in, out, 1.f, dy.data(), wt.data(), 0.f, dx.data());
        cpu::gemm(trans::yes, trans::no, out, in, rows, 1.f, dy.data(), x.data(), 0.f, dw.data());
      });
      const double fwd_s = mp.guarded ? less_empty(mp, fwd, empty) : fwd - empty;
      const double bwd_s = mp.guarded ? less_empty(mp, bwd, empty) : bwd - empty;
      if (pair >= warm) ratio.push_back(2.0 * fwd_s / bwd_s);  // twice the forward's FLOPs
    }
    // (at most 2, what the format takes)
    prof.backward.push_back({static_cast<double>(std::min(in, out)), std::min(median_of(ratio), 2.0)});
  }
}

/// Elementwise: y = 2x + y over two arrays (read x, read y, write y), bytes per second.
template <Communicator C> void measure_bandwidth(C& w, const measure_plan& mp, device_profile& prof) {
  const index_t n = mp.bandwidth_floats;
  tensor<float> x({n}), y({n});
  for (auto& v : x) v = 1.f;
  for (auto& v : y) v = 0.f;
  const double s = timed(w, mp, mp.bandwidth_reps, [&] {
    float* __restrict yy = y.data();
    const float* __restrict xx = x.data();
    for (index_t i = 0; i < n; ++i) yy[i] += 2.f * xx[i];
  });
  prof.bandwidth_bps = 12.0 * static_cast<double>(n) / s;
}

}  // namespace whale::detail

#include "whale/plan/measure_run.hpp"  // the collectives, the sharing of cores, and measure_profile
