// Compile-fail pair: pipeline<S, M, stages<N>> with more stages than a repeat
// of 2 blocks can fill (inner stages need a block each).
// expect-error: more stages than the repeat's blocks
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/pipeline.hpp"

using namespace whale;
using model = sequential<linear<8, 16>, repeat<2, sequential<linear<16, 16>, relu>>, linear<16, 4>, softmax_cross_entropy>;
#if WHALE_FAIL
using plan = pipeline<one_f_one_b, model, stages<5>>;
#else
using plan = pipeline<one_f_one_b, model, stages<4>>;
#endif

int main() { return plan::name().empty() || plan::fixed_stages != 4 ? 1 : 0; }
