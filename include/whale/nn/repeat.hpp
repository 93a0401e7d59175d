// `repeat<N, Block>`: N copies of a width-preserving block applied in order
// (a transformer's layer stack). Each copy has its own parameters and init
// stream. Where a pipeline cuts the stack is decided in strategy/, not here.
#pragma once

#include <array>
#include <cstddef>
#include <ostream>
#include <string>
#include <type_traits>

#include "whale/nn/layer.hpp"

namespace whale {

/// N copies of Block in sequence, equivalent to sequential<Block, ..., Block>
/// (N times): copy i is bound after copy i-1 and initialised from stream
/// child(i), exactly as sequential does for its i-th element.
template <std::size_t N, class Block>
class repeat {
  static_assert(N > 0, "whale::repeat: N must be at least 1");
  static_assert(Layer<Block>, "whale::repeat: Block must model whale::Layer (a loss cannot be repeated)");
  static_assert(Block::in_features == Block::out_features,
                "whale::repeat: Block must keep the feature width (in_features == out_features) "
                "so that its copies can follow each other");
  static_assert(std::is_same_v<typename Block::input_type, float>,
                "whale::repeat: Block must take float activations");

 public:
  using block_type = Block;
  using input_type = float;
  static constexpr bool is_container = true;
  // what it returns is what an element it ran returned, stored as that element stores it
  static constexpr bool rounds_output = true, rounds_input_grad = true;
  static constexpr bool takes_residual_sum = whale::takes_residual_sum<Block>();
  static constexpr bool carries_residual_sum = true;  // to its last copy
  static constexpr std::size_t count = N;
  static constexpr index_t in_features = Block::in_features;
  static constexpr index_t out_features = Block::out_features;

  static std::string name() { return "repeat<" + std::to_string(N) + ", " + layer_name<Block>() + ">"; }
  static constexpr cost_info cost() {
    cost_info c = Block::cost();
    const cost_info one = c;
    for (std::size_t i = 1; i < N; ++i) c += one;
    return c;
  }
  static void print_structure(std::ostream& os, int indent, index_t width) {
    os << std::string(static_cast<std::size_t>(indent), ' ') << N << " x " << layer_name<Block>()
       << "  [" << Block::cost().params << " params each]\n";
    if constexpr (requires { Block::print_structure(os, indent, width); })
      Block::print_structure(os, indent + 2, width);
  }

  index_t param_count() const {
    index_t n = 0;
    for (const auto& b : blocks_) n += b.param_count();
    return n;
  }
  void bind(param_binder& b) {
    for (std::size_t i = 0; i < N; ++i) {
      offset_[i] = b.offset();
      blocks_[i].bind(b);
    }
  }
  void init(const counter_rng& r) {
    for (std::size_t i = 0; i < N; ++i) blocks_[i].init(r.child(i));
  }
  /// Unsplit parameters of every copy (see gather_full_params).
  void gather_full(const float* local, float* full) {
    for (std::size_t i = 0; i < N; ++i)
      gather_full_params(blocks_[i], local + (offset_[i] - offset_[0]), full + static_cast<index_t>(i) * Block::cost().params);
  }
  /// Forward a plan's configuration to every copy.
  template <class Env> void configure(const Env& e) {
    for (auto& b : blocks_) configure_layer(b, e);
  }

  // x: (R, F) -> y: (R, F), through copies 0..N-1
  // A residual's sum at a copy's end may be left to the next copy (step_ctx::sum_taken_after), and at
  // the last copy's end to what follows the repeat, as the caller said.
  view<float> forward(step_ctx& c, cview<float> x) {
    const bool last_takes = c.sum_taken_after;
    view<float> y;
    for (std::size_t i = 0; i < N; ++i) {
      c.sum_taken_after = i + 1 < N ? whale::takes_residual_sum<Block>() && c.bf16 : last_takes;
      y = run_forward(blocks_[i], c, i == 0 ? x : cview<float>(y), offset_[i]);
    }
    c.sum_taken_after = false;
    return y;
  }
  // dy: (R, F) -> dx: (R, F), through copies N-1..0
  view<float> backward(step_ctx& c, cview<float> dy) {
    const bool outer = c.need_input_grad;
    view<float> d;
    cview<float> g = dy;
    for (std::size_t k = N; k-- > 0;) {
      c.need_input_grad = k > 0 || outer;
      d = run_backward(blocks_[k], c, g, offset_[k]);
      c.need_input_grad = outer;
      g = d;
    }
    return d;
  }

  Block& block(std::size_t i) { return blocks_.at(i); }
  const Block& block(std::size_t i) const { return blocks_.at(i); }
  /// Flat parameter offset of copy i (valid after bind).
  index_t offset(std::size_t i) const { return offset_.at(i); }

 private:
  std::array<Block, N> blocks_{};
  std::array<index_t, N> offset_{};
};

}  // namespace whale
