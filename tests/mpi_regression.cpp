// Regression on float targets under every plan: a small MLP with mse_loss
// (l1_loss and huber_loss in the split and mixed plans) trained replicated,
// pipelined with micro-batches (data x pipe), sharded (ZeRO 1-3), with its
// head split over the model axis (the loss on the gathered output) and over
// the data axis, and in a mixed plan (ZeRO-1 around data x pipe x model, the
// last stage holding a split head) — each against single-process training on the same global
// batch, on every rank, with SGD (step losses and parameters) and with AdamW
// + weight decay + active clipping; the bytes of a step are the lowered
// program's. Targets are real values, half negative.
// Adapts to the world size (1, 2 and 4 ranks).
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <string>
#include <vector>

#include "whale/comm/context.hpp"
#include "whale/nn/regression_loss.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/plan/lower.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/data_source.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {
// Legend: 6 features in, 16 hidden, 4 targets out; 48 samples, global batch 8.
template <class L> using reg_mlp = sequential<linear<6, 16>, relu, linear<16, 4>, L>;
// the same elements with the head a sequential of its own (the single-process form of a split head)
template <class L> using head_part = sequential<linear<6, 16>, relu, sequential<linear<16, 4>, L>>;
// a deeper one whose repeat a pipeline cuts into as many stages as the pipe axis has ranks
using block = sequential<linear<16, 16>, relu>;
template <class Head> using deep = sequential<linear<6, 16>, relu, repeat<2, block>, Head>;

/// y = (x0 - 2 x1, -x2 x3 - 1, 0.5 x4 + x5^2 - 1.5, -x0 - 0.5): real-valued targets, many negative.
tensor_data<float, float> batches() {
  constexpr index_t n = 48;
  tensor<float> x({n, 6}), y({n, 4});
  counter_rng r(seed{11}, 0);
  for (index_t i = 0; i < n * 6; ++i) x[i] = static_cast<float>(r.normal(static_cast<std::uint64_t>(i)));
  for (index_t s = 0; s < n; ++s) {
    const float* v = x.data() + s * 6;
    float* t = y.data() + s * 4;
    t[0] = v[0] - 2 * v[1];
    t[1] = -v[2] * v[3] - 1;
    t[2] = 0.5f * v[4] + v[5] * v[5] - 1.5f;
    t[3] = -v[0] - 0.5f;
  }
  return tensor_data<float, float>(std::move(x), std::move(y), 8);
}

// SGD: |p - p_single| <= 2e-6 + 1e-4 |p_single| (sums in another order: data slices, micro-batches,
// reduce-scatters); AdamW is nonlinear: 1e-5 + 1e-4 |p_single| (as tests/mpi_compose.cpp).
constexpr double sgd_atol = 2e-6, sgd_rtol = 1e-4, clip_atol = 1e-5, clip_rtol = 1e-4, norm_rtol = 1e-5, loss_rtol = 1e-5;

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// Plan P on `spec` (micro-batches `micro`) for 5 SGD steps against
/// network<Single>: each step's global loss and the parameters after, on every
/// rank; then 4 AdamW steps clipped at `clip` (active: asserted).
template <class P, class Single> void check(const std::string& spec, int micro = 0, double clip = 0.5) {
  auto ctx = test::on_mesh(spec);
  const std::string what = layer_name<P>() + " on " + spec + (micro ? ", " + std::to_string(micro) + " micro-batches" : "");
  try {
    plan_options o;
    o.micro_batches = micro;
    const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
    double loss_rel = 0;
    {
      auto net = make<P>(ctx, seed{42}, o);
      network<Single> single(seed{42});
      auto data = batches(), d2 = batches();
      trainer t(net, opt, test::quiet());
      trainer ts(single, opt, test::quiet());
      for (std::int64_t s = 0; s < 5; ++s) {
        const double a = t.step(data, s), b = ts.step(d2, s);
        loss_rel = std::max(loss_rel, std::abs(a / b - 1.0));
      }
      auto full = net.full_params();  // collective over the world
      CHECK(full.numel() == single.param_count());
      const auto d = test::over_ranks(ctx.world(), test::compare(full.v(), single.params(), sgd_atol, sgd_rtol));
      all_reduce(ctx.world(), view<double>(&loss_rel, {1}), reduce_op::max);
      if (ctx.rank() == 0) MESSAGE(what << ", SGD: max |plan - single| = " << d.max_abs << ", loss rel. diff " << loss_rel);
      CHECK(d.bad == 0);
      CHECK(loss_rel <= loss_rtol);
      // one more step: the bytes it moves are the lowered program's (a data-axis head gathers every row's targets)
      lower_options lo;
      lo.global_batch = 8, lo.micro_batches = net.micro_batches();
      const auto prog = lower<P>(ctx.mesh().shape(), ctx.rank(), lo);
      auto before = ctx.mesh().stats();
      before += ctx.world().stats();
      t.step(data, 5);
      auto after = ctx.mesh().stats();
      after += ctx.world().stats();
      CHECK(prog.totals().bytes_sent == after.bytes_sent - before.bytes_sent);
      CHECK(prog.totals().bytes_received == after.bytes_received - before.bytes_received);
    }
    auto net = make<P>(ctx, seed{42}, o);
    const auto r = test::run_clipped<Single>(ctx.world(), net, batches, clip, 4, [&](network<Single>& single) {
      auto full = net.full_params();
      return test::compare(full.v(), single.params(), clip_atol, clip_rtol);
    });
    if (ctx.rank() == 0)
      MESSAGE(what << ", AdamW clipped at " << clip << " (single norm at step 0: " << r.single_norm0
                   << "): max |plan - single| = " << r.params.max_abs << ", norm rel. diff " << r.norm_rel);
    CHECK(r.single_norm0 > clip);
    CHECK(r.norms == 4u);
    CHECK(r.norm_rel <= norm_rtol);
    CHECK(r.params.bad == 0);
  } catch (const std::exception& e) {
    FAIL_CHECK(what << ": " << std::string(e.what()));
  }
}

std::string data_all() { return "data=" + std::to_string(world_size()); }
/// data x a second axis of 2 where the world has 2 ranks or more.
std::string with_two(const char* axis) {
  const int n = world_size();
  return n == 1 ? std::string("data=1") : "data=" + std::to_string(n / 2) + "," + axis + "=2";
}
}  // namespace

TEST_CASE("regression with mse_loss: data parallel (replicate) and ZeRO 1, 2, 3 equal single-process training") {
  check<replicate<reg_mlp<mse_loss>>, reg_mlp<mse_loss>>(data_all());
  check<replicate<reg_mlp<mse_loss>>, reg_mlp<mse_loss>>(data_all(), 2);  // micro-batches: the same mean
  check<shard<reg_mlp<mse_loss>, 1>, reg_mlp<mse_loss>>(data_all());
  check<shard<reg_mlp<mse_loss>, 2>, reg_mlp<mse_loss>>(data_all());
  check<shard<reg_mlp<mse_loss>, 3>, reg_mlp<mse_loss>>(data_all());
}

TEST_CASE("regression with mse_loss: a pipeline (the loss and its targets on the last stage) equals single-process training") {
  // cut into as many stages as the pipe axis has ranks; data x pipe at 4 ranks
  check<replicate<pipeline<one_f_one_b, deep<sequential<linear<16, 4>, mse_loss>>>>, deep<sequential<linear<16, 4>, mse_loss>>>(
      with_two("pipe"), 2);
}

TEST_CASE("regression with a split head: over the model axis (the loss on the gathered output) and over the data axis") {
  // split<sequential<linear, mse_loss>>: the column-split output is gathered, every rank of the axis takes the whole loss
  check<sequential<linear<6, 16>, relu, split<sequential<linear<16, 4>, mse_loss>>>, head_part<mse_loss>>(with_two("model"));
  // the data axis: every rank computes the head on all rows, so the targets of every row are gathered
  check<sequential<linear<6, 16>, relu, split<sequential<linear<16, 4>, l1_loss>, axis::data>>, head_part<l1_loss>>(data_all(),
                                                                                                                   0, 0.2);
}

TEST_CASE("regression with huber_loss in a mixed plan: ZeRO-1 around a pipeline whose last stage holds a split head") {
  using P = shard<replicate<pipeline<one_f_one_b, deep<split<sequential<linear<16, 4>, huber_loss<>>>>>>, 1>;
  using S = deep<sequential<linear<16, 4>, huber_loss<>>>;
  const int n = world_size();
  check<P, S>(n == 4 ? "pipe=2,model=2" : n == 2 ? "pipe=2" : "data=1", 2, 0.2);
  if (n >= 2) check<P, S>(n == 4 ? "data=2,pipe=2" : "model=2", 2, 0.2);
}
