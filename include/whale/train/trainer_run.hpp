// The trainer's construction (the checks of its options, the checkpoint
// directory and the metrics log, made before any work) and its loop (run()
// and run(data, steps, eval)): resuming,
// checkpoints every save_every steps, evaluation every eval_every steps with
// its optional metric, and the steps queued on a device. Member definitions
// of trainer (train/trainer.hpp, which includes this file at its end).
#pragma once

#include "whale/train/trainer.hpp"

namespace whale {

template <Trainable Net, Optimizer Opt>
trainer<Net, Opt>::trainer(Net& net, Opt opt, trainer_options o)
    : net_(net), opt_(std::move(opt)), o_(std::move(o)), state_(net.make_optimizer_state(opt_)), next_(o_.first_step) {
  detail::check_trainer_options(o_);
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
    rec_.note_progress(o_, next_);
  }
  detail::check_checkpoint_options(o_);
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
    if (net_.rank() == 0) err = rec_.open_log(o_);
    if constexpr (Checkpointable<Net>) ckpt::agree(net_, err);
    else if (!err.empty()) throw std::runtime_error(err);
  }
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
        r.step_seconds.push_back(rec_.last_dt);
      }
      if constexpr (!std::is_void_v<Eval>)
        if (eval_due) run_eval(*eval);
    }
    rec_.line.reset();  // manual steps after run() start a line of their own
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

}  // namespace whale
