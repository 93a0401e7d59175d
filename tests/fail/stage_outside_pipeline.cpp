// Compile-fail pair: a stage<...> used outside a pipeline (here, in a sequential).
// expect-error: whale::stage: a stage may only be a direct element of whale::pipeline
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/strategy/pipeline.hpp"

using namespace whale;
#if WHALE_FAIL
using model = sequential<stage<linear<16, 32>, relu>, stage<linear<32, 4>, softmax_cross_entropy>>;
#else
using model = sequential<sequential<linear<16, 32>, relu>, sequential<linear<32, 4>, softmax_cross_entropy>>;
#endif

int main() {
  network<model> net(seed{1});
  return net.param_count() > 0 ? 0 : 1;
}
