// Compile-fail pair: a split over the model axis of a region with nothing to
// split (a LayerNorm works on whole rows): it would run as replication.
// expect-error: whale::split<M>: M holds nothing the model axis can split
#include "whale/nn/layer_norm.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using region = split<sequential<layer_norm<128>, relu>>;
#else
using region = split<sequential<layer_norm<128>, linear<128, 128>, relu>>;
#endif

int main() { return region::name().empty() ? 1 : 0; }
