// Compile-fail pair: a replicate inside a split region is no strategy there;
// replicate<split<M>> is split<M> (data parallel outside the region) and compiles.
// expect-error: whale::split<replicate<M>>: the region is or holds a replicate<...>
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using plan = split<sequential<replicate<linear<8, 16>>, relu, linear<16, 4>, softmax_cross_entropy>>;
#else
using plan = replicate<split<sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
