// 01: train the `gpt` reference workload on one process, on built-in
// Markov-chain tokens, with a live progress line: GPT-2's initialisation, AdamW
// with warm-up and cosine decay, clipping at 1. Loss falls from ln(8192) ≈ 9.0
// towards ln(8) ≈ 2.08 (the chain's entropy).
//
//   ./example_01_train_gpt [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE] [--lr LR] [--threads T]
//
// Legend of shape comments: B sequences, T tokens per sequence, C width.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

using namespace whale;

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);  // --threads N / WHALE_THREADS; one process here
  return ctx.guard([&] {
    run_flags flags(300);  // --steps --save --save-every --resume --log
    float lr = 3e-3f;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--lr" && i + 1 < argc) lr = static_cast<float>(whale::detail::parse_double(argv[++i], "--lr", 0, 10, true));
      else throw std::invalid_argument("example_01: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --lr, --threads)");
    }

    // (B, T) tokens -> (B*T, C) -> ... -> (B*T, 8192) logits -> loss
    using model = models::gpt;
    auto net = make<model>(ctx, seed{42});
    initialize(net, seed{42}, gpt2_init{});  // weights N(0, 0.02), residual outputs N(0, 0.02 / sqrt(8))
    std::cout << net;

    auto data = models::gpt_data(seed{7});  // 16 sequences x 128 tokens per step
    auto o = flags.options();
    o.max_grad_norm = 1.0;
    o.lr_schedule = warmup_cosine(lr, std::min<std::int64_t>(30, flags.steps / 10), flags.steps, lr / 10);
    trainer t(net, adamw{.lr = lr, .weight_decay = 0.0f}, o);
    const auto r = flags.run(t, data);  // resumes, trains to --steps, saves
    std::printf("loss %.4f -> %.4f (floor ln 8 = 2.0794), median step %.3f s\n", r.loss_first(), r.loss_last(),
                r.median_step_s());
    print_params_checksum(net);  // collective
    return 0;
  });
}
