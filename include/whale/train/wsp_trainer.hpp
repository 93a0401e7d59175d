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
    wave_ = detail::wsp_wave(be_, mine, o_.wave);
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
  template <class Data> double step(Data& data, std::int64_t step) {
    static_assert(detail::data_source_for<Data, typename Net::input_type, loss_target_t<typename Net::model_type>>(),
                  "whale::wsp_trainer::step: the data is not a DataSource for this network (see train/data_source.hpp)");
    check_usable();
    if (o_.in_flight)
      throw std::logic_error("whale::wsp_trainer::step: with wsp_options::in_flight a wave's minibatches run "
                             "together; call wave(data, first_step) once per wave");
    const index_t global = data.global_batch();
    const auto [begin, count] = net_->local_batch(global);
    const auto b = data.get(step, begin, count);
    if (auto why = detail::batch_problem<typename Net::model_type>(b, begin, count, global, data.seq()); !why.empty())
      throw std::runtime_error("whale::wsp_trainer: data step " + std::to_string(step) + ": " + why);
    if (in_wave_ == 0) {
      wave_.begin(net_->params());
      wave_records_ = minibatches_.size();
    }
    step_ctx c;
    c.batch = b.sequences;
    c.seq = b.seq;
    c.global_rows = global * b.seq;
    c.bf16 = bf16();
    share_ = static_cast<double>(count) / static_cast<double>(global);
    const int k = in_wave_;
    if (wave_.device()) c.loss_sum = wave_.loss(k);  // the loss, the checks and the scale stay there
    // the loss's rows are the global batch's; the worker trains as if alone on its
    // own rows: its mean loss, and gradients scaled up by global / count
    double share = 0;
    {
      detail::bf16_weights w(bf16(), net_->params(), master_, be_);
      share = net_->compute_only_step(c, b.inputs, detail::labels_of(b));
      w.restore();
    }
    if (wave_.device()) {
      shares_[static_cast<std::size_t>(k)] = share;
      wave_steps_[static_cast<std::size_t>(k)] = step;
      minibatches_.push_back({step, clock_, steps_, least_});
      gated_update(k);
      const bool ends = ++in_wave_ == o_.wave;
      if (ends) end_wave();
      ++steps_;
      // inside a wave: this minibatch's loss read now (a host wait; its checks come at the wave's end)
      return ends ? wave_losses_[static_cast<std::size_t>(k)] : (share + wave_.loss_now(k)) / share_;
    }
    const double loss = share / share_;
    check_finite(std::isfinite(loss) ? -1 : step);
    minibatches_.push_back({step, clock_, steps_, least_});
    net_->apply_optimizer(opt_, state_, clip_scale(static_cast<float>(1.0 / share_), step));
    if (++in_wave_ == o_.wave) end_wave();
    ++steps_;
    return loss;
  }

  /// One wave in flight (wsp_options::in_flight): data steps first ...
  /// first + N_m - 1, this worker's rows of each, as the N_m micro-batches of
  /// one pipelined pass on the weights the wave began with (forward and
  /// backward of every minibatch, at every stage, use that one version: no
  /// weight stashing is needed and none is approximated); then each
  /// minibatch's update in step order (clipped alone if asked), then the push,
  /// the wait and the pull as after any wave. Returns each minibatch's mean
  /// loss on the worker's rows (on the last stage; 0 elsewhere).
  template <class Data> std::vector<double> wave(Data& data, std::int64_t first) {
    static_assert(detail::data_source_for<Data, typename Net::input_type, loss_target_t<typename Net::model_type>>(),
                  "whale::wsp_trainer::wave: the data is not a DataSource for this network (see train/data_source.hpp)");
    check_usable();
    if (!o_.in_flight)
      throw std::logic_error("whale::wsp_trainer::wave: set wsp_options::in_flight to run a wave's minibatches in "
                             "flight together; without it call step() once per minibatch");
    const int n = o_.wave;
    const index_t global = data.global_batch();
    const auto [begin, count] = net_->local_batch(global);
    index_t seq = 1, in_row = 0, label_row = 0;
    for (int k = 0; k < n; ++k) {  // the wave's minibatches, one after another
      const auto b = data.get(first + k, begin, count);
      if (auto why = detail::batch_problem<typename Net::model_type>(b, begin, count, global, data.seq()); !why.empty())
        throw std::runtime_error("whale::wsp_trainer: data step " + std::to_string(first + k) + ": " + why);
      if (k == 0) {
        seq = b.seq;
        in_row = b.inputs.numel() / std::max<index_t>(1, count);
        label_row = b.labels.numel() / std::max<index_t>(1, count);
        if (!(x_.shape() == b.inputs.shape().with_rows(count * n)))
          x_ = tensor<typename Net::input_type>(b.inputs.shape().with_rows(count * n), mem_kind::workspace);
        // the label buffer (layer.hpp): a label, or a row's float targets' bits, per row
        const shape ys = label_row == 1 || seq > 1 ? shape{count * n * label_row} : shape{count * n, label_row};
        if (!(y_.shape() == ys)) y_ = tensor<std::int32_t>(ys, mem_kind::workspace);
      }
      if (b.seq != seq || b.inputs.numel() != count * in_row || b.labels.numel() != count * label_row)
        throw std::invalid_argument("whale::wsp_trainer::wave: the minibatches of one wave differ in shape (step " +
                                    std::to_string(first + k) + ")");
      std::copy_n(b.inputs.data(), count * in_row, x_.data() + k * count * in_row);
      std::memcpy(y_.data() + k * count * label_row, b.labels.data(),
                  static_cast<std::size_t>(count * label_row) * sizeof(std::int32_t));
    }
    wave_.begin(net_->params());
    wave_records_ = minibatches_.size();
    const index_t np = net_->params().numel();
    if (slots_.numel() < std::max<index_t>(1, np * n)) {
      const place_scope on(be_.memory());
      slots_ = tensor<float>({std::max<index_t>(1, np * n)}, mem_kind::workspace);
    }
    share_ = static_cast<double>(count) / static_cast<double>(global);
    step_ctx c;
    c.batch = count * n;
    c.seq = seq;
    c.global_rows = global * seq;  // as step(): shares of the global batch, scaled up by global / count below
    const bool device = wave_.device();
    if (device) c.loss_sum = wave_.loss(0);  // minibatch k's at wave_.loss(k)
    const auto g = net_->grads();
    const auto bytes = static_cast<std::size_t>(np) * sizeof(float);
    c.bf16 = bf16();
    std::vector<double> shares;
    {
      detail::bf16_weights w(bf16(), net_->params(), master_, be_);  // every minibatch on the wave's first weights
      shares = net_->in_flight_step(c, x_.v(), y_.v(), n, [&](int k) {
        be_.copy(slots_.data() + static_cast<index_t>(k) * np, g.data(), bytes);
      });
      w.restore();
    }
    if (device) {  // the checks at the wave's end, where the figures are read
      for (int k = 0; k < n; ++k) {
        shares_[static_cast<std::size_t>(k)] = shares[static_cast<std::size_t>(k)];
        wave_steps_[static_cast<std::size_t>(k)] = first + k;
        minibatches_.push_back({first + k, clock_, steps_, least_});
      }
      for (int k = 0; k < n; ++k) {  // the wave's updates, in step order
        be_.copy(g.data(), slots_.data() + static_cast<index_t>(k) * np, bytes);
        gated_update(k);
        ++steps_;
      }
      in_wave_ = n;
      end_wave();
      return wave_losses_;
    }
    std::vector<double> losses(shares.begin(), shares.end());
    std::int64_t bad = -1;  // the first minibatch whose loss is not finite
    for (int k = n - 1; k >= 0; --k) {
      losses[static_cast<std::size_t>(k)] /= share_;  // the mean over the worker's rows
      if (!std::isfinite(losses[static_cast<std::size_t>(k)])) bad = first + k;
    }
    check_finite(bad);
    for (int k = 0; k < n; ++k) minibatches_.push_back({first + k, clock_, steps_, least_});
    for (int k = 0; k < n; ++k) {  // the wave's updates, in step order
      be_.copy(g.data(), slots_.data() + static_cast<index_t>(k) * np, bytes);
      net_->apply_optimizer(opt_, state_, clip_scale(static_cast<float>(1.0 / share_), first + k));
      ++steps_;
    }
    in_wave_ = n;
    end_wave();
    return losses;
  }

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
  /// The optimizer's state (refused after a fault on a device: its step counts
  /// moved on past the updates the fault gated).
  typename Opt::state& optimizer_state() {
    check_usable();
    return state_;
  }

 private:
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
  void end_wave(bool wait = true) {
    auto& tr = net_->trace_recorder();  // the executor's timeline (plan_options::trace), when on
    const auto t0 = std::chrono::steady_clock::now();
    // the worker's update weighs as its share of the global batch: with SGD (linear
    // in the gradients) the pushed updates add up to the update of the whole batch
    const auto p = net_->params();
    const auto update = wave_.update(p, static_cast<float>(share_));  // on a device: the wave's one wait
    if (wave_.device()) check_wave();  // before anything is pushed: a faulty minibatch throws here
    // No rank may still be about to pull wave clock_ - D: this push would leak into
    // its weights (with D = 0 every worker then pulls exactly the synchronous weights).
    auto& h = *holders_;
    h.wait([&] { return h.min_pulled() >= clock_ - o_.staleness || h.stop_requested(); }, o_.poll_us,
           clock_ - o_.staleness, "every rank pulled the weights of wave clock - D");
    const auto t_push = tr.now();
    if (p.numel() > 0) holders_->push(update, offset_);
    holders_->advance();
    ++clock_;
    in_wave_ = 0;
    const int at = static_cast<int>(steps_);
    tr.add(span_kind::wsp_push, at, static_cast<int>(clock_), t_push, tr.now());
    if (!wait) return;
    const auto t_wait = tr.now();
    std::int64_t least = 0;
    h.wait([&] { return (least = h.least_clock()) >= clock_ - o_.staleness || h.stop_requested(); }, o_.poll_us,
           clock_ - o_.staleness, "every rank pushed wave clock - D");
    // The ranks of one worker must stop at the same wave (a pipeline's stages
    // exchange messages): they agree on the stop flag they saw.
    int stop = holders_->stop_requested() ? 1 : 0;
    all_reduce(*group_, view<int>(&stop, {1}), reduce_op::max);
    stopping_ = stop != 0;
    waves_.push_back({clock_, least, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), stopping_});
    least_ = least;
    tr.add(span_kind::wsp_wait, at, static_cast<int>(clock_), t_wait, tr.now());
    const auto t_pull = tr.now();
    pull();
    holders_->pulled();
    tr.add(span_kind::wsp_pull, at, static_cast<int>(least), t_pull, tr.now());
  }
  void pull() {
    const auto p = net_->params();
    if (p.numel() > 0) wave_.pull_into(p, [&](view<float> to) { holders_->pull(to, offset_); });
  }
  bool bf16() const noexcept { return o_.precision == whale::precision::bf16; }
  /// On a device, minibatch k's update (its gradients in grads()): the worker's
  /// squared norm summed over its ranks where clipping needs it, the gate
  /// (kernels::wsp_gate: the host's checks and scale), and the update under it.
  /// The host reads nothing.
  void gated_update(int k) {
    if constexpr (GatedOptimizer<Opt>) {
      double* squares = nullptr;  // the worker's norm: for clipping, and so that a fault stops every stage
      if (o_.max_grad_norm > 0 || group_->size() > 1) {
        squares = wave_.squares(k);
        net_->replica_grad_squares_into(squares);
        wave_.poison_on_bad_loss(k, shares_[static_cast<std::size_t>(k)]);  // a loss fault reaches every stage's gate
        if (group_->size() > 1) {
          if (dev_group_) {
            all_reduce(*dev_group_, view<double>(squares, {1}));
          } else {  // without the device's own communicators: through the host (a wait)
            double sq = 0;
            be_.copy(&sq, squares, sizeof sq);
            be_.synchronize();
            all_reduce(*group_, view<double>(&sq, {1}));
            be_.copy(squares, &sq, sizeof sq);
            be_.synchronize();  // before `sq` goes out of scope
          }
        }
      }
      const auto gate = wave_.gate(k, shares_[static_cast<std::size_t>(k)], squares, static_cast<float>(1.0 / share_), o_.max_grad_norm);
      net_->apply_optimizer(opt_, state_, gate);
    } else {
      (void)k;
      throw std::logic_error("whale::wsp_trainer: a device's update needs a gated optimizer");
    }
  }
  /// On a device, after the wave's read: the losses, and a faulty minibatch
  /// thrown on every rank of the worker before anything is pushed.
  void check_wave() {
    const int n = in_wave_;
    wave_losses_.assign(static_cast<std::size_t>(n), 0.0);
    int bad = -1, kind = 0;  // the wave's first faulty minibatch on this rank (its place in the wave)
    for (int k = 0; k < n; ++k) {
      const auto ku = static_cast<std::size_t>(k);
      wave_losses_[ku] = (shares_[ku] + wave_.device_loss(k)) / share_;
      if (wave_.fault(k) != 0 && bad < 0) bad = k, kind = wave_.fault(k);
    }
    // over the worker's ranks (which run the same minibatches): the first, a loss fault before a norm fault
    std::int64_t worst[2] = {bad >= 0 ? 1 : 0, bad >= 0 ? -(4 * bad + kind) : std::numeric_limits<std::int64_t>::min()};
    all_reduce(*group_, view<std::int64_t>(worst, {2}), reduce_op::max);
    if (worst[0] == 0) return;
    const auto at = static_cast<std::size_t>(-worst[1] / 4);
    minibatches_.resize(wave_records_ + at);  // the records of the minibatches not applied go
    try {
      detail::throw_wsp_fault(wave_steps_[at], static_cast<int>(-worst[1] % 4));
    } catch (const std::exception& e) {
      spent_ = e.what();
      throw;
    }
  }
  /// On a device a fault is seen at the wave's end, after the optimizer's
  /// step counts moved on past the gated updates: the trainer goes no further.
  void check_usable() const {
    if (!spent_.empty())
      throw std::logic_error("whale::wsp_trainer: this trainer stopped at a fault (" + spent_ +
                             "); on a device the fault is seen at the wave's end, so it cannot go on: make a new "
                             "wsp_trainer (from a checkpoint) to continue");
  }

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
