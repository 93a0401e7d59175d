// Kernel bodies of causal attention as one backend call (backend_ref::
// attention_forward / attention_backward): the head-major layout the batched
// products need, and the softmax rows that keep each query's log-sum-exp so
// that the backward recomputes the probabilities instead of keeping them.
#pragma once

#include <cmath>
#include <cstdint>

#include "whale/backend/kernels/math.hpp"
#include "whale/backend/kernels/shapes.hpp"

namespace whale::kernels {

/// The two layouts of `parts` matrices of H heads of width hd over B sequences
/// of T tokens: token-major, (B*T, parts*W) with W = H*hd, the heads side by
/// side in each part (a QKV projection's output is 3 parts: Q, K, V); and
/// head-major, (parts, B, H, T, hd), every (part, sequence, head) one
/// contiguous (T, hd) matrix, so one strided-batched product covers them all.
struct head_layout {
  index_t B, T, H, hd, parts;
  WHALE_HD WHALE_INLINE index_t elements() const noexcept { return parts * B * T * H * hd; }
  /// The token-major index of head-major element i.
  WHALE_HD WHALE_INLINE index_t token_major(index_t i) const noexcept {
    const index_t d = i % hd, t = (i / hd) % T, h = (i / (hd * T)) % H, b = (i / (hd * T * H)) % B;
    const index_t p = i / (hd * T * H * B);
    return (b * T + t) * parts * H * hd + p * H * hd + h * hd + d;
  }
};

/// Token-major to head-major, one row body per head-row: row r is the hd
/// floats of head-major element r * hd, copied from where token_major puts
/// them (one index computation a row, a contiguous copy of hd floats).
struct split_heads {
  const float* x;
  float* y;
  head_layout l;
  index_t width() const noexcept { return l.hd; }
  index_t rows() const noexcept { return l.elements() / l.hd; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* src = x + l.token_major(r * l.hd);
    float* dst = y + r * l.hd;
    t.for_each(l.hd, [&](index_t d) { dst[d] = src[d]; });
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * l.hd * 8; }
};
/// Head-major back to token-major, a head-row per row body: the inverse copy.
struct merge_heads {
  const float* x;
  float* y;
  head_layout l;
  index_t width() const noexcept { return l.hd; }
  index_t rows() const noexcept { return l.elements() / l.hd; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t r) const noexcept {
    const float* src = x + r * l.hd;
    float* dst = y + l.token_major(r * l.hd);
    t.for_each(l.hd, [&](index_t d) { dst[d] = src[d]; });
  }
  std::int64_t bytes(index_t rows) const noexcept { return rows * l.hd * 8; }
};

/// Sum over `rows` score rows of T of the columns the causal mask leaves
/// visible (row r sees r % T + 1): what the softmax rows read and write.
WHALE_HD WHALE_INLINE std::int64_t causal_visible(index_t rows, index_t T) noexcept {
  const std::int64_t full = rows / T, rest = rows % T;
  return full * T * (T + 1) / 2 + rest * (rest + 1) / 2;
}

/// Causal softmax of the scaled scores in place: row `row` of T holds query
/// i = row % T against every key; columns 0..i become probabilities and the
/// rest 0. Three passes over the visible columns and one exponential per
/// element (each lane rereads what it wrote): the scores are short rows,
/// where the exponentials cost more than the reads. With `lse`, each row's
/// log-sum-exp m + log(sum exp(s - m)) is kept there, from which the backward
/// recomputes the row (causal_softmax_backward).
struct causal_softmax_forward {
  float* p;
  index_t T;
  float* lse = nullptr;
  index_t width() const noexcept { return T; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t row) const noexcept {
    float* pr = p + row * T;
    const index_t n = row % T + 1;
    const float m = t.max(n, [&](index_t j) { return pr[j]; });
    const float sum = t.sum(n, [&](index_t j) {
      const float e = vexp(pr[j] - m);
      pr[j] = e;
      return e;
    });
    if (lse != nullptr && t.leader()) lse[row] = m + std::log(sum);
    const float inv = 1.f / sum;
    t.for_each(T, [&](index_t j) { pr[j] = j < n ? pr[j] * inv : 0.f; });
  }
  /// the maximum reads, the exponentials read and write, the scaling reads the visible and writes every column
  std::int64_t bytes(index_t rows) const noexcept {
    return 4 * (4 * causal_visible(rows, T) + static_cast<std::int64_t>(rows) * T) + (lse != nullptr ? rows * 4 : 0);
  }
};
/// The backward of a causal softmax row from its recomputed scores s and the
/// forward's log-sum-exp, with dP in d: P = exp(s - lse) is written over s
/// and dS = P (dP - <dP, P>) over d, on columns 0..i of row `row`; both get 0
/// past them (the products after it read whole rows).
struct causal_softmax_backward {
  float* s;
  float* d;
  const float* lse;
  index_t T;
  index_t width() const noexcept { return T; }
  template <class Team> WHALE_HD WHALE_INLINE void operator()(const Team& t, index_t row) const noexcept {
    float* sr = s + row * T;
    float* dr = d + row * T;
    const index_t n = row % T + 1;
    const float l = lse[row];
    const float dot = t.sum(n, [&](index_t j) {
      const float p = vexp(sr[j] - l);
      sr[j] = p;
      return p * dr[j];
    });
    t.for_each(T, [&](index_t j) {
      if (j < n) {
        dr[j] = sr[j] * (dr[j] - dot);
      } else {
        sr[j] = 0.f;
        dr[j] = 0.f;
      }
    });
  }
  /// s read and written and d read over the visible columns; then s and d
  /// read and d written there, and both written past them
  std::int64_t bytes(index_t rows) const noexcept {
    return 4 * (4 * causal_visible(rows, T) + 2 * static_cast<std::int64_t>(rows) * T) + rows * 4;
  }
};

/// Rotary position embeddings (RoPE) in place, in transformers' `rotate_half`
/// convention: in each of the first `heads` heads of width hd of a row (the
/// query heads, then the key heads, of a token-major QKV row of `stride`
/// floats), element j < hd/2 pairs with j + hd/2 and the pair turns by the
/// angle t theta_j of the row's position t = row % T:
///   x_j' = x_j cos - x_{j+hd/2} sin,   x_{j+hd/2}' = x_{j+hd/2} cos + x_j sin.
/// `cs` holds cos then sin, each (T, hd/2) (rotary_table). `inverse` turns
/// by minus the angle: the backward, as the rotation's transpose is its inverse.
/// One index per (row, head, pair).
struct rotary_rows {
  float* x;
  const float* cs;
  index_t stride, heads, hd, T;
  bool inverse = false;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const index_t half = hd / 2, j = i % half, rh = i / half, h = rh % heads, r = rh / heads, t = r % T;
    float* p = x + r * stride + h * hd;
    const float c = cs[t * half + j], sn = inverse ? -cs[T * half + t * half + j] : cs[T * half + t * half + j];
    const float a = p[j], b = p[j + half];
    p[j] = a * c - b * sn;
    p[j + half] = b * c + a * sn;
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 24; }
};

/// The cos and sin of rotary_rows for positions 0..T-1 and a head width hd,
/// as transformers' LlamaRotaryEmbedding forms them in float: inv_j =
/// 1 / theta^(2j / hd), the angle t inv_j, then its cos and sin (here in
/// double, rounded once). `out` holds 2 T (hd/2) floats.
inline void rotary_table(float* out, index_t T, index_t hd, float theta) {
  const index_t half = hd / 2;
  for (index_t j = 0; j < half; ++j) {
    const float e = static_cast<float>(2 * j) / static_cast<float>(hd);
    const float inv = 1.f / std::pow(theta, e);
    for (index_t t = 0; t < T; ++t) {
      const float a = static_cast<float>(t) * inv;
      out[t * half + j] = static_cast<float>(std::cos(static_cast<double>(a)));
      out[T * half + t * half + j] = static_cast<float>(std::sin(static_cast<double>(a)));
    }
  }
}

/// Grouped-query attention's keys and values repeated for every query head:
/// from rows of [Q (H heads) | K (KV heads) | V (KV heads)] to rows of
/// [Q | K | V] of H heads each, query head h reading KV head h / (H / KV)
/// (transformers' repeat_kv). One index per output float.
struct repeat_kv {
  const float* src;
  float* dst;
  index_t H, KV, hd;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const index_t W = H * hd, in_w = (H + 2 * KV) * hd, row = i / (3 * W), j = i - row * 3 * W;
    const float* s = src + row * in_w;
    if (j < W) {
      dst[i] = s[j];
      return;
    }
    const index_t part = (j - W) / W, jj = j - W - part * W, h = jj / hd, e = jj - h * hd;
    dst[i] = s[W + part * KV * hd + (h / (H / KV)) * hd + e];
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 8; }
};
/// The backward of repeat_kv: each KV head's gradient is the sum, in order,
/// over the H / KV query heads that read it; the queries' is copied.
struct sum_kv_groups {
  const float* src;
  float* dst;
  index_t H, KV, hd;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const index_t W = H * hd, out_w = (H + 2 * KV) * hd, row = i / out_w, j = i - row * out_w;
    const float* s = src + row * 3 * W;
    if (j < W) {
      dst[i] = s[j];
      return;
    }
    const index_t part = (j - W) / (KV * hd), jj = j - W - part * KV * hd, kv = jj / hd, e = jj - kv * hd, g = H / KV;
    float acc = 0.f;
    for (index_t k = 0; k < g; ++k) acc += s[W + part * W + (kv * g + k) * hd + e];
    dst[i] = acc;
  }
  /// each row's 3 H hd floats read, its (H + 2 KV) hd written
  std::int64_t bytes(index_t n) const noexcept { return n * 4 + n / ((H + 2 * KV) * hd) * 3 * H * hd * 4; }
};

}  // namespace whale::kernels
