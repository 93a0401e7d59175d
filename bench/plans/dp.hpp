// Plan `dp`: data parallelism, `executor<replicate<model>>` over every rank
// (runtime/executor.hpp), options --bucket-mib X and --no-overlap. Besides
// the step it measures, in the same run, the two limits of a data-parallel step:
// compute alone (every rank steps on its own rows at once, no communication) and
// communication alone (one all-reduce of all gradient bytes), and their ratio.
#pragma once

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "../bench_common.hpp"
#include "hetero.hpp"
#include "../inter_node.hpp"
#include "whale/runtime/make.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/train/bf16_weights.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/train/trainer.hpp"

namespace bench::plans {

struct dp {
  static constexpr const char* name = "dp";
  static constexpr const char* help =
      "data parallel: replicate<model> over all ranks; --bucket-mib X (default 25), --no-overlap, "
      "--nonblocking, --bf16-reduce (gradient buckets summed in bf16), --micro-batches m (gradient accumulation: m "
      "passes a step, the buckets summed in the last) (xc: 64 samples per rank); time to loss (deep-mlp, or with --target-loss / --speeds): "
      "--speeds 1,1,2,4, --balance, --memory-caps MiB,... (one a rank), --target-loss X, --max-steps N, --curve FILE; "
      "with a pipe axis in --mesh (data=2,pipe=2) each replica is a 1F1B pipeline";
  template <class W> static constexpr bool supports = true;

  template <class W> static void run(config& c) {
    using namespace whale;
    if constexpr (W::time_to_loss) {
      if (c.simulate) throw usage_error(std::string("bench: --simulate is not for the time-to-loss workload ") + W::name);
      ttl_dp<W>(c);
      return;
    } else {
      if (c.args.flag("--balance") || !c.args.text("--speeds", "").empty() || c.args.value("--target-loss", -1) >= 0 ||
          !c.args.text("--memory-caps", "").empty())
        throw usage_error(std::string("bench: --speeds, --balance, --memory-caps and --target-loss are for the time-to-loss workload "
                                      "deep-mlp (this is '") + W::name + "')");
      run_steps_plan<W>(c);
    }
  }

  template <class W> static void run_steps_plan(config& c) {
    using namespace whale;
    using M = replicate<typename W::model>;
    plan_options o = plan_options::from_env();
    o.bucket_mib = c.args.value("--bucket-mib", o.bucket_mib);
    if (c.args.flag("--no-overlap")) o.overlap = false;
    if (c.args.flag("--nonblocking")) o.blocking = false;
    if (c.args.flag("--bf16-reduce")) o.bf16_reduce = true;
    o.micro_batches =
        static_cast<int>(whale::detail::parse_int(c.args.text("--micro-batches", "0"), "--micro-batches", 0, 1 << 16));
    const auto prec = precision_arg(c.args);
    c.args.done(name);
    if (o.bucket_mib <= 0) throw usage_error("bench: --bucket-mib must be positive");

    auto& ctx = *c.ctx;
    const int P = ctx.size();
    const index_t global = W::global_batch(P);
    auto data = W::data(global);
    if (o.precision != prec && o.precision != precision::fp32)  // --precision is the benchmark's one setting
      throw usage_error("bench: WHALE_PRECISION says " + std::string(to_string(o.precision)) + " but --precision " +
                        to_string(prec) + " (default fp32); give the precision with --precision");
    o.precision = prec;  // the plan's precision, which the trainer trains in
    auto net = make<M>(ctx, seed{42}, o);
    auto& comm = ctx.mesh().comm(axis::data);
    const sgd opt{.lr = 0.01f, .momentum = 0.9f};
    trainer_options to;
    to.progress = false;
    trainer t(net, opt, to);

    // ---- the data-parallel steps: 2 warm-up, then timed (slowest rank per step) ----
    std::vector<double> secs, losses;
    std::vector<cpu::gemm_call> log;
    std::int64_t sent = 0;
    for (int s = 0; s < c.steps; ++s) {
      auto b = t.fetch(data, s);
      if (s == 2) reset_memory_peaks();
      if (s == 0) cpu::set_gemm_log(&log);
      const auto before = comm.stats().bytes_sent;
      double loss = 0;
      secs.push_back(timed(ctx, [&] { loss = t.step_on(b, global, s); }));
      if (s >= 2) sent += comm.stats().bytes_sent - before;
      if (s == 0) cpu::set_gemm_log(nullptr);
      losses.push_back(loss);
    }
    const int timed_steps = c.steps - 2;
    const double step_s = median(std::vector<double>(secs.begin() + 2, secs.end()));
    // Read before the limit measurements below, which allocate on their own.
    const double rss = max_over_ranks(ctx, peak_rss_mib());
    const auto mem = max_memory(ctx);
    const double busiest_mib = busiest_rank_mib(ctx);
    const auto predicted_mem = predicted_memory_json(ctx, net.predicted_memory(global, data.seq(), 4));  // SGD with momentum

    // ---- compute limit 1: this rank's GEMMs alone, all ranks at once ----
    barrier(ctx.world());
    const auto gl = time_gemms(log);
    const double gemm_s = max_over_ranks(ctx, gl.seconds);

    // ---- compute limit 2: a whole step on this rank's rows, no communication ----
    // All ranks at once (as in the real step, P ranks share the cores and memory
    // bandwidth), on the same local network and optimizer state; the replicas
    // drift apart from here on, which is why this comes after the timed steps.
    const int reps = std::max(3, std::min(5, timed_steps));
    std::vector<double> comp;
    tensor<float> master({0}, mem_kind::params);  // bf16: the fp32 master weights while a step computes with rounded ones
    auto b = t.fetch(data, 0);
    for (int r = 0; r <= reps; ++r) {
      step_ctx sc;
      sc.batch = b.sequences;
      sc.seq = b.seq;
      sc.global_rows = global * b.seq;
      sc.bf16 = prec == precision::bf16;  // the plan's precision, as the trainer's steps
      const double dt = timed(ctx, [&] {
        {
          whale::detail::bf16_weights w(sc.bf16, net.params(), master, net.backend());  // bf16: computed with rounded weights
          net.compute_only_step(sc, b.inputs, b.labels);
          w.restore();  // a failed copy back is an error here, not swallowed by the destructor
        }
        net.apply_optimizer(opt, t.optimizer_state(), 1.f);
      });
      if (r > 0) comp.push_back(dt);  // r == 0: warm-up
    }
    const double compute_s = median(comp);

    // ---- communication limit: all gradient bytes in one blocking all-reduce,
    // and in the plan's buckets as the plan issues them (blocking one after the
    // other, or non-blocking all started then waited for) ----
    // (--bf16-reduce: the same counts of bf16 elements, without the packing)
    auto g = net.grads();
    tensor<bf16> g16(o.bf16_reduce ? shape{g.numel()} : shape{0}, mem_kind::comm);
    const dtype gt = o.bf16_reduce ? dtype::bf16 : dtype::f32;
    auto at = [&](index_t i) -> void* { return o.bf16_reduce ? static_cast<void*>(g16.data() + i) : g.data() + i; };
    std::vector<double> one, bucketed;
    for (int r = 0; r <= 3; ++r) {
      const double dt = timed(ctx, [&] { comm.all_reduce(at(0), g.numel(), gt, reduce_op::sum); });
      if (r > 0) one.push_back(dt);
    }
    const auto per = std::max<index_t>(1, static_cast<index_t>(o.bucket_mib * 1048576.0 / sizeof(float)));
    for (int r = 0; r <= 3; ++r) {
      const double dt = timed(ctx, [&] {
        std::vector<typename world_comm::request> q;
        for (index_t end = g.numel(); end > 0; end -= per) {
          const index_t begin = std::max<index_t>(0, end - per);
          if (o.blocking.value_or(true)) comm.all_reduce(at(begin), end - begin, gt, reduce_op::sum);
          else q.push_back(comm.iall_reduce(at(begin), end - begin, gt, reduce_op::sum));
        }
        for (auto& x : q) x.wait();
      });
      if (r > 0) bucketed.push_back(dt);
    }
    const double comm_s = median(one), comm_b_s = median(bucketed);
    const auto hosts = gather_hosts(ctx);
    if (ctx.rank() != 0) return;

    char plan[160];
    std::snprintf(plan, sizeof plan, "dp: replicate<%s> over data:%d, %zu %s bucket(s) of <= %g MiB %s%s", W::name,
                  P, net.bucket_count(), o.blocking.value_or(true) ? "blocking" : "non-blocking", o.bucket_mib,
                  o.overlap ? "during backward" : "after backward",
                  o.micro_batches > 1 ? (", " + std::to_string(o.micro_batches) + " micro-batches").c_str() : "");
    json_line j;
    head_fields<W>(j, plan, P, step_s, global, data.seq());
    j.add("precision", to_string(prec));
    j.add("grad_reduce", o.bf16_reduce ? "bf16" : "fp32");
    j.add("comm_bytes_per_rank_per_step", static_cast<long long>(sent / timed_steps));
    add_inter_node_fields(j, net, hosts, global, data.seq(), c.simulate);
    j.add("peak_rss_mib_per_rank", rss);
    j.raw("memory_mib", memory_json(mem));
    j.add("memory_busiest_rank_mib", busiest_mib);
    j.raw("predicted_memory_mib", predicted_mem);
    j.add("sgemm_gflops", gl.flops / gemm_s / 1e9).add("gemm_only_step_s", gemm_s);
    j.add("gemm_flops_per_step_per_rank", gl.flops).add("executed_gemm_gflops_per_rank", gl.flops / step_s / 1e9);
    j.add("compute_only_step_s", compute_s);
    j.add("comm_only_s", comm_s).add("comm_only_bucketed_s", comm_b_s);
    j.add("dp_over_limit", step_s / std::max(compute_s, comm_s));
    j.add("loss_first", losses.front()).add("loss_last", losses.back());
    j.print();
  }
};

}  // namespace bench::plans
