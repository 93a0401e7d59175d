// pipeline<Schedule, ...> against single-process training on the same global
// batches (GPipe and 1F1B; gpt cut at run time, mlp in explicit uneven stages;
// replicate<pipeline> on data × pipe), activation slots of 1F1B, schedule and
// mesh errors, the merged trace, and 3-D parallelism (split regions inside
// stages on [data ×] pipe × model), all also with AdamW and active gradient
// clipping (the global gradient norm over the mesh). Adapts to the world size
// (1, 2, 4 ranks).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "whale/comm/context.hpp"
#include "whale/models/gpt.hpp"
#include "whale/nn/gelu.hpp"
#include "whale/nn/transformer_block.hpp"
#include "whale/optim/adamw.hpp"
#include "whale/optim/sgd.hpp"
#include "whale/runtime/make.hpp"
#include "whale/strategy/pipeline.hpp"
#include "whale/comm/trace.hpp"
#include "whale/train/trainer.hpp"
#include "support/plan_check.hpp"

using namespace whale;

namespace {

// A reduced gpt (vocabulary 64, 16 positions, width 32, 2 heads, FFN 64, 4 blocks)
// so that the file runs in seconds at 4 ranks on 2 cores.
using small_gpt = models::gpt_model<64, 16, 32, 2, 64, 4>;
markov_data gpt_batches() { return markov_data(seed{7}, 64, 16, 8); }  // 8 sequences x 16 tokens

// Tolerance: |p_pipe - p_single| <= atol + rtol * |p_single| elementwise, fp32.
// A pipeline changes only the order of float sums (gradients accumulated over
// micro-batches instead of one GEMM over the batch), so differences stay at
// rounding level; GPipe and 1F1B accumulate in the same order, so they agree exactly.
constexpr double atol = 2e-6, rtol = 1e-4;

using test::quiet;
using test::diff;
context with_mesh(const std::string& spec) { return test::on_mesh(spec); }
diff compare(cview<float> a, cview<float> b) { return test::compare(a, b, atol, rtol); }

/// Train `net` for 5 steps, the single-process model `Single` the same, and
/// compare this rank's stage with the same range of the single parameters.
template <class Single, class Net, class MakeData>
diff train_and_compare(Net& net, MakeData make_data, int n_steps = 5) {
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  {
    auto data = make_data();
    trainer t(net, opt, quiet());
    t.run(data, steps{n_steps});
  }
  network<Single> single(seed{42});
  auto data = make_data();
  trainer t(single, opt, quiet());
  t.run(data, steps{n_steps});
  CHECK(net.total_params() == single.param_count());
  auto ref = single.params().rows(net.param_begin(), net.param_end() - net.param_begin());
  return compare(net.params(), ref);
}

template <class Sched> plan_options opts(int m, std::vector<int> blocks = {}) {
  plan_options o;
  o.micro_batches = m;
  o.blocks = std::move(blocks);
  return o;
}

// A schedule whose stages wait on each other: stage 0 alternates F j, B j while
// stage 1 runs every forward first.
struct deadlocking {
  static std::string name() { return "deadlocking"; }
  static std::vector<pipe_action> actions(int s, int, int m) {
    std::vector<pipe_action> a;
    if (s == 0) {
      for (int j = 0; j < m; ++j) a.push_back({pipe_action::forward, j}), a.push_back({pipe_action::backward, j});
    } else {
      a = gpipe::actions(s, 0, m);
    }
    return a;
  }
};
struct backward_first {
  static std::string name() { return "backward_first"; }
  static std::vector<pipe_action> actions(int, int, int m) {
    auto a = gpipe::actions(0, 0, m);
    std::reverse(a.begin(), a.end());
    return a;
  }
};

// A minimal JSON checker (objects, arrays, strings, numbers, literals).
struct json_checker {
  const std::string& s;
  std::size_t i = 0;
  void ws() { while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i; }
  bool lit(const char* w) {
    const std::size_t n = std::char_traits<char>::length(w);
    if (s.compare(i, n, w) != 0) return false;
    i += n;
    return true;
  }
  bool str() {
    if (s[i] != '"') return false;
    for (++i; i < s.size(); ++i) {
      if (s[i] == '\\') ++i;
      else if (s[i] == '"') return ++i, true;
    }
    return false;
  }
  bool num() {
    const std::size_t b = i;
    while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || std::strchr("+-.eE", s[i]))) ++i;
    return i > b;
  }
  bool value() {
    ws();
    if (i >= s.size()) return false;
    bool ok;
    if (s[i] == '{') {
      ++i, ws();
      if (s[i] == '}') return ++i, true;
      do {
        ws();
        if (!str()) return false;
        ws();
        if (s[i++] != ':' || !value()) return false;
        ws();
      } while (s[i] == ',' && ++i);
      ok = s[i++] == '}';
    } else if (s[i] == '[') {
      ++i, ws();
      if (s[i] == ']') return ++i, true;
      do {
        if (!value()) return false;
        ws();
      } while (s[i] == ',' && ++i);
      ok = s[i++] == ']';
    } else if (s[i] == '"') {
      ok = str();
    } else {
      ok = lit("true") || lit("false") || lit("null") || num();
    }
    return ok;
  }
  bool document() {
    const bool ok = value();
    ws();
    return ok && i == s.size();
  }
};

}  // namespace

TEST_CASE("pipeline<gpipe|1f1b, gpt> equals single-process training (8 x 16 tokens, m = 4, 5 steps)") {
  auto ctx = context::init();
  const int W = ctx.size();
  auto ctxp = with_mesh("pipe=" + std::to_string(W));
  auto gp = make<pipeline<gpipe, small_gpt>>(ctxp, seed{42}, opts<gpipe>(4));
  auto ofob = make<pipeline<one_f_one_b, small_gpt>>(ctxp, seed{42}, opts<one_f_one_b>(4));
  const auto dg = train_and_compare<small_gpt>(gp, gpt_batches);
  const auto d1 = train_and_compare<small_gpt>(ofob, gpt_batches);
  MESSAGE("ranks " << W << " stage " << gp.stage() << " (" << gp.param_count() << " params): max |gpipe - single| = "
                   << dg.max_abs << ", max |1f1b - single| = " << d1.max_abs);
  CHECK(dg.bad == 0);
  CHECK(d1.bad == 0);
  CHECK(compare(gp.params(), ofob.params()).max_abs == 0.0);  // same accumulation order
  // every rank holds only its stage: the stages tile the model
  index_t mine = gp.param_count(), total = 0;
  all_reduce(ctxp.world(), view<index_t>(&mine, {1}));
  total = gp.total_params();
  CHECK(mine == total);
}

TEST_CASE("pipeline<1f1b, gpt> with uneven, explicit stage boundaries") {
  auto ctx = context::init();
  const int W = ctx.size();
  if (W != 2 && W != 4) {
    MESSAGE("skipped: uneven stage boundaries need 2 or 4 ranks (have " << W << ")");
    return;
  }
  auto ctxp = with_mesh("pipe=" + std::to_string(W));
  const std::vector<std::vector<int>> cuts = W == 2 ? std::vector<std::vector<int>>{{1, 3}, {4, 0}}
                                                    : std::vector<std::vector<int>>{{0, 1, 2, 1}, {2, 1, 1, 0}};
  for (const auto& cut : cuts) {
    auto net = make<pipeline<one_f_one_b, small_gpt>>(ctxp, seed{42}, opts<one_f_one_b>(2, cut));
    CHECK(net.stage_blocks() == cut);
    const auto d = train_and_compare<small_gpt>(net, gpt_batches);
    std::string cut_s;
    for (int b : cut) {
      if (!cut_s.empty()) cut_s += ',';
      cut_s += std::to_string(b);
    }
    MESSAGE("cut {" << cut_s << "} stage " << net.stage() << ": max |pipe - single| = " << d.max_abs);
    CHECK(d.bad == 0);
  }
}

TEST_CASE("pipeline<S, stage<...>, ...> (mlp, uneven explicit stages) equals sequential<sequential<...>, ...>") {
  auto ctx = context::init();
  const int W = ctx.size();
  auto ctxp = with_mesh("pipe=" + std::to_string(W));
  auto data = [] { return teacher_data(seed{7}, 32, 16, 16); };
  if (W == 1) {
    using P = pipeline<gpipe, stage<linear<32, 64>, gelu, linear<64, 16>, softmax_cross_entropy>>;
    using S = sequential<sequential<linear<32, 64>, gelu, linear<64, 16>, softmax_cross_entropy>>;
    auto net = make<P>(ctxp, seed{42}, opts<gpipe>(4));
    CHECK(train_and_compare<S>(net, data).bad == 0);
  } else if (W == 2) {
    using A = stage<linear<32, 64>, gelu, linear<64, 64>, gelu>;  // uneven: 6,240 parameters
    using B = stage<linear<64, 16>, softmax_cross_entropy>;       // and 1,040
    using S = sequential<A::layers, B::layers>;
    auto net1 = make<pipeline<one_f_one_b, A, B>>(ctxp, seed{42}, opts<one_f_one_b>(4));
    auto netg = make<pipeline<gpipe, A, B>>(ctxp, seed{42}, opts<gpipe>(8));
    const auto d1 = train_and_compare<S>(net1, data), dg = train_and_compare<S>(netg, data);
    MESSAGE("mlp 2 stages, stage " << net1.stage() << ": max diff 1f1b " << d1.max_abs << ", gpipe " << dg.max_abs);
    CHECK(d1.bad == 0);
    CHECK(dg.bad == 0);
  } else if (W == 4) {
    using A = stage<linear<32, 64>, gelu, linear<64, 64>, gelu, linear<64, 48>>;
    using B = stage<gelu, linear<48, 64>>;  // starts with a width-keeping layer
    using C = stage<gelu>;                   // no parameters at all
    using D = stage<linear<64, 16>, softmax_cross_entropy>;
    using S = sequential<A::layers, B::layers, C::layers, D::layers>;
    auto net = make<pipeline<one_f_one_b, A, B, C, D>>(ctxp, seed{42}, opts<one_f_one_b>(4));
    const auto d = train_and_compare<S>(net, data);
    MESSAGE("mlp 4 stages, stage " << net.stage() << ": max diff " << d.max_abs);
    CHECK(d.bad == 0);
  } else {
    MESSAGE("skipped: explicit-stage mlp runs at 1, 2 or 4 ranks (have " << W << ")");
  }
}

TEST_CASE("replicate<pipeline<1f1b, gpt>> on data x pipe equals single-process training") {
  auto ctx = context::init();
  const int W = ctx.size();
  if (W % 2 != 0) {
    MESSAGE("skipped: data x pipe needs an even world (have " << W << ")");
    return;
  }
  auto ctxp = with_mesh("data=2,pipe=" + std::to_string(W / 2));
  auto o = opts<one_f_one_b>(2);  // per-replica batch 4 -> 2 micro-batches of 2
  o.bucket_mib = 0.01;         // several buckets, launched during the last backward
  auto net = make<replicate<pipeline<one_f_one_b, small_gpt>>>(ctxp, seed{42}, o);
  const auto d = train_and_compare<small_gpt>(net, gpt_batches);
  MESSAGE("data=2,pipe=" << W / 2 << " stage " << net.stage() << ": max |pipe - single| = " << d.max_abs);
  CHECK(d.bad == 0);
  // both replicas of a stage hold the same parameters
  tensor<float> root({net.param_count()});
  copy<float>(net.params(), root);
  broadcast(ctxp.mesh().comm(axis::data), root.v(), 0);
  CHECK(compare(net.params(), root).max_abs == 0.0);

  // the same plan through make<> (options from the environment)
  ::setenv("WHALE_MICRO_BATCHES", "2", 1);
  auto made = make<replicate<pipeline<one_f_one_b, small_gpt>>>(ctxp, seed{42});
  ::unsetenv("WHALE_MICRO_BATCHES");
  CHECK(train_and_compare<small_gpt>(made, gpt_batches).bad == 0);
}

// 3-D parallelism: a gpt whose embedding, blocks and head are split over the
// model axis (Megatron), cut into pipeline stages, optionally replicated.
using tp_single = models::gpt_model<64, 16, 32, 4, 64, 4>;
using tp_gpt = sequential<split<embedding<64, 32>>, position_embedding<16, 32>,
                          repeat<4, split<transformer_block<32, 4, 64>>>, layer_norm<32>, split<linear<32, 64>>,
                          softmax_cross_entropy>;

/// Train the split pipeline and the unsplit single-process model 5 steps; the
/// stage's shards gathered over the model axis equal the single model's range,
/// and the reported losses agree (model ranks are not double counted).
template <class Net>
diff train_and_compare_split(Net& net) {
  const auto opt = sgd{.lr = 0.05f, .momentum = 0.9f};
  train_result r;
  {
    auto data = gpt_batches();
    trainer t(net, opt, quiet());
    r = t.run(data, steps{5});
  }
  auto full = net.stage_params();  // collective over the model axis
  network<tp_single> single(seed{42});
  auto data = gpt_batches();
  trainer t(single, opt, quiet());
  const auto rs = t.run(data, steps{5});
  REQUIRE(r.losses.size() == rs.losses.size());
  for (std::size_t i = 0; i < r.losses.size(); ++i) CHECK(std::abs(r.losses[i] - rs.losses[i]) <= 1e-4 * rs.losses[i]);
  REQUIRE(net.full_param_end() <= single.param_count());
  auto ref = single.params().rows(net.full_param_begin(), net.full_param_end() - net.full_param_begin());
  return compare(full.v(), ref);
}

TEST_CASE("3-D: pipeline<1f1b, gpt with split embedding, blocks and head> on [data x] pipe x model equals single-process") {
  auto ctx = context::init();
  const int W = ctx.size();
  std::vector<std::string> plain, replicated;
  if (W == 1) plain = {"pipe=1"};
  else if (W == 2) plain = {"pipe=1,model=2", "pipe=2,model=1"};
  else if (W == 4) plain = {"pipe=2,model=2", "pipe=1,model=4"}, replicated = {"data=2,pipe=1,model=2", "data=2,pipe=2,model=1"};
  else {
    MESSAGE("skipped: the 3-D pipeline test runs at 1, 2 or 4 ranks (have " << W << ")");
    return;
  }
  for (const auto& mesh : plain) {
    auto c = with_mesh(mesh);
    auto net = make<pipeline<one_f_one_b, tp_gpt>>(c, seed{42}, opts<one_f_one_b>(4));
    const auto d = train_and_compare_split(net);
    MESSAGE(mesh << " stage " << net.stage() << " model rank " << c.mesh().coord(axis::model) << " ("
                 << net.param_count() << " local params, unsplit range " << net.full_param_begin() << ".."
                 << net.full_param_end() << "): max |3d - single| = " << d.max_abs);
    CHECK(d.bad == 0);
    if (c.mesh().shape().size(axis::model) > 1) CHECK(net.param_count() < net.full_param_end() - net.full_param_begin());
  }
  for (const auto& mesh : replicated) {
    auto c = with_mesh(mesh);
    auto o = opts<one_f_one_b>(2);
    o.bucket_mib = 0.01;  // several buckets
    auto net = make<replicate<pipeline<one_f_one_b, tp_gpt>>>(c, seed{42}, o);
    const auto d = train_and_compare_split(net);
    MESSAGE(mesh << " (replicated) stage " << net.stage() << ": max |3d - single| = " << d.max_abs);
    CHECK(d.bad == 0);
  }
  if (W == 4) {  // through make<>
    auto c = with_mesh("pipe=2,model=2");
    ::setenv("WHALE_MICRO_BATCHES", "4", 1);
    auto made = make<pipeline<one_f_one_b, tp_gpt>>(c, seed{42});
    ::unsetenv("WHALE_MICRO_BATCHES");
    CHECK(train_and_compare_split(made).bad == 0);
  }
  if (W > 1) {  // a model axis without split regions is still refused
    auto c = with_mesh("model=" + std::to_string(W));
    CHECK_THROWS_WITH_AS((make<pipeline<gpipe, small_gpt>>(c, seed{1}, opts<gpipe>(2))),
                         doctest::Contains("has a model axis, but no stage holds a split region"), std::invalid_argument);
  }
}

// Clipped AdamW (test::clip_adamw) for 4 steps. Tolerance: |p_pipe - p_single|
// <= 1e-5 + 1e-4 |p_single|, looser than SGD's: Adam divides by sqrt(v), which
// magnifies rounding differences in small gradients. The gradient norms the
// trainer clips with agree to a relative 1e-5 on every rank.
constexpr double clip_atol = 1e-5, clip_rtol = 1e-4, norm_rtol = 1e-5;
constexpr int clip_steps = 4;

/// `net` and Single clipped at `max_norm` (below the single-process norm at
/// step 0, so clipping is active); every rank checks its stage's unsplit parameters.
template <class Single, class Net>
void check_clipped(const context& c, Net& net, double max_norm, const std::string& what) {
  const auto r = test::run_clipped<Single>(c.world(), net, gpt_batches, max_norm, clip_steps, [&](network<Single>& single) {
    auto full = net.stage_params();  // collective over the model axis
    CHECK(net.full_param_end() <= single.param_count());
    if (net.full_param_end() > single.param_count()) return diff{0.0, 1};
    auto ref = single.params().rows(net.full_param_begin(), net.full_param_end() - net.full_param_begin());
    return test::compare(full.v(), ref, clip_atol, clip_rtol);
  });
  if (c.rank() == 0)
    MESSAGE(what << " clipped at " << max_norm << " (single-process norm at step 0: " << r.single_norm0
                 << "): max |pipe - single| = " << r.params.max_abs << ", max norm rel. diff = " << r.norm_rel);
  CHECK(r.single_norm0 > max_norm);
  CHECK(r.norms == static_cast<std::size_t>(clip_steps));
  CHECK(r.norm_rel <= norm_rtol);
  CHECK(r.params.bad == 0);
}

TEST_CASE("pipeline<1f1b>, replicated and 3-D, with AdamW, weight decay and active clipping equal single-process training") {
  auto ctx = context::init();
  const int W = ctx.size();
  {
    auto c = with_mesh("pipe=" + std::to_string(W));
    auto net = make<pipeline<one_f_one_b, small_gpt>>(c, seed{42}, opts<one_f_one_b>(4));
    check_clipped<small_gpt>(c, net, 0.5, "1f1b gpt on pipe=" + std::to_string(W));
  }
  // split regions inside the stages: [data x] pipe x model
  std::vector<std::string> plain, replicated;
  if (W == 1) plain = {"pipe=1"};
  else if (W == 2) plain = {"pipe=1,model=2", "pipe=2,model=1"}, replicated = {"data=2,pipe=1,model=1"};
  else if (W == 4) plain = {"pipe=2,model=2"}, replicated = {"data=2,pipe=1,model=2", "data=2,pipe=2,model=1"};
  for (const auto& mesh : plain) {
    auto c = with_mesh(mesh);
    auto net = make<pipeline<one_f_one_b, tp_gpt>>(c, seed{42}, opts<one_f_one_b>(4));
    check_clipped<tp_single>(c, net, 0.5, "split gpt on " + mesh);
  }
  for (const auto& mesh : replicated) {
    auto c = with_mesh(mesh);
    auto net = make<replicate<pipeline<one_f_one_b, tp_gpt>>>(c, seed{42}, opts<one_f_one_b>(2));
    check_clipped<tp_single>(c, net, 0.5, "replicated split gpt on " + mesh);
  }
}

TEST_CASE("1F1B keeps at most p - s micro-batches alive on stage s; GPipe keeps m") {
  // the schedules' replay, at sizes beyond this job's
  for (int p : {2, 4, 8})
    for (int m : {1, 3, 8, 16}) {
      const auto r1 = check_schedule<one_f_one_b>(p, m), rg = check_schedule<gpipe>(p, m);
      for (int s = 0; s < p; ++s) {
        CHECK(r1.peak_live[static_cast<std::size_t>(s)] == std::min(m, p - s));
        CHECK(rg.peak_live[static_cast<std::size_t>(s)] == m);
      }
    }
  // counted while running: 8 micro-batches of one sequence
  auto ctx = context::init();
  const int W = ctx.size();
  auto ctxp = with_mesh("pipe=" + std::to_string(W));
  auto n1 = make<pipeline<one_f_one_b, small_gpt>>(ctxp, seed{42}, opts<one_f_one_b>(8));
  auto ng = make<pipeline<gpipe, small_gpt>>(ctxp, seed{42}, opts<gpipe>(8));
  auto d1 = gpt_batches(), dg = gpt_batches();
  trainer(n1, sgd{.lr = 0.01f}, quiet()).run(d1, steps{2});
  trainer(ng, sgd{.lr = 0.01f}, quiet()).run(dg, steps{2});
  const int s = n1.stage();
  MESSAGE("stage " << s << " of " << W << ": 1f1b alive " << n1.peak_live_micro_batches() << " (slots "
                   << n1.activation_slots_used() << "), gpipe " << ng.peak_live_micro_batches());
  CHECK(n1.peak_live_micro_batches() == std::min(8, W - s));
  CHECK(n1.activation_slots_used() == std::min(8, W - s));
  CHECK(ng.peak_live_micro_batches() == 8);
  CHECK(ng.activation_slots_used() == 8);
}

TEST_CASE("pipeline errors: wrong degree, data axis without replicate, micro-batches, bad schedules") {
  auto ctx = context::init();
  const int W = ctx.size();
  using two = pipeline<one_f_one_b, stage<linear<8, 8>, relu>, stage<linear<8, 4>, softmax_cross_entropy>>;
  using four = pipeline<one_f_one_b, stage<linear<8, 8>>, stage<relu>, stage<linear<8, 8>>,
                        stage<linear<8, 4>, softmax_cross_entropy>>;
  auto ctxp = with_mesh("pipe=" + std::to_string(W));
  if (W != 2) {
    CHECK_THROWS_WITH_AS(make<two>(ctxp, seed{1}), doctest::Contains("the pipeline has 2 stages but the mesh's pipe axis has"),
                         std::invalid_argument);
  } else {
    CHECK_THROWS_WITH_AS(make<four>(ctxp, seed{1}), doctest::Contains("the pipeline has 4 stages but the mesh's pipe axis has 2"),
                         std::invalid_argument);
  }
  if (W > 1) {  // the default mesh puts every rank on data
    CHECK_THROWS_WITH_AS((make<pipeline<gpipe, small_gpt>>(ctx, seed{1})), doctest::Contains("the plan is not replicated"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS((make<pipeline<deadlocking, small_gpt>>(ctxp, seed{1}, opts<deadlocking>(4))),
                         doctest::Contains("the schedule deadlocks"), std::invalid_argument);
  }
  if (W > 2) {
    CHECK_THROWS_WITH_AS((make<pipeline<gpipe, small_gpt>>(ctxp, seed{1}, opts<gpipe>(2, {4, 0, 0, 0}))),
                         doctest::Contains("do not fit"), std::invalid_argument);
  }
  // pure checks: the same on every rank
  CHECK_THROWS_WITH_AS(check_schedule<deadlocking>(2, 4), doctest::Contains("stage 0 waits at B0"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(check_schedule<backward_first>(2, 2), doctest::Contains("runs B0 before F0"), std::invalid_argument);
  auto net = make<pipeline<gpipe, small_gpt>>(ctxp, seed{1}, opts<gpipe>(3));
  CHECK_THROWS_WITH_AS(net.local_batch(8), doctest::Contains("3 micro-batches do not divide the per-replica batch of 8"),
                       std::invalid_argument);
}

TEST_CASE("--trace: a merged Chrome trace with one span per forward, backward, send, receive, all-reduce, optimizer") {
  auto ctx = context::init();
  const int W = ctx.size();
  auto ctxp = with_mesh("pipe=" + std::to_string(W));
  const std::string path = "whale_pipeline_trace_np" + std::to_string(W) + ".json";
  constexpr int m = 4, n_steps = 3;
  {
    auto o = opts<one_f_one_b>(m);
    o.trace_path = path;
    auto net = make<pipeline<one_f_one_b, small_gpt>>(ctxp, seed{42}, o);
    auto data = gpt_batches();
    trainer(net, sgd{.lr = 0.01f}, quiet()).run(data, steps{n_steps});
    const auto ev = net.finish_trace();
    const auto b = measure_bubble(ev);
    CHECK(static_cast<int>(b.per_stage.size()) == W);
    for (double f : b.per_stage) CHECK((f >= 0.0 && f < 1.0));
    MESSAGE("bubble measured " << b.mean << " vs theory " << bubble_theory(W, m));
  }
  if (ctx.rank() == 0) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string s = ss.str();
    json_checker j{s};
    CHECK(j.document());
    std::size_t spans = 0;
    for (std::size_t at = 0; (at = s.find("\"ph\": \"X\"", at)) != std::string::npos; ++at) ++spans;
    // per step: 2m compute + 2 (loss all-reduce, optimizer) per stage, and 4m p2p per stage boundary
    const std::size_t want = static_cast<std::size_t>(n_steps) * (static_cast<std::size_t>(W) * (2 * m + 2) + 4u * m * (W - 1));
    CHECK(spans == want);
    std::size_t rows = 0;
    for (std::size_t at = 0; (at = s.find("\"process_name\"", at)) != std::string::npos; ++at) ++rows;
    CHECK(rows == static_cast<std::size_t>(W));
    std::remove(path.c_str());
  }
}
