// Row kernel bodies of the norms, body(team, r) (backend/kernels/shapes.hpp):
// LayerNorm and RMSNorm forward (each optionally storing a residual's pending
// sum first) and backward, and the column sums of their gain and bias
// gradients. Included by backend/kernels/rows.hpp.
#pragma once

#include <cmath>
#include <cstdint>

#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/math.hpp"
#include "whale/backend/kernels/shapes.hpp"

namespace whale::kernels {


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

}  // namespace whale::kernels
