// local_comm (a world of one rank) and the MPI-free context: every collective
// is a copy or a no-op, sends to self are buffered, and the mesh is 1×1×1.
// device_comm over it: the progress hook its waits call, and the guarded
// backend's window that its operations open.
#include <doctest/doctest.h>

#include <numeric>
#include <vector>

#include "whale/backend/guarded.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/comm/device_comm.hpp"
#include "whale/comm/local_comm.hpp"

using namespace whale;

static_assert(Communicator<local_comm>);
#ifndef WHALE_HAS_MPI
static_assert(std::is_same_v<world_comm, local_comm>);
#endif

TEST_CASE_TEMPLATE("local_comm: collectives are copies or no-ops", T, float, double, std::int32_t,
                   std::int64_t) {
  local_comm c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);
  tensor<T> a(shape{5});
  std::iota(a.begin(), a.end(), T(1));
  for (auto op : {reduce_op::sum, reduce_op::avg, reduce_op::max, reduce_op::min}) {
    all_reduce(c, a, op);
    iall_reduce(c, a.v(), op).wait();
  }
  for (index_t i = 0; i < 5; ++i) CHECK(a[i] == T(i + 1));

  tensor<T> out(shape{5});
  all_gather(c, a.v().as_const(), out);
  CHECK(out[4] == T(5));
  out.zero();
  auto r = ireduce_scatter(c, a, out.v());
  CHECK(r.test());
  CHECK(out[0] == T(1));
  std::vector<index_t> counts{5};
  out.zero();
  all_gather_v(c, a, out, counts);
  CHECK(out[2] == T(3));
  out.zero();
  reduce_scatter_v(c, a, out, counts, reduce_op::max);
  CHECK(out[3] == T(4));
  broadcast(c, a, 0);
  barrier(c);
  ibarrier(c).wait();
  CHECK(c.stats().bytes_sent == 0);
  CHECK(c.stats().bytes_received == 0);
  CHECK(c.stats().operations > 0);
}

TEST_CASE("local_comm: zero-size buffers") {
  local_comm c;
  tensor<float> e(shape{0});
  all_reduce(c, e);
  all_gather(c, e, e);
  reduce_scatter(c, e, e);
  broadcast(c, e, 0);
}

TEST_CASE("local_comm: send to self, in either order") {
  local_comm c;
  tensor<float> x(shape{3}), y(shape{3});
  x[0] = 1, x[1] = 2, x[2] = 3;
  send(c, x, 0, 7);
  recv(c, y, 0, 7);
  CHECK(y[2] == 3.f);
  tensor<float> z(shape{3});
  auto r = irecv(c, z, 0, 1);
  CHECK_FALSE(r.test());
  isend(c, x, 0, 1).wait();
  CHECK(r.test());
  CHECK(z[1] == 2.f);
  auto lost = irecv(c, z, 0, 9);
  CHECK_THROWS_AS(lost.wait(), std::logic_error);
  CHECK_THROWS_AS(send(c, x, 1), std::invalid_argument);
}

TEST_CASE("local_comm: size checks say what is wrong") {
  local_comm c;
  tensor<float> a(shape{4}), b(shape{3});
  CHECK_THROWS_WITH_AS(all_gather(c, a, b), doctest::Contains("whale::all_gather: the output holds 3"),
                       std::invalid_argument);
  std::vector<index_t> two{2, 2};
  CHECK_THROWS_AS(all_gather_v(c, a, b, two), std::invalid_argument);
}

TEST_CASE("local_comm: split and a 1-rank mesh") {
  local_comm w;
  auto s = w.split(3, 0);
  CHECK(s.size() == 1);
  basic_mesh<local_comm> m(w, mesh_shape::parse("", 1));
  CHECK(m.comm(axis::data).size() == 1);
  CHECK(m.comm(axis::data | axis::model).name() == "data+model");
  CHECK(m.shape() == mesh_shape(1, 1, 1));
}

#ifndef WHALE_HAS_MPI
TEST_CASE("context without MPI: a world of one rank; flags are removed") {
  char a0[] = "prog", a1[] = "--mesh", a2[] = "data=1", a3[] = "keep", a4[] = "--threads=1";
  char* args[] = {a0, a1, a2, a3, a4, nullptr};
  int argc = 5;
  char** argv = args;
  auto ctx = context::init(argc, argv);
  CHECK(argc == 2);
  CHECK(std::string(argv[1]) == "keep");
  CHECK(argv[2] == nullptr);
  CHECK(ctx.rank() == 0);
  CHECK(ctx.size() == 1);
  CHECK(ctx.threads() == 1);
  CHECK(ctx.mesh().shape() == mesh_shape(1, 1, 1));
  auto moved = std::move(ctx);
  CHECK(moved.size() == 1);
  CHECK(run_guarded(moved, [] { return 42; }) == 42);
}

TEST_CASE("context without MPI: a mesh of 2 ranks is a clear error") {
  char a0[] = "prog", a1[] = "--mesh=data=2";
  char* args[] = {a0, a1, nullptr};
  int argc = 2;
  char** argv = args;
  CHECK_THROWS_WITH_AS(context::init(argc, argv),
                       doctest::Contains("needs 2 ranks, but the job has 1"), mesh_error);
}
#endif

namespace {
// local_comm whose operations complete only after `delay` tests, with a request
// that can poll while it waits (as nccl_comm's does): what device_comm's progress hook needs.
struct slow_comm {
  using space = whale::host;
  struct request {
    int left = 0;
    bool test() { return left <= 0 || --left <= 0; }
    void wait() { left = 0; }
    template <class Poll> void wait(Poll&& poll) {
      while (!test()) poll();
    }
  };
  local_comm c = local_comm();
  int delay = 3;
  int rank() const { return c.rank(); }
  int size() const { return c.size(); }
  std::string name() const { return c.name(); }
  comm_stats stats() const { return c.stats(); }
  void reset_stats() { c.reset_stats(); }
  request done() const { return request{delay}; }
  request iall_reduce(void* b, index_t n, dtype t, reduce_op op) { return c.iall_reduce(b, n, t, op).wait(), done(); }
  request iall_gather(const void* i, void* o, index_t n, dtype t) { return c.iall_gather(i, o, n, t).wait(), done(); }
  request iall_gather_v(const void* i, void* o, std::span<const index_t> k, dtype t) {
    return c.iall_gather_v(i, o, k, t).wait(), done();
  }
  request ireduce_scatter(const void* i, void* o, index_t n, dtype t, reduce_op op) {
    return c.ireduce_scatter(i, o, n, t, op).wait(), done();
  }
  request ireduce_scatter_v(const void* i, void* o, std::span<const index_t> k, dtype t, reduce_op op) {
    return c.ireduce_scatter_v(i, o, k, t, op).wait(), done();
  }
  request ibroadcast(void* b, index_t n, dtype t, int root) { return c.ibroadcast(b, n, t, root).wait(), done(); }
  request isend(const void* b, index_t n, dtype t, int dst, int tag) { return c.isend(b, n, t, dst, tag).wait(), done(); }
  request irecv(void* b, index_t n, dtype t, int src, int tag) { return c.irecv(b, n, t, src, tag), done(); }
  request ibarrier() { return done(); }
  slow_comm split(int color, int key) { return slow_comm{c.split(color, key), delay}; }
};
static_assert(Communicator<slow_comm>);
}  // namespace

TEST_CASE("device_comm: waits poll the progress hook where the request can; blocking forms too; split keeps it") {
  device_comm d(slow_comm{}, backend_ref{});
  CHECK(d.valid());
  tensor<float> a(shape{4});
  d.iall_reduce(a.data(), 4, dtype::f32, reduce_op::sum).wait();  // no hook: waits without polling
  int polls = 0;
  d.set_progress([&] { ++polls; });
  d.iall_reduce(a.data(), 4, dtype::f32, reduce_op::sum).wait();
  CHECK(polls == 2);  // three tests to complete: two polls between them
  all_reduce(d, a.v());  // slow_comm has no blocking form: the non-blocking one, waited for with polls
  CHECK(polls == 4);
  auto half = d.split(0, 0);
  half.iall_reduce(a.data(), 4, dtype::f32, reduce_op::sum).wait();
  CHECK(polls == 6);
  auto r = d.iall_reduce(a.data(), 4, dtype::f32, reduce_op::sum);
  CHECK_FALSE(r.test());
  CHECK_FALSE(r.test());
  CHECK(r.test());  // completed by tests alone: no poll
  CHECK(polls == 6);
}

TEST_CASE("device_comm on the guarded backend: its operations reach device memory inside the backend's window") {
  guarded_backend g;
  tensor<float> in, out;
  {
    const place_scope on(g.memory());
    in = tensor<float>(shape{3});
    out = tensor<float>(shape{3});
  }
  const std::vector<float> v{1.f, 2.f, 3.f};
  g.copy(in.data(), v.data(), 3 * sizeof(float));
  local_comm world;
  auto d = make_device_comm(world, backend_ref(g));
  REQUIRE(d);
  all_gather(*d, in.v(), out.v());  // local_comm copies with memcpy: inside the window
  d->iall_gather(in.data(), out.data(), 3, dtype::f32).wait();
  std::vector<float> back(3);
  g.copy(back.data(), out.data(), 3 * sizeof(float));
  CHECK(back == v);
  CHECK(make_device_comm(world, backend_ref{}) == nullptr);  // the CPU: none
}
