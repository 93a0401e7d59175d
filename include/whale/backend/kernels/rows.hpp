// Row-wise kernel bodies, body(r) over the rows of a (R, C) matrix: bias rows,
// LayerNorm forward and backward, the causal softmax of attention scores and
// softmax cross-entropy; and column-block bodies, body(b) over blocks of
// `col_block` columns, for the sums over rows (bias and gain gradients). Each
// body runs one row (or block) serially: a CPU loop vectorizes inside the row;
// on the GPU one thread takes one row, which is correct but leaves the
// warp-level reductions of a tuned kernel to the CUDA backend (docs/backend.md).
#pragma once

#include <cmath>
#include <cstdint>

#include "whale/backend/kernels/math.hpp"

namespace whale::kernels {

/// Columns per body of the column-block kernels: 1 KiB of each row, long enough
/// for the CPU to stream rows, while the accumulators stay in L1.
inline constexpr index_t col_block = 256;
/// How many column blocks cover `cols` columns.
constexpr index_t col_blocks(index_t cols) noexcept { return (cols + col_block - 1) / col_block; }

/// y[r, :] = b (beta 0) or y[r, :] += b, a row of width C per body.
struct bias_rows {
  float* y;
  const float* b;
  index_t C;
  bool accumulate;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    float* yr = y + r * C;
    if (accumulate)
      for (index_t c = 0; c < C; ++c) yr[c] += b[c];
    else
      for (index_t c = 0; c < C; ++c) yr[c] = b[c];
  }
};

/// y[r, :] = table[tokens[r] - first, :]: an embedding lookup, a row of width D
/// per body (token ids checked by the caller). A table that holds only the
/// `held` rows from `first` (a vocabulary slice) gives zeros for other tokens;
/// held < 0: the whole table.
struct gather_rows {
  const float* table;
  const std::int32_t* tokens;
  float* y;
  index_t D;
  index_t first = 0, held = -1;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const index_t t = static_cast<index_t>(tokens[r]) - first;
    float* yr = y + r * D;
    if (held >= 0 && (t < 0 || t >= held)) {
      for (index_t c = 0; c < D; ++c) yr[c] = 0.f;
      return;
    }
    const float* src = table + t * D;
    for (index_t c = 0; c < D; ++c) yr[c] = src[c];
  }
};

/// out[c] (+)= sum over R rows of x[r, c], for the columns of block `blk`.
struct column_sums {
  const float* x;
  float* out;
  index_t R, C;
  bool accumulate;
  WHALE_HD WHALE_INLINE void operator()(index_t blk) const noexcept {
    const index_t c0 = blk * col_block;
    const index_t w = C - c0 < col_block ? C - c0 : col_block;
    float acc[col_block] = {};
    for (index_t r = 0; r < R; ++r) {
      const float* xr = x + r * C + c0;
      for (index_t c = 0; c < w; ++c) acc[c] += xr[c];
    }
    for (index_t c = 0; c < w; ++c) out[c0 + c] = accumulate ? out[c0 + c] + acc[c] : acc[c];
  }
};

/// LayerNorm of row r (width D): xhat = (x - mean) rstd, y = xhat gain + bias.
struct layer_norm_forward {
  const float* x;
  const float* gain;
  const float* bias;
  float* y;
  float* xhat;
  float* rstd;
  index_t D;
  float eps;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const float* xr = x + r * D;
    float* hr = xhat + r * D;
    float* yr = y + r * D;
    const float mean = vsum(xr, D) / static_cast<float>(D);
    for (index_t j = 0; j < D; ++j) hr[j] = xr[j] - mean;
    const float var = vdot(hr, hr, D) / static_cast<float>(D);
    const float s = 1.f / std::sqrt(var + eps);
    rstd[r] = s;
    for (index_t j = 0; j < D; ++j) {
      hr[j] *= s;
      yr[j] = hr[j] * gain[j] + bias[j];
    }
  }
};
/// d(input) of row r: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gain.
struct layer_norm_backward {
  const float* dy;
  const float* xhat;
  const float* rstd;
  const float* gain;
  float* dx;
  index_t D;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const float* gr = dy + r * D;
    const float* hr = xhat + r * D;
    float* dr = dx + r * D;
    for (index_t j = 0; j < D; ++j) dr[j] = gr[j] * gain[j];  // d(x-hat), staged in dx
    const float m1 = vsum(dr, D) / static_cast<float>(D);
    const float m2 = vdot(dr, hr, D) / static_cast<float>(D);
    const float s = rstd[r];
    for (index_t j = 0; j < D; ++j) dr[j] = s * (dr[j] - m1 - hr[j] * m2);
  }
};
/// d(gain) and d(bias) for the columns of block `blk`: sums over R rows of dy xhat and dy.
struct layer_norm_param_grads {
  const float* dy;
  const float* xhat;
  float* dgain;
  float* dbias;
  index_t R, D;
  bool accumulate;
  WHALE_HD WHALE_INLINE void operator()(index_t blk) const noexcept {
    const index_t c0 = blk * col_block;
    const index_t w = D - c0 < col_block ? D - c0 : col_block;
    float ag[col_block] = {}, ab[col_block] = {};
    for (index_t r = 0; r < R; ++r) {
      const float* gr = dy + r * D + c0;
      const float* hr = xhat + r * D + c0;
      for (index_t c = 0; c < w; ++c) {
        ag[c] += gr[c] * hr[c];
        ab[c] += gr[c];
      }
    }
    for (index_t c = 0; c < w; ++c) {
      dgain[c0 + c] = accumulate ? dgain[c0 + c] + ag[c] : ag[c];
      dbias[c0 + c] = accumulate ? dbias[c0 + c] + ab[c] : ab[c];
    }
  }
};

/// Softmax over columns 0..i of score row `row` (width T, i = row % T, the
/// causal mask), zeros after; in place.
struct causal_softmax_forward {
  float* p;
  index_t T;
  WHALE_HD WHALE_INLINE void operator()(index_t row) const noexcept {
    float* pr = p + row * T;
    const index_t n = row % T + 1;
    const float m = vmax(pr, n);
    for (index_t j = 0; j < n; ++j) pr[j] = vexp(pr[j] - m);
    const float inv = 1.f / vsum(pr, n);
    for (index_t j = 0; j < n; ++j) pr[j] *= inv;
    for (index_t j = n; j < T; ++j) pr[j] = 0.f;
  }
};
/// dS = P (dP - <dP, P>) on columns 0..i of row `row`, in place in d; masked columns get 0.
struct causal_softmax_backward {
  const float* p;
  float* d;
  index_t T;
  WHALE_HD WHALE_INLINE void operator()(index_t row) const noexcept {
    const float* pr = p + row * T;
    float* dr = d + row * T;
    const index_t n = row % T + 1;
    const float dot = vdot(pr, dr, n);
    for (index_t j = 0; j < n; ++j) dr[j] = pr[j] * (dr[j] - dot);
    for (index_t j = n; j < T; ++j) dr[j] = 0.f;
  }
};

/// Softmax cross-entropy of row r (C classes, label y[r]; labels are checked
/// before launch): loss[r] = log(sum exp(z - m)) + m - z[y], and the gradient
/// q = (softmax(z) - onehot(y)) * inv where inv is 1 / (the global label count).
/// A row labelled `ignore` gets loss 0 and gradient 0.
struct cross_entropy_rows {
  const float* z;
  const std::int32_t* y;
  float* q;
  double* loss;
  index_t C;
  float inv;
  std::int32_t ignore;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const float* zr = z + r * C;
    float* qr = q + r * C;
    const std::int32_t label = y[r];
    if (label == ignore) {
      for (index_t j = 0; j < C; ++j) qr[j] = 0.f;
      loss[r] = 0.0;
      return;
    }
    const float m = vmax(zr, C);
    for (index_t j = 0; j < C; ++j) qr[j] = vexp(zr[j] - m);
    const float sum = vsum(qr, C);
    loss[r] = std::log(static_cast<double>(sum)) + m - zr[label];
    const float scale = inv / sum;
    for (index_t j = 0; j < C; ++j) qr[j] *= scale;
    qr[label] -= inv;
  }
};

/// dst[r, 0:w] = src[r, 0:w], rows `src_stride` and `dst_stride` floats apart:
/// a block of columns moved between matrices of different widths (the column
/// layouts of a split region: gathering, slicing and packing column blocks).
struct copy_cols {
  const float* src;
  index_t src_stride;
  float* dst;
  index_t dst_stride;
  index_t w;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const float* s = src + r * src_stride;
    float* d = dst + r * dst_stride;
    for (index_t c = 0; c < w; ++c) d[c] = s[c];
  }
};

/// m[r] = the maximum of row r (width C): the first pass of a class-split softmax.
struct row_max {
  const float* z;
  float* m;
  index_t C;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept { m[r] = vmax(z + r * C, C); }
};
/// q[r, :] = exp(z[r, :] - m[r]) and sum[r] = the row's sum: the second pass.
struct exp_rows {
  const float* z;
  const float* m;
  float* q;
  float* sum;
  index_t C;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const float* zr = z + r * C;
    float* qr = q + r * C;
    const float mr = m[r];
    for (index_t j = 0; j < C; ++j) qr[j] = vexp(zr[j] - mr);
    sum[r] = vsum(qr, C);
  }
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
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    float* qr = q + r * C;
    const std::int32_t label = y[r];
    if (label == ignore) {  // an exact zero, whatever the logits held
      for (index_t j = 0; j < C; ++j) qr[j] = 0.f;
      return;
    }
    const float scale = inv / sum[r];
    for (index_t j = 0; j < C; ++j) qr[j] *= scale;
    if (label >= c0 && label < c0 + C) qr[label - c0] -= inv;
  }
};

/// y[r, :] = x[r, :] + pos[r % T, :] (learned positions added to token rows).
struct add_positions {
  const float* x;
  const float* pos;
  float* y;
  index_t T, D;
  WHALE_HD WHALE_INLINE void operator()(index_t r) const noexcept {
    const float* xr = x + r * D;
    const float* pr = pos + (r % T) * D;
    float* yr = y + r * D;
    for (index_t j = 0; j < D; ++j) yr[j] = xr[j] + pr[j];
  }
};
/// Scatter-add of R gradient rows into table rows: table[idx(r), c] += dy[r, c]
/// for the columns of block `blk`, rows in order. idx(r) is tokens[r] when
/// tokens is set, else r % T (positions); a table that holds only the `held`
/// rows from `first` (a vocabulary slice; held < 0: all) takes the rows of its
/// tokens, at tokens[r] - first, and skips the rest. One block per body, so that no two
/// bodies write the same element (no atomics on the GPU) and every element
/// sums its rows in the same order on both sides.
struct scatter_add_rows {
  const float* dy;
  const std::int32_t* tokens;
  float* table;
  index_t R, D, T;
  index_t first = 0, held = -1;
  WHALE_HD WHALE_INLINE void operator()(index_t blk) const noexcept {
    const index_t c0 = blk * col_block;
    const index_t w = D - c0 < col_block ? D - c0 : col_block;
    for (index_t r = 0; r < R; ++r) {
      const index_t row = tokens ? static_cast<index_t>(tokens[r]) - first : r % T;
      if (held >= 0 && (row < 0 || row >= held)) continue;
      float* tr = table + row * D + c0;
      const float* gr = dy + r * D + c0;
      for (index_t c = 0; c < w; ++c) tr[c] += gr[c];
    }
  }
};

/// The sum of squares of x[0, n) by blocks of 4096: out[b] is block b's sum,
/// computed exactly as cpu::sum_squares computes one block (16 float lanes,
/// then the tail, then the lanes, in that order), so adding out[] in order on
/// the host gives cpu::sum_squares's result to the bit. One index per block:
/// on a GPU a thread walks 4096 elements (a norm per step, not a hot kernel).
struct sum_squares_blocks {
  static constexpr index_t block = 4096, lanes = 16;
  const float* x;
  double* out;
  index_t n;
  static constexpr index_t blocks(index_t n) noexcept { return (n + block - 1) / block; }
  WHALE_HD WHALE_INLINE void operator()(index_t b) const noexcept {
    const index_t i0 = b * block;
    const index_t e = i0 + block < n ? i0 + block : n;
    float acc[lanes] = {};
    index_t i = i0;
    for (; i + lanes <= e; i += lanes)
      for (index_t k = 0; k < lanes; ++k) acc[k] += x[i + k] * x[i + k];
    float s = 0.f;
    for (; i < e; ++i) s += x[i] * x[i];
    for (index_t k = 0; k < lanes; ++k) s += acc[k];
    out[b] = s;
  }
};

}  // namespace whale::kernels
