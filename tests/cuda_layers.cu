// Every layer of nn/ compiled by nvcc, through backend_ref: a small GPT (token
// and position embeddings, two pre-LN transformer blocks with attention, GELU
// and residuals, LayerNorm, the LM head and cross-entropy) trained on the CPU
// backend from a translation unit nvcc compiled. That instantiates each
// layer's kernel bodies for the GPU as well (backend_ref::launch holds the
// CUDA grid under nvcc), so CI checks that the layers compile for both spaces,
// and the run checks that nvcc's host code computes the right gradients:
// central differences on 24 parameters spread over the flat buffer, error
// relative to the largest analytic entry below 2e-2 (h = 1e-2 in fp32 on a
// loss of about 3.5: rounding noise ~1e-4 of the gradients' scale), then 5 SGD
// steps lower the loss. Runs without a GPU.
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"

using namespace whale;

namespace {
using tiny_gpt = models::gpt_model<32, 8, 16, 2, 32, 2>;
constexpr index_t B = 2, T = 8;

int failures = 0;
void check(bool ok, const char* what, double value) {
  std::printf("%s %s: %g\n", ok ? "ok" : "FAILED", what, value);
  if (!ok) ++failures;
}
}  // namespace

int main() {
  network<tiny_gpt> net(seed{11});
  std::vector<std::int32_t> tokens(B * T), labels(B * T);
  for (index_t i = 0; i < B * T; ++i) {
    tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 7 + 3) % 32);
    labels[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 5 + 1) % 32);
  }
  const cview<std::int32_t> x(tokens.data(), {B, T}), y(labels.data(), {B * T});
  auto ctx = [&] {
    step_ctx c;
    c.batch = B;
    c.seq = T;
    c.global_rows = B * T;
    return c;
  };
  auto c = ctx();
  check(c.be.on_cpu(), "step_ctx computes on the CPU backend by default", 1);
  const double loss0 = net.train_step(c, x, y);
  const std::vector<float> grad(net.grads().data(), net.grads().data() + net.param_count());

  double amax = 0, emax = 0;
  auto p = net.params();
  const index_t n = net.param_count();
  for (int k = 0; k < 24; ++k) {
    const index_t i = (n / 24) * k + 5;
    const float keep = p[i];
    const float h = 1e-2f;
    p[i] = keep + h;
    auto cp = ctx();
    const double up = net.evaluate(cp, x, y);
    p[i] = keep - h;
    auto cm = ctx();
    const double down = net.evaluate(cm, x, y);
    p[i] = keep;
    const double fd = (up - down) / (2.0 * h);
    amax = std::max(amax, std::fabs(static_cast<double>(grad[static_cast<std::size_t>(i)])));
    emax = std::max(emax, std::fabs(fd - grad[static_cast<std::size_t>(i)]));
  }
  check(amax > 1e-3, "the sampled analytic gradients are not trivial (largest entry)", amax);
  check(emax / amax < 2e-2, "gradients against central differences (worst error / largest entry)", emax / amax);

  sgd opt{.lr = 0.5f};
  auto st = net.make_optimizer_state(opt);
  double loss = loss0;
  for (int s = 0; s < 5; ++s) {
    auto cs = ctx();
    loss = net.train_step(cs, x, y);
    net.apply_optimizer(opt, st, 1.f);
  }
  check(std::isfinite(loss) && loss < loss0, "5 SGD steps lower the loss (last step's loss)", loss);
  std::printf("first loss %.6f, after 5 steps %.6f\n", loss0, loss);
  return failures ? 1 : 0;
}
