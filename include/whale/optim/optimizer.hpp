// The `Optimizer` concept (an update rule on a flat slice of parameters with
// its own state) and gradient clipping by global norm. Rules: sgd.hpp, adamw.hpp.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/optim.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// An update rule: `make_state(n)` for n parameters, `update(state, p, g)` once
/// per step. A rule that also takes the backend, `update(state, p, g, be)`,
/// runs where the executor computes; one without it runs on the CPU only.
template <class O>
concept Optimizer = requires(const O& o, typename O::state& s, view<float> p, cview<float> g) {
  typename O::state;
  { o.make_state(index_t{}) } -> std::same_as<typename O::state>;
  o.update(s, p, g);
};

/// One per-parameter vector of an optimizer's state (as long as its slice of
/// parameters), named for checkpoints: "exp_avg", "momentum_buffer", ...
struct state_vector {
  const char* name;
  view<float> values;
};
/// Optimizer state that a checkpoint can save and restore: its per-parameter
/// vectors and its step counter.
template <class S>
concept CheckpointableState = requires(S& s) {
  { s.vectors() } -> std::same_as<std::vector<state_vector>>;
  { s.steps } -> std::convertible_to<std::int64_t>;
};

/// Scale factor that brings a gradient of global norm `norm` to at most `max_norm`.
inline float clip_coefficient(double norm, double max_norm) { return kernels::clip_scale(norm, max_norm); }

/// Clip gradients in place by their norm (single process, host memory);
/// returns the norm before clipping.
inline double clip_grad_norm(view<float> g, double max_norm) {
  const double norm = std::sqrt(cpu::sum_squares(g.numel(), g.data()));
  const float k = clip_coefficient(norm, max_norm);
  if (k != 1.f) cpu::launch(g.numel(), kernels::scale{g.data(), k});
  return norm;
}

/// Run one update of rule `o` on backend `be`: through the rule's backend
/// overload where it has one; a rule without it runs on the CPU, so on any
/// other backend it is an error that names the rule.
template <Optimizer O>
void update_on(const backend_ref& be, const O& o, typename O::state& s, view<float> p, cview<float> g) {
  if constexpr (requires { o.update(s, p, g, be); }) o.update(s, p, g, be);
  else {
    if (!be.on_cpu())
      throw std::invalid_argument(std::string("whale: the optimizer ") + typeid(O).name() +
                                  " has no update(state, p, g, backend) and so runs on the CPU only, but the "
                                  "parameters are on " + be.name());
    o.update(s, p, g);
  }
}

/// Run one update of gated rule `o` on backend `be`, under `gate` (GatedOptimizer).
template <Optimizer O>
void update_on(const backend_ref& be, const O& o, typename O::state& s, view<float> p, cview<float> g,
               kernels::update_gate gate) {
  static_assert(requires { o.update(s, p, g, be, gate); },
                "whale: this optimizer has no update(state, p, g, backend, kernels::update_gate), so it cannot update "
                "under a clipping scale and a halt flag kept in device memory; give it one (see sgd, adamw)");
  o.update(s, p, g, be, gate);
}

/// Run one update of rule `o` on backend `be` (under `gate` where it is set)
/// that also writes p's new values rounded to bf16 into `copy`
/// (RoundingOptimizer): bf16 mixed precision's master weights in p, the
/// weights the next step computes with in `copy`.
template <Optimizer O>
void update_on(const backend_ref& be, const O& o, typename O::state& s, view<float> p, cview<float> g,
               kernels::update_gate gate, float* copy) {
  static_assert(requires { o.update(s, p, g, be, gate, copy); },
                "whale: this optimizer has no update(state, p, g, backend, kernels::update_gate, copy), so it cannot "
                "write the rounded weights as it updates the master weights; give it one (see sgd, adamw)");
  o.update(s, p, g, be, gate, copy);
}
/// Whether rule O writes the bf16-rounded new values beside the fp32 ones in
/// its update pass (sgd and adamw do): bf16 mixed precision then keeps the
/// master weights apart from the weights a step computes with, and no pass
/// rounds or copies them (the network's precision: plan_options::precision).
template <class O>
concept RoundingOptimizer = Optimizer<O> && requires(const O& o, typename O::state& s, view<float> p, cview<float> g,
                                                     const backend_ref& be, kernels::update_gate gate, float* copy) {
  o.update(s, p, g, be, gate, copy);
};
/// Run one update of gated rule `o` on backend `be` under `gate` that also
/// writes what it changed, weighed, into `delta` (DeltaOptimizer).
template <Optimizer O>
void update_on(const backend_ref& be, const O& o, typename O::state& s, view<float> p, cview<float> g,
               kernels::update_gate gate, kernels::update_delta delta) {
  static_assert(requires { o.update(s, p, g, be, gate, nullptr, delta); },
                "whale: this optimizer has no update(state, p, g, backend, kernels::update_gate, copy, "
                "kernels::update_delta), so it cannot write what its step changed; give it one (see sgd, adamw)");
  o.update(s, p, g, be, gate, nullptr, delta);
}
/// The delta of an update pass (kernels::update_delta) is written only under a gate.
inline void check_delta(kernels::update_gate gate, kernels::update_delta delta) {
  if (delta.set() && !gate.set())
    throw std::invalid_argument("whale: an optimizer step asked to write what it changed (kernels::update_delta) "
                                "without a gate (kernels::update_gate): give both");
}
/// Whether rule O writes what its step changed, weighed, in the same pass
/// (kernels::update_delta; sgd and adamw do): Wave Synchronous Parallel's
/// update of a wave of one minibatch then needs no snapshot of the weights.
/// A rule says so with `static constexpr bool writes_delta = true` beside the
/// overload, so that an overload that merely accepts the argument is not taken
/// for one that writes it.
template <class O>
concept DeltaOptimizer = Optimizer<O> && requires(const O& o, typename O::state& s, view<float> p, cview<float> g,
                                                  const backend_ref& be, kernels::update_gate gate,
                                                  kernels::update_delta delta) {
  requires O::writes_delta;
  o.update(s, p, g, be, gate, nullptr, delta);
};
/// Whether rule O updates under a gate in device memory (kernels::update_gate:
/// a clipping scale and a halt flag), as a step that keeps its figures on the
/// device needs (trainer_options::log_every): sgd and adamw do.
template <class O>
concept GatedOptimizer = Optimizer<O> && requires(const O& o, typename O::state& s, view<float> p, cview<float> g,
                                                  const backend_ref& be, kernels::update_gate gate) {
  o.update(s, p, g, be, gate);
};

}  // namespace whale
