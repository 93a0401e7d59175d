// 03: Whale's 100,000-class classifier. The backbone is replicated (data
// parallel) and the classifier is split by class over the same ranks, so the
// 205M-parameter classifier is never all-reduced: its logits stay split by
// class and the softmax runs with two small all-reduces (row max, row sum).
//
//   mpirun -np 2 ./example_03_split_xc [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE]
//
// Legend: B samples per rank, G = B x ranks, C = 100,000 classes, p ranks.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdlib>
#include <iostream>
#include <string>

using namespace whale;

// (B, 512) -> (B, 2048): replicated, batch split<0> over the data axis
using backbone = sequential<linear<512, 2048>, relu>;
// (G, 2048) -> (G, C/p) -> loss: all-gather the rows, class-split linear, split softmax
using classifier = sequential<linear<2048, 100000>, softmax_cross_entropy>;
using model = sequential<replicate<backbone>, split<classifier, axis::data>>;

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);  // mesh: every rank on the data axis
  return ctx.guard([&] {
    run_flags flags(20);  // --steps --save --save-every --resume --log
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else throw std::invalid_argument("example_03: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --mesh, --threads)");
    }
    auto net = make<model>(ctx, seed{42});
    if (ctx.rank() == 0) std::cout << net;

    auto data = models::xc_data(seed{7}, models::xc_batch_per_rank * ctx.size());
    trainer t(net, sgd{.lr = 0.01f, .momentum = 0.9f}, flags.options());
    const auto r = flags.run(t, data);  // resumes, trains to --steps, saves
    const auto bytes = ctx.mesh().comm(axis::data).stats().bytes_sent;
    if (ctx.rank() == 0)
      std::cout << "loss " << r.loss_first() << " -> " << r.loss_last() << ", median step " << r.median_step_s()
                << " s, " << static_cast<double>(bytes) / static_cast<double>(std::max<std::size_t>(1, r.losses.size())) / 1e6
                << " MB sent per rank per step\n";
    print_params_checksum(net);  // collective
    return 0;
  });
}
