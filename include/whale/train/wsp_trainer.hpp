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
#include <deque>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/trace.hpp"
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
    if (o_.staleness < 0 || o_.staleness > 1000000)
      throw std::invalid_argument("whale::wsp_trainer: the staleness bound D must be from 0 to 1000000 (got " +
                                  std::to_string(o_.staleness) + ")");
    if (o_.wave < 1 || o_.wave > 1000000)
      throw std::invalid_argument("whale::wsp_trainer: a wave must hold 1 to 1000000 minibatches (got " +
                                  std::to_string(o_.wave) + ")");
    if (o_.poll_us < 1 || o_.poll_us > 1000000)
      throw std::invalid_argument("whale::wsp_trainer: poll_us must be from 1 to 1000000");
    // The holders' layout: the concatenation of what each position of a worker
    // (its pipe x model coordinates) holds; every worker has the same positions.
    const auto& shape = ctx.mesh().shape();
    const int positions = shape.size(axis::pipe | axis::model);
    position_ = shape.index_in(axis::pipe | axis::model, ctx.rank());
    std::vector<index_t> held(static_cast<std::size_t>(ctx.size()));
    index_t mine = net.params().numel();
    all_gather(ctx.world(), cview<index_t>(&mine, {1}), view<index_t>(held.data(), {ctx.size()}));
    std::vector<index_t> per(static_cast<std::size_t>(positions), -1);
    for (int r = 0; r < ctx.size(); ++r) {
      auto& p = per[static_cast<std::size_t>(shape.index_in(axis::pipe | axis::model, r))];
      if (p >= 0 && p != held[static_cast<std::size_t>(r)])
        throw std::logic_error("whale::wsp_trainer: two virtual workers hold different parameter counts at one position");
      p = held[static_cast<std::size_t>(r)];
    }
    offset_ = std::accumulate(per.begin(), per.begin() + position_, index_t{0});
    total_ = std::accumulate(per.begin(), per.end(), index_t{0});
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
    static_assert(detail::data_source_for<Data, typename Net::input_type>(),
                  "whale::wsp_trainer::step: the data is not a DataSource for this network (see train/data_source.hpp)");
    const index_t global = data.global_batch();
    const auto [begin, count] = net_->local_batch(global);
    const auto b = data.get(step, begin, count);
    const auto p = net_->params();
    if (in_wave_ == 0) std::copy_n(p.data(), p.numel(), snapshot_.data());
    step_ctx c;
    c.batch = b.sequences;
    c.seq = b.seq;
    c.global_rows = global * b.seq;
    share_ = static_cast<double>(count) / static_cast<double>(global);
    // the loss's rows are the global batch's; the worker trains as if alone on its
    // own rows: its mean loss, and gradients scaled up by global / count
    const double loss = net_->compute_only_step(c, b.inputs, b.labels) / share_;
    if (!std::isfinite(loss))  // the other workers stop at the watchdog, which names this rank
      throw std::runtime_error("whale::wsp_trainer: data step " + std::to_string(step) + ": this worker's loss is " +
                               (std::isnan(loss) ? "NaN" : "infinite") +
                               "; check the data for NaN/Inf or lower the learning rate (no update was pushed)");
    net_->apply_optimizer(opt_, state_, static_cast<float>(1.0 / share_));
    if (++in_wave_ == o_.wave) end_wave();
    ++steps_;
    return loss;
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
  std::int64_t clock() const noexcept { return clock_; }
  typename Opt::state& optimizer_state() noexcept { return state_; }

 private:
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
  std::int64_t clock_ = 0, steps_ = 0;
  bool stopping_ = false;
  std::vector<wave_record> waves_;
};

}  // namespace whale
