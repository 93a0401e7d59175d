// cuBLASLt GEMMs for the CUDA backend (backend/cuda.hpp): fp32 operands,
// fp32 accumulation, and a compute mode -- plain fp32, TF32 tensor cores, or
// bf16 tensor cores on operands cuBLASLt converts to bf16 (32F_FAST_16BF;
// exact where the operands are bf16 values already, as every GEMM operand of
// whale's layers is under bf16 mixed precision). An epilogue may ride on the
// product: the bias gradient (BGRADB), a fully connected layer's dW = dy^T x
// and db = the column sums of dy in one call instead of a GEMM and a column
// reduction; the bias (BIAS), y = x W^T + b in one call instead of a
// pass that writes b and a GEMM that adds to it; and GELU (GELU_AUX_BIAS:
// GELU of the biased product, which is also written to an aux matrix) with its
// gradient (DGELU: the product times GELU' of the aux matrix), instead of a
// GELU kernel after the GEMM. A plan (descriptors and the algorithm cuBLASLt's
// heuristic picked) is made once per shape, mode, epilogue and operand
// alignment and kept; a shape cuBLASLt has no algorithm for (at the
// heuristic, or CUBLAS_STATUS_NOT_SUPPORTED at the call) is remembered too,
// and the caller then runs its unfused steps.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "whale/backend/backend.hpp"

namespace whale {

/// How the CUDA backend's fp32 GEMMs use the tensor cores.
enum class gemm_math : std::uint8_t {
  fp32,  ///< plain fp32 (no tensor cores): the CPU's results to rounding
  tf32,  ///< TF32 tensor cores (operands to 10 mantissa bits)
  bf16,  ///< bf16 tensor cores, operands converted to bf16 (exact on bf16 values): bf16 mixed precision's GEMMs
};

namespace detail::lt {

inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("whale::cuda_backend: ") + what + " failed: " + cublasGetStatusString(s));
}

/// The largest power of two, at most 256, that divides the address (cuBLASLt picks kernels by alignment).
inline std::uint32_t alignment(const void* p) noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t al = 256;
  while (al > 4 && (a % al) != 0) al /= 2;
  return al;
}

/// What rides on a product: nothing, the bias gradient (BGRADB: the sums of
/// op(B) over k into the bias pointer), or the bias (BIAS: added to every
/// column-major column, a vector of m).
enum class epilogue : std::uint8_t { none, bias_grad, bias, gelu_aux, gelu_aux_bias, dgelu };
/// cuBLASLt's value for it.
inline int lt_value(epilogue e) noexcept {
  switch (e) {
    case epilogue::bias_grad: return static_cast<int>(CUBLASLT_EPILOGUE_BGRADB);
    case epilogue::bias: return static_cast<int>(CUBLASLT_EPILOGUE_BIAS);
    case epilogue::gelu_aux: return static_cast<int>(CUBLASLT_EPILOGUE_GELU_AUX);
    case epilogue::gelu_aux_bias: return static_cast<int>(CUBLASLT_EPILOGUE_GELU_AUX_BIAS);
    case epilogue::dgelu: return static_cast<int>(CUBLASLT_EPILOGUE_DGELU);
    default: return static_cast<int>(CUBLASLT_EPILOGUE_DEFAULT);
  }
}
/// Whether epilogue e reads or writes the bias pointer, and the aux matrix.
constexpr bool uses_bias(epilogue e) noexcept {
  return e == epilogue::bias_grad || e == epilogue::bias || e == epilogue::gelu_aux_bias;
}
constexpr bool uses_aux(epilogue e) noexcept {
  return e == epilogue::gelu_aux || e == epilogue::gelu_aux_bias || e == epilogue::dgelu;
}

/// Everything a plan depends on, in cuBLAS's column-major terms.
struct key {
  std::int64_t m, n, k, lda, ldb, ldc;
  bool ta, tb, beta;
  gemm_math math;
  int epilogue;
  std::uint32_t align_a, align_b, align_c, align_bias, align_aux;
  std::int64_t aux_ld;
  auto operator<=>(const key&) const = default;
};

/// Descriptors and the chosen algorithm for one key; `ok` false: cuBLASLt offers none.
struct plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
  plan() = default;
  plan(const plan&) = delete;
  plan& operator=(const plan&) = delete;
  ~plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

/// A cuBLASLt handle and its plans. Workspace memory is the caller's (the
/// backend's caching allocator); `workspace_bytes` is what every plan may use.
class gemms {
 public:
  static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;  // Hopper's recommended 32 MiB

  gemms() { check(cublasLtCreate(&handle_), "cublasLtCreate"); }
  gemms(const gemms&) = delete;
  gemms& operator=(const gemms&) = delete;
  ~gemms() {
    plans_.clear();
    if (handle_) cublasLtDestroy(handle_);
  }

  /// Column-major C (m x n, ldc) = alpha op(A) op(B) + beta C, with A (lda)
  /// and B (ldb) as stored, and epilogue `e`: bias_grad, bias (n) = the sums
  /// of op(B) over k (BGRADB); bias, C + bias (m) on every column (BIAS);
  /// gelu_aux(_bias), C = GELU(the product (+ bias)) with the argument
  /// written to `aux` (m x n, aux_ld); dgelu, C = the product times GELU'
  /// of `aux`. False, with nothing queued, where cuBLASLt has no algorithm
  /// for this call.
  bool run(gemm_math math, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
           const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc,
           epilogue e, const void* bias, void* workspace, cudaStream_t stream, const void* aux = nullptr,
           std::int64_t aux_ld = 0) {
    if (uses_bias(e) && bias == nullptr) return false;
    if (uses_aux(e) && aux == nullptr) return false;
    if (!uses_bias(e)) bias = nullptr;
    if (!uses_aux(e)) aux = nullptr, aux_ld = 0;
    const key kk{m, n, k, lda, ldb, ldc, ta, tb, beta != 0.f, math, lt_value(e),
                 alignment(A), alignment(B), alignment(C), bias ? alignment(bias) : 256u, aux ? alignment(aux) : 256u,
                 aux_ld};
    auto it = plans_.find(kk);
    if (it == plans_.end()) it = plans_.emplace(kk, make(kk, bias, aux)).first;
    plan& p = *it->second;
    if (!p.ok) return false;
    if (bias)
      check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
            "cublasLtMatmulDescSetAttribute (bias pointer)");
    if (aux)
      check(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
            "cublasLtMatmulDescSetAttribute (aux pointer)");
    const cublasStatus_t s = cublasLtMatmul(handle_, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c, &p.algo,
                                            workspace, workspace_bytes, stream);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) {  // refused at the call after all: remembered, and the caller's steps run
      p.ok = false;
      return false;
    }
    check(s, "cublasLtMatmul");
    return true;
  }
  /// Plans made so far, and how many of them cuBLASLt had no algorithm for.
  std::size_t plans() const noexcept { return plans_.size(); }
  std::size_t refused() const noexcept {
    std::size_t r = 0;
    for (const auto& [k, p] : plans_) r += p->ok ? 0 : 1;
    return r;
  }

 private:
  /// `bias` and `aux`: the call's pointers, set before the heuristic looks (it judges their alignment).
  std::unique_ptr<plan> make(const key& k, const void* bias, const void* aux) const {
    auto p = std::make_unique<plan>();
    const cublasComputeType_t compute = k.math == gemm_math::bf16   ? CUBLAS_COMPUTE_32F_FAST_16BF
                                        : k.math == gemm_math::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                                    : CUBLAS_COMPUTE_32F;
    check(cublasLtMatmulDescCreate(&p->op, compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t oa = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa), "set TRANSA");
    check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob), "set TRANSB");
    const auto epi = static_cast<cublasLtEpilogue_t>(k.epilogue);
    check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "set EPILOGUE");
    if (bias) {
      const cudaDataType_t bias_type = CUDA_R_32F;
      check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type),
            "set BIAS_DATA_TYPE");
      check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias),
            "set BIAS_POINTER");
    }
    if (aux) {
      check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux),
            "set EPILOGUE_AUX_POINTER");
      const std::int64_t ld = k.aux_ld;
      check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld),
            "set EPILOGUE_AUX_LD");
    }
    // stored shapes: op(A) is m x k, op(B) is k x n
    check(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_32F, k.ta ? k.k : k.m, k.ta ? k.m : k.k, k.lda), "layout A");
    check(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_32F, k.tb ? k.n : k.k, k.tb ? k.k : k.n, k.ldb), "layout B");
    check(cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, k.m, k.n, k.ldc), "layout C");
    cublasLtMatmulPreference_t pref = nullptr;
    check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t ws = workspace_bytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    const std::uint32_t al[4] = {k.align_a, k.align_b, k.align_c, k.align_c};
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], sizeof al[0]);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], sizeof al[1]);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], sizeof al[2]);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], sizeof al[3]);
    cublasLtMatmulHeuristicResult_t found{};
    int count = 0;
    const cublasStatus_t s =
        cublasLtMatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->c, p->c, pref, 1, &found, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    p->ok = s == CUBLAS_STATUS_SUCCESS && count > 0 && found.state == CUBLAS_STATUS_SUCCESS &&
            found.workspaceSize <= workspace_bytes && k.align_bias >= 16 && k.align_aux >= 16 &&
            (k.aux_ld == 0 || k.aux_ld % 8 == 0);  // the aux matrix: 16-byte aligned, its leading dimension a multiple of 8
    if (p->ok) p->algo = found.algo;
    return p;
  }

  cublasLtHandle_t handle_ = nullptr;
  std::map<key, std::unique_ptr<plan>> plans_;
};

}  // namespace detail::lt
}  // namespace whale
