// Compile-fail pair: replicate<shard<M>> would train plain data parallelism and
// drop the ZeRO partitioning; shard<replicate<M>> (the same plan as shard<M>) compiles.
// expect-error: whale::replicate<shard<M>>: the wrapped model is or holds a shard<...>, which replicate would train as plain data parallelism
#include "whale/nn/linear.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/shard.hpp"

using namespace whale;
using model = sequential<linear<8, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = replicate<shard<model>>;
#else
using plan = shard<replicate<model>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
