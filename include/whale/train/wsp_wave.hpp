// One wave of a virtual worker under Wave Synchronous Parallel
// (train/wsp_trainer.hpp), where the worker's weights live: their snapshot at
// the wave's start, the wave's update (the weights less the snapshot, weighed
// by the worker's share of the global batch), and, on a device, the wave's
// figures (each minibatch's loss, the worker's squared norm, the gradients'
// scale and the fault), which stay there until the wave's one read. Not a
// template: the same code for every model.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/optim.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale::detail {

class wsp_wave {
 public:
  wsp_wave() = default;
  /// For a rank of `params` weights on `be`, and waves of `minibatches`.
  /// `from_optimizer`: the optimizer's pass writes the update (delta(); a wave
  /// of one minibatch), so no snapshot is kept and none is taken.
  wsp_wave(const backend_ref& be, index_t params, int minibatches, bool from_optimizer = false)
      : be_(be), n_(minibatches), params_(params), padded_(params + params % 2), from_optimizer_(from_optimizer) {
    const place_scope on(be_.memory());  // on a device: all of it there
    if (!from_optimizer_) snapshot_ = tensor<float>({std::max<index_t>(1, params)}, mem_kind::workspace);
    // the update, then (on a device, 8-byte aligned) the figures: one copy brings both to the host
    delta_ = tensor<float>({std::max<index_t>(1, padded_ + (device() ? 2 * figure_count() : 0))}, mem_kind::workspace);
    if (device()) {
      be_.fill_zero(delta_.data(), delta_.v().bytes());
      host_.resize(static_cast<std::size_t>(padded_ + 8 * static_cast<index_t>(n_)));  // never grown while a copy may read it
    }
  }

  bool device() const noexcept { return !be_.on_cpu(); }
  /// The wave's start: the weights' snapshot, and the figures zeroed (the
  /// losses are added there; the halt flag cleared).
  void begin(cview<float> p) {
    if (!from_optimizer_) be_.copy(snapshot_.data(), p.data(), p.bytes());
    if (device()) be_.fill_zero(figure(0, 0), static_cast<std::size_t>(figure_count()) * sizeof(double));
  }
  /// On a device: where minibatch k's loss share is added (step_ctx::loss_sum;
  /// in flight, the wave's k minibatches' at loss(0) + k), and where the
  /// worker's squared gradient norm goes.
  double* loss(int k) { return figure(0, k); }
  double* squares(int k) { return figure(1, k); }
  /// On a device, before the worker's squares are summed: squares(k) set to
  /// NaN where minibatch k's loss (on the device, plus `host_share`) is not
  /// finite, so that the stages without the loss see the fault too.
  void poison_on_bad_loss(int k, double host_share) {
    be_.launch(1, kernels::poison_on_bad_loss{figure(0, k), host_share, figure(1, k)});
  }
  /// On a device: minibatch k's gate, kernels::wsp_gate (the host's checks and
  /// the gradients' scale, made where the figures are); the update it gives.
  kernels::update_gate gate(int k, double host_share, const double* squares, float base, double max_norm) {
    be_.launch(1, kernels::wsp_gate{figure(0, k), host_share, squares, figure(2, k), figure(3, k), halt(), base, max_norm,
                                    static_cast<double>(k + 1)});
    return {figure(2, k), halt()};
  }
  /// On a device inside a wave: minibatch k's loss share as added there, read
  /// now (the host waits).
  double loss_now(int k) const {
    std::vector<double> keep;
    return be_.host_readable(cview<double>(figure(0, k), {1}), keep)[0];
  }
  /// With `from_optimizer`: where the optimizer's pass writes the wave's
  /// update, (its new weights - its old) x share.
  kernels::update_delta delta(float share) const noexcept { return {delta_.data(), share}; }
  bool from_optimizer() const noexcept { return from_optimizer_; }
  /// The wave's end: the update (p - snapshot) x share (or, `from_optimizer`,
  /// as the optimizer wrote it), readable by the host.
  /// On a device it comes up with the figures, in one copy and one wait;
  /// device_loss() and fault() then read them.
  cview<float> update(cview<float> p, float share) {
    if (!from_optimizer_) be_.launch(p.numel(), kernels::scaled_difference{p.data(), snapshot_.data(), delta_.data(), share});
    if (!device()) return cview<float>(delta_.data(), {p.numel()});
    const index_t floats = padded_ + 8 * static_cast<index_t>(n_);  // the update and figures 0-3
    uploading_ = false;  // the synchronisation below ends any copy up from host_
    if (host_.size() < static_cast<std::size_t>(floats)) host_.resize(static_cast<std::size_t>(floats));
    be_.copy(host_.data(), delta_.data(), static_cast<std::size_t>(floats) * sizeof(float));
    be_.synchronize();
    figures_.resize(4 * static_cast<std::size_t>(n_));
    std::memcpy(figures_.data(), host_.data() + padded_, figures_.size() * sizeof(double));
    return cview<float>(host_.data(), {p.numel()});
  }
  /// After update() on a device: minibatch k's loss share added there, and its
  /// fault (0: none; 1: the loss was not finite; 2: the norm clipping needs was not).
  double device_loss(int k) const { return figures_[static_cast<std::size_t>(k)]; }
  int fault(int k) const { return static_cast<int>(figures_[static_cast<std::size_t>(3 * n_ + k)]); }
  /// The weights pulled from the holders into `p`: `fill(host)` writes them
  /// to host memory (on the CPU, `p` itself), which is then copied up, queued.
  /// A second pull before the next update() (finish() after a wave's end)
  /// first waits for the copy before it.
  template <class Fill> void pull_into(view<float> p, Fill&& fill) {
    if (!device()) return fill(p);
    if (uploading_) be_.synchronize();
    if (host_.size() < static_cast<std::size_t>(p.numel())) host_.resize(static_cast<std::size_t>(p.numel()));
    const view<float> h(host_.data(), {p.numel()});
    fill(h);
    be_.copy(p.data(), h.data(), p.bytes());
    uploading_ = true;
  }

 private:
  /// 4 figures a minibatch (loss, squares, scale, fault: part 0-3), then the halt flag.
  index_t figure_count() const noexcept { return 4 * static_cast<index_t>(n_) + 1; }
  double* figure(int part, int k) const {
    return reinterpret_cast<double*>(delta_.data() + padded_) + part * n_ + k;
  }
  double* halt() const { return figure(4, 0); }

  backend_ref be_;
  int n_ = 1;
  index_t params_ = 0, padded_ = 0;  // this rank's weights; where the figures start in delta_
  tensor<float> snapshot_, delta_;
  std::vector<float> host_;       // on a device: the update (and figures) read, and the weights pulled
  std::vector<double> figures_;   // on a device: figures 0-3 of the last read
  bool uploading_ = false;        // on a device: a copy up from host_ may still be queued
  bool from_optimizer_ = false;   // the optimizer writes the update (no snapshot)
};

}  // namespace whale::detail
