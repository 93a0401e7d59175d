// Compile-fail pair: a shard<...> in a pipeline stage would train without the
// ZeRO partitioning (make checks what a pipeline cannot).
// expect-error: whale::make: the plan holds a shard<...> below its top
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
using head = sequential<linear<16, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = pipeline<one_f_one_b, stage<linear<8, 16>, relu>, stage<shard<head>>>;
#else
using plan = pipeline<one_f_one_b, stage<linear<8, 16>, relu>, stage<head>>;
#endif

int main() {
  auto build = [](const context& ctx) { return make<plan>(ctx, seed{1}); };  // instantiated, not run
  (void)build;
  return 0;
}
