// `sgd`: stochastic gradient descent with momentum (PyTorch's formulation),
// on a flat slice of parameters. Any slice: a sharded optimizer updates its own.
#pragma once

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
      if (buf.numel() == 0) return {};
      return {{"momentum_buffer", buf.v()}};
    }
  };
  static constexpr const char* name() { return "sgd"; }
  state make_state(index_t n) const {
    state s;
    if (momentum != 0.f) s.buf = tensor<float>({n}, mem_kind::optimizer);
    return s;
  }
  void update(state& s, view<float> p, cview<float> g) const {
    const index_t n = p.numel();
    float* __restrict pp = p.data();
    const float* __restrict gp = g.data();
    const float lr_ = lr, mu = momentum, wd = weight_decay;
    if (mu == 0.f) {
      for (index_t i = 0; i < n; ++i) pp[i] -= lr_ * (gp[i] + wd * pp[i]);
    } else {
      float* __restrict b = s.buf.data();
      if (s.steps == 0) {
        for (index_t i = 0; i < n; ++i) {
          b[i] = gp[i] + wd * pp[i];
          pp[i] -= lr_ * b[i];
        }
      } else {
        for (index_t i = 0; i < n; ++i) {
          b[i] = mu * b[i] + gp[i] + wd * pp[i];
          pp[i] -= lr_ * b[i];
        }
      }
    }
    ++s.steps;
  }
};

}  // namespace whale
