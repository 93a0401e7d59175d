// Optimizer kernel bodies, body(i) over a flat parameter slice: SGD with
// momentum (PyTorch's formulation) and AdamW. The scalars that depend on the
// step count (bias corrections) are computed once on the host and passed in.
#pragma once

#include <cmath>

#include "whale/backend/kernel.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/math.hpp"

namespace whale::kernels {

/// What a step kept in device memory hands the optimizer (trainer_options::log_every):
/// the gradients' clipping scale and a halt flag, both in the backend's memory
/// (both, or neither: no gate).
struct update_gate {
  const double* scale = nullptr;  ///< multiplies every gradient (clipping)
  const double* halt = nullptr;   ///< non-zero: change nothing (a step was not finite)
  bool set() const noexcept { return scale != nullptr; }
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

/// One index: Wave Synchronous Parallel's gate for one minibatch of a
/// virtual worker (train/wsp_trainer.hpp) on a device, the host's checks
/// made where the figures lie. The loss is *loss + host (the loss layers'
/// share added on the device, and what they returned on the host); the
/// worker's norm is sqrt(*squares) x base (squares null: not checked); the
/// gradients' scale is `base` (the worker's rows scaled up to the global
/// batch), times the norm's clip coefficient when max_norm > 0: the host's
/// float arithmetic. The fault: 1 when the loss is not finite, 2 when the
/// norm is not; the first faulty minibatch's number (`number`, from 1) goes
/// to *halt, which gates its update and every one after it until cleared.
struct wsp_gate {
  const double* loss;
  double host;
  const double* squares;  ///< the worker's squared norm (null: none taken)
  double* scale;
  double* fault;
  double* halt;
  float base;
  double max_norm;
  double number;
  WHALE_HD WHALE_INLINE void operator()(index_t) const noexcept {
    const double l = *loss + host;
    double f = 0, norm = 0;
    if (l - l != 0.0) f = 1;
    else if (squares) {
      norm = std::sqrt(*squares) * static_cast<double>(base);
      if (norm - norm != 0.0) f = 2;
    }
    if (f != 0 && *halt == 0.0) *halt = number;
    *fault = f;
    *scale = f == 0 && max_norm > 0 ? static_cast<double>(base * clip_scale(norm, max_norm)) : static_cast<double>(base);
  }
  std::int64_t bytes(index_t) const noexcept { return 48; }
};

/// One index: *squares = NaN where *loss + host is not finite (a worker's
/// squared norm marked before its ranks sum it, so that every rank's
/// wsp_gate sees a loss fault of the rank that has the loss).
struct poison_on_bad_loss {
  const double* loss;
  double host;
  double* squares;
  WHALE_HD WHALE_INLINE void operator()(index_t) const noexcept {
    const double l = *loss + host;
    if (l - l != 0.0) *squares = l - l;  // NaN (inf - inf, or NaN)
  }
  std::int64_t bytes(index_t) const noexcept { return 16; }
};

// Each rule's apply(i, gi, keep): the update of element i with gradient gi,
// or (keep) the element's values written back unchanged: a select rather
// than a branch, so that a CPU loop under a runtime halt flag still vectorizes.
// Every multiply-add is one madd (kernels/math.hpp), so that no compiler is left to
// choose which products to fuse: g++ contracts a * b + c at -O2 and above
// (-ffp-contract=fast, its default) and may choose differently in two loops
// over the same rule (the plain update and gated_update), which made
// trainer_options::log_every change the parameters' last bits.
//
// Each rule's `copy`, when set, receives every element's new value rounded to
// bf16 in the same pass: under bf16 mixed precision `p` is then the fp32
// master weights and `copy` the weights the next step computes with, so no
// pass rounds them and none copies the master weights aside or back.

/// p -= lr (g + wd p), no momentum: p + (-lr) (wd p + g), two multiply-adds.
struct sgd_plain {
  float* p;
  const float* g;
  float lr, wd;
  float* copy = nullptr;  ///< set: the new p rounded to bf16
  WHALE_HD WHALE_INLINE void apply(index_t i, float gi, bool keep) const noexcept {
    const float pi = p[i];
    const float next = madd(-lr, madd(wd, pi, gi), pi);
    p[i] = keep ? pi : next;
    if (copy) copy[i] = round_bf16(keep ? pi : next);
  }
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { apply(i, g[i], false); }
  std::int64_t bytes(index_t n) const noexcept { return n * (copy ? 16 : 12); }
};
/// buf = mu buf + (g + wd p) (buf = g + wd p on the first step); p -= lr buf:
/// buf = wd p + (mu buf + g), p = (-lr) buf + p, each sum a multiply-add.
struct sgd_momentum {
  float* p;
  const float* g;
  float* buf;
  float lr, wd, mu;
  bool first;
  float* copy = nullptr;  ///< set: the new p rounded to bf16
  WHALE_HD WHALE_INLINE void apply(index_t i, float gi, bool keep) const noexcept {
    const float pi = p[i], bi = first ? 0.f : buf[i];
    const float b = madd(wd, pi, first ? gi : madd(mu, bi, gi));
    const float next = madd(-lr, b, pi);
    if (first) buf[i] = keep ? 0.f : b;  // a halted first step leaves the buffer as make_state made it
    else buf[i] = keep ? bi : b;
    p[i] = keep ? pi : next;
    if (copy) copy[i] = round_bf16(keep ? pi : next);
  }
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { apply(i, g[i], false); }
  std::int64_t bytes(index_t n) const noexcept { return n * ((first ? 16 : 20) + (copy ? 4 : 0)); }
};
/// AdamW: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
/// p = p (1 - lr wd) - (lr / c1) m / (sqrt(v / c2) + eps), c1 and c2 the bias
/// corrections; the three sums are multiply-adds (b1 m, b2 v and p (1 - lr wd) fused).
struct adamw_step {
  float* p;
  const float* g;
  float* m;
  float* v;
  float b1, b2, step, inv_c2, decay, eps;
  float* copy = nullptr;  ///< set: the new p rounded to bf16
  WHALE_HD WHALE_INLINE void apply(index_t i, float gi, bool keep) const noexcept {
    const float m0 = m[i], v0 = v[i], p0 = p[i];
    const float mi = madd(b1, m0, (1.f - b1) * gi);
    const float vi = madd(b2, v0, (1.f - b2) * gi * gi);
    const float pi = madd(p0, decay, -(step * mi / (std::sqrt(vi * inv_c2) + eps)));
    m[i] = keep ? m0 : mi;
    v[i] = keep ? v0 : vi;
    p[i] = keep ? p0 : pi;
    if (copy) copy[i] = round_bf16(keep ? p0 : pi);
  }
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { apply(i, g[i], false); }
  std::int64_t bytes(index_t n) const noexcept { return n * (copy ? 32 : 28); }
};

/// Rule K under a gate in device memory (update_gate, both pointers set):
/// every gradient scaled by *scale as it is read, and nothing changed while
/// *halt is non-zero. The same arithmetic as K after kernels::scale.
template <class K> struct gated_update {
  K rule;
  const double* scale;
  const double* halt;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const bool keep = *halt != 0.0;
    rule.apply(i, rule.g[i] * static_cast<float>(*scale), keep);
  }
  std::int64_t bytes(index_t n) const noexcept { return rule.bytes(n) + 16; }
};

/// Where an update pass also writes what it changed, weighed: out[i] =
/// (p[i] after - p[i] before) x k. Wave Synchronous Parallel's update of a
/// wave of one minibatch (train/wsp_trainer.hpp), made in the optimizer's
/// own pass: no snapshot of the weights and no pass over them afterwards.
struct update_delta {
  float* out = nullptr;
  float k = 1.f;
  bool set() const noexcept { return out != nullptr; }
};

/// Rule K under a gate, as gated_update, that also writes what it changed
/// (update_delta): the difference of the same two floats scaled_difference
/// would take from a snapshot, so the same bits.
template <class K> struct gated_delta_update {
  K rule;
  const double* scale;
  const double* halt;
  update_delta delta;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const bool keep = *halt != 0.0;
    const float before = rule.p[i];
    rule.apply(i, rule.g[i] * static_cast<float>(*scale), keep);
    delta.out[i] = (rule.p[i] - before) * delta.k;
  }
  std::int64_t bytes(index_t n) const noexcept { return rule.bytes(n) + 16 + 4 * n; }
};

}  // namespace whale::kernels
