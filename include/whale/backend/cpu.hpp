// CPU compute backend: GEMM through CBLAS (OpenBLAS), strided-batched GEMM,
// the thread count of OpenBLAS, the helpers layers share, and `cpu_backend`,
// the model of the Backend concept that runs kernel bodies by a loop. The
// kernels' arithmetic is in backend/kernels/, shared with the CUDA backend.
#pragma once

#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "whale/backend/backend.hpp"
#include "whale/backend/cpu/launch.hpp"
#include "whale/backend/kernels/rows.hpp"
#include "whale/detail/environment.hpp"
#include "whale/detail/parse.hpp"
#include "whale/tensor/tensor.hpp"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace whale::cpu {

using whale::trans;

/// One GEMM as issued: transposes, sizes, and how long it took where it ran.
/// Benchmarks record a step's GEMMs (set_gemm_log), add up their time inside the
/// step, and time each shape alone to measure the compute limit.
struct gemm_call {
  bool ta = false, tb = false;
  index_t M = 0, N = 0, K = 0;
  double seconds = 0;  ///< wall time of this call inside the step
  double flops() const noexcept { return 2.0 * static_cast<double>(M) * N * K; }
};
namespace detail {
inline std::vector<gemm_call>*& gemm_log() noexcept {
  static std::vector<gemm_call>* log = nullptr;
  return log;
}
}  // namespace detail
/// Record every GEMM into `log` until called with nullptr.
inline void set_gemm_log(std::vector<gemm_call>* log) noexcept { detail::gemm_log() = log; }

/// C(M,N) = alpha * op(A) * op(B) + beta * C, row-major, op(A) is (M,K), op(B) is (K,N).
/// lda/ldb/ldc are the row strides of A, B, C as stored.
inline void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                 index_t lda, const float* B, index_t ldb, float beta, float* C, index_t ldc) {
  if (M == 0 || N == 0) return;
  auto* log = detail::gemm_log();
  const auto t0 = log ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  cblas_sgemm(CblasRowMajor, ta == trans::yes ? CblasTrans : CblasNoTrans,
              tb == trans::yes ? CblasTrans : CblasNoTrans, static_cast<int>(M),
              static_cast<int>(N), static_cast<int>(K), alpha, A, static_cast<int>(lda), B,
              static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
  if (log)
    log->push_back({ta == trans::yes, tb == trans::yes, M, N, K,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()});
}

/// Contiguous GEMM: lda/ldb/ldc follow from the stored shapes.
inline void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                 const float* B, float beta, float* C) {
  gemm(ta, tb, M, N, K, alpha, A, ta == trans::yes ? M : K, B, tb == trans::yes ? K : N, beta, C,
       N);
}

/// `count` GEMMs whose operands are `strideA/B/C` elements apart (attention heads).
inline void gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha,
                                 const float* A, index_t lda, index_t strideA, const float* B,
                                 index_t ldb, index_t strideB, float beta, float* C, index_t ldc,
                                 index_t strideC, index_t count) {
  for (index_t i = 0; i < count; ++i)
    gemm(ta, tb, M, N, K, alpha, A + i * strideA, lda, B + i * strideB, ldb, beta, C + i * strideC,
         ldc);
}

/// OpenBLAS threads for this process: WHALE_THREADS, else OPENBLAS_NUM_THREADS
/// (OpenBLAS's own variable, respected), else 1 (one rank per core).
inline void set_threads(int n) { openblas_set_num_threads(n < 1 ? 1 : n); }
inline int threads() { return openblas_get_num_threads(); }
inline int default_threads() {
  return env::threads().value_or(1);  // "2x", "0", "-1" are errors
}

// ---- host-side reductions (the runtime's, on host memory) ----

inline double sum_squares(index_t n, const float* x) {
  // Blocks of 4096 in 16 float lanes each (kernels::sum_squares_blocks, which
  // the compiler turns into vector registers without reassociating anything),
  // in double: groups of 256 block sums added in order (kernels::sum_blocks),
  // then the groups' sums in order (kernels::sum_in_order). One pass at
  // memory speed, and accurate. A device backend runs the same bodies in the
  // same order (backend_ref::sum_squares_into), so the guarded backend's norm
  // is this one to the bit.
  const index_t nb = kernels::sum_squares_blocks::blocks(n);
  constexpr index_t chunk = kernels::sum_blocks::block;  // block sums per launch, on the stack
  double part[chunk];
  double total = 0.0;
  for (index_t b0 = 0; b0 < nb; b0 += chunk) {
    const index_t m = nb - b0 < chunk ? nb - b0 : chunk;
    launch(m, kernels::sum_squares_blocks{x + b0 * kernels::sum_squares_blocks::block, part, n - b0 * kernels::sum_squares_blocks::block});
    double group = 0.0;
    for (index_t b = 0; b < m; ++b) group += part[b];
    total += group;
  }
  return total;
}

inline bool all_finite(index_t n, const float* x) {
  float acc = 0.f;
  for (index_t i = 0; i < n; ++i) acc += x[i] * 0.f;  // NaN/Inf propagate, finite gives 0
  return acc == 0.f;
}

}  // namespace whale::cpu

namespace whale {

/// The CPU as a Backend: OpenBLAS GEMMs, kernel bodies by a loop (with the
/// widest vectors the processor has), 64-byte aligned heap memory (2 MiB and
/// huge pages for big blocks), and a queue that is the calling thread.
struct cpu_backend {
  using space = host;
  struct event_type {};
  static constexpr const char* name() noexcept { return "cpu"; }

  void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
            const float* B, index_t ldb, float beta, float* C, index_t ldc) const {
    cpu::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                            index_t lda, index_t strideA, const float* B, index_t ldb, index_t strideB, float beta,
                            float* C, index_t ldc, index_t strideC, index_t count) const {
    cpu::gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC,
                              count);
  }
  template <kernels::KernelBody K> void launch(index_t n, const K& body) const { cpu::launch(n, body); }
  template <kernels::RowBody K> void launch(index_t rows, const K& body) const { cpu::launch(rows, body); }
  template <kernels::ColumnBody K> void reduce_columns(const K& body) const { cpu::reduce_columns(body); }
  void* allocate(std::size_t bytes) const { return detail::allocate_raw(bytes, mem_kind::workspace); }
  void deallocate(void* p, std::size_t bytes) const noexcept { detail::free_raw(p, bytes, mem_kind::workspace); }
  void copy(void* dst, const void* src, std::size_t bytes) const noexcept {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void fill_zero(void* p, std::size_t bytes) const noexcept {
    if (bytes) std::memset(p, 0, bytes);
  }
  void record(event_type&) const noexcept {}
  void wait(event_type&) const noexcept {}
  void synchronize() const noexcept {}
};
static_assert(Backend<cpu_backend>, "whale::cpu_backend must model the Backend concept");

}  // namespace whale
