// The soak run (scripts/soak): a composed plan — ZeRO-1 over data, a 1F1B
// pipeline over pipe, tensor parallelism over model, recomputed blocks — on
// a small GPT, trained with AdamW and clipping for many steps, with an
// evaluation and a checkpoint every few hundred steps. Every `--every`
// steps each rank prints one JSON line with its resident set (from
// /proc/self/statm), the tracker's live bytes and its allocation count; at
// the end rank 0 says whether memory stayed flat after the warm-up (30% of
// the run: growth of the resident set at most 2 MiB + 2%, of the tracker's
// live bytes at most 64 KiB + 1%: a pipeline's pool of outgoing copies can
// gain one when a send is slow). Built under ASan and
// UBSan by scripts/soak, so a leak, an out-of-bounds access or undefined
// behaviour ends the run with the sanitizer's report.
//
//   mpirun -np 4 ./whale_soak [--steps 2000] [--every 100] [--mesh data=1,pipe=2,model=2] [--save DIR]
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

using namespace whale;

namespace {
constexpr index_t V = 64, S = 16, D = 32, H = 2, F = 64;
using block = transformer_block<D, H, F>;
using tp_gpt = sequential<split<embedding<V, D>>, position_embedding<S, D>, repeat<4, recompute<split<block>>>, layer_norm<D>,
                          split<sequential<linear<D, V>, softmax_cross_entropy>>>;
using plan = shard<pipeline<one_f_one_b, tp_gpt>, 1>;

double resident_mib() {
  std::ifstream f("/proc/self/statm");
  long long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1048576.0;
}
}  // namespace

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    std::int64_t total = 2000, every = 100;
    std::string save;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("whale_soak: " + a + " needs a value");
        return argv[++i];
      };
      if (a == "--steps") total = whale::detail::parse_int(value(), "--steps", 1, 100000000);
      else if (a == "--every") every = whale::detail::parse_int(value(), "--every", 1, 100000000);
      else if (a == "--save") save = value();
      else throw std::invalid_argument("whale_soak: unknown argument " + a + " (have --steps, --every, --save, --mesh)");
    }
    plan_options o;
    o.micro_batches = 4;
    auto net = make<plan>(ctx, seed{42}, o);
    initialize(net, seed{42}, gpt2_init{});
    markov_data data(seed{7}, V, S, 16);
    auto held = data.held_out(16);
    trainer_options to;
    to.progress = false;
    to.max_grad_norm = 1.0;
    if (!save.empty()) to.checkpoint_dir = save, to.save_every = 500, to.keep_last = 2;
    trainer t(net, adamw{.lr = 1e-3f}, to);

    std::vector<double> rss;
    std::vector<std::int64_t> live;
    double first_loss = 0, last_loss = 0;
    for (std::int64_t s = 0; s < total; ++s) {
      const double loss = t.step(data, s);
      if ((s + 1) % 250 == 0) (void)t.evaluate(held, steps{2});
      if (s == 0) first_loss = loss;
      last_loss = loss;
      if ((s + 1) % every == 0 || s + 1 == total) {
        rss.push_back(resident_mib());
        live.push_back(memory_snapshot().live_total());
        std::printf("{\"rank\": %d, \"step\": %lld, \"loss\": %.5f, \"rss_mib\": %.2f, \"live_bytes\": %lld, \"tensor_allocations\": %lld}\n",
                    ctx.rank(), static_cast<long long>(s + 1), loss, rss.back(), static_cast<long long>(live.back()),
                    static_cast<long long>(memory_snapshot().allocations));
        std::fflush(stdout);
      }
    }
    // flat after the warm-up: from the first sample at 30% of the run on (by then
    // every buffer, the first evaluation's and the first checkpoint's included, exists once)
    std::size_t base = 0;
    while (base + 1 < rss.size() && static_cast<double>((base + 1) * every) < 0.3 * static_cast<double>(total)) ++base;
    const double growth = rss.back() - rss[base];
    const bool flat_rss = growth <= 2.0 + 0.02 * rss[base];
    // the pipeline's pool of outgoing message copies gains a buffer when a send is still
    // in flight as the next one starts (bounded by the sends of a step): allow 1% + 64 KiB
    const bool flat_live = static_cast<double>(live.back() - live[base]) <= 65536.0 + 0.01 * static_cast<double>(live[base]);
    double worst[4] = {flat_rss ? 0.0 : 1.0, flat_live ? 0.0 : 1.0, growth, static_cast<double>(live.back() - live[base])};
    all_reduce(ctx.world(), view<double>(worst, {4}), reduce_op::max);
    if (ctx.rank() == 0)
      std::printf("{\"soak\": \"%s\", \"steps\": %lld, \"ranks\": %d, \"loss_first\": %.4f, \"loss_last\": %.4f, "
                  "\"rank0_rss_mib_after_warmup\": %.2f, \"rank0_rss_mib_end\": %.2f, \"max_rss_growth_mib\": %.2f, "
                  "\"max_live_growth_bytes\": %.0f, \"flat_rss\": %s, \"flat_live\": %s}\n",
                  layer_name<plan>().c_str(), static_cast<long long>(total), ctx.size(), first_loss, last_loss, rss[base],
                  rss.back(), worst[2], worst[3], worst[0] == 0 ? "true" : "false", worst[1] == 0 ? "true" : "false");
    return worst[0] == 0 && worst[1] == 0 ? 0 : 1;
  });
}
