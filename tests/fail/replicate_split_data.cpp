// Compile-fail pair: a replicate around a model that splits a region over the
// data axis (that region's parameters are split over the axis, not replicated);
// the xc plan replicates only the backbone.
// expect-error: whale::replicate<split<M, axis::data>>: the wrapped model splits a region over the data axis
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
using backbone = sequential<linear<8, 16>, relu>;
using classifier = sequential<linear<16, 40>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = replicate<sequential<backbone, split<classifier, axis::data>>>;
#else
using plan = sequential<replicate<backbone>, split<classifier, axis::data>>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
