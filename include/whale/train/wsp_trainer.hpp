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
#include <deque>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/trace.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/runtime/wsp.hpp"
#include "whale/train/data_source.hpp"

namespace whale {

/// Options of Wave Synchronous Parallel training.
struct wsp_options {
  /// D: a virtual worker may start wave c + 1 only when every rank has pushed
  /// wave c - D (D = 0: synchronous). HetPipe's staleness bound.
  int staleness = 0;
  /// N_m: minibatches (data steps) per wave; the update pushed is their sum.
  int wave = 1;
  /// Microseconds between two reads of the clocks while waiting.
  int poll_us = 200;
  /// HetPipe's pipelined minibatches: the N_m minibatches of a wave are in
  /// flight together in the worker's pipeline (no flush between them) and all
  /// run on the weights the wave began with; their N_m updates are applied in
  /// order when the last one's backward is done. Train with wave(), not step().
  /// false: each minibatch flushes and the next sees its update.
  bool in_flight = false;
  /// Clip each minibatch's gradients to this norm over its worker (0: no clipping).
  double max_grad_norm = 0;
};

/// What one minibatch ran on: data step `step` of wave `wave` (0-based), on
/// weights that held `local_version` of this worker's own minibatch updates
/// (all of its steps < local_version) and, from the other workers, every
/// update of their waves < `global_clock` (the smallest clock at the last pull).
/// Sequential waves: step - local_version = 0; in flight: the minibatch's
/// place in its wave (at most N_m - 1, HetPipe's local staleness).
struct minibatch_record {
  std::int64_t step = 0, wave = 0, local_version = 0, global_clock = 0;
};

/// What one wave of this rank saw: its clock after the push, the smallest
/// clock of any rank when it went on (the oldest wave every update of which it
/// then pulled), and how long it waited. wave - min_clock <= staleness for
/// every wave after which the worker went on (not `stopped`).
struct wave_record {
  std::int64_t wave = 0, min_clock = 0;
  double wait_s = 0;
  /// The wave ended on a stop request: the worker went no further (the wait
  /// for the others was cut short), so the bound does not apply to it.
  bool stopped = false;
};

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
    if constexpr (requires { net.backend(); })
      if (!net.backend().on_cpu())
        throw std::invalid_argument(std::string("whale::wsp_trainer: a plan on a device (") + net.backend().name() +
                                    ") is not implemented yet: the parameter holders exchange host memory");
    if constexpr (requires { net.has_tied_head(); })
      if (net.has_tied_head())
        throw std::invalid_argument("whale::wsp_trainer: the model has a tied head (tied_head), whose copy of the token "
                                    "table the parameter holders would update apart from the table (each holder block "
                                    "adds the workers' pushes in its own order); not supported yet: untie the head "
                                    "(linear<D, V, no_bias>) for Wave Synchronous Parallel");
    if (o_.staleness < 0 || o_.staleness > 1000000)
      throw std::invalid_argument("whale::wsp_trainer: the staleness bound D must be from 0 to 1000000 (got " +
                                  std::to_string(o_.staleness) + ")");
    if (o_.wave < 1 || o_.wave > 1000000)
      throw std::invalid_argument("whale::wsp_trainer: a wave must hold 1 to 1000000 minibatches (got " +
                                  std::to_string(o_.wave) + ")");
    if (o_.poll_us < 1 || o_.poll_us > 1000000)
      throw std::invalid_argument("whale::wsp_trainer: poll_us must be from 1 to 1000000");
    if (net.options().in_flight != 0 && net.options().in_flight != (o_.in_flight ? o_.wave : 0))
      throw std::invalid_argument("whale::wsp_trainer: the plan was made for " + std::to_string(net.options().in_flight) +
                                  " minibatches in flight (plan_options::in_flight), but this trainer runs " +
                                  (o_.in_flight ? std::to_string(o_.wave) : std::string("none")) +
                                  " (wsp_options::wave, in_flight); make them agree");
    if (o_.in_flight && !net.options().memory_caps_mib.empty() && net.options().in_flight != o_.wave)
      throw std::invalid_argument("whale::wsp_trainer: with memory caps and minibatches in flight, make the plan with "
                                  "plan_options::in_flight = " + std::to_string(o_.wave) +
                                  " so that its stage cut counts the activations of the minibatches in flight");
    if (!(o_.max_grad_norm >= 0) || !std::isfinite(o_.max_grad_norm))
      throw std::invalid_argument("whale::wsp_trainer: max_grad_norm must be a finite number >= 0 (0: no clipping)");
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
      const int positions = shape.size(axis::pipe | axis::model);
      position_ = shape.index_in(axis::pipe | axis::model, ctx.rank());
      std::vector<index_t> held(static_cast<std::size_t>(ctx.size()));
      all_gather(ctx.world(), cview<index_t>(&mine, {1}), view<index_t>(held.data(), {ctx.size()}));
      std::vector<index_t> per(static_cast<std::size_t>(positions), -1);
      for (int r = 0; r < ctx.size(); ++r) {
        auto& p = per[static_cast<std::size_t>(shape.index_in(axis::pipe | axis::model, r))];
        if (p >= 0 && p != held[static_cast<std::size_t>(r)])
          throw std::invalid_argument("whale::wsp_trainer: two virtual workers hold different parameter counts at one "
                                      "position; with tensor parallelism (a model axis) or interleaved chunks every "
                                      "worker must cut its pipeline alike (no plan_options::worker_cuts)");
        p = held[static_cast<std::size_t>(r)];
      }
      offset_ = std::accumulate(per.begin(), per.begin() + position_, index_t{0});
      total_ = std::accumulate(per.begin(), per.end(), index_t{0});
    }
    // Worker 0 (identical to every other at the start) fills the holders.
    const bool first = shape.coord(ctx.rank(), axis::data) == 0;
    holders_.emplace(ctx.world(), total_);
    if (first && mine > 0) holders_->push(net.params(), offset_);
    barrier(ctx.world());
    snapshot_ = tensor<float>({std::max<index_t>(1, mine)}, mem_kind::workspace);
    delta_ = tensor<float>({std::max<index_t>(1, mine)}, mem_kind::workspace);
  }

  /// One minibatch, data step `step`: this worker's rows of that global batch,
  /// forward, backward (the loss is the mean over the worker's own rows) and a
  /// local update; at a wave's end the push, the wait and the pull. Returns the
  /// worker's mean loss on its rows on the ranks that compute the loss (the last
  /// stage), 0 elsewhere; no collective between workers.
  template <class Data> double step(Data& data, std::int64_t step) {
    static_assert(detail::data_source_for<Data, typename Net::input_type, loss_target_t<typename Net::model_type>>(),
                  "whale::wsp_trainer::step: the data is not a DataSource for this network (see train/data_source.hpp)");
    if (o_.in_flight)
      throw std::logic_error("whale::wsp_trainer::step: with wsp_options::in_flight a wave's minibatches run "
                             "together; call wave(data, first_step) once per wave");
    const index_t global = data.global_batch();
    const auto [begin, count] = net_->local_batch(global);
    const auto b = data.get(step, begin, count);
    if (auto why = detail::batch_problem<typename Net::model_type>(b, begin, count, global, data.seq()); !why.empty())
      throw std::runtime_error("whale::wsp_trainer: data step " + std::to_string(step) + ": " + why);
    const auto p = net_->params();
    if (in_wave_ == 0) std::copy_n(p.data(), p.numel(), snapshot_.data());
    step_ctx c;
    c.batch = b.sequences;
    c.seq = b.seq;
    c.global_rows = global * b.seq;
    share_ = static_cast<double>(count) / static_cast<double>(global);
    // the loss's rows are the global batch's; the worker trains as if alone on its
    // own rows: its mean loss, and gradients scaled up by global / count
    const double loss = net_->compute_only_step(c, b.inputs, detail::labels_of(b)) / share_;
    check_finite(std::isfinite(loss) ? -1 : step);
    minibatches_.push_back({step, clock_, steps_, least_});
    net_->apply_optimizer(opt_, state_, clip_scale(static_cast<float>(1.0 / share_)));
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
    const auto p = net_->params();
    std::copy_n(p.data(), p.numel(), snapshot_.data());
    const index_t np = p.numel();
    if (slots_.numel() < std::max<index_t>(1, np * n)) slots_ = tensor<float>({std::max<index_t>(1, np * n)}, mem_kind::workspace);
    share_ = static_cast<double>(count) / static_cast<double>(global);
    step_ctx c;
    c.batch = count * n;
    c.seq = seq;
    c.global_rows = global * seq;  // as step(): shares of the global batch, scaled up by global / count below
    const auto g = net_->grads();
    const auto& shares = net_->in_flight_step(c, x_.v(), y_.v(), n, [&](int k) {
      std::copy_n(g.data(), np, slots_.data() + static_cast<index_t>(k) * np);
    });
    std::vector<double> losses(shares.begin(), shares.end());
    std::int64_t bad = -1;  // the first minibatch whose loss is not finite
    for (int k = n - 1; k >= 0; --k) {
      losses[static_cast<std::size_t>(k)] /= share_;  // the mean over the worker's rows
      if (!std::isfinite(losses[static_cast<std::size_t>(k)])) bad = first + k;
    }
    check_finite(bad);
    for (int k = 0; k < n; ++k) minibatches_.push_back({first + k, clock_, steps_, least_});
    for (int k = 0; k < n; ++k) {  // the wave's updates, in step order
      std::copy_n(slots_.data() + static_cast<index_t>(k) * np, np, g.data());
      net_->apply_optimizer(opt_, state_, clip_scale(static_cast<float>(1.0 / share_)));
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
  typename Opt::state& optimizer_state() noexcept { return state_; }

 private:
  /// Every rank of the worker learns whether one saw a non-finite loss (`step`
  /// >= 0: the first such data step on this rank) and all throw alike, before
  /// any update or push: a pipeline's other stages cannot go on without it.
  void check_finite(std::int64_t step) {
    std::int64_t worst[2] = {step >= 0 ? 1 : 0, step >= 0 ? -step : std::numeric_limits<std::int64_t>::min()};
    all_reduce(*group_, view<std::int64_t>(worst, {2}), reduce_op::max);
    if (worst[0] == 0) return;
    throw std::runtime_error("whale::wsp_trainer: data step " + std::to_string(-worst[1]) +
                             ": this worker's loss is NaN or infinite; check the data for NaN/Inf or lower the "
                             "learning rate (no update of that wave was pushed)");
  }
  /// The gradients' scale: `base`, times the clip coefficient of their norm
  /// over this worker (scaled by `base`) when clipping is on.
  float clip_scale(float base) {
    if (o_.max_grad_norm <= 0) return base;
    double sq = net_->grad_squares(true);  // each parameter once over this worker's ranks
    all_reduce(*group_, view<double>(&sq, {1}));
    const double norm = std::sqrt(sq) * static_cast<double>(base);
    if (!std::isfinite(norm))
      throw std::runtime_error("whale::wsp_trainer: a minibatch's gradient norm is not finite; check the data or lower the learning rate");
    return base * clip_coefficient(norm, o_.max_grad_norm);
  }
  void end_wave(bool wait = true) {
    auto& tr = net_->trace_recorder();  // the executor's timeline (plan_options::trace), when on
    const auto t0 = std::chrono::steady_clock::now();
    // No rank may still be about to pull wave clock_ - D: this push would leak into
    // its weights (with D = 0 every worker then pulls exactly the synchronous weights).
    auto& h = *holders_;
    h.wait([&] { return h.min_pulled() >= clock_ - o_.staleness || h.stop_requested(); }, o_.poll_us,
           clock_ - o_.staleness, "every rank pulled the weights of wave clock - D");
    // the worker's update weighs as its share of the global batch: with SGD (linear
    // in the gradients) the pushed updates add up to the update of the whole batch
    const auto p = net_->params();
    const auto w = static_cast<float>(share_);
    for (index_t i = 0; i < p.numel(); ++i) delta_[i] = (p[i] - snapshot_[i]) * w;
    const auto t_push = tr.now();
    if (p.numel() > 0) holders_->push(cview<float>(delta_.data(), {p.numel()}), offset_);
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
    if (p.numel() > 0) holders_->pull(p, offset_);
  }

  context* ctx_;
  Net* net_;
  Opt opt_;
  wsp_options o_;
  typename Opt::state state_;
  world_comm* group_;
  std::optional<detail::wsp_holders> holders_;
  tensor<float> snapshot_, delta_;
  int position_ = 0, in_wave_ = 0;
  index_t offset_ = 0, total_ = 0;
  double share_ = 1.0;  // this worker's rows / the global batch
  std::int64_t clock_ = 0, steps_ = 0, least_ = 0;
  bool stopping_ = false;
  std::vector<wave_record> waves_;
  std::vector<minibatch_record> minibatches_;
  tensor<typename Net::input_type> x_;  // wave(): the wave's inputs, minibatch after minibatch
  tensor<std::int32_t> y_;              // wave(): their labels
  tensor<float> slots_;                 // wave(): each minibatch's gradients (N_m x this rank's parameters)
};

}  // namespace whale
