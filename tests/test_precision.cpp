// bf16 mixed precision, emulated on the CPU: a GPT (the `gpt` workload's
// architecture, narrowed so that 200 steps learn in seconds) trained 200 steps
// in fp32 and in bf16 from the same start stays within a stated loss tolerance; in
// bf16 a step computes with bf16 weights and stores bf16 activations while the
// master weights stay fp32; the option is parsed whole.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;
using models::gpt;
// Legend: V vocabulary, S max positions, D width, H heads, F FFN width, L blocks.
using small_gpt = models::gpt_model<256, 64, 64, 2, 256, 2>;

namespace {
bool is_bf16(float x) { return (kernels::as_int(x) & 0xffff) == 0; }

// Losses of `steps` steps of small_gpt on 8 sequences of 64 tokens, AdamW with clipping.
std::vector<double> train_gpt(precision p, int steps) {
  network<small_gpt> net(seed{42});
  trainer_options o;
  o.progress = false;
  o.max_grad_norm = 1.0;
  o.precision = p;
  trainer t(net, adamw{.lr = 3e-3f}, o);
  markov_data data(seed{7}, small_gpt::vocab, 64, 8);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(t.step_on(t.fetch(data, s), 8, s));
  return losses;
}
double mean_of_last(const std::vector<double>& v, std::size_t n) {
  return std::accumulate(v.end() - static_cast<std::ptrdiff_t>(n), v.end(), 0.0) / static_cast<double>(n);
}
}  // namespace

TEST_CASE("bf16 vs fp32: a GPT trained 200 steps ends within 1% of the fp32 loss") {
  const auto f = train_gpt(precision::fp32, 200);
  const auto b = train_gpt(precision::bf16, 200);
  const double lf = mean_of_last(f, 20), lb = mean_of_last(b, 20);
  MESSAGE("small GPT, 200 steps: fp32 loss " << f.front() << " -> " << lf << ", bf16 " << b.front() << " -> " << lb
                                       << " (mean of the last 20 steps)");
  CHECK(f.front() == doctest::Approx(b.front()).epsilon(1e-3));  // the same start, to bf16's resolution
  CHECK(lf < f.front() - 1.0);                                     // it learns
  CHECK(std::fabs(lb - lf) <= 0.01 * lf);                          // the stated tolerance
  CHECK(lb != lf);                                                 // and bf16 did change the arithmetic
}

TEST_CASE("bf16: activations are stored as bf16, weights computed with as bf16, master weights stay fp32") {
  network<gpt> net(seed{42});
  trainer_options o;
  o.progress = false;
  o.precision = precision::bf16;
  trainer t(net, adamw{.lr = 1e-3f}, o);
  markov_data data(seed{7}, gpt::vocab, 16, 2);
  t.step_on(t.fetch(data, 0), 2, 0);
  // the master weights after an update are fp32 values, not bf16 ones
  const auto p = net.params();
  index_t not_bf16 = 0;
  for (index_t i = 0; i < p.numel(); ++i) not_bf16 += !is_bf16(p[i]);
  CHECK(not_bf16 > p.numel() / 2);
  // a bf16 forward returns bf16 logits
  auto b = t.fetch(data, 1);
  step_ctx c;
  c.batch = 2, c.seq = 16, c.global_rows = 32, c.bf16 = true;
  const auto logits = net.forward(c, b.inputs);
  index_t bad = 0;
  for (index_t i = 0; i < logits.numel(); ++i) bad += !is_bf16(logits[i]);
  CHECK(bad == 0);
}

TEST_CASE("precision is parsed whole") {
  CHECK(parse_precision("fp32", "--precision") == precision::fp32);
  CHECK(parse_precision("bf16", "--precision") == precision::bf16);
  for (const char* bad : {"", "BF16", "bf16 ", "fp16", "32"})
    CHECK_THROWS_WITH_AS(parse_precision(bad, "--precision"), doctest::Contains("expected fp32 or bf16"),
                         std::invalid_argument);
}
