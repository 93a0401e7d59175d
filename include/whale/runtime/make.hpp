// `make<P>(ctx, seed, options)`: the runtime of plan P on this rank — the one
// executor (runtime/executor.hpp), which lowers the plan, checks it against the
// mesh on every rank before any training communication, and runs it; a model
// without strategies is a network on one rank. The strategy types are in strategy/.
#pragma once

#include <concepts>
#include <stdexcept>
#include <string>
#include <utility>

#include "whale/comm/context.hpp"
#include "whale/nn/network.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/runtime/auto_plan.hpp"
#include "whale/runtime/executor.hpp"

namespace whale {

/// A plan: what make<P> builds and executor<P> runs — a whole model that ends
/// in a loss (whale::Loss: it can be trained, it names itself), with or
/// without strategies (replicate, split, pipeline, shard) around or inside it.
/// A layer or a part of a model is not a plan.
template <class P>
concept Strategy = Loss<P> && requires {
  { P::name() } -> std::convertible_to<std::string>;
  typename P::input_type;
};

/// Build plan M for this job: every plan with a strategy (replicate, split,
/// pipeline, shard and their nestings) runs on executor<M> with `o`; a model
/// without strategies is a network<M> on one rank only.
/// Errors (on every rank, before any work): a plan that does not use the
/// ranks mpirun gave, a mesh the plan cannot use. Compile errors: the nestings
/// that sequential, stage and pipeline cannot refuse themselves (a shard, a
/// pipeline or, in a pipeline, a replicate below the plan's top; see
/// docs/strategies.md, "Nestings").
template <class M>
auto make(const context& ctx, seed s, plan_options o = plan_options::from_env()) {
  static_assert(Strategy<M>,
                "whale::make<P>: P is not a plan (whale::Strategy): a plan is a whole model that ends in a loss, "
                "e.g. sequential<..., softmax_cross_entropy>, with or without replicate/split/pipeline/shard around "
                "it; a single layer or a part of a model cannot be trained on its own");
  if constexpr (is_auto_plan_v<M>) {
    return auto_executor<typename M::model, M::space>(ctx, s, std::move(o));
  } else {
  using top = strip_replicate_t<M>;
  // replicate, split and shard check what they wrap; a sequential or a pipeline cannot
  constexpr bool unchecked = detail::kind_of<M> == detail::part_kind::layer ||
                             detail::kind_of<M> == detail::part_kind::pipeline;
  static_assert(!unchecked || !detail::holds<detail::part_kind::shard, M>(),
                "whale::make: the plan holds a shard<...> below its top (pipeline<Schedule, shard<M>>, "
                "stage<shard<...>> or sequential<A, shard<B>>), which would train without the ZeRO partitioning; "
                "shard is a whole-model strategy: make<shard<M, Level>> with M the whole model, or "
                "make<shard<pipeline<Schedule, ...>, Level>> for ZeRO inside each pipeline stage");
  static_assert(!unchecked || !detail::holds<detail::part_kind::pipeline, M>(),
                "whale::make: the plan holds a pipeline<...> below its top (sequential<A, pipeline<...>> or "
                "stage<pipeline<...>>), which would run as one sequential without its stages; a pipeline is a "
                "whole-model strategy: put every layer in its stages and make<pipeline<...>> or "
                "make<replicate<pipeline<...>>>");
  static_assert(!is_pipeline_plan_v<M> || !detail::holds<detail::part_kind::replicate, top>(),
                "whale::make: the plan has a replicate<...> inside a pipeline (pipeline<Schedule, replicate<M>> or "
                "stage<replicate<...>>), which the pipeline would ignore: its stages are not data parallel on "
                "their own. Replicate the whole pipeline: make<replicate<pipeline<Schedule, ...>>> (data × pipe)");
  if constexpr (is_shard_v<M> || is_pipeline_plan_v<M> || contains_split<M>() || is_replicate_v<M>) {
    return executor<M>(ctx, s, std::move(o));
  } else {
    if (ctx.size() != 1)
      throw std::invalid_argument("whale::make: " + layer_name<M>() + " has no parallel strategy, but the job has " +
                                  std::to_string(ctx.size()) +
                                  " ranks; wrap the model in whale::replicate<...> or launch one rank");
    return network<M>(s, o.backend, o.precision);
  }
  }
}

}  // namespace whale
