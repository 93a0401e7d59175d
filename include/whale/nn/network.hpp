// `network<M>`: a model M (a Loss, e.g. a sequential ending in
// softmax_cross_entropy) with its parameters and gradients in two flat,
// huge-page buffers, initialised from a seed. No parallelism here: the
// strategies in strategy/ decide what each rank holds and communicates.
// Given a device backend (a GPU, or the guarded backend), everything the
// network allocates -- parameters, gradients, optimizer state, activations,
// the step's inputs -- lives in that backend's memory, and the host touches
// none of it: see docs/device.md.
#pragma once

#include <cstdint>
#include <ostream>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/nn/layer.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/plan/precision_rule.hpp"

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
  /// On backend `be`: a device backend places everything in its memory (the
  /// backend must outlive the network); the CPU, the default, keeps it on the host.
  network(seed s, backend_ref be) : network(s, [](M&) {}, be) {}
  /// Trained in precision `p` (fp32, or bf16 mixed precision): the trainer
  /// trains a network in its own precision, fp32 unless given here.
  network(seed s, whale::precision p) : network(s, [](M&) {}) { precision_ = p; }
  network(seed s, backend_ref be, whale::precision p) : network(s, [](M&) {}, be) { precision_ = p; }
  /// `configure(model)` runs before parameters are counted: plans use it to
  /// tell sharded layers their degree and communicators.
  template <class F>
    requires std::invocable<F&, M&>
  network(seed s, F&& configure, backend_ref be = {}) : be_(be) {
    configure(model_);
    const index_t n = model_.param_count();
    params_ = tensor<float>({n}, mem_kind::params);
    grads_ = tensor<float>({n}, mem_kind::grads);
    param_binder b(params_.data(), grads_.data(), n);
    model_.bind(b);
    model_.init(counter_rng(s));  // on the host: initialisers are host loops
    tie_heads(b.ties());
    if (!be_.on_cpu()) {          // then into the device's memory, and the layers bound there
      detail::place_params(be_, params_, grads_);
      param_binder d(params_.data(), grads_.data(), n);
      model_.bind(d);
    }
  }
  network(const network&) = delete;
  network& operator=(const network&) = delete;

  /// One forward and backward pass; returns this rank's share of the loss.
  /// On a device, `x` and `labels` are host memory (what a data source gives):
  /// they are copied to the device first.
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    if (!be_.on_cpu()) return on_device(c, [&](cview<input_type> dx, cview<std::int32_t> dl) {
      return train_step_here(c, dx, dl);
    }, x, labels);
    return train_step_here(c, x, labels);
  }
  /// Forward only; returns this rank's share of the loss.
  double evaluate(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    if (!be_.on_cpu()) return on_device(c, [&](cview<input_type> dx, cview<std::int32_t> dl) {
      return model_.forward_loss(c, dx, dl);
    }, x, labels);
    return model_.forward_loss(c, x, labels);
  }
  /// The logits of rows `x` (host memory), (rows, classes), in host memory.
  tensor<float> forward(step_ctx& c, cview<input_type> x) {
    view<float> y;
    if (!be_.on_cpu()) {
      c.be = be_;
      const place_scope on(be_.memory());
      y = model_.forward(c, upload(x, in_));
    } else {
      y = model_.forward(c, x);
    }
    tensor<float> out({y.shape()[0], y.numel() / (y.shape()[0] ? y.shape()[0] : 1)}, mem_kind::workspace);
    be_.copy(out.data(), y.data(), static_cast<std::size_t>(y.numel()) * sizeof(float));
    be_.synchronize();
    return out;
  }

  // ---- Trainable (single process): the whole batch, no communication ----
  std::pair<index_t, index_t> local_batch(index_t global_batch) const { return {0, global_batch}; }
  double reduce_loss(double share) const noexcept { return share; }
  /// The gradients' norm, each parameter once (a tied head's copy of its table not counted).
  double grad_norm() const {
    if (ties_.empty()) return std::sqrt(be_.sum_squares(grads_.numel(), grads_.data()));
    double sq = 0;
    for (auto [b, e] : counted_) sq += be_.sum_squares(e - b, grads_.data() + b);
    return std::sqrt(sq);
  }
  /// *out = the gradients' sum of squares, with `out` in the network's memory
  /// and nothing read back (the square of grad_norm(), to the bit, without a tied head).
  void grad_sum_squares_into(double* out) const {
    if (ties_.empty()) return be_.sum_squares_into(grads_.numel(), grads_.data(), out);
    double* parts = part_sums_.data();
    for (std::size_t k = 0; k < counted_.size(); ++k)
      be_.sum_squares_into(counted_[k].second - counted_[k].first, grads_.data() + counted_[k].first, parts + k);
    be_.sum_into(static_cast<index_t>(counted_.size()), parts, 1.0, out, false);
  }
  /// The tied heads (tied_head): each one's flat range and its table's.
  const std::vector<param_binder::tie>& ties() const noexcept { return ties_; }
  int rank() const noexcept { return 0; }
  int world_size() const noexcept { return 1; }
  /// The optimizer's state, in the network's memory (the device's, on one).
  template <class O> typename O::state make_optimizer_state(const O& opt) const {
    const place_scope on(be_.memory());
    return opt.make_state(param_count());
  }
  /// Scale gradients by `grad_scale` (clipping) and apply one optimizer step, on the network's backend.
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, float grad_scale) {
    if (grad_scale != 1.f) be_.launch(grads_.numel(), kernels::scale{grads_.data(), grad_scale});
    update_on(be_, opt, s, params_.v(), grads_.v());
  }
  /// One optimizer step under `gate` (in the network's memory): the
  /// gradients scaled by *gate.scale as they are read, nothing changed while
  /// *gate.halt is non-zero. The host reads neither.
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, kernels::update_gate gate) {
    update_on(be_, opt, s, params_.v(), grads_.v(), gate);
  }
  /// The same, for bf16 mixed precision with the master weights apart:
  /// `master` (as many floats as params()) is updated, and its new values
  /// rounded to bf16 are written into params() in the same pass.
  template <class O>
  void apply_optimizer(const O& opt, typename O::state& s, kernels::update_gate gate, view<float> master) {
    if (master.numel() != params_.numel())
      throw std::invalid_argument("whale::network::apply_optimizer: the master weights hold " +
                                  std::to_string(master.numel()) + " values for " + std::to_string(params_.numel()) +
                                  " parameters");
    update_on(be_, opt, s, master, grads_.v(), gate, params_.data());
  }

  M& model() noexcept { return model_; }
  const M& model() const noexcept { return model_; }
  /// The flat parameters and gradients where they live: on a device backend,
  /// device memory (read them with params_on_host / grads_on_host).
  view<float> params() const noexcept { return params_.v(); }
  view<float> grads() const noexcept { return grads_.v(); }
  index_t param_count() const noexcept { return params_.numel(); }
  /// The backend the network computes on and keeps its memory in.
  const backend_ref& backend() const noexcept { return be_; }
  /// The number format the trainer trains the network in (its constructor's; fp32 by default).
  whale::precision precision() const noexcept { return precision_; }
  /// Copies in host memory, wherever the network lives.
  std::vector<float> params_on_host() const { return to_host(params_); }
  std::vector<float> grads_on_host() const { return to_host(grads_); }

 private:
  /// Host values into device buffer `buf` (reused from step to step).
  template <class T> cview<T> upload(cview<T> host, tensor<T>& buf) {
    buf.resize(host.shape());
    be_.copy(buf.data(), host.data(), host.bytes());
    return buf.v();
  }
  /// Run `f` on device copies of `x` and `labels`, with everything it allocates
  /// in the device's memory and every call on its backend.
  template <class F>
  double on_device(step_ctx& c, F&& f, cview<input_type> x, cview<std::int32_t> labels) {
    c.be = be_;
    const place_scope on(be_.memory());
    const auto dx = upload(x, in_);
    const auto dl = upload(labels, labels_);
    // the layers check token ids and labels on the host copies, without waiting for the device
    c.mirrors[0] = {dx.data(), x.data(), static_cast<std::size_t>(x.bytes())};
    c.mirrors[1] = {dl.data(), labels.data(), static_cast<std::size_t>(labels.bytes())};
    struct clear {  // the host buffers are the caller's: forget them after the pass
      step_ctx& c;
      ~clear() { c.mirrors = {}; }
    } forget{c};
    return f(dx, dl);
  }
  double train_step_here(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    if (c.accumulate && !ties_.empty())
      throw std::invalid_argument("whale::network: accumulating gradients across train_step calls (step_ctx::accumulate) "
                                  "is not supported with a tied head (tied_head): each call sums its gradients with the table's");
    const double loss = model_.forward_loss(c, x, labels);
    c.need_input_grad = false;
    model_.backward_loss(c);
    for (const auto& t : ties_)  // the head and its table both take the sum of their gradients
      be_.launch(t.count, kernels::tie_sum{grads_.data() + t.table, grads_.data() + t.head});
    return loss;
  }
  /// After binding and initialising: each tied head starts as its table, and
  /// the norm counts every range but the heads'.
  void tie_heads(const std::vector<param_binder::tie>& ties) {
    for (const auto& t : ties) {
      if (t.table < 0)
        throw std::invalid_argument("whale::network: tied_head<" + std::to_string(t.rows) + ", " + std::to_string(t.cols) +
                                    "> (at parameter " + std::to_string(t.head) + ") ties its weight to the token table, but no embedding<" +
                                    std::to_string(t.rows) + ", " + std::to_string(t.cols) +
                                    "> comes before it that another tied head does not take");
      std::memcpy(params_.data() + t.head, params_.data() + t.table, static_cast<std::size_t>(t.count) * sizeof(float));
    }
    ties_ = ties;
    if (ties_.empty()) return;
    std::vector<std::pair<index_t, index_t>> heads;
    for (const auto& t : ties_) heads.push_back({t.head, t.head + t.count});
    std::sort(heads.begin(), heads.end());
    index_t at = 0;
    for (auto [b, e] : heads) {
      if (b > at) counted_.push_back({at, b});
      at = e;
    }
    if (params_.numel() > at) counted_.push_back({at, params_.numel()});
    const place_scope on(be_.memory());
    part_sums_ = tensor<double>({static_cast<index_t>(counted_.size()) + 1}, mem_kind::workspace);
  }
  std::vector<float> to_host(const tensor<float>& t) const {
    std::vector<float> h(static_cast<std::size_t>(t.numel()));
    be_.copy(h.data(), t.data(), h.size() * sizeof(float));
    be_.synchronize();
    return h;
  }

 public:
  friend std::ostream& operator<<(std::ostream& os, const network& n) {
    os << "network: " << n.param_count() << " parameters ("
       << static_cast<double>(n.param_count()) * 4 / 1048576.0 << " MiB)\n";
    M::print_structure(os, 2, M::in_features);
    return os;
  }

 private:
  backend_ref be_;  // where the network computes and keeps its memory
  whale::precision precision_ = whale::precision::fp32;  // what the trainer trains it in
  M model_;
  tensor<float> params_, grads_;
  tensor<input_type> in_;       // the step's inputs and labels on a device
  tensor<std::int32_t> labels_;
  std::vector<param_binder::tie> ties_;              // tied heads and their tables
  std::vector<std::pair<index_t, index_t>> counted_;  // with ties: the ranges the norm counts
  mutable tensor<double> part_sums_;                        // with ties: their sums of squares (the network's memory)
};

}  // namespace whale
