// Compile-fail pair: make<P> of a layer that does not end in a loss (not a
// whale::Strategy) is refused with a sentence, not an error deep in the executor.
// expect-error: whale::make<P>: P is not a plan
#include "whale/comm/context.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/runtime/make.hpp"

using namespace whale;
#if WHALE_FAIL
using plan = replicate<sequential<linear<8, 16>, relu>>;
#else
using plan = replicate<sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>>;
#endif
static_assert(!Strategy<linear<8, 4>> && Strategy<sequential<linear<8, 4>, softmax_cross_entropy>>);

int main() {
  auto build = [](const context& ctx) { return make<plan>(ctx, seed{1}); };  // instantiated, not run
  (void)build;
  return 0;
}
