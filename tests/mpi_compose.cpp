// Compositions that only the one executor runs: ZeRO 1–3 inside pipeline
// stages (Megatron's distributed optimizer is ZeRO-1 there), ZeRO beside
// tensor parallelism (ZeRO over data, TP over model), and ZeRO over data x
// pipe x model — each against single-process training on the same global
// batch, on every rank (the whole model via full_params()), with SGD and with
// AdamW + weight decay + active clipping; and the law that one plan holding
// every strategy, with degree 1 where unused, trains as the simpler plan.
// The bytes of each step equal the lowered program's (as tests/mpi_plan.cpp).
// Adapts to the world size (1, 2, 4 and 8 ranks).
#include <doctest/doctest.h>
#include <mpi.h>

#include <string>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/plan/lower.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {
// Legend: V vocabulary 64, S 16 positions, D width 32, H 4 heads, F FFN 64, 4 blocks.
// The tensor-parallel form has the same elements as small_gpt (so the same initialisation).
using small_gpt = models::gpt_model<64, 16, 32, 4, 64, 4>;
using block = transformer_block<32, 4, 64>;
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<4, split<block>>, layer_norm<32>,
                          split<linear<32, 64>>, softmax_cross_entropy>;
markov_data batches() { return markov_data(seed{7}, 64, 16, 8); }  // 8 sequences x 16 tokens

// SGD: |p - p_single| <= 2e-6 + 1e-4 |p_single| (the order of float sums changes: micro-batches,
// reduce-scatters); AdamW is nonlinear, so 1e-5 + 1e-4 |p_single| (as tests/mpi_split.cpp).
constexpr double sgd_atol = 2e-6, sgd_rtol = 1e-4, clip_atol = 1e-5, clip_rtol = 1e-4, norm_rtol = 1e-5;

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// Plan P on `spec` for 5 SGD steps against network<small_gpt>, on every rank;
/// then the bytes of one more step against the program.
template <class P> void check(const std::string& spec, int micro = 0) {
  auto ctx = test::on_mesh(spec);
  try {
    plan_options o;
    o.micro_batches = micro;
    auto net = make<P>(ctx, seed{42}, o);
    const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
    auto data = batches();
    trainer t(net, opt, test::quiet());
    t.run(data, steps{5});
    auto full = net.full_params();  // collective over the world
    network<small_gpt> single(seed{42});
    {
      auto d2 = batches();
      trainer ts(single, opt, test::quiet());
      ts.run(d2, steps{5});
    }
    CHECK(full.numel() == single.param_count());
    const auto d = test::over_ranks(ctx.world(), test::compare(full.v(), single.params(), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE(layer_name<P>() << " on " << spec << ": max |plan - single| = " << d.max_abs);
    CHECK(d.bad == 0);
    // one more step: the counted bytes are the program's
    lower_options lo;
    lo.global_batch = 8, lo.seq = 16, lo.micro_batches = net.micro_batches();
    const auto prog = lower<P>(ctx.mesh().shape(), ctx.rank(), lo);
    auto before = ctx.mesh().stats();
    before += ctx.world().stats();
    t.step(data, 5);
    auto after = ctx.mesh().stats();
    after += ctx.world().stats();
    CHECK(prog.totals().bytes_sent == after.bytes_sent - before.bytes_sent);
    CHECK(prog.totals().bytes_received == after.bytes_received - before.bytes_received);
  } catch (const std::exception& e) {
    FAIL_CHECK(layer_name<P>() << " on " << spec << ": " << std::string(e.what()));
  }
}

/// Plan P on `spec` with AdamW, weight decay and clipping at 0.5 (active: asserted), on every rank.
template <class P> void check_clipped(const std::string& spec) {
  auto ctx = test::on_mesh(spec);
  try {
    auto net = make<P>(ctx, seed{42});
    const auto r = test::run_clipped<small_gpt>(ctx.world(), net, batches, 0.5, 4, [&](network<small_gpt>& single) {
      auto full = net.full_params();
      return test::compare(full.v(), single.params(), clip_atol, clip_rtol);
    });
    if (ctx.rank() == 0)
      MESSAGE(layer_name<P>() << " on " << spec << " clipped at 0.5 (single norm at step 0: " << r.single_norm0
                              << "): max |plan - single| = " << r.params.max_abs << ", norm rel. diff " << r.norm_rel);
    CHECK(r.single_norm0 > 0.5);
    CHECK(r.norms == 4u);
    CHECK(r.norm_rel <= norm_rtol);
    CHECK(r.params.bad == 0);
  } catch (const std::exception& e) {
    FAIL_CHECK(layer_name<P>() << " on " << spec << ": " << std::string(e.what()));
  }
}

// The same gpt with every block recomputed in backward (same elements, same initialisation).
using rec_tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>, repeat<4, recompute<split<block>>>,
                              layer_norm<32>, split<linear<32, 64>>, softmax_cross_entropy>;
template <int L> using zero_pipe = shard<pipeline<one_f_one_b, small_gpt>, L>;
template <int L> using zero_tp = shard<tp_gpt, L>;
template <int L> using zero_3d = shard<replicate<pipeline<one_f_one_b, tp_gpt>>, L>;
}  // namespace

TEST_CASE("ZeRO 1, 2, 3 inside pipeline stages equal single-process training (data x pipe)") {
  const int n = world_size();
  const std::string spec = n >= 4 ? "data=" + std::to_string(n / 2) + ",pipe=2" : n == 2 ? "data=1,pipe=2" : "data=1";
  check<zero_pipe<1>>(spec);
  check<zero_pipe<2>>(spec);
  check<zero_pipe<3>>(spec);
  if (n >= 2) check<zero_pipe<2>>("data=" + std::to_string(n) + ",pipe=1");  // micro-batches accumulate into the owned range
  check_clipped<zero_pipe<1>>(spec);
  check_clipped<zero_pipe<3>>(spec);
}

TEST_CASE("ZeRO 1, 2, 3 beside tensor parallelism (ZeRO over data, TP over model) equal single-process training") {
  const int n = world_size();
  const std::string spec = n >= 4 ? "data=" + std::to_string(n / 2) + ",model=2" : "data=" + std::to_string(n);
  check<zero_tp<1>>(spec);
  check<zero_tp<2>>(spec);
  check<zero_tp<3>>(spec);
  check_clipped<zero_tp<2>>(spec);
  if (n == 2) check_clipped<zero_tp<3>>("model=2");
}

TEST_CASE("ZeRO over data x pipe x model equals single-process training") {
  const int n = world_size();
  const std::string spec = n == 8 ? "data=2,pipe=2,model=2" : n == 4 ? "data=2,pipe=2" : n == 2 ? "pipe=2" : "data=1";
  check<zero_3d<1>>(spec);
  check<zero_3d<3>>(spec);
  check_clipped<zero_3d<2>>(spec);
}

TEST_CASE("micro-batches without a pipeline (gradient accumulation inside a step) equal single-process training") {
  const int n = world_size();
  const int per = 8 / n, m2 = per >= 2 ? 2 : 1, m4 = per >= 4 ? 4 : m2;  // micro-batches that divide each replica's rows
  check<replicate<small_gpt>>("data=" + std::to_string(n), m2);
  check<shard<small_gpt, 2>>("data=" + std::to_string(n), m4);
  check<shard<small_gpt, 3>>("data=" + std::to_string(n), m2);
  check<tp_gpt>(n <= 4 ? "model=" + std::to_string(n) : "data=2,model=4", 2);
}

TEST_CASE("recompute inside pipeline stages and tensor-parallel blocks, with and without ZeRO, equals single-process training") {
  const int n = world_size();
  const std::string pipe = n >= 4 ? "data=" + std::to_string(n / 2) + ",pipe=2" : "pipe=" + std::to_string(n);
  check<replicate<pipeline<one_f_one_b, rec_tp_gpt>>>(pipe);
  check<shard<replicate<pipeline<gpipe, rec_tp_gpt>>, 3>>(pipe);
  check<rec_tp_gpt>(n <= 4 ? "model=" + std::to_string(n) : "data=2,model=4");
}

TEST_CASE("evaluate(): the forward-only global loss of every plan equals the single-process one, parameters untouched") {
  const int n = world_size();
  auto eval = [](auto& net) {
    auto data = batches();
    trainer t(net, sgd{.lr = 0.05f}, test::quiet());
    return t.evaluate(data, steps{2}, 3);
  };
  network<small_gpt> single(seed{42});
  const double want = eval(single);
  auto one = [&]<class P>(const std::string& spec) {
    auto ctx = test::on_mesh(spec);
    auto net = make<P>(ctx, seed{42});
    const auto before = net.full_params();
    const double got = eval(net);
    const auto after = net.full_params();
    if (ctx.rank() == 0) MESSAGE(layer_name<P>() << " on " << spec << ": evaluate " << got << " vs " << want);
    CHECK(got == doctest::Approx(want).epsilon(1e-6));
    CHECK(test::over_ranks(ctx.world(), test::compare(after.v(), before.v(), 0, 0)).bad == 0);
  };
  one.template operator()<replicate<pipeline<one_f_one_b, small_gpt>>>(n >= 4 ? "data=" + std::to_string(n / 2) + ",pipe=2" : "pipe=" + std::to_string(n));
  one.template operator()<shard<small_gpt, 3>>("data=" + std::to_string(n));
  one.template operator()<tp_gpt>(n <= 4 ? "model=" + std::to_string(n) : "data=2,model=4");
}

TEST_CASE("law: a plan with every strategy, degree 1 where unused, trains as the simpler plan") {
  // shard<replicate<pipeline<1f1b, tensor-parallel gpt>>, 1> with one micro-batch is, on a
  // data-only mesh, replicate<gpt>; on a pipe-only mesh, pipeline<1f1b, gpt>; on a model-only
  // mesh, the tensor-parallel gpt. Each pair trains to the same parameters on every rank.
  const int n = world_size();
  using all = zero_3d<1>;
  for (const std::string& spec : {"data=" + std::to_string(n), "pipe=" + std::to_string(n), "model=" + std::to_string(n)}) {
    if (n > 4 && spec.rfind("data", 0) != 0) continue;  // 4 heads, 4 blocks: at most 4 model ranks, 6 stages
    auto ctx = test::on_mesh(spec);
    plan_options o;
    o.micro_batches = spec.rfind("pipe", 0) == 0 ? 4 : 1;
    auto a = make<all>(ctx, seed{42}, o);
    auto run = [&](auto& net) {
      auto data = batches();
      trainer t(net, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet());
      t.run(data, steps{4});
      return net.full_params();
    };
    const auto pa = run(a);
    tensor<float> pb;
    if (spec.rfind("data", 0) == 0) {
      auto b = make<replicate<small_gpt>>(ctx, seed{42}, o);
      pb = run(b);
    } else if (spec.rfind("pipe", 0) == 0) {
      auto b = make<pipeline<one_f_one_b, small_gpt>>(ctx, seed{42}, o);
      pb = run(b);
    } else {
      auto b = make<tp_gpt>(ctx, seed{42}, o);
      pb = run(b);
    }
    const auto d = test::over_ranks(ctx.world(), test::compare(pa.v(), pb.v(), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE("every strategy on " << spec << " vs the simpler plan: max difference " << d.max_abs);
    CHECK(d.bad == 0);
  }
}
