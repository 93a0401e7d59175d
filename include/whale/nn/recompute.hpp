// `recompute<Block>`: activation recomputation (gradient checkpointing). The
// block keeps only its input and a copy of its output between forward and
// backward; its inner activations are recomputed in backward. No policy of
// which blocks to recompute lives here: the user wraps the blocks.
#pragma once

#include <cstring>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "whale/nn/layer.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/tensor/memory.hpp"

namespace whale {

template <class M, int Level> struct shard;              // strategy/shard.hpp
template <class Sched, class... Parts> struct pipeline;  // strategy/pipeline.hpp

namespace detail {
/// A whole-model strategy, which recompute cannot wrap (see recompute's asserts).
template <class T> inline constexpr bool recompute_whole_model = false;
template <class M, int L> inline constexpr bool recompute_whole_model<shard<M, L>> = true;
template <class S, class... P> inline constexpr bool recompute_whole_model<pipeline<S, P...>> = true;

/// While alive: the slots that layers touch are recorded into `rec`, and
/// activation buffers come from the activation pool. `stop()` ends both; the
/// destructor then releases every recorded slot (its buffers return to the pool).
class recompute_scope {
 public:
  explicit recompute_scope(std::vector<slot_record>& rec) : rec_(rec), prev_(slot_recorder()) {
    rec_.clear();
    slot_recorder() = &rec_;
    activation_pool::instance().enter();
  }
  recompute_scope(const recompute_scope&) = delete;
  recompute_scope& operator=(const recompute_scope&) = delete;
  void stop() noexcept {
    if (!on_) return;
    slot_recorder() = prev_;
    activation_pool::instance().leave();
    on_ = false;
  }
  ~recompute_scope() {
    stop();
    for (const auto& e : rec_) e.release(e.owner, e.slot);
    rec_.clear();  // keeps its capacity: no heap allocation after the first step
  }

 private:
  std::vector<slot_record>& rec_;
  std::vector<slot_record>* prev_;
  bool on_ = true;
};
}  // namespace detail

/// Block, with its activations recomputed in backward instead of kept.
///
/// Same parameters and initialisation as Block itself (bound and initialised
/// with the recompute's stream), so `recompute<B>` trains exactly as `B`.
/// Forward runs Block inside a recording scope, copies its output into a
/// buffer of its own, then releases every activation slot Block's layers
/// touched: their buffers go back to the process's activation pool
/// (tensor/memory.hpp), where the next recomputed block takes them again.
/// Backward re-runs Block's forward from the saved input (layer hooks see a
/// second forward, so ZeRO-3 gathers again), runs Block's backward, copies
/// d(input) out and releases the slots again.
///
/// Memory, per recompute<Block> on R rows: kept between forward and backward
/// are its output copy (R × out) and, after backward, its d(input) copy
/// (R × in); Block's own buffers exist only while it runs. A stack of L
/// recomputed blocks therefore holds L·R·(in + out) floats plus ONE block's
/// forward and backward buffers (the pool), instead of L blocks' buffers.
/// The input is a view of the previous layer's output, which that layer keeps
/// anyway. After the first step nothing is allocated from the heap.
template <class Block>
class recompute {
  static_assert(!detail::recompute_whole_model<Block>,
                "whale::recompute<shard<...>> / recompute<pipeline<...>>: shard and pipeline are whole-model "
                "strategies (they end in the loss) and cannot be recomputed; recompute the blocks inside them: "
                "shard<sequential<..., recompute<Block>, ..., Loss>> or pipeline<Schedule, sequential<..., "
                "repeat<N, recompute<Block>>, ..., Loss>>");
  static_assert(Layer<Block>,
                "whale::recompute: Block must model whale::Layer; a loss cannot be recomputed "
                "(put the loss after the recompute<...>)");

 public:
  using block_type = Block;
  using input_type = typename Block::input_type;
  static constexpr bool is_container = true;
  static constexpr index_t in_features = Block::in_features;
  static constexpr index_t out_features = Block::out_features;

  static std::string name() { return "recompute<" + layer_name<Block>() + ">"; }
  /// Block's cost, plus one more forward in backward; the bytes kept per row
  /// are the output and input-gradient copies only.
  static constexpr cost_info cost() {
    cost_info c = Block::cost();
    c.bwd_flops += c.fwd_flops;
    c.seq_act_bytes = 0;  // the probabilities exist only while the block runs
    if constexpr (in_features == any_features || out_features == any_features) {
      c.act_bytes = c.per_feature ? 8.0 : 0.0;
    } else {
      c.act_bytes = 4.0 * static_cast<double>(in_features + out_features);
    }
    return c;
  }
  static void print_structure(std::ostream& os, int indent, index_t width) {
    os << std::string(static_cast<std::size_t>(indent), ' ')
       << "recompute (activations recomputed in backward)\n";
    detail::print_layer<Block>(os, indent + 2, width);
  }

  index_t param_count() const { return block_.param_count(); }
  void bind(param_binder& b) {
    offset_ = b.offset();
    block_.bind(b);
  }
  void init(const counter_rng& r) { block_.init(r); }
  /// A plan's configuration (split degrees, communicators) goes to the block.
  template <class Env> void configure(const Env& e) { configure_layer(block_, e); }
  /// The block's unsplit parameters (see gather_full_params).
  void gather_full(const float* local, float* full) { gather_full_params(block_, local, full); }

  // x: (R, in) -> y: (R, out); keeps x (a view) and a copy of y
  view<float> forward(step_ctx& c, cview<input_type> x) {
    auto& s = st_(c.slot);
    s.x = x;
    detail::recompute_scope scope(rec_);
    auto y = run_forward(block_, c, x, offset_);
    scope.stop();  // the copy below is the recompute's own, not Block's
    auto out = detail::ensure(s.y, y.shape());
    c.be.copy(out.data(), y.data(), y.bytes());
    return out;  // Block's buffers are released when `scope` ends
  }

  // dy: (R, out) -> dx: (R, in); recomputes Block's forward first
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    detail::recompute_scope scope(rec_);
    // the block's state is released below, so its weight gradients cannot wait for a W pass
    auto* const deferred = std::exchange(c.deferred, nullptr);
    run_forward(block_, c, s.x, offset_);
    auto dx = run_backward(block_, c, dy, offset_);
    c.deferred = deferred;
    scope.stop();
    if (!c.need_input_grad || dx.empty()) return {};
    auto out = detail::ensure(s.dx, dx.shape());
    c.be.copy(out.data(), dx.data(), dx.bytes());
    return out;
  }

  Block& block() noexcept { return block_; }
  const Block& block() const noexcept { return block_; }
  /// Flat parameter offset of the block (valid after bind).
  index_t offset() const noexcept { return offset_; }

 private:
  struct state {
    cview<input_type> x;
    tensor<float> y, dx;
  };
  Block block_{};
  index_t offset_ = 0;
  slots<state> st_;
  std::vector<detail::slot_record> rec_;
};

namespace detail {
/// Whether T is a recompute<Block>.
template <class T> inline constexpr bool is_recompute_v = false;
template <class B> inline constexpr bool is_recompute_v<recompute<B>> = true;
}  // namespace detail

}  // namespace whale
