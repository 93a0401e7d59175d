// `adamw`: Adam with decoupled weight decay (Loshchilov & Hutter), on a flat
// slice of parameters, with bias correction as in PyTorch's AdamW.
#pragma once

#include <cmath>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/optim.hpp"
#include "whale/optim/optimizer.hpp"

namespace whale {

struct adamw {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;

  struct state {
    tensor<float> m, v;
    std::int64_t steps = 0;
    std::vector<state_vector> vectors() { return {{"exp_avg", m.v()}, {"exp_avg_sq", v.v()}}; }
  };
  static constexpr const char* name() { return "adamw"; }
  static constexpr bool writes_delta = true;  ///< update() writes its change into an update_delta (DeltaOptimizer)
  state make_state(index_t n) const {
    state s;
    s.m = tensor<float>({n}, mem_kind::optimizer);
    s.v = tensor<float>({n}, mem_kind::optimizer);
    return s;
  }
  /// One step; under `gate` (in the backend's memory) the gradients are scaled
  /// by *gate.scale, and nothing changes while *gate.halt is non-zero. With
  /// `copy` (as many floats as p): p's new values rounded to bf16 go there too.
  /// With `delta` (under a gate): what the step changed, weighed, goes there.
  void update(state& s, view<float> p, cview<float> g, const backend_ref& be = {}, kernels::update_gate gate = {},
              float* copy = nullptr, kernels::update_delta delta = {}) const {
    check_delta(gate, delta);
    ++s.steps;
    const float b1 = beta1, b2 = beta2;
    const float c1 = 1.f - static_cast<float>(std::pow(static_cast<double>(b1), static_cast<double>(s.steps)));
    const float c2 = 1.f - static_cast<float>(std::pow(static_cast<double>(b2), static_cast<double>(s.steps)));
    const kernels::adamw_step rule{p.data(), g.data(), s.m.data(), s.v.data(), b1, b2, lr / c1, 1.f / c2,
                                   1.f - lr * weight_decay, eps, copy};
    if (delta.set()) be.launch(p.numel(), kernels::gated_delta_update<kernels::adamw_step>{rule, gate.scale, gate.halt, delta});
    else if (gate.set()) be.launch(p.numel(), kernels::gated_update<kernels::adamw_step>{rule, gate.scale, gate.halt});
    else be.launch(p.numel(), rule);
  }
};

}  // namespace whale
