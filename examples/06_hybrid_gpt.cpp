// 06: the gpt workload with Megatron-style tensor parallelism inside (split
// over the `model` axis: vocabulary-split embedding and LM head with a split
// softmax, column- then row-parallel FFN) and data parallelism outside, on a
// data × model mesh. The collectives between layers are chosen at compile
// time from the layouts; the plan prints them. It is the main job
// (scripts/main): GPT-2's initialisation (train/init.hpp), AdamW with warm-up
// and cosine decay, clipping at 1, and a held-out evaluation every 100 steps.
//
//   mpirun -np 4 ./example_06_hybrid_gpt --mesh data=2,model=2 [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE]
//
// Legend: B sequences per data rank, T = 128 tokens, C = 256 width, V = 8192.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdlib>
#include <iostream>
#include <string>

using namespace whale;

// (B, T) tokens -> (B*T, C) -> 4 blocks -> (B*T, V/model) logits -> split loss
using model = split<models::gpt, axis::model>;

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    run_flags flags(300);  // --steps --save --save-every --resume --log
    float lr = 3e-3f;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--lr" && i + 1 < argc) lr = static_cast<float>(whale::detail::parse_double(argv[++i], "--lr", 0, 10, true));
      else throw std::invalid_argument("example_06: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --lr, --mesh, --threads)");
    }
    auto net = make<model>(ctx, seed{42});
    initialize(net, seed{42}, gpt2_init{});  // N(0, 0.02), residual outputs N(0, 0.02 / sqrt(8))
    if (ctx.rank() == 0) std::cout << ctx.mesh() << "\n" << net;

    auto data = models::gpt_data(seed{7});  // 16 sequences x 128 tokens per step, split over data
    auto held = data.held_out(16);          // the same chain, sequences training never sees
    auto o = flags.options();
    o.max_grad_norm = 1.0;
    o.lr_schedule = warmup_cosine(lr, std::min<std::int64_t>(30, flags.steps / 10), flags.steps, lr / 10);
    o.eval_every = 100;
    o.eval_steps = 2;
    trainer t(net, adamw{.lr = lr, .weight_decay = 0.0f}, o);
    const auto r = flags.run(t, data, held);  // resumes, trains to --steps (evaluating), saves
    const double eval = t.evaluate(held, steps{2});
    if (ctx.rank() == 0)
      std::cout << "loss " << r.loss_first() << " -> " << r.loss_last() << ", held-out " << eval
                << " (floor ln 8 = 2.079), median step " << r.median_step_s() << " s\n";
    print_params_checksum(net);  // collective
    return 0;
  });
}
