// `gelu`: the tanh form of the Gaussian error linear unit (GPT-2, BERT),
// elementwise, any width. Keeps a view of its input for backward; the exact
// erf form is not provided.
#pragma once

#include <string>
#include <utility>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); keeps the width it is given.
/// Backward recomputes the tanh from the saved input view (the producer's output).
struct gelu : stateless_params {
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = any_features;
  static constexpr bool rounds_output = true, rounds_input_grad = true;  // under bf16 its kernels store rounded
  static constexpr bool rounds_grad_on_read = true;  // under bf16 its backward reads dy rounded
  static constexpr bool rounds_input_on_read = true;  // and both passes read x rounded
  static constexpr bool is_gelu = true;  // a linear before it may compute it in its GEMM (step_ctx::gelu_in_gemm)
  static std::string name() { return "gelu"; }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 24;  // the cubic, the exp polynomial, a division
    c.bwd_flops = 32;  // the same again, plus the derivative
    c.act_bytes = 8;   // output and input-gradient buffers (the input is the producer's)
    c.per_feature = true;
    return c;
  }

  // x: (R, F) -> y: (R, F)
  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);
    if (c.gelu_pre.data()) {  // the layer before computed GELU in its GEMM: x is the result, gelu_pre its argument
      s.x = std::exchange(c.gelu_pre, cview<float>{});
      return view<float>(const_cast<float*>(x.data()), x.shape());
    }
    s.x = x;
    auto y = detail::ensure(s.y, x.shape());
    c.be.launch(x.numel(), kernels::gelu_forward{x.data(), y.data(), c.bf16});
    return y;
  }
  /// The input the forward of slot `slot` kept (GELU's argument), for a layer after it that computes its gradient.
  cview<float> kept_input(int slot) { return st_(slot).x; }
  // dy: (R, F) -> dx: (R, F)
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    if (std::exchange(c.dgelu_done, false))  // the layer after computed d(input) through GELU in its GEMM: dy is it
      return c.need_input_grad ? view<float>(const_cast<float*>(dy.data()), dy.shape()) : view<float>{};
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, dy.shape());
    c.be.launch(dy.numel(), kernels::gelu_backward{s.x.data(), dy.data(), dx.data(), c.bf16});
    return dx;
  }

 private:
  struct state {
    cview<float> x;
    tensor<float> y, dx;
  };
  slots<state> st_;
};

}  // namespace whale
