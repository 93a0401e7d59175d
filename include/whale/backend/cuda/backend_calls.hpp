// cuda_backend's larger calls, defined: its GEMMs (cuBLASLt, cuBLAS where
// cuBLASLt has no algorithm, bf16, strided-batched, through an epilogue), a
// linear layer's weight and bias gradients through cuBLASLt's BGRADB
// epilogue, the fused attention of cuDNN's frontend, the GEMM math setting,
// the per-kind kernel timing and the teardown. Each is declared, with what it
// does, in backend/cuda.hpp, which includes this file after the class.
#pragma once

#include "whale/backend/cuda.hpp"

namespace whale {

inline bool cuda_backend::linear_weight_grads(const weight_grad_args& a) {
  if (a.R == 0 || a.out == 0 || a.in == 0 || a.db == nullptr) return false;
  // row-major dW (out x in) = dy^T (out x R) x (R x in): column-major dW^T = x^T dy, reduced over R
  timed t(*this, "gemm");
  if (lt_gemm(trans::yes, trans::no, a.out, a.in, a.R, 1.f, a.dy, a.out, a.x, a.in, 0.f, a.dw, a.in,
              detail::lt::epilogue::bias_grad, a.db)) {
    ++fused_bias_grads_;
    return true;
  }
  t.cancel();  // nothing was queued: the caller's GEMM is timed instead
  if (!bias_grad_refused_)
    std::fprintf(stderr, "whale::cuda_backend: cuBLASLt has no bias-gradient epilogue for R %lld, out %lld, in %lld; "
                 "the bias gradients run as a column reduction\n", static_cast<long long>(a.R),
                 static_cast<long long>(a.out), static_cast<long long>(a.in));
  bias_grad_refused_ = true;
  return false;
}

inline bool cuda_backend::fused_attention(const attention_args& a, bool backward) {
#if defined(WHALE_HAS_CUDNN_FRONTEND) && defined(__CUDACC__)
  if (!a.bf16) return false;
  namespace dnn = detail::cudnn;
  if (!attention_) attention_ = dnn::make_engine(compute_);
  auto& att = *attention_;
  std::string why;
  if (!dnn::supports(att, a.B, a.T, a.H, a.hd, why)) {
    if (!attention_refused_)
      std::fprintf(stderr, "whale::cuda_backend: cuDNN's fused attention refuses B %lld, T %lld, H %lld, hd %lld (%s); "
                   "attention runs as batched GEMMs in fp32\n", static_cast<long long>(a.B), static_cast<long long>(a.T),
                   static_cast<long long>(a.H), static_cast<long long>(a.hd), why.c_str());
    attention_refused_ = true;
    return false;
  }
  const index_t W = a.H * a.hd, R = a.B * a.T;
  struct block {  // device memory from the cache for this call
    cuda_backend& g;
    std::size_t bytes;
    void* p = bytes ? g.allocate(bytes) : nullptr;
    ~block() { if (p) g.deallocate(p, bytes); }
  };
  const auto u16 = [](void* p) { return static_cast<std::uint16_t*>(p); };
  // bf16 Q, K, V and O: in the caller's kept buffer (a.packed) from the forward to the backward, or packed per call
  const bool kept = a.packed != nullptr;
  const block own{*this, kept ? 0 : static_cast<std::size_t>(R * 4 * W) * 2};
  std::uint16_t* const qkv16 = u16(kept ? a.packed : own.p);
  std::uint16_t* const o16 = qkv16 + R * 3 * W;
  if (!backward || !kept) launch(R * 3 * W, kernels::pack_bf16{a.qkv, qkv16});
  if (!backward) {
    const block ws{*this, static_cast<std::size_t>(dnn::forward_workspace(att, a.B, a.T, a.H, a.hd))};
    {
      const timed t(*this, "attention");
      dnn::forward(att, a.B, a.T, a.H, a.hd, qkv16, o16, a.lse, ws.p);
    }
    launch(R * W, kernels::unpack_bf16{o16, a.o});
    ++fused_attention_calls_;
    return true;
  }
  const block do16{*this, static_cast<std::size_t>(R * W) * 2}, dqkv16{*this, static_cast<std::size_t>(R * 3 * W) * 2};
  const block ws{*this, static_cast<std::size_t>(dnn::backward_workspace(att, a.B, a.T, a.H, a.hd))};
  if (!kept) launch(R * W, kernels::pack_bf16{a.o, o16});
  launch(R * W, kernels::pack_bf16{a.dout, u16(do16.p)});
  {
    const timed t(*this, "attention");
    dnn::backward(att, a.B, a.T, a.H, a.hd, qkv16, o16, a.lse, do16.p, dqkv16.p, ws.p);
  }
  launch(R * 3 * W, kernels::unpack_bf16{u16(dqkv16.p), a.dqkv});
  ++fused_attention_calls_;
  return true;
#else
  (void)a, (void)backward;
  return false;
#endif
}

inline void cuda_backend::set_math(gemm_math m) {
  math_ = m;
  detail::cublas_check(
      cublasSetMathMode(blas_, m == gemm_math::tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
      "cublasSetMathMode");
}

inline std::map<std::string, cuda_backend::kernel_time> cuda_backend::kernel_times() {
  synchronize();
  std::map<std::string, kernel_time> out;
  for (const auto& m : marks_) {
    float ms = 0;
    detail::cuda_check(cudaEventElapsedTime(&ms, events_[m.pair].first, events_[m.pair].second), "cudaEventElapsedTime");
    auto& k = out[m.what];
    k.ms += ms, ++k.calls;
  }
  marks_.clear();
  return out;
}

inline int cuda_backend::time_begin(const char* what) {
  if (!timing_ || in_timed_) return -1;
  const auto i = marks_.size();
  if (i == events_.size()) {
    std::pair<cudaEvent_t, cudaEvent_t> e{};
    detail::cuda_check(cudaEventCreate(&e.first), "cudaEventCreate");
    detail::cuda_check(cudaEventCreate(&e.second), "cudaEventCreate");
    events_.push_back(e);
  }
  marks_.push_back({what, i});
  detail::cuda_check(cudaEventRecord(events_[i].first, compute_), "cudaEventRecord");
  in_timed_ = true;
  return static_cast<int>(i);
}

inline void cuda_backend::gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
    const float* B, index_t ldb, float beta, float* C, index_t ldc) {
  if (M == 0 || N == 0) return;
  const timed t(*this, "gemm");
  if (lt_gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, detail::lt::epilogue::none, nullptr)) return;
  if (products() == gemm_math::bf16) {
    detail::cublas_check(cublasGemmEx(blas_, op(tb), op(ta), i32(N), i32(M), i32(K), &alpha, B, CUDA_R_32F,
                                      i32(ldb), A, CUDA_R_32F, i32(lda), &beta, C, CUDA_R_32F, i32(ldc),
                                      CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
                         "cublasGemmEx (32F_FAST_16BF)");
    return;
  }
  detail::cublas_check(cublasSgemm(blas_, op(tb), op(ta), i32(N), i32(M), i32(K), &alpha, B, i32(ldb), A,
                                   i32(lda), &beta, C, i32(ldc)),
                       "cublasSgemm");
}

inline void cuda_backend::gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
    index_t lda, index_t strideA, const float* B, index_t ldb, index_t strideB, float beta,
    float* C, index_t ldc, index_t strideC, index_t count) {
  if (M == 0 || N == 0 || count == 0) return;
  const timed t(*this, "attention");  // only attention's steps run batched GEMMs
  detail::cublas_check(cublasSgemmStridedBatched(blas_, op(tb), op(ta), i32(N), i32(M), i32(K), &alpha, B,
                                                 i32(ldb), strideB, A, i32(lda), strideA, &beta, C, i32(ldc),
                                                 strideC, i32(count)),
                       "cublasSgemmStridedBatched");
}

inline void cuda_backend::gemm_bf16(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const void* A, index_t lda,
    const void* B, index_t ldb, float beta, void* C, index_t ldc, bool c_bf16) {
  if (M == 0 || N == 0) return;
  detail::cublas_check(cublasGemmEx(blas_, op(tb), op(ta), i32(N), i32(M), i32(K), &alpha, B, CUDA_R_16BF,
                                    i32(ldb), A, CUDA_R_16BF, i32(lda), &beta, C,
                                    c_bf16 ? CUDA_R_16BF : CUDA_R_32F, i32(ldc), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx (bf16)");
}

inline bool cuda_backend::epilogue_gemm(trans ta, trans tb, index_t M, index_t N, index_t K, const float* A, const float* B, float* C,
    detail::lt::epilogue e, const void* bias, const void* aux, std::int64_t& count, bool& refused,
    const char* what, const char* instead) {
  if (M == 0 || N == 0 || K == 0) return false;
  timed t(*this, "gemm");
  const index_t lda = ta == trans::yes ? M : K, ldb = tb == trans::yes ? K : N;
  if (lt_gemm(ta, tb, M, N, K, 1.f, A, lda, B, ldb, 0.f, C, N, e, bias, aux, aux ? N : 0)) {
    ++count;
    return true;
  }
  t.cancel();
  if (!refused)
    std::fprintf(stderr, "whale::cuda_backend: cuBLASLt has no %s epilogue for M %lld, N %lld, K %lld; %s\n", what,
                 static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), instead);
  refused = true;
  return false;
}

inline void cuda_backend::destroy() noexcept {
  if (compute_) cudaStreamSynchronize(compute_);
  attention_.reset();
  for (auto& e : events_) cudaEventDestroy(e.first), cudaEventDestroy(e.second);
  events_.clear();
  if (lt_workspace_) alloc_.deallocate(lt_workspace_, detail::lt::gemms::workspace_bytes);
  lt_workspace_ = nullptr;
  lt_.reset();
  alloc_.release();
  if (blas_) cublasDestroy(blas_);
  if (comm_) cudaStreamDestroy(comm_);
  if (compute_) cudaStreamDestroy(compute_);
  blas_ = nullptr, comm_ = nullptr, compute_ = nullptr;
}

}  // namespace whale
