// `rms_norm<D, Eps>`: RMSNorm over the last dimension with a learned gain, as
// Llama, Mistral and Qwen use it (transformers' LlamaRMSNorm): no mean is
// subtracted and there is no bias. Eps defaults to 1e-6 (LlamaConfig's
// rms_norm_eps; Llama 2 and 3 checkpoints say 1e-5: write rms_norm<D, 1e-5f>).
#pragma once

#include <array>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "whale/backend/kernels/rows.hpp"
#include "whale/fwd.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// y = x / sqrt(mean(x^2) + Eps) * gain, per row of width D. Parameters: gain
/// (D), init 1. Keeps the normalized input and 1/rms per row for backward.
/// Row-wise: inside a split region it runs whole on every rank (replicated
/// features), as layer_norm does.
template <index_t D, float Eps>  // Eps defaults to 1e-6f (its declaration in whale/fwd.hpp)
struct rms_norm {
  static_assert(D > 0, "whale::rms_norm: D must be a positive feature count");
  static_assert(Eps > 0.f, "whale::rms_norm: Eps must be positive");
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static constexpr float eps = Eps;
  static constexpr bool rounds_output = true, rounds_input_grad = true;  // under bf16 its kernels store rounded
  static constexpr bool takes_residual_sum = true;  // a residual's sum left to it is stored in its forward's pass
  static constexpr bool accepts_residual_grad = true;  // first in a residual branch: its dx kernel adds the residual's dy
  static constexpr bool rounds_grad_on_read = true;    // under bf16 its kernels read dy rounded

  static std::string name() {
    if (Eps == 1e-6f) return "rms_norm<" + std::to_string(D) + ">";
    char e[32];
    std::snprintf(e, sizeof e, "%g", static_cast<double>(Eps));
    return "rms_norm<" + std::to_string(D) + ", " + e + ">";
  }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 4.0 * D;  // squares, their mean, normalize, scale
    c.bwd_flops = 7.0 * D;  // one row reduction, dx, d(gain)
    c.params = D;
    c.act_bytes = 4.0 * (3 * D + 1);  // x-hat, output, input gradient, 1/rms
    return c;
  }
  static constexpr index_t param_count() noexcept { return D; }
  static constexpr std::array<param_tensor, 1> param_tensors() { return {{{"gain", param_role::gain, D, D, {D}}}}; }

  void bind(param_binder& b) {
    auto g = b.take({D});
    g_ = g.value;
    dg_ = g.grad;
  }
  /// Constant init (gain 1): trivially a pure function of the index.
  void init(const counter_rng&) {
    for (index_t i = 0; i < D; ++i) g_[i] = 1.f;
  }

  // x: (R, D) -> y: (R, D)
  view<float> forward(step_ctx& c, cview<float> x) {
    if (x.numel() % D != 0)
      throw std::invalid_argument("whale::rms_norm: " + std::to_string(x.numel()) + " inputs do not form rows of " +
                                  std::to_string(D));
    auto& s = st_(c.slot);
    const index_t R = x.numel() / D;
    auto y = detail::ensure(s.y, {R, D});
    auto xh = detail::ensure(s.xhat, {R, D});
    auto rs = detail::ensure(s.rstd, {R});
    // a residual's sum left to this layer (step_ctx::pending_sum): stored into x in this pass, then normalised
    auto& p = c.pending_sum;
    const bool sum_here = p.y && p.y == x.data() && p.cols == D && p.rows == R;
    if (p.y && !sum_here) detail::finish_residual_sum(c);
    kernels::rms_norm_forward body{x.data(), g_.data(), y.data(), xh.data(), rs.data(), D, Eps, c.bf16};
    if (sum_here) body.sum_y = p.y, body.sum_bias = p.bias, body.sum_add = p.add, p = {};
    c.be.launch(R, body);
    return y;
  }

  // dy: (R, D) -> dx: (R, D);  dx = rstd (dy gain - xh mean(dy gain xh))
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / D;
    view<float> dx;
    const float* add = nullptr;
    if (c.need_input_grad) {
      dx = detail::ensure(s.dx, {R, D});
      add = c.bf16 ? detail::take_residual(c.residual_grad, R * D) : nullptr;
    }
    // d(input) and, in the same pass over dy and x-hat, the tiles' sums of d(gain); then the tiles added
    const kernels::rms_norm_backward row{dy.data(), s.xhat.data(), s.rstd.data(), g_.data(), dx.data(), D, c.bf16, add};
    c.be.launch_summing(R, kernels::rms_norm_backward_sums{row, nullptr, R},
                        kernels::rms_norm_param_grads{dy.data(), s.xhat.data(), dg_.data(), R, D, c.accumulate, c.bf16});
    if (!c.need_input_grad) return {};
    return dx;
  }

  view<float> gain() const noexcept { return g_; }

 private:
  struct state {
    tensor<float> y, xhat, rstd, dx;
  };
  view<float> g_, dg_;
  slots<state> st_;
};

}  // namespace whale
