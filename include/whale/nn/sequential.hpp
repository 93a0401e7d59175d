// `sequential<L...>`: layers applied in order, checked at compile time (each
// layer's in_features equals the width the previous one produces). When the
// last element is a Loss, the sequential is itself a Loss.
#pragma once

#include <array>
#include <cstddef>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "whale/nn/layer.hpp"

namespace whale {

namespace detail {

/// Named in the compiler's error when two neighbouring layers disagree on a width:
/// Producer makes `Produced` features, Consumer expects `Expected`.
template <class Producer, class Consumer, index_t Produced, index_t Expected>
struct feature_mismatch {
  static_assert(Produced == Expected,
                "whale::sequential: a layer's in_features must equal the out_features of the "
                "layer before it; the two layers and their sizes are named in "
                "'feature_mismatch<Producer, Consumer, produced, expected>' in the compiler's "
                "instantiation notes. Change one of them so the sizes agree");
  static constexpr bool value = true;
};

template <class L> constexpr bool is_layer_or_loss = Layer<L> || Loss<L>;

template <class... L> struct widths {
  static constexpr std::size_t n = sizeof...(L);
  static constexpr std::array<index_t, n> ins{L::in_features...};
  static constexpr std::array<index_t, n> outs{L::out_features...};
  // width flowing into layer i (any_features if not yet known), and who produced it
  static constexpr std::array<index_t, n + 1> in_width = [] {
    std::array<index_t, n + 1> w{};
    index_t cur = any_features;
    for (std::size_t i = 0; i < n; ++i) {
      if (cur == any_features) cur = ins[i];
      w[i] = cur;
      if (outs[i] != any_features) cur = outs[i];
    }
    w[n] = cur;
    return w;
  }();
  static constexpr std::array<std::size_t, n + 1> producer = [] {
    std::array<std::size_t, n + 1> p{};
    std::size_t cur = n;  // n: none yet
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = cur;
      if (outs[i] != any_features) cur = i;
    }
    p[n] = cur;
    return p;
  }();
};

template <class Tuple, class W, std::size_t... I>
constexpr bool check_features(std::index_sequence<I...>) {
  // For each layer with a fixed in_features and a known producer, instantiate the check.
  auto one = []<std::size_t J>(std::integral_constant<std::size_t, J>) {
    if constexpr (std::tuple_element_t<J, Tuple>::in_features != any_features &&
                  W::producer[J] < W::n) {
      using P = std::tuple_element_t<W::producer[J], Tuple>;
      using C = std::tuple_element_t<J, Tuple>;
      return feature_mismatch<P, C, P::out_features, C::in_features>::value;
    } else {
      return true;
    }
  };
  return (one(std::integral_constant<std::size_t, I>{}) && ...);
}

/// Elements I..N-1 of a tuple of layers forward (hooks around leaves).
/// A residual's addend (step_ctx::residual_add) is shown to the last element
/// only, where it accepts it; hidden from the others and put back after.
/// A leaf whose next element rounds its input as it reads it (or, for the
/// last, `LastReadRounded`: the loss after it does) is told so under bf16
/// (step_ctx::output_read_rounded), unless hooks or --check-finite look at
/// its output.
/// A residual's sum may be left to the element after (step_ctx::sum_taken_after):
/// for the last, where `last_takes` (what held when the container started).
template <std::size_t I, std::size_t N, bool LastReadRounded = false, class Tuple, class Offsets, class X>
view<float> forward_through(Tuple& layers, const Offsets& offset, step_ctx& c, X x, bool last_takes = false) {
  using E = std::tuple_element_t<I, Tuple>;
  constexpr bool shown = I + 1 == N && accepts_residual_add<E>();
  constexpr bool next_reads_rounded = [] {
    if constexpr (I + 1 < N) return rounds_input_on_read<std::tuple_element_t<I + 1, Tuple>>();
    else return LastReadRounded;
  }();
  constexpr bool gelu_next = [] {  // a gelu after it that its GEMM can compute
    if constexpr (I + 1 < N) return fuses_gelu<E>() && is_gelu<std::tuple_element_t<I + 1, Tuple>>();
    else return false;
  }();
  constexpr bool next_takes_sum = [] {
    if constexpr (I + 1 < N) return takes_residual_sum<std::tuple_element_t<I + 1, Tuple>>();
    else return false;
  }();
  const cview<float> held = shown ? cview<float>{} : std::exchange(c.residual_add, cview<float>{});
  const bool looked_at = c.hooks || c.check_finite;
  c.output_read_rounded = next_reads_rounded && !is_container<E> && c.bf16 && !looked_at;
  c.gelu_in_gemm = gelu_next && !looked_at;
  c.sum_taken_after = (I + 1 < N ? next_takes_sum : last_takes) && c.bf16 && !looked_at;
  auto y = run_forward(std::get<I>(layers), c, x, offset[I]);
  c.output_read_rounded = false;
  c.gelu_in_gemm = false;
  c.sum_taken_after = false;
  if constexpr (!shown) c.residual_add = held;
  if constexpr (I + 1 < N)
    return forward_through<I + 1, N, LastReadRounded>(layers, offset, c, cview<float>(y), last_takes);
  else return y;
}
/// Elements I..0 backward; d(input) of element 0 only if the caller asked for it.
/// A residual's gradient addend (step_ctx::residual_grad) is shown to element 0
/// only, where it accepts it; hidden from the others and put back after.
template <std::size_t I, class Tuple, class Offsets>
view<float> backward_through(Tuple& layers, const Offsets& offset, step_ctx& c, cview<float> dy) {
  constexpr bool shown = I == 0 && accepts_residual_grad<std::tuple_element_t<I, Tuple>>();
  const cview<float> held = shown ? cview<float>{} : std::exchange(c.residual_grad, cview<float>{});
  constexpr bool next_rounds = [] {  // the element before reads this one's d(input) rounded
    if constexpr (I > 0) return rounds_grad_on_read<std::tuple_element_t<I - 1, Tuple>>();
    else return false;
  }();
  const bool outer = c.need_input_grad;
  c.need_input_grad = I > 0 || outer;
  if constexpr (I > 0) {  // a gelu before it: its gradient in this layer's d(input) GEMM
    using P = std::tuple_element_t<I - 1, Tuple>;
    if constexpr (fuses_gelu<std::tuple_element_t<I, Tuple>>() && is_gelu<P>())
      if (!c.hooks && !c.check_finite) c.dgelu_pre = std::get<I - 1>(layers).kept_input(c.slot);
  }
  auto dx = run_backward<next_rounds>(std::get<I>(layers), c, dy, offset[I]);
  c.dgelu_pre = {};
  c.need_input_grad = outer;
  if constexpr (!shown) c.residual_grad = held;
  if constexpr (I > 0) return backward_through<I - 1>(layers, offset, c, cview<float>(dx));
  else return dx;
}

/// Backward from the loss (the last of N elements) through the others;
/// d(input) of element 0 only if the caller asked for it.
template <std::size_t N, class Tuple, class Offsets>
view<float> backward_from_loss(Tuple& layers, const Offsets& offset, step_ctx& c) {
  const bool outer = c.need_input_grad;
  c.need_input_grad = N > 1 || outer;
  auto d = run_backward_loss(std::get<N - 1>(layers), c, offset[N - 1]);
  c.need_input_grad = outer;
  if constexpr (N == 1) return d;
  else return backward_through<N - 2>(layers, offset, c, cview<float>(d));
}

template <class L> void print_layer(std::ostream& os, int indent, index_t width) {
  if constexpr (requires { L::print_structure(os, indent, width); }) {
    L::print_structure(os, indent, width);
  } else {
    const auto c = L::cost().scaled(static_cast<double>(width));
    os << std::string(static_cast<std::size_t>(indent), ' ') << layer_name<L>();
    if (c.params) os << "  [" << c.params << " params]";
    os << '\n';
  }
}

}  // namespace detail

/// Layers applied in order. The last element may be a Loss (then this is a Loss).
template <class... L>
class sequential {
  static_assert(sizeof...(L) > 0, "whale::sequential: a sequential needs at least one layer");

 public:
  using tuple_type = std::tuple<L...>;
  static constexpr std::size_t size = sizeof...(L);
  using first = std::tuple_element_t<0, tuple_type>;
  using last = std::tuple_element_t<size - 1, tuple_type>;
  static constexpr bool has_loss = Loss<last>;
  static constexpr std::size_t n_layers = has_loss ? size - 1 : size;

 private:
  static_assert((detail::is_layer_or_loss<L> && ...),
                "whale::sequential: every element must model whale::Layer (or whale::Loss for "
                "the last one); check the concept's requirements for the offending type");
  template <std::size_t... I>
  static constexpr bool all_but_last_are_layers(std::index_sequence<I...>) {
    return (Layer<std::tuple_element_t<I, tuple_type>> && ...);
  }
  static_assert(all_but_last_are_layers(std::make_index_sequence<n_layers>{}),
                "whale::sequential: a Loss (softmax_cross_entropy, or a sequential ending in "
                "one) may only be the last element; move it to the end");
  using W = detail::widths<L...>;
  static constexpr bool features_ok =
      detail::check_features<tuple_type, W>(std::make_index_sequence<size>{});
  static_assert(features_ok, "whale::sequential: feature sizes of neighbouring layers disagree");

 public:
  using input_type = typename first::input_type;
  static constexpr bool is_container = true;
  // what it returns is what an element it ran returned, stored as that element stores it
  static constexpr bool rounds_output = true, rounds_input_grad = true;
  // a residual's sums go to the elements at its ends (step_ctx::residual_add, residual_grad)
  static constexpr bool accepts_residual_add =
      n_layers > 0 && !has_loss && whale::accepts_residual_add<std::tuple_element_t<(n_layers > 0 ? n_layers - 1 : 0), tuple_type>>();
  static constexpr bool accepts_residual_grad = whale::accepts_residual_grad<first>();
  static constexpr bool takes_residual_sum = whale::takes_residual_sum<first>();
  static constexpr bool carries_residual_sum = true;  // to its last element (forward_through's last_takes)
  static constexpr index_t in_features = W::in_width[0];
  static constexpr index_t out_features = has_loss ? 1 : W::in_width[size];
  /// What the loss compares with (loss_target_t): its targets' type, and how
  /// many a row takes (a loss whose width follows its input: the width it
  /// receives here, or any_features where no layer before it fixes one).
  using target_type = loss_target_t<last>;
  static constexpr index_t target_width =
      loss_target_width<last>() == any_features ? W::in_width[size - 1] : loss_target_width<last>();

  static std::string name() {
    std::string s = "sequential<";
    std::size_t i = 0;
    ((s += (i++ ? ", " : "") + layer_name<L>()), ...);
    return s + ">";
  }

  /// Sum of the layers' costs, elementwise layers scaled by the width they
  /// see; a gelu computed in the GEMM of the layer before it (fuses_gelu)
  /// keeps nothing of its own, and that layer keeps GELU's output beside its own.
  static constexpr cost_info cost() {
    cost_info c;
    std::size_t i = 0;
    ((c += L::cost().scaled(W::in_width[i] == any_features ? 0.0
                                                           : static_cast<double>(W::in_width[i])),
      ++i),
     ...);
    c.act_bytes += fused_gelu_bytes(std::make_index_sequence<size - 1>{});
    return c;
  }
  static void print_structure(std::ostream& os, int indent, index_t) {
    std::size_t i = 0;
    ((detail::print_layer<L>(os, indent, W::in_width[i]), ++i), ...);
  }

  index_t param_count() const {
    return std::apply([](const auto&... l) { return (index_t{0} + ... + l.param_count()); },
                      layers_);
  }
  void bind(param_binder& b) {
    bind_each(b, std::make_index_sequence<size>{});
  }
  /// Unsplit parameters of every element, at their unsplit offsets (see gather_full_params).
  void gather_full(const float* local, float* full) {
    gather_each(local, full, std::make_index_sequence<size>{});
  }
  /// Forward a plan's configuration to every element.
  template <class Env> void configure(const Env& e) {
    std::apply([&](auto&... l) { (configure_layer(l, e), ...); }, layers_);
  }
  void init(const counter_rng& r) {
    init_each(r, std::make_index_sequence<size>{});
  }

  /// Through every layer (all but the loss, if there is one).
  view<float> forward(step_ctx& c, cview<input_type> x)
    requires(n_layers > 0)
  {
    return fwd<0>(c, x);
  }
  /// Backward through every layer (all but the loss); returns d(input) if asked for.
  view<float> backward(step_ctx& c, cview<float> dy)
    requires(n_layers > 0)
  {
    return bwd<n_layers - 1>(c, dy);
  }

  /// Forward through the layers and the loss; returns this rank's share of the loss.
  double forward_loss(step_ctx& c, cview<input_type> x, label_buffer labels)
    requires has_loss
  {
    if constexpr (n_layers == 0) {
      return run_forward_loss(std::get<size - 1>(layers_), c, x, labels, offset_[size - 1]);
    } else {
      auto y = detail::forward_through<0, n_layers, rounds_input_on_read<last>()>(layers_, offset_, c, x);
      return run_forward_loss(std::get<size - 1>(layers_), c, cview<float>(y), labels, offset_[size - 1]);
    }
  }
  /// Backward from the loss through every layer; returns d(input) if asked for.
  view<float> backward_loss(step_ctx& c)
    requires has_loss
  {
    return detail::backward_from_loss<size>(layers_, offset_, c);
  }

  template <std::size_t I> auto& get() noexcept { return std::get<I>(layers_); }
  template <std::size_t I> const auto& get() const noexcept { return std::get<I>(layers_); }
  /// Flat parameter offset of element I (valid after bind).
  index_t offset(std::size_t i) const noexcept { return offset_[i]; }

 private:
  /// What each (fuses_gelu layer, gelu) pair keeps less than the two alone: the gelu's output and
  /// input-gradient buffers (8 bytes a feature) gone, GELU's output kept by the layer (4).
  template <std::size_t... I> static constexpr double fused_gelu_bytes(std::index_sequence<I...>) {
    double d = 0;
    auto one = [&]<std::size_t J>(std::integral_constant<std::size_t, J>) {
      using A = std::tuple_element_t<J, tuple_type>;
      if constexpr (fuses_gelu<A>() && is_gelu<std::tuple_element_t<J + 1, tuple_type>>()) {
        const auto g = std::tuple_element_t<J + 1, tuple_type>::cost().scaled(static_cast<double>(A::out_features));
        d += 4.0 * static_cast<double>(A::out_features) - g.act_bytes;
      }
    };
    (one(std::integral_constant<std::size_t, I>{}), ...);
    (void)one;  // a sequential of one element has no pair
    return d;
  }
  template <std::size_t... I> void bind_each(param_binder& b, std::index_sequence<I...>) {
    ((offset_[I] = b.offset(), std::get<I>(layers_).bind(b)), ...);
  }
  template <std::size_t... I> void gather_each(const float* local, float* full, std::index_sequence<I...>) {
    index_t at = 0;
    ((gather_full_params(std::get<I>(layers_), local + (offset_[I] - offset_[0]), full + at),
      at += std::tuple_element_t<I, tuple_type>::cost().params),
     ...);
  }
  template <std::size_t... I> void init_each(const counter_rng& r, std::index_sequence<I...>) {
    (std::get<I>(layers_).init(r.child(I)), ...);
  }
  template <std::size_t I, class X> view<float> fwd(step_ctx& c, X x) {
    return detail::forward_through<I, n_layers>(layers_, offset_, c, x, c.sum_taken_after);
  }
  template <std::size_t I> view<float> bwd(step_ctx& c, cview<float> dy) {
    return detail::backward_through<I>(layers_, offset_, c, dy);
  }

  tuple_type layers_;
  std::array<index_t, size> offset_{};
};

}  // namespace whale
