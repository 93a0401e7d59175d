// `network<M>`: a model M (a Loss, e.g. a sequential ending in
// softmax_cross_entropy) with its parameters and gradients in two flat,
// huge-page buffers, initialised from a seed. No parallelism here: the
// strategies in strategy/ decide what each rank holds and communicates.
#pragma once

#include <cstdint>
#include <ostream>

#include <cmath>
#include <concepts>
#include <utility>

#include "whale/backend/cpu.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// A model bound to flat parameter/gradient storage.
template <class M>
class network {
  static_assert(Loss<M>,
                "whale::network: the model must end in a loss (e.g. sequential<..., "
                "softmax_cross_entropy>) so that it can be trained");

 public:
  using model_type = M;
  using input_type = typename M::input_type;

  explicit network(seed s) : network(s, [](M&) {}) {}
  /// `configure(model)` runs before parameters are counted: plans use it to
  /// tell sharded layers their degree and communicators.
  template <class F>
    requires std::invocable<F&, M&>
  network(seed s, F&& configure) {
    configure(model_);
    const index_t n = model_.param_count();
    params_ = tensor<float>({n}, mem_kind::params);
    grads_ = tensor<float>({n}, mem_kind::grads);
    param_binder b(params_.data(), grads_.data(), n);
    model_.bind(b);
    model_.init(counter_rng(s));
  }
  network(const network&) = delete;
  network& operator=(const network&) = delete;

  /// One forward and backward pass; returns this rank's share of the loss.
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    const double loss = model_.forward_loss(c, x, labels);
    c.need_input_grad = false;
    model_.backward_loss(c);
    return loss;
  }
  /// Forward only; returns this rank's share of the loss.
  double evaluate(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    return model_.forward_loss(c, x, labels);
  }
  /// The logits of rows `x` (the model's output before its loss), (rows, classes).
  tensor<float> forward(step_ctx& c, cview<input_type> x) {
    const auto y = model_.forward(c, x);
    tensor<float> out({y.shape()[0], y.numel() / (y.shape()[0] ? y.shape()[0] : 1)}, mem_kind::workspace);
    std::memcpy(out.data(), y.data(), static_cast<std::size_t>(y.numel()) * sizeof(float));
    return out;
  }

  // ---- Trainable (single process): the whole batch, no communication ----
  std::pair<index_t, index_t> local_batch(index_t global_batch) const { return {0, global_batch}; }
  double reduce_loss(double share) const noexcept { return share; }
  double grad_norm() const { return std::sqrt(cpu::sum_squares(grads_.numel(), grads_.data())); }
  int rank() const noexcept { return 0; }
  int world_size() const noexcept { return 1; }
  template <class O> typename O::state make_optimizer_state(const O& opt) const {
    return opt.make_state(param_count());
  }
  /// Scale gradients by `grad_scale` (clipping) and apply one optimizer step.
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, float grad_scale) {
    if (grad_scale != 1.f) cpu::launch(grads_.numel(), kernels::scale{grads_.data(), grad_scale});
    opt.update(s, params_.v(), grads_.v());
  }

  M& model() noexcept { return model_; }
  const M& model() const noexcept { return model_; }
  view<float> params() const noexcept { return params_.v(); }
  view<float> grads() const noexcept { return grads_.v(); }
  index_t param_count() const noexcept { return params_.numel(); }

  friend std::ostream& operator<<(std::ostream& os, const network& n) {
    os << "network: " << n.param_count() << " parameters ("
       << static_cast<double>(n.param_count()) * 4 / 1048576.0 << " MiB)\n";
    M::print_structure(os, 2, M::in_features);
    return os;
  }

 private:
  M model_;
  tensor<float> params_, grads_;
};

}  // namespace whale
