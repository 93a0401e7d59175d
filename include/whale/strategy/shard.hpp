// `shard<M, Level>`: ZeRO stages 1–3 over the mesh's `data` axis, as a type,
// and the model-state formulas of each level. The flat parameter space is cut
// into contiguous, near-even ranges, one per data rank; each rank updates only
// its range. The runtime is the one executor (runtime/executor.hpp with the
// ZeRO engine of runtime/zero.hpp). Composes with split regions over the model
// axis and with a pipeline at the model's top (docs/compositions.md).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include "whale/nn/layer.hpp"
#include "whale/strategy/replicate.hpp"

namespace whale {

namespace detail {
/// Whether a pipeline lies below the sharded model's top (a pipeline is a
/// whole-model strategy: shard<pipeline<...>> and shard<replicate<pipeline<...>>>
/// are ZeRO inside each stage's data group; a pipeline as a part is not a plan).
template <class M> constexpr bool shard_nested_pipeline() {
  using T = typename strip_replicate<M>::type;
  if constexpr (kind_of<T> == part_kind::pipeline) return holds<part_kind::pipeline, T>();
  else return is_or_holds<part_kind::pipeline, T>();
}
template <class T> struct is_shard_impl : std::false_type {};
}  // namespace detail

/// ZeRO data parallelism of a whole model M over the mesh's data axis.
///   Level 1: optimizer state partitioned; gradients all-reduced (in buckets,
///            during backward); each rank updates its range, then parameters
///            are all-gathered.
///   Level 2: plus gradients partitioned: each leaf layer's gradients go to a
///            temporary buffer and are reduce-scattered (non-blocking) as soon
///            as its backward ends; each rank keeps only its range.
///   Level 3: plus parameters partitioned: a leaf's parameters are all-gathered
///            just before its forward and again before its backward and freed
///            after; the next leaf's gather is prefetched (non-blocking).
/// Behaves exactly as M (same parameters, same initialisation); `make` builds
/// the runtime. shard<replicate<M>> is shard<M> (the batch is split over the
/// data axis either way). Composes with split regions (ZeRO over data of each
/// rank's tensor-parallel shard) and with a pipeline at the top of M
/// (shard<pipeline<S, ...>, L>: ZeRO inside each stage's data group; with
/// micro-batches, levels 2–3 reduce-scatter every micro-batch and add into the
/// owned range). See docs/shard.md for memory formulas.
template <class M, int Level = 3>
struct shard : M {
  static_assert(Level >= 1 && Level <= 3,
                "whale::shard<M, Level>: Level must be 1 (optimizer state partitioned), 2 (plus "
                "gradients) or 3 (plus parameters, the default)");
  static_assert(Loss<M>,
                "whale::shard: shard the whole model (a sequential ending in a loss); sharding one "
                "part of a model is not supported yet — wrap the whole model in whale::shard<...>");
  static_assert(!detail::is_or_holds<detail::part_kind::shard, M>(),
                "whale::shard: shard<shard<M>> is not meaningful (there is one data axis), nor is a shard<...> "
                "inside the sharded model; use one shard<M, Level> around the whole model");
  static_assert(!detail::shard_nested_pipeline<M>(),
                "whale::shard: the model holds a pipeline<...> as a part, which is not a plan; a pipeline is a "
                "whole-model strategy: shard<pipeline<Schedule, ...>, Level> (ZeRO inside each stage's data "
                "group, over data x pipe) or shard<M, Level> of a model without one");
  static_assert(!detail::is_or_holds<detail::part_kind::split_data, M>(),
                "whale::shard: the model splits a region over the data axis (split<..., axis::data>), whose "
                "shards differ between data ranks, so ZeRO cannot partition them over that same axis; shard a "
                "model whose split regions are over axis::model, or use replicate<...> beside the data split");
  using inner = M;
  static constexpr int level = Level;
  static std::string name() { return "shard<" + layer_name<M>() + ", " + std::to_string(Level) + ">"; }
};

namespace detail {
template <class M, int L> struct is_shard_impl<shard<M, L>> : std::true_type {};
}  // namespace detail
template <class T> inline constexpr bool is_shard_v = detail::is_shard_impl<T>::value;

/// Model-state bytes per rank predicted by ZeRO's formulas (docs/shard.md), for
/// Ψ parameters, `shard` of them on this rank, K optimizer bytes per parameter.
/// level 0 is plain data parallelism.
constexpr std::int64_t zero_model_state_bytes(int level, std::int64_t psi, std::int64_t shard, std::int64_t k) {
  switch (level) {
    case 1: return 8 * psi + k * shard;
    case 2: return 4 * psi + (4 + k) * shard;
    case 3: return (8 + k) * shard;
    default: return (8 + k) * psi;
  }
}

}  // namespace whale
