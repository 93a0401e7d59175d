// The operations each pass of a step adds to a rank's program (detail::lowering,
// plan/lower_impl.hpp): ZeRO gathers and scatters, computations, pipeline messages,
// gradient buckets, the step's end. Not the placement, schedule or op primitives.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "whale/comm/detail/cost.hpp"
#include "whale/plan/lower_impl.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/plan/lower_pass.hpp holds the compiled core's definitions: include whale/plan/lower.hpp, not this file"
#endif

namespace whale::detail {

// ZeRO: the counts of flat range [b, e) of the local buffer held by each data rank
inline std::vector<index_t> lowering::zero_split(index_t b, index_t e) const {
  std::vector<index_t> c(zero_counts_.size());
  for (std::size_t r = 0; r < c.size(); ++r) {
    const index_t lo = std::max(b, zero_starts_[r]), hi = std::min(e, zero_starts_[r] + zero_counts_[r]);
    c[r] = std::max<index_t>(0, hi - lo);
  }
  return c;
}
// ZeRO-3: gather a leaf's parameters before its layer runs, unless it is still held from the
// use before or was gathered ahead; with prefetch, then gather the next leaf used
inline void lowering::zero_gather(int unit, bool backward, int micro) {
  const auto& h = prog_.holds[static_cast<std::size_t>(unit_hold_[static_cast<std::size_t>(unit)])];
  if (zero_ < 3 || data_size_ == 1 || h.local_params == 0) return;
  if (uses_) uses_->push_back(2 * unit + (backward ? 1 : 0));
  ++use_pos_;
  if (held_ != unit) {
    if (prefetched_ == unit) {  // its gather was issued one leaf ahead; its layer waits for it
      gathers_.push_back(prefetch_op_);
      prefetched_ = prefetch_op_ = -1;
    } else {
      gathers_.push_back(gather_op(unit, backward, micro, last_));  // gathered when its layer asks
    }
    held_ = unit;
  }
  if (use_pos_ < use_order_.size()) {
    const int next = use_order_[use_pos_] / 2;
    if (next != unit && next != prefetched_) {
      // issued now, after this leaf's gather: it may start once the layer before this one ends
      prefetch_op_ = gather_op(next, use_order_[use_pos_] % 2 == 1, micro, last_);
      prefetched_ = next;
    }
  }
}
inline int lowering::gather_op(int unit, bool backward, int micro, int after) {
  const auto& h = prog_.holds[static_cast<std::size_t>(unit_hold_[static_cast<std::size_t>(unit)])];
  const auto c = zero_split(h.local_offset, h.local_offset + h.local_params);
  const auto t = all_gather_traffic(std::span<const index_t>(c), data_rank_, data_size_, 4);
  op o;
  o.kind = op_kind::collective;
  o.coll = coll_kind::all_gather;
  o.group = axes(axis::data);
  o.group_size = data_size_;
  o.bytes_sent = t.sent;
  o.slowest_bytes = t.slowest;
  o.even_bytes = t.even;
  o.bytes_received = t.received;
  o.elements = h.local_params;
  o.micro = micro;
  o.what = "ZeRO-3 gather of " + h.name + (backward ? " for backward" : " for forward");
  // one layer ahead: it may start when the layer `after` ends; its layer waits for it
  if (after >= 0) o.deps.push_back(after);
  return add(std::move(o));
}

inline void lowering::forward_unit(int i, int micro, bool again) {
  const auto& u = desc_.units[static_cast<std::size_t>(i)];
  if (u.kind == unit_kind::convert) {
    conversion_op(u.fwd, static_cast<axis>(u.split_axis), u.from, u.to, u.in_width,
                  std::string(layout_kind_name(u.from)) + " -> " + layout_kind_name(u.to) + " " + neighbours(i) +
                      (again ? " (recompute)" : ""),
                  micro, true);
    return;
  }
  zero_gather(i, false, micro);
  if (u.kind == unit_kind::loss && u.split_axis == static_cast<int>(axis::data) && u.in != layout_kind::S0 && data_size_ > 1) {
    std::vector<index_t> counts(static_cast<std::size_t>(data_size_));
    const index_t w = u.labels_per_row;  // a label per row, or a row's float targets
    for (int r = 0; r < data_size_; ++r) counts[static_cast<std::size_t>(r)] = weighted_slice(o_.global_batch, data_size_, r, o_.replica_weights, std::max(1, o_.micro_batches)).second * o_.seq * w;
    pending_.push_back(add_coll(coll_kind::all_gather, axes(axis::data), data_size_,
                                all_gather_traffic(std::span<const index_t>(counts), data_rank_, data_size_, 4), o_.global_batch * o_.seq * w,
                                w > 1 ? "targets of every row for the loss" : "labels of every row for the loss", micro));
  }
  add_compute(again ? op_kind::recompute : op_kind::forward, i, micro, rows_for(u));
  if (u.split_loss) {
    const axis a = static_cast<axis>(u.split_axis);
    const int p = prog_.mesh.size(a);
    if (p > 1) {
      const index_t R = rows_for(u);
      int last = -1;  // the loss's own collectives, as the layer issues them; what follows waits for the last
      for (const auto& k : split_loss_collectives)
        last = add_coll(coll_kind::all_reduce, axes(a), p, all_reduce_traffic(k.floats_per_row * R * 4, p), k.floats_per_row * R,
                        k.what, micro);
      pending_.push_back(last);
    }
  }
}
// "between column_linear<8, 16>/model and gelu": the layers a conversion sits between
inline std::string lowering::neighbours(int i) const {
  std::string before, after;
  for (int k = i - 1; k >= 0 && before.empty(); --k)
    if (desc_.units[static_cast<std::size_t>(k)].kind != unit_kind::convert) before = desc_.units[static_cast<std::size_t>(k)].name;
  for (std::size_t k = static_cast<std::size_t>(i) + 1; k < desc_.units.size() && after.empty(); ++k)
    if (desc_.units[k].kind != unit_kind::convert) after = desc_.units[k].name;
  if (before.empty()) return "into " + after;
  if (after.empty()) return "after " + before;
  return "between " + before + " and " + after;
}
inline void lowering::p2p(op_kind k, int peer_stage, index_t width, int micro, const char* what) {
  op o;
  o.kind = k;
  o.group = axes(axis::pipe);
  o.group_size = pipe_size_;
  o.peer = prog_.mesh.rank_of({data_rank_, peer_stage, model_rank_});
  o.elements = rows_local() * width;
  (k == op_kind::send ? o.bytes_sent : o.bytes_received) = o.elements * 4;
  o.micro = micro;
  o.what = what;
  if (k == op_kind::send && last_ >= 0) o.deps.push_back(last_);
  if (k == op_kind::send)  // and the conversions that produced what it sends (its next compute waits for them too)
    for (int g : pending_) o.deps.push_back(g);
  const int id = add(std::move(o));
  if (k == op_kind::recv) pending_.push_back(id);
}

inline void lowering::forward(int c, int j) {
  const int v = c * pipe_size_ + stage_, pv = pipe_size_ * chunks_;
  const auto cu = static_cast<std::size_t>(c);
  if (v > 0) p2p(op_kind::recv, (v - 1) % pipe_size_, in_width_[cu], j, "activation from the previous stage");
  for (int i : chunk_units_[cu]) forward_unit(i, j, false);
  if (v + 1 < pv) p2p(op_kind::send, (v + 1) % pipe_size_, out_width_[cu], j, "activation to the next stage");
}

inline void lowering::backward(int c, int j, bool last_micro) {
  const int v = c * pipe_size_ + stage_, pv = pipe_size_ * chunks_;
  const auto cu = static_cast<std::size_t>(c);
  const auto& mine = chunk_units_[cu];
  if (v + 1 < pv) p2p(op_kind::recv, (v + 1) % pipe_size_, out_width_[cu], j, "gradient from the next stage");
  for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
    const int i = *it;
    const auto& u = desc_.units[static_cast<std::size_t>(i)];
    // entering a recompute group from its end: its forward runs again first
    if (u.recompute_group >= 0 && (it == mine.rbegin() || desc_.units[static_cast<std::size_t>(*std::prev(it))].recompute_group != u.recompute_group)) {
      auto first = it;
      while (std::next(first) != mine.rend() && desc_.units[static_cast<std::size_t>(*std::next(first))].recompute_group == u.recompute_group) ++first;
      for (auto f = first;; --f) {
        forward_unit(*f, j, true);
        if (f == it) break;
      }
    }
    if (u.kind == unit_kind::convert) {
      conversion_op(u.bwd, static_cast<axis>(u.split_axis), u.grad_from, u.grad_to, u.in_width,
                    std::string("gradient ") + layout_kind_name(u.grad_from) + " -> " + layout_kind_name(u.grad_to) + " " +
                        neighbours(i),
                    j, true);
      continue;
    }
    zero_gather(i, true, j);
    const int b = add_compute(op_kind::backward, i, j, rows_for(u));
    const auto& h = prog_.holds[static_cast<std::size_t>(unit_hold_[static_cast<std::size_t>(i)])];
    if (h.local_params == 0) continue;
    if (zero_ >= 2 && data_size_ > 1) zero_scatter(h, b, j);
    // each bucket as the backward that finishes it ends (split, interleaved, or without overlap: all at the end)
    if (last_micro && o_.overlap_buckets && !desc_.split_backward && chunks_ == 1) ready(h.local_offset, b, false);
  }
  if (v > 0 && j >= 0) p2p(op_kind::send, (v - 1) % pipe_size_, in_width_[cu], j, "gradient to the previous stage");
}
// A split schedule's W pass: the weight gradients its backward put off
inline void lowering::weight(int c, int j) {
  const auto& mine = chunk_units_[static_cast<std::size_t>(c)];
  for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
    const auto& u = desc_.units[static_cast<std::size_t>(*it)];
    if (u.defers) add_compute(op_kind::weight, *it, j, rows_for(u));
  }
}
// ZeRO-2/3: a leaf's gradients reduce-scattered into the ranges, in buckets
inline void lowering::zero_scatter(const unit_holding& h, int after, int micro) {
  for (index_t a = 0; a < h.local_params; a += per_bucket_) {
    const index_t b = std::min(h.local_params, a + per_bucket_);
    const auto c = zero_split(h.local_offset + a, h.local_offset + b);
    const auto t = reduce_scatter_traffic(std::span<const index_t>(c), data_rank_, data_size_, o_.bf16_reduce ? 2 : 4);
    const int id = add_coll(coll_kind::reduce_scatter, axes(axis::data), data_size_, t, b - a,
                            "ZeRO gradients of " + h.name + (o_.bf16_reduce ? " in bf16" : ""), micro);
    prog_.ops[static_cast<std::size_t>(id)].deps = {after};
    prog_.ops[static_cast<std::size_t>(id)].mine = c[static_cast<std::size_t>(data_rank_)];
    sync_.push_back(id);
  }
}
// Gradients at local offsets >= `offset` are final (`at_end`: the backward has ended): the buckets they complete.
inline void lowering::ready(index_t offset, int after, bool at_end) {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].first >= offset) {
    const auto [b, e] = buckets_[next_bucket_];
    const index_t bytes = o_.bf16_reduce ? 2 : 4;
    const int id = add_coll(coll_kind::all_reduce, axes(axis::data), data_size_, all_reduce_traffic((e - b) * bytes, data_size_), e - b,
                            "gradient bucket " + std::to_string(next_bucket_) + " [" + std::to_string(b) + ", " +
                                std::to_string(e) + ")" + (pipe_size_ > 1 ? " of stage " + std::to_string(stage_) : "") +
                                (o_.bf16_reduce ? " in bf16" : ""),
                            -1);
    prog_.ops[static_cast<std::size_t>(id)].deps = {after};
    prog_.ops[static_cast<std::size_t>(id)].bucket = static_cast<int>(next_bucket_);
    prog_.bucket_launch.push_back(at_end ? program::after_backward : offset);
    sync_.push_back(id);
    ++next_bucket_;
  }
}

inline void lowering::finish() {
  ready(0, last_, true);
  // the global loss
  const axes lg = axes::from_bits(7u);  // shares summed over the world, once per model group
  const int lsize = prog_.mesh.size();
  if (lsize > 1) sync_.push_back(add_coll(coll_kind::all_reduce, lg, lsize, all_reduce_traffic(8, lsize), 1, "the step's loss", -1));
  if (o_.grad_norm && prog_.mesh.size() > 1)  // each rank's squares of the parameters it counts, summed over the world
    sync_.push_back(add_coll(coll_kind::all_reduce, axes::from_bits(7u), prog_.mesh.size(),
                             all_reduce_traffic(8, prog_.mesh.size()), 1,
                             "squared gradient norm (clipping, non-finite check)", -1));
  op u;
  u.kind = op_kind::optimizer;
  u.elements = prog_.owned_end - prog_.owned_begin;
  u.what = "update of parameters [" + std::to_string(prog_.owned_begin) + ", " + std::to_string(prog_.owned_end) + ")";
  u.deps = sync_;
  u.deps.insert(u.deps.end(), pending_.begin(), pending_.end());
  u.deps.insert(u.deps.end(), gathers_.begin(), gathers_.end());
  pending_.clear();
  gathers_.clear();
  if (last_ >= 0) u.deps.push_back(last_);
  const int opt = add(std::move(u));
  if ((zero_ == 1 || zero_ == 2) && data_size_ > 1) {
    const auto t = all_gather_traffic(std::span<const index_t>(zero_counts_), data_rank_, data_size_, 4);
    const int id = add_coll(coll_kind::all_gather, axes(axis::data), data_size_, t, n_local_, "ZeRO parameters after the update", -1);
    prog_.ops[static_cast<std::size_t>(id)].deps = {opt};
  }
}

}  // namespace whale::detail
