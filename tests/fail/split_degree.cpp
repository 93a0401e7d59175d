// Compile-fail pair: a static split degree that does not divide the layer it
// shards (30 output features over 4 ranks).
// expect-error: split_degree_check<whale::column_linear<8, 30, whale::axis::model, whale::bias_mode::added>, 30, 4>.*split degree must divide
#include "whale/nn/linear.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/strategy/split.hpp"

using namespace whale;
#if WHALE_FAIL
using region = split<sequential<linear<8, 30>, relu, linear<30, 8>>, axis::model, 4>;
#else
using region = split<sequential<linear<8, 32>, relu, linear<32, 8>>, axis::model, 4>;
#endif

int main() {
  region r;
  return r.cost().params > 0 ? 0 : 1;
}
