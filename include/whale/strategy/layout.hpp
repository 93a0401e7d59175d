// Activation layouts along one mesh axis, and the collective that converts
// one into another (forward), with its dual for gradients (backward).
// `convert<...>` is the parameter-free layer a split region inserts between
// two layers whose layouts differ. The split layers are in split_layers.hpp.
#pragma once

#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/backend/kernels/rows.hpp"
#include "whale/comm/collectives.hpp"
#include "whale/comm/staging.hpp"
#include "whale/comm/context.hpp"
#include "whale/nn/layer.hpp"

namespace whale {

/// Layout of an activation (rows, features) along one mesh axis.
///   R  replicated: every rank of the axis holds all of it
///   S0 split<0>:   each rank holds a slice of the rows (the batch)
///   S1 split<1>:   each rank holds a slice of the features (columns)
///   P  partial:    each rank holds a summand of the whole
enum class layout_kind : int { R, S0, S1, P };

constexpr const char* layout_kind_name(layout_kind l) {
  switch (l) {
    case layout_kind::R: return "replicated";
    case layout_kind::S0: return "split<0>";
    case layout_kind::S1: return "split<1>";
    case layout_kind::P: return "partial";
  }
  return "?";
}
constexpr const char* axis_name(axis a) {
  return a == axis::data ? "data" : a == axis::pipe ? "pipe" : "model";
}

/// The collective that turns layout `From` into `To` along an axis.
enum class conv_op : int { none, all_reduce, gather_rows, gather_cols, reduce_scatter_rows, reduce_scatter_cols,
                        slice_rows, slice_cols, impossible };

constexpr conv_op conversion(layout_kind from, layout_kind to) {
  if (from == to) return conv_op::none;
  switch (to) {
    case layout_kind::R:
      return from == layout_kind::P ? conv_op::all_reduce : from == layout_kind::S0 ? conv_op::gather_rows : conv_op::gather_cols;
    case layout_kind::S0:
      return from == layout_kind::R ? conv_op::slice_rows : from == layout_kind::P ? conv_op::reduce_scatter_rows : conv_op::impossible;
    case layout_kind::S1:
      return from == layout_kind::R ? conv_op::slice_cols : from == layout_kind::P ? conv_op::reduce_scatter_cols : conv_op::impossible;
    case layout_kind::P:
      return conv_op::impossible;  // nothing produces a summand from a whole
  }
  return conv_op::impossible;
}
constexpr const char* coll_name(conv_op c) {
  switch (c) {
    case conv_op::none: return "none";
    case conv_op::all_reduce: return "all-reduce";
    case conv_op::gather_rows: return "all-gather(rows)";
    case conv_op::gather_cols: return "all-gather(columns)";
    case conv_op::reduce_scatter_rows: return "reduce-scatter(rows)";
    case conv_op::reduce_scatter_cols: return "reduce-scatter(columns)";
    case conv_op::slice_rows: return "slice(rows)";
    case conv_op::slice_cols: return "slice(columns)";
    case conv_op::impossible: return "impossible";
  }
  return "?";
}
/// On the data axis, S0 holds this rank's rows of the batch; every other
/// layout holds all rows of the global batch.
constexpr bool local_rows(axis a, layout_kind l) { return a != axis::data || l == layout_kind::S0; }

/// Named in the compiler's error when no single collective converts the
/// layout `From` that Producer makes into the layout `To` that Consumer needs.
template <class Producer, class Consumer, axis A, layout_kind From, layout_kind To>
struct show_conflicting_layouts {
  static_assert(conversion(From, To) != conv_op::impossible,
                "whale::split: no collective converts the layout the first layer produces into the "
                "one the second needs on this mesh axis (e.g. batch-split rows into class-split "
                "columns would need an all-to-all); both layers and layouts are named in "
                "'show_conflicting_layouts<Producer, Consumer, axis, from, to>' in the compiler's "
                "notes. Put a layer that needs replicated input between them, or split both over "
                "the same layout");
  static constexpr bool value = true;
};

/// The runtime of the split plans: the communicators of the mesh axes and
/// the flat parameter ranges whose gradients are NOT summed over the data axis.
struct split_env {
  world_comm* data = nullptr;
  world_comm* model = nullptr;
  std::vector<std::pair<index_t, index_t>>* no_data_sync = nullptr;
  /// On a device: the communicators that take its buffers (null: host copies around data / model).
  device_comm* data_device = nullptr;
  device_comm* model_device = nullptr;
  world_comm& comm(axis a) const {
    world_comm* c = a == axis::data ? data : model;
    if (!c) throw std::logic_error("whale::split: the plan was not configured with a mesh");
    return *c;
  }
  device_comm* device(axis a) const noexcept { return a == axis::data ? data_device : model_device; }
};

namespace detail {
/// Rows of the global batch held by rank `r` of `p` when the batch is split<0>.
inline index_t rows_of(index_t global_seqs, index_t seq, int p, int r) {
  const index_t q = global_seqs / p, rem = global_seqs % p;
  return (q + (r < rem ? 1 : 0)) * seq;
}

/// Apply collective `k` to x (rows_in, w_in) along `c`, into `out`; returns
/// the output view. `rows_local`/`rows_global` describe the data-axis batch.
/// x, out and tmp are in `be`'s memory; on a device `dc` takes them (null:
/// `host` stages the collectives over `c`).
inline view<float> apply_collective(conv_op k, world_comm& c, device_comm* dc, const backend_ref& be, cview<float> x,
                                    index_t rows_in,
                                    index_t rows_out, tensor<float>& out, tensor<float>& tmp, tensor<float>& host,
                                    std::vector<index_t>& counts, index_t global_seqs, index_t seq) {
  const int p = c.size(), r = c.rank();
  const index_t w_in = rows_in ? x.numel() / rows_in : 0;
  auto row_counts = [&] {
    counts.resize(static_cast<std::size_t>(p));
    for (int i = 0; i < p; ++i) counts[static_cast<std::size_t>(i)] = rows_of(global_seqs, seq, p, i) * w_in;
    return std::span<const index_t>(counts);
  };
  switch (k) {
    case conv_op::none:
      return view<float>(const_cast<float*>(x.data()), x.shape());
    case conv_op::all_reduce: {
      auto y = detail::ensure(out, {rows_out, w_in});
      be.copy(y.data(), x.data(), x.bytes());
      collective_in(be, c, dc, host, y.data(), y.numel(), y.data(), y.numel(),
                    [&](auto& cm, const float*, float* h) { all_reduce(cm, view<float>(h, {y.numel()})); });
      return y;
    }
    case conv_op::gather_rows: {
      const auto n = row_counts();
      auto y = detail::ensure(out, {rows_out, w_in});
      collective_in(be, c, dc, host, x.data(), x.numel(), y.data(), y.numel(), [&](auto& cm, const float* i, float* o) {
        all_gather_v(cm, cview<float>(i, {x.numel()}), view<float>(o, {y.numel()}), n);
      });
      return y;
    }
    case conv_op::reduce_scatter_rows: {
      const auto n = row_counts();
      auto y = detail::ensure(out, {rows_out, w_in});
      collective_in(be, c, dc, host, x.data(), x.numel(), y.data(), y.numel(), [&](auto& cm, const float* i, float* o) {
        reduce_scatter_v(cm, cview<float>(i, {x.numel()}), view<float>(o, {y.numel()}), n);
      });
      return y;
    }
    case conv_op::slice_rows: {
      index_t begin = 0;
      for (int i = 0; i < r; ++i) begin += rows_of(global_seqs, seq, p, i);
      auto y = detail::ensure(out, {rows_out, w_in});
      be.copy(y.data(), x.data() + begin * w_in, static_cast<std::size_t>(rows_out * w_in) * sizeof(float));
      return y;
    }
    case conv_op::gather_cols: {  // (rows, w) on each rank -> (rows, p*w)
      const index_t w = w_in;
      auto t = detail::ensure(tmp, {p * rows_in * w}, mem_kind::comm);
      collective_in(be, c, dc, host, x.data(), x.numel(), t.data(), t.numel(), [&](auto& cm, const float* i, float* o) {
        all_gather(cm, cview<float>(i, {x.numel()}), view<float>(o, {t.numel()}));
      });
      auto y = detail::ensure(out, {rows_in, p * w});
      for (int k2 = 0; k2 < p; ++k2)  // rank k2's block of rows: columns [k2 w, k2 w + w)
        be.launch(rows_in, kernels::copy_cols{t.data() + k2 * rows_in * w, w, y.data() + k2 * w, p * w, w});
      return y;
    }
    case conv_op::reduce_scatter_cols: {  // (rows, W) summands -> (rows, W/p) sums
      const index_t w = w_in / p;
      auto t = detail::ensure(tmp, {p * rows_in * w}, mem_kind::comm);
      for (int k2 = 0; k2 < p; ++k2)  // columns [k2 w, k2 w + w) as rank k2's block of rows
        be.launch(rows_in, kernels::copy_cols{x.data() + k2 * w, w_in, t.data() + k2 * rows_in * w, w, w});
      auto y = detail::ensure(out, {rows_in, w});
      collective_in(be, c, dc, host, t.data(), t.numel(), y.data(), y.numel(), [&](auto& cm, const float* i, float* o) {
        reduce_scatter(cm, cview<float>(i, {t.numel()}), view<float>(o, {y.numel()}));
      });
      return y;
    }
    case conv_op::slice_cols: {
      const index_t w = w_in / p;
      auto y = detail::ensure(out, {rows_in, w});
      be.launch(rows_in, kernels::copy_cols{x.data() + r * w, w_in, y.data(), w, w});
      return y;
    }
    case conv_op::impossible:
      break;
  }
  throw std::logic_error("whale::split: impossible layout conversion reached at run time");
}
}  // namespace detail

/// The layer a split region inserts where layouts differ on axis A: forward
/// converts From -> To, backward converts the consumer's gradient layout
/// GFrom into the producer's GTo (the dual: all-gather <-> reduce-scatter,
/// all-reduce <-> identity, slice <-> all-gather).
template <axis A, layout_kind From, layout_kind To, layout_kind GFrom, layout_kind GTo>
class convert : public stateless_params {
 public:
  static constexpr conv_op fwd_coll = conversion(From, To);
  static constexpr conv_op bwd_coll = conversion(GFrom, GTo);
  static constexpr axis on_axis = A;  ///< the mesh axis it converts along
  static constexpr layout_kind from = From, to = To, grad_from = GFrom, grad_to = GTo;
  static_assert(fwd_coll != conv_op::impossible && bwd_coll != conv_op::impossible,
                "whale::convert: no collective converts these layouts");
  using input_type = float;
  static constexpr index_t in_features = any_features;
  static constexpr index_t out_features = any_features;
  static std::string name() {
    return std::string("[") + coll_name(fwd_coll) + " over " + axis_name(A) + ": " + layout_kind_name(From) + " -> " +
           layout_kind_name(To) + "; backward " + coll_name(bwd_coll) + "]";
  }
  static constexpr cost_info cost() { return {}; }

  void configure(const split_env& e) {
    comm_ = &e.comm(A);
    dev_ = e.device(A);
  }

  view<float> forward(step_ctx& c, cview<float> x) {
    auto& s = st_(c.slot);
    const index_t gseq = c.global_rows / c.seq;
    const index_t rows_in = c.rows();
    if constexpr (!local_rows(A, From) && local_rows(A, To)) c.batch = detail::rows_of(gseq, c.seq, comm_->size(), comm_->rank()) / c.seq;
    if constexpr (local_rows(A, From) && !local_rows(A, To)) c.batch = gseq;
    return detail::apply_collective(fwd_coll, *comm_, dev_, c.be, x, rows_in, c.rows(), s.y, s.tmp, s.host, s.counts, gseq,
                                    c.seq);
  }
  view<float> backward(step_ctx& c, cview<float> dy) {
    auto& s = st_(c.slot);
    const index_t gseq = c.global_rows / c.seq;
    const index_t rows_in = c.rows();
    // the gradient goes from the consumer's batch layout back to the producer's
    if constexpr (!local_rows(A, To) && local_rows(A, From)) c.batch = detail::rows_of(gseq, c.seq, comm_->size(), comm_->rank()) / c.seq;
    if constexpr (local_rows(A, To) && !local_rows(A, From)) c.batch = gseq;
    return detail::apply_collective(bwd_coll, *comm_, dev_, c.be, dy, rows_in, c.rows(), s.dx, s.tmp, s.host, s.counts, gseq,
                                    c.seq);
  }

 private:
  struct state {
    tensor<float> y, dx, tmp;
    tensor<float> host;  // on a device: the collective's host copies
    std::vector<index_t> counts;
  };
  world_comm* comm_ = nullptr;
  device_comm* dev_ = nullptr;  // on a device: the communicator that takes its buffers (null: host copies)
  slots<state> st_;
};

}  // namespace whale
