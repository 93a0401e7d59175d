// The device mesh: parsing and validation of shapes, rank <-> coordinates,
// axis groups and their communicators over MPI at 1, 2 and 4 ranks, printing,
// and context::init's flag handling. CHECK, never REQUIRE, before collectives.
#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "whale/comm/context.hpp"

using namespace whale;

namespace {
int world_size() {
  int p = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}
std::vector<mesh_shape> shapes_of(int p) {
  std::vector<mesh_shape> s;
  for (int d = 1; d <= p; ++d)
    for (int q = 1; q <= p; ++q)
      for (int m = 1; m <= p; ++m)
        if (d * q * m == p) s.emplace_back(d, q, m);
  return s;
}
}  // namespace

TEST_CASE("mesh_shape: parse, defaults and inference") {
  CHECK(mesh_shape::parse("", 4) == mesh_shape(4, 1, 1));
  CHECK(mesh_shape::parse("data=2,model=2", 4) == mesh_shape(2, 1, 2));
  CHECK(mesh_shape::parse("model=2", 4) == mesh_shape(2, 1, 2));  // data inferred
  CHECK(mesh_shape::parse("model=2, pipe=2", 8) == mesh_shape(2, 2, 2));
  CHECK(mesh_shape::parse(mesh_shape(1, 2, 3).spec(), 6) == mesh_shape(1, 2, 3));
  std::ostringstream os;
  os << mesh_shape(2, 1, 2);
  CHECK(os.str() == "data:2 × pipe:1 × model:2");
}

TEST_CASE("mesh_shape: a wrong mesh is a clear error") {
  CHECK_THROWS_WITH_AS(mesh_shape::parse("data=3", 2),
                       "whale: the mesh data:3 × pipe:1 × model:1 (from --mesh data=3) needs 3 "
                       "ranks, but the job has 2 (mpirun -np 2); launch with -np 3 or give a mesh "
                       "whose axis sizes multiply to 2",
                       mesh_error);
  CHECK_THROWS_WITH_AS(mesh_shape::parse("model=3", 4), doctest::Contains("multiple of pipe×model = 3"),
                       mesh_error);
  CHECK_THROWS_WITH_AS(mesh_shape::parse("tensor=2", 2), doctest::Contains("unknown axis 'tensor'"),
                       mesh_error);
  CHECK_THROWS_WITH_AS(mesh_shape::parse("data=x", 2), doctest::Contains("positive integer"), mesh_error);
  CHECK_THROWS_WITH_AS(mesh_shape::parse("data=0", 2), doctest::Contains("positive integer"), mesh_error);
  CHECK_THROWS_WITH_AS(mesh_shape::parse("data=1,data=2", 2), doctest::Contains("given twice"), mesh_error);
  CHECK_THROWS_WITH_AS(mesh_shape::parse("data2", 2), doctest::Contains("not axis=size"), mesh_error);
  CHECK_NOTHROW(mesh_shape(2, 1, 2).validate(4));
  CHECK_THROWS_AS(mesh_shape(2, 1, 2).validate(2), mesh_error);
}

TEST_CASE("mesh_shape: coordinates, model innermost, groups") {
  const mesh_shape m(2, 1, 2);
  CHECK(m.coords(3) == std::array<int, 3>{1, 0, 1});
  CHECK(m.coords(1) == std::array<int, 3>{0, 0, 1});
  for (int r = 0; r < 4; ++r) CHECK(m.rank_of(m.coords(r)) == r);
  CHECK(m.groups(axis::model) == std::vector<std::vector<int>>{{0, 1}, {2, 3}});
  CHECK(m.groups(axis::data) == std::vector<std::vector<int>>{{0, 2}, {1, 3}});
  CHECK(m.groups(axis::pipe) == std::vector<std::vector<int>>{{0}, {1}, {2}, {3}});
  CHECK(m.group(axis::data | axis::model, 2) == std::vector<int>{0, 1, 2, 3});
  const mesh_shape q(2, 2, 2);
  CHECK(q.coords(5) == std::array<int, 3>{1, 0, 1});
  CHECK(q.group(axis::pipe, 5) == std::vector<int>{5, 7});
  CHECK(q.group(axis::data | axis::pipe, 5) == std::vector<int>{1, 3, 5, 7});
  CHECK(q.index_in(axis::data | axis::pipe, 5) == 2);
  CHECK_THROWS_AS(q.coords(8), std::out_of_range);
}

TEST_CASE("basic_mesh over MPI: every shape of this world, communicators per axis group") {
  const int p = world_size();
  auto world = mpi_comm::world();
  const int r = world.rank();
  for (const auto& s : shapes_of(p)) {
    CAPTURE(s.spec());
    basic_mesh<mpi_comm> m(world, s);
    for (unsigned b = 1; b < 8; ++b) {
      const auto ax = axes::from_bits(b);
      auto& c = m.comm(ax);
      CHECK(c.size() == s.size(ax));
      CHECK(c.rank() == s.index_in(ax, r));
      CHECK(c.world_ranks() == s.group(ax, r));
      CHECK(c.name() == ax.name());
      // The sum of world ranks over the group, through the group's communicator.
      tensor<std::int64_t> x(shape{1});
      x[0] = r;
      all_reduce(c, x);
      std::int64_t expect = 0;
      for (int q : s.group(ax, r)) expect += q;
      CHECK(x[0] == expect);
    }
    for (auto a : all_axes) CHECK(m.coord(a) == s.coord(r, a));
  }
}

TEST_CASE("basic_mesh prints its shape and groups") {
  if (world_size() != 4) return;
  auto world = mpi_comm::world();
  basic_mesh<mpi_comm> m(world, mesh_shape::parse("data=2,model=2", 4));
  std::ostringstream os;
  os << m;
  CHECK(os.str() ==
        "mesh data:2 × pipe:1 × model:2 (4 ranks)\n"
        "  data groups: {0,2} {1,3}\n"
        "  pipe groups: {0} {1} {2} {3}\n"
        "  model groups: {0,1} {2,3}");
}

TEST_CASE("context::init: removes its flags, builds the mesh, validates on every rank") {
  const int p = world_size();
  const std::string spec = "model=" + std::to_string(p);
  std::vector<std::string> words{"prog", "--mesh", spec, "keep", "--threads=1"};
  std::vector<char*> args;
  for (auto& w : words) args.push_back(w.data());
  args.push_back(nullptr);
  int argc = 5;
  char** argv = args.data();
  {
    auto ctx = context::init(argc, argv);  // MPI already initialized: the test main owns it
    CHECK(argc == 2);
    CHECK(std::string(argv[1]) == "keep");
    CHECK(ctx.size() == p);
    CHECK(ctx.mesh().shape() == mesh_shape(1, 1, p));
    CHECK(ctx.mesh().comm(axis::model).size() == p);
    CHECK(ctx.threads() == 1);
    auto moved = std::move(ctx);
    CHECK(moved.world().size() == p);
  }
  std::string bad = "--mesh=data=" + std::to_string(p + 1);
  char* bargs[] = {words[0].data(), bad.data(), nullptr};
  int bargc = 2;
  char** bargv = bargs;
  const std::string want =
      "needs " + std::to_string(p + 1) + " ranks, but the job has " + std::to_string(p);
  CHECK_THROWS_WITH_AS(context::init(bargc, bargv), doctest::Contains(want.c_str()), mesh_error);
}
