// `causal_self_attention<D, Heads>`: multi-head self-attention with a causal
// mask, fused QKV projection and output projection, on (B*T, D) rows. No
// dropout, no KV cache, no cross-attention; the head-split form is in strategy/.
#pragma once

#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "whale/backend/kernels/rows.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// y = softmax(mask(Q K^T / sqrt(hd))) V, per sequence and head, then y Wo^T + bo,
/// with [Q K V] = x Wqkv^T + bqkv. Rows are B sequences of T tokens
/// (B = step_ctx::batch, T = step_ctx::seq); a row count other than B*T throws.
/// Parameters, in order: Wqkv (3D, D), bqkv (3D), Wo (D, D), bo (D); element i
/// of that flat block is uniform(-1/sqrt(D), 1/sqrt(D)) from the layer's stream
/// at index i (as linear). Legend: B sequences, T tokens, H heads, hd = D/H.
/// The attention itself is one backend call (backend_ref::attention_forward):
/// it keeps each query's log-sum-exp, and the backward recomputes the
/// probabilities from it; no (B, H, T, T) tensor is kept. Under bf16 on a
/// device that fuses attention (cuDNN's), the forward's bf16 Q, K, V and O
/// (8 D bytes a row) are kept too, so that the backward packs only d(o).

template <index_t D, index_t Heads>
struct causal_self_attention {
  static_assert(D > 0 && Heads > 0,
                "whale::causal_self_attention: D and Heads must be positive");
  static_assert(D % Heads == 0,
                "whale::causal_self_attention: D must be divisible by Heads (each head gets D / "
                "Heads features); choose a head count that divides D");
  static constexpr bool accepts_residual_add = true;  // last in a residual branch: under bf16 the projection's bias pass adds x
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static constexpr index_t heads = Heads;
  static constexpr index_t head_dim = D / Heads;
  static constexpr bool rounds_output = true;  // under bf16 the output projection's bias pass stores y rounded

  static std::string name() {
    return "causal_self_attention<" + std::to_string(D) + ", " + std::to_string(Heads) + ">";
  }
  /// Per token: projections 8 D^2 forward, 16 D^2 backward; Q K^T and P V are
  /// 4 D FLOPs per token of context (seq_flops; backward is twice that, and
  /// its recompute of Q K^T a quarter more; the full T x T scores are
  /// computed, the mask is applied after). The scores and probabilities, H *
  /// T floats per token, exist only inside the attention call: seq_work_bytes,
  /// not kept; the log-sum-exps, H floats per token, are. seq_inner is the
  /// head width, those products' inner size.
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 8.0 * D * D;
    c.bwd_flops = 16.0 * D * D;
    c.params = 4 * D * D + 4 * D;
    c.act_bytes = 4.0 * 10 * D + 4.0 * Heads;  // qkv, heads' output, y, lse; in backward d(att), d(qkv), dx
    c.seq_flops = 4.0 * D;
    c.seq_work_bytes = 4.0 * Heads;
    c.seq_inner = static_cast<double>(D / Heads);
    return c;
  }
  static constexpr index_t param_count() noexcept { return 4 * D * D + 4 * D; }
  /// W_qkv (3D, D), b_qkv, then the output projection W_o (D, D), b_o.
  static constexpr std::array<param_tensor, 4> param_tensors() {
    return {{{"qkv.weight", param_role::weight, 3 * D * D, D, {3 * D, D}},
             {"qkv.bias", param_role::bias, 3 * D, D, {3 * D}},
             {"out.weight", param_role::weight, D * D, D, {D, D}},
             {"out.bias", param_role::bias, D, D, {D}}}};
  }

  void bind(param_binder& b) {
    auto wqkv = b.take({3 * D, D});
    auto bqkv = b.take({3 * D});
    auto wo = b.take({D, D});
    auto bo = b.take({D});
    wqkv_ = wqkv.value;
    dwqkv_ = wqkv.grad;
    bqkv_ = bqkv.value;
    dbqkv_ = bqkv.grad;
    wo_ = wo.value;
    dwo_ = wo.grad;
    bo_ = bo.value;
    dbo_ = bo.grad;
  }
  void init(const counter_rng& r) {
    const double k = 1.0 / std::sqrt(static_cast<double>(D));
    auto fill = [&](view<float> p, index_t base) {
      for (index_t i = 0; i < p.numel(); ++i)
        p[i] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(base + i)) - 1) * k);
    };
    fill(wqkv_, 0);
    fill(bqkv_, 3 * D * D);
    fill(wo_, 3 * D * D + 3 * D);
    fill(bo_, 4 * D * D + 3 * D);
  }

  // x: (B*T, D) -> y: (B*T, D)
  view<float> forward(step_ctx& c, cview<float> x) {
    const index_t B = c.batch, T = c.seq, R = check(c, x.numel());
    auto& s = st_(c.slot);
    s.x = x;
    auto qkv = detail::ensure(s.qkv, {R, 3 * D});        // (B*T, 3D): [Q | K | V], heads side by side
    auto lse = detail::ensure(s.lse, {B, Heads, T});     // (B, H, T) each query's log-sum-exp
    auto att = detail::ensure(s.att, {R, D});            // (B*T, D): heads' outputs side by side
    auto y = detail::ensure(s.y, {R, D});                // (B*T, D)
    // Q, K and V with their bias in one GEMM call where the device can (the attention reads them rounded under bf16)
    c.be.gemm_bias(trans::no, trans::yes, R, 3 * D, D, x.data(), wqkv_.data(), bqkv_.data(), qkv.data());
    c.be.attention_forward(B, T, Heads, hd, qkv.data(), att.data(), lse.data(), c.bf16, packed(c, s, R));
    const float* add = c.bf16 ? detail::take_residual(c.residual_add, R * D) : nullptr;
    detail::affine_forward(c, att.data(), wo_.data(), bo_.data(), y.data(), R, D, D, c.bf16, add);
    return y;
  }

  // dy: (B*T, D) -> dx: (B*T, D); the weight gradients now or, in a split backward, in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) {
    const index_t B = c.batch, T = c.seq, R = check(c, dy.numel());
    auto& s = st_(c.slot);
    auto datt = detail::ensure(s.datt, {R, D});          // (B*T, D)
    auto dqkv = detail::ensure(s.dqkv, {R, 3 * D});      // (B*T, 3D)
    s.dy = dy;
    // output projection, attention core, then (if asked) d(input) through the QKV projection
    c.be.gemm(trans::no, trans::no, R, D, D, 1.f, dy.data(), wo_.data(), 0.f, datt.data());
    c.be.attention_backward(B, T, Heads, hd, s.qkv.data(), s.att.data(), s.lse.data(), datt.data(), dqkv.data(), c.bf16,
                            s.packed.numel() ? s.packed.data() : nullptr);
    if (!defer_weights(c, this)) weight_grads(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, D});
    c.be.gemm(trans::no, trans::no, R, D, 3 * D, 1.f, dqkv.data(), wqkv_.data(), 0.f,
              dx.data());
    return dx;
  }
  /// The projections' weight and bias gradients from slot `slot`'s saved x, dy, att and d(qkv).
  void weight_grads(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    const index_t R = s.dy.numel() / D;
    be.linear_weight_grads(R, D, D, s.dy.data(), s.att.data(), dwo_.data(), dbo_.data(), accumulate);
    be.linear_weight_grads(R, 3 * D, D, s.dqkv.data(), s.x.data(), dwqkv_.data(), dbqkv_.data(), accumulate);
  }

  view<float> qkv_weight() const noexcept { return wqkv_; }
  view<float> out_weight() const noexcept { return wo_; }

 private:
  static constexpr index_t hd = D / Heads;

  static index_t check(const step_ctx& c, index_t n) {
    if (c.batch < 1 || c.seq < 1 || c.batch * c.seq * D != n)
      throw std::invalid_argument(
          "whale::causal_self_attention: " + std::to_string(n) + " inputs are not step_ctx::batch (" +
          std::to_string(c.batch) + ") x seq (" + std::to_string(c.seq) + ") rows of " +
          std::to_string(D) + "; set batch and seq in the step context");
    return c.batch * c.seq;
  }
  struct state {
    cview<float> x, dy;
    tensor<float> qkv, lse, att, y, datt, dqkv, dx;
    tensor<float> packed;  // a fused attention's bf16 Q, K, V and O, kept for the backward (empty otherwise)
  };
  /// The kept buffer of a fused bf16 attention (backend_ref::attention_packed_floats); null where there is none.
  static float* packed(const step_ctx& c, state& s, index_t R) {
    const index_t n = c.be.attention_packed_floats(R, D, c.bf16);
    if (n == 0) {
      s.packed = {};
      return nullptr;
    }
    return detail::ensure(s.packed, {n}).data();
  }
  view<float> wqkv_, dwqkv_, bqkv_, dbqkv_, wo_, dwo_, bo_, dbo_;
  slots<state> st_;
};

}  // namespace whale
