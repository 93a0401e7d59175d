// Compile-fail pair: float targets fed to a model that ends in
// softmax_cross_entropy are refused with a sentence naming the mismatch (class
// labels compile): floats are never read as class ids.
// expect-error: the model's loss \(softmax_cross_entropy\) takes std::int32_t class labels, but the data source gives float targets
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

int main() {
  network<sequential<linear<8, 4>, softmax_cross_entropy>> net(seed{1});
  trainer t(net, sgd{.lr = 0.1f});
  tensor<float> x({4, 8});
#if WHALE_FAIL
  tensor<float> y({4, 1});  // real-valued targets
#else
  tensor<std::int32_t> y({4});
#endif
  auto data = tensor_data(std::move(x), std::move(y), 4);
  auto train = [&] { t.run(data, steps{1}); };  // instantiated, not run
  (void)train;
  return 0;
}
