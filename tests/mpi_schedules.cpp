// The zero-bubble schedule (zb_h1: backward split into input-gradient B and
// weight-gradient W passes) and interleaved 1F1B (V model chunks per pipe rank)
// against single-process training and against 1F1B (bitwise: the same float
// operations in the same order), on a pipe axis, with split regions inside the
// stages, replicated (with ZeRO-1), with AdamW and active clipping; and the
// schedules' replay (in-flight bound, bubble, checks) at sizes beyond this job's;
// pipeline<S, M, stages<N>>. Adapts to the world size (1, 2, 4 ranks); every
// rank compares its own parameters.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/relu.hpp"
#include "whale/nn/transformer_block.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/strategy/shard.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {

using small_gpt = models::gpt_model<64, 16, 32, 2, 64, 4>;
markov_data gpt_batches() { return markov_data(seed{7}, 64, 16, 8); }  // 8 sequences x 16 tokens
using tp_single = models::gpt_model<64, 16, 32, 4, 64, 4>;
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>,
                          repeat<4, split<transformer_block<32, 4, 64>>>, layer_norm<32>, split<linear<32, 64>>,
                          softmax_cross_entropy>;

// SGD with momentum, 5 steps. Tolerance against single-process training:
// |p_pipe - p_single| <= 2e-6 + 1e-4 |p_single| (micro-batches change only the
// order of float sums); against 1F1B: bitwise equal.
constexpr double atol = 2e-6, rtol = 1e-4;

plan_options micro(int m, double bucket_mib = 25.0) {
  plan_options o;
  o.micro_batches = m;
  o.bucket_mib = bucket_mib;
  return o;
}

/// Train `net` 5 steps with SGD; return this rank's unsplit stage parameters.
template <class Net> tensor<float> trained(Net& net) {
  auto data = gpt_batches();
  trainer t(net, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet());
  t.run(data, steps{5});
  return net.stage_params();  // collective over the model axis
}
template <class Single> tensor<float> single_trained() {
  network<Single> single(seed{42});
  auto data = gpt_batches();
  trainer t(single, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet());
  t.run(data, steps{5});
  tensor<float> p({single.param_count()});
  copy<float>(single.params(), p.v());
  return p;
}

/// zb_h1 and 1f1b of plan template Plan<Sched> on `mesh`: each equals single-process
/// training on every rank, and zb_h1 equals 1f1b bitwise.
template <template <class> class Plan, class Single>
void check_against_1f1b(const std::string& mesh, const plan_options& o) {
  auto c = test::on_mesh(mesh);
  auto zb = make<Plan<zb_h1>>(c, seed{42}, o);
  auto fb = make<Plan<one_f_one_b>>(c, seed{42}, o);
  const auto pz = trained(zb), pf = trained(fb);
  const auto ps = single_trained<Single>();
  REQUIRE(zb.full_param_end() <= ps.numel());
  const auto ref = cview<float>(ps.v()).rows(zb.full_param_begin(), zb.full_param_end() - zb.full_param_begin());
  const auto dz = test::over_ranks(c.world(), test::compare(pz.v(), ref, atol, rtol));
  const auto df = test::over_ranks(c.world(), test::compare(pz.v(), pf.v(), 0.0, 0.0));
  if (c.rank() == 0)
    MESSAGE(layer_name<Plan<zb_h1>>() << " on " << mesh << ", m = " << zb.micro_batches()
                                      << ": max |zb-h1 - single| = " << dz.max_abs << " (every rank), max |zb-h1 - 1f1b| = "
                                      << df.max_abs);
  CHECK(dz.bad == 0);
  CHECK(df.max_abs == 0.0);
}

template <class S> using pipe_gpt = pipeline<S, small_gpt>;
template <class S> using pipe_tp = pipeline<S, tp_gpt>;
template <class S> using dp_pipe = replicate<pipeline<S, small_gpt>>;
template <class S> using zero1_pipe = shard<pipeline<S, small_gpt>, 1>;

}  // namespace

TEST_CASE("zb_h1: the replay bounds the micro-batches in flight and shrinks the bubble against 1F1B") {
  for (int p : {1, 2, 4, 8})
    for (int m : {1, 2, 3, 8, 16, 32}) {
      CAPTURE(p);
      CAPTURE(m);
      const auto z = check_schedule<zb_h1>(p, m);  // throws if malformed or deadlocking
      const auto f = check_schedule<one_f_one_b>(p, m);
      CHECK(z.split);
      CHECK_FALSE(f.split);
      for (int s = 0; s < p; ++s) {
        const auto l = zb_h1::actions(s, p, m);
        CHECK(l.size() == static_cast<std::size_t>(3 * m));
        CHECK(z.peak_live[static_cast<std::size_t>(s)] <= std::min(m, p + 1));
      }
      // idle pass times of the busiest stage: 1F1B with B + W as one pass of two
      // times has 3(p-1); ZB-H1's construction p-1; this replay's order at most 2 more
      CHECK(f.bubble == doctest::Approx(bubble_theory(p, m)));
      const int idle = z.rounds - 3 * m;
      CHECK(z.bubble == doctest::Approx(static_cast<double>(idle) / z.rounds));
      if (p > 1) CHECK(idle < 3 * (p - 1));
      if (m >= p) CHECK(idle <= (p - 1) + 2);
    }
  const auto r = check_schedule<zb_h1>(4, 8);
  MESSAGE("zb-h1, p = 4, m = 8: " << r.rounds << " rounds of equal passes, bubble " << r.bubble
                                  << " (1f1b, its B twice as long: " << 9.0 / 33.0 << ")");
}

namespace {
// W listed by a schedule that does not say it splits the backward; W before B
struct undeclared_w {
  static std::string name() { return "undeclared_w"; }
  static std::vector<pipe_action> actions(int, int, int m) {
    std::vector<pipe_action> a;
    for (int j = 0; j < m; ++j) a.push_back({pipe_action::forward, j}), a.push_back({pipe_action::backward, j}), a.push_back({pipe_action::weight, j});
    return a;
  }
};
struct early_w {
  static constexpr bool splits_backward = true;
  static std::string name() { return "early_w"; }
  static std::vector<pipe_action> actions(int, int, int m) {
    std::vector<pipe_action> a;
    for (int j = 0; j < m; ++j) a.push_back({pipe_action::forward, j}), a.push_back({pipe_action::weight, j}), a.push_back({pipe_action::backward, j});
    return a;
  }
};
struct missing_w {
  static constexpr bool splits_backward = true;
  static std::string name() { return "missing_w"; }
  static std::vector<pipe_action> actions(int, int, int m) { return one_f_one_b::actions(0, 1, m); }
};
}  // namespace

TEST_CASE("in_order: every built-in schedule sends each link's messages in the order they are read; a swapped one does not") {
  for (int p : {2, 3, 4})
    for (int m : {p, 2 * p}) {
      CAPTURE(p);
      CAPTURE(m);
      CHECK(check_schedule<one_f_one_b>(p, m).in_order);
      CHECK(check_schedule<gpipe>(p, m).in_order);
      CHECK(check_schedule<zb_h1>(p, m).in_order);
      CHECK(check_schedule<interleaved_1f1b<2>>(p, m).in_order);
      CHECK(check_schedule<interleaved_1f1b<3>>(p, m).in_order);
      CHECK_FALSE(check_schedule<test::swapped_schedule>(p, m).in_order);
    }
  CHECK(check_schedule<test::swapped_schedule>(1, 2).in_order);  // one stage: no link
}

namespace {
using ops_t = std::vector<std::vector<detail::pipe_op>>;
// Every rank's operations run one at a time in its list's order, on one queue, as NCCL runs a
// communicator's operations on its stream; a message completes when its send and its receive
// are both at the heads of their queues. True when every message completes.
bool one_at_a_time(const ops_t& ops) {
  const auto p = ops.size();
  std::vector<std::size_t> at(p, 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t s = 0; s < p; ++s) {
      if (at[s] == ops[s].size() || !ops[s][at[s]].send) continue;
      const auto& o = ops[s][at[s]];
      const auto r = static_cast<std::size_t>(o.peer);
      if (at[r] == ops[r].size()) continue;
      const auto& q = ops[r][at[r]];
      if (!q.send && q.peer == static_cast<int>(s) && q.kind == o.kind && q.key == o.key) ++at[s], ++at[r], moved = true;
    }
  }
  for (std::size_t s = 0; s < p; ++s)
    if (at[s] != ops[s].size()) return false;
  return true;
}
// Each rank's messages as it runs its list: a receive just before the action that reads it, a
// send just after the action that makes it (the order the stage itself would give).
ops_t as_run(const std::vector<std::vector<pipe_action>>& lists, int p, int m, int V) {
  ops_t ops(static_cast<std::size_t>(p));
  const int pv = p * V;
  for (int s = 0; s < p; ++s)
    for (const auto& a : lists[static_cast<std::size_t>(s)]) {
      const int v = a.chunk * p + s;
      auto& o = ops[static_cast<std::size_t>(s)];
      if (a.kind == pipe_action::forward && v > 0) o.push_back({false, 0, a.chunk * m + a.micro, (v - 1) % p, 0});
      if (a.kind == pipe_action::backward && v < pv - 1) o.push_back({false, 1, a.chunk * m + a.micro, (v + 1) % p, 0});
      if (a.kind == pipe_action::forward && v < pv - 1) o.push_back({true, 0, ((v + 1) / p) * m + a.micro, (v + 1) % p, 0});
      if (a.kind == pipe_action::backward && v > 0) o.push_back({true, 1, ((v - 1) / p) * m + a.micro, (v - 1) % p, 0});
    }
  return ops;
}
// S's training lists and forward-only lists on p ranks, m micro-batches: each rank's list holds
// every message of its own once, in rounds that never go back, and every message completes one
// operation at a time.
template <class S> void ordered_safely(int p, int m) {
  constexpr int V = chunks_v<S>;
  const auto all = schedule_lists<S>(p, m), fwd = detail::forwards_of(all);
  const auto fr = detail::replay(fwd, p, m, V);
  REQUIRE_FALSE(fr.stuck);
  const auto rounds = check_schedule<S>(p, m).round;
  for (const bool train : {true, false}) {
    const auto& lists = train ? all : fwd;
    const auto& r = train ? rounds : fr.round;
    ops_t ops;
    std::size_t messages = 0;
    for (int s = 0; s < p; ++s) {
      ops.push_back(detail::message_order(lists, r, p, m, V, s));
      for (std::size_t i = 1; i < ops.back().size(); ++i) CHECK(ops.back()[i - 1].round <= ops.back()[i].round);
      messages += ops.back().size();
    }
    INFO(S::name() << ", " << p << " ranks, " << m << " micro-batches, " << (train ? "training" : "forward only"));
    std::size_t made = 0;  // every message once at each end
    for (const auto& o : as_run(lists, p, m, V)) made += o.size();
    CHECK(messages == made);
    CHECK(one_at_a_time(ops));
  }
}
}  // namespace

TEST_CASE("message_order: on one communicator, one operation at a time a rank, every built-in schedule's messages complete") {
  for (int p : {2, 3, 4, 8})
    for (int m : {p, 2 * p, 4 * p}) {
      ordered_safely<gpipe>(p, m);
      ordered_safely<one_f_one_b>(p, m);
      ordered_safely<zb_h1>(p, m);
      ordered_safely<interleaved_1f1b<2>>(p, m);
      ordered_safely<interleaved_1f1b<3>>(p, m);
    }
  for (int m : {1, 3, 5}) ordered_safely<one_f_one_b>(4, m);
  // the check can fail: 1F1B's messages in the order its stages make and read them need two
  // operations in flight (stage 0 sends F1's activation while stage 1 sends B0's gradient)
  std::vector<std::vector<pipe_action>> l{one_f_one_b::actions(0, 2, 2), one_f_one_b::actions(1, 2, 2)};
  CHECK_FALSE(one_at_a_time(as_run(l, 2, 2, 1)));
}

TEST_CASE("split schedules are checked: W declared, once per micro-batch, after its B") {
  CHECK_THROWS_WITH_AS(check_schedule<undeclared_w>(2, 2), doctest::Contains("does not declare splits_backward"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(check_schedule<early_w>(2, 2), doctest::Contains("runs W0 before B0"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(check_schedule<missing_w>(1, 2), doctest::Contains("never runs W0"), std::invalid_argument);
}

TEST_CASE("pipeline<zb_h1, gpt> equals single-process training and 1F1B bitwise, on every rank") {
  auto ctx = context::init();
  const int W = ctx.size();
  check_against_1f1b<pipe_gpt, small_gpt>("pipe=" + std::to_string(W), micro(4));
  check_against_1f1b<pipe_gpt, small_gpt>("pipe=" + std::to_string(W), micro(8));
  if (W == 2 || W == 4) {  // split regions inside the stages
    check_against_1f1b<pipe_tp, tp_single>(W == 2 ? "pipe=2,model=1" : "pipe=2,model=2", micro(4));
    if (W == 4) check_against_1f1b<pipe_tp, tp_single>("pipe=1,model=4", micro(4));
  }
  if (W % 2 == 0) {  // replicated, gradient buckets after the last W; and ZeRO-1 (the partitioned optimizer)
    const std::string mesh = "data=2,pipe=" + std::to_string(W / 2);
    check_against_1f1b<dp_pipe, small_gpt>(mesh, micro(2, 0.01));
    check_against_1f1b<zero1_pipe, small_gpt>(mesh, micro(2, 0.01));
  }
}

TEST_CASE("pipeline<zb_h1> with AdamW, weight decay and active clipping equals single-process training") {
  auto ctx = context::init();
  const int W = ctx.size();
  auto c = test::on_mesh("pipe=" + std::to_string(W));
  auto net = make<pipeline<zb_h1, small_gpt>>(c, seed{42}, micro(4));
  const auto r = test::run_clipped<small_gpt>(c.world(), net, gpt_batches, 0.5, 4, [&](network<small_gpt>& single) {
    auto full = net.stage_params();
    auto ref = single.params().rows(net.full_param_begin(), net.full_param_end() - net.full_param_begin());
    return test::compare(full.v(), ref, 1e-5, 1e-4);  // Adam's 1/sqrt(v) magnifies rounding
  });
  if (c.rank() == 0)
    MESSAGE("zb-h1 gpt on pipe=" << W << " clipped at 0.5 (single norm at step 0: " << r.single_norm0
                                 << "): max |zb - single| = " << r.params.max_abs << ", norm rel. diff " << r.norm_rel);
  CHECK(r.single_norm0 > 0.5);
  CHECK(r.norms == 4u);
  CHECK(r.norm_rel <= 1e-5);
  CHECK(r.params.bad == 0);
}

TEST_CASE("pipeline<zb_h1> runs the W passes and keeps each slot until its W") {
  auto ctx = context::init();
  const int W = ctx.size();
  auto c = test::on_mesh("pipe=" + std::to_string(W));
  plan_options o = micro(8);
  o.trace = true;
  auto net = make<pipeline<zb_h1, small_gpt>>(c, seed{42}, o);
  auto data = gpt_batches();
  trainer(net, sgd{.lr = 0.01f}, test::quiet()).run(data, steps{2});
  const auto rep = check_schedule<zb_h1>(W, 8);
  const int s = net.stage();
  CHECK(net.peak_live_micro_batches() == rep.peak_live[static_cast<std::size_t>(s)]);
  CHECK(net.activation_slots_used() == rep.peak_live[static_cast<std::size_t>(s)]);
  const auto ev = net.finish_trace();
  int weights = 0;
  for (const auto& e : ev)
    if (e.what() == span_kind::weight && e.rank == c.rank()) ++weights;
  CHECK(weights == 2 * 8);  // one W per micro-batch per step
  // the layers did put their weight gradients off: per micro-batch, the stage's
  // attention and two linears per block, and the head on the last stage
  const auto& blocks = net.stage_blocks();
  const std::size_t per_micro = 3 * static_cast<std::size_t>(blocks[static_cast<std::size_t>(s)]) + (s == W - 1 ? 1 : 0);
  MESSAGE("stage " << s << ": " << net.deferred_weight_grads() << " weight-gradient computations put off to W passes in the last step");
  CHECK(net.deferred_weight_grads() == 8 * per_micro);
  // the program lists them too, with the weight-gradient FLOPs moved out of B
  const auto& prog = net.placement();
  (void)prog;
  lower_options lo;
  lo.global_batch = 8;
  lo.seq = 16;
  lo.micro_batches = 8;
  const auto pz = lower<pipeline<zb_h1, small_gpt>>(c.mesh().shape(), c.rank(), lo);
  const auto pf = lower<pipeline<one_f_one_b, small_gpt>>(c.mesh().shape(), c.rank(), lo);
  int wops = 0;
  for (const auto& x : pz.ops) wops += x.kind == op_kind::weight;
  CHECK(wops > 0);
  CHECK(pz.totals().flops == doctest::Approx(pf.totals().flops));
  CHECK(pz.totals().bytes_sent == pf.totals().bytes_sent);
}

TEST_CASE("pipeline<S, M, stages<2>>: runs on a pipe axis of 2, and is an error on any other") {
  auto ctx = context::init();
  const int W = ctx.size();
  using fixed = pipeline<one_f_one_b, small_gpt, stages<2>>;
  static_assert(fixed::fixed_stages == 2 && pipeline<one_f_one_b, small_gpt>::fixed_stages == 0);
  if (W == 2) {
    auto c = test::on_mesh("pipe=2");
    auto net = make<fixed>(c, seed{42}, micro(4));
    const auto p = trained(net);
    const auto ps = single_trained<small_gpt>();
    const auto ref = cview<float>(ps.v()).rows(net.full_param_begin(), net.full_param_end() - net.full_param_begin());
    CHECK(test::over_ranks(c.world(), test::compare(p.v(), ref, 2e-6, 1e-4)).bad == 0);
  } else {
    auto c = test::on_mesh("pipe=" + std::to_string(W));
    const std::string want = "the pipeline has 2 stages but the mesh's pipe axis has " + std::to_string(W);
    CHECK_THROWS_WITH_AS(make<fixed>(c, seed{42}, micro(4)), doctest::Contains(want.c_str()), std::invalid_argument);
    lower_options lo;
    lo.global_batch = 8;
    CHECK_THROWS_WITH_AS(lower<fixed>(c.mesh().shape(), c.rank(), lo), doctest::Contains("the pipeline has 2 stages"),
                         std::invalid_argument);
  }
}

namespace {
using deep_gpt = models::gpt_model<64, 16, 32, 2, 64, 8>;  // 8 blocks: 2 chunks on up to 4 pipe ranks
}  // namespace

TEST_CASE("pipeline<interleaved_1f1b<2>, gpt> equals single-process training and 1F1B bitwise, on every rank") {
  auto ctx = context::init();
  const int W = ctx.size();
  auto c = test::on_mesh("pipe=" + std::to_string(W));
  const int m = W == 1 ? 4 : 2 * W;  // a multiple of the pipe ranks
  auto il = make<pipeline<interleaved_1f1b<2>, deep_gpt>>(c, seed{42}, micro(m));
  auto fb = make<pipeline<one_f_one_b, deep_gpt>>(c, seed{42}, micro(m));
  CHECK(il.chunks() == 2);
  CHECK(il.chunk_ranges().size() == 2u);
  {
    auto data = gpt_batches();
    trainer(il, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet()).run(data, steps{5});
    auto data2 = gpt_batches();
    trainer(fb, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet()).run(data2, steps{5});
  }
  const auto pi = il.full_params(), pf = fb.full_params();  // the whole model on every rank
  const auto ps = single_trained<deep_gpt>();
  REQUIRE(pi.numel() == ps.numel());
  const auto ds = test::over_ranks(c.world(), test::compare(pi.v(), ps.v(), 2e-6, 1e-4));
  const auto df = test::over_ranks(c.world(), test::compare(pi.v(), pf.v(), 0.0, 0.0));
  if (c.rank() == 0)
    MESSAGE("interleaved-1f1b<2> on pipe=" << W << ", m = " << m << ": max |il - single| = " << ds.max_abs
                                           << ", max |il - 1f1b| = " << df.max_abs);
  CHECK(ds.bad == 0);
  CHECK(df.max_abs == 0.0);
  CHECK_THROWS_WITH_AS(il.param_begin(), doctest::Contains("holds 2 chunks"), std::logic_error);
}

TEST_CASE("interleaved_1f1b<V>: the replay's bubble is (p-1)/(V m + p-1), and m must be a multiple of p") {
  for (int p : {1, 2, 4, 8})
    for (int mult : {1, 2, 4}) {
      const int m = p * mult;
      CAPTURE(p);
      CAPTURE(m);
      const auto r2 = check_schedule<interleaved_1f1b<2>>(p, m);
      const auto r3 = check_schedule<interleaved_1f1b<3>>(p, m);
      CHECK(r2.chunks == 2);
      CHECK(r2.bubble == doctest::Approx(static_cast<double>(p - 1) / (2.0 * m + p - 1)));
      CHECK(r3.bubble == doctest::Approx(static_cast<double>(p - 1) / (3.0 * m + p - 1)));
      for (int s = 0; s < p; ++s)  // Megatron's warm-up bound: (p-s-1)·2 + (V-1)·p + 1 chunk passes in flight
        CHECK(r2.peak_live[static_cast<std::size_t>(s)] <= std::min(2 * m, (p - s - 1) * 2 + p + 1));
    }
  CHECK_THROWS_WITH_AS(check_schedule<interleaved_1f1b<2>>(4, 6), doctest::Contains("must be a multiple of the pipe ranks (4)"),
                       std::invalid_argument);
  MESSAGE("interleaved-1f1b<2>, p = 4, m = 8: bubble " << check_schedule<interleaved_1f1b<2>>(4, 8).bubble << " (1f1b: "
                                                       << bubble_theory(4, 8) << ")");
}

namespace {
template <class S> using il_dp = replicate<pipeline<S, small_gpt>>;
template <class S> using il_zero1 = shard<pipeline<S, small_gpt>, 1>;
template <class S> using il_tp = pipeline<S, tp_gpt>;
/// Plan<S> trained 5 steps with SGD under interleaved_1f1b<2> and one_f_one_b: the
/// whole model (full_params, on every rank) equals single-process training, and 1F1B bitwise.
template <template <class> class Plan, class Single> void check_interleaved(const std::string& mesh, int m) {
  auto c = test::on_mesh(mesh);
  auto il = make<Plan<interleaved_1f1b<2>>>(c, seed{42}, micro(m, 0.01));
  auto fb = make<Plan<one_f_one_b>>(c, seed{42}, micro(m, 0.01));
  {
    auto d1 = gpt_batches(), d2 = gpt_batches();
    trainer(il, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet()).run(d1, steps{5});
    trainer(fb, sgd{.lr = 0.05f, .momentum = 0.9f}, test::quiet()).run(d2, steps{5});
  }
  const auto pi = il.full_params(), pf = fb.full_params();
  const auto ps = single_trained<Single>();
  REQUIRE(pi.numel() == ps.numel());
  const auto ds = test::over_ranks(c.world(), test::compare(pi.v(), ps.v(), 2e-6, 1e-4));
  const auto df = test::over_ranks(c.world(), test::compare(pi.v(), pf.v(), 0.0, 0.0));
  if (c.rank() == 0)
    MESSAGE(layer_name<Plan<interleaved_1f1b<2>>>() << " on " << mesh << ", m = " << m << ": max |il - single| = "
                                                    << ds.max_abs << ", max |il - 1f1b| = " << df.max_abs);
  CHECK(ds.bad == 0);
  CHECK(df.max_abs == 0.0);
}
}  // namespace

TEST_CASE("interleaved 1F1B composes: with TP inside the stages, replicated, ZeRO-1; AdamW + clipping; explicit stages") {
  auto ctx = context::init();
  const int W = ctx.size();
  if (W == 2) check_interleaved<il_tp, tp_single>("pipe=2,model=1", 4);
  if (W == 4) {
    check_interleaved<il_tp, tp_single>("pipe=2,model=2", 4);
    check_interleaved<il_dp, small_gpt>("data=2,pipe=2", 2);
    check_interleaved<il_zero1, small_gpt>("data=2,pipe=2", 2);
  }
  if (W <= 2) {  // clipped AdamW, the norm counted once over the chunks
    auto c = test::on_mesh("pipe=" + std::to_string(W));
    auto net = make<pipeline<interleaved_1f1b<2>, small_gpt>>(c, seed{42}, micro(4));
    const auto r = test::run_clipped<small_gpt>(c.world(), net, gpt_batches, 0.5, 4, [&](network<small_gpt>& single) {
      auto full = net.full_params();
      return test::compare(full.v(), single.params(), 1e-5, 1e-4);
    });
    if (c.rank() == 0)
      MESSAGE("interleaved gpt on pipe=" << W << " clipped at 0.5: max |il - single| = " << r.params.max_abs
                                         << ", norm rel. diff " << r.norm_rel);
    CHECK(r.single_norm0 > 0.5);
    CHECK(r.norm_rel <= 1e-5);
    CHECK(r.params.bad == 0);
  }
  if (W == 2) {  // four explicit stages on two pipe ranks: stages 0, 2 on rank 0 and 1, 3 on rank 1
    using A = stage<linear<8, 16>, relu>;
    using B = stage<linear<16, 16>, relu>;
    using C = stage<linear<16, 16>, relu>;
    using D = stage<linear<16, 4>, softmax_cross_entropy>;
    auto c = test::on_mesh("pipe=2");
    auto net = make<pipeline<interleaved_1f1b<2>, A, B, C, D>>(c, seed{42}, micro(4));
    auto data = teacher_data(seed{3}, 8, 4, 8);
    trainer(net, sgd{.lr = 0.05f}, test::quiet()).run(data, steps{5});
    network<sequential<sequential<linear<8, 16>, relu>, sequential<linear<16, 16>, relu>, sequential<linear<16, 16>, relu>,
                       sequential<linear<16, 4>, softmax_cross_entropy>>>
        single(seed{42});
    auto data2 = teacher_data(seed{3}, 8, 4, 8);
    trainer(single, sgd{.lr = 0.05f}, test::quiet()).run(data2, steps{5});
    const auto full = net.full_params();
    CHECK(test::over_ranks(c.world(), test::compare(full.v(), single.params(), 2e-6, 1e-4)).bad == 0);
  }
  if (W == 1) {  // four stages on one pipe rank of 2 chunks cannot run: the stage count must be pipe ranks x chunks
    using A = stage<linear<8, 16>, relu>;
    using A2 = stage<linear<16, 16>, relu>;
    using D = stage<linear<16, 4>, softmax_cross_entropy>;
    auto c1 = test::on_mesh("pipe=1");
    CHECK_THROWS_WITH_AS((make<pipeline<interleaved_1f1b<2>, A, A2, A2, D>>(c1, seed{42}, micro(4))),
                         doctest::Contains("the pipeline has 4 stages but the mesh's pipe axis has 1 rank(s)"),
                         std::invalid_argument);
  }
}
