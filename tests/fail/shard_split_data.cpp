// Compile-fail pair: ZeRO over the data axis of a model whose region is split
// over that same axis (each data rank holds other shards: nothing to partition).
// expect-error: whale::shard: the model splits a region over the data axis
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
using backbone = sequential<linear<8, 16>, relu>;
using classifier = sequential<linear<16, 40>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = shard<sequential<backbone, split<classifier, axis::data>>, 1>;
#else
using plan = shard<sequential<backbone, split<classifier, axis::model>>, 1>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
