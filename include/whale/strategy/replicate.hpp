// `replicate<M>`: data parallelism. The wrapped part keeps its parameters on
// every rank of the `data` axis; the batch is split over that axis and the
// parameter gradients are summed (all-reduced in buckets during backward).
// The runtime that does this is runtime/executor.hpp; this is the type.
#pragma once

#include <string>
#include <type_traits>

#include "whale/comm/mesh.hpp"
#include "whale/nn/layer.hpp"
#include "whale/nn/sequential.hpp"

namespace whale {

template <class M, axis A, index_t Degree> struct split;  // strategy/split.hpp
template <class M, int Level> struct shard;               // strategy/shard.hpp
template <class... L> struct stage;                       // strategy/pipeline.hpp
template <class Sched, class... Parts> struct pipeline;   // strategy/pipeline.hpp
template <class M> struct replicate;

namespace detail {
/// What a model type is, for the nesting rules of the strategies
/// (docs/strategies.md, "Nestings"): a layer or container, or one strategy.
enum class part_kind { layer, replicate, split_model, split_data, shard, stage, pipeline };
template <class T> inline constexpr part_kind kind_of = part_kind::layer;
template <class M> inline constexpr part_kind kind_of<replicate<M>> = part_kind::replicate;
template <class M, axis A, index_t D>
inline constexpr part_kind kind_of<split<M, A, D>> = A == axis::data ? part_kind::split_data : part_kind::split_model;
template <class M, int L> inline constexpr part_kind kind_of<shard<M, L>> = part_kind::shard;
template <class... L> inline constexpr part_kind kind_of<stage<L...>> = part_kind::stage;
template <class S, class... P> inline constexpr part_kind kind_of<pipeline<S, P...>> = part_kind::pipeline;

/// The direct parts of a model type as the user wrote it: a strategy's
/// argument(s), a sequential's or stage's elements, a residual's branch, a
/// repeat's or recompute's block.
template <class... T> struct part_list {};
template <class... L> part_list<L...> sequential_parts(const sequential<L...>*);
template <class T> auto parts_of() {
  if constexpr (requires { typename T::block_type; }) return part_list<typename T::block_type>{};
  else if constexpr (requires { typename T::inner_type; }) return part_list<typename T::inner_type>{};
  else if constexpr (requires { sequential_parts(static_cast<const T*>(nullptr)); })
    return decltype(sequential_parts(static_cast<const T*>(nullptr))){};
  else return part_list<>{};
}
template <class T> struct parts { using type = decltype(parts_of<T>()); };
template <class M> struct parts<replicate<M>> { using type = part_list<M>; };
template <class M, axis A, index_t D> struct parts<split<M, A, D>> { using type = part_list<M>; };
template <class M, int L> struct parts<shard<M, L>> { using type = part_list<M>; };
template <class S, class... P> struct parts<pipeline<S, P...>> { using type = part_list<P...>; };

/// Whether a part of T at any depth below T (T itself excluded) is of kind K.
template <part_kind K, class T> constexpr bool holds();
template <part_kind K, class... P> constexpr bool holds_any(part_list<P...>) {
  return ((kind_of<P> == K || holds<K, P>()) || ...);
}
template <part_kind K, class T> constexpr bool holds() { return holds_any<K>(typename parts<T>::type{}); }
/// T is of kind K, or holds a part of kind K.
template <part_kind K, class T> constexpr bool is_or_holds() { return kind_of<T> == K || holds<K, T>(); }
template <class T> struct strip_replicate;
}  // namespace detail

/// Data-parallel wrapper. Behaves exactly as M (same parameters, same
/// initialisation); the plan built by `make` splits the batch and sums gradients.
///
/// Law: replicate<replicate<M>> is replicate<M> — nesting multiplies the data
/// degree, and with one `data` mesh axis the product is that axis' size, so
/// the nested form trains exactly as the flat one (tested).
///
/// Nestings (docs/strategies.md): replicate<split<M>> is split<M> (a split
/// plan is data parallel outside its regions); replicate<pipeline<...>> is
/// data × pipe. Refused: a shard<...> inside (write shard<M>), a region split
/// over axis::data inside, a pipeline<...> that is not the whole wrapped model.
template <class M>
struct replicate : M {
  static_assert(Layer<M> || Loss<M>,
                "whale::replicate: the wrapped type must be a Layer or a Loss (e.g. a sequential)");
  static_assert(!detail::is_or_holds<detail::part_kind::shard, M>(),
                "whale::replicate<shard<M>>: the wrapped model is or holds a shard<...>, which replicate would "
                "train as plain data parallelism, dropping the ZeRO partitioning. shard<M, Level> is data "
                "parallel over the data axis itself: write shard<M, Level> around the whole model instead "
                "(shard<replicate<M>> is the same plan as shard<M>)");
  static_assert(!detail::is_or_holds<detail::part_kind::split_data, M>(),
                "whale::replicate<split<M, axis::data>>: the wrapped model splits a region over the data axis, "
                "whose parameters are then split over that axis, not replicated on it; replicate only the "
                "parts outside the region, e.g. sequential<replicate<Backbone>, split<Classifier, axis::data>> "
                "(Whale's 100k-class plan)");
  static_assert(detail::kind_of<typename detail::strip_replicate<M>::type> == detail::part_kind::pipeline ||
                    !detail::holds<detail::part_kind::pipeline, M>(),
                "whale::replicate: the wrapped model holds a pipeline<...> as a part (e.g. "
                "replicate<sequential<A, pipeline<...>>>), which would run as one sequential without its stages; "
                "a pipeline is a whole-model strategy: put every layer in its stages and write "
                "replicate<pipeline<Schedule, stage<...>, ...>> (data × pipe)");
  using inner = M;
  static std::string name() { return "replicate<" + layer_name<M>() + ">"; }
};

template <class T> struct is_replicate : std::false_type {};
template <class M> struct is_replicate<replicate<M>> : std::true_type {};
template <class T> inline constexpr bool is_replicate_v = is_replicate<T>::value;

namespace detail {
template <class T> struct strip_replicate { using type = T; };
template <class M> struct strip_replicate<replicate<M>> : strip_replicate<M> {};
}  // namespace detail
/// M with every outer `replicate` removed.
template <class T> using strip_replicate_t = typename detail::strip_replicate<T>::type;

}  // namespace whale
