// Compile-fail pair: a data source of token ids fed to a model whose first
// layer takes float features is refused with a sentence naming the mismatch,
// not "cannot convert view<const int> to view<const float>" deep in the trainer.
// expect-error: the model's first layer takes features \(float\), but the data source's input_type is not float
#include "whale/models/mlp.hpp"
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

int main() {
  network<sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>> net(seed{1});
  trainer t(net, sgd{.lr = 0.1f});
#if WHALE_FAIL
  auto data = markov_data(seed{2}, 8, 4, 2);
#else
  auto data = teacher_data(seed{2}, 8, 4, 2);
#endif
  auto train = [&] { t.run(data, steps{1}); };  // instantiated, not run
  (void)train;
  return 0;
}
