// `predict_memory(desc, program)`: the bytes one rank's program needs, by the
// categories the memory tracker counts (tensor/memory.hpp): parameters,
// gradients and optimizer state by ZeRO level; the activations the layers
// keep (each leaf's act_bytes per row × the rows of a micro-batch × the
// micro-batches alive at once under the schedule; a recompute<Block> keeps its
// boundary copies and one block's buffers); the buffers of pipeline messages
// and ZeRO collectives. Pure, like lowering: no MPI, no tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "whale/plan/describe.hpp"
#include "whale/plan/program.hpp"
#include "whale/plan/zero_options.hpp"
#include "whale/strategy/split_linear.hpp"

namespace whale {

/// Predicted peak bytes of one rank, by category.
struct memory_estimate {
  std::int64_t params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0;
  int live_micro_batches = 1;  ///< micro-batches whose activations are kept at once (the schedule's peak)
  index_t rows = 0;            ///< rows (samples, or tokens) of one micro-batch on this rank

  std::int64_t model_state() const noexcept { return params + grads + optimizer; }
  std::int64_t total() const noexcept { return model_state() + activations + comm; }

  /// "params 96.0 MiB, grads 96.0 MiB, ..., total 308.2 MiB"
  friend std::ostream& operator<<(std::ostream& os, const memory_estimate& e) {
    const auto put = [&](const char* n, std::int64_t b) {
      os << n << ' ' << static_cast<double>(b) / 1048576.0 << " MiB";
    };
    const auto f = os.flags();
    const auto pr = os.precision();
    os.setf(std::ios::fixed);
    os.precision(1);
    put("params", e.params), os << ", ";
    put("grads", e.grads), os << ", ";
    put("optimizer", e.optimizer), os << ", ";
    put("activations", e.activations);
    os << " (" << e.live_micro_batches << " micro-batch(es) of " << e.rows << " rows kept), ";
    put("comm", e.comm), os << "; total ";
    os << static_cast<double>(e.total()) / 1048576.0 << " MiB";
    os.flags(f);
    os.precision(pr);
    return os;
  }
};

namespace detail {
/// Bytes of the ZeRO engine's buffer pool after one step of program `p`: a
/// gradient buffer per leaf in backward (back to the pool when its
/// reduce-scatters end, at most `max_pending` leaves later), an accumulation
/// buffer per bucket (the piece this rank keeps) in micro-batches after the
/// first — or, when gradients are reduce-scattered in bf16, a packed bf16 copy
/// of each bucket and a bf16 piece instead, the gradient buffer going back as
/// soon as the leaf is packed — and at level 3 the gathered
/// parameters of the running leaf and of the prefetched one. One engine pass
/// spans the step's micro-batches and prefetches across them: a micro-batch's
/// end gives no gathered buffer back (the next micro-batch's first leaf is
/// already on its way).
inline std::int64_t zero_pool_bytes(const program& p, const zero_options& o) {
  struct size_pool {  // buffers taken by exact size: size -> (buffers, free), as the engine's pools
    std::map<std::int64_t, std::pair<int, int>> by;
    void take(std::int64_t n) {
      auto& b = by[n];
      if (b.second > 0) --b.second;
      else ++b.first;
    }
    void give(std::int64_t n) { ++by[n].second; }
    std::int64_t elements() const {
      std::int64_t e = 0;
      for (const auto& [n, b] : by) e += n * b.first;
      return e;
    }
  } pool, pool16;  // fp32; bf16 (packed buckets and summed pieces)
  struct leaf {    // a leaf's buffers while its reduce-scatters are in flight
    std::vector<std::int64_t> fp32, bf16;
  };
  std::vector<std::int64_t> gathered;  // level 3: in use, oldest first
  std::vector<leaf> in_flight;
  const int D = p.mesh.size(axis::data);
  const bool in_bf16 = p.bf16_reduce && D > 1;
  const int keep = o.prefetch ? 2 : 1;
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    const auto& op = p.ops[i];
    if (op.kind == op_kind::collective && op.coll == coll_kind::all_gather && op.what.starts_with("ZeRO-3 gather")) {
      while (static_cast<int>(gathered.size()) >= keep) pool.give(gathered.front()), gathered.erase(gathered.begin());
      pool.take(op.elements), gathered.push_back(op.elements);
    } else if (op.kind == op_kind::backward) {
      std::int64_t grads = 0;  // the leaf's gradient buffer
      leaf l;
      for (std::size_t k = i + 1; k < p.ops.size(); ++k) {  // its reduce-scatters follow it
        const auto& rs = p.ops[k];
        // (a layout conversion's reduce-scatter of the gradient rows is no ZeRO buffer)
        if (rs.kind != op_kind::collective || rs.coll != coll_kind::reduce_scatter || !rs.what.starts_with("ZeRO gradients")) break;
        grads += rs.elements;
        if (in_bf16) {  // the packed bucket, and the summed piece this rank keeps
          l.bf16.push_back(rs.elements);
          if (rs.mine > 0) l.bf16.push_back(rs.mine);
        } else if (op.micro > 0 && rs.mine > 0) {
          l.fp32.push_back(rs.mine);  // accumulating: the piece arrives beside the owned gradients
        }
      }
      if (grads == 0) continue;
      if (in_bf16) pool.take(grads), pool.give(grads);  // packed: the fp32 gradients go back at once
      else l.fp32.push_back(grads);
      for (auto n : l.fp32) pool.take(n);
      for (auto n : l.bf16) pool16.take(n);
      in_flight.push_back(std::move(l));
      while (static_cast<int>(in_flight.size()) > o.max_pending) {
        for (auto n : in_flight.front().fp32) pool.give(n);
        for (auto n : in_flight.front().bf16) pool16.give(n);
        in_flight.erase(in_flight.begin());
      }
    }
  }
  return 4 * pool.elements() + 2 * pool16.elements();
}
/// A split region's inserted conversion (strategy/layout.hpp): the buffer its
/// forward writes, the one its backward writes, and for column collectives
/// the staging buffer they share. Widths: the stream's full width, divided
/// where the layout splits the features; rows: local, or every row of the
/// global batch where the data-axis layout is whole.
inline void convert_bytes(const unit_desc& u, int p, index_t rows_local, index_t rows_all, double& kept, double& comm) {
  if (u.in_width == any_features) return;
  const bool data = u.split_axis == static_cast<int>(axis::data);
  auto out = [&](conv_op k, layout_kind to) {
    if (k == conv_op::none) return 0.0;
    const double w = static_cast<double>(to == layout_kind::S1 ? u.in_width / p : u.in_width);
    const double r = static_cast<double>(data && to != layout_kind::S0 ? rows_all : rows_local);
    return 4.0 * w * r;
  };
  kept += out(u.fwd, u.to) + out(u.bwd, u.grad_to);
  auto cols = [](conv_op k) { return k == conv_op::gather_cols || k == conv_op::reduce_scatter_cols; };
  if (cols(u.fwd) || cols(u.bwd)) comm += 4.0 * static_cast<double>(u.in_width) * static_cast<double>(rows_local);
}
}  // namespace detail

/// The memory rank `p.rank` needs to run program `p` of plan `d` (lower(d, ...)):
/// the optimizer at p.optimizer_bytes_per_param per owned parameter. Data
/// batches and short-lived temporaries (the tracker's `workspace`) are not included.
inline memory_estimate predict_memory(const model_desc& d, const program& p, const zero_options& o = {}) {
  memory_estimate e;
  const auto t = p.totals();
  e.params = t.param_bytes, e.grads = t.grad_bytes, e.optimizer = t.optimizer_bytes;
  if (p.bf16) e.optimizer += 4 * t.params_held;  // the fp32 master weights (trainer: master_), counted as optimizer state
  const int m = std::max(1, p.micro_batches);
  const index_t micro_seqs = p.local_sequences / m;
  e.rows = micro_seqs * p.seq;
  const index_t all_rows = p.global_batch / m * p.seq;  // layers that see every row of the global batch
  int live = 1;
  if (d.pipeline) {  // the schedule's replay, from lowering
    if (static_cast<int>(p.order.report.peak_live.size()) <= p.stage)
      throw std::logic_error("whale::predict_memory: the program of a pipeline has no order of its passes (program::order); lower it with lower()");
    live = p.order.report.peak_live[static_cast<std::size_t>(p.stage)];
  }
  e.live_micro_batches = live;
  // How many micro-batches' activations each model chunk keeps: the layers of a
  // chunk hold one buffer per activation slot its passes use. With one chunk a
  // rank that is the peak alive; an interleaved rank's chunks take their slots
  // from one pool (keys chunk·m + micro), each chunk only some of them.
  const int chunks = std::max(1, p.chunks);
  std::vector<int> uses(static_cast<std::size_t>(chunks), live);
  if (d.pipeline && chunks > 1) {
    if (static_cast<int>(p.order.report.slot.size()) <= p.stage ||
        static_cast<int>(p.order.report.slot[static_cast<std::size_t>(p.stage)].size()) < chunks * m)
      throw std::logic_error("whale::predict_memory: the program of an interleaved pipeline has no activation slot for each of its passes (program::order); lower it with lower()");
    const auto& slots = p.order.report.slot[static_cast<std::size_t>(p.stage)];
    for (int c = 0; c < chunks; ++c) {
      std::vector<int> mine;
      for (int j = 0; j < m; ++j) mine.push_back(slots[static_cast<std::size_t>(c * m + j)]);
      std::sort(mine.begin(), mine.end());
      uses[static_cast<std::size_t>(c)] = static_cast<int>(std::unique(mine.begin(), mine.end()) - mine.begin());
    }
  }
  auto degree = [&](const unit_desc& u) { return u.split_axis < 0 ? 1 : p.mesh.size(static_cast<axis>(u.split_axis)); };
  std::map<int, double> group;  // recompute group -> its inner buffers for one micro-batch
  std::vector<double> kept(static_cast<std::size_t>(chunks), 0.0);            // per chunk: bytes kept per micro-batch in flight
  std::vector<double> comm_per_micro(static_cast<std::size_t>(chunks), 0.0);  // conversions' staging buffers, the same
  auto chunk_of = [&](const unit_holding& h) { return static_cast<std::size_t>(std::clamp(h.chunk, 0, chunks - 1)); };
  for (const auto& h : p.holds) {
    const auto& u = d.units[static_cast<std::size_t>(h.unit)];
    const auto ch = chunk_of(h);
    const cost_info c = !u.sharded ? u.cost
                        : u.shard_cost ? u.shard_cost(degree(u)).scaled(u.in_width == any_features ? 0.0 : static_cast<double>(u.in_width))
                                       : detail::shard_of(u.cost, degree(u), u.split_params, u.replicated_params);
    if (u.kind == unit_kind::convert) {  // its output and gradient buffers, and a staging buffer for column collectives
      detail::convert_bytes(u, p.mesh.size(static_cast<axis>(u.split_axis)), e.rows, all_rows, kept[ch], comm_per_micro[ch]);
      // a split residual ending in its exit conversion keeps its stream buffers there
      (u.recompute_group < 0 ? kept[ch] : group[u.recompute_group]) += u.container_act_bytes * static_cast<double>(e.rows);
      continue;
    }
    const double rows = static_cast<double>(u.all_rows() ? all_rows : e.rows);
    // a row-wise layer on features split over its axis holds its share of the width
    const double share = !u.sharded && u.split_axis >= 0 && u.in == layout_kind::S1 ? 1.0 / degree(u) : 1.0;
    // ZeRO 2-3 run the layers under its hooks, and hooks turn the layers' fusions off
    const double fused = p.zero_level >= 2 ? 0.0 : u.fused_act_bytes;
    const double per_row = (c.act_bytes + c.seq_act_bytes * static_cast<double>(p.seq)) * share + u.container_act_bytes + fused;
    (u.recompute_group < 0 ? kept[ch] : group[u.recompute_group]) += per_row * rows;
  }
  // a recompute<Block> keeps its output and input-gradient copies (rows × (in + out))
  struct edge {
    index_t in = 0, out = 0;
    std::size_t chunk = 0;
  };
  std::map<int, edge> edges;  // group -> its first unit's in width, its last unit's out width, its chunk
  for (const auto& h : p.holds) {
    const auto& u = d.units[static_cast<std::size_t>(h.unit)];
    if (u.recompute_group < 0) continue;
    auto [it, fresh] = edges.try_emplace(u.recompute_group, edge{u.in_width, u.out_width, chunk_of(h)});
    if (!fresh) it->second.out = u.out_width;
  }
  for (const auto& [g, w] : edges) kept[w.chunk] += 4.0 * static_cast<double>(w.in + w.out) * static_cast<double>(e.rows);
  double pool = 0;  // one block's buffers at a time, reused by every recomputed block
  for (const auto& [g, b] : group) pool = std::max(pool, b);
  double act = pool, conv = 0;
  for (std::size_t c = 0; c < kept.size(); ++c) {
    act += kept[c] * uses[c];
    conv += comm_per_micro[c] * uses[c];
  }
  e.activations = static_cast<std::int64_t>(act);
  e.comm += static_cast<std::int64_t>(conv);
  // pipeline messages: received activations (activations) and gradients (comm)
  // in one buffer per live slot, and as many pooled outgoing copies
  if (p.stages * p.chunks > 1) {
    index_t in_w = 0, out_w = 0;
    bool first = false, last = false;
    for (const auto& h : p.holds) {
      const int v = h.chunk * p.stages + h.stage;
      if (v == 0) first = true;
      if (v == p.stages * p.chunks - 1) last = true;
    }
    for (const auto& o : p.ops) {
      if (o.kind == op_kind::recv && o.what.starts_with("activation")) in_w = std::max<index_t>(in_w, o.elements / std::max<index_t>(1, e.rows));
      if (o.kind == op_kind::send && o.what.starts_with("activation")) out_w = std::max<index_t>(out_w, o.elements / std::max<index_t>(1, e.rows));
    }
    const auto slot = [&](index_t w) { return 4 * static_cast<std::int64_t>(live) * e.rows * w; };
    if (!first || p.chunks > 1) e.activations += slot(in_w);
    if (!last || p.chunks > 1) e.comm += slot(out_w);
    e.comm += slot(std::max(in_w, out_w));
  }
  // ZeRO collectives (levels 2-3): buffers from a pool taken by exact size, as
  // runtime/zero.hpp takes them, replayed over the step's operations
  if (p.zero_level >= 2 && p.mesh.size(axis::data) > 1) e.comm += detail::zero_pool_bytes(p, o);
  // gradient buckets summed in bf16 (data parallel, ZeRO-1): one staging
  // buffer of 2 bytes per gradient they cover, as runtime/grad_sync.hpp holds it
  if (p.bf16_reduce && p.zero_level < 2)
    for (const auto& op : p.ops)
      if (op.kind == op_kind::collective && op.coll == coll_kind::all_reduce && op.what.starts_with("gradient bucket"))
        e.comm += 2 * op.elements;
  return e;
}

}  // namespace whale
