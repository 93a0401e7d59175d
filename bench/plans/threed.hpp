// Plan `3d`: any composition of data, pipeline and tensor parallelism on
// `gpt`, on the mesh given by --mesh data=D,pipe=P,model=M: the reference gpt
// with tensor parallelism inside every layer (vocabulary-split embedding,
// head-split attention, column/row FFN, class-split head and loss), its blocks
// cut into pipeline stages at run time, replicated over data. Options
// --schedule gpipe|1f1b, --micro-batches m (default: the runtime's),
// --recompute (each block recomputed in backward), --zero 0..3 (ZeRO over
// the data axis inside each stage; with 1f1b and without --recompute).
// Besides the step it reports the bytes the lowered program predicts per rank
// next to the bytes counted, and model-state memory per rank.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <type_traits>

#include "../bench_common.hpp"
#include "whale/runtime/make.hpp"
#include "whale/detail/parse.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/plan/lower.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/train/trainer.hpp"

namespace bench::plans {

struct threed {
  static constexpr const char* name = "3d";
  static constexpr const char* help =
      "gpt only: tensor parallel over model, pipelined over pipe, replicated over data, on --mesh "
      "data=D,pipe=P,model=M; --schedule gpipe|1f1b (default 1f1b), --micro-batches m (default: the runtime's), "
      "--recompute, --zero 0..3 (ZeRO inside each stage; 1f1b, no --recompute), --bf16-reduce (gradients summed in bf16)";
  template <class W> static constexpr bool supports = std::is_same_v<W, gpt_workload>;

  // (B, T) tokens -> vocabulary-split embedding -> (B*T, C) -> Stack -> class-split head and loss
  static constexpr whale::index_t V = 8192, S = 128, D = 256, H = 4, F = 1024;
  using block = whale::transformer_block<D, H, F>;
  template <class Stack>
  using tp_gpt = whale::sequential<whale::split<whale::embedding<V, D>>, whale::position_embedding<S, D>, Stack,
                                   whale::layer_norm<D>,
                                   whale::split<whale::sequential<whale::linear<D, V>, whale::softmax_cross_entropy>>>;

  template <class W> static void run(config& c) {
    const std::string sched = c.args.text("--schedule", "1f1b");
    const std::string mtext = c.args.text("--micro-batches", "0");
    const int m = static_cast<int>(whale::detail::parse_int(mtext, "--micro-batches", 0, 1 << 16));
    const bool rec = c.args.flag("--recompute");
    bf16_ = c.args.flag("--bf16-reduce");
    const int zero = static_cast<int>(whale::detail::parse_int(c.args.text("--zero", "0"), "--zero", 0, 3));
    c.args.done(name);
    if (sched != "gpipe" && sched != "1f1b") throw usage_error("bench: --schedule " + sched + ": have gpipe, 1f1b");
    if (zero != 0 && (rec || sched != "1f1b"))
      throw usage_error("bench: --plan 3d --zero " + std::to_string(zero) +
                        " is built for --schedule 1f1b without --recompute (to keep the benchmark's build small)");
    const bool g = sched == "gpipe";
    using R = whale::repeat<4, whale::recompute<whale::split<block>>>;
    using N = whale::repeat<4, whale::split<block>>;
    using whale::one_f_one_b;
    if (zero == 1) go<W, zero_plan<N, 1>>(c, m);
    else if (zero == 2) go<W, zero_plan<N, 2>>(c, m);
    else if (zero == 3) go<W, zero_plan<N, 3>>(c, m);
    else if (rec) g ? go<W, plan<whale::gpipe, R>>(c, m) : go<W, plan<one_f_one_b, R>>(c, m);
    else g ? go<W, plan<whale::gpipe, N>>(c, m) : go<W, plan<one_f_one_b, N>>(c, m);
  }

 private:
  static inline bool bf16_ = false;  // --bf16-reduce
  template <class Sched, class Stack> using plan = whale::replicate<whale::pipeline<Sched, tp_gpt<Stack>>>;
  template <class Stack, int L> using zero_plan = whale::shard<plan<whale::one_f_one_b, Stack>, L>;
  template <class> struct plan_parts;
  template <class Sched, class Stack> struct plan_parts<plan<Sched, Stack>> {
    using sched = Sched;
    static constexpr bool recomputed = !std::is_same_v<Stack, whale::repeat<4, whale::split<block>>>;
    static constexpr int zero = 0;
  };
  template <class Stack, int L> struct plan_parts<zero_plan<Stack, L>> : plan_parts<plan<whale::one_f_one_b, Stack>> {
    static constexpr int zero = L;
  };

  template <class W, class P> static void go(config& c, int m) {
    using namespace whale;
    using Sched = typename plan_parts<P>::sched;
    auto& ctx = *c.ctx;
    const auto& shape = ctx.mesh().shape();
    plan_options o;
    o.micro_batches = m;
    o.bf16_reduce = bf16_;
    const index_t global = W::global_batch(1);
    lower_options lo = lowering_of(o, global, models::gpt_seq);
    lo.optimizer_bytes_per_param = 4;  // SGD with momentum
    lo.zero_level = plan_parts<P>::zero;
    const auto prog = lower<P>(shape, ctx.rank(), lo);  // checks the plan against the mesh on every rank
    auto data = W::data(global);
    auto net = make<P>(ctx, seed{42}, o);
    trainer_options to;
    to.progress = false;
    trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, to);
    const auto run = run_steps(ctx, t, data, global, c.steps);
    const auto& losses = run.losses;
    const std::int64_t sent = run.sent;
    const int timed_steps = c.steps - 2;
    const double step_s = run.step_s;
    const double counted = max_over_ranks(ctx, static_cast<double>(sent) / timed_steps);
    const auto tot = prog.totals();
    const double predicted = max_over_ranks(ctx, static_cast<double>(tot.bytes_sent));
    const double state = max_over_ranks(ctx, static_cast<double>(tot.param_bytes + tot.grad_bytes + tot.optimizer_bytes));
    const double rss = max_over_ranks(ctx, peak_rss_mib());
    const auto mem = max_memory(ctx);
    const double busiest_mib = busiest_rank_mib(ctx);
    const auto predicted_mem = predicted_memory_json(ctx, net.predicted_memory(global, data.seq(), 4));  // SGD with momentum
    if (ctx.rank() != 0) return;
    char plan[256];
    std::snprintf(plan, sizeof plan, "3d: gpt tensor parallel over model:%d, %s pipeline over pipe:%d (m=%d%s), data:%d%s%s",
                  shape.size(axis::model), Sched::name().c_str(), shape.size(axis::pipe), net.micro_batches(),
                  plan_parts<P>::recomputed ? ", blocks recomputed" : "", shape.size(axis::data),
                  plan_parts<P>::zero ? (", ZeRO-" + std::to_string(plan_parts<P>::zero)).c_str() : "",
                  bf16_ ? ", gradients summed in bf16" : "");
    json_line j;
    head_fields<W>(j, plan, ctx.size(), step_s, global, data.seq());
    j.add("mesh", shape.spec()).add("schedule", Sched::name()).add("micro_batches", net.micro_batches());
    j.add("zero", plan_parts<P>::zero).add("grad_reduce", bf16_ ? "bf16" : "fp32");
    j.add("comm_bytes_per_rank_per_step", static_cast<long long>(counted));
    j.add("program_bytes_per_rank_per_step", static_cast<long long>(predicted));
    j.add("model_state_mib_per_rank", state / 1048576.0);
    j.add("peak_rss_mib_per_rank", rss);
    j.raw("memory_mib", memory_json(mem));
    j.add("memory_busiest_rank_mib", busiest_mib);
    j.raw("predicted_memory_mib", predicted_mem);
    j.add("loss_first", losses.front()).add("loss_last", losses.back());
    j.print();
  }
};

}  // namespace bench::plans
