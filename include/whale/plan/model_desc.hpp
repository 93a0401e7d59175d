// The plan read into plain data (`model_desc`, made by describe<P>(),
// plan/describe.hpp): the model's units in flat order -- layers, losses and
// layout conversions, each with its sharded form, layouts, cost, kernels and
// parameters -- and the strategies around them. What lowering, the planner and
// checkpoints read; no templates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "whale/nn/layer.hpp"
#include "whale/strategy/layout.hpp"
#include "whale/strategy/schedule.hpp"

namespace whale {

/// What a unit of the flat model is.
enum class unit_kind : std::uint8_t { layer, loss, convert };

/// What one pass of a leaf asks of a GPU (plan/probe.hpp counts it on the
/// guarded backend's ledger): GEMMs, attention's products, the bytes its other
/// kernels, copies and fills move (an underfilled launch's scaled up, as the
/// ledger's effective bytes), and every launch.
struct pass_kernels {
  double gemm_flops = 0;
  std::int64_t gemms = 0;
  double attention_flops = 0;        ///< fused attention calls, or the batched GEMMs of its steps
  std::int64_t attention_calls = 0;
  double bytes = 0;
  std::int64_t launches = 0;
  std::int64_t host_waits = 0;       ///< the host waiting for the device (synchronisations, reads back): none in a step
};
/// A leaf's passes: forward, backward, and a split schedule's two halves
/// (d(input) only, then the deferred weight gradients).
struct unit_kernels {
  pass_kernels forward, backward, backward_input, weight;
};
/// A leaf's kernels on `batch` sequences of `seq` tokens, `in` features in and `out` out,
/// in bf16 mixed precision or fp32: the whole layer's (a sharded form's is scaled by its caller).
using kernel_probe = unit_kernels (*)(index_t batch, index_t seq, index_t in, index_t out, bool bf16);

/// One leaf layer, or a conversion a split region inserted, in flat order.
struct unit_desc {
  std::string name;
  std::string unsplit;           ///< the name of the layer it is a form of (its own name unless sharded)
  unit_kind kind = unit_kind::layer;
  int element = 0;               ///< top-level element of the model (a stage, for explicit pipelines)
  int block = -1;                ///< block of the top-level repeat it belongs to (-1: none)
  index_t full_params = 0;       ///< parameters of the unsplit layer
  /// Its largest weight matrix (in × out of the unsplit layer, from param_tensors;
  /// 0: none listed): the width a thin product's rate is read at.
  index_t widest_weight = 0;
  int split_axis = -1;           ///< axis of the split region it is in (-1: none)
  bool sharded = false;          ///< a sharded form: split_params divided over split_axis
  index_t split_params = 0, replicated_params = 0;
  /// Sharded forms: what one of `degree` ranks holds and computes per row (unscaled; scale by in_width).
  cost_info (*shard_cost)(index_t degree) = nullptr;
  layout_kind in = layout_kind::R;               ///< layout it receives on split_axis
  cost_info cost;                ///< unsplit cost per row, scaled by its input width
  index_t in_width = any_features, out_width = any_features;  ///< full widths
  conv_op fwd = conv_op::none, bwd = conv_op::none;  ///< converts: the collectives
  layout_kind from = layout_kind::R, to = layout_kind::R, grad_from = layout_kind::R, grad_to = layout_kind::R;
  bool split_loss = false;       ///< class-split softmax cross-entropy (two all-reduces of row statistics)
  /// A loss: the labels it reads per row (1: a class label; a regression loss: its input width of float targets).
  index_t labels_per_row = 1;
  int recompute_group = -1;      ///< recompute<Block> it lies in (-1: none)
  bool defers = false;           ///< can put its weight gradients off to a W pass (split schedules)
  /// Sharded forms: the dimension the ranks share out (heads, vocabulary, features; its
  /// split_extent), which the split degree must divide; 0: none declared.
  index_t split_extent = 0;
  /// Sharded forms: where rank r of p's parameters lie in the unsplit layer's (its param_runs).
  void (*runs)(int r, int p, std::vector<param_run>& out) = nullptr;
  /// The unsplit layer's parameter tensors in flat order (its param_tensors()); null: none listed.
  std::vector<param_tensor> (*tensors)() = nullptr;
  bool residual_out = false;     ///< the last layer with parameters in a residual branch (it writes the stream)
  bool token_table = false;      ///< an embedding<V, D> (or its vocabulary-split form): a table a head may tie to
  index_t table_rows = 0, table_cols = 0;  ///< a token table's or a tied head's (V, D)
  /// A tied head (tied_head<V, D>): the unit of the token table its weight is a
  /// copy of (the last embedding<V, D> before it); -1 otherwise.
  int ties_to = -1;
  /// Bytes per row kept by the containers that end at this unit: a residual's
  /// sum and its input gradient (8 per feature), which no leaf counts.
  double container_act_bytes = 0;
  /// Bytes per row this unit keeps more (or less) where the layers run
  /// without hooks: a gelu after a layer that computes GELU in its GEMM
  /// (fuses_gelu) keeps nothing, and that layer keeps GELU's output.
  double fused_act_bytes = 0;
  /// Its kernels as a GPU runs them (describe_kernels<P>(), plan/probe.hpp); null: not probed.
  kernel_probe kernels = nullptr;

  /// Parameters one of `degree` ranks of its split axis holds.
  index_t local_params(int degree) const {
    return sharded ? split_params / (degree < 1 ? 1 : degree) + replicated_params : full_params;
  }
  /// Whether it sees every row of the global batch (a data-axis layout other than split<0>).
  bool all_rows() const { return split_axis == static_cast<int>(axis::data) && in != layout_kind::S0; }
};

/// The plan type as data.
struct model_desc {
  std::string name;
  std::vector<unit_desc> units;
  bool replicated = false;       ///< replicate<...> somewhere: batch split over data
  int zero_level = 0;            ///< shard<M, L>
  bool pipeline = false, explicit_stages = false;
  int fixed_stages = 0;
  std::string schedule;
  bool split_backward = false;   ///< the schedule has W passes (zb_h1)
  int chunks = 1;                ///< model chunks per pipe rank (interleaved schedules)
  std::vector<pipe_action> (*actions)(int stage, int stages, int micro) = nullptr;
  int elements = 0;              ///< top-level elements
  int repeat_element = -1;       ///< the top-level repeat a pipeline cuts (-1: none)
  int repeat_count = 0;
  std::vector<cost_info> element_cost;   ///< unscaled, as the pipeline's balancer weighs them
  std::vector<index_t> element_width;    ///< width flowing into each element
  cost_info block_cost;
  /// The kernels of the repeat's block as a whole (its dense form), whose fusions
  /// and residual sums its leaves alone do not show (describe_kernels; null: none).
  kernel_probe block_kernels = nullptr;
  bool splits_model = false, splits_data = false;
  index_t full_params = 0;
  bool tokens = false;           ///< input is token ids
};

}  // namespace whale
