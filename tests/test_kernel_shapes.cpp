// The kernel shapes (backend/kernels/shapes.hpp) on the CPU: the emulated
// team's reductions against double references at edge sizes (one element,
// one lane short of a warp, a 50,304-wide row), the row and column bodies of
// backend/kernels/rows.hpp at edge shapes (one row, rows not a multiple of a
// tile, widths not a multiple of a warp, a block team), the guarded backend
// running every case in the device's shape bit-equal to the CPU backend, and
// the device ledger it keeps (launches, threads, bytes, FLOPs, host waits).
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "support/kernel_cases.hpp"
#include "whale/backend/backend_ref.hpp"
#include "whale/backend/guarded.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/train/data.hpp"
#include "whale/train/ledger.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;
namespace kc = kernel_cases;

namespace {
std::vector<float> values(index_t n, std::uint32_t seed, float lo = -3.f, float hi = 3.f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = lo + (hi - lo) * static_cast<float>(seed >> 8) / 16777216.f;
  }
  return v;
}
template <int W> void team_reductions_at(index_t n) {
  const kernels::emulated_team<W> t;
  const auto x = values(n, static_cast<std::uint32_t>(n) + 7);
  double sum = 0, mx = -INFINITY;
  for (float v : x) sum += v, mx = std::fmax(mx, v);
  double se = 0;
  for (float v : x) se += std::exp(v - mx);
  INFO("team of " << W << " warps over " << n << " elements");
  CHECK(t.sum(n, [&](index_t j) { return x[j]; }) == doctest::Approx(sum).epsilon(1e-5).scale(1.0 + std::sqrt(n)));
  if (n == 0) return;
  CHECK(t.max(n, [&](index_t j) { return x[j]; }) == static_cast<float>(mx));
  const auto st = t.softmax_stats(n, [&](index_t j) { return x[j]; });
  CHECK(st.m == static_cast<float>(mx));
  CHECK(st.s == doctest::Approx(se).epsilon(1e-5));
}
}  // namespace

TEST_CASE("an emulated team reduces in the tree order the GPU uses, at every edge size") {
  for (index_t n : {0, 1, 2, 31, 32, 33, 255, 256, 257, 1000, 4096, 50304}) {
    team_reductions_at<1>(n);
    team_reductions_at<8>(n);
  }
  // the tree, by hand: lane l holds l + 1; within each warp lane i takes i + 16, 8, 4, 2, 1
  const kernels::emulated_team<1> t;
  float v[32];
  for (int l = 0; l < 32; ++l) v[l] = static_cast<float>(l + 1);
  CHECK(kernels::tree_reduce<1>(v, [](float a, float b) { return a + b; }) == 528.f);
  // values whose float sum depends on the order: the tree is not the sequential sum
  std::vector<float> x(64, 1.f);
  x[0] = 1e8f;
  float seq = 0.f;
  for (float e : x) seq += e;
  const float tree = t.sum(64, [&](index_t j) { return x[j]; });
  CHECK(seq == 1e8f);            // each 1 vanishes when added to 1e8 one at a time
  // lane 0 holds 1e8 (its second 1 is lost), every other lane 2; the butterfly adds
  // 2 (lost), 4 (a tie, to even: lost), 8, 16, 32: 1e8 + 56, where the sequential sum keeps none
  CHECK(tree == 1e8f + 56.f);
  CHECK(kernels::row_warps(4095) == 1);
  CHECK(kernels::row_warps(kernels::wide_row) == 8);
}

TEST_CASE("row bodies at edge shapes: one row, narrow and 50,304-wide rows, against double references") {
  for (const index_t D : {1, 7, 33, 1000, 4096, 50304}) {
    for (const index_t R : {1, 3}) {
      INFO("LayerNorm of " << R << " rows of " << D);
      const auto x = values(R * D, 11), g = values(D, 12), b = values(D, 13), dy = values(R * D, 14);
      std::vector<float> y(x.size()), xh(x.size()), rs(R), dx(x.size());
      cpu::launch(R, kernels::layer_norm_forward{x.data(), g.data(), b.data(), y.data(), xh.data(), rs.data(), D, 1e-5f});
      cpu::launch(R, kernels::layer_norm_backward{dy.data(), xh.data(), rs.data(), g.data(), dx.data(), D});
      double worst_y = 0, worst_dx = 0;
      for (index_t r = 0; r < R; ++r) {
        double mean = 0, var = 0, m1 = 0, m2 = 0;
        for (index_t j = 0; j < D; ++j) mean += x[r * D + j];
        mean /= D;
        for (index_t j = 0; j < D; ++j) var += (x[r * D + j] - mean) * (x[r * D + j] - mean);
        var /= D;
        const double s = 1 / std::sqrt(var + 1e-5);
        for (index_t j = 0; j < D; ++j) {
          const double h = (x[r * D + j] - mean) * s, gj = dy[r * D + j] * g[j];
          worst_y = std::fmax(worst_y, std::fabs(y[r * D + j] - (h * g[j] + b[j])));
          m1 += gj / D, m2 += gj * h / D;
        }
        for (index_t j = 0; j < D; ++j) {
          const double h = (x[r * D + j] - mean) * s;
          worst_dx = std::fmax(worst_dx, std::fabs(dx[r * D + j] - s * (dy[r * D + j] * g[j] - m1 - h * m2)) / (1 + s));
        }
      }
      CHECK(worst_y < 1e-4);
      CHECK(worst_dx < 2e-4);
    }
  }
  for (const index_t D : {1, 7, 33, 1000, 4096, 50304}) {
    for (const index_t R : {1, 3}) {
      INFO("RMSNorm of " << R << " rows of " << D);
      const auto x = values(R * D, 15), g = values(D, 16), dy = values(R * D, 17);
      std::vector<float> y(x.size()), xh(x.size()), rs(R), dx(x.size());
      cpu::launch(R, kernels::rms_norm_forward{x.data(), g.data(), y.data(), xh.data(), rs.data(), D, 1e-6f});
      cpu::launch(R, kernels::rms_norm_backward{dy.data(), xh.data(), rs.data(), g.data(), dx.data(), D});
      double worst_y = 0, worst_dx = 0;
      for (index_t r = 0; r < R; ++r) {
        double ms = 0, m2 = 0;
        for (index_t j = 0; j < D; ++j) ms += static_cast<double>(x[r * D + j]) * x[r * D + j] / D;
        const double s = 1 / std::sqrt(ms + 1e-6);
        for (index_t j = 0; j < D; ++j) {
          const double h = x[r * D + j] * s;
          worst_y = std::fmax(worst_y, std::fabs(y[r * D + j] - h * g[j]));
          m2 += dy[r * D + j] * g[j] * h / D;
        }
        for (index_t j = 0; j < D; ++j) {
          const double h = x[r * D + j] * s;
          worst_dx = std::fmax(worst_dx, std::fabs(dx[r * D + j] - s * (dy[r * D + j] * g[j] - h * m2)) / (1 + s));
        }
      }
      CHECK(worst_y < 1e-4);
      CHECK(worst_dx < 2e-4);
    }
  }
  // cross-entropy over a 50,304-wide row and a 33-wide one, one row ignored, the gradient in place
  for (const index_t C : {33, 50304}) {
    const index_t R = 3;
    auto z = values(R * C, 21, -8.f, 8.f);
    const auto z0 = z;
    const std::vector<std::int32_t> y{static_cast<std::int32_t>(C - 1), -100, 0};
    std::vector<double> loss(R);
    cpu::launch(R, kernels::cross_entropy_rows{z.data(), y.data(), z.data(), loss.data(), C, 0.5f, -100});
    for (index_t r = 0; r < R; ++r) {
      INFO("cross-entropy row " << r << " of width " << C);
      if (y[r] == -100) {
        CHECK(loss[r] == 0.0);
        for (index_t j = 0; j < C; ++j) REQUIRE(z[r * C + j] == 0.f);
        continue;
      }
      double m = -INFINITY, se = 0;
      for (index_t j = 0; j < C; ++j) m = std::fmax(m, z0[r * C + j]);
      for (index_t j = 0; j < C; ++j) se += std::exp(z0[r * C + j] - m);
      CHECK(loss[r] == doctest::Approx(std::log(se) + m - z0[r * C + y[r]]).epsilon(1e-6));
      double worst = 0;
      for (index_t j = 0; j < C; ++j) {
        const double want = 0.5 * (std::exp(z0[r * C + j] - m) / se - (j == y[r] ? 1 : 0));
        worst = std::fmax(worst, std::fabs(z[r * C + j] - want));
      }
      CHECK(worst < 1e-7);
    }
  }
  // causal softmax: a sequence of one, and of 33 (past a warp)
  for (const index_t T : {1, 33}) {
    auto p = values(T * T, 31);
    const auto p0 = p;
    cpu::launch(T, kernels::causal_softmax_forward{p.data(), T});
    for (index_t i = 0; i < T; ++i) {
      double m = -INFINITY, se = 0;
      for (index_t j = 0; j <= i; ++j) m = std::fmax(m, p0[i * T + j]);
      for (index_t j = 0; j <= i; ++j) se += std::exp(p0[i * T + j] - m);
      for (index_t j = 0; j < T; ++j)
        REQUIRE(p[i * T + j] == doctest::Approx(j <= i ? std::exp(p0[i * T + j] - m) / se : 0.0).epsilon(1e-6));
    }
  }
}

TEST_CASE("staged rows: a GPU team's rows in shared memory give the unstaged rows' bits; rows too wide for it run unstaged") {
  // where an H200 block holds the staged rows: 8 warps' rows below kernels::wide_row, one block's row from it
  CHECK(kernels::stage_fits(2, 1024));    // LayerNorm's backward at gpt's width: 64 KiB a block
  CHECK(!kernels::stage_fits(2, 4095));   // 8 warps x 2 rows x 16 KiB: past 227 KiB
  CHECK(kernels::stage_fits(2, 4096));    // one team of 8 warps: 32 KiB
  CHECK(kernels::stage_fits(1, 50304));   // GPT-2's logits: 196.5 KiB
  CHECK(!kernels::stage_fits(1, 60000));  // 234 KiB
  CHECK(!kernels::stage_fits(0, 16));
  for (const index_t D : {1, 7, 33, 1000, 4095, 4096, 50304, 60000}) {
    const index_t R = 3;
    INFO("rows of " << D);
    const auto x = values(R * D, 41), g = values(D, 42), b = values(D, 43), dy = values(R * D, 44), add = values(R * D, 45);
    auto both = [&](auto&& make) {  // unstaged (the CPU backend), then staged (the guarded backend, as a GPU)
      std::vector<float> out[2][3];
      std::vector<float> rs[2];
      for (int staged = 0; staged < 2; ++staged) {
        for (auto& o : out[staged]) o.assign(static_cast<std::size_t>(R * D), 0.f);
        rs[staged].assign(static_cast<std::size_t>(R), 0.f);
        const auto body = make(out[staged][0].data(), out[staged][1].data(), out[staged][2].data(), rs[staged].data());
        if (staged) cpu::launch_staged(R, body);
        else cpu::launch(R, body);
      }
      for (int i = 0; i < 3; ++i) CHECK(out[0][i] == out[1][i]);
      CHECK(rs[0] == rs[1]);
    };
    for (const bool round : {false, true}) {
      INFO("stored as bf16: " << round);
      both([&](float* y, float* xh, float*, float* rs) {
        return kernels::layer_norm_forward{x.data(), g.data(), b.data(), y, xh, rs, D, 1e-5f, round};
      });
      both([&](float* dx, float*, float*, float* rs) {
        for (index_t r = 0; r < R; ++r) rs[r] = 0.5f + static_cast<float>(r);
        return kernels::layer_norm_backward{dy.data(), x.data(), rs, g.data(), dx, D, round, round ? add.data() : nullptr};
      });
      both([&](float* dx, float*, float*, float* rs) {  // x-hat recomputed from x, the means (b) and rstd
        for (index_t r = 0; r < R; ++r) rs[r] = 0.5f + static_cast<float>(r);
        return kernels::layer_norm_backward{dy.data(), nullptr, rs, g.data(), dx, D, round, round ? add.data() : nullptr,
                                            x.data(), b.data()};
      });
      both([&](float* y, float* xh, float*, float* rs) {
        return kernels::rms_norm_forward{x.data(), g.data(), y, xh, rs, D, 1e-6f, round};
      });
      both([&](float* dx, float*, float*, float* rs) {
        for (index_t r = 0; r < R; ++r) rs[r] = 0.5f + static_cast<float>(r);
        return kernels::rms_norm_backward{dy.data(), x.data(), rs, g.data(), dx, D, round, round ? add.data() : nullptr};
      });
      const std::vector<std::int32_t> labels{static_cast<std::int32_t>(D - 1), -100, 0};
      for (const bool in_place : {false, true}) {
        INFO("cross-entropy, gradient in place: " << in_place);
        std::vector<double> loss[2];
        std::vector<float> q[2];
        for (int staged = 0; staged < 2; ++staged) {
          q[staged] = x;
          loss[staged].assign(static_cast<std::size_t>(R), 0.0);
          std::vector<float> z = x;
          const kernels::cross_entropy_rows body{in_place ? q[staged].data() : z.data(), labels.data(), q[staged].data(),
                                                 loss[staged].data(), D, 0.5f, -100, round};
          if (staged) cpu::launch_staged(R, body);
          else cpu::launch(R, body);
          if (!in_place) CHECK(z == x);  // the logits untouched where the gradient goes elsewhere
        }
        CHECK(q[0] == q[1]);
        CHECK(loss[0] == loss[1]);
      }
    }
    // the bytes each body declares: its rows read once where they are staged
    const kernels::cross_entropy_rows ce{nullptr, nullptr, nullptr, nullptr, D, 1.f, -100};
    CHECK(ce.bytes(R) == R * ((kernels::stage_fits(1, D) ? 2 : 5) * D * 4 + 12));
  }
}

TEST_CASE("column reductions at edge shapes: one row, a tile, a tile and one, many tiles; one and 300 columns") {
  for (const index_t R : {1, 64, 65, 200, 1000})
    for (const index_t C : {1, 7, 300}) {
      INFO(R << " rows of " << C);
      const auto x = values(R * C, 41), h = values(R * C, 42);
      std::vector<float> s(C, 2.f), dg(C, 1.f), db(C, 1.f);
      cpu::reduce_columns(kernels::column_sums{x.data(), s.data(), R, C, true});
      cpu::reduce_columns(kernels::layer_norm_param_grads{x.data(), h.data(), dg.data(), db.data(), R, C, false});
      std::vector<float> rg(C, 3.f);
      cpu::reduce_columns(kernels::rms_norm_param_grads{x.data(), h.data(), rg.data(), R, C, true});
      for (index_t c = 0; c < C; ++c) {
        double want = 0, wg = 0;
        for (index_t r = 0; r < R; ++r) want += x[r * C + c], wg += x[r * C + c] * h[r * C + c];
        CHECK(s[c] == doctest::Approx(2 + want).epsilon(1e-5).scale(10));
        CHECK(db[c] == doctest::Approx(want).epsilon(1e-5).scale(10));
        CHECK(dg[c] == doctest::Approx(wg).epsilon(1e-5).scale(10));
        CHECK(rg[c] == doctest::Approx(3 + wg).epsilon(1e-5).scale(10));
      }
    }
}

namespace {
// A host_buffers set copied into a device backend's memory, and back.
struct placed_buffers {
  backend_ref be;
  std::vector<tensor<float>> f;
  tensor<std::int32_t> labels, tokens;
  tensor<double> rowd;
  placed_buffers(backend_ref b, kc::host_buffers& h) : be(b) {
    const place_scope on(be.memory());
    for (auto* v : h.floats()) {
      f.emplace_back(whale::shape{static_cast<index_t>(v->size())});
      be.copy(f.back().data(), v->data(), v->size() * sizeof(float));
    }
    labels = tensor<std::int32_t>({kc::R});
    tokens = tensor<std::int32_t>({kc::R});
    rowd = tensor<double>({kc::R});
    be.copy(labels.data(), h.labels.data(), h.labels.size() * 4);
    be.copy(tokens.data(), h.tokens.data(), h.tokens.size() * 4);
    be.copy(rowd.data(), h.rowd.data(), h.rowd.size() * 8);
  }
  kc::buffers ptrs() {
    return {f[0].data(), f[1].data(), f[2].data(), f[3].data(), f[4].data(), f[5].data(), labels.data(),
            tokens.data(), rowd.data()};
  }
  void to_host(kc::host_buffers& h) {
    auto hv = h.floats();
    for (std::size_t i = 0; i < hv.size(); ++i) be.copy(hv[i]->data(), f[i].data(), hv[i]->size() * sizeof(float));
    be.copy(h.rowd.data(), rowd.data(), h.rowd.size() * 8);
  }
};
}  // namespace

TEST_CASE("the guarded backend runs every kernel in the device's shape, bit-equal to the CPU backend") {
  guarded_backend g;
  int cases = 0;
  kc::for_each_case([&](const char* name, index_t n, auto make) {
    ++cases;
    kc::host_buffers on_cpu, on_device;
    kc::run(cpu_backend{}, n, make(on_cpu.ptrs()));
    {
      placed_buffers d(backend_ref(g), on_device);
      kc::run(backend_ref(g), n, make(d.ptrs()));
      d.to_host(on_device);
    }
    auto c = on_cpu.floats(), d = on_device.floats();
    for (std::size_t i = 0; i < c.size(); ++i) {
      INFO(name << ", buffer " << i);
      CHECK(*c[i] == *d[i]);
    }
    CHECK(on_cpu.rowd == on_device.rowd);
  });
  CHECK(cases == 76);
}

TEST_CASE("attention as one call: a plain reference's outputs, log-sum-exps and gradients; the device's bits") {
  struct shape_case {
    index_t B, T, H, hd;
  };
  for (const auto [B, T, H, hd] : {shape_case{1, 1, 1, 4}, shape_case{2, 5, 3, 7}, shape_case{3, 16, 2, 8}}) {
    INFO("B " << B << ", T " << T << ", H " << H << ", hd " << hd);
    const index_t W = H * hd, R = B * T;
    const auto qkv = values(R * 3 * W, 71, -1.f, 1.f), dout = values(R * W, 73, -1.f, 1.f);
    std::vector<float> o(static_cast<std::size_t>(R * W)), lse(static_cast<std::size_t>(B * H * T)),
        dqkv(static_cast<std::size_t>(R * 3 * W));
    const backend_ref cpu;
    cpu.attention_forward(B, T, H, hd, qkv.data(), o.data(), lse.data());
    cpu.attention_backward(B, T, H, hd, qkv.data(), o.data(), lse.data(), dout.data(), dqkv.data());

    // the plain reference in double: per sequence, head and query, over its visible keys
    std::vector<double> ro(o.size()), rl(lse.size()), rd(dqkv.size());
    const double sc = 1.0 / std::sqrt(static_cast<double>(hd));
    auto at = [&](index_t b, index_t t, index_t part, index_t h, index_t d) {
      return static_cast<std::size_t>((b * T + t) * 3 * W + part * W + h * hd + d);
    };
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        std::vector<double> p(static_cast<std::size_t>(T * T), 0.0), dp(p.size(), 0.0);
        for (index_t i = 0; i < T; ++i) {
          double m = -INFINITY, sum = 0;
          for (index_t j = 0; j <= i; ++j) {
            double s = 0;
            for (index_t d = 0; d < hd; ++d) s += static_cast<double>(qkv[at(b, i, 0, h, d)]) * qkv[at(b, j, 1, h, d)];
            p[static_cast<std::size_t>(i * T + j)] = s * sc;
            m = std::fmax(m, s * sc);
          }
          for (index_t j = 0; j <= i; ++j) sum += std::exp(p[static_cast<std::size_t>(i * T + j)] - m);
          rl[static_cast<std::size_t>((b * H + h) * T + i)] = m + std::log(sum);
          for (index_t j = 0; j <= i; ++j) {
            auto& pij = p[static_cast<std::size_t>(i * T + j)];
            pij = std::exp(pij - m) / sum;
          }
          for (index_t d = 0; d < hd; ++d) {
            double acc = 0;
            for (index_t j = 0; j <= i; ++j) acc += p[static_cast<std::size_t>(i * T + j)] * qkv[at(b, j, 2, h, d)];
            ro[static_cast<std::size_t>((b * T + i) * W + h * hd + d)] = acc;
          }
        }
        auto dO = [&](index_t i, index_t d) { return static_cast<double>(dout[static_cast<std::size_t>((b * T + i) * W + h * hd + d)]); };
        for (index_t i = 0; i < T; ++i) {
          double dot = 0;
          for (index_t j = 0; j <= i; ++j) {
            double g = 0;
            for (index_t d = 0; d < hd; ++d) g += dO(i, d) * qkv[at(b, j, 2, h, d)];
            dp[static_cast<std::size_t>(i * T + j)] = g;
            dot += g * p[static_cast<std::size_t>(i * T + j)];
          }
          for (index_t j = 0; j <= i; ++j) {
            const double pij = p[static_cast<std::size_t>(i * T + j)];
            const double ds = pij * (dp[static_cast<std::size_t>(i * T + j)] - dot) * sc;
            for (index_t d = 0; d < hd; ++d) {
              rd[at(b, i, 0, h, d)] += ds * qkv[at(b, j, 1, h, d)];
              rd[at(b, j, 1, h, d)] += ds * qkv[at(b, i, 0, h, d)];
              rd[at(b, j, 2, h, d)] += pij * dO(i, d);
            }
          }
        }
      }
    auto worst = [](const std::vector<float>& x, const std::vector<double>& ref) {  // normalised per tensor
      double scale = 1, e = 0;
      for (const double r : ref) scale = std::fmax(scale, std::fabs(r));
      for (std::size_t i = 0; i < x.size(); ++i) e = std::fmax(e, std::fabs(x[i] - ref[i]));
      return e / scale;
    };
    CHECK(worst(o, ro) < 1e-5);
    CHECK(worst(lse, rl) < 1e-5);
    CHECK(worst(dqkv, rd) < 1e-5);

    // the device's steps, on the guarded backend: the CPU's bits, 5 calls forward and 9 backward, and
    // nothing left allocated by them (the scores lived only inside each call)
    {
      guarded_backend g;
      const backend_ref be(g);
      std::vector<float> o2(o.size()), lse2(lse.size()), dqkv2(dqkv.size());
      {
        const place_scope on(be.memory());
        tensor<float> d_qkv({R * 3 * W}), d_dout({R * W}), d_o({R * W}), d_lse({B * H * T}), d_dqkv({R * 3 * W});
        be.copy(d_qkv.data(), qkv.data(), qkv.size() * 4);
        be.copy(d_dout.data(), dout.data(), dout.size() * 4);
        const auto in_use = g.allocator().bytes_in_use;
        g.ledger().clear();
        be.attention_forward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data());
        CHECK(g.ledger().launches() == 5);
        be.attention_backward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data(), d_dout.data(), d_dqkv.data());
        CHECK(g.ledger().launches() == 14);
        CHECK(g.ledger().batched_gemms == 7);
        CHECK(g.allocator().bytes_in_use == in_use);
        be.copy(o2.data(), d_o.data(), o2.size() * 4);
        be.copy(lse2.data(), d_lse.data(), lse2.size() * 4);
        be.copy(dqkv2.data(), d_dqkv.data(), dqkv2.size() * 4);
      }
      CHECK(o2 == o);
      CHECK(lse2 == lse);
      CHECK(dqkv2 == dqkv);
    }

    // the fused call a GPU with cuDNN makes under bf16, modelled: a pack, the call and an unpack forward;
    // three packs, the call and an unpack backward; the results those of bf16 operands, within bf16's
    // rounding of the fp32 steps' (and the steps again when the step is not bf16)
    guarded_backend f;
    f.set_fused_attention(true);
    const backend_ref fe(f);
    std::vector<float> o3(o.size()), lse3(lse.size()), dqkv3(dqkv.size());
    {
      const place_scope on(fe.memory());
      tensor<float> d_qkv({R * 3 * W}), d_dout({R * W}), d_o({R * W}), d_lse({B * H * T}), d_dqkv({R * 3 * W});
      fe.copy(d_qkv.data(), qkv.data(), qkv.size() * 4);
      fe.copy(d_dout.data(), dout.data(), dout.size() * 4);
      f.ledger().clear();
      fe.attention_forward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data(), true);
      CHECK(f.ledger().attention_calls == 1);
      CHECK(f.ledger().launches() == 3);
      fe.attention_backward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data(), d_dout.data(), d_dqkv.data(), true);
      CHECK(f.ledger().attention_calls == 2);
      CHECK(f.ledger().launches() == 8);
      CHECK(f.ledger().attention_flops == doctest::Approx(7.0 * B * H * T * T * hd));
      fe.copy(o3.data(), d_o.data(), o3.size() * 4);
      fe.copy(lse3.data(), d_lse.data(), lse3.size() * 4);
      fe.copy(dqkv3.data(), d_dqkv.data(), dqkv3.size() * 4);
      f.ledger().clear();
      fe.attention_forward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data(), false);
      CHECK(f.ledger().attention_calls == 0);
      CHECK(f.ledger().launches() == 5);

      // with the caller's kept buffer: the same bits, and a backward that packs only d(o) and reads
      // Q, K, V from that buffer (qkv is zeroed between the calls, and the gradients do not change)
      CHECK(fe.attention_packed_floats(R, W, true) == R * 2 * W);
      CHECK(fe.attention_packed_floats(R, W, false) == 0);
      CHECK(backend_ref{}.attention_packed_floats(R, W, true) == 0);
      tensor<float> kept({fe.attention_packed_floats(R, W, true)});
      std::vector<float> o4(o.size()), dqkv4(dqkv.size());
      f.ledger().clear();
      fe.attention_forward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data(), true, kept.data());
      CHECK(f.ledger().launches() == 3);
      fe.fill_zero(d_qkv.data(), static_cast<std::size_t>(d_qkv.numel()) * 4);
      f.ledger().clear();
      fe.attention_backward(B, T, H, hd, d_qkv.data(), d_o.data(), d_lse.data(), d_dout.data(), d_dqkv.data(), true,
                            kept.data());
      CHECK(f.ledger().attention_calls == 1);
      CHECK(f.ledger().launches() == 3);  // pack d(o), the call, unpack d(qkv)
      fe.copy(o4.data(), d_o.data(), o4.size() * 4);
      fe.copy(dqkv4.data(), d_dqkv.data(), dqkv4.size() * 4);
      CHECK(o4 == o3);
      CHECK(dqkv4 == dqkv3);
    }
    auto as_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
    CHECK(worst(o3, as_double(o)) < 2e-2);
    CHECK(worst(lse3, as_double(lse)) < 2e-2);
    CHECK(worst(dqkv3, as_double(dqkv)) < 3e-2);
    for (const float x : o3) CHECK(x == kernels::round_bf16(x));  // stored in bf16
  }
}

TEST_CASE("LayerNorm's backward with its parameter sums in one pass: the device's bits, the plain pass's d(input), sums in double") {
  // tiles of kernels::summing_tile rows, one team each: no row, part of a tile, tiles and one; one to gpt's width
  for (const index_t R : {0, 1, 7, 8, 9, 200})
    for (const index_t D : {1, 7, 300, 1024}) {
      for (const bool round : {false, true}) {
        INFO(R << " rows of " << D << ", bf16 " << round);
        const auto x = values(R * D, 61), dy = values(R * D, 62), g = values(D, 63), add = values(R * D, 64);
        std::vector<float> mean(static_cast<std::size_t>(R)), rstd(static_cast<std::size_t>(R));
        for (index_t r = 0; r < R; ++r) mean[r] = 0.1f * static_cast<float>(r % 5), rstd[r] = 0.5f + 0.25f * static_cast<float>(r % 3);
        const float* a = round ? add.data() : nullptr;
        // the CPU backend
        std::vector<float> dx(static_cast<std::size_t>(R * D), 0.f), dg(static_cast<std::size_t>(D), 1.f), db(dg);
        {
          const backend_ref be;
          const kernels::layer_norm_backward row{dy.data(), nullptr, rstd.data(), g.data(), dx.data(), D, round, a,
                                                 x.data(), mean.data()};
          be.launch_summing(R, kernels::layer_norm_backward_sums{row, nullptr, R},
                            kernels::layer_norm_param_grads{dy.data(), nullptr, dg.data(), db.data(), R, D, true, round,
                                                            x.data(), mean.data(), rstd.data()});
        }
        // the device's path (staged rows and slots, the finish's teams) on the guarded backend
        std::vector<float> gdx(dx.size(), 0.f), gdg(static_cast<std::size_t>(D), 1.f), gdb(gdg);
        {
          guarded_backend gb;
          const backend_ref be(gb);
          const place_scope on(be.memory());
          tensor<float> t_x({R * D + 1}), t_dy({R * D + 1}), t_g({D}), t_add({R * D + 1}), t_m({R + 1}), t_r({R + 1}),
              t_dx({R * D + 1}), t_dg({D}), t_db({D});
          auto up = [&](tensor<float>& t, const std::vector<float>& v) { be.copy(t.data(), v.data(), v.size() * 4); };
          up(t_x, x), up(t_dy, dy), up(t_g, g), up(t_add, add), up(t_m, mean), up(t_r, rstd), up(t_dg, gdg), up(t_db, gdb);
          const kernels::layer_norm_backward row{t_dy.data(), nullptr, t_r.data(), t_g.data(), t_dx.data(), D, round,
                                                 round ? t_add.data() : nullptr, t_x.data(), t_m.data()};
          be.launch_summing(R, kernels::layer_norm_backward_sums{row, nullptr, R},
                            kernels::layer_norm_param_grads{t_dy.data(), nullptr, t_dg.data(), t_db.data(), R, D, true,
                                                            round, t_x.data(), t_m.data(), t_r.data()});
          be.copy(gdx.data(), t_dx.data(), gdx.size() * 4);
          be.copy(gdg.data(), t_dg.data(), gdg.size() * 4);
          be.copy(gdb.data(), t_db.data(), gdb.size() * 4);
          if (R > 0) {
            const auto& l = gb.ledger();
            CHECK(l.kernels.at("norm_backward_sums<layer_norm_backward>").threads_min == kernels::summing_tiles(R) * 32);
            CHECK(l.kernels.at("column_tile_finish<layer_norm_param_grads>").threads_min ==
                  (D + kernels::finish_columns - 1) / kernels::finish_columns * 256);
          }
        }
        CHECK(gdx == dx);
        CHECK(gdg == dg);
        CHECK(gdb == db);
        // d(input): the plain row pass's bits
        std::vector<float> plain(dx.size(), 0.f);
        cpu::launch(R, kernels::layer_norm_backward{dy.data(), nullptr, rstd.data(), g.data(), plain.data(), D, round, a,
                                                    x.data(), mean.data()});
        CHECK(plain == dx);
        // the sums against double
        for (index_t c = 0; c < D; ++c) {
          double sg = 1, sb = 1;
          for (index_t r = 0; r < R; ++r) {
            const double gy = round ? kernels::round_bf16(dy[r * D + c]) : dy[r * D + c];
            sg += gy * ((x[r * D + c] - mean[r]) * rstd[r]);
            sb += gy;
          }
          CHECK(dg[c] == doctest::Approx(sg).epsilon(1e-5).scale(10));
          CHECK(db[c] == doctest::Approx(sb).epsilon(1e-5).scale(10));
        }
      }
    }
  // the sums only (no d(input) asked): the same sums
  const index_t R = 40, D = 33;
  const auto x = values(R * D, 71), dy = values(R * D, 72), g = values(D, 73);
  std::vector<float> mean(static_cast<std::size_t>(R), 0.2f), rstd(static_cast<std::size_t>(R), 1.5f), dx(static_cast<std::size_t>(R * D));
  std::vector<float> dg[2], db[2];
  for (int only = 0; only < 2; ++only) {
    dg[only].assign(static_cast<std::size_t>(D), 0.f), db[only].assign(static_cast<std::size_t>(D), 0.f);
    const kernels::layer_norm_backward row{dy.data(), nullptr, rstd.data(), g.data(), only ? nullptr : dx.data(), D, false,
                                           nullptr, x.data(), mean.data()};
    backend_ref().launch_summing(R, kernels::layer_norm_backward_sums{row, nullptr, R},
                                 kernels::layer_norm_param_grads{dy.data(), nullptr, dg[only].data(), db[only].data(), R, D,
                                                                 false, false, x.data(), mean.data(), rstd.data()});
  }
  CHECK(dg[0] == dg[1]);
  CHECK(db[0] == db[1]);
}

TEST_CASE("RMSNorm's backward with its gain's sums in one pass: the device's bits, the plain pass's d(input), sums in double") {
  // 3,000 wide: the three slots do not fit an H200 block, so the running sums stay in the partials
  CHECK(!kernels::stage_fits(kernels::rms_norm_backward_sums::staged_rows, 3000));
  for (const index_t R : {0, 1, 9, 200})
    for (const index_t D : {1, 300, 1024, 3000})
      for (const int mode : {0, 1, 2}) {  // bf16 with an addend; fp32; fp32, the sums only
        if (D == 3000 && R == 200) continue;
        const bool round = mode == 0, only = mode == 2;
        INFO(R << " rows of " << D << ", mode " << mode);
        const auto xh = values(R * D, 81), dy = values(R * D, 82), g = values(D, 83), add = values(R * D, 84);
        std::vector<float> rstd(static_cast<std::size_t>(R), 0.75f);
        auto pass = [&](const backend_ref& be, const float* pdy, const float* pxh, const float* prs, const float* pg,
                        const float* padd, float* pdx, float* pdg) {
          const kernels::rms_norm_backward row{pdy, pxh, prs, pg, only ? nullptr : pdx, D, round, round ? padd : nullptr};
          be.launch_summing(R, kernels::rms_norm_backward_sums{row, nullptr, R},
                            kernels::rms_norm_param_grads{pdy, pxh, pdg, R, D, true, round});
        };
        std::vector<float> dx(static_cast<std::size_t>(R * D), 0.f), dg(static_cast<std::size_t>(D), 1.f);
        pass(backend_ref{}, dy.data(), xh.data(), rstd.data(), g.data(), add.data(), dx.data(), dg.data());
        std::vector<float> gdx(dx.size(), 0.f), gdg(static_cast<std::size_t>(D), 1.f);
        {
          guarded_backend gb;
          const backend_ref be(gb);
          const place_scope on(be.memory());
          tensor<float> t_xh({R * D + 1}), t_dy({R * D + 1}), t_g({D}), t_add({R * D + 1}), t_r({R + 1}), t_dx({R * D + 1}),
              t_dg({D});
          auto up = [&](tensor<float>& t, const std::vector<float>& v) { be.copy(t.data(), v.data(), v.size() * 4); };
          up(t_xh, xh), up(t_dy, dy), up(t_g, g), up(t_add, add), up(t_r, rstd), up(t_dg, gdg), up(t_dx, gdx);
          pass(be, t_dy.data(), t_xh.data(), t_r.data(), t_g.data(), t_add.data(), t_dx.data(), t_dg.data());
          be.copy(gdx.data(), t_dx.data(), gdx.size() * 4);
          be.copy(gdg.data(), t_dg.data(), gdg.size() * 4);
        }
        CHECK(gdx == dx);
        CHECK(gdg == dg);
        std::vector<float> plain(dx.size(), 0.f);
        if (!only)
          cpu::launch(R, kernels::rms_norm_backward{dy.data(), xh.data(), rstd.data(), g.data(), plain.data(), D, round,
                                                    round ? add.data() : nullptr});
        CHECK(plain == dx);  // zeros where only the sums were asked for
        for (index_t c = 0; c < D; ++c) {
          double want = 1;
          for (index_t r = 0; r < R; ++r)
            want += static_cast<double>(round ? kernels::round_bf16(dy[r * D + c]) : dy[r * D + c]) * xh[r * D + c];
          CHECK(dg[c] == doctest::Approx(want).epsilon(1e-5).scale(10));
        }
      }
}

TEST_CASE("an embedding's scatter-add: the device's stripes give the CPU's column blocks' bits") {
  // 300 gradient rows of width 70 onto a table of 40 rows, tokens repeating; the whole table and a slice
  const index_t R = 300, D = 70, V = 40;
  const auto dy = values(R * D, 51);
  std::vector<std::int32_t> tokens(R);
  for (index_t r = 0; r < R; ++r) tokens[r] = static_cast<std::int32_t>((r * r + 3 * r) % V);
  for (const index_t first : {index_t{0}, index_t{12}}) {
    const index_t held = first ? 17 : -1;
    std::vector<float> on_cpu(static_cast<std::size_t>(V * D), 0.5f);
    backend_ref().scatter_add(kernels::scatter_add_rows{dy.data(), tokens.data(), on_cpu.data(), R, D, 0, first, held});
    std::vector<float> on_device(on_cpu.size(), 0.5f);
    {
      guarded_backend g;
      const backend_ref be(g);
      const place_scope on(be.memory());
      tensor<float> d_dy({R * D}), d_table({V * D});
      tensor<std::int32_t> d_tok({R});
      be.copy(d_dy.data(), dy.data(), dy.size() * 4);
      be.copy(d_tok.data(), tokens.data(), tokens.size() * 4);
      be.copy(d_table.data(), on_device.data(), on_device.size() * 4);
      be.scatter_add(kernels::scatter_add_rows{d_dy.data(), d_tok.data(), d_table.data(), R, D, 0, first, held});
      CHECK(g.ledger().kernels.at("scatter_add_stripes").threads_min == kernels::scatter_add_stripes::stripes_for(D) * D);
      be.copy(on_device.data(), d_table.data(), on_device.size() * 4);
    }
    INFO("first " << first);
    CHECK(on_device == on_cpu);
    double worst = 0;  // and against the sums in double
    for (index_t t = 0; t < V; ++t)
      for (index_t c = 0; c < D; ++c) {
        const index_t row = t - first;
        if (held >= 0 && (row < 0 || row >= held)) continue;
        double want = 0.5;
        for (index_t r = 0; r < R; ++r) want += tokens[r] == t ? dy[r * D + c] : 0.0;
        worst = std::fmax(worst, std::fabs(on_cpu[row * D + c] - want));
      }
    CHECK(worst < 1e-4);
  }
}

TEST_CASE("the device ledger: each launch with its kernel, threads and declared bytes; GEMMs, copies, fills, waits") {
  guarded_backend g;
  const backend_ref be(g);
  kc::host_buffers h;
  {
    placed_buffers d(be, h);
    g.ledger().clear();
    auto p = d.ptrs();
    be.launch(kc::R, kernels::layer_norm_forward{p.a, p.b, p.c, p.f, p.e, p.d, kc::C, 1e-5f});  // 37 warps
    be.launch(kc::N, kernels::gelu_forward{p.a, p.f});
    be.sum_rows(p.a, p.f, kc::R, kc::C, false);                      // one tile: one phase
    be.reduce_columns(kernels::column_sums{p.a, p.f, kc::N / 20, 20, false});  // 9 tiles: two phases
    be.gemm(trans::no, trans::yes, 4, 5, 6, 1.f, p.a, p.b, 0.f, p.f);
    be.gemm_strided_batched(trans::no, trans::no, 2, 3, 4, 1.f, p.a, 4, 8, p.b, 3, 12, 0.f, p.f, 3, 6, 5);
    std::vector<float> back(10);
    be.copy(back.data(), p.a, 40);
    be.synchronize();
    const auto& l = g.ledger();
    CHECK(l.kernel_launches == 5);
    CHECK(l.gemms == 1);
    CHECK(l.batched_gemms == 1);
    CHECK(l.gemm_flops == 2.0 * 4 * 5 * 6);
    CHECK(l.batched_gemm_flops == 2.0 * 2 * 3 * 4 * 5);
    CHECK(l.device_to_host == 1);
    CHECK(l.host_syncs == 1);
    CHECK(l.launches() == 8);
    const auto& ln = l.kernels.at("layer_norm_forward");
    CHECK(ln.launches == 1);
    CHECK(ln.threads_min == kc::R * 32);
    // every pass over a row counted: x twice, then x in and x-hat, y out, and 1/std; gain, bias, and gain again
    CHECK(ln.bytes == kc::R * (3 * kc::C * 4 + 4) + 3 * kc::C * 4);  // x staged: read once
    CHECK(ln.underfilled == 1);  // 37 warps cannot fill a GPU
    CHECK(l.kernels.at("column_one_tile<column_sums>").threads_min == kc::C);
    CHECK(l.kernels.at("column_tile_sums<column_sums>").threads_min == 9 * 20);
    CHECK(l.kernels.at("column_tile_finish<column_sums>").launches == 1);
    CHECK(l.kernels.at("gelu_forward").bytes == kc::N * 8);
    CHECK(l.undeclared_launches == 0);
  }
}

TEST_CASE("count_only: the same ledger as a computed run, and no arithmetic done") {
  kc::host_buffers h;
  device_ledger computed, counted;
  std::vector<float> after_count;
  for (const bool count : {false, true}) {
    guarded_backend g;
    const backend_ref be(g);
    placed_buffers d(be, h);
    g.ledger().clear();
    g.set_count_only(count);
    auto p = d.ptrs();
    be.launch(kc::R, kernels::layer_norm_forward{p.a, p.b, p.c, p.f, p.e, p.d, kc::C, 1e-5f});
    be.reduce_columns(kernels::layer_norm_param_grads{p.a, p.b, p.f, p.e, kc::N / 20, 20, false});
    be.gemm(trans::no, trans::yes, 4, 5, 6, 1.f, p.a, p.b, 0.f, p.f);
    g.set_count_only(false);
    std::vector<float> out(kc::N);
    be.copy(out.data(), p.f, out.size() * 4);
    (count ? counted : computed) = g.ledger();
    if (count) after_count = out;
  }
  CHECK(counted.launches() == computed.launches());
  CHECK(counted.kernel_bytes == computed.kernel_bytes);
  CHECK(counted.gemm_flops == computed.gemm_flops);
  CHECK(counted.kernels.size() == computed.kernels.size());
  CHECK(after_count == h.f);  // nothing was written: f still holds its initial zeros
}

namespace {
// One counted training step of a GPT of L blocks, 8 sequences of 16, as the trainer runs it with
// log_every > 1 (steady_step_ledger). bf16: under bf16 mixed precision, on a device whose attention is
// fused (cuDNN's, modelled). Each layer's bias gradient comes from its weight GEMM's epilogue.
template <std::size_t L> device_ledger gpt_step_ledger(bool bf16 = false) {
  guarded_backend g;
  g.set_count_only(true);
  g.set_fused_attention(bf16);
  g.set_fused_bias_grads(true);  // cuBLASLt's BGRADB, as the CUDA backend runs the weight gradients
  network<models::gpt_model<64, 16, 32, 2, 64, L>> net(seed{1}, backend_ref(g), bf16 ? precision::bf16 : precision::fp32);
  markov_data data(seed{3}, 64, 16, 8);
  trainer_options o;
  o.progress = false;
  o.max_grad_norm = 1.0;
  o.log_every = 100;
  trainer t(net, adamw{.lr = 1e-3f}, o);
  return steady_step_ledger(g, t, data);
}
}  // namespace

// A ratchet, not the goal: the goal (issue 38) is 0 host waits and at most 40
// launches per block. These bounds fail when a change adds a wait or a launch.
TEST_CASE("a GPT step's ledger: launches per block and host waits do not grow") {
  const auto one = gpt_step_ledger<1>(), two = gpt_step_ledger<2>();
  const auto per_block = two.launches() - one.launches();
  MESSAGE("launches per block " << per_block << ", per step of 2 blocks " << two.launches() << ", host waits "
                                << two.host_syncs << ", device-to-host copies " << two.device_to_host);
  CHECK(per_block <= 36);  // 44 before Q, K, V's bias and GELU rode on the GEMMs, 38 before LayerNorm's sums joined its backward
  CHECK(two.host_syncs == 0);  // the loss, the norm and the clipping scale stay on the device
  CHECK(two.device_to_host == 0);
  CHECK(two.undeclared_launches == 0);  // every kernel declares its bytes
  CHECK(two.underfilled_launches > 0);  // at this toy size most launches are small: counted, not hidden

  // bf16 with the fused attention: 2 attention calls a block; the kernels that produce a layer's
  // output store it rounded; the residuals' sums are stored by the kernels at their branches' ends
  const auto one16 = gpt_step_ledger<1>(true), two16 = gpt_step_ledger<2>(true);
  const auto per_block16 = two16.launches() - one16.launches();
  MESSAGE("bf16 with fused attention: launches per block " << per_block16 << ", host waits " << two16.host_syncs);
  CHECK(two16.attention_calls - one16.attention_calls == 2);
  CHECK(per_block16 <= 24);  // the goal is at most 40 launches a block, forward and backward together
  // LayerNorm's parameter sums in its backward's pass (no column_tile_sums of their own), the tiles added once
  CHECK(two16.kernels.count("column_tile_sums<layer_norm_param_grads>") == 0);
  CHECK(two16.kernels.at("norm_backward_sums<layer_norm_backward>").launches - one16.kernels.at("norm_backward_sums<layer_norm_backward>").launches == 2);
  // in the GEMMs' calls: Q, K, V's bias and the first MLP linear's with GELU, GELU's gradient in the second's
  // d(input); the two linears that end a residual leave its sum to the layer norm after it
  CHECK(two16.bias_epilogues - one16.bias_epilogues == 2);
  CHECK(two16.gelu_epilogues - one16.gelu_epilogues == 2);
  CHECK(two16.kernels.count("gelu_forward") + two16.kernels.count("gelu_backward") == 0);
  const auto launches_of = [](const device_ledger& l, const char* k) { return l.kernels.count(k) ? l.kernels.at(k).launches : 0; };
  CHECK(launches_of(two16, "bias_rows") - launches_of(one16, "bias_rows") == 0);
  CHECK(two16.kernels.count("add") == 0);  // the residuals' sums are stored by their branches' kernels
  // a GEMM's d(input) is rounded as layer norm's or GELU's backward reads it: no rounding pass in a block
  CHECK(launches_of(two16, "to_bf16") - launches_of(one16, "to_bf16") == 0);
  // none at all: the embeddings store their rows rounded, and the position embedding's d(input) too
  CHECK(launches_of(two16, "to_bf16") == 0);
  CHECK(two16.host_syncs == 0);
}
