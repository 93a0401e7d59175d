// What a training run is told and what it reports: `trainer_options`,
// `step_report`, `eval_report`, `train_result` and `steps`. Plain data; the
// loop that reads them is train/trainer.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/plan/precision_rule.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// Number of training steps, as users write it: `steps{100}`.
struct steps {
  std::int64_t value = 0;
};

/// What one step did, for trainer_options::on_step and the metrics log.
struct step_report {
  std::int64_t step = 0;     ///< the data step (from 0)
  double loss = 0;           ///< global mean loss
  double lr = 0;             ///< the learning rate applied (the optimizer's, or the schedule's)
  double grad_norm = 0;      ///< global gradient norm before clipping (NaN if not computed)
  double seconds = 0;        ///< wall time of the step
  double tokens_per_s = 0;   ///< rows (tokens, or samples) of the global batch per second
};

/// What one evaluation did, for trainer_options::on_eval and the metrics log.
struct eval_report {
  std::int64_t step = 0;  ///< data steps trained when it ran (the next data step)
  double loss = 0;        ///< global mean loss over the evaluation steps
  double metric = 0;      ///< trainer_options::eval_metric over the same steps (NaN without one)
};

/// A metric's share of one batch: the sum of its per-row values and the rows
/// (or weight) they count for; the evaluation reports sum / count over the
/// global batches.
struct metric_share {
  double sum = 0, count = 0;
};

struct trainer_options {
  double max_grad_norm = 0;      ///< clip gradients to this global norm (0: no clipping)
  bool progress = true;          ///< print the progress line (rank 0 only)
  /// A run that diverges: when the loss rises past this factor times its lowest
  /// so far, or the gradient norm past this factor times its mean over the
  /// earlier steps (from the 6th step), rank 0 prints a warning naming the step
  /// to `out` (once, until the figures fall back below). 0: no watch.
  double divergence_factor = 10;
  /// With the watch: end the run there instead (every rank; the figures are
  /// global), naming the last checkpoint this trainer saved or loaded (--stop-on-divergence).
  bool stop_on_divergence = false;
  /// SIGINT (Ctrl-C) and SIGTERM end the process at once with one line on rank 0,
  /// "whale: interrupted (SIGINT) at step N; last checkpoint '…'" (a save in
  /// progress is finished first), exit status 128 + the signal. The handlers are
  /// installed when the trainer is made, unless the program has its own; false: none.
  bool handle_signals = true;
  std::FILE* out = stderr;       ///< where the progress line goes
  int plain_every = 10;          ///< without a terminal, print every this many steps
  std::int64_t first_step = 0;   ///< data step of the first step (for resuming)
  /// Compute the global gradient norm every step (also without clipping) and
  /// fail, naming the step and the first layer with a non-finite gradient, if
  /// it is NaN or Inf: one pass over this rank's gradients and an 8-byte
  /// all-reduce per step. false: only when clipping.
  bool check_grad_norm = true;
  /// How often run() makes the host wait for the device: every `log_every`
  /// steps it reads the steps' losses and gradient norms since the last read,
  /// checks them, and reports them (progress line, metrics log, on_step, the
  /// result), each step with its own loss and norm and the interval's mean
  /// step time. In between, a step leaves its loss, norm and clipping scale in
  /// the device's memory and the optimizer reads them there, so the host queues
  /// the next step without waiting. A step whose loss or norm is not finite
  /// stops every update after it on the device; the read names that step,
  /// with the parameters and optimizer state as they were before it. run()
  /// also reads at its last step and before a checkpoint or an evaluation.
  /// 1: every step is read and checked as it ends. Single-process networks
  /// with sgd or adamw; plans, and --check-finite, read every step.
  std::int64_t log_every = 1;
  /// Debugging: check every leaf layer's output and input gradient for NaN/Inf
  /// (a pass over every activation; also plan_options::check_finite, --check-finite).
  bool check_finite = false;
  /// Checkpoints (train/checkpoint.hpp): run() saves to `checkpoint_dir` after
  /// every `save_every` data steps (0: never), keeping the newest `keep_last`
  /// (0: all); with `resume`, run() first loads the newest complete checkpoint
  /// in `checkpoint_dir` if there is one, and continues from its step.
  std::string checkpoint_dir;
  /// Metrics log: rank 0 writes one JSON object per step to this file (flushed per line):
  /// {"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s"}. Checked when the trainer is made.
  /// An existing, non-empty log is continued when the run starts from a loaded
  /// checkpoint (`resume`, or `continue_log`): its lines from the resumed step on
  /// are dropped, so no step appears twice. Otherwise it is an error, unless
  /// `overwrite_log` replaces it.
  std::string log_path;
  bool continue_log = false;   ///< continue an existing log (the run loads a checkpoint itself; run_flags' --resume sets it)
  bool overwrite_log = false;  ///< replace an existing log (--overwrite-log)
  /// The learning rate of each data step (e.g. warmup_cosine(3e-4, 100, 2000); optim/lr_schedule.hpp),
  /// set on the optimizer (its `lr`) before each update. Empty: the optimizer's own rate.
  std::function<double(std::int64_t)> lr_schedule;
  /// Called on every rank after each step (e.g. to log, or to stop and evaluate).
  std::function<void(const step_report&)> on_step;
  /// Evaluation during run(data, n, eval_data): every `eval_every` data steps
  /// (0: never), the global mean loss of `eval_steps` steps of eval_data (from
  /// its step 0, so every evaluation sees the same batches), printed on rank 0,
  /// written to the metrics log as {"step", "eval_loss"} and passed to on_eval.
  std::int64_t eval_every = 0;
  std::int64_t eval_steps = 1;
  /// A metric of the logits, e.g. accuracy: called on every rank with the
  /// unsplit logits (rows, classes) of the rows it fetched and their labels;
  /// the evaluation reports the global sum / count (eval_report::metric, the
  /// log's "eval_metric"). Needs a model that ends in a plain loss layer (the
  /// logits are gathered); empty: none.
  std::function<metric_share(cview<float> logits, cview<std::int32_t> labels)> eval_metric;
  std::function<void(const eval_report&)> on_eval;
  /// The step count the progress line shows when stepping by hand (step());
  /// 0: none (no ETA). run() shows its own.
  std::int64_t total_steps = 0;
  /// (checkpoints, continued: see checkpoint_dir above)
  std::int64_t save_every = 0;
  int keep_last = 0;
  bool resume = false;
};

/// What a run did.
struct train_result {
  std::vector<double> losses;       ///< mean loss over the global batch, per step
  std::vector<double> step_seconds; ///< wall time per step
  double loss_first() const { return losses.empty() ? 0 : losses.front(); }
  double loss_last() const { return losses.empty() ? 0 : losses.back(); }
  /// Median step time, skipping `warmup` steps.
  double median_step_s(std::size_t warmup = 2) const {
    std::vector<double> s(step_seconds.begin() + static_cast<std::ptrdiff_t>(std::min(warmup, step_seconds.size())),
                          step_seconds.end());
    if (s.empty()) s = step_seconds;
    if (s.empty()) return 0;
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(s.size() / 2), s.end());
    return s[s.size() / 2];
  }
};

}  // namespace whale
