// The seconds of one compute operation of a lowered program on a device
// profile (the simulator's compute, plan/simulate.hpp): from the layer's
// analytic costs (GEMM FLOPs at the profile's rate for their size and
// thinness, a backward's at its backward factor, attention's per-head
// products at the attention rate, elementwise bytes at the bandwidth), or, on
// a GPU profile (a `kernels` line), from the kernels the GPU step's ledger
// counts for the layer (plan/probe.hpp). Pure.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "whale/plan/describe.hpp"
#include "whale/plan/device.hpp"
#include "whale/plan/program.hpp"
#include "whale/strategy/split_linear.hpp"

namespace whale {

/// The link kind of a program operation (collectives and messages).
inline link_kind link_of(const op& o) {
  if (o.kind == op_kind::send || o.kind == op_kind::recv) return link_kind::p2p;
  switch (o.coll) {
    case coll_kind::all_reduce: return link_kind::all_reduce;
    case coll_kind::all_gather: return link_kind::all_gather;
    case coll_kind::reduce_scatter: return link_kind::reduce_scatter;
    case coll_kind::broadcast: return link_kind::broadcast;
  }
  return link_kind::all_reduce;
}

}  // namespace whale

namespace whale::detail {

/// Seconds of one pass's kernels (plan/probe.hpp) on `dev`: its GEMM FLOPs at
/// the profile's GEMM rate for their mean size (`rows`, `width` and
/// `back_factor` as the analytic pricing reads them), attention's products at
/// the attention rate for (`seq`, `head_dim`) where the profile has one, else
/// the GEMM rate, its other kernels' bytes at the bandwidth, and LAUNCH_US per
/// launch. A sharded form's products and bytes are the whole layer's at
/// `share` of its FLOPs (attention's at `seq_share`); its launches, the whole layer's.
inline double pass_seconds(const pass_kernels& ps, const device_profile& dev, double share, double seq_share, double seq,
                           double head_dim, double rows, double width, double back_factor) {
  double t = static_cast<double>(ps.launches) * dev.launch_s + ps.bytes * share / dev.bandwidth_bps;
  if (const double g = ps.gemm_flops * share; g > 0)
    t += g / (dev.gemm_rate(g / static_cast<double>(std::max<std::int64_t>(1, ps.gemms)), rows, width) * back_factor);
  if (const double a = ps.attention_flops * seq_share; a > 0) {
    const double ar = dev.attention_rate(seq, head_dim);
    t += a / (ar > 0 ? ar : dev.gemm_rate(a / static_cast<double>(std::max<std::int64_t>(1, ps.attention_calls))));
  }
  return t;
}
/// The pass of `k` that operation kind `kind` runs (a split schedule's
/// backward: d(input) only, where the layer defers its weight gradients).
inline const pass_kernels& pass_for(const unit_kernels& k, op_kind kind, bool split_input) {
  if (kind == op_kind::forward || kind == op_kind::recompute) return k.forward;
  if (kind == op_kind::weight) return k.weight;
  return split_input ? k.backward_input : k.backward;
}
/// A repeat's block run whole does less than its leaves run one at a time
/// (GELU's gradient in the next GEMM, residual sums taken by the next pass):
/// the block's kernels over the sum of its leaves', forward or backward (the
/// split halves together), each priced alone on `dev`; 1 without a block probe.
inline double block_scale(const model_desc& d, const unit_desc& u, index_t batch, index_t seq, bool fwd, const device_profile& dev,
                          bool bf16) {
  if (!d.block_kernels || u.block < 0) return 1.0;
  const auto price = [&](const unit_kernels& k) {
    const auto one = [&](const pass_kernels& ps) { return pass_seconds(ps, dev, 1, 1, static_cast<double>(seq), 0, 0, 0, 1); };
    return fwd ? one(k.forward) : one(k.backward);
  };
  double leaves = 0;
  index_t width = 0;
  for (const auto& v : d.units)
    if (v.block == u.block && v.kind != unit_kind::convert) {
      if (!v.kernels || v.in_width == any_features || v.out_width == any_features) return 1.0;
      if (width == 0) width = v.in_width;
      leaves += price(v.kernels(batch, seq, v.in_width, v.out_width, bf16));
    }
  const double whole = width > 0 ? price(d.block_kernels(batch, seq, width, width, bf16)) : 0.0;
  return leaves > 0 && whole > 0 ? whole / leaves : 1.0;
}
/// Seconds of compute operation `o` of unit `u` (its cost `c` on this rank, split
/// `deg` ways) priced from the leaf's GPU kernels (a profile's `kernels` mode,
/// plan/probe.hpp; pass_seconds), times its block's block_scale. -1: the unit
/// has no probe (a conversion, a priced stand-in) or rows that are not whole sequences.
inline double kernel_seconds(const model_desc& d, const program& p, const op& o, const unit_desc& u, const cost_info& c, int deg,
                             const device_profile& dev, double rows, double width, double back_factor) {
  if (!u.kernels || o.rows < 1 || u.in_width == any_features || u.out_width == any_features) return -1;
  const index_t seq = std::max<index_t>(1, p.seq);
  if (o.rows % seq != 0) return -1;
  const bool bf16 = dev.prices_bf16();
  const index_t batch = o.rows / seq;
  const unit_kernels k = u.kernels(batch, seq, u.in_width, u.out_width, bf16);
  const bool fwd = o.kind == op_kind::forward || o.kind == op_kind::recompute;
  double share = 1, seq_share = 1;
  if (u.sharded && deg > 1) {
    const double whole = fwd ? u.cost.fwd_flops : u.cost.bwd_flops, mine = fwd ? c.fwd_flops : c.bwd_flops;
    share = whole > 0 ? mine / whole : 1.0 / deg;
    seq_share = u.cost.seq_flops > 0 ? c.seq_flops / u.cost.seq_flops : share;
  }
  return pass_seconds(pass_for(k, o.kind, d.split_backward && u.defers), dev, share, seq_share, static_cast<double>(seq), c.seq_inner,
                      c.all_gemm ? 0.0 : rows, width, back_factor) *
         block_scale(d, u, batch, seq, fwd, dev, bf16);
}
/// Seconds of one compute operation of unit `u` on `p`'s rank.
inline double compute_seconds(const model_desc& d, const program& p, const op& o, const device_profile& dev) {
  const bool kernels = !dev.kernel_precision.empty();
  if (o.kind == op_kind::optimizer) {  // read p, g and the state, write p and the state: about 6 floats per element
    if (!kernels) return 24.0 * static_cast<double>(o.elements) / dev.bandwidth_bps;
    // as the GPU step's ledger counts them: AdamW's fused update, 28 bytes an element
    // (32 under bf16, with the fp32 master weights), in one launch; the trainer's
    // gradient norm, 4 bytes an element, then its partial sums and check: 6 launches
    const double per = (dev.prices_bf16() ? 32.0 : 28.0) + (p.grad_norm ? 4.0 : 0.0);
    return per * static_cast<double>(o.elements) / dev.bandwidth_bps + (p.grad_norm ? 7 : 1) * dev.launch_s;
  }
  const auto& u = d.units[static_cast<std::size_t>(o.unit)];
  const int deg = u.split_axis < 0 ? 1 : p.mesh.size(static_cast<axis>(u.split_axis));
  const cost_info c = !u.sharded ? u.cost
                      : u.shard_cost ? u.shard_cost(deg).scaled(u.in_width == any_features ? 0.0 : static_cast<double>(u.in_width))
                                     : shard_of(u.cost, deg, u.split_params, u.replicated_params);
  // GEMM work: 2 FLOPs per parameter of a weight matrix per row, plus attention's
  // context products; the rest of a layer's FLOPs is elementwise
  const index_t w = u.sharded ? c.params : u.full_params;
  const double rows = static_cast<double>(o.rows);
  double gemm = 2.0 * static_cast<double>(w) * rows;
  if (o.kind == op_kind::backward) gemm *= 2;  // d(input) and d(weights)
  if (o.kind == op_kind::weight) gemm = o.flops;
  gemm = std::min(gemm, o.flops);
  // attention's Q K^T and P V are GEMMs too, and so is all of a convolution's work
  gemm += std::max(0.0, o.flops - gemm) * (c.seq_flops > 0 || c.all_gemm ? 1.0 : 0.0);
  const int gemms = o.kind == op_kind::backward ? 2 : 1;
  // attention's per-head products (seq_flops: 2 of them forward, 4 backward), at their own
  // rate where the profile measured one
  double t = 0;
  if (const double ar = c.seq_flops > 0 && o.kind != op_kind::weight ? dev.attention_rate(static_cast<double>(p.seq), c.seq_inner) : 0.0;
      ar > 0) {
    const double context = std::min(gemm, rows * c.seq_flops * static_cast<double>(p.seq) * (o.kind == op_kind::backward ? 2.0 : 1.0));
    t += context / ar;
    gemm -= context;
  }
  // the rows are the products' batch side (a convolution's are images: its side is not known);
  // the width, its largest weight matrix (this rank's share of a split one; 0: FLOPs per row)
  const double width = u.widest_weight > 0 ? static_cast<double>(u.widest_weight) / (u.sharded ? deg : 1) : 0.0;
  // a backward pass's products (d-input, d-weights) at the profile's factor for the narrower
  // side of this rank's widest weight (a split one's share: its inputs where the split runs
  // along them, else its outputs); 0 where not known (a convolution): factor 1
  const bool back = o.kind == op_kind::backward || o.kind == op_kind::weight;
  double narrow = 0;
  if (back && !c.all_gemm && u.widest_weight > 0 && u.in_width != any_features && u.in_width > 0) {
    double in = static_cast<double>(u.in_width), out = static_cast<double>(u.widest_weight) / in;
    if (u.sharded) (u.split_extent == u.in_width ? in : out) /= deg;
    narrow = std::min(in, out);
  }
  if (kernels) {
    const double k = kernel_seconds(d, p, o, u, c, deg, dev, rows, width, back ? dev.backward_factor(narrow) : 1.0);
    if (k >= 0) return k;
  }
  if (gemm > 0)
    t += gemm / (dev.gemm_rate(gemm / gemms, c.all_gemm ? 0.0 : rows, width) * (back ? dev.backward_factor(narrow) : 1.0));
  // elementwise: the bytes it keeps and its short-lived ones, written once and read once
  const double bytes = 2.0 * (c.act_bytes + (c.seq_act_bytes + c.seq_work_bytes) * static_cast<double>(p.seq)) * rows;
  t += bytes / dev.bandwidth_bps;
  return t;
}

}  // namespace whale::detail
