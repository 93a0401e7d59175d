// Plan `hybrid`: split regions beside data parallelism (runtime/executor.hpp).
//   xc:  Whale's plan — backbone replicated, classifier split by class over
//        the same ranks (sequential<replicate<backbone>, split<classifier, axis::data>>);
//   gpt: Megatron tensor parallelism over the `model` axis (split<gpt>),
//        data parallel over `data`; choose the mesh with --mesh data=D,model=M.
// Also measures, in the same run, the step's own compute without any
// communication (compute_only_step_s) and its GEMMs alone.
#pragma once

#include <algorithm>
#include <sstream>
#include <cstdio>
#include <string>
#include <vector>

#include "../bench_common.hpp"
#include "whale/runtime/make.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/trainer.hpp"

namespace bench::plans {

struct hybrid {
  static constexpr const char* name = "hybrid";
  static constexpr const char* help =
      "xc: replicated backbone + class-split classifier over all ranks; gpt: tensor parallel over the model "
      "axis (--mesh data=D,model=M), data parallel over data";
  template <class W> static constexpr bool supports = !std::is_same_v<W, mlp_workload> && !W::time_to_loss;

  template <class W> static auto plan_type() {
    using namespace whale;
    if constexpr (std::is_same_v<W, xc_workload>)
      return sequential<replicate<models::xc_backbone>, split<models::xc_classifier, axis::data>>{};
    else
      return split<models::gpt, axis::model>{};
  }

  // One xc hybrid rank's computation with no communication: a backbone step on
  // this rank's rows and a step of the classifier shard (100000/p classes) on
  // every row of the global batch, each with its optimizer update; the same
  // layers and kernels as the hybrid step, the collectives left out.
  template <whale::index_t C>
  static double xc_compute_only(whale::context& ctx, whale::index_t local, whale::index_t global, int reps) {
    using namespace whale;
    network<sequential<models::xc_backbone, linear<2048, 1>, softmax_cross_entropy>> back(seed{1});
    // relu first so that the classifier computes d(input), as it does for the backbone in the plan
    network<sequential<relu, linear<2048, C>, softmax_cross_entropy>> shard(seed{2});
    tensor<float> xb({local, 512}), xs({global, 2048});
    tensor<std::int32_t> yb({local}), ys({global});
    for (index_t i = 0; i < xb.numel(); ++i) xb[i] = static_cast<float>((i % 7) - 3) * 0.1f;
    for (index_t i = 0; i < xs.numel(); ++i) xs[i] = static_cast<float>((i % 5) - 2) * 0.1f;
    const sgd opt{.lr = 0.01f, .momentum = 0.9f};
    auto sb = back.make_optimizer_state(opt);
    auto ss = shard.make_optimizer_state(opt);
    std::vector<double> t;
    for (int r = 0; r <= reps; ++r) {
      const double dt = timed(ctx, [&] {
        step_ctx cb, cs;
        cb.batch = cb.global_rows = local;
        cs.batch = cs.global_rows = global;
        back.train_step(cb, xb, yb);
        back.apply_optimizer(opt, sb, 1.f);
        shard.train_step(cs, xs, ys);
        shard.apply_optimizer(opt, ss, 1.f);
      });
      if (r > 0) t.push_back(dt);  // r == 0: warm-up
    }
    return median(t);
  }

  template <class W> static void run(config& c) {
    using namespace whale;
    using M = decltype(plan_type<W>());
    c.args.done(name);
    auto& ctx = *c.ctx;
    const int P = ctx.size();
    const int D = ctx.mesh().size(axis::data);
    const index_t global = W::global_batch(D);
    auto data = W::data(global);
    const plan_options po = plan_options::from_env();
    if (po.precision != precision::fp32)  // its line has no precision field, and its compute limit runs fp32 steps
      throw usage_error(std::string("bench: --plan ") + name + " measures fp32 (WHALE_PRECISION says " + to_string(po.precision) +
                        "); bf16 mixed precision is measured with --plan single or dp --precision bf16");
    auto net = make<M>(ctx, seed{42}, po);
    trainer_options to;
    to.progress = false;
    trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, to);
    auto stats = [&] { return ctx.mesh().stats().bytes_sent; };

    std::vector<double> secs, losses;
    std::vector<cpu::gemm_call> log;
    std::int64_t sent = 0;
    for (int s = 0; s < c.steps; ++s) {
      auto b = t.fetch(data, s);
      if (s == 2) reset_memory_peaks();
      if (s == 0) cpu::set_gemm_log(&log);
      const auto before = stats();
      double loss = 0;
      secs.push_back(timed(ctx, [&] { loss = t.step_on(b, global, s); }));
      if (s >= 2) sent += stats() - before;
      if (s == 0) cpu::set_gemm_log(nullptr);
      losses.push_back(loss);
    }
    const int timed_steps = c.steps - 2;
    const double step_s = median(std::vector<double>(secs.begin() + 2, secs.end()));
    const double rss = max_over_ranks(ctx, peak_rss_mib());
    const auto mem = max_memory(ctx);
    const double busiest_mib = busiest_rank_mib(ctx);
    const auto predicted_mem = predicted_memory_json(ctx, net.predicted_memory(global, data.seq(), 4));  // SGD with momentum
    barrier(ctx.world());
    const auto gl = time_gemms(log);
    const double gemm_s = max_over_ranks(ctx, gl.seconds);
    // compute alone: exact for xc at 1, 2 or 4 ranks; otherwise (gpt) the GEMMs alone
    double compute_s = gemm_s;
    const char* compute_how = "gemm_only";
    if constexpr (std::is_same_v<W, xc_workload>) {
      const index_t n = net.local_batch(global).second;
      const int reps = std::max(3, std::min(5, timed_steps));
      compute_how = "same layers, no communication";
      if (P == 1) compute_s = xc_compute_only<100000>(ctx, n, global, reps);
      else if (P == 2) compute_s = xc_compute_only<50000>(ctx, n, global, reps);
      else if (P == 4) compute_s = xc_compute_only<25000>(ctx, n, global, reps);
      else compute_how = "gemm_only";
    }
    if (ctx.rank() != 0) return;

    char plan[200];
    std::snprintf(plan, sizeof plan, "hybrid: %s over %s", layer_name<M>().c_str(),
                  (std::ostringstream{} << ctx.mesh().shape()).str().c_str());
    json_line j;
    head_fields<W>(j, plan, P, step_s, global, data.seq());
    j.add("comm_bytes_per_rank_per_step", static_cast<long long>(sent / timed_steps));
    j.add("peak_rss_mib_per_rank", rss);
    j.raw("memory_mib", memory_json(mem));
    j.add("memory_busiest_rank_mib", busiest_mib);
    j.raw("predicted_memory_mib", predicted_mem);
    j.add("params_per_rank", static_cast<long long>(net.param_count()));
    j.add("sgemm_gflops", gl.flops / gemm_s / 1e9).add("gemm_only_step_s", gemm_s);
    j.add("gemm_flops_per_step_per_rank", gl.flops).add("executed_gemm_gflops_per_rank", gl.flops / step_s / 1e9);
    j.add("compute_only_step_s", compute_s).add("compute_only_how", compute_how);
    j.add("step_over_compute_only", step_s / compute_s);
    j.add("loss_first", losses.front()).add("loss_last", losses.back());
    j.print();
  }
};

}  // namespace bench::plans
