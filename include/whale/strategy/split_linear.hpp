// The column- and row-parallel forms of linear<In, Out, Bias> (Megatron's pair),
// each holding its slice of the unsplit layer's parameters along one mesh axis
// (same initial values, element by element), and what every sharded form
// shares: the run-time degree check and the per-rank cost.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "whale/nn/linear.hpp"
#include "whale/nn/tied_head.hpp"
#include "whale/strategy/layout.hpp"

namespace whale {

namespace detail {
/// Runtime twin of the static degree check: the axis size must divide `n`.
inline void check_divides(const std::string& layer, const char* what, index_t n, int p, axis a) {
  if (p <= 0 || n % p != 0)
    throw std::invalid_argument("whale::split: " + layer + ": the split degree must divide " + what + " (" +
                                std::to_string(n) + " % " + std::to_string(p) + " != 0) on the " +
                                axis_name(a) + " axis; choose a mesh whose " + axis_name(a) +
                                " size divides it");
}
/// A row-parallel weight (rows, p k) gathered whole into `full` from each of the
/// p ranks' column blocks (rows, k) at `local`: rank q's block is columns [q k, q k + k).
inline void gather_column_blocks(world_comm& comm, const float* local, index_t rows, index_t k, float* full) {
  const int p = comm.size();
  tensor<float> t({static_cast<index_t>(p) * rows * k}, mem_kind::comm);
  all_gather(comm, cview<float>(local, {rows * k}), t.v());
  for (int q = 0; q < p; ++q)
    for (index_t o = 0; o < rows; ++o)
      std::memcpy(full + o * p * k + q * k, t.data() + (q * rows + o) * k, static_cast<std::size_t>(k) * sizeof(float));
}
/// A layer's per-rank cost when `degree` ranks share it: its arithmetic and
/// activations divided among them, `split` parameters divided, `whole` held by each.
constexpr cost_info shard_of(cost_info c, index_t degree, index_t split, index_t whole) {
  const double d = degree < 1 ? 1.0 : static_cast<double>(degree);
  c.fwd_flops /= d;
  c.bwd_flops /= d;
  c.seq_flops /= d;
  c.act_bytes /= d;
  c.seq_act_bytes /= d;
  c.seq_work_bytes /= d;
  c.params = split / (degree < 1 ? 1 : degree) + whole;
  return c;
}
}  // namespace detail

/// linear<In, Out, Bias> split by output features (column-parallel): replicated in,
/// split<1> out; d(input) is partial (each rank's slice contributes).
template <index_t In, index_t Out, axis A, bias_mode Bias = with_bias>
class column_linear {
 public:
  using unsplit_type = linear<In, Out, Bias>;  ///< the layer it is a shard of
  static constexpr bool has_bias = unsplit_type::has_bias;
  static constexpr index_t split_extent = Out;  ///< the dimension shared among the ranks
  using input_type = float;
  static constexpr index_t in_features = In;
  static constexpr index_t out_features = Out;
  static std::string name() {
    return "column_linear<" + std::to_string(In) + ", " + std::to_string(Out) + detail::bias_suffix(Bias) + ">/" +
           axis_name(A);
  }
  static constexpr cost_info cost() { return unsplit_type::cost(); }
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = (In + (has_bias ? 1 : 0)) * Out, replicated_params = 0;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    auto c = detail::shard_of(cost(), degree, split_params, replicated_params);
    c.act_bytes = 4.0 * static_cast<double>(In + Out / (degree < 1 ? 1 : degree));  // y split, d(input) whole
    return c;
  }

  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
    detail::check_divides(unsplit_type::name(), "out_features", Out, parts_, A);
    n_ = Out / parts_;
  }
  /// Rank r of p holds rows [r n, r n + n) of W (Out, In) and the same entries of b.
  static void param_runs(int r, int p, std::vector<param_run>& out) {
    const index_t n = Out / p;
    out.push_back({0, r * n * In, n * In});
    if constexpr (has_bias) out.push_back({n * In, Out * In + r * n, n});
  }
  /// W (Out, In) then b (Out), gathered from the row blocks of every rank.
  void gather_full(const float* local, float* full) {
    all_gather(*comm_, cview<float>(local, {n_ * In}), view<float>(full, {Out * In}));
    if constexpr (has_bias)
      all_gather(*comm_, cview<float>(local + n_ * In, {n_}), view<float>(full + Out * In, {Out}));
  }
  index_t param_count() const { return n_ * In + (has_bias ? n_ : 0); }
  void bind(param_binder& b) {
    auto w = b.take({n_, In});
    w_ = w.value, dw_ = w.grad;
    if constexpr (has_bias) {
      auto bias = b.take({n_});
      b_ = bias.value, db_ = bias.grad;
    }
  }
  // Rows o0..o0+n of W (Out, In) and of b: the unsplit layer's values.
  void init(const counter_rng& r) {
    const double k = 1.0 / std::sqrt(static_cast<double>(In));
    const index_t o0 = part_ * n_;
    for (index_t i = 0; i < n_ * In; ++i)
      w_[i] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(o0 * In + i)) - 1) * k);
    if constexpr (has_bias)
      for (index_t o = 0; o < n_; ++o)
        b_[o] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(In * Out + o0 + o)) - 1) * k);
  }
  // x: (R, In) -> y: (R, Out/p)
  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);
    const index_t R = x.numel() / In;
    s.x = x;
    auto y = detail::ensure(s.y, {R, n_});
    c.be.gemm_bias(trans::no, trans::yes, R, n_, In, x.data(), w_.data(), has_bias ? b_.data() : nullptr, y.data());
    return y;
  }
  // dy: (R, Out/p) -> dx: (R, In), partial
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / n_;
    s.dy = dy;
    if (!defer_weights(c, this)) weight_grads(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, In});
    c.be.gemm(trans::no, trans::no, R, In, n_, 1.f, dy.data(), w_.data(), 0.f, dx.data());
    return dx;
  }
  /// This rank's rows of dW and db (with a bias) from slot `slot`'s saved x and dy.
  void weight_grads(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    be.linear_weight_grads(s.dy.numel() / n_, n_, In, s.dy.data(), s.x.data(), dw_.data(), db_.data(), accumulate);
  }

 private:
  struct state {
    cview<float> x, dy;
    tensor<float> y, dx;
  };
  world_comm* comm_ = nullptr;
  int parts_ = 1, part_ = 0;
  index_t n_ = Out;
  view<float> w_, dw_, b_, db_;
  slots<state> st_;
};

/// linear<In, Out, Bias> split by input features (row-parallel): split<1> in,
/// partial out. The bias is replicated and added by rank 0 of the axis only,
/// so the sum of the partials holds it once; its gradient is the same on every rank.
template <index_t In, index_t Out, axis A, bias_mode Bias = with_bias>
class row_linear {
 public:
  using unsplit_type = linear<In, Out, Bias>;  ///< the layer it is a shard of
  static constexpr bool has_bias = unsplit_type::has_bias;
  static constexpr index_t split_extent = In;
  using input_type = float;
  static constexpr index_t in_features = In;
  static constexpr index_t out_features = Out;
  static std::string name() {
    return "row_linear<" + std::to_string(In) + ", " + std::to_string(Out) + detail::bias_suffix(Bias) + ">/" +
           axis_name(A);
  }
  static constexpr cost_info cost() { return unsplit_type::cost(); }
  /// Parameters divided among the ranks of the axis, and those every rank holds whole.
  static constexpr index_t split_params = In * Out, replicated_params = has_bias ? Out : 0;
  /// What one of `degree` ranks holds and computes per row.
  static constexpr cost_info shard_cost(index_t degree) {
    auto c = detail::shard_of(cost(), degree, split_params, replicated_params);
    c.act_bytes = 4.0 * static_cast<double>(Out + In / (degree < 1 ? 1 : degree));  // y whole (partial sums), d(input) split
    return c;
  }

  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    parts_ = comm_->size();
    part_ = comm_->rank();
    detail::check_divides(unsplit_type::name(), "in_features", In, parts_, A);
    k_ = In / parts_;
  }
  /// Rank r of p holds columns [r k, r k + k) of each row of W (Out, In), and the whole bias.
  static void param_runs(int r, int p, std::vector<param_run>& out) {
    const index_t k = In / p;
    for (index_t o = 0; o < Out; ++o) out.push_back({o * k, o * In + r * k, k});
    if constexpr (has_bias) out.push_back({Out * k, Out * In, Out, true});
  }
  /// W (Out, In) from the column blocks of every rank, then the (replicated) bias.
  void gather_full(const float* local, float* full) {
    detail::gather_column_blocks(*comm_, local, Out, k_, full);
    if constexpr (has_bias)
      std::memcpy(full + Out * In, local + Out * k_, static_cast<std::size_t>(Out) * sizeof(float));
  }
  index_t param_count() const { return Out * k_ + (has_bias ? Out : 0); }
  void bind(param_binder& b) {
    auto w = b.take({Out, k_});
    w_ = w.value, dw_ = w.grad;
    if constexpr (has_bias) {
      auto bias = b.take({Out});
      b_ = bias.value, db_ = bias.grad;
    }
  }
  // Columns i0..i0+k of W (Out, In); the whole bias.
  void init(const counter_rng& r) {
    const double s = 1.0 / std::sqrt(static_cast<double>(In));
    const index_t i0 = part_ * k_;
    for (index_t o = 0; o < Out; ++o)
      for (index_t j = 0; j < k_; ++j)
        w_[o * k_ + j] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(o * In + i0 + j)) - 1) * s);
    if constexpr (has_bias)
      for (index_t o = 0; o < Out; ++o)
        b_[o] = static_cast<float>((2 * r.uniform(static_cast<std::uint64_t>(In * Out + o)) - 1) * s);
  }
  // x: (R, In/p) -> y: (R, Out) partial
  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);
    const index_t R = x.numel() / k_;
    s.x = x;
    auto y = detail::ensure(s.y, {R, Out});
    const bool adds_bias = has_bias && part_ == 0;
    c.be.gemm_bias(trans::no, trans::yes, R, Out, k_, x.data(), w_.data(), adds_bias ? b_.data() : nullptr, y.data());
    return y;
  }
  // dy: (R, Out) replicated -> dx: (R, In/p)
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t R = dy.numel() / Out;
    s.dy = dy;
    if (!defer_weights(c, this)) weight_grads(c.be, c.slot, c.accumulate);
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, k_});
    c.be.gemm(trans::no, trans::no, R, k_, Out, 1.f, dy.data(), w_.data(), 0.f, dx.data());
    return dx;
  }
  /// This rank's columns of dW, and the whole db (with a bias), from slot `slot`'s saved x and dy.
  void weight_grads(const backend_ref& be, int slot, bool accumulate) {
    auto& s = st_(slot);
    be.linear_weight_grads(s.dy.numel() / Out, Out, k_, s.dy.data(), s.x.data(), dw_.data(), db_.data(), accumulate);
  }

 private:
  struct state {
    cview<float> x, dy;
    tensor<float> y, dx;
  };
  world_comm* comm_ = nullptr;
  int parts_ = 1, part_ = 0;
  index_t k_ = In;
  view<float> w_, dw_, b_, db_;
  slots<state> st_;
};

/// tied_head<Vocab, D> split by vocabulary (class-parallel logits): rank r of p
/// holds rows [r V/p, (r + 1) V/p) of the table's copy, the same rows a
/// vocab_embedding<Vocab, D> holds on that rank, so each rank's copy is tied
/// to its own slice of the table.
template <index_t Vocab, index_t D, axis A>
class tied_column_head : public column_linear<D, Vocab, A, no_bias> {
 public:
  using unsplit_type = tied_head<Vocab, D>;
  static constexpr bool ties_token_table = true;
  static std::string name() { return unsplit_type::name() + "/" + axis_name(A); }
};

}  // namespace whale
