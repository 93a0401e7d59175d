// `auto_plan<M>`: the plan left to the planner. The type is the model (a Loss,
// as M); make<auto_plan<M>> prices every plan it can build for M on the mesh
// the job was launched with and runs the fastest that fits in memory
// (runtime/auto_plan.hpp). The candidates are plan types instantiated at
// compile time, so each keeps every compile-time check; only which one runs,
// its ZeRO level and its micro-batch count are chosen at run time.
// auto_plan<M, plan_space{.recompute = false}> leaves the recomputed candidates
// out: half the plan types, about a third less compile time.
#pragma once

#include <string>

#include "whale/fwd.hpp"
#include "whale/nn/layer.hpp"
#include "whale/strategy/pipeline.hpp"

namespace whale {

template <class M, plan_space S = plan_space{}>
struct auto_plan : M {
  static_assert(Loss<M>, "whale::auto_plan<M>: M must be a whole model that ends in a loss (e.g. models::gpt), "
                         "as for every plan");
  using model = M;
  static constexpr plan_space space = S;
  static std::string name() {
    return "auto_plan<" + layer_name<M>() + (S.recompute ? std::string() : ", plan_space{.recompute = false}") + ">";
  }
};

template <class T> inline constexpr bool is_auto_plan_v = false;
template <class M, plan_space S> inline constexpr bool is_auto_plan_v<auto_plan<M, S>> = true;

namespace detail {
/// Whether pipeline<Schedule, M> is a plan: M a sequential with exactly one
/// repeat<N, Block>, not one split region (the pipeline's own rules).
template <class M> constexpr bool pipelinable() {
  if constexpr (!pipe_sequential_like<M>) return false;
  else if constexpr (pipe_split_of<M>::value) return false;
  else return tuple_types<typename M::tuple_type>::repeat_count == 1;
}
}  // namespace detail

}  // namespace whale
