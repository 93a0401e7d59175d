// bf16 mixed precision, emulated on the CPU: a GPT (the `gpt` workload's
// architecture, narrowed so that 200 steps learn in seconds) trained 200 steps
// in fp32 and in bf16 from the same start stays within a stated loss tolerance; in
// bf16 a step computes with bf16 weights and stores bf16 activations while the
// master weights stay fp32; the option is parsed whole.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/models/gpt.hpp"
#include "whale/models/llama.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/swiglu_mlp.hpp"
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
  network<small_gpt> net(seed{42}, p);  // the network's precision, which the trainer trains in
  trainer_options o;
  o.progress = false;
  o.max_grad_norm = 1.0;
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
  network<gpt> net(seed{42}, precision::bf16);
  trainer_options o;
  o.progress = false;
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

namespace {
// Layer L (bound to fresh parameters) forward and backward under bf16 and fp32 on the same
// non-bf16 input and a bf16 output gradient (as gradients are stored), through run_forward /
// run_backward as the containers run it: under bf16 its output and input gradient are stored as
// bf16, whether its own kernels round them or a rounding pass follows. `one_op`: a layer of one operation each way, whose bf16 values
// are its fp32 values rounded, to the bit (a composite rounds its intermediates too); of its fp32
// values on the rounded input where it reads its input as bf16 holds it (rounds_input_on_read).
template <class L> void check_stored_bf16(index_t width, bool one_op) {
  network<sequential<L, softmax_cross_entropy>> net(seed{3});
  auto& l = net.model().template get<0>();
  const index_t B = 2, T = 8, R = B * T;
  std::vector<float> x(static_cast<std::size_t>(R * width)), dy(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(0.37f * static_cast<float>(i)) * 1.7f + 0.013f;  // not bf16 values
    // a gradient as it is stored: bf16 values (a layer's backward reads dy as bf16 holds it)
    dy[i] = kernels::round_bf16(std::cos(0.11f * static_cast<float>(i)) * 0.3f + 0.0007f);
  }
  std::vector<float> y[2], dx[2];
  std::vector<float> x_read = x;  // the input as the layer reads it under bf16
  if constexpr (rounds_input_on_read<L>())
    for (auto& v : x_read) v = kernels::round_bf16(v);
  for (const bool bf16 : {false, true}) {
    step_ctx c;
    c.batch = B, c.seq = T, c.global_rows = R, c.bf16 = bf16;
    const auto out = run_forward(l, c, cview<float>((bf16 ? x : x_read).data(), {R, width}), 0);
    y[bf16].assign(out.begin(), out.end());
    c.need_input_grad = true;
    const auto din = run_backward(l, c, cview<float>(dy.data(), {R, width}), 0);
    dx[bf16].assign(din.begin(), din.end());
  }
  index_t not_bf16 = 0, off = 0;
  for (const auto* v : {&y[1], &dx[1]})
    for (const float e : *v) not_bf16 += !is_bf16(e);
  CHECK(not_bf16 == 0);
  for (std::size_t i = 0; i < y[0].size(); ++i) {
    const float want = kernels::round_bf16(y[0][i]);
    off += one_op && y[1][i] != want;
  }
  for (std::size_t i = 0; i < dx[0].size(); ++i) {
    const float want = kernels::round_bf16(dx[0][i]);
    off += one_op && dx[1][i] != want;
  }
  CHECK(off == 0);
}
}  // namespace

TEST_CASE("bf16: every layer's output and input gradient is stored rounded, by its own kernels or by a pass after it") {
  SUBCASE("layer_norm (its kernels round)") { check_stored_bf16<layer_norm<32>>(32, true); }
  SUBCASE("rms_norm (its kernels round)") { check_stored_bf16<rms_norm<32>>(32, true); }
  SUBCASE("gelu (its kernels round, and read x rounded)") { check_stored_bf16<gelu>(32, true); }
  SUBCASE("linear (the bias pass after the product rounds; a pass rounds d(input))") { check_stored_bf16<linear<32, 32>>(32, true); }
  SUBCASE("linear without bias (the pass after the product rounds)") { check_stored_bf16<linear<32, 32, no_bias>>(32, true); }
  SUBCASE("residual (its sums round)") { check_stored_bf16<residual<layer_norm<32>, linear<32, 32>>>(32, false); }
  SUBCASE("residual ending in a linear without bias") { check_stored_bf16<residual<rms_norm<32>, linear<32, 32, no_bias>>>(32, false); }
  SUBCASE("swiglu_mlp (its gate kernels round; the pass after the down projection rounds)") { check_stored_bf16<swiglu_mlp<32, 48>>(32, false); }
  SUBCASE("residual ending in a swiglu_mlp") { check_stored_bf16<residual<rms_norm<32>, swiglu_mlp<32, 48>>>(32, false); }
  SUBCASE("rotary_attention (grouped)") { check_stored_bf16<rotary_attention<32, 4, 2>>(32, false); }
  SUBCASE("residual ending in a rotary_attention") { check_stored_bf16<residual<rms_norm<32>, rotary_attention<32, 4, 2>>>(32, false); }
  SUBCASE("causal_self_attention") { check_stored_bf16<causal_self_attention<32, 2>>(32, false); }
  SUBCASE("transformer_block (a sequential: its elements' values)") { check_stored_bf16<transformer_block<32, 2, 64>>(32, false); }
  SUBCASE("repeat") { check_stored_bf16<repeat<2, transformer_block<32, 2, 64>>>(32, false); }
}

TEST_CASE("bf16: the cross-entropy's kernel reads the logits rounded and stores d(logits) rounded: the fp32 gradient of the rounded logits rounded, to the bit, and no pass after") {
  constexpr index_t R = 12, C = 37;
  std::vector<float> z(static_cast<std::size_t>(R * C));
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = std::sin(0.29f * static_cast<float>(i)) * 3.1f + 0.0173f;
  std::vector<std::int32_t> y(static_cast<std::size_t>(R));
  for (index_t r = 0; r < R; ++r) y[static_cast<std::size_t>(r)] = static_cast<std::int32_t>((r * 7) % C);
  y[5] = -100;  // an ignored row: a zero gradient
  std::vector<float> z_read = z;  // the logits as the kernel reads them under bf16
  for (auto& v : z_read) v = kernels::round_bf16(v);
  auto grad = [&](const backend_ref& be, bool bf16) {
    const place_scope on(be.memory());  // the layer's state too, as a network on a device keeps it
    softmax_cross_entropy l;
    tensor<float> dz({R, C});
    tensor<std::int32_t> dy({R});
    be.copy(dz.data(), (bf16 ? z : z_read).data(), z.size() * 4);
    be.copy(dy.data(), y.data(), y.size() * 4);
    step_ctx c;
    c.be = be, c.global_rows = R, c.bf16 = bf16;
    (void)l.forward_loss(c, cview<float>(dz), cview<std::int32_t>(dy));
    const auto g = run_backward_loss(l, c, 0);
    std::vector<float> out(static_cast<std::size_t>(g.numel()));
    be.copy(out.data(), g.data(), out.size() * 4);
    be.synchronize();
    return out;
  };
  const auto g32 = grad(backend_ref{}, false), g16 = grad(backend_ref{}, true);
  REQUIRE(g16.size() == g32.size());
  index_t off = 0;
  for (std::size_t i = 0; i < g32.size(); ++i) off += g16[i] != kernels::round_bf16(g32[i]);
  CHECK(off == 0);
  guarded_backend g;
  const backend_ref dev(g);
  CHECK(grad(dev, true) == g16);  // the device's shape gives the CPU's bits
  CHECK(g.ledger().kernels.count("to_bf16") == 0);
  CHECK(g.ledger().kernels.at("cross_entropy_rows").launches == 1);
}

TEST_CASE("bf16: a residual's sums are stored by its branch's own kernels, and a GEMM's d(input) rounded as the next layer reads it: bit for bit, with no add or rounding pass launched") {
  // two blocks of a transformer under bf16, forward and backward: fused (no hooks) against unfused (a
  // hook that does nothing turns the fusion off), on the CPU and on the guarded backend
  using block = sequential<transformer_block<32, 2, 64>, transformer_block<32, 2, 64>>;
  const index_t B = 2, T = 8, R = B * T, D = 32;
  std::vector<float> x(static_cast<std::size_t>(R * D)), dy(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = kernels::round_bf16(std::sin(0.37f * static_cast<float>(i)) * 1.7f + 0.013f);
    dy[i] = kernels::round_bf16(std::cos(0.11f * static_cast<float>(i)) * 0.3f + 0.0007f);
  }
  struct nothing : layer_hooks {};
  struct result {
    std::vector<float> y, dx, grads;
    std::int64_t adds = 0, roundings = 0, bias_passes = 0, bias_epilogues = 0, gelu_epilogues = 0, gelu_kernels = 0;
  };
  // the blocks of `Blk`'s type (two transformer blocks here, two Llama blocks in the check after)
  auto run_as = [&]<class Blk>(std::type_identity<Blk>, backend_ref be, bool hooked, guarded_backend* g, bool bf16 = true) {
    network<sequential<Blk, softmax_cross_entropy>> net(seed{4}, be);
    auto& l = net.model().template get<0>();
    const place_scope on(be.memory());  // the layers' state too, as the network keeps it
    tensor<float> dx_in({R, D}), dy_in({R, D});
    be.copy(dx_in.data(), x.data(), x.size() * 4);
    be.copy(dy_in.data(), dy.data(), dy.size() * 4);
    nothing h;
    step_ctx c;
    c.be = be, c.batch = B, c.seq = T, c.global_rows = R, c.bf16 = bf16;
    if (hooked) c.hooks = &h;
    if (g) g->ledger().clear();
    result r;
    const auto out = run_forward(l, c, cview<float>(dx_in), 0);
    c.need_input_grad = true;
    const auto din = run_backward(l, c, cview<float>(dy_in), 0);
    r.y.resize(static_cast<std::size_t>(out.numel())), r.dx.resize(static_cast<std::size_t>(din.numel()));
    be.copy(r.y.data(), out.data(), r.y.size() * 4);
    be.copy(r.dx.data(), din.data(), r.dx.size() * 4);
    r.grads.resize(static_cast<std::size_t>(net.grads().numel()));
    be.copy(r.grads.data(), net.grads().data(), r.grads.size() * 4);
    be.synchronize();
    if (g) {
      const auto& k = g->ledger().kernels;
      r.adds = k.count("add") ? k.at("add").launches : 0;
      r.roundings = k.count("to_bf16") ? k.at("to_bf16").launches : 0;
      r.bias_passes = k.count("bias_rows") ? k.at("bias_rows").launches : 0;
      r.bias_epilogues = g->ledger().bias_epilogues;
      r.gelu_epilogues = g->ledger().gelu_epilogues;
      r.gelu_kernels = (k.count("gelu_forward") ? k.at("gelu_forward").launches : 0) +
                       (k.count("gelu_backward") ? k.at("gelu_backward").launches : 0);
    }
    return r;
  };
  auto run = [&](auto... a) { return run_as(std::type_identity<block>{}, a...); };
  const auto fused = run(backend_ref{}, false, nullptr), unfused = run(backend_ref{}, true, nullptr);
  CHECK(fused.y == unfused.y);
  CHECK(fused.dx == unfused.dx);
  CHECK(fused.grads == unfused.grads);
  guarded_backend g;
  const auto dev = run(backend_ref(g), false, &g);
  CHECK(dev.y == fused.y);
  CHECK(dev.dx == fused.dx);
  CHECK(dev.grads == fused.grads);
  CHECK(dev.adds == 0);  // 4 residuals, 8 sums: all stored by the bias and layer norm kernels
  // the linear layers' d(input), which GEMMs write, is rounded as the next layer reads it (layer norm's
  // and GELU's backward kernels), not by a pass: 3 a block when hooks look at each value
  CHECK(dev.roundings == 0);
  const auto dev_unfused = run(backend_ref(g), true, &g);
  CHECK(dev_unfused.adds == 8);
  CHECK(dev_unfused.roundings == 6);
  // a device whose GEMMs add the bias in their epilogue: Q, K, V's and the first MLP linear's (with
  // GELU, and GELU's gradient in the second's d(input) GEMM) in the GEMM call; the two linears that end
  // a residual keep their bias pass, which stores the residual's sum rounded. The same bits.
  g.set_fused_bias_grads(true);
  const auto epi = run(backend_ref(g), false, &g);
  CHECK(epi.y == fused.y);
  CHECK(epi.dx == fused.dx);
  CHECK(epi.grads == fused.grads);
  CHECK(epi.bias_epilogues == 4);
  CHECK(epi.gelu_epilogues == 4);  // 2 forward, 2 backward
  CHECK(epi.gelu_kernels == 0);
  CHECK(epi.bias_passes == 1);  // the residuals' sums: left to the layer norm after each, but the last's
  CHECK(dev.bias_passes == 5);  // without the epilogue: the bias written before Q, K, V's and the MLP's GEMMs
  CHECK(dev.gelu_kernels == 4);
  const auto epi_unfused = run(backend_ref(g), true, &g);  // hooks see the first MLP linear's output: stored rounded
  CHECK(epi_unfused.y == fused.y);
  CHECK(epi_unfused.dx == fused.dx);
  CHECK(epi_unfused.bias_epilogues == 2);
  CHECK(epi_unfused.gelu_epilogues == 0);
  // fp32: GELU in the GEMMs' calls as well, the values of the layers run one by one
  const auto f32 = run(backend_ref(g), false, &g, false);
  const auto f32_cpu_hooked = run(backend_ref{}, true, nullptr, false);
  CHECK(f32.y == f32_cpu_hooked.y);
  CHECK(f32.dx == f32_cpu_hooked.dx);
  CHECK(f32.grads == f32_cpu_hooked.grads);
  CHECK(f32.gelu_epilogues == 4);

  // two Llama blocks (RMSNorm, grouped rotary attention, SwiGLU, no biases): the residuals' sums left to the
  // RMSNorm after each but the last, RMSNorm's gain gradient in its backward's pass; the same bits
  using llama2 = sequential<models::llama_block<32, 4, 2, 48>, models::llama_block<32, 4, 2, 48>>;
  const auto l_fused = run_as(std::type_identity<llama2>{}, backend_ref{}, false, nullptr);
  const auto l_unfused = run_as(std::type_identity<llama2>{}, backend_ref{}, true, nullptr);
  CHECK(l_fused.y == l_unfused.y);
  CHECK(l_fused.dx == l_unfused.dx);
  CHECK(l_fused.grads == l_unfused.grads);
  const auto l_dev = run_as(std::type_identity<llama2>{}, backend_ref(g), false, &g);  // one guarded backend at a time
  CHECK(l_dev.y == l_fused.y);
  CHECK(l_dev.dx == l_fused.dx);
  CHECK(l_dev.grads == l_fused.grads);
  CHECK(l_dev.bias_passes == 1);  // the last residual's sum; the three before are stored by the next RMSNorm
  CHECK(l_dev.adds == 0);
  CHECK(g.ledger().kernels.count("column_one_tile<rms_norm_param_grads>") == 0);  // no column pass of its own
  CHECK(g.ledger().kernels.at("norm_backward_sums<rms_norm_backward>").launches == 4);
}
