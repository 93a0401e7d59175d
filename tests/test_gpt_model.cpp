// The `gpt` model type: parameter counts of the reference workload, a
// finite-difference check of a tiny GPT end to end, the causal property at the
// logits, repeat's law, no allocation after step 1, and a tiny GPT learning.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/tensor/memory.hpp"

using namespace whale;
using models::gpt;
using models::gpt_model;

namespace {
// Legend: V vocabulary, S max positions, D width, H heads, F FFN width, L blocks.
using tiny_gpt = gpt_model<11, 6, 8, 2, 16, 2>;   // for gradients and the causal check
using small_gpt = gpt_model<32, 16, 32, 2, 64, 2>;  // for training

step_ctx ctx(index_t batch, index_t seq) {
  step_ctx c;
  c.batch = batch;
  c.seq = seq;
  c.global_rows = batch * seq;
  return c;
}
}  // namespace

TEST_CASE("gpt: parameter counts of the reference workload") {
  static_assert(gpt::cost().params == 7'394'816);
  static_assert(gpt::non_embedding_params == 5'264'896);
  static_assert(gpt::embedding_params == 8192 * 256 + 128 * 256);
  static_assert(Loss<gpt>);
  static_assert(std::is_same_v<gpt::input_type, std::int32_t>);
  // model FLOPs per token: 6 x non-embedding params + attention 12 x L x T x D (workloads.md),
  // up to the elementwise layers (layer norms, gelu, residual adds, position add, biases)
  constexpr auto c = gpt::cost();
  const double gemm = 6.0 * gpt::non_embedding_params;
  CHECK(c.fwd_flops + c.bwd_flops >= gemm - 6.0 * 100000);  // biases are params but not GEMM FLOPs
  CHECK(c.fwd_flops + c.bwd_flops <= 1.02 * gemm);
  CHECK(3 * c.seq_flops == 12.0 * 4 * 256);

  network<gpt> net(seed{42});
  CHECK(net.param_count() == 7'394'816);
  std::ostringstream os;
  os << net;
  CHECK(os.str().find("transformer_block<256, 4, 1024>") != std::string::npos);
  CHECK(os.str().find("causal_self_attention<256, 4>") != std::string::npos);
}

TEST_CASE("gpt: one step of the reference model on a short batch starts near ln(vocab)") {
  network<gpt> net(seed{42});
  auto data = models::gpt_data(seed{7}, 2);
  auto b = data.get(0, 0, 1);
  // one sequence of 16 tokens is enough to run every layer
  tensor<std::int32_t> tok({1, 16}), lab({16});
  for (index_t i = 0; i < 16; ++i) {
    tok[i] = b.inputs[i];
    lab[i] = b.labels[i];
  }
  auto c = ctx(1, 16);
  const double loss = net.train_step(c, tok.v(), lab.v());
  CHECK(loss == doctest::Approx(std::log(8192.0)).epsilon(0.05));
  CHECK(cpu::all_finite(net.grads().numel(), net.grads().data()));
}

TEST_CASE("tiny gpt: every parameter's gradient matches finite differences") {
  // Same method and tolerance as test_gradcheck.cpp (central differences of the fp32
  // loss, worst error relative to the largest gradient entry < 1e-2), but h = 1e-3:
  // embeddings are N(0, 0.02) and the first LayerNorm divides them by their std
  // (~0.03), so a step of 1e-2 would leave the linear regime.
  network<tiny_gpt> net(seed{3});
  auto p = net.params();
  auto c = ctx(2, 5);
  tensor<std::int32_t> tok({2, 5}), lab({10});
  for (index_t i = 0; i < 10; ++i) {
    tok[i] = static_cast<std::int32_t>((7 * i + 3) % 11);
    lab[i] = static_cast<std::int32_t>((5 * i + 1) % 11);
  }
  net.train_step(c, tok.v(), lab.v());
  std::vector<double> an(net.grads().begin(), net.grads().end()), fd;
  const float h = 1e-3f;
  for (index_t i = 0; i < p.numel(); ++i) {
    const float saved = p[i];
    p[i] = saved + h;
    const double lp = net.evaluate(c, tok.v(), lab.v());
    p[i] = saved - h;
    const double lm = net.evaluate(c, tok.v(), lab.v());
    p[i] = saved;
    fd.push_back((lp - lm) / (2.0 * h));
  }
  double amax = 0, emax = 0;
  for (std::size_t i = 0; i < an.size(); ++i) {
    amax = std::max(amax, std::abs(an[i]));
    emax = std::max(emax, std::abs(an[i] - fd[i]));
  }
  INFO("largest gradient " << amax << ", worst error " << emax);
  CHECK(amax > 1e-3);
  CHECK(emax / amax < 1e-2);
}

TEST_CASE("tiny gpt: changing a later token leaves earlier logits unchanged") {
  network<tiny_gpt> net(seed{3});
  auto c = ctx(2, 6);
  tensor<std::int32_t> tok({2, 6});
  for (index_t i = 0; i < 12; ++i) tok[i] = static_cast<std::int32_t>((7 * i + 3) % 11);
  auto z0 = net.model().forward(c, tok.v());
  std::vector<float> before(z0.begin(), z0.end());
  tok[3] = (tok[3] + 5) % 11;  // sequence 0, token 3
  auto z1 = net.model().forward(c, tok.v());
  for (index_t r = 0; r < 12; ++r) {
    float diff = 0;
    for (index_t j = 0; j < 11; ++j)
      diff = std::max(diff, std::abs(z1[r * 11 + j] - before[static_cast<std::size_t>(r * 11 + j)]));
    INFO("row " << r);
    if (r < 3 || r >= 6) CHECK(diff == 0.f);
    else CHECK(diff > 0.f);
  }
}

TEST_CASE("repeat<N, B> equals sequential<B, ..., B> (same parameters, same outputs)") {
  using block = transformer_block<8, 2, 16>;
  using A = sequential<repeat<3, block>, linear<8, 5>, softmax_cross_entropy>;
  using B = sequential<sequential<block, block, block>, linear<8, 5>, softmax_cross_entropy>;
  static_assert(A::cost().params == B::cost().params);
  network<A> a(seed{9});
  network<B> b(seed{9});
  REQUIRE(a.param_count() == b.param_count());
  for (index_t i = 0; i < a.param_count(); ++i) REQUIRE(a.params()[i] == b.params()[i]);
  auto c = ctx(2, 4);
  tensor<float> x({8, 8});
  counter_rng r(seed{1});
  for (index_t i = 0; i < x.numel(); ++i) x[i] = static_cast<float>(r.normal(static_cast<std::uint64_t>(i)));
  tensor<std::int32_t> y({8});
  for (index_t i = 0; i < 8; ++i) y[i] = static_cast<std::int32_t>(i % 5);
  auto ca = c, cb = c;
  CHECK(a.train_step(ca, x.v(), y.v()) == b.train_step(cb, x.v(), y.v()));
  for (index_t i = 0; i < a.param_count(); ++i) CHECK(a.grads()[i] == b.grads()[i]);
}

TEST_CASE("small gpt: loss falls under SGD and steps after the first allocate nothing") {
  network<small_gpt> net(seed{42});
  markov_data data(seed{7}, small_gpt::vocab, 16, 8, 2);  // 2 successors: loss floor ln 2
  const sgd opt{.lr = 0.1f, .momentum = 0.9f};
  auto st = opt.make_state(net.param_count());
  std::vector<double> losses;
  std::int64_t allocs_after_first = 0;
  for (int s = 0; s < 40; ++s) {
    auto b = data.get(s, 0, 8);
    auto c = ctx(b.sequences, b.seq);
    losses.push_back(net.train_step(c, b.inputs, b.labels));
    opt.update(st, net.params(), net.grads());
    if (s == 0) allocs_after_first = memory_snapshot().allocations;
  }
  CHECK(memory_snapshot().allocations == allocs_after_first);
  INFO("first " << losses.front() << ", last " << losses.back());
  CHECK(losses.front() == doctest::Approx(std::log(32.0)).epsilon(0.1));
  CHECK(losses.back() < 0.7 * losses.front());
}
