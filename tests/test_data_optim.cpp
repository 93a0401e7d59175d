// Synthetic data (pure functions of seed, step and sample index) and optimizers.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data.hpp"

using namespace whale;

TEST_CASE("teacher_data: any slice equals the same rows of the full batch") {
  teacher_data d(seed{3}, 16, 10, 8);
  auto full = d.get(5, 0, 8);
  std::vector<float> x(full.inputs.begin(), full.inputs.end());
  std::vector<int> y(full.labels.begin(), full.labels.end());
  teacher_data e(seed{3}, 16, 10, 8);
  auto part = e.get(5, 3, 4);
  for (index_t i = 0; i < 4 * 16; ++i) CHECK(part.inputs[i] == x[static_cast<std::size_t>(3 * 16 + i)]);
  for (index_t i = 0; i < 4; ++i) CHECK(part.labels[i] == y[static_cast<std::size_t>(3 + i)]);
  auto other = e.get(6, 0, 8);
  CHECK(other.inputs[0] != x[0]);
  CHECK_THROWS_AS(e.get(0, 6, 4), std::out_of_range);
}

TEST_CASE("markov_data: labels are the next tokens and follow the chain") {
  markov_data d(seed{1}, 50, 12, 4, 8);
  auto b = d.get(2, 0, 4);
  for (index_t r = 0; r < 4; ++r)
    for (index_t t = 0; t + 1 < 12; ++t) CHECK(b.labels[r * 12 + t] == b.inputs[r * 12 + t + 1]);
  markov_data e(seed{1}, 50, 12, 4, 8);
  auto p = e.get(2, 2, 2);
  for (index_t i = 0; i < 2 * 12; ++i) CHECK(p.inputs[i] == b.inputs[2 * 12 + i]);
  // each token has at most 8 distinct successors
  std::vector<std::vector<int>> succ(50);
  for (int step = 0; step < 20; ++step) {
    auto q = e.get(step, 0, 4);
    for (index_t i = 0; i < 4 * 12; ++i) succ[static_cast<std::size_t>(q.inputs[i])].push_back(q.labels[i]);
  }
  for (auto& s : succ) {
    std::sort(s.begin(), s.end());
    s.erase(std::unique(s.begin(), s.end()), s.end());
    CHECK(s.size() <= 8);
  }
}

TEST_CASE("sgd with momentum matches the PyTorch recurrence") {
  sgd opt{.lr = 0.1f, .momentum = 0.9f};
  tensor<float> p({2}), g({2});
  p[0] = 1.f; p[1] = -2.f;
  auto st = opt.make_state(2);
  float buf = 0.f, ref = 1.f;
  for (int k = 0; k < 3; ++k) {
    g[0] = 0.5f * static_cast<float>(k + 1);
    g[1] = 0.f;
    opt.update(st, p, g);
    buf = k == 0 ? g[0] : 0.9f * buf + g[0];
    ref -= 0.1f * buf;
    CHECK(p[0] == doctest::Approx(ref).epsilon(1e-6));
  }
  CHECK(p[1] == -2.f);
}

TEST_CASE("adamw: first step moves each parameter by lr against the gradient sign") {
  adamw opt{.lr = 0.01f, .weight_decay = 0.f};
  tensor<float> p({3}), g({3});
  g[0] = 3.f; g[1] = -0.001f; g[2] = 0.f;
  auto st = opt.make_state(3);
  opt.update(st, p, g);
  CHECK(p[0] == doctest::Approx(-0.01f).epsilon(1e-4));
  CHECK(p[1] == doctest::Approx(0.01f).epsilon(1e-3));
  CHECK(p[2] == 0.f);
}

TEST_CASE("clip_grad_norm scales to the maximum norm") {
  tensor<float> g({2});
  g[0] = 3.f; g[1] = 4.f;
  CHECK(clip_grad_norm(g, 1.0) == doctest::Approx(5.0));
  CHECK(std::sqrt(g[0] * g[0] + g[1] * g[1]) == doctest::Approx(1.0).epsilon(1e-4));
  CHECK(clip_coefficient(0.5, 1.0) == 1.f);
}

TEST_CASE("an update that writes its change (update_delta) gives the same weights, and the change a snapshot would give, bit for bit") {
  // sgd plain, sgd with momentum and adamw, 3 steps each, under a gate that scales
  // the gradients; one run updates plainly and takes (after - before) x k from a
  // snapshot (scaled_difference), the other writes the change in the same pass
  constexpr index_t n = 37;  // not a multiple of any vector width
  auto run = [&](const auto& opt) {
    tensor<float> p0({n}), p1({n}), g({n}), snap({n}), want({n}), got({n});
    for (index_t i = 0; i < n; ++i) {
      p0[i] = p1[i] = 0.3f * std::sin(0.7f * static_cast<float>(i)) - 0.01f * static_cast<float>(i);
    }
    auto s0 = opt.make_state(n);
    auto s1 = opt.make_state(n);
    double scale = 1.7, halt = 0;
    const float k = 0.3125f + 1e-3f;
    for (int step = 0; step < 4; ++step) {
      for (index_t i = 0; i < n; ++i) g[i] = std::cos(0.37f * static_cast<float>(i * (step + 2))) * (i % 5 == 0 ? 1e-3f : 1.f);
      halt = step == 2 ? 3 : 0;  // a halted step changes nothing: its change is 0
      std::copy_n(p0.data(), n, snap.data());
      opt.update(s0, p0.v(), g.v(), backend_ref{}, kernels::update_gate{&scale, &halt});
      cpu::launch(n, kernels::scaled_difference{p0.data(), snap.data(), want.data(), k});
      opt.update(s1, p1.v(), g.v(), backend_ref{}, kernels::update_gate{&scale, &halt}, nullptr,
                 kernels::update_delta{got.data(), k});
      for (index_t i = 0; i < n; ++i) {
        CHECK(p1[i] == p0[i]);
        CHECK(got[i] == want[i]);
        if (step == 2) CHECK(got[i] == 0.f);
      }
    }
  };
  run(sgd{.lr = 0.05f});
  run(sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.01f});
  run(adamw{.lr = 1e-2f, .weight_decay = 0.01f});
  // a change asked for without a gate is an error that names both
  sgd opt{.lr = 0.05f};
  tensor<float> p({4}), g({4}), d({4});
  auto st = opt.make_state(4);
  CHECK_THROWS_WITH_AS(opt.update(st, p.v(), g.v(), backend_ref{}, {}, nullptr, kernels::update_delta{d.data(), 1.f}),
                       doctest::Contains("without a gate"), std::invalid_argument);
}
