// lower()'s work (plan/lower.hpp), defined: `detail::lowering`, which places
// the plan's units on this rank, schedules its passes and emits the step's
// operations (with plan/lower_pass.hpp's passes), and pass_order_of. Compiled
// once in whale::core under the compiled core (detail/compiled.hpp); inline,
// as the rest of the library, without it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/plan/lower.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/plan/lower_impl.hpp holds the compiled core's definitions: include whale/plan/lower.hpp, not this file"
#endif

namespace whale {

WHALE_CORE_INLINE pass_order pass_order_of(const model_desc& d, int stage, int stages, int m) {
  const bool piped = d.pipeline && d.actions;
  const auto actions = piped ? d.actions : &one_f_one_b::actions;
  const int chunks_per_rank = piped ? d.chunks : 1;
  const std::string who = "whale::pipeline<" + (piped ? d.schedule : one_f_one_b::name()) + ", ...>: ";
  if (stages < 1) throw std::invalid_argument(who + "a pipeline needs at least one stage");
  if (m < 1) throw std::invalid_argument(who + "the micro-batch count must be at least 1 (got " + std::to_string(m) + ")");
  std::vector<std::vector<pipe_action>> lists(static_cast<std::size_t>(stages));
  for (int s = 0; s < stages; ++s) lists[static_cast<std::size_t>(s)] = actions(s, stages, m);
  pass_order o;
  o.report = detail::check_lists(lists, stages, m, piped && d.split_backward, who, chunks_per_rank);
  const auto fwd = detail::forwards_of(lists);
  const auto fr = detail::replay(fwd, stages, m, chunks_per_rank);
  const auto at = static_cast<std::size_t>(stage);
  o.actions = {fwd[at], lists[at]};
  o.rounds = {fr.round[at], o.report.round[at]};
  o.messages = {detail::message_order(fwd, fr.round, stages, m, chunks_per_rank, stage), detail::message_order(lists, o.report.round, stages, m, chunks_per_rank, stage)};
  o.micro_batches = m;
  return o;
}

namespace detail {

/// Builds one rank's program; each member adds one kind of operation.
class lowering {
 public:
  lowering(const model_desc& d, const mesh_shape& m, int rank, const lower_options& o)
      : desc_(d), o_(o) {
    prog_.plan = d.name;
    prog_.mesh = m;
    prog_.rank = rank;
    prog_.coords = m.coords(rank);
    prog_.global_batch = o.global_batch;
    prog_.seq = o.seq;
    prog_.full_params = d.full_params;
    prog_.optimizer_bytes_per_param = o.optimizer_bytes_per_param;
    data_size_ = m.size(axis::data), pipe_size_ = m.size(axis::pipe), model_size_ = m.size(axis::model);
    data_rank_ = prog_.coords[0], stage_ = prog_.coords[1], model_rank_ = prog_.coords[2];
    zero_ = o.zero_level >= 0 ? o.zero_level : d.zero_level;
    prog_.zero_level = zero_;
    prog_.bf16_reduce = o.bf16_reduce;
    prog_.bf16 = o.bf16;
    prog_.grad_norm = o.grad_norm;
    chunks_ = d.pipeline ? d.chunks : 1;
    prog_.chunks = chunks_;
  }

  program run() {
    validate();
    place();
    schedule();
    const auto acts = prog_.order.actions[1];  // a training pass's
    if (zero_ == 3 && data_size_ > 1 && o_.zero_prefetch) {  // the order the leaves are used in, for gathers one ahead
      lowering dry = *this;
      dry.uses_ = &use_order_;
      dry.passes(acts);
    }
    passes(acts);
    finish();
    return std::move(prog_);
  }

 private:
  // ---- checks: the run-time twins of the type's rules ----
  void validate() { check_plan(desc_, prog_.mesh, o_, zero_); }

  // ---- what this rank holds ----
  // the virtual stage that runs a unit (the pipe rank, without interleaving): chunk c of rank s is c·P + s
  int stage_of(const unit_desc& u) const {
    if (!desc_.pipeline || pipe_size_ * chunks_ == 1) return 0;
    if (desc_.explicit_stages) return u.element;
    if (u.element < desc_.repeat_element) return 0;
    if (u.element > desc_.repeat_element) return pipe_size_ * chunks_ - 1;
    return block_stage_[static_cast<std::size_t>(u.block)];
  }
  void place() {
    if (desc_.pipeline && !desc_.explicit_stages && desc_.repeat_element >= 0) {
      const auto blocks = stage_cut(desc_, pipe_size_ * chunks_, o_);
      prog_.stage_blocks = blocks;
      for (int s = 0; s < static_cast<int>(blocks.size()); ++s)
        for (int k = 0; k < blocks[static_cast<std::size_t>(s)]; ++k) block_stage_.push_back(s);
    }
    prog_.stages = desc_.pipeline ? pipe_size_ : 1;
    prog_.stage = stage_;
    index_t full = 0, local = 0;
    for (std::size_t i = 0; i < desc_.units.size(); ++i) {
      const auto& u = desc_.units[i];
      const int st = stage_of(u);
      if (st % pipe_size_ == stage_) {
        unit_holding h;
        h.name = u.name;
        h.unit = static_cast<int>(i);
        h.stage = st % pipe_size_;
        h.chunk = st / pipe_size_;
        h.full_params = u.full_params;
        h.local_params = u.local_params(degree(u));
        h.full_offset = full;
        h.local_offset = local;
        h.layout_in = u.in;
        h.recompute = u.recompute_group >= 0;
        h.ties_to = u.ties_to;
        if (u.sharded) h.split_over = axes(static_cast<axis>(u.split_axis)), h.whole_tail = u.replicated_params;
        if (!o_.placement) {
          // pricing only: unit_holding::runs left empty
        } else if (u.sharded && h.full_params > 0) {
          if (!u.runs)
            throw std::logic_error("whale: lowering: the sharded layer " + u.name + " does not say where its parameters lie (param_runs)");
          u.runs(prog_.coords[static_cast<std::size_t>(u.split_axis)], degree(u), h.runs);
        } else if (h.local_params > 0) {
          h.runs.push_back({0, 0, h.local_params});
        }
        if (model_size_ > 1 && !(u.sharded && u.split_axis == static_cast<int>(axis::model))) h.replicated_over = h.replicated_over | axis::model;
        const bool data_whole = !(u.sharded && u.split_axis == static_cast<int>(axis::data));
        if (data_size_ > 1 && data_whole && zero_ < 3) h.replicated_over = h.replicated_over | axis::data;
        if (zero_ > 0 && data_size_ > 1) h.zero_level = zero_;
        local += h.local_params;
        unit_hold_.resize(desc_.units.size(), -1);
        unit_hold_[i] = static_cast<int>(prog_.holds.size());
        prog_.holds.push_back(std::move(h));
      }
      full += u.full_params;
    }
    unit_hold_.resize(desc_.units.size(), -1);
    n_local_ = local;
    // ZeRO: near-even contiguous ranges of the local flat buffer over the data axis
    zero_counts_ = block_counts(n_local_, data_size_);
    zero_starts_.assign(zero_counts_.size(), 0);
    for (std::size_t r = 1; r < zero_counts_.size(); ++r) zero_starts_[r] = zero_starts_[r - 1] + zero_counts_[r - 1];
    prog_.owned_begin = zero_ > 0 ? zero_starts_[static_cast<std::size_t>(data_rank_)] : 0;
    prog_.owned_end = zero_ > 0 ? prog_.owned_begin + zero_counts_[static_cast<std::size_t>(data_rank_)] : n_local_;
    // units of this stage in flat order
    for (std::size_t i = 0; i < desc_.units.size(); ++i)
      if (unit_hold_[i] >= 0) mine_.push_back(static_cast<int>(i));
    chunk_units_.assign(static_cast<std::size_t>(chunks_), {});
    for (int i : mine_) chunk_units_[static_cast<std::size_t>(stage_of(desc_.units[static_cast<std::size_t>(i)]) / pipe_size_)].push_back(i);
    for (int c = 0; c < chunks_; ++c) {
      const auto& cu = chunk_units_[static_cast<std::size_t>(c)];
      if (cu.empty())
        lower_fail(desc_, "stage " + std::to_string(stage_) + (chunks_ > 1 ? " chunk " + std::to_string(c) : std::string()) + " holds no layer");
      // widths at the chunk's edges
      in_width_.push_back(desc_.units[static_cast<std::size_t>(cu.front())].in_width);
      out_width_.push_back(desc_.units[static_cast<std::size_t>(cu.back())].out_width);
    }
  }
  int degree(const unit_desc& u) const {
    return u.split_axis < 0 ? 1 : prog_.mesh.size(static_cast<axis>(u.split_axis));
  }

  void schedule() {
    const auto [b, n] = data_size_ > 1 ? weighted_slice(o_.global_batch, data_size_, data_rank_, o_.replica_weights, std::max(1, o_.micro_batches)) : std::pair<index_t, index_t>{0, o_.global_batch};
    (void)b;
    prog_.local_sequences = n;
    int m = 1;  // without a pipeline, more than one is gradient accumulation inside one step
    try {
      m = micro_batch_count(n, o_.micro_batches, desc_.pipeline, pipe_size_, desc_.pipeline ? desc_.chunks : 1);
    } catch (const std::invalid_argument& e) {
      lower_fail(desc_, e.what());
    }
    if (desc_.pipeline) prog_.schedule = desc_.schedule;
    // throws, naming the stages, if the schedule is malformed or deadlocks
    prog_.order = desc_.pipeline ? pass_order_of(desc_, stage_, pipe_size_, m) : pass_order_of(desc_, 0, 1, m);
    prog_.micro_batches = m;
    micro_seqs_ = n / m;
    per_bucket_ = bucket_elements(o_.bucket_mib);
    make_buckets();
  }

  // Data-parallel buckets (all-reduce over data) of the gradient ranges summed over data.
  void make_buckets() {
    if (data_size_ == 1 || zero_ >= 2) return;
    std::vector<std::pair<index_t, index_t>> ranges;
    for (int i : mine_) {
      const auto& h = prog_.holds[static_cast<std::size_t>(unit_hold_[static_cast<std::size_t>(i)])];
      if (h.local_params == 0 || desc_.units[static_cast<std::size_t>(i)].all_rows()) continue;
      if (!ranges.empty() && ranges.back().second == h.local_offset) ranges.back().second += h.local_params;
      else ranges.push_back({h.local_offset, h.local_offset + h.local_params});
    }
    buckets_ = bucket_ranges(ranges, per_bucket_);
    prog_.grad_buckets = buckets_;
  }

  // ---- operations ----
  int add(op o) {
    prog_.ops.push_back(std::move(o));
    return static_cast<int>(prog_.ops.size()) - 1;
  }
  int add_compute(op_kind k, int unit, int micro, index_t rows) {
    const auto& u = desc_.units[static_cast<std::size_t>(unit)];
    const cost_info c = u.sharded ? shard_of(u.cost, degree(u), u.split_params, u.replicated_params) : u.cost;
    const double seqf = c.seq_flops * static_cast<double>(o_.seq);
    op o;
    o.kind = k;
    o.unit = unit;
    o.micro = micro;
    o.what = u.name;
    o.rows = rows;
    const double r = static_cast<double>(rows);
    o.flops = k == op_kind::backward ? r * (c.bwd_flops + 2 * seqf) : r * (c.fwd_flops + seqf);
    if (desc_.split_backward && u.defers && (k == op_kind::backward || k == op_kind::weight)) {
      // the weight gradients' GEMMs: 2 FLOPs per parameter per row (biases counted alike)
      const double w = r * 2.0 * static_cast<double>(u.local_params(degree(u)));
      o.flops = k == op_kind::weight ? w : r * (c.bwd_flops + 2 * seqf) - w;
    }
    if (last_ >= 0) o.deps.push_back(last_);
    for (int g : pending_) o.deps.push_back(g);
    for (int g : gathers_) o.deps.push_back(g);
    pending_.clear();
    gathers_.clear();
    before_last_ = last_;
    return last_ = add(std::move(o));
  }
  int add_coll(coll_kind k, axes g, int size, traffic t, std::int64_t elements, std::string why, int micro) {
    op o;
    o.kind = op_kind::collective;
    o.coll = k;
    o.group = g;
    o.group_size = size;
    o.bytes_sent = t.sent;
    o.slowest_bytes = t.slowest;
    o.even_bytes = t.even;
    o.bytes_received = t.received;
    o.elements = elements;
    o.micro = micro;
    o.what = std::move(why);
    if (last_ >= 0) o.deps.push_back(last_);
    return add(std::move(o));
  }

  index_t rows_local() const { return micro_seqs_ * o_.seq; }
  index_t rows_for(const unit_desc& u) const {
    return u.all_rows() ? o_.global_batch / prog_.micro_batches * o_.seq : rows_local();
  }
  // rows of layout l on the data axis for data rank r (global batch split<0> or whole)
  index_t rows_on_data(layout_kind l, int r) const {
    if (l != layout_kind::S0) return o_.global_batch * o_.seq;
    return weighted_slice(o_.global_batch, data_size_, r, o_.replica_weights, std::max(1, o_.micro_batches)).second * o_.seq;
  }

  /// The collective that converts layout `from` into `to` for a tensor of full width `w` on axis `a`.
  void conversion_op(conv_op k, axis a, layout_kind from, layout_kind to, index_t w, const std::string& why, int micro, bool after) {
    const int p = prog_.mesh.size(a), r = prog_.coords[static_cast<std::size_t>(a)];
    const bool data = a == axis::data;
    const auto c = conversion_cost(k, p, r, data ? rows_on_data(from, r) : rows_local(),
                                   data ? rows_on_data(to, r) : rows_local(), w, o_.global_batch, o_.seq);
    if (!c.moves) return;
    const int id = add_coll(c.kind, axes(a), p, c.t, c.elements, why, micro);
    prog_.ops[static_cast<std::size_t>(id)].mine = c.mine;
    if (after) pending_.push_back(id);
  }

  // ---- the operations of each pass and of the step's end (plan/lower_pass.hpp) ----
  std::vector<index_t> zero_split(index_t b, index_t e) const;
  void zero_gather(int unit, bool backward, int micro);
  int gather_op(int unit, bool backward, int micro, int after);
  void forward_unit(int i, int micro, bool again);
  std::string neighbours(int i) const;
  void p2p(op_kind k, int peer_stage, index_t width, int micro, const char* what);
  void forward(int c, int j);
  void backward(int c, int j, bool last_micro);
  void weight(int c, int j);
  void zero_scatter(const unit_holding& h, int after, int micro);
  void ready(index_t offset, int after, bool at_end);
  void finish();

  const model_desc& desc_;
  lower_options o_;
  program prog_;
  int data_size_ = 1, pipe_size_ = 1, model_size_ = 1;  // the mesh's axes
  int data_rank_ = 0, stage_ = 0, model_rank_ = 0, zero_ = 0;  // this rank's coordinates; the ZeRO level
  std::vector<int> block_stage_, unit_hold_, mine_;
  std::vector<std::vector<int>> chunk_units_;  // this rank's units of each chunk, in flat order
  std::vector<index_t> in_width_, out_width_;  // per chunk
  int chunks_ = 1;  // interleaved: model chunks a rank holds
  index_t n_local_ = 0, micro_seqs_ = 0, per_bucket_ = 1;
  std::vector<index_t> zero_counts_, zero_starts_;
  std::vector<std::pair<index_t, index_t>> buckets_;
  std::size_t next_bucket_ = 0;
  void passes(const std::vector<pipe_action>& acts) {
    int backwards = 0;
    for (const auto& a : acts) {
      if (a.kind == pipe_action::forward) forward(a.chunk, a.micro);
      else if (a.kind == pipe_action::backward) backward(a.chunk, a.micro, ++backwards == prog_.micro_batches * chunks_);
      else weight(a.chunk, a.micro);
    }
  }

  int last_ = -1, held_ = -1;
  // ZeRO-3 with prefetch, as the runtime's engine (runtime/zero.hpp) issues it: each use of a
  // leaf gathers it unless held or prefetched, then gathers the next leaf used
  std::vector<int>* uses_ = nullptr;  // a dry pass: where it writes the leaves' uses in order
  std::vector<int> use_order_;        // the leaves' uses in order, 2·unit + backward (empty: no prefetch)
  std::size_t use_pos_ = 0;           // uses so far
  int prefetched_ = -1, prefetch_op_ = -1;  // the leaf gathered ahead, and its gather
  int before_last_ = -1;       // the compute before last_: a ZeRO-3 gather may start once it ends (one layer ahead)
  std::vector<int> gathers_;   // ZeRO-3 gathers the next compute waits for
  std::vector<int> pending_, sync_;
};

}  // namespace detail

WHALE_CORE_INLINE program lower(const model_desc& d, const mesh_shape& mesh, int rank, const lower_options& o) {
  return detail::lowering(d, mesh, rank, o).run();
}

}  // namespace whale

#include "whale/plan/lower_pass.hpp"  // the passes' operations: members of detail::lowering
