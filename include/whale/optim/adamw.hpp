// `adamw`: Adam with decoupled weight decay (Loshchilov & Hutter), on a flat
// slice of parameters, with bias correction as in PyTorch's AdamW.
#pragma once

#include <cmath>

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
  state make_state(index_t n) const {
    state s;
    s.m = tensor<float>({n}, mem_kind::optimizer);
    s.v = tensor<float>({n}, mem_kind::optimizer);
    return s;
  }
  void update(state& s, view<float> p, cview<float> g) const {
    ++s.steps;
    const index_t n = p.numel();
    const float b1 = beta1, b2 = beta2;
    const float c1 = 1.f - static_cast<float>(std::pow(static_cast<double>(b1), static_cast<double>(s.steps)));
    const float c2 = 1.f - static_cast<float>(std::pow(static_cast<double>(b2), static_cast<double>(s.steps)));
    const float step = lr / c1, inv_c2 = 1.f / c2, decay = 1.f - lr * weight_decay, e = eps;
    float* __restrict pp = p.data();
    const float* __restrict gp = g.data();
    float* __restrict m = s.m.data();
    float* __restrict v = s.v.data();
    for (index_t i = 0; i < n; ++i) {
      m[i] = b1 * m[i] + (1.f - b1) * gp[i];
      v[i] = b2 * v[i] + (1.f - b2) * gp[i] * gp[i];
      pp[i] = pp[i] * decay - step * m[i] / (std::sqrt(v[i] * inv_c2) + e);
    }
  }
};

}  // namespace whale
