// The `Layer` concept and what every layer shares: the per-pass context
// (`step_ctx`), parameter binding into one flat buffer (`param_binder`),
// per-micro-batch activation slots, and constexpr cost metadata.
// Concrete layers live in their own headers beside this one.
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
  /// Called during backward when every gradient at flat offset >= `offset` is final.
  std::function<void(index_t offset)> grads_ready;
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

/// A layer: typed features, parameters bound into flat buffers, forward and
/// backward on row-major activations of shape (rows, features).
template <class L>
concept Layer = requires(L& l, step_ctx& c, param_binder& b, const counter_rng& r,
                         cview<typename L::input_type> x, cview<float> dy) {
  typename L::input_type;
  { L::in_features } -> std::convertible_to<index_t>;
  { L::out_features } -> std::convertible_to<index_t>;
  { L::cost() } -> std::same_as<cost_info>;
  { l.param_count() } -> std::convertible_to<index_t>;
  l.bind(b);
  l.init(r);
  { l.forward(c, x) } -> std::same_as<view<float>>;
  { l.backward(c, dy) } -> std::same_as<view<float>>;
};

/// Containers (sequential, repeat, residual, ...) declare `static constexpr
/// bool is_container = true`; everything else is a leaf layer.
template <class L> inline constexpr bool is_container = requires { requires L::is_container; };

/// What a loss compares its input with: `L::target_type` where it says
/// (float: regression targets, one per input feature), else std::int32_t
/// (class labels, one per row). Containers that end in a loss report their loss's.
template <class L> struct loss_target { using type = std::int32_t; };
template <class L>
  requires requires { typename L::target_type; }
struct loss_target<L> { using type = typename L::target_type; };
template <class L> using loss_target_t = typename loss_target<L>::type;
/// Targets per row a loss takes: `L::target_width` where it says
/// (any_features: one per feature of its input, whatever the width), else 1.
template <class L> constexpr index_t loss_target_width() {
  if constexpr (requires { L::target_width; }) return L::target_width;
  else return 1;
}

/// The label buffer: what travels from a data source to the loss, 4 bytes a
/// label, as class ids (std::int32_t) or as the bits of float targets. Plans
/// slice, copy and send it without reading it; only the loss reads it, as its
/// loss_target_t. A leaf loss's forward_loss takes `cview<loss_target_t<L>>`,
/// a container's the label buffer.
using label_buffer = cview<std::int32_t>;
template <class L> using loss_labels_t = std::conditional_t<is_container<L>, std::int32_t, loss_target_t<L>>;

namespace detail {
/// The label buffer holding `v`'s values (the same memory, the same shape).
template <class T> label_buffer label_bits(cview<T> v) noexcept {
  static_assert(sizeof(T) == sizeof(std::int32_t) && alignof(T) == alignof(std::int32_t),
                "whale: labels and targets are 4-byte values (std::int32_t class ids or float targets)");
  return label_buffer(reinterpret_cast<const std::int32_t*>(v.data()), v.shape());
}
/// The targets of type T a label buffer holds (the inverse of label_bits).
template <class T> cview<T> targets_of(label_buffer v) noexcept {
  static_assert(sizeof(T) == sizeof(std::int32_t) && alignof(T) == alignof(std::int32_t),
                "whale: labels and targets are 4-byte values (std::int32_t class ids or float targets)");
  return cview<T>(reinterpret_cast<const T*>(v.data()), v.shape());
}
}  // namespace detail

/// A loss: consumes logits and its targets (int32 class labels, or float
/// targets where L::target_type says), returns the loss summed over local rows
/// and divided by the global count, and produces d(logits).
template <class L>
concept Loss = requires(L& l, step_ctx& c, cview<typename L::input_type> x,
                        cview<loss_labels_t<L>> labels) {
  typename L::input_type;
  { L::in_features } -> std::convertible_to<index_t>;
  { L::cost() } -> std::same_as<cost_info>;
  { l.param_count() } -> std::convertible_to<index_t>;
  { l.forward_loss(c, x, labels) } -> std::convertible_to<double>;
  { l.backward_loss(c) } -> std::same_as<view<float>>;
};

/// A readable name for a layer type: L::name() when it has one.
template <class L> std::string layer_name() {
  if constexpr (requires { L::name(); }) return L::name();
  else return "layer";
}

/// Layers without parameters get these members by inheriting.
struct stateless_params {
  static constexpr index_t param_count() noexcept { return 0; }
  static void bind(param_binder&) noexcept {}
  static void init(const counter_rng&) noexcept {}
};

/// A leaf layer as plan hooks see it: its flat parameter range, and a way to
/// point its parameters and gradients at other storage (e.g. a ZeRO-3 gather buffer).
struct leaf_ref {
  index_t offset = 0;  ///< first flat parameter index
  index_t count = 0;   ///< parameter count
  void* layer = nullptr;
  void (*rebind_fn)(void*, float*, float*, index_t, index_t) = nullptr;
  /// Bind the layer's parameters to params[0, count) and gradients to grads[0, count).
  void rebind(float* params, float* grads) const { rebind_fn(layer, params, grads, offset, count); }
};
template <class L> leaf_ref make_leaf_ref(L& l, index_t offset) {
  leaf_ref r;
  r.offset = offset;
  r.count = l.param_count();
  r.layer = &l;
  r.rebind_fn = [](void* p, float* params, float* grads, index_t off, index_t n) {
    param_binder b(params, grads, off + n, off);
    static_cast<L*>(p)->bind(b);
  };
  return r;
}

/// What a plan may do around each leaf layer: gather parameters before use
/// (ZeRO-3), free them after, record a trace. Default: nothing.
struct layer_hooks {
  virtual ~layer_hooks() = default;
  virtual void before_forward(const leaf_ref&) {}
  virtual void after_forward(const leaf_ref&) {}
  virtual void before_backward(const leaf_ref&) {}
  virtual void after_backward(const leaf_ref&) {}
};

namespace detail {
/// --check-finite: the first NaN/Inf of `v` (what leaf `name` produced), as an error naming it.
inline void check_finite_values(cview<float> given, const std::string& name, const char* what, const step_ctx& c) {
  if (given.data() == nullptr) return;  // no input gradient asked for
  std::vector<float> host;  // the values on the host, when they are on a device
  const auto v = c.be.host_readable(given, host);
  for (index_t i = 0; i < v.numel(); ++i) {
    const float x = v[i];
    if (x - x != 0.f) {  // NaN or +-Inf
      const index_t w = v.shape().rank() == 2 ? v.shape()[1] : 1;
      throw std::runtime_error("whale: --check-finite: " + name + " produced " + (x != x ? "NaN" : "Inf") + " in its " +
                               what + " at row " + std::to_string(i / (w ? w : 1)) + ", column " +
                               std::to_string(i % (w ? w : 1)) + " (activation slot " + std::to_string(c.slot) +
                               "); the layers before it produced finite values, so it comes from this layer or, for a first layer, "
                               "from the input data");
    }
  }
}
}  // namespace detail

/// Whether layer L stores its forward output (`rounds_output`) or its input
/// gradient (`rounds_input_grad`) as bf16 mixed precision stores it by
/// itself: the kernel that writes it rounds (kernels::stored_as), or the
/// container returns what an element it ran gave. Then no rounding pass
/// follows. Default: no.
template <class L> constexpr bool rounds_output() {
  if constexpr (requires { L::rounds_output; }) return L::rounds_output;
  else return false;
}
template <class L> constexpr bool rounds_input_grad() {
  if constexpr (requires { L::rounds_input_grad; }) return L::rounds_input_grad;
  else return false;
}

/// Whether layer L, as the last layer of a residual branch, may add the
/// residual's input to its output (step_ctx::residual_add), or, as the first,
/// the residual's output gradient to its input gradient (residual_grad).
/// Whether layer L's backward reads its dy as bf16 would hold it (rounding
/// each value it reads; a stored value is unchanged): then the element
/// before it need not round its input gradient in a pass of its own.
template <class L> constexpr bool rounds_grad_on_read() {
  if constexpr (requires { L::rounds_grad_on_read; }) return L::rounds_grad_on_read;
  else return false;
}
/// Whether layer L's forward reads its input as bf16 would hold it (rounding
/// each value it reads; a stored value is unchanged): then the element
/// before it may leave its output unrounded (step_ctx::output_read_rounded).
template <class L> constexpr bool rounds_input_on_read() {
  if constexpr (requires { L::rounds_input_on_read; }) return L::rounds_input_on_read;
  else return false;
}
/// Whether layer L computes a `gelu` after it in its GEMM's call, and the
/// gradient of a `gelu` before it in its d(input) GEMM (step_ctx::gelu_in_gemm, dgelu_pre).
template <class L> constexpr bool fuses_gelu() {
  if constexpr (requires { L::fuses_gelu; }) return L::fuses_gelu;
  else return false;
}
/// Whether L is `gelu` (it takes what a fuses_gelu layer computed for it).
template <class L> constexpr bool is_gelu() {
  if constexpr (requires { L::is_gelu; }) return L::is_gelu;
  else return false;
}
/// Whether layer L's forward takes a residual's sum left pending by the
/// element before it (step_ctx::pending_sum) and stores it in its own pass.
template <class L> constexpr bool takes_residual_sum() {
  if constexpr (requires { L::takes_residual_sum; }) return L::takes_residual_sum;
  else return false;
}
/// Whether container L passes step_ctx::sum_taken_after on to the element
/// that ends it (sequential, repeat, residual). Any other container (e.g.
/// recompute<B>, which copies its block's output) runs with it cleared, so
/// that no sum is left pending inside it.
template <class L> constexpr bool carries_residual_sum() {
  if constexpr (requires { L::carries_residual_sum; }) return L::carries_residual_sum;
  else return false;
}
template <class L> constexpr bool accepts_residual_add() {
  if constexpr (requires { L::accepts_residual_add; }) return L::accepts_residual_add;
  else return false;
}
template <class L> constexpr bool accepts_residual_grad() {
  if constexpr (requires { L::accepts_residual_grad; }) return L::accepts_residual_grad;
  else return false;
}

namespace detail {
/// The residual's addend offered in `slot` (step_ctx::residual_add or
/// residual_grad), taken by a layer whose result has `n` elements: its data,
/// with the field cleared (the residual adds nothing then); null where none
/// is offered or its size differs (the residual then adds, or says why not).
inline const float* take_residual(cview<float>& slot, index_t n) noexcept {
  if (slot.data() == nullptr || slot.numel() != n) return nullptr;
  const float* p = slot.data();
  slot = {};
  return p;
}
/// A residual's sum left pending (step_ctx::pending_sum) stored by the bias
/// pass: for a layer that does not take it, before it runs.
inline void finish_residual_sum(step_ctx& c) {
  auto& p = c.pending_sum;
  if (!p.y) return;
  c.be.launch(p.rows, kernels::bias_rows{p.y, p.bias, p.cols, true, true, p.add});
  p = {};
}
/// Under bf16 mixed precision, a tensor as it would be stored: rounded to bf16
/// in place, unless what produced it rounded it already (`done`).
template <bool done = false> inline view<float> stored(const step_ctx& c, view<float> v) {
  if constexpr (!done)
    if (c.bf16 && v.data() && v.numel() > 0) c.be.launch(v.numel(), kernels::to_bf16{v.data()});
  return v;
}
/// y = x W^T + b, with x (R, In), W (Out, In) and y (R, Out). Under bf16
/// (`round`): the product, then the bias added in the pass that stores y
/// rounded (no rounding pass after). Otherwise: the product and the bias in
/// one GEMM call where the device's GEMM has a bias epilogue, or y = b and
/// then the product added (backend_ref::gemm_bias: the same values).
/// With `add` (a residual's input, bf16 only): y = x W^T + b + add, each sum
/// stored rounded, in the same pass. `b` null: no bias (y = x W^T, rounded
/// in the pass that adds `add` under bf16).
inline void affine_forward(const backend_ref& be, const float* x, const float* w, const float* b, float* y, index_t R,
                           index_t Out, index_t In, bool round, const float* add = nullptr) {
  if (round) {
    be.gemm(trans::no, trans::yes, R, Out, In, 1.f, x, w, 0.f, y);
    be.launch(R, kernels::bias_rows{y, b, Out, true, true, add});
  } else {
    be.gemm_bias(trans::no, trans::yes, R, Out, In, x, w, b, y);
  }
}
/// The same at a residual branch's end: with `add` (the residual's input,
/// under bf16) where the element after the residual takes the sum
/// (step_ctx::sum_taken_after), the product only, the bias and `add` left
/// to it (step_ctx::pending_sum): the values the bias pass would store.
inline void affine_forward(step_ctx& c, const float* x, const float* w, const float* b, float* y, index_t R, index_t Out,
                           index_t In, bool round, const float* add) {
  if (add && round && c.sum_taken_after) {
    c.be.gemm(trans::no, trans::yes, R, Out, In, 1.f, x, w, 0.f, y);
    c.pending_sum = {y, b, add, R, Out};
    return;
  }
  affine_forward(c.be, x, w, b, y, R, Out, In, round, add);
}
}  // namespace detail

/// Run element `l` (at flat offset `offset`) forward, with hooks around leaves.
template <class L, class X> view<float> run_forward(L& l, step_ctx& c, X x, index_t offset) {
  if constexpr (!takes_residual_sum<L>()) detail::finish_residual_sum(c);
  if constexpr (is_container<L> && !carries_residual_sum<L>()) c.sum_taken_after = false;
  if constexpr (is_container<L>) {
    return detail::stored<rounds_output<L>()>(c, l.forward(c, x));
  } else {
    if (!c.hooks && !c.check_finite) return detail::stored<rounds_output<L>()>(c, l.forward(c, x));
    const auto ref = make_leaf_ref(l, offset);
    if (c.hooks) c.hooks->before_forward(ref);
    auto y = detail::stored<rounds_output<L>()>(c, l.forward(c, x));
    if (c.hooks) c.hooks->after_forward(ref);
    if (c.check_finite) detail::check_finite_values(y, layer_name<L>(), "output", c);
    return y;
  }
}
/// Run element `l` backward, with hooks around leaves. `next_rounds`: the
/// element that reads the result rounds it as it reads (rounds_grad_on_read),
/// so no rounding pass follows a leaf's backward (where no hook or
/// finiteness check looks at the value between them).
template <bool next_rounds = false, class L> view<float> run_backward(L& l, step_ctx& c, cview<float> dy, index_t offset) {
  if constexpr (is_container<L>) {
    return detail::stored<rounds_input_grad<L>()>(c, l.backward(c, dy));
  } else {
    if (!c.hooks && !c.check_finite)
      return detail::stored<rounds_input_grad<L>() || next_rounds>(c, l.backward(c, dy));
    const auto ref = make_leaf_ref(l, offset);
    if (c.hooks) c.hooks->before_backward(ref);
    auto dx = detail::stored<rounds_input_grad<L>()>(c, l.backward(c, dy));
    if (c.hooks) c.hooks->after_backward(ref);
    if (c.check_finite) detail::check_finite_values(dx, layer_name<L>(), "input gradient", c);
    return dx;
  }
}
/// The loss's forward, with hooks when it is a leaf. `labels` is the label
/// buffer; a leaf loss sees it as its loss_target_t (class ids or float targets).
template <class L, class X>
double run_forward_loss(L& l, step_ctx& c, X x, label_buffer labels, index_t offset) {
  detail::finish_residual_sum(c);
  if constexpr (is_container<L>) {
    return l.forward_loss(c, x, labels);
  } else {
    const auto targets = detail::targets_of<loss_target_t<L>>(labels);
    if (!c.hooks) return l.forward_loss(c, x, targets);
    const auto ref = make_leaf_ref(l, offset);
    c.hooks->before_forward(ref);
    const double v = l.forward_loss(c, x, targets);
    c.hooks->after_forward(ref);
    return v;
  }
}
/// The loss's backward, with hooks when it is a leaf.
template <class L> view<float> run_backward_loss(L& l, step_ctx& c, index_t offset) {
  if constexpr (is_container<L>) {
    return detail::stored(c, l.backward_loss(c));
  } else {
    if (!c.hooks && !c.check_finite) return detail::stored<rounds_input_grad<L>()>(c, l.backward_loss(c));
    const auto ref = make_leaf_ref(l, offset);
    if (c.hooks) c.hooks->before_backward(ref);
    auto d = detail::stored<rounds_input_grad<L>()>(c, l.backward_loss(c));
    if (c.hooks) c.hooks->after_backward(ref);
    if (c.check_finite) detail::check_finite_values(d, layer_name<L>(), "input gradient", c);
    return d;
  }
}

/// Pass a plan's configuration (e.g. split degrees and communicators) to a
/// layer that takes it; layers without `configure` ignore it.
template <class L, class Env> void configure_layer(L& l, const Env& e) {
  if constexpr (requires { l.configure(e); }) l.configure(e);
}

/// What a parameter tensor is, for initialisation schemes (train/init.hpp).
enum class param_role : std::uint8_t {
  weight,  ///< a matrix multiplying the input (fan_in: its input width)
  bias,    ///< added to an output
  gain,    ///< a scale (e.g. layer_norm's), 1 at init
  table,   ///< rows looked up by index (embeddings)
};
/// One tensor of a layer's parameters; a layer with parameters lists them in
/// flat order with a static `param_tensors()` (their counts add up to its params).
/// `shape` describes its `count` floats as stored, row-major (a linear's
/// weight (Out, In)); whale's safetensors export writes each tensor with it
/// and refuses a layer whose tensors state none (rank 0).
struct param_tensor {
  const char* name = "";
  param_role role = param_role::weight;
  index_t count = 0;
  index_t fan_in = 0;
  whale::shape shape{};
};
/// Whether every tensor `L::param_tensors()` lists states a shape of its count.
template <class L> constexpr bool param_shapes_stated() {
  if constexpr (requires { L::param_tensors(); }) {
    for (const auto& t : L::param_tensors())
      if (t.shape.rank() == 0 || t.shape.numel() != t.count) return false;
    return true;
  } else {
    return false;
  }
}

/// Where a sharded layer's local parameters lie in the unsplit layer's: `count`
/// floats from `local` (its local flat order) are those at `full` (the unsplit
/// layer's flat order). `whole`: held whole by every rank of the split axis (a
/// row-parallel bias), so one of them is enough. Sharded forms report theirs
/// with a static `param_runs(rank, degree, out)`; checkpoints read and write by them.
struct param_run {
  index_t local = 0, full = 0, count = 0;
  bool whole = false;
};

/// Write the unsplit parameters of `l` to `full`, given its local parameters
/// at `local`. A layer that holds a shard gathers it (collectively) through
/// its `gather_full`; any other layer's local parameters are already the
/// unsplit ones, in the same order.
template <class L> void gather_full_params(L& l, const float* local, float* full) {
  if constexpr (requires { l.gather_full(local, full); }) l.gather_full(local, full);
  else if (const auto n = l.param_count(); n > 0) std::memcpy(full, local, static_cast<std::size_t>(n) * sizeof(float));
}

/// In a layer's backward: if the pass is split, put the weight gradients of
/// activation slot `c.slot` off to the W pass (the layer's
/// `weight_grads(be, slot, accumulate)`, from the state it keeps in that
/// slot, which stays alive until then) and return true; otherwise return false
/// and the layer computes them now.
template <class L> bool defer_weights(step_ctx& c, L* layer) {
  if (!c.deferred) return false;
  c.deferred->push_back({layer, c.be, c.slot, [](void* o, const backend_ref& be, int slot, bool acc) {
                           static_cast<L*>(o)->weight_grads(be, slot, acc);
                         }});
  return true;
}
/// The W pass: run the put-off weight gradients (in the order they were put off).
inline void run_weight_tasks(const std::vector<weight_task>& tasks, bool accumulate) {
  for (const auto& t : tasks) t.run(t.owner, t.be, t.slot, accumulate);
}

namespace detail {
/// Ensure a slot buffer has shape s (reallocates only when it grows).
template <class T> view<T> ensure(tensor<T>& t, shape s, mem_kind k = mem_kind::activations) {
  if (t.capacity() == 0) t.set_kind(k);
  t.resize(s);
  return t.v();
}
/// A loss layer's share of the global mean from its R rows' losses (doubles in
/// the backend's memory) times `inv`: added where they lie, in one order on
/// every backend, into step_ctx::loss_sum where it is set (returning 0: the
/// host reads nothing), or into `total` (one double the layer keeps) and read back.
inline double loss_share(const step_ctx& c, index_t R, const double* row_loss, double inv, tensor<double>& total) {
  if (c.loss_sum) {
    c.be.sum_into(R, row_loss, inv, c.loss_sum, true);
    return 0.0;
  }
  auto t = ensure(total, {1});
  c.be.sum_into(R, row_loss, inv, t.data(), false);
  std::vector<double> host;
  return c.be.host_readable(cview<double>(t), host)[0];
}
}  // namespace detail

}  // namespace whale
