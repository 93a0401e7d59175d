// 05: ZeRO. The `gpt` reference workload with its blocks recomputed, wrapped in
// shard<..., Level>: each of p ranks keeps 1/p of the optimizer state (level 1),
// of the gradients (2) and of the parameters (3, the default); a leaf layer's
// parameters are all-gathered just before it runs and freed after. It trains
// exactly as one process would on the whole batch; what changes is the memory
// each rank holds, printed by category after the first step. --bf16-reduce
// sends the gradients in bf16 (half the bytes; each partial sum rounded to bf16).
//
//   mpirun -np 2 ./build/examples/example_05_shard [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE] [--level 1|2|3] [--bf16-reduce] [--threads T]
//
// Legend of shape comments: B sequences (16 per step, B/p per rank), T tokens (128), C width (256).
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>
#include <whale/nn/recompute.hpp>
#include <whale/strategy/shard.hpp>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

using namespace whale;

// The reference gpt with each transformer block recomputed in backward:
// (B/p, T) tokens -> (B/p*T, C) -> 4 x recompute<block> -> (B/p*T, 8192) logits -> loss
using gpt_recomputed =
    sequential<embedding<8192, 256>, position_embedding<128, 256>, repeat<4, recompute<transformer_block<256, 4, 1024>>>,
               layer_norm<256>, linear<256, 8192>, softmax_cross_entropy>;

template <int Level> int train(const context& ctx, const run_flags& flags, const plan_options& o) {
  // 1. The plan is the type: shard<M, Level>. make() builds its runtime.
  auto net = make<shard<gpt_recomputed, Level>>(ctx, seed{42}, o);
  if (ctx.rank() == 0) std::cout << net;

  // 2. One step, then the memory each rank holds (params/grads/optimizer are the
  //    model state; comm holds gathered parameters and gradients in flight).
  auto data = models::gpt_data(seed{7});
  trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, flags.options());
  if (!flags.resume.empty()) t.load(flags.resume);
  if (flags.remaining(t) > 0) {
    reset_memory_peaks();
    const auto r1 = t.run(data, steps{1});
    if (ctx.rank() == 0) std::cout << "after step " << t.next_step() << ", rank 0: " << memory_snapshot() << "\n";

    // 3. The rest, with the progress line; then the final save of --save.
    const auto r = t.run(data, steps{flags.remaining(t)});
    if (ctx.rank() == 0)
      std::printf("ZeRO-%d on %d rank(s): loss %.4f -> %.4f, median step %.3f s\n", Level, ctx.size(), r1.loss_first(),
                  r.losses.empty() ? r1.loss_last() : r.loss_last(), r.losses.empty() ? r1.median_step_s() : r.median_step_s());
  }
  flags.finish(t);
  print_params_checksum(net);  // collective
  return 0;
}

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    run_flags flags(10);  // --steps --save --save-every --resume --log
    int level = 3;
    plan_options o;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--level" && i + 1 < argc) level = static_cast<int>(whale::detail::parse_int(argv[++i], "--level", 1, 3));
      else if (a == "--bf16-reduce") o.bf16_reduce = true;  // gradients reduced in bf16 (plan_options::bf16_reduce)
      else throw std::invalid_argument("example_05: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --level, --bf16-reduce, --threads)");
    }
    switch (level) {
      case 1: return train<1>(ctx, flags, o);
      case 2: return train<2>(ctx, flags, o);
      case 3: return train<3>(ctx, flags, o);
      default: throw std::invalid_argument("example_05: --level must be 1, 2 or 3");
    }
  });
}
