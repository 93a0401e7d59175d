// 01: train the `gpt` reference workload on one process, on built-in
// Markov-chain tokens, with a live progress line. Loss falls from ln(8192) ≈ 9.0
// towards ln(8) ≈ 2.08 (the chain's entropy).
//
//   ./example_01_train_gpt [--steps N] [--lr LR] [--threads T]
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
    std::int64_t n_steps = 300;
    float lr = 3e-3f;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--steps" && i + 1 < argc) n_steps = whale::detail::parse_int(argv[++i], "--steps", 1, 100000000);
      else if (a == "--lr" && i + 1 < argc) lr = static_cast<float>(whale::detail::parse_double(argv[++i], "--lr", 0, 10, true));
      else throw std::invalid_argument("example_01: unknown argument " + a + " (have --steps, --lr, --threads)");
    }

    // (B, T) tokens -> (B*T, C) -> ... -> (B*T, 8192) logits -> loss
    using model = models::gpt;
    auto net = make<model>(ctx, seed{42});
    std::cout << net;

    auto data = models::gpt_data(seed{7});  // 16 sequences x 128 tokens per step
    trainer_options o;
    o.max_grad_norm = 1.0;
    trainer t(net, adamw{.lr = lr, .weight_decay = 0.0f}, o);
    const auto r = t.run(data, steps{n_steps});
    std::printf("loss %.4f -> %.4f (floor ln 8 = 2.0794), median step %.3f s\n", r.loss_first(), r.loss_last(),
                r.median_step_s());
    return 0;
  });
}
