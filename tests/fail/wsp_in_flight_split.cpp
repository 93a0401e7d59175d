// Compile-fail pair: minibatches in flight (wsp_options::in_flight) hand over
// each minibatch's gradients when its backward ends on a rank; zb_h1 computes
// the weight gradients later, in W passes, so there is no such moment.
// expect-error: interleaved and split-backward schedules spread that over several passes
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
#if WHALE_FAIL
using sched = zb_h1;
#else
using sched = one_f_one_b;
#endif
using plan = replicate<pipeline<sched, stage<linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>>;

int main() {
  auto build = [](const context& ctx) {  // instantiated, not run
    auto net = make<plan>(ctx, seed{1});
    step_ctx c;
    c.batch = 2;
    net.in_flight_step(c, {}, {}, 2, [](int) {});  // what wsp_trainer::wave runs
  };
  (void)build;
  return 0;
}
