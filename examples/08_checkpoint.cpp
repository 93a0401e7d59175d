// 08: checkpoints. Train a small gpt data parallel, save a checkpoint, load it
// under another plan (tensor parallel over the same ranks) and keep training;
// then export the unsplit model to one safetensors file and load it into a
// single process. Each rank writes only what it owns and reads only what its
// plan places on it: no gather on either side.
//
//   mpirun -np 2 ./example_08_checkpoint [--steps N] [--dir DIR] [--threads T]
//
// It prints the parameters' checksum after saving and after loading (equal:
// resharding is exact). DIR/dp/step-<N/2>/ holds meta.txt and one rank-<r>.bin
// per rank; DIR/model.safetensors the unsplit model. Examples 01-06 take
// --save DIR, --save-every K and --resume DIR to do the same across jobs.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <unistd.h>

using namespace whale;

// Legend: vocabulary 256, 32 positions, width 64, 4 heads, FFN 256, 2 blocks.
using small_gpt = models::gpt_model<256, 32, 64, 4, 256, 2>;
using block = transformer_block<64, 4, 256>;
// The same model, tensor parallel: every split<> holds 1/p of its layer (same initialisation, same checkpoint).
using small_gpt_tp = sequential<split<embedding<256, 64>>, position_embedding<32, 64>, repeat<2, split<block>>, layer_norm<64>,
                                split<linear<64, 256>>, softmax_cross_entropy>;

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    std::int64_t n_steps = 40;
    std::string dir = (std::filesystem::temp_directory_path() / ("whale-example-08-" + std::to_string(::getpid()))).string();
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--steps" && i + 1 < argc) n_steps = detail::parse_int(argv[++i], "--steps", 2, 100000000);
      else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
      else throw std::invalid_argument("example_08: unknown argument " + a + " (have --steps, --dir, --threads)");
    }
    auto data = markov_data(seed{7}, 256, 32, 16);  // 16 sequences x 32 tokens per step
    const auto opt = adamw{.lr = 3e-3f, .weight_decay = 0.0f};
    trainer_options o;
    o.max_grad_norm = 1.0;
    o.plain_every = 10;

    // 1. Data parallel for the first half; save (collective: each rank its shard, rank 0 the metadata).
    std::string saved;
    {
      auto net = make<replicate<small_gpt>>(ctx, seed{42});
      trainer t(net, opt, o);
      t.run(data, steps{n_steps / 2});
      saved = t.save(dir + "/dp");
      if (ctx.rank() == 0) std::printf("saved %s under %s\n", saved.c_str(), net.placement().plan.c_str());
      print_params_checksum(net);
    }

    // 2. Tensor parallel over the same ranks: load (each rank reads its slices of every
    //    layer, and the optimizer state of them), and train the second half.
    auto tp_ctx = ctx.with_mesh("model=" + std::to_string(ctx.size()));
    auto net = make<small_gpt_tp>(tp_ctx, seed{1});  // another seed: the values come from the checkpoint
    trainer t(net, opt, o);
    const auto info = t.load(dir + "/dp");
    if (ctx.rank() == 0) std::printf("loaded step %lld (saved under %s on %s) into %s\n", static_cast<long long>(info.step),
                                     info.plan.c_str(), info.mesh.c_str(), net.placement().plan.c_str());
    print_params_checksum(net);  // the same as above: resharding is exact
    const auto r = t.run(data, steps{n_steps - t.next_step()});
    if (ctx.rank() == 0) std::printf("loss after %lld steps: %.4f (floor ln 8 = 2.079)\n", static_cast<long long>(t.next_step()), r.loss_last());

    // 3. One consolidated file of the unsplit parameters, read by one process.
    export_safetensors(dir + "/model.safetensors", net, t.next_step());
    if (ctx.rank() == 0) {
      network<small_gpt> single(seed{3});
      import_safetensors(dir + "/model.safetensors", single);
      std::printf("%s: %lld parameters imported into one process\n", (dir + "/model.safetensors").c_str(),
                  static_cast<long long>(single.param_count()));
    }
    print_params_checksum(net);
    return 0;
  });
}
