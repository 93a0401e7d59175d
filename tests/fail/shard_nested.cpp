// Compile-fail pair: a shard<...> inside a sharded model (shard is one
// whole-model strategy over the one data axis).
// expect-error: whale::shard: shard<shard<M>> is not meaningful \(there is one data axis\), nor is a shard<...> inside the sharded model
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/shard.hpp"

using namespace whale;
using head = sequential<linear<16, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = shard<sequential<linear<8, 16>, relu, shard<head>>>;
#else
using plan = shard<sequential<linear<8, 16>, relu, head>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
