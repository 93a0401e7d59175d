// Compile-fail pair: a pipeline as one part of a model would run as a plain
// sequential without its stages; a pipeline must be the whole model.
// expect-error: whale::make: the plan holds a pipeline<...> below its top
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
#if WHALE_FAIL
using plan = sequential<linear<8, 8>, pipeline<one_f_one_b, stage<linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>>;
#else
using plan = pipeline<one_f_one_b, stage<linear<8, 8>, linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>;
#endif

int main() {
  auto build = [](const context& ctx) { return make<plan>(ctx, seed{1}); };  // instantiated, not run
  (void)build;
  return 0;
}
