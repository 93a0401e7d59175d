// Compile-fail pair: a type without get(step, begin, count) is not a data
// source; the error names the member it needs.
// expect-error: a data source needs `batch_view<input_type> get\(std::int64_t step
#include "whale/nn/network.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

struct rows {
  using input_type = float;
  teacher_data inner{seed{2}, 8, 4, 2};
  index_t global_batch() const { return 2; }
  index_t seq() const { return 1; }
#if !WHALE_FAIL
  batch_view<float> get(std::int64_t s, index_t b, index_t n) { return inner.get(s, b, n); }
#endif
};

int main() {
  network<sequential<linear<8, 16>, relu, linear<16, 4>, softmax_cross_entropy>> net(seed{1});
  trainer t(net, sgd{.lr = 0.1f});
  rows data;
  auto train = [&] { t.run(data, steps{1}); };  // instantiated, not run
  (void)train;
  return 0;
}
