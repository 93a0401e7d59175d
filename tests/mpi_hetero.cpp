// Heterogeneous devices (docs/hetero.md): emulated slow ranks, speed-balanced
// synchronous data parallelism (equal to single-process training on every
// rank, SGD and AdamW + clipping), and Wave Synchronous Parallel (D = 0 equals
// synchronous data parallelism; the staleness bound holds with a slow rank),
// at whatever world size mpirun gives (1, 2, 4).
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/linear.hpp"
#include "whale/nn/repeat.hpp"
#include "whale/nn/sequential.hpp"
#include "whale/nn/softmax_cross_entropy.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/replicate.hpp"
#include "whale/train/trainer.hpp"
#include "whale/train/wsp_trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// A deep-mlp of the reference's shape at a sixteenth of the width: a repeat
// (so a pipeline cuts it at run time), GELU, a class head.
using block = sequential<linear<32, 32>, gelu>;
using small_deep = sequential<repeat<4, block>, linear<32, 8>, softmax_cross_entropy>;
constexpr index_t global_batch = 24;
teacher_data batches() { return teacher_data(seed{7}, 32, 8, global_batch); }

// SGD: data parallelism changes only the order of float sums.
constexpr double sgd_atol = 2e-6, sgd_rtol = 1e-4;
// AdamW + clipping: Adam divides by sqrt(v), magnifying rounding in small gradients.
constexpr double clip_atol = 1e-5, clip_rtol = 1e-4;

/// Slowness factors for n ranks: the last rank 3x slower, the one before 2x.
std::vector<double> speeds_for(int n) {
  std::vector<double> s(static_cast<std::size_t>(n), 1.0);
  if (n >= 2) s.back() = 3.0;
  if (n >= 4) s[static_cast<std::size_t>(n) - 2] = 2.0;
  return s;
}

template <class Net> tensor<float> trained_single(int n, sgd opt) {
  Net single(seed{42});
  auto data = batches();
  trainer t(single, opt, test::quiet());
  t.run(data, steps{n});
  tensor<float> out({single.params().numel()});
  copy<float>(single.params(), out.v());
  return out;
}

/// Trains `net` (a plan on ctx) for n steps of SGD `opt`, and compares every
/// rank's full parameters with one process trained alike (collective).
template <class Net> test::diff train_against_single(context& ctx, Net& net, sgd opt, int n) {
  {
    auto data = batches();
    trainer t(net, opt, test::quiet());
    t.run(data, steps{n});
  }
  const auto want = trained_single<network<small_deep>>(n, opt);
  const auto got = net.full_params();
  return test::over_ranks(ctx.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol));
}

}  // namespace

TEST_CASE("weighted_slice: proportional, every part at least one row, slices tile the batch") {
  const std::vector<double> w{1.0, 1.0 / 3};
  const auto a = detail::weighted_slice(24, 2, 0, w), b = detail::weighted_slice(24, 2, 1, w);
  CHECK(a.first == 0);
  CHECK(b.first == a.second);
  CHECK(a.second + b.second == 24);
  CHECK(a.second == 18);  // 1 + 22 * 3/4 = 17.5, rounded by the larger remainder
  const std::vector<double> tiny{1000.0, 1.0, 1.0};
  for (int p = 0; p < 3; ++p) CHECK(detail::weighted_slice(5, 3, p, tiny).second >= 1);
  CHECK(detail::weighted_slice(10, 3, 2, {}).second == detail::even_slice(10, 3, 2).second);
  // in multiples of the micro-batch count, where the batch allows it
  const std::vector<double> w2{0.5, 0.25};
  const auto q0 = detail::weighted_slice(128, 2, 0, w2, 4), q1 = detail::weighted_slice(128, 2, 1, w2, 4);
  CHECK(q0.second % 4 == 0);
  CHECK(q1.second % 4 == 0);
  CHECK(q0.second + q1.second == 128);
  CHECK(q1.first == q0.second);
}

TEST_CASE("worker_order: np keeps the launch order, ed gives every worker one rank of each speed, hd balances their speed") {
  const std::vector<double> f{1, 1, 2, 4};  // two fast ranks, two slow ones
  CHECK(detail::worker_order(f, 2, detail::worker_policy::np) == std::vector<int>{0, 1, 2, 3});
  CHECK(detail::worker_order(f, 2, detail::worker_policy::ed) == std::vector<int>{0, 2, 1, 3});  // {1,2} and {1,4}
  CHECK(detail::worker_order(f, 2, detail::worker_policy::hd) == std::vector<int>{0, 2, 1, 3});  // speeds 1.5 and 1.25, not 2 and 0.75
  const std::vector<double> g{4, 1, 1, 1, 2, 2};  // three workers of two
  const auto ed = detail::worker_order(g, 3, detail::worker_policy::ed);
  auto sorted = ed;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == std::vector<int>{0, 1, 2, 3, 4, 5});  // a permutation
  for (int w = 0; w < 3; ++w) CHECK(g[static_cast<std::size_t>(ed[static_cast<std::size_t>(2 * w)])] == 1);  // a fast rank first in each
  CHECK_THROWS_WITH_AS(detail::worker_order(g, 4, detail::worker_policy::ed), doctest::Contains("do not form 4 equal workers"),
                       std::invalid_argument);
}

TEST_CASE("with_rank_order: rank i of the new context is the old rank order[i]; WSP trains the same there") {
  const int n = world_size();
  auto base = test::on_mesh("data=" + std::to_string(n));
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = n - 1 - i;  // reversed
  auto ctx = base.with_rank_order(order);
  CHECK(ctx.rank() == n - 1 - base.rank());
  CHECK(ctx.mesh().shape().size(axis::data) == n);
  std::vector<int> bad(static_cast<std::size_t>(n), 0);
  if (n > 1) CHECK_THROWS_WITH_AS(base.with_rank_order(bad), doctest::Contains("not a permutation"), std::invalid_argument);
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  const auto want = trained_single<network<small_deep>>(4, opt);
  auto net = make<replicate<small_deep>>(ctx, seed{42});
  auto data = batches();
  wsp_trainer t(ctx, net, opt, wsp_options{.staleness = 0, .wave = 1});
  for (int s = 0; s < 4; ++s) t.step(data, s);
  t.finish();
  const auto got = net.full_params();
  CHECK(test::over_ranks(ctx.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol)).bad == 0);
}

TEST_CASE("speeds: balanced batches follow the replicas' speeds and train as one process, on every rank") {
  const int n = world_size();
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  plan_options o;
  o.speeds = speeds_for(n);
  o.balance = true;
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  auto net = make<replicate<small_deep>>(ctx, seed{42}, o);
  const auto [begin, rows] = net.local_batch(global_batch);
  // the fastest rank (0) gets at least as many rows as the slowest (the last)
  index_t first_rows = rows, last_rows = rows;
  broadcast(ctx.world(), view<index_t>(&first_rows, {1}), 0);
  broadcast(ctx.world(), view<index_t>(&last_rows, {1}), n - 1);
  CHECK(first_rows >= last_rows);
  if (n >= 2) CHECK(first_rows > last_rows);
  const auto d = train_against_single(ctx, net, opt, 5);
  if (ctx.rank() == 0) MESSAGE("balanced dp at " << n << " ranks: max |dp - single| = " << d.max_abs);
  CHECK(d.bad == 0);
  // the slow ranks slept; a rank of factor 1 never does
  const double waited = net.emulated_wait_s();
  if (o.speeds[static_cast<std::size_t>(ctx.rank())] > 1) CHECK(waited > 0);
  else CHECK(waited == 0);
}

TEST_CASE("speeds: balanced batches with AdamW and active clipping equal one process, on every rank") {
  const int n = world_size();
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  plan_options o;
  o.speeds = speeds_for(n);
  o.balance = true;
  auto net = make<replicate<small_deep>>(ctx, seed{42}, o);
  const auto r = test::run_clipped<small_deep>(ctx.world(), net, batches, 0.1, 4, [&](const auto& single) {
    const auto got = net.full_params();
    return test::compare(got.v(), single.params(), clip_atol, clip_rtol);
  });
  if (ctx.rank() == 0)
    MESSAGE("balanced dp, AdamW + clip: max diff " << r.params.max_abs << ", norm rel " << r.norm_rel << ", single norm "
                                                   << r.single_norm0);
  CHECK(r.single_norm0 > 0.1);  // clipping was active
  CHECK(r.params.bad == 0);
  CHECK(r.norm_rel < 1e-5);
}

TEST_CASE("speeds: a pipeline in each replica, balanced by the slowest stage, equals one process") {
  const int n = world_size();
  if (n < 4) return;  // needs data=2,pipe=2
  auto ctx = test::on_mesh("data=" + std::to_string(n / 2) + ",pipe=2");
  plan_options o;
  o.speeds = speeds_for(n);
  o.balance = true;
  o.micro_batches = 2;
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  auto net = make<replicate<pipeline<one_f_one_b, small_deep>>>(ctx, seed{42}, o);
  const auto d = train_against_single(ctx, net, opt, 5);
  if (ctx.rank() == 0) MESSAGE("balanced data x pipe: max |plan - single| = " << d.max_abs);
  CHECK(d.bad == 0);
}

TEST_CASE("speeds: a pipeline's stages are cut by their ranks' speeds (slow stages get fewer blocks), and train as one process") {
  const int n = world_size();
  if (n < 2) return;
  auto ctx = test::on_mesh("pipe=" + std::to_string(n));
  plan_options o;
  o.speeds = speeds_for(n);  // the last stage 3x slower
  o.micro_batches = 4;
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  auto net = make<pipeline<one_f_one_b, small_deep>>(ctx, seed{42}, o);
  plan_options plain;
  plain.micro_batches = 4;
  auto even = make<pipeline<one_f_one_b, small_deep>>(ctx, seed{42}, plain);
  const auto cut = net.stage_blocks(), even_cut = even.stage_blocks();
  CHECK(cut.back() < even_cut.back());  // the slow last stage gives blocks away
  CHECK(cut.front() > even_cut.front());
  const auto d = train_against_single(ctx, net, opt, 5);
  if (ctx.rank() == 0) MESSAGE("pipe=" << n << " cut by speed: max |plan - single| = " << d.max_abs);
  CHECK(d.bad == 0);
}

// A block of small_deep holds 32 x 32 + 32 parameters: 16.5 KiB of parameters,
// gradients and AdamW state (16 bytes a parameter).
constexpr double block_state_mib = (32.0 * 32 + 32) * 16 / 1048576.0;

TEST_CASE("memory caps: a pipeline is cut so that every stage fits its ranks' caps, and trains as one process") {
  const int n = world_size();
  if (n < 2) return;
  auto ctx = test::on_mesh("pipe=" + std::to_string(n));
  plan_options o;
  o.micro_batches = 4;
  o.memory_caps_mib.assign(static_cast<std::size_t>(n), 1024.0);
  o.memory_caps_mib[0] = 1.5 * block_state_mib;  // the first stage's device holds one block, not two
  auto net = make<pipeline<one_f_one_b, small_deep>>(ctx, seed{42}, o);
  plan_options plain;
  plain.micro_batches = 4;
  auto even = make<pipeline<one_f_one_b, small_deep>>(ctx, seed{42}, plain);
  const auto cut = net.stage_blocks();
  CHECK(cut.front() == 1);
  if (n == 2) CHECK(even.stage_blocks().front() == 2);  // without caps the first of two stages takes 2 of the 4
  const auto d = train_against_single(ctx, net, sgd{.lr = 0.05f, .momentum = 0.9f}, 5);
  if (ctx.rank() == 0) MESSAGE("pipe=" << n << " cut by memory caps: first stage " << cut.front() << " blocks; max |plan - single| = " << d.max_abs);
  CHECK(d.bad == 0);
  // caps no cut fits: every stage below one block (and the last one also holds the head)
  plan_options none = plain;
  none.memory_caps_mib.assign(static_cast<std::size_t>(n), 0.5 * block_state_mib);
  using piped = pipeline<one_f_one_b, small_deep>;
  CHECK_THROWS_WITH_AS(make<piped>(ctx, seed{42}, none), doctest::Contains("no cut of the 4 blocks"), std::invalid_argument);
}

TEST_CASE("memory caps: a rank whose share does not fit its cap is an error on every rank; bad lists are errors") {
  auto ctx = context::init();
  const int n = ctx.size();
  plan_options o;
  o.memory_caps_mib.assign(static_cast<std::size_t>(n), 1024.0);
  o.memory_caps_mib.back() = block_state_mib;  // the whole replicated model does not fit
  CHECK_THROWS_WITH_AS(make<replicate<small_deep>>(ctx, seed{42}, o),
                       doctest::Contains(("rank " + std::to_string(n - 1) + "'s memory cap").c_str()), std::invalid_argument);
  o.memory_caps_mib.assign(static_cast<std::size_t>(n) + 1, 1024.0);
  CHECK_THROWS_WITH_AS(make<replicate<small_deep>>(ctx, seed{42}, o), doctest::Contains("give one per rank"),
                       std::invalid_argument);
  for (const char* bad : {"0", "-5", "abc", "2x", "nan", "1,,2"})
    CHECK_THROWS_AS(plan_options::parse_caps(bad, "--memory-caps"), detail::parse_error);
  CHECK(plan_options::parse_caps("4096,0.5", "--memory-caps") == std::vector<double>{4096, 0.5});
}

TEST_CASE("speeds: a list of the wrong length, or a factor below 1, is an error on every rank") {
  const int n = world_size();
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  plan_options o;
  o.speeds.assign(static_cast<std::size_t>(n) + 1, 1.0);
  CHECK_THROWS_WITH_AS(make<replicate<small_deep>>(ctx, seed{42}, o), doctest::Contains("give one per rank"),
                       std::invalid_argument);
  if (n > 1) {  // ranks launched with other speeds: every rank names the difference before any work
    plan_options mixed;
    mixed.speeds.assign(static_cast<std::size_t>(n), ctx.rank() == 1 ? 2.0 : 1.0);
    CHECK_THROWS_WITH_AS(make<replicate<small_deep>>(ctx, seed{42}, mixed), doctest::Contains("the speeds (--speeds, WHALE_SPEEDS) differs"),
                         std::invalid_argument);
  }
  CHECK_THROWS_WITH_AS(plan_options::parse_speeds("1,0.5", "--speeds"), doctest::Contains("out of range"),
                       detail::parse_error);
  CHECK_THROWS_AS(plan_options::parse_speeds("1,,2", "--speeds"), detail::parse_error);
  CHECK_THROWS_AS(plan_options::parse_speeds("2x", "--speeds"), detail::parse_error);
  CHECK_THROWS_AS(plan_options::parse_speeds("nan", "--speeds"), detail::parse_error);
}

namespace {

/// WSP over plan P for `n` data steps (whole waves when w.in_flight); returns
/// every rank's parameters after finish(), and the waves' and minibatches' records.
template <class P, class Opt> tensor<float> train_wsp(context& ctx, plan_options o, wsp_options w, int n, Opt opt,
                                                      std::vector<wave_record>* waves = nullptr,
                                                      std::vector<minibatch_record>* rec = nullptr) {
  auto net = make<P>(ctx, seed{42}, o);
  auto data = batches();
  wsp_trainer t(ctx, net, opt, w);
  if (w.in_flight) {
    REQUIRE(n % w.wave == 0);
    for (int s = 0; s < n; s += w.wave) CHECK(t.wave(data, s).size() == static_cast<std::size_t>(w.wave));
  } else {
    for (int s = 0; s < n; ++s) t.step(data, s);
  }
  t.finish();
  if (waves) *waves = t.waves();
  if (rec) *rec = t.minibatches();
  return net.full_params();
}

}  // namespace

TEST_CASE("wsp: D = 0, one minibatch a wave, trains as synchronous data parallelism, on every rank") {
  const int n = world_size();
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  const auto want = trained_single<network<small_deep>>(6, opt);
  auto check = [&]<class P>(const std::string& spec, bool balanced = false) {
    auto ctx = test::on_mesh(spec);
    plan_options o;
    if (spec.find("pipe") != std::string::npos) o.micro_batches = 2;
    if (balanced) o.speeds = speeds_for(ctx.size()), o.balance = true;  // unequal slices, weighted by their rows
    const auto got = train_wsp<P>(ctx, o, wsp_options{.staleness = 0, .wave = 1}, 6, opt);
    const auto d = test::over_ranks(ctx.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE("wsp D=0 on " << spec << std::string(balanced ? ", balanced" : "") << ": max |wsp - single| = " << d.max_abs);
    CHECK(d.bad == 0);
  };
  check.template operator()<replicate<small_deep>>("data=" + std::to_string(n));
  check.template operator()<replicate<small_deep>>("data=" + std::to_string(n), true);
  if (n >= 4) check.template operator()<replicate<pipeline<one_f_one_b, small_deep>>>("data=" + std::to_string(n / 2) + ",pipe=2");
}

TEST_CASE("wsp: with a slow rank the staleness bound holds, and every worker ends with the same weights") {
  const int n = world_size();
  for (int D : {0, 1, 2}) {
    auto ctx = test::on_mesh("data=" + std::to_string(n));
    plan_options o;
    o.speeds = speeds_for(n);
    std::vector<wave_record> waves;
    const auto got = train_wsp<replicate<small_deep>>(ctx, o, wsp_options{.staleness = D, .wave = 2}, 12,
                                                      sgd{.lr = 0.05f, .momentum = 0.9f}, &waves);
    CHECK(waves.size() == 6);
    std::int64_t worst = 0, last = 0;
    for (const auto& w : waves) {
      worst = std::max(worst, w.wave - w.min_clock);
      CHECK(w.wave == last + 1);  // one record per wave, in order
      last = w.wave;
    }
    CHECK(worst <= D);
    std::int64_t worst_all = worst;
    all_reduce(ctx.world(), view<std::int64_t>(&worst_all, {1}), reduce_op::max);
    if (ctx.rank() == 0) MESSAGE("wsp D=" << D << " at " << n << " ranks: largest lead over the slowest = " << worst_all);
    // after finish() every worker pulled the same global weights
    tensor<float> root({got.numel()});
    copy<float>(got.v(), root.v());
    broadcast(ctx.world(), root.v(), 0);
    CHECK(test::over_ranks(ctx.world(), test::compare(got.v(), root.v(), 0, 0)).bad == 0);
  }
}

TEST_CASE("wsp: a stop asked for by one worker ends every worker at a wave boundary") {
  const int n = world_size();
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  plan_options o;
  o.speeds = speeds_for(n);
  auto net = make<replicate<small_deep>>(ctx, seed{42}, o);
  auto data = batches();
  wsp_trainer t(ctx, net, sgd{.lr = 0.05f}, wsp_options{.staleness = 2, .wave = 1});
  t.publish(0.5 + ctx.rank());
  barrier(ctx.world());
  int s = 0;
  for (; s < 1000 && !t.stopping(); ++s) {
    t.step(data, s);
    if (ctx.rank() == 0 && s == 3) t.request_stop();
  }
  t.finish();
  CHECK(t.stopping());
  CHECK(s < 1000);
  for (const auto& w : t.waves())  // the bound holds for every wave a worker went on from
    if (!w.stopped) CHECK(w.wave - w.min_clock <= 2);
  CHECK(t.waves().back().stopped);
  // what each rank published before the first step, every rank read at a wave end
  const auto pub = t.published();
  for (int r = 0; r < ctx.size(); ++r) CHECK(pub[static_cast<std::size_t>(r)] == 0.5 + r);
}

TEST_CASE("wsp: the trace shows each wave's push, wait and pull, with the weights' version") {
  const int n = world_size();
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  plan_options o;
  o.speeds = speeds_for(n);
  o.trace = true;
  auto net = make<replicate<small_deep>>(ctx, seed{42}, o);
  auto data = batches();
  constexpr int D = 1;
  wsp_trainer t(ctx, net, sgd{.lr = 0.05f}, wsp_options{.staleness = D, .wave = 1});
  for (int s = 0; s < 5; ++s) t.step(data, s);
  int push = 0, wait = 0, pull = 0;
  for (const auto& e : net.trace().events()) {
    if (e.what() == span_kind::wsp_push) ++push;
    if (e.what() == span_kind::wsp_wait) ++wait;
    if (e.what() == span_kind::wsp_pull) {
      ++pull;
      CHECK(e.micro >= pull - D);  // the pulled weights hold every worker's waves <= micro
      CHECK(category(e.what()) == std::string("wsp"));
    }
  }
  CHECK(push == 5);
  CHECK(wait == 5);
  CHECK(pull == 5);
  t.finish();
}

TEST_CASE("wsp: bad options are errors naming them") {
  auto ctx = test::on_mesh("data=" + std::to_string(world_size()));
  auto net = make<replicate<small_deep>>(ctx, seed{42});
  CHECK_THROWS_WITH_AS(wsp_trainer(ctx, net, sgd{}, wsp_options{.staleness = -1}), doctest::Contains("staleness bound D"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(wsp_trainer(ctx, net, sgd{}, wsp_options{.wave = 0}), doctest::Contains("a wave must hold"),
                       std::invalid_argument);
}

namespace {

/// One process, waves of `n` minibatches in flight (HetPipe's pipelined
/// minibatches): every minibatch of a wave takes its gradient at the weights the
/// wave began with; the n updates follow in step order, each clipped alone to
/// `max_norm` when it is > 0.
template <class Opt> tensor<float> in_flight_single(int waves, int n, Opt opt, double max_norm, int* clipped = nullptr) {
  network<small_deep> single(seed{42});
  auto data = batches();
  auto st = single.make_optimizer_state(opt);
  const index_t np = single.params().numel();
  tensor<float> start({np}), slots({np * n});
  for (int c = 0; c < waves; ++c) {
    copy<float>(single.params(), start.v());
    for (int k = 0; k < n; ++k) {
      copy<float>(start.v(), single.params());
      const auto b = data.get(c * n + k, 0, global_batch);
      step_ctx sc;
      sc.batch = b.sequences;
      sc.seq = b.seq;
      sc.global_rows = global_batch * b.seq;
      single.train_step(sc, b.inputs, b.labels);
      std::copy_n(single.grads().data(), np, slots.data() + k * np);
    }
    copy<float>(start.v(), single.params());
    for (int k = 0; k < n; ++k) {
      std::copy_n(slots.data() + k * np, np, single.grads().data());
      const float scale = max_norm > 0 ? clip_coefficient(single.grad_norm(), max_norm) : 1.f;
      if (clipped && scale < 1.f) ++*clipped;
      single.apply_optimizer(opt, st, scale);
    }
  }
  tensor<float> out({np});
  copy<float>(single.params(), out.v());
  return out;
}

}  // namespace

TEST_CASE("wsp in flight: one virtual worker over every rank equals one process with stale-by-wave updates, SGD and AdamW + clipping, on every rank") {
  const int n = world_size();
  const std::string spec = "data=1,pipe=" + std::to_string(n);
  constexpr int waves = 4, per_wave = 3;
  {
    auto ctx = test::on_mesh(spec);
    const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
    std::vector<minibatch_record> rec;
    const auto got = train_wsp<replicate<pipeline<one_f_one_b, small_deep>>>(
        ctx, {}, wsp_options{.wave = per_wave, .in_flight = true}, waves * per_wave, opt, nullptr, &rec);
    const auto want = in_flight_single(waves, per_wave, opt, 0);
    const auto d = test::over_ranks(ctx.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE("in flight, SGD, " << spec << ": max |wsp - single| = " << d.max_abs);
    CHECK(d.bad == 0);
    // which weights each minibatch ran on: its wave's start, so it lacks the
    // updates of the earlier minibatches of its wave (at most N_m - 1)
    REQUIRE(rec.size() == static_cast<std::size_t>(waves * per_wave));
    for (const auto& r : rec) {
      CHECK(r.step - r.local_version == r.step % per_wave);
      CHECK(r.wave == r.step / per_wave);
    }
    // and the stale-by-wave reference is not just any training: sequential waves differ
    const auto sequential = trained_single<network<small_deep>>(waves * per_wave, opt);
    CHECK(test::compare(got.v(), sequential.v(), sgd_atol, sgd_rtol).bad > 0);
  }
  {
    auto ctx = test::on_mesh(spec);
    const auto opt = adamw{.lr = 1e-2f, .weight_decay = 0.01f};
    constexpr double max_norm = 0.05;  // below the gradients' norms here: every update is clipped
    const auto got = train_wsp<replicate<pipeline<gpipe, small_deep>>>(
        ctx, {}, wsp_options{.wave = per_wave, .in_flight = true, .max_grad_norm = max_norm}, waves * per_wave, opt);
    int clipped = 0;
    const auto want = in_flight_single(waves, per_wave, opt, max_norm, &clipped);
    CHECK(clipped == waves * per_wave);
    const auto d = test::over_ranks(ctx.world(), test::compare(got.v(), want.v(), clip_atol, clip_rtol));
    if (ctx.rank() == 0) MESSAGE("in flight, AdamW + clip, gpipe, " << spec << ": max |wsp - single| = " << d.max_abs);
    CHECK(d.bad == 0);
  }
}

TEST_CASE("wsp in flight: D = 0 over several virtual workers (pipelines) equals one process with stale-by-wave updates, on every rank") {
  const int n = world_size();
  constexpr int waves = 3, per_wave = 2;
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  const auto want = in_flight_single(waves, per_wave, opt, 0);
  auto check = [&]<class P>(const std::string& spec) {
    auto ctx = test::on_mesh(spec);
    const auto got = train_wsp<P>(ctx, {}, wsp_options{.staleness = 0, .wave = per_wave, .in_flight = true}, waves * per_wave, opt);
    const auto d = test::over_ranks(ctx.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE("in flight D=0 on " << spec << ": max |wsp - single| = " << d.max_abs);
    CHECK(d.bad == 0);
  };
  check.template operator()<replicate<small_deep>>("data=" + std::to_string(n));
  if (n >= 4) check.template operator()<replicate<pipeline<one_f_one_b, small_deep>>>("data=" + std::to_string(n / 2) + ",pipe=2");
}

TEST_CASE("wsp in flight: with a slow rank the bound holds; sequential waves record no local staleness; misuse is an error") {
  const int n = world_size();
  {
    auto ctx = test::on_mesh("data=" + std::to_string(n));
    plan_options o;
    o.speeds = speeds_for(n);
    auto net = make<replicate<small_deep>>(ctx, seed{42}, o);
    auto data = batches();
    constexpr int D = 1;
    wsp_trainer t(ctx, net, sgd{.lr = 0.05f}, wsp_options{.staleness = D, .wave = 2, .in_flight = true});
    for (int c = 0; c < 5; ++c) t.wave(data, 2 * c);
    t.finish();
    for (const auto& w : t.waves())
      if (!w.stopped) CHECK(w.wave - w.min_clock <= D);
    for (const auto& r : t.minibatches()) CHECK(r.global_clock >= r.wave - D);  // the weights it ran on
    CHECK_THROWS_WITH_AS(t.step(data, 10), doctest::Contains("call wave(data, first_step)"), std::logic_error);
  }
  {
    auto ctx = test::on_mesh("data=" + std::to_string(n));
    auto net = make<replicate<small_deep>>(ctx, seed{42});
    auto data = batches();
    wsp_trainer t(ctx, net, sgd{.lr = 0.05f}, wsp_options{.wave = 2});
    for (int s = 0; s < 4; ++s) t.step(data, s);
    t.finish();
    for (const auto& r : t.minibatches()) CHECK(r.local_version == r.step);  // each saw every earlier update
    CHECK_THROWS_WITH_AS(t.wave(data, 4), doctest::Contains("set wsp_options::in_flight"), std::logic_error);
    CHECK_THROWS_WITH_AS(wsp_trainer(ctx, net, sgd{}, wsp_options{.max_grad_norm = -1}), doctest::Contains("max_grad_norm"),
                         std::invalid_argument);
  }
}

TEST_CASE("worker cuts: each virtual worker cuts its pipeline for its own ranks, and WSP still trains as one process, on every rank") {
  const int n = world_size();
  if (n < 4) return;  // two workers of two stages
  auto ctx = test::on_mesh("data=2,pipe=2");
  const auto& shape = ctx.mesh().shape();
  plan_options o;
  o.speeds.assign(static_cast<std::size_t>(n), 1.0);
  for (int r = 0; r < n; ++r)  // worker 1's second stage is 3x slower; worker 0 is even
    if (shape.coord(r, axis::data) == 1 && shape.coord(r, axis::pipe) == 1) o.speeds[static_cast<std::size_t>(r)] = 3.0;
  using P = replicate<pipeline<one_f_one_b, small_deep>>;
  // every rank's first-stage blocks under one shared cut and under worker cuts
  auto first_blocks = [&](const plan_options& po) {
    auto net = make<P>(ctx, seed{42}, po);
    std::vector<int> b(2, 0);
    b[static_cast<std::size_t>(shape.coord(ctx.rank(), axis::data))] = net.stage_blocks()[0];
    all_reduce(ctx.world(), view<int>(b.data(), {2}), reduce_op::max);
    return b;
  };
  const auto shared = first_blocks(o);
  plan_options wo = o;
  wo.worker_cuts = true;
  const auto own = first_blocks(wo);
  if (ctx.rank() == 0)
    MESSAGE("first stage's blocks, workers 0 and 1: shared cut " << shared[0] << ", " << shared[1] << "; worker cuts " << own[0]
                                                                 << ", " << own[1]);
  CHECK(shared[0] == shared[1]);  // one cut: the worst case at each position
  CHECK(own[0] < own[1]);         // worker 1 moves blocks off its slow second stage, worker 0 does not
  CHECK(own[1] == shared[1]);
  // WSP at D = 0 over the unlike workers: synchronous training, minibatch by minibatch and in flight
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  {
    auto c2 = test::on_mesh("data=2,pipe=2");
    wo.micro_batches = 2;
    const auto got = train_wsp<P>(c2, wo, wsp_options{.staleness = 0, .wave = 1}, 6, opt);
    const auto want = trained_single<network<small_deep>>(6, opt);
    const auto d = test::over_ranks(c2.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol));
    if (c2.rank() == 0) MESSAGE("worker cuts, wsp D=0: max |wsp - single| = " << d.max_abs);
    CHECK(d.bad == 0);
    wo.micro_batches = 0;
  }
  {
    auto c2 = test::on_mesh("data=2,pipe=2");
    const auto got = train_wsp<P>(c2, wo, wsp_options{.staleness = 0, .wave = 2, .in_flight = true}, 6, opt);
    const auto want = in_flight_single(3, 2, opt, 0);
    const auto d = test::over_ranks(c2.world(), test::compare(got.v(), want.v(), sgd_atol, sgd_rtol));
    if (c2.rank() == 0) MESSAGE("worker cuts, wsp in flight D=0: max |wsp - single| = " << d.max_abs);
    CHECK(d.bad == 0);
    // synchronous data parallelism cannot sum gradients of unlike replicas: an error on every rank
    auto net = make<P>(c2, seed{42}, wo);
    auto data = batches();
    trainer tr(net, opt, test::quiet());
    CHECK_THROWS_WITH_AS(tr.step(data, 0), doctest::Contains("worker_cuts gave each data replica its own stage cut"),
                         std::invalid_argument);
  }
}

TEST_CASE("worker cuts: a plan without a pipeline to cut, or with stage blocks given, is an error naming the option") {
  auto ctx = test::on_mesh("data=" + std::to_string(world_size()));
  plan_options o;
  o.worker_cuts = true;
  CHECK_THROWS_WITH_AS(make<replicate<small_deep>>(ctx, seed{42}, o), doctest::Contains("this plan has none to cut"),
                       std::invalid_argument);
  auto c2 = test::on_mesh("data=1,pipe=" + std::to_string(world_size()));
  o.blocks.assign(static_cast<std::size_t>(world_size()), 0);
  o.blocks[0] = 4;
  CHECK_THROWS_WITH_AS((make<replicate<pipeline<one_f_one_b, small_deep>>>(c2, seed{42}, o)),
                       doctest::Contains("give one or the other"), std::invalid_argument);
}

TEST_CASE("in flight: memory caps count the activations of the minibatches in flight; the trainer checks the plan agrees") {
  const int n = world_size();
  using P = replicate<pipeline<one_f_one_b, small_deep>>;
  auto ctx = test::on_mesh("data=1,pipe=" + std::to_string(n));
  // the smallest cap (same on every rank, MiB, in steps of 2%) that some cut fits
  auto smallest_cap = [&](int in_flight) {
    double cap = 0.005;
    for (; cap < 10; cap *= 1.02) {
      plan_options o;
      o.memory_caps_mib.assign(static_cast<std::size_t>(n), cap);
      o.plan_batch = global_batch;
      o.in_flight = in_flight;
      try {
        auto net = make<P>(ctx, seed{42}, o);
        return cap;
      } catch (const std::invalid_argument&) {
      }
    }
    return cap;
  };
  const double micro = smallest_cap(0), flight = smallest_cap(8);
  if (ctx.rank() == 0) MESSAGE("smallest cap that fits: " << micro << " MiB with the plan's micro-batches, " << flight << " MiB with 8 minibatches in flight");
  if (n > 1) CHECK(flight > micro);  // whole minibatches, several of them, on the first stage
  plan_options o;
  o.memory_caps_mib.assign(static_cast<std::size_t>(n), 10.0);
  auto net = make<P>(ctx, seed{42}, o);
  CHECK_THROWS_WITH_AS(wsp_trainer(ctx, net, sgd{}, wsp_options{.wave = 4, .in_flight = true}),
                       doctest::Contains("plan_options::in_flight = 4"), std::invalid_argument);
  o.in_flight = 2;
  auto net2 = make<P>(ctx, seed{42}, o);
  CHECK_THROWS_WITH_AS(wsp_trainer(ctx, net2, sgd{}, wsp_options{.wave = 4, .in_flight = true}),
                       doctest::Contains("make them agree"), std::invalid_argument);
  o.micro_batches = 2;
  CHECK_THROWS_WITH_AS(make<P>(ctx, seed{42}, o), doctest::Contains("do not also set micro_batches"), std::invalid_argument);
}

TEST_CASE("memory caps: balanced rows follow speed under the caps: a replica whose cap holds fewer rows gets only those, and the plan trains as one process") {
  const int n = world_size();
  if (n < 2) return;  // two replicas at least
  auto ctx = test::on_mesh("data=" + std::to_string(n));
  // what replica 0's rank needs for the even share of a step: its state and activations
  plan_options probe;
  probe.speeds.assign(static_cast<std::size_t>(n), 1.0);
  probe.balance = true;
  auto even = make<replicate<small_deep>>(ctx, seed{42}, probe);
  const auto e = even.predicted_memory(global_batch, 1);
  const index_t even_rows = even.local_batch(global_batch).second;
  // replica 0's cap holds its state and about half its even share's activations; the others are roomy
  const double half = static_cast<double>(e.model_state() + e.comm) + 0.5 * static_cast<double>(e.activations);
  plan_options o = probe;
  o.memory_caps_mib.assign(static_cast<std::size_t>(n), 1024.0);
  o.memory_caps_mib[0] = half / 1048576.0;
  o.plan_batch = global_batch;
  auto net = make<replicate<small_deep>>(ctx, seed{42}, o);
  index_t rows0 = net.local_batch(global_batch).second;
  broadcast(ctx.world(), view<index_t>(&rows0, {1}), 0);
  if (ctx.rank() == 0) MESSAGE("replica 0 under its cap: " << rows0 << " rows of " << global_batch << " (even share " << even_rows << ")");
  CHECK(rows0 < even_rows);
  CHECK(rows0 >= even_rows / 2 - 1);
  CHECK(rows0 >= 1);
  if (ctx.rank() == 0) CHECK(net.predicted_memory(global_batch, 1).total() <= o.memory_caps_mib[0] * 1048576.0);
  const auto d = train_against_single(ctx, net, sgd{.lr = 0.05f, .momentum = 0.9f}, 5);
  if (ctx.rank() == 0) MESSAGE("capped balanced dp at " << n << " ranks: max |dp - single| = " << d.max_abs);
  CHECK(d.bad == 0);
  // a cap that holds the state but no row is an error naming the replica, on every rank
  o.memory_caps_mib[0] = (static_cast<double>(e.model_state() + e.comm) + 1.0) / 1048576.0;
  CHECK_THROWS_WITH_AS(make<replicate<small_deep>>(ctx, seed{42}, o), doctest::Contains("data replica 0's ranks fit no row"),
                       std::invalid_argument);
}

TEST_CASE("wsp: a worker's gradient norm counts its own copy on every worker (clipping under WSP)") {
  const int n = world_size();
  auto check = [&]<class P>(const std::string& spec) {
    auto ctx = test::on_mesh(spec);
    auto net = make<P>(ctx, seed{42});
    auto data = batches();
    const auto [begin, count] = net.local_batch(global_batch);
    const auto b = data.get(0, begin, count);
    step_ctx c;
    c.batch = b.sequences;
    c.seq = b.seq;
    c.global_rows = global_batch;
    net.compute_only_step(c, b.inputs, b.labels);
    // no layer is copied over pipe or model here: the worker's squares are its ranks' own gradients
    double got[2] = {net.grad_squares(true), cpu::sum_squares(net.grads().numel(), net.grads().data())};
    all_reduce(ctx.mesh().comm(axis::pipe | axis::model), view<double>(got, {2}));
    CHECK(got[0] > 0);
    CHECK(got[0] == doctest::Approx(got[1]).epsilon(1e-6));  // the same squares, summed in another order
  };
  check.template operator()<replicate<small_deep>>("data=" + std::to_string(n));
  if (n >= 4) check.template operator()<replicate<pipeline<one_f_one_b, small_deep>>>("data=" + std::to_string(n / 2) + ",pipe=2");
}

namespace {
/// teacher_data whose step `bad` has a NaN in every input row.
struct nan_data {
  using input_type = float;
  teacher_data inner = batches();
  std::int64_t bad = 1;
  tensor<float> poisoned;
  index_t global_batch() const { return inner.global_batch(); }
  index_t seq() const { return inner.seq(); }
  batch_view<float> get(std::int64_t s, index_t begin, index_t count) {
    auto b = inner.get(s, begin, count);
    if (s != bad) return b;
    poisoned = tensor<float>(b.inputs.shape(), mem_kind::workspace);
    copy<float>(b.inputs, poisoned.v());
    for (index_t r = 0; r < count; ++r) poisoned.data()[r * (b.inputs.numel() / count)] = std::nanf("");
    b.inputs = poisoned.v();
    return b;
  }
};
}  // namespace

TEST_CASE("wsp: a NaN loss is an error on every rank of the worker, before any update is pushed (one by one and in flight, on the CPU and on a device)") {
  const int n = world_size();
  using P = replicate<pipeline<one_f_one_b, small_deep>>;
  for (bool device : {false, true})  // the CPU, and the guarded backend's device memory (checks made there)
    for (bool flight : {false, true}) {
      auto ctx = test::on_mesh("data=1,pipe=" + std::to_string(n));
      guarded_backend g;
      plan_options o;
      if (device) o.backend = backend_ref(g);
      auto net = make<P>(ctx, seed{42}, o);
      nan_data data;
      wsp_trainer t(ctx, net, sgd{.lr = 0.05f}, wsp_options{.wave = 2, .in_flight = flight});
      auto run = [&] {
        if (flight) t.wave(data, 0);
        else
          for (int s = 0; s < 2; ++s) t.step(data, s);
      };
      // every rank throws (a rank that did not would hang in the next collective)
      CHECK_THROWS_WITH_AS(run(), doctest::Contains("data step 1: this worker's loss is NaN or infinite"), std::runtime_error);
      CHECK(t.clock() == 0);  // nothing pushed
    }
}

namespace {
/// WSP over plan P on backend `be` for `waves` waves: this rank's parameters
/// after finish() (a host copy), the losses, and, on a guarded backend, the
/// host's waits for the device (synchronisations, its communicators' waits
/// included) and its reads from the device's memory over the waves after the first.
struct wsp_run {
  std::vector<float> params;
  std::vector<double> losses;
  std::int64_t syncs = 0, reads = 0, clock = 0;
};
template <class P, class Opt>
wsp_run wsp_on(context& ctx, backend_ref be, plan_options o, wsp_options w, int waves, Opt opt, const guarded_backend* g = nullptr) {
  o.backend = be;
  auto net = make<P>(ctx, seed{42}, o);
  auto data = batches();
  wsp_trainer t(ctx, net, opt, w);
  wsp_run r;
  auto syncs = [&] { return g ? g->ledger().host_syncs + net.device_host_waits() : 0; };
  auto reads = [&] { return g ? g->ledger().device_to_host : 0; };
  std::int64_t s0 = 0, r0 = 0;
  for (int v = 0; v < waves; ++v) {
    if (v == 1) s0 = syncs(), r0 = reads();
    if (w.in_flight) {
      for (double l : t.wave(data, v * w.wave)) r.losses.push_back(l);
    } else {
      for (int k = 0; k < w.wave; ++k) r.losses.push_back(t.step(data, v * w.wave + k));
    }
  }
  r.syncs = syncs() - s0, r.reads = reads() - r0;
  t.finish();
  r.clock = t.clock();
  r.params.resize(static_cast<std::size_t>(net.params().numel()));
  be.copy(r.params.data(), net.params().data(), r.params.size() * sizeof(float));
  be.synchronize();
  return r;
}
cview<float> as_view(const std::vector<float>& v) { return cview<float>(v.data(), {static_cast<index_t>(v.size())}); }
}  // namespace

TEST_CASE("wsp on a device (the guarded backend): one worker equals the CPU bit for bit, several within rounding; one read a wave") {
  const int n = world_size();
  // One virtual worker over every rank (a pipeline): the holders add one update a wave,
  // in one order, so the device's run must give the CPU's bits, with the checks, the
  // clipping norm (summed over the worker's ranks on the device's communicator, or
  // through host copies) and the scale made in the device's memory.
  auto one_worker = [&]<class P>(const char* what, plan_options o, wsp_options w, auto opt, std::int64_t syncs_a_wave) {
    auto ctx = test::on_mesh("data=1,pipe=" + std::to_string(n));
    constexpr int waves = 3;
    const auto host = wsp_on<P>(ctx, backend_ref{}, o, w, waves, opt);
    for (bool direct : {true, false}) {
      plan_options od = o;
      od.device_collectives = direct;
      guarded_backend g;
      const auto dev = wsp_on<P>(ctx, backend_ref(g), od, w, waves, opt, &g);
      INFO("rank " << ctx.rank() << " of " << n << ", " << what << (direct ? ", the device's communicators" : ", host copies"));
      CHECK(dev.losses == host.losses);
      CHECK(dev.params == host.params);
      CHECK(dev.clock == host.clock);
      for (double l : dev.losses) CHECK(std::isfinite(l));
      if (direct) {  // the wave's read (the update and the figures together), and no other
        CHECK(dev.syncs == (waves - 1) * syncs_a_wave);
        CHECK(dev.reads == (waves - 1) * syncs_a_wave);
      }
    }
  };
  plan_options two;
  two.micro_batches = 2;
  one_worker.template operator()<replicate<pipeline<one_f_one_b, small_deep>>>(
      "sequential waves of 2, adamw clipped to 0.05", two, wsp_options{.wave = 2, .max_grad_norm = 0.05},
      adamw{.lr = 1e-2f, .weight_decay = 0.01f}, 2);  // a minibatch inside a wave reads its loss
  plan_options flight;
  flight.in_flight = 3;  // the plan made for them (its memory check counts 3 minibatches' activations)
  one_worker.template operator()<replicate<pipeline<gpipe, small_deep>>>(
      "waves of 3 in flight, sgd with momentum clipped to 0.05", flight,
      wsp_options{.wave = 3, .in_flight = true, .max_grad_norm = 0.05}, sgd{.lr = 0.05f, .momentum = 0.9f}, 1);
  one_worker.template operator()<replicate<pipeline<one_f_one_b, small_deep>>>(
      "one minibatch a wave, sgd", two, wsp_options{.wave = 1}, sgd{.lr = 0.05f}, 1);
  // bf16 mixed precision (the plan's): the weights rounded for each pass, fp32 updates and holders
  const wsp_options flight_of_2{.wave = 2, .in_flight = true, .max_grad_norm = 0.05};
  plan_options two_flight;
  two_flight.in_flight = 2;
  plan_options two_flight_bf16 = two_flight;
  two_flight_bf16.precision = precision::bf16;
  one_worker.template operator()<replicate<pipeline<one_f_one_b, small_deep>>>(
      "bf16, waves of 2 in flight, adamw clipped to 0.05", two_flight_bf16, flight_of_2, adamw{.lr = 1e-2f}, 1);
  {
    auto ctx = test::on_mesh("data=1,pipe=" + std::to_string(n));
    using P = replicate<pipeline<one_f_one_b, small_deep>>;
    const auto a = wsp_on<P>(ctx, backend_ref{}, two_flight_bf16, flight_of_2, 2, adamw{.lr = 1e-2f});
    const auto b = wsp_on<P>(ctx, backend_ref{}, two_flight, flight_of_2, 2, adamw{.lr = 1e-2f});
    CHECK(a.params != b.params);  // bf16 is not fp32
    REQUIRE(a.losses.size() == b.losses.size());
    for (std::size_t i = 0; i < a.losses.size(); ++i)  // but its losses are close (AdamW flips the sign of some tiny steps)
      CHECK(a.losses[i] == doctest::Approx(b.losses[i]).epsilon(1e-2));
  }
  // Several workers, D = 0: the holders add the workers' updates in the order they
  // arrive, so device and CPU agree within rounding; every rank ends with the same weights.
  {
    auto ctx = test::on_mesh("data=" + std::to_string(n));
    const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
    const wsp_options w{.staleness = 0, .wave = 1};
    const auto host = wsp_on<replicate<small_deep>>(ctx, backend_ref{}, {}, w, 4, opt);
    guarded_backend g;
    const auto dev = wsp_on<replicate<small_deep>>(ctx, backend_ref(g), {}, w, 4, opt, &g);
    const auto d = test::over_ranks(ctx.world(), test::compare(as_view(dev.params), as_view(host.params), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE("wsp D=0 on data=" << n << ", guarded against the CPU: max |diff| = " << d.max_abs);
    CHECK(d.bad == 0);
    std::vector<float> root = dev.params;
    broadcast(ctx.world(), view<float>(root.data(), {static_cast<index_t>(root.size())}), 0);
    CHECK(root == dev.params);
    CHECK(dev.syncs == 3);
    CHECK(dev.reads == 3);
  }
  // Two workers of two stages, each cut for its own ranks' speeds (worker_cuts), in flight.
  if (n >= 4) {
    auto ctx = test::on_mesh("data=2,pipe=2");
    const auto& shape = ctx.mesh().shape();
    plan_options o;
    o.worker_cuts = true;
    o.speeds.assign(static_cast<std::size_t>(n), 1.0);
    for (int r = 0; r < n; ++r)
      if (shape.coord(r, axis::data) == 1 && shape.coord(r, axis::pipe) == 1) o.speeds[static_cast<std::size_t>(r)] = 3.0;
    const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
    const wsp_options w{.staleness = 0, .wave = 2, .in_flight = true};
    using P = replicate<pipeline<one_f_one_b, small_deep>>;
    const auto host = wsp_on<P>(ctx, backend_ref{}, o, w, 3, opt);
    guarded_backend g;
    const auto dev = wsp_on<P>(ctx, backend_ref(g), o, w, 3, opt, &g);
    const auto d = test::over_ranks(ctx.world(), test::compare(as_view(dev.params), as_view(host.params), sgd_atol, sgd_rtol));
    if (ctx.rank() == 0) MESSAGE("worker cuts, in flight, guarded against the CPU: max |diff| = " << d.max_abs);
    CHECK(d.bad == 0);
    CHECK(dev.syncs == 2);
  }
}

namespace {
/// Optimizer O without the overload that writes its step's change
/// (DeltaOptimizer): WSP then takes each wave's update from a snapshot.
template <class O> struct without_delta : O {
  static constexpr bool writes_delta = false;
  void update(typename O::state& s, view<float> p, cview<float> g, const backend_ref& be = {},
              kernels::update_gate gate = {}, float* copy = nullptr) const {
    O::update(s, p, g, be, gate, copy);
  }
};
/// An optimizer whose update takes an update_delta and ignores it, without
/// the writes_delta flag: not a DeltaOptimizer.
template <class O> struct accepts_delta : without_delta<O> {
  void update(typename O::state& s, view<float> p, cview<float> g, const backend_ref& be = {},
              kernels::update_gate gate = {}, float* copy = nullptr, kernels::update_delta = {}) const {
    O::update(s, p, g, be, gate, copy);
  }
};
}  // namespace

TEST_CASE("wsp: a wave of one minibatch takes its update from the optimizer's pass, the same bits as from a snapshot, on the CPU and a device") {
  const int n = world_size();
  static_assert(DeltaOptimizer<sgd> && DeltaOptimizer<adamw> && !DeltaOptimizer<without_delta<sgd>>);
  static_assert(!DeltaOptimizer<accepts_delta<sgd>>);  // an overload that takes the argument is not taken for one that writes it
  auto same = [&]<class P>(const char* what, const std::string& spec, plan_options o, wsp_options w, auto opt) {
    auto ctx = test::on_mesh(spec);
    {  // which path each trainer takes
      auto net = make<P>(ctx, seed{42}, o);
      CHECK(wsp_trainer(ctx, net, opt, w).update_from_optimizer() == (w.wave == 1 && !w.in_flight));
      CHECK_FALSE(wsp_trainer(ctx, net, without_delta<decltype(opt)>{opt}, w).update_from_optimizer());
    }
    for (bool device : {false, true}) {
      guarded_backend g;
      const backend_ref be = device ? backend_ref(g) : backend_ref{};
      const auto fused = wsp_on<P>(ctx, be, o, w, 4, opt);
      const auto snapshot = wsp_on<P>(ctx, be, o, w, 4, without_delta<decltype(opt)>{opt});
      INFO("rank " << ctx.rank() << " of " << n << ", " << what << (device ? ", guarded" : ", CPU"));
      CHECK(fused.losses == snapshot.losses);
      CHECK(fused.params == snapshot.params);
    }
  };
  // one worker over every rank: the holders add one update a wave, in one order, so the
  // bits can be compared (its share is 1; a share below 1 on this path is checked bit for
  // bit against a snapshot in test_data_optim, and against one process by the test
  // "wsp: D = 0, one minibatch a wave" over several workers)
  plan_options two;
  two.micro_batches = 2;
  using P = replicate<pipeline<one_f_one_b, small_deep>>;
  const std::string one = "data=1,pipe=" + std::to_string(n);
  same.template operator()<P>("sgd", one, two, wsp_options{.wave = 1}, sgd{.lr = 0.05f});
  same.template operator()<P>("sgd with momentum", one, two, wsp_options{.wave = 1}, sgd{.lr = 0.05f, .momentum = 0.9f});
  same.template operator()<P>("adamw clipped to 0.05", one, two, wsp_options{.wave = 1, .max_grad_norm = 0.05},
                              adamw{.lr = 1e-2f, .weight_decay = 0.01f});
  plan_options two_bf16 = two;
  two_bf16.precision = precision::bf16;
  same.template operator()<P>("bf16, adamw", one, two_bf16, wsp_options{.wave = 1}, adamw{.lr = 1e-2f});
  same.template operator()<P>("waves of 2 (a snapshot both ways)", one, two, wsp_options{.wave = 2}, sgd{.lr = 0.05f});
}

TEST_CASE("wsp on a device: a NaN loss is an error on every rank of the worker, before any update is pushed; no stage applies it") {
  const int n = world_size();
  using P = replicate<pipeline<one_f_one_b, small_deep>>;
  // minibatch 1 of a wave of 2 is poisoned: every stage keeps minibatch 0's update and no other,
  // as a run of minibatch 0 alone leaves them
  for (double clip : {0.0, 0.05}) {
    auto ctx = test::on_mesh("data=1,pipe=" + std::to_string(n));
    const wsp_options w{.wave = 2, .max_grad_norm = clip};
    // minibatch 0 on a device, then `then(trainer, data)`; this rank's parameters after it
    auto on_device = [&](auto&& then) {
      guarded_backend g;
      plan_options o;
      o.backend = backend_ref(g);
      auto net = make<P>(ctx, seed{42}, o);
      nan_data data;
      wsp_trainer t(ctx, net, sgd{.lr = 0.05f}, w);
      t.step(data, 0);
      then(t, data);
      std::vector<float> params(static_cast<std::size_t>(net.params().numel()));
      backend_ref(g).copy(params.data(), net.params().data(), params.size() * sizeof(float));
      backend_ref(g).synchronize();
      return params;
    };
    const auto want = on_device([](auto&, auto&) {});
    const auto got = on_device([](auto& t, auto& data) {
      CHECK_THROWS_WITH_AS(t.step(data, 1), doctest::Contains("data step 1: this worker's loss is NaN or infinite"), std::runtime_error);
      CHECK(t.minibatches().size() == 1);  // the record of the minibatch not applied is gone
      CHECK_THROWS_WITH_AS(t.step(data, 2), doctest::Contains("this trainer stopped at a fault"), std::logic_error);
    });
    CHECK(got == want);  // on every rank: the faulty minibatch's update was gated everywhere
  }
}
