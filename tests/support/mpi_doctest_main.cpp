// doctest's main for MPI tests: every rank runs every test case of the
// program's own test file (whale_test_file, as in doctest_main.cpp); the exit
// code is the maximum over ranks, so a failure on any rank fails the job.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

extern const char* const whale_test_file;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  ctx.addFilter("source-file", ("*" + std::string(whale_test_file)).c_str());
  if (rank != 0) ctx.setOption("minimal", true);  // other ranks print only their failures
  int rc = ctx.run();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != rc) std::fprintf(stderr, "whale test: another rank failed\n");
  MPI_Finalize();
  return worst;
}
