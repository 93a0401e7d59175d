// Compile-fail pair: split<stage<...>> outside a pipeline would train as a
// plain sequential; the split belongs inside the stage.
// expect-error: whale::split<stage<...>>: the region is or holds a stage<...>
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using plan = sequential<linear<8, 16>, split<stage<linear<16, 4>, softmax_cross_entropy>>>;
#else
using plan = pipeline<one_f_one_b, stage<linear<8, 16>>, stage<split<sequential<linear<16, 4>, softmax_cross_entropy>>>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
