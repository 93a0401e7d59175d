// `backend_ref`: the backend a rank computes on, chosen at run time among the
// ones built into the program -- the CPU always, a GPU (any Backend whose
// space is `cuda`, i.e. cuda_backend) where nvcc compiles the training code.
// Layers, their split forms and the optimizers issue every GEMM and kernel
// body through one (step_ctx::be), so one layer source serves both spaces.
// Small and copied by value; a GPU reference does not own the backend. The
// guarded backend (backend/guarded.hpp) is a third kind: the CPU computing in
// memory host code may not touch, a GPU's memory rules without a GPU.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "whale/backend/backend.hpp"
#include "whale/backend/cpu.hpp"
#include "whale/backend/kernels/attention.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/rows.hpp"
#include "whale/backend/kernels/shapes.hpp"
#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "whale/backend/cuda/launch.cuh"
#endif

namespace whale {

class backend_ref {
 public:
  /// The CPU: OpenBLAS GEMMs and kernel bodies by a loop (the default).
  constexpr backend_ref() noexcept = default;
  /// A GPU backend, held by reference: GEMMs through it, kernel bodies on its
  /// compute stream. Launching bodies on it needs the calling translation unit
  /// compiled by nvcc (a .cu file); from any other it is an error that says so.
  template <Backend G>
    requires std::same_as<typename G::space, cuda>
  explicit backend_ref(G& gpu) noexcept
      : gpu_(&gpu), stream_(static_cast<void*>(gpu.compute_stream())), ops_(&gpu_table<G>) {}
  /// A backend whose kernel bodies run on the host between its `enter()` and
  /// `leave()` (the guarded backend): device memory rules, CPU arithmetic.
  template <Backend G>
    requires requires(G& g) {
      requires G::host_executed;
      g.enter();
      g.leave();
    }
  explicit backend_ref(G& dev) noexcept : gpu_(&dev), ops_(&gpu_table<G>) {}

  /// Whether this is the CPU (host memory, which host code may read) or a
  /// device backend (a GPU, or the guarded backend): memory only its calls touch.
  bool on_cpu() const noexcept { return gpu_ == nullptr; }
  const char* name() const noexcept { return gpu_ ? ops_->name : "cpu"; }
  /// Where tensors allocated for this backend live (open a place_scope on it):
  /// null for the CPU (host memory).
  const memory_place* memory() const noexcept { return gpu_ ? ops_->memory(gpu_) : nullptr; }
  /// Bytes the backend's memory could still hand out, where it can say
  /// (memory_free() of the backend); -1 for the CPU (host memory: the node's
  /// figure, runtime/memory_check.hpp) and for a backend that cannot.
  std::int64_t memory_free() const { return gpu_ ? ops_->memory_free(gpu_) : -1; }
  /// Whether this is a GPU (CUDA): its memory is reached by CUDA calls on its compute stream.
  bool on_cuda() const noexcept { return gpu_ != nullptr && ops_->enter == nullptr; }
  /// Whether this is a device whose calls run on the host inside a window (the guarded backend).
  bool host_executed() const noexcept { return gpu_ != nullptr && ops_->enter != nullptr; }
  /// A GPU's compute stream (a cudaStream_t); null otherwise.
  void* compute_stream() const noexcept { return stream_; }
  /// A host-executed backend: open its memory to this process until the
  /// matching close_window() (nested calls count), for a library that reads
  /// and writes it outside the backend's calls (MPI, standing in for a GPU's
  /// own communicator in tests). Nothing on other backends.
  void open_window() const {
    if (host_executed()) ops_->enter(gpu_);
  }
  void close_window() const noexcept {
    if (host_executed()) ops_->leave(gpu_);
  }

  /// C(M,N) = alpha op(A) op(B) + beta C, row-major, with the rows' strides.
  void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
            const float* B, index_t ldb, float beta, float* C, index_t ldc) const {
    if (!gpu_) return cpu::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    ops_->gemm(gpu_, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  /// Contiguous operands: the strides follow from the stored shapes.
  void gemm(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, const float* B,
            float beta, float* C) const {
    gemm(ta, tb, M, N, K, alpha, A, ta == trans::yes ? M : K, B, tb == trans::yes ? K : N, beta, C, N);
  }
  /// `count` GEMMs whose operands are strideA/B/C elements apart (attention heads).
  void gemm_strided_batched(trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A,
                            index_t lda, index_t strideA, const float* B, index_t ldb, index_t strideB, float beta,
                            float* C, index_t ldc, index_t strideC, index_t count) const {
    if (!gpu_)
      return cpu::gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc,
                                       strideC, count);
    ops_->batched(gpu_, ta, tb, M, N, K, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC, count);
  }
  /// body(i) for i in [0, n): a CPU loop, or a CUDA grid on the GPU's compute stream.
  template <kernels::KernelBody K> void launch(index_t n, const K& body) const {
    if (!gpu_) return cpu::launch(n, body);
    on_device(n, body, 'i', n);
  }
  /// body(team, r) for each of `rows` rows: a team of one warp per row, or of
  /// 8 warps for rows of kernels::wide_row and more (emulated on the CPU).
  template <kernels::RowBody K> void launch(index_t rows, const K& body) const {
    if (!gpu_) return cpu::launch(rows, body);
    on_device(rows, body, 'r', rows * kernels::row_warps(body.width()) * kernels::warp_lanes);
  }
  /// A column reduction over body.rows() x body.cols(). The CPU sums blocks of
  /// columns tile by tile; a device runs the two phases, the tiles' partial
  /// sums (one thread per tile and column, in workspace memory) and then
  /// their sum in tile order (one thread per column), or one phase when all
  /// rows fit a tile. The same sums in the same order on every backend.
  template <kernels::ColumnBody K> void reduce_columns(const K& body) const {
    if (!gpu_) return cpu::reduce_columns(body);
    const index_t R = body.rows(), C = body.cols(), tiles = kernels::row_tiles(R);
    if (tiles <= 1) return launch(C, kernels::column_one_tile<K>{body, R});
    // the partials, in the device's workspace and not zeroed (phase 1 writes every one)
    const scratch partial(*this, tiles * C * K::accumulators);
    launch(tiles * C, kernels::column_tile_sums<K>{body, partial.p, R, C});
    launch(kernels::column_tile_finish<K>::groups(C), kernels::column_tile_finish<K>{body, partial.p, tiles, C});
  }
  /// A row pass that also sums its columns: `body` (with a `partial` field)
  /// runs one team per tile of kernels::summing_tile rows, each tile writing
  /// its partial sums, then column_tile_finish adds the tiles with `sums`'s
  /// store (e.g. layer_norm_backward_sums, then layer_norm_param_grads'
  /// store). The same passes, and sums, on every backend.
  template <kernels::RowBody K, kernels::ColumnBody S> void launch_summing(index_t rows, K body, const S& sums) const {
    const index_t tiles = kernels::summing_tiles(rows), C = sums.cols();
    const scratch partial(*this, tiles * C * S::accumulators);  // every partial written by the pass
    body.partial = partial.p;
    launch(tiles, body);
    launch(kernels::column_tile_finish<S>::groups(C), kernels::column_tile_finish<S>{sums, partial.p, tiles, C});
  }
  /// Copy within the backend's space (and, on the GPU, between spaces), in its queue's order.
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (!gpu_) {
      if (bytes) std::memcpy(dst, src, bytes);
      return;
    }
    ops_->copy(gpu_, dst, src, bytes);
  }
  /// Zero `bytes` in the backend's space, in its queue's order.
  void fill_zero(void* p, std::size_t bytes) const {
    if (!gpu_) {
      if (bytes) std::memset(p, 0, bytes);
      return;
    }
    ops_->fill_zero(gpu_, p, bytes);
  }
  /// bf16 mixed precision's GEMMs from here on (`on`), or no longer: a GPU
  /// then multiplies on its bf16 tensor cores, the operands converted to bf16
  /// (exact where the operands are bf16 values, as whale's layers store them
  /// under bf16; attention's unfused steps keep o and d(qkv) in fp32, which
  /// such GEMMs then round).
  /// The trainer sets it around each step it runs in bf16. Nothing elsewhere
  /// (the CPU's and the guarded backend's products are exact in fp32 anyway).
  void bf16_products(bool on) const {
    if (gpu_ && ops_->products) ops_->products(gpu_, on);
  }
  /// Wait until the queue's work is done (nothing to wait for on the CPU).
  void synchronize() const {
    if (gpu_) ops_->synchronize(gpu_);
  }
  /// `v` readable by host code: `v` itself on the CPU; on a device, a copy in
  /// `keep` (queued after the work so far, waited for), which the result views.
  template <class T> cview<T> host_readable(cview<T> v, std::vector<std::remove_const_t<T>>& keep) const {
    if (!gpu_ || v.data() == nullptr) return v;
    keep.resize(static_cast<std::size_t>(v.numel()));
    copy(keep.data(), v.data(), v.bytes());
    synchronize();
    return cview<T>(keep.data(), v.shape());
  }

  // ---- the compositions layers share ----

  /// The sum of squares of x[0, n) (a gradient norm): cpu::sum_squares on the
  /// CPU; on a device, sum_squares_into a double there, read back (the host
  /// waits). The CPU's value to the bit on the guarded backend; on a GPU to
  /// rounding (nvcc may fuse a multiply and an add).
  double sum_squares(index_t n, const float* x) const {
    if (!gpu_) return cpu::sum_squares(n, x);
    const scratch total(*this, 3);
    double* t = doubles(total);
    sum_squares_into(n, x, t);
    std::vector<double> host;
    return host_readable(cview<double>(t, {1}), host)[0];
  }
  /// *out = the sum of squares of x[0, n), with `out` in the backend's memory
  /// and nothing read back: per-block sums (kernels::sum_squares_blocks),
  /// those summed in groups (kernels::sum_blocks), and the groups in order
  /// (kernels::sum_in_order), as cpu::sum_squares adds them: the same bits.
  void sum_squares_into(index_t n, const float* x, double* out) const {
    if (!gpu_) {
      *out = cpu::sum_squares(n, x);
      return;
    }
    const index_t nb = kernels::sum_squares_blocks::blocks(n), ng = kernels::sum_blocks::blocks(nb);
    const scratch partial(*this, 2 * (nb + ng) + 2);
    double* part = doubles(partial);
    if (nb > 0) {
      launch(nb, kernels::sum_squares_blocks{x, part, n});
      launch(ng, kernels::sum_blocks{part, part + nb, nb});
    }
    launch(1, kernels::sum_in_order{part + nb, ng, 1.0, out, false});
  }
  /// *out = scale * (the sum of x[0, n)), or that added to *out (`add`), with
  /// x and out in the backend's memory and nothing read back: blocks of
  /// kernels::sum_blocks, then their sum in order, on every backend (the CPU
  /// included), so every backend adds in one order.
  void sum_into(index_t n, const double* x, double scale, double* out, bool add) const {
    const index_t nb = kernels::sum_blocks::blocks(n);
    const scratch partial(*this, 2 * nb + 2);
    double* part = doubles(partial);
    if (nb > 0) launch(nb, kernels::sum_blocks{x, part, n});
    launch(1, kernels::sum_in_order{part, nb, scale, out, add});
  }

  /// Causal self-attention as one call, on B sequences of T tokens and H heads
  /// of width hd (W = H * hd):
  /// - qkv: (B*T, 3W) = [Q | K | V], the heads side by side in each third;
  /// - o: (B*T, W) out, the heads' outputs side by side;
  /// - lse: (B, H, T) out, each query's log-sum-exp of its scaled scores.
  /// qkv, o and lse are all the backward needs: the T x T scores live only
  /// inside the call, in workspace memory, and no tensor of B*H*T*T floats
  /// outlives it. Every backend runs the same five steps: Q, K, V copied
  /// head-major (kernels::split_heads); S = Q K^T / sqrt(hd) for every
  /// (sequence, head) in one strided-batched product; the causal softmax of
  /// each row, keeping its lse; O = P V in one product; O back to token-major.
  /// Under bf16 mixed precision (`bf16`) a backend that fuses attention runs
  /// it instead: the CUDA backend through cuDNN's flash attention (bf16 Q, K,
  /// V and O, fp32 lse) where the program was built with the cuDNN frontend.
  /// `packed` (optional, from the caller while it keeps qkv, o and lse: see
  /// attention_packed_floats) keeps a fused attention's bf16 operands for the backward.
  void attention_forward(index_t B, index_t T, index_t H, index_t hd, const float* qkv, float* o, float* lse,
                         bool bf16 = false, float* packed = nullptr) const {
    if (gpu_ && ops_->attention &&
        ops_->attention(gpu_, attention_args{B, T, H, hd, qkv, o, lse, nullptr, nullptr, bf16, packed}, false))
      return;
    const kernels::head_layout in{B, T, H, hd, 3}, out{B, T, H, hd, 1};
    const index_t n = B * H, th = T * hd, tt = T * T;
    const scratch heads(*this, in.elements()), s(*this, n * tt), oh(*this, out.elements());
    const float* q = heads.p;
    launch_rows(kernels::split_heads{qkv, heads.p, in});
    gemm_strided_batched(trans::no, trans::yes, T, T, hd, attention_scale(hd), q, hd, th, q + n * th, hd, th, 0.f,
                         s.p, T, tt, n);
    launch(n * T, kernels::causal_softmax_forward{s.p, T, lse});
    gemm_strided_batched(trans::no, trans::no, T, hd, T, 1.f, s.p, T, tt, q + 2 * n * th, hd, th, 0.f, oh.p, hd, th,
                         n);
    launch_rows(kernels::merge_heads{oh.p, o, out});
  }
  /// The backward of attention_forward: d(o) (B*T, W) to d(qkv) (B*T, 3W),
  /// from the forward's qkv and lse (o is for backends whose fused form reads
  /// it; these steps do not). S = Q K^T / sqrt(hd) and dP = dO V^T; then one
  /// row kernel recomputes P = exp(S - lse) and forms dS = P (dP - rowsum(P
  /// dP)); then dV = P^T dO, dQ = dS K / sqrt(hd), dK = dS^T Q / sqrt(hd):
  /// five strided-batched products over every (sequence, head), one row
  /// kernel and three layout copies.
  void attention_backward(index_t B, index_t T, index_t H, index_t hd, const float* qkv, const float* o,
                          const float* lse, const float* dout, float* dqkv, bool bf16 = false,
                          float* packed = nullptr) const {
    if (gpu_ && ops_->attention &&
        ops_->attention(gpu_, attention_args{B, T, H, hd, qkv, const_cast<float*>(o), const_cast<float*>(lse), dout, dqkv,
                                             bf16, packed},
                        true))
      return;
    const kernels::head_layout in{B, T, H, hd, 3}, one{B, T, H, hd, 1};
    const index_t n = B * H, th = T * hd, tt = T * T;
    const float scale = attention_scale(hd);
    const scratch heads(*this, in.elements()), dheads(*this, in.elements()), dh(*this, one.elements());
    const scratch p(*this, n * tt), dp(*this, n * tt);
    const float *q = heads.p, *k = q + n * th, *v = k + n * th;
    float *dq = dheads.p, *dk = dq + n * th, *dv = dk + n * th;
    launch_rows(kernels::split_heads{qkv, heads.p, in});
    launch_rows(kernels::split_heads{dout, dh.p, one});
    gemm_strided_batched(trans::no, trans::yes, T, T, hd, scale, q, hd, th, k, hd, th, 0.f, p.p, T, tt, n);
    gemm_strided_batched(trans::no, trans::yes, T, T, hd, 1.f, dh.p, hd, th, v, hd, th, 0.f, dp.p, T, tt, n);
    launch(n * T, kernels::causal_softmax_backward{p.p, dp.p, lse, T});
    gemm_strided_batched(trans::yes, trans::no, T, hd, T, 1.f, p.p, T, tt, dh.p, hd, th, 0.f, dv, hd, th, n);
    gemm_strided_batched(trans::no, trans::no, T, hd, T, scale, dp.p, T, tt, k, hd, th, 0.f, dq, hd, th, n);
    gemm_strided_batched(trans::yes, trans::no, T, hd, T, scale, dp.p, T, tt, q, hd, th, 0.f, dk, hd, th, n);
    launch_rows(kernels::merge_heads{dheads.p, dqkv, in});
  }

  /// Floats a caller of attention_forward keeps as its `packed` buffer, for
  /// rows of width W under bf16 (`bf16`): 2W a row where the backend fuses
  /// attention (a GPU with cuDNN's, or the guarded backend modelling it),
  /// otherwise 0 (nothing to keep).
  index_t attention_packed_floats(index_t rows, index_t W, bool bf16) const {
    return bf16 && gpu_ && ops_->attention_fused && ops_->attention_fused(gpu_) ? rows * 2 * W : 0;
  }

  /// The scatter-add of an embedding's gradient rows into its table: the
  /// CPU's blocks of 256 columns, or the device's stripes of table rows
  /// (kernels::scatter_add_stripes); the same sums in the same order.
  void scatter_add(const kernels::scatter_add_rows& body) const {
    if (!gpu_) return launch(kernels::col_blocks(body.D), body);
    const index_t stripes = kernels::scatter_add_stripes::stripes_for(body.D);
    launch(stripes * body.D, kernels::scatter_add_stripes{body, stripes});
  }
  /// y[r, :] += b over `rows` rows of width `cols`.
  void add_row_bias(float* y, const float* b, index_t rows, index_t cols) const {
    launch(rows, kernels::bias_rows{y, b, cols, true});
  }
  /// db[c] (+)= the sum over rows of dy[r, c].
  void sum_rows(const float* dy, float* db, index_t rows, index_t cols, bool accumulate) const {
    reduce_columns(kernels::column_sums{dy, db, rows, cols, accumulate});
  }
  /// C (M, N) = op(A) op(B) + bias (N, added to every row; null: none), in
  /// fp32, contiguous operands. A device whose GEMM has a bias epilogue (the
  /// CUDA backend's cuBLASLt, or the guarded backend modelling it) adds the
  /// bias in the GEMM's call; otherwise C = bias, then the product added to
  /// it (the same values as y + b after the product: the product's sum, then the bias).
  void gemm_bias(trans ta, trans tb, index_t M, index_t N, index_t K, const float* A, const float* B,
                 const float* bias, float* C) const {
    if (!bias || K == 0) {
      if (bias) launch(M, kernels::bias_rows{C, bias, N, false});
      else gemm(ta, tb, M, N, K, 1.f, A, B, 0.f, C);
      return;
    }
    if (gpu_ && ops_->bias_gemm && ops_->bias_gemm(gpu_, gemm_bias_args{ta, tb, M, N, K, A, B, bias, C})) return;
    launch(M, kernels::bias_rows{C, bias, N, false});
    gemm(ta, tb, M, N, K, 1.f, A, B, 1.f, C);
  }
  /// A GEMM and GELU (gemm_gelu_args): forward, pre = op(A) op(B) + bias and
  /// out = GELU(pre); backward, out = (op(A) op(B)) GELU'(pre). A device
  /// whose GEMM has GELU epilogues (the CUDA backend's cuBLASLt, or the
  /// guarded backend modelling it) does it in the GEMM's call; otherwise the
  /// GEMM (gemm_bias), then kernels::gelu_forward or gelu_backward (in place
  /// on the product): the values of a linear layer followed by `gelu`.
  void gemm_gelu(const gemm_gelu_args& a) const {
    if (a.M == 0 || a.N == 0) return;
    if (a.K > 0 && gpu_ && ops_->gelu_gemm && ops_->gelu_gemm(gpu_, a)) return;
    unfused_gemm_gelu(*this, a);
  }
  /// What gemm_gelu computes, as separate calls on `be` (a backend that models
  /// the epilogue runs them on the CPU).
  template <class Be> static void unfused_gemm_gelu(Be&& be, const gemm_gelu_args& a) {
    if (!a.backward) {
      be.gemm_bias(a.ta, a.tb, a.M, a.N, a.K, a.A, a.B, a.bias, a.pre);
      be.launch(a.M * a.N, kernels::gelu_forward{a.pre, a.out, a.round});
    } else {
      be.gemm(a.ta, a.tb, a.M, a.N, a.K, 1.f, a.A, a.B, 0.f, a.out);
      be.launch(a.M * a.N, kernels::gelu_backward{a.pre, a.out, a.out, a.round});
    }
  }
  /// A fully connected layer's parameter gradients from R rows: dW (out, in) =
  /// dy^T x and db (out) = the column sums of dy (db null: no bias); `accumulate` adds to them.
  /// A device that fuses the two (the CUDA backend's cuBLASLt epilogue, or
  /// the guarded backend modelling it) computes them in one call where they
  /// are overwritten; otherwise, and to accumulate, a GEMM and a column reduction.
  void linear_weight_grads(index_t R, index_t out, index_t in, const float* dy, const float* x, float* dw, float* db,
                           bool accumulate) const {
    if (!db) {  // no bias (linear<In, Out, no_bias>): the GEMM alone
      gemm(trans::yes, trans::no, out, in, R, 1.f, dy, x, accumulate ? 1.f : 0.f, dw);
      return;
    }
    if (gpu_ && !accumulate && ops_->weight_grads && ops_->weight_grads(gpu_, weight_grad_args{R, out, in, dy, x, dw, db}))
      return;
    gemm(trans::yes, trans::no, out, in, R, 1.f, dy, x, accumulate ? 1.f : 0.f, dw);
    sum_rows(dy, db, R, out, accumulate);
  }

 private:
  /// A launch on the device: a host-executed backend notes it and runs the CPU
  /// loop inside its window; a GPU runs it on its compute stream.
  template <class K> void on_device(index_t n, const K& body, char shape, std::int64_t threads) const {
    if (ops_->enter) {
      if (!ops_->note(gpu_, note_of(body, shape, n, threads))) return;
      const opened o(*this);
      if constexpr (kernels::RowBody<K>) return cpu::launch_staged(n, body);  // with a GPU team's staged rows
      else return cpu::launch(n, body);
    }
#if defined(__CUDACC__)
    struct timed {  // a GPU's per-kind timing, ended on every way out
      const backend_ref& b;
      int i;
      ~timed() {
        if (i >= 0) b.ops_->time_end(b.gpu_, i);
      }
    } const t{*this, ops_->time_begin ? ops_->time_begin(gpu_, kernel_class<K>(shape)) : -1};
    cuda_space::launch(n, body, static_cast<cudaStream_t>(stream_));
#else
    (void)threads;
    no_nvcc();
#endif
  }
  [[noreturn]] static void no_nvcc() {
    throw std::logic_error(
        "whale::backend_ref: a kernel body was launched on a CUDA device from a translation unit not compiled by "
        "nvcc; compile the training code as a .cu file (every unit of the program with the same compiler)");
  }
  /// The kind of work a body is, for a GPU's per-kind timing (cuda_backend::set_kernel_timing).
  template <class K> static constexpr const char* kernel_class(char shape) {
    if (shape == 'r') return "row";
    if constexpr (requires(const K& k) { k.apply(index_t{0}, 0.f, false); } || requires(const K& k) { k.rule.apply(index_t{0}, 0.f, false); })
      return "optimizer";
    else if constexpr (kernels::is_column_phase<K>)
      return "column_reduction";
    else
      return "elementwise";
  }
  template <class K> static launch_note note_of(const K& body, char shape, index_t n, std::int64_t threads) {
    std::int64_t bytes = -1;
    if constexpr (requires { body.bytes(n); }) bytes = body.bytes(n);
    return {kernels::kernel_name<K>().c_str(), shape, n, threads, bytes};
  }
  /// A row body over its own rows().
  template <kernels::RowBody K> void launch_rows(const K& body) const { launch(body.rows(), body); }
  /// The CPU's scratch memory: one block used as a stack by the scratches of
  /// a call (freed in reverse order), grown to the most they asked for at once
  /// when the last is freed; until then what does not fit comes from the
  /// heap. So steps after the first allocate nothing. One per thread.
  class scratch_stack {
   public:
    static scratch_stack& local() {
      static thread_local scratch_stack s;
      return s;
    }
    float* take(index_t floats, bool& heap) {
      const index_t n = rounded(floats);
      demand_ += n;
      high_ = demand_ > high_ ? demand_ : high_;
      heap = top_ + n > cap_;
      if (heap) return static_cast<float*>(detail::allocate_raw(static_cast<std::size_t>(n) * sizeof(float), mem_kind::workspace));
      float* p = base_ + top_;
      top_ += n;
      return p;
    }
    void give(float* p, index_t floats, bool heap) noexcept {
      const index_t n = rounded(floats);
      demand_ -= n;
      if (heap) detail::free_raw(p, static_cast<std::size_t>(n) * sizeof(float), mem_kind::workspace);
      else top_ -= n;
      if (demand_ == 0 && high_ > cap_) {  // nothing taken: the block may move
        release();
        base_ = static_cast<float*>(detail::allocate_raw(static_cast<std::size_t>(high_) * sizeof(float), mem_kind::workspace));
        cap_ = high_;
      }
    }
    ~scratch_stack() { release(); }

   private:
    static index_t rounded(index_t floats) noexcept { return (floats + 15) / 16 * 16; }  // 64-byte aligned pieces
    void release() noexcept {
      if (base_) detail::free_raw(base_, static_cast<std::size_t>(cap_) * sizeof(float), mem_kind::workspace);
      base_ = nullptr, cap_ = 0;
    }
    float* base_ = nullptr;
    index_t cap_ = 0, top_ = 0, demand_ = 0, high_ = 0;
  };
  /// Floats in the backend's workspace memory for one call, not zeroed: on a
  /// device from its allocator (which caches), on the CPU from its scratch stack.
  struct scratch {
    const memory_place* place;
    index_t floats;
    bool heap = false;
    float* p;
    scratch(const backend_ref& be, index_t n)
        : place(be.memory()), floats(n),
          p(place ? static_cast<float*>(detail::allocate_in(place, bytes(), mem_kind::workspace))
                  : scratch_stack::local().take(n, heap)) {}
    ~scratch() {
      if (place) detail::free_in(place, p, bytes(), mem_kind::workspace);
      else scratch_stack::local().give(p, floats, heap);
    }
    std::size_t bytes() const noexcept { return static_cast<std::size_t>(floats) * sizeof(float); }
    scratch(const scratch&) = delete;
    scratch& operator=(const scratch&) = delete;
  };
  static float attention_scale(index_t hd) { return 1.f / std::sqrt(static_cast<float>(hd)); }
  /// Scratch as doubles, aligned to 8 bytes: 2 k + 1 floats hold k doubles.
  static double* doubles(const scratch& s) noexcept {
    const auto a = (reinterpret_cast<std::uintptr_t>(s.p) + 7) & ~std::uintptr_t{7};
    return reinterpret_cast<double*>(a);
  }
  /// The window of a host-executed backend, closed on every way out.
  struct opened {
    const backend_ref& b;
    explicit opened(const backend_ref& r) : b(r) { b.ops_->enter(b.gpu_); }
    ~opened() { b.ops_->leave(b.gpu_); }
    opened(const opened&) = delete;
    opened& operator=(const opened&) = delete;
  };
  struct table {
    void (*gemm)(void*, trans, trans, index_t, index_t, index_t, float, const float*, index_t, const float*, index_t,
                 float, float*, index_t);
    void (*batched)(void*, trans, trans, index_t, index_t, index_t, float, const float*, index_t, index_t,
                    const float*, index_t, index_t, float, float*, index_t, index_t, index_t);
    void (*copy)(void*, void*, const void*, std::size_t);
    void (*fill_zero)(void*, void*, std::size_t);
    void (*synchronize)(void*);
    const memory_place* (*memory)(void*);
    std::int64_t (*memory_free)(void*);
    const char* name;
    void (*enter)(void*);  // host-executed backends only; null otherwise
    void (*leave)(void*);
    bool (*note)(void*, const launch_note&);  // the launch for its ledger; false: do not run it
    // a fused attention call (forward, or backward when the flag is set); false: not taken, run the steps
    bool (*attention)(void*, const attention_args&, bool);
    // a layer's weight and bias gradients in one call; false: not taken, run the GEMM and the reduction
    bool (*weight_grads)(void*, const weight_grad_args&);
    // a GEMM with its bias added in the call; false: not taken, fill the bias and add the product
    bool (*bias_gemm)(void*, const gemm_bias_args&);
    // a GEMM with GELU or its gradient in the call; false: not taken, the GEMM and then the kernel
    bool (*gelu_gemm)(void*, const gemm_gelu_args&);
    bool (*attention_fused)(void*);  // whether bf16 attention calls are fused; null: never
    void (*products)(void*, bool);  // bf16 products on or off; null: nothing to set
    int (*time_begin)(void*, const char*);  // a timed launch's start (-1: not timing); null: no timing
    void (*time_end)(void*, int) noexcept;
  };
  template <class G> static constexpr bool host_executed_v = requires { requires G::host_executed; };
  template <class G> static void enter_of(void* g) {
    if constexpr (host_executed_v<G>) static_cast<G*>(g)->enter();
  }
  template <class G> static void leave_of(void* g) {
    if constexpr (host_executed_v<G>) static_cast<G*>(g)->leave();
  }
  template <class G> static bool note_to(void* g, const launch_note& n) {
    if constexpr (host_executed_v<G>) return static_cast<G*>(g)->note(n);
    else return (void)g, (void)n, true;
  }
  template <class G>
  static constexpr bool fuses_attention_v = requires(G& g, const attention_args& a) {
    { g.fused_attention(a, true) } -> std::same_as<bool>;
  };
  template <class G> static bool attention_fused_of(void* g) {
    if constexpr (requires(G& b) { { b.fuses_attention() } -> std::same_as<bool>; })
      return static_cast<G*>(g)->fuses_attention();
    else return (void)g, false;
  }
  template <class G> static bool attention_of(void* g, const attention_args& a, bool backward) {
    if constexpr (fuses_attention_v<G>) return static_cast<G*>(g)->fused_attention(a, backward);
    else return (void)g, (void)a, (void)backward, false;
  }
  template <class G>
  static constexpr bool fuses_weight_grads_v = requires(G& g, const weight_grad_args& a) {
    { g.linear_weight_grads(a) } -> std::same_as<bool>;
  };
  template <class G> static bool weight_grads_of(void* g, const weight_grad_args& a) {
    if constexpr (fuses_weight_grads_v<G>) return static_cast<G*>(g)->linear_weight_grads(a);
    else return (void)g, (void)a, false;
  }
  template <class G>
  static constexpr bool fuses_bias_v = requires(G& g, const gemm_bias_args& a) {
    { g.gemm_bias(a) } -> std::same_as<bool>;
  };
  template <class G> static bool bias_gemm_of(void* g, const gemm_bias_args& a) {
    if constexpr (fuses_bias_v<G>) return static_cast<G*>(g)->gemm_bias(a);
    else return (void)g, (void)a, false;
  }
  template <class G>
  static constexpr bool fuses_gelu_v = requires(G& g, const gemm_gelu_args& a) {
    { g.gemm_gelu(a) } -> std::same_as<bool>;
  };
  template <class G> static bool gelu_gemm_of(void* g, const gemm_gelu_args& a) {
    if constexpr (fuses_gelu_v<G>) return static_cast<G*>(g)->gemm_gelu(a);
    else return (void)g, (void)a, false;
  }
  template <class G> static constexpr bool sets_products_v = requires(G& g) { g.set_bf16_products(true); };
  template <class G> static void products_of(void* g, bool on) {
    if constexpr (sets_products_v<G>) static_cast<G*>(g)->set_bf16_products(on);
    else (void)g, (void)on;
  }
  template <class G> static constexpr bool times_v = requires(G& g) { g.time_end(g.time_begin("")); };
  template <class G> static int time_begin_of(void* g, const char* what) {
    if constexpr (times_v<G>) return static_cast<G*>(g)->time_begin(what);
    else return (void)g, (void)what, -1;
  }
  template <class G> static void time_end_of(void* g, int i) noexcept {
    if constexpr (times_v<G>) {
      try {
        static_cast<G*>(g)->time_end(i);
      } catch (...) {  // a failed event record loses one timing; the launch's own errors surface elsewhere
      }
    } else {
      (void)g, (void)i;
    }
  }
  template <class G>
  static constexpr table gpu_table{
      [](void* g, trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
         const float* B, index_t ldb, float beta, float* C, index_t ldc) {
        static_cast<G*>(g)->gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      },
      [](void* g, trans ta, trans tb, index_t M, index_t N, index_t K, float alpha, const float* A, index_t lda,
         index_t sA, const float* B, index_t ldb, index_t sB, float beta, float* C, index_t ldc, index_t sC,
         index_t count) {
        static_cast<G*>(g)->gemm_strided_batched(ta, tb, M, N, K, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC,
                                                 count);
      },
      [](void* g, void* dst, const void* src, std::size_t bytes) { static_cast<G*>(g)->copy(dst, src, bytes); },
      [](void* g, void* p, std::size_t bytes) { static_cast<G*>(g)->fill_zero(p, bytes); },
      [](void* g) { static_cast<G*>(g)->synchronize(); },
      [](void* g) -> const memory_place* { return static_cast<G*>(g)->memory(); },
      [](void* g) -> std::int64_t {
        if constexpr (requires(G& b) { b.memory_free(); })
          return static_cast<std::int64_t>(static_cast<G*>(g)->memory_free());
        else
          return (void)g, std::int64_t{-1};
      },
      G::name(),
      host_executed_v<G> ? &enter_of<G> : nullptr,
      host_executed_v<G> ? &leave_of<G> : nullptr,
      host_executed_v<G> ? &note_to<G> : nullptr,
      fuses_attention_v<G> ? &attention_of<G> : nullptr,
      fuses_weight_grads_v<G> ? &weight_grads_of<G> : nullptr,
      fuses_bias_v<G> ? &bias_gemm_of<G> : nullptr,
      fuses_gelu_v<G> ? &gelu_gemm_of<G> : nullptr,
      fuses_attention_v<G> ? &attention_fused_of<G> : nullptr,
      sets_products_v<G> ? &products_of<G> : nullptr,
      times_v<G> ? &time_begin_of<G> : nullptr,
      times_v<G> ? &time_end_of<G> : nullptr,
  };

  void* gpu_ = nullptr;     // the GPU backend; null: the CPU
  void* stream_ = nullptr;  // its compute stream (a cudaStream_t)
  const table* ops_ = nullptr;
};

}  // namespace whale

#include "whale/backend/cpu/instances.hpp"  // the compiled core's CPU loops (declared only with it)
