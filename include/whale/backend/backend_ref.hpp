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
#include "whale/backend/device_ops.hpp"
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
      : gpu_(&gpu), stream_(static_cast<void*>(gpu.compute_stream())), ops_(&detail::device_ops_of<G>) {}
  /// A backend whose kernel bodies run on the host between its `enter()` and
  /// `leave()` (the guarded backend): device memory rules, CPU arithmetic.
  template <Backend G>
    requires requires(G& g) {
      requires G::host_executed;
      g.enter();
      g.leave();
    }
  explicit backend_ref(G& dev) noexcept : gpu_(&dev), ops_(&detail::device_ops_of<G>) {}

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
  double sum_squares(index_t n, const float* x) const;
  /// *out = the sum of squares of x[0, n), with `out` in the backend's memory
  /// and nothing read back: per-block sums (kernels::sum_squares_blocks),
  /// those summed in groups (kernels::sum_blocks), and the groups in order
  /// (kernels::sum_in_order), as cpu::sum_squares adds them: the same bits.
  void sum_squares_into(index_t n, const float* x, double* out) const;
  /// *out = scale * (the sum of x[0, n)), or that added to *out (`add`), with
  /// x and out in the backend's memory and nothing read back: blocks of
  /// kernels::sum_blocks, then their sum in order, on every backend (the CPU
  /// included), so every backend adds in one order.
  void sum_into(index_t n, const double* x, double scale, double* out, bool add) const;

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
                         bool bf16 = false, float* packed = nullptr) const;
  /// The backward of attention_forward: d(o) (B*T, W) to d(qkv) (B*T, 3W),
  /// from the forward's qkv and lse (o is for backends whose fused form reads
  /// it; these steps do not). S = Q K^T / sqrt(hd) and dP = dO V^T; then one
  /// row kernel recomputes P = exp(S - lse) and forms dS = P (dP - rowsum(P
  /// dP)); then dV = P^T dO, dQ = dS K / sqrt(hd), dK = dS^T Q / sqrt(hd):
  /// five strided-batched products over every (sequence, head), one row
  /// kernel and three layout copies.
  void attention_backward(index_t B, index_t T, index_t H, index_t hd, const float* qkv, const float* o,
                          const float* lse, const float* dout, float* dqkv, bool bf16 = false,
                          float* packed = nullptr) const;

  /// Floats a caller of attention_forward keeps as its `packed` buffer, for
  /// rows of width W under bf16 (`bf16`): 2W a row where the backend fuses
  /// attention (a GPU with cuDNN's, or the guarded backend modelling it),
  /// otherwise 0 (nothing to keep).
  index_t attention_packed_floats(index_t rows, index_t W, bool bf16) const;

  /// The scatter-add of an embedding's gradient rows into its table: the
  /// CPU's blocks of 256 columns, or the device's stripes of table rows
  /// (kernels::scatter_add_stripes); the same sums in the same order.
  void scatter_add(const kernels::scatter_add_rows& body) const;
  /// y[r, :] += b over `rows` rows of width `cols`.
  void add_row_bias(float* y, const float* b, index_t rows, index_t cols) const;
  /// db[c] (+)= the sum over rows of dy[r, c].
  void sum_rows(const float* dy, float* db, index_t rows, index_t cols, bool accumulate) const;
  /// C (M, N) = op(A) op(B) + bias (N, added to every row; null: none), in
  /// fp32, contiguous operands. A device whose GEMM has a bias epilogue (the
  /// CUDA backend's cuBLASLt, or the guarded backend modelling it) adds the
  /// bias in the GEMM's call; otherwise C = bias, then the product added to
  /// it (the same values as y + b after the product: the product's sum, then the bias).
  void gemm_bias(trans ta, trans tb, index_t M, index_t N, index_t K, const float* A, const float* B,
                 const float* bias, float* C) const;
  /// A GEMM and GELU (gemm_gelu_args): forward, pre = op(A) op(B) + bias and
  /// out = GELU(pre); backward, out = (op(A) op(B)) GELU'(pre). A device
  /// whose GEMM has GELU epilogues (the CUDA backend's cuBLASLt, or the
  /// guarded backend modelling it) does it in the GEMM's call; otherwise the
  /// GEMM (gemm_bias), then kernels::gelu_forward or gelu_backward (in place
  /// on the product): the values of a linear layer followed by `gelu`.
  void gemm_gelu(const gemm_gelu_args& a) const;
  /// What gemm_gelu computes, as separate calls on `be` (a backend that models
  /// the epilogue runs them on the CPU).
  template <class Be> static void unfused_gemm_gelu(Be&& be, const gemm_gelu_args& a);
  /// A fully connected layer's parameter gradients from R rows: dW (out, in) =
  /// dy^T x and db (out) = the column sums of dy (db null: no bias); `accumulate` adds to them.
  /// A device that fuses the two (the CUDA backend's cuBLASLt epilogue, or
  /// the guarded backend modelling it) computes them in one call where they
  /// are overwritten; otherwise, and to accumulate, a GEMM and a column reduction.
  void linear_weight_grads(index_t R, index_t out, index_t in, const float* dy, const float* x, float* dw, float* db,
                           bool accumulate) const;

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
                  : detail::scratch_stack::local().take(n, heap)) {}
    ~scratch() {
      if (place) detail::free_in(place, p, bytes(), mem_kind::workspace);
      else detail::scratch_stack::local().give(p, floats, heap);
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

  void* gpu_ = nullptr;     // the GPU backend; null: the CPU
  void* stream_ = nullptr;  // its compute stream (a cudaStream_t)
  const detail::device_ops* ops_ = nullptr;
};

}  // namespace whale

#include "whale/backend/compositions.hpp"  // the compositions' definitions
#include "whale/backend/cpu/instances.hpp"  // the compiled core's CPU loops (declared only with it)
