// One pass of executor_core (runtime/executor_core.hpp): the schedule's
// actions over the micro-batches — receives posted as soon as their activation
// slot is free, forward, backward (and, in split schedules, weight) passes of
// this rank's chunks, sends that never block — then the data-axis gradient
// buckets and the ZeRO reduce-scatters completed. A pass without training runs
// every forward and no backward. The chunks' layers are executor<P>'s: the
// pass asks for them through chunk_forward, chunk_backward and the like.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/runtime/executor_core.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/runtime/pass.hpp holds the compiled core's definitions: include whale/runtime/executor_core.hpp, not this file"
#endif

namespace whale::detail {

WHALE_CORE_INLINE void executor_core::check_pass(const step_ctx& c, pass_mode mode) const {
  if (c.accumulate && (level_ >= 2 || replicas_ > 1))
    throw std::invalid_argument(who() +
                                "accumulating gradients across train_step calls (step_ctx::accumulate) is not "
                                "supported with a data axis or ZeRO levels 2-3 (each call sums or scatters the "
                                "gradients over data); accumulate inside one step: plan_options::micro_batches");
  if (c.accumulate && tied_model_)
    throw std::invalid_argument(who() +
                                "accumulating gradients across train_step calls (step_ctx::accumulate) is not "
                                "supported with a tied head (tied_head): each call sums its gradients with the table's; "
                                "accumulate inside one step: plan_options::micro_batches");
  if (mode.train && c.bf16 != (o_.precision == precision::bf16))
    throw std::invalid_argument(who() + "a training step in " + (c.bf16 ? "bf16" : "fp32") + " (step_ctx::bf16), but the plan " +
                                "was made for " + to_string(o_.precision) + " (plan_options::precision, --precision): its " +
                                "checks and memory are the plan's; make it with the precision it trains in");
  if (mode.train && mode.data_sum && replicas_ > 1 && o_.worker_cuts)
    throw std::invalid_argument(who() +
                                "plan_options::worker_cuts gave each data replica its own stage cut, so gradients "
                                "cannot be summed over the data axis; train it with wsp_trainer (no data-axis sum), or "
                                "drop worker_cuts");
}

WHALE_CORE_INLINE double executor_core::run_pass(step_ctx& c, int m, cview<std::int32_t> labels, pass_mode mode, tensor<float>* logits,
                                      const std::array<step_ctx::host_mirror, 2>& mirrors) {
  const bool train = mode.train;
  if (train && !memory_checked_) check_step_memory(c);  // lowers the step's program
  order_for(m);  // the program's order of passes, if it has m micro-batches
  const index_t B = c.batch, T = c.seq, mb = B / m, rows = mb * T;
  const int chunk_count = facts_.chunks;
  // passes are keyed chunk·m + micro; chunk c of this rank is virtual stage c·p + stage
  const int pv = stages_ * chunk_count, keys = m * chunk_count;
  auto vstage = [&](int chunk) { return chunk * stages_ + stage_; };
  auto key_of = [&](const pipe_action& a) { return a.chunk * m + a.micro; };
  // forward-only: the schedule's forwards in order; the layers keep nothing for a
  // backward, so all use activation slot 0, while each pass's receive has its own buffer
  const auto& acts = order_.actions[train];
  const auto& rep = order_.report;
  const auto& slot = rep.slot[static_cast<std::size_t>(facts_.staged ? stage_ : 0)];
  const auto& free_at = rep.free_at[static_cast<std::size_t>(facts_.staged ? stage_ : 0)];
  auto msg_slot = [&](int key) { return train ? slot[static_cast<std::size_t>(key)] : key; };
  auto layer_slot = [&](int key) { return train ? slot[static_cast<std::size_t>(key)] : 0; };
  if (pv > 1) {
    index_t in_w = 0, out_w = 0;
    bool acts_in = false, grads_in = false;
    for (int ch = 0; ch < chunk_count; ++ch) {
      in_w = std::max(in_w, chunk_in_width(ch));
      out_w = std::max(out_w, chunk_out_width(ch));
      acts_in = acts_in || vstage(ch) > 0;
      grads_in = grads_in || (train && vstage(ch) < pv - 1);
    }
    msg_.start_step(keys, train ? rep.peak_live[static_cast<std::size_t>(stage_)] : keys, rows, in_w, out_w, acts_in, grads_in,
                    rep.in_order);
    if (msg_.channels()) msg_.set_order(order_.messages[train]);  // the order every rank issues its messages in
  }
  posted_.assign(static_cast<std::size_t>(keys), 0);
  auto& posted = posted_;
  if (train) sync_.start_step();
  const bool sum_data = train && mode.data_sum && replicas_ > 1 && level_ < 2;
  const bool zero_hooks = level_ == 3 || (train && level_ == 2);
  step_ctx zc = c;
  if (slow_.active()) zc.hooks = slow_.wrap(zc.hooks);  // inside ZeRO's: its gathers are not compute
  if (zero_hooks) zero_.begin_pass(zc, train ? zero_engine::pass_kind::training : zero_engine::pass_kind::forward_only);

  double share = 0;
  int backwards = 0, weights_done = 0;
  std::vector<int> chunk_backwards(static_cast<std::size_t>(chunk_count), 0);
  if (train) deferred_ = 0;
  // Split regions over data change the rows a pass carries (batch split <-> whole); a
  // backward starts from what its forward ended with.
  batch_after_.assign(static_cast<std::size_t>(keys), mb);
  auto& batch_after = batch_after_;
  for (std::size_t k = 0; k < acts.size(); ++k) {
    if (pv > 1)  // post the receives of every pass whose slot is free by now
      for (int key = 0; key < keys; ++key) {
        const auto ku = static_cast<std::size_t>(key);
        if (posted[ku] || (train && free_at[ku] > static_cast<int>(k))) continue;
        posted[ku] = 1;
        const int ch = key / m, j = key % m, v = vstage(ch);
        const peer_msg act{v > 0, v > 0 ? (v - 1) % stages_ : 0, 2 * (j * chunk_count + ch), chunk_in_width(ch)};
        const peer_msg grad{train && v < pv - 1, (v + 1) % stages_, 2 * (j * chunk_count + ch) + 1, chunk_out_width(ch)};
        msg_.post(key, msg_slot(key), act, grad);
      }
    if (pv > 1 && msg_.channels()) msg_.issue_through(order_.rounds[train][k]);  // the messages read by this action's round
    const auto a = acts[k];
    const int key = key_of(a), v = vstage(a.chunk);
    const auto ku = static_cast<std::size_t>(key);
    const int ch = a.chunk;
    const bool first = v == 0, last = v == pv - 1;
    step_ctx mc;
    mc.batch = mb;
    mc.seq = T;
    mc.global_rows = c.global_rows > 0 ? c.global_rows : B * T;
    mc.loss_terms = c.loss_terms;
    mc.slot = layer_slot(key);
    mc.hooks = zc.hooks;
    mc.check_finite = c.check_finite || o_.check_finite;
    mc.bf16 = c.bf16;
    mc.be = c.be;
    mc.mirrors = mirrors;
    mc.loss_sum = in_flight_ > 0 && c.loss_sum ? c.loss_sum + a.micro : c.loss_sum;  // the trainer's device record (in flight: each minibatch's own)
    if (a.kind == pipe_action::forward) {
      cview<float> in;
      if (!first) {
        const auto t0 = tr_.now();
        in = msg_.activation(key, msg_slot(key), chunk_in_width(ch));
        tr_.add(span_kind::recv_act, step_, a.micro, t0, tr_.now());
      }
      const auto t0 = tr_.now();
      view<float> y;
      if (last && logits) keep_logits(*logits, chunk_logits(ch, mc, a.micro, mb, in), a.micro, m);
      else if (last) {
        const double sh = chunk_forward_loss(ch, mc, a.micro, mb, in, labels.rows(a.micro * rows, rows));
        share += sh;
        if (in_flight_ > 0) micro_shares_[static_cast<std::size_t>(a.micro)] += sh;
      }
      else y = chunk_forward(ch, mc, a.micro, mb, in);
      batch_after[ku] = mc.batch;
      tr_.add(span_kind::forward, step_, a.micro, t0, tr_.now());
      if (!last) {
        const auto t1 = tr_.now();
        msg_.send(y, (v + 1) % stages_, 2 * (a.micro * chunk_count + (v + 1) / stages_), messenger::message_kind::activation, chunk_out_width(ch));
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
        dy = msg_.gradient(key, msg_slot(key), chunk_out_width(ch));
        tr_.add(span_kind::recv_grad, step_, a.micro, t0, tr_.now());
      }
      mc.batch = batch_after[ku];
      // ZeRO 2-3 add each micro-batch's reduce-scattered gradients into the owned range themselves
      const int done_here = chunk_backwards[static_cast<std::size_t>(a.chunk)]++;  // this chunk's layers so far
      // minibatches in flight: each backward starts its own gradients (handed over below)
      mc.accumulate = (done_here > 0 && level_ < 2 && in_flight_ == 0) || (c.accumulate && level_ < 2);
      if (level_ >= 2) zero_.set_accumulate(backwards > 0);
      if (facts_.split_backward) {  // the weight gradients wait for this micro-batch's W
        auto& q = weight_queue(mc.slot);
        q.clear();
        mc.deferred = &q;
      }
      const bool final_backward = ++backwards == m;
      const index_t base = chunk_begin(ch);
      // the buckets the program sums during backward go as the stage reports their gradients final
      if (final_backward && sum_data && sync_.during_backward())
        mc.leaf_backward_done = [this, base](index_t off) { sync_.ready(*data_, grads_.data(), off - base); };
      const auto t0 = tr_.now();
      auto dx = chunk_backward(ch, mc, dy);
      tr_.add(span_kind::backward, step_, a.micro, t0, tr_.now());
      if (!first) {
        const auto t1 = tr_.now();
        msg_.send(dx, (v - 1) % stages_, 2 * (a.micro * chunk_count + (v - 1) / stages_) + 1, messenger::message_kind::gradient, chunk_in_width(ch));
        tr_.add(span_kind::send_grad, step_, a.micro, t1, tr_.now());
      }
      if (!facts_.split_backward) --live_;
      if (in_flight_ > 0) micro_done_(a.micro);
    } else {  // W: the weight gradients the micro-batch's B put off; its slot is free after
      const auto t0 = tr_.now();
      const auto& q = weight_queue(layer_slot(key));
      run_weight_tasks(q, weights_done++ > 0 || c.accumulate);
      deferred_ += q.size();
      tr_.add(span_kind::weight, step_, a.micro, t0, tr_.now());
      --live_;
    }
    if (pv > 1) msg_.progress();
  }
  if (pv > 1) msg_.flush();
  if (zero_hooks) zero_.end_pass(zc);
  if (sum_data) {
    const auto t0 = tr_.now();
    sync_.finish(*data_, grads_.data());  // launch what is left, wait for all
    tr_.add(span_kind::grad_all_reduce, step_, -1, t0, tr_.now());
  }
  // tied heads: table and head both take the sum of their gradients (a pass without the data-axis sum
  // too: wsp_trainer pushes those gradients as they are)
  if (train && !ties_.empty()) {
    if (level_ >= 2)
      tie_owned_grads(ties_, zero_.shard_grads().data(), zero_.begin(), zero_.end(), be_, *data_, pipe_, stage_);
    else
      tie_grads(ties_, grads_.data(), be_, pipe_, stage_);
  }
  ++step_;
  return share;
}


WHALE_CORE_INLINE void executor_core::keep_logits(tensor<float>& out, cview<float> y, int micro, int m) {
  const index_t r = y.shape().rank() ? y.shape()[0] : 0, w = y.shape().rank() == 2 ? y.shape()[1] : y.numel() / (r ? r : 1);
  if (micro == 0) {
    const place_scope host(nullptr);  // the logits are returned in host memory
    out = tensor<float>({static_cast<index_t>(m) * r, w}, mem_kind::workspace);
  }
  if (out.shape()[0] != static_cast<index_t>(m) * r || out.shape()[1] != w)
    throw std::logic_error("whale::executor::forward: the micro-batches' outputs differ in shape");
  be_.copy(out.data() + static_cast<index_t>(micro) * r * w, y.data(), static_cast<std::size_t>(r * w) * sizeof(float));
  be_.synchronize();
}

}  // namespace whale::detail
