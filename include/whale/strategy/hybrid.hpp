// The runtime of plans with `split` regions (possibly beside `replicate`) on a
// data × model mesh: the batch is split over the data axis, split layers hold
// their shard and run the collectives their layouts need, and the gradients
// of every parameter that saw only this rank's rows are summed over the data
// axis in buckets during backward. Also which parameters of a split plan each
// rank counts in the global gradient norm (detail::param_pieces).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/network.hpp"
#include "whale/strategy/data_parallel.hpp"
#include "whale/strategy/grad_sync.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

namespace detail {
/// The axis of a split region (split<M, A> and the chains inside it).
template <axis A, lay In, exit_kind X, lay XL, stream_kind S, class... E>
constexpr axis region_axis_of(const split_chain<A, In, X, XL, S, E...>*) {
  return A;
}
template <class T>
concept split_region_like = requires { detail::region_axis_of(static_cast<const T*>(nullptr)); };

/// Named in the compiler's error when a leaf has a split dimension but does
/// not say which of its parameters are divided among the ranks.
template <class Leaf> struct show_sharded_leaf_without_split_params {
  static_assert(!requires { Leaf::split_extent; },
                "whale::split: this layer is sharded (it has split_extent) but does not declare split_params and "
                "replicated_params, which the gradient norm needs to count each parameter once; declare them "
                "(split_layers.hpp) for the layer named in 'show_sharded_leaf_without_split_params<Leaf>'");
  static constexpr bool value = true;
};

inline void add_piece(std::vector<param_piece>& out, index_t count, axes shared) {
  if (count == 0) return;
  if (!out.empty() && out.back().shared == shared) out.back().count += count;
  else out.push_back({count, shared});
}

/// The pieces of T's flat parameters in binding order (as T::bind takes
/// them), on a mesh of `sizes`, inside a split region over axis `Region` (-1:
/// none). A sharded leaf holds its split_params / degree, shared by the axes
/// other than the region's, then its replicated_params (bound last: a
/// row-parallel bias, head attention's output bias), shared by data and model
/// as every other parameter is.
template <class T, int Region>
void param_pieces(std::vector<param_piece>& out, const std::array<int, axis_count>& sizes) {
  constexpr axes both = axis::data | axis::model;
  if constexpr (requires { T::split_params; T::replicated_params; }) {
    static_assert(Region >= 0,
                  "whale::split: a sharded layer (one with split_params) outside a split region; sharded layers "
                  "are made by split<...> from the layer they shard: write split<layer> instead");
    constexpr axes shard_shared = Region == static_cast<int>(axis::data) ? axes(axis::model) : axes(axis::data);
    add_piece(out, T::split_params / sizes[static_cast<std::size_t>(Region)], shard_shared);
    add_piece(out, T::replicated_params, both);
  } else if constexpr (requires { typename T::chain_type; }) {  // split_residual
    param_pieces<typename T::chain_type, Region>(out, sizes);
  } else if constexpr (split_region_like<T>) {
    constexpr int a = static_cast<int>(region_axis_of(static_cast<const T*>(nullptr)));
    [&]<class... E>(std::tuple<E...>*) { (param_pieces<E, a>(out, sizes), ...); }(static_cast<typename T::tuple_type*>(nullptr));
  } else if constexpr (requires { typename T::tuple_type; }) {  // sequential, replicate<sequential>
    [&]<class... E>(std::tuple<E...>*) { (param_pieces<E, Region>(out, sizes), ...); }(
        static_cast<typename T::tuple_type*>(nullptr));
  } else if constexpr (requires { typename T::block_type; T::count; }) {  // repeat
    for (std::size_t i = 0; i < T::count; ++i) param_pieces<typename T::block_type, Region>(out, sizes);
  } else if constexpr (requires { typename T::block_type; }) {  // recompute
    param_pieces<typename T::block_type, Region>(out, sizes);
  } else if constexpr (requires { typename T::inner_type; }) {  // residual
    param_pieces<typename T::inner_type, Region>(out, sizes);
  } else if constexpr (requires { typename T::inner; }) {  // replicate of a leaf
    param_pieces<typename T::inner, Region>(out, sizes);
  } else {
    static_assert(show_sharded_leaf_without_split_params<T>::value);
    add_piece(out, T::cost().params, both);
  }
}

/// The flat ranges [begin, end) of model T laid out from `offset` that this
/// rank counts in the global gradient norm (see counted_ranges); throws if the
/// pieces do not add up to `local_count`, this rank's parameters of T.
template <class T>
void add_counted_ranges(flat_ranges& out, index_t offset, index_t local_count, const mesh& m, const std::string& who) {
  std::vector<param_piece> pieces;
  const std::array<int, axis_count> sizes{m.size(axis::data), m.size(axis::pipe), m.size(axis::model)};
  param_pieces<T, -1>(pieces, sizes);
  const index_t end = counted_ranges(out, pieces, offset, m.coords());
  if (end - offset != local_count)
    throw std::logic_error(who + ": the gradient norm counts " + std::to_string(end - offset) + " parameters of " +
                           layer_name<T>() + ", but this rank holds " + std::to_string(local_count));
}
}  // namespace detail

/// A model with split regions, trained on `ctx.mesh()` (data × model).
template <class M>
class hybrid_parallel {
  static_assert(contains_split<M>(), "whale::hybrid_parallel: the model has no split region; use replicate");

 public:
  using model_type = M;
  using input_type = typename M::input_type;

  hybrid_parallel(const context& ctx, seed s, dp_options o = dp_options::from_env())
      : ctx_(&ctx), data_(&ctx.mesh().comm(axis::data)), model_(&ctx.mesh().comm(axis::model)),
        net_(s, [&](M& m) { configure_layer(m, env()); }), o_(o) {
    const auto& shape = ctx.mesh().shape();
    if (shape.size(axis::pipe) != 1)
      throw std::invalid_argument("whale::split: this plan uses the data and model axes, but the mesh is " +
                                  shape.spec() + "; launch with --mesh data=D,model=M");
    sync_ = detail::complement(no_sync_, net_.param_count());
    // Parameters replicated over the data axis start equal: rank 0 of each data group wins.
    // (Shards split over the data axis differ by design and are left alone.)
    for (auto [b, e] : sync_) broadcast(*data_, net_.params().rows(b, e - b), 0);
    const auto per = std::max<index_t>(1, static_cast<index_t>(o_.bucket_mib * 1048576.0 / sizeof(float)));
    buckets_.plan(sync_, per, o_.blocking);
    detail::add_counted_ranges<M>(counted_, 0, net_.param_count(), ctx.mesh(), "whale::split");
  }
  hybrid_parallel(const hybrid_parallel&) = delete;
  hybrid_parallel& operator=(const hybrid_parallel&) = delete;

  // ---- Trainable ----
  std::pair<index_t, index_t> local_batch(index_t global_batch) const {
    if (global_batch < data_->size())
      throw std::invalid_argument("whale::split: the global batch (" + std::to_string(global_batch) +
                                  ") is smaller than the data-parallel degree (" + std::to_string(data_->size()) + ")");
    return even_slice(global_batch, data_->size(), data_->rank());
  }
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    buckets_.start_step();
    const bool comm = data_->size() > 1;
    if (o_.overlap && comm)
      c.grads_ready = [this](index_t offset) { buckets_.ready(*data_, net_.grads().data(), offset); };
    const double share = net_.train_step(c, x, labels);
    c.grads_ready = nullptr;
    if (comm) buckets_.finish(*data_, net_.grads().data());
    return share;
  }
  double reduce_loss(double share) {
    double v = share;
    all_reduce(*data_, view<double>(&v, {1}));
    return v;
  }
  /// The norm of the whole model's gradient, the same on every rank: shards'
  /// squares summed over their axis, replicated parameters counted once
  /// (collective: one all-reduce of one double over the mesh).
  double grad_norm() const {
    return detail::global_grad_norm(net_.grads().data(), 0, counted_, &ctx_->world());
  }
  int rank() const noexcept { return ctx_->rank(); }
  int world_size() const noexcept { return ctx_->size(); }
  template <class O> typename O::state make_optimizer_state(const O& opt) const { return net_.make_optimizer_state(opt); }
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, float grad_scale) {
    net_.apply_optimizer(opt, s, grad_scale);
  }

  network<M>& local() noexcept { return net_; }
  view<float> params() const noexcept { return net_.params(); }
  index_t param_count() const noexcept { return net_.param_count(); }
  /// The unsplit parameters (as network<unsplit model> would hold them),
  /// gathered from the shards; collective: every rank calls it.
  tensor<float> full_params() {
    tensor<float> full({M::cost().params}, mem_kind::workspace);
    gather_full_params(net_.model(), net_.params().data(), full.data());
    return full;
  }
  /// Flat ranges whose gradients are summed over the data axis.
  const std::vector<std::pair<index_t, index_t>>& synced_ranges() const noexcept { return sync_; }

  friend std::ostream& operator<<(std::ostream& os, const hybrid_parallel& h) {
    index_t synced = 0;
    for (auto [b, e] : h.sync_) synced += e - b;
    os << "plan: " << layer_name<M>() << "\n  mesh " << h.ctx_->mesh().shape() << "; rank " << h.rank()
       << " holds " << h.net_.param_count() << " parameters, " << synced
       << " of them all-reduced over data in " << h.buckets_.size() << " bucket(s)\n";
    M::print_structure(os, 2, M::in_features);
    return os;
  }

 private:
  split_env env() {
    split_env e;
    e.data = data_;
    e.model = model_;
    e.no_data_sync = &no_sync_;
    return e;
  }
  const context* ctx_;
  world_comm* data_;
  world_comm* model_;
  std::vector<std::pair<index_t, index_t>> no_sync_;  // filled while the network binds
  network<M> net_;
  dp_options o_;
  std::vector<std::pair<index_t, index_t>> sync_;
  detail::flat_ranges counted_;  // what this rank adds to the gradient norm
  detail::grad_buckets buckets_;
};

}  // namespace whale
