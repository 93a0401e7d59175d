// The `Backend` concept: the compute a memory space offers to layers and
// optimizers -- GEMM in every transpose, strided-batched GEMM, any kernel body
// (backend/kernel.hpp) over an index space, allocation, copy and fill in its
// space, and an ordered queue with events. Models: `cpu_backend`
// (backend/cpu.hpp) and `cuda_backend` (backend/cuda.hpp). No implementation here.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "whale/backend/kernel.hpp"

namespace whale {

/// One kernel launch as a device backend's ledger sees it (backend/guarded.hpp).
struct launch_note {
  const char* kernel;         ///< the body's type name (kernels::kernel_name)
  char shape;                 ///< 'i' an index space, 'r' row teams, 'c' a phase of a column reduction
  index_t n;                  ///< indices, or rows
  std::int64_t threads;       ///< GPU threads the launch runs
  std::int64_t bytes;         ///< bytes read and written, as the body declares them; -1: it declares none
};

/// One causal self-attention call (backend_ref::attention_forward and
/// attention_backward), for a backend that fuses it: B sequences of T tokens,
/// H heads of width hd (W = H * hd), token-major rows with the heads side by side.
struct attention_args {
  index_t B, T, H, hd;
  const float* qkv;              ///< (B*T, 3W): [Q | K | V]
  float* o;                      ///< (B*T, W): written forward, read backward
  float* lse;                    ///< (B, H, T): each query's log-sum-exp of its scaled scores; likewise
  const float* dout = nullptr;   ///< backward: d(o)
  float* dqkv = nullptr;         ///< backward: d(qkv), written
  bool bf16 = false;             ///< the step computes in bf16 mixed precision
  /// Device memory of (B*T, 4W) bf16 values (2W floats a row) that keeps the
  /// forward's bf16 Q, K, V and O for the backward, so that it packs only
  /// d(o); null: the backward packs qkv and o again.
  void* packed = nullptr;
};

/// A fully connected layer's parameter gradients from R rows, for a backend
/// that computes them in one call (the CUDA backend's cuBLASLt epilogue):
/// dw (out, in) = dy^T x and db (out) = the column sums of dy, both overwritten.
struct weight_grad_args {
  index_t R, out, in;
  const float* dy;  ///< (R, out)
  const float* x;   ///< (R, in)
  float* dw;        ///< (out, in)
  float* db;        ///< (out)
};

/// Transpose flag of a GEMM operand (row-major storage).
enum class trans : bool { no = false, yes = true };

/// A GEMM with its bias added in the same call, for a backend whose GEMM has
/// a bias epilogue (the CUDA backend's cuBLASLt): C (M, N) = op(A) op(B) +
/// bias, the bias (N) added to every row, in fp32; contiguous operands.
struct gemm_bias_args {
  trans ta, tb;
  index_t M, N, K;
  const float* A;
  const float* B;
  const float* bias;
  float* C;
};

/// A GEMM with GELU (the tanh form) in the same call, for a backend whose
/// GEMM has GELU epilogues (cuBLASLt's GELU_AUX_BIAS and DGELU), contiguous
/// operands, (M, N) results. Forward (`backward` false): pre = op(A) op(B) +
/// bias (bias may be null) and out = GELU(pre). Backward: out = (op(A)
/// op(B)) GELU'(pre), pre read. `round` (bf16 mixed precision): out stored
/// rounded to bf16, and pre and the product read as bf16 would hold them
/// (kernels::gelu_forward and gelu_backward with their `round`).
struct gemm_gelu_args {
  trans ta, tb;
  index_t M, N, K;
  const float* A;
  const float* B;
  const float* bias;
  float* pre;
  float* out;
  bool backward = false;
  bool round = false;
};

namespace detail {
/// A kernel body used only to check that a backend can launch bodies.
struct probe_body {
  float* x;
  WHALE_HD void operator()(index_t i) const noexcept { x[i] = 0.f; }
};
}  // namespace detail

/// What a compute backend provides. Members a type needs, and nothing else:
/// - `space`: the memory space of the pointers it takes (host, cuda);
/// - `event_type`, `record(e)`, `wait(e)`, `synchronize()`: its queue (the CPU
///   queue is the calling thread, so these do nothing there);
/// - `gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)`, row-major,
///   C(M,N) = alpha op(A) op(B) + beta C, and `gemm_strided_batched` with
///   element strides between the `count` problems;
/// - `launch(n, body)`: body(i) for i in [0, n) (one body, two spaces);
/// - `allocate(bytes)`, `deallocate(p, bytes)`, `copy(dst, src, bytes)` and
///   `fill_zero(p, bytes)` in its space.
template <class B>
concept Backend = requires(B& b, float* p, const float* cp, index_t n, std::size_t bytes, void* v, const void* cv,
                           typename B::event_type& e) {
  typename B::space;
  typename B::event_type;
  { B::name() } -> std::convertible_to<const char*>;
  b.gemm(trans::no, trans::yes, n, n, n, 1.f, cp, n, cp, n, 0.f, p, n);
  b.gemm_strided_batched(trans::no, trans::yes, n, n, n, 1.f, cp, n, n, cp, n, n, 0.f, p, n, n, n);
  b.launch(n, detail::probe_body{p});
  { b.allocate(bytes) } -> std::same_as<void*>;
  b.deallocate(v, bytes);
  b.copy(v, cv, bytes);
  b.fill_zero(v, bytes);
  b.record(e);
  b.wait(e);
  b.synchronize();
};

}  // namespace whale
