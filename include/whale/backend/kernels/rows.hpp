// Row and column kernel bodies over a (R, C) matrix. Row bodies,
// body(team, r) (backend/kernels/shapes.hpp): a team of lanes takes row r,
// reduces across lanes in a fixed tree and writes the row in strided passes
// -- bias rows, embedding lookups, LayerNorm and RMSNorm forward and backward,
// cross-entropy, the regression losses, the class-split passes (attention's
// rows: kernels/attention.hpp).
// Column bodies, load/store (the column-reduction shape): the sums over rows
// of bias and LayerNorm gradients and of position gradients. The embedding's
// scatter-add by token is still one index per block of columns (below).
#pragma once

#include <cmath>
#include <cstdint>

#include "whale/backend/kernels/attention.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/math.hpp"
#include "whale/backend/kernels/shapes.hpp"

namespace whale::kernels {

/// Columns per body of the column-block kernels: 1 KiB of each row, long enough
/// for the CPU to stream rows, while the accumulators stay in L1.
inline constexpr index_t col_block = 256;
/// How many column blocks cover `cols` columns.
constexpr index_t col_blocks(index_t cols) noexcept { return (cols + col_block - 1) / col_block; }

/// y[r, :] = b (beta 0) or y[r, :] += b, a row of width C per team; `round`:
/// stored rounded to bf16 (a linear layer's output under bf16, after its GEMM).
struct bias_rows {
  float* y;
  const float* b;  // null: no bias (the pass only stores y, or y + add)
  index_t C;
  bool accumulate;
  bool round = false;
  /// A residual's input (rows of C) added after the bias, each sum stored as
  /// `round` says: y = (y + b) + add, a residual's sum in the same pass.
  const float* add = nullptr;
  index_t width() const noexcept { return C; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    float* yr = y + r * C;
    if (!b) {  // no bias (linear<In, Out, no_bias>): y stored as `round` says, with `add` if given
      if (add) {
        const float* ar = add + r * C;
        t.for_each(C, [&](index_t c) { yr[c] = stored_as(ar[c] + stored_as(accumulate ? yr[c] : 0.f, round), round); });
      } else if (accumulate) {
        t.for_each(C, [&](index_t c) { yr[c] = stored_as(yr[c], round); });
      } else {
        t.for_each(C, [&](index_t c) { yr[c] = 0.f; });
      }
    } else if (add) {
      const float* ar = add + r * C;
      t.for_each(C, [&](index_t c) {
        yr[c] = stored_as(ar[c] + stored_as((accumulate ? yr[c] : 0.f) + b[c], round), round);
      });
    } else if (accumulate) {
      t.for_each(C, [&](index_t c) { yr[c] = stored_as(yr[c] + b[c], round); });
    } else {
      t.for_each(C, [&](index_t c) { yr[c] = stored_as(b[c], round); });
    }
  }
  std::int64_t bytes(index_t rows) const noexcept {
    return rows * C * 4 * ((accumulate ? 2 : 1) + (add ? 1 : 0)) + (b ? C * 4 : 0);
  }
};

/// y[r, :] = table[tokens[r] - first, :]: an embedding lookup, a row of width D
/// per team (token ids checked by the caller). A table that holds only the
/// `held` rows from `first` (a vocabulary slice) gives zeros for other tokens;
/// held < 0: the whole table.
struct gather_rows {
  const float* table;
  const std::int32_t* tokens;
  float* y;
  index_t D;
  index_t first = 0, held = -1;
  bool round = false;  ///< store the rows rounded to bf16
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& tm, index_t r) const noexcept {
    const index_t t = static_cast<index_t>(tokens[r]) - first;
    float* yr = y + r * D;
    if (held >= 0 && (t < 0 || t >= held)) {
      tm.for_each(D, [&](index_t c) { yr[c] = 0.f; });
      return;
    }
    const float* src = table + t * D;
    tm.for_each(D, [&](index_t c) { yr[c] = stored_as(src[c], round); });
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * (2 * D * 4 + 4); }
};

/// out[c] (+)= the sum over R rows of x[r, c]: a column reduction.
struct column_sums {
  static constexpr int accumulators = 1;
  const float* x;
  float* out;
  index_t R, C;
  bool accumulate;
  index_t rows() const noexcept { return R; }
  index_t cols() const noexcept { return C; }
  WHALE_HD WHALE_INLINE void load(index_t r, index_t c, float* v) const noexcept { v[0] = x[r * C + c]; }
  WHALE_HD WHALE_INLINE void store(index_t c, const float* acc) const noexcept {
    out[c] = accumulate ? out[c] + acc[0] : acc[0];
  }
};

/// The row a norm's forward normalises: x's row r through slot 0 (staged);
/// or, with a residual's sum pending (`sum_y`, step_ctx::pending_sum), that
/// sum stored first -- sum_add + (sum_y + sum_bias), each sum as `round`
/// says, bias_rows' values -- into sum_y's row (which is x's) and kept in
/// slot 0, each lane its own elements.
template <class Team>
WHALE_HD WHALE_INLINE const float* norm_input_row(const Team& t, index_t r, index_t D, const float* x, float* sum_y,
                                                  const float* sum_bias, const float* sum_add, bool round) noexcept {
  if (!sum_y) return t.stage(0, x + r * D, D);
  float* sr = sum_y + r * D;
  const float* ar = sum_add + r * D;
  float* kept = t.scratch(0, sr);
  t.for_each(D, [&](index_t j) {
    const float v = sum_bias ? stored_as(ar[j] + stored_as(sr[j] + sum_bias[j], round), round)
                             : stored_as(ar[j] + stored_as(sr[j], round), round);
    sr[j] = v;
    kept[j] = v;
  });
  return kept;
}
/// LayerNorm of row r (width D): xhat = (x - mean) rstd, y = xhat gain + bias.
/// x-hat is written where `xhat` is set; the row's mean where `mean` is set
/// (a backward then recomputes x-hat from x, the mean and rstd, to the bit).
struct layer_norm_forward {
  const float* x;
  const float* gain;
  const float* bias;
  float* y;
  float* xhat;  ///< null: not kept
  float* rstd;
  index_t D;
  float eps;
  bool round = false;  ///< store y rounded to bf16 (x-hat and rstd stay fp32)
  float* mean = nullptr;  ///< set: each row's mean, for a backward that recomputes x-hat
  /// A residual's sum to store first (step_ctx::pending_sum): x = sum_add +
  /// (x + sum_bias), each sum stored as `round` says (bias_rows' values),
  /// written into sum_y (which is x) and normalised from the staged row.
  float* sum_y = nullptr;
  const float* sum_bias = nullptr;  ///< null: no bias
  const float* sum_add = nullptr;
  static constexpr int staged_rows = 1;  ///< x, read three times
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* xr = norm_input_row(t, r, D, x, sum_y, sum_bias, sum_add, round);
    float* yr = y + r * D;
    const float mu = t.sum(D, [&](index_t j) { return xr[j]; }) / static_cast<float>(D);
    const float var = t.sum(D, [&](index_t j) {
      const float d = xr[j] - mu;
      return d * d;
    }) / static_cast<float>(D);
    const float s = 1.f / std::sqrt(var + eps);
    if (t.leader()) {
      rstd[r] = s;
      if (mean) mean[r] = mu;
    }
    if (xhat) {
      float* hr = xhat + r * D;
      t.for_each(D, [&](index_t j) {
        const float h = (xr[j] - mu) * s;
        hr[j] = h;
        yr[j] = stored_as(h * gain[j] + bias[j], round);
      });
    } else {
      t.for_each(D, [&](index_t j) { yr[j] = stored_as((xr[j] - mu) * s * gain[j] + bias[j], round); });
    }
  }
  // x (three times unstaged), x-hat (if kept) and y out; with a residual's sum: the product and the
  // addend in, the sum out, then x read from the staged row (three times unstaged)
  std::int64_t bytes(index_t rows) const noexcept {
    const bool staged = stage_fits(staged_rows, D);
    const int x_reads = sum_y ? (staged ? 3 : 6) : (staged ? 1 : 3);
    return rows * ((x_reads + (xhat ? 2 : 1)) * D * 4 + (mean ? 8 : 4)) + (sum_bias ? 4 : 3) * D * 4;
  }
};
/// x-hat of row r, element j, as layer_norm_forward computed it: kept, or from x, the mean and rstd.
WHALE_HD WHALE_INLINE float layer_norm_xhat(const float* hr, const float* xr, float mu, float s, index_t j) noexcept {
  return hr ? hr[j] : (xr[j] - mu) * s;
}
/// d(input) of row r: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gain;
/// x-hat read (`xhat`) or, where it was not kept, recomputed from x and the
/// row's mean and rstd (`x`, `mean`), the forward's values to the bit.
struct layer_norm_backward {
  const float* dy;
  const float* xhat;  ///< null: recomputed from x and mean
  const float* rstd;
  const float* gain;
  float* dx;
  index_t D;
  /// store dx rounded to bf16, and read dy as bf16 would hold it (as gelu_backward)
  bool round = false;
  /// A residual's output gradient (rows of D) added to dx, each stored as
  /// `round` says: dx = add + dx, a residual's sum in the same pass.
  const float* add = nullptr;
  const float* x = nullptr;     ///< the forward's input, where xhat is null
  const float* mean = nullptr;  ///< its rows' means, where xhat is null
  static constexpr int staged_rows = 2;  ///< dy and x-hat (or x), each read three times
  static constexpr int param_sums = 2;   ///< d(gain) and d(bias): dy x-hat and dy (norm_backward_sums)
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    row(t, r, [](index_t, float, float) {});
  }
  /// Row r, and each(j, dy_j as read, x-hat_j) for every element, on the lane
  /// that writes dx_j (layer_norm_backward_sums sums them). dx null: each() only.
  template <class Team, class Each>
  WHALE_HD WHALE_INLINE void row(const Team& t, index_t r, Each each) const noexcept {
    const float* gr = t.stage(0, dy + r * D, D);
    const float* hr = xhat ? t.stage(1, xhat + r * D, D) : nullptr;
    const float* xr = xhat ? nullptr : t.stage(1, x + r * D, D);
    const float mu = xhat ? 0.f : mean[r];
    const float s = rstd[r];
    const auto g = [&](index_t j) { return stored_as(gr[j], round); };
    const auto h = [&](index_t j) { return layer_norm_xhat(hr, xr, mu, s, j); };
    if (!dx) {
      t.for_each(D, [&](index_t j) { each(j, g(j), h(j)); });
      return;
    }
    float* dr = dx + r * D;
    const float m1 = t.sum(D, [&](index_t j) { return g(j) * gain[j]; }) / static_cast<float>(D);
    const float m2 = t.sum(D, [&](index_t j) { return g(j) * gain[j] * h(j); }) / static_cast<float>(D);
    if (add) {
      const float* ar = add + r * D;
      t.for_each(D, [&](index_t j) {
        const float gj = g(j), hj = h(j);
        dr[j] = stored_as(ar[j] + stored_as(s * (gj * gain[j] - m1 - hj * m2), round), round);
        each(j, gj, hj);
      });
    } else {
      t.for_each(D, [&](index_t j) {
        const float gj = g(j), hj = h(j);
        dr[j] = stored_as(s * (gj * gain[j] - m1 - hj * m2), round);
        each(j, gj, hj);
      });
    }
  }
  std::int64_t bytes(index_t rows) const noexcept { return pass_bytes(rows, stage_fits(staged_rows, D)); }
  /// dy and x-hat or x (dy three times, x-hat twice unstaged; once each for the sums only), dx out (and the
  /// addend), the row's statistics, and the gain read by each of d(input)'s three passes.
  std::int64_t pass_bytes(index_t rows, bool staged) const noexcept {
    const int reads = !dx || staged ? 2 : 5;
    return rows * ((reads + (dx ? 1 : 0) + (add ? 1 : 0)) * D * 4 + (xhat ? 4 : 8)) + (dx ? 3 * D * 4 : 0);
  }
};
/// A norm's backward with its parameter gradients in the same pass (Row:
/// layer_norm_backward or rms_norm_backward): one team per tile of
/// kernels::summing_tile rows, which takes its rows in order and adds, per
/// column, dy x-hat (and dy where Row::param_sums is 2: LayerNorm's bias)
/// into the tile's partials, partial[(k A + a) D + c] (column_tile_sums'
/// layout, A = param_sums, so column_tile_finish adds the tiles; each added
/// as column_tile_sums adds). The running sums stay in the team's slots from
/// 2 on, one a sum (shared memory on a GPU; the partials themselves on the CPU).
/// `row.dx` null: the sums only.
template <class Row> struct norm_backward_sums {
  static constexpr int A = Row::param_sums;
  Row row;
  float* partial;
  index_t R;
  static constexpr int staged_rows = 2 + A;  ///< the row's dy and x (or x-hat), and the tile's running sums
  index_t width() const noexcept { return row.D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t k) const noexcept {
    const index_t D = row.D;
    float* p[A];
    float* s[A];
    for (int a = 0; a < A; ++a) p[a] = partial + (A * k + a) * D, s[a] = t.scratch(2 + a, p[a]);
    t.for_each(D, [&](index_t j) {
      for (int a = 0; a < A; ++a) s[a][j] = 0.f;
    });
    const index_t r1 = (k + 1) * summing_tile < R ? (k + 1) * summing_tile : R;
    for (index_t r = k * summing_tile; r < r1; ++r)
      row.row(t, r, [&](index_t j, float g, float h) {
        const float v = g * h;
        s[0][j] = madd(v, 1.f, s[0][j]);
        if constexpr (A > 1) s[1][j] = madd(g, 1.f, s[1][j]);
      });
    if (s[0] != p[0])
      t.for_each(D, [&](index_t j) {
        for (int a = 0; a < A; ++a) p[a][j] = s[a][j];
      });
  }
  // rows(): tiles. Per row as Row's pass (its rows staged where every slot fits), the running sums read and
  // written per row where they are not staged, else each tile's partial rows written once
  std::int64_t bytes(index_t tiles) const noexcept {
    const bool staged = stage_fits(staged_rows, row.D);
    const index_t rows = tiles * summing_tile < R ? tiles * summing_tile : R;
    return row.pass_bytes(rows, staged) + (staged ? tiles * A * row.D * 4 : rows * 2 * A * row.D * 4);
  }
};
using layer_norm_backward_sums = norm_backward_sums<layer_norm_backward>;
/// d(gain) and d(bias): the sums over R rows of dy xhat and of dy, a column
/// reduction; x-hat read, or recomputed from x, the mean and rstd (as layer_norm_backward).
struct layer_norm_param_grads {
  static constexpr int accumulators = 2;
  const float* dy;
  const float* xhat;  ///< null: recomputed from x, mean and rstd
  float* dgain;
  float* dbias;
  index_t R, D;
  bool accumulate;
  bool round = false;  ///< read dy as bf16 would hold it (as layer_norm_backward)
  const float* x = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  index_t rows() const noexcept { return R; }
  index_t cols() const noexcept { return D; }
  WHALE_HD WHALE_INLINE void load(index_t r, index_t c, float* v) const noexcept {
    const float g = stored_as(dy[r * D + c], round);
    v[0] = g * (xhat ? xhat[r * D + c] : (x[r * D + c] - mean[r]) * rstd[r]);
    v[1] = g;
  }
  WHALE_HD WHALE_INLINE void store(index_t c, const float* acc) const noexcept {
    dgain[c] = accumulate ? dgain[c] + acc[0] : acc[0];
    dbias[c] = accumulate ? dbias[c] + acc[1] : acc[1];
  }
};

/// RMSNorm of row r (width D), as Llama's: s = 1 / sqrt(mean(x^2) + eps),
/// xhat = x s, y = gain xhat (HF transformers' LlamaRMSNorm, in fp32).
struct rms_norm_forward {
  const float* x;
  const float* gain;
  float* y;
  float* xhat;
  float* rstd;
  index_t D;
  float eps;
  bool round = false;  ///< store y rounded to bf16 (x-hat and rstd stay fp32)
  /// A residual's sum to store first (as layer_norm_forward: norm_input_row).
  float* sum_y = nullptr;
  const float* sum_bias = nullptr;
  const float* sum_add = nullptr;
  static constexpr int staged_rows = 1;  ///< x, read twice
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* xr = norm_input_row(t, r, D, x, sum_y, sum_bias, sum_add, round);
    float* hr = xhat + r * D;
    float* yr = y + r * D;
    const float ms = t.sum(D, [&](index_t j) { return xr[j] * xr[j]; }) / static_cast<float>(D);
    const float s = 1.f / std::sqrt(ms + eps);
    if (t.leader()) rstd[r] = s;
    t.for_each(D, [&](index_t j) {
      const float h = xr[j] * s;
      hr[j] = h;
      yr[j] = stored_as(gain[j] * h, round);
    });
  }
  // x (twice unstaged), x-hat and y out; with a residual's sum: the product and the addend in, the sum out,
  // then x read from the staged row (twice unstaged)
  std::int64_t bytes(index_t rows) const noexcept {
    const bool staged = stage_fits(staged_rows, D);
    const int x_reads = sum_y ? (staged ? 3 : 5) : (staged ? 1 : 2);
    return rows * ((x_reads + 2) * D * 4 + 4) + (sum_bias ? 3 : 2) * D * 4;
  }
};
/// d(input) of row r: dx = rstd (g - xhat mean(g xhat)), g = dy gain (RMSNorm has no mean to subtract).
struct rms_norm_backward {
  const float* dy;
  const float* xhat;
  const float* rstd;
  const float* gain;
  float* dx;
  index_t D;
  /// store dx rounded to bf16, and read dy as bf16 would hold it (as layer_norm_backward)
  bool round = false;
  /// A residual's output gradient added to dx, each stored as `round` says (as layer_norm_backward).
  const float* add = nullptr;
  static constexpr int staged_rows = 2;  ///< dy and x-hat, each read twice
  static constexpr int param_sums = 1;   ///< d(gain): dy x-hat (norm_backward_sums)
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    row(t, r, [](index_t, float, float) {});
  }
  /// Row r, and each(j, dy_j as read, x-hat_j) for every element, on the lane
  /// that writes dx_j (norm_backward_sums sums them). dx null: each() only.
  template <class Team, class Each>
  WHALE_HD WHALE_INLINE void row(const Team& t, index_t r, Each each) const noexcept {
    const float* gr = t.stage(0, dy + r * D, D);
    const float* hr = t.stage(1, xhat + r * D, D);
    const auto g = [&](index_t j) { return stored_as(gr[j], round); };
    if (!dx) {
      t.for_each(D, [&](index_t j) { each(j, g(j), hr[j]); });
      return;
    }
    float* dr = dx + r * D;
    const float m2 = t.sum(D, [&](index_t j) { return g(j) * gain[j] * hr[j]; }) / static_cast<float>(D);
    const float s = rstd[r];
    if (add) {
      const float* ar = add + r * D;
      t.for_each(D, [&](index_t j) {
        const float gj = g(j);
        dr[j] = stored_as(ar[j] + stored_as(s * (gj * gain[j] - hr[j] * m2), round), round);
        each(j, gj, hr[j]);
      });
    } else {
      t.for_each(D, [&](index_t j) {
        const float gj = g(j);
        dr[j] = stored_as(s * (gj * gain[j] - hr[j] * m2), round);
        each(j, gj, hr[j]);
      });
    }
  }
  std::int64_t bytes(index_t rows) const noexcept { return pass_bytes(rows, stage_fits(staged_rows, D)); }
  /// dy and x-hat (each twice unstaged; once each for the sums only), dx out (and the addend), 1/std, and the
  /// gain read by each of d(input)'s two passes.
  std::int64_t pass_bytes(index_t rows, bool staged) const noexcept {
    const int reads = !dx || staged ? 2 : 4;
    return rows * ((reads + (dx ? 1 : 0) + (add ? 1 : 0)) * D * 4 + 4) + (dx ? 2 * D * 4 : 0);
  }
};
using rms_norm_backward_sums = norm_backward_sums<rms_norm_backward>;
/// d(gain) of RMSNorm: the sums over R rows of dy xhat, a column reduction.
struct rms_norm_param_grads {
  static constexpr int accumulators = 1;
  const float* dy;
  const float* xhat;
  float* dgain;
  index_t R, D;
  bool accumulate;
  bool round = false;  ///< read dy as bf16 would hold it (as rms_norm_backward)
  index_t rows() const noexcept { return R; }
  index_t cols() const noexcept { return D; }
  WHALE_HD WHALE_INLINE void load(index_t r, index_t c, float* v) const noexcept {
    v[0] = stored_as(dy[r * D + c], round) * xhat[r * D + c];
  }
  WHALE_HD WHALE_INLINE void store(index_t c, const float* acc) const noexcept {
    dgain[c] = accumulate ? dgain[c] + acc[0] : acc[0];
  }
};

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

/// dst[r, 0:w] = src[r, 0:w], rows `src_stride` and `dst_stride` floats apart:
/// a block of columns moved between matrices of different widths (the column
/// layouts of a split region: gathering, slicing and packing column blocks).
struct copy_cols {
  const float* src;
  index_t src_stride;
  float* dst;
  index_t dst_stride;
  index_t w;
  index_t width() const noexcept { return w; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* s = src + r * src_stride;
    float* d = dst + r * dst_stride;
    t.for_each(w, [&](index_t c) { d[c] = s[c]; });
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * w * 8; }
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

/// y[r, :] = x[r, :] + pos[r % T, :] (learned positions added to token rows).
struct add_positions {
  const float* x;
  const float* pos;
  float* y;
  index_t T, D;
  bool round = false;  ///< store y rounded to bf16
  index_t width() const noexcept { return D; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* xr = x + r * D;
    const float* pr = pos + (r % T) * D;
    float* yr = y + r * D;
    t.for_each(D, [&](index_t j) { yr[j] = stored_as(xr[j] + pr[j], round); });
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * D * 4 * 3; }
};
/// Scatter-add of R gradient rows into table rows: table[idx(r), c] += dy[r, c],
/// every element adding its rows in row order, without atomics. idx(r) is
/// tokens[r] when tokens is set, else r % T (positions); a table that holds
/// only the `held` rows from `first` (a vocabulary slice; held < 0: all)
/// takes the rows of its tokens, at tokens[r] - first, and skips the rest.
/// As an index body it takes a block of 256 columns over all rows: the CPU's
/// shape. A device runs scatter_add_stripes (below) instead.
struct scatter_add_rows {
  const float* dy;
  const std::int32_t* tokens;
  float* table;
  index_t R, D, T;
  index_t first = 0, held = -1;
  /// The table row of gradient row r, or -1 when this table does not hold it.
  WHALE_HD WHALE_INLINE index_t target(index_t r) const noexcept {
    const index_t row = tokens ? static_cast<index_t>(tokens[r]) - first : r % T;
    return held >= 0 && (row < 0 || row >= held) ? -1 : row;
  }
  WHALE_HD WHALE_INLINE void operator()(index_t blk) const noexcept {
    const index_t c0 = blk * col_block;
    const index_t w = D - c0 < col_block ? D - c0 : col_block;
    for (index_t r = 0; r < R; ++r) {
      const index_t row = target(r);
      if (row < 0) continue;
      float* tr = table + row * D + c0;
      const float* gr = dy + r * D + c0;
      for (index_t c = 0; c < w; ++c) tr[c] += gr[c];
    }
  }
  std::int64_t bytes(index_t) const noexcept { return R * (D * 4 * 3 + 4); }
};
/// The device's shape of scatter_add_rows: one index per (stripe, column),
/// stripe s taking the table rows t with t % stripes == s. Each index walks
/// the R rows in order and adds those of its stripe, so every element adds
/// its rows in the order the CPU's column blocks add them (the same bits),
/// no two indices write one element, and stripes x D threads share the work
/// (a warp: 32 neighbouring columns of one stripe, reading each row's token
/// once and its gradient coalesced). The tokens are read by every stripe.
struct scatter_add_stripes {
  scatter_add_rows rows;
  index_t stripes;
  /// Stripes for width D: enough for about 64 Ki threads, at most 64.
  static constexpr index_t stripes_for(index_t D) noexcept {
    const index_t s = (65536 + D - 1) / (D > 0 ? D : 1);
    return s < 1 ? 1 : (s > 64 ? 64 : s);
  }
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const index_t s = i / rows.D, c = i - s * rows.D;
    for (index_t r = 0; r < rows.R; ++r) {
      const index_t row = rows.target(r);
      if (row < 0 || row % stripes != s) continue;
      rows.table[row * rows.D + c] += rows.dy[r * rows.D + c];
    }
  }
  /// The gradient read once, each table row's update read and written, the tokens once.
  std::int64_t bytes(index_t) const noexcept { return rows.R * (rows.D * 4 * 3 + 4); }
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
  std::int64_t bytes(index_t nb) const noexcept { return (n < nb * block ? n : nb * block) * 4 + nb * 8; }
};

/// out[b] = the sum of x over block b of `block` doubles, in index order: the
/// first of two passes that add up per-row figures (the rows' losses) where
/// they lie, in one order on every backend.
struct sum_blocks {
  static constexpr index_t block = 256;
  const double* x;
  double* out;
  index_t n;
  static constexpr index_t blocks(index_t n) noexcept { return (n + block - 1) / block; }
  WHALE_HD WHALE_INLINE void operator()(index_t b) const noexcept {
    const index_t e = (b + 1) * block < n ? (b + 1) * block : n;
    double s = 0.0;
    for (index_t i = b * block; i < e; ++i) s += x[i];
    out[b] = s;
  }
  std::int64_t bytes(index_t nb) const noexcept { return (n < nb * block ? n : nb * block) * 8 + nb * 8; }
};
/// One index: *out = scale * (the sum of part[0, n) in order), or that added
/// to *out (`add`): the second pass, which leaves a total in device memory
/// for the host to read when it likes (or never).
struct sum_in_order {
  const double* part;
  index_t n;
  double scale;
  double* out;
  bool add;
  WHALE_HD WHALE_INLINE void operator()(index_t) const noexcept {
    double s = 0.0;
    for (index_t i = 0; i < n; ++i) s += part[i];
    s *= scale;
    *out = add ? *out + s : s;
  }
  std::int64_t bytes(index_t) const noexcept { return n * 8 + 16; }
};

}  // namespace whale::kernels
