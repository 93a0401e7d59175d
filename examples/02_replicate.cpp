// 02: data parallelism. The `mlp` reference workload wrapped in replicate<...>:
// every rank holds all parameters, feeds its rows of each global batch of 256,
// and gradients are summed over ranks (all-reduced in buckets during backward),
// so every rank applies the same update and the run trains exactly as one
// process would on the whole batch (the same losses at 1, 2 or 4 ranks), in less
// time. The loss falls slowly from ln(1024) ≈ 6.93: 1024 teacher classes.
//
//   mpirun -np 2 ./build/examples/example_02_replicate [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE] [--threads T]
//                  [--bf16-reduce]   (gradient buckets summed in bf16: half the bytes, each sum rounded to bf16)
//
// Legend of shape comments: B the global batch (256), B/p the rows of one of p ranks.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

using namespace whale;

int main(int argc, char** argv) {
  // 1. Start: MPI, the mesh (default: every rank on the `data` axis), --threads.
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    run_flags flags(20);  // --steps --save --save-every --resume --log
    plan_options o = plan_options::from_env();
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--bf16-reduce") o.bf16_reduce = true;
      else throw std::invalid_argument("example_02: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --threads, --bf16-reduce)");
    }

    // 2. The plan is the type: replicate<mlp> = mlp, data parallel over `data`.
    //    (B/p, 1024) -> (B/p, 4096) -> (B/p, 4096) -> (B/p, 1024) logits -> loss
    using model = replicate<models::mlp>;
    auto net = make<model>(ctx, seed{42}, o);  // same initial parameters on every rank

    // 3. Print the plan (rank 0): the mesh, the buckets, the layers.
    if (ctx.rank() == 0) std::cout << net;

    // 4. Train: the trainer gives each rank its rows of every global batch and
    //    prints the progress line on rank 0; the loss it reports is global.
    auto data = models::mlp_data(seed{7});  // 256 samples per step, whatever the rank count
    trainer t(net, sgd{.lr = 0.1f, .momentum = 0.9f}, flags.options());
    const auto r = flags.run(t, data);  // resumes, trains to --steps, saves

    // 5. The same numbers on every rank; rank 0 says them.
    if (ctx.rank() == 0)
      std::printf("%d rank(s): loss %.4f -> %.4f, median step %.3f s\n", ctx.size(), r.loss_first(),
                  r.loss_last(), r.median_step_s());
    print_params_checksum(net);  // collective
    return 0;
  });
}
