// The CUDA backend: `cuda_backend`, a model of the Backend concept on one GPU
// -- cuBLASLt GEMMs (fp32, TF32 opt-in, bf16 tensor cores under bf16 mixed
// precision; the bias gradient as an epilogue), cuBLAS where cuBLASLt has no
// algorithm,
// kernel bodies (backend/kernels/) on a CUDA grid, a caching device allocator
// (no cudaMalloc in the steady state), pinned host staging, a compute and a
// communication stream with events between them. Needs the CUDA toolkit
// (link whale::cuda); launching bodies needs a .cu file compiled by nvcc.
// A network<M> or a parallel plan given backend_ref(gpu) trains on it in
// device memory (plan_options::backend; docs/gpu-kernels.md says what runs).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/backend/backend.hpp"
#include "whale/backend/caching_allocator.hpp"
#include "whale/detail/parse.hpp"
#include "whale/comm/launcher.hpp"
#include "whale/backend/cuda/cudnn_attention.hpp"
#include "whale/backend/cuda/lt_gemm.hpp"
#if defined(__CUDACC__)
#include "whale/backend/cuda/launch.cuh"
#include "whale/backend/kernels/elementwise.hpp"
#endif

namespace whale {

namespace detail {
inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed: " + cudaGetErrorString(e));
}
inline void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed: " + cublasGetStatusString(s));
}
/// cudaMalloc and cudaFree, counted (the caching allocator's upstream).
struct cuda_device_upstream {
  void* allocate(std::size_t n) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, n), ("cudaMalloc of " + std::to_string(n) + " bytes").c_str());
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept { cudaFree(p); }
};
}  // namespace detail

/// GPUs visible to this process; 0 where there is no device or no driver (never throws).
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error of a missing driver
    return 0;
  }
  return n;
}

/// The device of this rank: its rank on its node, read from whichever
/// launcher started it (comm/launcher.hpp: Open MPI, MPICH / Intel MPI, a
/// torchrun-style LOCAL_RANK, Slurm), among the devices CUDA_VISIBLE_DEVICES
/// leaves visible. Throws naming the problem when there is no device, a
/// launcher variable is malformed, or the node has more ranks than devices.
inline int cuda_device_for_local_rank() {
  const local_place p = local_place_of_process();
  try {
    return device_for(p, cuda_device_count(), env::text("CUDA_VISIBLE_DEVICES"));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("whale::cuda_backend: ") + e.what());
  }
}

/// One GPU as a Backend. Owns a compute stream (every GEMM, kernel, copy and
/// fill is queued there, in order), a communication stream for NCCL, a cuBLAS
/// handle on the compute stream and a caching allocator whose blocks are
/// reused in the compute stream's order. Not copyable; one per rank.
class cuda_backend {
 public:
  using space = cuda;
  /// A CUDA event (timing disabled), created on first record.
  class event_type {
   public:
    event_type() = default;
    event_type(const event_type&) = delete;
    event_type& operator=(const event_type&) = delete;
    ~event_type() {
      if (e_) cudaEventDestroy(e_);
    }
    cudaEvent_t get() {
      if (!e_) detail::cuda_check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreate");
      return e_;
    }

   private:
    cudaEvent_t e_ = nullptr;
  };
  static constexpr const char* name() noexcept { return "cuda"; }

  /// On `device`, or by local rank when negative (cuda_device_for_local_rank).
  explicit cuda_backend(int device = -1) : device_(device < 0 ? cuda_device_for_local_rank() : device) {
    if (device_ >= cuda_device_count())
      throw std::invalid_argument("whale::cuda_backend: device " + std::to_string(device_) + " does not exist (" +
                                  std::to_string(cuda_device_count()) + " visible)");
    try {
      detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice");
      detail::cuda_check(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking), "cudaStreamCreate (compute)");
      detail::cuda_check(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking), "cudaStreamCreate (communication)");
      detail::cublas_check(cublasCreate(&blas_), "cublasCreate");
      detail::cublas_check(cublasSetStream(blas_, compute_), "cublasSetStream");
    } catch (...) {
      destroy();  // what was created before the failure
      throw;
    }
  }
  cuda_backend(const cuda_backend&) = delete;
  cuda_backend& operator=(const cuda_backend&) = delete;
  ~cuda_backend() { destroy(); }

  int device() const noexcept { return device_; }
  cudaStream_t compute_stream() const noexcept { return compute_; }
  cudaStream_t comm_stream() const noexcept { return comm_; }
  cublasHandle_t blas_handle() const noexcept { return blas_; }

  /// TF32 tensor cores for fp32 GEMMs (off by default: results then match fp32 to ~1e-3 relative).
  void set_tf32(bool on) { set_math(on ? gemm_math::tf32 : gemm_math::fp32); }
  /// How the GEMMs use the tensor cores (gemm_math; fp32 by default). The
  /// strided-batched GEMMs (attention's steps) follow it, except that under
  /// gemm_math::bf16 they stay fp32 (their operands are not bf16 values).
  void set_math(gemm_math m);
  gemm_math math() const noexcept { return math_; }
  /// While on, every non-batched GEMM runs as gemm_math::bf16 whatever
  /// set_math chose: bf16 mixed precision, whose layers round every GEMM
  /// operand to bf16 first, so that the conversion changes no value (the
  /// trainer turns it on for the steps it runs under precision::bf16).
  void set_bf16_products(bool on) noexcept { bf16_products_ = on; }

  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
  // cuBLASLt in the backend's math; cuBLAS where cuBLASLt has no algorithm for the call.
  void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
            const float* B, index_t ldb, float beta, float* C, index_t ldc);
  /// A fully connected layer's parameter gradients from R rows in one
  /// cuBLASLt call: dW (out, in) = dy^T x and db (out) = the column sums of
  /// dy (the BGRADB epilogue), both overwritten. False, with nothing queued,
  /// where cuBLASLt has no algorithm for it (said once on stderr): the caller
  /// then runs a GEMM and a column reduction.
  bool linear_weight_grads(const weight_grad_args& a);
  /// C = op(A) op(B) + bias in one cuBLASLt call (the BIAS epilogue). False,
  /// with nothing queued, where cuBLASLt has no algorithm for it (said once on
  /// stderr): the caller then writes the bias and adds the product to it.
  bool gemm_bias(const gemm_bias_args& a) {
    if (a.bias == nullptr) return false;
    return epilogue_gemm(a.ta, a.tb, a.M, a.N, a.K, a.A, a.B, a.C, detail::lt::epilogue::bias, a.bias, nullptr,
                         fused_biases_, bias_refused_, "bias", "the bias is written before the GEMM");
  }
  /// A GEMM and GELU in one cuBLASLt call (gemm_gelu_args): forward through
  /// GELU_AUX_BIAS (GELU_AUX without a bias), pre as its aux matrix;
  /// backward through DGELU, reading pre. The epilogue computes in fp32 on
  /// the values it has: under bf16 its output is not rounded (the GEMMs that
  /// read it take their operands as bf16 on the tensor cores) and it reads
  /// pre and the product unrounded, where the CPU rounds them (`round`). False,
  /// with nothing queued, where cuBLASLt has no algorithm for it (said once).
  bool gemm_gelu(const gemm_gelu_args& a) {
    const auto e = a.backward ? detail::lt::epilogue::dgelu
                   : a.bias   ? detail::lt::epilogue::gelu_aux_bias
                              : detail::lt::epilogue::gelu_aux;
    return epilogue_gemm(a.ta, a.tb, a.M, a.N, a.K, a.A, a.B, a.out, e, a.bias, a.pre, fused_gelus_, gelu_refused_, "GELU",
                         "GELU runs as a kernel after the GEMM");
  }
  /// How many GEMMs carried GELU or its gradient so far.
  std::int64_t fused_gelus() const noexcept { return fused_gelus_; }
  /// How many biases the BIAS epilogue added so far.
  std::int64_t fused_biases() const noexcept { return fused_biases_; }
  /// How many bias gradients the BGRADB epilogue computed so far, and how
  /// many GEMM plans cuBLASLt had no algorithm for (cuBLAS ran those).
  std::int64_t fused_bias_grads() const noexcept { return fused_bias_grads_; }
  std::size_t lt_refused_plans() const noexcept { return lt_ ? lt_->refused() : 0; }
  void gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                            index_t lda, index_t strideA, const float* B, index_t ldb, index_t strideB, float beta,
                            float* C, index_t ldc, index_t strideC, index_t count);
  /// C (fp32 or bf16, `c_bf16`) = alpha op(A) op(B) + beta C with A and B in
  /// bf16 (the bits of __nv_bfloat16), accumulated in fp32: the GEMM of bf16
  /// mixed precision.
  void gemm_bf16(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const void* A, index_t lda,
                 const void* B, index_t ldb, float beta, void* C, index_t ldc, bool c_bf16);

  /// body(i) for i in [0, n) on the compute stream, asynchronously.
  template <kernels::KernelBody K> void launch(index_t n, const K& body) {
#if defined(__CUDACC__)
    const timed t(*this, "elementwise");
    cuda_space::launch(n, body, compute_);
#else
    static_assert(sizeof(K) == 0,
                  "whale::cuda_backend::launch: kernel bodies are compiled for the GPU only by nvcc; call it from "
                  "a .cu file (the CPU backend runs the same bodies from any C++ file)");
    (void)n;
    (void)body;
#endif
  }

  /// Where tensors live on this GPU: a place_scope on it allocates tensors'
  /// storage from this backend's cache and zeroes it on the compute stream.
  const memory_place* memory() const noexcept { return &place_; }
  /// Device memory from the cache (cudaMalloc only when no cached block fits).
  void* allocate(std::size_t bytes) { return alloc_.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) { alloc_.deallocate(p, bytes); }
  const allocator_stats& allocator() const noexcept { return alloc_.stats(); }
  /// Bytes it could still hand out: the device's free memory (cudaMemGetInfo)
  /// and the blocks its allocator holds for reuse.
  std::size_t memory_free() const {
    detail::cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    std::size_t free = 0, total = 0;
    detail::cuda_check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return free + static_cast<std::size_t>(alloc_.stats().bytes_cached);
  }
  /// Page-locked host memory for staging copies (cudaMallocHost), and its release.
  void* allocate_pinned(std::size_t bytes) {
    void* p = nullptr;
    detail::cuda_check(cudaMallocHost(&p, bytes), "cudaMallocHost");
    return p;
  }
  void deallocate_pinned(void* p) noexcept {
    if (p) cudaFreeHost(p);
  }

  /// Copy within or between spaces (unified addressing decides the direction), on the compute stream.
  void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes) detail::cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, compute_), "cudaMemcpyAsync");
  }
  void fill_zero(void* p, std::size_t bytes) {
    if (bytes) detail::cuda_check(cudaMemsetAsync(p, 0, bytes, compute_), "cudaMemsetAsync");
  }

  /// Mark the compute stream's work so far; `wait` makes the compute stream wait for a mark.
  void record(event_type& e) { detail::cuda_check(cudaEventRecord(e.get(), compute_), "cudaEventRecord"); }
  void wait(event_type& e) { detail::cuda_check(cudaStreamWaitEvent(compute_, e.get(), 0), "cudaStreamWaitEvent"); }
  /// The same on the communication stream: gradient buckets wait for backward's
  /// event there, and the optimizer waits for the all-reduce's event here.
  void record_comm(event_type& e) { detail::cuda_check(cudaEventRecord(e.get(), comm_), "cudaEventRecord"); }
  void comm_wait(event_type& e) { detail::cuda_check(cudaStreamWaitEvent(comm_, e.get(), 0), "cudaStreamWaitEvent"); }
  void synchronize() { detail::cuda_check(cudaStreamSynchronize(compute_), "cudaStreamSynchronize"); }

  /// Causal attention fused by cuDNN (backend/cuda/cudnn_attention.hpp), for
  /// backend_ref::attention_forward / attention_backward under bf16 mixed
  /// precision: Q, K, V (and O, d(O)) packed to bf16, cuDNN's flash attention,
  /// the results unpacked to fp32. False, and the caller runs its batched-GEMM
  /// steps, in fp32, in a program built without the cuDNN frontend (link
  /// whale::cudnn), or for a shape cuDNN refuses (said once on stderr).
  bool fused_attention(const attention_args& a, bool backward);
  /// Whether attention calls under bf16 go to cuDNN: built with the cuDNN
  /// frontend (whale::cudnn) and no shape refused so far.
  bool fuses_attention() const noexcept {
#if defined(WHALE_HAS_CUDNN_FRONTEND) && defined(__CUDACC__)
    return !attention_refused_;
#else
    return false;
#endif
  }
  /// GPU time by kind of work, measured by CUDA events around each call
  /// while on (scripts/gpu-check; off by default: the events cost a little):
  /// "gemm" (cuBLASLt and cuBLAS, bias-gradient epilogues included),
  /// "attention" (cuDNN's calls, or the batched-GEMM steps), and for kernel
  /// bodies "row", "column_reduction", "optimizer" and "elementwise" (the
  /// attention's bf16 packing included). kernel_times() waits for the queue,
  /// sums what was marked since the last call and forgets it. A pair of
  /// events brackets what the stream ran between them: where the host queues
  /// launches more slowly than the GPU runs them, the gaps count too, so
  /// small kernels then read slower than they are.
  void set_kernel_timing(bool on) noexcept { timing_ = on; }
  struct kernel_time {
    double ms = 0;
    std::int64_t calls = 0;
  };
  std::map<std::string, kernel_time> kernel_times();
  /// Mark the start of a call of kind `what` (-1 while timing is off), and its end.
  int time_begin(const char* what);
  void time_end(int i) {
    if (i < 0) return;
    in_timed_ = false;
    detail::cuda_check(cudaEventRecord(events_[static_cast<std::size_t>(i)].second, compute_), "cudaEventRecord");
  }
  /// Forget mark `i`, the last one begun (a call that queued nothing after all).
  void time_cancel(int i) noexcept {
    if (i < 0 || static_cast<std::size_t>(i) + 1 != marks_.size()) return;
    marks_.pop_back();
    in_timed_ = false;
  }
  /// How many attention calls (forward and backward) cuDNN ran so far.
  std::int64_t fused_attention_calls() const noexcept { return fused_attention_calls_; }

 private:
  /// A timed call (set_kernel_timing), for the scope's life; calls inside another count as the outer one's.
  struct timed {
    cuda_backend& g;
    int i;
    timed(cuda_backend& b, const char* what) : g(b), i(b.time_begin(what)) {}
    ~timed() {
      try {
        g.time_end(i);
      } catch (...) {
      }
    }
    /// Nothing was queued: forget the mark.
    void cancel() noexcept {
      g.time_cancel(i);
      i = -1;
    }
    timed(const timed&) = delete;
    timed& operator=(const timed&) = delete;
  };
  gemm_math products() const noexcept { return bf16_products_ ? gemm_math::bf16 : math_; }
  /// Row-major C (M x N) = op(A) op(B) through cuBLASLt; with `bias_grad`,
  /// also bias_grad (M) = the sums of op(A) (M x K) over K, the BGRADB epilogue.
  /// Row-major C (M, N) = op(A) op(B) with epilogue `e` on `bias` and `aux` (an (M, N) matrix) in one
  /// cuBLASLt call, counted in `count`; false where cuBLASLt has none, said once (`refused`) on stderr.
  bool epilogue_gemm(trans ta, trans tb, index_t M, index_t N, index_t K, const float* A, const float* B, float* C,
                     detail::lt::epilogue e, const void* bias, const void* aux, std::int64_t& count, bool& refused,
                     const char* what, const char* instead);
  bool lt_gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
               const float* B, index_t ldb, float beta, float* C, index_t ldc, detail::lt::epilogue e,
               const void* bias, const void* aux = nullptr, index_t aux_ld = 0) {
    if (!lt_) lt_ = std::make_unique<detail::lt::gemms>();
    if (!lt_workspace_) lt_workspace_ = allocate(detail::lt::gemms::workspace_bytes);
    // column-major: C^T (N x M) = op(B)^T op(A)^T, and op(A)^T is the second operand, reduced over K
    return lt_->run(products(), tb == trans::yes, ta == trans::yes, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc, e,
                    bias, lt_workspace_, compute_, aux, aux_ld);
  }
  void destroy() noexcept;
  static cublasOperation_t op(trans t) noexcept { return t == trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N; }
  static int i32(index_t v) {
    if (v < 0 || v > INT_MAX)
      throw std::invalid_argument("whale::cuda_backend: GEMM size " + std::to_string(v) + " exceeds cuBLAS's int");
    return static_cast<int>(v);
  }
  int device_ = 0;
  cudaStream_t compute_ = nullptr, comm_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::shared_ptr<detail::cudnn::engine> attention_;  // cuDNN's attention, once used
  std::unique_ptr<detail::lt::gemms> lt_;             // cuBLASLt's handle and plans, once used
  void* lt_workspace_ = nullptr;                      // its workspace, from the cache
  gemm_math math_ = gemm_math::fp32;
  bool bf16_products_ = false, bias_grad_refused_ = false, timing_ = false, in_timed_ = false;
  struct mark {
    const char* what;
    std::size_t pair;
  };
  std::vector<mark> marks_;                                    // timed calls since the last kernel_times()
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> events_;   // their events, reused
  std::int64_t fused_bias_grads_ = 0, fused_biases_ = 0, fused_gelus_ = 0;
  bool bias_refused_ = false, gelu_refused_ = false;
  bool attention_refused_ = false;
  std::int64_t fused_attention_calls_ = 0;
  caching_allocator<detail::cuda_device_upstream> alloc_;
  memory_place place_{this,
                      [](void* o, std::size_t n) { return static_cast<cuda_backend*>(o)->allocate(n); },
                      [](void* o, void* p, std::size_t n) { static_cast<cuda_backend*>(o)->deallocate(p, n); },
                      [](void* o, void* p, std::size_t n) { static_cast<cuda_backend*>(o)->fill_zero(p, n); },
                      "cuda"};
};
static_assert(Backend<cuda_backend>, "whale::cuda_backend must model the Backend concept");

}  // namespace whale

#include "whale/backend/cuda/backend_calls.hpp"  // the larger calls' definitions
