// doctest's main for MPI tests: every rank runs every test case of the
// program's own test file, and fails when none is left to run
// (support/own_file.hpp); the exit code is the maximum over ranks, so a
// failure on any rank fails the job.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>

#include "own_file.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  whale::test::only_own_file(ctx);
  if (rank != 0) ctx.setOption("minimal", true);  // other ranks print only their failures
  int rc = whale::test::fail_if_none_ran(ctx.run());
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != rc) std::fprintf(stderr, "whale test: another rank failed\n");
  MPI_Finalize();
  return worst;
}
