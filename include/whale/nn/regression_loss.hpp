// The regression losses on float targets: `mse_loss`, `l1_loss` and
// `huber_loss<Delta>`, each the mean over every target element of the global
// batch (PyTorch's reduction='mean'). Their arithmetic is kernels::regression_rows;
// the class-id loss is softmax_cross_entropy.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/kernels/rows.hpp"
#include "whale/fwd.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

namespace detail {
/// What mse_loss, l1_loss and huber_loss share: float targets, one per input
/// feature, compared elementwise. forward_loss returns this rank's share, the
/// sum of its elements' losses over (global rows x width), so shares add up
/// to the mean over every target element of the global batch; with
/// step_ctx::loss_sum set it adds the share there instead and returns 0.
template <kernels::regression Kind, float Delta>
class regression_loss : public stateless_params {
 public:
  using input_type = float;
  using target_type = float;  // targets, not class ids: a data source gives them as float
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = 1;
  static constexpr index_t target_width = any_features;  // one target per input feature
  static constexpr bool rounds_input_grad = true;       // under bf16 the kernel stores d(input) rounded
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 4;  // difference, loss, slope, scale
    c.act_bytes = 4;  // the gradient, computed in forward
    c.per_feature = true;
    return c;
  }

  // predictions: (R, C), targets: (R, C) -> the loss share; d(predictions) kept for backward_loss.
  double forward_loss(step_ctx& c, cview<float> pred, cview<float> targets) {
    const index_t R = pred.shape().rank() == 2 ? pred.shape()[0] : c.rows();
    if (R == 0 || pred.numel() == 0) return 0.0;
    const index_t C = pred.numel() / R;
    if (C * R != pred.numel() || targets.numel() != pred.numel())
      throw std::invalid_argument(what() + ": " + std::to_string(targets.numel()) + " targets for " +
                                  std::to_string(pred.numel()) + " predictions (" + std::to_string(R) + " rows of " +
                                  std::to_string(C) + "); give one float target per output of the layer before the loss");
    auto& s = st_(c.slot);
    auto g = detail::ensure(s.grad, {R, C});
    const double rows = c.global_rows > 0 ? c.loss_count() : static_cast<double>(R);
    const double n = rows * static_cast<double>(C);
    const double inv = n > 0 ? 1.0 / n : 0.0;
    auto loss = detail::ensure(s.row_loss, {R});
    c.be.launch(R, kernels::regression_rows{pred.data(), targets.data(), g.data(), loss.data(), C, static_cast<float>(inv),
                                            Kind, Delta, c.bf16});
    return loss_share(c, R, loss.data(), inv, s.total);
  }
  view<float> backward_loss(step_ctx& c) { return st_(c.slot).grad.v(); }

 private:
  static std::string what() {
    if constexpr (Kind == kernels::regression::mse) return "whale::mse_loss";
    else if constexpr (Kind == kernels::regression::l1) return "whale::l1_loss";
    else return "whale::huber_loss";
  }
  struct state {
    tensor<float> grad;
    tensor<double> row_loss;
    tensor<double> total;  // the rows' share, when it is read back
  };
  slots<state> st_;
};
}  // namespace detail

/// Mean squared error: the mean over every target element of the global batch
/// of (prediction - target)^2 (PyTorch's MSELoss). Takes float targets (rows,
/// width of its input).
struct mse_loss : detail::regression_loss<kernels::regression::mse, 0.f> {
  static std::string name() { return "mse_loss"; }
};

/// Mean absolute error: the mean over every target element of the global
/// batch of |prediction - target| (PyTorch's L1Loss); its gradient at a zero
/// difference is 0.
struct l1_loss : detail::regression_loss<kernels::regression::l1, 0.f> {
  static std::string name() { return "l1_loss"; }
};

/// Huber loss with threshold Delta (PyTorch's HuberLoss(delta)): per element
/// of difference d, 0.5 d^2 where |d| < Delta, else Delta (|d| - 0.5 Delta);
/// the mean over every target element of the global batch.
template <float Delta>  // Delta defaults to 1 (its declaration in whale/fwd.hpp)
struct huber_loss : detail::regression_loss<kernels::regression::huber, Delta> {
  static_assert(Delta > 0.f, "whale::huber_loss<Delta>: Delta must be positive (PyTorch's HuberLoss needs delta > 0)");
  static std::string name() {
    char b[48];
    std::snprintf(b, sizeof b, "huber_loss<%g>", static_cast<double>(Delta));
    return b;
  }
};

}  // namespace whale
