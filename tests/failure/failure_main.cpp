// One program for the failure tests; argv[1] picks what goes wrong:
//   throw           rank 1 throws inside run_guarded while rank 0 waits in an all_reduce
//   terminate       rank 1's exception escapes main (the terminate handler reports it)
//   watchdog        rank 1 skips an all_reduce on the world (WHALE_WATCHDOG_S is short)
//   watchdog_model  rank 3 skips an all_reduce on its model group (--mesh data=2,model=2)
//   mesh            nothing: run with a --mesh that does not fit the world
//   nan_input       replicate<mlp> on 2 ranks; one input of rank 1's rows at step 4 is NaN
//                   (the loss stays finite, the gradient norm does not)
//   check_finite    the same with --check-finite: rank 1 names the layer whose output is NaN
//   unwind          rank 1 throws while a second context is alive; main catches and prints
//                   the message, and the job still ends (the context cannot finalize)
//   trace_path      replicate<mlp> with a trace file in a directory that does not exist:
//                   refused on every rank before any step
//   disagree_micro  rank 1 makes the plan with micro_batches 4, rank 0 with 2 (as if launched with other flags)
//   disagree_mesh   rank 1 on the mesh data=1,pipe=2, rank 0 on data=2
//   killed          rank 1 kills itself (SIGKILL) before an all_reduce (mpirun may name it first)
//   frozen          rank 1 stops itself (SIGSTOP) before an all_reduce; rank 0 names it by its heartbeat
//   wsp_stall       Wave Synchronous Parallel (D = 0) on 2 ranks; rank 1 stalls before its
//                   third step: rank 0, polling the clocks, is stopped by the watchdog, naming the waves
//   memory          replicate<mlp> on a batch of 4096 under WHALE_MEMORY_LIMIT_MIB (the test sets it):
//                   refused before the parameters, or before the first step's activations
//   interrupt       replicate<mlp> trains on; after step 3 rank 0 sends SIGINT to mpirun (its parent), as
//                   Ctrl-C does; mpirun passes SIGTERM to every rank, and each ends at once, rank 0 with one line
#include <csignal>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

#include <unistd.h>

#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/trainer.hpp"
#include "whale/train/wsp_trainer.hpp"

using namespace whale;

namespace {
// teacher_data whose sample 5 of data step 3 (the 4th step) has a NaN input feature
struct poisoned_data {
  using input_type = float;
  teacher_data inner{seed{7}, 8, 4, 8};
  tensor<float> copy;
  index_t global_batch() const noexcept { return inner.global_batch(); }
  index_t seq() const noexcept { return 1; }
  batch_view<float> get(std::int64_t step, index_t begin, index_t count) {
    auto b = inner.get(step, begin, count);
    copy = tensor<float>({count, 8});
    std::copy(b.inputs.data(), b.inputs.data() + count * 8, copy.data());
    if (step == 3 && begin <= 5 && 5 < begin + count) copy[(5 - begin) * 8 + 2] = std::nanf("");
    return {copy.v(), b.labels, b.sequences, b.seq};
  }
};
using mlp = sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>;
}  // namespace

int main(int argc, char** argv) {
  auto ctx = context::init(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  auto& w = ctx.world();
  tensor<float> x(shape{4});
  auto stall = [] { std::this_thread::sleep_for(std::chrono::seconds(60)); };
  if (mode == "throw") {
    run_guarded(ctx, [&] {
      barrier(w);
      if (ctx.rank() == 1) throw std::runtime_error("injected failure at step 3");
      all_reduce(w, x);
    });
  } else if (mode == "terminate") {
    barrier(w);
    if (ctx.rank() == 1) throw std::runtime_error("uncaught failure at step 5");
    all_reduce(w, x);
  } else if (mode == "nan_input" || mode == "check_finite") {
    run_guarded(ctx, [&] {
      plan_options o;
      o.check_finite = mode == "check_finite";
      auto net = make<replicate<mlp>>(ctx, seed{1}, o);
      poisoned_data data;
      trainer_options to;
      to.progress = false;
      trainer(net, sgd{.lr = 0.1f}, to).run(data, steps{6});
    });
  } else if (mode == "memory") {
    run_guarded(ctx, [&] {
      auto net = make<replicate<mlp>>(ctx, seed{1});
      std::printf("whale failure test: rank %d allocated the parameters\n", ctx.rank());
      std::fflush(stdout);
      teacher_data data(seed{7}, 8, 4, 4096);
      trainer_options to;
      to.progress = false;
      trainer(net, sgd{.lr = 0.1f}, to).run(data, steps{2});
      std::printf("whale failure test: rank %d trained; it should not have\n", ctx.rank());
    });
  } else if (mode == "interrupt") {
    run_guarded(ctx, [&] {
      auto net = make<replicate<mlp>>(ctx, seed{1});
      teacher_data data(seed{7}, 8, 4, 64);
      trainer_options to;
      to.progress = false;
      to.on_step = [&](const step_report& r) {
        if (r.step == 3 && ctx.rank() == 0) ::kill(::getppid(), SIGINT);
      };
      trainer(net, sgd{.lr = 0.01f}, to).run(data, steps{100000000});
      std::printf("whale failure test: rank %d trained to the end; it should have been interrupted\n", ctx.rank());
    });
  } else if (mode == "unwind") {
    try {
      auto inner = context::init();
      barrier(w);
      if (ctx.rank() == 1) throw std::runtime_error("injected failure while a context unwinds");
      all_reduce(w, x);
    } catch (const std::exception& e) {
      std::printf("whale failure test: rank %d caught: %s\n", ctx.rank(), e.what());
      std::fflush(stdout);
      stall();
    }
  } else if (mode == "trace_path") {
    run_guarded(ctx, [&] {
      plan_options o;
      o.trace_path = "/nonexistent-whale-dir/trace.json";
      auto net = make<replicate<mlp>>(ctx, seed{1}, o);
      std::printf("whale failure test: rank %d built the plan; it should not have\n", ctx.rank());
    });
  } else if (mode == "disagree_micro" || mode == "disagree_mesh") {
    // as if rank 1 were launched with other flags: --micro-batches 4, or --mesh data=1,pipe=2
    run_guarded(ctx, [&] {
      plan_options o;
      o.micro_batches = mode == "disagree_micro" && ctx.rank() == 1 ? 4 : 2;
      if (mode == "disagree_micro") {
        auto net = make<replicate<mlp>>(ctx, seed{1}, o);
      } else {
        auto c = ctx.with_mesh(ctx.rank() == 1 ? "data=1,pipe=2" : "data=2");  // (its unwinding prints a line of its own)
        auto net = make<replicate<mlp>>(c, seed{1}, o);
      }
      std::printf("whale failure test: rank %d built the plan; it should not have\n", ctx.rank());
    });
  } else if (mode == "killed") {  // rank 1 is killed (SIGKILL) before the all-reduce
    barrier(w);
    if (ctx.rank() == 1) ::raise(SIGKILL);
    all_reduce(w, x);
  } else if (mode == "frozen") {  // rank 1 stops (SIGSTOP) before the all-reduce: its heartbeat stops too
    barrier(w);
    if (ctx.rank() == 1) ::raise(SIGSTOP);
    all_reduce(w, x);
  } else if (mode == "wsp_stall") {
    auto net = make<replicate<mlp>>(ctx, seed{1});
    teacher_data data(seed{7}, 8, 4, 8);
    wsp_trainer t(ctx, net, sgd{.lr = 0.1f}, wsp_options{.staleness = 0, .wave = 1});
    for (int s = 0; s < 5; ++s) {
      if (s == 2 && ctx.rank() == 1) stall();
      t.step(data, s);
    }
    t.finish();
  } else if (mode == "watchdog") {
    barrier(w);
    if (ctx.rank() == 1) stall();
    all_reduce(w, x);
  } else if (mode == "watchdog_model") {
    auto& model = ctx.mesh().comm(axis::model);
    barrier(model);
    if (ctx.rank() == 3) stall();
    all_reduce(model, x);
  }
  std::printf("whale failure test: rank %d finished mode '%s'\n", ctx.rank(), mode.c_str());
  return 0;
}
