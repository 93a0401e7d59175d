// Elementwise kernel bodies, body(i) over the elements: GELU (tanh form) and
// ReLU forward and backward, the residual sum, scaling, bf16 rounding and packing. One body each,
// run by a CPU loop or a CUDA grid (backend/kernel.hpp); no reductions here.
#pragma once

#include "whale/backend/kernels/math.hpp"

namespace whale::kernels {

inline constexpr float gelu_k0 = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float gelu_k1 = 0.044715f;

/// x rounded to the nearest bfloat16 (ties to even), kept in a float: the
/// emulation of bf16 storage on the CPU and the cast on the GPU. NaN stays NaN;
/// values beyond bf16's range round to infinity as a real cast does.
WHALE_HD WHALE_INLINE float round_bf16(float x) noexcept {
  const std::int32_t b = as_int(x);
  const std::uint32_t u = static_cast<std::uint32_t>(b);
  const std::uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  // inf and NaN pass through (an integer select, so that the loop vectorizes)
  return as_float((b & 0x7f800000) == 0x7f800000 ? b : static_cast<std::int32_t>(r));
}
/// v as bf16 mixed precision stores it (`round`: rounded to bf16), or v:
/// the store of a body that produces a layer's output under bf16, so that no
/// separate rounding pass reads and writes the tensor again.
WHALE_HD WHALE_INLINE float stored_as(float v, bool round) noexcept { return round ? round_bf16(v) : v; }

/// y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
struct gelu_forward {
  const float* x;
  float* y;
  /// read x as bf16 would hold it and store y rounded to bf16 (stored_as; a
  /// stored x is unchanged, a GEMM's output left unrounded is rounded here)
  bool round = false;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float v = stored_as(x[i], round);
    const float t = vtanh(gelu_k0 * (v + gelu_k1 * v * v * v));
    y[i] = stored_as(0.5f * v * (1.f + t), round);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 8; }
};
/// dx = dy * GELU'(x), the tanh recomputed from x.
struct gelu_backward {
  const float* x;
  const float* dy;
  float* dx;
  /// store dx rounded to bf16 (stored_as), and read dy and x as bf16 would
  /// hold them (rounding a stored value again changes nothing; a GEMM's
  /// result left unrounded is rounded here instead of by a pass before)
  bool round = false;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float v = stored_as(x[i], round);
    const float v2 = v * v;
    const float t = vtanh(gelu_k0 * (v + gelu_k1 * v2 * v));
    const float du = gelu_k0 * (1.f + 3.f * gelu_k1 * v2);  // d(inner)/dx
    dx[i] = stored_as(stored_as(dy[i], round) * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du), round);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};

/// sigmoid(v) = 1 / (1 + e^{-v}); saturates without overflow (vexp's clamps).
WHALE_HD WHALE_INLINE float vsigmoid(float v) noexcept { return 1.f / (1.f + vexp(-v)); }

/// SwiGLU's gate (Llama's MLP): h = SiLU(g) u, with SiLU(g) = g sigmoid(g),
/// over rows of width H whose gate and up values lie side by side in `gu`
/// (rows of 2H: g in columns [0, H), u in [H, 2H), one GEMM's output). Under
/// bf16 (`round`) g and u are read as bf16 stores them and h is stored rounded.
struct swiglu_forward {
  const float* gu;
  float* h;
  index_t H;
  bool round = false;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const index_t r = i / H, c = i - r * H;
    const float g = stored_as(gu[2 * r * H + c], round), u = stored_as(gu[2 * r * H + H + c], round);
    h[i] = stored_as(g * vsigmoid(g) * u, round);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};
/// SwiGLU's backward: dg = dh u SiLU'(g), du = dh SiLU(g), with SiLU'(g) =
/// s (1 + g (1 - s)), s = sigmoid(g); written side by side into `dgu` as the
/// forward read them. Under bf16 dh (a GEMM's d(input)), g and u are read as
/// bf16 holds them, and dg, du are stored rounded.
struct swiglu_backward {
  const float* gu;
  const float* dh;
  float* dgu;
  index_t H;
  bool round = false;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const index_t r = i / H, c = i - r * H;
    const float g = stored_as(gu[2 * r * H + c], round), u = stored_as(gu[2 * r * H + H + c], round);
    const float d = stored_as(dh[i], round), s = vsigmoid(g);
    dgu[2 * r * H + c] = stored_as(d * u * (s * (1.f + g * (1.f - s))), round);
    dgu[2 * r * H + H + c] = stored_as(d * (g * s), round);
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 20; }
};

/// y = max(x, 0)
struct relu_forward {
  const float* x;
  float* y;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { y[i] = x[i] > 0.f ? x[i] : 0.f; }
  std::int64_t bytes(index_t n) const noexcept { return n * 8; }
};
/// dx = dy where the output was positive, else 0 (from the saved output y).
struct relu_backward {
  const float* y;
  const float* dy;
  float* dx;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { dx[i] = y[i] > 0.f ? dy[i] : 0.f; }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};

/// out = a + b (the residual sum, forward and backward).
struct add {
  const float* a;
  const float* b;
  float* out;
  bool round = false;  ///< store out rounded to bf16 (stored_as)
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { out[i] = stored_as(a[i] + b[i], round); }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};

/// x *= k (gradient clipping and scaling).
struct scale {
  float* x;
  float k;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { x[i] *= k; }
  std::int64_t bytes(index_t n) const noexcept { return n * 8; }
};

/// out = (a - b) * k: a virtual worker's update over a wave (its weights less
/// their snapshot), weighed by its share of the global batch (train/wsp_trainer.hpp).
struct scaled_difference {
  const float* a;
  const float* b;
  float* out;
  float k;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { out[i] = (a[i] - b[i]) * k; }
  std::int64_t bytes(index_t n) const noexcept { return n * 12; }
};

/// A tie's gradients (runtime/tie.hpp): a[i] = b[i] = a[i] + b[i] (table, then head).
struct tie_sum {
  float* a;
  float* b;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept {
    const float s = a[i] + b[i];
    a[i] = s;
    b[i] = s;
  }
  std::int64_t bytes(index_t n) const noexcept { return n * 16; }
};

/// The bits of x rounded to bf16 (what a cast to bfloat16 stores), and back.
/// A NaN stays a NaN (quieted: its payload may lie only in the bits dropped).
WHALE_HD WHALE_INLINE std::uint16_t bf16_bits(float x) noexcept {
  const auto u = static_cast<std::uint32_t>(as_int(round_bf16(x)));
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>((u >> 16) | (nan ? 0x0040u : 0u));
}
WHALE_HD WHALE_INLINE float from_bf16_bits(std::uint16_t b) noexcept {
  return as_float(static_cast<std::int32_t>(static_cast<std::uint32_t>(b) << 16));
}
/// out[i] = the bf16 bits of x[i] (a gradient bucket packed to travel in bf16).
struct pack_bf16 {
  const float* x;
  std::uint16_t* out;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { out[i] = bf16_bits(x[i]); }
  std::int64_t bytes(index_t n) const noexcept { return n * 6; }
};
/// out[i] = the float of bf16 bits in[i] (the summed bucket unpacked).
struct unpack_bf16 {
  const std::uint16_t* in;
  float* out;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { out[i] = from_bf16_bits(in[i]); }
  std::int64_t bytes(index_t n) const noexcept { return n * 6; }
};

/// out[i] += the float of bf16 bits in[i] (a summed piece added to accumulated gradients).
struct unpack_add_bf16 {
  const std::uint16_t* in;
  float* out;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { out[i] += from_bf16_bits(in[i]); }
  std::int64_t bytes(index_t n) const noexcept { return n * 10; }
};

/// y[i] = x[i], stored as `round` says (a copy that rounds to bf16).
struct copy_stored {
  const float* x;
  float* y;
  bool round = false;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { y[i] = stored_as(x[i], round); }
  std::int64_t bytes(index_t n) const noexcept { return n * 8; }
};

/// x[i] = round_bf16(x[i]) in place.
struct to_bf16 {
  float* x;
  WHALE_HD WHALE_INLINE void operator()(index_t i) const noexcept { x[i] = round_bf16(x[i]); }
  std::int64_t bytes(index_t n) const noexcept { return n * 8; }
};

}  // namespace whale::kernels
