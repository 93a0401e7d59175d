// `linear<In, Out>`: y = x W^T + b with W of shape (Out, In), as in PyTorch;
// `linear<In, Out, no_bias>`: y = x W^T (PyTorch's bias=False).
// The unsplit layer only; its column- and row-parallel forms are in strategy/.
#pragma once

#include <array>
#include <cmath>
#include <string>

#include "whale/fwd.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

namespace detail {
/// ", no_bias" in a layer's name when it has no bias, nothing otherwise.
constexpr const char* bias_suffix(bias_mode b) { return b == bias_mode::none ? ", no_bias" : ""; }
}  // namespace detail

/// Fully connected layer. Parameters: W (Out, In), then b (Out) unless
/// Bias is no_bias. Init as PyTorch: uniform(-1/sqrt(In), 1/sqrt(In)),
/// element i of the flat (W, b) drawn from the layer's stream at index i, so
/// any slice can be made alone (W's values do not depend on Bias).
template <index_t In, index_t Out, bias_mode Bias>  // Bias defaults to with_bias (whale/fwd.hpp)
struct linear {
  static_assert(In > 0 && Out > 0, "whale::linear: In and Out must be positive feature counts");
  using input_type = float;
  static constexpr index_t in_features = In;
  static constexpr index_t out_features = Out;
  static constexpr bool has_bias = Bias == bias_mode::added;
  static constexpr bool rounds_output = true;  // under bf16 the bias pass stores y rounded (d(input) is a GEMM's)
  static constexpr bool accepts_residual_add = true;  // last in a residual branch: under bf16 the bias pass adds x
  // (and under bf16, where the next layer rounds its input as it reads it, y is left as the GEMM writes it:
  // the product and the bias in one call, step_ctx::output_read_rounded)
  static constexpr bool fuses_gelu = true;  // a gelu after it in its GEMM, a gelu's gradient before it in its d(input) GEMM

  static std::string name() {
    return "linear<" + std::to_string(In) + ", " + std::to_string(Out) + detail::bias_suffix(Bias) + ">";
  }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 2.0 * In * Out;
    c.bwd_flops = 4.0 * In * Out;
    c.params = param_count();
    c.act_bytes = 4.0 * (In + Out);  // saved input and the output buffer
    return c;
  }
  static constexpr index_t param_count() noexcept { return In * Out + (has_bias ? Out : 0); }
  static constexpr std::array<param_tensor, has_bias ? 2 : 1> param_tensors() {
    if constexpr (has_bias)
      return {{{"weight", param_role::weight, In * Out, In, {Out, In}}, {"bias", param_role::bias, Out, In, {Out}}}};
    else
      return {{{"weight", param_role::weight, In * Out, In, {Out, In}}}};
  }

  void bind(param_binder& b) {
    auto w = b.take({Out, In});
    w_ = w.value;
    dw_ = w.grad;
    if constexpr (has_bias) {
      auto bias = b.take({Out});
      b_ = bias.value;
      db_ = bias.grad;
    }
  }
  void init(const counter_rng& r) {
    const double k = 1.0 / std::sqrt(static_cast<double>(In));
    for (index_t i = 0; i < In * Out; ++i) w_[i] = static_cast<float>((2 * r.uniform(i) - 1) * k);
    if constexpr (has_bias)
      for (index_t o = 0; o < Out; ++o)
        b_[o] = static_cast<float>((2 * r.uniform(In * Out + o) - 1) * k);
  }

  // x: (R, In) -> y: (R, Out)
  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);
    const index_t R = x.numel() / In;
    s.x = x;
    auto y = detail::ensure(s.y, {R, Out});
    const float* add = c.bf16 ? detail::take_residual(c.residual_add, R * Out) : nullptr;
    if (c.gelu_in_gemm && !add) {  // y = x W^T + b kept for the gelu after, which returns GELU(y) computed here
      c.gelu_in_gemm = false;
      auto h = detail::ensure(s.h, {R, Out});
      c.be.gemm_gelu({trans::no, trans::yes, R, Out, In, x.data(), w_.data(), b_.data(), y.data(), h.data(), false, c.bf16});
      c.gelu_pre = y;
      return h;
    }
    const bool round = c.bf16 && (add || !c.output_read_rounded);
    detail::affine_forward(c, x.data(), w_.data(), b_.data(), y.data(), R, Out, In, round, add);
    return y;
  }
  // dy: (R, Out) -> dx: (R, In); the weight gradients now or, in a split backward, in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / Out;
    s.dy = dy;
    if (!defer_weights(c, this)) weight_grads(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, In});
    if (c.dgelu_pre.data() && c.dgelu_pre.numel() == R * In) {  // d(the gelu before's input), through GELU' in the GEMM
      c.be.gemm_gelu({trans::no, trans::no, R, In, Out, dy.data(), w_.data(), nullptr,
                      const_cast<float*>(c.dgelu_pre.data()), dx.data(), true, c.bf16});
      c.dgelu_pre = {};
      c.dgelu_done = true;
      return dx;
    }
    c.be.gemm(trans::no, trans::no, R, In, Out, 1.f, dy.data(), w_.data(), 0.f, dx.data());
    return dx;
  }

  /// dW = dy^T x and db = column sums of dy (with a bias), from slot `slot`'s saved x and dy.
  void weight_grads(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    be.linear_weight_grads(s.dy.numel() / Out, Out, In, s.dy.data(), s.x.data(), dw_.data(), db_.data(), accumulate);
  }

  view<float> weight() const noexcept { return w_; }
  view<float> bias() const noexcept { return b_; }  ///< empty without a bias

 private:
  struct state {
    cview<float> x, dy;
    tensor<float> y, dx;
    tensor<float> h;  // GELU(y), where the gelu after it is computed in its GEMM
  };
  view<float> w_, dw_, b_, db_;  // b_ and db_ stay empty (null) without a bias
  slots<state> st_;
};

}  // namespace whale
