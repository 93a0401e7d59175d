// Plan `pipeline`: `pipeline<Schedule, gpt>` over every rank on the pipe axis
// (strategy/pipeline.hpp), options --schedule gpipe|1f1b|zb-h1|interleaved (2 chunks per rank), --micro-batches m,
// --stage-blocks a,b,... and --trace out.json. Besides the step it reports the
// bubble measured from the run's own trace against the schedule's replay with
// equal pass times ((p-1)/(m+p-1) for GPipe and 1F1B), the peak
// activation memory of each stage, and the bytes each rank sends per step.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "../bench_common.hpp"
#include "../inter_node.hpp"
#include "whale/runtime/make.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/comm/trace.hpp"
#include "whale/train/trainer.hpp"

namespace bench::plans {

struct pipeline {
  static constexpr const char* name = "pipeline";
  static constexpr const char* help =
      "pipeline<S, gpt> over all ranks on the pipe axis (gpt only); --schedule gpipe|1f1b|zb-h1|interleaved (2 chunks per rank; default 1f1b), "
      "--micro-batches m (default 8), --stage-blocks a,b,... (default: balanced by cost), --trace out.json";
  template <class W> static constexpr bool supports = std::is_same_v<W, gpt_workload>;

  template <class W> static void run(config& c) {
    const std::string sched = c.args.text("--schedule", "1f1b");
    const int m = static_cast<int>(c.args.count("--micro-batches", 8, 1, 16000));
    const std::string blocks = c.args.text("--stage-blocks", "");
    const std::string trace = c.args.text("--trace", "");
    c.args.done(name);
    if (sched == "gpipe") go<W, whale::gpipe>(c, m, blocks, trace);
    else if (sched == "1f1b") go<W, whale::one_f_one_b>(c, m, blocks, trace);
    else if (sched == "zb-h1") go<W, whale::zb_h1>(c, m, blocks, trace);
    else if (sched == "interleaved") go<W, whale::interleaved_1f1b<2>>(c, m, blocks, trace);
    else throw usage_error("bench: --schedule " + sched + ": have gpipe, 1f1b, zb-h1, interleaved");
  }

 private:
  template <class W, class S>
  static void go(config& c, int m, const std::string& blocks, const std::string& trace) {
    using namespace whale;
    if (m < 1) throw usage_error("bench: --micro-batches must be at least 1");
    const int P = c.ranks();
    auto& ctx = *c.ctx;  // every rank on the pipe axis (bench_workloads' main sets the mesh)
    if (ctx.mesh().shape().size(axis::pipe) != P)
      throw usage_error("bench: --plan pipeline runs every rank on the pipe axis, but the mesh is " +
                        ctx.mesh().shape().spec() + "; leave --mesh out or give --mesh pipe=" + std::to_string(P) +
                        " (--plan 3d composes pipelines with other axes)");
    plan_options o;
    o.micro_batches = m;
    if (!blocks.empty()) o.blocks = plan_options::parse_list(blocks, "--stage-blocks");
    o.trace = true;
    o.trace_path = trace;
    const index_t global = W::global_batch(1);
    auto data = W::data(global);
    auto net = make<whale::pipeline<S, typename W::model>>(ctx, seed{42}, o);
    const sgd opt{.lr = 0.01f, .momentum = 0.9f};
    trainer_options to;
    to.progress = false;
    trainer t(net, opt, to);

    const auto run = run_steps(ctx, t, data, global, c.steps);
    const auto& losses = run.losses;
    const std::int64_t sent = run.sent;
    const int timed_steps = c.steps - 2;
    const double step_s = run.step_s;
    const double rss = max_over_ranks(ctx, peak_rss_mib());
    const auto mem = max_memory(ctx);
    const double busiest_mib = busiest_rank_mib(ctx);
    const auto predicted_mem = predicted_memory_json(ctx, net.predicted_memory(global, data.seq(), 4));  // SGD with momentum
    // per-stage activation peak (MiB) and bytes sent, gathered in rank order (= stage order)
    std::vector<double> act(static_cast<std::size_t>(P)), bytes(static_cast<std::size_t>(P));
    double my_act = static_cast<double>(memory_snapshot().peak_of(mem_kind::activations)) / 1048576.0;
    double my_bytes = static_cast<double>(sent) / timed_steps;
    all_gather(ctx.world(), view<double>(&my_act, {1}), view<double>(act.data(), {P}));
    all_gather(ctx.world(), view<double>(&my_bytes, {1}), view<double>(bytes.data(), {P}));
    const auto ev = net.finish_trace();  // collective; writes --trace on rank 0
    const auto bub = measure_bubble(ev, 2);
    const auto hosts = gather_hosts(ctx);
    if (ctx.rank() != 0) return;

    auto list = [](const std::vector<double>& v) {
      std::string s = "[";
      char b[32];
      for (std::size_t i = 0; i < v.size(); ++i) {
        std::snprintf(b, sizeof b, "%s%.4g", i ? ", " : "", v[i]);
        s += b;
      }
      return s + "]";
    };
    std::string cut;
    for (int k : net.stage_blocks()) {
      if (!cut.empty()) cut += ',';
      cut += std::to_string(k);
    }
    char plan[200];
    std::snprintf(plan, sizeof plan, "pipeline<%s, %s> over pipe:%d, m=%d micro-batches, blocks per stage {%s}",
                  S::name().c_str(), W::name, P, m, cut.c_str());
    json_line j;
    head_fields<W>(j, plan, P, step_s, global, data.seq());
    j.add("schedule", S::name()).add("micro_batches", m);
    j.add("comm_bytes_per_rank_per_step", static_cast<long long>(*std::max_element(bytes.begin(), bytes.end())));
    j.raw("comm_bytes_per_stage_per_step", list(bytes));
    add_inter_node_fields(j, net, hosts, global, data.seq(), c.simulate);
    j.add("peak_rss_mib_per_rank", rss);
    j.raw("memory_mib", memory_json(mem));
    j.add("memory_busiest_rank_mib", busiest_mib);
    j.raw("predicted_memory_mib", predicted_mem);
    j.raw("activation_mib_per_stage", list(act));
    // bubble_measured: idle fraction of the busiest stage (the one that sets the
    // step time), what the replay of the schedule with equal pass times models
    // ((p-1)/(m+p-1) for GPipe and 1F1B); the other stages also wait for it
    // (stage_imbalance), which the mean over stages includes.
    j.add("bubble_measured", bub.bottleneck).add("bubble_theory", check_schedule<S>(P, m).bubble);
    j.add("bubble_measured_mean", bub.mean).add("stage_imbalance", bub.imbalance);
    j.raw("bubble_measured_per_stage", list(bub.per_stage));
    std::vector<double> busy_ms;
    for (double u : bub.busy_us) busy_ms.push_back(u / 1000.0);
    j.raw("compute_ms_per_stage_per_step", list(busy_ms));
    j.add("loss_first", losses.front()).add("loss_last", losses.back());
    j.print();
  }
};

}  // namespace bench::plans
