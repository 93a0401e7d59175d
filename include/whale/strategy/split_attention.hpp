// The sharded forms of whale's attention layers: causal self-attention split
// by heads (`head_attention`) and rotary attention split by key/value groups
// (`head_rotary_attention`), each holding its heads' slices of the unsplit
// layer's parameters with the same initial values, element by element
// (detail::init_runs). Part of split_layers.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/nn/causal_self_attention.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/rotary_attention.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/split_linear.hpp"

namespace whale {

namespace detail {
/// A sharded layer's local parameters (at `local`) as the unsplit layer's
/// uniform init gives them: flat element f of the unsplit layer is
/// uniform(-k(f), k(f)) from the layer's stream at index f, for the elements
/// L::param_runs(rank, degree) says this rank holds.
template <class L, class Scale>
void init_runs(float* local, int rank, int degree, const counter_rng& rng, Scale k) {
  std::vector<param_run> runs;
  L::param_runs(rank, degree, runs);
  for (const auto& run : runs)
    for (index_t i = 0; i < run.count; ++i) {
      const index_t f = run.full + i;
      local[run.local + i] = static_cast<float>((2 * rng.uniform(static_cast<std::uint64_t>(f)) - 1) * k(f));
    }
}
}  // namespace detail

/// causal_self_attention<D, Heads> split by heads: rank r holds heads
/// [r·H/p, (r+1)·H/p): their rows of the fused QKV projection (column-parallel)
/// and their columns of the output projection (row-parallel; the bias is
/// replicated and added by rank 0). Replicated in, partial out.
template <index_t D, index_t Heads, axis A>
class head_attention {
  static constexpr index_t hd = D / Heads;

 public:
  static constexpr index_t split_extent = Heads;
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static std::string name() {
    return "head_attention<" + std::to_string(D) + ", " + std::to_string(Heads) + ">/" + axis_name(A);
  }
  static constexpr cost_info cost() { return causal_self_attention<D, Heads>::cost(); }
  using unsplit_type = causal_self_attention<D, Heads>;  ///< the layer it is a shard of
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = 4 * D * D + 3 * D, replicated_params = D;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    auto c = detail::shard_of(cost(), degree, split_params, replicated_params);
    // its heads' Q, K, V, outputs and their gradients; y and d(input) whole
    c.act_bytes = 4.0 * static_cast<double>(8 * D / (degree < 1 ? 1 : degree) + 2 * D);
    return c;
  }

  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
    detail::check_divides(causal_self_attention<D, Heads>::name(), "the number of heads", Heads, parts_, A);
    h_ = Heads / parts_;
    w_ = h_ * hd;
  }
  index_t param_count() const { return 3 * w_ * D + 3 * w_ + D * w_ + D; }
  void bind(param_binder& b) {
    auto qkv = b.take({3 * w_, D});
    auto bqkv = b.take({3 * w_});
    auto wo = b.take({D, w_});
    auto bo = b.take({D});
    wqkv_ = qkv.value, dwqkv_ = qkv.grad, bqkv_ = bqkv.value, dbqkv_ = bqkv.grad;
    wo_ = wo.value, dwo_ = wo.grad, bo_ = bo.value, dbo_ = bo.grad;
  }
  // The unsplit layer's values: W_qkv (3D, D) at 0, b_qkv at 3D*D, W_o (D, D) at 3D*D+3D, b_o after.
  void init(const counter_rng& r) {
    const double k = 1.0 / std::sqrt(static_cast<double>(D));
    auto u = [&](index_t i) { return static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(i)) - 1) * k); };
    for (index_t q = 0; q < 3; ++q)
      for (index_t j = 0; j < w_; ++j) {
        const index_t row = q * D + part_ * w_ + j;  // global row of W_qkv
        for (index_t i = 0; i < D; ++i) wqkv_[(q * w_ + j) * D + i] = u(row * D + i);
        bqkv_[q * w_ + j] = u(3 * D * D + row);
      }
    for (index_t o = 0; o < D; ++o)
      for (index_t j = 0; j < w_; ++j) wo_[o * w_ + j] = u(3 * D * D + 3 * D + o * D + part_ * w_ + j);
    for (index_t o = 0; o < D; ++o) bo_[o] = u(4 * D * D + 3 * D + o);
  }
  /// Rank r of p holds its heads' rows of each of Q, K, V in W_qkv (3D, D) and
  /// b_qkv, their columns of W_o (D, D), and the whole b_o.
  static void param_runs(int r, int p, std::vector<param_run>& out) {
    const index_t w = (Heads / p) * (D / Heads);
    for (index_t q = 0; q < 3; ++q) out.push_back({q * w * D, q * D * D + r * w * D, w * D});
    for (index_t q = 0; q < 3; ++q) out.push_back({3 * w * D + q * w, 3 * D * D + q * D + r * w, w});
    const index_t lo = 3 * w * D + 3 * w, fo = 3 * D * D + 3 * D;
    for (index_t o = 0; o < D; ++o) out.push_back({lo + o * w, fo + o * D + r * w, w});
    out.push_back({lo + D * w, fo + D * D, D, true});
  }
  void gather_full(const float* local, float* full) {
    for (index_t q = 0; q < 3; ++q) {
      all_gather(*comm_, cview<float>(local + q * w_ * D, {w_ * D}), view<float>(full + q * D * D, {D * D}));
      all_gather(*comm_, cview<float>(local + 3 * w_ * D + q * w_, {w_}), view<float>(full + 3 * D * D + q * D, {D}));
    }
    const float* wo = local + 3 * w_ * D + 3 * w_;
    float* fo = full + 3 * D * D + 3 * D;
    detail::gather_column_blocks(*comm_, wo, D, w_, fo);
    std::memcpy(fo + D * D, wo + D * w_, static_cast<std::size_t>(D) * sizeof(float));
  }

  // x: (B*T, D) replicated -> y: (B*T, D) partial
  view<float> forward(step_ctx& c, cview<float> x) {
    const index_t B = c.batch, T = c.seq, R = B * T;
    auto& s = st_(c.slot);
    s.x = x;
    auto qkv = detail::ensure(s.qkv, {R, 3 * w_});  // (B*T, 3W): this rank's heads of Q, K, V
    auto lse = detail::ensure(s.lse, {B, h_, T});
    auto att = detail::ensure(s.att, {R, w_});
    auto y = detail::ensure(s.y, {R, D});
    c.be.gemm_bias(trans::no, trans::yes, R, 3 * w_, D, x.data(), wqkv_.data(), bqkv_.data(), qkv.data());
    c.be.attention_forward(B, T, h_, hd, qkv.data(), att.data(), lse.data(), c.bf16);
    c.be.gemm_bias(trans::no, trans::yes, R, D, w_, att.data(), wo_.data(), part_ == 0 ? bo_.data() : nullptr, y.data());
    return y;
  }
  // dy: (B*T, D) replicated -> dx: (B*T, D) partial; weight gradients now or in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) {
    const index_t B = c.batch, T = c.seq, R = B * T;
    auto& s = st_(c.slot);
    auto datt = detail::ensure(s.datt, {R, w_});
    auto dqkv = detail::ensure(s.dqkv, {R, 3 * w_});
    s.dy = dy;
    c.be.gemm(trans::no, trans::no, R, w_, D, 1.f, dy.data(), wo_.data(), 0.f, datt.data());
    c.be.attention_backward(B, T, h_, hd, s.qkv.data(), s.att.data(), s.lse.data(), datt.data(), dqkv.data(), c.bf16);
    if (!defer_weights(c, this)) weight_grads(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, D});
    c.be.gemm(trans::no, trans::no, R, D, 3 * w_, 1.f, dqkv.data(), wqkv_.data(), 0.f, dx.data());
    return dx;
  }
  /// This rank's heads' projection gradients (and the whole output bias's) from slot `slot`.
  void weight_grads(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    const index_t R = s.dy.numel() / D;
    be.linear_weight_grads(R, D, w_, s.dy.data(), s.att.data(), dwo_.data(), dbo_.data(), accumulate);
    be.linear_weight_grads(R, 3 * w_, D, s.dqkv.data(), s.x.data(), dwqkv_.data(), dbqkv_.data(), accumulate);
  }

 private:
  struct state {
    cview<float> x, dy;
    tensor<float> qkv, lse, att, y, datt, dqkv, dx;
  };
  world_comm* comm_ = nullptr;
  int parts_ = 1, part_ = 0;
  index_t h_ = Heads, w_ = D;
  view<float> wqkv_, dwqkv_, bqkv_, dbqkv_, wo_, dwo_, bo_, dbo_;
  slots<state> st_;
};

/// rotary_attention<D, Heads, KVHeads, Theta> split by key/value groups: rank
/// r of p holds key/value heads [r KV/p, (r+1) KV/p) and the query heads that
/// read them, [r H/p, (r+1) H/p): those rows of W_q, W_k and W_v
/// (column-parallel) and those columns of W_o (row-parallel). A degree that
/// does not divide KVHeads is an error naming it. Replicated in, partial out.
template <index_t D, index_t Heads, index_t KVHeads, float Theta, axis A>
class head_rotary_attention : detail::rotary_attention_body<D, D / Heads> {
  static constexpr index_t hd = D / Heads;
  using body = detail::rotary_attention_body<D, hd>;

 public:
  static constexpr index_t split_extent = KVHeads;
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  using unsplit_type = rotary_attention<D, Heads, KVHeads, Theta>;  ///< the layer it is a shard of
  static std::string name() {
    const auto u = unsplit_type::name();
    return "head_" + u + "/" + axis_name(A);
  }
  static constexpr cost_info cost() { return unsplit_type::cost(); }
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = unsplit_type::param_count(), replicated_params = 0;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    auto c = detail::shard_of(cost(), degree, split_params, replicated_params);
    const double d = degree < 1 ? 1.0 : static_cast<double>(degree);
    c.act_bytes = unsplit_type::cost().act_bytes / d + 4.0 * 2 * D;  // y and d(input) whole
    return c;
  }

  head_rotary_attention() : body(Heads, KVHeads, Theta) {}
  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
    detail::check_divides(unsplit_type::name(), "the number of key/value heads (KVHeads)", KVHeads, parts_, A);
    this->h_ = Heads / parts_;
    this->kv_ = KVHeads / parts_;
  }
  index_t param_count() const { return this->param_count_(); }
  void bind(param_binder& b) { this->bind_(b); }
  /// Rank r of p: its query rows of W_q (D, D), its key/value rows of W_k and
  /// W_v (KVHeads hd, D) each, and its query heads' columns of W_o (D, D).
  static void param_runs(int r, int p, std::vector<param_run>& out) {
    const index_t wq = Heads / p * hd, wk = KVHeads / p * hd, kvw = KVHeads * hd;
    out.push_back({0, r * wq * D, wq * D});
    out.push_back({wq * D, D * D + r * wk * D, wk * D});
    out.push_back({(wq + wk) * D, D * D + kvw * D + r * wk * D, wk * D});
    const index_t lo = (wq + 2 * wk) * D, fo = (D + 2 * kvw) * D;
    for (index_t o = 0; o < D; ++o) out.push_back({lo + o * wq, fo + o * D + r * wq, wq});
  }
  // The unsplit layer's values at the same flat indices (rotary_attention::init); W_qkv and W_o lie one after the other.
  void init(const counter_rng& rng) {
    const double k = 1.0 / std::sqrt(static_cast<double>(D));
    detail::init_runs<head_rotary_attention>(this->wqkv_.data(), part_, parts_, rng, [&](index_t) { return k; });
  }
  /// W_q, W_k, W_v (row blocks of every rank) and W_o (column blocks), unsplit.
  void gather_full(const float* local, float* full) {
    const index_t wq = this->h_ * hd, wk = this->kv_ * hd, kvw = KVHeads * hd;
    all_gather(*comm_, cview<float>(local, {wq * D}), view<float>(full, {D * D}));
    all_gather(*comm_, cview<float>(local + wq * D, {wk * D}), view<float>(full + D * D, {kvw * D}));
    all_gather(*comm_, cview<float>(local + (wq + wk) * D, {wk * D}), view<float>(full + (D + kvw) * D, {kvw * D}));
    detail::gather_column_blocks(*comm_, local + (wq + 2 * wk) * D, D, wq, full + (D + 2 * kvw) * D);
  }

  // x: (B*T, D) replicated -> y: (B*T, D) partial
  view<float> forward(step_ctx& c, cview<float> x) { return this->forward_(c, x, false, "head_rotary_attention"); }
  // dy: (B*T, D) replicated -> dx: (B*T, D) partial; weight gradients now or in the W pass
  view<float> backward(step_ctx& c, cview<float> dy) { return this->backward_(c, dy, this, "head_rotary_attention"); }
  /// This rank's heads' projection gradients from slot `slot`.
  void weight_grads(const backend_ref& be, int slot, bool accumulate) { this->weight_grads_(be, slot, accumulate); }

 private:
  world_comm* comm_ = nullptr;
  int parts_ = 1, part_ = 0;
};

}  // namespace whale
