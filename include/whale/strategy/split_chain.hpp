// `split_chain`: a chain of sharded elements along one mesh axis, entered with
// a layout computed at compile time; its forward and backward passes, the
// converting collectives between elements, and how it leaves the region. The
// region itself, and which element a layer becomes, is split.hpp's.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/embedding.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/split_layers.hpp"
#include "whale/strategy/split_resolve.hpp"

namespace whale {

namespace detail {
struct no_gather {};
}  // namespace detail

/// A chain of sharded elements along axis A entered with layout In. Exit
/// `forced`: a converter to ExitLay is appended (unless it ends in a loss).
template <axis A, layout_kind In, detail::exit_kind Exit, layout_kind ExitLay, detail::stream_kind Mode, class... E>
class split_chain {
  using built = detail::build<detail::tlist<>, A, In, grad_of(In), void, 0, E...>;
  static_assert(sizeof(built) > 0, "whale::split: the region's layouts are checked here");
  template <class... It> static auto tuple_of(detail::tlist<It...>) -> std::tuple<typename It::type...>;
  template <class... It> static constexpr auto indices_of(detail::tlist<It...>) {
    return std::array<std::size_t, sizeof...(It)>{It::index...};
  }
  template <class... It> static constexpr auto layouts_of(detail::tlist<It...>) {
    return std::array<layout_kind, sizeof...(It)>{It::in...};
  }
  using last_elem = std::tuple_element_t<sizeof...(E) - 1, std::tuple<E...>>;
  static constexpr bool ends_in_loss = Loss<last_elem>;
  static constexpr bool add_exit = Exit == detail::exit_kind::forced && !ends_in_loss &&
                                   (built::out != ExitLay || built::gout != grad_of(ExitLay));
  // The exit converter; where no single collective reaches the exit layout
  // (features split -> rows split on the data axis), two, through replicated.
  static constexpr bool exit_direct = conversion(built::out, ExitLay) != conv_op::impossible &&
                                      conversion(grad_of(ExitLay), built::gout) != conv_op::impossible;
  template <class... It> static auto with_exit(detail::tlist<It...>) {
    if constexpr (!add_exit) {
      return detail::tlist<It...>{};
    } else if constexpr (exit_direct) {
      return detail::tlist<It..., detail::indexed<convert<A, built::out, ExitLay, grad_of(ExitLay), built::gout>,
                                                   detail::inserted, built::out>>{};
    } else {
      return detail::tlist<It..., detail::indexed<convert<A, built::out, layout_kind::R, layout_kind::R, built::gout>, detail::inserted, built::out>,
                           detail::indexed<convert<A, layout_kind::R, ExitLay, grad_of(ExitLay), layout_kind::R>, detail::inserted, layout_kind::R>>{};
    }
  }
  using items = decltype(with_exit(typename built::items{}));

 public:
  using tuple_type = decltype(tuple_of(items{}));
  static constexpr std::size_t size = std::tuple_size_v<tuple_type>;
  static constexpr auto original = indices_of(items{});
  static constexpr auto in_layout = layouts_of(items{});  ///< the layout each item receives
  static constexpr bool is_container = true;
  static constexpr layout_kind out_layout = add_exit ? ExitLay : built::out;
  static constexpr layout_kind gout_layout = add_exit ? grad_of(ExitLay) : built::gout;
  using input_type = typename std::tuple_element_t<0, std::tuple<E...>>::input_type;
  static constexpr index_t in_features = sequential<E...>::in_features;
  static constexpr index_t out_features = sequential<E...>::out_features;
  static constexpr std::size_t n_layers = ends_in_loss ? size - 1 : size;
  using target_type = typename sequential<E...>::target_type;
  static constexpr index_t target_width = sequential<E...>::target_width;

  static std::string name() { return "split<" + sequential<E...>::name() + ", " + axis_name(A) + ">"; }
  static constexpr cost_info cost() { return sequential<E...>::cost(); }
  static void print_structure(std::ostream& os, int indent, index_t width) {
    print_items(os, indent, width, std::make_index_sequence<size>{});
  }

  void configure(const split_env& e) {
    env_ = e;
    std::apply([&](auto&... l) { (configure_layer(l, e), ...); }, layers_);
    if constexpr (!std::is_same_v<logits_gather, detail::no_gather>) gather_logits_.configure(e);
  }
  index_t param_count() const {
    return std::apply([](const auto&... l) { return (index_t{0} + ... + l.param_count()); }, layers_);
  }
  void bind(param_binder& b) { bind_each(b, std::make_index_sequence<size>{}); }
  /// The unsplit parameters, gathered from the shards (collective over A).
  void gather_full(const float* local, float* full) { gather_each(local, full, std::make_index_sequence<size>{}); }
  void init(const counter_rng& r) { init_each(r, std::make_index_sequence<size>{}); }

  view<float> forward(step_ctx& c, cview<input_type> x)
    requires(!ends_in_loss)
  {
    return fwd<0>(c, x);
  }
  view<float> backward(step_ctx& c, cview<float> dy)
    requires(!ends_in_loss)
  {
    return bwd<size - 1>(c, dy);
  }
  /// The output before the loss, unsplit: the layers but the loss, then a
  /// class-split loss's logits gathered by columns over A (rows split over
  /// the data axis stay this rank's own).
  /// Forward only (executor::forward); collective over A.
  view<float> forward(step_ctx& c, cview<input_type> x)
    requires(ends_in_loss && n_layers > 0)
  {
    auto y = fwd<0>(c, x);
    if constexpr (std::is_same_v<logits_gather, detail::no_gather>) {
      return y;
    } else {
      const index_t batch = c.batch;
      auto out = gather_logits_.forward(c, cview<float>(y));
      c.batch = batch;
      return out;
    }
  }
  double forward_loss(step_ctx& c, cview<input_type> x, label_buffer labels)
    requires ends_in_loss
  {
    auto& loss = std::get<size - 1>(layers_);
    struct hidden {  // where loss_share rescales the share, the loss inside returns it whole (not into step_ctx::loss_sum)
      step_ctx& c;
      double* sum = rescales_loss() ? std::exchange(c.loss_sum, nullptr) : c.loss_sum;
      step_ctx::host_mirror labels = c.mirrors[1];  // labels_for may point it at the gathered labels' host copy
      ~hidden() { c.loss_sum = sum, c.mirrors[1] = labels; }
    } hide{c};
    if constexpr (n_layers == 0) {
      return loss_share(run_forward_loss(loss, c, x, labels_for(c, labels), offset_[size - 1]));
    } else {
      auto y = fwd<0>(c, x);
      return loss_share(run_forward_loss(loss, c, cview<float>(y), labels_for(c, labels), offset_[size - 1]));
    }
  }
  // A whole (unsplit) loss that sees every row of the global batch on every data
  // rank computes the loss of all of them: each rank's share is 1/p of it, so that
  // summing shares over the data axis is right. (The class-split loss does this itself.)
  static constexpr bool rescales_loss() {
    using L = std::tuple_element_t<size - 1, tuple_type>;
    return A == axis::data && built::out != layout_kind::S0 && !requires { L::split_params; };
  }
  double loss_share(double v) {
    if constexpr (rescales_loss()) return v / env_.comm(axis::data).size();
    else return v;
  }
  view<float> backward_loss(step_ctx& c)
    requires ends_in_loss
  {
    return detail::backward_from_loss<size>(layers_, offset_, c);
  }

 private:
  template <std::size_t... I>
  static void print_items(std::ostream& os, int indent, index_t width, std::index_sequence<I...>) {
    ((print_one<I>(os, indent, width)), ...);
  }
  template <std::size_t I> static void print_one(std::ostream& os, int indent, index_t width) {
    using T = std::tuple_element_t<I, tuple_type>;
    const std::string pad(static_cast<std::size_t>(indent), ' ');
    if constexpr (original[I] == detail::inserted) {
      os << pad << layer_name<T>() << '\n';
    } else if constexpr (whale::is_container<T> && requires { T::print_structure(os, indent, width); }) {
      os << pad << layer_name<T>() << "  (" << axis_name(A) << ": " << layout_kind_name(in_layout[I]) << " in)\n";
      T::print_structure(os, indent + 2, width);
    } else {
      os << pad << layer_name<T>() << "  (" << axis_name(A) << ": " << layout_kind_name(in_layout[I]) << " in)\n";
    }
  }

  // Labels of all global rows when the loss sees all rows but the data gave this
  // rank its own: the label buffer gathered by rows (a row's labels or targets whole).
  label_buffer labels_for(step_ctx& c, label_buffer labels) {
    if constexpr (A == axis::data && built::out != layout_kind::S0) {
      auto& comm = env_.comm(axis::data);
      const int p = comm.size();
      const index_t gseq = c.global_rows / c.seq;
      // labels per row: the loss's target width, or (a width that follows the data) the buffer's columns
      const index_t w = target_width > 0 ? target_width : (labels.shape().rank() == 2 ? labels.shape()[1] : 1);
      counts_.resize(static_cast<std::size_t>(p));
      for (int i = 0; i < p; ++i) counts_[static_cast<std::size_t>(i)] = detail::rows_of(gseq, c.seq, p, i) * w;
      if (all_labels_.capacity() == 0) all_labels_.set_kind(mem_kind::comm);
      const index_t total = c.global_rows * w;
      all_labels_.resize(w == 1 ? shape{c.global_rows} : shape{c.global_rows, w});
      detail::collective_in(c.be, comm, env_.device(axis::data), host_labels_, labels.data(), labels.numel(),
                            all_labels_.data(), total, [&](auto& cm, const std::int32_t* in, std::int32_t* out) {
                              all_gather_v(cm, cview<std::int32_t>(in, {labels.numel()}),
                                           view<std::int32_t>(out, {total}), std::span<const index_t>(counts_));
                            });
      // on a device, for a loss that checks class labels on the host: the same gather of
      // the ranks' host copies (step_ctx::mirrors; read back where a rank has none) on the
      // host, as the gathered labels' host copy, so that the loss never reads the device's.
      // Every device rank takes part, whatever its copies.
      if constexpr (std::is_same_v<loss_target_t<std::tuple_element_t<size - 1, tuple_type>>, std::int32_t>)
        if (!c.be.on_cpu()) {
          std::vector<std::int32_t> read;
          const auto mine = host_values(c, labels, read);
          host_all_labels_.resize(static_cast<std::size_t>(total));
          all_gather_v(comm, cview<std::int32_t>(mine.data(), {labels.numel()}),
                       view<std::int32_t>(host_all_labels_.data(), {total}), std::span<const index_t>(counts_));
          c.mirrors[1] = {all_labels_.data(), host_all_labels_.data(), static_cast<std::size_t>(total) * sizeof(std::int32_t)};
        }
      return all_labels_.v();
    } else {
      (void)c;
      return labels;
    }
  }

  template <std::size_t... I> void gather_each(const float* local, float* full, std::index_sequence<I...>) {
    index_t at = 0;
    ((gather_one<I>(local, full, at)), ...);
  }
  template <std::size_t I> void gather_one(const float* local, float* full, index_t& at) {
    if constexpr (original[I] != detail::inserted) {
      gather_full_params(std::get<I>(layers_), local + (offset_[I] - offset_[0]), full + at);
      at += std::tuple_element_t<original[I], std::tuple<E...>>::cost().params;
    }
  }
  template <std::size_t... I> void bind_each(param_binder& b, std::index_sequence<I...>) {
    ((offset_[I] = b.offset(), std::get<I>(layers_).bind(b), register_range<I>(offset_[I], b.offset())), ...);
  }
  // Parameters of a layer that sees all rows of the global batch on the data
  // axis already hold the whole gradient: they are not summed over the data axis.
  template <std::size_t I> void register_range(index_t begin, index_t end) {
    using T = std::tuple_element_t<I, tuple_type>;
    if constexpr (A == axis::data && original[I] != detail::inserted && !whale::is_container<T>) {
      if (end > begin && !local_rows(A, in_layout[I]) && env_.no_data_sync)
        env_.no_data_sync->push_back({begin, end});
    }
  }

  template <std::size_t... I> void init_each(const counter_rng& r, std::index_sequence<I...>) {
    ((init_one<I>(r)), ...);
  }
  template <std::size_t I> void init_one(const counter_rng& r) {
    if constexpr (original[I] != detail::inserted) {
      if constexpr (Mode == detail::stream_kind::flatten) std::get<I>(layers_).init(r.child(original[I]));
      else std::get<I>(layers_).init(r);
    }
  }
  template <std::size_t I, class X> view<float> fwd(step_ctx& c, X x) {
    return detail::forward_through<I, n_layers>(layers_, offset_, c, x);
  }
  template <std::size_t I> view<float> bwd(step_ctx& c, cview<float> dy) {
    return detail::backward_through<I>(layers_, offset_, c, dy);
  }

  // forward()'s gather of the loss's input to replicated, where the loss does not receive it replicated
  static constexpr layout_kind at_loss = ends_in_loss ? in_layout[size - 1] : layout_kind::R;
  // (rows split over the data axis stay this rank's: forward() gives the logits of the rows it was given)
  using logits_gather = std::conditional_t<at_loss == layout_kind::R || at_loss == layout_kind::P || at_loss == layout_kind::S0, detail::no_gather,
                                           convert<A, at_loss, layout_kind::R, layout_kind::R, at_loss>>;
  tuple_type layers_;
  std::array<index_t, size> offset_{};
  split_env env_{};
  logits_gather gather_logits_;
  tensor<std::int32_t> all_labels_;
  tensor<std::int32_t> host_labels_;  // on a device: the gather's host copies
  std::vector<std::int32_t> host_all_labels_;  // on a device: the gathered labels' host copy (for the loss's check)
  std::vector<index_t> counts_;
};

}  // namespace whale
