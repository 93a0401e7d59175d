// auto_plan<M>: the planner prices every candidate plan on the job's mesh with
// a device profile and runs the fastest that fits; the plan it runs trains as
// single-process training does (parameters after 5 steps, every rank), every
// rank makes the same choice, a memory limit is respected (and one that no
// plan fits is a clear error listing every candidate), and missing inputs are
// clear errors (a missing profile is measured: mpi_auto_profile.cpp). At 1, 2 and 4 ranks; on a data x pipe mesh where the world is even.
// Tensor parallelism (split<M> on a data x model reshaping) and the class-split
// head are chosen where they move the fewest bytes, and train as single-process
// training with SGD and with AdamW + clipping; 3-D plans are priced on data x
// pipe x model meshes, and on pipe:2 x model:2 (4 ranks) one runs and trains as
// single-process training.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <sstream>
#include <string>

#include "support/plan_check.hpp"
#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/recompute.hpp"
#include "whale/nn/relu.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/train/trainer.hpp"

using namespace whale;

namespace {
// Legend: V vocabulary, S max positions, D width, H heads, F FFN width, L blocks.
using small_gpt = models::gpt_model<256, 32, 32, 2, 64, 4>;
constexpr index_t batch = 8, seq = 32;
constexpr int n_steps = 5;
// Tolerance of every plan against single-process SGD (as the plans' own tests): fp32 sums in another order.
constexpr double atol = 1e-5, rtol = 1e-4;

plan_options auto_options(double memory_limit_mib = 0) {
  plan_options o;
  o.profile = std::string(WHALE_PROFILES_DIR) + "/vm-2.txt";
  o.plan_batch = batch;
  o.plan_seq = seq;
  o.memory_limit_mib = memory_limit_mib;
  return o;
}

// A profile file on every rank's path (rank 0 writes it): collectives of `coll_gbps`
// and point-to-point messages of `p2p_gbps` (GB/s, 1 us latency), GEMMs at 100 GFLOP/s.
std::string temp_profile(const context& ctx, const std::string& name, double coll_gbps, double p2p_gbps,
                         const std::string& extra = "") {
  long id = static_cast<long>(::getpid());
  broadcast(ctx.world(), view<long>(&id, {1}), 0);
  const auto path = (std::filesystem::temp_directory_path() / ("whale-" + name + "-" + std::to_string(id) + ".txt")).string();
  if (ctx.rank() == 0) {
    std::ofstream f(path);
    f << "device " << name << "\ngemm 64 64 64 0 0 100\nbandwidth 10\n";
    for (const char* k : {"all_reduce", "all_gather", "reduce_scatter", "broadcast"})
      f << "link node " << k << " 2 1 " << coll_gbps << "\n";
    f << "link node p2p 2 1 " << p2p_gbps << "\n" << extra;
  }
  barrier(ctx.world());
  return path;
}

// Trains the chosen plan of auto_plan<M> and single-process M on the same batches, each from
// `data()` (SGD; with `adamw_too`, then AdamW with every step clipped); every rank compares all parameters.
template <class M, class Data>
void trains_as_single(const context& ctx, const plan_options& o, Data data, bool adamw_too) {
  for (int opt = 0; opt < (adamw_too ? 2 : 1); ++opt) {
    auto net = make<auto_plan<M>>(ctx, seed{42}, o);
    if (ctx.rank() == 0 && opt == 0) {
      std::ostringstream os;
      os << net;
      MESSAGE("ranks " << ctx.size() << ", mesh " << ctx.mesh().shape() << ":\n" << os.str().substr(0, 900));
    }
    // every rank chose the same plan (its label names the type, micro-batches and mesh)
    int idx = static_cast<int>(std::hash<std::string>{}(net.choice().label) % 1000000007u), root = idx;
    broadcast(ctx.world(), view<int>(&root, {1}), 0);
    CHECK(idx == root);
    network<M> single(seed{42});
    auto run = [&](auto& n) {
      auto d = data();
      auto to = test::quiet();
      if (opt == 0) {
        trainer t(n, sgd{.lr = 0.05f, .momentum = 0.9f}, to);
        t.run(d, steps{n_steps});
      } else {
        to.max_grad_norm = 0.05;  // below the gradients' norm: every step is clipped
        trainer t(n, adamw{.lr = 1e-3f, .weight_decay = 0.01f}, to);
        t.run(d, steps{n_steps});
      }
    };
    run(net);
    run(single);
    const auto diff = test::compare(net.full_params(), single.params(), atol, rtol);
    INFO("chosen " << net.choice().label << std::string(opt ? ", AdamW + clipping" : ", SGD") << ": max |auto - single| = "
                   << diff.max_abs);
    CHECK(diff.bad == 0);
  }
}
// The same on small_gpt's Markov-chain tokens.
template <class M = small_gpt> void check_trains_as_single(const context& ctx, const plan_options& o, bool adamw_too = false) {
  trains_as_single<M>(ctx, o, [] { return markov_data(seed{7}, small_gpt::vocab, seq, batch); }, adamw_too);
}
}  // namespace

TEST_CASE("auto_plan<gpt> runs the fastest predicted plan, which trains as single-process training on every rank") {
  auto ctx = context::init();
  check_trains_as_single(ctx, auto_options());
}

TEST_CASE("auto_plan on a data x pipe mesh chooses among pipelines and trains as single-process training") {
  auto probe = context::init();
  if (probe.size() % 2 != 0) return;  // one rank: no pipe axis to give
  auto ctx = test::on_mesh("data=" + std::to_string(probe.size() / 2) + ",pipe=2");
  auto net = make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options());
  CHECK(net.choice().label.rfind("pipeline", 0) == 0);  // dp and ZeRO cannot use the pipe axis
  for (const auto& c : net.ranking())
    if (c.label.rfind("pipeline", 0) != 0) CHECK(!c.valid);
  check_trains_as_single(ctx, auto_options());
}

TEST_CASE("auto_plan on a data-only mesh also reshapes the world into data x pipe, and the reshaped pipeline trains as single-process") {
  auto ctx = context::init();
  if (ctx.size() == 1) return;  // one rank: nothing to reshape
  // a device whose collectives are slow and messages fast: a pipeline over every rank wins
  const auto path = temp_profile(ctx, "slow-collectives", 0.001, 100);
  auto o = auto_options();
  o.profile = path;
  {
    auto net = make<auto_plan<small_gpt>>(ctx, seed{42}, o);
    const std::string whole = "on data=1,pipe=" + std::to_string(ctx.size()) + ",model=1";
    INFO("chosen: " << net.choice().label);
    CHECK(net.choice().label.find(whole) != std::string::npos);
    CHECK(net.choice().mesh == "data=1,pipe=" + std::to_string(ctx.size()) + ",model=1");
    int reshaped = 0;
    for (const auto& c : net.ranking()) reshaped += c.label.find(" on data=") != std::string::npos && c.valid;
    CHECK(reshaped >= 3);  // m = p, 2p, 4p on at least one reshaping
  }
  check_trains_as_single(ctx, o);
  barrier(ctx.world());
  if (ctx.rank() == 0) std::filesystem::remove(path);
}

TEST_CASE("auto_plan respects a memory limit, and a limit no plan fits is an error naming every candidate") {
  auto ctx = context::init();
  auto free_choice = make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options());
  double least = 1e300, most = 0;
  for (const auto& c : free_choice.ranking())
    if (c.valid) least = std::min(least, c.memory_mib), most = std::max(most, c.memory_mib);
  REQUIRE(least < 1e300);
  // a limit just above the smallest plan: the choice fits it
  auto tight = make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options(least * 1.0001));
  CHECK(tight.choice().memory_mib <= least * 1.0001);
  for (const auto& c : tight.ranking())
    if (c.valid && c.memory_mib > least * 1.0001) CHECK(!c.fits);
  if (ctx.size() > 1) CHECK(most > least);  // sharding saves memory when there is more than one rank
  // below every plan: an error that lists them
  CHECK_THROWS_WITH_AS(make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options(least * 0.5)),
                       doctest::Contains("no candidate plan runs on the mesh"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options(least * 0.5)),
                       doctest::Contains("zero3: needs"), std::invalid_argument);
}

// (without a profile it measures one at start: tests/mpi_auto_profile.cpp)
TEST_CASE("auto_plan without a batch to price, or with a profile it cannot read, is a clear error") {
  auto ctx = context::init();
  auto o = auto_options();
  o.plan_batch = 0;
  CHECK_THROWS_WITH_AS(make<auto_plan<small_gpt>>(ctx, seed{42}, o), doctest::Contains("plan_batch"),
                       std::invalid_argument);
  o = auto_options();
  o.profile = "/nonexistent/profile.txt";
  CHECK_THROWS_AS(make<auto_plan<small_gpt>>(ctx, seed{42}, o), std::exception);
}

// One precision, the plan's (plan_options::precision): auto_plan prices every candidate
// in it (bf16's fp32 master weights, and no ZeRO-3, which bf16 refuses), with an analytic
// profile as with one that times bf16 kernels; a profile that times the other precision's
// kernels is refused when the plan is made, naming both, on every rank; the trainer trains
// in the plan's precision without being told.
TEST_CASE("auto_plan in bf16 (plan_options::precision): every candidate priced in it, ZeRO-3 refused, a profile of the other precision refused, and the trainer trains in bf16") {
  auto ctx = context::init();
  const auto bf16_kernels = temp_profile(ctx, "bf16-kernels", 10, 10, "kernels bf16 3\n");
  const auto fp32_kernels = temp_profile(ctx, "fp32-kernels", 10, 10, "kernels fp32 3\n");
  auto in_bf16 = [](plan_options o, const std::string& profile) {
    o.precision = precision::bf16;
    o.profile = profile;
    return o;
  };
  const auto fp32_analytic = make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options());
  CHECK(fp32_analytic.precision() == precision::fp32);
  CHECK_FALSE(fp32_analytic.priced_bf16().has_value());
  for (const std::string& profile : {auto_options().profile, bf16_kernels}) {
    INFO("profile " << profile);
    auto net = make<auto_plan<small_gpt>>(ctx, seed{42}, in_bf16(auto_options(), profile));
    CHECK(net.precision() == precision::bf16);
    CHECK(net.priced_bf16().has_value() == (profile == bf16_kernels));
    CHECK(net.zero_level_now() != 3);
    for (const auto& c : net.ranking()) {
      INFO(c.label);
      if (c.label.find("zero3") != std::string::npos) {
        CHECK_FALSE(c.valid);
        CHECK(c.why.find("bf16 mixed precision with ZeRO-3") != std::string::npos);
      }
      if (profile != bf16_kernels && c.valid)  // the same candidate in fp32 needs less: no master weights
        for (const auto& f : fp32_analytic.ranking())
          if (f.label == c.label && f.valid) CHECK(c.memory_mib > f.memory_mib);
    }
    trainer t(net, sgd{.lr = 0.05f}, test::quiet());  // in the plan's precision: nothing to set
    auto d = markov_data(seed{7}, small_gpt::vocab, seq, batch);
    const auto r = t.run(d, steps{2});
    CHECK(std::isfinite(r.losses.back()));
  }
  CHECK_THROWS_WITH_AS(make<auto_plan<small_gpt>>(ctx, seed{42}, in_bf16(auto_options(), fp32_kernels)),
                       doctest::Contains("the device profile times its kernels in fp32 (its 'kernels' line), but the plan "
                                         "trains in bf16 (plan_options::precision, --precision)"),
                       std::invalid_argument);
  auto fp32_plan = auto_options();
  fp32_plan.profile = bf16_kernels;
  CHECK_THROWS_WITH_AS(make<auto_plan<small_gpt>>(ctx, seed{42}, fp32_plan),
                       doctest::Contains("times its kernels in bf16 (its 'kernels' line), but the plan trains in fp32"),
                       std::invalid_argument);
  barrier(ctx.world());
  if (ctx.rank() == 0) std::filesystem::remove(bf16_kernels), std::filesystem::remove(fp32_kernels);
}

// plan_options::plan_tie: candidates predicted within that fraction of the
// fastest tie, and the one listed first (the simplest: dp, ZeRO 1-3,
// pipelines, tensor parallelism) runs; the others keep their order.
TEST_CASE("prefer_simpler moves the simplest candidate within the band to the front, and only it") {
  auto choice = [](const char* label, int order, double step, bool valid = true, bool fits = true) {
    plan_choice c;
    c.label = label, c.order = order, c.step_s = step, c.valid = valid, c.fits = fits;
    return c;
  };
  auto labels = [](const std::vector<plan_choice>& cs) {
    std::string l;
    for (const auto& c : cs) l += c.label + std::string(c.tie ? "*" : "") + " ";
    return l;
  };
  // ranked by time: tp 1.00, zero1 1.01, dp 1.015, zero3 1.03, then one over memory and one that cannot run
  const std::vector<plan_choice> ranked = {choice("tp", 5, 1.00), choice("zero1", 1, 1.01), choice("dp", 0, 1.015),
                                           choice("zero3", 3, 1.03), choice("big", 0, 0.5, true, false),
                                           choice("bad", 0, 0, false)};
  auto with = [&](double tie) {
    auto cs = ranked;
    prefer_simpler(cs, tie);
    return labels(cs);
  };
  CHECK(with(0.0) == "tp zero1 dp zero3 big bad ");        // no band: the fastest
  CHECK(with(0.005) == "tp zero1 dp zero3 big bad ");      // nothing simpler within 0.5%
  CHECK(with(0.012) == "zero1* tp dp zero3 big bad ");     // zero1 within 1.2%, dp not
  CHECK(with(0.02) == "dp* tp zero1 zero3 big bad ");      // dp within 2%: the simplest
  CHECK(with(0.9) == "dp* tp zero1 zero3 big bad ");       // never one over memory or unable to run
  std::vector<plan_choice> none = {choice("bad", 0, 0, false)};
  prefer_simpler(none, 0.5);  // nothing runnable: unchanged
  CHECK(labels(none) == "bad ");
}

// With a memory limit, a near-tie choice must leave tie_headroom (10%) of it
// free: the simplest plan of the band that does, else the simplest of all.
TEST_CASE("prefer_simpler with a memory limit: the simplest plan of the band that leaves 10% free") {
  auto choice = [](const char* label, int order, double step, double mib) {
    plan_choice c;
    c.label = label, c.order = order, c.step_s = step, c.memory_mib = mib, c.valid = true, c.fits = true;
    return c;
  };
  auto pick = [](std::vector<plan_choice> cs, double limit) {
    prefer_simpler(cs, 0.02, limit);
    return cs.front().label + (cs.front().tie ? "*" : "");
  };
  // ranked by time: tp 1.00 (50 MiB), zero1 1.005 (95 MiB), dp 1.01 (96 MiB)
  const std::vector<plan_choice> a = {choice("tp", 5, 1.00, 50), choice("zero1", 1, 1.005, 95), choice("dp", 0, 1.01, 96)};
  CHECK(pick(a, 0) == "dp*");      // no limit: the simplest
  CHECK(pick(a, 200) == "dp*");    // all leave 10% of 200 free
  CHECK(pick(a, 100) == "tp");     // only tp leaves 10% of 100 free: the fastest stays
  CHECK(pick(a, 105.6) == "zero1*");  // zero1 (95 <= 95.04) leaves it, dp (96) does not
  CHECK(pick(a, 50) == "dp*");     // none leaves it (a limit under every plan is the caller's filter): the simplest
  // a simpler front plan without room loses to a roomy one of the band
  const std::vector<plan_choice> c = {choice("dp", 0, 1.00, 96), choice("tp", 5, 1.01, 50)};
  CHECK(pick(c, 100) == "tp*");
  // a roomy plan outside the band never wins
  const std::vector<plan_choice> b = {choice("tp", 5, 1.00, 99), choice("dp", 0, 1.05, 10)};
  CHECK(pick(b, 100) == "tp");
}

TEST_CASE("auto_plan's ranking applies plan_tie on every rank; a band outside [0, 1) is an error") {
  auto ctx = context::init();
  const auto dev = device_profile::load(auto_options().profile);
  const auto& mesh = ctx.mesh().shape();
  auto o = auto_options();
  o.plan_tie = 0;
  const auto exact = rank_auto_plans<small_gpt>(mesh, o, dev);
  CHECK(!exact.front().tie);
  for (const auto& c : exact)
    if (c.valid && c.fits) CHECK(c.step_s >= exact.front().step_s);  // no band: the fastest prediction
  for (const double band : {0.02, 0.1, 0.5}) {
    o.plan_tie = band;
    const auto r = rank_auto_plans<small_gpt>(mesh, o, dev);
    INFO("plan_tie " << band << ": chose " << r.front().label << ", fastest " << exact.front().label);
    REQUIRE(r.size() == exact.size());
    // the ranking without a band, with one candidate moved to the front
    auto expect = exact;
    prefer_simpler(expect, band);
    for (std::size_t i = 0; i < r.size(); ++i) CHECK(r[i].label == expect[i].label);
    CHECK(r.front().step_s <= exact.front().step_s * (1 + band));
    for (const auto& c : r)  // no simpler candidate within the band
      if (c.valid && c.fits && c.step_s <= exact.front().step_s * (1 + band)) CHECK(r.front().order <= c.order);
    CHECK(r.front().tie == (r.front().label != exact.front().label));
  }
  for (const double bad : {-0.01, 1.0, std::nan("")}) {
    o.plan_tie = bad;
    CHECK_THROWS_WITH_AS(rank_auto_plans<small_gpt>(mesh, o, dev), doctest::Contains("plan_tie must be in [0, 1)"),
                         std::invalid_argument);
  }
}

TEST_CASE("auto_plan checkpoints through the plan it chose: saved, loaded by single-process training, identical") {
  namespace fs = std::filesystem;
  auto ctx = context::init();
  long id = static_cast<long>(::getpid());
  broadcast(ctx.world(), view<long>(&id, {1}), 0);
  const auto dir = (fs::temp_directory_path() / ("whale-auto-ckpt-" + std::to_string(id))).string();
  if (ctx.rank() == 0) fs::remove_all(dir);
  barrier(ctx.world());
  auto net = make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options());
  {
    markov_data d(seed{7}, small_gpt::vocab, seq, batch);
    trainer t(net, adamw{.lr = 1e-3f}, test::quiet());
    t.run(d, steps{3});
    t.save(dir);
  }
  const auto saved = net.full_params();
  network<small_gpt> single(seed{5});
  trainer ts(single, adamw{.lr = 1e-3f}, test::quiet());
  ts.load(dir);
  CHECK(test::compare(single.params(), saved, 0, 0).max_abs == 0.0);  // every rank reads the same bits
  barrier(ctx.world());
  if (ctx.rank() == 0) fs::remove_all(dir);
}

namespace {
// Wide layers and a small batch: plans that move activations (tensor parallel, a
// class-split head) send far fewer bytes than those that sum every gradient (dp, ZeRO).
// Legend: rows are samples of 16 features, C classes.
// 18 classes: the head splits 2 ways, not 4.
using wide_mlp = sequential<linear<16, 512>, gelu, linear<512, 512>, gelu, linear<512, 18>, softmax_cross_entropy>;
constexpr index_t wide_classes = 18;
using wide_head = sequential<sequential<linear<16, 32>, relu>, sequential<linear<32, 4096>, softmax_cross_entropy>>;
static_assert(splittable<wide_mlp> && splittable<wide_head> && splittable<small_gpt>);
static_assert(!splittable<sequential<linear<4, 4>, repeat<2, recompute<sequential<linear<4, 4>, gelu>>>, softmax_cross_entropy>>,
              "a recompute inside is refused by split<M>, so it is not splittable");
static_assert(!splittable<sequential<replicate<linear<4, 4>>, softmax_cross_entropy>>,
              "a strategy inside is refused by split<M>, so it is not splittable");
static_assert(!detail::head_split<wide_mlp>::ok && detail::head_split<wide_head>::ok && !detail::head_split<small_gpt>::ok);

// Trains auto_plan<M>'s choice and single-process M on a teacher's samples (SGD, then
// AdamW with every step clipped); every rank compares all parameters.
template <class M>
void check_choice_trains_as_single(const context& ctx, const plan_options& o, index_t classes) {
  trains_as_single<M>(ctx, o, [=] { return teacher_data(seed{7}, 16, classes, batch); }, true);
}
}  // namespace

TEST_CASE("auto_plan prices tensor parallelism on every data x model reshaping, chooses it for wide layers, and it trains as single-process") {
  auto ctx = context::init();
  // a slow network (50 MB/s): bytes decide, and tensor parallelism sends activations, not 1 MiB of gradients
  auto o = auto_options();
  o.profile = temp_profile(ctx, "slow-network", 0.05, 0.05);
  auto net = make<auto_plan<wide_mlp>>(ctx, seed{42}, o);
  int tensor = 0, valid = 0;
  for (const auto& c : net.ranking())
    if (c.label.rfind("tensor parallel on data=", 0) == 0) {
      INFO(c.label << ": " << c.why);
      ++tensor, valid += c.valid;
      // 18 classes do not split 4 ways: a reason the candidate cannot run, not an error
      if (c.mesh == "data=1,pipe=1,model=4") CHECK(c.why.find("cannot be split 4 ways") != std::string::npos);
      else CHECK(c.valid);
    }
  const int n = ctx.size();
  CHECK(tensor == (n == 1 ? 0 : n == 2 ? 1 : 2));  // model = 2 (and 4) of the world's ranks
  CHECK(valid == (n == 1 ? 0 : 1));
  if (ctx.rank() == 0) {
    std::ostringstream os;
    os << net;
    MESSAGE("ranks " << n << ":\n" << os.str().substr(0, 1200));
  }
  if (n > 1) {
    INFO("chosen: " << net.choice().label);
    CHECK(net.choice().label.rfind("tensor parallel on data=", 0) == 0);
    CHECK(net.choice().mesh.find(",model=1") == std::string::npos);
  }
  check_choice_trains_as_single<wide_mlp>(ctx, o, wide_classes);
  barrier(ctx.world());
  if (ctx.rank() == 0) std::filesystem::remove(o.profile);
}

namespace {
// On a data x model mesh only the tensor-parallel candidate of auto_plan<M> can run, and it is chosen.
template <class M> void only_tensor_parallel_runs(const context& ctx) {
  auto net = make<auto_plan<M>>(ctx, seed{42}, auto_options());
  CHECK(net.choice().label == "tensor parallel");
  for (const auto& c : net.ranking())
    if (c.label != "tensor parallel") CHECK(!c.valid);
}
}  // namespace

TEST_CASE("auto_plan on a data x model mesh prices tensor parallelism on it, and only it can run there") {
  auto probe = context::init();
  if (probe.size() == 1) return;
  {
    auto ctx = test::on_mesh("data=" + std::to_string(probe.size() / 2) + ",model=2");
    only_tensor_parallel_runs<wide_mlp>(ctx);
    check_choice_trains_as_single<wide_mlp>(ctx, auto_options(), wide_classes);
  }
}

TEST_CASE("auto_plan prices 3-D plans (tensor parallelism inside pipeline stages); on a pipe x model mesh only they run, and train as single-process") {
  auto probe = context::init();
  const auto dev = device_profile::load(auto_options().profile);
  // pure: every rank ranks a data:1 x pipe:2 x model:2 mesh, and a data-only mesh of 4 ranks reshaped
  const auto cs = rank_auto_plans<small_gpt>(mesh_shape(1, 2, 2), auto_options(), dev);
  int three_d = 0, recomputed = 0;
  for (const auto& c : cs) {
    INFO(c.label << ": " << c.why);
    if (c.label.rfind("3-D 1f1b m=", 0) == 0) {
      ++(c.label.find(" recompute") == std::string::npos ? three_d : recomputed);
      CHECK(c.valid);
      CHECK(c.label.find(" zero") == std::string::npos);  // one data rank: no ZeRO to price
    } else {
      CHECK(!c.valid);  // nothing else uses both the pipe and the model axis
    }
  }
  CHECK(three_d == 3);     // m = 2, 4, 8
  CHECK(recomputed == 3);  // the same with each block recomputed
  CHECK(cs.front().label.rfind("3-D 1f1b m=", 0) == 0);
  int reshaped = 0;
  for (const auto& c : rank_auto_plans<small_gpt>(mesh_shape(4, 1, 1), auto_options(), dev))
    reshaped += c.valid && c.label.rfind("3-D 1f1b m=", 0) == 0 && c.mesh == "data=1,pipe=2,model=2";
  CHECK(reshaped == 6);
  if (probe.size() != 4) return;
  auto ctx = test::on_mesh("pipe=2,model=2");
  {
    auto net = make<auto_plan<small_gpt>>(ctx, seed{42}, auto_options());
    CHECK(net.choice().label.rfind("3-D 1f1b m=", 0) == 0);
  }
  check_trains_as_single(ctx, auto_options());
}

TEST_CASE("auto_plan prices 3-D plans with ZeRO 1-3 and recompute where the data axis has ranks: less memory, chosen when only they fit") {
  auto probe = context::init();
  const auto dev = device_profile::load(auto_options().profile);
  // pure: every rank ranks a data:2 x pipe:2 x model:2 mesh (8 ranks), where only 3-D plans run,
  // with a global batch of 16 sequences (8 a replica: 2, 4 and 8 micro-batches divide it); a
  // gpt of 16 wider blocks (3.2 M parameters), whose state outweighs the whole layers ZeRO 2-3
  // hold while they reduce-scatter or gather one (with small_gpt, ZeRO-2 is predicted 0.04 MiB
  // above ZeRO-1 per rank; with 4 blocks of this width and a 4096-token vocabulary, 1.4 MiB)
  using wide_gpt = models::gpt_model<256, 32, 128, 2, 512, 16>;
  auto o = auto_options();
  o.plan_batch = 16;
  auto cs = rank_auto_plans<wide_gpt>(mesh_shape(2, 2, 2), o, dev);
  // "m=K" -> predicted memory by ZeRO level (0-3), without and with recompute
  std::map<std::string, std::array<double, 4>> plain, rec;  // -1: not priced
  for (const auto& c : cs) {
    INFO(c.label << ": " << c.why);
    if (c.label.rfind("3-D 1f1b m=", 0) != 0) {
      CHECK(!c.valid);
      continue;
    }
    CHECK(c.valid);
    const auto m = c.label.substr(9, c.label.find(' ', 9) - 9);
    const auto z = c.label.find(" zero");
    const int level = z == std::string::npos ? 0 : c.label[z + 5] - '0';
    REQUIRE((level >= 0 && level <= 3));
    auto& to = c.label.find(" recompute") != std::string::npos ? rec : plain;
    if (!to.count(m)) to[m] = {-1, -1, -1, -1};
    to[m][static_cast<std::size_t>(level)] = c.memory_mib;
  }
  REQUIRE(plain.size() == 3);  // m = 2, 4, 8 each
  REQUIRE(rec.size() == 3);
  double smallest = 1e300;
  for (const auto& [m, mib] : plain) {
    INFO("m=" << m << ": " << mib[0] << " / " << mib[1] << " / " << mib[2] << " / " << mib[3]
              << " MiB at ZeRO 0-3; recomputed " << rec[m][0] << " / " << rec[m][1] << " / " << rec[m][2] << " / "
              << rec[m][3]);
    for (std::size_t l = 0; l < 4; ++l) {  // every level priced, with and without recompute
      CHECK(mib[l] > 0);
      CHECK(rec[m][l] > 0);
    }
    CHECK(mib[1] < mib[0]);  // the optimizer state halved over data:2
    CHECK(mib[2] < mib[1]);  // and the gradients
    CHECK(mib[3] < mib[2]);  // and the parameters
    for (std::size_t l = 0; l < 4; ++l) CHECK(rec[m][l] < mib[l]);  // a block's inner activations are not kept
    smallest = std::min(smallest, mib[0]);
  }
  // without a limit the front is the fastest, or the simplest (first listed) of those within plan_tie of it
  double fastest = 1e300;
  for (const auto& c : cs)
    if (c.valid) fastest = std::min(fastest, c.step_s);
  CHECK(cs.front().step_s <= fastest * (1 + o.plan_tie));
  for (const auto& c : cs)
    if (c.valid && c.step_s <= fastest * (1 + o.plan_tie)) CHECK(cs.front().order <= c.order);
  // a limit under every plain 3-D plan: a sharded or recomputed one is chosen
  o.memory_limit_mib = smallest - 0.001;
  cs = rank_auto_plans<wide_gpt>(mesh_shape(2, 2, 2), o, dev);
  REQUIRE(cs.front().valid);
  CHECK(cs.front().fits);
  auto plain_3d = [](const std::string& l) {
    return l.find(" zero") == std::string::npos && l.find(" recompute") == std::string::npos;
  };
  CHECK(!plain_3d(cs.front().label));
  for (const auto& c : cs)
    if (c.valid && plain_3d(c.label)) CHECK(!c.fits);
  // a limit under every 3-D plan but those with ZeRO-3: one of them is chosen
  double under = 1e300;
  for (const auto& c : cs)
    if (c.valid && c.label.find(" zero3") == std::string::npos) under = std::min(under, c.memory_mib);
  o.memory_limit_mib = under - 0.001;
  cs = rank_auto_plans<wide_gpt>(mesh_shape(2, 2, 2), o, dev);
  REQUIRE(cs.front().fits);
  INFO("chosen under " << o.memory_limit_mib << " MiB: " << cs.front().label);
  CHECK(cs.front().label.find(" zero3") != std::string::npos);
  // a data-only world of 8 is reshaped into it too; one of 4 has no data axis left for ZeRO
  o.memory_limit_mib = 0;
  int reshaped = 0;
  for (const auto& c : rank_auto_plans<small_gpt>(mesh_shape(8, 1, 1), o, dev))
    for (const char* z : {" zero1", " zero2", " zero3"})
      reshaped += c.valid && c.label.find(z + std::string(" on data=2,pipe=2,model=2")) != std::string::npos;
  CHECK(reshaped == 9);
  for (const auto& c : rank_auto_plans<small_gpt>(mesh_shape(4, 1, 1), auto_options(), dev))
    if (c.label.rfind("3-D", 0) == 0) CHECK(c.label.find(" zero") == std::string::npos);
}

// small_gpt with each block recomputed in backward: the recompute variant auto_plan<small_gpt>
// prices, and a model a user may write (split<M> refuses a recompute inside).
using rec_gpt = sequential<embedding<256, 32>, position_embedding<32, 32>, repeat<4, recompute<transformer_block<32, 2, 64>>>,
                           layer_norm<32>, linear<32, 256>, softmax_cross_entropy>;
static_assert(std::is_same_v<detail::recomputed_t<small_gpt>, rec_gpt>);
static_assert(std::is_void_v<detail::recomputed_t<rec_gpt>>, "already recomputed: no second variant");
static_assert(!splittable<rec_gpt> && std::is_same_v<detail::family<rec_gpt>::tensor, detail::tp_stages<rec_gpt>::type>);
// a strategy inside: neither a tensor-parallel candidate nor a recomputed one (only the 3-D plan splits the rest)
using split_block_gpt = sequential<embedding<256, 32>, position_embedding<32, 32>, repeat<4, split<transformer_block<32, 2, 64>>>,
                                   layer_norm<32>, linear<32, 256>, softmax_cross_entropy>;
static_assert(std::is_void_v<detail::family<split_block_gpt>::tensor> && std::is_void_v<detail::recomputed_t<split_block_gpt>>);

TEST_CASE("auto_plan prices every plan with its blocks recomputed too: less memory, slower, chosen when only they fit, and trains as single-process") {
  auto ctx = context::init();
  const auto dev = device_profile::load(auto_options().profile);
  const auto cs = rank_auto_plans<small_gpt>(ctx.mesh().shape(), auto_options(), dev);
  std::map<std::string, const plan_choice*> by_label;
  for (const auto& c : cs) by_label[c.label] = &c;
  int pairs = 0;
  double least_plain = 1e300, least_rec = 1e300;
  for (const auto& c : cs) {
    if (!c.valid) continue;
    const auto at = c.label.find(" recompute");
    if (at == std::string::npos) {
      least_plain = std::min(least_plain, c.memory_mib);
      continue;
    }
    least_rec = std::min(least_rec, c.memory_mib);
    // the recomputed tensor-parallel form splits each element on its own (the logits gathered
    // for an unsplit loss), where split<M> splits the loss by class: another scheme, not a twin
    if (c.label.rfind("tensor parallel", 0) == 0) continue;
    const auto plain = c.label.substr(0, at) + c.label.substr(at + 10);
    INFO(c.label << " against " << plain);
    REQUIRE(by_label.count(plain) == 1);
    const auto& p = *by_label[plain];
    REQUIRE(p.valid);
    CHECK(c.memory_mib < p.memory_mib);  // a block's inner activations are not kept
    CHECK(c.step_s > p.step_s);          // each block's forward runs twice
    ++pairs;
  }
  CHECK(pairs >= 4);  // dp, ZeRO 1-3 at least
  REQUIRE(least_rec < least_plain);
  // a limit under every plain plan: a recomputed one runs, and trains as single-process training
  auto o = auto_options(least_plain - 0.001);
  {
    auto net = make<auto_plan<small_gpt>>(ctx, seed{42}, o);
    INFO("chosen: " << net.choice().label);
    CHECK(net.choice().label.find(" recompute") != std::string::npos);
    CHECK(net.choice().memory_mib < least_plain);
  }
  check_trains_as_single(ctx, o, true);
}

TEST_CASE("auto_plan<M, plan_space{.recompute = false}> compiles in and prices no recomputed plan") {
  constexpr plan_space plain{.recompute = false};
  static_assert(detail::auto_variant<detail::auto_candidates<small_gpt, plain>>::size * 2 ==
                    detail::auto_variant<detail::auto_candidates<small_gpt>>::size,
                "each plan type of small_gpt has one recomputed twin");
  auto ctx = context::init();
  const auto dev = device_profile::load(auto_options().profile);
  double least_plain = 1e300;
  for (const auto& c : rank_auto_plans<small_gpt, plain>(ctx.mesh().shape(), auto_options(), dev)) {
    CHECK(c.label.find(" recompute") == std::string::npos);
    if (c.valid) least_plain = std::min(least_plain, c.memory_mib);
  }
  // under every plain plan: auto_plan<M> runs a recomputed one (the test above); without them, nothing fits
  CHECK_THROWS_WITH_AS((make<auto_plan<small_gpt, plain>>(ctx, seed{42}, auto_options(least_plain - 0.001))),
                       doctest::Contains("plan_space{.recompute = false}>: no candidate plan runs on the mesh"),
                       std::invalid_argument);
  CHECK(auto_plan<small_gpt, plain>::name().find("plan_space{.recompute = false}") != std::string::npos);
}

TEST_CASE("auto_plan of a model with a recompute inside prices its tensor-parallel form (recompute<split<Block>>), which trains as single-process") {
  auto probe = context::init();
  const auto dev = device_profile::load(auto_options().profile);
  int tensor = 0;
  for (const auto& c : rank_auto_plans<rec_gpt>(mesh_shape(4, 1, 1), auto_options(), dev)) {
    CHECK(c.label.find(" recompute") == std::string::npos);  // M itself is the recomputed model
    if (c.label.rfind("tensor parallel on ", 0) == 0) {
      INFO(c.label << ": " << c.why);
      ++tensor;
      // 2 heads do not split 4 ways: refused when priced, as the layer refuses it when built
      if (c.mesh == "data=1,pipe=1,model=4") CHECK(c.why.find("cannot be split 4 ways over the model axis: the dimension its ranks share (2)") != std::string::npos);
      else CHECK(c.valid);
    }
  }
  CHECK(tensor == 2);  // data=2 x model=2, model=4
  if (probe.size() == 1) return;
  auto ctx = test::on_mesh("data=" + std::to_string(probe.size() / 2) + ",model=2");
  only_tensor_parallel_runs<rec_gpt>(ctx);
  check_trains_as_single<rec_gpt>(ctx, auto_options(), true);
}

TEST_CASE("auto_plan on a backbone and a head prices the class-split head (Whale's 100k-class plan) and it trains as single-process") {
  auto ctx = context::init();
  auto o = auto_options();
  o.profile = temp_profile(ctx, "slow-network", 0.05, 0.05);
  auto net = make<auto_plan<wide_head>>(ctx, seed{42}, o);
  bool priced = false;
  for (const auto& c : net.ranking())
    if (c.label == "class-split head") {
      INFO(c.why);
      CHECK(c.valid);
      priced = true;
    }
  CHECK(priced);
  if (ctx.rank() == 0) {
    std::ostringstream os;
    os << net;
    MESSAGE("ranks " << ctx.size() << ":\n" << os.str().substr(0, 1200));
  }
  // the head's gradients (0.5 MiB) are most of dp's and ZeRO's bytes, and a row-parallel
  // head all-reduces whole logits: the class-split head sends least
  if (ctx.size() > 1) {
    INFO("chosen: " << net.choice().label);
    CHECK(net.choice().label == "class-split head");
  }
  check_choice_trains_as_single<wide_head>(ctx, o, 4096);
  barrier(ctx.world());
  if (ctx.rank() == 0) std::filesystem::remove(o.profile);
}
