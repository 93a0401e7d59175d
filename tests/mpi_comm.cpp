// mpi_comm: semantics of every collective (blocking and non-blocking) for
// f32, f64, i32, i64, uneven (v) and zero sizes, send/recv, sub-communicators
// and the traffic counters. Runs at 1, 2 and 4 ranks; CHECK, never REQUIRE.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/mpi_comm.hpp"

using namespace whale;

static_assert(Communicator<mpi_comm>);

namespace {
mpi_comm& world() {
  static mpi_comm w = mpi_comm::world();
  return w;
}
// Rank r holds (r + 1) · (i + 1) at index i.
template <class T> tensor<T> ramp(index_t n, int r) {
  tensor<T> t(shape{n});
  for (index_t i = 0; i < n; ++i) t[i] = static_cast<T>((r + 1) * (i + 1));
  return t;
}
template <class T> T expected(reduce_op op, index_t i, int p) {
  const T sum = static_cast<T>((i + 1) * p * (p + 1) / 2);
  switch (op) {
    case reduce_op::sum: return sum;
    case reduce_op::avg: return static_cast<T>(sum / static_cast<T>(p));
    case reduce_op::max: return static_cast<T>(p * (i + 1));
    case reduce_op::min: return static_cast<T>(i + 1);
  }
  return T{};
}
}  // namespace

TEST_CASE_TEMPLATE("all_reduce: sum, avg, max, min, blocking and not", T, float, double,
                   std::int32_t, std::int64_t) {
  auto& c = world();
  const int p = c.size(), r = c.rank();
  for (auto op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
    for (index_t n : {index_t{0}, index_t{1}, index_t{1001}}) {
      auto a = ramp<T>(n, r);
      all_reduce(c, a, op);
      auto b = ramp<T>(n, r);
      auto req = iall_reduce(c, b.v(), op);
      while (!req.test()) {
      }
      for (index_t i = 0; i < n; ++i) {
        CHECK(a[i] == doctest::Approx(expected<T>(op, i, p)));
        CHECK(b[i] == a[i]);
      }
    }
  }
  // A view of some rows of a bigger tensor: only those rows change.
  tensor<T> m(shape{4, 3});
  for (auto& x : m) x = T(1);
  all_reduce(c, m.v().rows(1, 2));
  CHECK(m[0] == T(1));
  CHECK(m[3] == T(p));
  CHECK(m[8] == T(p));
  CHECK(m[9] == T(1));
}

TEST_CASE_TEMPLATE("all_gather and all_gather_v (uneven, zero, in place)", T, float, double,
                   std::int32_t, std::int64_t) {
  auto& c = world();
  const int p = c.size(), r = c.rank();
  tensor<T> in(shape{3});
  for (index_t i = 0; i < 3; ++i) in[i] = T(10 * r + i);
  tensor<T> out(shape{3 * p});
  all_gather(c, in, out);
  for (int q = 0; q < p; ++q)
    for (index_t i = 0; i < 3; ++i) CHECK(out[3 * q + i] == T(10 * q + i));

  // In place: the input is this rank's block of the output.
  tensor<T> buf(shape{2 * p});
  buf[2 * r] = T(r), buf[2 * r + 1] = T(-r);
  iall_gather(c, buf.v().rows(2 * r, 2), buf.v()).wait();
  for (int q = 0; q < p; ++q) CHECK(buf[2 * q + 1] == T(-q));

  // Rank q contributes q elements (rank 0 none).
  std::vector<index_t> counts(static_cast<std::size_t>(p));
  std::iota(counts.begin(), counts.end(), index_t{0});
  const index_t total = std::accumulate(counts.begin(), counts.end(), index_t{0});
  tensor<T> mine(shape{r});
  for (index_t i = 0; i < r; ++i) mine[i] = T(100 * r + i);
  tensor<T> all(shape{total});
  all_gather_v(c, mine, all, counts);
  index_t at = 0;
  for (int q = 0; q < p; ++q)
    for (index_t i = 0; i < q; ++i) CHECK(all[at++] == T(100 * q + i));

  tensor<T> none(shape{0}), none_out(shape{0});
  all_gather(c, none, none_out);
}

TEST_CASE_TEMPLATE("reduce_scatter and reduce_scatter_v (uneven, in place, avg)", T, float, double,
                   std::int32_t, std::int64_t) {
  auto& c = world();
  const int p = c.size(), r = c.rank();
  const index_t n = 4;
  auto in = ramp<T>(n * p, r);
  tensor<T> out(shape{n});
  reduce_scatter(c, in, out);
  for (index_t i = 0; i < n; ++i) CHECK(out[i] == expected<T>(reduce_op::sum, r * n + i, p));

  auto inp = ramp<T>(n * p, r);  // in place: the result lands in the first block
  ireduce_scatter(c, inp.v(), inp.v().rows(0, n), reduce_op::max).wait();
  for (index_t i = 0; i < n; ++i) CHECK(inp[i] == expected<T>(reduce_op::max, r * n + i, p));

  auto counts = block_counts(7, p);  // 7 elements over p ranks, not divisible by 2 or 4
  auto in7 = ramp<T>(7, r);
  tensor<T> mine(shape{counts[static_cast<std::size_t>(r)]});
  reduce_scatter_v(c, in7, mine, counts, reduce_op::avg);
  index_t first = 0;
  for (int q = 0; q < r; ++q) first += counts[static_cast<std::size_t>(q)];
  for (index_t i = 0; i < mine.numel(); ++i)
    CHECK(mine[i] == doctest::Approx(expected<T>(reduce_op::avg, first + i, p)));

  tensor<T> none(shape{0}), none_out(shape{0});
  reduce_scatter(c, none, none_out);
}

TEST_CASE_TEMPLATE("broadcast from every root", T, float, double, std::int32_t, std::int64_t) {
  auto& c = world();
  for (int root = 0; root < c.size(); ++root) {
    tensor<T> b(shape{5});
    for (auto& x : b) x = T(c.rank() == root ? 7 + root : -1);
    if (root % 2) ibroadcast(c, b, root).wait();
    else broadcast(c, b, root);
    for (auto x : b) CHECK(x == T(7 + root));
  }
  tensor<T> e(shape{0});
  broadcast(c, e, 0);
}

TEST_CASE("send and recv around a ring, blocking and not") {
  auto& c = world();
  const int p = c.size(), r = c.rank();
  tensor<float> out(shape{6}), in(shape{6});
  for (index_t i = 0; i < 6; ++i) out[i] = float(r * 10 + i);
  auto rq = irecv(c, in, (r + p - 1) % p, 3);
  auto sq = isend(c, out, (r + 1) % p, 3);
  sq.wait();
  rq.wait();
  CHECK(in[5] == float(((r + p - 1) % p) * 10 + 5));
  // Blocking pairs: even ranks send first.
  if (p > 1) {
    tensor<std::int64_t> v(shape{2});
    const int partner = r ^ 1;
    if (partner < p) {
      v[0] = r;
      if (r % 2 == 0) {
        send(c, v, partner, 1);
        recv(c, v, partner, 2);
      } else {
        tensor<std::int64_t> got(shape{2});
        recv(c, got, partner, 1);
        CHECK(got[0] == partner);
        send(c, v, partner, 2);
      }
    }
  }
  barrier(c);
  auto b = ibarrier(c);
  b.wait();
  CHECK(b.test());
}

TEST_CASE("split: sub-communicators by color, ordered by key") {
  auto& c = world();
  const int p = c.size(), r = c.rank();
  auto half = c.split(r % 2, -r, "parity");  // reversed order inside each color
  const int members = (p + 1 - r % 2) / 2;
  CHECK(half.size() == members);
  CHECK(half.name() == "parity");
  tensor<std::int32_t> x(shape{1});
  x[0] = r;
  all_reduce(half, x);
  int expect = 0;
  for (int q = r % 2; q < p; q += 2) expect += q;
  CHECK(x[0] == expect);
  // Highest world rank first.
  CHECK(half.world_rank(0) == (p - 1 - ((p - 1) % 2 != r % 2 ? 1 : 0)));
  auto none = c.split(r == 0 ? -1 : 1, 0);
  CHECK(none.valid() == (r != 0));
}

TEST_CASE("traffic counters follow the ring model") {
  auto& c = world();
  const int p = c.size(), r = c.rank();
  c.reset_stats();
  tensor<float> a(shape{1000});
  all_reduce(c, a);
  CHECK(c.stats().bytes_sent == 2 * (p - 1) * 4000 / p);
  CHECK(c.stats().bytes_received == c.stats().bytes_sent);
  c.reset_stats();
  tensor<double> g(shape{10 * p});
  all_gather(c, g.v().rows(r * 10, 10), g.v());
  CHECK(c.stats().bytes_sent == (p - 1) * 80);
  c.reset_stats();
  tensor<float> b(shape{8});
  broadcast(c, b, 0);
  const std::int64_t sent = p == 1 ? 0 : (r == p - 1 ? 0 : 32);
  const std::int64_t recvd = p == 1 || r == 0 ? 0 : 32;
  CHECK(c.stats().bytes_sent == sent);
  CHECK(c.stats().bytes_received == recvd);
  CHECK(c.stats().operations == 1);
}

TEST_CASE("size errors are thrown before any communication, with the same words") {
  auto& c = world();
  tensor<float> a(shape{3}), b(shape{3 * c.size() + 1});
  CHECK_THROWS_WITH_AS(all_gather(c, a, b), doctest::Contains("whale::all_gather: the output holds"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(reduce_scatter(c, b, a), doctest::Contains("whale::reduce_scatter"),
                       std::invalid_argument);
  std::vector<index_t> wrong(static_cast<std::size_t>(c.size() + 1), 1);
  CHECK_THROWS_AS(all_gather_v(c, a, b, wrong), std::invalid_argument);
  CHECK_THROWS_AS(broadcast(c, a, c.size()), std::invalid_argument);
  barrier(c);
}
