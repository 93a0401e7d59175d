// Finite-difference checks of every layer's backward (inputs and parameters),
// the causal mask, runtime errors of the new layers, and the Layer concept.
//
// Method: central differences in fp32 on the scalar L = sum(w * y) for fixed
// random w (for losses, L is the loss itself), accumulated in double; step h =
// 1e-2 on inputs and parameters of scale ~1. Tolerance: for each gradient
// tensor, max_i |fd_i - analytic_i| / max(max_i |analytic_i|, 1e-3) < 1e-2,
// i.e. the worst error relative to the largest entry; the analytic gradient
// must also be non-trivial (largest entry > 1e-3). fp32 rounding noise of
// (L(+h) - L(-h)) / 2h is ~1e-4 of that scale, truncation O(h^2) ~1e-4; a wrong
// term in a backward gives errors of order 1 (the test "checker detects a
// wrong backward" keeps that property checked).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/embedding.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/gradcheck.hpp"
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/rms_norm.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/nn/swiglu_mlp.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/nn/transformer_block.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

// ---- the Layer concept, checked at compile time ----
static_assert(Layer<gelu>);
static_assert(Layer<layer_norm<8>>);
static_assert(Layer<rms_norm<8>>);
static_assert(Layer<embedding<10, 4>>);
static_assert(Layer<position_embedding<6, 4>>);
static_assert(Layer<causal_self_attention<8, 2>>);
static_assert(Layer<residual<layer_norm<8>, linear<8, 8>>>);
static_assert(Layer<transformer_block<8, 2, 16>>);
static_assert(Layer<repeat<3, transformer_block<8, 2, 16>>>);
static_assert(Loss<softmax_cross_entropy>);
static_assert(transformer_block<8, 2, 16>::in_features == 8 &&
              transformer_block<8, 2, 16>::out_features == 8);
static_assert(causal_self_attention<256, 4>::cost().seq_flops == 4.0 * 256);
static_assert(transformer_block<256, 4, 1024>::cost().params == 789760);

namespace {

constexpr double fd_step = 1e-2;
constexpr double fd_tol = 1e-2;

/// Worst |fd - an| relative to the largest |an| (whale::normalised_error).
double rel_error(const std::vector<double>& an, const std::vector<double>& fd) { return normalised_error(an, fd); }
double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

void check_close(const std::vector<double>& an, const std::vector<double>& fd, const std::string& what) {
  INFO(what);
  CHECK(an.size() == fd.size());
  CHECK(max_abs(an) > 1e-3);
  const double e = rel_error(an, fd);
  INFO("relative error " << e);
  CHECK(e < fd_tol);
}

// The library's gradient checker (whale/nn/gradcheck.hpp), under the names these tests use.
template <class L> using bound = bound_layer<L>;
template <class L, class In>
layer_gradients gradients(bound<L>& m, step_ctx c, view<In> x, index_t out_width, index_t stride = 1) {
  return finite_differences(m, c, x, out_width, fd_step, stride);
}

step_ctx ctx(index_t batch, index_t seq) {
  step_ctx c;
  c.batch = batch;
  c.seq = seq;
  c.global_rows = batch * seq;
  return c;
}

/// Full check of a float layer: inputs (R, in) ~ N(0,1), outputs (R, out); the error of the
/// input gradient and of each parameter tensor, each normalised by its own largest entry.
template <class L>
void check_layer(const std::string& what, index_t batch, index_t seq, index_t in, index_t out,
                 index_t stride = 1) {
  const auto r = gradcheck<L>(in, out, {.batch = batch, .seq = seq, .step = fd_step, .tolerance = fd_tol, .stride = stride});
  INFO(what << ": " << r.str());
  CHECK(r.ok());
  CHECK(r.tensors.size() >= 1);
}

/// A deliberately wrong layer: y = x^2, backward claims 2.2 x. The checker must reject it.
struct wrong_square : stateless_params {
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = any_features;
  static constexpr cost_info cost() { return {}; }
  view<float> forward(step_ctx&, cview<float> x) {
    x_ = x;
    y_.resize(x.shape());
    for (index_t i = 0; i < x.numel(); ++i) y_[i] = x[i] * x[i];
    return y_.v();
  }
  view<float> backward(step_ctx&, cview<float> dy) {
    dx_.resize(dy.shape());
    for (index_t i = 0; i < dy.numel(); ++i) dx_[i] = dy[i] * 2.2f * x_[i];
    return dx_.v();
  }
  cview<float> x_;
  tensor<float> y_, dx_;
};

}  // namespace

// ---- docs/layers.md's layer, as written there (keep the two the same) ----
/// y = x * gain + shift, per feature: D gains (1 at init) and D shifts (0 at init).
template <index_t D> struct scale_shift {
  using input_type = float;                                     // std::int32_t for a layer of token ids
  static constexpr index_t in_features = D, out_features = D;  // or any_features (elementwise layers)
  static std::string name() { return "scale_shift<" + std::to_string(D) + ">"; }
  static constexpr cost_info cost() {  // per row
    cost_info c;
    c.fwd_flops = 2.0 * D;
    c.bwd_flops = 4.0 * D;
    c.params = 2 * D;
    c.act_bytes = 4.0 * 2 * D;  // what a row keeps: y, and dx in backward
    return c;
  }
  static constexpr index_t param_count() { return 2 * D; }
  // the parameter tensors in flat order: name, role, size, fan-in, shape as stored (initialisers,
  // checks and the safetensors export read them)
  static constexpr std::array<param_tensor, 2> param_tensors() {
    return {{{"gain", param_role::gain, D, D, {D}}, {"shift", param_role::bias, D, D, {D}}}};
  }
  void bind(param_binder& b) {  // consecutive slices of the network's flat buffers
    auto g = b.take({D});        // a slot: .value, .grad (views) and .offset (flat index)
    auto s = b.take({D});
    gain_ = g.value, dgain_ = g.grad, shift_ = s.value, dshift_ = s.grad;
  }
  void init(const counter_rng&) {  // value i a pure function of i (r.uniform(i), r.normal(i)); here constants
    for (index_t i = 0; i < D; ++i) gain_[i] = 1.f, shift_[i] = 0.f;
  }
  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);                 // this micro-batch's state
    const index_t R = x.numel() / D;       // rows (c.rows() = c.batch * c.seq says the same)
    s.x = x;                               // a view of the input, valid until backward
    auto y = detail::ensure(s.y, {R, D});  // allocated at the first step, reused after
    for (index_t r = 0; r < R; ++r)
      for (index_t i = 0; i < D; ++i) y[r * D + i] = x[r * D + i] * gain_[i] + shift_[i];
    return y;
  }
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / D;
    if (!c.accumulate)  // parameter gradients are overwritten, or added to (micro-batches)
      for (index_t i = 0; i < D; ++i) dgain_[i] = 0.f, dshift_[i] = 0.f;
    for (index_t r = 0; r < R; ++r)
      for (index_t i = 0; i < D; ++i) {
        dgain_[i] += dy[r * D + i] * s.x[r * D + i];
        dshift_[i] += dy[r * D + i];
      }
    if (!c.need_input_grad) return {};  // the first layer's input gradient is not needed
    auto dx = detail::ensure(s.dx, {R, D});
    for (index_t r = 0; r < R; ++r)
      for (index_t i = 0; i < D; ++i) dx[r * D + i] = dy[r * D + i] * gain_[i];
    return dx;
  }

 private:
  struct state {
    cview<float> x;
    tensor<float> y, dx;
  };
  view<float> gain_, dgain_, shift_, dshift_;
  slots<state> st_;
};
static_assert(Layer<scale_shift<8>> && param_shapes_stated<scale_shift<8>>());

TEST_CASE("gradcheck: the documented layer passes, per tensor; a wrong backward fails, naming the tensor") {
  const auto r = gradcheck<sequential<linear<8, 8>, scale_shift<8>>>(8, 8);
  MESSAGE(r.str());
  CHECK(r.ok());
  const auto one = gradcheck<scale_shift<8>>(8, 8);
  CHECK(one.ok());
  REQUIRE(one.tensors.size() == 3);
  CHECK(one.tensors[0].tensor == "input");
  CHECK(one.tensors[1].tensor == "gain");
  CHECK(one.tensors[2].tensor == "shift");
  // trained in a network with the trainer, as any layer
  network<sequential<linear<8, 8>, scale_shift<8>, linear<8, 3>, softmax_cross_entropy>> net(seed{1});
  auto data = teacher_data(seed{2}, 8, 3, 16);
  trainer_options quiet;
  quiet.progress = false;
  trainer t(net, sgd{.lr = 0.1f}, quiet);
  const auto res = t.run(data, steps{20});
  CHECK(res.loss_last() < res.loss_first());
  const auto wrong = gradcheck<wrong_square>(4, 4);
  CHECK_FALSE(wrong.ok());
  CHECK(wrong.str().find("input: error") != std::string::npos);
  CHECK(wrong.str().find("FAILS") != std::string::npos);
}

TEST_CASE("the gradient checker detects a wrong backward") {
  bound<wrong_square> m;
  auto c = ctx(3, 1);
  tensor<float> x({3, 4});
  fill_normal(x.v(), 7);
  auto r = gradients(m, c, x.v(), 4);
  CHECK(rel_error(r.an_x, r.fd_x) > 5 * fd_tol);  // 10% off: rejected with margin
}

TEST_CASE("linear: backward matches finite differences") {
  check_layer<linear<5, 3>>("linear<5, 3>", 4, 1, 5, 3);
}

TEST_CASE("linear<In, Out, no_bias>: no bias parameter, the same weights, backward matches finite differences") {
  check_layer<linear<5, 3, no_bias>>("linear<5, 3, no_bias>", 4, 1, 5, 3);
  static_assert(linear<5, 3, no_bias>::param_count() == 15 && linear<5, 3>::param_count() == 18);
  static_assert(linear<5, 3, no_bias>::param_tensors().size() == 1 && linear<5, 3, with_bias>::param_tensors().size() == 2);
  static_assert(std::is_same_v<linear<5, 3>, linear<5, 3, with_bias>>);
  CHECK(linear<5, 3, no_bias>::name() == "linear<5, 3, no_bias>");
  CHECK(linear<5, 3>::name() == "linear<5, 3>");
  // the weight's initial values do not depend on the bias (the same stream indices)
  bound<linear<5, 3, no_bias>> nb;
  bound<linear<5, 3>> wb;
  for (index_t i = 0; i < 15; ++i) CHECK(nb.params[i] == wb.params[i]);
  // y = x W^T exactly: a zero input gives a zero output
  auto c = ctx(2, 1);
  tensor<float> x({2, 5});
  for (auto& v : x) v = 0.f;
  const auto y = nb.layer.forward(c, x.v());
  for (const float v : y) CHECK(v == 0.f);
}

TEST_CASE("swiglu_mlp: backward matches finite differences, alone and in a residual after rms_norm") {
  check_layer<swiglu_mlp<6, 10>>("swiglu_mlp<6, 10>", 4, 1, 6, 6);
  check_layer<residual<rms_norm<6>, swiglu_mlp<6, 10>>>("residual<rms_norm, swiglu_mlp>", 4, 1, 6, 6);
  static_assert(swiglu_mlp<6, 10>::param_count() == 180);
  CHECK(swiglu_mlp<6, 10>::name() == "swiglu_mlp<6, 10>");
  // y = down(SiLU(gate x) * up x), each a linear without bias, from the layer's own weights
  bound<swiglu_mlp<6, 10>> m;
  auto c = ctx(3, 1);
  tensor<float> x({3, 6});
  fill_normal(x.v(), 11);
  const auto y = m.layer.forward(c, x.v());
  const float* wg = m.params.data();
  const float* wu = wg + 60;
  const float* wd = wu + 60;
  double worst = 0;
  for (index_t r = 0; r < 3; ++r)
    for (index_t o = 0; o < 6; ++o) {
      double acc = 0;
      for (index_t j = 0; j < 10; ++j) {
        double g = 0, u = 0;
        for (index_t i = 0; i < 6; ++i) {
          g += double(wg[j * 6 + i]) * x[r * 6 + i];
          u += double(wu[j * 6 + i]) * x[r * 6 + i];
        }
        acc += double(wd[o * 10 + j]) * (g / (1 + std::exp(-g))) * u;
      }
      worst = std::max(worst, std::abs(acc - y[r * 6 + o]));
    }
  CHECK(worst < 1e-5);
}

TEST_CASE("relu: backward matches finite differences away from the kink") {
  bound<relu> m;
  auto c = ctx(3, 1);
  tensor<float> x({3, 6});
  fill_normal(x.v(), 7);
  for (auto& v : x) v = v < 0 ? v - 0.1f : v + 0.1f;  // |x| > h: no kink inside [x-h, x+h]
  auto r = gradients(m, c, x.v(), 6);
  check_close(r.an_x, r.fd_x, "relu: d(input)");
}

TEST_CASE("gelu: backward matches finite differences, values match the tanh form") {
  check_layer<gelu>("gelu", 3, 1, 7, 7);
  bound<gelu> m;
  auto c = ctx(1, 1);
  tensor<float> x({1, 9});
  for (index_t i = 0; i < 9; ++i) x[i] = -6.f + 1.5f * static_cast<float>(i);
  auto y = m.layer.forward(c, x);
  for (index_t i = 0; i < 9; ++i) {
    const double v = x[i];
    const double ref = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
    CHECK(y[i] == doctest::Approx(ref).epsilon(1e-5).scale(1.0));
  }
}

TEST_CASE("rms_norm: backward matches finite differences; output rows have unit mean square") {
  bound<rms_norm<6, 1e-5f>> m;  // gains away from 1, so that their gradients are generic
  for (index_t i = 0; i < m.count(); ++i) m.params[i] += 0.3f * static_cast<float>(i % 5) - 0.5f;
  auto c = ctx(4, 1);
  tensor<float> x({4, 6});
  fill_normal(x.v(), 7, 2.f);
  auto r = gradients(m, c, x.v(), 6);
  check_close(r.an_x, r.fd_x, "rms_norm: d(input)");
  check_close(r.an_p, r.fd_p, "rms_norm: d(gain)");
  check_layer<residual<rms_norm<6>, linear<6, 6>>>("residual<rms_norm, linear>", 4, 1, 6, 6);

  bound<rms_norm<6>> fresh;  // gain 1: each row's mean square is 1 (up to eps)
  auto y = fresh.layer.forward(c, x);
  for (index_t rr = 0; rr < 4; ++rr) {
    double ms = 0;
    for (index_t j = 0; j < 6; ++j) ms += y[rr * 6 + j] * y[rr * 6 + j] / 6.0;
    CHECK(ms == doctest::Approx(1).epsilon(1e-4));
  }
  CHECK(rms_norm<4096>::name() == "rms_norm<4096>");
  CHECK(rms_norm<4096, 1e-5f>::name() == "rms_norm<4096, 1e-05>");
  static_assert(rms_norm<8>::param_count() == 8 && rms_norm<8>::cost().params == 8);
}

TEST_CASE("layer_norm: backward matches finite differences; output rows are normalized") {
  // Perturb gain and bias away from (1, 0) so that their gradients are generic.
  bound<layer_norm<6>> m;
  for (index_t i = 0; i < m.count(); ++i) m.params[i] += 0.3f * static_cast<float>(i % 5) - 0.5f;
  auto c = ctx(4, 1);
  tensor<float> x({4, 6});
  fill_normal(x.v(), 7, 2.f);
  auto r = gradients(m, c, x.v(), 6);
  check_close(r.an_x, r.fd_x, "layer_norm: d(input)");
  check_close(r.an_p, r.fd_p, "layer_norm: d(gain, bias)");

  bound<layer_norm<6>> fresh;  // gain 1, bias 0: rows have mean 0, variance 1
  auto y = fresh.layer.forward(c, x);
  for (index_t rr = 0; rr < 4; ++rr) {
    double mean = 0, var = 0;
    for (index_t j = 0; j < 6; ++j) mean += y[rr * 6 + j] / 6.0;
    for (index_t j = 0; j < 6; ++j) var += (y[rr * 6 + j] - mean) * (y[rr * 6 + j] - mean) / 6.0;
    CHECK(mean == doctest::Approx(0).scale(1.0).epsilon(1e-5));
    CHECK(var == doctest::Approx(1).epsilon(1e-3));
  }
}

TEST_CASE("embedding: parameter gradient matches finite differences, repeated tokens add up") {
  bound<embedding<10, 4>> m;
  auto c = ctx(2, 5);
  tensor<std::int32_t> tok({2, 5});
  const std::int32_t ids[] = {3, 7, 3, 0, 9, 7, 7, 1, 3, 2};  // repeats: 3 x3, 7 x3
  for (index_t i = 0; i < 10; ++i) tok[i] = ids[i];
  auto r = gradients(m, c, tok.v(), 4);
  check_close(r.an_p, r.fd_p, "embedding: d(table)");

  // accumulate: a second backward adds the same gradient again
  std::vector<float> once(m.grads.begin(), m.grads.begin() + m.count());
  tensor<float> w({10, 4});
  fill_normal(w.v(), 99);
  c.accumulate = true;
  m.layer.forward(c, tok.v());
  m.layer.backward(c, w.v());
  for (index_t i = 0; i < m.count(); ++i) CHECK(m.grads[i] == doctest::Approx(2 * once[static_cast<std::size_t>(i)]));
}

TEST_CASE("embedding: an out-of-range token names the token and the vocabulary") {
  bound<embedding<10, 4>> m;
  auto c = ctx(1, 3);
  tensor<std::int32_t> tok({1, 3});
  tok[0] = 1;
  tok[1] = 10;
  tok[2] = 2;
  CHECK_THROWS_WITH_AS(m.layer.forward(c, tok.v()), doctest::Contains("token 10"), std::out_of_range);
  CHECK_THROWS_WITH_AS(m.layer.forward(c, tok.v()), doctest::Contains("vocabulary of 10"), std::out_of_range);
  tok[1] = -1;
  CHECK_THROWS_AS(m.layer.forward(c, tok.v()), std::out_of_range);
}

TEST_CASE("position_embedding: backward matches finite differences; T checked against MaxSeq") {
  check_layer<position_embedding<6, 4>>("position_embedding<6, 4>", 3, 5, 4, 4);
  bound<position_embedding<6, 4>> m;
  auto c = ctx(1, 7);
  tensor<float> x({7, 4});
  CHECK_THROWS_WITH_AS(m.layer.forward(c, x.v()), doctest::Contains("sequence length 7"),
                       std::invalid_argument);
}

TEST_CASE("causal_self_attention: backward matches finite differences") {
  check_layer<causal_self_attention<8, 2>>("causal_self_attention<8, 2>", 2, 5, 8, 8);
  check_layer<causal_self_attention<6, 3>>("causal_self_attention<6, 3>", 3, 4, 6, 6);
  check_layer<causal_self_attention<4, 1>>("causal_self_attention<4, 1>", 1, 1, 4, 4);
}

TEST_CASE("rotary_attention: backward matches finite differences (grouped, multi-head, multi-query, another base)") {
  check_layer<rotary_attention<8, 2, 1>>("rotary_attention<8, 2, 1>", 2, 5, 8, 8);
  check_layer<rotary_attention<8, 2>>("rotary_attention<8, 2>", 2, 5, 8, 8);
  check_layer<rotary_attention<12, 6, 3>>("rotary_attention<12, 6, 3>", 1, 4, 12, 12);
  check_layer<rotary_attention<8, 2, 1, 500.f>>("rotary_attention<8, 2, 1, 500>", 2, 5, 8, 8);
  check_layer<residual<rms_norm<8>, rotary_attention<8, 4, 2>>>("residual<rms_norm, rotary_attention>", 2, 5, 8, 8);
  static_assert(rotary_attention<8, 4, 2>::param_count() == 8 * 8 + 2 * 4 * 8 + 8 * 8);
  CHECK(rotary_attention<8, 4, 2>::name() == "rotary_attention<8, 4, 2>");
  CHECK(rotary_attention<8, 4, 2, 500000.f>::name() == "rotary_attention<8, 4, 2, 500000>");
}

namespace {
/// transformers' LlamaAttention written out in double from its formulas: q, k, v
/// projections; q and k turned by `q * cos + rotate_half(q) * sin` with float
/// inv_freq = 1 / theta^(arange(0, hd, 2) / hd); key/value head h / (H / KV) for
/// query head h (repeat_kv); causal softmax of q k^T / sqrt(hd); o_proj.
std::vector<double> llama_attention_reference(const float* w, const tensor<float>& x, index_t B, index_t T, index_t D,
                                              index_t H, index_t KV, float theta) {
  const index_t hd = D / H, R = B * T, kvw = KV * hd;
  const float* wq = w;
  const float* wk = wq + D * D;
  const float* wv = wk + kvw * D;
  const float* wo = wv + kvw * D;
  auto proj = [&](const float* m, index_t rows) {
    std::vector<double> out(static_cast<std::size_t>(R * rows));
    for (index_t r = 0; r < R; ++r)
      for (index_t o = 0; o < rows; ++o) {
        double a = 0;
        for (index_t i = 0; i < D; ++i) a += double(m[o * D + i]) * x[r * D + i];
        out[r * rows + o] = a;
      }
    return out;
  };
  auto q = proj(wq, D), k = proj(wk, kvw), v = proj(wv, kvw);
  auto rope = [&](std::vector<double>& t, index_t heads) {
    for (index_t r = 0; r < R; ++r)
      for (index_t h = 0; h < heads; ++h) {
        double* p = t.data() + r * heads * hd + h * hd;
        std::vector<double> rot(static_cast<std::size_t>(hd));
        for (index_t j = 0; j < hd; ++j) rot[j] = j < hd / 2 ? -p[j + hd / 2] : p[j - hd / 2];  // rotate_half
        for (index_t j = 0; j < hd; ++j) {
          const index_t f = j % (hd / 2);  // emb = cat(freqs, freqs)
          const float inv = 1.f / std::pow(theta, static_cast<float>(2 * f) / static_cast<float>(hd));
          const double a = static_cast<float>(r % T) * inv;
          p[j] = p[j] * std::cos(a) + rot[j] * std::sin(a);
        }
      }
  };
  rope(q, H);
  rope(k, KV);
  std::vector<double> o(static_cast<std::size_t>(R * D)), y(static_cast<std::size_t>(R * D));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const index_t g = h / (H / KV);
      for (index_t i = 0; i < T; ++i) {
        std::vector<double> sc(static_cast<std::size_t>(i + 1));
        double m = -1e300, z = 0;
        for (index_t j = 0; j <= i; ++j) {
          double a = 0;
          for (index_t e = 0; e < hd; ++e) a += q[(b * T + i) * D + h * hd + e] * k[(b * T + j) * kvw + g * hd + e];
          sc[j] = a / std::sqrt(double(hd));
          m = std::max(m, sc[j]);
        }
        for (auto& e : sc) z += (e = std::exp(e - m));
        for (index_t e = 0; e < hd; ++e) {
          double a = 0;
          for (index_t j = 0; j <= i; ++j) a += sc[j] / z * v[(b * T + j) * kvw + g * hd + e];
          o[(b * T + i) * D + h * hd + e] = a;
        }
      }
    }
  for (index_t r = 0; r < R; ++r)
    for (index_t c = 0; c < D; ++c) {
      double a = 0;
      for (index_t i = 0; i < D; ++i) a += double(wo[c * D + i]) * o[r * D + i];
      y[r * D + c] = a;
    }
  return y;
}
template <index_t D, index_t H, index_t KV, float Theta = 10000.f> double worst_against_reference(index_t B, index_t T) {
  bound<rotary_attention<D, H, KV, Theta>> m;
  auto c = ctx(B, T);
  tensor<float> x({B * T, D});
  fill_normal(x.v(), 13);
  const auto y = m.layer.forward(c, x.v());
  const auto want = llama_attention_reference(m.params.data(), x, B, T, D, H, KV, Theta);
  double worst = 0;
  for (index_t i = 0; i < B * T * D; ++i) worst = std::max(worst, std::abs(want[i] - y[i]) / std::max(1.0, std::abs(want[i])));
  return worst;
}
}  // namespace

TEST_CASE("rotary_attention: transformers' LlamaAttention formulas (rotate_half, repeat_kv), in double") {
  CHECK(worst_against_reference<16, 4, 2>(2, 9) < 1e-5);
  CHECK(worst_against_reference<16, 4, 1>(1, 12) < 1e-5);
  CHECK(worst_against_reference<16, 4, 4>(2, 7) < 1e-5);
  CHECK(worst_against_reference<16, 2, 1, 50.f>(1, 30) < 1e-5);  // a small base: large angles at later positions
}

TEST_CASE("causal_self_attention: a later token does not change earlier outputs") {
  bound<causal_self_attention<8, 2>> m;
  auto c = ctx(2, 6);
  tensor<float> x({12, 8});
  fill_normal(x.v(), 7);
  auto y0 = m.layer.forward(c, x.v());
  std::vector<float> before(y0.begin(), y0.end());
  for (index_t j = 0; j < 8; ++j) x[4 * 8 + j] += 1.f;  // sequence 0, token 4
  auto y1 = m.layer.forward(c, x.v());
  for (index_t r = 0; r < 12; ++r) {
    float diff = 0;
    for (index_t j = 0; j < 8; ++j) diff = std::max(diff, std::abs(y1[r * 8 + j] - before[static_cast<std::size_t>(r * 8 + j)]));
    INFO("row " << r);
    if (r < 4 || r >= 6) CHECK(diff == 0.f);  // earlier tokens and the other sequence
    else CHECK(diff > 1e-4f);                  // token 4 itself and token 5 see the change
  }
}

TEST_CASE("causal_self_attention: rows that are not batch x seq throw") {
  bound<causal_self_attention<8, 2>> m;
  auto c = ctx(2, 3);
  tensor<float> x({5, 8});
  CHECK_THROWS_WITH_AS(m.layer.forward(c, x.v()), doctest::Contains("step_ctx::batch"),
                       std::invalid_argument);
}

TEST_CASE("residual: backward matches finite differences") {
  check_layer<residual<layer_norm<6>, linear<6, 6>>>("residual<layer_norm, linear>", 4, 1, 6, 6);
  check_layer<residual<gelu>>("residual<gelu>", 2, 1, 5, 5);
}

TEST_CASE("transformer_block: backward matches finite differences") {
  check_layer<transformer_block<8, 2, 16>>("transformer_block<8, 2, 16>", 2, 4, 8, 8);
}

TEST_CASE("repeat: backward matches finite differences") {
  check_layer<repeat<2, transformer_block<4, 2, 8>>>("repeat<2, transformer_block<4, 2, 8>>", 2, 3, 4, 4);
}

TEST_CASE("sequential: backward matches finite differences") {
  check_layer<sequential<linear<5, 8>, gelu, layer_norm<8>, linear<8, 3>, relu, linear<3, 4>>>(
      "sequential<linear, gelu, layer_norm, linear, relu, linear>", 4, 1, 5, 4);
}

TEST_CASE("softmax_cross_entropy: d(logits) matches finite differences") {
  softmax_cross_entropy loss;
  auto c = ctx(5, 1);
  c.global_rows = 8;  // this rank's share of a larger batch
  tensor<float> z({5, 7});
  fill_normal(z.v(), 7, 2.f);
  tensor<std::int32_t> y({5});
  for (index_t i = 0; i < 5; ++i) y[i] = static_cast<std::int32_t>((3 * i + 1) % 7);
  loss.forward_loss(c, z.v(), y.v());
  auto d = loss.backward_loss(c);
  std::vector<double> an(d.begin(), d.end()), fd;
  for (index_t i = 0; i < z.numel(); ++i) {
    const float saved = z[i];
    z[i] = static_cast<float>(saved + fd_step);
    const double lp = loss.forward_loss(c, z.v(), y.v());
    z[i] = static_cast<float>(saved - fd_step);
    const double lm = loss.forward_loss(c, z.v(), y.v());
    z[i] = saved;
    fd.push_back((lp - lm) / (2 * fd_step));
  }
  check_close(an, fd, "softmax_cross_entropy: d(logits)");
}
