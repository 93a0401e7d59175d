// `stage<L...>` and `pipeline<Schedule, ...>`: pipeline parallelism as types.
// Each stage runs on its own coordinate of the mesh's pipe axis; micro-batches
// run under the Schedule (strategy/schedule.hpp). The runtime is the one
// executor (runtime/executor.hpp, its stage walk in runtime/stage.hpp); the
// stage cut of pipeline<S, M> is chosen at run time (plan/partition.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/nn/layer.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/schedule.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

namespace detail {
template <class> inline constexpr bool stage_misplaced = false;
}  // namespace detail

/// Consecutive layers that run on one coordinate of the pipe axis. Only
/// meaningful as a direct element of `pipeline<Schedule, stage<...>, ...>`;
/// anywhere else (a sequential, a network, make) it does not compile.
template <class... L>
struct stage : sequential<L...> {
  using layers = sequential<L...>;
  static std::string name() { return "stage<" + layers::name().substr(11); }
  /// Poisoned: a stage is bound only by its pipeline, which binds `layers`.
  template <class Use = void> void bind(param_binder&) {
    static_assert(detail::stage_misplaced<Use>,
                  "whale::stage: a stage may only be a direct element of whale::pipeline<Schedule, "
                  "stage<...>, stage<...>, ...> (it runs on its own rank of the pipe axis); outside a "
                  "pipeline use sequential<...> instead");
  }
};

template <class T> struct is_stage : std::false_type {};
template <class... L> struct is_stage<stage<L...>> : std::true_type {};
template <class T> inline constexpr bool is_stage_v = is_stage<T>::value;

namespace detail {
template <class T> struct pipe_is_repeat : std::false_type {};
template <std::size_t N, class B> struct pipe_is_repeat<repeat<N, B>> : std::true_type {};
template <class T> inline constexpr bool pipe_is_repeat_v = pipe_is_repeat<T>::value;

template <class T> struct tuple_types;
template <class... E> struct tuple_types<std::tuple<E...>> {
  static constexpr std::size_t n = sizeof...(E);
  static constexpr std::array<bool, n> repeats{pipe_is_repeat_v<E>...};
  static constexpr std::size_t repeat_count = (std::size_t{0} + ... + (pipe_is_repeat_v<E> ? 1 : 0));
  static constexpr std::size_t repeat_index = [] {
    for (std::size_t i = 0; i < n; ++i)
      if (repeats[i]) return i;
    return n;
  }();
  /// Width flowing into element i (any_features while unknown).
  static constexpr std::array<index_t, n> in_width = [] {
    constexpr std::array<index_t, n> ins{E::in_features...};
    constexpr std::array<index_t, n> outs{E::out_features...};
    std::array<index_t, n> w{};
    index_t cur = any_features;
    for (std::size_t i = 0; i < n; ++i) {
      if (cur == any_features) cur = ins[i];
      w[i] = cur;
      if (outs[i] != any_features) cur = outs[i];
    }
    return w;
  }();
};

template <class M> concept pipe_sequential_like = requires { typename M::tuple_type; M::size; };

/// Split regions anywhere in a model (through sequentials, repeats, residuals,
/// replicate and other wrappers): `any`, and `data` if one splits over axis::data.
struct split_scan {
  bool any = false, data = false;
};
template <class M> constexpr split_scan pipe_splits();
template <class M> struct pipe_split_of : std::false_type {};
template <class M, axis A, index_t D> struct pipe_split_of<split<M, A, D>> : std::true_type {
  static constexpr bool over_data = A == axis::data;
};
template <class... L> constexpr split_scan pipe_splits_all(tlist<L...>) {
  split_scan r;
  ((r.any = r.any || pipe_splits<L>().any, r.data = r.data || pipe_splits<L>().data), ...);
  return r;
}
template <class... I> constexpr split_scan pipe_splits_residual(const residual<I...>*) {
  return pipe_splits_all(tlist<I...>{});
}
template <class M> constexpr split_scan pipe_splits() {
  if constexpr (pipe_split_of<M>::value) return {true, pipe_split_of<M>::over_data};
  else if constexpr (requires { pipe_splits_residual(static_cast<const M*>(nullptr)); })
    return pipe_splits_residual(static_cast<const M*>(nullptr));
  else if constexpr (sequential_like<M>) return pipe_splits_all(elements_of<M>{});
  else if constexpr (requires { typename M::block_type; }) return pipe_splits<typename M::block_type>();
  else if constexpr (requires { typename M::inner; }) return pipe_splits<typename M::inner>();
  else return {};
}

template <bool Explicit, class... Parts> struct pipeline_flat;
template <class... S> struct pipeline_flat<true, S...> {
  using type = sequential<typename S::layers...>;
};
template <class M> struct pipeline_flat<false, M> {
  static_assert(pipe_sequential_like<M>,
                "whale::pipeline: give the stages explicitly (pipeline<Schedule, stage<...>, stage<...>>) "
                "or one model that is a sequential with one repeat<N, Block> among its elements "
                "(pipeline<Schedule, models::gpt>), whose blocks the pipeline cuts into stages");
  static_assert(!pipe_split_of<M>::value,
                "whale::pipeline<Schedule, split<M>>: the pipeline cannot cut one split region around the whole "
                "model; split its elements instead (e.g. sequential<split<embedding<V, D>>, ..., repeat<N, "
                "split<Block>>, ..., split<linear<D, V>>, softmax_cross_entropy>), which trains the same");
  using type = M;
};
}  // namespace detail

/// Pipeline parallelism over the mesh's pipe axis, in two forms:
///  * pipeline<Schedule, stage<A...>, stage<B...>, ...>: stage s on pipe
///    coordinate s. Trains exactly as sequential<sequential<A...>, sequential<B...>, ...>
///    (same parameters, same initialisation); the last stage ends in the loss.
///  * pipeline<Schedule, M> (or pipeline<Schedule, M, stages<S>> to fix the
///    count), M a sequential with one repeat<N, Block> among its
///    elements (e.g. models::gpt): the repeat's blocks are cut into as many
///    stages as the pipe axis has ranks, at run time (balanced by cost, or
///    pipeline_options::blocks); elements before the repeat join the first
///    stage, those after it (head, loss) the last. Trains exactly as M.
/// The type behaves as that flat model (a Loss); `make` builds its runtime.
template <class Sched, class... Parts>
struct pipeline : detail::pipeline_flat<(is_stage_v<Parts> && ...), Parts...>::type {
  static_assert(Schedule<Sched>,
                "whale::pipeline: the first argument must be a schedule (whale::gpipe, whale::one_f_one_b, "
                "or a class with static name() and actions(stage, stages, micro_batches))");
  static_assert(sizeof...(Parts) > 0, "whale::pipeline: give at least one stage");
  static_assert((is_stage_v<Parts> && ...) || sizeof...(Parts) == 1,
                "whale::pipeline: either every element after the schedule is a stage<...>, or there is "
                "exactly one model (a sequential containing one repeat<N, Block>)");
  static constexpr bool explicit_stages = (is_stage_v<Parts> && ...);
  using schedule = Sched;
  using flat = typename detail::pipeline_flat<explicit_stages, Parts...>::type;
  static_assert(Loss<flat>,
                "whale::pipeline: the last stage (or the model) must end in a loss (e.g. softmax_cross_entropy)");
  using elements = detail::tuple_types<typename flat::tuple_type>;
  static_assert(explicit_stages || elements::repeat_count == 1,
                "whale::pipeline<Schedule, M>: M must contain exactly one repeat<N, Block> among its "
                "elements (the blocks the pipeline cuts into stages); otherwise list the stages explicitly");
  /// Stages fixed by the type (explicit form, or stages<N>), or 0 (as many as the pipe axis).
  static constexpr int fixed_stages = explicit_stages ? static_cast<int>(sizeof...(Parts)) : 0;
  static std::string name() {
    if constexpr (explicit_stages) {
      std::string s = "pipeline<" + Sched::name();
      ((s += ", " + Parts::name()), ...);
      return s + ">";
    } else {
      return "pipeline<" + Sched::name() + ", " + (layer_name<Parts>() + ...) + ">";
    }
  }
};

/// The stage count of a cut pipeline, fixed by its type: pipeline<Schedule, M, stages<N>>.
template <int N> struct stages {
  static_assert(N >= 1, "whale::stages<N>: a pipeline needs at least one stage");
  static constexpr int value = N;
};

/// pipeline<Schedule, M> whose pipe axis must have exactly N ranks: the cut
/// form of a model with one repeat<R, Block>, its count checked at compile
/// time against the blocks and at start-up against the mesh (a mesh whose
/// pipe axis differs is an error on every rank, never a different plan).
template <class Sched, class M, int N>
struct pipeline<Sched, M, stages<N>> : pipeline<Sched, M> {
  using base = pipeline<Sched, M>;
  static_assert(!base::explicit_stages,
                "whale::pipeline<Schedule, stage<...>, stages<N>>: stages<N> fixes the count of a model the pipeline "
                "cuts (pipeline<Schedule, M, stages<N>>); explicit stage<...> lists fix it already");
  static_assert(N <= static_cast<int>(std::tuple_element_t<base::elements::repeat_index, typename base::flat::tuple_type>::count) + 2,
                "whale::pipeline<Schedule, M, stages<N>>: more stages than the repeat's blocks + 2 (the first and last "
                "stages may hold no block, every inner stage needs one); use fewer stages");
  static constexpr int fixed_stages = N;
  static std::string name() { return "pipeline<" + Sched::name() + ", " + layer_name<M>() + ", stages<" + std::to_string(N) + ">>"; }
};

template <class T> struct is_pipeline : std::false_type {};
template <class S, class... P> struct is_pipeline<pipeline<S, P...>> : std::true_type {};
template <class T> inline constexpr bool is_pipeline_v = is_pipeline<T>::value;
/// pipeline<...> or replicate<pipeline<...>> (any nesting of replicate).
template <class T> inline constexpr bool is_pipeline_plan_v = is_pipeline_v<strip_replicate_t<T>>;

}  // namespace whale
