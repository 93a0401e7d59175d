// The trainer's core (train/trainer_core.hpp), defined. Compiled once in
// whale::core under the compiled core (detail/compiled.hpp); inline, as the
// rest of the library, without it.
#pragma once

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "whale/optim/optimizer.hpp"
#include "whale/train/bf16_weights.hpp"
#include "whale/train/trainer_core.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/train/trainer_core_impl.hpp holds the compiled core's definitions: include whale/train/trainer_core.hpp, not this file"
#endif

namespace whale::detail {

WHALE_CORE_INLINE step_ctx trainer_core::context(index_t sequences, index_t seq, index_t global_batch, std::int64_t loss_terms) const {
  step_ctx c;
  c.batch = sequences;
  c.seq = seq;
  c.global_rows = global_batch * seq;
  c.loss_terms = loss_terms;
  c.check_finite = o_.check_finite;
  c.bf16 = bf16();
  return c;
}

WHALE_CORE_INLINE double trainer_core::step_with(step_ctx c, std::int64_t step, callback<double(step_ctx&)> pass) {
  double share = 0;
  {
    bf16_weights w(bf16(), local_params(), master_, net_backend());  // bf16: compute with rounded weights, update the master
    share = pass(c);
    w.restore();
  }
  const double loss = net_reduce_loss(share);
  if (!std::isfinite(loss)) throw loss_error(step, loss);
  float scale = 1.f;
  rec_.last_norm = std::numeric_limits<double>::quiet_NaN();
  if (o_.max_grad_norm > 0 || o_.check_grad_norm) {
    const double norm = net_grad_norm();
    rec_.last_norm = norm;
    if (!std::isfinite(norm)) throw norm_error(step, norm, loss, true);
    if (o_.max_grad_norm > 0) scale = clip_coefficient(norm, o_.max_grad_norm);
  }
  set_lr(step);
  update(scale);
  return loss;
}

WHALE_CORE_INLINE double trainer_core::evaluate_with(step_ctx c, callback<double(step_ctx&)> pass) {
  bf16_weights w(bf16(), local_params(), master_, net_backend());
  const double share = pass(c);
  w.restore();
  return net_reduce_loss(share);
}

WHALE_CORE_INLINE void trainer_core::queue_with(step_ctx c, std::int64_t step, callback<double(step_ctx&)> pass) {
  if (!traits_.figures_on_device) throw std::logic_error("whale::trainer: a step queued where the network cannot keep its figures");
  const auto be = net_backend();
  if (figures_.numel() == 0) {
    {
      const place_scope where(be.memory());
      figures_ = tensor<double>({4 * o_.log_every + 1}, mem_kind::workspace);
    }
    be.fill_zero(figures_.data(), figures_.v().bytes());
  }
  auto* rec = figure(queue_.size());
  be.fill_zero(rec, sizeof *rec);
  c.loss_sum = &rec->loss;
  double share = 0;
  const bool keep = keeps_rounded();
  if (keep) {
    try {
      round_weights_once();
      be.bf16_products(true);  // a GPU's GEMMs on its bf16 tensor cores: the layers' operands are bf16 values
      share = pass(c);
      be.bf16_products(false);
    } catch (...) {
      be.bf16_products(false);
      put_master_back();
      throw;
    }
  } else {
    bf16_weights w(bf16(), local_params(), master_, be);
    share = pass(c);
    w.restore();
  }
  // several ranks: the norm always, summed over the world, so that a non-finite gradient on
  // any rank halts every rank's update (each rank's loss check sees only its own share)
  const bool norm = o_.max_grad_norm > 0 || o_.check_grad_norm || net_world_size() > 1;
  if (norm) net_grad_sum_squares_into(&rec->sum_squares);
  be.launch(1, kernels::check_step{rec, halt(), o_.max_grad_norm, static_cast<double>(queue_.size() + 1), norm});
  set_lr(step);
  queue_.push_back({step, share, rec_.last_lr});
  update_gated(kernels::update_gate{&rec->scale, halt()}, keep);
  next_ = step + 1;
}

WHALE_CORE_INLINE void trainer_core::read_queued(index_t rows, index_t seq, train_result* r) {
  if (queue_.empty()) return;
  put_master_back();  // from here the parameters are the fp32 weights again (a halted step changed neither)
  const auto be = net_backend();
  const std::size_t k = queue_.size();
  const auto f = be.host_readable(cview<double>(figures_.data(), {static_cast<index_t>(4 * k)}), figures_host_);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - queued_since_).count() / static_cast<double>(k);
  const bool norm = o_.max_grad_norm > 0 || o_.check_grad_norm || net_world_size() > 1;  // as queue_with
  for (std::size_t i = 0; i < k; ++i) {
    const auto q = queue_[i];
    const double loss = net_reduce_loss(q.share + f[static_cast<index_t>(4 * i)]);
    const double sq = f[static_cast<index_t>(4 * i + 1)], fault = f[static_cast<index_t>(4 * i + 3)];
    if (fault != 0 || !std::isfinite(loss)) {
      rewind_optimizer(static_cast<std::int64_t>(k - i));
      be.fill_zero(halt(), sizeof(double));  // updates go again
      next_ = q.step;
      queue_.clear();
      if (!std::isfinite(loss)) throw loss_error(q.step, loss);
      throw norm_error(q.step, std::sqrt(sq), loss, i + 1 == k);  // the gradients held are the last step's
    }
    rec_.last_norm = norm ? std::sqrt(sq) : std::numeric_limits<double>::quiet_NaN();
    rec_.last_lr = q.lr;
    rec_.last_dt = dt;
    report(q.step, loss, dt, rows, seq);
    if (r) {
      r->losses.push_back(loss);
      r->step_seconds.push_back(dt);
    }
  }
  queue_.clear();
}

WHALE_CORE_INLINE void trainer_core::run_loop(std::int64_t n, const loop& l, train_result& r) {
  for (std::int64_t s = 0; s < n; ++s) {
    const bool save_due = l.save && o_.save_every > 0 && (next_ + 1) % o_.save_every == 0;
    const bool eval_due = l.eval && o_.eval_every > 0 && (next_ + 1) % o_.eval_every == 0;
    if (deferring()) {
      l.queue(next_);
      if (static_cast<std::int64_t>(queue_.size()) == o_.log_every || s + 1 == n || save_due || eval_due)
        read_queued(l.rows, l.seq, &r);
      if (save_due) (*l.save)();
    } else {
      r.losses.push_back(l.step(next_));
      r.step_seconds.push_back(rec_.last_dt);
    }
    if (eval_due) (*l.eval)();
  }
  rec_.line.reset();  // manual steps after run() start a line of their own
}

WHALE_CORE_INLINE void trainer_core::report(std::int64_t step, double loss, double dt, index_t rows, index_t seq) {
  const double r = static_cast<double>(rows), flops = traits_.flops_per_row * r + 3.0 * traits_.seq_flops_per_token * r * static_cast<double>(seq);
  rec_.report(o_, step, loss, dt, rows, seq, flops / static_cast<double>(net_world_size()), net_rank() == 0);
  rec_.note_progress(o_, next_);
}

WHALE_CORE_INLINE void trainer_core::set_lr(std::int64_t step) {
  if (!has_lr()) return;
  if (o_.lr_schedule) {
    const double rate = o_.lr_schedule(step);
    if (!std::isfinite(rate) || rate < 0)
      throw std::invalid_argument(at(step) + "the learning-rate schedule gave " + std::to_string(rate) + "; it must be finite and >= 0");
    set_optimizer_lr(rate);
  }
  rec_.last_lr = lr();
}

WHALE_CORE_INLINE std::runtime_error trainer_core::norm_error(std::int64_t step, double norm, double loss, bool locate) {
  return run_record::norm_error(o_, step, norm, loss, locate ? net_first_nonfinite_grad() : std::string());
}

WHALE_CORE_INLINE void trainer_core::round_weights_once() {
  if (rounded_) return;
  const auto p = local_params();
  const auto be = net_backend();
  {
    const place_scope where(be.memory());
    master_.resize(p.shape());
  }
  be.copy(master_.data(), p.data(), p.bytes());
  be.launch(p.numel(), kernels::to_bf16{p.data()});
  rounded_ = true;
}

WHALE_CORE_INLINE void trainer_core::put_master_back() {
  if (!rounded_) return;
  rounded_ = false;
  const auto p = local_params();
  net_backend().copy(p.data(), master_.data(), p.bytes());
}

}  // namespace whale::detail
