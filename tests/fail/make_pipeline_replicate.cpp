// Compile-fail pair: a replicate<...> inside a pipeline stage is ignored by the
// pipeline; replicate<pipeline<...>> (data × pipe) compiles.
// expect-error: whale::make: the plan has a replicate<...> inside a pipeline
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
using body = sequential<linear<8, 16>, relu>;
#if WHALE_FAIL
using plan = pipeline<one_f_one_b, stage<replicate<body>>, stage<linear<16, 4>, softmax_cross_entropy>>;
#else
using plan = replicate<pipeline<one_f_one_b, stage<body>, stage<linear<16, 4>, softmax_cross_entropy>>>;
#endif

int main() {
  auto build = [](const context& ctx) { return make<plan>(ctx, seed{1}); };  // instantiated, not run
  (void)build;
  return 0;
}
