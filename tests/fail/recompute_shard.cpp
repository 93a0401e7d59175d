// Compile-fail pair: recompute<shard<M>> (a whole-model strategy cannot be
// recomputed); the blocks inside a sharded model can.
// expect-error: whale::recompute<shard<...>> / recompute<pipeline<...>>: shard and pipeline are whole-model strategies
#include "whale/nn/linear.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/shard.hpp"

using namespace whale;
using head = sequential<linear<16, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = recompute<shard<head>>;
#else
using plan = shard<sequential<recompute<sequential<linear<8, 16>, relu>>, head>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
