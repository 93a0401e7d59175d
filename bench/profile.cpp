// whale_profile (scripts/profile): measures this machine for the planner's
// cost model and writes a device profile (plan/device.hpp, docs/planning.md).
// Every rank measures at once, as they run in training (ranks share cores and
// memory bandwidth): GEMM rates at shapes from 64 to 2048 with the transposes
// backward uses, thin products against square ones (16 to 512 rows through a
// 1024 x 4096 layer, 16 to 256 through a 1024 x 32768 one, 16 and 64 through a
// 2048 x 100,000 one), attention's per-head
// products as the layer runs them, a linear layer's backward rate against its
// forward by how wide it is, elementwise bandwidth, and — when launched on 2 or more
// ranks — latency and bandwidth of all-reduce, all-gather, reduce-scatter and
// messages, fitted by least squares over sizes from 4 KiB to 32 MiB (the
// measured points kept beside the fit), and the cores the ranks shared. The
// slowest rank's figures are written (by rank 0, atomically).
//
//   mpirun -np 4 ./whale_profile --out bench/profiles/this-machine-4.txt [--name NAME] [--runs N]
#include <whale/whale.hpp>
#include <whale/comm/detail/cost.hpp>
#include <whale/detail/io.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <unistd.h>

using namespace whale;

namespace {
using clock_type = std::chrono::steady_clock;

// A product over this many FLOPs (about 0.2 s here) is timed in fewer rounds and not
// warmed: such long products vary less, and take most of the profile's time.
constexpr double long_product_flops = 6e9;

/// Seconds of one phase of f on every rank at once: from a barrier to the end of
/// the last rank's run (a rank that waits for a core is counted waiting). A
/// phase ends at the same barrier on every rank, so every rank has the figure.
template <class F> double phase(world_comm& w, F&& f) {
  barrier(w);
  const auto t0 = clock_type::now();
  f();
  barrier(w);
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Median seconds of `reps` phases of f (the slowest rank's median), less the
/// time of an empty phase; `warm` runs first, untimed.
template <class F, class W> double timed(world_comm& w, int reps, F&& f, W&& warm) {
  auto median = [&](auto&& g) {
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) t.push_back(phase(w, g));
    double m = detail::median_of(t);
    all_reduce(w, view<double>(&m, {1}), reduce_op::max);
    return m;
  };
  warm();
  const double empty = median([] {});
  return std::max(1e-9, median(f) - empty);
}
template <class F> double timed(world_comm& w, int reps, F&& f) { return timed(w, reps, f, f); }

/// Least squares t = alpha + bytes / beta over (bytes, seconds) points, each
/// weighted by 1/t^2 (relative error), so that small messages fix alpha; the
/// points are kept too (times made non-decreasing), and the simulator follows them.
link_fit fit(const std::vector<std::pair<double, double>>& pts, int ranks) {
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
}  // namespace

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    std::string out, name = "this-machine";
    int runs = 1;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("whale_profile: " + a + " needs a value");
        return argv[++i];
      };
      if (a == "--out") out = value();
      else if (a == "--name") name = value();
      else if (a == "--thin") throw std::invalid_argument("whale_profile: --thin is gone: thin products are always measured (since 2026-12-04)");
      else if (a == "--runs") runs = static_cast<int>(detail::parse_int(value(), "whale_profile: --runs", 1, 9));
      else throw std::invalid_argument("whale_profile: unknown argument " + a + " (have --out FILE, --name NAME, --runs N)");
    }
    if (out.empty()) throw std::invalid_argument("whale_profile: --out FILE is required");
    auto& w = ctx.world();
    check_output_path(w, out, "whale_profile: the profile (--out)");
    const int p = ctx.size();
    // the whole measurement, once; with --runs N, N times in turns and each figure the
    // median of the runs' (median_profile): one run's figures move with the machine's
    // spells (here one run's GEMM rates read 12-17% above the next two's)
    auto measure_once = [&] {
      device_profile prof;
      prof.name = name + "-" + std::to_string(p) + "-ranks";
      // the ranks measure at once on this node's cores: the simulator then knows that
      // a rank computing while others wait runs faster than these figures
      if (const unsigned c = std::thread::hardware_concurrency(); c > 0) prof.cores = static_cast<int>(c), prof.cores_measured_ranks = p;

      // GEMM: squares per size class, and the transposes of backward at each
      auto measure = [&](index_t m, index_t n, index_t k, bool ta, bool tb) {
        tensor<float> a({m * k}), b({k * n}), c({m * n});
        for (auto& x : a) x = 0.5f;
        for (auto& x : b) x = 0.25f;
        // repeated to at least 0.1 s per run, so that the ranks' GEMMs overlap as in training
        gemm_point g{m, n, k, ta, tb, 0};
        const int times = std::max(1, static_cast<int>(0.1 * 30e9 / g.flops()));
        auto run = [&](int count) {
          for (int r = 0; r < count; ++r)
            cpu::gemm(ta ? cpu::trans::yes : cpu::trans::no, tb ? cpu::trans::yes : cpu::trans::no, m, n, k, 1.f, a.data(), b.data(), 0.f, c.data());
        };
        // warmed by one product (the repeats warm the rest)
        const double s = timed(w, 3, [&] { run(times); }, [&] { run(1); });
        g.gflops = g.flops() * times / s / 1e9;
        prof.gemm.push_back(g);
      };
      const std::vector<std::tuple<index_t, index_t, index_t>> shapes = {
          {64, 64, 64}, {128, 128, 128}, {256, 256, 256}, {512, 512, 512}, {256, 1024, 256}, {1024, 1024, 1024},
          {2048, 1024, 256}, {1024, 4096, 1024}, {2048, 2048, 2048}};
      for (auto [m, n, k] : shapes)
        for (int t = 0; t < 3; ++t) measure(m, n, k, t == 2, t == 1);  // NN (forward), NT (d input), TN (d weights)
      // Thin products: a batch of t rows through a layer, as a linear layer runs it: forward
      // y = x W^T (t, out, in), d input dy W (t, in, out), d weights dy^T x (out, in, t).
      // After one untimed product of each, rounds of the three forms and a cube of the same
      // FLOPs, timed in turns: a form's factor is the median over the rounds of its rate over
      // the same round's cube's, the row count's the median of the three forms, so a slow
      // spell of the machine falls on both sides of a ratio (rates timed minutes apart were
      // not steady enough here, docs/records-planning.md). Where one product is over 6
      // GFLOP (about 0.2 s) three rounds and no untimed products: those long products vary
      // less, and take most of the time. Three layers: 1024 x 4096 (16 to 512 rows), a wide
      // one, 1024 x 32768, as a language model's head (16 to 256 rows), and xc's 2048 x
      // 100,000 classifier (16 and 64 rows): the wider the layer, the slower its thin
      // products run here.
      struct thin_layer {
        index_t in, out;
        std::vector<index_t> rows;
      };
      for (const auto& layer : {thin_layer{1024, 4096, {16, 32, 64, 128, 256, 512}}, thin_layer{1024, 32768, {16, 64, 256}},
                                thin_layer{2048, 100000, {16, 64}}}) {
        const index_t in = layer.in, out = layer.out;
        // a: x (t x in) or dy (t x out), as the form reads it; b: W; c: the product
        tensor<float> a({layer.rows.back() * std::max(in, out)}), b({out * in}), c({out * in});
        for (auto* x : {&a, &b})
          for (auto& v : *x) v = 0.5f;
        for (index_t t : layer.rows) {
          const double flops = 2.0 * static_cast<double>(t) * static_cast<double>(out) * static_cast<double>(in);
          const auto side = static_cast<index_t>(std::lround(std::cbrt(flops / 2.0)));
          const int times = std::max(1, static_cast<int>(0.05 * 30e9 / flops));
          tensor<float> q({side * side}), r({side * side}), o({side * side});
          for (auto* x : {&q, &r})
            for (auto& v : *x) v = 0.5f;
          auto product = [&](index_t m, index_t n, index_t k, bool ta, bool tb, const float* x, const float* y, float* z) {
            return [=](int count) {
              for (int i = 0; i < count; ++i)
                cpu::gemm(ta ? cpu::trans::yes : cpu::trans::no, tb ? cpu::trans::yes : cpu::trans::no, m, n, k, 1.f, x, y, 0.f, z);
            };
          };
          const auto cube = product(side, side, side, false, false, q.data(), r.data(), o.data());
          const std::vector<std::function<void(int)>> forms = {product(t, out, in, false, true, a.data(), b.data(), c.data()),
                                                               product(t, in, out, false, false, a.data(), b.data(), c.data()),
                                                               product(out, in, t, true, false, a.data(), b.data(), c.data())};
          const bool long_products = flops > long_product_flops;  // (then times is 1)
          if (!long_products) {  // (the buffers' pages were touched when they were zeroed)
            for (const auto& f : forms) f(1);
            cube(1);
          }
          const double empty = phase(w, [] {});
          const int rounds = long_products ? 3 : 5;
          const double cube_flops = 2.0 * static_cast<double>(side) * static_cast<double>(side) * static_cast<double>(side);
          std::vector<std::vector<double>> ratio(forms.size());
          for (int round = 0; round < rounds; ++round) {
            std::vector<double> form_s;
            for (const auto& f : forms) form_s.push_back(std::max(1e-9, phase(w, [&] { f(times); }) - empty));
            const double cube_s = std::max(1e-9, phase(w, [&] { cube(times); }) - empty);
            for (std::size_t i = 0; i < forms.size(); ++i) ratio[i].push_back((flops / form_s[i]) / (cube_flops / cube_s));  // thin rate over cube rate
          }
          std::vector<double> factor;
          for (auto& v : ratio) factor.push_back(detail::median_of(v));
          prof.thin.push_back({static_cast<double>(t), detail::median_of(factor), static_cast<double>(in) * static_cast<double>(out)});
        }
      }
      // Attention's per-head products, as causal_self_attention runs them: its forward and
      // backward core on 4 heads (Q, K, V strided in one QKV buffer; the softmax between the
      // products, untimed), the products' time summed from the GEMM log, 3 runs after a
      // warm-up: the median rate. Before the forward and again before the backward the
      // ranks, all at once, each write their share of a buffer the last-level cache's size
      // (at least 16 MiB each), as the rest of a training step does between them: these
      // small products ran about 30% slower here after such writes than on operands left in
      // the caches, and at that slower rate inside gpt's step. A rate, not a factor over the
      // size curve: the curve's smallest shapes (64 cubed) run from the first-level caches,
      // faster than these. Sequences 64 to 2048, head widths 64 and 128 (the gpt and
      // BERT-Large workloads' 128 x 64, gpt-13b's 2048 x 128); the writes take most of this
      // part's time.
      {
        const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
        tensor<float> evict({static_cast<index_t>(std::clamp((llc > 0 ? llc : 256L << 20) / p, 16L << 20, 1L << 30) / 4)});
        auto flush = [&] {
          float* e = evict.data();
          for (index_t i = 0; i < evict.numel(); ++i) e[i] += 1.f;
          volatile float sink = e[evict.numel() / 2];
          (void)sink;
        };
        for (const auto& [T, hd] : std::vector<std::pair<index_t, index_t>>{{64, 64}, {128, 64}, {512, 64}, {512, 128}, {2048, 128}}) {
          const index_t H = 4, W = H * hd;
          const double product = 2.0 * static_cast<double>(T) * static_cast<double>(T) * static_cast<double>(hd);
          const index_t B = std::max<index_t>(1, static_cast<index_t>(std::ceil(0.3e9 / (6.0 * product * static_cast<double>(H)))));
          tensor<float> qkv({B * T * 3 * W}), lse({B * H * T}), att({B * T * W}), dqkv({B * T * 3 * W});
          for (auto* x : {&qkv, &att})
            for (auto& v : *x) v = 0.01f;
          const backend_ref be;  // the CPU
          std::vector<cpu::gemm_call> log;
          log.reserve(static_cast<std::size_t>(6 * B * H + 8));
          std::vector<double> rate;
          for (int run = 0; run < 4; ++run) {  // the first a warm-up
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
          std::sort(rate.begin(), rate.end());
          double r = rate[1];
          all_reduce(w, view<double>(&r, {1}), reduce_op::min);  // the slowest rank's
          prof.attention.push_back({static_cast<double>(T), static_cast<double>(hd), r});
        }
        // A linear layer's backward against its forward: 2,048 rows through layers whose
        // narrower side is 256 and 1024 features (256 -> 1024, 1024 -> 4096), 512 through
        // 4096 -> 4096. The forward y = x W^T on operands it has just touched (a step's
        // forward reads what the layer before wrote), then, after the cache writes above,
        // d input dy W and d weights dy^T x (a step's backward reads what its forward kept
        // long before). Each side timed as a phase of all ranks at once, from a barrier to
        // the last rank's end (as the GEMM rates above), 5 pairs after a warm-up (3 and none
        // where the forward is over 6 GFLOP, about 0.2 s, as the thin products): the factor is
        // the median of the pairs' rate ratios.
        struct layer_shape {
          index_t in, out, rows;
        };
        for (const auto shape : {layer_shape{256, 1024, 2048}, layer_shape{1024, 4096, 2048}, layer_shape{4096, 4096, 512}}) {
          const index_t in = shape.in, out = shape.out, rows = shape.rows;
          tensor<float> x({rows * in}), wt({out * in}), y({rows * out}), dy({rows * out}), dx({rows * in}), dw({out * in});
          for (auto* t : {&x, &wt, &dy})
            for (auto& v : *t) v = 0.01f;
          using cpu::trans;
          auto forward = [&] { cpu::gemm(trans::no, trans::yes, rows, out, in, 1.f, x.data(), wt.data(), 0.f, y.data()); };
          const double empty = phase(w, [] {});
          const bool long_products = 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out) > long_product_flops;
          const int warm = long_products ? 0 : 1, pairs = long_products ? 3 : 5;
          std::vector<double> ratio;
          for (int pair = 0; pair < warm + pairs; ++pair) {
            forward();
            const double fwd_s = phase(w, forward) - empty;
            flush();
            const double bwd_s = phase(w, [&] {
              cpu::gemm(trans::no, trans::no, rows, in, out, 1.f, dy.data(), wt.data(), 0.f, dx.data());
              cpu::gemm(trans::yes, trans::no, out, in, rows, 1.f, dy.data(), x.data(), 0.f, dw.data());
            }) - empty;
            if (pair >= warm) ratio.push_back(2.0 * fwd_s / bwd_s);  // twice the forward's FLOPs
          }
          // (at most 2, what the format takes)
          prof.backward.push_back({static_cast<double>(std::min(in, out)), std::min(detail::median_of(ratio), 2.0)});
        }
      }
      // more ranks than cores: how much of a core a rank waiting in a receive still takes (MPI
      // polls while it waits). Rank 0 multiplies while the others wait for its message; against
      // every rank multiplying at once, sharing_slowdown (plan/device.hpp) gives the share.
      if (prof.cores > 0 && p > prof.cores) {
        const index_t m = 1024;
        tensor<float> a({m * m}), b({m * m}), c({m * m});
        for (auto& x : a) x = 0.5f;
        for (auto& x : b) x = 0.25f;
        const int times = std::max(1, static_cast<int>(0.3 * 30e9 / (2.0 * m * m * m)));
        auto product = [&] {
          for (int r = 0; r < times; ++r)
            cpu::gemm(cpu::trans::no, cpu::trans::no, m, m, m, 1.f, a.data(), b.data(), 0.f, c.data());
        };
        const double all = timed(w, 3, product);
        int token = 0;
        const double alone = timed(w, 3, [&] {
          if (ctx.rank() == 0) {
            product();
            for (int q = 1; q < p; ++q) send(w, cview<int>(&token, {1}), q, 9);
          } else {
            recv(w, view<int>(&token, {1}), 0, 9);
          }
        });
        const double C = prof.cores, R = p;
        const double load = alone / all * std::max(1.0, R / C) * C;  // 1 + share x (R - 1), where it is above C
        prof.waiting_share = std::clamp((load - 1.0) / (R - 1.0), 0.0, 1.0);
      }
      // elementwise: y = 2x + y over 64 MiB arrays (read x, read y, write y)
      {
        const index_t n = index_t{16} << 20;
        tensor<float> x({n}), y({n});
        for (auto& v : x) v = 1.f;
        for (auto& v : y) v = 0.f;
        const double s = timed(w, 5, [&] {
          float* __restrict yy = y.data();
          const float* __restrict xx = x.data();
          for (index_t i = 0; i < n; ++i) yy[i] += 2.f * xx[i];
        });
        prof.bandwidth_bps = 12.0 * static_cast<double>(n) / s;
      }
      // links, inside this node
      if (p > 1) {
        // floats: 4 KiB .. 32 MiB (gradient buckets are 25 MiB by default), doubling: the
        // times are kept as points, and they jump where the buffers leave the caches
        std::vector<index_t> sizes;
        for (index_t n = 1024; n <= 8388608; n *= 2) sizes.push_back(n);
        tensor<float> buf({sizes.back() * p}), out_buf({sizes.back() * p});
        for (auto& v : buf) v = 1.f;
        std::vector<std::pair<double, double>> ar, ag, rs, pp;
        for (index_t n : sizes) {
          const std::int64_t bytes = 4 * n;
          ar.push_back({static_cast<double>(detail::all_reduce_traffic(bytes, p).sent),
                        timed(w, 5, [&] { all_reduce(w, view<float>(buf.data(), {n})); })});
          ag.push_back({static_cast<double>(detail::all_gather_traffic(bytes, p).sent),
                        timed(w, 5, [&] { all_gather(w, cview<float>(buf.data(), {n}), view<float>(out_buf.data(), {n * p})); })});
          rs.push_back({static_cast<double>(detail::reduce_scatter_traffic(bytes, p).sent),
                        timed(w, 5, [&] { reduce_scatter(w, cview<float>(buf.data(), {n * p}), view<float>(out_buf.data(), {n})); })});
          // messages: rank 0 to rank 1 and back, half the round trip
          const double rt = timed(w, 5, [&] {
            if (ctx.rank() == 0) {
              send(w, cview<float>(buf.data(), {n}), 1, 7);
              recv(w, view<float>(out_buf.data(), {n}), 1, 8);
            } else if (ctx.rank() == 1) {
              recv(w, view<float>(out_buf.data(), {n}), 0, 7);
              send(w, cview<float>(buf.data(), {n}), 0, 8);
            }
          });
          pp.push_back({static_cast<double>(bytes), rt / 2});
        }
        auto& node = prof.links[static_cast<std::size_t>(link_level::node)];
        node[static_cast<std::size_t>(link_kind::all_reduce)] = fit(ar, p);
        node[static_cast<std::size_t>(link_kind::all_gather)] = fit(ag, p);
        node[static_cast<std::size_t>(link_kind::reduce_scatter)] = fit(rs, p);
        node[static_cast<std::size_t>(link_kind::broadcast)] = fit(ag, p);  // (not measured: taken as an all-gather)
        node[static_cast<std::size_t>(link_kind::p2p)] = fit(pp, 2);
      }
      return prof;
    };
    std::vector<device_profile> all;
    for (int r = 0; r < runs; ++r) all.push_back(measure_once());
    const device_profile prof = median_profile(all);
    if (ctx.rank() == 0) {
      std::ostringstream s;
      s << prof;
      detail::write_file_atomically(out, s.str(), "whale_profile");
      std::cout << s.str();
    }
    return 0;
  });
}
