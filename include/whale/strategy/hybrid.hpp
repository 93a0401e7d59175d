// The runtime of plans with `split` regions (possibly beside `replicate`) on a
// data × model mesh: the batch is split over the data axis, split layers hold
// their shard and run the collectives their layouts need, and the gradients
// of every parameter that saw only this rank's rows are summed over the data
// axis in buckets during backward.
#pragma once

#include <cmath>
#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/network.hpp"
#include "whale/strategy/data_parallel.hpp"
#include "whale/strategy/grad_sync.hpp"
#include "whale/strategy/split.hpp"

namespace whale {

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
  double grad_norm() const {
    throw std::invalid_argument(
        "whale::split: gradient clipping (max_grad_norm) is not supported with split plans yet; train without it");
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
  detail::grad_buckets buckets_;
};

}  // namespace whale
