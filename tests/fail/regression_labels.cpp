// Compile-fail pair: int32 class labels fed to a model that ends in a
// regression loss are refused with a sentence naming the mismatch (and float
// targets compile), not a view conversion error deep in the trainer.
// expect-error: the model's loss \(mse_loss, l1_loss, huber_loss\) takes float targets, but the data source gives std::int32_t class labels
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/regression_loss.hpp"
#include "whale/nn/relu.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

int main() {
  network<sequential<linear<8, 16>, relu, linear<16, 2>, mse_loss>> net(seed{1});
  trainer t(net, sgd{.lr = 0.1f});
#if WHALE_FAIL
  auto data = teacher_data(seed{2}, 8, 2, 4);  // class labels
#else
  tensor<float> x({4, 8}), y({4, 2});
  auto data = tensor_data(std::move(x), std::move(y), 4);
#endif
  auto train = [&] { t.run(data, steps{1}); };  // instantiated, not run
  (void)train;
  return 0;
}
