// The CUDA execution space: a kernel body (backend/kernel.hpp) run by a CUDA
// grid, one thread per index with a grid-stride loop; a row body
// (backend/kernels/shapes.hpp) with one warp per row (8 rows to a block of
// 256 threads) or, for rows of kernels::wide_row and more, a block of 8 warps
// per row, reducing across lanes with shuffles and shared memory in the tree
// the CPU's emulated team replays. Only for translation units compiled by
// nvcc; the CPU runs the same bodies by loops (backend/cpu/launch.hpp).
#pragma once

#if !defined(__CUDACC__)
#error "whale/backend/cuda/launch.cuh launches kernels and needs nvcc (a .cu file)"
#endif

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "whale/backend/kernel.hpp"
#include "whale/backend/kernels/shapes.hpp"

namespace whale::cuda_space {

/// Threads per block of every launch.
inline constexpr int block_threads = 256;

namespace detail {
template <class K> __global__ void run_body(index_t n, K body) {
  const index_t stride = static_cast<index_t>(blockDim.x) * gridDim.x;
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) body(i);
}

// A lane's value from lane `lane ^ o` of its warp, for the reduction's value types.
__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ kernels::max_sum shfl_xor(kernels::max_sum v, int o) {
  return {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
}
__device__ __forceinline__ float shfl0(float v) { return __shfl_sync(0xffffffffu, v, 0); }
__device__ __forceinline__ kernels::max_sum shfl0(kernels::max_sum v) {
  return {__shfl_sync(0xffffffffu, v.m, 0), __shfl_sync(0xffffffffu, v.s, 0)};
}
}  // namespace detail

/// The team of W warps that takes one row on the GPU. Lane l accumulates
/// elements l, l + 32 W, ...; the warp reduces by xor-shuffles (lane i with
/// lane i ^ o, o = 16 ... 1) and takes lane 0's value; W > 1 warps then join
/// their values through shared memory in kernels::tree_reduce's order.
template <int W> struct cuda_team : kernels::team_reductions<cuda_team<W>> {
  static constexpr int lanes = W * kernels::warp_lanes;
  int lane;
  float* smem = nullptr;  ///< this team's staging slots in shared memory, `stride` floats apart; null: none
  index_t stride = 0;
  /// Row `src` of n floats copied to slot `slot` (each lane its own elements), or src itself without slots.
  WHALE_HD WHALE_INLINE const float* stage(int slot, const float* src, index_t n) const {
    if (!smem) return src;
    float* s = smem + slot * stride;
    for (index_t j = lane; j < n; j += lanes) s[j] = src[j];
    return s;
  }
  /// Slot `slot` as a row to write and read back, or `fallback` without slots.
  WHALE_HD WHALE_INLINE float* scratch(int slot, float* fallback) const { return smem ? smem + slot * stride : fallback; }
  template <class S, class Step, class Join>
  WHALE_HD WHALE_INLINE S reduce(index_t n, S init, Step step, Join join) const {
#if defined(__CUDA_ARCH__)
    S acc = init;
    for (index_t j = lane; j < n; j += lanes) step(acc, j);
#pragma unroll
    for (int o = kernels::warp_lanes / 2; o > 0; o /= 2) acc = join(acc, detail::shfl_xor(acc, o));
    acc = detail::shfl0(acc);  // lane 0's bits on every lane (the joins need not commute to the bit)
    if constexpr (W == 1) {
      return acc;
    } else {
      __shared__ S part[W];
      __syncthreads();  // an earlier reduction's readers are done with part
      if (lane % kernels::warp_lanes == 0) part[lane / kernels::warp_lanes] = acc;
      __syncthreads();
      S v[W];
#pragma unroll
      for (int w = 0; w < W; ++w) v[w] = part[w];
#pragma unroll
      for (int o = W / 2; o > 0; o /= 2)
#pragma unroll
        for (int i = 0; i < o; ++i) v[i] = join(v[i], v[i + o]);
      return v[0];
    }
#else
    (void)n, (void)step, (void)join;
    return init;  // never run: cuda_team exists only inside a kernel
#endif
  }
  template <class F> WHALE_HD WHALE_INLINE void for_each(index_t n, F f) const {
    for (index_t j = lane; j < n; j += lanes) f(j);
  }
  WHALE_HD WHALE_INLINE bool leader() const noexcept { return lane == 0; }
  WHALE_HD WHALE_INLINE void sync() const noexcept {
#if defined(__CUDA_ARCH__)
    if constexpr (W == 1) __syncwarp();
    else __syncthreads();
#endif
  }
};

namespace detail {
// Staged rows (kernels::staged_rows): `slots` rows of `stride` floats per team in dynamic shared memory; 0: none.
template <class K>
__global__ void __launch_bounds__(block_threads) run_rows_warp(index_t rows, K body, int slots, index_t stride) {
  extern __shared__ float4 staged_rows_smem[];  // float4: 16-byte aligned
  constexpr int per_block = block_threads / kernels::warp_lanes;
  const int warp = static_cast<int>(threadIdx.x) / kernels::warp_lanes;
  const index_t r = static_cast<index_t>(blockIdx.x) * per_block + warp;
  float* smem = slots > 0 ? reinterpret_cast<float*>(staged_rows_smem) + warp * slots * stride : nullptr;
  if (r < rows)  // warp-uniform
    body(cuda_team<1>{{}, static_cast<int>(threadIdx.x % kernels::warp_lanes), smem, stride}, r);
}
template <class K>
__global__ void __launch_bounds__(block_threads) run_rows_block(index_t rows, K body, int slots, index_t stride) {
  extern __shared__ float4 staged_rows_smem[];
  constexpr int W = block_threads / kernels::warp_lanes;
  float* smem = slots > 0 ? reinterpret_cast<float*>(staged_rows_smem) : nullptr;
  // each lane reads back only what it staged, so the next row may overwrite the slots without a barrier
  for (index_t r = blockIdx.x; r < rows; r += gridDim.x) body(cuda_team<W>{{}, static_cast<int>(threadIdx.x), smem, stride}, r);
}
/// The shared memory one block may opt into on the current device (cudaDevAttrMaxSharedMemoryPerBlockOptin).
inline std::int64_t smem_optin() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 48 * 1024;
  return v;
}
/// Let `kernel` take `bytes` of dynamic shared memory (past the default 48 KiB), once per kernel and size.
template <class F> void allow_smem(F* kernel, std::int64_t bytes) {
  static std::int64_t allowed = 48 * 1024;  // one static per kernel instantiation
  if (bytes <= allowed) return;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      e != cudaSuccess)
    throw std::runtime_error(std::string("whale::cuda: cudaFuncSetAttribute (dynamic shared memory) failed: ") + cudaGetErrorString(e));
  allowed = bytes;
}
inline void check_launch(const char* what) {
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    throw std::runtime_error(std::string("whale::cuda launch of ") + what + " failed: " + cudaGetErrorString(e));
}
inline constexpr index_t max_blocks = 65535L * 32;  // a grid-stride loop covers the rest
}  // namespace detail

/// body(i) for i in [0, n) on `stream`, asynchronously; a launch error throws, naming the kernel.
template <kernels::KernelBody K>
void launch(index_t n, const K& body, cudaStream_t stream = nullptr) {
  if (n <= 0) return;
  index_t blocks = (n + block_threads - 1) / block_threads;
  if (blocks > detail::max_blocks) blocks = detail::max_blocks;
  detail::run_body<<<static_cast<unsigned>(blocks), block_threads, 0, stream>>>(n, body);
  detail::check_launch(kernels::kernel_name<K>().c_str());
}

/// body(team, r) for each of `rows` rows on `stream`: a warp per row, or a
/// block per row for rows of kernels::wide_row and more (kernels::row_warps).
template <kernels::RowBody K>
void launch(index_t rows, const K& body, cudaStream_t stream = nullptr) {
  if (rows <= 0) return;
  constexpr int per_block = block_threads / kernels::warp_lanes;
  static_assert(per_block == 8, "whale::cuda_space: the wide-row team is a block of 8 warps (kernels::row_warps)");
  // staged rows in shared memory where the device has room for them (unstaged otherwise: the same values)
  constexpr int slots = kernels::staged_rows<K>();
  int use = 0;
  std::int64_t smem = 0;
  if constexpr (slots > 0) {
    static const std::int64_t optin = detail::smem_optin();
    const std::int64_t need = kernels::stage_bytes(slots, body.width());
    if (need <= optin) use = slots, smem = need;
  }
  const index_t stride = kernels::stage_stride(body.width());
  if (kernels::row_warps(body.width()) == 1) {
    if (smem > 0) detail::allow_smem(detail::run_rows_warp<K>, smem);
    detail::run_rows_warp<<<static_cast<unsigned>((rows + per_block - 1) / per_block), block_threads,
                            static_cast<std::size_t>(smem), stream>>>(rows, body, use, stride);
  } else {
    const index_t blocks = rows < detail::max_blocks ? rows : detail::max_blocks;
    if (smem > 0) detail::allow_smem(detail::run_rows_block<K>, smem);
    detail::run_rows_block<<<static_cast<unsigned>(blocks), block_threads, static_cast<std::size_t>(smem), stream>>>(
        rows, body, use, stride);
  }
  detail::check_launch(kernels::kernel_name<K>().c_str());
}

}  // namespace whale::cuda_space
