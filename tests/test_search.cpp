// The reference workloads' plan search (bench/search.hpp: scripts/plan --search,
// scripts/bench --plan auto) breaks near-ties toward the simpler plan as
// auto_plan<M> does (plan/tie.hpp), on the shipped profiles of this machine.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
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

TEST_CASE("the plan search prices a 3-D plan with ZeRO level L where level L - 1 is over the memory limit, and only there") {
  const auto dev = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/vm-4.txt");
  bench::search::plan_query q;
  q.workload = "gpt";
  q.o.global_batch = -1, q.o.seq = -1;
  // label -> predicted MiB of the valid 3-D plans, with a memory limit (0: none)
  auto three_d = [&](double limit) {
    std::map<std::string, double> memory;
    for (const auto& c : bench::search::rank_plans(q, 8, dev, limit))
      if (c.a.plan == "3d") {
        INFO(c.label() << ": " << c.why);
        CHECK(c.valid);
        memory[c.label()] = c.memory_mib;
        if (c.a.zero > 0) CHECK(c.mesh.rfind("data=2,", 0) == 0);  // data=1 meshes: no ZeRO
      }
    return memory;
  };
  auto label = [](int m, int z, const char* rec) {
    return "3d 1f1b m=" + std::to_string(m) + (z > 0 ? " zero" + std::to_string(z) : "") + rec + " on data=2,pipe=2,model=2";
  };
  // no limit: every plain 3-D plan fits, no ZeRO is priced
  auto least = [&](const std::map<std::string, double>& memory, int z) {
    double l = 1e300;
    for (const char* rec : {"", " recompute"})
      for (int m : {2, 4, 8}) {
        INFO(label(m, z, rec));
        REQUIRE(memory.count(label(m, z, rec)) == 1);
        l = std::min(l, memory.at(label(m, z, rec)));
      }
    return l;
  };
  auto levels = [](const std::map<std::string, double>& memory) {
    int most = 0;
    for (const auto& [l, mib] : memory)
      for (int z = 1; z <= 3; ++z)
        if (l.find(" zero" + std::to_string(z)) != std::string::npos) most = std::max(most, z);
    return most;
  };
  const auto free = three_d(0);
  CHECK(levels(free) == 0);
  // a limit the smallest plain plan fits with under tie_headroom of it free: its ZeRO-1 form is
  // priced too (a near-tie goes to a plan that leaves room), and only where a plan is that snug
  {
    const double snug = least(free, 0) / 0.95;
    const auto near = three_d(snug);
    int priced = 0;
    for (const char* rec : {"", " recompute"})
      for (int m : {2, 4, 8}) {
        const bool tight = free.at(label(m, 0, rec)) > (1.0 - tie_headroom) * snug;
        INFO(label(m, 1, rec) << ", the plain plan " << free.at(label(m, 0, rec)) << " MiB under " << snug);
        CHECK(near.count(label(m, 1, rec)) == (tight ? 1u : 0u));
        priced += static_cast<int>(near.count(label(m, 1, rec)));
      }
    CHECK(priced > 0);
  }
  // level by level: a limit under every plan of level z - 1 prices level z of each, and
  // level z + 1 exactly where level z is over the limit too
  double limit = least(free, 0) - 0.001;
  for (int z = 1; z <= 2; ++z) {
    const auto tight = three_d(limit);
    int next = 0;
    for (const char* rec : {"", " recompute"})
      for (int m : {2, 4, 8}) {
        INFO(label(m, z, rec) << " under " << limit << " MiB");
        REQUIRE(tight.count(label(m, z, rec)) == 1);
        if (z == 1) CHECK(tight.at(label(m, 1, rec)) < tight.at(label(m, 0, rec)));  // the optimizer state sharded over data:2
        CHECK(tight.count(label(m, z + 1, rec)) == (tight.at(label(m, z, rec)) > limit ? 1u : 0u));
        next += static_cast<int>(tight.count(label(m, z + 1, rec)));
      }
    // gpt's ZeRO-2 needs more than its ZeRO-1 here (its 8192 x 128 embedding shard reduce-scattered whole per micro-batch)
    if (z == 2) CHECK(next > 0);
    limit = least(tight, z) - 0.001;
  }
}

TEST_CASE("the plan search prices the job's precision (--precision), and refuses a profile that times the other one") {
  bench::search::plan_query q;
  q.workload = "gpt";
  q.o.global_batch = -1, q.o.seq = -1;
  const auto vm = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/vm-4.txt");  // no kernels line
  REQUIRE(vm.kernel_precision.empty());
  // the profile's precision when none is given (fp32 without a kernels line)
  CHECK_FALSE(bench::search::prices_bf16(q, vm));
  std::map<std::string, double> fp32_memory;
  for (const auto& c : bench::search::rank_plans(q, 4, vm, 0))
    if (c.valid) fp32_memory[c.label()] = c.memory_mib;
  q.trains_in = precision::bf16;
  CHECK(bench::search::prices_bf16(q, vm));
  int compared = 0, zero3 = 0;
  for (const auto& c : bench::search::rank_plans(q, 4, vm, 0)) {
    INFO(c.label() << ": " << c.why);
    if (c.a.plan == "zero3" || c.a.zero == 3) {  // the one rule refuses bf16 with ZeRO-3
      CHECK_FALSE(c.valid);
      CHECK(c.why.find("bf16 mixed precision with ZeRO-3 is not implemented") != std::string::npos);
      ++zero3;
      continue;
    }
    if (!c.valid || !fp32_memory.count(c.label())) continue;
    CHECK(c.memory_mib > fp32_memory.at(c.label()));  // the fp32 master weights beside the bf16 parameters
    ++compared;
  }
  CHECK(zero3 > 0);
  CHECK(compared > 0);
  // a profile of bf16 kernels prices a bf16 job, and refuses an fp32 one, naming both
  const auto h200 = device_profile::load(std::string(WHALE_PROFILES_DIR) + "/datasheet-h200-8x-ib400-bf16.txt");
  CHECK(bench::search::prices_bf16(q, h200));
  q.trains_in = precision::fp32;
  CHECK_THROWS_WITH_AS(bench::search::rank_plans(q, 8, h200, 0),
                       doctest::Contains("plan search: the device profile times its kernels in bf16 (its 'kernels' line), but "
                                         "the plan trains in fp32 (--precision)"),
                       std::invalid_argument);
  q.trains_in.reset();
  CHECK(bench::search::prices_bf16(q, h200));
}
