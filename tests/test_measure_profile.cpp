// measure_profile (plan/measure.hpp) in one process: the quick measurement fills
// every entry the planner reads (GEMM rates by size and transpose, thin factors,
// attention's rate, backward factors, bandwidth, the cores) in seconds, and its
// profile round-trips through the text format: written, read back and written
// again, the same text and the same figures to the bit. A run count outside 1 to 9
// is refused before anything is measured.
#include <doctest/doctest.h>

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "whale/comm/local_comm.hpp"
#include "whale/plan/measure.hpp"

using namespace whale;

TEST_CASE("a quick profile fills every entry the planner reads, and round-trips through the text format") {
  cpu::set_threads(1);  // as context::init does by default (a rank a core)
  local_comm w;
  const auto t0 = std::chrono::steady_clock::now();
  const device_profile p = measure_profile(w, {.quick = true, .name = "unit"});
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("quick profile on 1 rank in " << secs << " s:\n" << profile_text(p));
  CHECK(secs < 30);  // seconds, not the full measurement's minute (here: about 1 s at -Og)
  CHECK(p.name == "unit-1-ranks");
  CHECK(p.gemm.size() == 15);  // 5 cubes, each NN, NT and TN
  for (const auto& g : p.gemm) CHECK(g.gflops > 0);
  REQUIRE(p.thin.size() == 2);  // 16 and 64 rows
  for (const auto& t : p.thin) {
    CHECK(t.factor > 0);
    CHECK(t.factor <= 2);
    CHECK(t.width == 1024.0 * 4096.0);
  }
  REQUIRE(p.attention.size() == 2);
  for (const auto& a : p.attention) CHECK(a.gflops > 0);
  REQUIRE(p.backward.size() == 2);
  for (const auto& b : p.backward) CHECK((b.factor > 0 && b.factor <= 2));
  CHECK(p.bandwidth_bps > 0);
  CHECK(p.cores == static_cast<int>(std::thread::hardware_concurrency()));
  CHECK(p.cores_measured_ranks == 1);
  for (const auto& level : p.links)
    for (const auto& f : level) CHECK(f.ranks == 0);  // one rank: no collectives to measure
  // what the planner asks of it (plan/price.hpp) has answers
  CHECK(p.gemm_rate(1e9) > 0);
  CHECK(p.thin_factor(16, 1024.0 * 4096.0) == doctest::Approx(p.thin.front().factor));
  CHECK(p.attention_rate(256, 64) > 0);
  CHECK(p.backward_factor(512) > 0);

  const std::string text = profile_text(p);
  std::istringstream in(text);
  const device_profile q = device_profile::parse(in, "the round trip");
  CHECK(profile_text(q) == text);
  CHECK(q.name == p.name);
  REQUIRE(q.gemm.size() == p.gemm.size());
  for (std::size_t i = 0; i < p.gemm.size(); ++i) {
    CHECK((q.gemm[i].m == p.gemm[i].m && q.gemm[i].n == p.gemm[i].n && q.gemm[i].k == p.gemm[i].k));
    CHECK((q.gemm[i].ta == p.gemm[i].ta && q.gemm[i].tb == p.gemm[i].tb));
    CHECK(q.gemm[i].gflops == p.gemm[i].gflops);
  }
  REQUIRE(q.thin.size() == p.thin.size());
  for (std::size_t i = 0; i < p.thin.size(); ++i)
    CHECK((q.thin[i].rows == p.thin[i].rows && q.thin[i].factor == p.thin[i].factor && q.thin[i].width == p.thin[i].width));
  REQUIRE(q.attention.size() == p.attention.size());
  for (std::size_t i = 0; i < p.attention.size(); ++i)
    CHECK((q.attention[i].seq == p.attention[i].seq && q.attention[i].head_dim == p.attention[i].head_dim &&
           q.attention[i].gflops == p.attention[i].gflops));
  REQUIRE(q.backward.size() == p.backward.size());
  for (std::size_t i = 0; i < p.backward.size(); ++i)
    CHECK((q.backward[i].narrow == p.backward[i].narrow && q.backward[i].factor == p.backward[i].factor));
  CHECK(q.bandwidth_bps == p.bandwidth_bps);
  CHECK((q.cores == p.cores && q.cores_measured_ranks == p.cores_measured_ranks && q.waiting_share == p.waiting_share));
  for (double flops : {1e5, 1e7, 1e9, 1e11}) CHECK(q.gemm_rate(flops, 64, 4e6) == p.gemm_rate(flops, 64, 4e6));
}

TEST_CASE("measure_profile refuses a run count outside 1 to 9 before measuring") {
  local_comm w;
  for (int runs : {0, 10})
    CHECK_THROWS_WITH_AS(measure_profile(w, {.runs = runs}),
                         doctest::Contains(("runs " + std::to_string(runs) + " is out of range; allowed 1 to 9").c_str()),
                         std::invalid_argument);
}
