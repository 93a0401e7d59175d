// The rules a plan must meet on a mesh, checked when it is lowered — the
// run-time twins of the type rules — and the options lowering takes. Pure:
// every rank and every machine reach the same verdict. No lowering here.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/comm/mesh.hpp"
#include "whale/plan/describe.hpp"
#include "whale/plan/partition.hpp"
#include "whale/plan/precision_rule.hpp"

namespace whale {

/// The run-time choices lowering needs (the rest is in the plan type).
struct lower_options {
  index_t global_batch = 0;     ///< sequences (or samples) per step; required
  index_t seq = 1;              ///< tokens per sequence
  int micro_batches = 0;        ///< 0: the runtime's default (pipelines of 2+ stages: <= 4 x stages; otherwise 1)
  std::vector<int> stage_blocks;  ///< pipelines of a repeat: blocks per stage (empty: balanced)
  index_t balance_seq = 128;    ///< context length the stage balancer assumes
  double bucket_mib = 25.0;     ///< gradient bucket size
  /// Each gradient bucket all-reduced as soon as the backward that finishes it
  /// ends (plan_options::overlap); false: every bucket after the step's backward.
  bool overlap_buckets = true;
  bool bf16_reduce = false;     ///< gradient buckets summed in bf16 (2 bytes an element; plan_options::bf16_reduce)
  bool zero_prefetch = true;    ///< ZeRO-3: each gather issued one leaf ahead (plan_options::prefetch)
  /// bf16 mixed precision (precision::bf16): fp32 master weights beside the parameters, 4 bytes a
  /// parameter more; ZeRO-3 is refused, as the trainer refuses it.
  bool bf16 = false;
  int zero_level = -1;          ///< -1: the plan's (shard<M, L>); 0..3 overrides
  /// The trainer's global gradient norm: an 8-byte all-reduce over the world per
  /// step (for clipping, and the non-finite check the trainer runs by default).
  bool grad_norm = true;
  int optimizer_bytes_per_param = 8;  ///< AdamW: 8 (two moments); SGD with momentum: 4
  /// Each data replica's share of the batch, by weight (plan_options::balance); empty: even.
  std::vector<double> replica_weights;
  /// Each pipeline stage's slowness for the balanced cut (empty: all equal); ignored with stage_blocks.
  std::vector<double> stage_slowness;
  /// Each pipeline stage's memory cap in bytes (its smallest device's; empty: none). The balanced
  /// cut keeps every stage's parameters, gradients and optimizer state (4 + 4 +
  /// optimizer_bytes_per_param bytes a parameter) plus the activations of `cap_rows` rows for each
  /// of the min(micro_batches, stages - s) micro-batches stage s keeps under 1F1B, within its cap.
  std::vector<double> stage_memory_caps;
  index_t cap_rows = 0;  ///< rows (tokens) of one micro-batch, for the activations term; 0: left out
  /// Where each holding's parameters lie in the unsplit model (unit_holding::runs: checkpoints
  /// read them). Pricing never does, so the planners leave it out (false): a row-split
  /// layer has one run per row, and listing them was a fifth of a 1,024-GPU search.
  bool placement = true;
};

namespace detail {

inline void lower_fail(const model_desc& d, const std::string& why) {
  throw std::invalid_argument("whale::lower: " + d.name + ": " + why);
}

/// Throws std::invalid_argument, naming the plan and the rule, when plan `d`
/// (with ZeRO level `zero`) cannot run on `mesh` with options `o`.
inline void check_plan(const model_desc& d, const mesh_shape& m, const lower_options& o, int zero) {
  const int D = m.size(axis::data), P = m.size(axis::pipe), M = m.size(axis::model);

  if (o.global_batch < 1) lower_fail(d, "the global batch must be at least 1 sequence");
  if (o.seq < 1) lower_fail(d, "the sequence length must be at least 1");
  if (zero < 0 || zero > 3) lower_fail(d, "the ZeRO level must be 0, 1, 2 or 3");
  if (const auto why = precision_refusal(o.bf16, zero); !why.empty()) lower_fail(d, why);
  if (!(o.bucket_mib > 0)) lower_fail(d, "the bucket size must be positive");
  if (!o.replica_weights.empty() && static_cast<int>(o.replica_weights.size()) != D)
    lower_fail(d, "the batch split has " + std::to_string(o.replica_weights.size()) + " weights for " + std::to_string(D) +
                      " data replicas; give one per replica");
  for (double w : o.replica_weights)
    if (!(w > 0) || !std::isfinite(w)) lower_fail(d, "every replica's weight in the batch split must be positive and finite");
  if (d.split_backward && zero >= 2)
    lower_fail(d, "the " + d.schedule + " schedule computes weight gradients in W passes after the backward, but ZeRO " +
                      std::to_string(zero) + " reduce-scatters them right after it; use ZeRO-1 or 1f1b");
  const std::string mesh = m.spec();
  if (P > 1 && !d.pipeline)
    lower_fail(d, "the mesh " + mesh + " has a pipe axis, but the plan has no pipeline<...>");
  if (d.pipeline && d.fixed_stages > 0 && P * d.chunks != d.fixed_stages)
    lower_fail(d, "the pipeline has " + std::to_string(d.fixed_stages) + " stages but the mesh " + mesh + " has " +
                       std::to_string(P) + " pipe rank(s)" +
                       (d.chunks > 1 ? " of " + std::to_string(d.chunks) + " chunks each" : std::string()));
  if (d.chunks > 1 && zero >= 2)
    lower_fail(d, "an interleaved pipe rank holds " + std::to_string(d.chunks) + " separate chunks, but ZeRO " +
                      std::to_string(zero) + " maps each layer into one stage range; use ZeRO-1");
  if (M > 1 && !d.splits_model)
    lower_fail(d, "the mesh " + mesh + " has a model axis, but nothing is split over it");
  // a plan with split regions is data parallel over the data axis outside them (Megatron's TP x DP)
  if (D > 1 && !d.replicated && !d.splits_data && !d.splits_model && zero == 0)
    lower_fail(d, "the mesh " + mesh + " has a data axis, but the plan is neither replicated, sharded nor split over data");
  if (o.global_batch < D)
    lower_fail(d, "the global batch (" + std::to_string(o.global_batch) + ") is smaller than the data axis (" +
                       std::to_string(D) + ")");
  for (const auto& u : d.units)
    if (u.sharded && u.split_axis >= 0) {
      const int deg = m.size(static_cast<axis>(u.split_axis));
      if (u.split_params % deg != 0)
        lower_fail(d, u.name + " cannot be split " + std::to_string(deg) + " ways over the " +
                           axis_name(static_cast<axis>(u.split_axis)) + " axis");
      // the dimension it shares out (heads, vocabulary, features), as the layer checks when built
      if (u.split_extent > 0 && u.split_extent % deg != 0)
        lower_fail(d, u.name + " cannot be split " + std::to_string(deg) + " ways over the " +
                           axis_name(static_cast<axis>(u.split_axis)) + " axis: the dimension its ranks share (" +
                           std::to_string(u.split_extent) + ") is not a multiple of " + std::to_string(deg));
    }
  }

/// Blocks of the pipelined repeat on each of `P` stages: `o.stage_blocks`,
/// checked, or balanced by the layers' cost as the runtime balances them.
inline std::vector<int> stage_cut(const model_desc& d, int P, const lower_options& o) {
  const int N = d.repeat_count;
  std::vector<int> blocks = o.stage_blocks;
  if (blocks.empty()) {
    if (P > 1 && N < P - 2)
      lower_fail(d, "the repeat has " + std::to_string(N) + " blocks, too few for " + std::to_string(P) +
                        " pipeline stages (each inner stage needs a block); use at most " + std::to_string(N + 2) + " stages");
    if (P > 1 && d.repeat_element == 0 && N < P - 1)
      lower_fail(d, "the repeat has " + std::to_string(N) + " blocks, too few for " + std::to_string(P) +
                        " pipeline stages (nothing comes before the repeat, so the first stage needs a block too, as each "
                        "inner stage does); use at most " + std::to_string(N + 1) + " stages");
    double pre = 0, post = 0;
    for (int i = 0; i < d.elements; ++i)
      if (i != d.repeat_element)
        (i < d.repeat_element ? pre : post) += balance_weight(d.element_cost[static_cast<std::size_t>(i)],
                                                              d.element_width[static_cast<std::size_t>(i)], o.balance_seq);
    const auto rep = static_cast<std::size_t>(d.repeat_element);
    if (!o.stage_slowness.empty() && static_cast<int>(o.stage_slowness.size()) != P)
      lower_fail(d, "the stage slowness list has " + std::to_string(o.stage_slowness.size()) + " factors for " +
                        std::to_string(P) + " stages");
    std::function<bool(int, int)> fits;
    if (!o.stage_memory_caps.empty()) {
      if (static_cast<int>(o.stage_memory_caps.size()) != P)
        lower_fail(d, "the stage memory caps list has " + std::to_string(o.stage_memory_caps.size()) + " values for " +
                          std::to_string(P) + " stages");
      // bytes a parameter, and bytes of activations a row, of the elements before and after the repeat and of a block
      const double per_param = 8.0 + o.optimizer_bytes_per_param + (o.bf16 ? 4.0 : 0.0);  // bf16: the fp32 master weights
      auto act_row = [&](const cost_info& c, index_t width) {
        const auto s = c.scaled(width == any_features ? 0.0 : static_cast<double>(width));
        return s.act_bytes + s.seq_act_bytes * static_cast<double>(o.balance_seq);
      };
      double pre_p = 0, post_p = 0, pre_a = 0, post_a = 0;
      for (int i = 0; i < d.elements; ++i) {
        if (i == d.repeat_element) continue;
        const auto& c = d.element_cost[static_cast<std::size_t>(i)];
        const auto w = d.element_width[static_cast<std::size_t>(i)];
        const double params = static_cast<double>(c.scaled(w == any_features ? 0.0 : static_cast<double>(w)).params);
        (i < d.repeat_element ? pre_p : post_p) += params;
        (i < d.repeat_element ? pre_a : post_a) += act_row(c, w);
      }
      const double blk_p = static_cast<double>(d.block_cost.scaled(static_cast<double>(d.element_width[rep])).params);
      const double blk_a = act_row(d.block_cost, d.element_width[rep]);
      const int m = o.micro_batches > 0 ? o.micro_batches : P;
      fits = [=, &o](int s, int n) {
        const double params = n * blk_p + (s == 0 ? pre_p : 0.0) + (s == P - 1 ? post_p : 0.0);
        const double act = (n * blk_a + (s == 0 ? pre_a : 0.0) + (s == P - 1 ? post_a : 0.0)) *
                           static_cast<double>(o.cap_rows) * std::min(m, P - s);
        return params * per_param + act <= o.stage_memory_caps[static_cast<std::size_t>(s)];
      };
    }
    // a first stage with nothing before the repeat must hold a block (a stage without a layer cannot run)
    const bool first_needs_block = d.repeat_element == 0;
    std::function<bool(int, int)> can = [fits, first_needs_block](int s, int n) {
      return !(first_needs_block && s == 0 && n == 0) && (!fits || fits(s, n));
    };
    return balance_blocks(N, P, pre, post, balance_weight(d.block_cost, d.element_width[rep], o.balance_seq),
                          o.stage_slowness, can);
  }
  int sum = 0;
  bool ok = static_cast<int>(blocks.size()) == P;
  for (std::size_t s = 0; s < blocks.size(); ++s) {
    sum += blocks[s];
    if (blocks[s] < 0 || (blocks[s] == 0 && s > 0 && static_cast<int>(s) + 1 < P)) ok = false;
  }
  if (!ok || sum != N) {
    std::string got;
    for (auto b : blocks) {
      if (!got.empty()) got += ',';
      got += std::to_string(b);
    }
    lower_fail(d, "stage blocks {" + got + "} do not fit: give one count per pipeline stage (" + std::to_string(P) +
                      "), summing to the repeat's " + std::to_string(N) + " blocks, each inner stage at least 1 (--stage-blocks, "
                      "WHALE_STAGE_BLOCKS)");
  }
  if (P > 1 && d.repeat_element == 0 && blocks[0] == 0)
    lower_fail(d, "stage 0 of " + std::to_string(P) + " holds no layer; give it blocks (--stage-blocks) or use fewer pipe ranks");
  return blocks;
}

}  // namespace detail
}  // namespace whale
