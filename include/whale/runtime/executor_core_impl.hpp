// The work of executor_core (runtime/executor_core.hpp) that does not fit in
// its class: the launch checks and this rank's program, the batch split, the
// placement's checks, the buckets and
// messages once bound, and the gradient norm's squares on a device.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "whale/runtime/executor_core.hpp"

#if !WHALE_CORE_DEFINITIONS
#error "whale/runtime/executor_core_impl.hpp holds the compiled core's definitions: include whale/runtime/executor_core.hpp, not this file"
#endif

namespace whale::detail {

WHALE_CORE_INLINE executor_core::executor_core(const context& ctx, plan_options o, plan_facts facts)
    : ctx_(&ctx), o_(std::move(o)), facts_(std::move(facts)), level_(facts_.zero_level) {
  const auto& shape = ctx.mesh().shape();
  const int chunk_count = facts_.chunks;
  const std::string who = this->who();
  chunk_at_.assign(static_cast<std::size_t>(chunk_count) + 1, 0);
  // first: a rank launched differently is named before it can hang the others
  check_ranks_agree(ctx.world(), launch_fields(facts_.name, shape, o_), who);
  if (!(o_.bucket_mib > 0)) throw std::invalid_argument(who + "the bucket size must be positive (got " + std::to_string(o_.bucket_mib) + " MiB)");
  if (o_.micro_batches * chunk_count > max_micro)
    throw std::invalid_argument(who + "at most " + std::to_string(max_micro / chunk_count) + " micro-batches" +
                                (chunk_count > 1 ? " with " + std::to_string(chunk_count) + " chunks per pipe rank" : std::string()));
  if (o_.micro_batches > 1 && facts_.splits_data)
    throw std::invalid_argument(who + "a split<..., axis::data> region needs the whole per-replica batch in one pass "
                                      "(it gathers every row of the global batch); use micro_batches 0 or 1");
  be_ = o_.backend;
  if (!be_.on_cpu()) {  // what runs in a device's memory so far (docs/device.md)
    if (o_.bf16_reduce && !o_.device_collectives)  // the packed buckets are summed by the device's own communicator
      throw std::invalid_argument(who + "summing gradients in bf16 (bf16_reduce) with the network on a device (" + be_.name() +
                                  ") needs the device's own communicator: set plan_options::device_collectives");
  }
  if (!facts_.staged && shape.size(axis::pipe) != 1)
    throw std::invalid_argument(who + "the mesh " + shape.spec() + " has a pipe axis, but the plan has no pipeline<...>");
  if (shape.size(axis::model) != 1 && !facts_.has_split)
    throw std::invalid_argument(who + "the mesh " + shape.spec() +
                                " has a model axis, but no stage holds a split region (the model ranks would only "
                                "repeat each other's work); launch without a model axis, or split layers over axis::model");
  if (shape.size(axis::data) != 1 && !facts_.replicated && !facts_.has_split)
    throw std::invalid_argument(who + "the mesh " + shape.spec() + " has " + std::to_string(shape.size(axis::data)) +
                                " ranks on the data axis, but the plan is not replicated; wrap it in replicate<...>");
  if (const int fixed = facts_.fixed_stages; fixed > 0 && shape.size(axis::pipe) * chunk_count != fixed)
    throw std::invalid_argument(who + "the pipeline has " + std::to_string(fixed) + " stages but the mesh's pipe axis has " +
                                std::to_string(shape.size(axis::pipe)) + " rank(s) (" + shape.spec() + ")" +
                                (chunk_count > 1 ? " holding " + std::to_string(chunk_count) + " chunks each" : std::string()) +
                                "; every stage needs its own pipe rank" + (chunk_count > 1 ? " and chunk" : "") + ": launch with --mesh " +
                                (facts_.replicated ? "data=D,pipe=" : "pipe=") + std::to_string(fixed / chunk_count));
  if (!o_.trace_path.empty()) check_output_path(ctx.world(), o_.trace_path, "whale: the trace file (--trace, WHALE_TRACE)");
  stages_ = shape.size(axis::pipe), replicas_ = shape.size(axis::data);
  stage_ = ctx.mesh().coord(axis::pipe), replica_ = ctx.mesh().coord(axis::data);
  model_rank_ = ctx.mesh().coord(axis::model);
  slow_.set_factor(o_.speed_of(ctx.rank(), ctx.size()));  // a list of the wrong length fails on every rank
  if (o_.balance && (!o_.speeds.empty() || !o_.memory_caps_mib.empty())) {  // a replica runs at the pace of its slowest rank
    if (facts_.splits_data)
      throw std::invalid_argument(who + "plan_options::balance splits the batch by speed, but a split<..., axis::data> "
                                        "region gathers the same number of rows from every replica; balance plans without one");
    std::vector<double> slowest(static_cast<std::size_t>(replicas_), 1.0);
    for (int r = 0; r < ctx.size(); ++r) {
      auto& f = slowest[static_cast<std::size_t>(shape.coord(r, axis::data))];
      f = std::max(f, o_.speed_of(r, ctx.size()));
    }
    for (double f : slowest) replica_weights_.push_back(1.0 / f);
  }
  pipe_ = &ctx.mesh().comm(axis::pipe), data_ = &ctx.mesh().comm(axis::data), model_comm_ = &ctx.mesh().comm(axis::model);
  if (!be_.on_cpu() && o_.device_collectives) {  // collective over each axis group, on every rank alike (agreed above)
    dev_data_ = make_device_comm(*data_, be_);
    if (facts_.has_split) dev_model_ = make_device_comm(*model_comm_, be_);
    if (ctx.size() > 1) dev_world_ = make_device_comm(ctx.world(), be_);
    if (shape.size(axis::pipe) > 1)  // waiting on NCCL, keep MPI's pipeline sends moving
      for (auto* d : {dev_data_.get(), dev_model_.get(), dev_world_.get()})
        if (d) d->set_progress([this] { msg_.progress(); });
  }
}

WHALE_CORE_INLINE void executor_core::lower_program() {
  const auto& ctx = *ctx_;
  const auto& shape = ctx.mesh().shape();
  const int chunk_count = facts_.chunks;
  const std::string who = this->who();
  if (o_.in_flight < 0 || o_.in_flight > max_micro || (o_.in_flight > 0 && o_.micro_batches > 0))
    throw std::invalid_argument(who + "plan_options::in_flight (N_m minibatches in flight, 1 to " + std::to_string(max_micro) +
                                ") makes each minibatch one micro-batch; do not also set micro_batches");
  const bool repeat_pipeline = facts_.staged && chunk_count == 1 && !facts_.explicit_stages;  // a pipeline that cuts a repeat
  if (o_.worker_cuts) {  // what it means must be what it does
    if (!(repeat_pipeline && level_ == 0))
      throw std::invalid_argument(who + "plan_options::worker_cuts cuts each data replica's pipeline of a repeat for "
                                        "its own ranks; this plan has none to cut (it needs replicate<pipeline<1f1b or "
                                        "gpipe, a model with one repeat>>, no explicit stages, no ZeRO)");
    if (!o_.blocks.empty())
      throw std::invalid_argument(who + "plan_options::worker_cuts chooses each replica's stage blocks, but stage blocks "
                                        "were given (--stage-blocks, WHALE_STAGE_BLOCKS); give one or the other");
  }
  // unequal ranks: slow stages get fewer blocks
  if (repeat_pipeline && o_.blocks.empty() && (!o_.speeds.empty() || !o_.memory_caps_mib.empty()) && stages_ > 1) {
    std::vector<double> slow(static_cast<std::size_t>(stages_), 1.0);  // a pipe position runs at its slowest rank's pace
    std::vector<double> cap(static_cast<std::size_t>(stages_), 0.0);   // and fits its smallest rank's memory
    for (int r = 0; r < ctx.size(); ++r) {
      // worker_cuts: only this replica's ranks; otherwise every replica's (one cut for all)
      if (o_.worker_cuts && shape.coord(r, axis::data) != replica_) continue;
      const auto at = static_cast<std::size_t>(shape.coord(r, axis::pipe));
      slow[at] = std::max(slow[at], o_.speed_of(r, ctx.size()));
      const double c = o_.memory_cap_of(r, ctx.size()) * 1048576.0;
      if (c > 0) cap[at] = cap[at] > 0 ? std::min(cap[at], c) : c;
    }
    // the capped cut counts whole, unsharded stages; with ZeRO or split stages only the make-time check applies
    const bool capped = level_ == 0 && !facts_.has_split && std::any_of(cap.begin(), cap.end(), [](double c) { return c > 0; });
    if (capped || std::any_of(slow.begin(), slow.end(), [](double f) { return f != 1.0; })) {
      lower_options lo = lowering_of(o_, replicas_ * stages_);  // (o_.blocks is empty here)
      lo.micro_batches = 0;
      lo.stage_slowness = slow;
      if (capped) {
        for (auto& c : cap) c = c > 0 ? c : std::numeric_limits<double>::infinity();
        lo.stage_memory_caps = cap;
        // minibatches in flight: each a whole minibatch of the replica, N_m of them
        lo.micro_batches = o_.in_flight > 0 ? o_.in_flight : o_.micro_batches;
        lo.balance_seq = o_.plan_batch > 0 ? o_.plan_seq : o_.balance_seq;
        if (o_.plan_batch > 0)  // rows of one micro-batch of one replica
          lo.cap_rows = o_.plan_batch * o_.plan_seq /
                        (replicas_ * (o_.in_flight > 0 ? 1 : std::max(1, o_.micro_batches > 0 ? o_.micro_batches : stages_)));
      }
      try {
        o_.blocks = stage_cut(desc_, stages_, lo);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(who + e.what());
      }
    }
  }
  // the program of this rank: what it holds, and the pipeline's cut
  try {
    prog_ = lower(desc_, shape, ctx.rank(), placement_lowering());
  } catch (const std::invalid_argument& e) {  // the plan's rules, named as the executor names them
    std::string why = e.what();
    if (const std::string by = "whale::lower: " + desc_.name + ": "; why.rfind(by, 0) == 0) why = why.substr(by.size());
    throw std::invalid_argument(who + why);
  }
}

WHALE_CORE_INLINE void executor_core::check_placement() {
  const index_t n = param_count();
  const auto held = prog_.totals();
  if (n != held.params_held)
    throw std::logic_error(who() + "the runtime holds " + std::to_string(n) + " parameters, the program " +
                           std::to_string(held.params_held));
  // tied heads: where each one's table lies (this rank, or another pipe rank's program)
  if (std::any_of(desc_.units.begin(), desc_.units.end(), [](const unit_desc& u) { return u.ties_to >= 0; })) {
    const auto lo = placement_lowering();
    const auto& shape = ctx_->mesh().shape();
    tied_model_ = true, ties_ = ties_of(prog_, [&](int pipe) {
      auto c = ctx_->mesh().coords();
      c[static_cast<std::size_t>(axis::pipe)] = pipe;
      return lower(desc_, shape, shape.rank_of(c), lo);
    });
  }
  check_state_memory(held, n);  // before the parameters are allocated: do they fit on this node?
  if (o_.balance && !o_.memory_caps_mib.empty() && o_.plan_batch > 0 && replicas_ > 1) fit_rows_to_caps();
}

WHALE_CORE_INLINE void executor_core::finish_setup() {
  const index_t n = param_count();
  if (replicas_ > 1 && level_ < 2 && !o_.worker_cuts) {
    // the program's buckets; binding found which ranges are summed over data, and they must be the same
    if (merged_ranges(prog_.grad_buckets) != complement(no_sync_, n))
      throw std::logic_error(who() + "the program's gradient buckets do not cover the ranges summed over the data axis");
    sync_.plan(prog_.grad_buckets, prog_.bucket_launches(), blocking_buckets(), o_.bf16_reduce, be_, dev_data_.get());
  }
  msg_.bind(*pipe_, be_);
  // on a device, pipeline messages take the device's own channels (collective over the pipe group, on every rank alike)
  if (!be_.on_cpu() && o_.device_collectives && stages_ > 1) msg_.open_channels(make_device_comm(*pipe_, be_));
  if (o_.trace || !o_.trace_path.empty()) {
    tr_.enable(ctx_->rank(), stage_, replica_);
    barrier(ctx_->world());
    tr_.set_origin();
  }
}

WHALE_CORE_INLINE std::pair<index_t, index_t> executor_core::local_batch(index_t global_batch) const {
  if (global_batch < replicas_)
    throw std::invalid_argument(who() + "the global batch (" + std::to_string(global_batch) +
                                ") is smaller than the data-parallel degree (" + std::to_string(replicas_) +
                                "); every rank needs at least one sample");
  // the same checks on every rank; ZeRO 2-3 issue collectives per micro-batch over the data
  // axis, so every replica must run as many
  const int m0 = micro_count(slice(global_batch, 0).second);
  for (int r = 1; r < replicas_; ++r) {
    const int mr = micro_count(slice(global_batch, r).second);
    if (mr != m0 && level_ >= 2)
      throw std::invalid_argument(who() + "the global batch (" + std::to_string(global_batch) + ") gives the data replicas " +
                                  std::to_string(m0) + " and " + std::to_string(mr) + " micro-batches, but ZeRO " +
                                  std::to_string(level_) +
                                  " needs the same count on every replica; choose a global batch that the data "
                                  "axis divides, or set plan_options::micro_batches to a count that divides every replica's batch");
  }
  return slice(global_batch, replica_);
}

WHALE_CORE_INLINE void executor_core::grad_sum_squares_into(double* out) const {
  if (be_.on_cpu()) {  // grad_norm()'s square, as it is
    *out = grad_squares();
    all_reduce(ctx_->world(), view<double>(out, {1}));
    return;
  }
  if (level_ >= 2) squares_into(owned_range_ranges(prog_, zero_.begin(), zero_.end()), zero_.shard_grads().data(), out);
  else squares_into(owned_ranges(prog_), grads_.data(), out);
  if (ctx_->size() == 1) return;
  if (dev_world_) {
    all_reduce(*dev_world_, view<double>(out, {1}));  // on a GPU joined: the device's queue waits, not the host
  } else {  // without the device's own communicators: through the host (a wait)
    double host = 0;
    be_.copy(&host, out, sizeof host);
    be_.synchronize();
    all_reduce(ctx_->world(), view<double>(&host, {1}));
    be_.copy(out, &host, sizeof host);
    be_.synchronize();
  }
}

WHALE_CORE_INLINE void executor_core::squares_into(const std::vector<std::pair<index_t, index_t>>& ranges, const float* g, double* out) const {
  const auto n = static_cast<index_t>(ranges.size());
  if (!sq_parts_.data() || sq_parts_.numel() < std::max<index_t>(n, 1)) {  // (an empty tensor counts 1 element)
    const place_scope on(be_.memory());
    sq_parts_ = tensor<double>({std::max<index_t>(n, 1)}, mem_kind::workspace);
  }
  for (index_t k = 0; k < n; ++k) {
    const auto [at, count] = ranges[static_cast<std::size_t>(k)];
    be_.sum_squares_into(count, g + at, sq_parts_.data() + k);
  }
  be_.launch(1, kernels::sum_in_order{sq_parts_.data(), n, 1.0, out, false});  // one running sum, as owned_squares() adds
}

WHALE_CORE_INLINE void executor_core::gather_params(view<float> out) {
  if (out.numel() != param_count())
    throw std::invalid_argument("whale::" + facts_.name + "::gather_params: the output holds " + std::to_string(out.numel()) +
                                " floats, this rank's stage has " + std::to_string(param_count()));
  if (level_ == 3) zero_.gather_params(out);
  else {  // `out` is host memory; on a device the parameters come through its backend
    be_.copy(out.data(), params_.data(), params_.v().bytes());
    be_.synchronize();
  }
}

// Found from the lowered program's holdings; run by the trainer after a
// non-finite gradient norm, so it costs nothing in a healthy step.
WHALE_CORE_INLINE std::string executor_core::first_nonfinite_grad() const {
  std::vector<float> keep;  // on a device: the gradients' host copy
  std::int64_t u = level_ >= 2 ? first_nonfinite_unit(prog_, be_.host_readable(cview<float>(zero_.shard_grads()), keep).data(),
                                                      zero_.begin(), zero_.end())
                               : first_nonfinite_unit(prog_, be_.host_readable(cview<float>(grads_.data(), {param_count()}), keep).data(),
                                                      0, param_count());
  all_reduce(ctx_->world(), view<std::int64_t>(&u, {1}), reduce_op::min);
  if (u == std::numeric_limits<std::int64_t>::max()) return {};
  index_t offset = 0;
  for (std::int64_t k = 0; k < u; ++k) offset += desc_.units[static_cast<std::size_t>(k)].full_params;
  const auto& unit = desc_.units[static_cast<std::size_t>(u)];
  return unit.name + " (unit " + std::to_string(u) + " of the model, its parameters [" + std::to_string(offset) + ", " +
         std::to_string(offset + unit.full_params) + ") of the unsplit flat order)";
}


WHALE_CORE_INLINE void executor_core::order_for(int m) {
  const bool programs = step_order_.micro_batches == m;
  if (m == order_.micro_batches && programs == order_from_program_) return;
  order_ = programs ? step_order_ : pass_order_of(desc_, facts_.staged ? stage_ : 0, facts_.staged ? stages_ : 1, m);
  order_from_program_ = programs;
}

WHALE_CORE_INLINE void executor_core::print(std::ostream& os) const {
  const int chunk_count = facts_.chunks;
  os << "plan: " << facts_.name << " over " << ctx_->mesh().shape() << "\n";
  if (stages_ * chunk_count > 1)
    for (int s = 0; s < stages_ * chunk_count; ++s)
      os << "  stage " << s % stages_ << (chunk_count > 1 ? " chunk " + std::to_string(s / stages_) : std::string()) << ": "
         << stage_description(s) << (s % stages_ == stage_ ? "  <- this rank" : "") << "\n";
  if (level_) os << "  ZeRO-" << level_ << " over data:" << replicas_ << "\n";
  if (replicas_ > 1)
    os << "  data: " << replicas_ << " replica(s); "
       << (level_ >= 2 ? std::string("gradients reduce-scattered per leaf") + (o_.bf16_reduce ? " in bf16" : "")
                       : "gradients all-reduced in " + std::to_string(sync_.size()) + " bucket(s)")
       << (level_ ? ", ZeRO-" + std::to_string(level_) + " owns [" + std::to_string(range().first) + ", " + std::to_string(range().second) + ")" : "")
       << "\n";
  if (stages_ > 1 || o_.micro_batches > 1)
    os << "  schedule " << facts_.schedule << ", micro-batches "
       << (o_.micro_batches ? std::to_string(o_.micro_batches) : std::string(facts_.staged ? "auto (<= 4 x stages)" : "1")) << "\n";
  if (replicas_ > 1 && level_ < 2)
    os << "  buckets of <= " << o_.bucket_mib << " MiB" << (blocking_buckets() ? ", blocking" : ", non-blocking")
       << (sync_.during_backward() ? ", during backward" : ", after backward") << (o_.bf16_reduce ? ", summed in bf16" : "") << "\n";
  const auto t = prog_.totals();
  os << "  this rank holds " << t.params_held << " of " << prog_.full_params << " parameters ("
     << static_cast<double>(t.params_held) * 4 / 1048576.0 << " MiB):\n";
  for (const auto& h : prog_.holds) {
    if (h.full_params == 0 && h.name.front() == '[') {  // an inserted conversion
      os << "    " << h.name << "\n";
      continue;
    }
    os << "    " << h.name << "  " << h.local_params;
    if (h.local_params != h.full_params) os << " of " << h.full_params;
    if (!h.split_over.empty()) os << ", split over " << h.split_over.name() << " (" << layout_kind_name(h.layout_in) << " in)";
    if (h.recompute) os << ", recomputed";
    os << "\n";
  }
}

WHALE_CORE_INLINE tensor<float> executor_core::all_stages_params(tensor<float> mine, const std::vector<index_t>& chunk_sizes) const {
  if (stages_ == 1) return mine;  // (interleaved on one rank: the chunks are already in flat order)
  const int chunk_count = facts_.chunks;
  if (chunk_sizes.size() != static_cast<std::size_t>(chunk_count))
    throw std::logic_error(who() + "all_stages_params: " + std::to_string(chunk_sizes.size()) + " chunk sizes for " +
                           std::to_string(chunk_count) + " chunks");
  // every rank's chunk sizes, then every rank's chunks
  std::vector<index_t> sizes(chunk_sizes), all_sizes(static_cast<std::size_t>(stages_ * chunk_count)),
      counts(static_cast<std::size_t>(stages_)), starts(counts.size());
  all_gather(*pipe_, view<index_t>(sizes.data(), {chunk_count}), view<index_t>(all_sizes.data(), {stages_ * chunk_count}));
  index_t total = 0;
  for (int r = 0; r < stages_; ++r) {
    starts[static_cast<std::size_t>(r)] = total;
    for (int ch = 0; ch < chunk_count; ++ch) counts[static_cast<std::size_t>(r)] += all_sizes[static_cast<std::size_t>(r * chunk_count + ch)];
    total += counts[static_cast<std::size_t>(r)];
  }
  tensor<float> all({total}, mem_kind::workspace);
  all_gather_v(*pipe_, cview<float>(mine.v()), all.v(), std::span<const index_t>(counts));
  if (chunk_count == 1) return all;
  tensor<float> ordered({total}, mem_kind::workspace);
  index_t at = 0;
  for (int vs = 0; vs < stages_ * chunk_count; ++vs) {
    const int r = vs % stages_, ch = vs / stages_;
    index_t from = starts[static_cast<std::size_t>(r)];
    for (int c2 = 0; c2 < ch; ++c2) from += all_sizes[static_cast<std::size_t>(r * chunk_count + c2)];
    const index_t k = all_sizes[static_cast<std::size_t>(r * chunk_count + ch)];
    std::memcpy(ordered.data() + at, all.data() + from, static_cast<std::size_t>(k) * sizeof(float));
    at += k;
  }
  return ordered;
}

}  // namespace whale::detail
