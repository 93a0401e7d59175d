// Every layer of nn/ compiled by nvcc, through backend_ref: a small GPT (token
// and position embeddings, two pre-LN transformer blocks with attention, GELU
// and residuals, LayerNorm, the LM head and cross-entropy), and RMSNorm in a
// small model of its own (gradients only), trained on the CPU
// backend from a translation unit nvcc compiled. That instantiates each
// layer's kernel bodies for the GPU as well (backend_ref::launch holds the
// CUDA grid under nvcc), so CI checks that the layers compile for both spaces,
// and the run checks that nvcc's host code computes the right gradients:
// central differences on 24 parameters spread over the flat buffer, error
// relative to the largest analytic entry below 2e-2 (h = 1e-2 in fp32 on a
// loss of about 3.5: rounding noise ~1e-4 of the gradients' scale; 1e-3 for
// the RMSNorm model), then 5 SGD
// steps lower the loss. Runs without a GPU. Where a GPU is present it also
// trains the same GPT on it -- network<M> on cuda_backend, everything in
// device memory -- for 5 steps of AdamW with clipping, against the CPU:
// losses within 1e-5 relative, parameters within 1e-4 of their largest
// magnitude (cuBLAS and OpenBLAS sum in different orders; fp32, TF32 off);
// and under bf16 mixed precision with the trainer (log_every 5: no host wait
// inside the 5 steps), against the CPU's emulated bf16: losses within 1e-2
// relative (a value one side rounds up and the other down differs by a bf16
// step), parameters within 2 lr x steps. The GPU's GEMMs, biases and GELU
// run in cuBLASLt's epilogues there, on its bf16 tensor cores.
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "whale/backend/cuda.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
using tiny_gpt = models::gpt_model<32, 8, 16, 2, 32, 2>;
// Llama's normalization, projections and MLP: RMSNorm first in a residual branch (its dx kernel adds the
// residual's), linears without bias (the last one's pass adds the residual), rotary grouped-query attention,
// a SwiGLU MLP, RMSNorm before the head
using tiny_rms = sequential<embedding<32, 16>, residual<rms_norm<16>, linear<16, 16, no_bias>, gelu, linear<16, 16, no_bias>>,
                            residual<rms_norm<16>, rotary_attention<16, 4, 2>>, residual<rms_norm<16>, swiglu_mlp<16, 24>>,
                            rms_norm<16, 1e-5f>, linear<16, 32, no_bias>,
                            softmax_cross_entropy>;
constexpr index_t B = 2, T = 8;

int failures = 0;
void check(bool ok, const char* what, double value) {
  std::printf("%s %s: %g\n", ok ? "ok" : "FAILED", what, value);
  if (!ok) ++failures;
}
/// `net`'s gradients (one training step) against central differences of step
/// `h` on 24 parameters spread over its flat buffer.
template <class M, class Ctx>
void check_gradients(network<M>& net, Ctx ctx, cview<std::int32_t> x, cview<std::int32_t> y, const char* name, float h) {
  auto c = ctx();
  net.train_step(c, x, y);
  const std::vector<float> grad(net.grads().data(), net.grads().data() + net.param_count());
  double amax = 0, emax = 0;
  auto p = net.params();
  const index_t n = net.param_count();
  for (int k = 0; k < 24; ++k) {
    const index_t i = (n / 24) * k + 5;
    const float keep = p[i];
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
  std::printf("%s:\n", name);
  check(amax > 1e-3, "  the sampled analytic gradients are not trivial (largest entry)", amax);
  check(emax / amax < 2e-2, "  gradients against central differences (worst error / largest entry)", emax / amax);
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
  const double loss0 = net.evaluate(c, x, y);
  check_gradients(net, ctx, x, y, "the GPT", 1e-2f);
  {
    network<tiny_rms> rms(seed{12});
    // h = 1e-3: RMSNorm of the small embedding rows curves the loss enough that h = 1e-2's truncation
    // error is 1.8% (it falls as h squared: 0.17% at 3e-3, 0.019% at 1e-3), where the GPT's is 0.005%
    check_gradients(rms, ctx, x, y, "RMSNorm (Llama's normalization) in a residual branch and before the head", 1e-3f);
  }

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

  if (cuda_device_count() == 0) {
    std::printf("skipped on the GPU: no CUDA device\n");
    return failures ? 1 : 0;
  }
  cuda_backend gpu;
  auto train5 = [&](backend_ref be, const auto& opt, std::vector<double>& losses) {
    network<tiny_gpt> n(seed{11}, be);
    auto s = n.make_optimizer_state(opt);
    for (int k = 0; k < 5; ++k) {
      auto ck = ctx();
      losses.push_back(n.train_step(ck, x, y));
      n.apply_optimizer(opt, s, clip_coefficient(n.grad_norm(), 0.05));
    }
    return n.params_on_host();
  };
  auto compare = [&](const auto& opt, const char* name, double param_bound, bool relative) {
    std::vector<double> lc, lg;
    const auto pc = train5(backend_ref{}, opt, lc);
    const auto pg = train5(backend_ref(gpu), opt, lg);
    double lerr = 0, perr = 0, pmax = 0;
    for (int k = 0; k < 5; ++k) lerr = std::max(lerr, std::fabs(lc[k] - lg[k]) / std::fabs(lc[k]));
    for (std::size_t i = 0; i < pc.size(); ++i) {
      perr = std::max(perr, static_cast<double>(std::fabs(pc[i] - pg[i])));
      pmax = std::max(pmax, static_cast<double>(std::fabs(pc[i])));
    }
    const double err = relative ? perr / pmax : perr;
    std::printf("GPU training with %s:\n", name);
    check(lerr < 1e-5, "  5 losses against the CPU's (largest relative difference)", lerr);
    check(err < param_bound,
          relative ? "  parameters (largest difference / largest magnitude)" : "  parameters (largest difference)", err);
  };
  // SGD: differences stay at rounding level. AdamW turns a tiny gradient
  // difference near zero into a step of about lr: bound 2 lr x steps.
  compare(sgd{.lr = 0.5f, .momentum = 0.9f}, "SGD with momentum, clipped", 1e-4, true);
  compare(adamw{.lr = 1e-2f}, "AdamW, clipped", 2 * 1e-2 * 5, false);
  // bf16 mixed precision: the GPU's step against the CPU's emulation, 5 steps through the trainer
  {
    auto bf16_run = [&](backend_ref be, std::vector<double>& losses) {
      network<tiny_gpt> n(seed{11}, be, precision::bf16);
      markov_data data(seed{7}, 32, T, B);
      trainer_options o;
      o.progress = false;
      o.max_grad_norm = 0.05;
      o.log_every = 5;
      trainer t(n, adamw{.lr = 1e-2f}, o);
      losses = t.run(data, steps{5}).losses;
      return n.params_on_host();
    };
    std::vector<double> lc, lg;
    const auto pc = bf16_run(backend_ref{}, lc);
    const auto pg = bf16_run(backend_ref(gpu), lg);
    double lerr = 0, perr = 0;
    for (std::size_t k = 0; k < lc.size() && k < lg.size(); ++k) lerr = std::max(lerr, std::fabs(lc[k] - lg[k]) / std::fabs(lc[k]));
    for (std::size_t i = 0; i < pc.size(); ++i) perr = std::max(perr, static_cast<double>(std::fabs(pc[i] - pg[i])));
    std::printf("GPU training under bf16 mixed precision (AdamW, clipped), against the CPU's emulation:\n");
    check(lc.size() == 5 && lg.size() == 5, "  5 losses read (count)", static_cast<double>(lg.size()));
    check(lerr < 1e-2, "  5 losses (largest relative difference)", lerr);
    check(perr < 2 * 1e-2 * 5, "  parameters (largest difference)", perr);
    std::printf("  GEMM epilogues on the GPU: %lld biases, %lld with GELU, %lld bias gradients\n",
                static_cast<long long>(gpu.fused_biases()), static_cast<long long>(gpu.fused_gelus()),
                static_cast<long long>(gpu.fused_bias_grads()));
  }
  return failures ? 1 : 0;
}
