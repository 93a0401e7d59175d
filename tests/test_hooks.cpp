// Layer hooks: called around every leaf layer, in order, with its flat
// parameter range; rebinding a leaf moves its parameters to other storage.
#include <doctest/doctest.h>

#include <vector>

#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/residual.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/train/data.hpp"

using namespace whale;

namespace {
struct recorder : layer_hooks {
  std::vector<std::pair<char, index_t>> events;  // ('f'|'F'|'b'|'B', offset)
  void before_forward(const leaf_ref& r) override { events.push_back({'f', r.offset}); }
  void after_forward(const leaf_ref& r) override { events.push_back({'F', r.offset}); }
  void before_backward(const leaf_ref& r) override { events.push_back({'b', r.offset}); }
  void after_backward(const leaf_ref& r) override { events.push_back({'B', r.offset}); }
};
using model = sequential<linear<4, 8>, relu, repeat<2, residual<linear<8, 8>>>, linear<8, 3>, softmax_cross_entropy>;
}  // namespace

TEST_CASE("hooks see every leaf in forward order, then in reverse in backward") {
  network<model> net(seed{1});
  teacher_data data(seed{2}, 4, 3, 5);
  auto b = data.get(0, 0, 5);
  recorder rec;
  step_ctx c;
  c.batch = 5;
  c.global_rows = 5;
  c.hooks = &rec;
  net.train_step(c, b.inputs, b.labels);
  // leaves: linear(0), relu(40), linear(40), linear(112), linear(184), loss(211)
  const std::vector<index_t> fwd = {0, 40, 40, 112, 184, 211};
  REQUIRE(rec.events.size() == 4 * fwd.size());
  for (std::size_t i = 0; i < fwd.size(); ++i) {
    CHECK(rec.events[2 * i] == std::pair<char, index_t>{'f', fwd[i]});
    CHECK(rec.events[2 * i + 1] == std::pair<char, index_t>{'F', fwd[i]});
  }
  for (std::size_t i = 0; i < fwd.size(); ++i) {
    const auto k = 2 * fwd.size() + 2 * i;
    CHECK(rec.events[k] == std::pair<char, index_t>{'b', fwd[fwd.size() - 1 - i]});
    CHECK(rec.events[k + 1] == std::pair<char, index_t>{'B', fwd[fwd.size() - 1 - i]});
  }
}

TEST_CASE("rebinding a leaf points it at other storage with the same results") {
  network<model> a(seed{1});
  network<model> b(seed{1});
  // move every leaf of b to a private copy of its parameters, then train both
  struct mover : layer_hooks {
    std::vector<std::vector<float>> p, g;
    network<model>* net;
    void before_forward(const leaf_ref& r) override {
      if (r.count == 0) return;
      p.emplace_back(net->params().data() + r.offset, net->params().data() + r.offset + r.count);
      g.emplace_back(static_cast<std::size_t>(r.count));
      r.rebind(p.back().data(), g.back().data());
    }
  } m;
  m.net = &b;
  m.p.reserve(16);
  m.g.reserve(16);
  teacher_data data(seed{2}, 4, 3, 5);
  auto batch = data.get(0, 0, 5);
  step_ctx c1, c2;
  c1.batch = c2.batch = 5;
  c1.global_rows = c2.global_rows = 5;
  c2.hooks = &m;
  const double la = a.train_step(c1, batch.inputs, batch.labels);
  const double lb = b.train_step(c2, batch.inputs, batch.labels);
  CHECK(la == lb);
  // gradients of b went to the private buffers: compare with a's
  std::size_t k = 0;
  for (index_t off : {0, 40, 112, 184}) {
    const auto n = static_cast<index_t>(m.g[k].size());
    for (index_t i = 0; i < n; ++i) CHECK(m.g[k][static_cast<std::size_t>(i)] == a.grads()[off + i]);
    ++k;
  }
}
