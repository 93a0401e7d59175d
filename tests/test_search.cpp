// The reference workloads' plan search (bench/search.hpp: scripts/plan --search,
// scripts/bench --plan auto) breaks near-ties toward the simpler plan as
// auto_plan<M> does (plan/tie.hpp), on the shipped profiles of this machine.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "../bench/search.hpp"

using namespace whale;

namespace {
std::string label_of(const bench::search::candidate& c) { return c.label() + (c.pipe_outer ? " outer" : ""); }
}  // namespace

TEST_CASE("the plan search: a band of 0 ranks by prediction; a band moves only the simplest within it to the front") {
  for (const auto& [workload, n] : {std::pair{"gpt", 2}, std::pair{"gpt", 4}, std::pair{"mlp", 4}, std::pair{"xc", 2}}) {
    const auto dev = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/vm-" + std::to_string(n) + ".txt");
    bench::search::plan_query q;
    q.workload = workload;
    q.o.global_batch = -1, q.o.seq = -1, q.o.optimizer_bytes_per_param = 4;
    q.plan_tie = 0;
    const auto exact = bench::search::rank_plans(q, n, dev, 0);
    CHECK(!exact.front().tie);
    for (const auto& c : exact)
      if (c.valid && c.fits) CHECK(c.step_s >= exact.front().step_s);
    for (const double band : {0.02, 0.1}) {
      q.plan_tie = band;
      const auto r = bench::search::rank_plans(q, n, dev, 0);
      INFO(workload << " on " << n << ", band " << band << ": chose " << r.front().label() << ", fastest " << exact.front().label());
      REQUIRE(r.size() == exact.size());
      auto expect = exact;
      prefer_simpler(expect, band);
      for (std::size_t i = 0; i < r.size(); ++i) CHECK(label_of(r[i]) == label_of(expect[i]));
      CHECK(r.front().step_s <= exact.front().step_s * (1 + band));
      for (const auto& c : r)
        if (c.valid && c.fits && c.step_s <= exact.front().step_s * (1 + band)) CHECK(r.front().order <= c.order);
      CHECK(r.front().tie == (label_of(r.front()) != label_of(exact.front())));
    }
  }
  // the order is the simplicity: data parallelism before pipelines before tensor parallelism before 3-D
  bench::search::plan_query q;
  q.workload = "gpt";
  q.o.global_batch = -1, q.o.seq = -1;
  const auto dev = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/vm-4.txt");
  int dp = -1, pipe = -1, tp = -1, three = -1;
  for (const auto& c : bench::search::rank_plans(q, 4, dev, 0)) {
    if (c.a.plan == "dp" && c.a.o.micro_batches == 0 && !c.a.recompute) dp = c.order;
    if (c.a.plan == "pipeline" && pipe < 0) pipe = c.order;
    if (c.a.plan == "hybrid" && tp < 0) tp = c.order;
    if (c.a.plan == "3d" && three < 0) three = c.order;
  }
  CHECK(dp >= 0);
  CHECK(dp < pipe);
  CHECK(pipe < tp);
  CHECK(tp < three);
}

TEST_CASE("the plan search refuses a tie band outside [0, 1), naming it") {
  const auto dev = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/vm-2.txt");
  bench::search::plan_query q;
  q.workload = "mlp";
  q.o.global_batch = -1, q.o.seq = -1;
  for (const double bad : {-0.01, 1.0, std::nan("")}) {
    q.plan_tie = bad;
    CHECK_THROWS_WITH_AS(bench::search::rank_plans(q, 2, dev, 0), doctest::Contains("plan search: the tie band (--plan-tie) must be in [0, 1)"),
                         std::invalid_argument);
  }
}
