// Plan `single`: the workload on one process, no communication — the baseline
// every other plan is compared with. Also reports step_over_gemm, the step's
// time over its GEMMs timed alone (how far the non-GEMM work costs), and
// step_over_gemm_in_step, the timed steps over the time their own GEMM calls
// took inside them (the same question without the drift between two clocks).
#pragma once

#include <chrono>
#include <numeric>
#include <vector>

#include "../bench_common.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/trainer.hpp"

namespace bench::plans {

struct single {
  static constexpr const char* name = "single";
  static constexpr const char* help = "one process, the whole batch, no communication (xc: batch 64)";
  template <class W> static constexpr bool supports = true;

  template <class W> static void run(config& c) {
    using namespace whale;
    using M = typename W::model;
    const auto prec = precision_arg(c.args);
    c.args.done(name);
    if (c.ranks() != 1)
      throw usage_error("bench: plan 'single' runs on one rank, but the job has " + std::to_string(c.ranks()) +
                        "; use --ranks 1 (or --plan dp)");
    const index_t global = W::global_batch(1);
    auto data = W::data(global);
    network<M> net(seed{42}, prec);  // the network's precision, which the trainer trains in
    trainer_options to;
    to.progress = false;
    trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, to);

    // The GEMMs of the timed steps (from the third on) are logged with their
    // time inside the step: their share of those same steps does not move when
    // the machine slows down between the step and the GEMMs timed alone. The
    // log is on around the step only (mlp's and xc's data source multiplies too).
    std::vector<double> secs, losses;
    std::vector<cpu::gemm_call> log;
    log.reserve(4096);
    for (int s = 0; s < c.steps; ++s) {
      auto b = t.fetch(data, s);
      if (s == 2) reset_memory_peaks();
      if (s >= 2) cpu::set_gemm_log(&log);
      const auto t0 = std::chrono::steady_clock::now();
      losses.push_back(t.step_on(b, global, s));
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      cpu::set_gemm_log(nullptr);
    }
    const std::vector<double> timed(secs.begin() + 2, secs.end());
    const double step_s = median(timed);
    const double rss = peak_rss_mib();
    const auto mem = memory_snapshot();
    lower_options lo;
    lo.global_batch = global, lo.seq = data.seq(), lo.optimizer_bytes_per_param = 4;  // SGD with momentum
    const auto predicted_mem = predicted_memory_json(*c.ctx, predict_memory(describe<M>(), lower<M>(mesh_shape(1, 1, 1), 0, lo)));
    const auto gl = time_gemms(log, static_cast<int>(timed.size()));
    double gemm_in_steps = 0;
    for (const auto& g : log) gemm_in_steps += g.seconds;
    const double timed_total = std::accumulate(timed.begin(), timed.end(), 0.0);

    json_line j;
    head_fields<W>(j, "single", 1, step_s, global, data.seq());
    j.add("precision", to_string(prec));
    j.add("comm_bytes_per_rank_per_step", 0LL);
    j.add("peak_rss_mib_per_rank", rss);
    j.raw("memory_mib", memory_json(mem));
    j.raw("predicted_memory_mib", predicted_mem);
    j.add("sgemm_gflops", gl.gflops()).add("gemm_only_step_s", gl.seconds).add("step_over_gemm", step_s / gl.seconds);
    j.add("gemm_in_step_s", gemm_in_steps / static_cast<double>(timed.size()))
        .add("step_over_gemm_in_step", gemm_in_steps > 0 ? timed_total / gemm_in_steps : 0.0);
    j.add("gemm_flops_per_step", gl.flops).add("executed_gemm_gflops_per_rank", gl.flops / step_s / 1e9);
    j.add("compute_only_step_s", step_s);
    j.add("loss_first", losses.front()).add("loss_last", losses.back());
    j.print();
  }
};

}  // namespace bench::plans
