// `gelu`: the tanh form of the Gaussian error linear unit (GPT-2, BERT),
// elementwise, any width. Keeps a view of its input for backward; the exact
// erf form is not provided.
#pragma once

#include <string>

#include "whale/nn/detail/vmath.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); keeps the width it is given.
/// Backward recomputes the tanh from the saved input view (the producer's output).
struct gelu : stateless_params {
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = any_features;
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
    s.x = x;
    auto y = detail::ensure(s.y, x.shape());
    const index_t n = x.numel();
    const float* __restrict xp = x.data();
    float* __restrict yp = y.data();
    for (index_t i = 0; i < n; ++i) {
      const float v = xp[i];
      const float t = detail::vtanh(k0 * (v + k1 * v * v * v));
      yp[i] = 0.5f * v * (1.f + t);
    }
    return y;
  }
  // dy: (R, F) -> dx: (R, F)
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, dy.shape());
    const index_t n = dy.numel();
    const float* __restrict xp = s.x.data();
    const float* __restrict g = dy.data();
    float* __restrict d = dx.data();
    for (index_t i = 0; i < n; ++i) {
      const float v = xp[i];
      const float v2 = v * v;
      const float t = detail::vtanh(k0 * (v + k1 * v2 * v));
      const float du = k0 * (1.f + 3.f * k1 * v2);  // d(inner)/dx
      d[i] = g[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
    }
    return dx;
  }

 private:
  static constexpr float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float k1 = 0.044715f;
  struct state {
    cview<float> x;
    tensor<float> y, dx;
  };
  slots<state> st_;
};

}  // namespace whale
