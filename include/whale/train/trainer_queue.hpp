// The trainer's steps whose figures stay in the device's memory
// (trainer_options::log_every > 1): a queued step adds its loss and squared
// gradient norm into a record on the device, checks them and gates the
// update there, and the host reads every queued step's record in one copy.
// Also bf16's rounded weights kept between queued steps. Member definitions
// of trainer (train/trainer.hpp, which includes this file at its end).
#pragma once

#include "whale/train/trainer.hpp"

namespace whale {

template <Trainable Net, Optimizer Opt>
template <class Data>
void trainer<Net, Opt>::queue_step(Data& data, std::int64_t step) {
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
    queue_.push_back({step, share, rec_.last_lr});
    if constexpr (requires { net_.apply_optimizer(opt_, state_, kernels::update_gate{}, master_.v()); }) {
      if (keep) net_.apply_optimizer(opt_, state_, kernels::update_gate{&rec->scale, halt()}, master_.v());
      else net_.apply_optimizer(opt_, state_, kernels::update_gate{&rec->scale, halt()});
    } else {
      net_.apply_optimizer(opt_, state_, kernels::update_gate{&rec->scale, halt()});
    }
    next_ = step + 1;
  }
}

template <Trainable Net, Optimizer Opt>
void trainer<Net, Opt>::read_queued(index_t rows, index_t seq, train_result* r) {
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
}

template <Trainable Net, Optimizer Opt>
bool trainer<Net, Opt>::keeps_rounded() const {
  if constexpr (RoundingOptimizer<Opt> &&
                requires(Net& n, const Opt& o, typename Opt::state& st, view<float> m) {
                  n.apply_optimizer(o, st, kernels::update_gate{}, m);
                })
    return bf16();
  else
    return false;
}

template <Trainable Net, Optimizer Opt>
void trainer<Net, Opt>::round_weights_once() {
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

template <Trainable Net, Optimizer Opt>
void trainer<Net, Opt>::put_master_back() {
  if (!rounded_) return;
  rounded_ = false;
  const auto p = local_params();
  backend().copy(p.data(), master_.data(), p.bytes());
}

}  // namespace whale
