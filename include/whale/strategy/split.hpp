// `split<M, Axis>`: operator sharding (Whale's split, Megatron's tensor
// parallelism). Inside a split region the layout of every activation along
// `Axis` is computed at compile time, layer by layer: each layer becomes its
// sharded form for the layout it receives (a linear after a replicated
// activation is column-parallel, after a feature-split one row-parallel), and
// where two layouts differ the one converting collective is inserted. At the
// region's boundary the activation has the canonical layout of the axis
// (data: rows split<0>; model: replicated). Runtime: runtime/executor.hpp.
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
#include "whale/strategy/split_chain.hpp"
#include "whale/strategy/split_layers.hpp"
#include "whale/strategy/split_resolve.hpp"

namespace whale {

/// residual<Inner...> inside a split region: y = x + chain(x), the chain
/// ending in x's layout X (so a row-parallel end is all-reduced back).
template <axis A, layout_kind X, class... Inner>
class split_residual {
  using chain = split_chain<A, X, detail::exit_kind::forced, X, detail::stream_kind::flatten, Inner...>;

 public:
  using chain_type = chain;
  using input_type = float;
  static constexpr bool is_container = true;
  static constexpr index_t in_features = chain::in_features;
  static constexpr index_t out_features = chain::in_features;
  static std::string name() { return "residual (x + ...) over " + std::string(axis_name(A)); }
  static constexpr cost_info cost() { return residual<Inner...>::cost(); }
  static void print_structure(std::ostream& os, int indent, index_t width) { chain::print_structure(os, indent, width); }

  void configure(const split_env& e) { inner_.configure(e); }
  void gather_full(const float* local, float* full) { inner_.gather_full(local, full); }
  index_t param_count() const { return inner_.param_count(); }
  void bind(param_binder& b) { inner_.bind(b); }
  void init(const counter_rng& r) { inner_.init(r); }
  view<float> forward(step_ctx& c, cview<float> x) {
    auto h = inner_.forward(c, x);
    auto y = detail::ensure(st_(c.slot).y, x.shape());
    c.be.launch(x.numel(), kernels::add{x.data(), h.data(), y.data()});
    return y;
  }
  view<float> backward(step_ctx& c, cview<float> dy) {
    const bool outer = c.need_input_grad;
    auto dh = inner_.backward(c, dy);
    if (!outer) return {};
    auto dx = detail::ensure(st_(c.slot).dx, dy.shape());
    c.be.launch(dy.numel(), kernels::add{dy.data(), dh.data(), dx.data()});
    return dx;
  }

 private:
  struct state {
    tensor<float> y, dx;
  };
  chain inner_;
  slots<state> st_;
};

/// Operator sharding of M along mesh axis A (default: the `model` axis).
/// Each layer of M becomes its sharded form for the layout it receives, and
/// the collectives between them are inserted at compile time; on entry and
/// exit the activation has the axis' canonical layout (model: replicated;
/// data: rows split<0>). `split<classifier, axis::data>` after a replicated
/// backbone is Whale's plan for 100,000 classes.
namespace detail {
template <axis A, class... L>
auto region_of(tlist<L...>) -> split_chain<A, canonical(A), exit_kind::forced, canonical(A), stream_kind::flatten, L...>;
template <axis A, class M> auto region_for() {
  if constexpr (sequential_like<M>) return decltype(region_of<A>(elements_of<M>{})){};
  else return split_chain<A, canonical(A), exit_kind::forced, canonical(A), stream_kind::single, M>{};
}
}  // namespace detail

/// Named in the compiler's error when a static split degree does not divide
/// the dimension that Layer shares among the ranks.
template <class Layer, index_t Extent, index_t Degree>
struct split_degree_check {
  static_assert(Degree == 0 || Extent % (Degree == 0 ? 1 : Degree) == 0,  // (no "% 0" for nvcc to warn of)
                "whale::split: the split degree must divide the dimension this layer splits (out_features "
                "of a column-parallel linear, in_features of a row-parallel one, the vocabulary, the "
                "heads); the layer, the dimension and the degree are named in 'split_degree_check<layer, "
                "extent, degree>' in the compiler's notes. Choose a degree that divides it");
  static constexpr bool value = true;
};

namespace detail {
template <class T, index_t Deg> constexpr bool degree_ok();
template <class Tuple, index_t Deg, std::size_t... I> constexpr bool degree_ok_all(std::index_sequence<I...>) {
  return (degree_ok<std::tuple_element_t<I, Tuple>, Deg>() && ...);
}
template <class T, index_t Deg> constexpr bool degree_ok() {
  if constexpr (requires { T::split_extent; }) return split_degree_check<T, T::split_extent, Deg>::value;
  else if constexpr (requires { typename T::chain_type; }) return degree_ok<typename T::chain_type, Deg>();
  else if constexpr (requires { typename T::block_type; }) return degree_ok<typename T::block_type, Deg>();
  else if constexpr (requires { typename T::tuple_type; T::original; })
    return degree_ok_all<typename T::tuple_type, Deg>(std::make_index_sequence<std::tuple_size_v<typename T::tuple_type>>{});
  else return true;
}
}  // namespace detail

namespace detail {
/// Whether T is or holds a layer that the model axis shards (a linear, an
/// embedding, an attention layer, a SwiGLU MLP); the others (LayerNorm, activations, a loss
/// alone) work on whole rows and would be computed whole on every rank.
template <index_t I, index_t O, bias_mode B> constexpr bool shards_on_model(const linear<I, O, B>*) { return true; }
template <index_t V, index_t D> constexpr bool shards_on_model(const embedding<V, D>*) { return true; }
template <index_t D, index_t H> constexpr bool shards_on_model(const causal_self_attention<D, H>*) { return true; }
template <index_t D, index_t H> constexpr bool shards_on_model(const swiglu_mlp<D, H>*) { return true; }
template <index_t D, index_t H, index_t KV, float Th>
constexpr bool shards_on_model(const rotary_attention<D, H, KV, Th>*) {
  return true;
}
template <class L> constexpr bool shards_on_model(const column_tag<L>*) { return true; }
template <class L> constexpr bool shards_on_model(const row_tag<L>*) { return true; }
constexpr bool shards_on_model(const void*) { return false; }
template <class T> constexpr bool model_split_finds_work() {
  if constexpr (shards_on_model(static_cast<const T*>(nullptr))) return true;
  else return []<class... P>(part_list<P...>) { return (model_split_finds_work<P>() || ...); }(typename parts<T>::type{});
}
}  // namespace detail

/// `Degree` (optional): the split degree, when known at compile time. Every
/// sharded dimension must be divisible by it (a compile error otherwise), and
/// the mesh axis must have exactly that many ranks (an error on every rank).
template <class M, axis A = axis::model, index_t Degree = 0>
struct split : decltype(detail::region_for<A, M>()) {
  using region = decltype(detail::region_for<A, M>());
  static_assert(A != axis::pipe,
                "whale::split: operators cannot be split over the pipe axis; use axis::model or axis::data");
  static_assert(Degree >= 0, "whale::split: the degree must be positive (or 0: the axis size at run time)");
  static_assert(Degree == 0 || detail::degree_ok<region, Degree>());
  static_assert(A != axis::model || detail::model_split_finds_work<M>(),
                "whale::split<M>: M holds nothing the model axis can split (no linear, embedding or attention "
                "layer): its layers work on whole rows, so every rank would compute all of it and the split would "
                "be a replication in disguise. Split a region that holds such a layer, or leave M unsplit");
  // Nestings (docs/strategies.md): a region holds layers and containers only.
  static_assert(!detail::is_or_holds<detail::part_kind::shard, M>(),
                "whale::split<shard<M>>: the region is or holds a shard<...>, which the split would train as a "
                "split region, dropping the ZeRO partitioning; shard does not compose with split yet. Shard a "
                "whole model without split regions (shard<M, Level>), or use replicate<...> beside the split");
  static_assert(!detail::is_or_holds<detail::part_kind::pipeline, M>(),
                "whale::split<pipeline<...>>: the region is or holds a pipeline<...>, which the split would train "
                "as one sequential without its stages; a pipeline is a whole-model strategy. Split inside its "
                "stages instead: pipeline<Schedule, stage<split<A>>, stage<B>>, or pipeline<Schedule, M> with M's "
                "blocks split (repeat<N, split<Block>>)");
  static_assert(detail::is_or_holds<detail::part_kind::pipeline, M>() ||
                    !detail::is_or_holds<detail::part_kind::stage, M>(),
                "whale::split<stage<...>>: the region is or holds a stage<...>, which the split would train as a "
                "plain sequential; a stage may only be a direct element of a pipeline. Put the split inside the "
                "stage: pipeline<Schedule, stage<split<A>>, stage<B>> (3-D parallelism)");
  static_assert(!detail::is_or_holds<detail::part_kind::replicate, M>(),
                "whale::split<replicate<M>>: the region is or holds a replicate<...>; inside a split region every "
                "layer takes the sharded form its incoming layout picks, so the replicate would not mean data "
                "parallelism there (a replicate<leaf> is computed whole on every rank of the axis, a "
                "replicate<sequential<...>> is split anyway). Move it out of the region "
                "(sequential<replicate<A>, split<B>>) or drop it: a split plan is data parallel outside its "
                "regions already (replicate<split<M>> is split<M>)");
  static constexpr bool is_split = true;
  static std::string name() { return "split<" + layer_name<M>() + ", " + axis_name(A) + ">"; }
  void configure(const split_env& e) {
    if (Degree != 0 && e.comm(A).size() != Degree)
      throw std::invalid_argument("whale::split: " + layer_name<M>() + " is split " + std::to_string(Degree) +
                                  " ways, but the " + axis_name(A) + " axis has " + std::to_string(e.comm(A).size()) +
                                  " ranks; launch with --mesh " + axis_name(A) + "=" + std::to_string(Degree));
    region::configure(e);
  }
};

/// Inside a split region, force a linear to be column-parallel (replicated
/// in, split<1> out) or row-parallel (split<1> in, partial out) instead of
/// letting the incoming layout decide, as Megatron's ColumnParallelLinear and
/// RowParallelLinear. A forced layout that no collective reaches does not compile.
template <class L> struct column_tag : L {
  static std::string name() { return "column<" + layer_name<L>() + ">"; }
};
template <class L> struct row_tag : L {
  static std::string name() { return "row<" + layer_name<L>() + ">"; }
};
template <class L> using column = column_tag<L>;
template <class L> using row = row_tag<L>;

namespace detail {
template <class T> constexpr bool plain_layers();
template <class... P> constexpr bool plain_parts(part_list<P...>) { return (plain_layers<P>() && ...); }
/// T and every part of it at any depth are layers or containers: no strategy, no recompute.
template <class T> constexpr bool plain_layers() {
  return kind_of<T> == part_kind::layer && !is_recompute_v<T> && plain_parts(typename parts<T>::type{});
}
}  // namespace detail

/// Whether split<M, A> is a plan, asked without compiling it: M is a Layer or
/// a Loss made of layers and containers only. A strategy or a recompute<...>
/// inside M is what split<M, A> refuses with a static_assert; every layer
/// then takes the sharded form its incoming layout picks, and no layout of
/// a plain model lacks a converting collective. The split degree is not
/// checked here (a runtime value: lowering refuses a degree that does not divide).
template <class M, axis A = axis::model>
inline constexpr bool splittable = A != axis::pipe && (Layer<M> || Loss<M>) && detail::plain_layers<M>();

/// Whether a model type contains a split region anywhere.
template <class M> constexpr bool contains_split();
namespace detail {
template <class... L> constexpr bool any_split(tlist<L...>) { return (whale::contains_split<L>() || ...); }
}  // namespace detail
template <class M> constexpr bool contains_split() {
  if constexpr (requires { M::is_split; }) return true;
  else if constexpr (detail::sequential_like<M>) return detail::any_split(detail::elements_of<M>{});
  else if constexpr (requires { typename M::inner; }) return contains_split<typename M::inner>();
  else if constexpr (requires { typename M::inner_type; }) return contains_split<typename M::inner_type>();
  else if constexpr (requires { typename M::block_type; }) return contains_split<typename M::block_type>();
  else return false;
}

}  // namespace whale
