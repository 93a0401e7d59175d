// whale consumer: one forward of a linear layer through whale's public headers,
// checked against a plain loop. Built against whale::whale, whale::mpi,
// whale::core and whale::cuda (when those exist) to prove each target
// compiles, links and runs.
#include <cmath>
#include <cstdio>

#include "whale/nn/linear.hpp"
#include "whale/tensor/tensor.hpp"

#if defined(WHALE_HAS_MPI)
#include <mpi.h>
#endif
#if defined(WHALE_HAS_CUDA)
#include <cuda_runtime_api.h>
#endif

int main(int argc, char** argv) {
  int rank = 0;
#if defined(WHALE_HAS_MPI)
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#else
  (void)argc;
  (void)argv;
#endif
  using layer = whale::linear<4, 3>;
  layer l;
  const whale::index_t n = l.param_count();
  whale::tensor<float> params({n}), grads({n});
  whale::param_binder b(params.data(), grads.data(), n);
  l.bind(b);
  l.init(whale::counter_rng(whale::seed{1}));

  whale::tensor<float> x({2, 4});  // (R, In)
  for (whale::index_t i = 0; i < x.numel(); ++i) x[i] = 0.1f * static_cast<float>(i) - 0.3f;
  whale::step_ctx c;
  c.batch = 2;
  auto y = l.forward(c, x);  // (R, Out)

  int bad = y.numel() != 6;
  for (whale::index_t r = 0; r < 2 && !bad; ++r)
    for (whale::index_t o = 0; o < 3; ++o) {
      float ref = l.bias()[o];
      for (whale::index_t i = 0; i < 4; ++i) ref += x[r * 4 + i] * l.weight()[o * 4 + i];
      if (std::fabs(ref - y[r * 3 + o]) > 1e-5f) bad = 1;
    }

#if defined(WHALE_HAS_CUDA)
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  std::printf("whale consumer: cuda devices: %d\n", devices);
#endif
#if defined(WHALE_HAS_MPI)
  int worst = 0, size = 0;
  MPI_Allreduce(&bad, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  bad = worst;
  if (rank == 0) std::printf("whale consumer: mpi ranks: %d\n", size);
  MPI_Finalize();
#endif
  if (rank == 0) std::printf("whale consumer: %s\n", bad ? "WRONG forward" : "ok");
  return bad;
}
