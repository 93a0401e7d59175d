// `make<M>(ctx, seed)`: builds the runtime of a model's parallel plan on every
// rank and validates it against the mesh before any training communication.
// The strategy types are in their own headers; this only dispatches.
#pragma once

#include <stdexcept>
#include <string>

#include "whale/comm/context.hpp"
#include "whale/nn/network.hpp"
#include "whale/strategy/data_parallel.hpp"
#include "whale/strategy/hybrid.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/shard.hpp"

namespace whale {

/// Build model M for this job: a model with `split` regions trains on the
/// data × model mesh (hybrid_parallel); `replicate<...>` trains data parallel
/// over the mesh's data axis; a model without strategies trains on one rank only.
/// Errors (on every rank, before any work): a plan that does not use the
/// ranks mpirun gave, a mesh the plan cannot use.
template <class M>
auto make(const context& ctx, seed s) {
  if constexpr (is_shard_v<M>) {  // shard<M, Level>: ZeRO over the data axis
    return sharded<M>(ctx, s);
  } else if constexpr (is_pipeline_plan_v<M>) {  // pipeline<...> or replicate<pipeline<...>>: data × pipe (× model)
    return pipelined<M>(ctx, s);
  } else if constexpr (contains_split<M>()) {
    return hybrid_parallel<M>(ctx, s);
  } else if constexpr (is_replicate_v<M>) {
    return data_parallel<M>(ctx, s);
  } else {
    if (ctx.size() != 1)
      throw std::invalid_argument("whale::make: " + layer_name<M>() + " has no parallel strategy, but the job has " +
                                  std::to_string(ctx.size()) +
                                  " ranks; wrap the model in whale::replicate<...> or launch one rank");
    return network<M>(s);
  }
}

}  // namespace whale
