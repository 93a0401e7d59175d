// `embedding<Vocab, D>` (token lookup, the first layer of a language model)
// and `position_embedding<MaxSeq, D>` (adds a learned (T, D) table). Tied
// input/output embeddings are nn/tied_head.hpp; vocabulary-split forms strategy/.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "whale/backend/kernels/rows.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// Token embedding: input (B, T) int32 tokens, output (B*T, D) rows of the
/// table. Parameter: table (Vocab, D), init N(0, 0.02) with element i drawn
/// from the layer's stream at index i. A token outside [0, Vocab) throws
/// std::out_of_range naming the token and the vocabulary size. No input gradient.
template <index_t Vocab, index_t D>
struct embedding {
  static_assert(Vocab > 0 && D > 0, "whale::embedding: Vocab and D must be positive");
  using input_type = std::int32_t;
  static constexpr index_t in_features = 1;  // one token id per row
  static constexpr bool rounds_output = true;  // under bf16 the gather stores its rows rounded
  static constexpr index_t out_features = D;

  static std::string name() {
    return "embedding<" + std::to_string(Vocab) + ", " + std::to_string(D) + ">";
  }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 0;  // a lookup
    c.bwd_flops = D;  // scatter-add of the row gradient
    c.params = Vocab * D;
    c.act_bytes = 4.0 * D + 4;  // output row and the token
    return c;
  }
  static constexpr index_t param_count() noexcept { return Vocab * D; }
  static constexpr std::array<param_tensor, 1> param_tensors() { return {{{"table", param_role::table, Vocab * D, D, {Vocab, D}}}}; }

  void bind(param_binder& b) {
    auto t = b.take({Vocab, D});
    b.note_table(t.offset, Vocab, D);  // a tied_head<Vocab, D> after it copies this table
    w_ = t.value;
    dw_ = t.grad;
  }
  void init(const counter_rng& r) {
    for (index_t i = 0; i < Vocab * D; ++i)
      w_[i] = static_cast<float>(0.02 * r.normal(static_cast<std::uint64_t>(i)));
  }

  // tokens: (B, T) -> y: (B*T, D)
  view<float> forward(step_ctx& c, cview<std::int32_t> tokens) {
    auto& s = st_(c.slot);
    const index_t R = tokens.numel();
    std::vector<std::int32_t> host;  // the tokens on the host, when they are on a device
    const auto readable = host_values(c, tokens, host);
    for (index_t r = 0; r < R; ++r) check(readable[r]);
    s.tokens = tokens;
    auto y = detail::ensure(s.y, {R, D});
    c.be.launch(R, kernels::gather_rows{w_.data(), tokens.data(), y.data(), D, 0, -1, c.bf16});
    return y;
  }
  // dy: (B*T, D) -> no input gradient (tokens are not differentiable); returns an empty view.
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    if (!c.accumulate) c.be.fill_zero(dw_.data(), dw_.bytes());
    const index_t R = s.tokens.numel();
    if (dy.numel() != R * D)
      throw std::invalid_argument("whale::embedding: the output gradient has " +
                                  std::to_string(dy.numel()) + " elements, expected " +
                                  std::to_string(R * D));
    c.be.scatter_add(kernels::scatter_add_rows{dy.data(), s.tokens.data(), dw_.data(), R, D, 0});
    return {};
  }

  view<float> table() const noexcept { return w_; }

 private:
  static void check(std::int32_t tok) {
    if (tok < 0 || tok >= Vocab)
      throw std::out_of_range("whale::embedding: token " + std::to_string(tok) +
                              " is outside the vocabulary of " + std::to_string(Vocab) +
                              " (valid tokens are 0.." + std::to_string(Vocab - 1) + ")");
  }
  struct state {
    cview<std::int32_t> tokens;
    tensor<float> y;
  };
  view<float> w_, dw_;
  slots<state> st_;
};

/// Learned positions: y[b*T + t, :] = x[b*T + t, :] + table[t, :] for input
/// (B*T, D) with T = step_ctx::seq. Parameter: table (MaxSeq, D), init
/// N(0, 0.02) by flat index. T outside [1, MaxSeq], or rows not a multiple
/// of T, throws std::invalid_argument.
template <index_t MaxSeq, index_t D>
struct position_embedding {
  static_assert(MaxSeq > 0 && D > 0, "whale::position_embedding: MaxSeq and D must be positive");
  using input_type = float;
  static constexpr index_t in_features = D;
  static constexpr index_t out_features = D;
  static constexpr bool rounds_output = true, rounds_input_grad = true;  // under bf16 its kernels store rounded

  static std::string name() {
    return "position_embedding<" + std::to_string(MaxSeq) + ", " + std::to_string(D) + ">";
  }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = D;
    c.bwd_flops = D;  // d(table) sums over the batch; d(input) is a copy
    c.params = MaxSeq * D;
    c.act_bytes = 8.0 * D;  // output and input-gradient rows
    return c;
  }
  static constexpr index_t param_count() noexcept { return MaxSeq * D; }
  static constexpr std::array<param_tensor, 1> param_tensors() { return {{{"table", param_role::table, MaxSeq * D, D, {MaxSeq, D}}}}; }

  void bind(param_binder& b) {
    auto t = b.take({MaxSeq, D});
    table_ = t.value;
    table_grad_ = t.grad;
  }
  void init(const counter_rng& r) {
    for (index_t i = 0; i < MaxSeq * D; ++i)
      table_[i] = static_cast<float>(0.02 * r.normal(static_cast<std::uint64_t>(i)));
  }

  // x: (B*T, D) -> y: (B*T, D)
  view<float> forward(step_ctx& c, cview<float> x) {
    const index_t R = x.numel() / D;
    const index_t T = check(c, x.numel());
    auto& s = st_(c.slot);
    auto y = detail::ensure(s.y, {R, D});
    c.be.launch(R, kernels::add_positions{x.data(), table_.data(), y.data(), T, D, c.bf16});
    return y;
  }
  // dy: (B*T, D) -> dx = dy: (B*T, D)
  view<float> backward(step_ctx& c, cview<float> dy) {
    const index_t R = dy.numel() / D;
    const index_t T = check(c, dy.numel());
    auto& s = st_(c.slot);
    // d(positions)[t, :] = the sum over the B sequences of dy[b, t, :]: column
    // sums of dy seen as (B, T*D); rows of the table past T get nothing.
    if (!c.accumulate && T < MaxSeq) c.be.fill_zero(table_grad_.data() + T * D, static_cast<std::size_t>((MaxSeq - T) * D) * sizeof(float));
    c.be.reduce_columns(kernels::column_sums{dy.data(), table_grad_.data(), R / T, T * D, c.accumulate});
    if (!c.need_input_grad) return {};
    auto dx = detail::ensure(s.dx, {R, D});
    if (c.bf16) c.be.launch(dy.numel(), kernels::copy_stored{dy.data(), dx.data(), true});
    else c.be.copy(dx.data(), dy.data(), dy.bytes());
    return dx;
  }

  view<float> table() const noexcept { return table_; }

 private:
  static index_t check(const step_ctx& c, index_t n) {
    const index_t T = c.seq;
    if (T < 1 || T > MaxSeq)
      throw std::invalid_argument("whale::position_embedding: sequence length " + std::to_string(T) +
                                  " is outside 1.." + std::to_string(MaxSeq) +
                                  " (MaxSeq); raise MaxSeq or shorten the sequences");
    if (n % (T * D) != 0)
      throw std::invalid_argument("whale::position_embedding: " + std::to_string(n) +
                                  " inputs do not form sequences of " + std::to_string(T) +
                                  " rows of " + std::to_string(D));
    return T;
  }
  struct state {
    tensor<float> y, dx;
  };
  view<float> table_, table_grad_;
  slots<state> st_;
};

}  // namespace whale
