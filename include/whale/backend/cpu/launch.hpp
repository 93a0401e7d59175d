// The CPU execution space: a kernel body run by a plain loop over its index
// space, on the calling thread; a row body by the same loop over rows, each
// row taken by an emulated team (the GPU's reduction order); a column body
// by blocks of columns, summing the GPU's row tiles in the GPU's order. The body is inlined into the loop, so that it
// vectorizes as a hand-written loop would; on x86-64 built for the baseline
// ISA, the loop is compiled three times (baseline, AVX2+FMA, AVX-512) and the
// widest the processor has is chosen once at run time, as PyTorch's CPU
// kernels do. Not threaded: one rank per core.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/kernel.hpp"
#include "whale/backend/kernels/shapes.hpp"
#include "whale/detail/environment.hpp"

// Dispatch only where it can help: GCC or Clang, x86-64, and not already
// compiled for AVX-512 (-march=native on such a machine makes it moot).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX512F__) && !defined(__CUDA_ARCH__) && \
    !defined(WHALE_NO_ISA_DISPATCH)
#define WHALE_ISA_DISPATCH 1
#else
#define WHALE_ISA_DISPATCH 0
#endif

namespace whale::cpu {

/// The instruction sets the CPU kernels' loops are compiled for.
enum class isa : int { baseline = 0, avx2 = 1, avx512 = 2 };

inline const char* isa_name(isa i) noexcept {
  switch (i) {
    case isa::avx2: return "avx2";
    case isa::avx512: return "avx512";
    default: return "baseline";
  }
}

namespace detail {
/// What this processor runs, capped by WHALE_CPU_ISA (baseline, avx2, avx512)
/// when set: a way to compare the paths, or to pin one across unequal hosts.
inline isa detect_isa() {
  isa best = isa::baseline;
#if WHALE_ISA_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = isa::avx2;
  if (best == isa::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    best = isa::avx512;
#endif
  if (const char* e = env::text("WHALE_CPU_ISA")) {
    const std::string v = e;
    isa want;
    if (v == "baseline") want = isa::baseline;
    else if (v == "avx2") want = isa::avx2;
    else if (v == "avx512") want = isa::avx512;
    else
      throw std::invalid_argument("WHALE_CPU_ISA='" + v + "': expected baseline, avx2 or avx512");
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

/// A body's flag `round` (store rounded to bf16: kernels::stored_as), found
/// through the runners that wrap it (their member `body`). The loops below
/// set it on their own copy of the body, as a constant of the loop, so that
/// each of the two loops is free of the branch and vectorizes.
template <class K> constexpr bool has_round_flag() {
  if constexpr (requires(K k) { k.round = true; }) return true;
  else if constexpr (requires { sizeof(decltype(K::body)); }) return has_round_flag<decltype(K::body)>();
  else return false;
}
template <class K> WHALE_INLINE bool& round_flag(K& k) {
  if constexpr (requires { k.round = true; }) return k.round;
  else return round_flag(k.body);
}
/// The loop's own copy of `body`, its flag fixed to R (R < 0: no flag).
template <int R, class K> WHALE_INLINE K fixed(const K& body) {
  K k = body;
  if constexpr (R >= 0) round_flag(k) = R != 0;
  return k;
}

#if WHALE_ISA_DISPATCH
template <int R, class K> [[gnu::target("avx2,fma"), gnu::flatten]] void launch_avx2(index_t n, const K body) {
  const K k = fixed<R>(body);
  for (index_t i = 0; i < n; ++i) k(i);
}
template <int R, class K>
[[gnu::target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"), gnu::flatten]] void launch_avx512(index_t n, const K body) {
  const K k = fixed<R>(body);
  for (index_t i = 0; i < n; ++i) k(i);
}
#endif

/// body(i) for i in [0, n), the flag (if any) fixed to R. Not inline, so that
/// the compiled core can hold the library's own loops (cpu/instances.hpp).
template <int R, class K> void launch_loop(index_t n, const K& body);
}  // namespace detail

/// The instruction set the kernels run with in this process (detected once).
inline isa active_isa() {
  static const isa i = detail::detect_isa();
  return i;
}

template <int R, class K> void detail::launch_loop(index_t n, const K& body) {
#if WHALE_ISA_DISPATCH
  switch (active_isa()) {
    case isa::avx512: return detail::launch_avx512<R>(n, body);
    case isa::avx2: return detail::launch_avx2<R>(n, body);
    default: break;
  }
#endif
  const K k = fixed<R>(body);  // a local copy: its pointers are known not to change inside the loop
  for (index_t i = 0; i < n; ++i) k(i);
}

/// body(i) for i in [0, n), in order, with the widest vectors this CPU has.
/// A body with a `round` flag runs one of two loops, each with the flag fixed.
template <kernels::KernelBody K>
inline void launch(index_t n, const K& body) {
  if constexpr (detail::has_round_flag<K>()) {
    K probe = body;
    if (detail::round_flag(probe)) return detail::launch_loop<1>(n, body);
    return detail::launch_loop<0>(n, body);
  } else {
    return detail::launch_loop<-1>(n, body);
  }
}

namespace detail {
/// A row body as an index body: row i with an emulated team of W warps.
template <int W, class K> struct row_runner {
  K body;
  WHALE_INLINE void operator()(index_t i) const noexcept { body(kernels::emulated_team<W>{}, i); }
};
/// The same with the team's staging slots (one buffer for every row: the rows run in order).
template <int W, class K> struct staged_row_runner {
  K body;
  float* smem;
  index_t stride;
  WHALE_INLINE void operator()(index_t i) const noexcept { body(kernels::emulated_team<W>{{}, smem, stride}, i); }
};
/// A column body as an index body over blocks of 256 columns: for each block,
/// the row tiles' sums (rows in order within a tile), as
/// kernels::column_tile_sums writes them, then each column's tiles added by
/// kernels::column_tile_finish with an emulated team: the sums a device adds,
/// in its order.
template <class K> struct column_runner {
  static constexpr index_t cols_per_block = 256;
  K body;
  index_t R, C;
  WHALE_INLINE void operator()(index_t blk) const {
    constexpr int A = K::accumulators;
    const index_t c0 = blk * cols_per_block;
    const index_t w = C - c0 < cols_per_block ? C - c0 : cols_per_block;
    const index_t tiles = kernels::row_tiles(R);
    thread_local std::vector<float> partial;  // (tiles, A, w), as column_tile_sums lays out (tiles, A, C)
    partial.assign(static_cast<std::size_t>(tiles * A * w), 0.f);
    float v[A];
    for (index_t t = 0; t < tiles; ++t) {
      float* pt = partial.data() + t * A * w;
      const index_t r1 = (t + 1) * kernels::row_tile < R ? (t + 1) * kernels::row_tile : R;
      for (index_t r = t * kernels::row_tile; r < r1; ++r)
        for (index_t c = 0; c < w; ++c) {
          body.load(r, c0 + c, v);
          for (int a = 0; a < A; ++a) pt[a * w + c] = kernels::madd(v[a], 1.f, pt[a * w + c]);  // as column_tile_sums adds
        }
    }
    const kernels::column_tile_finish<K> finish{body, partial.data(), tiles, w, c0};
    for (index_t g = 0; g < finish.groups(w); ++g) finish(kernels::emulated_team<8>{}, g);
  }
};
}  // namespace detail

/// body(team, r) for each of `rows` rows, in order, each row by an emulated
/// team of kernels::row_warps(body.width()) warps.
template <kernels::RowBody K>
inline void launch(index_t rows, const K& body) {
  if (kernels::row_warps(body.width()) == 1) return launch(rows, detail::row_runner<1, K>{body});
  launch(rows, detail::row_runner<8, K>{body});
}

/// The same rows as a GPU team runs them (the guarded backend): a body that
/// stages rows (kernels::staged_rows) gets staging slots where an H200's
/// shared memory holds them (kernels::stage_fits), so the device's path,
/// slots included, runs here. The same values as launch().
template <kernels::RowBody K>
inline void launch_staged(index_t rows, const K& body) {
  constexpr int slots = kernels::staged_rows<K>();
  if (slots == 0 || !kernels::stage_fits(slots, body.width())) return launch(rows, body);
  const index_t stride = kernels::stage_stride(body.width());
  std::vector<float> smem(static_cast<std::size_t>(slots * stride));
  // through launch() as the unstaged rows go, so that the same instruction set's loop (and its
  // contractions of a multiply and an add) runs them: the same bits
  if (kernels::row_warps(body.width()) == 1)
    return launch(rows, detail::staged_row_runner<1, K>{body, smem.data(), stride});
  launch(rows, detail::staged_row_runner<8, K>{body, smem.data(), stride});
}

/// A column reduction over body.rows() x body.cols(): each column's sums stored once.
template <kernels::ColumnBody K>
inline void reduce_columns(const K& body) {
  const index_t C = body.cols();
  launch((C + detail::column_runner<K>::cols_per_block - 1) / detail::column_runner<K>::cols_per_block,
         detail::column_runner<K>{body, body.rows(), C});
}

}  // namespace whale::cpu
