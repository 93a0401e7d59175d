// Plans `zero1`, `zero2`, `zero3`: ZeRO data parallelism, `executor<shard<model,
// Level>>` over every rank (strategy/shard.hpp), option --recompute (gpt: every
// transformer block recomputed; xc and mlp: the whole network before the last
// linear and the loss). Reports step time, bytes per step and memory by category,
// with the model state (params + grads + optimizer) per rank beside its formula.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "../bench_common.hpp"
#include "whale/runtime/make.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/train/trainer.hpp"

namespace bench::plans {

namespace zero_detail {
/// The workload's model with recomputation: gpt's blocks; for mlp and xc, the
/// layers before the last linear (their activations are recomputed in backward).
template <class M> struct recomputed;
template <> struct recomputed<whale::models::gpt> {
  using type = whale::sequential<whale::embedding<8192, 256>, whale::position_embedding<128, 256>,
                                 whale::repeat<4, whale::recompute<whale::transformer_block<256, 4, 1024>>>,
                                 whale::layer_norm<256>, whale::linear<256, 8192>, whale::softmax_cross_entropy>;
};
template <> struct recomputed<whale::models::xc> {
  using type = whale::sequential<whale::recompute<whale::models::xc_backbone>, whale::models::xc_classifier>;
};
template <> struct recomputed<whale::models::mlp> {
  using type = whale::sequential<
      whale::recompute<whale::sequential<whale::linear<1024, 4096>, whale::gelu, whale::linear<4096, 4096>, whale::gelu>>,
      whale::linear<4096, 1024>, whale::softmax_cross_entropy>;
};
}  // namespace zero_detail

template <int Level> struct zero {
  static constexpr const char* name = Level == 1 ? "zero1" : Level == 2 ? "zero2" : "zero3";
  static constexpr const char* help =
      Level == 1 ? "ZeRO-1: shard<model, 1> (optimizer state partitioned) over all ranks; --recompute, --bucket-mib X, --bf16-reduce"
      : Level == 2 ? "ZeRO-2: shard<model, 2> (plus gradients reduce-scattered); --recompute, --bucket-mib X, --bf16-reduce"
                   : "ZeRO-3: shard<model, 3> (plus parameters gathered per leaf); --recompute, --bucket-mib X, --no-prefetch, --bf16-reduce";
  template <class W> static constexpr bool supports = !W::time_to_loss;

  template <class W> static void run(config& c) {
    const bool rc = c.args.flag("--recompute");
    if (rc) run_model<W, typename zero_detail::recomputed<typename W::model>::type>(c, true);
    else run_model<W, typename W::model>(c, false);
  }

  template <class W, class M> static void run_model(config& c, bool rc) {
    using namespace whale;
    plan_options o = plan_options::from_env();
    o.bucket_mib = c.args.value("--bucket-mib", o.bucket_mib);
    if (c.args.flag("--no-prefetch")) o.prefetch = false;
    if (c.args.flag("--bf16-reduce")) o.bf16_reduce = true;
    c.args.done(name);
    if (o.bucket_mib <= 0) throw usage_error("bench: --bucket-mib must be positive");
    if (o.precision != precision::fp32)  // its line has no precision field, and its compute limit runs fp32 steps
      throw usage_error(std::string("bench: --plan ") + name + " measures fp32 (WHALE_PRECISION says " + to_string(o.precision) +
                        "); bf16 mixed precision is measured with --plan single or dp --precision bf16");

    auto& ctx = *c.ctx;
    const int P = ctx.size();
    const index_t global = W::global_batch(P);
    auto data = W::data(global);
    const auto state0 = memory_snapshot().model_state();
    auto net = make<shard<M, Level>>(ctx, seed{42}, o);
    auto& comm = ctx.mesh().comm(axis::data);
    trainer_options to;
    to.progress = false;
    trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, to);
    const auto model_state = memory_snapshot().model_state() - state0;

    // ---- 2 warm-up steps, then timed (slowest rank per step) ----
    std::vector<double> secs, losses;
    std::int64_t sent = 0;
    for (int s = 0; s < c.steps; ++s) {
      auto b = t.fetch(data, s);
      if (s == 2) reset_memory_peaks();
      const auto before = comm.stats().bytes_sent;
      double loss = 0;
      secs.push_back(timed(ctx, [&] { loss = t.step_on(b, global, s); }));
      if (s >= 2) sent += comm.stats().bytes_sent - before;
      losses.push_back(loss);
    }
    const int timed_steps = c.steps - 2;
    const double step_s = median(std::vector<double>(secs.begin() + 2, secs.end()));
    const double rss = max_over_ranks(ctx, peak_rss_mib());
    const auto mem = max_memory(ctx);
    const double busiest_mib = busiest_rank_mib(ctx);
    const auto predicted_mem = predicted_memory_json(ctx, net.predicted_memory(global, data.seq(), 4));  // SGD with momentum
    const double state_mib = max_over_ranks(ctx, static_cast<double>(model_state)) / 1048576.0;
    const double formula_mib =
        max_over_ranks(ctx, static_cast<double>(zero_model_state_bytes(Level, net.param_count(), net.local_count(), 4))) /
        1048576.0;
    if (ctx.rank() != 0) return;

    char plan[240];
    std::snprintf(plan, sizeof plan, "zero%d: shard<%s%s, %d> over data:%d%s%s", Level, W::name,
                  rc ? " with recompute" : "", Level, P,
                  Level == 3 ? (o.prefetch ? ", per-leaf gathers prefetched" : ", per-leaf gathers") : "",
                  o.bf16_reduce ? (Level == 1 ? ", gradients summed in bf16" : ", gradients reduce-scattered in bf16") : "");
    json_line j;
    head_fields<W>(j, plan, P, step_s, global, data.seq());
    j.add("comm_bytes_per_rank_per_step", static_cast<long long>(sent / timed_steps));
    j.add("peak_rss_mib_per_rank", rss);
    j.raw("memory_mib", memory_json(mem));
    j.add("memory_busiest_rank_mib", busiest_mib);
    j.raw("predicted_memory_mib", predicted_mem);
    j.add("model_state_mib_per_rank", state_mib).add("model_state_formula_mib", formula_mib);
    j.add("recompute", rc ? 1 : 0);
    j.add("grad_reduce", o.bf16_reduce ? "bf16" : "fp32");
    j.add("loss_first", losses.front()).add("loss_last", losses.back());
    j.print();
  }
};

using zero1 = zero<1>;
using zero2 = zero<2>;
using zero3 = zero<3>;

}  // namespace bench::plans
