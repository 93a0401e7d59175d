// Optimizer kernel bodies, body(i) over a flat parameter slice: SGD with
// momentum (PyTorch's formulation) and AdamW. The scalars that depend on the
// step count (bias corrections) are computed once on the host and passed in.
#pragma once

#include <cmath>

#include "whale/backend/kernel.hpp"

namespace whale::kernels {

/// p -= lr (g + wd p), no momentum.
struct sgd_plain {
  float* p;
  const float* g;
  float lr, wd;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { p[i] -= lr * (g[i] + wd * p[i]); }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};
/// buf = mu buf + (g + wd p) (buf = g + wd p on the first step); p -= lr buf.
struct sgd_momentum {
  float* p;
  const float* g;
  float* buf;
  float lr, wd, mu;
  bool first;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float b = (first ? 0.f : mu * buf[i]) + g[i] + wd * p[i];
    buf[i] = b;
    p[i] -= lr * b;
  }
  std::int64_t bytes(index_t n) const noexcept { return n * (first ? 16 : 20); }
};
/// AdamW: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
/// p = p (1 - lr wd) - (lr / c1) m / (sqrt(v / c2) + eps), c1 and c2 the bias corrections.
struct adamw_step {
  float* p;
  const float* g;
  float* m;
  float* v;
  float b1, b2, step, inv_c2, decay, eps;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float gi = g[i];
    const float mi = b1 * m[i] + (1.f - b1) * gi;
    const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step * mi / (std::sqrt(vi * inv_c2) + eps);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 28; }
};

}  // namespace whale::kernels
