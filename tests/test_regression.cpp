// The regression losses (mse_loss, l1_loss, huber_loss) and float targets:
// each loss's value and gradient against a plain double-precision reference
// (Huber on both sides of delta, l1 at a zero difference), the mean over the
// global batch's elements, central differences, the bf16 and guarded-backend
// paths, float targets through tensor_data and the trainer, and the errors a
// wrong combination gets. Plans against single-process training: mpi_regression.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/network.hpp"
#include "whale/nn/regression_loss.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
constexpr index_t R = 6, C = 3;

/// Predictions and targets with negative values, a zero difference at (0, 0),
/// differences just inside and outside 1 and 0.5 (Huber's two sides).
void fill(std::vector<float>& z, std::vector<float>& y) {
  z.resize(R * C), y.resize(R * C);
  for (index_t i = 0; i < R * C; ++i) {
    z[static_cast<std::size_t>(i)] = 0.37f * static_cast<float>(i % 7) - 1.1f;
    y[static_cast<std::size_t>(i)] = -0.6f * static_cast<float>((i * 5) % 4) + 0.9f;
  }
  z[0] = y[0] = -0.75f;                  // d = 0
  z[1] = y[1] + 0.9f, z[2] = y[2] - 1.2f;  // |d| 0.9 and 1.2 around delta 1
  z[3] = y[3] + 0.4f, z[4] = y[4] - 0.6f;  // |d| 0.4 and 0.6 around delta 0.5
}

/// The reference in double: the loss of one element and its derivative.
struct ref_fn {
  std::function<double(double)> value, slope;
};
ref_fn mse_ref() { return {[](double d) { return d * d; }, [](double d) { return 2 * d; }}; }
ref_fn l1_ref() {
  return {[](double d) { return std::abs(d); }, [](double d) { return d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0; }};
}
ref_fn huber_ref(double delta) {
  return {[delta](double d) { return std::abs(d) < delta ? 0.5 * d * d : delta * (std::abs(d) - 0.5 * delta); },
          [delta](double d) { return std::abs(d) <= delta ? d : (d > 0 ? delta : -delta); }};
}

/// Loss L on (R, C) predictions of a global batch of `global` rows: its share
/// and gradient against the reference, on backend `be`.
template <class L> void check_loss(const ref_fn& f, index_t global, const backend_ref& be = {}) {
  std::vector<float> z, y;
  fill(z, y);
  L loss;
  step_ctx c;
  c.be = be;
  c.batch = R;
  c.global_rows = global;
  const double share = loss.forward_loss(c, cview<float>(z.data(), {R, C}), cview<float>(y.data(), {R, C}));
  const auto g = loss.backward_loss(c);
  const double n = static_cast<double>(global * C);  // every target element of the global batch
  double want = 0;
  for (index_t i = 0; i < R * C; ++i) want += f.value(static_cast<double>(z[static_cast<std::size_t>(i)]) - y[static_cast<std::size_t>(i)]);
  want /= n;
  INFO(layer_name<L>() << ", global rows " << global);
  CHECK(share == doctest::Approx(want).epsilon(1e-6));
  REQUIRE(g.numel() == R * C);
  for (index_t i = 0; i < R * C; ++i) {
    const double d = static_cast<double>(z[static_cast<std::size_t>(i)]) - y[static_cast<std::size_t>(i)];
    INFO("element " << i << ", difference " << d);
    CHECK(g[i] == doctest::Approx(f.slope(d) / n).epsilon(1e-5));
  }
}

/// Central differences of L's share by each prediction (step h) against its
/// backward, away from the kinks (|d| = 0 for l1, |d| = delta for huber).
template <class L> double fd_error(double h = 1e-3) {
  std::vector<float> z, y;
  fill(z, y);
  for (index_t i = 0; i < R * C; ++i) z[static_cast<std::size_t>(i)] += 0.05f;  // no difference at 0 or at a delta
  L loss;
  step_ctx c;
  c.batch = R;
  c.global_rows = R;
  auto share = [&] { return loss.forward_loss(c, cview<float>(z.data(), {R, C}), cview<float>(y.data(), {R, C})); };
  share();
  std::vector<double> an;
  for (index_t i = 0; i < R * C; ++i) an.push_back(loss.backward_loss(c)[i]);
  double worst = 0, largest = 0;
  for (index_t i = 0; i < R * C; ++i) {
    float& v = z[static_cast<std::size_t>(i)];
    const float keep = v;
    v = static_cast<float>(keep + h);
    const double up = share();
    v = static_cast<float>(keep - h);
    const double down = share();
    v = keep;
    const double fd = (up - down) / (2 * h);
    worst = std::max(worst, std::abs(fd - an[static_cast<std::size_t>(i)]));
    largest = std::max(largest, std::abs(an[static_cast<std::size_t>(i)]));
  }
  return worst / largest;
}
}  // namespace

TEST_CASE("mse, l1 and huber: value and gradient against a double reference, the mean over every target element") {
  for (const index_t global : {R, 4 * R}) {  // this rank's rows alone, or a quarter of the global batch
    check_loss<mse_loss>(mse_ref(), global);
    check_loss<l1_loss>(l1_ref(), global);
    check_loss<huber_loss<>>(huber_ref(1.0), global);
    check_loss<huber_loss<0.5f>>(huber_ref(0.5), global);
  }
}

TEST_CASE("edge cases: l1's gradient at a zero difference is 0; huber on both sides of delta; huber<Delta> at the kink") {
  std::vector<float> z, y;
  fill(z, y);
  step_ctx c;
  c.batch = R;
  c.global_rows = R;
  const cview<float> zv(z.data(), {R, C}), yv(y.data(), {R, C});
  const double n = R * C;
  l1_loss l1;
  l1.forward_loss(c, zv, yv);
  CHECK(l1.backward_loss(c)[0] == 0.f);  // sign(0) = 0, as PyTorch
  huber_loss<> h;
  h.forward_loss(c, zv, yv);
  const auto g = h.backward_loss(c);
  CHECK(g[1] == doctest::Approx(0.9 / n).epsilon(1e-5));   // inside: d
  CHECK(g[2] == doctest::Approx(-1.0 / n).epsilon(1e-5));  // outside: delta sign(d)
  huber_loss<0.5f> h5;
  h5.forward_loss(c, zv, yv);
  const auto g5 = h5.backward_loss(c);
  CHECK(g5[3] == doctest::Approx(0.4 / n).epsilon(1e-4));
  CHECK(g5[4] == doctest::Approx(-0.5 / n).epsilon(1e-5));
  // at |d| = delta exactly both pieces give delta^2 / 2 and slope delta
  std::vector<float> zk{1.5f, -2.f}, yk{0.5f, -1.f};
  huber_loss<> hk;
  step_ctx k;
  k.batch = 1;
  k.global_rows = 1;
  CHECK(hk.forward_loss(k, cview<float>(zk.data(), {1, 2}), cview<float>(yk.data(), {1, 2})) == doctest::Approx(0.5));
  CHECK(hk.backward_loss(k)[0] == doctest::Approx(0.5));
  CHECK(hk.backward_loss(k)[1] == doctest::Approx(-0.5));
  // mse of a row of zero differences is 0 with a zero gradient
  mse_loss m;
  CHECK(m.forward_loss(k, cview<float>(yk.data(), {1, 2}), cview<float>(yk.data(), {1, 2})) == 0.0);
  CHECK(m.backward_loss(k)[0] == 0.f);
}

TEST_CASE("central differences of each loss's value match its gradient (away from the kinks)") {
  CHECK(fd_error<mse_loss>() < 1e-2);
  CHECK(fd_error<l1_loss>() < 1e-2);
  CHECK(fd_error<huber_loss<>>() < 1e-2);
  CHECK(fd_error<huber_loss<0.5f>>() < 1e-2);
}

namespace {
/// L's share and gradient on backend `be`, the inputs copied into its memory
/// (under bf16: the gradient stored rounded).
template <class L> std::pair<double, std::vector<float>> run_on(const backend_ref& be, bool bf16 = false) {
  std::vector<float> z, y, g(R * C);
  fill(z, y);
  L loss;
  step_ctx c;
  c.be = be;
  c.batch = R;
  c.global_rows = 2 * R;
  c.bf16 = bf16;
  const place_scope on(be.memory());
  tensor<float> dz({R, C}), dy({R, C});
  be.copy(dz.data(), z.data(), z.size() * 4);
  be.copy(dy.data(), y.data(), y.size() * 4);
  const double share = loss.forward_loss(c, cview<float>(dz.v()), cview<float>(dy.v()));
  be.copy(g.data(), loss.backward_loss(c).data(), g.size() * 4);
  be.synchronize();
  return {share, g};
}
template <class L> void same_on_device() {
  guarded_backend gb;
  for (const bool bf16 : {false, true}) {
    INFO(layer_name<L>() << (bf16 ? " under bf16" : ""));
    const auto cpu = run_on<L>(backend_ref{}, bf16);
    const auto dev = run_on<L>(backend_ref(gb), bf16);
    CHECK(dev.first == cpu.first);
    CHECK(dev.second == cpu.second);
    if (bf16)  // every gradient stored as bf16 holds
      for (const float v : cpu.second) CHECK(kernels::round_bf16(v) == v);
  }
}
}  // namespace

TEST_CASE("the guarded backend (the device's code paths on the CPU) gives the CPU's bits; bf16 stores the gradient rounded") {
  same_on_device<mse_loss>();
  same_on_device<l1_loss>();
  same_on_device<huber_loss<>>();
}

TEST_CASE("a loss given as many targets as predictions only; the message names the counts") {
  std::vector<float> z(R * C, 0.f), y(R * 2, 0.f);
  mse_loss m;
  step_ctx c;
  c.batch = R;
  c.global_rows = R;
  CHECK_THROWS_WITH(m.forward_loss(c, cview<float>(z.data(), {R, C}), cview<float>(y.data(), {R, 2})),
                    doctest::Contains("12 targets for 18 predictions (6 rows of 3)"));
}

TEST_CASE("tensor_data with float targets: negative values pass, rows travel whole, non-finite targets are refused") {
  tensor<float> x({5, 2}), y({5, 3});
  for (index_t i = 0; i < 10; ++i) x[i] = static_cast<float>(i);
  for (index_t i = 0; i < 15; ++i) y[i] = -2.5f * static_cast<float>(i);
  tensor_data data(std::move(x), std::move(y), 4, {.shuffle = false});
  static_assert(std::is_same_v<decltype(data), tensor_data<float, float>>);
  static_assert(DataSource<decltype(data)>);
  const auto b = data.get(1, 1, 2);  // samples 5 and 6 of the stream: 0 and 1 of the second epoch
  REQUIRE(b.labels.numel() == 6);
  CHECK(b.labels.shape()[1] == 3);
  CHECK(b.labels[0] == 0.f);
  CHECK(b.labels[4] == -10.f);
  CHECK(b.inputs[2] == 2.f);

  tensor<float> x2({2, 2}), y2({2, 1});
  y2[1] = std::nanf("");
  CHECK_THROWS_WITH(tensor_data(std::move(x2), std::move(y2), 2), doctest::Contains("float target 1 (sample 1) is nan"));
  tensor<float> x3({2, 2});
  tensor<std::int32_t> y3({2});
  y3[0] = -3;
  CHECK_THROWS_WITH(tensor_data(std::move(x3), std::move(y3), 2), doctest::Contains("give y as tensor<float>"));
}

namespace {
using reg_mlp = sequential<linear<4, 16>, relu, linear<16, 2>, mse_loss>;
/// y = (x0 - 2 x1, -x2 x3 - 1): real-valued, half negative.
tensor_data<float, float> regression_data(index_t n, index_t batch, index_t ywidth = 2) {
  tensor<float> x({n, 4}), y({n, ywidth});
  counter_rng r(seed{3}, 0);
  for (index_t i = 0; i < n * 4; ++i) x[i] = static_cast<float>(r.normal(static_cast<std::uint64_t>(i)));
  for (index_t s = 0; s < n; ++s)
    for (index_t j = 0; j < ywidth; ++j)
      y[s * ywidth + j] = j % 2 == 0 ? x[s * 4] - 2 * x[s * 4 + 1] : -x[s * 4 + 2] * x[s * 4 + 3] - 1;
  return tensor_data<float, float>(std::move(x), std::move(y), batch);
}
}  // namespace

TEST_CASE("a regression MLP trains with mse_loss on float targets; a wrong target width is an error naming it") {
  static_assert(std::is_same_v<loss_target_t<reg_mlp>, float> && reg_mlp::target_width == 2);
  static_assert(std::is_same_v<loss_target_t<sequential<linear<4, 3>, softmax_cross_entropy>>, std::int32_t>);
  network<reg_mlp> net(seed{1});
  trainer_options o;
  o.progress = false;
  trainer t(net, sgd{.lr = 0.05f, .momentum = 0.9f}, o);
  auto data = regression_data(64, 16);
  const double first = t.evaluate(data, steps{4});
  t.run(data, steps{60});
  const double last = t.evaluate(data, steps{4});
  MESSAGE("mse over 64 samples: " << first << " -> " << last);
  CHECK(last < 0.5 * first);

  network<reg_mlp> other(seed{1});
  trainer t2(other, sgd{.lr = 0.05f}, o);
  auto wide = regression_data(8, 4, 3);  // three targets a row for a model of two outputs
  CHECK_THROWS_WITH(t2.step(wide, 0), doctest::Contains("12 float targets (for 4 rows; the model's loss takes 2 a row"));

  // an accuracy-style metric compares logits with class labels: refused before any step
  trainer_options m = o;
  m.eval_every = 2;
  m.eval_metric = accuracy;
  trainer t3(other, sgd{.lr = 0.05f}, m);
  auto train = regression_data(16, 4), eval = regression_data(16, 4);
  CHECK_THROWS_WITH(t3.run(train, steps{2}, eval), doctest::Contains("eval_metric compares logits with class labels"));
  CHECK(t3.next_step() == 0);
}
