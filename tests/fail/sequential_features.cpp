// Compile-fail pair: neighbouring layers whose feature sizes disagree.
// expect-error: feature_mismatch<whale::linear<512, 2048>, whale::linear<1024, 10>, 2048, 1024>.*in_features must equal the out_features of the layer before it
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"

using namespace whale;
#if WHALE_FAIL
using model = sequential<linear<512, 2048>, relu, linear<1024, 10>, softmax_cross_entropy>;
#else
using model = sequential<linear<512, 2048>, relu, linear<2048, 10>, softmax_cross_entropy>;
#endif

int main() {
  network<model> net(seed{1});
  return net.param_count() > 0 ? 0 : 1;
}
