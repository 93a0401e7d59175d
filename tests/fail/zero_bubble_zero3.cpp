// Compile-fail pair: ZeRO 2-3 reduce-scatter each layer's gradients right after
// its backward, but zb_h1 computes the weight gradients later, in W passes.
// expect-error: a schedule that splits the backward computes the weight gradients in later W passes
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
using pipe_plan = pipeline<zb_h1, stage<linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>;
#if WHALE_FAIL
using plan = shard<pipe_plan, 3>;
#else
using plan = shard<pipe_plan, 1>;
#endif

int main() {
  auto build = [](const context& ctx) { return make<plan>(ctx, seed{1}); };  // instantiated, not run
  (void)build;
  return 0;
}
