// Compile-fail pair: split<shard<M>> would train the split region and drop the
// ZeRO partitioning (shard does not compose with split yet).
// expect-error: whale::split<shard<M>>: the region is or holds a shard<...>
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
using model = sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = split<shard<model>>;
#else
using plan = split<model>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
