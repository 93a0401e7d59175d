// What a layer's pass is given and keeps: its cost metadata (`cost_info`),
// the per-pass context (`step_ctx`: backend, precision, micro-batch, hooks),
// parameter binding into one flat buffer (`param_binder`) and the
// per-micro-batch activation slots (`slots`). Part of nn/layer.hpp.
#pragma once

#include <array>
#include <concepts>
#include <cstring>
#include <cstdint>
#include <functional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/backend/backend_ref.hpp"
#include "whale/backend/kernels/elementwise.hpp"
#include "whale/backend/kernels/rows.hpp"
#include "whale/tensor/random.hpp"
#include "whale/tensor/tensor.hpp"

namespace whale {

/// Feature size of a layer that keeps whatever width it is given (relu, gelu, ...).
inline constexpr index_t any_features = -1;

/// Cost of a layer per row (a sample, or a token for sequence models).
struct cost_info {
  double fwd_flops = 0;    ///< forward FLOPs per row
  double bwd_flops = 0;    ///< backward FLOPs per row (input and parameter gradients)
  index_t params = 0;      ///< parameter count
  double act_bytes = 0;    ///< bytes kept for backward per row
  double seq_flops = 0;    ///< extra forward FLOPs per row per token of context (attention)
  double seq_act_bytes = 0;  ///< extra bytes kept per row per token of context
  /// Extra bytes written and read per row per token of context that are not
  /// kept (attention's scores and probabilities, which live only inside its call).
  double seq_work_bytes = 0;
  /// The inner size of the context products (attention's head width: its Q Kᵀ and
  /// P V are per-head products of T × T × head_dim); 0: none. A profile with
  /// `attention` lines prices those products by it (plan/device.hpp).
  double seq_inner = 0;
  bool per_feature = false;  ///< flops and bytes are per feature: scale by the width
  /// Every FLOP is a GEMM FLOP (a convolution run as an implicit GEMM reuses each
  /// weight at every position); otherwise a leaf's GEMM work is 2 FLOPs per weight per row.
  bool all_gemm = false;
  constexpr cost_info& operator+=(const cost_info& o) {
    fwd_flops += o.fwd_flops;
    bwd_flops += o.bwd_flops;
    params += o.params;
    act_bytes += o.act_bytes;
    seq_flops += o.seq_flops;
    seq_act_bytes += o.seq_act_bytes;
    seq_work_bytes += o.seq_work_bytes;
    seq_inner = seq_inner > o.seq_inner ? seq_inner : o.seq_inner;  // (one head width per block)
    return *this;
  }
  constexpr cost_info scaled(double width) const {
    cost_info r = *this;
    if (per_feature) {
      r.fwd_flops *= width;
      r.bwd_flops *= width;
      r.act_bytes *= width;
      r.per_feature = false;
    }
    return r;
  }
  constexpr index_t param_bytes() const { return params * 4; }
};

struct layer_hooks;

/// Weight-gradient work a layer put off during a split backward (zb_h1's B
/// pass), to be run by the schedule's W pass of the same micro-batch:
/// `run(owner, be, slot, accumulate)` computes the layer's parameter gradients
/// on backend `be` from the state it saved in activation slot `slot`.
struct weight_task {
  void* owner = nullptr;
  backend_ref be;
  int slot = 0;
  void (*run)(void* owner, const backend_ref& be, int slot, bool accumulate) = nullptr;
};

/// A label that counts for nothing: no loss and no gradient, and it is left
/// out of the mean (PyTorch's ignore_index default; e.g. padding).
inline constexpr std::int32_t ignore_index = -100;

/// What one forward/backward pass needs to know at run time.
struct step_ctx {
  /// Where the layers compute: every GEMM and kernel body of the pass goes
  /// through it (the CPU unless the executor runs on another backend).
  backend_ref be;
  index_t batch = 0;        ///< sequences (or samples) on this rank in this pass
  index_t seq = 1;          ///< tokens per sequence; 1 for non-sequence models
  index_t global_rows = 0;  ///< rows (samples, or tokens) of the global batch
  /// Labels of the global batch that count (not ignore_index): the loss is
  /// their mean. -1: every row counts (global_rows).
  std::int64_t loss_terms = -1;
  /// The loss's denominator: loss_terms, or global_rows when every row counts.
  double loss_count() const noexcept {
    return static_cast<double>(loss_terms >= 0 ? loss_terms : global_rows);
  }
  int slot = 0;             ///< activation slot: which in-flight micro-batch this is
  bool accumulate = false;  ///< add to parameter gradients instead of overwriting them
  bool need_input_grad = true;  ///< whether the caller needs d(input) from backward
  /// Called after each leaf layer's backward with the leaf's flat offset:
  /// that unit's backward operation of the program has ended, and every
  /// gradient at flat offset >= `offset` is final (backward runs the leaves
  /// in reverse flat order). The executor issues the operations that wait for
  /// it (program::bucket_launches); null: nobody waits.
  std::function<void(index_t offset)> leaf_backward_done;
  /// Called around every leaf layer (not containers); null: none.
  layer_hooks* hooks = nullptr;
  /// Split backward (schedules with weight passes): while non-null, a layer
  /// that can put its weight gradients off computes only d(input) and appends
  /// a task here (defer_weights); null: backward computes everything.
  std::vector<weight_task>* deferred = nullptr;
  /// Debugging (--check-finite): every leaf's output and input gradient is checked for NaN/Inf.
  bool check_finite = false;
  /// bf16 mixed precision (precision::bf16): every layer's output and input
  /// gradient is rounded to bf16 where it is produced; arithmetic stays fp32.
  bool bf16 = false;
  /// Where the loss goes without the host reading it (trainer_options::log_every):
  /// when set (a double in the backend's memory), a loss layer adds its share
  /// there and returns 0 instead of reading its rows' losses back. What
  /// forward_loss returns and what lands here add up to the share. A container
  /// that rescales its loss's share (a data-split region) hides it from the layers inside.
  double* loss_sum = nullptr;
  /// A residual's sum, offered to the layers that produce its branch's ends
  /// (residual<...>, under bf16 without hooks or --check-finite): the
  /// branch's last layer may add `residual_add` (the residual's input) to its
  /// output in the kernel that stores it, and the branch's first layer may add
  /// `residual_grad` (the residual's output gradient) to its input gradient.
  /// A layer that does clears the field; the residual then adds nothing. Each
  /// sequential shows them only to the element at that end, where it accepts
  /// them (accepts_residual_add / accepts_residual_grad).
  cview<float> residual_add, residual_grad;
  /// The element after this one reads its output rounding each value as
  /// bf16 would hold it (rounds_input_on_read; a sequential sets this for a
  /// leaf, under bf16 without hooks or --check-finite, and clears it after):
  /// a layer that can may then leave its output unrounded, as a GEMM writes
  /// it (a linear layer's product and bias in one GEMM call, its bias epilogue).
  bool output_read_rounded = false;
  /// A layer that can fold GELU into its GEMM (fuses_gelu) followed by
  /// `gelu` in a sequential, without hooks or --check-finite. Forward: the
  /// sequential sets gelu_in_gemm for the layer, which then returns GELU of
  /// its output, computed in its GEMM's call (backend_ref::gemm_gelu), and
  /// leaves its output (GELU's input) in gelu_pre; the gelu keeps that for
  /// its backward and passes its input on. Backward: the sequential shows the
  /// layer after a gelu the gelu's kept input (dgelu_pre); the layer's
  /// d(input) GEMM then gives d(GELU's input), and sets dgelu_done, so the
  /// gelu passes its dy on. Each field is cleared by the layer that takes it.
  bool gelu_in_gemm = false;
  cview<float> gelu_pre, dgelu_pre;
  bool dgelu_done = false;
  /// A residual's sum left to the layer after the residual (under bf16,
  /// where the branch's last layer takes residual_add). A sequential (or a
  /// repeat) sets sum_taken_after while it runs an element whose next
  /// element takes such a sum (takes_residual_sum: a layer_norm or an
  /// rms_norm, or a container that starts with one); the value at a container's start
  /// holds for its last element. The branch's last layer then computes its
  /// GEMM's product only and leaves the rest in pending_sum: y = add + (y +
  /// bias), each sum rounded, as the bias pass would store it. The layer
  /// after takes it in its own pass over the row (a norm's forward stores
  /// the sum in y and normalises it), and clears it; any other layer
  /// is preceded by the bias pass (run_forward), so a sum is never lost.
  bool sum_taken_after = false;
  struct residual_sum {
    float* y = nullptr;            ///< the product, (rows, cols); null: no sum pending
    const float* bias = nullptr;   ///< null: none
    const float* add = nullptr;    ///< the residual's input, (rows, cols)
    index_t rows = 0, cols = 0;
  } pending_sum;
  /// Inputs copied up to a device from host memory for this pass (the
  /// network and the executor set them): each device buffer and the host
  /// values it was copied from. A layer that checks values it is given (token
  /// ids, labels) reads them there (host_values) instead of reading the device
  /// back, which would make the host wait for the device.
  struct host_mirror {
    const void* device = nullptr;
    const void* host = nullptr;
    std::size_t bytes = 0;
  };
  std::array<host_mirror, 2> mirrors{};
  /// The host copy of `v`'s values, where `v` lies in a mirrored buffer; null otherwise.
  template <class T> const T* host_copy(cview<T> v) const noexcept {
    const auto* p = reinterpret_cast<const char*>(v.data());
    for (const auto& m : mirrors) {
      const auto* d = static_cast<const char*>(m.device);
      if (p && d && p >= d && p + v.bytes() <= d + m.bytes)
        return reinterpret_cast<const T*>(static_cast<const char*>(m.host) + (p - d));
    }
    return nullptr;
  }
  index_t rows() const noexcept { return batch * seq; }
};

/// The values of `v` readable by host code: the host copy it was uploaded from
/// (step_ctx::mirrors; no wait), or else `v` itself on the CPU, or else a copy
/// read back from the device into `keep` (the host waits for the device).
template <class T> cview<T> host_values(const step_ctx& c, cview<T> v, std::vector<std::remove_const_t<T>>& keep) {
  if (const T* h = c.host_copy(v)) return cview<T>(h, v.shape());
  return c.be.host_readable(v, keep);
}

/// Hands out consecutive slices of the flat parameter and gradient buffers.
class param_binder {
 public:
  struct slot {
    view<float> value;
    view<float> grad;
    index_t offset = 0;
  };
  param_binder(float* params, float* grads, index_t capacity)
      : params_(params), grads_(grads), capacity_(capacity) {}
  /// Storage that holds flat elements [start, capacity): params[0] is element `start`.
  param_binder(float* params, float* grads, index_t capacity, index_t start)
      : params_(params), grads_(grads), capacity_(capacity), offset_(start), start_(start) {}
  slot take(shape s) {
    const index_t n = s.numel();
    if (offset_ + n > capacity_)
      throw std::logic_error("whale::param_binder: layers asked for more parameters (" +
                             std::to_string(offset_ + n) + ") than were counted (" +
                             std::to_string(capacity_) + ")");
    const index_t at = offset_ - start_;
    slot r{view<float>(params_ ? params_ + at : nullptr, s), view<float>(grads_ ? grads_ + at : nullptr, s), offset_};
    offset_ += n;
    return r;
  }
  index_t offset() const noexcept { return offset_; }

  /// Tied parameters (tied_head): a token table of (rows, cols) bound at
  /// flat index `at`, and a head of (rows, cols) bound at `at` whose
  /// parameters copy the last such table bound before it by this binder
  /// (table -1: none was, or another head took it).
  struct tie {
    index_t table = -1, head = 0, count = 0;
    index_t rows = 0, cols = 0;
  };
  void note_table(index_t at, index_t rows, index_t cols) { tables_.push_back({at, at, rows * cols, rows, cols}); }
  void note_tied_head(index_t at, index_t rows, index_t cols) {
    index_t table = -1;
    for (auto t = tables_.rbegin(); t != tables_.rend() && table < 0; ++t)
      if (t->rows == rows && t->cols == cols) table = t->table;
    for (const auto& t : ties_)
      if (t.table == table) table = -1;
    ties_.push_back({table, at, rows * cols, rows, cols});
  }
  /// The ties of the layers bound so far (one binder over a whole model: all of them).
  const std::vector<tie>& ties() const noexcept { return ties_; }

 private:
  float* params_;
  float* grads_;
  index_t capacity_;
  index_t offset_ = 0;
  index_t start_ = 0;
  std::vector<tie> tables_, ties_;
};

namespace detail {
/// Tensor `t`, filled in host memory, moved into device backend `be`'s memory
/// as kind `k` (its values copied); nothing to do on the CPU or when empty.
inline void move_to(const backend_ref& be, tensor<float>& t, mem_kind k) {
  if (be.on_cpu() || t.capacity() == 0 || !t.on_host()) return;
  tensor<float> d;
  {
    const place_scope on(be.memory());
    d = tensor<float>(t.shape(), k);
  }
  be.copy(d.data(), t.data(), t.v().bytes());
  be.synchronize();
  t = std::move(d);
}
/// Flat parameters initialised in host memory, moved into device backend
/// `be`'s memory: the values copied, the gradients new (zero); the caller
/// binds its layers to the new buffers. Nothing to do on the CPU.
inline void place_params(const backend_ref& be, tensor<float>& params, tensor<float>& grads) {
  if (be.on_cpu()) return;
  move_to(be, params, mem_kind::params);
  const place_scope on(be.memory());
  grads = tensor<float>({params.numel()}, mem_kind::grads);
}

/// One activation slot a layer touched: `release(owner, slot)` drops its state.
struct slot_record {
  void* owner;
  int slot;
  void (*release)(void*, int);
};
/// While non-null, every slot a layer touches is appended here, so that
/// `recompute<Block>` (nn/recompute.hpp) can release its block's state after use.
inline std::vector<slot_record>*& slot_recorder() noexcept {
  static std::vector<slot_record>* r = nullptr;
  return r;
}
}  // namespace detail

/// Per-slot activation state of a layer (one per in-flight micro-batch).
template <class State>
class slots {
 public:
  State& operator()(int slot) {
    if (slot < 0) throw std::out_of_range("whale::slots: negative activation slot");
    if (static_cast<std::size_t>(slot) >= s_.size()) s_.resize(static_cast<std::size_t>(slot) + 1);
    if (auto* r = detail::slot_recorder()) r->push_back({this, slot, &release_one});
    return s_[static_cast<std::size_t>(slot)];
  }
  std::size_t size() const noexcept { return s_.size(); }
  /// Drop the state of `slot` (its buffers are freed; the next use reallocates them).
  void release(int slot) {
    if (slot >= 0 && static_cast<std::size_t>(slot) < s_.size()) s_[static_cast<std::size_t>(slot)] = State{};
  }

 private:
  static void release_one(void* self, int slot) { static_cast<slots*>(self)->release(slot); }
  std::vector<State> s_;
};

}  // namespace whale
