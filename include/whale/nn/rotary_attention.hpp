// `rotary_attention<D, Heads, KVHeads, Theta>`: causal self-attention as
// Llama, Mistral and Qwen have it (transformers' LlamaAttention): rotary
// position embeddings on queries and keys, grouped-query attention (KVHeads
// key and value heads, each shared by Heads / KVHeads query heads), and
// projections without bias. No KV cache, no rope scaling, no sliding window.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "whale/backend/kernels/attention.hpp"
#include "whale/fwd.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

namespace detail {
/// What the whole and the head-split rotary attention share: the arithmetic
/// on `h_` query heads and `kv_` key/value heads of width hd (all of them, or
/// one rank's group). W_qkv is ((h + 2 kv) hd, D): the query rows, then the
/// key rows, then the value rows, so one GEMM gives rows of [Q | K | V]; W_o
/// is (D, h hd).
template <index_t D, index_t hd> class rotary_attention_body {
 protected:
  rotary_attention_body(index_t h, index_t kv, float theta) : h_(h), kv_(kv), theta_(theta) {}
  index_t qkv_width() const { return (h_ + 2 * kv_) * hd; }
  index_t param_count_() const { return qkv_width() * D + D * h_ * hd; }
  void bind_(param_binder& b) {
    auto qkv = b.take({qkv_width(), D});
    auto o = b.take({D, h_ * hd});
    wqkv_ = qkv.value, dwqkv_ = qkv.grad, wo_ = o.value, dwo_ = o.grad;
  }
  static index_t check(const step_ctx& c, index_t n, const char* layer) {
    if (c.batch < 1 || c.seq < 1 || c.batch * c.seq * D != n)
      throw std::invalid_argument(std::string("whale::") + layer + ": " + std::to_string(n) +
                                  " inputs are not step_ctx::batch (" + std::to_string(c.batch) + ") x seq (" +
                                  std::to_string(c.seq) + ") rows of " + std::to_string(D) +
                                  "; set batch and seq in the step context");
    return c.batch * c.seq;
  }
  /// x (B*T, D) -> y (B*T, D). `whole`: the unsplit layer, whose output under
  /// bf16 is stored rounded by the pass that adds a residual's input; a split
  /// rank's output is a partial sum, left as it is.
  view<float> forward_(step_ctx& c, cview<float> x, bool whole, const char* layer) {
    const index_t B = c.batch, T = c.seq, R = check(c, x.numel(), layer);
    const index_t W = h_ * hd;
    auto& s = st_(c.slot);
    s.x = x;
    auto qkv = detail::ensure(s.qkv, {R, qkv_width()});
    auto lse = detail::ensure(s.lse, {B, h_, T});
    auto att = detail::ensure(s.att, {R, W});
    auto y = detail::ensure(s.y, {R, D});
    c.be.gemm(trans::no, trans::yes, R, qkv_width(), D, 1.f, x.data(), wqkv_.data(), 0.f, qkv.data());
    c.be.launch(R * (h_ + kv_) * (hd / 2),
                kernels::rotary_rows{qkv.data(), table(c.be, T), qkv_width(), h_ + kv_, hd, T, false});
    const float* full = qkv.data();
    if (kv_ != h_) {  // every query head's keys and values side by side, for the attention call
      auto f = detail::ensure(s.full, {R, 3 * W});
      c.be.launch(R * 3 * W, kernels::repeat_kv{qkv.data(), f.data(), h_, kv_, hd});
      full = f.data();
    }
    c.be.attention_forward(B, T, h_, hd, full, att.data(), lse.data(), c.bf16, packed(c, s, R));
    if (whole) {
      const float* add = c.bf16 ? detail::take_residual(c.residual_add, R * D) : nullptr;
      detail::affine_forward(c, att.data(), wo_.data(), nullptr, y.data(), R, D, W, c.bf16, add);
    } else {
      c.be.gemm(trans::no, trans::yes, R, D, W, 1.f, att.data(), wo_.data(), 0.f, y.data());
    }
    return y;
  }
  template <class L> view<float> backward_(step_ctx& c, cview<float> dy, L* self, const char* layer) {
    const index_t B = c.batch, T = c.seq, R = check(c, dy.numel(), layer);
    const index_t W = h_ * hd;
    auto& s = st_(c.slot);
    s.dy = dy;
    auto datt = detail::ensure(s.datt, {R, W});
    auto dqkv = detail::ensure(s.dqkv, {R, qkv_width()});
    c.be.gemm(trans::no, trans::no, R, W, D, 1.f, dy.data(), wo_.data(), 0.f, datt.data());
    const bool grouped = kv_ != h_;
    const float* full = grouped ? s.full.data() : s.qkv.data();
    float* dfull = grouped ? detail::ensure(s.dfull, {R, 3 * W}).data() : dqkv.data();
    c.be.attention_backward(B, T, h_, hd, full, s.att.data(), s.lse.data(), datt.data(), dfull, c.bf16,
                            s.packed.numel() ? s.packed.data() : nullptr);
    if (grouped) c.be.launch(R * qkv_width(), kernels::sum_kv_groups{dfull, dqkv.data(), h_, kv_, hd});
    c.be.launch(R * (h_ + kv_) * (hd / 2),
                kernels::rotary_rows{dqkv.data(), table(c.be, T), qkv_width(), h_ + kv_, hd, T, true});
    if (!defer_weights(c, self)) weight_grads_(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, D});
    c.be.gemm(trans::no, trans::no, R, D, qkv_width(), 1.f, dqkv.data(), wqkv_.data(), 0.f, dx.data());
    return dx;
  }
  /// The projections' weight gradients from slot `slot`'s saved x, dy, att and d(qkv).
  void weight_grads_(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    const index_t R = s.dy.numel() / D;
    be.linear_weight_grads(R, D, h_ * hd, s.dy.data(), s.att.data(), dwo_.data(), nullptr, accumulate);
    be.linear_weight_grads(R, qkv_width(), D, s.dqkv.data(), s.x.data(), dwqkv_.data(), nullptr, accumulate);
  }

  struct state {
    cview<float> x, dy;
    tensor<float> qkv, full, lse, att, y, datt, dfull, dqkv, dx;
    tensor<float> packed;  // a fused attention's bf16 Q, K, V and O, kept for the backward (empty otherwise)
  };
  /// The cos and sin of every position up to T (kernels::rotary_table), made
  /// once per sequence length in the backend's memory.
  const float* table(const backend_ref& be, index_t T) {
    if (table_T_ != T) {
      tensor<float> t;
      {
        const place_scope on_host(nullptr);  // filled here, then moved to the device's memory (if any)
        t = tensor<float>({2 * T * (hd / 2)}, mem_kind::workspace);
      }
      kernels::rotary_table(t.data(), T, hd, theta_);
      detail::move_to(be, t, mem_kind::workspace);
      table_ = std::move(t);
      table_T_ = T;
    }
    return table_.data();
  }
  float* packed(const step_ctx& c, state& s, index_t R) {
    const index_t n = c.be.attention_packed_floats(R, h_ * hd, c.bf16);
    if (n == 0) {
      s.packed = {};
      return nullptr;
    }
    return detail::ensure(s.packed, {n}).data();
  }

  index_t h_, kv_;
  float theta_;
  view<float> wqkv_, dwqkv_, wo_, dwo_;
  slots<state> st_;
  tensor<float> table_;
  index_t table_T_ = 0;
};
}  // namespace detail

/// Causal self-attention with rotary positions and grouped KV heads, on
/// (B*T, D) rows of B sequences of T tokens (step_ctx::batch, seq):
///   [Q K V] = x Wqkv^T; Q and K turned by their positions (RoPE, base Theta,
///   transformers' rotate_half pairing); each query head h attends with KV
///   head h / (Heads / KVHeads), causally, scaled by 1/sqrt(hd); y = o Wo^T.
/// Parameters, in order: q.weight (D, D), k.weight (KVHeads hd, D), v.weight
/// (KVHeads hd, D), o.weight (D, D), as transformers' q_proj, k_proj, v_proj
/// and o_proj hold them; no biases. Init uniform(-1/sqrt(D), 1/sqrt(D)), element
/// i of that flat block from the layer's stream at index i (as linear).
/// KVHeads = Heads is plain multi-head attention (no repeat), KVHeads = 1
/// multi-query attention. Inside split<...> over the model axis the heads are
/// divided by KV group (split_layers.hpp).
template <index_t D, index_t Heads, index_t KVHeads, float Theta>  // defaults in whale/fwd.hpp
struct rotary_attention : detail::rotary_attention_body<D, (Heads > 0 && D % Heads == 0 ? D / Heads : 2)> {
  static_assert(D > 0 && Heads > 0 && KVHeads > 0, "whale::rotary_attention: D, Heads and KVHeads must be positive");
  static_assert(D % Heads == 0, "whale::rotary_attention: D must be divisible by Heads (each head gets D / Heads features)");
  static_assert(Heads % KVHeads == 0,
                "whale::rotary_attention: Heads must be a multiple of KVHeads (each key/value head serves Heads / KVHeads "
                "query heads)");
  static_assert((D / Heads) % 2 == 0, "whale::rotary_attention: the head width D / Heads must be even (RoPE turns pairs)");
  static_assert(Theta > 0.f, "whale::rotary_attention: Theta (the RoPE base) must be positive");
  static constexpr index_t head_dim = D / Heads;
  using body = detail::rotary_attention_body<D, head_dim>;
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static constexpr index_t heads = Heads, kv_heads = KVHeads;
  static constexpr float theta = Theta;
  static constexpr bool rounds_output = true;         // under bf16 the pass after the output projection stores y rounded
  static constexpr bool accepts_residual_add = true;  // last in a residual branch: under bf16 that pass adds x

  rotary_attention() : body(Heads, KVHeads, Theta) {}

  static std::string name() {
    std::string n = "rotary_attention<" + std::to_string(D) + ", " + std::to_string(Heads) + ", " + std::to_string(KVHeads);
    if (Theta != 10000.f) {
      char t[32];
      std::snprintf(t, sizeof t, "%g", static_cast<double>(Theta));
      n += std::string(", ") + t;
    }
    return n + ">";
  }
  /// Per token: projections 2 D (D + 2 KVHeads hd) + 2 D^2 forward, twice that
  /// backward; the attention products as causal_self_attention's (seq_flops).
  static constexpr cost_info cost() {
    constexpr double kvw = static_cast<double>(KVHeads * head_dim);
    cost_info c;
    c.fwd_flops = 2.0 * D * (D + 2 * kvw) + 2.0 * D * D;
    c.bwd_flops = 2 * c.fwd_flops;
    c.params = param_count();
    // qkv, the repeated K and V, heads' output, y, lse; in backward d(att), the repeated d(qkv), d(qkv), dx
    c.act_bytes = 4.0 * (2 * (D + 2 * kvw) + 2 * 3.0 * D + 4.0 * D) + 4.0 * Heads;
    c.seq_flops = 4.0 * D;
    c.seq_work_bytes = 4.0 * Heads;
    c.seq_inner = static_cast<double>(head_dim);
    return c;
  }
  static constexpr index_t param_count() noexcept { return (D + 2 * KVHeads * head_dim) * D + D * D; }
  static constexpr std::array<param_tensor, 4> param_tensors() {
    return {{{"q.weight", param_role::weight, D * D, D, {D, D}},
             {"k.weight", param_role::weight, KVHeads * head_dim * D, D, {KVHeads * head_dim, D}},
             {"v.weight", param_role::weight, KVHeads * head_dim * D, D, {KVHeads * head_dim, D}},
             {"o.weight", param_role::weight, D * D, D, {D, D}}}};
  }

  void bind(param_binder& b) { this->bind_(b); }
  void init(const counter_rng& r) {
    const double k = 1.0 / std::sqrt(static_cast<double>(D));
    const index_t nq = this->wqkv_.numel();
    for (index_t i = 0; i < nq; ++i)
      this->wqkv_[i] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(i)) - 1) * k);
    for (index_t i = 0; i < D * D; ++i)
      this->wo_[i] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(nq + i)) - 1) * k);
  }

  // x: (B*T, D) -> y: (B*T, D)
  view<float> forward(step_ctx& c, cview<float> x) { return this->forward_(c, x, true, "rotary_attention"); }
  // dy: (B*T, D) -> dx: (B*T, D); the weight gradients now or, in a split backward, in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) { return this->backward_(c, dy, this, "rotary_attention"); }
  void weight_grads(const backend_ref& be, int slot, bool accumulate) { this->weight_grads_(be, slot, accumulate); }

  view<float> qkv_weight() const noexcept { return this->wqkv_; }  ///< ((Heads + 2 KVHeads) hd, D)
  view<float> out_weight() const noexcept { return this->wo_; }
};

}  // namespace whale
