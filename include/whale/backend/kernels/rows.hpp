// Row and column kernel bodies over a (R, C) matrix. Row bodies,
// body(team, r) (backend/kernels/shapes.hpp): a team of lanes takes row r,
// reduces across lanes in a fixed tree and writes the row in strided passes
// -- bias rows, embedding lookups, column blocks, position sums. Column
// bodies, load/store (the column-reduction shape): the sums over rows of bias
// gradients and of position gradients. The embedding's scatter-add by token
// is still one index per block of columns (below). The norms' rows are in
// kernels/norms.hpp, the losses' in kernels/losses.hpp (both included here),
// attention's in kernels/attention.hpp.
#pragma once

#include <cmath>
#include <cstdint>

#include "whale/backend/kernels/attention.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/losses.hpp"
#include "whale/backend/kernels/math.hpp"
#include "whale/backend/kernels/norms.hpp"
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
