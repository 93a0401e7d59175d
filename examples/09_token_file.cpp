// 09: your own data. Train a small GPT on a file of token ids (nanoGPT's
// flat uint16 train.bin, or llm.c's .bin with its header), memory-mapped, with
// the last 5% held out and evaluated every 50 steps. Without --data it first
// writes such a file from a random Markov chain (8 successors per token: the
// loss floor is ln 8 = 2.08), so it runs as it is.
//
//   ./example_09_token_file [--data FILE.bin [--vocab V]] [--u32] [--steps N] [--save DIR [--save-every K]] [--resume DIR] [--log FILE] [--threads T]
//   mpirun -np 2 ./example_09_token_file        (data parallel over the ranks)
//
// Legend: T = 64 tokens per sequence, 16 sequences per step, width 128, 2 blocks.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

using namespace whale;

constexpr index_t vocab = 1024, seq = 64, batch = 16;
using model = models::gpt_model<vocab, seq, 128, 4, 512, 2>;

// 2M tokens of markov_data's chain as a flat uint16 file, written whole under a temporary name, then renamed.
std::string write_demo_file(const std::string& path) {
  markov_data chain(seed{7}, vocab, 4096, 1);
  std::vector<std::uint16_t> toks;
  for (std::int64_t s = 0; s < 512; ++s) {
    const auto b = chain.get(s, 0, 1);
    for (index_t t = 0; t < 4096; ++t) toks.push_back(static_cast<std::uint16_t>(b.inputs[t]));
  }
  const auto tmp = path + ".tmp";
  std::ofstream f(tmp, std::ios::binary);
  f.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 2));
  f.close();
  if (!f) throw std::runtime_error("example_09: cannot write the demo token file " + tmp);
  std::filesystem::rename(tmp, path);
  return path;
}

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    run_flags flags(200);  // --steps --save --save-every --resume --log
    std::string path;
    index_t v = vocab;
    bool u32 = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--data" && i + 1 < argc) path = argv[++i];
      else if (a == "--vocab" && i + 1 < argc) v = detail::parse_int(argv[++i], "--vocab", 2, vocab);
      else if (a == "--u32") u32 = true;
      else throw std::invalid_argument("example_09: unknown argument " + a + " (have " + std::string(run_flags::names) +
                                       ", --data, --vocab, --u32, --threads)");
    }
    std::string demo;
    if (path.empty()) {  // rank 0 writes it; the others wait for the rename
      long id = static_cast<long>(::getpid());
      if (ctx.world().size() > 1) broadcast(ctx.world(), view<long>(&id, {1}), 0);
      demo = (std::filesystem::temp_directory_path() / ("whale-example-09-" + std::to_string(id) + ".bin")).string();
      if (ctx.rank() == 0) write_demo_file(demo);
      if (ctx.world().size() > 1) barrier(ctx.world());
      path = demo;
    }
    const token_file_options o{.width = u32 ? token_width::u32 : token_width::u16, .held_out = 0.05, .vocab = v};
    token_file train(path, seq, batch, o);
    auto ho = o;
    ho.split = token_split::held_out;
    token_file held(path, seq, batch, ho);
    if (ctx.rank() == 0)
      std::printf("%s: %lld training tokens (%lld sequences of %lld + 1), %lld held out\n", path.c_str(),
                  static_cast<long long>(train.tokens()), static_cast<long long>(train.windows()),
                  static_cast<long long>(seq), static_cast<long long>(held.tokens()));

    auto net = make<replicate<model>>(ctx, seed{42});
    initialize(net, seed{42}, gpt2_init{});
    auto to = flags.options();
    to.max_grad_norm = 1.0;
    to.lr_schedule = warmup_cosine(3e-3, std::min<std::int64_t>(20, flags.steps / 10), flags.steps, 3e-4);
    to.eval_every = 50;
    to.eval_steps = 4;
    to.eval_metric = accuracy;  // next-token top-1 on the held-out part
    trainer t(net, adamw{.lr = 3e-3f, .weight_decay = 0.0f}, to);
    const auto r = flags.run(t, train, held);  // resumes, trains to --steps (evaluating), saves
    const double eval = t.evaluate(held, steps{4});
    if (ctx.rank() == 0) std::printf("loss %.4f -> %.4f, held-out %.4f (the demo file's floor: ln 8 = 2.0794)\n", r.loss_first(), r.loss_last(), eval);
    print_params_checksum(net);
    if (!demo.empty() && ctx.rank() == 0) std::filesystem::remove(demo);
    return 0;
  });
}
