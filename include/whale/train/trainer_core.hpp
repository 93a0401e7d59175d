// The part of trainer<Net, Opt> (train/trainer.hpp) that does not depend on
// the network, the optimizer or the data: one class whatever they are,
// compiled once per program (once per build with the compiled core,
// detail/compiled.hpp), not once per network and optimizer. It holds the
// options, the progress record, the bf16 master weights and the steps queued
// on a device, and does a step's work around the network's pass: the loss
// check, the gradient norm and clipping, the learning rate, the update, the
// device's step records read back, the progress line and the loop of run().
// It asks trainer<Net, Opt> for what only the network and optimizer know
// through a few virtual functions, and runs the typed pass (the batch into the
// network) through a callback.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/optim.hpp"
#include "whale/detail/compiled.hpp"
#include "whale/nn/layer.hpp"
#include "whale/tensor/tensor.hpp"
#include "whale/train/metrics.hpp"
#include "whale/train/run_record.hpp"
#include "whale/train/trainer_options.hpp"

namespace whale::detail {

/// A callable borrowed for one call (it must outlive the call): what the
/// trainer's core calls back into trainer<Net, Opt> with, without a template.
template <class Sig> class callback;
template <class R, class... A> class callback<R(A...)> {
 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, callback> && std::is_invocable_r_v<R, F&, A...>)
  callback(F& f) noexcept  // NOLINT: implicit, as a function reference is
      : obj_(static_cast<void*>(&f)), call_([](void* o, A... a) -> R { return (*static_cast<F*>(o))(std::forward<A>(a)...); }) {}
  R operator()(A... a) const { return call_(obj_, std::forward<A>(a)...); }

 private:
  void* obj_;
  R (*call_)(void*, A...);
};

/// What trainer_core knows of its network and optimizer, as values (trainer<Net, Opt> fills them).
struct trainer_traits {
  /// The network's precision (plan_options::precision, or network<M>'s constructor): the one the trainer trains in.
  whale::precision precision = whale::precision::fp32;
  /// The network and optimizer can keep a step's figures where the step runs (trainer_options::log_every > 1).
  bool figures_on_device = false;
  /// Under bf16 with queued steps, the optimizer writes the rounded weights and the fp32 master in one pass (RoundingOptimizer).
  bool writes_rounded = false;
  /// Model FLOPs of a step: flops_per_row × rows + 3 × seq_flops_per_token × rows × seq (model_flops).
  double flops_per_row = 0, seq_flops_per_token = 0;
};

/// trainer<Net, Opt>'s work that does not depend on its types (see the file's comment).
class trainer_core {
 public:
  trainer_core(const trainer_core&) = delete;
  trainer_core& operator=(const trainer_core&) = delete;

  /// The data step run() trains next (first_step, advanced by run() and by load()).
  std::int64_t next_step() const noexcept { return next_; }

 protected:
  trainer_core(trainer_options o, trainer_traits t) : o_(std::move(o)), traits_(t), next_(o_.first_step) {}
  virtual ~trainer_core() = default;

  // ---- what trainer<Net, Opt> answers ----
  virtual double net_reduce_loss(double share) = 0;
  virtual double net_grad_norm() = 0;
  /// The first layer (flat order) with a non-finite gradient, named; empty if none (collective for a plan).
  virtual std::string net_first_nonfinite_grad() = 0;
  virtual int net_rank() const = 0;
  virtual int net_world_size() const = 0;
  virtual backend_ref net_backend() const = 0;
  /// The parameters this rank computes with; empty for a network that does not expose them.
  virtual view<float> net_params() = 0;
  /// The optimizer step of this rank's range, the gradients scaled by `grad_scale` (ZeRO 1-2 then gather).
  virtual void update(float grad_scale) = 0;
  /// The same on the device, under `gate` (figures_on_device); `into_master`: the fp32 master
  /// weights (master_) updated too, the parameters written rounded (writes_rounded).
  virtual void update_gated(kernels::update_gate gate, bool into_master) = 0;
  /// *out = the squared gradient norm, in the backend's memory (figures_on_device).
  virtual void net_grad_sum_squares_into(double* out) = 0;
  /// The optimizer's learning rate (`lr`), if it has one.
  virtual bool has_lr() const = 0;
  virtual double lr() const = 0;
  virtual void set_optimizer_lr(double lr) = 0;
  /// `k` updates undone in the optimizer's step count, where it keeps one (a queued step that faulted).
  virtual void rewind_optimizer(std::int64_t k) = 0;

  // ---- the work ----
  /// The step's context for a batch of `sequences` sequences of `seq` tokens, of
  /// `global_batch`, of which `loss_terms` labels count (-1: all).
  step_ctx context(index_t sequences, index_t seq, index_t global_batch, std::int64_t loss_terms) const;
  /// One step whose pass is `pass` (the batch into the network): the loss
  /// reduced and checked, the gradient norm and clipping, the learning rate,
  /// the update. Returns the global mean loss.
  double step_with(step_ctx c, std::int64_t step, callback<double(step_ctx&)> pass);
  /// A forward-only pass (`pass`) under bf16's rounded weights where set: the global mean loss.
  double evaluate_with(step_ctx c, callback<double(step_ctx&)> pass);
  /// Before a queued step fetches its batch: the first of a read's steps starts their clock.
  void start_queued_clock() {
    if (queue_.empty()) queued_since_ = std::chrono::steady_clock::now();
  }
  /// One step queued on the device (start_queued_clock first): forward and backward with the loss added
  /// into its record, the gradients' sum of squares there, the check and the
  /// clipping scale (kernels::check_step), and the update gated by them. The
  /// host waits for none of it.
  void queue_with(step_ctx c, std::int64_t step, callback<double(step_ctx&)> pass);
  /// Read the queued steps' figures (the host's one wait), check them in
  /// order and report each; a faulty step throws, its updates and those after
  /// it undone in the host's counts (the device made none).
  void read_queued(index_t rows, index_t seq, train_result* r);
  /// What run() does for `n` steps once started: each step (`step`, or queued by
  /// `queue` with the figures read every log_every steps), a save every
  /// save_every steps (`save`, null without checkpoints), an evaluation every
  /// eval_every (`eval`, null without evaluation data). `rows`, `seq`: a step's.
  struct loop {
    callback<double(std::int64_t)> step;
    callback<void(std::int64_t)> queue;
    const callback<void()>* save = nullptr;
    const callback<void()>* eval = nullptr;
    index_t rows = 0, seq = 0;
  };
  void run_loop(std::int64_t n, const loop& l, train_result& r);
  /// The progress line, the metrics log, on_step and the divergence watch for one step.
  void report(std::int64_t step, double loss, double dt, index_t rows, index_t seq);
  /// trainer_options::lr_schedule's rate for data step `step`, set on the optimizer.
  void set_lr(std::int64_t step);
  std::string at(std::int64_t step) const { return run_record::at(o_, step); }
  std::runtime_error loss_error(std::int64_t step, double loss) const { return run_record::loss_error(o_, step, loss); }
  /// `locate`: the gradients are this step's, so the first non-finite layer can be named (collective for a plan).
  std::runtime_error norm_error(std::int64_t step, double norm, double loss, bool locate);

  bool bf16() const noexcept { return traits_.precision == precision::bf16; }
  /// Whether steps are queued on the device (their figures read every log_every steps).
  bool deferring() const noexcept { return traits_.figures_on_device && o_.log_every > 1 && !o_.check_finite; }
  /// Under bf16 with queued steps and an optimizer that writes rounded copies:
  /// the queued steps keep the fp32 master weights in master_ and the
  /// parameters rounded to bf16 from one step to the next, until the host
  /// reads the steps' figures (rounded_ says which holds).
  bool keeps_rounded() const noexcept { return traits_.writes_rounded && bf16(); }
  /// The parameters bf16 rounds (empty in fp32, or for a network without params()).
  view<float> local_params() { return bf16() ? net_params() : view<float>{}; }
  /// The first queued step's rounding: the fp32 weights into master_, the parameters rounded in place.
  void round_weights_once();
  /// The fp32 master weights back into the parameters, where the queued steps left them rounded.
  void put_master_back();

  /// A queued step, until its figures are read.
  struct queued {
    std::int64_t step;
    double share;  // what the loss layers returned on the host (0 when all of it went to the device)
    double lr;
  };
  kernels::step_figures* figure(std::size_t k) { return reinterpret_cast<kernels::step_figures*>(figures_.data()) + k; }
  double* halt() { return figures_.data() + 4 * o_.log_every; }

  trainer_options o_;
  trainer_traits traits_;
  std::int64_t next_ = 0;
  bool resumed_ = false;
  tensor<float> master_{shape{0}, mem_kind::params};  // bf16: the fp32 master weights during a step
  bool rounded_ = false;  // the parameters hold the rounded weights and master_ the fp32 ones (keeps_rounded)
  tensor<double> figures_{shape{0}, mem_kind::workspace};  // log_every > 1: log_every step_figures, then the halt flag
  std::vector<double> figures_host_;                        // their copy on the host, when read
  std::vector<queued> queue_;                               // steps queued since the last read
  std::chrono::steady_clock::time_point queued_since_;
  run_record rec_;  // the progress line, the metrics log, the divergence watch, the last checkpoint
};

}  // namespace whale::detail

#if WHALE_CORE_DEFINITIONS  // header-only, or the compiled core's own unit (detail/compiled.hpp)
#include "whale/train/trainer_core_impl.hpp"
#endif
