// The `Layer` and `Loss` concepts and what they name: layer hooks, leaf
// references, parameter roles and shapes, deferred weight-gradient tasks and
// the per-plan configuration hook. Part of nn/layer.hpp.
#pragma once

#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "whale/nn/context.hpp"

namespace whale {

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
