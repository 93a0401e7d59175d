// 04: train the `gpt` reference workload with pipeline parallelism: the
// model's 4 transformer blocks are cut into as many stages as the mesh's pipe
// axis has ranks (balanced by the layers' cost), the first stage also holding
// the embeddings and the last the head and the loss. Micro-batches run under
// 1F1B (or GPipe; the zero-bubble zb-h1, whose backward is split into input-
// and weight-gradient passes; or interleaved 1F1B, two model chunks per pipe
// rank); each step ends with a flush, so it trains exactly as one process would.
//
//   mpirun -np 2 ./example_04_pipeline --mesh pipe=2 [--micro-batches 8] [--stage-blocks 3,1]
//          [--schedule gpipe|1f1b|zb-h1|interleaved] [--trace out.json] [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE]
//   mpirun -np 4 ./example_04_pipeline --mesh data=2,pipe=2     (replicate<pipeline<...>>)
//
// Open out.json in https://ui.perfetto.dev: one row per rank, a span per
// micro-batch's forward (F j), backward (B j) and, under zb-h1, weight pass (W j), sends, receive waits,
// all-reduces and the optimizer.
//
// Legend of shape comments: B sequences per replica, m micro-batches, T tokens, C width.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

using namespace whale;

template <class Plan> int train(const context& ctx, const plan_options& o, const run_flags& flags) {
  auto net = make<Plan>(ctx, seed{42}, o);  // checks the mesh, the stage cut and the schedule on every rank
  if (ctx.rank() == 0) std::cout << net;
  auto data = models::gpt_data(seed{7});  // 16 sequences x 128 tokens per step
  // Each stage sends (B/m * T, C) activations forward and their gradients back.
  trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, flags.options());
  const auto r = flags.run(t, data);  // resumes, trains to --steps, saves
  // Predictions: the logits of this replica's rows of a held-out step, by a
  // forward-only pass (every micro-batch forward; the last stage's output is
  // broadcast to the replica's other stages). (B*T, V) on every rank.
  const auto held = data.get(1000000, 0, data.global_batch());
  const auto [first, n] = net.local_batch(data.global_batch());
  step_ctx c;
  c.batch = n;
  c.seq = held.seq;
  const auto logits = net.forward(c, held.inputs.rows(first, n));
  const index_t rows = logits.shape()[0], vocab = logits.shape()[1];
  index_t hits = 0;
  for (index_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * vocab;
    hits += std::max_element(row, row + vocab) - row == held.labels[first * held.seq + r];
  }
  const auto ev = net.finish_trace();  // collective; writes --trace on rank 0
  const auto b = measure_bubble(ev, 2);
  if (ctx.rank() == 0) {
    std::printf("loss %.4f -> %.4f, median step %.3f s, micro-batches %d\n", r.loss_first(), r.loss_last(),
                r.median_step_s(), net.micro_batches());
    std::printf("held-out next-token accuracy (this replica's %lld rows, forward()): %.3f\n",
                static_cast<long long>(rows), static_cast<double>(hits) / static_cast<double>(rows));
    if (!ev.empty() && b.steps == 0)
      std::printf("bubble: not measured (steps 1-2 are warm-up; run with --steps 3 or more)\n");
    else if (!ev.empty())
      std::printf("bubble: busiest stage %.3f (the schedule's, passes of equal time: %.3f), mean over stages %.3f\n",
                  b.bottleneck, net.schedule_info().bubble, b.mean);
  }
  print_params_checksum(net);  // collective
  return 0;
}

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);  // --mesh data=D,pipe=P / WHALE_MESH; --threads
  return ctx.guard([&] {
    auto o = plan_options::from_args(argc, argv);  // --micro-batches, --stage-blocks, --trace
    if (o.micro_batches == 0) o.micro_batches = 8;
    o.trace = true;  // record spans in memory, for the bubble line
    run_flags flags(10);  // --steps --save --save-every --resume --log
    std::string schedule = "1f1b";
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--schedule" && i + 1 < argc) schedule = argv[++i];
      else throw std::invalid_argument("example_04: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --schedule, --mesh, --micro-batches, --stage-blocks, --trace, --threads)");
    }
    const bool replicated = ctx.mesh().shape().size(axis::data) > 1;
    // The plan is a type: the schedule and replicate<...> are chosen at compile time.
    if (schedule == "gpipe")
      return replicated ? train<replicate<pipeline<gpipe, models::gpt>>>(ctx, o, flags)
                        : train<pipeline<gpipe, models::gpt>>(ctx, o, flags);
    if (schedule == "1f1b")
      return replicated ? train<replicate<pipeline<one_f_one_b, models::gpt>>>(ctx, o, flags)
                        : train<pipeline<one_f_one_b, models::gpt>>(ctx, o, flags);
    if (schedule == "zb-h1")
      return replicated ? train<replicate<pipeline<zb_h1, models::gpt>>>(ctx, o, flags)
                        : train<pipeline<zb_h1, models::gpt>>(ctx, o, flags);
    if (schedule == "interleaved")
      return replicated ? train<replicate<pipeline<interleaved_1f1b<2>, models::gpt>>>(ctx, o, flags)
                        : train<pipeline<interleaved_1f1b<2>, models::gpt>>(ctx, o, flags);
    throw std::invalid_argument("example_04: --schedule " + schedule + ": have gpipe, 1f1b, zb-h1, interleaved");
  });
}
