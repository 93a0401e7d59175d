// What one rank runs of a model, behind one interface for the executor:
// `whole_stage<M>` (the whole model on every rank of its pipe group: plans
// without a pipeline) and `pipe_stage<Pipe>` (this rank's pipeline stage:
// contiguous top-level elements and blocks of the pipelined repeat). Each
// places, binds and initialises its parameters as the unsplit model would
// (same streams), and runs one micro-batch forward and backward. No communication
// here beyond what split regions inside the layers do.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "whale/nn/layer.hpp"
#include "whale/plan/partition.hpp"
#include "whale/runtime/options.hpp"
#include "whale/strategy/pipeline.hpp"

namespace whale::detail {

/// The whole model M as one stage.
template <class M> class whole_stage {
 public:
  using input_type = typename M::input_type;
  static constexpr bool has_split = whale::contains_split<M>();
  static constexpr bool splits_data = pipe_splits<M>().data;

  template <class Env> void configure(const Env& e) { configure_layer(model_, e); }
  void place(int /*stages*/, int /*stage*/, const std::vector<int>& /*blocks*/) {}
  index_t begin() const noexcept { return 0; }
  index_t end() const { return model_.param_count(); }
  index_t total() const { return model_.param_count(); }
  index_t full_begin() const noexcept { return 0; }
  index_t full_end() const noexcept { return M::cost().params; }
  index_t in_width() const noexcept { return 0; }
  index_t out_width() const noexcept { return 0; }
  std::vector<int> blocks() const { return {}; }
  void bind_and_init(float* params, float* grads, seed s, bool init) {
    param_binder b(params, grads, model_.param_count());
    model_.bind(b);
    if (init) model_.init(counter_rng(s));
  }
  view<float> forward(step_ctx&, cview<input_type>, cview<float>) {
    throw std::logic_error("whale: a whole-model stage ends in the loss");
  }
  double forward_loss(step_ctx& c, cview<input_type> x0, cview<float>, cview<std::int32_t> labels) {
    return model_.forward_loss(c, x0, labels);
  }
  view<float> backward(step_ctx& c, cview<float>) {
    c.need_input_grad = false;
    return model_.backward_loss(c);
  }
  /// The model's output before its loss (forward(inputs)).
  view<float> logits(step_ctx& c, cview<input_type> x0, cview<float>) {
    if constexpr (requires { model_.forward(c, x0); }) return model_.forward(c, x0);
    else throw std::logic_error("whale: this model has no forward without its loss");  // executor::forward refuses it at compile time
  }
  /// The unsplit parameters of this stage from this rank's (collective over split axes).
  void gather_full(const float* local, float* full) { gather_full_params(model_, local, full); }
  std::string describe(int) const { return layer_name<M>(); }
  M& model() noexcept { return model_; }

 private:
  M model_;
};

/// This rank's stage of pipeline type Pipe (pipeline<S, stage...> or pipeline<S, M>).
template <class Pipe> class pipe_stage {
 public:
  using flat = typename Pipe::flat;
  using input_type = typename flat::input_type;
  static constexpr bool has_split = pipe_splits<flat>().any;
  static constexpr bool splits_data = pipe_splits<flat>().data;

 private:
  using E = typename Pipe::elements;
  static constexpr std::size_t n_elems = E::n;
  static constexpr std::size_t loss_index = n_elems - 1;
  static constexpr std::size_t rep_index = Pipe::explicit_stages ? n_elems : E::repeat_index;
  template <std::size_t I> using elem_t = std::tuple_element_t<I, typename flat::tuple_type>;
  template <class F> static void for_elems(F&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) { (f(std::integral_constant<std::size_t, I>{}), ...); }(
        std::make_index_sequence<n_elems>{});
  }
  template <class F> static void for_elems_reverse(F&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(std::integral_constant<std::size_t, n_elems - 1 - I>{}), ...);
    }(std::make_index_sequence<n_elems>{});
  }

 public:
  template <class Env> void configure(const Env& e) { configure_layer(model_, e); }

  /// Which elements (and repeat blocks) each of `p` stages holds; this rank's
  /// is `stage`. `blocks`: the repeat's blocks on each stage, as the program
  /// cut them (program::stage_blocks: given, or balanced by cost).
  void place(int p, int stage, const std::vector<int>& blocks) {
    stages_ = p, stage_ = stage;
    const std::string who = "whale::" + layer_name<Pipe>() + ": ";
    index_t at = 0, fat = 0;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      off_[I] = at, full_off_[I] = fat;
      at += model_.template get<I>().param_count();
      fat += elem_t<I>::cost().params;
    });
    total_ = at;
    if constexpr (Pipe::explicit_stages) {
      for (std::size_t i = 0; i < n_elems; ++i) elem_stage_[i] = static_cast<int>(i);
      blocks_.assign(static_cast<std::size_t>(stages_), 1);
    } else {
      for (std::size_t i = 0; i < n_elems; ++i) elem_stage_[i] = i < rep_index ? 0 : (i > rep_index ? stages_ - 1 : -1);
      using R = elem_t<rep_index>;
      constexpr int N = static_cast<int>(R::count);
      block_params_ = model_.template get<rep_index>().block(0).param_count();
      int sum = 0;
      for (int b : blocks) sum += b;
      if (static_cast<int>(blocks.size()) != stages_ || sum != N)
        throw std::logic_error(who + "the program's stage cut has " + std::to_string(blocks.size()) + " stages and " +
                               std::to_string(sum) + " blocks, not " + std::to_string(stages_) + " and " + std::to_string(N));
      blocks_ = blocks;
      first_block_.assign(static_cast<std::size_t>(stages_) + 1, 0);
      for (int s = 0; s < stages_; ++s) first_block_[su(s) + 1] = first_block_[su(s)] + blocks_[su(s)];
    }
    // each stage's contiguous range of the flat parameters
    stage_begin_.assign(su(stages_) + 1, total_);
    for (int s = stages_ - 1; s >= 0; --s) {
      index_t b = stage_begin_[su(s) + 1];
      for (std::size_t i = n_elems; i-- > 0;) {
        if (i == rep_index) {
          if (blocks_[su(s)] > 0) b = std::min(b, block_offset(first_block_[su(s)]));
        } else if (elem_stage_[i] == s) {
          b = std::min(b, off_[i]);
        }
      }
      stage_begin_[su(s)] = b;
    }
    full_begin_ = fat, full_end_ = 0;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      index_t b = full_off_[I], e = full_off_[I] + elem_t<I>::cost().params;
      if constexpr (I == rep_index) {
        constexpr index_t per = elem_t<I>::block_type::cost().params;
        b = full_off_[I] + first_block_[su(stage_)] * per;
        e = full_off_[I] + first_block_[su(stage_) + 1] * per;
      }
      full_begin_ = std::min(full_begin_, b), full_end_ = std::max(full_end_, e);
    });
    if (full_end_ < full_begin_) full_begin_ = full_end_ = 0;
    // every stage checked on every rank, so that all ranks fail together, before any communication
    for (int s = 0; s < stages_; ++s) {
      if (describe(s).empty())
        throw std::invalid_argument(who + "stage " + std::to_string(s) + " of " + std::to_string(stages_) +
                                    " holds no layer; give it blocks (--stage-blocks) or use fewer pipe ranks");
      if (s > 0 && stage_in_width(s) == any_features)
        throw std::invalid_argument(who + "the width of the activation between stages " + std::to_string(s - 1) + " and " +
                                    std::to_string(s) + " is not known from the layer types (both sides keep any width); "
                                    "start each stage with a layer of fixed in_features");
    }
    in_width_ = stage_in_width(stage_);
    out_width_ = stage_ + 1 < stages_ ? stage_in_width(stage_ + 1) : 0;
  }
  index_t begin() const { return stage_begin_[su(stage_)]; }
  index_t end() const { return stage_begin_[su(stage_) + 1]; }
  index_t total() const noexcept { return total_; }
  index_t full_begin() const noexcept { return full_begin_; }
  index_t full_end() const noexcept { return full_end_; }
  index_t in_width() const noexcept { return in_width_; }
  index_t out_width() const noexcept { return out_width_; }
  const std::vector<int>& blocks() const noexcept { return blocks_; }

  /// Bind this stage's layers to params/grads (holding flat [begin, end)); init from the model's streams.
  void bind_and_init(float* params, float* grads, seed sd, bool init) {
    param_binder b(params, grads, end(), begin());
    const counter_rng r(sd);
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == rep_index) {
        for (int k = first_block_[su(stage_)]; k < first_block_[su(stage_) + 1]; ++k) {
          check(b, block_offset(k));
          e.block(static_cast<std::size_t>(k)).bind(b);
          if (init) e.block(static_cast<std::size_t>(k)).init(r.child(I).child(static_cast<std::uint64_t>(k)));
        }
      } else {
        check(b, off_[I]);
        e.bind(b);
        if (init) e.init(r.child(I));  // as sequential::init: element I from stream child(I)
      }
    });
    if (b.offset() != end()) throw std::logic_error("whale::pipeline: stage binding did not fill its parameter range");
  }

  /// One micro-batch forward through this stage's layers (x0: data rows on stage 0; in: received activation).
  view<float> forward(step_ctx& c, cview<input_type> x0, cview<float> in) {
    cview<float> cur = in;
    if constexpr (std::is_same_v<input_type, float>)
      if (stage_ == 0) cur = x0;
    view<float> y;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if constexpr (I != loss_index) {
        if (!owns(I)) return;
        auto& e = model_.template get<I>();
        if constexpr (I == rep_index) {
          // a residual's sum at a block's end may be left to the stage's next block (step_ctx::sum_taken_after)
          using block_type = std::remove_cvref_t<decltype(e.block(0))>;
          const int end = first_block_[su(stage_) + 1];
          for (int k = first_block_[su(stage_)]; k < end; ++k) {
            c.sum_taken_after = k + 1 < end && takes_residual_sum<block_type>() && c.bf16 && !c.hooks && !c.check_finite;
            cur = y = run_forward(e.block(static_cast<std::size_t>(k)), c, cur, block_offset(k));
          }
          c.sum_taken_after = false;
        } else {
          if constexpr (I == 0) y = run_forward(e, c, x0, off_[I]);
          else y = run_forward(e, c, cur, off_[I]);
          cur = y;
        }
      }
    });
    if (stage_ > 0 && y.data() == nullptr) y = view<float>(const_cast<float*>(in.data()), in.shape());
    detail::finish_residual_sum(c);  // what leaves a stage is whole (none is left pending at a stage's end)
    return y;
  }
  double forward_loss(step_ctx& c, cview<input_type> x0, cview<float> in, cview<std::int32_t> labels) {
    auto& loss = model_.template get<loss_index>();
    bool any_layer = false;
    for (std::size_t i = 0; i < loss_index; ++i) any_layer = any_layer || owns(i);
    if constexpr (loss_index == 0) {
      return run_forward_loss(loss, c, x0, labels, off_[loss_index]);
    } else {
      if (!any_layer) {
        if constexpr (std::is_same_v<input_type, float>)
          if (stage_ == 0) return run_forward_loss(loss, c, x0, labels, off_[loss_index]);
        return run_forward_loss(loss, c, in, labels, off_[loss_index]);
      }
      auto y = forward(c, x0, in);
      return run_forward_loss(loss, c, cview<float>(y), labels, off_[loss_index]);
    }
  }
  /// The last stage's output before the loss (forward(inputs)): its layers but the loss.
  view<float> logits(step_ctx& c, cview<input_type> x0, cview<float> in) {
    if constexpr (std::is_same_v<input_type, float>)
      if (stage_ == 0 && loss_index == 0) return view<float>(const_cast<float*>(x0.data()), x0.shape());
    bool any_layer = false;
    for (std::size_t i = 0; i < loss_index; ++i) any_layer = any_layer || owns(i);
    if (!any_layer) return view<float>(const_cast<float*>(in.data()), in.shape());
    return forward(c, x0, in);
  }
  /// One micro-batch backward (each leaf tells c.leaf_backward_done its global flat offset).
  view<float> backward(step_ctx& c, cview<float> dy) {
    const bool upstream = stage_ > 0;
    cview<float> g = dy;
    view<float> d;
    for_elems_reverse([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == loss_index) {
        c.need_input_grad = upstream || !is_first_unit(I, 0);
        g = d = run_backward_loss(e, c, off_[I]);
      } else if constexpr (I == rep_index) {
        for (int k = first_block_[su(stage_) + 1]; k-- > first_block_[su(stage_)];) {
          c.need_input_grad = upstream || !is_first_unit(I, k);
          g = d = run_backward(e.block(static_cast<std::size_t>(k)), c, g, block_offset(k));
        }
      } else {
        c.need_input_grad = upstream || !is_first_unit(I, 0);
        g = d = run_backward(e, c, g, off_[I]);
      }
    });
    return d;
  }
  /// This stage's unsplit parameters [full_begin, full_end) from its local ones (collective over model).
  void gather_full(const float* local, float* full) {
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      if (!owns(I)) return;
      auto& e = model_.template get<I>();
      if constexpr (I == rep_index) {
        constexpr index_t per = elem_t<I>::block_type::cost().params;
        for (int k = first_block_[su(stage_)]; k < first_block_[su(stage_) + 1]; ++k)
          gather_full_params(e.block(static_cast<std::size_t>(k)), local + (block_offset(k) - begin()),
                             full + (full_off_[I] + k * per - full_begin_));
      } else {
        gather_full_params(e, local + (off_[I] - begin()), full + (full_off_[I] - full_begin_));
      }
    });
  }
  std::string describe(int s) const {
    std::string d;
    for_elems([&](auto ic) {
      constexpr std::size_t I = decltype(ic)::value;
      std::string part;
      if constexpr (I == rep_index) {
        const int b0 = first_block_[su(s)], n = blocks_[su(s)];
        if (n > 0)
          part = std::to_string(n) + " x " + layer_name<typename elem_t<I>::block_type>() + " (blocks " +
                 std::to_string(b0) + ".." + std::to_string(b0 + n - 1) + ")";
      } else if (elem_stage_[I] == s) {
        part = layer_name<elem_t<I>>();
      }
      if (part.empty()) return;
      if (!d.empty()) d += ", ";
      d += part;
    });
    return d;
  }
  flat& model() noexcept { return model_; }

 private:
  static std::size_t su(int s) noexcept { return static_cast<std::size_t>(s); }
  static void check(const param_binder& b, index_t want) {
    if (b.offset() != want) throw std::logic_error("whale::pipeline: stage parameters out of order");
  }
  index_t block_offset(int b) const { return off_[rep_index < n_elems ? rep_index : 0] + b * block_params_; }
  index_t stage_in_width(int s) const {
    for (std::size_t i = 0; i < n_elems; ++i) {
      if (i == rep_index && blocks_[su(s)] > 0) return E::in_width[i];
      if (i != rep_index && elem_stage_[i] == s) return E::in_width[i];
    }
    return any_features;
  }
  bool owns(std::size_t i) const {
    if (i == rep_index) return blocks_[su(stage_)] > 0;
    return elem_stage_[i] == stage_;
  }
  // Is (element i, block k) this stage's first unit? Its d(input) is needed only upstream.
  bool is_first_unit(std::size_t i, int k) const {
    for (std::size_t j = 0; j < n_elems; ++j) {
      if (!owns(j)) continue;
      if (j != i) return false;
      return j != rep_index || k == first_block_[su(stage_)];
    }
    return false;
  }

  flat model_;
  int stages_ = 1, stage_ = 0;
  std::array<index_t, n_elems> off_{}, full_off_{};
  std::array<int, n_elems> elem_stage_{};
  std::vector<int> blocks_, first_block_;
  std::vector<index_t> stage_begin_;
  index_t block_params_ = 0, total_ = 0, full_begin_ = 0, full_end_ = 0, in_width_ = 0, out_width_ = 0;
};

}  // namespace whale::detail
