// 16: regression on float targets. An MLP predicts two real values of 8
// features, y = (sin(x0) + x1 x2 / 2, x3 - x4^2), with mse_loss (the mean
// over every target element of the global batch, as PyTorch's MSELoss); the
// targets are floats in a tensor_data, negative ones included. The plan is
// data parallel (replicate<...>); pipeline<...>, shard<...> or a split head
// (split<sequential<linear<64, 2>, mse_loss>>) train the same numbers, and
// l1_loss or huber_loss<> (Huber, delta 1) in place of mse_loss train with
// those losses. At the end, the mse of held-out samples.
//
//   mpirun -np 2 ./build/examples/example_16_regression [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE] [--threads T]
//
// Legend of shape comments: B the global batch (64), B/p the rows of one of p ranks.
#include <whale/whale.hpp>

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

using namespace whale;

namespace {
/// n samples from sample stream `stream`: x ~ N(0, 1) (n, 8), y (n, 2) as above.
tensor_data<float, float> samples(index_t n, std::uint64_t stream, bool shuffle) {
  tensor<float> x({n, 8}), y({n, 2});
  const counter_rng r(seed{5}, stream);
  for (index_t i = 0; i < n * 8; ++i) x[i] = static_cast<float>(r.normal(static_cast<std::uint64_t>(i)));
  for (index_t s = 0; s < n; ++s) {
    const float* v = x.data() + s * 8;
    y[s * 2] = std::sin(v[0]) + 0.5f * v[1] * v[2];
    y[s * 2 + 1] = v[3] - v[4] * v[4];
  }
  return tensor_data<float, float>(std::move(x), std::move(y), 64, {.shuffle = shuffle, .seed = seed{9}});
}
}  // namespace

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    run_flags flags(300);
    for (int i = 1; i < argc; ++i)
      if (!flags.take(i, argc, argv))
        throw std::invalid_argument("example_16: unknown argument " + std::string(argv[i]) + " (have " +
                                    std::string(run_flags::names) + ", --threads)");

    // 1. The model ends in a regression loss: its targets are floats, 2 a sample.
    //    (B/p, 8) -> (B/p, 64) -> (B/p, 64) -> (B/p, 2) predictions -> mse against (B/p, 2) targets
    using body = sequential<linear<8, 64>, gelu, linear<64, 64>, gelu, linear<64, 2>>;
    using model = replicate<sequential<body, mse_loss>>;  // or l1_loss, huber_loss<>, huber_loss<0.5f>
    auto net = make<model>(ctx, seed{42});
    if (ctx.rank() == 0) std::cout << net;

    // 2. Float targets: tensor_data(x, y, B) with y of float is tensor_data<float, float>;
    //    class labels here would not compile (the loss takes float targets).
    auto train = samples(4096, 1, true);
    auto held_out = samples(512, 2, false);  // another sample stream: 8 steps of 64

    // 3. Train with AdamW; the loss the trainer reports is the global batch's mean.
    trainer t(net, adamw{.lr = 3e-3f, .weight_decay = 0.01f}, flags.options());
    const auto r = flags.run(t, train);
    const double mse = t.evaluate(held_out, steps{8});

    if (ctx.rank() == 0)
      std::printf("%d rank(s): train mse %.4f -> %.4f; held-out mse %.4f\n", ctx.size(), r.loss_first(), r.loss_last(), mse);
    return 0;
  });
}
