// `sgd`: stochastic gradient descent with momentum (PyTorch's formulation),
// on a flat slice of parameters. Any slice: a sharded optimizer updates its own.
#pragma once

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/optim.hpp"
#include "whale/optim/optimizer.hpp"

namespace whale {

/// SGD with momentum: buf = momentum * buf + (g + wd * p); p -= lr * buf.
struct sgd {
  float lr = 0.01f;
  float momentum = 0.f;
  float weight_decay = 0.f;

  struct state {
    tensor<float> buf;
    std::int64_t steps = 0;
    std::vector<state_vector> vectors() {
      if (buf.data() == nullptr) return {};  // without momentum: no buffer (a default tensor counts 1 element)
      return {{"momentum_buffer", buf.v()}};
    }
  };
  static constexpr const char* name() { return "sgd"; }
  static constexpr bool writes_delta = true;  ///< update() writes its change into an update_delta (DeltaOptimizer)
  state make_state(index_t n) const {
    state s;
    if (momentum != 0.f) s.buf = tensor<float>({n}, mem_kind::optimizer);
    return s;
  }
  template <class K>
  static void run(const backend_ref& be, index_t n, const K& rule, kernels::update_gate gate, kernels::update_delta delta) {
    if (delta.set()) be.launch(n, kernels::gated_delta_update<K>{rule, gate.scale, gate.halt, delta});
    else if (gate.set()) be.launch(n, kernels::gated_update<K>{rule, gate.scale, gate.halt});
    else be.launch(n, rule);
  }
  /// One step; under `gate` (in the backend's memory) the gradients are scaled
  /// by *gate.scale, and nothing changes while *gate.halt is non-zero. With
  /// `copy` (as many floats as p): p's new values rounded to bf16 go there too.
  /// With `delta` (under a gate): what the step changed, weighed, goes there.
  void update(state& s, view<float> p, cview<float> g, const backend_ref& be = {}, kernels::update_gate gate = {},
              float* copy = nullptr, kernels::update_delta delta = {}) const {
    check_delta(gate, delta);
    if (momentum == 0.f)
      run(be, p.numel(), kernels::sgd_plain{p.data(), g.data(), lr, weight_decay, copy}, gate, delta);
    else
      run(be, p.numel(),
          kernels::sgd_momentum{p.data(), g.data(), s.buf.data(), lr, weight_decay, momentum, s.steps == 0, copy}, gate,
          delta);
    ++s.steps;
  }
};

}  // namespace whale
