// Compile-fail pair: a split region around a pipeline would train it as one
// sequential without its stages; splitting inside a stage is 3-D parallelism.
// expect-error: whale::split<pipeline<...>>: the region is or holds a pipeline<...>
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using plan = split<pipeline<one_f_one_b, stage<linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>>;
#else
using plan = pipeline<one_f_one_b, stage<split<sequential<linear<8, 16>, relu>>>, stage<linear<16, 4>, softmax_cross_entropy>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
