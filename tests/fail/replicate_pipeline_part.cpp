// Compile-fail pair: a pipeline as one part of a replicated model would run as a
// plain sequential; replicate<pipeline<...>> (data × pipe) compiles.
// expect-error: whale::replicate: the wrapped model holds a pipeline<...> as a part
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"

using namespace whale;
using two_stages = pipeline<one_f_one_b, stage<linear<8, 16>, relu>, stage<linear<16, 4>, softmax_cross_entropy>>;
#if WHALE_FAIL
using plan = replicate<sequential<linear<8, 8>, two_stages>>;
#else
using plan = replicate<two_stages>;
#endif

int main() { return plan::name().empty() ? 1 : 0; }
