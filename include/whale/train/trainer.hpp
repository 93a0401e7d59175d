// `trainer`: the training loop over any `Trainable` network (single process or
// a parallel plan) — data slicing, forward/backward, gradient clipping, the
// optimizer step, NaN/Inf checks and the progress line. It holds no model.
// trainer<Net, Opt> is a thin typed layer: the work that depends on neither
// type is detail::trainer_core's (train/trainer_core.hpp), compiled once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <type_traits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/nn/layer.hpp"
#include "whale/optim/lr_schedule.hpp"
#include "whale/optim/optimizer.hpp"
#include "whale/plan/describe.hpp"
#include "whale/train/bf16_weights.hpp"
#include "whale/train/checkpoint.hpp"
#include "whale/train/data.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/metrics.hpp"
#include "whale/train/progress.hpp"
#include "whale/train/run_record.hpp"
#include "whale/train/trainer_core.hpp"
#include "whale/train/trainer_options.hpp"
#include "whale/train/trainer_start.hpp"

namespace whale {

/// A network the trainer can drive: it says which rows of a global batch this
/// rank feeds, runs forward+backward (with whatever communication its plan
/// needs), combines loss shares across ranks, and applies an optimizer.
template <class N>
concept Trainable = requires(N& n, const N& cn, step_ctx& c, index_t g, double d,
                             cview<typename N::input_type> x, cview<std::int32_t> y) {
  typename N::model_type;
  { cn.local_batch(g) } -> std::same_as<std::pair<index_t, index_t>>;
  { n.train_step(c, x, y) } -> std::convertible_to<double>;
  { n.reduce_loss(d) } -> std::convertible_to<double>;
  { n.grad_norm() } -> std::convertible_to<double>;
  { cn.rank() } -> std::convertible_to<int>;
  { cn.world_size() } -> std::convertible_to<int>;
};

/// Model FLOPs of one step over `rows` rows (samples, or tokens) in sequences of `seq`.
template <class M> constexpr double model_flops(index_t rows, index_t seq) {
  const auto c = M::cost();
  return (c.fwd_flops + c.bwd_flops) * static_cast<double>(rows) +
         3.0 * c.seq_flops * static_cast<double>(rows) * static_cast<double>(seq);
}

namespace detail {
/// Whether `N::forward` gives logits (a plan whose model ends in a split region does not).
template <class N> constexpr bool gives_logits_v = [] {
  if constexpr (requires { N::gives_logits(); }) return N::gives_logits();
  else return true;
}();
/// A single-process network's first layer (flat order) with a non-finite gradient, named; empty if none.
template <class Net> std::string first_nonfinite_grad_of(const Net& net) {
  if constexpr (requires { net.grads(); }) {
    std::vector<float> host;  // the gradients on the host, for a network on a device
    cview<float> g = net.grads();
    if constexpr (requires { net.backend(); }) g = net.backend().host_readable(g, host);
    const auto d = describe<typename Net::model_type>();
    index_t at = 0;
    for (std::size_t k = 0; k < d.units.size(); ++k) {
      const auto& u = d.units[k];
      for (index_t i = at; i < at + u.full_params && i < g.numel(); ++i)
        if (g[i] - g[i] != 0.f)
          return u.name + " (unit " + std::to_string(k) + " of the model, its parameters [" + std::to_string(at) + ", " +
                 std::to_string(at + u.full_params) + "))";
      at += u.full_params;
    }
  }
  return {};
}
}  // namespace detail

/// Drives a Trainable network with an optimizer over a data source. A thin
/// typed layer over detail::trainer_core (train/trainer_core.hpp), which does
/// the work that depends on neither: this class feeds the batches to the
/// network and answers the core's questions about the network and optimizer.
template <Trainable Net, Optimizer Opt>
class trainer final : public detail::trainer_core {
 public:
  /// Whether save(), load() and the checkpoint options work with this network and optimizer.
  static constexpr bool checkpoints = Checkpointable<Net> && CheckpointableState<typename Opt::state>;

  /// Checks the options (std::invalid_argument naming one), and on every rank
  /// the checkpoint directory and the metrics log before any work (every rank fails alike).
  trainer(Net& net, Opt opt, trainer_options o = {});

  /// Save a checkpoint of the model, the optimizer state and next_step() under
  /// `dir` (default: checkpoint_dir) as dir/step-<next_step()>/ (collective); returns that directory.
  std::string save(std::string dir = {})
    requires checkpoints
  {
    const detail::interrupt_deferral finish_first;  // an interruption during the save ends the process after it, naming it
    rec_.last_checkpoint = save_checkpoint(dir.empty() ? o_.checkpoint_dir : dir, net_, opt_, state_, next_, o_.keep_last);
    rec_.note_progress(o_, next_);
    return rec_.last_checkpoint;
  }
  /// Load a checkpoint (a step directory, or the newest in a checkpoint
  /// directory) saved under any plan; run() continues from its step (collective).
  checkpoint_info load(const std::string& path)
    requires checkpoints
  {
    auto info = load_checkpoint(path, net_, opt_, state_);
    next_ = info.step;
    rec_.last_checkpoint = info.dir;
    rec_.note_progress(o_, next_);
    return info;
  }

  /// Whether `Data` is a DataSource this network can train on (a
  /// static_assert names what is missing; train/data_source.hpp).
  template <class Data>
  static constexpr bool data_ok =
      detail::data_source_for<Data, typename Net::input_type, loss_target_t<typename Net::model_type>>();

  /// This rank's rows of data step `step` (no training).
  /// Throws, naming the step, when the batch is not the rows asked for: a
  /// short batch (a reader at the end of its data) would train on a wrong
  /// loss, since the loss is divided by the whole global batch.
  template <class Data> auto fetch(Data& data, std::int64_t step) {
    if constexpr (data_ok<Data>) {
      const auto [begin, count] = net_.local_batch(data.global_batch());
      auto b = data.get(step, begin, count);
      if (auto why = detail::batch_problem<typename Net::model_type>(b, begin, count, data.global_batch(), data.seq()); !why.empty())
        throw std::runtime_error(at(step) + why);
      return b;
    } else {
      return batch_view<typename Net::input_type>{};
    }
  }

  /// One step on data step `step`, with what run() does around each step:
  /// the progress line (of trainer_options::total_steps steps), the metrics
  /// log, on_step and save_every. Returns the global mean loss; next_step() becomes step + 1.
  template <class Data> double step(Data& data, std::int64_t step) {
    if constexpr (data_ok<Data>) {
      check_memory_first(data);
      const auto t0 = std::chrono::steady_clock::now();
      const double loss = step_on(fetch(data, step), data.global_batch(), step, labelled(data, step));
      next_ = step + 1;
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rec_.last_dt = dt;
      report(step, loss, dt, data.global_batch() * data.seq(), data.seq());
      if constexpr (checkpoints)
        if (o_.save_every > 0 && next_ % o_.save_every == 0) save();
      return loss;
    } else {
      return 0;
    }
  }

  /// One step on a fetched batch (this rank's rows of a global batch of
  /// `global_batch` sequences, of which `loss_terms` labels count; -1: all)
  /// and nothing else: no progress line, log or hooks. Returns the global mean loss.
  template <class In, class Target>
  double step_on(const batch_view<In, Target>& b, index_t global_batch, std::int64_t step, std::int64_t loss_terms = -1) {
    auto pass = [&](step_ctx& c) -> double { return net_.train_step(c, b.inputs, detail::labels_of(b)); };
    return step_with(context(b.sequences, b.seq, global_batch, loss_terms), step, pass);
  }

  /// Train for `n` steps from next_step(); prints progress on rank 0.
  template <class Data> train_result run(Data& data, steps n) {
    if (o_.eval_every > 0)
      throw std::invalid_argument("whale::trainer: eval_every is set but run() was given no evaluation data; "
                                  "call run(data, steps, eval_data)");
    return run_with<Data, void>(data, n, nullptr);
  }
  /// Train for `n` steps, evaluating on `eval` every trainer_options::eval_every data steps.
  template <class Data, class Eval> train_result run(Data& data, steps n, Eval& eval) {
    if constexpr (data_ok<Eval>) return run_with(data, n, &eval);
    else return {};
  }

  /// The global mean loss of `n` data steps from `first` (no backward, no update):
  /// every plan runs a forward-only pass (pipelines: every forward, in order).
  template <class Data> double evaluate(Data& data, steps n, std::int64_t first = 0)
    requires requires(Net& m, step_ctx& c, cview<typename Net::input_type> x, cview<std::int32_t> y) { m.evaluate(c, x, y); }
  {
    if constexpr (data_ok<Data>) {
      if (n.value < 1) throw std::invalid_argument("whale::trainer::evaluate: at least one step (got " + std::to_string(n.value) + ")");
      double sum = 0;
      for (std::int64_t s = 0; s < n.value; ++s) {
        const auto b = fetch(data, first + s);
        auto pass = [&](step_ctx& c) -> double { return net_.evaluate(c, b.inputs, detail::labels_of(b)); };
        sum += evaluate_with(context(b.sequences, b.seq, data.global_batch(), labelled(data, first + s)), pass);
      }
      return sum / static_cast<double>(n.value);
    } else {
      return 0;
    }
  }

  typename Opt::state& optimizer_state() noexcept { return state_; }

  ~trainer() override {
    try {
      put_master_back();  // steps queued under bf16 and never read (an error between them): the fp32 weights back
    } catch (...) {
    }
  }

 private:
  /// What trainer_core knows of Net and Opt, as values.
  static detail::trainer_traits traits(const Net& net) {
    detail::trainer_traits t;
    // the network's precision (plan_options::precision, network<M>'s constructor); a network type without one trains in fp32
    if constexpr (requires { { net.precision() } -> std::convertible_to<whale::precision>; }) t.precision = net.precision();
    t.figures_on_device = figures_on_device;
    t.writes_rounded = writes_rounded;
    const auto c = Net::model_type::cost();
    t.flops_per_row = c.fwd_flops + c.bwd_flops;
    t.seq_flops_per_token = c.seq_flops;
    return t;
  }
  /// Whether this network and optimizer can keep a step's figures where the step runs.
  static constexpr bool figures_on_device =
      GatedOptimizer<Opt> && requires(Net& n, const Net& cn, double* d, const Opt& o, typename Opt::state& st,
                                      kernels::update_gate g) {
        cn.grad_sum_squares_into(d);
        n.apply_optimizer(o, st, g);
        cn.backend();
      };
  /// Whether the optimizer's pass can write the rounded weights and the fp32 master together (RoundingOptimizer).
  static constexpr bool writes_rounded =
      RoundingOptimizer<Opt> && requires(Net& n, const Opt& o, typename Opt::state& st, view<float> m) {
        n.apply_optimizer(o, st, kernels::update_gate{}, m);
      };

  // ---- what trainer_core asks of the network and optimizer ----
  double net_reduce_loss(double share) override { return net_.reduce_loss(share); }
  double net_grad_norm() override { return net_.grad_norm(); }
  std::string net_first_nonfinite_grad() override {
    if constexpr (requires { net_.first_nonfinite_grad(); }) return net_.first_nonfinite_grad();
    else return detail::first_nonfinite_grad_of(net_);
  }
  int net_rank() const override { return net_.rank(); }
  int net_world_size() const override { return net_.world_size(); }
  backend_ref net_backend() const override { return ckpt::backend_of(net_); }
  view<float> net_params() override {
    if constexpr (requires { net_.params(); }) return net_.params();
    else return {};
  }
  void update(float grad_scale) override { net_.apply_optimizer(opt_, state_, grad_scale); }
  void update_gated(kernels::update_gate gate, bool into_master) override {
    if constexpr (writes_rounded) {
      if (into_master) return net_.apply_optimizer(opt_, state_, gate, master_.v());
    }
    if constexpr (figures_on_device) net_.apply_optimizer(opt_, state_, gate);
    else throw std::logic_error("whale::trainer: a gated update where the network cannot keep a step's figures");
  }
  void net_grad_sum_squares_into(double* out) override {
    if constexpr (figures_on_device) net_.grad_sum_squares_into(out);
    else throw std::logic_error("whale::trainer: the gradients' squares asked where the network cannot keep a step's figures");
  }
  bool has_lr() const override { return requires { opt_.lr; }; }
  double lr() const override {
    if constexpr (requires { opt_.lr; }) return static_cast<double>(opt_.lr);
    else return 0;
  }
  void set_optimizer_lr(double rate) override {
    if constexpr (requires { opt_.lr; }) opt_.lr = static_cast<decltype(opt_.lr)>(rate);
  }
  void rewind_optimizer(std::int64_t k) override {
    if constexpr (requires { state_.steps -= 1; }) state_.steps -= k;
  }

  /// The plan's memory check of a training step, with the data source's batch
  /// on this rank, before the source allocates it (once; collective).
  template <class Data> void check_memory_first(Data& data) {
    if constexpr (requires(const step_ctx& c) { net_.check_step_memory(c, std::int64_t{}); }) {
      const auto [begin, count] = net_.local_batch(data.global_batch());
      step_ctx c;
      c.batch = count;
      c.seq = data.seq();
      c.global_rows = data.global_batch() * data.seq();
      c.bf16 = bf16();
      net_.check_step_memory(c, detail::data_source_bytes<typename Net::model_type>(data, count));
    }
  }
  /// One step queued on the device (trainer_core::queue_with) on data step `step`.
  template <class Data> void queue_step(Data& data, std::int64_t step) {
    if constexpr (figures_on_device) {
      start_queued_clock();  // the steps' time includes fetching their batches
      const auto b = fetch(data, step);
      auto pass = [&](step_ctx& c) -> double { return net_.train_step(c, b.inputs, detail::labels_of(b)); };
      queue_with(context(b.sequences, b.seq, data.global_batch(), labelled(data, step)), step, pass);
    }
  }
  /// The labels of step `s`'s global batch that count, if the data says (-1: all).
  template <class Data> static std::int64_t labelled(const Data& data, std::int64_t s) {
    if constexpr (requires { { data.labelled(s) } -> std::convertible_to<std::int64_t>; }) return data.labelled(s);
    else return -1;
  }
  template <class Data, class Eval> train_result run_with(Data& data, steps n, Eval* eval);
  template <class Eval> void run_eval(Eval& eval);
  /// trainer_options::eval_metric over eval_steps steps of `eval`: the global sum / count.
  template <class Eval> double metric_of(Eval& eval);

  Net& net_;
  Opt opt_;
  typename Opt::state state_;
};

}  // namespace whale

#include "whale/train/trainer_run.hpp"  // its construction, run() and evaluation
