// `relu`: y = max(x, 0), elementwise, any width. Keeps its output for backward.
#pragma once

#include <string>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// Rectified linear unit; keeps the feature width it is given.
struct relu : stateless_params {
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = any_features;
  static std::string name() { return "relu"; }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 1;
    c.bwd_flops = 1;
    c.act_bytes = 8;  // output and input-gradient buffers
    c.per_feature = true;
    return c;
  }

  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);
    auto y = detail::ensure(s.y, x.shape());
    c.be.launch(x.numel(), kernels::relu_forward{x.data(), y.data()});
    return y;
  }
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    auto dx = detail::ensure(s.dx, dy.shape());
    c.be.launch(dy.numel(), kernels::relu_backward{s.y.data(), dy.data(), dx.data()});
    return dx;
  }

 private:
  struct state {
    tensor<float> y, dx;
  };
  slots<state> st_;
};

}  // namespace whale
