// One program for the failure tests; argv[1] picks what goes wrong:
//   throw           rank 1 throws inside run_guarded while rank 0 waits in an all_reduce
//   terminate       rank 1's exception escapes main (the terminate handler reports it)
//   watchdog        rank 1 skips an all_reduce on the world (WHALE_WATCHDOG_S is short)
//   watchdog_model  rank 3 skips an all_reduce on its model group (--mesh data=2,model=2)
//   mesh            nothing: run with a --mesh that does not fit the world
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

#include "whale/comm/context.hpp"

using namespace whale;

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
