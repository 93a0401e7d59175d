// Compile-fail pair: recompute<...> inside a split region would run its layers
// unsplit (over the data axis, summing their whole gradients again); the
// region is recomputed as a whole instead.
// expect-error: whale::split: recompute<...> inside a split region is not supported
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using region = split<sequential<linear<8, 16>, relu, recompute<layer_norm<16>>, linear<16, 8>>, axis::data>;
#else
using region = recompute<split<sequential<linear<8, 16>, relu, layer_norm<16>, linear<16, 8>>, axis::data>>;
#endif
using plan = sequential<region, linear<8, 4>, softmax_cross_entropy>;

int main() { return plan::name().empty() ? 1 : 0; }
