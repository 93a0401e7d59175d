// `swiglu_mlp<D, Hidden>`: Llama's MLP (transformers' LlamaMLP), on (R, D)
// rows: down(SiLU(gate(x)) * up(x)), three projections without bias. The
// tensor-parallel form (Megatron's: gate and up column-split together, down
// row-split) is in strategy/split_layers.hpp.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/fwd.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

namespace detail {
/// What the whole and the split SwiGLU MLP share: the arithmetic on `n_`
/// hidden features (all of them, or one rank's slice). Gate and up are one
/// (2n, D) matrix, gate rows first, so their product is one GEMM whose rows
/// hold g and u side by side; down is (D, n).
template <index_t D> class swiglu_body {
 protected:
  explicit swiglu_body(index_t n) : n_(n) {}
  index_t param_count_() const { return 3 * n_ * D; }
  void bind_(param_binder& b) {
    auto gu = b.take({2 * n_, D});  // gate (n, D), then up (n, D)
    auto d = b.take({D, n_});
    wgu_ = gu.value, dwgu_ = gu.grad, wd_ = d.value, dwd_ = d.grad;
  }
  /// y = (SiLU(x Wg^T) * (x Wu^T)) Wd^T. `whole`: the unsplit layer, whose
  /// output under bf16 is stored rounded by the pass that adds a residual's
  /// input (as linear's); a split rank's output is a partial sum, left as it is.
  view<float> forward_(step_ctx& c, cview<float> x, bool whole) {
    auto& s = st_(c.slot);
    const index_t R = x.numel() / D;
    s.x = x;
    auto gu = detail::ensure(s.gu, {R, 2 * n_});
    auto h = detail::ensure(s.h, {R, n_});
    auto y = detail::ensure(s.y, {R, D});
    c.be.gemm(trans::no, trans::yes, R, 2 * n_, D, 1.f, x.data(), wgu_.data(), 0.f, gu.data());
    c.be.launch(R * n_, kernels::swiglu_forward{gu.data(), h.data(), n_, c.bf16});
    if (whole) {
      const float* add = c.bf16 ? detail::take_residual(c.residual_add, R * D) : nullptr;
      detail::affine_forward(c, h.data(), wd_.data(), nullptr, y.data(), R, D, n_, c.bf16, add);
    } else {
      c.be.gemm(trans::no, trans::yes, R, D, n_, 1.f, h.data(), wd_.data(), 0.f, y.data());
    }
    return y;
  }
  template <class L> view<float> backward_(step_ctx& c, cview<float> dy, L* self) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / D;
    s.dy = dy;
    auto dh = detail::ensure(s.dh, {R, n_});
    auto dgu = detail::ensure(s.dgu, {R, 2 * n_});
    c.be.gemm(trans::no, trans::no, R, n_, D, 1.f, dy.data(), wd_.data(), 0.f, dh.data());
    c.be.launch(R * n_, kernels::swiglu_backward{s.gu.data(), dh.data(), dgu.data(), n_, c.bf16});
    if (!defer_weights(c, self)) weight_grads_(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, D});
    c.be.gemm(trans::no, trans::no, R, D, 2 * n_, 1.f, dgu.data(), wgu_.data(), 0.f, dx.data());
    return dx;
  }
  /// d(down) = dy^T h and d(gate, up) = d(g, u)^T x from slot `slot`'s saved tensors.
  void weight_grads_(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    const index_t R = s.dy.numel() / D;
    be.linear_weight_grads(R, D, n_, s.dy.data(), s.h.data(), dwd_.data(), nullptr, accumulate);
    be.linear_weight_grads(R, 2 * n_, D, s.dgu.data(), s.x.data(), dwgu_.data(), nullptr, accumulate);
  }

  struct state {
    cview<float> x, dy;
    tensor<float> gu, h, y, dh, dgu, dx;
  };
  index_t n_;
  view<float> wgu_, dwgu_, wd_, dwd_;
  slots<state> st_;
};
}  // namespace detail

/// Llama's MLP on (R, D) rows: y = down(SiLU(gate(x)) * up(x)), each
/// projection a linear without bias. Parameters, in order: gate.weight
/// (Hidden, D), up.weight (Hidden, D), down.weight (D, Hidden), as
/// transformers' gate_proj, up_proj and down_proj hold them. Init as three
/// PyTorch linears: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), element i of the
/// flat block drawn from the layer's stream at index i.
template <index_t D, index_t Hidden>
struct swiglu_mlp : detail::swiglu_body<D> {
  static_assert(D > 0 && Hidden > 0, "whale::swiglu_mlp: D and Hidden must be positive feature counts");
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static constexpr index_t hidden = Hidden;
  static constexpr bool rounds_output = true;         // under bf16 the pass after the down projection stores y rounded
  static constexpr bool accepts_residual_add = true;  // last in a residual branch: under bf16 that pass adds x

  swiglu_mlp() : detail::swiglu_body<D>(Hidden) {}

  static std::string name() { return "swiglu_mlp<" + std::to_string(D) + ", " + std::to_string(Hidden) + ">"; }
  /// Per row: three GEMMs of D x Hidden (6 D H forward, 12 D H backward) and
  /// the gate (about 8 and 14 FLOPs per hidden feature). Activations: g and u,
  /// h, y; in backward d(h), d(g, u), d(input).
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 6.0 * D * Hidden + 8.0 * Hidden;
    c.bwd_flops = 12.0 * D * Hidden + 14.0 * Hidden;
    c.params = param_count();
    c.act_bytes = 4.0 * (6 * Hidden + 2 * D);
    return c;
  }
  static constexpr index_t param_count() noexcept { return 3 * D * Hidden; }
  static constexpr std::array<param_tensor, 3> param_tensors() {
    return {{{"gate.weight", param_role::weight, Hidden * D, D, {Hidden, D}},
             {"up.weight", param_role::weight, Hidden * D, D, {Hidden, D}},
             {"down.weight", param_role::weight, D * Hidden, Hidden, {D, Hidden}}}};
  }

  void bind(param_binder& b) { this->bind_(b); }
  void init(const counter_rng& r) {
    const double kin = 1.0 / std::sqrt(static_cast<double>(D)), kh = 1.0 / std::sqrt(static_cast<double>(Hidden));
    for (index_t i = 0; i < 2 * Hidden * D; ++i)
      this->wgu_[i] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(i)) - 1) * kin);
    for (index_t i = 0; i < D * Hidden; ++i)
      this->wd_[i] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(2 * Hidden * D + i)) - 1) * kh);
  }

  // x: (R, D) -> y: (R, D)
  view<float> forward(step_ctx& c, cview<float> x) { return this->forward_(c, x, true); }
  // dy: (R, D) -> dx: (R, D); the weight gradients now or, in a split backward, in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) { return this->backward_(c, dy, this); }
  void weight_grads(const backend_ref& be, int slot, bool accumulate) { this->weight_grads_(be, slot, accumulate); }

  view<float> gate_up_weight() const noexcept { return this->wgu_; }  ///< (2 Hidden, D): gate rows, then up rows
  view<float> down_weight() const noexcept { return this->wd_; }
};

}  // namespace whale
