// What a training run reports, whatever its model: the progress line, the
// metrics log (JSON lines; a resumed run continues it), the divergence watch,
// the messages that name a step, and the text an interruption prints. Not a
// template: the trainer of every model and optimizer uses this one class, and
// the checks of trainer_options that need neither are here too.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "whale/detail/io.hpp"
#include "whale/train/interrupt.hpp"
#include "whale/train/progress.hpp"
#include "whale/train/trainer_options.hpp"

namespace whale::detail {

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

/// The checks of trainer_options that hold for any network and optimizer:
/// throws std::invalid_argument naming the option and its value.
inline void check_trainer_options(const trainer_options& o) {
  auto at_least = [](std::int64_t v, std::int64_t lo, const char* name) {
    if (v < lo)
      throw std::invalid_argument(std::string("whale::trainer: ") + name + " must be >= " + std::to_string(lo) + " (got " +
                                  std::to_string(v) + ")");
  };
  at_least(o.save_every, 0, "save_every");
  at_least(o.eval_every, 0, "eval_every");
  at_least(o.eval_steps, 1, "eval_steps");
  at_least(o.total_steps, 0, "total_steps");
  at_least(o.log_every, 1, "log_every");
}

/// The checkpoint options' own checks (after those of the network's precision, in the trainer).
inline void check_checkpoint_options(const trainer_options& o) {
  if (o.keep_last < 0) throw std::invalid_argument("whale::trainer: keep_last must be >= 0 (got " + std::to_string(o.keep_last) + ")");
  if ((o.save_every > 0 || o.resume) && o.checkpoint_dir.empty())
    throw std::invalid_argument("whale::trainer: save_every and resume need trainer_options::checkpoint_dir");
}

/// A run's reports. The trainer passes its options to each call (it owns them).
class run_record {
 public:
  double last_norm = 0, last_lr = 0, last_dt = 0;  ///< of the step reported last
  std::string last_checkpoint;                      ///< the step folder saved or loaded last
  std::optional<progress_line> line;                ///< of run(), or of manual steps
  std::int64_t line_steps = 0;                      ///< steps on `line`

  /// On the rank that writes the log (rank 0): checks trainer_options::log_path
  /// and opens it, or marks an existing log to continue at the first line.
  /// Returns "" or the reason, for the caller to agree on over every rank.
  std::string open_log(const trainer_options& o) {
    const auto lines = count_lines(o.log_path);
    const bool continues = lines > 0 && !o.overwrite_log && (o.resume || o.continue_log);
    if (auto why = output_path_problem(o.log_path); !why.empty())
      return "whale::trainer: the metrics log (trainer_options::log_path, --log) '" + o.log_path + "': " + why + "; nothing was run";
    if (lines > 0 && !o.overwrite_log && !continues)
      return "whale::trainer: the metrics log (trainer_options::log_path, --log) '" + o.log_path + "' exists (" +
             std::to_string(lines) +
             " lines) and this run would overwrite it: continue it by resuming from a checkpoint (--resume), replace it with "
             "--overwrite-log (trainer_options::overwrite_log), or give another path; nothing was run";
    if (continues) log_pending_ = true;  // opened when the first step is known (after a resume's load)
    else if (log_.reset(std::fopen(o.log_path.c_str(), "w")); !log_)
      return "whale::trainer: the metrics log '" + o.log_path + "' cannot be opened: " + system_reason(errno);
    return {};
  }

  /// A new progress line of `total` steps (0: open-ended); `speaks`: this rank prints it.
  void start_line(const trainer_options& o, std::int64_t total, bool tokens, bool speaks) {
    line.emplace(total, tokens, (o.progress && speaks) ? o.out : nullptr, o.plain_every);
    line_steps = 0;
  }

  /// The progress line, the metrics log and on_step for data step `step`, then
  /// the divergence watch. `flops`: the model FLOPs of the step on this rank.
  void report(const trainer_options& o, std::int64_t step, double loss, double dt, index_t rows, index_t seq, double flops,
              bool speaks) {
    if (!line) line.emplace(o.total_steps, seq > 1, (o.progress && speaks) ? o.out : nullptr, o.plain_every);  // (the count goes on)
    line->update(++line_steps, loss, dt, static_cast<double>(rows), flops);
    open_continued_log(o, step);
    if (o.on_step || log_) {
      const step_report rep{step, loss, last_lr, last_norm, dt, dt > 0 ? static_cast<double>(rows) / dt : 0};
      if (log_) {
        std::fprintf(log_.get(), "{\"step\":%lld,\"loss\":%.9g,\"lr\":%.9g,\"grad_norm\":%s,\"step_s\":%.6g,\"tokens_per_s\":%.6g}\n",
                     static_cast<long long>(rep.step), rep.loss, rep.lr,
                     std::isfinite(rep.grad_norm) ? std::to_string(rep.grad_norm).c_str() : "null", rep.seconds, rep.tokens_per_s);
        std::fflush(log_.get());
      }
      if (o.on_step) o.on_step(rep);
    }
    watch_divergence(o, step, loss, last_norm, speaks);
  }

  /// An evaluation's line: under the progress line, in the metrics log, and on_eval.
  void report_eval(const trainer_options& o, const eval_report& rep) {
    char buf[128];
    const int n = std::snprintf(buf, sizeof buf, "eval after step %lld  loss %.4f", static_cast<long long>(rep.step), rep.loss);
    if (o.eval_metric && n > 0) std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), "  metric %.4f", rep.metric);
    if (line) line->note(buf);
    open_continued_log(o, rep.step);
    if (log_) {
      std::fprintf(log_.get(), "{\"step\":%lld,\"eval_loss\":%.9g", static_cast<long long>(rep.step), rep.loss);
      if (o.eval_metric) std::fprintf(log_.get(), ",\"eval_metric\":%.9g", rep.metric);
      std::fputs("}\n", log_.get());
      std::fflush(log_.get());
    }
    if (o.on_eval) o.on_eval(rep);
  }

  /// What an interruption's line says from now on: `next`, the data step in
  /// progress, and the last checkpoint.
  void note_progress(const trainer_options& o, std::int64_t next) const {
    if (!o.handle_signals) return;
    char text[480];
    const int n = std::snprintf(text, sizeof text, " at step %lld; %s%s%s", static_cast<long long>(next - o.first_step + 1),
                                last_checkpoint.empty() ? "no checkpoint saved or loaded" : "last checkpoint '",
                                last_checkpoint.c_str(), last_checkpoint.empty() ? "" : "'");
    if (n > 0) set_interrupt_text(text, std::min<std::size_t>(static_cast<std::size_t>(n), sizeof text - 1));
  }

  /// "whale::trainer: step N (data step S): " — steps named from 1, as the progress line counts them.
  static std::string at(const trainer_options& o, std::int64_t step) {
    return "whale::trainer: step " + std::to_string(step - o.first_step + 1) +
           (o.first_step ? " (data step " + std::to_string(step) + ")" : "") + ": ";
  }
  static std::string clip_hint(const trainer_options& o) {
    return o.max_grad_norm > 0 ? "" : ", clip gradients (trainer_options::max_grad_norm)";
  }
  static std::runtime_error loss_error(const trainer_options& o, std::int64_t step, double loss) {
    return std::runtime_error(at(o, step) + "the loss is " + (std::isnan(loss) ? "NaN" : "infinite") +
                              "; check the data for NaN/Inf, lower the learning rate" + clip_hint(o) +
                              ", or run with --check-finite to name the first layer whose output is not finite");
  }
  /// `where`: the first layer with a non-finite gradient, when known.
  static std::runtime_error norm_error(const trainer_options& o, std::int64_t step, double norm, double loss,
                                       const std::string& where) {
    return std::runtime_error(at(o, step) + "the gradient norm is " + (std::isnan(norm) ? "NaN" : "infinite") +
                              " while the loss is finite (" + std::to_string(loss) + ")" +
                              (where.empty() ? "" : "; the first layer with a non-finite gradient is " + where) +
                              "; no parameter was updated. Look for NaN/Inf in the input data (a ReLU hides a NaN "
                              "input from the loss, not from the weight gradients), lower the learning rate" + clip_hint(o) +
                              ", or run with --check-finite to name the first layer whose output is not finite");
  }

 private:
  /// A continued metrics log, opened before the first line this run writes, of
  /// data step `from`: its lines of data steps `from` and later (and evaluations
  /// after step `from`) are dropped, as the run writes them again.
  void open_continued_log(const trainer_options& o, std::int64_t from) {
    if (!log_pending_) return;
    log_pending_ = false;
    keep_log_before(o.log_path, from, "whale::trainer: the metrics log");
    log_.reset(std::fopen(o.log_path.c_str(), "a"));
    if (!log_) throw std::runtime_error("whale::trainer: the metrics log '" + o.log_path + "' cannot be opened: " + system_reason(errno));
  }

  /// trainer_options::divergence_factor's watch over step `step`'s global loss
  /// and gradient norm: a warning where `speaks`, or (stop_on_divergence) an error on every rank.
  void watch_divergence(const trainer_options& o, std::int64_t step, double loss, double norm, bool speaks) {
    const double f = o.divergence_factor;
    if (!(f > 0) || !std::isfinite(loss)) return;
    char what[256] = "";
    if (watched_ > 0 && min_loss_ > 0 && loss > f * min_loss_)
      std::snprintf(what, sizeof what, "the loss %.6g is %.3g times its lowest so far (%.6g, at step %lld)", loss, loss / min_loss_,
                    min_loss_, static_cast<long long>(min_step_ - o.first_step + 1));
    else if (std::isfinite(norm) && norms_ >= 5 && norm > f * norm_sum_ / static_cast<double>(norms_))
      std::snprintf(what, sizeof what, "the gradient norm %.6g is %.3g times its mean over the %lld steps before (%.6g)", norm,
                    norm * static_cast<double>(norms_) / norm_sum_, static_cast<long long>(norms_), norm_sum_ / static_cast<double>(norms_));
    if (watched_++ == 0 || loss < min_loss_) min_loss_ = loss, min_step_ = step;
    if (std::isfinite(norm)) norm_sum_ += norm, ++norms_;
    if (what[0] == '\0') {
      diverging_ = false;
      return;
    }
    const std::string advice = "; lower the learning rate" + clip_hint(o) + ", or look at the data of these steps";
    if (o.stop_on_divergence)
      throw std::runtime_error(at(o, step) + what + ": the run diverges; stopped (stop_on_divergence, --stop-on-divergence)" +
                               (last_checkpoint.empty() ? std::string("; this run saved and loaded no checkpoint")
                                                        : "; the last checkpoint is '" + last_checkpoint + "'") + advice);
    if (!diverging_ && speaks && o.out) {
      const std::string msg = "warning: " + at(o, step) + what + ": the run may be diverging" + advice;
      if (line && o.progress) line->note(msg.c_str());
      else std::fprintf(o.out, "%s\n", msg.c_str());
    }
    diverging_ = true;
  }

  struct file_close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, file_close> log_;
  bool log_pending_ = false;  // an existing log to continue, opened at the first line
  // the divergence watch: steps seen, the lowest loss and its step, the norms' sum and count, a warning given
  std::int64_t watched_ = 0, min_step_ = 0, norms_ = 0;
  double min_loss_ = 0, norm_sum_ = 0;
  bool diverging_ = false;
};

}  // namespace whale::detail
