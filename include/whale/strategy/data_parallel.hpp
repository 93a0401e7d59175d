// The runtime of `replicate<M>`: data parallelism over the mesh's `data` axis.
// Each rank holds all of M's parameters, feeds its rows of the global batch,
// and sums gradients with bucketed all-reduces issued during backward as soon
// as a bucket's last gradient is final (blocking by default, see dp_options).
// Also the model-independent part of every plan's global gradient norm
// (detail::global_grad_norm). No layouts here.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/backend/cpu.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/network.hpp"
#include "whale/strategy/grad_sync.hpp"
#include "whale/strategy/replicate.hpp"

namespace whale {

/// Options of data parallelism, as DDP users expect them.
struct dp_options {
  double bucket_mib = 25.0;  ///< gradient bucket size (MiB); WHALE_BUCKET_MIB overrides the default
  bool overlap = true;       ///< reduce buckets during backward; false: all after backward
  /// Each bucket in one blocking all-reduce as soon as it is ready (true), or in
  /// a non-blocking one started then and waited for after backward (false;
  /// WHALE_DP_BLOCKING=0; for transports that progress on their own).
  /// Blocking is the default because on the CPU backend nothing runs a
  /// non-blocking all-reduce while backward keeps every core busy (MPI progresses
  /// only inside MPI calls), and Open MPI's blocking algorithms are ~2.7x faster
  /// than its non-blocking ones at 25 MiB (docs/bench.md). A bucket reduced right
  /// after backward wrote it is still in cache.
  bool blocking = true;
  static dp_options from_env() {
    dp_options o;
    if (const char* e = std::getenv("WHALE_BUCKET_MIB")) o.bucket_mib = std::atof(e);
    if (const char* e = std::getenv("WHALE_DP_OVERLAP")) o.overlap = std::string(e) != "0";
    if (const char* e = std::getenv("WHALE_DP_BLOCKING")) o.blocking = std::string(e) != "0";
    return o;
  }
};

/// Rows [begin, begin + count) of a global batch of `global` rows that part
/// `part` of `parts` feeds: as even as possible, the first global % parts get one more.
inline std::pair<index_t, index_t> even_slice(index_t global, int parts, int part) {
  const index_t q = global / parts, r = global % parts;
  const index_t begin = part * q + std::min<index_t>(part, r);
  return {begin, q + (part < r ? 1 : 0)};
}

namespace detail {
/// A run of flat parameters, in binding order: `count` of them, held as the
/// same copy by the ranks that differ only along the axes `shared` (after the
/// data-parallel sum, a gradient replicated over data is such a copy; a shard
/// of a split layer is shared by the one of data and model it is not split over).
struct param_piece {
  index_t count = 0;
  axes shared;
};
using flat_ranges = std::vector<std::pair<index_t, index_t>>;

/// Append to `out` the ranges that this rank counts in the global gradient
/// norm, of `pieces` laid out from flat offset `offset` on: a piece is counted
/// by the rank at coordinate 0 of every axis that shares it, so that summing
/// over the world counts each parameter once. Returns the offset after them.
inline index_t counted_ranges(flat_ranges& out, const std::vector<param_piece>& pieces, index_t offset,
                              const std::array<int, axis_count>& coords) {
  for (const auto& p : pieces) {
    bool mine = p.count > 0;
    for (axis a : all_axes)
      if (p.shared.contains(a) && coords[static_cast<std::size_t>(a)] != 0) mine = false;
    if (mine) {
      if (!out.empty() && out.back().second == offset) out.back().second += p.count;
      else out.push_back({offset, offset + p.count});
    }
    offset += p.count;
  }
  return offset;
}

/// The norm of the whole model's gradient: the squares of this rank's
/// gradients over its counted ranges (flat offsets; grads[0] is offset `base`),
/// summed over `comm` (null: this rank holds the whole model) in one
/// all-reduce of one double. Collective over `comm`.
inline double global_grad_norm(const float* grads, index_t base, const flat_ranges& counted, world_comm* comm) {
  double sq = 0;
  for (auto [b, e] : counted) sq += cpu::sum_squares(e - b, grads + (b - base));
  if (comm && comm->size() > 1) all_reduce(*comm, view<double>(&sq, {1}));
  return std::sqrt(sq);
}
}  // namespace detail

/// A network trained with data parallelism over `ctx.mesh()`'s data axis.
template <class M>
class data_parallel {
  static_assert(is_replicate_v<M>,
                "whale::data_parallel: the model must be replicate<...> (data parallel); wrap it "
                "in whale::replicate");

 public:
  using model_type = M;
  using input_type = typename M::input_type;

  data_parallel(const context& ctx, seed s, dp_options o = dp_options::from_env())
      : ctx_(&ctx), comm_(&ctx.mesh().comm(axis::data)), net_(s), o_(o) {
    const auto& shape = ctx.mesh().shape();
    if (shape.size(axis::pipe) != 1 || shape.size(axis::model) != 1)
      throw std::invalid_argument(
          "whale::replicate: this plan uses only the data axis, but the mesh is " + shape.spec() +
          "; launch with --mesh data=" + std::to_string(ctx.size()) +
          " (or add split/pipeline strategies that use the other axes)");
    if (o_.bucket_mib <= 0)
      throw std::invalid_argument("whale::replicate: bucket size must be positive (got " +
                                  std::to_string(o_.bucket_mib) + " MiB)");
    // Identical start on every rank: rank 0's parameters win.
    broadcast(*comm_, net_.params(), 0);
    const auto per = std::max<index_t>(1, static_cast<index_t>(o_.bucket_mib * 1048576.0 / sizeof(float)));
    buckets_.plan({{0, net_.param_count()}}, per, o_.blocking);
  }
  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;

  // ---- Trainable ----
  std::pair<index_t, index_t> local_batch(index_t global_batch) const {
    if (global_batch < comm_->size())
      throw std::invalid_argument("whale::replicate: the global batch (" + std::to_string(global_batch) +
                                  ") is smaller than the data-parallel degree (" +
                                  std::to_string(comm_->size()) + "); every rank needs at least one sample");
    return even_slice(global_batch, comm_->size(), comm_->rank());
  }

  /// Forward and backward on this rank's rows; gradients summed over the data
  /// axis when it returns. Returns this rank's share of the loss.
  double train_step(step_ctx& c, cview<input_type> x, cview<std::int32_t> labels) {
    buckets_.start_step();
    const bool comm = comm_->size() > 1;
    if (o_.overlap && comm)
      c.grads_ready = [this](index_t offset) { buckets_.ready(*comm_, net_.grads().data(), offset); };
    const double share = net_.train_step(c, x, labels);
    c.grads_ready = nullptr;
    if (comm) buckets_.finish(*comm_, net_.grads().data());  // what is left, then wait for all
    return share;
  }
  double reduce_loss(double share) {
    double v = share;
    all_reduce(*comm_, view<double>(&v, {1}));
    return v;
  }
  /// Gradients are identical on every rank after the all-reduce: a local norm.
  double grad_norm() const { return net_.grad_norm(); }
  int rank() const noexcept { return ctx_->rank(); }
  int world_size() const noexcept { return ctx_->size(); }
  template <class O> typename O::state make_optimizer_state(const O& opt) const {
    return net_.make_optimizer_state(opt);
  }
  template <class O> void apply_optimizer(const O& opt, typename O::state& s, float grad_scale) {
    net_.apply_optimizer(opt, s, grad_scale);
  }

  network<M>& local() noexcept { return net_; }
  view<float> params() const noexcept { return net_.params(); }
  view<float> grads() const noexcept { return net_.grads(); }
  index_t param_count() const noexcept { return net_.param_count(); }
  std::size_t bucket_count() const noexcept { return buckets_.size(); }
  const dp_options& options() const noexcept { return o_; }

  friend std::ostream& operator<<(std::ostream& os, const data_parallel& d) {
    os << "plan: " << layer_name<M>() << " over " << d.ctx_->mesh().shape() << "\n"
       << "  data parallel: batch split<0> over data:" << d.comm_->size()
       << ", gradients all-reduced in " << d.buckets_.size() << " bucket(s) of <= "
       << d.o_.bucket_mib << " MiB" << (d.o_.blocking ? " (blocking)" : " (non-blocking)")
       << (d.o_.overlap ? ", during backward" : ", after backward") << "\n"
       << d.net_;
    return os;
  }

 private:
  const context* ctx_;
  world_comm* comm_;
  network<M> net_;
  dp_options o_;
  detail::grad_buckets buckets_;
};

}  // namespace whale
