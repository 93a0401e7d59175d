// Tensors, views, shapes and the memory tracker.
#include <doctest/doctest.h>

#include <cstdint>

#include "whale/tensor/random.hpp"
#include "whale/tensor/tensor.hpp"

using namespace whale;

TEST_CASE("shape: rank, extents and bounds") {
  shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.row_size() == 12);
  CHECK(s[1] == 3);
  CHECK_THROWS_AS(s[3], std::out_of_range);
  CHECK_THROWS_AS((shape{1, 2, 3, 4, 5}), std::invalid_argument);
  CHECK_THROWS_AS((shape{2, -1}), std::invalid_argument);
  CHECK(shape{} .numel() == 1);
  CHECK(s.with_rows(5) == shape{5, 3, 4});
}

TEST_CASE("tensor: aligned, zeroed, move-only, resize reuses storage") {
  tensor<float> t({16, 8});
  CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  for (float v : t) CHECK(v == 0.f);
  float* p = t.data();
  t.resize({8, 8});
  CHECK(t.data() == p);  // smaller: same storage
  CHECK(t.numel() == 64);
  tensor<float> u = std::move(t);
  CHECK(u.data() == p);
  CHECK(t.data() == nullptr);
  tensor<float> big({1 << 20});  // 4 MiB: 2 MiB aligned
  CHECK(reinterpret_cast<std::uintptr_t>(big.data()) % (2u << 20) == 0);
}

TEST_CASE("view: rows, reshape, const conversion and checks") {
  tensor<float> t({4, 3});
  for (index_t i = 0; i < 12; ++i) t[i] = static_cast<float>(i);
  view<float> v = t;
  auto r = v.rows(1, 2);
  CHECK(r.shape() == shape{2, 3});
  CHECK(r[0] == 3.f);
  CHECK_THROWS_AS(v.rows(3, 2), std::out_of_range);
  CHECK(v.reshape({2, 6}).shape() == shape{2, 6});
  CHECK_THROWS_AS(v.reshape({5, 2}), std::invalid_argument);
  cview<float> c = v;
  CHECK(c.data() == v.data());
  CHECK_THROWS_AS(v.at(12), std::out_of_range);
}

TEST_CASE("memory tracker counts live and peak bytes by kind") {
  const auto before = memory_snapshot();
  {
    tensor<float> a({1000}, mem_kind::params);
    tensor<float> b({500}, mem_kind::optimizer);
    const auto during = memory_snapshot();
    CHECK(during.live_of(mem_kind::params) - before.live_of(mem_kind::params) == 4000);
    CHECK(during.live_of(mem_kind::optimizer) - before.live_of(mem_kind::optimizer) == 2000);
    CHECK(during.allocations - before.allocations == 2);
  }
  const auto after = memory_snapshot();
  CHECK(after.live_of(mem_kind::params) == before.live_of(mem_kind::params));
  CHECK(after.peak_of(mem_kind::params) >= before.live_of(mem_kind::params) + 4000);
}

TEST_CASE("counter_rng: pure function of (seed, stream, index)") {
  counter_rng a(seed{1}), b(seed{1}), c(seed{2});
  CHECK(a.bits(10) == b.bits(10));
  CHECK(a.bits(10) != c.bits(10));
  CHECK(a.child(3).bits(0) == b.child(3).bits(0));
  CHECK(a.child(3).bits(0) != a.child(4).bits(0));
  double m = 0, v = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const double x = a.normal(static_cast<std::uint64_t>(i));
    m += x;
    v += x * x;
  }
  m /= n;
  v = v / n - m * m;
  CHECK(std::abs(m) < 0.03);
  CHECK(std::abs(v - 1) < 0.05);
}
