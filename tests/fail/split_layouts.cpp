// Compile-fail pair: inside a data-axis split region a batch-split activation
// cannot feed a forced row-parallel linear (split<0> -> split<1> would need an
// all-to-all); the error names both layers and both layouts.
// expect-error: show_conflicting_layouts<whale::relu, whale::row_tag<whale::linear<8, 4> ?>, whale::axis::data, whale::layout_kind::S0, whale::layout_kind::S1>.*no collective converts
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using region = split<sequential<relu, row<linear<8, 4>>, softmax_cross_entropy>, axis::data>;
#else
using region = split<sequential<relu, column<linear<8, 4>>, softmax_cross_entropy>, axis::data>;
#endif

int main() { return region::cost().params > 0 ? 0 : 1; }
