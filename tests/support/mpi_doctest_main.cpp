// doctest's main for MPI tests: every rank runs every test case; the exit code
// is the maximum over ranks, so a failure on any rank fails the job.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  if (rank != 0) ctx.setOption("minimal", true);  // other ranks print only their failures
  int rc = ctx.run();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != rc) std::fprintf(stderr, "whale test: another rank failed\n");
  MPI_Finalize();
  return worst;
}
