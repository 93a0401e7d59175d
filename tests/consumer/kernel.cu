// whale consumer, CUDA: whale's headers compile under nvcc as C++20, and a
// kernel runs where a GPU is present (a machine without one says so and passes).
#include <cstdio>

#include <cuda_runtime_api.h>

#include "whale/nn/linear.hpp"

__global__ void add_one(float* x, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) x[i] += 1.f;
}

int main() {
  whale::tensor<float> h({4});  // host values 0, 1, 2, 3
  for (whale::index_t i = 0; i < 4; ++i) h[i] = static_cast<float>(i);
  float* d = nullptr;
  if (cudaMalloc(&d, 4 * sizeof(float)) != cudaSuccess) {
    std::printf("whale consumer (cu): no GPU, kernel not run\n");
    return 0;
  }
  cudaMemcpy(d, h.data(), 4 * sizeof(float), cudaMemcpyHostToDevice);
  add_one<<<1, 4>>>(d, 4);
  cudaMemcpy(h.data(), d, 4 * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(d);
  int bad = 0;
  for (whale::index_t i = 0; i < 4; ++i) bad |= h[i] != static_cast<float>(i + 1);
  std::printf("whale consumer (cu): %s\n", bad ? "WRONG kernel result" : "ok");
  return bad;
}
