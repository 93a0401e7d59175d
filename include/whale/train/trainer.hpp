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
#include "whale/train/trainer_options.hpp"

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
/// The lines of the file at `path` (0 if it is missing or empty).
inline std::int64_t count_lines(const std::string& path) {
  std::ifstream f(path);
  std::int64_t n = 0;
  std::string line;
  while (f && std::getline(f, line)) ++n;
  return n;
}
/// Rewrite the metrics log at `path` (atomically) keeping its lines of data
/// steps before `from` and its evaluations up to `from` (an evaluation line
/// records the steps done); lines it cannot read are kept.
inline void keep_log_before(const std::string& path, std::int64_t from, const std::string& what) {
  std::ifstream f(path);
  std::string kept, line;
  while (f && std::getline(f, line)) {
    long long step = 0;
    const bool known = std::sscanf(line.c_str(), "{\"step\":%lld,", &step) == 1;
    const bool eval = line.find("\"eval_loss\"") != std::string::npos;
    if (!known || (eval ? step <= from : step < from)) kept += line + "\n";
  }
  f.close();
  write_file_atomically(path, kept, what);
}
/// The label buffer of batch `b` (layer.hpp): class labels as they are, float
/// targets as their bits, shaped (rows, targets per row) so that plans slice it by rows.
template <class In, class T> label_buffer labels_of(const batch_view<In, T>& b) {
  const auto l = label_bits(b.labels);
  const index_t rows = b.sequences * b.seq;
  if (rows > 0 && l.numel() != rows && l.numel() % rows == 0 && !(l.shape().rank() == 2 && l.shape()[0] == rows))
    return l.reshape({rows, l.numel() / rows});
  return l;
}
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

  trainer(Net& net, Opt opt, trainer_options o = {})
      : net_(net), opt_(std::move(opt)), o_(std::move(o)), state_(net.make_optimizer_state(opt_)), next_(o_.first_step) {
    if (o_.save_every < 0) throw std::invalid_argument("whale::trainer: save_every must be >= 0 (got " + std::to_string(o_.save_every) + ")");
    auto at_least = [](std::int64_t v, std::int64_t lo, const char* name) {
      if (v < lo) throw std::invalid_argument(std::string("whale::trainer: ") + name + " must be >= " + std::to_string(lo) + " (got " + std::to_string(v) + ")");
    };
    at_least(o_.eval_every, 0, "eval_every");
    at_least(o_.eval_steps, 1, "eval_steps");
    at_least(o_.total_steps, 0, "total_steps");
    at_least(o_.log_every, 1, "log_every");
    if constexpr (!requires { net_.params(); })
      if (o_.precision == precision::bf16)
        throw std::invalid_argument("whale::trainer: bf16 mixed precision needs the network's params() (the weights it rounds); "
                                    "this network type does not have it");
    bool zero3 = false;
    if constexpr (requires { Net::zero_level; }) zero3 = Net::zero_level == 3;
    if constexpr (requires { net.zero_level_now(); }) zero3 = net.zero_level_now() == 3;
    if (zero3 && o_.precision == precision::bf16)
        throw std::invalid_argument("whale::trainer: bf16 mixed precision with ZeRO-3 (shard<..., 3>) is not implemented: "
                                    "its gathered weights are not rounded; use ZeRO 0-2 or fp32");
    if (bf16()) {  // the fp32 master weights, beside the parameters (on a device, in its memory) for the whole run
      std::string err = ckpt::catching([&] {
        const place_scope where(backend().memory());
        master_.resize(local_params().shape());
      });
      if (!err.empty()) err = "whale::trainer: bf16 mixed precision keeps fp32 master weights beside the parameters (" +
                              std::to_string(local_params().bytes()) + " bytes): " + err;
      if constexpr (Checkpointable<Net>) ckpt::agree(net_, err);  // every rank fails alike
      else if (!err.empty()) throw std::runtime_error(err);
    }
    if (o_.handle_signals) {
      detail::install_interrupt_handlers(net_.rank() == 0);
      note_progress();
    }
    if (o_.keep_last < 0) throw std::invalid_argument("whale::trainer: keep_last must be >= 0 (got " + std::to_string(o_.keep_last) + ")");
    if ((o_.save_every > 0 || o_.resume) && o_.checkpoint_dir.empty())
      throw std::invalid_argument("whale::trainer: save_every and resume need trainer_options::checkpoint_dir");
    if ((o_.save_every > 0 || o_.resume) && !checkpoints)
      throw std::invalid_argument("whale::trainer: save_every and resume need a Checkpointable network (network<M> or a plan "
                                  "made by make<P>) and an optimizer whose state has vectors() (sgd, adamw)");
    if constexpr (!requires { opt_.lr; })
      if (o_.lr_schedule) throw std::invalid_argument(std::string("whale::trainer: lr_schedule needs an optimizer with a member `lr`; ") + Opt::name() + " has none");
    if constexpr (checkpoints) {
      if (!o_.checkpoint_dir.empty()) {  // made and checked before any work, on every rank
        std::string err;
        if (net_.rank() == 0) {
          std::error_code ec;
          std::filesystem::create_directories(o_.checkpoint_dir, ec);
          if (ec) err = "cannot create it: " + ec.message();
          else err = detail::output_path_problem(o_.checkpoint_dir + "/.whale-probe");
          if (!err.empty()) err = "whale::trainer: the checkpoint directory (trainer_options::checkpoint_dir, --save) '" + o_.checkpoint_dir + "': " + err + "; nothing was run";
          else if (err = ckpt::catching([&] { ckpt::hold_folder(o_.checkpoint_dir, "whale::trainer"); }); !err.empty()) err += "; nothing was run";
        }
        ckpt::agree(net_, err);
      }
    }
    if (!o_.log_path.empty()) {  // checked on every rank (collective when the network has a world)
      std::string err;
      if (net_.rank() == 0) {
        const auto lines = detail::count_lines(o_.log_path);
        const bool continues = lines > 0 && !o_.overwrite_log && (o_.resume || o_.continue_log);
        if (auto why = detail::output_path_problem(o_.log_path); !why.empty())
          err = "whale::trainer: the metrics log (trainer_options::log_path, --log) '" + o_.log_path + "': " + why + "; nothing was run";
        else if (lines > 0 && !o_.overwrite_log && !continues)
          err = "whale::trainer: the metrics log (trainer_options::log_path, --log) '" + o_.log_path + "' exists (" + std::to_string(lines) +
                " lines) and this run would overwrite it: continue it by resuming from a checkpoint (--resume), replace it with "
                "--overwrite-log (trainer_options::overwrite_log), or give another path; nothing was run";
        else if (continues) log_pending_ = true;  // opened when the first step is known (after a resume's load)
        else if (log_.reset(std::fopen(o_.log_path.c_str(), "w")); !log_)
          err = "whale::trainer: the metrics log '" + o_.log_path + "' cannot be opened: " + detail::system_reason(errno);
      }
      if constexpr (Checkpointable<Net>) ckpt::agree(net_, err);
      else if (!err.empty()) throw std::runtime_error(err);
    }
  }

  /// The data step run() trains next (first_step, advanced by run() and by load()).
  std::int64_t next_step() const noexcept { return next_; }
  /// Save a checkpoint of the model, the optimizer state and next_step() under
  /// `dir` (default: checkpoint_dir) as dir/step-<next_step()>/ (collective); returns that directory.
  std::string save(std::string dir = {})
    requires checkpoints
  {
    const detail::interrupt_deferral finish_first;  // an interruption during the save ends the process after it, naming it
    last_checkpoint_ = save_checkpoint(dir.empty() ? o_.checkpoint_dir : dir, net_, opt_, state_, next_, o_.keep_last);
    note_progress();
    return last_checkpoint_;
  }
  /// Load a checkpoint (a step directory, or the newest in a checkpoint
  /// directory) saved under any plan; run() continues from its step (collective).
  checkpoint_info load(const std::string& path)
    requires checkpoints
  {
    auto info = load_checkpoint(path, net_, opt_, state_);
    next_ = info.step;
    last_checkpoint_ = info.dir;
    note_progress();
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
      last_dt_ = dt;
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
    last_norm_ = std::numeric_limits<double>::quiet_NaN();
    if (o_.max_grad_norm > 0 || o_.check_grad_norm) {
      const double norm = net_.grad_norm();
      last_norm_ = norm;
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
  /// A continued metrics log, opened before the first line this run writes, of
  /// data step `from`: its lines of data steps `from` and later (and evaluations
  /// after step `from`) are dropped, as the run writes them again.
  void open_continued_log(std::int64_t from) {
    if (!log_pending_) return;
    log_pending_ = false;
    detail::keep_log_before(o_.log_path, from, "whale::trainer: the metrics log");
    log_.reset(std::fopen(o_.log_path.c_str(), "a"));
    if (!log_) throw std::runtime_error("whale::trainer: the metrics log '" + o_.log_path + "' cannot be opened: " + detail::system_reason(errno));
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
      net_.check_step_memory(c, detail::data_source_bytes<typename Net::model_type>(data, count));
    }
  }
  /// "whale::trainer: step N (data step S): " — steps named from 1, as the progress line counts them.
  std::string at(std::int64_t step) const {
    return "whale::trainer: step " + std::to_string(step - o_.first_step + 1) +
           (o_.first_step ? " (data step " + std::to_string(step) + ")" : "") + ": ";
  }
  std::string clip_hint() const { return o_.max_grad_norm > 0 ? "" : ", clip gradients (trainer_options::max_grad_norm)"; }
  std::runtime_error loss_error(std::int64_t step, double loss) const {
    return std::runtime_error(at(step) + "the loss is " + (std::isnan(loss) ? "NaN" : "infinite") +
                              "; check the data for NaN/Inf, lower the learning rate" + clip_hint() +
                              ", or run with --check-finite to name the first layer whose output is not finite");
  }
  /// `locate`: the gradients are this step's, so the first non-finite layer can be named (collective for a plan).
  std::runtime_error norm_error(std::int64_t step, double norm, double loss, bool locate) {
    std::string where;
    if (locate) {
      if constexpr (requires { net_.first_nonfinite_grad(); }) where = net_.first_nonfinite_grad();
      else where = detail::first_nonfinite_grad_of(net_);
    }
    return std::runtime_error(at(step) + "the gradient norm is " + (std::isnan(norm) ? "NaN" : "infinite") +
                              " while the loss is finite (" + std::to_string(loss) + ")" +
                              (where.empty() ? "" : "; the first layer with a non-finite gradient is " + where) +
                              "; no parameter was updated. Look for NaN/Inf in the input data (a ReLU hides a NaN "
                              "input from the loss, not from the weight gradients), lower the learning rate" + clip_hint() +
                              ", or run with --check-finite to name the first layer whose output is not finite");
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
      last_lr_ = opt_.lr;
    }
  }
  /// The progress line, the metrics log and on_step for one step.
  void report(std::int64_t step, double loss, double dt, index_t rows, index_t seq) {
    if (!line_) line_.emplace(o_.total_steps, seq > 1, (o_.progress && net_.rank() == 0) ? o_.out : nullptr, o_.plain_every);
    line_->update(++line_steps_, loss, dt, static_cast<double>(rows),
                  model_flops<typename Net::model_type>(rows, seq) / static_cast<double>(net_.world_size()));
    open_continued_log(step);
    if (o_.on_step || log_) {
      const step_report rep{step, loss, last_lr_, last_norm_, dt, dt > 0 ? static_cast<double>(rows) / dt : 0};
      if (log_) {
        std::fprintf(log_.get(), "{\"step\":%lld,\"loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%s,\"step_s\":%.6g,\"tokens_per_s\":%.6g}\n",
                     static_cast<long long>(rep.step), rep.loss, rep.lr,
                     std::isfinite(rep.grad_norm) ? std::to_string(rep.grad_norm).c_str() : "null", rep.seconds, rep.tokens_per_s);
        std::fflush(log_.get());
      }
      if (o_.on_step) o_.on_step(rep);
    }
    watch_divergence(step, loss, last_norm_);
    note_progress();
  }
  /// What an interruption's line says from now on: the step in progress and the last checkpoint.
  void note_progress() const {
    if (!o_.handle_signals) return;
    char text[480];
    const int n = std::snprintf(text, sizeof text, " at step %lld; %s%s%s", static_cast<long long>(next_ - o_.first_step + 1),
                                last_checkpoint_.empty() ? "no checkpoint saved or loaded" : "last checkpoint '",
                                last_checkpoint_.c_str(), last_checkpoint_.empty() ? "" : "'");
    if (n > 0) detail::set_interrupt_text(text, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof text - 1));
  }
  /// trainer_options::divergence_factor's watch over step `step`'s global loss
  /// and gradient norm: a warning on rank 0, or (stop_on_divergence) an error on every rank.
  void watch_divergence(std::int64_t step, double loss, double norm) {
    const double f = o_.divergence_factor;
    if (!(f > 0) || !std::isfinite(loss)) return;
    char what[256] = "";
    if (watched_ > 0 && min_loss_ > 0 && loss > f * min_loss_)
      std::snprintf(what, sizeof what, "the loss %.6g is %.3g times its lowest so far (%.6g, at step %lld)", loss, loss / min_loss_,
                    min_loss_, static_cast<long long>(min_step_ - o_.first_step + 1));
    else if (std::isfinite(norm) && norms_ >= 5 && norm > f * norm_sum_ / static_cast<double>(norms_))
      std::snprintf(what, sizeof what, "the gradient norm %.6g is %.3g times its mean over the %lld steps before (%.6g)", norm,
                    norm * static_cast<double>(norms_) / norm_sum_, static_cast<long long>(norms_), norm_sum_ / static_cast<double>(norms_));
    if (watched_++ == 0 || loss < min_loss_) min_loss_ = loss, min_step_ = step;
    if (std::isfinite(norm)) norm_sum_ += norm, ++norms_;
    if (what[0] == '\0') {
      diverging_ = false;
      return;
    }
    const std::string advice = "; lower the learning rate" + clip_hint() + ", or look at the data of these steps";
    if (o_.stop_on_divergence)
      throw std::runtime_error(at(step) + what + ": the run diverges; stopped (stop_on_divergence, --stop-on-divergence)" +
                               (last_checkpoint_.empty() ? std::string("; this run saved and loaded no checkpoint")
                                                         : "; the last checkpoint is '" + last_checkpoint_ + "'") + advice);
    if (!diverging_ && net_.rank() == 0 && o_.out) {
      const std::string msg = "warning: " + at(step) + what + ": the run may be diverging" + advice;
      if (line_ && o_.progress) line_->note(msg.c_str());
      else std::fprintf(o_.out, "%s\n", msg.c_str());
    }
    diverging_ = true;
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
  template <class Data> void queue_step(Data& data, std::int64_t step) {
    if constexpr (figures_on_device) {
      const auto be = net_.backend();
      if (figures_.numel() == 0) {
        {
          const place_scope where(be.memory());
          figures_ = tensor<double>({4 * o_.log_every + 1}, mem_kind::workspace);
        }
        be.fill_zero(figures_.data(), figures_.v().bytes());
      }
      if (queue_.empty()) queued_since_ = std::chrono::steady_clock::now();
      auto* rec = figure(queue_.size());
      be.fill_zero(rec, sizeof *rec);
      const auto b = fetch(data, step);
      step_ctx c = context_of(b, data.global_batch(), labelled(data, step));
      c.loss_sum = &rec->loss;
      double share = 0;
      const bool keep = keeps_rounded();
      if (keep) {
        try {
          round_weights_once();
          be.bf16_products(true);  // a GPU's GEMMs on its bf16 tensor cores: the layers' operands are bf16 values
          share = net_.train_step(c, b.inputs, detail::labels_of(b));
          be.bf16_products(false);
        } catch (...) {
          be.bf16_products(false);
          put_master_back();
          throw;
        }
      } else {
        weights_scope w(bf16(), local_params(), master_, backend());
        share = net_.train_step(c, b.inputs, detail::labels_of(b));
        w.restore();
      }
      // several ranks: the norm always, summed over the world, so that a non-finite gradient on
      // any rank halts every rank's update (each rank's loss check sees only its own share)
      const bool norm = o_.max_grad_norm > 0 || o_.check_grad_norm || net_.world_size() > 1;
      if (norm) net_.grad_sum_squares_into(&rec->sum_squares);
      be.launch(1, kernels::check_step{rec, halt(), o_.max_grad_norm, static_cast<double>(queue_.size() + 1), norm});
      set_lr(step);
      queue_.push_back({step, share, last_lr_});
      if constexpr (requires { net_.apply_optimizer(opt_, state_, kernels::update_gate{}, master_.v()); }) {
        if (keep) net_.apply_optimizer(opt_, state_, kernels::update_gate{&rec->scale, halt()}, master_.v());
        else net_.apply_optimizer(opt_, state_, kernels::update_gate{&rec->scale, halt()});
      } else {
        net_.apply_optimizer(opt_, state_, kernels::update_gate{&rec->scale, halt()});
      }
      next_ = step + 1;
    }
  }
  /// Read the queued steps' figures (the host's one wait), check them in
  /// order and report each; a faulty step throws, its updates and those after
  /// it undone in the host's counts (the device made none).
  void read_queued(index_t rows, index_t seq, train_result* r) {
    if constexpr (figures_on_device) {
      if (queue_.empty()) return;
      put_master_back();  // from here the parameters are the fp32 weights again (a halted step changed neither)
      const auto be = net_.backend();
      const std::size_t k = queue_.size();
      const auto f = be.host_readable(cview<double>(figures_.data(), {static_cast<index_t>(4 * k)}), figures_host_);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - queued_since_).count() / static_cast<double>(k);
      const bool norm = o_.max_grad_norm > 0 || o_.check_grad_norm || net_.world_size() > 1;  // as queue_step
      for (std::size_t i = 0; i < k; ++i) {
        const auto q = queue_[i];
        const double loss = net_.reduce_loss(q.share + f[static_cast<index_t>(4 * i)]);
        const double sq = f[static_cast<index_t>(4 * i + 1)], fault = f[static_cast<index_t>(4 * i + 3)];
        if (fault != 0 || !std::isfinite(loss)) {
          if constexpr (requires { state_.steps -= 1; }) state_.steps -= static_cast<std::int64_t>(k - i);
          be.fill_zero(halt(), sizeof(double));  // updates go again
          next_ = q.step;
          queue_.clear();
          if (!std::isfinite(loss)) throw loss_error(q.step, loss);
          throw norm_error(q.step, std::sqrt(sq), loss, i + 1 == k);  // the gradients held are the last step's
        }
        last_norm_ = norm ? std::sqrt(sq) : std::numeric_limits<double>::quiet_NaN();
        last_lr_ = q.lr;
        last_dt_ = dt;
        report(q.step, loss, dt, rows, seq);
        if (r) {
          r->losses.push_back(loss);
          r->step_seconds.push_back(dt);
        }
      }
      queue_.clear();
    }
  }

  /// Under bf16 with log_every > 1 and an optimizer that writes rounded
  /// copies (RoundingOptimizer): the queued steps keep the fp32 master weights
  /// in master_ and the parameters rounded to bf16 from one step to the next,
  /// the optimizer's pass writing both, until the host reads the steps'
  /// figures; only the first step of each read rounds and copies, and the
  /// read puts the master weights back (rounded_ says which holds).
  bool keeps_rounded() const {
    if constexpr (RoundingOptimizer<Opt> &&
                  requires(Net& n, const Opt& o, typename Opt::state& st, view<float> m) {
                    n.apply_optimizer(o, st, kernels::update_gate{}, m);
                  })
      return bf16();
    else
      return false;
  }
  /// The first queued step's rounding: the fp32 weights into master_, the parameters rounded in place.
  void round_weights_once() {
    if (rounded_) return;
    const auto p = local_params();
    const auto be = backend();
    {
      const place_scope where(be.memory());
      master_.resize(p.shape());
    }
    be.copy(master_.data(), p.data(), p.bytes());
    be.launch(p.numel(), kernels::to_bf16{p.data()});
    rounded_ = true;
  }
  /// The fp32 master weights back into the parameters, where the queued steps left them rounded.
  void put_master_back() {
    if (!rounded_) return;
    rounded_ = false;
    const auto p = local_params();
    backend().copy(p.data(), master_.data(), p.bytes());
  }

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
  template <class Data, class Eval> train_result run_with(Data& data, steps n, Eval* eval) {
    train_result r;
    if constexpr (data_ok<Data>) {
      if (n.value < 0) throw std::invalid_argument("whale::trainer::run: steps must be >= 0 (got " + std::to_string(n.value) + ")");
      if constexpr (!std::is_void_v<Eval>) {
        if constexpr (std::is_same_v<data_target_t<Eval>, float>)
          if (o_.eval_metric) metric_of(*eval);  // refuses float targets, saying why, before any step
      }
      r.losses.reserve(static_cast<std::size_t>(n.value));
      r.step_seconds.reserve(static_cast<std::size_t>(n.value));
      if constexpr (checkpoints) {
        if (o_.resume && !resumed_) {
          resumed_ = true;
          // a directory with only what an interrupted save left aside is not a fresh start: load says so
          if (!ckpt::latest(o_.checkpoint_dir).empty() || !ckpt::leftovers(o_.checkpoint_dir).empty()) {
            const auto info = load(o_.checkpoint_dir);
            if (o_.progress && net_.rank() == 0 && o_.out) {
              std::fprintf(o_.out, "resumed from %s (step %lld, saved under %s)\n", info.dir.c_str(), static_cast<long long>(info.step), info.plan.c_str());
              if (!info.note.empty()) std::fprintf(o_.out, "note: %s\n", info.note.c_str());
            }
          }
        }
      }
      if (n.value > 0) check_memory_first(data);
      line_.emplace(n.value, data.seq() > 1, (o_.progress && net_.rank() == 0) ? o_.out : nullptr, o_.plain_every);
      line_steps_ = 0;
      for (std::int64_t s = 0; s < n.value; ++s) {
        bool save_due = false;
        if constexpr (checkpoints) save_due = o_.save_every > 0 && (next_ + 1) % o_.save_every == 0;
        bool eval_due = false;
        if constexpr (!std::is_void_v<Eval>) eval_due = o_.eval_every > 0 && (next_ + 1) % o_.eval_every == 0;
        if (deferring()) {
          queue_step(data, next_);
          if (static_cast<std::int64_t>(queue_.size()) == o_.log_every || s + 1 == n.value || save_due || eval_due)
            read_queued(data.global_batch() * data.seq(), data.seq(), &r);
          if constexpr (checkpoints)
            if (save_due) save();
        } else {
          r.losses.push_back(step(data, next_));
          r.step_seconds.push_back(last_dt_);
        }
        if constexpr (!std::is_void_v<Eval>)
          if (eval_due) run_eval(*eval);
      }
      line_.reset();  // manual steps after run() start a line of their own
    }
    return r;
  }
  template <class Eval> void run_eval(Eval& eval) {
    if constexpr (requires { evaluate(eval, steps{1}, 0); }) {
      const eval_report rep{next_, evaluate(eval, steps{o_.eval_steps}, 0), o_.eval_metric ? metric_of(eval) : std::nan("")};
      char buf[128];
      const int n = std::snprintf(buf, sizeof buf, "eval after step %lld  loss %.4f", static_cast<long long>(rep.step), rep.loss);
      if (o_.eval_metric && n > 0) std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), "  metric %.4f", rep.metric);
      if (line_) line_->note(buf);
      open_continued_log(rep.step);
      if (log_) {
        std::fprintf(log_.get(), "{\"step\":%lld,\"eval_loss\":%.9g", static_cast<long long>(rep.step), rep.loss);
        if (o_.eval_metric) std::fprintf(log_.get(), ",\"eval_metric\":%.9g", rep.metric);
        std::fputs("}\n", log_.get());
        std::fflush(log_.get());
      }
      if (o_.on_eval) o_.on_eval(rep);
    } else {
      static_assert(requires { evaluate(eval, steps{1}, 0); }, "whale::trainer: this network has no forward-only evaluate()");
    }
  }

  /// trainer_options::eval_metric over eval_steps steps of `eval`: the global sum / count.
  template <class Eval> double metric_of(Eval& eval) {
    if constexpr (std::is_same_v<data_target_t<Eval>, float>) {
      throw std::invalid_argument("whale::trainer: eval_metric compares logits with class labels, and this data gives "
                                  "float targets; a regression run's evaluation is its loss (leave eval_metric unset)");
    } else if constexpr (!detail::gives_logits_v<Net>) {
      throw std::invalid_argument("whale::trainer: eval_metric needs the logits, and this plan does not gather them (its model "
                                  "ends in a split region: end it in softmax_cross_entropy after the region)");
    } else {
      metric_share m;
      for (std::int64_t s = 0; s < o_.eval_steps; ++s) {
        const auto b = fetch(eval, s);
        step_ctx c = context_of(b, eval.global_batch(), -1);
        weights_scope w(bf16(), local_params(), master_, backend());
        const auto logits = net_.forward(c, b.inputs);
        w.restore();
        const auto share = o_.eval_metric(logits.v(), b.labels);
        m.sum += share.sum, m.count += share.count;
      }
      // every rank of a replica holds the same rows: the world sum counts each replica equally often
      if constexpr (Checkpointable<Net>)
        if (auto* w = ckpt::world_of(net_)) {
          double v[2] = {m.sum, m.count};
          all_reduce(*w, view<double>(v, {2}));
          m.sum = v[0], m.count = v[1];
        }
      return m.count > 0 ? m.sum / m.count : std::nan("");
    }
  }

  Net& net_;
  Opt opt_;
  trainer_options o_;
  typename Opt::state state_;
  tensor<float> master_{shape{0}, mem_kind::params};  // bf16: the fp32 master weights during a step
  bool rounded_ = false;  // the parameters hold the rounded weights and master_ the fp32 ones (keeps_rounded)
  std::int64_t next_ = 0;
  bool resumed_ = false;
  double last_norm_ = 0, last_lr_ = 0, last_dt_ = 0;
  std::optional<progress_line> line_;  // of run(), or of manual steps
  tensor<double> figures_{shape{0}, mem_kind::workspace};  // log_every > 1: log_every step_figures, then the halt flag
  std::vector<double> figures_host_;                        // their copy on the host, when read
  std::vector<queued> queue_;                               // steps queued since the last read
  std::chrono::steady_clock::time_point queued_since_;
  std::int64_t line_steps_ = 0;
  struct file_close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, file_close> log_;
  bool log_pending_ = false;  // an existing log to continue, opened at the first line
  std::string last_checkpoint_;  // the step folder this trainer saved or loaded last
  // the divergence watch: steps seen, the lowest loss and its step, the norms' sum and count, a warning given
  std::int64_t watched_ = 0, min_step_ = 0, norms_ = 0;
  double min_loss_ = 0, norm_sum_ = 0;
  bool diverging_ = false;
};

}  // namespace whale
