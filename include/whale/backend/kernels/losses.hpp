// Row kernel bodies of the losses, body(team, r) (backend/kernels/shapes.hpp):
// softmax cross-entropy, the regression losses (MSE, L1, Huber), and the
// passes of the class-split loss (a split region's logits: the row maximum,
// the exponentials, the target logits, the loss and the gradient). Included
// by backend/kernels/rows.hpp.
#pragma once

#include <cmath>
#include <cstdint>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/math.hpp"
#include "whale/backend/kernels/shapes.hpp"

namespace whale::kernels {

/// Softmax cross-entropy of row r (C classes, label y[r]; labels are checked
/// before launch): loss[r] = log(sum exp(z - m)) + m - z[y], and the gradient
/// q = (softmax(z) - onehot(y)) * inv where inv is 1 / (the global label count).
/// A row labelled `ignore` gets loss 0 and gradient 0. q may be z itself (the
/// gradient in place of the logits). Three passes with one exponential per
/// element: the maximum; exp(z - max) written to q and summed; q scaled (and,
/// under bf16, stored rounded: `round`, no pass after). The
/// online softmax (kernels::max_sum) reads the logits once less but costs
/// two more exponentials per element, which the CPU pays (1.6% of gpt's step).
/// A GPU team stages the row in shared memory and keeps the exponentials
/// there, so the logits are read once and the gradient written once.
struct cross_entropy_rows {
  const float* z;
  const std::int32_t* y;
  float* q;
  double* loss;
  index_t C;
  float inv;
  std::int32_t ignore;
  /// read z as bf16 would hold it and store the gradient rounded to bf16
  /// (stored_as; stored logits are unchanged, a GEMM's left unrounded are rounded here)
  bool round = false;
  static constexpr int staged_rows = 1;  ///< z, then the exponentials in its place
  index_t width() const noexcept { return C; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    float* qr = q + r * C;
    const std::int32_t label = y[r];
    if (label == ignore) {
      t.for_each(C, [&](index_t j) { qr[j] = 0.f; });
      if (t.leader()) loss[r] = 0.0;
      return;
    }
    const float target = stored_as(z[r * C + label], round);
    const float* zr = t.stage(0, z + r * C, C);
    const float m = t.max(C, [&](index_t j) { return stored_as(zr[j], round); });
    t.sync();  // every lane has read z[label] before q (maybe z) is written
    float* e = t.scratch(0, qr);  // the exponentials: over the staged z, or in q
    const float sum = t.sum(C, [&](index_t j) {
      const float v = vexp(stored_as(zr[j], round) - m);
      e[j] = v;
      return v;
    });
    if (t.leader()) loss[r] = std::log(static_cast<double>(sum)) + m - target;
    const float scale = inv / sum;
    t.for_each(C, [&](index_t j) {  // the label's element less inv, in the same pass
      const float g = e[j] * scale;
      qr[j] = stored_as(j == label ? g - inv : g, round);
    });
  }
  std::int64_t bytes(index_t rows) const noexcept {  // z (twice unstaged), q written (and read back unstaged), z[label]
    return rows * ((stage_fits(staged_rows, C) ? 2 : 5) * C * 4 + 4 + 8);
  }
};

/// The regression losses, elementwise on the difference d = prediction - target.
enum class regression : std::uint8_t {
  mse,    ///< d^2
  l1,     ///< |d|
  huber,  ///< 0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta) (PyTorch's HuberLoss)
};
/// The loss of one element of difference d.
WHALE_HD WHALE_INLINE float regression_value(regression k, float d, float delta) noexcept {
  const float a = d < 0.f ? -d : d;
  if (k == regression::mse) return d * d;
  if (k == regression::l1) return a;
  return a < delta ? 0.5f * d * d : delta * (a - 0.5f * delta);
}
/// Its derivative by the prediction: 2 d; sign(d) (0 at d = 0, as PyTorch's
/// sign); d inside delta, else delta sign(d).
WHALE_HD WHALE_INLINE float regression_slope(regression k, float d, float delta) noexcept {
  const float s = d > 0.f ? 1.f : (d < 0.f ? -1.f : 0.f);
  if (k == regression::mse) return 2.f * d;
  if (k == regression::l1) return s;
  return (d < 0.f ? -d : d) < delta ? d : delta * s;
}
/// A regression loss of row r (C predictions z against C float targets y):
/// loss[r] = the sum of the elements' losses, and the gradient q = the
/// elements' slopes times inv, where inv is 1 / (the global count of target
/// elements). One pass: each element's loss is summed as its gradient is
/// written (stored rounded to bf16 under `round`).
struct regression_rows {
  const float* z;
  const float* y;
  float* q;
  double* loss;
  index_t C;
  float inv;
  regression kind;
  float delta = 1.f;   ///< huber's threshold
  bool round = false;  ///< store the gradient rounded to bf16 (stored_as)
  index_t width() const noexcept { return C; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* zr = z + r * C;
    const float* yr = y + r * C;
    float* qr = q + r * C;
    const float sum = t.sum(C, [&](index_t j) {
      const float d = zr[j] - yr[j];
      qr[j] = stored_as(regression_slope(kind, d, delta) * inv, round);
      return regression_value(kind, d, delta);
    });
    if (t.leader()) loss[r] = static_cast<double>(sum);
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * (3 * C * 4 + 8); }
};

/// m[r] = the maximum of row r (width C): the first pass of a class-split softmax.
struct row_max {
  const float* z;
  float* m;
  index_t C;
  index_t width() const noexcept { return C; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* zr = z + r * C;
    const float v = t.max(C, [&](index_t j) { return zr[j]; });
    if (t.leader()) m[r] = v;
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * (C + 1) * 4; }
};
/// q[r, :] = exp(z[r, :] - m[r]) and sum[r] = the row's sum: the second pass.
struct exp_rows {
  const float* z;
  const float* m;
  float* q;
  float* sum;
  index_t C;
  index_t width() const noexcept { return C; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* zr = z + r * C;
    float* qr = q + r * C;
    const float mr = m[r];
    const float s = t.sum(C, [&](index_t j) {
      const float e = vexp(zr[j] - mr);
      qr[j] = e;
      return e;
    });
    if (t.leader()) sum[r] = s;
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * (2 * C + 2) * 4; }
};
/// t[r] = z[r, y[r] - c0] when this rank holds the label's class (columns
/// c0..c0+C of a class-split row), else 0 (an ignored row too): the target
/// logits, summed over the ranks afterwards (labels checked by the caller).
struct target_logits {
  const float* z;
  const std::int32_t* y;
  float* t;
  index_t C, c0;
  std::int32_t ignore;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const std::int32_t label = y[r];
    t[r] = label != ignore && label >= c0 && label < c0 + C ? z[r * C + (label - c0)] : 0.f;
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * 12; }
};
/// A class-split cross-entropy's row losses, once its row sums and target
/// logits are summed over the ranks (st: R sums, then R targets):
/// loss[r] = log(sum[r]) + m[r] - target[r], as cross_entropy_rows computes a
/// whole row's; 0 for a row labelled `ignore`.
struct split_loss_rows {
  const float* st;
  const float* m;
  const std::int32_t* y;
  double* loss;
  index_t R;
  std::int32_t ignore;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    loss[r] = y[r] == ignore ? 0.0 : std::log(static_cast<double>(st[r])) + m[r] - st[R + r];
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * 24; }
};
/// The last pass of a class-split cross-entropy: q[r, :] *= inv / sum[r], and
/// inv is subtracted at the label when this rank holds its class (columns
/// c0..c0+C); a row labelled `ignore` gets a zero gradient.
struct softmax_grad_rows {
  float* q;
  const float* sum;
  const std::int32_t* y;
  index_t C, c0;
  float inv;
  std::int32_t ignore;
  index_t width() const noexcept { return C; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    float* qr = q + r * C;
    const std::int32_t label = y[r];
    if (label == ignore) {  // an exact zero, whatever the logits held
      t.for_each(C, [&](index_t j) { qr[j] = 0.f; });
      return;
    }
    const float scale = inv / sum[r];
    t.for_each(C, [&](index_t j) { qr[j] *= scale; });
    t.sync();  // the lane that wrote q[label - c0] is done before the leader changes it
    if (t.leader() && label >= c0 && label < c0 + C) qr[label - c0] -= inv;
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * (2 * C * 4 + 8); }
};

}  // namespace whale::kernels
