// 15: a small Llama (or GPT-2) learns a real text, byte by byte, under the plan you name.
// The text becomes a token file of bytes (vocabulary 256), as
// `scripts/prepare-text FILE OUT` writes it; the last 10% is held out. Every
// 50 steps and at the end it reports the held-out loss and bits per byte
// (the loss in nats / ln 2). Without --data it reads the licence texts that
// every Debian system ships (/usr/share/common-licenses, package base-files:
// 14 files, 237 KB of English, one after another by name; the held-out 10% is
// the end of the Mozilla Public Licences).
//
//   ./example_15_llama_text [--data FILE.bin] [--model llama|gpt2] [--plan dp|tp|pp|zero3] [--steps N] [--save DIR ...]
//   mpirun -np 2 ./example_15_llama_text                               (data parallel)
//   mpirun -np 2 ./example_15_llama_text --plan tp --mesh model=2      (tensor parallel)
//   mpirun -np 2 ./example_15_llama_text --plan pp --mesh pipe=2       (pipeline)
//   mpirun -np 2 ./example_15_llama_text --plan zero3                  (ZeRO-3 over the data ranks)
//   mpirun -np 2 ./example_15_llama_text --model gpt2 --plan pp --mesh pipe=2
//                                  (GPT-2: its tied head on the last stage, kept equal to the table on the first)
//
// Legend: Llama: 4 layers, width 128, 4 query heads sharing 2 key/value
// heads, MLP 352. GPT-2 (--model gpt2): 4 layers, width 128, 4 heads, MLP
// 512, the LM head tied to the token table. 128 bytes per sequence, 16
// sequences per step.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>
#include <whale/models/gpt2.hpp>
#include <whale/models/llama.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

using namespace whale;

constexpr index_t seq = 128, batch = 16;
using llama_model = models::llama<4, 128, 4, 2, 352, 256, seq>;
using gpt2_model = models::gpt2<4, 128, 4, 256, seq>;
const char* const default_texts = "/usr/share/common-licenses";

// The bytes of the regular files in folder `texts` (by name; links skipped), as uint16 tokens
// (what scripts/prepare-text writes), under a temporary name, then renamed.
void bytes_to_tokens(const std::string& texts, const std::string& out) {
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(texts))
    if (e.is_regular_file() && !e.is_symlink()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw std::runtime_error("example_15: no texts in " + texts + "; give --data FILE.bin (scripts/prepare-text)");
  std::string bytes;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw std::runtime_error("example_15: cannot read " + f.string());
    bytes.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::vector<std::uint16_t> toks(bytes.size());
  for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<unsigned char>(bytes[i]);
  const auto tmp = out + ".tmp";
  std::ofstream f(tmp, std::ios::binary);
  f.write(reinterpret_cast<const char*>(toks.data()), static_cast<std::streamsize>(toks.size() * 2));
  f.close();
  if (!f) throw std::runtime_error("example_15: cannot write the token file " + tmp);
  std::filesystem::rename(tmp, out);
}

template <class Plan>
int train(context& ctx, run_flags& flags, token_file& data, token_file& held, const char* plan) {
  auto net = make<Plan>(ctx, seed{42});
  initialize(net, seed{42}, gpt2_init{});  // N(0, 0.02) weights, as transformers initialises Llama and GPT-2
  auto to = flags.options();
  to.max_grad_norm = 1.0;
  to.lr_schedule = warmup_cosine(2e-3, std::min<std::int64_t>(20, flags.steps / 10), flags.steps, 2e-4);
  to.eval_every = 50;
  to.eval_steps = 4;
  trainer t(net, adamw{.lr = 2e-3f, .weight_decay = 0.1f}, to);
  const auto r = flags.run(t, data, held);
  const double eval = t.evaluate(held, steps{4});
  if (ctx.rank() == 0)
    std::printf("%s: loss %.4f -> %.4f; held-out %.4f nats per byte = %.3f bits per byte (uniform: 8)\n", plan, r.loss_first(),
                r.loss_last(), eval, eval / std::log(2.0));
  print_params_checksum(net);
  return 0;
}

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    run_flags flags(600);  // --steps --save --save-every --resume --log ...
    std::string path, plan = "dp", model = "llama";
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      else if (a == "--data" && i + 1 < argc) path = argv[++i];
      else if (a == "--plan" && i + 1 < argc) plan = argv[++i];
      else if (a == "--model" && i + 1 < argc) model = argv[++i];
      else throw std::invalid_argument("example_15: unknown argument " + a + " (have " + std::string(run_flags::names) +
                                       ", --data FILE, --model llama|gpt2, --plan dp|tp|pp|zero3, --mesh, --threads)");
    }
    if (model != "llama" && model != "gpt2")
      throw std::invalid_argument("example_15: --model " + model + ": have llama, gpt2");
    if (plan != "dp" && plan != "tp" && plan != "pp" && plan != "zero3")
      throw std::invalid_argument("example_15: --plan " + plan + ": have dp (data parallel), tp (tensor parallel), pp (pipeline), zero3");
    std::string made;
    if (path.empty()) {  // rank 0 turns the default text into tokens; the others wait for the rename
      long id = static_cast<long>(::getpid());
      if (ctx.world().size() > 1) broadcast(ctx.world(), view<long>(&id, {1}), 0);
      made = (std::filesystem::temp_directory_path() / ("whale-example-15-" + std::to_string(id) + ".bin")).string();
      if (ctx.rank() == 0) bytes_to_tokens(default_texts, made);
      if (ctx.world().size() > 1) barrier(ctx.world());
      path = made;
    }
    const token_file_options o{.width = token_width::u16, .held_out = 0.10, .vocab = 256};
    token_file data(path, seq, batch, o);
    auto ho = o;
    ho.split = token_split::held_out;
    token_file held(path, seq, batch, ho);
    if (ctx.rank() == 0)
      std::printf("%s: %lld bytes to train on, %lld held out; %s on %d ranks\n", made.empty() ? path.c_str() : default_texts,
                  static_cast<long long>(data.tokens()), static_cast<long long>(held.tokens()), plan.c_str(), ctx.world().size());
    if (ctx.rank() == 0) std::printf("model: %s\n", model == "gpt2" ? layer_name<gpt2_model>().c_str() : layer_name<llama_model>().c_str());
    int rc = 0;
    const int n = ctx.world().size();
    const auto& shape = ctx.mesh().shape();
    auto need_axis = [&](axis a, const char* mesh) {
      if (n > 1 && shape.size(a) != n)
        throw std::invalid_argument("example_15: --plan " + plan + " on " + std::to_string(n) + " ranks needs --mesh " + mesh +
                                    "=" + std::to_string(n));
    };
    if (plan == "tp") need_axis(axis::model, "model");
    if (plan == "pp") need_axis(axis::pipe, "pipe");
    auto run = [&]<class model>(model*) {
      if (plan == "dp") return train<replicate<model>>(ctx, flags, data, held, "data parallel");
      if (plan == "pp") return train<pipeline<one_f_one_b, model>>(ctx, flags, data, held, "pipeline (1F1B)");
      if (plan == "zero3") return train<shard<model, 3>>(ctx, flags, data, held, "ZeRO-3");
      return train<split<model>>(ctx, flags, data, held, "tensor parallel");
    };
    if (plan == "tp" && model == "llama" && n > 2)
      throw std::invalid_argument("example_15: --plan tp: the Llama's 2 key/value heads allow at most 2 ranks");
    if (plan == "tp" && model == "gpt2" && 4 % n != 0)
      throw std::invalid_argument("example_15: --plan tp: the GPT-2's 4 heads allow 1, 2 or 4 ranks");
    rc = model == "gpt2" ? run(static_cast<gpt2_model*>(nullptr)) : run(static_cast<llama_model*>(nullptr));
    if (!made.empty() && ctx.rank() == 0) std::filesystem::remove(made);
    return rc;
  });
}
