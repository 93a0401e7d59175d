// Compile-fail pair: ZeRO 2-3 map each layer's gradients into one contiguous
// stage range, but an interleaved pipe rank holds V separate chunks.
// expect-error: an interleaved pipe rank holds V separate chunks; use ZeRO-1 or 1f1b
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
using pipe_plan = pipeline<interleaved_1f1b<2>, stage<linear<8, 16>, relu>, stage<linear<16, 16>, relu>,
                           stage<linear<16, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>;
#if WHALE_FAIL
using plan = shard<pipe_plan, 2>;
#else
using plan = shard<pipe_plan, 1>;
#endif

int main() {
  auto build = [](const context& ctx) { return make<plan>(ctx, seed{1}); };  // instantiated, not run
  (void)build;
  return 0;
}
