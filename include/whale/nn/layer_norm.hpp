// `layer_norm<D>`: LayerNorm over the last dimension with a learned gain and
// bias (eps 1e-5), as torch.nn.LayerNorm(D). No RMSNorm, no other axes.
#pragma once

#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "whale/backend/kernels/rows.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// y = (x - mean) / sqrt(var + 1e-5) * gain + bias, per row of width D.
/// Parameters: gain (D) init 1, then bias (D) init 0. Keeps the normalized
/// input and 1/std per row for backward.
template <index_t D>
struct layer_norm {
  static_assert(D > 0, "whale::layer_norm: D must be a positive feature count");
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static constexpr float eps = 1e-5f;
  static constexpr bool rounds_output = true, rounds_input_grad = true;  // under bf16 its kernels store rounded
  static constexpr bool takes_residual_sum = true;  // a residual's sum left to it is stored in its forward's pass
  static constexpr bool accepts_residual_grad = true;  // first in a residual branch: its dx kernel adds the residual's dy
  static constexpr bool rounds_grad_on_read = true;    // under bf16 its kernels read dy rounded

  static std::string name() { return "layer_norm<" + std::to_string(D) + ">"; }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 8.0 * D;   // mean, variance, normalize, scale and shift
    c.bwd_flops = 12.0 * D;  // two row reductions, dx, d(gain), d(bias)
    c.params = 2 * D;
    c.act_bytes = 4.0 * (2 * D + 2);  // output, input gradient, mean and 1/std (x-hat is recomputed from the kept input)
    return c;
  }
  static constexpr index_t param_count() noexcept { return 2 * D; }
  static constexpr std::array<param_tensor, 2> param_tensors() {
    return {{{"gain", param_role::gain, D, D, {D}}, {"bias", param_role::bias, D, D, {D}}}};
  }

  void bind(param_binder& b) {
    auto g = b.take({D});
    auto bias = b.take({D});
    g_ = g.value;
    dg_ = g.grad;
    b_ = bias.value;
    db_ = bias.grad;
  }
  /// Constant init (gain 1, bias 0): trivially a pure function of the index.
  void init(const counter_rng&) {
    for (index_t i = 0; i < D; ++i) {
      g_[i] = 1.f;
      b_[i] = 0.f;
    }
  }

  // x: (R, D) -> y: (R, D)
  view<float> forward(step_ctx& c, cview<float> x) {
    if (x.numel() % D != 0)
      throw std::invalid_argument("whale::layer_norm: " + std::to_string(x.numel()) +
                                  " inputs do not form rows of " + std::to_string(D));
    auto& s = st_(c.slot);
    const index_t R = x.numel() / D;
    auto y = detail::ensure(s.y, {R, D});
    auto mean = detail::ensure(s.mean, {R});
    auto rs = detail::ensure(s.rstd, {R});
    s.x = x;  // x-hat is recomputed from x, the mean and 1/std in backward, to the bit
    // a residual's sum left to this layer (step_ctx::pending_sum): stored into x in this pass, then normalised
    auto& p = c.pending_sum;
    const bool sum_here = p.y && p.y == x.data() && p.cols == D && p.rows == R;
    if (p.y && !sum_here) detail::finish_residual_sum(c);
    kernels::layer_norm_forward body{x.data(), g_.data(), b_.data(), y.data(), nullptr, rs.data(), D, eps, c.bf16,
                                     mean.data()};
    if (sum_here) body.sum_y = p.y, body.sum_bias = p.bias, body.sum_add = p.add, p = {};
    c.be.launch(R, body);
    return y;
  }

  // dy: (R, D) -> dx: (R, D);  dx = rstd (dxh - mean(dxh) - xh mean(dxh xh)), dxh = dy gain
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / D;
    view<float> dx;
    const float* add = nullptr;
    if (c.need_input_grad) {
      dx = detail::ensure(s.dx, {R, D});
      add = c.bf16 ? detail::take_residual(c.residual_grad, R * D) : nullptr;
    }
    // d(input) and, in the same pass over dy and x, the tiles' sums of d(gain) and d(bias); then the tiles added
    const kernels::layer_norm_backward row{dy.data(), nullptr, s.rstd.data(), g_.data(), dx.data(), D, c.bf16, add,
                                           s.x.data(), s.mean.data()};
    c.be.launch_summing(R, kernels::layer_norm_backward_sums{row, nullptr, R},
                        kernels::layer_norm_param_grads{dy.data(), nullptr, dg_.data(), db_.data(), R, D, c.accumulate,
                                                        c.bf16, s.x.data(), s.mean.data(), s.rstd.data()});
    if (!c.need_input_grad) return {};
    return dx;
  }

  view<float> gain() const noexcept { return g_; }
  view<float> bias() const noexcept { return b_; }

 private:
  struct state {
    cview<float> x;  // the input, kept (x-hat is recomputed from it)
    tensor<float> y, mean, rstd, dx;
  };
  view<float> g_, dg_, b_, db_;
  slots<state> st_;
};

}  // namespace whale
