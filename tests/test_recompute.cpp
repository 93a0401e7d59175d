// recompute<Block>: the same gradients as Block (bit for bit), the activation
// bytes of a gpt block stack reduced to the stated amount (asserted exactly from
// the memory tracker), hooks see the second forward, no allocation after step 1.
#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/tensor/memory.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
// Legend: V vocabulary, S max positions, D width, H heads, F FFN width, L blocks.
// The reference gpt's shapes, with its block stack recomputed or not.
constexpr index_t V = 8192, S = 128, D = 256, H = 4, F = 1024;
constexpr std::size_t L = 4;
using block = transformer_block<D, H, F>;
template <class Stack>
using gpt_with = sequential<embedding<V, D>, position_embedding<S, D>, Stack, layer_norm<D>, linear<D, V>,
                            softmax_cross_entropy>;
using plain_gpt = gpt_with<repeat<L, block>>;
using recomputed_gpt = gpt_with<repeat<L, recompute<block>>>;
static_assert(plain_gpt::cost().params == models::gpt::cost().params);

// A small gpt with its block stack recomputed or not: the trainings compared below.
using small_block = transformer_block<32, 2, 64>;
template <class Stack>
using small_gpt = sequential<embedding<32, 32>, position_embedding<16, 32>, Stack, layer_norm<32>, linear<32, 32>,
                             softmax_cross_entropy>;
using small_plain = small_gpt<repeat<3, small_block>>;
using small_rc = small_gpt<repeat<3, recompute<small_block>>>;
/// The two small models from one seed, each with its own copy of the same data.
struct small_pair {
  explicit small_pair(precision p = precision::fp32) : a{seed{5}, p}, b{seed{5}, p} {}
  network<small_plain> a;
  network<small_rc> b;
  markov_data da{seed{6}, 32, 16, 4}, db{seed{6}, 32, 16, 4};
  trainer_options o = [] {
    trainer_options t;
    t.progress = false;
    return t;
  }();
};

step_ctx ctx(index_t batch, index_t seq) {
  step_ctx c;
  c.batch = batch;
  c.seq = seq;
  c.global_rows = batch * seq;
  return c;
}

/// Floats one transformer_block<D, H, F> keeps for forward and backward on B
/// sequences of T tokens (R = B T rows): its layers' per-slot buffers.
///   2 residuals: y, dx                                  4 R D
///   2 layer_norms: y, dx (R D), mean, rstd (R)          4 R D + 4 R
///   attention: qkv, dqkv (3 R D), att, y, datt, dx       10 R D
///              p (B H T T), ds (H T T)                  B H T² + H T²
///   FFN: linear y, GELU(y) (R F), dx (R D);             3 R F + 2 R D
///        linear y (R D), dx through GELU (R F)
///        (the gelu between them keeps nothing of its own)
constexpr index_t block_floats(index_t B, index_t T) {
  const index_t R = B * T;
  return 20 * R * D + 3 * R * F + 4 * R + B * H * T;  // the attention keeps one log-sum-exp per (sequence, head, query)
}

/// Activation bytes one step adds (the peak of the category, from zero).
template <class Model> struct measured {
  std::int64_t act = 0;
  std::vector<float> grads;
};
template <class Model> measured<Model> one_step(index_t B, index_t T) {
  detail::activation_pool::instance().trim();
  network<Model> net(seed{42});
  auto data = markov_data(seed{7}, V, T, B);
  auto b = data.get(0, 0, B);
  const auto before = memory_snapshot().live_of(mem_kind::activations);
  reset_memory_peaks();
  auto c = ctx(B, T);
  net.train_step(c, b.inputs, b.labels);
  measured<Model> m;
  m.act = memory_snapshot().peak_of(mem_kind::activations) - before;
  m.grads.assign(net.grads().begin(), net.grads().end());
  return m;
}
}  // namespace

TEST_CASE("recompute<transformer_block>: identical gradients, and the stack's activations drop to the stated amount") {
  constexpr index_t B = 2, T = S;
  const auto plain = one_step<plain_gpt>(B, T);
  const auto rc = one_step<recomputed_gpt>(B, T);
  detail::activation_pool::instance().trim();

  // Same arithmetic on the same inputs: gradients are equal bit for bit.
  REQUIRE(plain.grads.size() == rc.grads.size());
  CHECK(std::memcmp(plain.grads.data(), rc.grads.data(), plain.grads.size() * sizeof(float)) == 0);

  // The stated amount (docs/shard.md): a stack of L blocks keeps L x W bytes
  // (W = block_floats x 4); recomputed, it keeps L x (output + d(input) copies,
  // 2 R D floats) plus ONE block's buffers (the activation pool): L·8·R·D + W.
  constexpr std::int64_t W = 4 * block_floats(B, T);
  constexpr std::int64_t kept = static_cast<std::int64_t>(L) * 4 * 2 * B * T * D;
  MESSAGE("activations per step: plain " << plain.act << " B, recomputed " << rc.act << " B; block W = " << W
                                         << " B");
  CHECK(plain.act - rc.act == static_cast<std::int64_t>(L - 1) * W - kept);
  // For B = 2 sequences of 128 tokens: the stack drops from 33,587,200 B to 10,493,952 B.
  static_assert(static_cast<std::int64_t>(L) * W == 33'587'200);
  static_assert(kept + W == 10'493'952);
}

TEST_CASE("recompute: no heap allocation after the first step, and training matches the plain model") {
  small_pair p;
  trainer ta(p.a, sgd{.lr = 0.05f, .momentum = 0.9f}, p.o);
  trainer tb(p.b, sgd{.lr = 0.05f, .momentum = 0.9f}, p.o);
  ta.run(p.da, steps{1});
  tb.run(p.db, steps{1});
  const auto after_first = memory_snapshot().allocations;
  tb.run(p.db, steps{3});
  CHECK(memory_snapshot().allocations == after_first);
  ta.run(p.da, steps{3});
  CHECK(std::memcmp(p.a.params().data(), p.b.params().data(), p.a.params().bytes()) == 0);
}

TEST_CASE("recompute under bf16: a residual's sum is never left pending inside it; the plain model's training, bit for bit") {
  // repeat<3, recompute<block>> before a layer_norm: the repeat would leave its last copy's residual sum to the
  // layer norm (step_ctx::sum_taken_after); the recompute copies its block's output, so it runs the block with
  // the flag cleared and the sum stored inside
  static_assert(carries_residual_sum<repeat<3, small_block>>() && !carries_residual_sum<recompute<small_block>>());
  small_pair p(precision::bf16);  // both networks trained in bf16
  p.o.max_grad_norm = 1.0;
  trainer ta(p.a, adamw{.lr = 1e-2f}, p.o);
  trainer tb(p.b, adamw{.lr = 1e-2f}, p.o);
  const auto ra = ta.run(p.da, steps{4});
  const auto rb = tb.run(p.db, steps{4});
  CHECK(ra.losses == rb.losses);
  CHECK(std::memcmp(p.a.params().data(), p.b.params().data(), p.a.params().bytes()) == 0);
}

TEST_CASE("recompute: nested and leaf blocks; hooks see the recomputed forward before the backward") {
  using inner = sequential<linear<6, 8>, relu, recompute<linear<8, 8>>>;
  using plain = sequential<linear<4, 6>, sequential<linear<6, 8>, relu, linear<8, 8>>, linear<8, 3>,
                           softmax_cross_entropy>;
  using nested = sequential<linear<4, 6>, recompute<inner>, linear<8, 3>, softmax_cross_entropy>;
  static_assert(is_container<recompute<linear<8, 8>>>);
  network<plain> a(seed{1});
  network<nested> b(seed{1});
  CHECK(std::memcmp(a.params().data(), b.params().data(), a.params().bytes()) == 0);
  teacher_data data(seed{2}, 4, 3, 5);
  auto batch = data.get(0, 0, 5);
  struct recorder : layer_hooks {
    std::vector<std::pair<char, index_t>> ev;
    void before_forward(const leaf_ref& r) override { ev.push_back({'f', r.offset}); }
    void before_backward(const leaf_ref& r) override { ev.push_back({'b', r.offset}); }
  } rec;
  auto c1 = ctx(5, 1), c2 = ctx(5, 1);
  c2.hooks = &rec;
  a.train_step(c1, batch.inputs, batch.labels);
  b.train_step(c2, batch.inputs, batch.labels);
  CHECK(std::memcmp(a.grads().data(), b.grads().data(), a.grads().bytes()) == 0);
  // leaves: linear(0) linear(30) relu(86) linear(86) linear(158) loss(185)
  using E = std::pair<char, index_t>;
  const std::vector<E> want = {{'f', 0},   {'f', 30},  {'f', 86}, {'f', 86}, {'f', 158}, {'f', 185},
                               {'b', 185}, {'b', 158},
                               // recompute<inner>: forward again (with the nested recompute's leaf)
                               {'f', 30}, {'f', 86}, {'f', 86},
                               // nested recompute<linear>: forward again, then its backward
                               {'f', 86}, {'b', 86}, {'b', 86}, {'b', 30},
                               {'b', 0}};
  CHECK(rec.ev == want);
}
