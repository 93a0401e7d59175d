// `wsp_trainer`: HetPipe's Wave Synchronous Parallel over any plan whose data
// replicas are virtual workers (replicate<M>, replicate<pipeline<S, M>>, with
// tensor parallelism inside). No all-reduce between replicas: each pushes its
// wave's update to the parameter holders (runtime/wsp.hpp) and runs ahead of
// the slowest by at most D waves. Semantics: docs/hetero.md.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/comm/trace.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/runtime/wsp.hpp"
#include "whale/train/bf16_weights.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/wsp_options.hpp"
#include "whale/train/wsp_wave.hpp"

namespace whale {

/// Trains `net` (an executor<P> whose data axis holds the virtual workers,
/// ZeRO level 0) under WSP with optimizer `opt`. Each virtual worker runs its
/// rows of every global batch (its slice, as under synchronous data
/// parallelism) forward and backward as if alone (the mean loss of its rows),
/// applies `opt` to its local weights after each minibatch and keeps the sum of
/// its updates; at the end of a wave it pushes that sum, times its share of the
/// global batch, to the holders, advances its clock, waits until no rank is
/// more than D waves behind, and pulls the global weights. The weights a
/// minibatch of wave c uses: those pulled after wave c - 1 (every update of
/// every worker's waves <= c - 1 - D, of its own waves <= c - 1, perhaps more),
/// plus its own local updates of wave c so far.
template <class Net, class Opt> class wsp_trainer {
 public:
  wsp_trainer(context& ctx, Net& net, Opt opt, wsp_options o = {})
      : ctx_(&ctx), net_(&net), opt_(std::move(opt)), o_(o), state_(net.make_optimizer_state(opt_)),
        group_(&ctx.mesh().comm(axis::pipe | axis::model)) {
    static_assert(Net::zero_level == 0,
                  "whale::wsp_trainer: the plan shards parameters over the data axis (shard<..., L>), but Wave "
                  "Synchronous Parallel keeps a whole copy of the model in every virtual worker; drop shard<>");
    if constexpr (requires { net.backend(); }) be_ = net.backend();
    if constexpr (!GatedOptimizer<Opt>)
      if (!be_.on_cpu())
        throw std::invalid_argument(std::string("whale::wsp_trainer: a plan on a device (") + be_.name() +
                                    ") needs an optimizer whose update a flag in the device's memory can gate (sgd, "
                                    "adamw): the checks of a minibatch's loss and norm are made there");
    if constexpr (requires { net.has_tied_head(); })
      if (net.has_tied_head())
        throw std::invalid_argument("whale::wsp_trainer: the model has a tied head (tied_head), whose copy of the token "
                                    "table the parameter holders would update apart from the table (each holder block "
                                    "adds the workers' pushes in its own order); not supported yet: untie the head "
                                    "(linear<D, V, no_bias>) for Wave Synchronous Parallel");
    detail::check_wsp_options(o_, net.options().in_flight, !net.options().memory_caps_mib.empty());
    // The holders' layout. Without tensor parallelism or interleaving a rank holds
    // one range of the model's flat parameters, which the holders keep in model
    // order: workers may then cut their pipelines differently (plan_options::
    // worker_cuts). Otherwise: the concatenation of what each position of a
    // worker (its pipe x model coordinates) holds, the same in every worker.
    const auto& shape = ctx.mesh().shape();
    index_t mine = net.params().numel();
    if (net.model_degree() == 1 && net.chunks() == 1) {
      offset_ = net.full_param_begin();
      total_ = net.total_params();
      if (net.full_param_end() - offset_ != mine)
        throw std::logic_error("whale::wsp_trainer: this rank's parameters are not its range of the model's");
    } else {
      std::tie(offset_, total_) = detail::wsp_position_layout(ctx, mine);
    }
    // Worker 0 (identical to every other at the start) fills the holders.
    const bool first = shape.coord(ctx.rank(), axis::data) == 0;
    holders_.emplace(ctx.world(), total_);
    if (first && mine > 0) {
      std::vector<float> keep;
      holders_->push(be_.host_readable(cview<float>(net.params()), keep), offset_);
    }
    barrier(ctx.world());
    // a wave of one minibatch takes its update from the optimizer's pass: no snapshot, no pass after
    fused_ = fusable && o_.wave == 1 && !o_.in_flight;
    wave_ = detail::wsp_wave(be_, mine, o_.wave, fused_);
    if (wave_.device()) {
      shares_.assign(static_cast<std::size_t>(o_.wave), 0.0);
      wave_steps_.assign(static_cast<std::size_t>(o_.wave), 0);
      // the worker's squares summed over its ranks on the device's own communicator (the checks, clipping)
      if (group_->size() > 1 && net.options().device_collectives)
        dev_group_ = make_device_comm(*group_, be_);
    }
  }

  /// One minibatch, data step `step`: this worker's rows of that global batch,
  /// forward, backward (the loss is the mean over the worker's own rows) and a
  /// local update; at a wave's end the push, the wait and the pull. Returns the
  /// worker's mean loss on its rows on the ranks that compute the loss (the last
  /// stage), 0 elsewhere; no collective between workers.
  template <class Data> double step(Data& data, std::int64_t step);

  /// One wave in flight (wsp_options::in_flight): data steps first ...
  /// first + N_m - 1, this worker's rows of each, as the N_m micro-batches of
  /// one pipelined pass on the weights the wave began with (forward and
  /// backward of every minibatch, at every stage, use that one version: no
  /// weight stashing is needed and none is approximated); then each
  /// minibatch's update in step order (clipped alone if asked), then the push,
  /// the wait and the pull as after any wave. Returns each minibatch's mean
  /// loss on the worker's rows (on the last stage; 0 elsewhere).
  template <class Data> std::vector<double> wave(Data& data, std::int64_t first);

  /// After the last step (collective over the world): pushes a partial wave,
  /// waits until every rank has finished, then every worker pulls the final
  /// global weights, so all end equal.
  void finish() {
    check_usable();
    if (in_wave_ > 0) end_wave(false);
    holders_->finish(o_.poll_us);
    pull();
    barrier(ctx_->world());
  }

  /// Ask every worker to stop at its next wave's end (e.g. a loss target was
  /// reached). A worker's ranks agree on what they saw, so a pipeline stops whole.
  void request_stop() { holders_->request_stop(); }
  /// Publish a number of this rank's (e.g. its worker's recent loss) to every rank.
  void publish(double v) { holders_->publish(v); }
  /// What each rank published, as read at this rank's last wave end (0: nothing yet).
  std::vector<double> published() const {
    std::vector<double> v;
    for (int r = 0; r < ctx_->size(); ++r) v.push_back(holders_->published(r));
    return v;
  }
  /// Whether a stop was seen at the last wave's end (the same on every rank of this worker).
  bool stopping() const noexcept { return stopping_; }
  /// This rank's waves so far.
  const std::vector<wave_record>& waves() const noexcept { return waves_; }
  /// This rank's minibatches so far, with the weights' version each ran on.
  const std::vector<minibatch_record>& minibatches() const noexcept { return minibatches_; }
  std::int64_t clock() const noexcept { return clock_; }
  /// Whether the optimizer's pass writes each wave's update (a wave of one
  /// minibatch, not in flight, with sgd, adamw or another DeltaOptimizer), so
  /// no snapshot of the weights is kept; otherwise the update is the weights
  /// at the wave's end less a snapshot taken at its start.
  bool update_from_optimizer() const noexcept { return fused_; }
  /// The optimizer's state (refused after a fault on a device: its step counts
  /// moved on past the updates the fault gated).
  typename Opt::state& optimizer_state() {
    check_usable();
    return state_;
  }

 private:
  /// Whether the optimizer and the plan can write an update's change in its own
  /// pass (kernels::update_delta: DeltaOptimizer, ZeRO 0).
  static constexpr bool fusable =
      DeltaOptimizer<Opt> && requires(Net& n, const Opt& o, typename Opt::state& s) {
        n.apply_optimizer(o, s, kernels::update_gate{}, kernels::update_delta{});
      };
  /// The optimizer's step on the CPU, the gradients scaled by `scale`; with
  /// fused_, under a gate in host memory, writing the wave's update.
  void host_update(float scale) {
    if constexpr (fusable) {
      if (fused_) {
        host_scale_ = scale;
        return net_->apply_optimizer(opt_, state_, kernels::update_gate{&host_scale_, &host_halt_},
                                     wave_.delta(static_cast<float>(share_)));
      }
    }
    net_->apply_optimizer(opt_, state_, scale);
  }
  /// Every rank of the worker learns whether one saw a non-finite loss (`step`
  /// >= 0: the first such data step on this rank) and all throw alike, before
  /// any update or push: a pipeline's other stages cannot go on without it.
  void check_finite(std::int64_t step) {
    std::int64_t worst[2] = {step >= 0 ? 1 : 0, step >= 0 ? -step : std::numeric_limits<std::int64_t>::min()};
    all_reduce(*group_, view<std::int64_t>(worst, {2}), reduce_op::max);
    if (worst[0] != 0) detail::throw_wsp_fault(-worst[1], 1);
  }
  /// The gradients' scale: `base`, times the clip coefficient of their norm
  /// over this worker (scaled by `base`) when clipping is on.
  float clip_scale(float base, std::int64_t step) {
    if (o_.max_grad_norm <= 0) return base;
    double sq = net_->grad_squares(true);  // each parameter once over this worker's ranks
    all_reduce(*group_, view<double>(&sq, {1}));
    const double norm = std::sqrt(sq) * static_cast<double>(base);
    if (!std::isfinite(norm)) detail::throw_wsp_fault(step, 2);
    return base * clip_coefficient(norm, o_.max_grad_norm);
  }
  void end_wave(bool wait = true);
  void pull() {
    const auto p = net_->params();
    if (p.numel() > 0) wave_.pull_into(p, [&](view<float> to) { holders_->pull(to, offset_); });
  }
  bool bf16() const noexcept { return net_->precision() == whale::precision::bf16; }  // the plan's (plan_options::precision)
  /// On a device, minibatch k's update (its gradients in grads()): the worker's
  /// squared norm summed over its ranks where clipping needs it, the gate
  /// (kernels::wsp_gate: the host's checks and scale), and the update under it.
  /// The host reads nothing.
  void gated_update(int k);
  /// On a device, after the wave's read: the losses, and a faulty minibatch
  /// thrown on every rank of the worker before anything is pushed.
  void check_wave();
  /// On a device a fault is seen at the wave's end, after the optimizer's
  /// step counts moved on past the gated updates: the trainer goes no further.
  void check_usable() const;

  context* ctx_;
  Net* net_;
  Opt opt_;
  wsp_options o_;
  typename Opt::state state_;
  world_comm* group_;
  std::optional<detail::wsp_holders> holders_;
  backend_ref be_;                        // where the worker's weights live (the CPU, or a device)
  detail::wsp_wave wave_;                 // the wave's snapshot, update and (on a device) figures
  tensor<float> master_;                  // bf16: the fp32 weights while a pass computes with them rounded
  std::vector<double> shares_, wave_losses_;  // on a device: what the loss layers returned on the host; the wave's losses
  std::vector<std::int64_t> wave_steps_;  // on a device: the data step of each minibatch of the wave
  std::unique_ptr<device_comm> dev_group_;  // on a device, clipping: the worker's ranks' own communicator
  int in_wave_ = 0;
  bool fused_ = false;                    // the optimizer's pass writes the wave's update (wsp_wave::delta)
  double host_scale_ = 1, host_halt_ = 0;  // fused_ on the CPU: the gate the update runs under
  index_t offset_ = 0, total_ = 0;
  double share_ = 1.0;  // this worker's rows / the global batch
  std::int64_t clock_ = 0, steps_ = 0, least_ = 0;
  bool stopping_ = false;
  std::string spent_;  // on a device: the fault that ended this trainer (empty: none)
  std::size_t wave_records_ = 0;  // minibatches_ before the wave's first
  std::vector<wave_record> waves_;
  std::vector<minibatch_record> minibatches_;
  tensor<typename Net::input_type> x_;  // wave(): the wave's inputs, minibatch after minibatch
  tensor<std::int32_t> y_;              // wave(): their labels
  tensor<float> slots_;                 // wave(): each minibatch's gradients (N_m x this rank's parameters)
};

}  // namespace whale

#include "whale/train/wsp_trainer_run.hpp"  // the larger members' definitions
