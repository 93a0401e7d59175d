// `trainer`: the training loop over any `Trainable` network (single process or
// a parallel plan) — data slicing, forward/backward, gradient clipping, the
// optimizer step, NaN/Inf checks and the progress line. It holds no model.
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

/// Drives a Trainable network with an optimizer over a data source.
template <Trainable Net, Optimizer Opt>
class trainer {
 public:
  /// Whether save(), load() and the checkpoint options work with this network and optimizer.
  static constexpr bool checkpoints = Checkpointable<Net> && CheckpointableState<typename Opt::state>;

  /// Checks the options (std::invalid_argument naming one), and on every rank
  /// the checkpoint directory and the metrics log before any work (every rank fails alike).
  trainer(Net& net, Opt opt, trainer_options o = {});

  /// The data step run() trains next (first_step, advanced by run() and by load()).
  std::int64_t next_step() const noexcept { return next_; }
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
    step_ctx c = context_of(b, global_batch, loss_terms);
    double share = 0;
    {
      weights_scope w(bf16(), local_params(), master_, backend());  // bf16: compute with rounded weights, update the master
      share = net_.train_step(c, b.inputs, detail::labels_of(b));
      w.restore();
    }
    const double loss = net_.reduce_loss(share);
    if (!std::isfinite(loss)) throw loss_error(step, loss);
    float scale = 1.f;
    rec_.last_norm = std::numeric_limits<double>::quiet_NaN();
    if (o_.max_grad_norm > 0 || o_.check_grad_norm) {
      const double norm = net_.grad_norm();
      rec_.last_norm = norm;
      if (!std::isfinite(norm)) throw norm_error(step, norm, loss, true);
      if (o_.max_grad_norm > 0) scale = clip_coefficient(norm, o_.max_grad_norm);
    }
    set_lr(step);
    net_.apply_optimizer(opt_, state_, scale);
    return loss;
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
        step_ctx c = context_of(b, data.global_batch(), labelled(data, first + s));
        weights_scope w(bf16(), local_params(), master_, backend());
        const double share = net_.evaluate(c, b.inputs, detail::labels_of(b));
        w.restore();
        sum += net_.reduce_loss(share);
      }
      return sum / static_cast<double>(n.value);
    } else {
      return 0;
    }
  }

  typename Opt::state& optimizer_state() noexcept { return state_; }

  ~trainer() {
    try {
      put_master_back();  // steps queued under bf16 and never read (an error between them): the fp32 weights back
    } catch (...) {
    }
  }

 private:
  template <class In, class Target>
  step_ctx context_of(const batch_view<In, Target>& b, index_t global_batch, std::int64_t loss_terms) const {
    step_ctx c;
    c.batch = b.sequences;
    c.seq = b.seq;
    c.global_rows = global_batch * b.seq;
    c.loss_terms = loss_terms;
    c.check_finite = o_.check_finite;
    c.bf16 = o_.precision == precision::bf16;
    return c;
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
  std::string at(std::int64_t step) const { return detail::run_record::at(o_, step); }
  std::runtime_error loss_error(std::int64_t step, double loss) const { return detail::run_record::loss_error(o_, step, loss); }
  /// `locate`: the gradients are this step's, so the first non-finite layer can be named (collective for a plan).
  std::runtime_error norm_error(std::int64_t step, double norm, double loss, bool locate) {
    std::string where;
    if (locate) {
      if constexpr (requires { net_.first_nonfinite_grad(); }) where = net_.first_nonfinite_grad();
      else where = detail::first_nonfinite_grad_of(net_);
    }
    return detail::run_record::norm_error(o_, step, norm, loss, where);
  }
  /// trainer_options::lr_schedule's rate for data step `step`, set on the optimizer.
  void set_lr(std::int64_t step) {
    if constexpr (requires { opt_.lr; }) {
      if (o_.lr_schedule) {
        const double lr = o_.lr_schedule(step);
        if (!std::isfinite(lr) || lr < 0)
          throw std::invalid_argument(at(step) + "the learning-rate schedule gave " + std::to_string(lr) + "; it must be finite and >= 0");
        opt_.lr = static_cast<float>(lr);
      }
      rec_.last_lr = opt_.lr;
    }
  }
  /// The progress line, the metrics log, on_step and the divergence watch for one step.
  void report(std::int64_t step, double loss, double dt, index_t rows, index_t seq) {
    rec_.report(o_, step, loss, dt, rows, seq, model_flops<typename Net::model_type>(rows, seq) / static_cast<double>(net_.world_size()),
                net_.rank() == 0);
    rec_.note_progress(o_, next_);
  }

  // ---- steps whose figures stay in the device's memory (trainer_options::log_every > 1) ----

  /// Whether this network and optimizer can keep a step's figures where the step runs.
  static constexpr bool figures_on_device =
      GatedOptimizer<Opt> && requires(Net& n, const Net& cn, double* d, const Opt& o, typename Opt::state& st,
                                      kernels::update_gate g) {
        cn.grad_sum_squares_into(d);
        n.apply_optimizer(o, st, g);
        cn.backend();
      };
  bool deferring() const noexcept { return figures_on_device && o_.log_every > 1 && !o_.check_finite; }
  /// A queued step, until its figures are read.
  struct queued {
    std::int64_t step;
    double share;  // what the loss layers returned on the host (0 when all of it went to the device)
    double lr;
  };
  kernels::step_figures* figure(std::size_t k) { return reinterpret_cast<kernels::step_figures*>(figures_.data()) + k; }
  double* halt() { return figures_.data() + 4 * o_.log_every; }
  /// One step queued on the device: forward and backward with the loss added
  /// into its record, the gradients' sum of squares there, the check and the
  /// clipping scale (kernels::check_step), and the update gated by them. The
  /// host waits for none of it.
  template <class Data> void queue_step(Data& data, std::int64_t step);
  /// Read the queued steps' figures (the host's one wait), check them in
  /// order and report each; a faulty step throws, its updates and those after
  /// it undone in the host's counts (the device made none).
  void read_queued(index_t rows, index_t seq, train_result* r);
  /// Under bf16 with log_every > 1 and an optimizer that writes rounded
  /// copies (RoundingOptimizer): the queued steps keep the fp32 master weights
  /// in master_ and the parameters rounded to bf16 from one step to the next,
  /// the optimizer's pass writing both, until the host reads the steps'
  /// figures; only the first step of each read rounds and copies, and the
  /// read puts the master weights back (rounded_ says which holds).
  bool keeps_rounded() const;
  /// The first queued step's rounding: the fp32 weights into master_, the parameters rounded in place.
  void round_weights_once();
  /// The fp32 master weights back into the parameters, where the queued steps left them rounded.
  void put_master_back();

  using weights_scope = detail::bf16_weights;  // bf16: the pass computes with rounded weights, the master kept aside
  backend_ref backend() const { return ckpt::backend_of(net_); }
  bool bf16() const noexcept { return o_.precision == precision::bf16; }
  /// The parameters this rank computes with (what bf16 rounds); empty for a network that does not expose them.
  view<float> local_params() {
    if constexpr (requires { net_.params(); }) {
      if (bf16()) return net_.params();
    }
    return {};
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
  trainer_options o_;
  typename Opt::state state_;
  tensor<float> master_{shape{0}, mem_kind::params};  // bf16: the fp32 master weights during a step
  bool rounded_ = false;  // the parameters hold the rounded weights and master_ the fp32 ones (keeps_rounded)
  std::int64_t next_ = 0;
  bool resumed_ = false;
  tensor<double> figures_{shape{0}, mem_kind::workspace};  // log_every > 1: log_every step_figures, then the halt flag
  std::vector<double> figures_host_;                        // their copy on the host, when read
  std::vector<queued> queue_;                               // steps queued since the last read
  std::chrono::steady_clock::time_point queued_since_;
  detail::run_record rec_;  // the progress line, the metrics log, the divergence watch, the last checkpoint
};

}  // namespace whale

#include "whale/train/trainer_queue.hpp"  // the queued steps' member definitions
#include "whale/train/trainer_run.hpp"    // run()'s loop and evaluation
