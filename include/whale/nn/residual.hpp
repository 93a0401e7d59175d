// `residual<Inner...>`: y = x + inner(x), where inner is sequential<Inner...>
// and keeps the feature width. No scaling, gating or dropout on the branch.
#pragma once

#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/sequential.hpp"

namespace whale {

namespace detail {
/// Named in the compiler's error when a residual branch changes the width.
template <class Inner, index_t In, index_t Out>
struct residual_width_mismatch {
  static_assert(In == any_features || In == Out,
                "whale::residual: the inner layers must keep the feature width (in_features == "
                "out_features) so that x + inner(x) is defined; the inner sequential and its "
                "widths are named in 'residual_width_mismatch<Inner, in, out>' in the compiler's "
                "notes. Make the last inner layer produce in_features");
  static constexpr bool value = true;
};
}  // namespace detail

/// Residual connection around sequential<Inner...>. Parameters are the inner
/// layers', in order; init gives the inner sequential the residual's stream.
/// Backward: dx = dy + inner'(dy). A branch whose output size differs from
/// its input at run time throws std::invalid_argument.
template <class... Inner>
class residual {
 public:
  using inner_type = sequential<Inner...>;

 private:
  static_assert(!inner_type::has_loss,
                "whale::residual: the inner layers may not end in a loss; put the loss after the "
                "residual");
  static_assert(std::is_same_v<typename inner_type::input_type, float>,
                "whale::residual: the inner layers must take float activations (an embedding "
                "cannot be inside a residual)");
  static_assert(detail::residual_width_mismatch<inner_type, inner_type::in_features,
                                                inner_type::out_features>::value,
                "whale::residual: the inner layers must keep the feature width");

 public:
  using input_type = float;
  static constexpr bool is_container = true;
  static constexpr bool rounds_output = true, rounds_input_grad = true;  // its sums are stored rounded under bf16
  // its input may be a residual's sum left pending: its branch's first layer takes it (the sum is stored before
  // this residual's own sum reads its input)
  static constexpr bool takes_residual_sum = whale::takes_residual_sum<typename inner_type::first>();
  static constexpr bool carries_residual_sum = true;  // to its branch's last layer, with residual_add
  static constexpr index_t in_features = inner_type::in_features;
  static constexpr index_t out_features = inner_type::in_features;

  static std::string name() {
    std::string s = "residual<";
    std::size_t i = 0;
    ((s += (i++ ? ", " : "") + layer_name<Inner>()), ...);
    return s + ">";
  }
  /// The inner layers' cost plus the addition (1 FLOP per feature each way).
  static constexpr cost_info cost() {
    cost_info c = inner_type::cost();
    if constexpr (in_features == any_features) {
      c.fwd_flops += 1;
      c.bwd_flops += 1;
      c.act_bytes += 8;
      c.per_feature = true;
    } else {
      c.fwd_flops += static_cast<double>(in_features);
      c.bwd_flops += static_cast<double>(in_features);
      c.act_bytes += 8.0 * static_cast<double>(in_features);  // output and input gradient
    }
    return c;
  }
  static void print_structure(std::ostream& os, int indent, index_t width) {
    os << std::string(static_cast<std::size_t>(indent), ' ') << "residual (x + ...)\n";
    inner_type::print_structure(os, indent + 2, width);
  }

  index_t param_count() const { return inner_.param_count(); }
  void bind(param_binder& b) { inner_.bind(b); }
  template <class Env> void configure(const Env& e) { inner_.configure(e); }
  void gather_full(const float* local, float* full) { gather_full_params(inner_, local, full); }
  void init(const counter_rng& r) { inner_.init(r); }

  // x: (R, F) -> y = x + inner(x): (R, F). Under bf16 (without hooks or
  // --check-finite) the branch's last layer may store the sum itself (step_ctx::residual_add).
  view<float> forward(step_ctx& c, cview<float> x) {
    const auto outer = std::exchange(c.residual_add, fuses(c) ? x : cview<float>{});
    auto h = inner_.forward(c, x);
    const bool fused = fuses(c) && c.residual_add.data() == nullptr;
    c.residual_add = outer;
    if (h.numel() != x.numel())
      throw std::invalid_argument("whale::residual: the inner layers turned " +
                                  std::to_string(x.numel()) + " inputs into " +
                                  std::to_string(h.numel()) +
                                  " outputs; a residual branch must keep the width");
    if (fused) return h;  // x + inner(x), stored by the branch's last kernel
    auto& s = st_(c.slot);
    auto y = detail::ensure(s.y, x.shape());
    c.be.launch(x.numel(), kernels::add{x.data(), h.data(), y.data(), c.bf16});
    return y;
  }
  // dy: (R, F) -> dx = dy + inner'(dy): (R, F). Under bf16 (as forward) the
  // branch's first layer may store the sum itself (step_ctx::residual_grad).
  view<float> backward(step_ctx& c, cview<float> dy) {
    const bool offer = fuses(c) && c.need_input_grad;
    const auto outer = std::exchange(c.residual_grad, offer ? dy : cview<float>{});
    auto dh = inner_.backward(c, dy);  // parameter gradients; d(input) only if asked
    const bool fused = offer && c.residual_grad.data() == nullptr;
    c.residual_grad = outer;
    if (!c.need_input_grad) return {};
    if (fused) return dh;  // dy + inner'(dy), stored by the branch's first kernel
    auto& s = st_(c.slot);
    auto dx = detail::ensure(s.dx, dy.shape());
    c.be.launch(dy.numel(), kernels::add{dy.data(), dh.data(), dx.data(), c.bf16});
    return dx;
  }

  inner_type& inner() noexcept { return inner_; }
  const inner_type& inner() const noexcept { return inner_; }

 private:
  /// Whether the sums may be stored by the branch's own kernels: under bf16
  /// (bit for bit the sums the add kernel stores), where no hook or finiteness
  /// check looks at a leaf's output or input gradient on its own.
  static bool fuses(const step_ctx& c) noexcept { return c.bf16 && !c.hooks && !c.check_finite; }
  struct state {
    tensor<float> y, dx;
  };
  inner_type inner_;
  slots<state> st_;
};

}  // namespace whale
