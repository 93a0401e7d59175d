// `softmax_cross_entropy`: fused, numerically stable softmax + negative
// log-likelihood over integer labels. The unsplit loss; the class-split form
// (distributed max and sum) is in strategy/.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "whale/backend/kernels/rows.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// Mean cross-entropy over the labels of the global batch. forward_loss returns
/// this rank's rows' share (sum of their losses / step_ctx::loss_count()), so
/// shares add up to the mean; with step_ctx::loss_sum set it adds the share
/// there instead, in the backend's memory, and returns 0. A row labelled ignore_index adds no loss and
/// gets a zero gradient.
struct softmax_cross_entropy : stateless_params {
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = 1;
  static constexpr bool rounds_input_grad = true;  // under bf16 the kernel stores d(logits) rounded
  static constexpr bool rounds_input_on_read = true;  // and reads the logits rounded
  static std::string name() { return "softmax_cross_entropy"; }
  static constexpr cost_info cost() {
    cost_info c;
    c.fwd_flops = 4;
    c.bwd_flops = 2;
    c.act_bytes = 4;  // the probabilities, reused as the gradient
    c.per_feature = true;
    return c;
  }

  // logits: (R, C), labels: (R) -> loss share; d(logits) kept for backward_loss.
  double forward_loss(step_ctx& c, cview<float> logits, cview<std::int32_t> labels) {
    const index_t R = labels.numel();
    if (R == 0) return 0.0;
    const index_t C = logits.numel() / R;
    if (C * R != logits.numel())
      throw std::invalid_argument("whale::softmax_cross_entropy: " + std::to_string(logits.numel()) +
                                  " logits do not form " + std::to_string(R) + " rows");
    auto& s = st_(c.slot);
    auto p = detail::ensure(s.grad, {R, C});
    const double n = c.global_rows > 0 ? c.loss_count() : static_cast<double>(R);
    const double inv = n > 0 ? 1.0 / n : 0.0;
    std::vector<std::int32_t> host_labels;  // the labels on the host, when they are on a device
    const auto readable = host_values(c, labels, host_labels);
    for (index_t r = 0; r < R; ++r) {
      const std::int32_t y = readable[r];
      if (y != ignore_index && (y < 0 || y >= C))
        throw std::out_of_range("whale::softmax_cross_entropy: label " + std::to_string(y) +
                                " out of range for " + std::to_string(C) + " classes (ignore_index is " +
                                std::to_string(ignore_index) + ")");
    }
    auto loss = detail::ensure(s.row_loss, {R});
    c.be.launch(R, kernels::cross_entropy_rows{logits.data(), labels.data(), p.data(), loss.data(), C,
                                               static_cast<float>(inv), ignore_index, c.bf16});
    return detail::loss_share(c, R, loss.data(), inv, s.total);
  }
  view<float> backward_loss(step_ctx& c) { return st_(c.slot).grad.v(); }

 private:
  struct state {
    tensor<float> grad;
    tensor<double> row_loss;
    tensor<double> total;  // the rows' share, when it is read back
  };
  slots<state> st_;
};

}  // namespace whale
