// The CUDA execution space: a kernel body (backend/kernel.hpp) run by a CUDA
// grid, one thread per index with a grid-stride loop, on a given stream. Only
// for translation units compiled by nvcc; the CPU runs the same bodies by a loop.
#pragma once

#if !defined(__CUDACC__)
#error "whale/backend/cuda/launch.cuh launches kernels and needs nvcc (a .cu file)"
#endif

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "whale/backend/kernel.hpp"

namespace whale::cuda_space {

namespace detail {
template <class K> __global__ void run_body(index_t n, K body) {
  const index_t stride = static_cast<index_t>(blockDim.x) * gridDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) body(i);
}
}  // namespace detail

/// Threads per block of every launch.
inline constexpr int block_threads = 256;

/// body(i) for i in [0, n) on `stream`, asynchronously; a launch error throws, naming the kernel.
template <kernels::KernelBody K>
void launch(index_t n, const K& body, cudaStream_t stream = nullptr) {
  if (n <= 0) return;
  index_t blocks = (n + block_threads - 1) / block_threads;
  if (blocks > 65535L * 32) blocks = 65535L * 32;  // the grid-stride loop covers the rest
  detail::run_body<<<static_cast<unsigned>(blocks), block_threads, 0, stream>>>(n, body);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("whale::cuda launch of a kernel body failed: ") + cudaGetErrorString(e));
}

}  // namespace whale::cuda_space
