// 12: auto_plan. The `gpt` reference workload wrapped in auto_plan<...>: the
// planner lowers every plan it can build for gpt on the mesh the job was
// launched with (data parallel, ZeRO 1-3, or a 1F1B pipeline with 1, 2 or 4
// micro-batches per stage on a data x pipe mesh; on a data-only mesh the
// pipeline also on every data x pipe reshaping of the world, tensor
// parallelism, split<gpt>, on every data x model one, and the 3-D plan -- the
// pipeline with each embedding, block and linear split over the model axis,
// with ZeRO 1-3 where the data axis has 2 ranks or more -- on every data x
// pipe x model one; and each of these again with gpt's blocks recomputed in
// backward, less memory for more compute), replays each on
// a measured device profile, drops those over the memory limit, and runs the fastest
// (of candidates predicted within --plan-tie of the fastest, default 0.02, the
// simplest). It prints its choice, the prediction and why the others lost, then trains.
// Under a tight --memory-mib (120 at 2 ranks on bench/profiles/vm-2.txt) a recomputed
// plan runs: "chose pipeline 1f1b m=8 recompute on data=1,pipe=2,model=1 (... 84 MiB per rank)".
//
//   mpirun -np 2 ./build/examples/example_12_auto_plan --profile bench/profiles/vm-2.txt [--steps N] [--memory-mib M] [--plan-tie F]
//   mpirun -np 4 ./build/examples/example_12_auto_plan --profile bench/profiles/vm-4.txt --mesh data=2,pipe=2
//   mpirun -np 2 ./build/examples/example_12_auto_plan    # no profile: measured at start (seconds), then cached
//
// Legend of shape comments: B the global batch (16 sequences), T 128 tokens.
#include <whale/whale.hpp>
#include <whale/detail/parse.hpp>
#include <whale/models/gpt.hpp>

#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>

using namespace whale;

int main(int argc, char** argv) {
  // 1. Start: MPI and the mesh (--mesh; default: every rank on `data`); --profile is a plan option.
  auto ctx = context::init(argc, argv);
  return ctx.guard([&] {
    plan_options o = plan_options::from_args(argc, argv);  // --profile PATH (or WHALE_PROFILE; none: measured and cached), ...
    run_flags flags(10);
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (flags.take(i, argc, argv)) continue;
      if (a == "--memory-mib" && i + 1 < argc) o.memory_limit_mib = detail::parse_double(argv[++i], "--memory-mib", 0, 1e9);
      else if (a == "--plan-tie" && i + 1 < argc) o.plan_tie = detail::parse_double(argv[++i], "--plan-tie", 0, 1);  // 1 itself: the library's error
      else throw std::invalid_argument("example_12: unknown argument " + a + " (have " + std::string(run_flags::names) + ", --profile, --memory-mib, --plan-tie, --mesh)");
    }

    // 2. What the planner prices: the global batch (B, T) and, with --memory-mib, a cap per rank.
    o.plan_batch = models::gpt_global_batch;  // 16 sequences
    o.plan_seq = models::gpt_seq;             // of 128 tokens

    // 3. The plan is auto_plan<gpt>: every candidate is a plan type compiled here, chosen at run time.
    auto net = make<auto_plan<models::gpt>>(ctx, seed{42}, o);
    if (ctx.rank() == 0) std::cout << net;  // the choice, the runners-up, then the plan that runs

    // 4. Train as any plan: the trainer does not know which one was chosen.
    auto data = models::gpt_data(seed{7});  // (B, T) tokens per step, whatever the plan
    trainer t(net, adamw{.lr = 1e-3f}, flags.options());
    const auto r = flags.run(t, data);
    if (ctx.rank() == 0)
      std::printf("auto_plan chose %s (predicted %.3f s per step); measured: loss %.4f -> %.4f, median step %.3f s\n",
                  net.choice().label.c_str(), net.choice().step_s, r.loss_first(), r.loss_last(), r.median_step_s());
    return 0;
  });
}
