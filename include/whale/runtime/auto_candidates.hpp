// The candidate plans of auto_plan<M>, as types: the families tried per
// model (data parallel, ZeRO 1-3, 1F1B pipelines, tensor parallel, the
// class-split head, 3-D plans), each also with its repeated block recomputed
// where M has one repeat; and the variant of their executors that
// auto_executor holds. runtime/auto_plan.hpp prices and builds them.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>
#include <variant>

#include "whale/runtime/executor.hpp"
#include "whale/strategy/auto_plan.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

namespace detail {
template <class... P> struct plan_list {};
template <class L, bool Add, class P> struct append_if { using type = L; };
template <class... Q, class P> struct append_if<plan_list<Q...>, true, P> { using type = plan_list<Q..., P>; };

/// Whale's plan for a classifier: M = sequential<Backbone, Head> with Head a
/// loss-ending sequential (e.g. linear + softmax_cross_entropy), both plain
/// layers. The candidate replicates the backbone and splits the head over the
/// data axis (by class), as models::xc's hybrid; it keeps M's nesting, so it
/// starts from M's parameters.
template <class E> struct head_split_of {
  static constexpr bool ok = false;
  using type = void;
};
template <class A, class B> struct head_split_of<tlist<A, B>> {
  static constexpr bool ok = Layer<A> && Loss<B> && sequential_like<B> && plain_layers<A>() && plain_layers<B>();
  using type = sequential<replicate<A>, split<B, axis::data>>;
};
template <class M> auto head_split_probe() {
  if constexpr (sequential_like<M>) return head_split_of<elements_of<M>>{};
  else return head_split_of<void>{};
}
template <class M> using head_split = decltype(head_split_probe<M>());

/// M with each element that has a tensor-parallel form split over the model
/// axis on its own: embeddings, fully connected layers, and the block of its
/// repeat (repeat<N, split<Block>>, or repeat<N, recompute<split<Block>>> for a
/// recomputed block); every other element as it is. Each split layer starts
/// from the unsplit one's values, so a plan of it starts where M's would
/// (tensor parallelism inside pipeline stages, and the tensor-parallel form of
/// a model that split<M> refuses because a recompute is inside).
template <class E> struct tp_element {
  using type = E;
};
template <index_t V, index_t D> struct tp_element<embedding<V, D>> {
  using type = split<embedding<V, D>, axis::model>;
};
template <index_t I, index_t O, bias_mode B> struct tp_element<linear<I, O, B>> {
  using type = split<linear<I, O, B>, axis::model>;
};
template <std::size_t N, class B> struct tp_element<repeat<N, B>> {
  using type = std::conditional_t<splittable<B, axis::model>, repeat<N, split<B, axis::model>>, repeat<N, B>>;
};
template <std::size_t N, class B> struct tp_element<repeat<N, recompute<B>>> {
  using type = std::conditional_t<splittable<B, axis::model>, repeat<N, recompute<split<B, axis::model>>>,
                                  repeat<N, recompute<B>>>;
};
template <class L> struct tp_stages_of {
  static constexpr bool ok = false;
  using type = void;
};
template <class... E> struct tp_stages_of<tlist<E...>> {
  using type = sequential<typename tp_element<E>::type...>;
  // a 3-D candidate only where something is split and the result is a pipeline's model
  static constexpr bool ok = !std::is_same_v<type, sequential<E...>> && pipelinable<type>() && Loss<type>;
};
template <class M> auto tp_stages_probe() {
  if constexpr (sequential_like<M> && pipelinable<M>()) return tp_stages_of<elements_of<M>>{};
  else return tp_stages_of<void>{};
}
template <class M> using tp_stages = decltype(tp_stages_probe<M>());

/// M with the block of its one repeat recomputed in backward: repeat<N,
/// recompute<Block>>, every other element as it is (same parameters, same
/// initial values: recompute<B> trains as B). `ok` where M is a pipeline's
/// model (a sequential with one repeat) whose block is plain layers (no
/// strategy, no recompute anywhere inside it).
template <class E> struct rec_element {
  using type = E;
};
template <std::size_t N, class B> struct rec_element<repeat<N, B>> {
  using type = std::conditional_t<plain_layers<B>(), repeat<N, recompute<B>>, repeat<N, B>>;
};
/// M with the recompute of its repeat's block taken off (the inverse of rec_element).
template <class E> struct unrec_element {
  using type = E;
};
template <std::size_t N, class B> struct unrec_element<repeat<N, recompute<B>>> {
  using type = repeat<N, B>;
};
template <class L> struct unrecomputed_of {
  static constexpr bool ok = false;
};
template <class... E> struct unrecomputed_of<tlist<E...>> {
  static constexpr bool ok = splittable<sequential<typename unrec_element<E>::type...>, axis::model>;
};
/// Whether split<M> is refused only for the recompute of its repeat's block: then
/// M with each element split on its own is its tensor-parallel form.
template <class M> constexpr bool splittable_but_recompute() {
  if constexpr (sequential_like<M> && !splittable<M, axis::model>) return unrecomputed_of<elements_of<M>>::ok;
  else return false;
}
template <class L> struct recomputed_of {
  static constexpr bool ok = false;
  using type = void;
};
template <class... E> struct recomputed_of<tlist<E...>> {
  using type = sequential<typename rec_element<E>::type...>;
  static constexpr bool ok = !std::is_same_v<type, sequential<E...>> && Loss<type>;
};
template <class M> auto recomputed_probe() {
  if constexpr (sequential_like<M> && pipelinable<M>()) return recomputed_of<elements_of<M>>{};
  else return recomputed_of<void>{};
}
template <class M> using recomputed = decltype(recomputed_probe<M>());
template <class M> using recomputed_t = std::conditional_t<recomputed<M>::ok, typename recomputed<M>::type, void>;
/// The recomputed variant auto_plan<M, S> prices: recomputed_t<M>, or none where S leaves it out.
template <class M, plan_space S> using variant_r = std::conditional_t<S.recompute, recomputed_t<M>, void>;

/// The plan types of one model X (M, or M with its blocks recomputed), each
/// void where it is not a plan for X: the pipeline (X with one repeat), tensor
/// parallelism (split<X> where X is plain layers; where only the recompute of
/// its repeat's block stops that, X with each element split on its own), the
/// class-split head, and the 3-D plan (tensor parallelism inside 1F1B stages,
/// replicated over the data axis) with ZeRO 0-3.
template <class X> struct family {
  static constexpr bool three_d = tp_stages<X>::ok;
  using pipe = std::conditional_t<pipelinable<X>(), replicate<pipeline<one_f_one_b, X>>, void>;
  using tensor = std::conditional_t<splittable<X, axis::model>, split<X, axis::model>,
                                    std::conditional_t<three_d && splittable_but_recompute<X>(),
                                                       typename tp_stages<X>::type, void>>;
  using head = std::conditional_t<head_split<X>::ok, typename head_split<X>::type, void>;
  using three_d_type = std::conditional_t<three_d, replicate<pipeline<one_f_one_b, typename tp_stages<X>::type>>, void>;
  template <int L> using three_d_zero = std::conditional_t<three_d, shard<three_d_type, L>, void>;
};
template <> struct family<void> {
  using pipe = void;
  using tensor = void;
  using head = void;
  using three_d_type = void;
  template <int L> using three_d_zero = void;
};

template <class L, class... P> struct append_plans { using type = L; };
template <class L, class P, class... R> struct append_plans<L, P, R...> {
  using type = typename append_plans<typename append_if<L, !std::is_void_v<P>, P>::type, R...>::type;
};
template <class X> struct dense_of {
  using dp = replicate<X>;
  template <int L> using zero = shard<X, L>;
};
template <> struct dense_of<void> {
  using dp = void;
  template <int L> using zero = void;
};

/// The candidate plan types of auto_plan<M, S>, in the order they are listed (the
/// simplicity that breaks near-ties): dp and ZeRO 1-3 of M, then of M with
/// its blocks recomputed (Mr); the pipeline of M, of Mr; tensor parallelism of
/// M, of Mr; the class-split head; the 3-D plan of M with ZeRO 0-3, of Mr.
/// Only those that are plans for M are listed (and compiled).
template <class M, plan_space S = plan_space{}, class R = variant_r<M, S>>
using auto_candidates = typename append_plans<
    plan_list<>, typename dense_of<M>::dp, typename dense_of<M>::template zero<1>, typename dense_of<M>::template zero<2>,
    typename dense_of<M>::template zero<3>, typename dense_of<R>::dp, typename dense_of<R>::template zero<1>,
    typename dense_of<R>::template zero<2>, typename dense_of<R>::template zero<3>, typename family<M>::pipe,
    typename family<R>::pipe, typename family<M>::tensor, typename family<R>::tensor, typename family<M>::head,
    typename family<M>::three_d_type, typename family<M>::template three_d_zero<1>,
    typename family<M>::template three_d_zero<2>, typename family<M>::template three_d_zero<3>,
    typename family<R>::three_d_type, typename family<R>::template three_d_zero<1>,
    typename family<R>::template three_d_zero<2>, typename family<R>::template three_d_zero<3>>::type;

template <class P, class L> struct index_in;
template <class P, class... Q> struct index_in<P, plan_list<Q...>> {
  static constexpr std::size_t value = [] {
    constexpr bool same[] = {std::is_same_v<P, Q>..., false};
    std::size_t i = 0;
    while (i < sizeof...(Q) && !same[i]) ++i;
    return i;
  }();
  static constexpr bool found = value < sizeof...(Q);
};

template <class L> struct auto_variant;
template <class... P> struct auto_variant<plan_list<P...>> {
  using type = std::variant<std::unique_ptr<executor<P>>...>;
  static constexpr std::size_t size = sizeof...(P);
  template <std::size_t I> using at = std::tuple_element_t<I, std::tuple<P...>>;
};

}  // namespace detail

}  // namespace whale
