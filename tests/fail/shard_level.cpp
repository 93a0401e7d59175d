// Compile-fail pair: a ZeRO level outside 1..3.
// expect-error: whale::shard<M, Level>: Level must be 1 \(optimizer state partitioned\), 2 \(plus gradients\) or 3
#include "whale/nn/linear.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/shard.hpp"

using namespace whale;
using model = sequential<linear<8, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = shard<model, 4>;
#else
using plan = shard<model, 2>;
#endif

int main() { return plan::level == 2 ? 0 : 1; }
