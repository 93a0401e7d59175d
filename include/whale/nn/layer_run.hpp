// How a layer's pass runs: what each layer rounds or fuses by itself under
// bf16 (the traits the containers ask), the residual sum handed between
// layers, the affine forward, and run_forward / run_backward with the
// finite-value checks and hooks around them. Part of nn/layer.hpp.
#pragma once

#include <type_traits>

#include "whale/nn/layer_concept.hpp"

namespace whale {

/// Whether layer L stores its forward output (`rounds_output`) or its input
/// gradient (`rounds_input_grad`) as bf16 mixed precision stores it by
/// itself: the kernel that writes it rounds (kernels::stored_as), or the
/// container returns what an element it ran gave. Then no rounding pass
/// follows. Default: no.
template <class L> constexpr bool rounds_output() {
  if constexpr (requires { L::rounds_output; }) return L::rounds_output;
  else return false;
}
template <class L> constexpr bool rounds_input_grad() {
  if constexpr (requires { L::rounds_input_grad; }) return L::rounds_input_grad;
  else return false;
}

/// Whether layer L, as the last layer of a residual branch, may add the
/// residual's input to its output (step_ctx::residual_add), or, as the first,
/// the residual's output gradient to its input gradient (residual_grad).
/// Whether layer L's backward reads its dy as bf16 would hold it (rounding
/// each value it reads; a stored value is unchanged): then the element
/// before it need not round its input gradient in a pass of its own.
template <class L> constexpr bool rounds_grad_on_read() {
  if constexpr (requires { L::rounds_grad_on_read; }) return L::rounds_grad_on_read;
  else return false;
}
/// Whether layer L's forward reads its input as bf16 would hold it (rounding
/// each value it reads; a stored value is unchanged): then the element
/// before it may leave its output unrounded (step_ctx::output_read_rounded).
template <class L> constexpr bool rounds_input_on_read() {
  if constexpr (requires { L::rounds_input_on_read; }) return L::rounds_input_on_read;
  else return false;
}
/// Whether layer L computes a `gelu` after it in its GEMM's call, and the
/// gradient of a `gelu` before it in its d(input) GEMM (step_ctx::gelu_in_gemm, dgelu_pre).
template <class L> constexpr bool fuses_gelu() {
  if constexpr (requires { L::fuses_gelu; }) return L::fuses_gelu;
  else return false;
}
/// Whether L is `gelu` (it takes what a fuses_gelu layer computed for it).
template <class L> constexpr bool is_gelu() {
  if constexpr (requires { L::is_gelu; }) return L::is_gelu;
  else return false;
}
/// Whether layer L's forward takes a residual's sum left pending by the
/// element before it (step_ctx::pending_sum) and stores it in its own pass.
template <class L> constexpr bool takes_residual_sum() {
  if constexpr (requires { L::takes_residual_sum; }) return L::takes_residual_sum;
  else return false;
}
/// Whether container L passes step_ctx::sum_taken_after on to the element
/// that ends it (sequential, repeat, residual). Any other container (e.g.
/// recompute<B>, which copies its block's output) runs with it cleared, so
/// that no sum is left pending inside it.
template <class L> constexpr bool carries_residual_sum() {
  if constexpr (requires { L::carries_residual_sum; }) return L::carries_residual_sum;
  else return false;
}
template <class L> constexpr bool accepts_residual_add() {
  if constexpr (requires { L::accepts_residual_add; }) return L::accepts_residual_add;
  else return false;
}
template <class L> constexpr bool accepts_residual_grad() {
  if constexpr (requires { L::accepts_residual_grad; }) return L::accepts_residual_grad;
  else return false;
}

namespace detail {
/// The residual's addend offered in `slot` (step_ctx::residual_add or
/// residual_grad), taken by a layer whose result has `n` elements: its data,
/// with the field cleared (the residual adds nothing then); null where none
/// is offered or its size differs (the residual then adds, or says why not).
inline const float* take_residual(cview<float>& slot, index_t n) noexcept {
  if (slot.data() == nullptr || slot.numel() != n) return nullptr;
  const float* p = slot.data();
  slot = {};
  return p;
}
/// A residual's sum left pending (step_ctx::pending_sum) stored by the bias
/// pass: for a layer that does not take it, before it runs.
inline void finish_residual_sum(step_ctx& c) {
  auto& p = c.pending_sum;
  if (!p.y) return;
  c.be.launch(p.rows, kernels::bias_rows{p.y, p.bias, p.cols, true, true, p.add});
  p = {};
}
/// Under bf16 mixed precision, a tensor as it would be stored: rounded to bf16
/// in place, unless what produced it rounded it already (`done`).
template <bool done = false> inline view<float> stored(const step_ctx& c, view<float> v) {
  if constexpr (!done)
    if (c.bf16 && v.data() && v.numel() > 0) c.be.launch(v.numel(), kernels::to_bf16{v.data()});
  return v;
}
/// y = x W^T + b, with x (R, In), W (Out, In) and y (R, Out). Under bf16
/// (`round`): the product, then the bias added in the pass that stores y
/// rounded (no rounding pass after). Otherwise: the product and the bias in
/// one GEMM call where the device's GEMM has a bias epilogue, or y = b and
/// then the product added (backend_ref::gemm_bias: the same values).
/// With `add` (a residual's input, bf16 only): y = x W^T + b + add, each sum
/// stored rounded, in the same pass. `b` null: no bias (y = x W^T, rounded
/// in the pass that adds `add` under bf16).
inline void affine_forward(const backend_ref& be, const float* x, const float* w, const float* b, float* y, index_t R,
                           index_t Out, index_t In, bool round, const float* add = nullptr) {
  if (round) {
    be.gemm(trans::no, trans::yes, R, Out, In, 1.f, x, w, 0.f, y);
    be.launch(R, kernels::bias_rows{y, b, Out, true, true, add});
  } else {
    be.gemm_bias(trans::no, trans::yes, R, Out, In, x, w, b, y);
  }
}
/// The same at a residual branch's end: with `add` (the residual's input,
/// under bf16) where the element after the residual takes the sum
/// (step_ctx::sum_taken_after), the product only, the bias and `add` left
/// to it (step_ctx::pending_sum): the values the bias pass would store.
inline void affine_forward(step_ctx& c, const float* x, const float* w, const float* b, float* y, index_t R, index_t Out,
                           index_t In, bool round, const float* add) {
  if (add && round && c.sum_taken_after) {
    c.be.gemm(trans::no, trans::yes, R, Out, In, 1.f, x, w, 0.f, y);
    c.pending_sum = {y, b, add, R, Out};
    return;
  }
  affine_forward(c.be, x, w, b, y, R, Out, In, round, add);
}
}  // namespace detail

/// Run element `l` (at flat offset `offset`) forward, with hooks around leaves.
template <class L, class X> view<float> run_forward(L& l, step_ctx& c, X x, index_t offset) {
  if constexpr (!takes_residual_sum<L>()) detail::finish_residual_sum(c);
  if constexpr (is_container<L> && !carries_residual_sum<L>()) c.sum_taken_after = false;
  if constexpr (is_container<L>) {
    return detail::stored<rounds_output<L>()>(c, l.forward(c, x));
  } else {
    if (!c.hooks && !c.check_finite) return detail::stored<rounds_output<L>()>(c, l.forward(c, x));
    const auto ref = make_leaf_ref(l, offset);
    if (c.hooks) c.hooks->before_forward(ref);
    auto y = detail::stored<rounds_output<L>()>(c, l.forward(c, x));
    if (c.hooks) c.hooks->after_forward(ref);
    if (c.check_finite) detail::check_finite_values(y, layer_name<L>(), "output", c);
    return y;
  }
}
/// Run element `l` backward, with hooks around leaves, and tell
/// step_ctx::leaf_backward_done when a leaf's has ended. `next_rounds`: the
/// element that reads the result rounds it as it reads (rounds_grad_on_read),
/// so no rounding pass follows a leaf's backward (where no hook or
/// finiteness check looks at the value between them).
template <bool next_rounds = false, class L> view<float> run_backward(L& l, step_ctx& c, cview<float> dy, index_t offset) {
  if constexpr (is_container<L>) {
    return detail::stored<rounds_input_grad<L>()>(c, l.backward(c, dy));
  } else {
    if (!c.hooks && !c.check_finite) {
      auto dx = detail::stored<rounds_input_grad<L>() || next_rounds>(c, l.backward(c, dy));
      if (c.leaf_backward_done) c.leaf_backward_done(offset);
      return dx;
    }
    const auto ref = make_leaf_ref(l, offset);
    if (c.hooks) c.hooks->before_backward(ref);
    auto dx = detail::stored<rounds_input_grad<L>()>(c, l.backward(c, dy));
    if (c.hooks) c.hooks->after_backward(ref);
    if (c.check_finite) detail::check_finite_values(dx, layer_name<L>(), "input gradient", c);
    if (c.leaf_backward_done) c.leaf_backward_done(offset);
    return dx;
  }
}
/// The loss's forward, with hooks when it is a leaf. `labels` is the label
/// buffer; a leaf loss sees it as its loss_target_t (class ids or float targets).
template <class L, class X>
double run_forward_loss(L& l, step_ctx& c, X x, label_buffer labels, index_t offset) {
  detail::finish_residual_sum(c);
  if constexpr (is_container<L>) {
    return l.forward_loss(c, x, labels);
  } else {
    const auto targets = detail::targets_of<loss_target_t<L>>(labels);
    if (!c.hooks) return l.forward_loss(c, x, targets);
    const auto ref = make_leaf_ref(l, offset);
    c.hooks->before_forward(ref);
    const double v = l.forward_loss(c, x, targets);
    c.hooks->after_forward(ref);
    return v;
  }
}
/// The loss's backward, with hooks when it is a leaf (and leaf_backward_done after it).
template <class L> view<float> run_backward_loss(L& l, step_ctx& c, index_t offset) {
  if constexpr (is_container<L>) {
    return detail::stored(c, l.backward_loss(c));
  } else {
    if (!c.hooks && !c.check_finite) {
      auto d = detail::stored<rounds_input_grad<L>()>(c, l.backward_loss(c));
      if (c.leaf_backward_done) c.leaf_backward_done(offset);
      return d;
    }
    const auto ref = make_leaf_ref(l, offset);
    if (c.hooks) c.hooks->before_backward(ref);
    auto d = detail::stored<rounds_input_grad<L>()>(c, l.backward_loss(c));
    if (c.hooks) c.hooks->after_backward(ref);
    if (c.check_finite) detail::check_finite_values(d, layer_name<L>(), "input gradient", c);
    if (c.leaf_backward_done) c.leaf_backward_done(offset);
    return d;
  }
}

}  // namespace whale
