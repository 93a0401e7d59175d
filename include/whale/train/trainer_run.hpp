// The trainer's construction (what its start, train/trainer_start.hpp, needs
// to know of the network and optimizer) and run() (run(data, steps) and
// run(data, steps, eval)): resuming, then trainer_core's loop over the typed
// step, queued step, save and evaluation; evaluation's optional metric.
// Member definitions of trainer (train/trainer.hpp, which includes this file
// at its end).
#pragma once

#include "whale/train/trainer.hpp"

namespace whale {

template <Trainable Net, Optimizer Opt>
trainer<Net, Opt>::trainer(Net& net, Opt opt, trainer_options o)
    : detail::trainer_core(std::move(o), traits(net)), net_(net), opt_(std::move(opt)), state_(net.make_optimizer_state(opt_)) {
  detail::trainer_facts f;  // what the start needs of Net and Opt; the rest is detail::start_trainer's
  f.rank = net_.rank();
  if constexpr (Checkpointable<Net>) f.world = ckpt::world_of(net_);
  f.has_params = requires { net_.params(); };
  if constexpr (requires { Net::zero_level; }) f.zero3 = Net::zero_level == 3;
  if constexpr (requires { net.zero_level_now(); }) f.zero3 = net.zero_level_now() == 3;
  f.checkpoints = checkpoints;
  f.has_lr = requires { opt_.lr; };
  f.optimizer = Opt::name();
  f.precision = bf16() ? precision::bf16 : precision::fp32;
  if (bf16() && f.has_params) f.params = local_params(), f.backend = net_backend();
  detail::start_trainer(o_, f, rec_, master_, next_);
}

template <Trainable Net, Optimizer Opt>
template <class Data, class Eval>
train_result trainer<Net, Opt>::run_with(Data& data, steps n, Eval* eval) {
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
    rec_.start_line(o_, n.value, data.seq() > 1, net_.rank() == 0);
    // the loop is trainer_core's; what it asks of the data and the network, typed here
    auto one_step = [&](std::int64_t s) { return step(data, s); };
    auto queue = [&](std::int64_t s) { queue_step(data, s); };
    auto save_now = [&] {
      if constexpr (checkpoints) save();
    };
    auto eval_now = [&] {
      if constexpr (!std::is_void_v<Eval>) run_eval(*eval);
    };
    const detail::callback<void()> save_cb(save_now), eval_cb(eval_now);
    detail::trainer_core::loop l{one_step, queue, checkpoints ? &save_cb : nullptr, std::is_void_v<Eval> ? nullptr : &eval_cb,
                                 data.global_batch() * data.seq(), data.seq()};
    run_loop(n.value, l, r);
  }
  return r;
}

template <Trainable Net, Optimizer Opt>
template <class Eval>
void trainer<Net, Opt>::run_eval(Eval& eval) {
  if constexpr (requires { evaluate(eval, steps{1}, 0); }) {
    const eval_report rep{next_, evaluate(eval, steps{o_.eval_steps}, 0), o_.eval_metric ? metric_of(eval) : std::nan("")};
    rec_.report_eval(o_, rep);
  } else {
    static_assert(requires { evaluate(eval, steps{1}, 0); }, "whale::trainer: this network has no forward-only evaluate()");
  }
}

template <Trainable Net, Optimizer Opt>
template <class Eval>
double trainer<Net, Opt>::metric_of(Eval& eval) {
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
      step_ctx c = context(b.sequences, b.seq, eval.global_batch(), -1);
      detail::bf16_weights w(bf16(), local_params(), master_, net_backend());
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

}  // namespace whale
