// Time-to-loss runs on emulated heterogeneous ranks (docs/hetero.md): plan
// `hetpipe` (virtual workers, each a pipeline over the pipe axis, joined by
// Wave Synchronous Parallel) and plan `dp` with --speeds / --target-loss
// (synchronous data parallelism, optionally speed-balanced). Both train until
// the loss averaged over the last 10 steps reaches the target.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../bench_common.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/train/trainer.hpp"
#include "whale/train/wsp_trainer.hpp"

namespace bench::plans {

/// The optimizer of every time-to-loss run: Adam (workloads.md lets a benchmark
/// name it). deep-mlp's 8 unnormalised GELU layers shrink the signal layer by
/// layer, and SGD (lr 0.01 or 0.1, momentum 0.9) left its loss at ln 16 for
/// 600 steps, where Adam at 1e-3 halves it (docs/bench.md).
inline whale::adamw ttl_optimizer() { return whale::adamw{.lr = 1e-3f, .weight_decay = 0.f}; }
inline constexpr const char* ttl_optimizer_name = "adam lr 1e-3, no weight decay";

/// The options every time-to-loss run takes.
struct ttl_options {
  double target = 0;       ///< --target-loss X (default: the workload's)
  long max_steps = 0;      ///< --max-steps N (default 5000): give up there
  std::string curve;       ///< --curve FILE: "seconds loss" per step, written atomically at the end
  std::vector<double> speeds;  ///< --speeds 1,1,2,4 (one per rank)
  std::vector<double> caps;    ///< --memory-caps MiB,... (one per rank): each rank's emulated memory

  template <class W> static ttl_options read(config& c) {
    ttl_options o;
    o.target = c.args.value("--target-loss", W::default_target);
    o.max_steps = static_cast<long>(c.args.count("--max-steps", 5000, 10, 10000000));
    o.curve = c.args.text("--curve", "");
    // a list of one number per rank: parsed whole by `parse`, its length checked
    auto per_rank = [&](const char* flag, const char* what, auto parse) {
      std::vector<double> v;
      const auto text = c.args.text(flag, "");
      if (text.empty()) return v;
      try {
        v = parse(text, (std::string("bench: ") + flag).c_str());
      } catch (const whale::detail::parse_error& e) {
        throw usage_error(e.what());
      }
      if (static_cast<int>(v.size()) != c.ranks())
        throw usage_error(std::string("bench: ") + flag + " gives " + std::to_string(v.size()) + " " + what +
                          "(s) for " + std::to_string(c.ranks()) + " rank(s); give one per rank");
      return v;
    };
    o.speeds = per_rank("--speeds", "factor", whale::plan_options::parse_speeds);
    o.caps = per_rank("--memory-caps", "cap", whale::plan_options::parse_caps);
    if (!(o.target > 0)) throw usage_error("bench: --target-loss must be above 0");
    if (o.max_steps < 10 || o.max_steps > 10000000) throw usage_error("bench: --max-steps must be from 10 to 10000000");
    if (!o.curve.empty()) {  // checked before any work, the same on every rank
      const auto dir = std::filesystem::path(o.curve).parent_path();
      if (::access(dir.empty() ? "." : dir.c_str(), W_OK) != 0)
        throw usage_error("bench: --curve " + o.curve + ": its directory is missing or not writable");
    }
    return o;
  }
  /// "1,1,2,4", or "all 1".
  std::string speeds_text() const { return speeds.empty() ? "all 1" : joined(speeds); }
  /// ", memory caps a,b,c,d MiB", or nothing.
  std::string caps_text() const { return caps.empty() ? "" : ", memory caps " + joined(caps) + " MiB"; }
  static std::string joined(const std::vector<double>& v) {
    std::string s;
    for (double f : v) {
      char b[32];
      std::snprintf(b, sizeof b, s.empty() ? "%g" : ",%g", f);
      s += b;
    }
    return s;
  }
};

/// The loss curve of one rank, written atomically (temporary file, then rename).
inline void write_curve(const std::string& path, const std::vector<std::pair<double, double>>& pts) {
  if (path.empty()) return;
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw std::runtime_error("bench: cannot write " + tmp);
  std::fprintf(f, "# seconds loss (mean of the last 10 steps)\n");
  for (const auto& [t, l] : pts) std::fprintf(f, "%.4f %.6f\n", t, l);
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("bench: cannot write " + path);
}

/// The mean of the last (up to) 10 losses.
struct last10 {
  std::deque<double> v;
  double add(double x) {
    v.push_back(x);
    if (v.size() > 10) v.pop_front();
    return mean();
  }
  double mean() const { return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size()); }
  bool full() const { return v.size() == 10; }
};

/// The loss of the final weights on 4 held-out global batches (data steps from 10^6), collective.
template <class Net, class Data> double held_out_loss(Net& net, Data& data) {
  whale::trainer_options to;
  to.progress = false;
  whale::trainer t(net, whale::sgd{}, to);
  return t.evaluate(data, whale::steps{4}, 1000000);
}

/// Synchronous data parallelism until the target: replicate<M> (with a pipe
/// axis in --mesh, replicate<pipeline<1F1B, M>>: replicas too large for one
/// rank's --memory-caps), speeds emulated, --balance.
template <class W, class P> void ttl_dp_on(config& c);
template <class W> void ttl_dp(config& c) {
  if (c.ctx->mesh().shape().size(whale::axis::pipe) > 1)
    return ttl_dp_on<W, whale::replicate<whale::pipeline<whale::one_f_one_b, typename W::model>>>(c);
  ttl_dp_on<W, whale::replicate<typename W::model>>(c);
}
template <class W, class P> void ttl_dp_on(config& c) {
  using namespace whale;
  auto o = ttl_options::read<W>(c);
  plan_options po;
  po.speeds = o.speeds;
  po.memory_caps_mib = o.caps;
  po.balance = c.args.flag("--balance");
  c.args.done("dp");
  auto& ctx = *c.ctx;
  const index_t global = W::global_batch(ctx.size());
  auto data = W::data(global);
  auto net = make<P>(ctx, seed{42}, po);
  trainer_options to;
  to.progress = false;
  to.check_grad_norm = false;
  trainer t(net, ttl_optimizer(), to);
  last10 avg;
  std::vector<std::pair<double, double>> curve;
  barrier(ctx.world());
  const auto t0 = std::chrono::steady_clock::now();
  long s = 0;
  bool reached = false;
  double first = 0;
  for (; s < o.max_steps && !reached; ++s) {
    const double loss = t.step_on(t.fetch(data, s), global, s);
    if (s == 0) first = loss;
    const double m = avg.add(loss);
    curve.emplace_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), m);
    reached = avg.full() && m <= o.target;
  }
  const double secs = max_over_ranks(ctx, curve.back().first);
  const double eval = held_out_loss(net, data);
  if (ctx.rank() != 0) return;
  write_curve(o.curve, curve);
  const auto [b0, rows0] = net.local_batch(global);
  const auto& shape = ctx.mesh().shape();
  const int pipes = shape.size(axis::pipe);
  std::string plan = std::string("dp: replicate<") + (pipes > 1 ? "pipeline<1f1b, " : "") + W::name +
                     (pipes > 1 ? ">" : "") + "> over data:" + std::to_string(shape.size(axis::data)) +
                     (pipes > 1 ? ",pipe:" + std::to_string(pipes) : "") +
                     (po.balance ? ", batch split by speed" : ", even batch") + "; emulated slowness " + o.speeds_text() +
                     o.caps_text();
  (void)b0;
  json_line j;
  head_fields<W>(j, plan, ctx.size(), secs / static_cast<double>(s), global, data.seq());
  j.add("emulated", ctx.size() > 1 ? "speeds emulated by sleeping; ranks oversubscribed on this machine's cores" : "speeds emulated by sleeping");
  j.add("optimizer", ttl_optimizer_name);
  j.add("target_loss", o.target).add("reached", reached ? 1 : 0);
  j.add("time_to_target_s", secs).add("steps_to_target", static_cast<long long>(s));
  j.add("rank0_rows", static_cast<long long>(rows0));
  j.add("loss_first", first).add("loss_last", avg.mean()).add("held_out_loss", eval);
  j.print();
}

struct hetpipe {
  static constexpr const char* name = "hetpipe";
  static constexpr const char* help =
      "HetPipe: virtual workers (data replicas, each a 1F1B pipeline over pipe; --mesh data=2,pipe=2) under Wave "
      "Synchronous Parallel: --staleness D (default 0), --wave N (minibatches per wave, default 1), --in-flight (a wave's minibatches in the pipeline together, all on "
      "the weights the wave began with), --worker-cuts (each worker's stages cut for its own ranks), --speeds 1,1,2,4, "
      "--balance (workers' rows by speed), --memory-caps MiB,... (one a rank), --policy np|ed|hd (grouping ranks into workers), "
      "--micro-batches M, --target-loss X, --max-steps N, --curve FILE (deep-mlp)";
  template <class W> static constexpr bool supports = W::time_to_loss;

  template <class W> static void run(config& c) {
    using namespace whale;
    auto o = ttl_options::read<W>(c);
    wsp_options w;
    w.staleness = static_cast<int>(c.args.count("--staleness", 0, 0, 1000000));
    w.wave = static_cast<int>(c.args.count("--wave", 1, 1, 1000000));
    w.in_flight = c.args.flag("--in-flight");
    const bool worker_cuts = c.args.flag("--worker-cuts");
    plan_options po;
    po.speeds = o.speeds;
    po.memory_caps_mib = o.caps;
    po.micro_batches = static_cast<int>(c.args.count("--micro-batches", 0, 0, 16000));
    if (w.in_flight && w.wave > o.max_steps)
      throw usage_error("bench: --wave (" + std::to_string(w.wave) + ") is longer than --max-steps (" +
                        std::to_string(o.max_steps) + "); in flight a run is whole waves");
    if (w.in_flight && po.micro_batches != 0)
      throw usage_error("bench: --micro-batches does not apply with --in-flight (each minibatch of a wave is one micro-batch of the pipeline)");
    po.balance = c.args.flag("--balance");
    po.worker_cuts = worker_cuts;
    if (w.in_flight) po.in_flight = w.wave;
    const auto policy_name = c.args.text("--policy", "np");
    c.args.done(name);
    detail::worker_policy policy = detail::worker_policy::np;
    if (policy_name == "ed") policy = detail::worker_policy::ed;
    else if (policy_name == "hd") policy = detail::worker_policy::hd;
    else if (policy_name != "np") throw usage_error("bench: --policy must be np, ed or hd (got '" + policy_name + "')");
    // the policy groups the launched ranks (whose --speeds are given in launch order) into workers
    std::optional<context> regrouped;
    context* cp = c.ctx;
    if (policy != detail::worker_policy::np && !o.speeds.empty()) {
      const auto order = detail::worker_order(o.speeds, c.ctx->mesh().shape().size(axis::data), policy);
      regrouped.emplace(c.ctx->with_rank_order(order));
      for (std::size_t i = 0; i < order.size(); ++i) po.speeds[i] = o.speeds[static_cast<std::size_t>(order[i])];
      for (std::size_t i = 0; i < order.size() && !o.caps.empty(); ++i) po.memory_caps_mib[i] = o.caps[static_cast<std::size_t>(order[i])];
      cp = &*regrouped;
    }
    auto& ctx = *cp;
    const auto& shape = ctx.mesh().shape();
    const index_t global = W::global_batch(ctx.size());
    auto data = W::data(global);
    using P = replicate<pipeline<one_f_one_b, typename W::model>>;
    auto net = make<P>(ctx, seed{42}, po);
    wsp_trainer t(ctx, net, ttl_optimizer(), w);
    // the rank that sees its worker's loss: the last stage, model rank 0
    const bool reporter = shape.coord(ctx.rank(), axis::pipe) == shape.size(axis::pipe) - 1 &&
                          shape.coord(ctx.rank(), axis::model) == 0;
    const int worker = shape.coord(ctx.rank(), axis::data);
    last10 avg;
    std::vector<std::pair<double, double>> curve;
    barrier(ctx.world());
    const auto t0 = std::chrono::steady_clock::now();
    long s = 0;
    bool asked = false;
    double first = 0, asked_at = 0;
    // the stop: every worker's reporter publishes the mean of its last 10 losses; when
    // all have, and their mean (the global loss, each worker at its own step) reaches
    // the target, the rank that sees it asks every worker to stop
    std::vector<int> reporters;
    for (int r = 0; r < ctx.size(); ++r)
      if (shape.coord(r, axis::pipe) == shape.size(axis::pipe) - 1 && shape.coord(r, axis::model) == 0) reporters.push_back(r);
    auto seen = [&](double loss) {
      if (!reporter) return;
      if (s == 0) first = loss;
      const double m = avg.add(loss);
      const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      curve.emplace_back(now, m);
      if (!avg.full()) return;
      t.publish(m);
      const auto pub = t.published();
      double sum = 0;
      bool all = true;
      for (int r : reporters) {
        all = all && pub[static_cast<std::size_t>(r)] > 0;
        sum += pub[static_cast<std::size_t>(r)];
      }
      if (!asked && all && sum / static_cast<double>(reporters.size()) <= o.target) {
        t.request_stop();
        asked = true;
        asked_at = now;
      }
    };
    // in flight a run is whole waves: it ends at the last one that fits in --max-steps
    while (s + (w.in_flight ? w.wave : 1) <= o.max_steps && !t.stopping()) {
      if (!w.in_flight) {
        seen(t.step(data, s));
        ++s;
        continue;
      }
      for (double loss : t.wave(data, s)) {  // the wave's minibatches ran together
        seen(loss);
        ++s;
      }
    }
    const double stopped_at = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t.finish();
    // what the workers did: the first stop request's time, every worker's steps, the largest lead
    double v[4] = {asked ? -asked_at : -1e300, stopped_at, static_cast<double>(s), -static_cast<double>(s)};
    std::int64_t lead = 0;
    for (const auto& r : t.waves())
      if (!r.stopped) lead = std::max(lead, r.wave - r.min_clock);
    all_reduce(ctx.world(), view<double>(v, {4}), reduce_op::max);
    all_reduce(ctx.world(), view<std::int64_t>(&lead, {1}), reduce_op::max);
    double reached = asked ? 1 : 0;
    all_reduce(ctx.world(), view<double>(&reached, {1}), reduce_op::max);
    all_reduce(ctx.world(), view<double>(&first, {1}), reduce_op::max);  // the reporters' first loss
    const double eval = held_out_loss(net, data);
    if (reporter && worker == 0) write_curve(o.curve, curve);
    if (ctx.rank() != 0) return;
    const double secs = reached > 0 ? -v[0] : v[1];
    char plan[512];
    std::snprintf(plan, sizeof plan,
                  "hetpipe: %d virtual worker(s) of pipe:%d (policy %s, %s), WSP staleness %d, wave %d minibatch(es)%s, %s; "
                  "emulated slowness %s (launch order)%s",
                  shape.size(axis::data), shape.size(axis::pipe), policy_name.c_str(),
                  worker_cuts ? "stages cut per worker" : "one stage cut for all workers", w.staleness, w.wave,
                  w.in_flight ? " in flight" : " one after another",
                  po.balance ? "rows by worker speed" : "even rows", o.speeds_text().c_str(), o.caps_text().c_str());
    json_line j;
    head_fields<W>(j, plan, ctx.size(), v[1] / v[2], global, data.seq());
    j.add("emulated", "speeds emulated by sleeping; ranks oversubscribed on this machine's cores");
    j.add("optimizer", ttl_optimizer_name);
    j.add("target_loss", o.target).add("reached", static_cast<int>(reached));
    j.add("time_to_target_s", secs).add("steps_to_target", static_cast<long long>(v[2]));
    j.add("steps_slowest_worker", static_cast<long long>(-v[3]));
    j.add("max_lead_waves", static_cast<long long>(lead));
    j.add("loss_first", first).add("held_out_loss", eval);
    j.print();
  }
};

}  // namespace bench::plans
