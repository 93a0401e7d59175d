// Optimizer kernel bodies, body(i) over a flat parameter slice: SGD with
// momentum (PyTorch's formulation) and AdamW. The scalars that depend on the
// step count (bias corrections) are computed once on the host and passed in.
#pragma once

#include <cmath>

#include "whale/backend/kernel.hpp"

namespace whale::kernels {

/// What a step kept in device memory hands the optimizer (trainer_options::log_every):
/// the gradients' clipping scale and a halt flag, read by every element; null: 1 and go.
struct update_gate {
  const double* scale = nullptr;  ///< multiplies every gradient (clipping); null: 1
  const double* halt = nullptr;   ///< non-zero: change nothing (a step was not finite)
  WHALE_HD WHALE_INLINE bool stop() const noexcept { return halt && *halt != 0.0; }
  WHALE_HD WHALE_INLINE float grad(const float* g, index_t i) const noexcept {
    return scale ? g[i] * static_cast<float>(*scale) : g[i];
  }
};

/// The factor that brings a gradient of global norm `norm` to at most
/// `max_norm` (1 when max_norm <= 0): the host's clip_coefficient, also on a device.
WHALE_HD WHALE_INLINE float clip_scale(double norm, double max_norm) noexcept {
  if (max_norm <= 0 || norm <= max_norm) return 1.f;
  return static_cast<float>(max_norm / (norm + 1e-6));
}

/// One step's figures where the step ran, for the host to read later: the
/// loss (what the loss layers added, step_ctx::loss_sum), the gradients' sum
/// of squares, the clipping scale the update used, and the fault (0: none;
/// 1: the loss was not finite; 2: the gradient norm was not finite).
struct step_figures {
  double loss, sum_squares, scale, fault;
};
/// One index, after the step's loss and sum of squares are in `rec`: the
/// fault and the clipping scale. The first faulty step's number (`step`,
/// from 1) goes to *halt, which stops every update until the host clears it.
struct check_step {
  step_figures* rec;
  double* halt;
  double max_norm;
  double step;
  bool check_norm;
  WHALE_HD WHALE_INLINE void operator()(index_t) const noexcept {
    const double loss = rec->loss, sq = rec->sum_squares;
    double fault = 0;
    if (loss - loss != 0.0) fault = 1;  // NaN or infinite
    else if (check_norm && sq - sq != 0.0) fault = 2;
    if (fault != 0 && *halt == 0.0) *halt = step;
    rec->fault = fault;
    rec->scale = fault == 0 && max_norm > 0 ? clip_scale(std::sqrt(sq), max_norm) : 1.0;
  }
  std::int64_t bytes(index_t) const noexcept { return 48; }
};

/// p -= lr (g + wd p), no momentum.
struct sgd_plain {
  float* p;
  const float* g;
  float lr, wd;
  update_gate gate{};
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    if (gate.stop()) return;
    p[i] -= lr * (gate.grad(g, i) + wd * p[i]);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};
/// buf = mu buf + (g + wd p) (buf = g + wd p on the first step); p -= lr buf.
struct sgd_momentum {
  float* p;
  const float* g;
  float* buf;
  float lr, wd, mu;
  bool first;
  update_gate gate{};
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    if (gate.stop()) return;
    const float b = (first ? 0.f : mu * buf[i]) + gate.grad(g, i) + wd * p[i];
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
  update_gate gate{};
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    if (gate.stop()) return;
    const float gi = gate.grad(g, i);
    const float mi = b1 * m[i] + (1.f - b1) * gi;
    const float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step * mi / (std::sqrt(vi * inv_c2) + eps);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 28; }
};

}  // namespace whale::kernels
