// One step of executor<P> (runtime/executor.hpp): the schedule's actions over
// the micro-batches — receives posted as soon as their activation slot is free,
// forward, backward (and, in split schedules, weight) passes of this rank's
// stage, sends that never block — then the
// data-axis gradient buckets and the ZeRO reduce-scatters completed. A pass
// without training runs every forward and no backward; forward(inputs) is
// such a pass that keeps the last stage's output instead of the loss.
#pragma once

#include <cstring>
#include <tuple>
#include <type_traits>

#include "whale/runtime/executor.hpp"

namespace whale {

template <class P>
double executor<P>::pass(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels, bool train, bool sync,
                         tensor<float>* logits) {
  const index_t B = c.batch, T = c.seq;
  const int m = micro_count(B);
  schedule_for(m);
  if (x.shape().rank() == 0 || x.shape()[0] != B)
    throw std::invalid_argument("whale::" + layer_name<P>() + ": the input has " +
                                std::to_string(x.shape().rank() ? x.shape()[0] : 0) + " rows but step_ctx says " +
                                std::to_string(B) + " sequences");
  if (c.accumulate && (level >= 2 || d_ > 1))
    throw std::invalid_argument("whale::" + layer_name<P>() +
                                ": accumulating gradients across train_step calls (step_ctx::accumulate) is not "
                                "supported with a data axis or ZeRO levels 2-3 (each call sums or scatters the "
                                "gradients over data); accumulate inside one step: plan_options::micro_batches");
  const index_t mb = B / m, rows = mb * T;
  const bool first = stage_ == 0, last = stage_ == p_ - 1;
  // forward-only: every forward in order; the layers keep nothing for a backward,
  // so all use activation slot 0, while each micro-batch's receive has its own buffer
  fwd_only_.clear();
  if (!train)
    for (int j = 0; j < m; ++j) fwd_only_.push_back({pipe_action::forward, j});
  const auto& acts = train ? actions_ : fwd_only_;
  const auto& slot = rep_.slot[static_cast<std::size_t>(stage_)];
  const auto& free_at = rep_.free_at[static_cast<std::size_t>(stage_)];
  auto msg_slot = [&](int j) { return train ? slot[static_cast<std::size_t>(j)] : j; };
  auto layer_slot = [&](int j) { return train ? slot[static_cast<std::size_t>(j)] : 0; };
  if (p_ > 1)
    msg_.start_step(m, train ? rep_.peak_live[static_cast<std::size_t>(stage_)] : m, rows, part_.in_width(),
                    part_.out_width(), first, last, train);
  posted_.assign(static_cast<std::size_t>(m), 0);
  auto& posted = posted_;
  if (train) sync_.start_step();
  const bool sum_data = train && sync && d_ > 1 && level < 2;
  const bool zero_hooks = level == 3 || (train && level == 2);
  step_ctx zc = c;
  if (zero_hooks) zero_.begin_pass(zc, false);

  double share = 0;
  int backwards = 0, weights_done = 0;
  if (train) deferred_ = 0;
  // Split regions over data change the rows a pass carries (batch split <-> whole); a
  // backward starts from what its forward ended with.
  batch_after_.assign(static_cast<std::size_t>(m), mb);
  auto& batch_after = batch_after_;
  for (std::size_t k = 0; k < acts.size(); ++k) {
    if (p_ > 1)  // post the receives of every micro-batch whose slot is free by now
      for (int j = 0; j < m; ++j) {
        const auto ju = static_cast<std::size_t>(j);
        if (posted[ju] || (train && free_at[ju] > static_cast<int>(k))) continue;
        posted[ju] = 1;
        msg_.post(j, msg_slot(j), stage_, train);
      }
    const auto a = acts[k];
    step_ctx mc;
    mc.batch = mb;
    mc.seq = T;
    mc.global_rows = c.global_rows > 0 ? c.global_rows : B * T;
    mc.slot = layer_slot(a.micro);
    mc.hooks = zc.hooks;
    mc.check_finite = c.check_finite || o_.check_finite;
    if (a.kind == pipe_action::forward) {
      cview<float> in;
      if (!first) {
        const auto t0 = tr_.now();
        in = msg_.activation(a.micro, msg_slot(a.micro));
        tr_.add(span_kind::recv_act, step_, a.micro, t0, tr_.now());
      }
      const auto t0 = tr_.now();
      cview<input_type> x0;
      if (first) x0 = x.rows(a.micro * mb, mb);
      view<float> y;
      if (last && logits) keep_logits(*logits, part_.logits(mc, x0, in), a.micro, m);
      else if (last) share += part_.forward_loss(mc, x0, in, labels.rows(a.micro * rows, rows));
      else y = part_.forward(mc, x0, in);
      batch_after[static_cast<std::size_t>(a.micro)] = mc.batch;
      tr_.add(span_kind::forward, step_, a.micro, t0, tr_.now());
      if (!last) {
        const auto t1 = tr_.now();
        msg_.send(y, stage_ + 1, 2 * a.micro);
        tr_.add(span_kind::send_act, step_, a.micro, t1, tr_.now());
      }
      if (train) {
        peak_live_ = std::max(peak_live_, ++live_);
        max_slot_ = std::max(max_slot_, mc.slot + 1);
      }
    } else if (a.kind == pipe_action::backward) {
      cview<float> dy;
      if (!last) {
        const auto t0 = tr_.now();
        dy = msg_.gradient(a.micro, msg_slot(a.micro));
        tr_.add(span_kind::recv_grad, step_, a.micro, t0, tr_.now());
      }
      mc.batch = batch_after[static_cast<std::size_t>(a.micro)];
      // ZeRO 2-3 add each micro-batch's reduce-scattered gradients into the owned range themselves
      mc.accumulate = (backwards > 0 && level < 2) || (c.accumulate && level < 2);
      if (level >= 2) zero_.set_accumulate(backwards > 0);
      if constexpr (split_backward) {  // the weight gradients wait for this micro-batch's W
        auto& q = weight_queue(mc.slot);
        q.clear();
        mc.deferred = &q;
      }
      const bool final_backward = ++backwards == m;
      const index_t base = part_.begin();
      if (final_backward && sum_data && o_.overlap && !split_backward)
        mc.grads_ready = [this, base](index_t off) { sync_.ready(*data_, grads_.data(), off - base); };
      const auto t0 = tr_.now();
      auto dx = part_.backward(mc, dy);
      tr_.add(span_kind::backward, step_, a.micro, t0, tr_.now());
      if (!first) {
        const auto t1 = tr_.now();
        msg_.send(dx, stage_ - 1, 2 * a.micro + 1);
        tr_.add(span_kind::send_grad, step_, a.micro, t1, tr_.now());
      }
      if (!split_backward) --live_;
    } else {  // W: the weight gradients the micro-batch's B put off; its slot is free after
      const auto t0 = tr_.now();
      const auto& q = weight_queue(layer_slot(a.micro));
      run_weight_tasks(q, weights_done++ > 0 || c.accumulate);
      deferred_ += q.size();
      tr_.add(span_kind::weight, step_, a.micro, t0, tr_.now());
      --live_;
    }
    if (p_ > 1) msg_.progress();
  }
  if (p_ > 1) msg_.flush();
  if (zero_hooks) zero_.end_pass(zc);
  if (sum_data) {
    const auto t0 = tr_.now();
    sync_.finish(*data_, grads_.data());  // launch what is left, wait for all
    tr_.add(span_kind::grad_all_reduce, step_, -1, t0, tr_.now());
  }
  ++step_;
  return share;
}

template <class P> tensor<float> executor<P>::forward(step_ctx& c, cview<input_type> x) {
  using flat = std::remove_cvref_t<decltype(part_.model())>;
  constexpr bool plain_tail = [] {
    if constexpr (requires { typename flat::tuple_type; }) {
      using tuple = typename flat::tuple_type;
      return !is_container<std::tuple_element_t<std::tuple_size_v<tuple> - 1, tuple>>;
    } else {
      return false;
    }
  }();
  static_assert(plain_tail,
                "whale::executor::forward: the model does not end in a plain loss layer (its last element is a "
                "container, e.g. split<sequential<..., Loss>>, whose class-split logits are never gathered, or the "
                "whole model is one split region); end the model in softmax_cross_entropy after the split region "
                "(sequential<..., split<linear<D, V>>, softmax_cross_entropy>) to get logits");
  tensor<float> out;
  pass(c, x, {}, false, false, &out);
  if (p_ > 1) {  // the last stage holds them
    index_t dims[2] = {out.shape().rank() == 2 ? out.shape()[0] : 0, out.shape().rank() == 2 ? out.shape()[1] : 0};
    broadcast(*pipe_, view<index_t>(dims, {2}), p_ - 1);
    if (stage_ != p_ - 1) out = tensor<float>({dims[0], dims[1]}, mem_kind::workspace);
    broadcast(*pipe_, view<float>(out.data(), {dims[0] * dims[1]}), p_ - 1);
  }
  return out;
}

template <class P> void executor<P>::keep_logits(tensor<float>& out, cview<float> y, int micro, int m) {
  const index_t r = y.shape().rank() ? y.shape()[0] : 0, w = y.shape().rank() == 2 ? y.shape()[1] : y.numel() / (r ? r : 1);
  if (micro == 0) out = tensor<float>({static_cast<index_t>(m) * r, w}, mem_kind::workspace);
  if (out.shape()[0] != static_cast<index_t>(m) * r || out.shape()[1] != w)
    throw std::logic_error("whale::executor::forward: the micro-batches' outputs differ in shape");
  std::memcpy(out.data() + static_cast<index_t>(micro) * r * w, y.data(), static_cast<std::size_t>(r * w) * sizeof(float));
}

}  // namespace whale
