// wsp_trainer's larger members (train/wsp_trainer.hpp), defined: a step and
// a wave of minibatches, the end of a wave (the push of the worker's update,
// the wait for the slowest worker within the staleness bound, the pull), the
// gated update, and the checks of a wave and of the options' use.
#pragma once

#include "whale/train/wsp_trainer.hpp"

namespace whale {

template <class Net, class Opt>
template <class Data> std::vector<double> wsp_trainer<Net, Opt>::wave(Data& data, std::int64_t first) {
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
    host_update(clip_scale(static_cast<float>(1.0 / share_), first + k));
    ++steps_;
  }
  in_wave_ = n;
  end_wave();
  return losses;
}

template <class Net, class Opt>
void wsp_trainer<Net, Opt>::end_wave(bool wait) {
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

template <class Net, class Opt>
void wsp_trainer<Net, Opt>::gated_update(int k) {
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
    if constexpr (fusable) {
      if (fused_) return net_->apply_optimizer(opt_, state_, gate, wave_.delta(static_cast<float>(share_)));
    }
    net_->apply_optimizer(opt_, state_, gate);
  } else {
    (void)k;
    throw std::logic_error("whale::wsp_trainer: a device's update needs a gated optimizer");
  }
}

template <class Net, class Opt>
void wsp_trainer<Net, Opt>::check_wave() {
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

template <class Net, class Opt>
void wsp_trainer<Net, Opt>::check_usable() const {
  if (!spent_.empty())
    throw std::logic_error("whale::wsp_trainer: this trainer stopped at a fault (" + spent_ +
                           "); on a device the fault is seen at the wave's end, so it cannot go on: make a new "
                           "wsp_trainer (from a checkpoint) to continue");
}

template <class Net, class Opt>
template <class Data> double wsp_trainer<Net, Opt>::step(Data& data, std::int64_t step) {
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
  host_update(clip_scale(static_cast<float>(1.0 / share_), step));
  if (++in_wave_ == o_.wave) end_wave();
  ++steps_;
  return loss;
}

}  // namespace whale
