// The two kernel shapes beside the index space (backend/kernel.hpp), as a GPU
// needs them and the CPU replays them: a *row* shape, where a team of lanes
// (one warp, or a block of warps for wide rows) takes one row and reduces
// across its lanes in a fixed tree; and a *column-reduction* shape, where
// sums over rows are taken in tiles of rows, then the tiles are added in
// order. Here: the teams' reduction order, the team the CPU emulates, and the
// index-space bodies of the column shape. The CUDA team is in
// backend/cuda/launch.cuh; no launching and no memory here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "whale/backend/kernels/math.hpp"

namespace whale::kernels {

/// Lanes of a warp: the unit of every team.
inline constexpr int warp_lanes = 32;
/// Rows at least this wide get a team of 8 warps (256 lanes); narrower rows one warp.
inline constexpr index_t wide_row = 4096;
/// Warps of the team that takes a row of `width` elements (1 or 8), the same on every backend.
constexpr int row_warps(index_t width) noexcept { return width >= wide_row ? 8 : 1; }
/// Shared memory a block may give to staged rows: sm_90's opt-in limit per
/// block (227 KiB). A device with less runs the same bodies unstaged.
inline constexpr std::int64_t stage_bytes_max = 232448;
/// Floats from one staged row to the next: the width rounded up to 4 (16-byte aligned).
constexpr index_t stage_stride(index_t width) noexcept { return (width + 3) / 4 * 4; }
/// Shared memory of a block whose teams each stage `slots` rows of `width`:
/// 8 teams of one warp, or one team of 8 warps.
constexpr std::int64_t stage_bytes(int slots, index_t width) noexcept {
  return static_cast<std::int64_t>(slots) * stage_stride(width) * 4 * (row_warps(width) == 1 ? 8 : 1);
}
/// Whether a body that stages `slots` rows of `width` keeps them in shared
/// memory on an H200 (each body declares its bytes by it).
constexpr bool stage_fits(int slots, index_t width) noexcept {
  return slots > 0 && stage_bytes(slots, width) <= stage_bytes_max;
}
/// The rows of width() a row body stages per team (K::staged_rows), or 0.
template <class K> constexpr int staged_rows() noexcept {
  if constexpr (requires { K::staged_rows; }) return K::staged_rows;
  else return 0;
}
/// Rows per tile of the column-reduction shape: each tile's sum is one partial per column.
inline constexpr index_t row_tile = 64;
/// Tiles of `rows` rows.
constexpr index_t row_tiles(index_t rows) noexcept { return (rows + row_tile - 1) / row_tile; }
/// Rows per team of a row pass that also sums its columns (the tiles' partials
/// of a column reduction, e.g. layer_norm_backward_sums): few, so that a
/// team per tile still fills a GPU (8,192 rows: 1,024 teams).
inline constexpr index_t summing_tile = 8;
constexpr index_t summing_tiles(index_t rows) noexcept { return (rows + summing_tile - 1) / summing_tile; }

/// The running maximum and the sum of exp(x - max) of a softmax, taken in one
/// pass (the online softmax): each lane pushes its elements, then lanes combine.
struct max_sum {
  float m, s;
};
/// Add x to the statistics.
WHALE_HD WHALE_INLINE void push(max_sum& st, float x) noexcept;
/// Join two lanes' statistics (commutative, so every lane of a team gets the same bits).
WHALE_HD WHALE_INLINE max_sum join(max_sum a, max_sum b) noexcept;

/// What every team offers a row body, written once on top of the team's
/// reduce(n, init, step, join): step(acc, j) folds element j into one lane's
/// accumulator (lane l takes j = l, l + lanes, ... in order), and join combines
/// lanes in the tree order below. for_each(n, f) calls f(j) for every j, each
/// j on the lane that took it in reduce, so a row read and written in passes
/// needs no barrier between them.
template <class Team> struct team_reductions {
  /// The sum over j < n of f(j).
  template <class F> WHALE_HD WHALE_INLINE float sum(index_t n, F f) const {
    return self().reduce(n, 0.f, [&](float& a, index_t j) { a += f(j); }, [](float a, float b) { return a + b; });
  }
  /// The maximum over j < n of f(j) (-inf when n is 0).
  template <class F> WHALE_HD WHALE_INLINE float max(index_t n, F f) const {
    return self().reduce(
        n, -__builtin_huge_valf(),
        [&](float& a, index_t j) {
          const float v = f(j);
          a = v > a ? v : a;
        },
        [](float a, float b) { return b > a ? b : a; });
  }
  /// The maximum and the sum of exp(f(j) - maximum) over j < n, in one pass.
  template <class F> WHALE_HD WHALE_INLINE max_sum softmax_stats(index_t n, F f) const {
    return self().reduce(
        n, max_sum{-__builtin_huge_valf(), 0.f}, [&](max_sum& a, index_t j) { push(a, f(j)); },
        [](max_sum a, max_sum b) { return join(a, b); });
  }

 private:
  WHALE_HD WHALE_INLINE const Team& self() const { return static_cast<const Team&>(*this); }
};

/// The tree every team reduces in: within each warp, lane i takes lane i + o
/// for o = 16, 8, 4, 2, 1 (a butterfly; lane 0 holds the warp's result); then
/// the warps' results the same way for o = W/2, ..., 1. v holds 32 W values.
template <int W, class S, class Join> WHALE_HD WHALE_INLINE S tree_reduce(S* v, Join join) {
  for (int w = 0; w < W; ++w)
    for (int o = warp_lanes / 2; o > 0; o /= 2)
      for (int i = 0; i < o; ++i) v[w * warp_lanes + i] = join(v[w * warp_lanes + i], v[w * warp_lanes + i + o]);
  for (int o = W / 2; o > 0; o /= 2)
    for (int i = 0; i < o; ++i) v[i * warp_lanes] = join(v[i * warp_lanes], v[(i + o) * warp_lanes]);
  return v[0];
}

/// A team of W warps emulated by one CPU thread: every lane's accumulator in
/// an array, then the tree. It sums in the GPU team's order, so the CPU tests
/// check the order the GPU uses (nvcc may still contract a multiply and an add).
///
/// Staged rows: a body that passes over a row more than once reads it from
/// the team's staging slots (`stage`), which a GPU team keeps in shared
/// memory, and may write a row it reads back into one (`scratch`). Each lane
/// copies and later reads only the elements it takes (j = lane, lane +
/// lanes, ...), so no barrier is needed. The CPU backend's team has no slots
/// (`smem` null): stage gives the row itself and scratch the fallback, the
/// same values; the guarded backend gives it slots, as a GPU does.
template <int W> struct emulated_team : team_reductions<emulated_team<W>> {
  static constexpr int lanes = W * warp_lanes;
  float* smem = nullptr;  ///< staging slots, `stride` floats apart; null: none
  index_t stride = 0;
  /// Row `src` of n floats copied to slot `slot` for the passes that follow, or src itself without slots.
  WHALE_HD WHALE_INLINE const float* stage(int slot, const float* src, index_t n) const {
    if (!smem) return src;
    float* s = smem + slot * stride;
    for (index_t j = 0; j < n; ++j) s[j] = src[j];
    return s;
  }
  /// Slot `slot` as a row to write and read back, or `fallback` without slots.
  WHALE_HD WHALE_INLINE float* scratch(int slot, float* fallback) const { return smem ? smem + slot * stride : fallback; }
  template <class S, class Step, class Join>
  WHALE_HD WHALE_INLINE S reduce(index_t n, S init, Step step, Join join) const {
    S acc[lanes];
    for (int l = 0; l < lanes; ++l) acc[l] = init;
    const index_t full = n / lanes * lanes;
    for (index_t j0 = 0; j0 < full; j0 += lanes)
      for (int l = 0; l < lanes; ++l) step(acc[l], j0 + l);
    for (index_t j = full; j < n; ++j) step(acc[j - full], j);
    return tree_reduce<W>(acc, join);
  }
  template <class F> WHALE_HD WHALE_INLINE void for_each(index_t n, F f) const {
    for (index_t j = 0; j < n; ++j) f(j);
  }
  /// Whether this lane writes the row's scalars (one lane of the team).
  WHALE_HD WHALE_INLINE bool leader() const noexcept { return true; }
  /// A barrier across the team's lanes (nothing to wait for on one thread).
  WHALE_HD WHALE_INLINE void sync() const noexcept {}
};

/// A row body: body(team, r) for each row r, with a team of either size.
template <class K>
concept RowBody = std::is_trivially_copyable_v<K> && requires(const K& k, index_t r) {
  k(emulated_team<1>{}, r);
  k(emulated_team<8>{}, r);
};

/// A column-reduction body over an (R, C) index space: `accumulators` sums per
/// column; load(r, c, v) gives element (r, c)'s `accumulators` values, and
/// store(c, acc) writes column c's sums (adding to what is there, or not,
/// as the body was told).
template <class K>
concept ColumnBody = std::is_trivially_copyable_v<K> && requires(const K& k, index_t i, float* v, const float* cv) {
  { K::accumulators } -> std::convertible_to<int>;
  k.load(i, i, v);
  k.store(i, cv);
};

/// Phase 1 of the column shape, one index per (tile, column): partial[(t A + a) C + c]
/// = the sum over the tile's rows, in row order, of accumulator a of (r, c).
template <ColumnBody K> struct column_tile_sums {
  K body;
  float* partial;
  index_t R, C;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    constexpr int A = K::accumulators;
    const index_t t = i / C, c = i - t * C;
    const index_t r1 = (t + 1) * row_tile < R ? (t + 1) * row_tile : R;
    float acc[A] = {}, v[A];
    for (index_t r = t * row_tile; r < r1; ++r) {
      body.load(r, c, v);
      for (int a = 0; a < A; ++a) acc[a] = madd(v[a], 1.f, acc[a]);  // v + acc: no product left to fuse into it
    }
    for (int a = 0; a < A; ++a) partial[(t * A + a) * C + c] = acc[a];
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 4 * K::accumulators * (row_tile + 1); }
};
/// Phase 2 as a row body: one team of 8 warps per group of
/// `finish_columns` columns (its "row"), which adds the tiles' partials
/// (laid out as column_tile_sums writes them). Lane l takes column l mod 8 of
/// the group and tiles l / 8, l / 8 + 32, ... in order, so each warp reads
/// whole 32-byte sectors; the 32 lanes of a column then leave their sums in a
/// slot, and one lane per column adds them in lane order and stores. 8,192
/// columns' worth of lanes, not one thread a column, keep a GPU busy.
/// `first`: the body's column of column 0 here (the CPU finishes a block of
/// columns at a time).
inline constexpr index_t finish_columns = 8;
template <ColumnBody K> struct column_tile_finish {
  K body;
  const float* partial;
  index_t tiles, C;
  index_t first = 0;
  static constexpr int staged_rows = 1;  ///< the lanes' sums, K::accumulators each
  /// A team of 8 warps (kernels::row_warps), whose slot holds every lane's sums.
  index_t width() const noexcept { return wide_row; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t g) const noexcept {
    constexpr int A = K::accumulators;
    constexpr int per = Team::lanes / static_cast<int>(finish_columns);  // lanes per column
    static_assert(Team::lanes * A <= wide_row, "column_tile_finish: the lanes' sums must fit one slot");
#if defined(__CUDA_ARCH__)
    float* sums = t.scratch(0, nullptr);  // a GPU launch gives every staged body its slots
#else
    float own[Team::lanes * A];  // the slot where a team has none (the CPU backend's)
    float* sums = t.scratch(0, own);
#endif
    const index_t c0 = g * finish_columns;
    t.for_each(Team::lanes, [&](index_t l) {
      const index_t c = c0 + l % finish_columns;
      float acc[A] = {};
      if (c < C)
        for (index_t k = l / finish_columns; k < tiles; k += per)
          for (int a = 0; a < A; ++a) acc[a] += partial[(k * A + a) * C + c];
      for (int a = 0; a < A; ++a) sums[l * A + a] = acc[a];
    });
    t.sync();
    t.for_each(finish_columns, [&](index_t i) {
      if (c0 + i >= C) return;
      float acc[A] = {};
      for (int s = 0; s < per; ++s)
        for (int a = 0; a < A; ++a) acc[a] += sums[(s * finish_columns + i) * A + a];
      body.store(first + c0 + i, acc);
    });
    t.sync();  // the slot is free for the team's next group
  }
  /// Teams for C columns.
  static constexpr index_t groups(index_t C) noexcept { return (C + finish_columns - 1) / finish_columns; }
  // `n` groups: every partial read once, each column's sums stored (read where added to)
  std::int64_t bytes(index_t n) const noexcept {
    const index_t cols = n * finish_columns < C ? n * finish_columns : C;
    return cols * (tiles * 4 * K::accumulators + 8 * K::accumulators);
  }
};

/// The column shape when all rows fit one tile, one index per column: the
/// tile's sum, added to zero as column_tile_finish adds it (the same bits).
template <ColumnBody K> struct column_one_tile {
  K body;
  index_t R;
  WHALE_HD WHALE_INLINE void operator()(index_t c) const noexcept {
    constexpr int A = K::accumulators;
    float tile[A] = {}, acc[A] = {}, v[A];
    for (index_t r = 0; r < R; ++r) {
      body.load(r, c, v);
      for (int a = 0; a < A; ++a) tile[a] = madd(v[a], 1.f, tile[a]);
    }
    for (int a = 0; a < A; ++a) acc[a] += tile[a];
    body.store(c, acc);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 4 * K::accumulators * (R + 2); }
};

namespace detail {
/// The type after "K = " in a compiler's signature text, without whale's namespaces.
inline std::string type_after_k(std::string_view f) {
  const auto at = f.find("K = ");
  if (at == std::string_view::npos) return "kernel";
  f.remove_prefix(at + 4);
  int depth = 0;
  std::size_t end = 0;
  for (; end < f.size(); ++end) {
    if (f[end] == '<') ++depth;
    if (f[end] == '>') --depth;
    if (depth == 0 && (f[end] == ';' || f[end] == ']')) break;
  }
  std::string s(f.substr(0, end));
  for (const std::string_view ns : {"whale::kernels::", "whale::"})
    for (auto p = s.find(ns); p != std::string::npos; p = s.find(ns)) s.erase(p, ns.size());
  return s;
}
}  // namespace detail

/// Whether K is a phase of a column reduction (a GPU's timing sorts by kind).
template <class K> inline constexpr bool is_column_phase = false;
template <ColumnBody B> inline constexpr bool is_column_phase<column_tile_sums<B>> = true;
template <ColumnBody B> inline constexpr bool is_column_phase<column_tile_finish<B>> = true;
template <ColumnBody B> inline constexpr bool is_column_phase<column_one_tile<B>> = true;

/// The name of a kernel body's type without whale's namespaces, for the
/// ledger and error messages: `layer_norm_forward`, `column_tile_sums<column_sums>`.
template <class K> const std::string& kernel_name() {
  static const std::string name = detail::type_after_k(__PRETTY_FUNCTION__);  // "... [with K = whale::kernels::x; ...]"
  return name;
}

// ---- definitions ----

WHALE_HD WHALE_INLINE void push(max_sum& st, float x) noexcept {
  // branch-free (two exponentials), so that a CPU loop over lanes vectorizes
  const float m = x > st.m ? x : st.m;
  st.s = st.s * vexp(st.m - m) + vexp(x - m);
  st.m = m;
}
WHALE_HD WHALE_INLINE max_sum join(max_sum a, max_sum b) noexcept {
  if (b.m > a.m) {
    const max_sum t = a;
    a = b;
    b = t;
  }
  if (b.s == 0.f) return a;  // an empty lane (its maximum may be -inf)
  return {a.m, a.s + b.s * vexp(b.m - a.m)};
}

}  // namespace whale::kernels
